//! cairn's content-addressed store: file contents named by their fs-verity
//! digest, EROFS metadata images named by their SHA-256, refs naming
//! images, and the lock and staging area that keep all of it consistent.
//!
//! # On disk
//!
//! ```text
//! <root>/                 default /var/lib/cairn; mode 0700, as is every
//! │                       directory directly below it (see `private`)
//! ├── objects/
//! │   └── ab/
//! │       └── cdef…       file contents, named by the fs-verity SHA-256 digest
//! │                       of those contents (hex, first two digits as a fan-out
//! │                       directory, as composefs does); mode 0644, sealed with
//! │                       fs-verity where the kernel can; never modified
//! ├── images/
//! │   └── <sha256>        EROFS metadata images, named by the SHA-256 of the
//! │                       file; mode 0600 (small files are inlined in them)
//! ├── layers/             per-layer records (`record`), mode 0600
//! ├── refs/
//! │   └── <name>          "<image sha256>\n"; replaced atomically; mode 0600
//! ├── tmp/
//! │   └── s.<pid>.<t>.<n>/  one staging directory per open Store, flock'ed
//! │       └── o.<n> …       while it lives; files are written here first
//! └── lock                flock(2) target for the store lock
//! ```
//!
//! The store is private: nobody but its owner can list it or read anything
//! in it (the `private` module says how, and how containers still read
//! their files as their images' modes allow).
//!
//! # Invariants
//!
//! - A file under `objects/` or `images/` is complete and its name is its
//!   digest: it is written under `tmp/`, fsynced, made read-only, then
//!   renamed into place without replacing anything (`RENAME_NOREPLACE`), and
//!   its directory is fsynced. Writers racing on the same content are
//!   harmless: the first rename wins, the others drop their copy.
//! - A crash leaves only `tmp/` debris. [`Store::open`] (or
//!   [`Store::clean_tmp`]) removes the staging directories no live writer
//!   holds; see the `tmp` module for why that is safe against concurrent
//!   writers in other processes.
//! - A failed import (full disk, unreadable source) leaves nothing visible
//!   and no staged file behind.
//! - Kernel fs-verity is probed at run time; without it everything works
//!   and digests are checked in userspace.
//! - The root and the directories below it are mode 0700; a store found
//!   wider is narrowed by its next write ([`Store::make_private`]) and
//!   reported by [`Store::fsck`].
//! - Every writer (import, pull, `mkfs --store`, tag, mount) holds the store
//!   lock shared for its whole operation, from its first lookup or write to
//!   the ref or mount that makes its result reachable; [`Store::gc`] holds
//!   it exclusive, so it never sees a half-built image. Readers lock
//!   nothing.
//! - Garbage collection removes only what no ref and no live mount reaches.
//!   Live mounts are not recorded in the store: they are read from the
//!   kernel's mount tables (an overlay whose `source` is
//!   `images/<digest>`), which no crash can leave stale (see `mounts`).
//!
//! # Modules
//!
//! `verity` computes digests (pure; `sha256x2` hashes its data blocks two
//! at a time), `object` publishes objects, `image`
//! images, `refs` refs, `lock` the store lock, `tmp` owns staging, `kernel`
//! probes and enables fs-verity, `private` keeps the store's modes,
//! `sys` (the fs-verity ioctl) and `sha256x2` (the CPU's SHA
//! instructions) hold the crate's only `unsafe`. Digests from outside are
//! parsed by `cairn_spec::parse_digest` (re-exported here), `resolve`
//! turns what a user types into an image, `graph` reads what keeps what alive, `mounts` finds live mounts,
//! and `gc`, `fsck` and `usage` walk that graph to collect garbage, check
//! and repair, and measure.

#![deny(unsafe_code)]

mod error;
mod fsck;
mod gc;
mod graph;
mod image;
mod kernel;
mod lock;
mod mounts;
mod object;
mod private;
mod publish;
mod record;
mod refs;
mod resolve;
mod sha256x2;
mod sys;
mod tmp;
mod usage;
mod verity;

use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The one parser of OCI digests from outside lives in `cairn-spec`; it is
/// re-exported here because every caller of the store names digests.
pub use cairn_spec::{parse_digest, DigestError};
pub use error::StoreError;
pub use fsck::{FsckOptions, FsckReport, Problem, Repair};
pub use gc::{GcOptions, GcReport, Removed};
pub use graph::{BadPayload, ImageContents, ObjectUse};
pub use image::{is_image_digest, ImageWriter, Images};
pub use kernel::{
    has_verity, measure_verity, seal_with_verity, VerityChoice, VerityDecision, VerityRefusal,
    VeritySupport,
};
pub use lock::{flock_waiters, LockKind, StoreLock};
pub use mounts::LiveMount;
pub use object::{ObjectBatch, ObjectLookup, Objects};
pub use private::{
    create_private_dir, ensure_private_dir, make_dir_private, wide_mode, PRIVATE_DIRS,
    PRIVATE_DIR_MODE, PRIVATE_FILE_MODE,
};
pub use publish::{
    open_file_budget, reserve_descriptors, PublishShard, Publisher, MAX_LAYER_OPEN_FILES,
};
pub use record::{
    image_name_for, is_diff_id, ref_name_for, ImageRecord, ImageRecordLayer, LayerRecord,
    LayerRecordWriter, LazySource, ObjectShard, ObjectStager, StagedObject, LAYER_ENTRIES_FILE,
    LAYER_FORMAT, LAYER_RECORD_FILE, OPAQUE_MARKER, WHITEOUT_PREFIX,
};
pub use refs::{validate_ref_name, MAX_REF_NAME};
pub use resolve::{ImageSource, ResolvedImage, MIN_DIGEST_PREFIX};
pub use usage::{Category, ImageUsage, StoreUsage};
pub use verity::{fsverity_digest, FsVerityHasher, ObjectId};

