//! Checking the store: every object re-hashed against its name, every image
//! against its digest and parsed, every object an image or layer record
//! uses present and whole, every ref pointing at a sound image, and no
//! directory of the store (or of its run root) that lets other users in.
//! Every problem is reported, not just the first.
//!
//! Permissions are checked on the directories that make the store private
//! (the root and those directly below it, see `private`, plus what the
//! caller adds: `cairn fsck` adds the run root), not on each object: those
//! directories are the barrier, and an object's mode carries nothing of
//! the file it backs.
//!
//! With `repair`, what is broken is removed so that the next pull or import
//! fetches it again: corrupt objects; images whose bytes do not match their
//! name, cannot be read or use an object that is missing or corrupt; layer
//! records that cannot be read or hold such objects (otherwise the layer
//! cache would keep claiming the layer); refs that hold no digest or point
//! at an image that is missing or removed. The store invariant, "a ref
//! points only at images whose objects are all present", holds again
//! afterwards. Directories that let other users in are narrowed to 0700.
//!
//! An incomplete image (its record has `lazy`: pulled with `--lazy`,
//! objects still in a registry) is not broken for lacking objects: the
//! ones it has are checked as any other, the missing ones are expected,
//! and its lazy index must be whole (hash to what the record says).
//!
//! Locking: a check takes the store lock shared (imports may run; gc waits,
//! so nothing vanishes under the check); a repair takes it exclusive.
//! Nothing is removed before every check has run.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::graph::contents_of;
use crate::verity::{fsverity_digest, ObjectId};
use crate::{Store, StoreError};

/// What [`Store::fsck`] does.
#[derive(Debug, Clone, Copy, Default)]
pub struct FsckOptions<'a> {
    /// Remove what is broken (see the module docs).
    pub repair: bool,
    /// Threads re-hashing objects; 0 for one per CPU.
    pub threads: usize,
    /// Directories outside the store that must be private as well (a
    /// container run root); checked and repaired as the store's own.
    pub private_dirs: &'a [&'a Path],
}

/// One thing wrong with the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// A directory that must be private (mode 0700) lets other users in.
    WideDirectory { path: PathBuf, mode: u32 },
    /// The mode of a directory that must be private cannot be read.
    UncheckedDirectory { path: PathBuf, reason: String },
    /// The object's content does not hash to its name.
    CorruptObject { id: ObjectId, actual: ObjectId },
    /// The object cannot be read, or is not a regular file.
    UnreadableObject { id: ObjectId, reason: String },
    /// The image's bytes do not hash to its name.
    ImageDigestMismatch { digest: String, actual: String },
    /// The image cannot be read or parsed.
    UnreadableImage { digest: String, reason: String },
    /// The image record (OCI metadata) of an image cannot be read.
    CorruptImageRecord { digest: String, reason: String },
    /// A file of the image is backed by something that is not an object.
    BadPayload {
        image: String,
        path: String,
        payload: String,
    },
    /// A file of the image is backed by an object that is not in the store.
    MissingObject {
        image: String,
        path: String,
        object: ObjectId,
    },
    /// A file of the image is backed by an object that is corrupt.
    CorruptObjectUsed {
        image: String,
        path: String,
        object: ObjectId,
    },
    /// The image gives a file another size than its object has.
    ObjectSizeMismatch {
        image: String,
        path: String,
        object: ObjectId,
        expected: u64,
        actual: u64,
    },
    /// The fs-verity digest the image records for a file is not the name of
    /// the object it points at.
    VerityDigestMismatch {
        image: String,
        path: String,
        object: ObjectId,
        recorded: ObjectId,
    },
    /// The ref holds no image digest.
    CorruptRef { name: String, reason: String },
    /// The ref names an image that is not in the store.
    DanglingRef { name: String, digest: String },
    /// The ref names an image that is broken.
    RefToBrokenImage { name: String, digest: String },
    /// A layer record cannot be read.
    CorruptLayer { name: String, reason: String },
    /// A layer record holds an object that is missing or corrupt.
    LayerMissingObject { name: String, object: ObjectId },
}

