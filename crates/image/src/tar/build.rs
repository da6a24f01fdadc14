//! One header, with the extension headers read before it, made into a
//! [`TarEntry`]: which name and link name win (GNU long names over pax
//! records over the header's own fields and prefix, as Go's archive/tar
//! decides), the pax overrides of numbers, xattrs, and the sparse maps,
//! each bounded as the module above says.

use cairn_erofs::tree::Mtime;

use super::header::{cstr, Format, Header};
use super::sparse::check_sparse;
use super::{
    id32, padding, show_type, EntryKind, TarEntry, TarError, TarErrorKind, TarReader, TarSource,
};
use crate::pax::Pax;

impl<R: TarSource> TarReader<R> {
    pub(super) fn build_entry(
        &mut self,
        h: &Header<'_>,
        header_size: u64,
        first: u64,
        long_name: Option<Vec<u8>>,
        long_link: Option<Vec<u8>>,
        pax: Option<Pax>,
    ) -> Result<TarEntry, TarError> {
        let pax = pax.unwrap_or_default();
        let invalid = |r: String| TarError::new(first, TarErrorKind::Invalid(r));
        let format = h.format();
        let typeflag = h.0[156];
        // A GNU long name wins over a pax path, a long link name over a
        // pax linkpath, as in Go (which merges the pax records first).
        let mut path = match (&long_name, &pax.path) {
            (Some(n), _) if !n.is_empty() => n.clone(),
            (_, Some(p)) => p.clone(),
            _ => {
                let name = cstr(h.field(0, 100)).to_vec();
                let prefix = h.prefix();
                if prefix.is_empty() {
                    name
                } else {
                    let mut p = prefix.to_vec();
                    p.push(b'/');
                    p.extend_from_slice(&name);
                    p
                }
            }
        };
        // Go reads the device numbers of every header but v7's, and
        // refuses the archive where they are not numbers.
        if format != Format::V7 && !h.go_reads_devices() {
            return Err(
                invalid("devmajor or devminor field is not a number".into()).with_entry(&path)
            );
        }
        if h.bad_star_times() {
            return Err(
                invalid("star header whose atime or ctime is not a number".into())
                    .with_entry(&path),
            );
        }
        // Whether the pax records make this a GNU sparse file (0.0, 0.1 or
        // 1.0), by Go's archive/tar rules; an old GNU sparse entry ('S')
        // carries its map in its header and ignores them, as Go does.
        let version = (pax.sparse_major.as_deref(), pax.sparse_minor.as_deref());
        let pax_sparse = if typeflag == b'S' {
            false
        } else {
            match version {
                (None, None) => {
                    pax.sparse_map.as_ref().is_some_and(|m| !m.is_empty())
                        || pax.sparse_excess.is_some()
                }
                (Some(b"0"), Some(b"0" | b"1")) | (Some(b"1"), Some(b"0")) => true,
                (major, minor) => {
                    let show = |v: Option<&[u8]>| {
                        v.map_or_else(
                            || "?".to_string(),
                            |v| String::from_utf8_lossy(v).into_owned(),
                        )
                    };
                    return Err(invalid(format!(
                        "unsupported GNU sparse format {}.{}",
                        show(major),
                        show(minor)
                    ))
                    .with_entry(&path));
                }
            }
        };
        let sparse_1_0 = pax_sparse && version == (Some(b"1"), Some(b"0"));
        // An old directory is a type NUL entry whose name ends in a slash,
        // before a sparse name renames it (as in Go).
        let nul_dir = typeflag == 0 && path.ends_with(b"/");

        // The sparse file's real name, only on a sparse file and only if
        // not empty (Go's rules: on a plain file the record is ignored).
        if let Some(name) = pax
            .sparse_name
            .as_ref()
            .filter(|n| pax_sparse && !n.is_empty())
        {
            path = name.clone();
        }
        let link = match (&long_link, &pax.linkpath) {
            (Some(n), _) if !n.is_empty() => n.clone(),
            (_, Some(p)) => p.clone(),
            _ => cstr(h.field(157, 100)).to_vec(),
        };
        let err_path = path.clone();
        let with_path = |e: TarError| e.with_entry(&err_path);
        if path.len() > self.limits.max_path {
            return Err(with_path(TarError::new(
                first,
                TarErrorKind::Limit(format!(
                    "path of {} bytes is longer than the limit of {}",
                    path.len(),
                    self.limits.max_path
                )),
            )));
        }
        if link.len() > self.limits.max_path {
            return Err(with_path(TarError::new(
                first,
                TarErrorKind::Limit(format!(
                    "link target of {} bytes is longer than the limit of {}",
                    link.len(),
                    self.limits.max_path
                )),
            )));
        }
        if path.is_empty() {
            return Err(invalid("entry with an empty path".into()));
        }

        let num = |off, len, what| h.number(off, len, what).map_err(|r| with_path(invalid(r)));
        let mode = (num(100, 8, "mode")? & 0o7777) as u32;
        let uid = match pax.uid {
            Some(u) => u,
            None => id32(num(108, 8, "uid")?, "uid").map_err(|r| with_path(invalid(r)))?,
        };
        let gid = match pax.gid {
            Some(g) => g,
            None => id32(num(116, 8, "gid")?, "gid").map_err(|r| with_path(invalid(r)))?,
        };
        let mtime = match pax.mtime {
            Some(m) => m,
            None => Mtime {
                sec: h
                    .signed_number(136, 12, "mtime")
                    .map_err(|r| with_path(invalid(r)))?,
                nsec: 0,
            },
        };
        let declared = pax.size.unwrap_or(header_size);
        let mut kind = match typeflag {
            b'0' | 0 | b'7' | b'S' => EntryKind::Regular,
            b'1' => EntryKind::Hardlink,
            b'2' => EntryKind::Symlink,
            b'3' => EntryKind::CharDevice,
            b'4' => EntryKind::BlockDevice,
            b'5' | b'D' => EntryKind::Directory,
            b'6' => EntryKind::Fifo,
            t => {
                return Err(with_path(invalid(format!(
                    "unsupported entry type {}",
                    show_type(t)
                ))))
            }
        };
        // Old (pre-POSIX) archives mark directories only by a trailing
        // slash on an entry of type NUL; an explicit regular file ('0')
        // stays one, as Go's archive/tar (docker, containerd, umoci) reads it.
        if nul_dir {
            kind = EntryKind::Directory;
        }
        // Links, devices, fifos and directories have no data, whatever
        // size their header declares: Go's archive/tar (docker,
        // containerd, umoci) reads the next header right after theirs. A
        // reader that skipped the declared bytes would see other entries
        // than those readers do (a layer that hides files from one of
        // them). A GNU dumpdir ('D') keeps its data, as in Go.
        let header_only = matches!(typeflag, b'1'..=b'6') || nul_dir;
        let stored = if header_only { 0 } else { declared };
        if header_only && pax_sparse {
            return Err(with_path(invalid(
                "sparse map on a non-regular entry".into(),
            )));
        }
        let (devmajor, devminor) = if matches!(kind, EntryKind::CharDevice | EntryKind::BlockDevice)
        {
            (
                id32(num(329, 8, "devmajor")?, "devmajor").map_err(|r| with_path(invalid(r)))?,
                id32(num(337, 8, "devminor")?, "devminor").map_err(|r| with_path(invalid(r)))?,
            )
        } else {
            (0, 0)
        };

        let mut xattr_bytes = 0usize;
        for (k, v) in &pax.xattrs {
            xattr_bytes = xattr_bytes.saturating_add(k.len() + v.len());
        }
        if xattr_bytes > self.limits.max_xattr_bytes {
            return Err(with_path(TarError::new(
                first,
                TarErrorKind::Limit(format!(
                    "xattrs of {xattr_bytes} bytes exceed the limit of {} bytes",
                    self.limits.max_xattr_bytes
                )),
            )));
        }

        let mut entry = TarEntry {
            offset: first,
            data_offset: self.pos,
            path,
            link,
            kind,
            mode,
            uid,
            gid,
            mtime,
            devmajor,
            devminor,
            size: stored,
            stored,
            sparse: None,
            xattrs: pax.xattrs.clone(),
        };

        // Sparse files. Segment and hole limits are checked as soon as the
        // numbers are known, before a map or any data is read on.
        let sparse_err = |r: String| with_path(TarError::new(first, TarErrorKind::Limit(r)));
        if let Some(n) = pax.sparse_excess {
            return Err(sparse_err(self.too_many_segments(n)));
        }
        if typeflag == b'S' {
            if format != Format::Gnu {
                return Err(with_path(invalid(
                    "GNU sparse entry without a GNU header".into(),
                )));
            }
            let (segments, real) = self
                .read_gnu_sparse(h, first, stored)
                .map_err(|e| e.with_entry(&entry.path))?;
            entry.data_offset = self.pos;
            entry.size = real;
            entry.sparse = Some(segments);
        } else if sparse_1_0 {
            let real = pax.sparse_size.ok_or_else(|| {
                with_path(invalid("GNU sparse 1.0 entry without a real size".into()))
            })?;
            // The map is part of the stored bytes: at least this much is
            // holes.
            self.check_holes(real, real.saturating_sub(stored))
                .map_err(sparse_err)?;
            let (segments, map_bytes) = self
                .read_sparse_map_1_0(first, stored)
                .map_err(|e| e.with_entry(&entry.path))?;
            entry.stored = stored - map_bytes;
            entry.data_offset = self.pos;
            entry.size = real;
            entry.sparse = Some(segments);
        } else if pax_sparse {
            let segments = pax.sparse_map.clone().ok_or_else(|| {
                with_path(invalid("GNU sparse 0.x entry without a sparse map".into()))
            })?;
            if pax.sparse_numblocks != Some(segments.len() as u64) {
                return Err(with_path(invalid(format!(
                    "GNU sparse 0.x entry of {} segments with {}",
                    segments.len(),
                    pax.sparse_numblocks
                        .map_or("no numblocks record".into(), |n| format!("numblocks {n}"))
                ))));
            }
            let real = pax
                .sparse_size
                .ok_or_else(|| with_path(invalid("GNU sparse entry without a real size".into())))?;
            entry.size = real;
            entry.sparse = Some(segments);
        }
        if let Some(segments) = &entry.sparse {
            if kind != EntryKind::Regular {
                return Err(with_path(invalid(
                    "sparse map on a non-regular entry".into(),
                )));
            }
            let n = segments.len() as u64;
            if n > self.segments_left() {
                return Err(sparse_err(self.too_many_segments(n)));
            }
            // Holes before the map's consistency: the error a bomb gets
            // names its size.
            self.check_holes(entry.size, entry.size.saturating_sub(entry.stored))
                .map_err(sparse_err)?;
            check_sparse(segments, entry.size, entry.stored).map_err(|r| with_path(invalid(r)))?;
            self.sparse_segments += n;
            self.hole_bytes += entry.size - entry.stored;
        }
        self.pending = entry
            .stored
            .checked_add(padding(entry.stored))
            .ok_or_else(|| with_path(invalid("entry size overflows".into())))?;
        Ok(entry)
    }
}