use tmp::Staging;

/// The default store root.
pub const DEFAULT_ROOT: &str = "/var/lib/cairn";

/// The directories every store has.
const LAYOUT_DIRS: [&str; 5] = ["objects", "images", "layers", "refs", "tmp"];

/// An open store. Cheap to share between threads (`&Store` is all any
/// operation needs).
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    /// This Store's staging directory, made on first write so that opening
    /// a store only to read it writes nothing.
    staging: Mutex<Option<Arc<Staging>>>,
    verity: OnceLock<VeritySupport>,
    /// Which fan-out directories of `objects/` this Store has seen: read
    /// once, on the first object staged, and kept up to date by
    /// [`publish_staged`](Self::publish_staged). An object whose fan-out
    /// directory is missing is not in the store, so staging it needs no
    /// `lstat` to find out; one made meanwhile by another process costs
    /// at most a duplicate staged file (dropped at publication).
    fanouts: OnceLock<object::Fanouts>,
    /// Whether unnamed files can be made and linked in this store
    /// (probed once; see `publish.rs`).
    anonymous: OnceLock<bool>,
}

impl Store {
    /// Opens the store at `root`, creating it and its layout (mode 0700
    /// directories, the lock file) where missing, and removes stale `tmp/`
    /// debris of writers that are gone. The modes of what exists are left
    /// alone: a store is narrowed by its first write
    /// ([`make_private`](Self::make_private)).
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        let root = std::path::absolute(root)
            .map_err(|e| StoreError::io("resolving store root", root, root, e))?;
        create_private_dir(&root, true).map_err(|e| StoreError::io("creating", &root, &root, e))?;
        for dir in LAYOUT_DIRS {
            let dir = root.join(dir);
            create_private_dir(&dir, false)
                .map_err(|e| StoreError::io("creating", &dir, &root, e))?;
        }
        let lock = root.join("lock");
        if fs::symlink_metadata(&lock).is_err() {
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(PRIVATE_FILE_MODE)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(&lock)
                .map_err(|e| StoreError::io("creating lock file", &lock, &root, e))?;
        }
        let store = Store {
            root,
            staging: Mutex::new(None),
            verity: OnceLock::new(),
            fanouts: OnceLock::new(),
            anonymous: OnceLock::new(),
        };
        // Cleaning is housekeeping: a store we may read but not write (or a
        // stuck entry) must not stop anyone from using it.
        if let Err(e) = store.clean_tmp() {
            match e.io_error().map(io::Error::kind) {
                Some(io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem) => {
                    tracing::debug!("not cleaning tmp/: {e}")
                }
                _ => tracing::warn!("could not clean stale staging files: {e}"),
            }
        }
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/layers`.
    pub fn layers_dir(&self) -> PathBuf {
        self.root.join("layers")
    }

    /// `<root>/tmp`.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// Removes what writers that are gone left in `tmp/` (never anything a
    /// live writer, in this process or another, holds). Returns how many
    /// entries were removed. [`Store::open`] does this already.
    pub fn clean_tmp(&self) -> Result<usize, StoreError> {
        let own = self.current_staging().map(|s| s.path().to_path_buf());
        tmp::clean_tmp(&self.root, own.as_deref())
    }

    /// Whether the kernel can seal objects with fs-verity on this store's
    /// filesystem. Probed once per Store, on first use, by trying it on a
    /// scratch file; when it cannot, a warning is logged once per process.
    pub fn verity_support(&self) -> VeritySupport {
        self.probed_verity().clone()
    }

    pub(crate) fn verity_supported(&self) -> bool {
        self.probed_verity().is_supported()
    }

    fn probed_verity(&self) -> &VeritySupport {
        self.verity.get_or_init(|| match self.staging() {
            Ok(staging) => kernel::probe(&staging),
            Err(e) => VeritySupport::Unsupported(format!("no scratch file to try it on: {e}")),
        })
    }

    fn current_staging(&self) -> Option<Arc<Staging>> {
        self.staging
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// This Store's staging directory, made and locked on first use, when
    /// the store is also made private (its first write).
    pub(crate) fn staging(&self) -> Result<Arc<Staging>, StoreError> {
        let mut slot = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = &*slot {
            return Ok(Arc::clone(s));
        }
        self.make_private_or_warn();
        let s = Staging::create(&self.root)?;
        *slot = Some(Arc::clone(&s));
        Ok(s)
    }
}

#[cfg(test)]
mod tests;
