//! pax extended headers (POSIX.1-2001 `x` records): parsed strictly
//! (every record's length must be exact, every number a number), with the
//! keys OCI layers use: `path`, `linkpath`, `size`, `uid`, `gid`, `mtime`
//! (nanoseconds), xattrs (`SCHILY.xattr.*`; bsdtar's `LIBARCHIVE.xattr.*`
//! is read past, as docker, containerd and umoci read past it) and the
//! GNU sparse keys. Everything else is read past. No I/O here: the tar
//! reader hands over the header's bytes, already capped in size.
//!
//! Limits: a record's length field has at most 20 digits and the record
//! must fit in the bytes left, so no record is longer than the header;
//! numbers have at most 20 digits and must fit in 64 bits. Sparse maps
//! (0.0 offset/numbytes pairs, 0.1 `GNU.sparse.map`) keep at most the
//! number of segments the caller allows; past that only the count goes on
//! ([`Pax::sparse_excess`]), so the tar reader can report it with the
//! entry's name.

use std::collections::BTreeMap;

use cairn_erofs::tree::Mtime;

use crate::tar::{id32, MAX_DIGITS};

pub(crate) fn parse_decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > MAX_DIGITS || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(s).ok()?.parse().ok()
}

/// What a pax extended header says about its entry.
#[derive(Debug, Default, Clone)]
pub(crate) struct Pax {
    pub path: Option<Vec<u8>>,
    pub linkpath: Option<Vec<u8>>,
    pub size: Option<u64>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mtime: Option<Mtime>,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// `GNU.sparse.major` and `.minor` as written (Go compares the
    /// strings: `01` is no version it knows); an empty value is none.
    pub sparse_major: Option<Vec<u8>>,
    pub sparse_minor: Option<Vec<u8>>,
    pub sparse_name: Option<Vec<u8>>,
    /// Real size of a sparse file: `GNU.sparse.size`, or else
    /// `GNU.sparse.realsize`, whichever comes first (as in Go).
    pub sparse_size: Option<u64>,
    /// `GNU.sparse.numblocks`: formats 0.0 and 0.1 need it, and it must
    /// count the map's segments.
    pub sparse_numblocks: Option<u64>,
    /// Sparse map from formats 0.0 and 0.1.
    pub sparse_map: Option<Vec<(u64, u64)>>,
    /// The number of sparse segments the header lists when that is more
    /// than the caller allowed (the map is then not kept).
    pub sparse_excess: Option<u64>,
    /// Whether `sparse_size` is `GNU.sparse.size`'s (which `realsize`
    /// then does not replace).
    sparse_size_is_gnu: bool,
}

impl Pax {
    /// Parses `LEN KEY=VALUE\n` records, strictly, keeping at most
    /// `max_segments` sparse segments.
    pub(crate) fn parse(data: &[u8], max_segments: u64) -> Result<Pax, String> {
        let mut pax = Pax::default();
        let mut offsets: Vec<u64> = Vec::new();
        let mut lengths: Vec<u64> = Vec::new();
        let mut pos = 0usize;
        while pos < data.len() {
            let rest = &data[pos..];
            // GNU tar pads the header with NULs in some versions.
            if rest.iter().all(|&b| b == 0) {
                break;
            }
            let sp = rest
                .iter()
                .take(21)
                .position(|&b| b == b' ')
                .ok_or_else(|| format!("record at byte {pos}: no length field"))?;
            let len = parse_decimal(&rest[..sp])
                .ok_or_else(|| format!("record at byte {pos}: bad length field"))?;
            if len <= sp as u64 + 1 || len > rest.len() as u64 {
                return Err(format!(
                    "record at byte {pos}: length {len} does not fit the {} bytes left",
                    rest.len()
                ));
            }
            let record = &rest[sp + 1..len as usize];
            let Some((b'\n', body)) = record.split_last() else {
                return Err(format!("record at byte {pos}: does not end with a newline"));
            };
            let eq = body
                .iter()
                .position(|&b| b == b'=')
                .ok_or_else(|| format!("record at byte {pos}: no '=' in it"))?;
            let (key, value) = (&body[..eq], &body[eq + 1..]);
            if key.is_empty() {
                return Err(format!("record at byte {pos}: empty key"));
            }
            pax.apply(key, value, max_segments, &mut offsets, &mut lengths)
                .map_err(|r| {
                    format!(
                        "record at byte {pos} ({}): {r}",
                        String::from_utf8_lossy(key)
                    )
                })?;
            pos += len as usize;
        }
        if let Some(n) = pax.sparse_excess {
            pax.sparse_map = None;
            pax.sparse_excess = Some(n.max(offsets.len() as u64));
        } else if !offsets.is_empty() || !lengths.is_empty() {
            if offsets.len() != lengths.len() {
                return Err("GNU sparse 0.0 offsets and lengths do not pair up".into());
            }
            pax.sparse_map = Some(offsets.into_iter().zip(lengths).collect());
        }
        Ok(pax)
    }

