//! Sparse files: the maps of old GNU sparse headers and of GNU pax sparse
//! format 1.0, read under the per-layer limits on segments and holes (see
//! "Bounded work" in the `tar` module's docs).

use super::*;

impl<R: TarSource> TarReader<R> {
    pub(super) fn too_many_segments(&self, n: u64) -> String {
        format!(
            "sparse map lists {n} segments; with the {} segments before it that is more than \
             the limit of {} sparse segments per layer",
            self.sparse_segments, self.limits.max_sparse_segments
        )
    }

    /// Reads the sparse map of an old GNU sparse header (at `first`) and
    /// its extension blocks; returns the segments and the real size. The
    /// holes are checked against the limit before any extension block is
    /// read, the segments as they come.
    pub(super) fn read_gnu_sparse(
        &mut self,
        h: &Header<'_>,
        first: u64,
        stored: u64,
    ) -> Result<(Vec<(u64, u64)>, u64), TarError> {
        let invalid = |r: String| TarError::new(first, TarErrorKind::Invalid(r));
        let limit = |r: String| TarError::new(first, TarErrorKind::Limit(r));
        let max = self.segments_left();
        let mut segments = Vec::new();
        // Appends the segment at `at` of `block`; false at an empty slot.
        let push = |block: &[u8], at: usize, segments: &mut Vec<(u64, u64)>| {
            let off = parse_octal_or_256(&block[at..at + 12], "sparse offset")
                .map_err(TarErrorKind::Invalid)?;
            let len = parse_octal_or_256(&block[at + 12..at + 24], "sparse length")
                .map_err(TarErrorKind::Invalid)?;
            if off == 0 && len == 0 && block[at] == 0 {
                return Ok(());
            }
            if segments.len() as u64 >= max {
                return Err(TarErrorKind::Limit(String::new()));
            }
            segments.push((off, len));
            Ok(())
        };
        let real = h.number(483, 12, "real size").map_err(invalid)?;
        self.check_holes(real, real.saturating_sub(stored))
            .map_err(limit)?;
        for i in 0..4 {
            push(h.0, 386 + i * 24, &mut segments).map_err(|k| match k {
                TarErrorKind::Limit(_) => limit(self.too_many_segments(segments.len() as u64 + 1)),
                k => TarError::new(first, k),
            })?;
        }
        let mut extended = h.0[482] != 0;
        let mut block = [0u8; 512];
        while extended {
            let at = self.pos;
            // Each extension block holds up to 21 segments; one that adds
            // none still costs a block of the stream (linear work).
            self.read_exact(&mut block, "a GNU sparse extension header")?;
            for i in 0..21 {
                push(&block, i * 24, &mut segments).map_err(|k| match k {
                    TarErrorKind::Limit(_) => limit(format!(
                        "{} (extension block at byte {at})",
                        self.too_many_segments(segments.len() as u64 + 1)
                    )),
                    TarErrorKind::Invalid(r) => {
                        invalid(format!("{r} (extension block at byte {at})"))
                    }
                    k => TarError::new(at, k),
                })?;
            }
            extended = block[504] != 0;
        }
        Ok((segments, real))
    }

    /// Reads the map at the start of a GNU sparse 1.0 entry's data (the
    /// entry starts at `first`, the data holds `stored` bytes): decimal
    /// numbers one per line (count, then offset and length pairs), padded
    /// to a block. Returns the segments and the bytes the map took.
    ///
    /// One block is read at a time and each byte looked at once; a line
    /// is at most [`MAX_DIGITS`] digits (an error at the first byte past
    /// them), the count is checked against the segment limit before the
    /// pairs are read, and the map may not run past the entry's data.
    pub(super) fn read_sparse_map_1_0(
        &mut self,
        first: u64,
        stored: u64,
    ) -> Result<(Vec<(u64, u64)>, u64), TarError> {
        let err = |r: String| TarError::new(first, TarErrorKind::Invalid(r));
        let start = self.pos;
        let mut line = [0u8; MAX_DIGITS];
        let mut line_len = 0usize;
        let mut line_at = start;
        let mut count: Option<u64> = None;
        let mut offset: Option<u64> = None;
        let mut segments: Vec<(u64, u64)> = Vec::new();
        let mut block = [0u8; 512];
        loop {
            let map_bytes = self.pos - start;
            if map_bytes + BLOCK > stored {
                return Err(err(format!(
                    "GNU sparse 1.0 map (from byte {start}) runs past the entry's {stored} bytes of data"
                )));
            }
            let block_at = self.pos;
            self.read_exact(&mut block, "a GNU sparse 1.0 map")?;
            for (i, &b) in block.iter().enumerate() {
                let at = block_at + i as u64;
                if b != b'\n' {
                    if !b.is_ascii_digit() {
                        return Err(err(format!(
                            "GNU sparse 1.0 map: byte {at} ({}) is not a digit",
                            show_type(b)
                        )));
                    }
                    if line_len == MAX_DIGITS {
                        return Err(err(format!(
                            "GNU sparse 1.0 map: the line at byte {line_at} is longer than \
                             {MAX_DIGITS} digits"
                        )));
                    }
                    line[line_len] = b;
                    line_len += 1;
                    continue;
                }
                let v = parse_decimal(&line[..line_len]).ok_or_else(|| {
                    err(format!(
                        "GNU sparse 1.0 map: the line at byte {line_at} ({:?}) is not a 64-bit number",
                        String::from_utf8_lossy(&line[..line_len])
                    ))
                })?;
                line_len = 0;
                line_at = at + 1;
                match (count, offset) {
                    (None, _) => {
                        if v > self.segments_left() {
                            return Err(TarError::new(
                                first,
                                TarErrorKind::Limit(format!(
                                    "GNU sparse 1.0 map at byte {start}: {}",
                                    self.too_many_segments(v)
                                )),
                            ));
                        }
                        count = Some(v);
                    }
                    (Some(_), None) => offset = Some(v),
                    (Some(_), Some(off)) => {
                        segments.push((off, v));
                        offset = None;
                    }
                }
                if offset.is_none() && count == Some(segments.len() as u64) {
                    // The rest of the block is padding.
                    return Ok((segments, self.pos - start));
                }
            }
        }
    }
}

/// Checks a sparse map against the real size and the stored data.
pub(super) fn check_sparse(segments: &[(u64, u64)], size: u64, stored: u64) -> Result<(), String> {
    let mut cur = 0u64;
    let mut total = 0u64;
    for &(off, len) in segments {
        if off < cur {
            return Err("sparse segments overlap or are out of order".into());
        }
        cur = off
            .checked_add(len)
            .filter(|&end| end <= size)
            .ok_or_else(|| {
                format!("sparse segment at {off} (+{len}) ends past the file size {size}")
            })?;
        total = total.saturating_add(len);
    }
    if total != stored {
        return Err(format!(
            "sparse map lists {total} bytes of data but the entry stores {stored}"
        ));
    }
    Ok(())
}
