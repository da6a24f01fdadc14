//! Staging under `tmp/`: where every file of the store is written before it
//! becomes visible by `rename(2)`, and the removal of what crashed writers
//! left there.
//!
//! This module owns `tmp/` and nothing else. It must never remove anything
//! outside `tmp/`, and never anything a live writer is using.
//!
//! # How live staging is told from debris
//!
//! Each [`Store`](crate::Store) that writes makes one staging directory,
//! `tmp/s.<pid>.<nanos>.<n>/`, and holds an exclusive `flock(2)` on it for
//! as long as it lives; all its temporary files go inside. The kernel drops
//! the lock when the process dies, however it dies, so "unlocked" means
//! "nobody is writing here", with no pid reuse or clock to get wrong.
//!
//! [`clean_tmp`] tries a non-blocking exclusive lock on each entry of
//! `tmp/`; it removes an entry only while holding that lock, and only after
//! checking the name still leads to the inode it locked.
//!
//! The one race is a creator between `mkdir` and `flock`: a cleaner may lock
//! and remove the brand-new directory. So the creator, once it holds the
//! lock, checks that the path still leads to the directory it locked, and
//! starts again with a new name if not. Anything written afterwards happens
//! under the lock, so a cleaner can never take a directory in use.
//!
//! Locks are `flock(2)` locks, which conflict between open file
//! descriptions even inside one process, so two `Store`s in the same
//! process protect their staging from each other too.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{
    flock, renameat, renameat_with, statat, AtFlags, FlockOperation, RenameFlags, CWD,
};
use rustix::io::Errno;

use crate::StoreError;

/// Prefix of staging directory names.
const STAGING_PREFIX: &str = "s.";

/// Bounds the create-lock-check loop; losing it more than a few times in a
/// row means something other than a cleaner is removing our directories.
const MAX_CREATE_ATTEMPTS: usize = 16;

/// Sequence for staging directory names within this process.
static STAGING_SEQ: AtomicU64 = AtomicU64::new(0);