    fn apply(
        &mut self,
        key: &[u8],
        value: &[u8],
        max_segments: u64,
        offsets: &mut Vec<u64>,
        lengths: &mut Vec<u64>,
    ) -> Result<(), String> {
        let num = |v: &[u8]| parse_decimal(v).ok_or_else(|| "not a decimal number".to_string());
        // An empty value unsets the key.
        let empty = value.is_empty();
        match key {
            b"path" => self.path = (!empty).then(|| value.to_vec()),
            b"linkpath" => self.linkpath = (!empty).then(|| value.to_vec()),
            b"size" => self.size = if empty { None } else { Some(num(value)?) },
            b"uid" => {
                self.uid = if empty {
                    None
                } else {
                    Some(id32(num(value)?, "uid")?)
                }
            }
            b"gid" => {
                self.gid = if empty {
                    None
                } else {
                    Some(id32(num(value)?, "gid")?)
                }
            }
            b"mtime" => {
                self.mtime = if empty {
                    None
                } else {
                    Some(parse_pax_time(value)?)
                }
            }
            b"GNU.sparse.major" => self.sparse_major = (!empty).then(|| value.to_vec()),
            b"GNU.sparse.minor" => self.sparse_minor = (!empty).then(|| value.to_vec()),
            b"GNU.sparse.name" => self.sparse_name = Some(value.to_vec()),
            b"GNU.sparse.size" => {
                if !empty {
                    self.sparse_size = Some(num(value)?);
                    self.sparse_size_is_gnu = true;
                }
            }
            b"GNU.sparse.realsize" => {
                if !empty && !self.sparse_size_is_gnu {
                    self.sparse_size = Some(num(value)?);
                }
            }
            b"GNU.sparse.numblocks" => {
                let n = num(value)?;
                if n > max_segments {
                    self.exceed(n);
                }
                self.sparse_numblocks = Some(n);
            }
            b"GNU.sparse.offset" | b"GNU.sparse.numbytes" => {
                // Alternating, an offset first, as Go requires them.
                let is_offset = key == b"GNU.sparse.offset";
                if self.sparse_excess.is_none() && is_offset != (offsets.len() == lengths.len()) {
                    return Err("GNU sparse 0.0 offsets and lengths out of order".into());
                }
                let v = num(value)?;
                let list = if is_offset { offsets } else { lengths };
                if list.len() as u64 >= max_segments {
                    self.exceed(list.len() as u64 + 1);
                } else {
                    list.push(v);
                }
            }
            b"GNU.sparse.map" => {
                // Counted before it is parsed: the excess is not kept.
                let values = if empty {
                    0
                } else {
                    value.iter().filter(|&&b| b == b',').count() as u64 + 1
                };
                if !values.is_multiple_of(2) {
                    return Err("odd number of values in the sparse map".into());
                }
                if values / 2 > max_segments {
                    self.exceed(values / 2);
                    self.sparse_map = None;
                    return Ok(());
                }
                let mut map = Vec::with_capacity((values / 2) as usize);
                let mut nums = value.split(|&b| b == b',').map(num);
                while let (Some(off), Some(len)) = (nums.next(), nums.next()) {
                    map.push((off?, len?));
                }
                self.sparse_map = Some(map);
            }
            _ => {
                if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                    if name.is_empty() {
                        return Err("empty xattr name".into());
                    }
                    // An empty value sets nothing: Go's archive/tar (so
                    // docker, containerd and umoci) reads a pax record
                    // with an empty value as no record.
                    if !empty {
                        self.xattrs.insert(name.to_vec(), value.to_vec());
                    }
                }
                // `LIBARCHIVE.xattr.*` (bsdtar's base64 form, which it
                // writes next to `SCHILY.xattr.*`) is read past, as the
                // Go-based unpackers read past it: one image, one tree.
                // Everything else (atime, ctime, uname, gname, comment,
                // hdrcharset, vendor keys) says nothing cairn keeps.
            }
        }
        Ok(())
    }
}

impl Pax {
    fn exceed(&mut self, n: u64) {
        self.sparse_excess = Some(self.sparse_excess.unwrap_or(0).max(n));
    }
}

/// `SECONDS[.FRACTION]`, possibly negative, to seconds and nanoseconds
/// (digits past the ninth are dropped).
fn parse_pax_time(v: &[u8]) -> Result<Mtime, String> {
    let bad = || {
        format!(
            "time {:?} is not a decimal number",
            String::from_utf8_lossy(v)
        )
    };
    let (neg, v) = match v.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, v),
    };
    let (int, frac) = match v.iter().position(|&b| b == b'.') {
        Some(p) => (&v[..p], &v[p + 1..]),
        None => (v, &[][..]),
    };
    if int.is_empty() && frac.is_empty() {
        return Err(bad());
    }
    let sec = if int.is_empty() {
        0
    } else {
        parse_decimal(int).ok_or_else(bad)?
    };
    if !frac.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    let mut nsec: u32 = 0;
    for i in 0..9 {
        nsec = nsec * 10 + frac.get(i).map_or(0, |d| u32::from(d - b'0'));
    }
    let sec = i64::try_from(sec).map_err(|_| bad())?;
    if !neg {
        return Ok(Mtime { sec, nsec });
    }
    Ok(if nsec == 0 {
        Mtime { sec: -sec, nsec: 0 }
    } else {
        Mtime {
            sec: -sec - 1,
            nsec: 1_000_000_000 - nsec,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_records() {
        let p = Pax::parse(b"30 mtime=1633950376.123456789\n20 path=a/long/name\n", 16).unwrap();
        assert_eq!(
            p.mtime,
            Some(Mtime {
                sec: 1633950376,
                nsec: 123456789
            })
        );
        assert_eq!(p.path.as_deref(), Some(&b"a/long/name"[..]));
        assert!(Pax::parse(b"99 path=x\n", 16).is_err());
        assert!(Pax::parse(b"x path=x\n", 16).is_err());
        assert!(Pax::parse(b"9 path=x\n", 16).is_ok());
        assert!(Pax::parse(b"10 path=x\n", 16).is_ok());
        assert!(Pax::parse(b"11 path=x\n", 16).is_err());
        assert!(Pax::parse(b"12 path=xy\n", 16).is_err());
        assert!(Pax::parse(b"99999999999999999999999 path=x\n", 16).is_err());
        assert_eq!(
            parse_pax_time(b"-1.5").unwrap(),
            Mtime {
                sec: -2,
                nsec: 500_000_000
            }
        );
    }
}
