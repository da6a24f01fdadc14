//! The second pass: the header, superblock, inode table, shared xattrs and
//! data blocks, in one forward stream, at the places the layout pass chose.
//! Every position is checked against the layout as it is written.

use std::io::Write;

use zerocopy::IntoBytes;

use super::*;
use crate::tree::FileType;

impl Layout<'_> {
    /// Second pass: the bytes.
    pub(super) fn emit<W: Write>(&self, w: &mut CountingWriter<W>) -> Result<(), Error> {
        let data_start = round_up(self.inodes_end + self.shared_size, BLKSIZ);

        let header = ComposefsHeader {
            magic: COMPOSEFS_MAGIC.into(),
            version: COMPOSEFS_HEADER_VERSION.into(),
            flags: if self.has_acl {
                COMPOSEFS_FLAGS_HAS_ACL
            } else {
                0
            }
            .into(),
            composefs_version: self.version.into(),
            unused: Default::default(),
        };
        w.write(header.as_bytes())?;
        w.pad_to(SUPER_OFFSET)?;

        let blocks = data_start / BLKSIZ + self.n_data_blocks;
        let sb = SuperBlock {
            magic: SUPER_MAGIC_V1.into(),
            feature_compat: (FEATURE_COMPAT_MTIME | FEATURE_COMPAT_XATTR_FILTER).into(),
            blkszbits: BLKSIZ_BITS,
            root_nid: (self.nodes[0].nid as u16).into(),
            inos: (self.nodes.len() as u64).into(),
            build_time: (self.min_mtime.sec as u64).into(),
            build_time_nsec: self.min_mtime.nsec.into(),
            blocks: u32::try_from(blocks)
                .map_err(|_| Error::Invalid(format!("image of {blocks} blocks is too large")))?
                .into(),
            meta_blkaddr: (((SUPER_OFFSET + size_of::<SuperBlock>() as u64) / BLKSIZ) as u32)
                .into(),
            xattr_blkaddr: ((self.inodes_end / BLKSIZ) as u32).into(),
            ..Default::default()
        };
        w.write(sb.as_bytes())?;

        let mut current_end = data_start;
        for (idx, n) in self.nodes.iter().enumerate() {
            self.emit_inode(w, idx, n, &mut current_end)?;
        }
        w.align(SLOTSIZE)?;
        check_pos(w.pos, self.inodes_end, "inode table")?;

        for (k, v) in &self.shared_xattrs {
            write_xattr(w, k, v)?;
        }
        w.align(BLKSIZ)?;
        check_pos(w.pos, data_start, "data start")?;

        for n in &self.nodes {
            self.emit_blocks(w, n)?;
        }
        check_pos(w.pos, current_end, "data end")?;
        check_pos(w.pos, data_start + self.n_data_blocks * BLKSIZ, "image end")?;
        Ok(())
    }

    fn emit_inode<W: Write>(
        &self,
        w: &mut CountingWriter<W>,
        idx: usize,
        n: &Node<'_>,
        current_end: &mut u64,
    ) -> Result<(), Error> {
        w.pad(n.ipad)?;
        let icount = if n.xattr_size == 0 {
            0
        } else {
            (n.xattr_size - size_of::<XattrIbodyHeader>() as u64) / 4 + 1
        };
        let icount = u16::try_from(icount).map_err(|_| Error::InvalidInode {
            path: self.path_of(idx),
            reason: "too many xattrs".into(),
        })?;
        let mut layout = if n.tail > 0 {
            INODE_FLAT_INLINE
        } else {
            INODE_FLAT_PLAIN
        };
        let ft = FileType::from_mode(n.mode);
        let mut chunk_format = None;
        let size = match (&n.body, ft) {
            (Body::Dir(_), _) => n.n_blocks * BLKSIZ + n.tail,
            (Body::Regular { content }, _) => {
                if n.size > 0 && content.is_none() {
                    layout = INODE_CHUNK_BASED;
                    chunk_format = Some((chunking(n.size).0 - u32::from(BLKSIZ_BITS)) as u16);
                }
                n.size
            }
            (Body::Symlink(_), _) if n.n_blocks == 0 => n.tail,
            (Body::Symlink(_), _) => n.size,
            _ => 0,
        };
        let mut i_u: u32 = 0;
        match ft {
            Some(FileType::CharDevice) | Some(FileType::BlockDevice) => i_u = n.rdev as u32,
            Some(FileType::Directory) | Some(FileType::Regular) | Some(FileType::Symlink) => {
                if n.n_blocks > 0 {
                    i_u = (*current_end / BLKSIZ) as u32;
                    *current_end += n.n_blocks * BLKSIZ;
                }
                if let Some(f) = chunk_format {
                    i_u = (i_u & 0xFFFF_0000) | u32::from(f);
                }
            }
            _ => {}
        }
        let format = (layout << I_DATALAYOUT_BIT) | (u16::from(!n.compact) << I_VERSION_BIT);
        let ino = idx as u32;
        if n.compact {
            let i = InodeCompact {
                i_format: format.into(),
                i_xattr_icount: icount.into(),
                i_mode: (n.mode as u16).into(),
                i_nlink: (n.nlink as u16).into(),
                i_size: (size as u32).into(),
                i_u: i_u.into(),
                i_ino: ino.into(),
                i_uid: (n.uid as u16).into(),
                i_gid: (n.gid as u16).into(),
                ..Default::default()
            };
            w.write(i.as_bytes())?;
        } else {
            let i = InodeExtended {
                i_format: format.into(),
                i_xattr_icount: icount.into(),
                i_mode: (n.mode as u16).into(),
                i_size: size.into(),
                i_u: i_u.into(),
                i_ino: ino.into(),
                i_uid: n.uid.into(),
                i_gid: n.gid.into(),
                i_mtime: (n.mtime.sec as u64).into(),
                i_mtime_nsec: n.mtime.nsec.into(),
                i_nlink: n.nlink.into(),
                ..Default::default()
            };
            w.write(i.as_bytes())?;
        }

        if n.xattr_size > 0 {
            let start = w.pos;
            let n_shared = n.shared.iter().filter(|s| s.is_some()).count();
            let hdr = XattrIbodyHeader {
                h_name_filter: xattr_filter(&n.xattrs).into(),
                h_shared_count: n_shared as u8,
                h_reserved2: [0; 7],
            };
            w.write(hdr.as_bytes())?;
            for off in n.shared.iter().flatten() {
                let v = ((self.inodes_end % BLKSIZ + off) / 4) as u32;
                w.write(&v.to_le_bytes())?;
            }
            for ((k, v), s) in n.xattrs.iter().zip(&n.shared) {
                if s.is_none() {
                    write_xattr(w, k, v)?;
                }
            }
            check_pos(w.pos - start, n.xattr_size, "xattr area")?;
        }

        match &n.body {
            Body::Dir(children) => write_dirents(w, &self.nodes, n, children, false, true)?,
            Body::Symlink(t) if n.n_blocks == 0 => w.write(t)?,
            Body::Regular { content } if n.tail > 0 => match content {
                Some(c) => {
                    let start = c.len() - n.tail as usize;
                    w.write(&c[start..])?;
                }
                None => w.write_null_chunks(chunking(n.size).1)?,
            },
            _ => {}
        }
        Ok(())
    }

    fn emit_blocks<W: Write>(&self, w: &mut CountingWriter<W>, n: &Node<'_>) -> Result<(), Error> {
        if let Body::Dir(children) = &n.body {
            write_dirents(w, &self.nodes, n, children, true, false)?;
        }
        if n.n_blocks == 0 {
            return Ok(());
        }
        let data: &[u8] = match &n.body {
            Body::Regular { content: Some(c) } => c,
            Body::Regular { content: None } => {
                w.write_null_chunks(BLKSIZ / 4)?;
                return Ok(());
            }
            Body::Symlink(t) => t,
            _ => return Ok(()),
        };
        let body_len = (n.n_blocks * BLKSIZ).min(data.len() as u64) as usize;
        w.write(&data[..body_len])?;
        w.align(BLKSIZ)?;
        Ok(())
    }
}

