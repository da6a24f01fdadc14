//! Objects: importing file contents into `objects/ab/cdef…`, finding and
//! listing them.
//!
//! This module owns the publication of objects: hash, stage under `tmp/`,
//! fsync, make read-only, seal with fs-verity where the kernel can, then
//! `rename(2)` without replacing. It must never modify or remove an object
//! once published, and never publish a file whose content does not match
//! its name. Only two places remove objects: garbage collection (`gc.rs`,
//! unreachable ones) and `fsck --repair` (`fsck.rs`, corrupt ones), both
//! through `Store::remove_entry`.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::io::Errno;

use crate::kernel;
use crate::tmp::{sync_dir, Persisted, TmpFile};
use crate::verity::{FsVerityHasher, ObjectId};
use crate::{Store, StoreError};

/// Read size for hashing and plain copies.
const CHUNK: usize = 256 * 1024;

impl Store {
    /// `<root>/objects`.
    pub fn objects_dir(&self) -> PathBuf {
        self.root.join("objects")
    }

    /// `<root>/objects/ab/cdef…`.
    pub fn object_path(&self, id: &ObjectId) -> PathBuf {
        self.objects_dir().join(id.object_path())
    }

    /// Whether the object may be in the store: false, without a system
    /// call, when its fan-out directory was missing when this Store last
    /// looked (see [`Fanouts`]); otherwise [`has_object`](Self::has_object).
    pub(crate) fn may_have_object(&self, id: &ObjectId) -> bool {
        self.fanouts().has(id.0[0]) && self.has_object(id)
    }

    /// The fan-out directories seen so far, read from `objects/` the first
    /// time.
    pub(crate) fn fanouts(&self) -> &Fanouts {
        self.fanouts.get_or_init(|| {
            let f = Fanouts::default();
            match fs::read_dir(self.objects_dir()) {
                Ok(entries) => {
                    for e in entries.flatten() {
                        let name = e.file_name();
                        let name = name.to_str().unwrap_or("");
                        if name.len() == 2 && is_lower_hex(name) {
                            if let Ok(b) = u8::from_str_radix(name, 16) {
                                f.set(b);
                            }
                        }
                    }
                }
                // Unreadable: assume every one is there (and look each
                // object up).
                Err(_) => (0..=255).for_each(|b| f.set(b)),
            }
            f
        })
    }

    /// Whether the object is in the store (as a regular file).
    pub fn has_object(&self, id: &ObjectId) -> bool {
        fs::symlink_metadata(self.object_path(id))
            .map(|m| m.is_file())
            .unwrap_or(false)
    }

