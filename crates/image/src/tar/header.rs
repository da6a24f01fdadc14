//! One 512-byte tar header block: its fields, its format (v7, ustar, GNU)
//! and its numbers (octal or GNU base-256).

/// The bytes of a NUL-terminated field.
pub(super) fn cstr(field: &[u8]) -> &[u8] {
    match field.iter().position(|&b| b == 0) {
        Some(n) => &field[..n],
        None => field,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    V7,
    Ustar,
    Gnu,
}

pub(super) struct Header<'a>(pub(super) &'a [u8; 512]);

impl Header<'_> {
    pub(super) fn field(&self, off: usize, len: usize) -> &[u8] {
        &self.0[off..off + len]
    }

    pub(super) fn format(&self) -> Format {
        match &self.0[257..265] {
            b"ustar\x0000" => Format::Ustar,
            b"ustar  \x00" => Format::Gnu,
            m if &m[..6] == b"ustar\x00" => Format::Ustar,
            _ => Format::V7,
        }
    }

    /// Whether Go's archive/tar reads the devmajor and devminor fields as
    /// numbers (it reads them in every ustar, pax, GNU and star header).
    pub(super) fn go_reads_devices(&self) -> bool {
        go_reads_number(self.field(329, 8)) && go_reads_number(self.field(337, 8))
    }

    /// A star header: ustar magic and `tar\0` in its last four bytes.
    fn is_star(&self) -> bool {
        self.format() == Format::Ustar && &self.0[508..512] == b"tar\0"
    }

    /// Whether this is a star header whose atime or ctime Go's
    /// archive/tar cannot read as a number: Go refuses the archive there.
    pub(super) fn bad_star_times(&self) -> bool {
        self.is_star()
            && !(go_reads_number(self.field(476, 12)) && go_reads_number(self.field(488, 12)))
    }

    /// The path prefix that goes before the name field, as Go's
    /// archive/tar (docker, containerd, umoci) reads it:
    /// - ustar and pax: the 155-byte prefix field;
    /// - star (ustar magic and `tar\0` in the last four bytes): a 131-byte
    ///   prefix, with its atime and ctime after it;
    /// - GNU: none (those bytes are the atime and the ctime), unless a time
    ///   there is not a number: writers of Go before 1.8 put a ustar prefix
    ///   in GNU headers, which Go reads as one if it is ASCII;
    /// - v7: none.
    pub(super) fn prefix(&self) -> &[u8] {
        match self.format() {
            Format::Ustar if self.is_star() => cstr(self.field(345, 131)),
            Format::Ustar => cstr(self.field(345, 155)),
            Format::Gnu => {
                let time_ok = |f: &[u8]| f[0] == 0 || go_reads_number(f);
                let prefix = cstr(self.field(345, 155));
                if time_ok(self.field(345, 12)) && time_ok(self.field(357, 12))
                    || !prefix.is_ascii()
                {
                    &[]
                } else {
                    prefix
                }
            }
            Format::V7 => &[],
        }
    }

    pub(super) fn check_checksum(&self) -> Result<(), String> {
        let stored = parse_octal(self.field(148, 8))
            .map_err(|_| "header checksum field is not a number".to_string())?;
        let mut unsigned = 0u64;
        let mut signed = 0i64;
        for (i, &b) in self.0.iter().enumerate() {
            let b = if (148..156).contains(&i) { b' ' } else { b };
            unsigned += u64::from(b);
            signed += i64::from(b as i8);
        }
        if stored == unsigned || i64::try_from(stored).ok() == Some(signed) {
            Ok(())
        } else {
            Err(format!(
                "header checksum mismatch (header says {stored}, bytes sum to {unsigned})"
            ))
        }
    }

    pub(super) fn number(&self, off: usize, len: usize, what: &str) -> Result<u64, String> {
        parse_octal_or_256(self.field(off, len), what)
    }

    pub(super) fn signed_number(&self, off: usize, len: usize, what: &str) -> Result<i64, String> {
        let f = self.field(off, len);
        if f[0] == 0xff {
            // Negative base-256 (two's complement).
            let mut v: i128 = -1;
            for &b in f {
                v = (v << 8) | i128::from(b);
            }
            return i64::try_from(v).map_err(|_| format!("{what} out of range"));
        }
        let v = parse_octal_or_256(f, what)?;
        i64::try_from(v).map_err(|_| format!("{what} {v} out of range"))
    }
}