/// Takes a `flock` lock, retrying on `EINTR`.
pub(crate) fn flock_retry(f: &impl AsFd, op: FlockOperation) -> io::Result<()> {
    loop {
        match flock(f, op) {
            Err(Errno::INTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

/// Whether `path` (not followed if a symlink) is the very inode `file` is
/// open on.
fn still_names(path: &Path, file: &File) -> io::Result<bool> {
    let held = file.metadata()?;
    match fs::symlink_metadata(path) {
        Ok(now) => Ok(now.dev() == held.dev() && now.ino() == held.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Opens and fsyncs a directory, so that entries just created, renamed or
/// removed in it survive a crash.
pub(crate) fn sync_dir(dir: &Path, root: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("syncing directory", dir, root, e))
}

/// One process's locked staging directory.
#[derive(Debug)]
pub(crate) struct Staging {
    root: PathBuf,
    path: PathBuf,
    /// The directory, open and exclusively `flock`ed; closing it (on drop)
    /// releases the lock. Temporary files are created relative to it.
    dir: File,
    seq: AtomicU64,
    /// For a shard (see [`shard`](Self::shard)): the staging directory it
    /// is in, kept alive (and locked) for as long as the shard is.
    parent: Option<Arc<Staging>>,
}

impl Staging {
    /// Creates and locks a fresh staging directory under `root/tmp/`.
    pub(crate) fn create(root: &Path) -> Result<Arc<Staging>, StoreError> {
        let tmp = root.join("tmp");
        let mut last_err = None;
        for _ in 0..MAX_CREATE_ATTEMPTS {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let name = format!(
                "{STAGING_PREFIX}{}.{nanos:x}.{}",
                std::process::id(),
                STAGING_SEQ.fetch_add(1, Ordering::Relaxed)
            );
            let path = tmp.join(&name);
            match fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(StoreError::io("creating staging directory", &path, root, e)),
            }
            let lock = match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io("opening staging directory", &path, root, e)),
            };
            match flock_retry(&lock, FlockOperation::LockExclusive) {
                Ok(()) => {}
                // A filesystem that cannot flock a directory (NFS maps flock
                // to fcntl locks, which want a writable descriptor): go on
                // unlocked. Cleaners cannot lock it either, so they leave it
                // alone; the cost is that a crash leaves debris for good.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EBADF | libc::ENOLCK | libc::EOPNOTSUPP)
                    ) => {}
                Err(e) => return Err(StoreError::io("locking staging directory", &path, root, e)),
            }
            match still_names(&path, &lock) {
                Ok(true) => {
                    return Ok(Arc::new(Staging {
                        root: root.to_path_buf(),
                        path,
                        dir: lock,
                        seq: AtomicU64::new(0),
                        parent: None,
                    }))
                }
                // A cleaner took it between mkdir and flock: try a new name.
                Ok(false) => last_err = Some(io::Error::from(io::ErrorKind::NotFound)),
                Err(e) => return Err(StoreError::io("checking staging directory", &path, root, e)),
            }
        }
        Err(StoreError::io(
            "creating staging directory",
            &tmp,
            root,
            last_err.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)),
        ))
    }

    /// A new subdirectory of this staging directory, to stage files in
    /// apart from other threads: creating a file locks its directory, so
    /// threads that each create thousands of files do better in
    /// directories of their own. The parent's lock covers it (a cleaner
    /// removes the parent whole, and only unlocked); it is removed when
    /// the last of its files is gone.
    pub(crate) fn shard(self: &Arc<Self>) -> Result<Arc<Staging>, StoreError> {
        use rustix::fs::{mkdirat, openat, Mode, OFlags};
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let name = format!("d.{n}");
        let path = self.path.join(&name);
        let err = |op, e: Errno| StoreError::io(op, &path, &self.root, e.into());
        mkdirat(&self.dir, &name, Mode::from_raw_mode(0o700))
            .map_err(|e| err("creating staging directory", e))?;
        let dir = openat(
            &self.dir,
            &name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| err("opening staging directory", e))?;
        Ok(Arc::new(Staging {
            root: self.root.clone(),
            path,
            dir: File::from(dir),
            seq: AtomicU64::new(0),
            parent: Some(Arc::clone(self)),
        }))
    }

    /// The directory itself, open.
    pub(crate) fn dir(&self) -> &File {
        &self.dir
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Creates a new private (0600) temporary file, open read-write, named
    /// `<kind>.<n>` in this staging directory. It is removed on drop unless
    /// persisted.
    pub(crate) fn tmp_file(self: &Arc<Self>, kind: &str) -> Result<TmpFile, StoreError> {
        self.tmp_file_mode(kind, 0o600)
    }

    /// [`tmp_file`](Self::tmp_file) created with `mode` (less the umask).
    /// The staging directory is 0700, so nobody else reaches the file
    /// whatever its mode.
    ///
    /// One `openat(2)` relative to the staging directory's descriptor:
    /// no path walk from `/`, and no `fcntl(FD_CLOEXEC)` after it (which
    /// musl's `open` adds).
    pub(crate) fn tmp_file_mode(
        self: &Arc<Self>,
        kind: &str,
        mode: u32,
    ) -> Result<TmpFile, StoreError> {
        use rustix::fs::{openat, Mode, OFlags};
        loop {
            let n = self.seq.fetch_add(1, Ordering::Relaxed);
            let name = format!("{kind}.{n}");
            match openat(
                &self.dir,
                &name,
                OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::from_raw_mode(mode),
            ) {
                Ok(fd) => {
                    return Ok(TmpFile {
                        staging: Arc::clone(self),
                        path: self.path.join(name),
                        file: Some(File::from(fd)),
                        done: false,
                        anonymous: false,
                    })
                }
                // Left by an earlier Store of ours in this very directory
                // cannot happen (names are fresh), but never reuse a name.
                Err(Errno::EXIST) => continue,
                Err(e) => {
                    return Err(StoreError::io(
                        "creating temporary file",
                        &self.path.join(name),
                        &self.root,
                        e.into(),
                    ))
                }
            }
        }
    }
}

impl Staging {
    /// A new unnamed file (`O_TMPFILE`) on this staging directory's
    /// filesystem, open read-write, created with `mode` (less the umask).
    /// It has no name anywhere until [`TmpFile::link_at`] gives it one,
    /// and vanishes when closed unnamed, however the process ends. An
    /// error if the filesystem cannot make one (`EOPNOTSUPP`, `EISDIR` on
    /// kernels without `O_TMPFILE`): the caller falls back to
    /// [`tmp_file_mode`](Self::tmp_file_mode).
    pub(crate) fn anon_file(self: &Arc<Self>, mode: u32) -> Result<TmpFile, StoreError> {
        use rustix::fs::{openat, Mode, OFlags};
        let fd = openat(
            &self.dir,
            ".",
            OFlags::RDWR | OFlags::TMPFILE | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| {
            StoreError::io(
                "creating unnamed temporary file in",
                &self.path,
                &self.root,
                e.into(),
            )
        })?;
        Ok(TmpFile {
            staging: Arc::clone(self),
            path: self.path.join("(unnamed)"),
            file: Some(File::from(fd)),
            done: false,
            anonymous: true,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.parent.is_some() {
            // A shard: its files are gone (each held an Arc); a failure
            // leaves it to the parent's removal.
            let _ = fs::remove_dir(&self.path);
            return;
        }
        // Every TmpFile holds an Arc, so the directory is empty by now unless
        // something was leaked; the lock is still held (`self.dir` closes
        // after this body), so clearing it is safe. Failures leave debris
        // that a later clean_tmp removes.
        if fs::remove_dir(&self.path).is_err() {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// What [`TmpFile::persist`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Persisted {
    /// The file is now at the destination.
    Created,
    /// The destination already existed; the temporary file was dropped.
    AlreadyExisted,
}

/// A temporary file in a staging directory, removed on drop unless it was
/// persisted.
#[derive(Debug)]
pub(crate) struct TmpFile {
    staging: Arc<Staging>,
    path: PathBuf,
    file: Option<File>,
    done: bool,
    /// An `O_TMPFILE` file: no name to remove, and it must stay open
    /// until linked (closing it frees it).
    anonymous: bool,
}

impl TmpFile {
    /// Whether it is an unnamed (`O_TMPFILE`) file.
    pub(crate) fn is_anonymous(&self) -> bool {
        self.anonymous
    }

    /// Gives an unnamed file (see [`Staging::anon_file`]) the name `name`
    /// in the directory `dir` (`dest` is the same place as a path, for
    /// errors), never replacing an existing one: `linkat(fd, "", dir,
    /// name, AT_EMPTY_PATH)`, which needs `CAP_DAC_READ_SEARCH`; without
    /// it (`ENOENT`), through `/proc/self/fd`. A link takes the target
    /// directory's lock only, not the filesystem's rename lock.
    pub(crate) fn link_at(
        mut self,
        dir: impl AsFd,
        name: &Path,
        dest: &Path,
    ) -> Result<Persisted, StoreError> {
        use rustix::fs::linkat;
        use std::os::fd::AsRawFd;
        debug_assert!(self.anonymous, "link_at of a named file");
        let root = self.staging.root().to_path_buf();
        let link_err = |e: Errno| StoreError::io("linking into", dest, &root, e.into());
        let file = self.file();
        let r = match linkat(file, "", &dir, name, AtFlags::EMPTY_PATH) {
            Err(Errno::NOENT | Errno::PERM) => {
                let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
                linkat(CWD, proc_path.as_str(), &dir, name, AtFlags::SYMLINK_FOLLOW)
            }
            r => r,
        };
        match r {
            Ok(()) => {
                self.done = true;
                Ok(Persisted::Created)
            }
            Err(Errno::EXIST) => Ok(Persisted::AlreadyExisted),
            Err(e) => Err(link_err(e)),
        }
    }

    /// The open file. Panics if [`close`](Self::close) was called: that is a
    /// bug in this crate, not a runtime condition.
    pub(crate) fn file(&self) -> &File {
        self.file.as_ref().expect("temporary file used after close")
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Shorthand for an I/O error about this file.
    pub(crate) fn err(&self, op: &'static str, e: io::Error) -> StoreError {
        StoreError::io(op, &self.path, self.staging.root(), e)
    }

    /// Closes the descriptor (fs-verity refuses files with writers open);
    /// the file stays until persisted or dropped.
    pub(crate) fn close(&mut self) {
        debug_assert!(!self.anonymous, "closing an unnamed file frees it");
        self.file = None;
    }

    /// Moves the file to `dest`. With `replace == false` an existing `dest`
    /// is kept (it has the same name, so for content-addressed files the
    /// same content) and the temporary file is dropped.
    pub(crate) fn persist(self, dest: &Path, replace: bool) -> Result<Persisted, StoreError> {
        self.persist_at(CWD, dest, dest, replace)
    }

    /// [`persist`](Self::persist) to `name` relative to the directory `dir`
    /// (`dest` is the same place as a path, for errors): from the staging
    /// directory's descriptor to `dir`'s, with no path walked from `/`.
    pub(crate) fn persist_at(
        mut self,
        dir: impl AsFd,
        name: &Path,
        dest: &Path,
        replace: bool,
    ) -> Result<Persisted, StoreError> {
        if self.anonymous {
            debug_assert!(!replace, "unnamed files are only linked, never replace");
            return self.link_at(dir, name, dest);
        }
        let root = self.staging.root().to_path_buf();
        let rename_err = |e: io::Error| StoreError::io("renaming into", dest, &root, e);
        let from = self
            .path
            .file_name()
            .expect("temporary files have a name")
            .to_owned();
        let from_dir = &self.staging.dir;
        if replace {
            renameat(from_dir, &from, &dir, name).map_err(|e| rename_err(e.into()))?;
            self.done = true;
            return Ok(Persisted::Created);
        }
        match renameat_with(from_dir, &from, &dir, name, RenameFlags::NOREPLACE) {
            Ok(()) => {
                self.done = true;
                Ok(Persisted::Created)
            }
            Err(Errno::EXIST) => Ok(Persisted::AlreadyExisted),
            // The filesystem has no RENAME_NOREPLACE: look, then rename. A
            // writer racing us between the two renames identical content
            // over identical content, which is harmless.
            Err(Errno::INVAL | Errno::NOSYS | Errno::NOTSUP) => {
                match statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(_) => return Ok(Persisted::AlreadyExisted),
                    Err(Errno::NOENT) => {}
                    Err(e) => return Err(rename_err(e.into())),
                }
                renameat(from_dir, &from, &dir, name).map_err(|e| rename_err(e.into()))?;
                self.done = true;
                Ok(Persisted::Created)
            }
            Err(e) => Err(rename_err(e.into())),
        }
    }
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if !self.done && !self.anonymous {
            self.file = None;
            // Nothing to report to: a failure leaves debris for clean_tmp.
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Removes from `root/tmp/` every entry no live writer holds locked (see the
/// module docs), skipping `keep` (this process's own staging directory).
/// Returns how many entries were removed.
pub(crate) fn clean_tmp(root: &Path, keep: Option<&Path>) -> Result<usize, StoreError> {
    let tmp = root.join("tmp");
    let entries = match fs::read_dir(&tmp) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(StoreError::io("listing", &tmp, root, e)),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io("listing", &tmp, root, e))?;
        let path = entry.path();
        if Some(path.as_path()) == keep {
            continue;
        }
        if remove_if_unlocked(&path)
            .map_err(|e| StoreError::io("removing stale", &path, root, e))?
        {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Removes one entry of `tmp/` if nobody holds a lock on it.
fn remove_if_unlocked(path: &Path) -> io::Result<bool> {
    let file = match OpenOptions::new()
        .read(true)
        // O_NONBLOCK: never hang opening a FIFO someone left here.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        // A symlink (ELOOP with O_NOFOLLOW) or a socket (ENXIO): nothing of
        // ours, nothing anyone can lock; remove the name itself.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO)) => {
            return match fs::remove_file(path) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(e),
            };
        }
        Err(e) => return Err(e),
    };
    // Held by a live writer (EWOULDBLOCK), or the filesystem cannot lock
    // it (some NFS setups): either way nothing proves it stale, so keep it.
    if flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
        return Ok(false);
    }
    // Locked: nobody is writing here. Make sure the name still leads to what
    // we locked (a writer may have renamed its file out, and something else
    // may have taken the name) before removing it, still under the lock.
    if !still_names(path, &file)? {
        return Ok(false);
    }
    let result = if file.metadata()?.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    match result {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