    /// [`has_object`](Self::has_object) for many objects: each looked up
    /// from its fan-out directory's descriptor (opened once), not by a
    /// path walked from `/` each time.
    pub fn object_lookup(&self) -> ObjectLookup<'_> {
        ObjectLookup {
            store: self,
            dirs: (0..256).map(|_| None).collect(),
        }
    }

    /// Imports `data`. If the object exists already nothing is written.
    pub fn import_bytes(&self, data: &[u8]) -> Result<ObjectId, StoreError> {
        let mut hasher = FsVerityHasher::new();
        hasher.update(data);
        let id = hasher.finalize();
        if self.has_object(&id) {
            return Ok(id);
        }
        let tmp = self.staging()?.tmp_file("o")?;
        tmp.file()
            .write_all(data)
            .map_err(|e| tmp.err("writing object", e))?;
        self.publish_object(tmp, &id)?;
        Ok(id)
    }

    /// Streams `r` into a staged file while hashing it (one pass), then
    /// publishes it. Returns the digest and the number of bytes read. If
    /// reading fails, nothing is published and the staged file is removed.
    pub fn import_reader(&self, mut r: impl Read) -> Result<(ObjectId, u64), StoreError> {
        let tmp = self.staging()?.tmp_file("o")?;
        let mut hasher = FsVerityHasher::new();
        let mut buf = vec![0u8; CHUNK];
        let mut out = tmp.file();
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    return Err(StoreError::Source {
                        op: "reading",
                        what: "the data being imported".into(),
                        error,
                    })
                }
            };
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| tmp.err("writing object", e))?;
        }
        let size = hasher.len();
        let id = hasher.finalize();
        if self.has_object(&id) {
            return Ok((id, size));
        }
        self.publish_object(tmp, &id)?;
        Ok((id, size))
    }

    /// Imports the contents of `src` (read from offset 0, whatever its file
    /// position). Hashes first, so a file already in the store costs one
    /// read and no write; otherwise clones it into staging (`FICLONE`, where
    /// source and store share a filesystem that can), else copies it
    /// (`copy_file_range`, else read/write). A source that changes while
    /// this runs is an error ([`StoreError::SourceChanged`]), never a
    /// mislabelled object. Non-regular files (pipes) are streamed.
    pub fn import_file(&self, src: &File) -> Result<ObjectId, StoreError> {
        let meta = src.metadata().map_err(|error| StoreError::Source {
            op: "reading",
            what: describe_fd(src),
            error,
        })?;
        if !meta.is_file() {
            return self.import_reader(src).map(|(id, _)| id);
        }
        let (id, size, before) = self.hash_file(src)?;
        if self.has_object(&id) {
            return Ok(id);
        }
        let tmp = self.stage_copy(src, &before, size)?;
        self.publish_object(tmp, &id)?;
        Ok(id)
    }

    /// Copies `src` (already hashed to `id`, `size` bytes) into staging and
    /// checks it did not change meanwhile.
    fn stage_copy(
        &self,
        src: &File,
        before: &fs::Metadata,
        size: u64,
    ) -> Result<TmpFile, StoreError> {
        let src_err = |error| StoreError::Source {
            op: "reading",
            what: describe_fd(src),
            error,
        };
        let changed = || StoreError::SourceChanged {
            what: describe_fd(src),
            root: self.root.clone(),
        };
        let tmp = self.staging()?.tmp_file("o")?;
        match copy_contents(src, tmp.file(), size) {
            Ok(()) => {}
            Err(CopyError::Short) => return Err(changed()),
            Err(CopyError::Read(e)) => return Err(src_err(e)),
            Err(CopyError::Write(e)) => return Err(tmp.err("writing object", e)),
        }
        let after = src.metadata().map_err(src_err)?;
        if !same_version(before, &after) {
            return Err(changed());
        }
        Ok(tmp)
    }

    /// Hashes a regular file from offset 0; returns its digest, size and the
    /// metadata seen before reading (to detect changes while copying).
    fn hash_file(&self, src: &File) -> Result<(ObjectId, u64, fs::Metadata), StoreError> {
        let src_err = |error| StoreError::Source {
            op: "reading",
            what: describe_fd(src),
            error,
        };
        let before = src.metadata().map_err(src_err)?;
        let mut hasher = FsVerityHasher::new();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match src.read_at(&mut buf, hasher.len()) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(src_err(e)),
            };
            hasher.update(&buf[..n]);
        }
        let size = hasher.len();
        if size != before.len() {
            return Err(StoreError::SourceChanged {
                what: describe_fd(src),
                root: self.root.clone(),
            });
        }
        Ok((hasher.finalize(), size, before))
    }

    /// Starts a batch of imports that become visible together at
    /// [`ObjectBatch::commit`], with one filesystem sync for the whole batch
    /// instead of one per object (importing a tree of 80k files).
    pub fn object_batch(&self) -> ObjectBatch<'_> {
        ObjectBatch {
            store: self,
            staged: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// Makes a fully written staged file the object `id`.
    fn publish_object(&self, mut tmp: TmpFile, id: &ObjectId) -> Result<(), StoreError> {
        tmp.file()
            .set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(|e| tmp.err("setting mode of object", e))?;
        tmp.file()
            .sync_all()
            .map_err(|e| tmp.err("syncing object", e))?;
        // fs-verity wants no writable descriptor open.
        tmp.close();
        self.persist_object(tmp, id, true)
    }

    /// Enables fs-verity on a staged object before it is published.
    pub(crate) fn enable_verity(&self, tmp: &TmpFile) -> Result<(), StoreError> {
        kernel::enable_on_path(tmp.path()).map_err(|error| StoreError::Verity {
            path: tmp
                .path()
                .strip_prefix(&self.root)
                .unwrap_or(tmp.path())
                .into(),
            root: self.root.clone(),
            error,
        })
    }

    /// Seals (where the kernel can) and renames a closed, durable staged file
    /// into place; `sync_fanout` makes the new name durable at once.
    fn persist_object(
        &self,
        tmp: TmpFile,
        id: &ObjectId,
        sync_fanout: bool,
    ) -> Result<(), StoreError> {
        if self.verity_supported() {
            self.enable_verity(&tmp)?;
        }
        let dest = self.object_path(id);
        let fanout = dest
            .parent()
            .expect("object paths have a fan-out directory");
        self.ensure_fanout_dir(fanout)?;
        if let Some(f) = self.fanouts.get() {
            f.set(id.0[0]);
        }
        if tmp.persist(&dest, false)? == Persisted::Created && sync_fanout {
            sync_dir(fanout, &self.root)?;
        }
        Ok(())
    }

    /// Creates `objects/ab/` if missing (0755 whatever the umask), and
    /// makes its entry in `objects/` durable.
    fn ensure_fanout_dir(&self, dir: &Path) -> Result<(), StoreError> {
        match fs::DirBuilder::new().mode(0o755).create(dir) {
            Ok(()) => {
                fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
                    .map_err(|e| StoreError::io("setting mode of", dir, &self.root, e))?;
                sync_dir(&self.objects_dir(), &self.root)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(StoreError::io("creating", dir, &self.root, e)),
        }
    }

    /// Every object in the store, in no particular order. Names under
    /// `objects/` that are not object paths are skipped.
    pub fn list_objects(&self) -> Result<Objects, StoreError> {
        let dir = self.objects_dir();
        let outer =
            fs::read_dir(&dir).map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
        Ok(Objects {
            root: self.root.clone(),
            outer,
            inner: None,
        })
    }
}

/// Which of the 256 fan-out directories `objects/ab/` exist, as far as
/// one [`Store`] knows: a bit set is a directory seen or made; a bit clear
/// one that was missing when last looked at (another process may have made
/// it since, which is harmless: see `Store::fanouts`).
#[derive(Debug, Default)]
pub(crate) struct Fanouts([std::sync::atomic::AtomicU64; 4]);

impl Fanouts {
    pub(crate) fn has(&self, b: u8) -> bool {
        self.0[(b >> 6) as usize].load(std::sync::atomic::Ordering::Relaxed) & (1 << (b & 63)) != 0
    }

    pub(crate) fn set(&self, b: u8) {
        self.0[(b >> 6) as usize].fetch_or(1 << (b & 63), std::sync::atomic::Ordering::Relaxed);
    }
}

/// Iterator over the objects of a store; see [`Store::list_objects`].
#[derive(Debug)]
pub struct Objects {
    root: PathBuf,
    outer: fs::ReadDir,
    /// The fan-out directory being read, with its two hex digits.
    inner: Option<(String, PathBuf, fs::ReadDir)>,
}

impl Iterator for Objects {
    type Item = Result<ObjectId, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((prefix, path, inner)) = &mut self.inner {
                match inner.next() {
                    Some(Ok(entry)) => {
                        let name = entry.file_name();
                        let Some(rest) = name.to_str() else { continue };
                        if rest.len() != 62 || !is_lower_hex(rest) {
                            continue;
                        }
                        match ObjectId::from_hex(&format!("{prefix}{rest}")) {
                            Ok(id) => return Some(Ok(id)),
                            Err(_) => continue,
                        }
                    }
                    Some(Err(e)) => {
                        return Some(Err(StoreError::io("listing", path, &self.root, e)));
                    }
                    None => self.inner = None,
                }
                continue;
            }
            let entry = match self.outer.next()? {
                Ok(entry) => entry,
                Err(e) => {
                    let dir = self.root.join("objects");
                    return Some(Err(StoreError::io("listing", &dir, &self.root, e)));
                }
            };
            let name = entry.file_name();
            let Some(prefix) = name.to_str() else {
                continue;
            };
            if prefix.len() != 2 || !is_lower_hex(prefix) {
                continue;
            }
            let path = entry.path();
            match fs::read_dir(&path) {
                Ok(inner) => self.inner = Some((prefix.to_owned(), path, inner)),
                Err(e) if e.kind() == io::ErrorKind::NotADirectory => continue,
                Err(e) => return Some(Err(StoreError::io("listing", &path, &self.root, e))),
            }
        }
    }
}

