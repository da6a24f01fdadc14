//! Keeping the store private: only its owner (root, for the default store)
//! may list it or read anything in it.
//!
//! Images hold whatever their builders put in them: `/etc/shadow`, private
//! keys, tokens. Objects carry no trace of the mode a file had in its image
//! (one object backs every file with that content, in every image, whatever
//! their modes), so the barrier is the directories: the store root and every
//! directory directly below it are mode 0700, as containers/storage keeps
//! its own. Files inside keep simple fixed modes: objects 0644 and object
//! fan-out directories 0755 (so a store made before this rule needs no walk
//! of its objects to become private, and an object's mode never pretends to
//! be a file's), everything else the store writes 0600 (images, which
//! inline small files; records; refs; logs; container state).
//!
//! Containers still read their files as the image's modes allow: overlayfs
//! checks a caller against the overlay inode (the image's mode and owner)
//! and reaches the layers below, the 0700 directories included, with the
//! credentials of whoever mounted it (root); with `--userns auto` the layers
//! are idmapped mounts, through which host root keeps its capabilities
//! because the store's owner (0) maps to the container's root.
//!
//! # When modes are fixed
//!
//! - New directories are made 0700 ([`create_private_dir`]).
//! - A store made by an older cairn (0755 directories) is narrowed on the
//!   next write: [`Store::make_private`], run when a `Store` first stages a
//!   file (import, pull, `mkfs --store`, tag) and by `cairn run`; one
//!   `stat` per directory, a `chmod` only where one is wider.
//! - [`Store::fsck`] reports each directory that lets others in
//!   ([`Problem::WideDirectory`](crate::Problem::WideDirectory)), and a
//!   repair narrows it.
//!
//! Opening a store to read it changes nothing, so that `cairn fsck` still
//! sees (and reports) a store whose directories are wider.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::{Store, StoreError};

/// Mode of the store's directories (and of a container run root).
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// Mode of the files the store writes, objects excepted.
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// The directories below the root that must be private, besides the root:
/// the layout every store has, and what `cairn run` keeps in the store
/// (container data, on-demand listeners) and `cairn mount --lazy` (its
/// servers' mountpoints and logs) once made.
pub const PRIVATE_DIRS: [&str; 8] = [
    "objects",
    "images",
    "layers",
    "refs",
    "tmp",
    "containers",
    "listeners",
    "lazy",
];

/// The mode bits that let anyone but the owner in.
const OTHERS: u32 = 0o077;

/// The permission bits of `dir` (followed if a symlink) when they let
/// anyone but its owner in; `None` when they do not, or `dir` is missing.
pub fn wide_mode(dir: &Path) -> io::Result<Option<u32>> {
    match fs::metadata(dir) {
        Ok(m) if m.mode() & OTHERS != 0 => Ok(Some(m.mode() & 0o7777)),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Sets `dir` to mode 0700 if its mode lets anyone but its owner in;
/// returns the mode it had when it changed it. One `stat`; a missing `dir`
/// is left alone.
pub fn make_dir_private(dir: &Path) -> io::Result<Option<u32>> {
    let Some(mode) = wide_mode(dir)? else {
        return Ok(None);
    };
    fs::set_permissions(dir, fs::Permissions::from_mode(PRIVATE_DIR_MODE))?;
    Ok(Some(mode))
}

/// Makes `dir` a private directory, in one `stat` when it is one already:
/// creates it (mode 0700, missing parents with the usual mode) if it is
/// missing, narrows it to 0700 if it lets others in. Returns the mode it
/// had when it narrowed it.
pub fn ensure_private_dir(dir: &Path) -> io::Result<Option<u32>> {
    match fs::metadata(dir) {
        Ok(m) if m.mode() & OTHERS != 0 => {
            fs::set_permissions(dir, fs::Permissions::from_mode(PRIVATE_DIR_MODE))?;
            Ok(Some(m.mode() & 0o7777))
        }
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            create_private_dir(dir, true).map(|()| None)
        }
        Err(e) => Err(e),
    }
}

/// Creates `dir` with mode 0700 (whatever the umask) if it is missing; with
/// `parents`, also its missing parents, with the usual mode (only `dir`
/// itself is private). An existing `dir` is left as it is.
pub fn create_private_dir(dir: &Path, parents: bool) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if parents {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent)?;
        }
    }
    match fs::DirBuilder::new().mode(PRIVATE_DIR_MODE).create(dir) {
        // An odd umask (say 0277) could take the owner's own bits.
        Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(PRIVATE_DIR_MODE)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

impl Store {
    /// The directories that must be private: the root, then
    /// [`PRIVATE_DIRS`] below it (whether or not they exist).
    pub fn private_dirs(&self) -> Vec<PathBuf> {
        std::iter::once(self.root.clone())
            .chain(PRIVATE_DIRS.iter().map(|d| self.root.join(d)))
            .collect()
    }

    /// Narrows the root and the directories below it that are wider than
    /// 0700 (see the module docs). Returns each directory changed with the
    /// mode it had. Costs one `stat` per directory when nothing is wider.
    pub fn make_private(&self) -> Result<Vec<(PathBuf, u32)>, StoreError> {
        let mut changed = Vec::new();
        for dir in self.private_dirs() {
            match make_dir_private(&dir) {
                Ok(Some(mode)) => changed.push((dir, mode)),
                Ok(None) => {}
                Err(e) => return Err(StoreError::io("making private", &dir, &self.root, e)),
            }
        }
        Ok(changed)
    }

    /// [`make_private`](Self::make_private) on the way to a write: a store
    /// that cannot be narrowed (not ours, a read-only filesystem) is worth
    /// a warning, not a failed write (`cairn fsck` reports it).
    pub fn make_private_or_warn(&self) {
        match self.make_private() {
            Ok(changed) => {
                for (dir, mode) in changed {
                    tracing::info!(
                        "{}: mode {mode:04o} let other users in; now {PRIVATE_DIR_MODE:04o}",
                        dir.display()
                    );
                }
            }
            Err(e) => tracing::warn!("the store is not private: {e}"),
        }
    }
}