impl Problem {
    /// A short, stable name of the kind of problem (for JSON).
    pub fn kind(&self) -> &'static str {
        match self {
            Problem::WideDirectory { .. } => "wide-directory",
            Problem::UncheckedDirectory { .. } => "unchecked-directory",
            Problem::CorruptObject { .. } => "corrupt-object",
            Problem::UnreadableObject { .. } => "unreadable-object",
            Problem::ImageDigestMismatch { .. } => "image-digest-mismatch",
            Problem::UnreadableImage { .. } => "unreadable-image",
            Problem::CorruptImageRecord { .. } => "corrupt-image-record",
            Problem::BadPayload { .. } => "bad-payload",
            Problem::MissingObject { .. } => "missing-object",
            Problem::CorruptObjectUsed { .. } => "corrupt-object-used",
            Problem::ObjectSizeMismatch { .. } => "object-size-mismatch",
            Problem::VerityDigestMismatch { .. } => "verity-digest-mismatch",
            Problem::CorruptRef { .. } => "corrupt-ref",
            Problem::DanglingRef { .. } => "dangling-ref",
            Problem::RefToBrokenImage { .. } => "ref-to-broken-image",
            Problem::CorruptLayer { .. } => "corrupt-layer",
            Problem::LayerMissingObject { .. } => "layer-missing-object",
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::WideDirectory { path, mode } => write!(
                f,
                "{}: mode {mode:04o} lets other users in (the store is private: {:04o})",
                path.display(),
                crate::PRIVATE_DIR_MODE
            ),
            Problem::UncheckedDirectory { path, reason } => {
                write!(f, "{}: cannot check its mode: {reason}", path.display())
            }
            Problem::CorruptObject { id, actual } => {
                write!(f, "object {id}: content hashes to {actual}")
            }
            Problem::UnreadableObject { id, reason } => write!(f, "object {id}: {reason}"),
            Problem::ImageDigestMismatch { digest, actual } => {
                write!(f, "image {digest}: content hashes to {actual}")
            }
            Problem::UnreadableImage { digest, reason } => write!(f, "image {digest}: {reason}"),
            Problem::CorruptImageRecord { digest, reason } => {
                write!(f, "image {digest}: record: {reason}")
            }
            Problem::BadPayload {
                image,
                path,
                payload,
            } => write!(
                f,
                "image {image}: {path}: backed by {payload:?}, which is not an object path"
            ),
            Problem::MissingObject {
                image,
                path,
                object,
            } => write!(f, "image {image}: {path}: object {object} is missing"),
            Problem::CorruptObjectUsed {
                image,
                path,
                object,
            } => write!(f, "image {image}: {path}: object {object} is corrupt"),
            Problem::ObjectSizeMismatch {
                image,
                path,
                object,
                expected,
                actual,
            } => write!(
                f,
                "image {image}: {path}: {expected} bytes, but object {object} holds {actual}"
            ),
            Problem::VerityDigestMismatch {
                image,
                path,
                object,
                recorded,
            } => write!(
                f,
                "image {image}: {path}: records fs-verity digest {recorded} for object {object}"
            ),
            Problem::CorruptRef { name, reason } => write!(f, "ref {name:?}: {reason}"),
            Problem::DanglingRef { name, digest } => {
                write!(f, "ref {name:?}: image {digest} is not in the store")
            }
            Problem::RefToBrokenImage { name, digest } => {
                write!(f, "ref {name:?}: image {digest} is broken")
            }
            Problem::CorruptLayer { name, reason } => write!(f, "layer {name}: {reason}"),
            Problem::LayerMissingObject { name, object } => {
                write!(f, "layer {name}: object {object} is missing or corrupt")
            }
        }
    }
}

/// What a repair removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// The directory was narrowed to 0700 from the mode given.
    MadePrivate(PathBuf, u32),
    RemovedObject(ObjectId),
    RemovedImage(String),
    RemovedLayer(String),
    RemovedRef(String),
}

