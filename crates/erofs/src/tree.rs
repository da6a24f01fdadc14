//! The in-memory filesystem tree that every other part of this crate speaks.
//!
//! A [`Tree`] is an arena of [`Inode`]s; directories name their children by
//! [`InodeId`]. A file with several names (a hardlink) is one inode reached
//! from several directory entries: exactly one of them is its *primary* entry
//! (the one the dumpfile prints in full, and the position at which the EROFS
//! writer lays the inode out); the others are marked [`DirEntry::hardlink`].
//!
//! The tree holds what composefs holds: ownership, mode, mtime, xattrs,
//! symlink targets, and for regular files either inline content (small
//! files) or a reference to an object in a content-addressed store
//! (`payload`, the path below `objects/`, and the fs-verity `digest`). It
//! never holds the data of a large file.
//!
//! Names and xattr keys are raw bytes (Linux names need not be UTF-8); the
//! composefs rules (no NUL, no `/` in a name, not `.` or `..`, at most 255
//! bytes) are checked by [`Tree::add_child`].

use std::collections::BTreeMap;

use crate::Error;

/// Index of an inode in its [`Tree`].
pub type InodeId = usize;

/// The file type bits of `st_mode`.
pub const S_IFMT: u32 = 0o170000;
pub const S_IFSOCK: u32 = 0o140000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFIFO: u32 = 0o010000;

/// Longest name of a directory entry, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Longest symlink target or payload path, in bytes (PATH_MAX less the NUL).
pub const MAX_PATH_LEN: usize = 4095;
/// Largest regular file content that may be stored inside the image.
pub const MAX_INLINE_CONTENT: usize = 5000;
/// Files up to this size are inlined by default when building from a directory.
pub const DEFAULT_INLINE_THRESHOLD: u64 = 64;

/// File type of an inode, derived from its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
}

impl FileType {
    /// The type encoded in `mode`, or `None` for an unknown type.
    pub fn from_mode(mode: u32) -> Option<FileType> {
        Some(match mode & S_IFMT {
            S_IFREG => FileType::Regular,
            S_IFDIR => FileType::Directory,
            S_IFLNK => FileType::Symlink,
            S_IFCHR => FileType::CharDevice,
            S_IFBLK => FileType::BlockDevice,
            S_IFIFO => FileType::Fifo,
            S_IFSOCK => FileType::Socket,
            _ => return None,
        })
    }
}

/// Modification time: seconds since the epoch and nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mtime {
    pub sec: i64,
    pub nsec: u32,
}

/// What a directory entry points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry {
    pub inode: InodeId,
    /// True for every name of a multiply-linked inode except its primary one.
    pub hardlink: bool,
}

/// Type-specific content of an inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InodeData {
    /// Children by name (never `.` or `..`), sorted by bytes.
    Directory(BTreeMap<Vec<u8>, DirEntry>),
    Regular(RegularFile),
    /// The link target (non-empty, at most [`MAX_PATH_LEN`] bytes).
    Symlink(Vec<u8>),
    /// Devices, fifos and sockets: everything is in the inode.
    Special,
}

/// Where a regular file's bytes are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegularFile {
    /// The whole content, for files stored inside the image.
    pub content: Option<Vec<u8>>,
    /// Path of the backing object relative to the object store
    /// (`ab/cdef…`), written as the overlay redirect.
    pub payload: Option<Vec<u8>>,
    /// fs-verity sha256 digest of the content, written into the metacopy xattr.
    pub digest: Option<[u8; 32]>,
}

/// One inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    /// `st_mode`, type bits included.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Link count. For directories the writer recomputes it (2 + subdirs).
    pub nlink: u32,
    /// Device number (`st_rdev`) of character and block devices, else 0.
    pub rdev: u64,
    /// `st_size` of regular files; the writer derives it for other types.
    pub size: u64,
    pub mtime: Mtime,
    /// Extended attributes by full name (`user.foo`, `security.selinux`, …).
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub data: InodeData,
}

impl Inode {
    /// A new inode of the type given by `mode`, with empty content.
    pub fn new(mode: u32) -> Result<Inode, Error> {
        let ft = FileType::from_mode(mode).ok_or(Error::InvalidMode(mode))?;
        let data = match ft {
            FileType::Directory => InodeData::Directory(BTreeMap::new()),
            FileType::Regular => InodeData::Regular(RegularFile::default()),
            FileType::Symlink => InodeData::Symlink(Vec::new()),
            _ => InodeData::Special,
        };
        Ok(Inode {
            mode,
            uid: 0,
            gid: 0,
            nlink: 1,
            rdev: 0,
            size: 0,
            mtime: Mtime::default(),
            xattrs: BTreeMap::new(),
            data,
        })
    }

    pub fn file_type(&self) -> FileType {
        // `new` validated the mode; a caller that rewrote it to garbage gets
        // a regular file rather than a panic.
        FileType::from_mode(self.mode).unwrap_or(FileType::Regular)
    }

    pub fn is_dir(&self) -> bool {
        matches!(self.data, InodeData::Directory(_))
    }