fn check_pos(actual: u64, expected: u64, what: &str) -> Result<(), Error> {
    if actual == expected {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "internal layout error: {what} at byte {actual}, expected {expected}"
        )))
    }
}

fn xattr_filter(xattrs: &[(Vec<u8>, Vec<u8>)]) -> u32 {
    let mut bits = 0u32;
    for (k, _) in xattrs {
        let (index, suffix) = xattr_name_index(k);
        let bit = xxh32(suffix, XATTR_FILTER_SEED.wrapping_add(u32::from(index)))
            & (XATTR_FILTER_BITS - 1);
        bits |= 1 << bit;
    }
    XATTR_FILTER_DEFAULT & !bits
}

fn write_xattr<W: Write>(w: &mut CountingWriter<W>, key: &[u8], value: &[u8]) -> Result<(), Error> {
    let (index, suffix) = xattr_name_index(key);
    let e = XattrEntry {
        e_name_len: suffix.len() as u8,
        e_name_index: index,
        e_value_size: (value.len() as u16).into(),
    };
    w.write(e.as_bytes())?;
    w.write(suffix)?;
    w.write(value)?;
    w.align(4)
}

/// Writes the directory's full blocks (`blocks`) or its inline tail (`tail`).
fn write_dirents<W: Write>(
    w: &mut CountingWriter<W>,
    nodes: &[Node<'_>],
    dir: &Node<'_>,
    children: &[Child<'_>],
    blocks: bool,
    tail: bool,
) -> Result<(), Error> {
    let mut used = 0;
    let mut written = 0;
    let mut first = 0;
    for (i, c) in children.iter().enumerate() {
        let len = dirent_len(c);
        if used + len > BLKSIZ {
            if blocks {
                write_dirent_chunk(w, nodes, &children[first..i], BLKSIZ)?;
            }
            written += 1;
            used = 0;
            first = i;
        }
        used += len;
    }
    if written < dir.n_blocks {
        if blocks {
            write_dirent_chunk(w, nodes, &children[first..], BLKSIZ)?;
        }
        used = 0;
        first = children.len();
    }
    if tail && used > 0 {
        write_dirent_chunk(w, nodes, &children[first..], 1)?;
    }
    Ok(())
}

fn write_dirent_chunk<W: Write>(
    w: &mut CountingWriter<W>,
    nodes: &[Node<'_>],
    children: &[Child<'_>],
    align: u64,
) -> Result<(), Error> {
    let mut nameoff = (children.len() * size_of::<Dirent>()) as u64;
    for c in children {
        let target = &nodes[c.node()];
        let d = Dirent {
            nid: target.nid.into(),
            nameoff: (nameoff as u16).into(),
            file_type: file_type_code(target.mode),
            reserved: 0,
        };
        nameoff += c.name.len() as u64;
        w.write(d.as_bytes())?;
    }
    for c in children {
        w.write(&c.name)?;
    }
    w.align(align)
}

fn file_type_code(mode: u32) -> u8 {
    match FileType::from_mode(mode) {
        Some(FileType::Regular) => FT_REG_FILE,
        Some(FileType::Directory) => FT_DIR,
        Some(FileType::Symlink) => FT_SYMLINK,
        Some(FileType::CharDevice) => FT_CHRDEV,
        Some(FileType::BlockDevice) => FT_BLKDEV,
        Some(FileType::Fifo) => FT_FIFO,
        Some(FileType::Socket) => FT_SOCK,
        None => FT_UNKNOWN,
    }
}

/// A writer that knows how many bytes went through it.
pub(super) struct CountingWriter<'w, W: Write> {
    pub(super) inner: &'w mut W,
    pub(super) pos: u64,
}

impl<W: Write> CountingWriter<'_, W> {
    fn write(&mut self, b: &[u8]) -> Result<(), Error> {
        self.inner.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self, n: u64) -> Result<(), Error> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut left = n;
        while left > 0 {
            let k = left.min(ZEROS.len() as u64);
            self.write(&ZEROS[..k as usize])?;
            left -= k;
        }
        Ok(())
    }

    fn pad_to(&mut self, pos: u64) -> Result<(), Error> {
        self.pad(pos.saturating_sub(self.pos))
    }

    fn align(&mut self, a: u64) -> Result<(), Error> {
        self.pad_to(round_up(self.pos, a))
    }

    fn write_null_chunks(&mut self, count: u64) -> Result<(), Error> {
        for _ in 0..count {
            self.write(&NULL_ADDR.to_le_bytes())?;
        }
        Ok(())
    }
}
