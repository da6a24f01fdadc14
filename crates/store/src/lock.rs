//! The store lock: `flock(2)` on `<root>/lock`, shared or exclusive.
//!
//! This module owns the lock file and the guard. Imports take it shared
//! (readers and writers of objects do not block each other); whatever must
//! see a still store (garbage collection, fsck repairs) takes it exclusive.
//! It must never be used for the per-writer staging locks (`tmp.rs`), and
//! it never writes to the lock file: its content means nothing.
//!
//! Each call opens the file anew, so two guards in one process conflict
//! exactly as they would in two processes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;
use rustix::io::Errno;

use crate::tmp::flock_retry;
use crate::{Store, StoreError};

/// Which way a [`StoreLock`] is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    Shared,
    Exclusive,
}

/// A held store lock; dropping it releases the lock.
#[derive(Debug)]
pub struct StoreLock {
    _file: File,
    kind: LockKind,
}

impl StoreLock {
    pub fn kind(&self) -> LockKind {
        self.kind
    }
}

impl Store {
    /// `<root>/lock`.
    pub fn lock_path(&self) -> PathBuf {
        self.root.join("lock")
    }

    fn open_lock_file(&self) -> Result<File, StoreError> {
        let path = self.lock_path();
        let open = |create| {
            OpenOptions::new()
                .read(true)
                .write(create)
                .create(create)
                .mode(crate::PRIVATE_FILE_MODE)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(&path)
        };
        // Read-only first, so users who may read the store can lock it
        // shared; create it only if some older store lacks it.
        match open(false) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => open(true),
            r => r,
        }
        .map_err(|e| StoreError::io("opening lock file", &path, &self.root, e))
    }

    fn lock(&self, kind: LockKind, wait: bool) -> Result<Option<StoreLock>, StoreError> {
        let file = self.open_lock_file()?;
        let op = match (kind, wait) {
            (LockKind::Shared, true) => FlockOperation::LockShared,
            (LockKind::Exclusive, true) => FlockOperation::LockExclusive,
            (LockKind::Shared, false) => FlockOperation::NonBlockingLockShared,
            (LockKind::Exclusive, false) => FlockOperation::NonBlockingLockExclusive,
        };
        match flock_retry(&file, op) {
            Ok(()) => Ok(Some(StoreLock { _file: file, kind })),
            Err(e) if !wait && e.raw_os_error() == Some(Errno::WOULDBLOCK.raw_os_error()) => {
                Ok(None)
            }
            Err(e) => Err(StoreError::io("locking", &self.lock_path(), &self.root, e)),
        }
    }

    /// Takes the store lock shared, waiting for any exclusive holder.
    pub fn lock_shared(&self) -> Result<StoreLock, StoreError> {
        self.lock(LockKind::Shared, true)
            .map(|l| l.expect("blocking lock returns a guard"))
    }

    /// Takes the store lock exclusive, waiting for every other holder.
    pub fn lock_exclusive(&self) -> Result<StoreLock, StoreError> {
        self.lock(LockKind::Exclusive, true)
            .map(|l| l.expect("blocking lock returns a guard"))
    }

    /// Takes the store lock shared if no one holds it exclusive; `None`
    /// otherwise.
    pub fn try_lock_shared(&self) -> Result<Option<StoreLock>, StoreError> {
        self.lock(LockKind::Shared, false)
    }

    /// Takes the store lock exclusive if no one holds it at all; `None`
    /// otherwise.
    pub fn try_lock_exclusive(&self) -> Result<Option<StoreLock>, StoreError> {
        self.lock(LockKind::Exclusive, false)
    }
}

/// Test hook, not part of the API: the process ids of every task blocked in
/// `flock(2)` waiting for the file at `path`, as `/proc/locks` lists them
/// (a `->` line under the holder; the file is matched by inode number).
///
/// Lets a test wait until a contender really is waiting for a lock, instead
/// of sleeping and assuming it is: the kernel adds the line when the task
/// blocks and removes it when the task gets the lock or gives up. Empty if
/// the file or `/proc/locks` cannot be read.
#[doc(hidden)]
pub fn flock_waiters(path: &Path) -> Vec<u32> {
    let Ok(inode) = std::fs::metadata(path).map(|m| m.ino()) else {
        return Vec::new();
    };
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    // `1: -> FLOCK  ADVISORY  WRITE <pid> <maj>:<min>:<inode> 0 EOF`
    locks
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace().skip(1);
            if fields.next() != Some("->") || fields.next() != Some("FLOCK") {
                return None;
            }
            let pid = fields.nth(2)?.parse().ok()?;
            let ino = fields.next()?.rsplit(':').next()?.parse::<u64>().ok()?;
            (ino == inode).then_some(pid)
        })
        .collect()
}