    /// A character device 0:0, which overlayfs reads as a whiteout.
    pub fn is_whiteout(&self) -> bool {
        self.file_type() == FileType::CharDevice && self.rdev == 0
    }

    pub fn entries(&self) -> Option<&BTreeMap<Vec<u8>, DirEntry>> {
        match &self.data {
            InodeData::Directory(e) => Some(e),
            _ => None,
        }
    }
}

/// A whole filesystem tree; inode 0 is the root directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub inodes: Vec<Inode>,
}

/// The id of the root directory of every tree.
pub const ROOT: InodeId = 0;

impl Tree {
    /// A tree whose root is `root`, which must be a directory.
    pub fn new(root: Inode) -> Result<Tree, Error> {
        if !root.is_dir() {
            return Err(Error::RootNotDirectory);
        }
        Ok(Tree { inodes: vec![root] })
    }

    pub fn root(&self) -> &Inode {
        &self.inodes[ROOT]
    }

    pub fn inode(&self, id: InodeId) -> &Inode {
        &self.inodes[id]
    }

    pub fn inode_mut(&mut self, id: InodeId) -> &mut Inode {
        &mut self.inodes[id]
    }

    /// Adds `inode` to the arena without linking it anywhere.
    pub fn push(&mut self, inode: Inode) -> InodeId {
        self.inodes.push(inode);
        self.inodes.len() - 1
    }

    /// Links `child` into directory `parent` as `name`.
    ///
    /// `hardlink` marks a secondary name of an inode that already has its
    /// primary entry elsewhere. Directories may not be hardlinked.
    pub fn add_child(
        &mut self,
        parent: InodeId,
        name: &[u8],
        child: InodeId,
        hardlink: bool,
    ) -> Result<(), Error> {
        check_name(name)?;
        if child >= self.inodes.len() {
            return Err(Error::Invalid(format!("no inode {child}")));
        }
        if hardlink && (self.inodes[child].is_dir() || child == parent) {
            return Err(Error::DirectoryHardlink(lossy(name)));
        }
        let entries = match &mut self.inodes[parent].data {
            InodeData::Directory(e) => e,
            _ => return Err(Error::NotADirectory(lossy(name))),
        };
        if entries.contains_key(name) {
            return Err(Error::DuplicateEntry(lossy(name)));
        }
        entries.insert(
            name.to_vec(),
            DirEntry {
                inode: child,
                hardlink,
            },
        );
        Ok(())
    }

    /// Looks up a `/`-separated path from the root (leading and repeated
    /// slashes are ignored), following primary and hardlink entries alike.
    pub fn lookup(&self, path: &[u8]) -> Option<InodeId> {
        let mut cur = ROOT;
        for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            cur = self.inodes[cur].entries()?.get(comp)?.inode;
        }
        Some(cur)
    }

    /// Visits every primary entry depth-first in name order, calling
    /// `f(path, id)`; the root is visited first with path `/`.
    pub fn walk(&self, mut f: impl FnMut(&[u8], InodeId, &DirEntryRef)) {
        let mut path = b"/".to_vec();
        f(&path, ROOT, &DirEntryRef { hardlink: false });
        self.walk_dir(ROOT, &mut path, &mut f, 0);
    }

    fn walk_dir(
        &self,
        dir: InodeId,
        path: &mut Vec<u8>,
        f: &mut impl FnMut(&[u8], InodeId, &DirEntryRef),
        depth: usize,
    ) {
        let Some(entries) = self.inodes[dir].entries() else {
            return;
        };
        let base = path.len();
        for (name, e) in entries {
            if path.len() > 1 {
                path.push(b'/');
            }
            path.extend_from_slice(name);
            f(
                path,
                e.inode,
                &DirEntryRef {
                    hardlink: e.hardlink,
                },
            );
            if !e.hardlink && self.inodes[e.inode].is_dir() && depth < MAX_DEPTH {
                self.walk_dir(e.inode, path, f, depth + 1);
            }
            path.truncate(base);
        }
    }
}

/// What [`Tree::walk`] tells about the entry it visits.
#[derive(Debug, Clone, Copy)]
pub struct DirEntryRef {
    pub hardlink: bool,
}

/// Deepest directory nesting the walkers follow (PATH_MAX / 2).
pub const MAX_DEPTH: usize = 2048;

/// Checks a directory entry name against the composefs rules.
pub fn check_name(name: &[u8]) -> Result<(), Error> {
    if name.is_empty() {
        return Err(Error::InvalidName("empty name".into()));
    }
    if name == b"." || name == b".." {
        return Err(Error::InvalidName(format!("'{}' is reserved", lossy(name))));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(Error::InvalidName(format!(
            "name of {} bytes is longer than {MAX_NAME_LEN}",
            name.len()
        )));
    }
    if name.iter().any(|&b| b == b'/' || b == 0) {
        return Err(Error::InvalidName(format!(
            "'{}' contains '/' or NUL",
            lossy(name)
        )));
    }
    Ok(())
}

pub(crate) fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