pub(super) fn parse_octal_or_256(f: &[u8], what: &str) -> Result<u64, String> {
    if f[0] & 0x80 != 0 {
        if f[0] == 0xff {
            return Err(format!("{what} is negative"));
        }
        let mut v: u64 = u64::from(f[0] & 0x7f);
        for &b in &f[1..] {
            v = v
                .checked_mul(256)
                .and_then(|v| v.checked_add(u64::from(b)))
                .ok_or_else(|| format!("{what} does not fit in 64 bits"))?;
        }
        return Ok(v);
    }
    parse_octal(f).map_err(|bad| {
        format!(
            "{what} field {:?} is not an octal number",
            String::from_utf8_lossy(bad)
        )
    })
}

/// Whether Go's archive/tar reads the numeric field `f` without an error
/// (`parseNumeric`): base-256 that fits in 63 bits, or octal digits with
/// spaces and NULs around them, cut at the first NUL inside. It decides
/// what Go would refuse or read another way (a GNU header's prefix, star
/// times, device numbers); the numbers cairn uses are read by
/// [`parse_octal_or_256`], which is stricter.
fn go_reads_number(f: &[u8]) -> bool {
    if f[0] & 0x80 != 0 {
        let inv = if f[0] & 0x40 != 0 { 0xff } else { 0 };
        let mut x: u64 = 0;
        for (i, &c) in f.iter().enumerate() {
            let c = if i == 0 { (c ^ inv) & 0x7f } else { c ^ inv };
            if x >> 56 != 0 {
                return false;
            }
            x = (x << 8) | u64::from(c);
        }
        return x >> 63 == 0;
    }
    let pad = |b: &u8| *b == b' ' || *b == 0;
    let start = f.iter().position(|b| !pad(b)).unwrap_or(f.len());
    let end = f.iter().rposition(|b| !pad(b)).map_or(start, |i| i + 1);
    if start >= end {
        return true;
    }
    let digits = cstr(&f[start..end]);
    if digits.is_empty() {
        return false;
    }
    let mut v: u64 = 0;
    for &d in digits {
        if !(b'0'..=b'7').contains(&d) {
            return false;
        }
        match v
            .checked_mul(8)
            .and_then(|v| v.checked_add(u64::from(d - b'0')))
        {
            Some(n) => v = n,
            None => return false,
        }
    }
    true
}

/// Octal digits, with leading spaces and trailing NULs or spaces allowed.
pub(super) fn parse_octal(f: &[u8]) -> Result<u64, &[u8]> {
    let start = f.iter().position(|&b| b != b' ').unwrap_or(f.len());
    let rest = &f[start..];
    let end = rest
        .iter()
        .position(|&b| b == 0 || b == b' ')
        .unwrap_or(rest.len());
    let digits = &rest[..end];
    if rest[end..].iter().any(|&b| b != 0 && b != b' ') {
        return Err(f);
    }
    let mut v: u64 = 0;
    for &d in digits {
        if !(b'0'..=b'7').contains(&d) {
            return Err(f);
        }
        v = v
            .checked_mul(8)
            .and_then(|v| v.checked_add(u64::from(d - b'0')))
            .ok_or(f)?;
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn octal_and_base256() {
        assert_eq!(parse_octal(b"0000644\0").unwrap(), 0o644);
        assert_eq!(parse_octal(b"   644 \0").unwrap(), 0o644);
        assert_eq!(parse_octal(b"\0\0\0\0").unwrap(), 0);
        assert!(parse_octal(b"0009\0").is_err());
        assert!(parse_octal(b"12 34").is_err());
        let mut f = [0u8; 12];
        f[0] = 0x80;
        f[11] = 5;
        f[10] = 1;
        assert_eq!(parse_octal_or_256(&f, "x").unwrap(), 261);
    }
}