impl fmt::Display for Repair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Repair::MadePrivate(path, mode) => write!(
                f,
                "made {} private (mode {:04o}, was {mode:04o})",
                path.display(),
                crate::PRIVATE_DIR_MODE
            ),
            Repair::RemovedObject(id) => write!(f, "removed object {id}"),
            Repair::RemovedImage(d) => write!(f, "removed image {d}"),
            Repair::RemovedLayer(n) => write!(f, "removed layer {n}"),
            Repair::RemovedRef(n) => write!(f, "removed ref {n:?}"),
        }
    }
}

/// What [`Store::fsck`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsckReport {
    pub objects: u64,
    pub object_bytes: u64,
    pub images: u64,
    pub layers: u64,
    pub refs: u64,
    /// Every problem: directories first, then objects, images, layers, refs.
    pub problems: Vec<Problem>,
    /// What the repair removed (empty without `repair`).
    pub repairs: Vec<Repair>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Store {
    /// Checks (and with `opts.repair` repairs) the whole store; see the
    /// module docs. Problems are in the report; an `Err` means the check
    /// itself could not run (e.g. `objects/` cannot be listed).
    pub fn fsck(&self, opts: &FsckOptions<'_>) -> Result<FsckReport, StoreError> {
        let _lock = if opts.repair {
            self.lock_exclusive()?
        } else {
            self.lock_shared()?
        };
        let mut report = FsckReport::default();

        // Directories that must be private.
        let mut wide_dirs = Vec::new();
        let dirs = self
            .private_dirs()
            .into_iter()
            .chain(opts.private_dirs.iter().map(|d| d.to_path_buf()));
        for path in dirs {
            match crate::wide_mode(&path) {
                Ok(None) => {}
                Ok(Some(mode)) => {
                    wide_dirs.push(path.clone());
                    report.problems.push(Problem::WideDirectory { path, mode });
                }
                Err(e) => report.problems.push(Problem::UncheckedDirectory {
                    path,
                    reason: describe(&e),
                }),
            }
        }

        // Objects.
        let mut ids = Vec::new();
        for id in self.list_objects()? {
            ids.push(id?);
        }
        ids.sort();
        report.objects = ids.len() as u64;
        let (object_problems, bytes) = self.check_objects(&ids, opts.threads);
        report.object_bytes = bytes;
        let bad_objects: HashSet<ObjectId> = object_problems
            .iter()
            .filter_map(|p| match p {
                Problem::CorruptObject { id, .. } | Problem::UnreadableObject { id, .. } => {
                    Some(*id)
                }
                _ => None,
            })
            .collect();
        report.problems.extend(object_problems);
        let object_state = |id: &ObjectId| -> ObjectState {
            if bad_objects.contains(id) {
                ObjectState::Corrupt
            } else {
                match fs::symlink_metadata(self.object_path(id)) {
                    Ok(m) if m.is_file() => ObjectState::Present(m.len()),
                    _ => ObjectState::Missing,
                }
            }
        };

        // Images.
        let mut digests = Vec::new();
        for d in self.list_images()? {
            digests.push(d?);
        }
        digests.sort();
        report.images = digests.len() as u64;
        let mut broken_images = BTreeSet::new();
        for digest in &digests {
            let found = self.check_image(digest, &object_state);
            if !found.is_empty() {
                broken_images.insert(digest.clone());
                report.problems.extend(found);
            }
        }

        // Layer records.
        let layers = self.layer_entries()?;
        report.layers = layers.len() as u64;
        let mut broken_layers = BTreeSet::new();
        for layer in &layers {
            match self.layer_objects(layer) {
                Ok(ids) => {
                    let mut missing: Vec<ObjectId> = ids
                        .into_iter()
                        .filter(|id| !matches!(object_state(id), ObjectState::Present(_)))
                        .collect();
                    missing.sort();
                    missing.dedup();
                    if !missing.is_empty() {
                        broken_layers.insert(layer.name.clone());
                    }
                    report.problems.extend(missing.into_iter().map(|object| {
                        Problem::LayerMissingObject {
                            name: layer.name.clone(),
                            object,
                        }
                    }));
                }
                Err(e) => {
                    broken_layers.insert(layer.name.clone());
                    report.problems.push(Problem::CorruptLayer {
                        name: layer.name.clone(),
                        reason: match e {
                            StoreError::CorruptLayer { reason, .. } => reason,
                            e => e.to_string(),
                        },
                    });
                }
            }
        }

        // Refs.
        let refs = self.scan_refs()?;
        report.refs = refs.len() as u64;
        let mut bad_refs = Vec::new();
        for r in refs {
            let problem = match r.target {
                Err(reason) => Problem::CorruptRef {
                    name: r.name.clone(),
                    reason,
                },
                Ok(digest) if broken_images.contains(&digest) => Problem::RefToBrokenImage {
                    name: r.name.clone(),
                    digest,
                },
                Ok(digest) if !self.has_image(&digest) => Problem::DanglingRef {
                    name: r.name.clone(),
                    digest,
                },
                Ok(_) => continue,
            };
            bad_refs.push(r.name);
            report.problems.push(problem);
        }

        if opts.repair {
            for dir in wide_dirs {
                if let Some(mode) = crate::make_dir_private(&dir)
                    .map_err(|e| StoreError::io("making private", &dir, &self.root, e))?
                {
                    report.repairs.push(Repair::MadePrivate(dir, mode));
                }
            }
            // Refs first: at no moment does a ref point at a removed image.
            for name in bad_refs {
                if self.remove_ref(&name)? {
                    report.repairs.push(Repair::RemovedRef(name));
                }
            }
            for digest in broken_images {
                self.remove_entry(&self.image_path(&digest))?;
                for side in self.image_side_files(&digest) {
                    self.remove_entry(&side)?;
                }
                report.repairs.push(Repair::RemovedImage(digest));
            }
            for layer in layers.iter().filter(|l| broken_layers.contains(&l.name)) {
                self.remove_entry(&layer.path)?;
                report
                    .repairs
                    .push(Repair::RemovedLayer(layer.name.clone()));
            }
            let mut bad: Vec<ObjectId> = bad_objects.into_iter().collect();
            bad.sort();
            for id in bad {
                self.remove_entry(&self.object_path(&id))?;
                report.repairs.push(Repair::RemovedObject(id));
            }
            for dir in [self.images_dir(), self.layers_dir()] {
                crate::tmp::sync_dir(&dir, &self.root)?;
            }
        }
        Ok(report)
    }

    /// Re-hashes `ids` on `threads` threads; returns the problems found and
    /// the bytes read.
    fn check_objects(&self, ids: &[ObjectId], threads: usize) -> (Vec<Problem>, u64) {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
        .min(ids.len().max(1));
        let next = AtomicUsize::new(0);
        let problems = Mutex::new(Vec::new());
        let bytes = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(id) = ids.get(i) else { break };
                    match self.hash_object(id) {
                        Ok((actual, len)) => {
                            bytes.fetch_add(len, Ordering::Relaxed);
                            if actual != *id {
                                lock(&problems).push(Problem::CorruptObject { id: *id, actual });
                            }
                        }
                        Err(reason) => {
                            lock(&problems).push(Problem::UnreadableObject { id: *id, reason })
                        }
                    }
                });
            }
        });
        let mut problems = problems.into_inner().unwrap_or_else(|p| p.into_inner());
        problems.sort_by_key(|p| match p {
            Problem::CorruptObject { id, .. } | Problem::UnreadableObject { id, .. } => *id,
            _ => ObjectId([0; 32]),
        });
        (problems, bytes.into_inner())
    }

    /// The fs-verity digest and size of the object file named `id`.
    fn hash_object(&self, id: &ObjectId) -> Result<(ObjectId, u64), String> {
        let path = self.object_path(id);
        let file: File = OpenOptions::new()
            .read(true)
            // Never follow a symlink out of the store, never hang on a FIFO.
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| describe(&e))?;
        let meta = file.metadata().map_err(|e| describe(&e))?;
        if !meta.is_file() {
            return Err("not a regular file".into());
        }
        let digest = fsverity_digest(&file).map_err(|e| describe(&e))?;
        Ok((digest, meta.len()))
    }

    /// Every problem of one image.
    fn check_image(
        &self,
        digest: &str,
        object_state: &dyn Fn(&ObjectId) -> ObjectState,
    ) -> Vec<Problem> {
        let mut found = Vec::new();
        let path = self.image_path(digest);
        let data = match read_regular(&path) {
            Ok(d) => d,
            Err(reason) => {
                found.push(Problem::UnreadableImage {
                    digest: digest.to_owned(),
                    reason,
                });
                return found;
            }
        };
        let actual = hex::encode(Sha256::digest(&data));
        if actual != digest {
            found.push(Problem::ImageDigestMismatch {
                digest: digest.to_owned(),
                actual,
            });
        }
        if let Err(e) = self.image_layers(digest) {
            found.push(Problem::CorruptImageRecord {
                digest: digest.to_owned(),
                reason: e.to_string(),
            });
        }
        // An incomplete image (pulled with --lazy) lacks objects by
        // design; what it needs instead is its index, whole.
        let lazy = self
            .image_record(digest)
            .ok()
            .flatten()
            .and_then(|r| r.lazy);
        if let Some(lazy) = &lazy {
            let index = self.lazy_index_path(digest);
            let problem = match read_regular(&index) {
                Ok(data) => {
                    let actual = format!("sha256:{}", hex::encode(Sha256::digest(&data)));
                    (actual != lazy.index_digest).then(|| {
                        format!(
                            "lazy index {} hashes to {actual}, the record says {}",
                            index.display(),
                            lazy.index_digest
                        )
                    })
                }
                Err(reason) => Some(format!("lazy index {}: {reason}", index.display())),
            };
            if let Some(reason) = problem {
                found.push(Problem::CorruptImageRecord {
                    digest: digest.to_owned(),
                    reason,
                });
            }
        }
        let contents = match contents_of(&data) {
            Ok(c) => c,
            Err(reason) => {
                found.push(Problem::UnreadableImage {
                    digest: digest.to_owned(),
                    reason,
                });
                return found;
            }
        };
        let image = || digest.to_owned();
        let show = |p: &[u8]| String::from_utf8_lossy(p).into_owned();
        for bad in &contents.bad_payloads {
            found.push(Problem::BadPayload {
                image: image(),
                path: show(&bad.path),
                payload: show(&bad.payload),
            });
        }
        for (id, used) in &contents.objects {
            match object_state(id) {
                ObjectState::Missing if lazy.is_some() => {}
                ObjectState::Missing => found.push(Problem::MissingObject {
                    image: image(),
                    path: show(&used.path),
                    object: *id,
                }),
                ObjectState::Corrupt => found.push(Problem::CorruptObjectUsed {
                    image: image(),
                    path: show(&used.path),
                    object: *id,
                }),
                ObjectState::Present(len) if len != used.size => {
                    found.push(Problem::ObjectSizeMismatch {
                        image: image(),
                        path: show(&used.path),
                        object: *id,
                        expected: used.size,
                        actual: len,
                    })
                }
                ObjectState::Present(_) => {}
            }
            if let Some(recorded) = used.digest.filter(|d| d != id) {
                found.push(Problem::VerityDigestMismatch {
                    image: image(),
                    path: show(&used.path),
                    object: *id,
                    recorded,
                });
            }
        }
        found
    }
}

/// What fsck knows of an object an image or layer uses.
#[derive(Debug, Clone, Copy)]
enum ObjectState {
    /// Present and whole, this many bytes.
    Present(u64),
    Missing,
    Corrupt,
}

/// Largest image read (the EROFS reader's own limit).
const MAX_IMAGE_BYTES: u64 = 4 << 30;

/// Reads a file that must be a regular file (never a FIFO or a symlink).
fn read_regular(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| describe(&e))?;
    let meta = file.metadata().map_err(|e| describe(&e))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_IMAGE_BYTES {
        return Err(format!(
            "{} bytes, more than any image may have",
            meta.len()
        ));
    }
    let mut data = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.read_to_end(&mut data).map_err(|e| describe(&e))?;
    Ok(data)
}

fn describe(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ELOOP) => "a symlink, not a regular file".into(),
        _ => e.to_string(),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