pub(crate) fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// What the source file is, for messages: its path if /proc knows it.
fn describe_fd(f: &File) -> String {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    match fs::read_link(format!("/proc/self/fd/{fd}")) {
        Ok(p) => p.display().to_string(),
        Err(_) => format!("file descriptor {fd}"),
    }
}

/// Whether two `stat`s of one file show the same inode, size and times, i.e.
/// nobody wrote to it in between.
fn same_version(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    a.dev() == b.dev()
        && a.ino() == b.ino()
        && a.len() == b.len()
        && a.mtime() == b.mtime()
        && a.mtime_nsec() == b.mtime_nsec()
        && a.ctime() == b.ctime()
        && a.ctime_nsec() == b.ctime_nsec()
}

pub(crate) enum CopyError {
    /// The source ended before `len` bytes.
    Short,
    Read(io::Error),
    Write(io::Error),
}

/// Copies the first `len` bytes of `src` into the empty file `dst`, sharing
/// extents where the filesystem can. Offsets are explicit, so neither
/// file's position matters.
pub(crate) fn copy_contents(src: &File, dst: &File, len: u64) -> Result<(), CopyError> {
    if len == 0 {
        return Ok(());
    }
    // FICLONE clones the whole file; a source that grew since it was hashed
    // is caught by the caller's before/after stat comparison.
    if rustix::fs::ioctl_ficlone(dst, src).is_ok() {
        return Ok(());
    }
    let mut off_in = 0u64;
    let mut off_out = 0u64;
    while off_in < len {
        let want = usize::try_from(len - off_in)
            .unwrap_or(usize::MAX)
            .min(1 << 30);
        match rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), want) {
            Ok(0) => return Err(CopyError::Short),
            Ok(_) => {}
            Err(Errno::INTR) => {}
            // Not across these filesystems, or not at all: plain copy of
            // what is left (the offsets say how far we got).
            Err(Errno::XDEV | Errno::NOSYS | Errno::OPNOTSUPP | Errno::INVAL) => {
                return copy_by_reading(src, dst, off_in, len);
            }
            // copy_file_range does not say which side failed; a full disk or
            // a quota is on ours, anything else could be either.
            Err(e @ (Errno::NOSPC | Errno::DQUOT | Errno::FBIG)) => {
                return Err(CopyError::Write(e.into()))
            }
            Err(e) => return Err(CopyError::Read(e.into())),
        }
    }
    Ok(())
}

