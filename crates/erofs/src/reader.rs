//! EROFS image → [`Tree`], for images cairn wrote and for images from
//! anywhere else.
//!
//! An image is untrusted input. The reader never panics on any byte
//! sequence: every offset is checked arithmetic against the image length,
//! every slice is taken with `.get()`, directory nesting and the inode count
//! are capped, and each failure is a typed [`ReadError`] that says what was
//! wrong and where (byte offset or node id).
//!
//! For composefs images (those with the composefs header) the reader undoes
//! what the writer added: overlay redirect/metacopy xattrs become the file's
//! payload and digest, escaped `trusted.overlay.overlay.*` xattrs are
//! unescaped, escaped whiteouts become character devices 0:0 again, and the
//! synthetic root whiteouts and markers disappear. Writing the tree back out
//! gives the same bytes (hardlinks keep their primary entry, recovered from
//! the breadth-first inode order).

use std::collections::VecDeque;

use zerocopy::FromBytes;

use crate::format::*;
use crate::tree::{
    check_name, DirEntry, FileType, Inode, InodeData, InodeId, Mtime, RegularFile, Tree,
    MAX_INLINE_CONTENT, MAX_PATH_LEN, S_IFCHR, S_IFMT,
};

/// What went wrong reading an image, and where.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("image is {0} bytes, too small to hold an EROFS superblock")]
    TooSmall(u64),
    #[error("image is {size} bytes, larger than the limit of {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("not an EROFS image: bad superblock magic {0:#010x} at byte 1024")]
    BadMagic(u32),
    #[error("unsupported EROFS image: {0}")]
    Unsupported(String),
    #[error("corrupt EROFS image: inode {nid}: {reason}")]
    CorruptInode { nid: u64, reason: String },
    #[error("corrupt EROFS image: {0}")]
    Corrupt(String),
    #[error("image holds more than {0} inodes")]
    TooManyInodes(u64),
    #[error("directories nested deeper than {0}")]
    TooDeep(usize),
}

/// Limits applied while reading.
#[derive(Debug, Clone, Copy)]
pub struct ReadOptions {
    /// Largest image accepted, in bytes.
    pub max_image_size: u64,
    /// Most inodes accepted.
    pub max_inodes: u64,
    /// Deepest directory nesting accepted.
    pub max_depth: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            max_image_size: 4 << 30,
            max_inodes: 16 << 20,
            max_depth: crate::tree::MAX_DEPTH,
        }
    }
}

/// Summary of the image header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// composefs format version, or `None` for a plain EROFS image.
    pub composefs_version: Option<u32>,
    pub inodes: u64,
    pub blocks: u32,
    pub build_time: Mtime,
}

/// Reads the image held in `data` with default limits.
pub fn read_image(data: &[u8]) -> Result<Tree, ReadError> {
    read_image_with(data, &ReadOptions::default())
}

/// Reads only the composefs header and the superblock; `data` may be just
/// the first block of the image (the rest is not looked at).
pub fn read_header(data: &[u8]) -> Result<ImageHeader, ReadError> {
    Image::parse_super(data, &ReadOptions::default()).map(|i| i.header)
}

/// Reads the image held in `data`.
pub fn read_image_with(data: &[u8], opts: &ReadOptions) -> Result<Tree, ReadError> {
    let img = Image::open(data, opts)?;
    img.build_tree(opts)
}

/// An xattr as (full name, value).
type Xattr = (Vec<u8>, Vec<u8>);

const OVERLAY_PREFIX: &[u8] = b"trusted.overlay.";
const OVERLAY_ESCAPED_PREFIX: &[u8] = b"trusted.overlay.overlay.";

struct Image<'a> {
    data: &'a [u8],
    header: ImageHeader,
    meta_base: u64,
    xattr_base: u64,
    root_nid: u64,
}

/// An inode as parsed from the image.
struct RawInode {
    nid: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u32,
    size: u64,
    mtime: Mtime,
    rdev: u64,
    layout: u16,
    raw_blkaddr: u32,
    /// Byte offset of the inode in the image and its fixed size.
    offset: u64,
    isize: u64,
    xattr_size: u64,
    xattr_icount: u16,
}

fn corrupt(nid: u64, reason: impl Into<String>) -> ReadError {
    ReadError::CorruptInode {
        nid,
        reason: reason.into(),
    }
}

