//! Tree → EROFS image in the composefs format, byte for byte what
//! composefs' `mkcomposefs` writes for the same tree.
//!
//! The writer is a pure function of the tree and the options: no clock, no
//! random UUID, sorted containers only. It works in two passes, as the
//! reference does: first it lays every inode out (breadth-first over the
//! primary directory entries, names sorted bytewise), deciding inode sizes,
//! inline tails, padding and block addresses; then it emits the header,
//! superblock, inode table, shared xattrs and data blocks in one forward
//! stream. Nothing but the tree's own metadata (and small inline files) is
//! held in memory.
//!
//! What composefs adds on the way, and this writer therefore adds too:
//! - `trusted.overlay.*` xattrs of the tree are escaped to
//!   `trusted.overlay.overlay.*`, so overlayfs shows them as they were;
//! - regular files whose data lives in the object store get
//!   `trusted.overlay.metacopy` (with the fs-verity digest when known) and
//!   `trusted.overlay.redirect=/ab/cdef…`, and a chunk table of holes;
//! - whiteouts (char 0:0) in the tree become escaped whiteouts (regular
//!   files marked with xattrs) so overlayfs passes them through;
//! - the root gets `trusted.overlay.opaque=y` and 256 real whiteouts `00`…`ff`
//!   (hiding the object store's fan-out directories when it is stacked the
//!   old `lowerdir=meta::objects` way);
//! - every directory gets `.` and `..` entries.
//!
//! The two passes have a file each: `layout` decides where everything goes
//! and `emit` writes it. The types they share, and the arithmetic both use,
//! are here.

mod emit;
mod layout;

use std::borrow::Cow;
use std::io::Write;

use crate::format::*;
use crate::tree::{InodeId, Mtime, Tree};
use crate::Error;
use emit::CountingWriter;

/// Largest composefs format version this writer produces.
pub const MAX_FORMAT_VERSION: u32 = 1;

const MAX_CHUNK_BITS: u32 = CHUNK_FORMAT_BLKBITS_MASK as u32 + BLKSIZ_BITS as u32;

/// Which composefs format version to write.
///
/// As with `mkcomposefs --min-version/--max-version`: the image is written
/// as `min_version`, raised up to `max_version` only where the tree needs a
/// newer feature (whiteouts inside the image need version 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    pub min_version: u32,
    pub max_version: u32,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            min_version: 0,
            max_version: 1,
        }
    }
}

impl WriteOptions {
    /// Exactly version `v`, never raised.
    pub fn pinned(v: u32) -> Self {
        WriteOptions {
            min_version: v,
            max_version: v,
        }
    }
}

/// What the writer produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// The composefs format version written.
    pub version: u32,
    /// Number of inodes in the image (synthetic root whiteouts included).
    pub inodes: u64,
    /// Total image size in bytes.
    pub size: u64,
}

/// Writes `tree` as a composefs EROFS image to `out`.
pub fn mkfs_erofs(
    tree: &Tree,
    opts: &WriteOptions,
    out: &mut impl Write,
) -> Result<ImageInfo, Error> {
    let mut version = opts.min_version;
    let max_version = opts.max_version.max(opts.min_version);
    if max_version > MAX_FORMAT_VERSION {
        return Err(Error::UnsupportedVersion(max_version));
    }
    if version < 1 && max_version >= 1 && has_whiteout(tree) {
        version = 1;
    }
    let mut layout = Layout::build(tree, version)?;
    layout.place()?;
    let mut w = CountingWriter { inner: out, pos: 0 };
    layout.emit(&mut w)?;
    Ok(ImageInfo {
        version,
        inodes: layout.nodes.len() as u64,
        size: w.pos,
    })
}

/// Writes `tree` to a byte vector (for tests and small images).
pub fn mkfs_erofs_to_vec(tree: &Tree, opts: &WriteOptions) -> Result<Vec<u8>, Error> {
    let mut v = Vec::new();
    mkfs_erofs(tree, opts, &mut v)?;
    Ok(v)
}

fn has_whiteout(tree: &Tree) -> bool {
    let mut found = false;
    tree.walk(|_, id, e| {
        if !e.hardlink && tree.inode(id).is_whiteout() {
            found = true;
        }
    });
    found
}

/// One inode as the image will hold it.
struct Node<'t> {
    parent: usize,
    /// Where the inode came from (for error messages); `None` for synthesized ones.
    source: Option<InodeId>,
    mode: u32,
    uid: u32,
    gid: u32,
    nlink: u32,
    rdev: u64,
    size: u64,
    mtime: Mtime,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    body: Body<'t>,
    // Layout, filled in by `place`.
    compact: bool,
    n_blocks: u64,
    tail: u64,
    ipad: u64,
    xattr_size: u64,
    nid: u64,
    /// Per xattr (same order as `xattrs`): offset into the shared area.
    shared: Vec<Option<u64>>,
}

enum Body<'t> {
    Dir(Vec<Child<'t>>),
    Regular { content: Option<&'t [u8]> },
    Symlink(&'t [u8]),
    Special,
}

struct Child<'t> {
    name: Cow<'t, [u8]>,
    target: Target,
}

#[derive(Clone, Copy)]
enum Target {
    Node(usize),
    /// A secondary name, resolved once every primary has a node.
    Link(InodeId),
}

impl Child<'_> {
    fn node(&self) -> usize {
        match self.target {
            Target::Node(n) => n,
            // `resolve_links` leaves none of these behind.
            Target::Link(_) => usize::MAX,
        }
    }
}

struct Layout<'t> {
    tree: &'t Tree,
    version: u32,
    nodes: Vec<Node<'t>>,
    min_mtime: Mtime,
    has_acl: bool,
    /// Shared xattrs in the order written, with their byte sizes.
    shared_xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    shared_size: u64,
    inodes_end: u64,
    n_data_blocks: u64,
}

/// log2 of the chunk size and the number of chunks describing a file of `size` bytes.
fn chunking(size: u64) -> (u32, u64) {
    let mut bits = if size <= 1 {
        0
    } else {
        64 - (size - 1).leading_zeros()
    };
    bits = bits.max(u32::from(BLKSIZ_BITS)).min(MAX_CHUNK_BITS);
    let chunk = 1u64 << bits;
    (bits, size.div_ceil(chunk))
}

fn dirent_len(c: &Child<'_>) -> u64 {
    (size_of::<Dirent>() + c.name.len()) as u64
}

fn round_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

fn round_down(x: u64, align: u64) -> u64 {
    x - x % align
}