fn copy_by_reading(src: &File, dst: &File, mut off: u64, len: u64) -> Result<(), CopyError> {
    let mut buf = vec![0u8; CHUNK];
    while off < len {
        let want = usize::try_from(len - off).unwrap_or(usize::MAX).min(CHUNK);
        let n = match src.read_at(&mut buf[..want], off) {
            Ok(0) => return Err(CopyError::Short),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CopyError::Read(e)),
        };
        dst.write_all_at(&buf[..n], off).map_err(CopyError::Write)?;
        off += n as u64;
    }
    Ok(())
}

/// Whether `dir`, the fan-out directory of `id`, holds the object (as a
/// regular file): one lookup of one name, no path walked from `/`.
pub(crate) fn object_in(dir: &File, id: &ObjectId) -> bool {
    use rustix::fs::{statat, AtFlags, FileType};
    let hex = id.to_hex();
    statat(dir, &hex[2..], AtFlags::SYMLINK_NOFOLLOW)
        .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile)
        .unwrap_or(false)
}

/// Looks objects up: see [`Store::object_lookup`].
pub struct ObjectLookup<'s> {
    store: &'s Store,
    /// Each fan-out directory once opened: `Some(None)` when it is missing.
    dirs: Vec<Option<Option<File>>>,
}