impl<'a> Image<'a> {
    fn open(data: &'a [u8], opts: &ReadOptions) -> Result<Image<'a>, ReadError> {
        let img = Image::parse_super(data, opts)?;
        let len = data.len() as u64;
        if img.meta_base >= len || img.xattr_base > len {
            return Err(ReadError::Corrupt(format!(
                "metadata at byte {} or shared xattrs at byte {} lie outside the {len}-byte image",
                img.meta_base, img.xattr_base
            )));
        }
        Ok(img)
    }

    /// Header and superblock only, without checking where they point.
    fn parse_super(data: &'a [u8], opts: &ReadOptions) -> Result<Image<'a>, ReadError> {
        let len = data.len() as u64;
        if len > opts.max_image_size {
            return Err(ReadError::TooLarge {
                size: len,
                limit: opts.max_image_size,
            });
        }
        let sb_end = SUPER_OFFSET + size_of::<SuperBlock>() as u64;
        if len < sb_end {
            return Err(ReadError::TooSmall(len));
        }
        let composefs_version = ComposefsHeader::read_from_prefix(data)
            .ok()
            .filter(|(h, _)| h.magic.get() == COMPOSEFS_MAGIC)
            .map(|(h, _)| (h.version.get(), h.composefs_version.get()));
        let composefs_version = match composefs_version {
            Some((v, cv)) if v == COMPOSEFS_HEADER_VERSION => Some(cv),
            Some((v, _)) => {
                return Err(ReadError::Unsupported(format!(
                    "composefs header version {v}"
                )))
            }
            None => None,
        };
        let sb_bytes = data
            .get(SUPER_OFFSET as usize..sb_end as usize)
            .ok_or(ReadError::TooSmall(len))?;
        let (sb, _) =
            SuperBlock::read_from_prefix(sb_bytes).map_err(|_| ReadError::TooSmall(len))?;
        if sb.magic.get() != SUPER_MAGIC_V1 {
            return Err(ReadError::BadMagic(sb.magic.get()));
        }
        if sb.blkszbits != BLKSIZ_BITS {
            return Err(ReadError::Unsupported(format!(
                "block size 2^{} (only 4096-byte blocks are read)",
                sb.blkszbits
            )));
        }
        let incompat = sb.feature_incompat.get();
        let known = FEATURE_INCOMPAT_CHUNKED_FILE;
        if incompat & !known != 0 {
            return Err(ReadError::Unsupported(format!(
                "incompatible features {:#x} (compression, extra devices, …)",
                incompat & !known
            )));
        }
        if sb.extra_devices.get() != 0 {
            return Err(ReadError::Unsupported("extra blob devices".into()));
        }
        let meta_base = u64::from(sb.meta_blkaddr.get()) * BLKSIZ;
        let xattr_base = u64::from(sb.xattr_blkaddr.get()) * BLKSIZ;
        Ok(Image {
            data,
            header: ImageHeader {
                composefs_version,
                inodes: sb.inos.get(),
                blocks: sb.blocks.get(),
                build_time: Mtime {
                    sec: sb.build_time.get() as i64,
                    nsec: sb.build_time_nsec.get(),
                },
            },
            meta_base,
            xattr_base,
            root_nid: u64::from(sb.root_nid.get()),
        })
    }

    fn bytes(&self, off: u64, len: u64) -> Option<&'a [u8]> {
        let start = usize::try_from(off).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        self.data.get(start..end)
    }

    fn inode(&self, nid: u64) -> Result<RawInode, ReadError> {
        let offset = nid
            .checked_mul(SLOTSIZE)
            .and_then(|o| o.checked_add(self.meta_base))
            .ok_or_else(|| corrupt(nid, "node id out of range"))?;
        let head = self
            .bytes(offset, size_of::<InodeCompact>() as u64)
            .ok_or_else(|| corrupt(nid, "inode lies past the end of the image"))?;
        let (c, _) =
            InodeCompact::read_from_prefix(head).map_err(|_| corrupt(nid, "short inode"))?;
        let format = c.i_format.get();
        let extended = (format >> I_VERSION_BIT) & I_VERSION_MASK == 1;
        let layout = (format >> I_DATALAYOUT_BIT) & I_DATALAYOUT_MASK;
        if format & !((I_DATALAYOUT_MASK << I_DATALAYOUT_BIT) | I_VERSION_MASK) != 0 {
            return Err(corrupt(
                nid,
                format!("unknown inode format bits {format:#x}"),
            ));
        }
        let mut raw = if extended {
            let b = self
                .bytes(offset, size_of::<InodeExtended>() as u64)
                .ok_or_else(|| corrupt(nid, "extended inode lies past the end of the image"))?;
            let (e, _) =
                InodeExtended::read_from_prefix(b).map_err(|_| corrupt(nid, "short inode"))?;
            RawInode {
                nid,
                mode: u32::from(e.i_mode.get()),
                uid: e.i_uid.get(),
                gid: e.i_gid.get(),
                nlink: e.i_nlink.get(),
                size: e.i_size.get(),
                mtime: Mtime {
                    sec: e.i_mtime.get() as i64,
                    nsec: e.i_mtime_nsec.get(),
                },
                rdev: u64::from(e.i_u.get()),
                layout,
                raw_blkaddr: e.i_u.get(),
                offset,
                isize: size_of::<InodeExtended>() as u64,
                xattr_size: 0,
                xattr_icount: e.i_xattr_icount.get(),
            }
        } else {
            RawInode {
                nid,
                mode: u32::from(c.i_mode.get()),
                uid: u32::from(c.i_uid.get()),
                gid: u32::from(c.i_gid.get()),
                nlink: u32::from(c.i_nlink.get()),
                size: u64::from(c.i_size.get()),
                mtime: self.header.build_time,
                rdev: u64::from(c.i_u.get()),
                layout,
                raw_blkaddr: c.i_u.get(),
                offset,
                isize: size_of::<InodeCompact>() as u64,
                xattr_size: 0,
                xattr_icount: c.i_xattr_icount.get(),
            }
        };
        raw.xattr_size = xattr_ibody_size(raw.xattr_icount) as u64;
        if FileType::from_mode(raw.mode).is_none() {
            return Err(corrupt(nid, format!("invalid file mode {:o}", raw.mode)));
        }
        if !matches!(
            FileType::from_mode(raw.mode),
            Some(FileType::CharDevice | FileType::BlockDevice)
        ) {
            raw.rdev = 0;
        }
        Ok(raw)
    }

    /// The bytes of a flat (plain or inline) inode's data, at most `limit` long.
    fn flat_data(&self, ino: &RawInode, limit: u64) -> Result<Vec<u8>, ReadError> {
        let (blocks, tail) = self.flat_parts(ino, limit)?;
        let mut out = Vec::with_capacity(blocks.len() + tail.len());
        out.extend_from_slice(blocks);
        out.extend_from_slice(tail);
        Ok(out)
    }

    /// A flat inode's data as it lies in the image, at most `limit` long:
    /// the whole blocks (a multiple of the block size, except for a plain
    /// inode's last block) and the inline tail (empty for plain inodes).
    fn flat_parts(&self, ino: &RawInode, limit: u64) -> Result<(&'a [u8], &'a [u8]), ReadError> {
        let nid = ino.nid;
        if ino.size > limit {
            return Err(corrupt(
                nid,
                format!("data of {} bytes exceeds the limit of {limit}", ino.size),
            ));
        }
        let (blocks_len, tail_len) = match ino.layout {
            INODE_FLAT_PLAIN => (ino.size, 0),
            INODE_FLAT_INLINE => {
                let tail = ino.size % BLKSIZ;
                let tail = if tail == 0 && ino.size > 0 {
                    BLKSIZ
                } else {
                    tail
                };
                (ino.size - tail, tail)
            }
            INODE_CHUNK_BASED => {
                return Err(corrupt(
                    nid,
                    "chunk-based data where flat data was expected",
                ))
            }
            other => {
                return Err(ReadError::Unsupported(format!(
                    "inode {nid}: data layout {other} (compressed)"
                )))
            }
        };
        let mut blocks: &'a [u8] = &[];
        let mut tail: &'a [u8] = &[];
        if blocks_len > 0 {
            let off = u64::from(ino.raw_blkaddr) * BLKSIZ;
            blocks = self.bytes(off, blocks_len).ok_or_else(|| {
                corrupt(
                    nid,
                    format!("data blocks at byte {off} lie past the end of the image"),
                )
            })?;
        }
        if tail_len > 0 {
            let off = ino.offset + ino.isize + ino.xattr_size;
            if off / BLKSIZ != (off + tail_len - 1) / BLKSIZ {
                return Err(corrupt(nid, "inline data crosses a block boundary"));
            }
            tail = self
                .bytes(off, tail_len)
                .ok_or_else(|| corrupt(nid, "inline data lies past the end of the image"))?;
        }
        Ok((blocks, tail))
    }

    fn xattrs(&self, ino: &RawInode) -> Result<Vec<Xattr>, ReadError> {
        let nid = ino.nid;
        let mut out = Vec::new();
        if ino.xattr_size == 0 {
            return Ok(out);
        }
        let start = ino.offset + ino.isize;
        let area = self
            .bytes(start, ino.xattr_size)
            .ok_or_else(|| corrupt(nid, "xattrs lie past the end of the image"))?;
        let (hdr, _) = XattrIbodyHeader::read_from_prefix(area)
            .map_err(|_| corrupt(nid, "xattr area shorter than its header"))?;
        let shared = u64::from(hdr.h_shared_count);
        let mut pos = size_of::<XattrIbodyHeader>() as u64;
        for _ in 0..shared {
            let b = area
                .get(pos as usize..pos as usize + 4)
                .ok_or_else(|| corrupt(nid, "shared xattr index past the xattr area"))?;
            let idx = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let off = self.xattr_base + u64::from(idx) * 4;
            let entry = self.data.get(off as usize..).ok_or_else(|| {
                corrupt(nid, format!("shared xattr {idx} past the end of the image"))
            })?;
            let (kv, _) = parse_xattr_entry(entry).map_err(|r| corrupt(nid, r))?;
            out.push(kv);
            pos += 4;
        }
        while pos + size_of::<XattrEntry>() as u64 <= ino.xattr_size {
            let rest = area.get(pos as usize..).unwrap_or_default();
            let (kv, used) = parse_xattr_entry(rest).map_err(|r| corrupt(nid, r))?;
            out.push(kv);
            pos += used;
        }
        Ok(out)
    }

    /// Directory entries (name, nid), `.` and `..` included, into `out`
    /// (cleared first). The names borrow from the image.
    fn dirents(&self, ino: &RawInode, out: &mut Vec<(&'a [u8], u64)>) -> Result<(), ReadError> {
        let nid = ino.nid;
        out.clear();
        // A directory holds at most one entry per 13 bytes; cap at the image size.
        let (blocks, tail) = self.flat_parts(ino, self.data.len() as u64)?;
        // The same blocks as chunking `blocks ++ tail`: `blocks` is whole
        // blocks whenever there is a tail.
        let tail = (!tail.is_empty()).then_some(tail);
        for block in blocks.chunks(BLKSIZ as usize).chain(tail) {
            let (first, _) = Dirent::read_from_prefix(block)
                .map_err(|_| corrupt(nid, "directory block shorter than one entry"))?;
            let names_start = usize::from(first.nameoff.get());
            let dsize = size_of::<Dirent>();
            if names_start < dsize || names_start % dsize != 0 || names_start > block.len() {
                return Err(corrupt(nid, format!("bad first name offset {names_start}")));
            }
            let count = names_start / dsize;
            out.reserve(count);
            for i in 0..count {
                let d = block
                    .get(i * dsize..(i + 1) * dsize)
                    .and_then(|b| Dirent::read_from_prefix(b).ok())
                    .map(|(d, _)| d)
                    .ok_or_else(|| corrupt(nid, "truncated directory entry"))?;
                let start = usize::from(d.nameoff.get());
                let end = if i + 1 < count {
                    let next = block
                        .get((i + 1) * dsize..(i + 2) * dsize)
                        .and_then(|b| Dirent::read_from_prefix(b).ok())
                        .map(|(d, _)| usize::from(d.nameoff.get()))
                        .ok_or_else(|| corrupt(nid, "truncated directory entry"))?;
                    next
                } else {
                    let tail = block.get(start..).unwrap_or_default();
                    start + tail.iter().position(|&b| b == 0).unwrap_or(tail.len())
                };
                let name = block
                    .get(start..end)
                    .filter(|_| start >= names_start)
                    .ok_or_else(|| corrupt(nid, format!("bad name offsets {start}..{end}")))?;
                out.push((name, d.nid.get()));
            }
        }
        Ok(())
    }

    fn build_tree(&self, opts: &ReadOptions) -> Result<Tree, ReadError> {
        let composefs = self.header.composefs_version.is_some();
        // Positions below are `u32`; an image needs more than 128 GiB of
        // inode slots before that cap matters.
        let max_inodes = opts
            .max_inodes
            .min(self.data.len() as u64 / SLOTSIZE + 1)
            .min(u64::from(u32::MAX - 1));

        // Inodes are numbered by position in `nodes` in the order they are
        // first reached. `index` maps a node id to its position + 1 (0: not
        // read yet). Every node id that `inode` accepts has its 32-byte slot
        // inside the image after `meta_base`, so `index` is bounded by the
        // image size; ids past its end are never read successfully and take
        // the same error path as any other bad id.
        let slots = (self.data.len() as u64).saturating_sub(self.meta_base) / SLOTSIZE + 1;
        let slots = usize::try_from(slots).map_err(|_| ReadError::TooManyInodes(max_inodes))?;
        let mut index: Vec<u32> = vec![0; slots];
        let slot = |nid: u64| usize::try_from(nid).ok().filter(|&i| i < slots);

        /// Per inode: the parsed inode and what the walk knows about it.
        struct Node {
            raw: RawInode,
            /// A directory already queued (or the root).
            dir_seen: bool,
            /// Target of at least one kept entry.
            linked: bool,
        }
        /// A kept directory entry, by positions in `nodes`.
        struct Entry<'n> {
            parent: u32,
            child: u32,
            name: &'n [u8],
            primary: bool,
        }

        // Breadth-first over directories, in the order the writer lays them out.
        struct DirVisit {
            pos: u32,
            depth: usize,
        }
        let root = self.inode(self.root_nid)?;
        if FileType::from_mode(root.mode) != Some(FileType::Directory) {
            return Err(corrupt(self.root_nid, "root is not a directory"));
        }
        let root_slot =
            slot(self.root_nid).ok_or_else(|| corrupt(self.root_nid, "node id out of range"))?;
        index[root_slot] = 1;
        let mut nodes: Vec<Node> = vec![Node {
            raw: root,
            dir_seen: true,
            linked: false,
        }];
        let mut queue = VecDeque::from([DirVisit { pos: 0, depth: 0 }]);
        // Kept entries in visiting order; each directory's entries are
        // contiguous and sorted by name.
        let mut entries: Vec<Entry<'a>> = Vec::new();
        let mut kids: Vec<(&'a [u8], u64)> = Vec::new();
        while let Some(v) = queue.pop_front() {
            let dir_nid = nodes[v.pos as usize].raw.nid;
            self.dirents(&nodes[v.pos as usize].raw, &mut kids)?;
            entries.reserve(kids.len());
            let mut prev: Option<&[u8]> = None;
            for &(name, child) in &kids {
                if name == b"." || name == b".." {
                    continue;
                }
                check_name(name).map_err(|e| corrupt(dir_nid, e.to_string()))?;
                if prev.is_some_and(|p| p >= name) {
                    return Err(corrupt(
                        dir_nid,
                        "directory entries are not sorted or repeat",
                    ));
                }
                prev = Some(name);
                let known = slot(child).map_or(0, |i| index[i]);
                let pos = if known != 0 {
                    known - 1
                } else {
                    if nodes.len() as u64 >= max_inodes {
                        return Err(ReadError::TooManyInodes(max_inodes));
                    }
                    let c = self.inode(child)?;
                    let i = slot(child).ok_or_else(|| corrupt(child, "node id out of range"))?;
                    let pos = nodes.len() as u32;
                    nodes.push(Node {
                        raw: c,
                        dir_seen: false,
                        linked: false,
                    });
                    index[i] = pos + 1;
                    pos
                };
                let c = &mut nodes[pos as usize];
                if composefs && c.raw.mode & S_IFMT == S_IFCHR && c.raw.rdev == 0 {
                    // A real whiteout in a composefs image: the root's 00..ff.
                    continue;
                }
                if FileType::from_mode(c.raw.mode) == Some(FileType::Directory) {
                    if c.dir_seen {
                        return Err(corrupt(
                            child,
                            "directory reached twice (a loop or a directory hardlink)",
                        ));
                    }
                    c.dir_seen = true;
                    if v.depth + 1 > opts.max_depth {
                        return Err(ReadError::TooDeep(opts.max_depth));
                    }
                    queue.push_back(DirVisit {
                        pos,
                        depth: v.depth + 1,
                    });
                }
                c.linked = true;
                entries.push(Entry {
                    parent: v.pos,
                    child: pos,
                    name,
                    primary: false,
                });
            }
        }

        // Primary entries: the writer enqueues primaries in node-id order, so
        // walk the entries with a cursor over the distinct child ids in
        // ascending order (`index` is in node-id order already).
        let mut distinct = index
            .iter()
            .filter(|&&p| p != 0)
            .map(|&p| p - 1)
            .filter(|&p| nodes[p as usize].linked)
            .peekable();
        let mut placed = vec![false; nodes.len()];
        for e in entries.iter_mut() {
            if distinct.peek() == Some(&e.child) {
                e.primary = true;
                placed[e.child as usize] = true;
                distinct.next();
            }
        }
        drop(index);
        for e in entries.iter_mut() {
            let c = &mut placed[e.child as usize];
            if !*c {
                e.primary = true;
                *c = true;
            }
        }

        // Build the tree: the root, then every other inode in the order its
        // first entry comes.
        const NO_ID: InodeId = InodeId::MAX;
        let mut ids: Vec<InodeId> = vec![NO_ID; nodes.len()];
        let root_inode = self.make_inode(&nodes[0].raw)?;
        let mut tree = Tree::new(root_inode).map_err(|e| ReadError::Corrupt(e.to_string()))?;
        tree.inodes.reserve(nodes.len() - 1);
        ids[0] = crate::tree::ROOT;
        for e in &entries {
            let id = &mut ids[e.child as usize];
            if *id == NO_ID {
                let inode = self.make_inode(&nodes[e.child as usize].raw)?;
                *id = tree.push(inode);
            }
        }
        drop(nodes);
        for group in entries.chunk_by(|a, b| a.parent == b.parent) {
            let p = ids[group[0].parent as usize];
            if let InodeData::Directory(map) = &mut tree.inode_mut(p).data {
                let kids = group.iter().map(|e| {
                    (
                        e.name.to_vec(),
                        DirEntry {
                            inode: ids[e.child as usize],
                            hardlink: !e.primary,
                        },
                    )
                });
                if map.is_empty() {
                    // Names are strictly ascending: a bulk build.
                    *map = kids.collect();
                } else {
                    map.extend(kids);
                }
            }
        }
        if composefs {
            strip_dir_markers(&mut tree);
        }
        Ok(tree)
    }

    fn make_inode(&self, r: &RawInode) -> Result<Inode, ReadError> {
        let composefs = self.header.composefs_version.is_some();
        let nid = r.nid;
        let mut inode = Inode::new(r.mode).map_err(|e| corrupt(nid, e.to_string()))?;
        inode.uid = r.uid;
        inode.gid = r.gid;
        inode.nlink = r.nlink;
        inode.rdev = r.rdev;
        inode.size = r.size;
        inode.mtime = r.mtime;
        let mut reg = RegularFile::default();
        let mut non_inline = false;
        let mut whiteout = false;
        for (k, v) in self.xattrs(r)? {
            if composefs && k.starts_with(OVERLAY_PREFIX) {
                let is_reg = inode.file_type() == FileType::Regular;
                match k.as_slice() {
                    b"trusted.overlay.metacopy" if is_reg => {
                        non_inline = true;
                        if v.len() == 36 {
                            let mut d = [0u8; 32];
                            d.copy_from_slice(&v[4..36]);
                            reg.digest = Some(d);
                        }
                    }
                    b"trusted.overlay.redirect" if is_reg => {
                        let p = v.strip_prefix(b"/").unwrap_or(&v);
                        if p.len() > MAX_PATH_LEN {
                            return Err(corrupt(nid, "redirect path too long"));
                        }
                        reg.payload = Some(p.to_vec());
                    }
                    b"trusted.overlay.overlay.whiteout" if is_reg => whiteout = true,
                    b"trusted.overlay.overlay.whiteouts" => {
                        // Kept until the whole tree is read: it tells
                        // `strip_dir_markers` which directories' markers
                        // are the writer's, and that removes it.
                        inode.xattrs.insert(k, v);
                    }
                    _ if k.starts_with(OVERLAY_ESCAPED_PREFIX) => {
                        let mut name = b"trusted.".to_vec();
                        name.extend_from_slice(&k[OVERLAY_PREFIX.len()..]);
                        inode.xattrs.insert(name, v);
                    }
                    // The writer's own markers (root opaque and such).
                    _ => {}
                }
                continue;
            }
            if composefs
                && (k.as_slice() == b"user.overlay.whiteout"
                    || k.as_slice() == b"user.overlay.whiteouts")
            {
                continue;
            }
            inode.xattrs.insert(k, v);
        }
        match inode.file_type() {
            FileType::Regular if whiteout => {
                inode.mode = S_IFCHR | (inode.mode & !S_IFMT);
                inode.data = InodeData::Special;
                inode.size = 0;
                inode.rdev = 0;
            }
            FileType::Regular => {
                if r.size > 0 && !non_inline && r.layout != INODE_CHUNK_BASED {
                    let c = self.flat_data(r, MAX_INLINE_CONTENT as u64)?;
                    reg.content = Some(c);
                } else if r.size > 0 && r.layout != INODE_CHUNK_BASED {
                    return Err(corrupt(nid, "file marked metacopy has flat data"));
                } else if r.size > 0 && !composefs {
                    return Err(ReadError::Unsupported(format!(
                        "inode {nid}: chunk-based file outside a composefs image"
                    )));
                }
                inode.data = InodeData::Regular(reg);
            }
            FileType::Symlink => {
                let t = self.flat_data(r, MAX_PATH_LEN as u64)?;
                if t.is_empty() {
                    return Err(corrupt(nid, "empty symlink target"));
                }
                inode.size = t.len() as u64;
                inode.data = InodeData::Symlink(t);
            }
            _ => {}
        }
        Ok(inode)
    }
}

/// Removes the whiteout markers the writer put on directories that hold
/// whiteouts (they come back when the tree is written again).
fn strip_dir_markers(tree: &mut Tree) {
    for inode in &mut tree.inodes {
        if !inode.is_dir() {
            continue;
        }
        if inode
            .xattrs
            .remove(b"trusted.overlay.overlay.whiteouts".as_slice())
            .is_some()
        {
            inode.xattrs.remove(b"user.overlay.whiteouts".as_slice());
            for k in [
                b"trusted.overlay.opaque".as_slice(),
                b"user.overlay.opaque".as_slice(),
            ] {
                if inode.xattrs.get(k).is_some_and(|v| v.as_slice() == b"x") {
                    inode.xattrs.remove(k);
                }
            }
        }
    }
}

/// Parses one xattr entry; returns the full name, value and bytes used (aligned).
fn parse_xattr_entry(b: &[u8]) -> Result<(Xattr, u64), String> {
    let (e, _) =
        XattrEntry::read_from_prefix(b).map_err(|_| "truncated xattr entry".to_string())?;
    let name_len = usize::from(e.e_name_len);
    let value_len = usize::from(e.e_value_size.get());
    let hdr = size_of::<XattrEntry>();
    if e.e_name_index & XATTR_LONG_PREFIX != 0 {
        return Err("long xattr name prefixes are not supported".into());
    }
    let prefix = XATTR_PREFIXES
        .get(usize::from(e.e_name_index))
        .ok_or_else(|| format!("unknown xattr name index {}", e.e_name_index))?;
    let suffix = b
        .get(hdr..hdr + name_len)
        .ok_or("xattr name past the end of its area")?;
    let value = b
        .get(hdr + name_len..hdr + name_len + value_len)
        .ok_or("xattr value past the end of its area")?;
    let mut name = Vec::with_capacity(prefix.len() + suffix.len());
    name.extend_from_slice(prefix);
    name.extend_from_slice(suffix);
    if name.is_empty() {
        return Err("empty xattr name".into());
    }
    let used = (hdr + name_len + value_len).div_ceil(4) * 4;
    Ok(((name, value.to_vec()), used as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Inode, Tree, S_IFDIR, S_IFREG};
    use crate::writer::{mkfs_erofs_to_vec, WriteOptions};

    #[test]
    fn header_reads_from_the_first_block_alone() {
        let mut root = Inode::new(S_IFDIR | 0o755).unwrap();
        root.mtime.sec = 1;
        let mut tree = Tree::new(root).unwrap();
        let mut f = Inode::new(S_IFREG | 0o644).unwrap();
        f.size = 1 << 30;
        let id = tree.push(f);
        tree.add_child(crate::ROOT, b"big", id, false).unwrap();
        let image = mkfs_erofs_to_vec(&tree, &WriteOptions::default()).unwrap();
        assert!(image.len() > 4096);
        let h = read_header(&image[..4096]).unwrap();
        assert_eq!(h.composefs_version, Some(0));
        assert_eq!(h.inodes, 258);
        assert!(matches!(
            read_image(&image[..4096]),
            Err(ReadError::Corrupt(_))
        ));
    }
}