impl ObjectLookup<'_> {
    /// Whether the object is in the store (as a regular file).
    pub fn has(&mut self, id: &ObjectId) -> bool {
        let b = id.0[0];
        let dir = self.dirs[b as usize].get_or_insert_with(|| {
            File::open(self.store.objects_dir().join(format!("{b:02x}"))).ok()
        });
        let Some(dir) = dir else {
            return false;
        };
        object_in(dir, id)
    }

    /// The first of `ids` (in fan-out order) that is not in the store, if
    /// any. Many ids in one fan-out directory are checked against one
    /// listing of it rather than a lookup each: a fresh Linux-tree image
    /// names 78,600 objects, ~300 per directory, and 78,600 `statat`s
    /// took 0.4-1.9 s where reading the 256 directories takes a few
    /// hundredths. A directory is listed only when the ids to check are at
    /// least a sixteenth of its (estimated) entries, so that a few ids in a
    /// large store still cost a lookup each.
    pub fn first_missing(&mut self, ids: &[ObjectId]) -> Option<ObjectId> {
        self.first_missing_by(ids, None)
    }

    /// [`first_missing`](Self::first_missing), listing every directory
    /// (`Some(true)`), looking every id up (`Some(false)`) or choosing.
    pub(crate) fn first_missing_by(
        &mut self,
        ids: &[ObjectId],
        listing: Option<bool>,
    ) -> Option<ObjectId> {
        let mut ids = ids.to_vec();
        ids.sort_unstable_by_key(|id| id.0);
        ids.dedup();
        for group in ids.chunk_by(|a, b| a.0[0] == b.0[0]) {
            if let Some(missing) = self.first_missing_in_fanout(group, listing) {
                return Some(missing);
            }
        }
        None
    }

    /// [`first_missing_by`](Self::first_missing_by) for ids of one fan-out.
    fn first_missing_in_fanout(
        &mut self,
        group: &[ObjectId],
        listing: Option<bool>,
    ) -> Option<ObjectId> {
        let b = group[0].0[0];
        let path = self.store.objects_dir().join(format!("{b:02x}"));
        let listing = listing.unwrap_or_else(|| {
            let estimate = fs::symlink_metadata(&path).map_or(0, |m| entries_estimate(m.len()));
            listing_pays(group.len() as u64, estimate)
        });
        if !listing {
            return group.iter().find(|id| !self.has(id)).copied();
        }
        let Some(FanoutListing { regular, unknown }) = list_fanout(&path) else {
            // Missing, or a listing that failed part-way: look up.
            return group.iter().find(|id| !self.has(id)).copied();
        };
        for id in group {
            let tail = fanout_tail(id);
            if regular.binary_search(&tail).is_ok() {
                continue;
            }
            if unknown.binary_search(&tail).is_ok() && self.has(id) {
                continue;
            }
            return Some(*id);
        }
        None
    }
}

/// The names of one fan-out directory, as the 31 bytes each stands for,
/// sorted: regular files, and entries whose type the listing did not give
/// (`d_type` unknown: a lookup decides those).
pub(crate) struct FanoutListing {
    pub(crate) regular: Vec<[u8; 31]>,
    pub(crate) unknown: Vec<[u8; 31]>,
}

/// Lists the fan-out directory at `path`; `None` if it cannot be read or
/// the listing fails part-way (which proves nothing either way). Names
/// that are not 62 hex digits are left out.
pub(crate) fn list_fanout(path: &Path) -> Option<FanoutListing> {
    let mut regular: Vec<[u8; 31]> = Vec::new();
    let mut unknown: Vec<[u8; 31]> = Vec::new();
    for entry in fs::read_dir(path).ok()? {
        let entry = entry.ok()?;
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(hex_tail) else {
            continue;
        };
        // From d_type, without a stat (std looks with lstat where the
        // filesystem leaves d_type unknown); if that fails, the lookup
        // decides.
        match entry.file_type() {
            Ok(t) if t.is_file() => regular.push(rest),
            Ok(_) => {}
            Err(_) => unknown.push(rest),
        }
    }
    // Sorted and searched: no hashing of every name of the store.
    regular.sort_unstable();
    unknown.sort_unstable();
    Some(FanoutListing { regular, unknown })
}

/// The entries a fan-out directory of `size` bytes holds, roughly: an ext4
/// entry with a 62-character name takes 72 bytes, and blocks are rarely
/// full, so this overestimates a little.
pub(crate) fn entries_estimate(size: u64) -> u64 {
    size / 64
}

/// Whether listing a directory of `entries` (estimated) pays for `lookups`
/// names looked up in it: when they are at least a sixteenth of them.
pub(crate) fn listing_pays(lookups: u64, entries: u64) -> bool {
    lookups.saturating_mul(16) >= entries
}

/// The last 31 bytes of `id`: its name within its fan-out directory.
pub(crate) fn fanout_tail(id: &ObjectId) -> [u8; 31] {
    let mut tail = [0u8; 31];
    tail.copy_from_slice(&id.0[1..]);
    tail
}

/// The 31 bytes a fan-out entry's name (62 lowercase hex digits) stands for.
fn hex_tail(name: &str) -> Option<[u8; 31]> {
    if name.len() != 62 || !name.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; 31];
    hex::decode_to_slice(name, &mut out).ok()?;
    Some(out)
}

/// Imports that become visible together (see [`Store::object_batch`]).
///
/// Each import is hashed and copied into staging at once, but nothing is
/// synced or renamed until [`commit`](Self::commit): then one `syncfs(2)`
/// makes every staged file durable, each is renamed into `objects/`, and
/// each touched fan-out directory is synced once. An object is thus still
/// complete before its name appears. Dropping the batch without committing
/// removes what it staged. Safe to use from several threads.
pub struct ObjectBatch<'s> {
    store: &'s Store,
    staged: std::sync::Mutex<std::collections::HashMap<ObjectId, TmpFile>>,
}

impl ObjectBatch<'_> {
    /// Like [`Store::import_file`], but published at [`commit`](Self::commit).
    pub fn import_file(&self, src: &File) -> Result<ObjectId, StoreError> {
        let meta = src.metadata().map_err(|error| StoreError::Source {
            op: "reading",
            what: describe_fd(src),
            error,
        })?;
        if !meta.is_file() {
            return self.store.import_reader(src).map(|(id, _)| id);
        }
        let (id, size, before) = self.store.hash_file(src)?;
        if self.store.has_object(&id) || self.is_staged(&id) {
            return Ok(id);
        }
        let mut tmp = self.store.stage_copy(src, &before, size)?;
        tmp.file()
            .set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(|e| tmp.err("setting mode of object", e))?;
        // Close now: a batch may stage more files than a process may hold open.
        tmp.close();
        self.staged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_insert(tmp);
        Ok(id)
    }

    fn is_staged(&self, id: &ObjectId) -> bool {
        self.staged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
    }

    /// Number of objects waiting for [`commit`](Self::commit).
    pub fn len(&self) -> usize {
        self.staged.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Syncs everything staged, then publishes it. Returns how many objects
    /// were new.
    pub fn commit(self) -> Result<usize, StoreError> {
        let staged = std::mem::take(&mut *self.staged.lock().unwrap_or_else(|p| p.into_inner()));
        if staged.is_empty() {
            return Ok(0);
        }
        self.store.publish_files(staged.into_iter().collect())
    }
}
