//! The snapshotter: containerd's snapshot semantics over [`Meta`] records,
//! directories under `$CAIRN_ROOT/snapshots/`, and the store.
//!
//! Every method is synchronous and is called with the snapshotter locked
//! (one operation at a time); the gRPC layer runs them on blocking threads.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_store::Store;
use rustix::fs::{flock, FlockOperation};

use crate::commit::Committed;
use crate::meta::{Kind, Layer, Meta, MetaError, Record, Time, RECORD_FORMAT};
use crate::proto;
use crate::remote::{self, RemoteRequest};

mod chain;
mod plans;
mod reaper;

pub use plans::{commit, prepare, CommitPlan, RemoteDone, RemotePlan};
use plans::{has_layers, warn_fallback};

/// The errors containerd's proxy client turns back into its errdefs.
#[derive(Debug, thiserror::Error)]
pub enum SnapError {
    #[error("snapshot {0:?}: not found")]
    NotFound(String),
    #[error("snapshot {0:?}: already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Internal(String),
}

impl From<MetaError> for SnapError {
    fn from(e: MetaError) -> Self {
        SnapError::Internal(format!("snapshot metadata: {e}"))
    }
}

fn internal(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> SnapError {
    move |e| SnapError::Internal(format!("{what}: {e}"))
}

/// Whether the image `img` of `store` is incomplete (pulled lazily: its
/// record says so).
fn image_incomplete(store: &Store, img: &str) -> bool {
    store
        .image_record(img)
        .ok()
        .flatten()
        .is_some_and(|r| r.lazy.is_some())
}

/// The prefix of the refs that keep committed snapshots' chain images.
pub const REF_PREFIX: &str = "containerd-snapshot-";

/// How long the manifest an image ref resolved to in a lazy pull stands
/// for that ref, for the later layers' Prepares of a pull that carry no
/// `cri.manifest-digest`: containerd prepares an image's layers one after
/// the other, and the lazy path places each in well under a second, so a
/// minute covers one pull and not the next one of a moved tag.
pub const RESOLVED_FOR: Duration = Duration::from_secs(60);

/// Mounts an incomplete (lazily pulled) image read-only at a directory,
/// its data layer served by a process that outlives the snapshotter and
/// goes when the mount goes. The `cairn` binary gives one at start
/// (docs/snapshotter.md, "The lazy remote path").
pub trait LazyMounter: Send + Sync {
    /// Mounts image `image` (hex sha256) of the store at `root` on `target`.
    fn mount(&self, root: &Path, image: &str, target: &Path) -> Result<(), String>;
}

pub struct Snapshotter {
    store: Arc<Store>,
    /// Set: the remote path pulls images that have a cairn lazy artifact
    /// lazily, and chain images that are incomplete are mounted with it.
    lazy: Option<Arc<dyn LazyMounter>>,
    /// Active snapshots being committed (key → id), and the names they
    /// will take: the import runs without the snapshotter's lock.
    committing: HashMap<String, u64>,
    reserved: HashSet<String>,
    /// Image ref → the manifest digest a lazy pull of it resolved to, and
    /// when: for the later layers of the same pull when containerd sends
    /// no `cri.manifest-digest` (see [`RESOLVED_FOR`]).
    resolved: HashMap<String, (String, Instant)>,
    /// Chain images being mounted without the snapshotter's lock, right
    /// after their lazy pull (see [`chain::BackgroundMount`]).
    mounting: HashMap<String, Arc<chain::MountFlight>>,
    meta: Meta,
    dir: PathBuf,
    /// Empties the directories of removed snapshots in the background.
    reaper: reaper::Reaper,
    /// Held (flock, exclusive) for the snapshotter's life.
    _lock: File,
}

/// What `Usage` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub size: i64,
    pub inodes: i64,
}

/// Asks the filesystem to spread the directories made in `dir` over its
/// block groups (ext4's `FS_TOPDIR_FL`, what `chattr +T` sets), as it
/// does for directories in `/`. Committing a layer on the normal path
/// frees every inode of the tree containerd unpacked into the snapshot's
/// directory, and ext4 avoids reusing inodes freed in the last minute or
/// so (`recently_deleted()`): each file or directory made next to them
/// (the next snapshot's directories, the metadata records) then costs
/// milliseconds instead of microseconds while its allocation skips them.
/// With the flag each snapshot's directory goes to a group of its own.
/// Measured here with containerd 1.6: warm `ctr run --rm` right after a
/// normal-path pull took 0.17-0.27 s, and 0.14-0.16 s a minute later.
/// Other filesystems ignore or refuse the flag; either is fine.
fn spread_subdirectories(dir: &Path) {
    use rustix::fs::{ioctl_getflags, ioctl_setflags, IFlags};
    let r = File::open(dir).and_then(|d| {
        let flags = ioctl_getflags(&d)?;
        if !flags.contains(IFlags::TOPDIR) {
            ioctl_setflags(&d, flags | IFlags::TOPDIR)?;
        }
        Ok(())
    });
    if let Err(e) = r {
        tracing::debug!("{}: not marked as a top directory: {e}", dir.display());
    }
}

impl Snapshotter {
    /// Opens the snapshotter of the store at `root` (creating
    /// `<root>/snapshots/`). Fails if another snapshotter has it open.
    pub fn open(root: &Path) -> Result<Snapshotter, SnapError> {
        let store = Store::open(root)
            .map_err(|e| SnapError::Internal(format!("opening the store: {e}")))?;
        let dir = store.root().join("snapshots");
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(internal(dir.display())(e)),
        }
        spread_subdirectories(&dir);
        let lock_path = dir.join("lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(internal(lock_path.display()))?;
        flock(&lock, FlockOperation::NonBlockingLockExclusive).map_err(|e| {
            SnapError::Internal(format!(
                "{}: another snapshotter runs on this store ({e})",
                lock_path.display()
            ))
        })?;
        let meta = Meta::open(&dir)?;
        let chains = dir.join("chains");
        match fs::DirBuilder::new().mode(0o700).create(&chains) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(internal(chains.display())(e)),
        }
        Ok(Snapshotter {
            store: Arc::new(store),
            lazy: None,
            committing: HashMap::new(),
            reserved: HashSet::new(),
            resolved: HashMap::new(),
            mounting: HashMap::new(),
            meta,
            dir,
            reaper: reaper::Reaper::default(),
            _lock: lock,
        })
    }

    /// Turns the lazy remote path on (see [`LazyMounter`]).
    pub fn set_lazy_mounter(&mut self, m: Arc<dyn LazyMounter>) {
        self.lazy = Some(m);
    }

    fn snap_dir(&self, id: u64) -> PathBuf {
        self.dir.join(id.to_string())
    }

    fn chain_dir(&self, image: &str) -> PathBuf {
        self.dir.join("chains").join(image)
    }

    pub fn info(&self, key: &str) -> Result<proto::Info, SnapError> {
        let r = self
            .meta
            .get(key)
            .ok_or_else(|| SnapError::NotFound(key.to_owned()))?;
        Ok(to_info(r))
    }

    fn create(
        &mut self,
        kind: Kind,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<proto::Mount>, SnapError> {
        if key.is_empty() {
            return Err(SnapError::InvalidArgument("empty snapshot key".into()));
        }
        if self.meta.get(key).is_some() || self.reserved.contains(key) {
            return Err(SnapError::AlreadyExists(key.to_owned()));
        }
        let parent_image = if parent.is_empty() {
            None
        } else {
            let p = self
                .meta
                .get(parent)
                .ok_or_else(|| SnapError::NotFound(parent.to_owned()))?
                .clone();
            let Some(layer) = &p.layer else {
                return Err(SnapError::InvalidArgument(format!(
                    "parent {parent:?} is not a committed snapshot"
                )));
            };
            if layer.lazy.as_ref().is_some_and(|l| l.partial) {
                Some(self.materialize(&p)?)
            } else {
                Some(layer.image.clone())
            }
        };
        let id = self.meta.allocate_id();
        let sdir = self.snap_dir(id);
        let made = (|| -> Result<(), SnapError> {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(&sdir)
                .map_err(internal(sdir.display()))?;
            let needs_fs = kind == Kind::Active || parent_image.is_none();
            if needs_fs {
                let fsd = sdir.join("fs");
                fs::DirBuilder::new()
                    .mode(0o755)
                    .create(&fsd)
                    .map_err(internal(fsd.display()))?;
            }
            if kind == Kind::Active && parent_image.is_some() {
                let w = sdir.join("work");
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&w)
                    .map_err(internal(w.display()))?;
            }
            if let Some(img) = &parent_image {
                self.ensure_chain_mounted(img)?;
            }
            let now = Time::now();
            let rec = Record {
                format: RECORD_FORMAT,
                id,
                key: key.to_owned(),
                kind,
                parent: (!parent.is_empty()).then(|| parent.to_owned()),
                parent_image: parent_image.clone(),
                labels: labels.into_iter().collect(),
                created: now,
                updated: now,
                layer: None,
            };
            self.meta.put(rec, None)?;
            Ok(())
        })();
        if let Err(e) = made {
            let _ = fs::remove_dir_all(&sdir);
            if let Some(img) = &parent_image {
                self.release_chain(img);
            }
            return Err(e);
        }
        self.mounts(key)
    }

    /// An intermediate layer placed in a whole pulled image (a lazy
    /// artifact's, or a full remote pull's) has no chain image of its own
    /// (its record names the whole image): pulls the image in full if the
    /// store lacks the chain's layer records (layers the store has are
    /// not fetched again), assembles the chain's image, points the snapshot's ref at it and
    /// rewrites its record as an ordinary layer. Slow, with the
    /// snapshotter locked, and rare: containerd mounts the top layer.
    fn materialize(&mut self, p: &Record) -> Result<String, SnapError> {
        let layer = p.layer.as_ref().expect("a committed record");
        let lz = layer.lazy.as_ref().expect("a lazy layer");
        let what = format!(
            "snapshot {:?} (a layer of {} placed in the whole image)",
            p.key, lz.image_ref
        );
        let _lock = self
            .store
            .lock_shared()
            .map_err(|e| SnapError::Internal(format!("locking the store: {e}")))?;
        // Pulled in full, the store has the chain's layer records.
        if !has_layers(&self.store, &layer.chain) {
            tracing::info!("{what}: pulling the image in full for a mount of this layer");
            remote::pull_full(&self.store, &lz.image_ref, &lz.manifest_digest)
                .map_err(|e| SnapError::Internal(format!("{what}: {e}")))?;
        }
        tracing::info!("{what}: assembling its chain's image for a mount of this layer");
        let image = crate::commit::assemble_chain(&self.store, &layer.chain)
            .map_err(|e| SnapError::Internal(format!("{what}: assembling its chain image: {e}")))?;
        self.store
            .set_ref(&layer.ref_name, &image)
            .map_err(|e| SnapError::Internal(format!("ref {}: {e}", layer.ref_name)))?;
        let mut r = p.clone();
        let l = r.layer.as_mut().expect("a committed record");
        l.image = image.clone();
        l.lazy = None;
        if let Ok(Some(rec)) = self.store.layer_record(&l.diff_id) {
            l.size = rec.size;
            l.entries = rec.entries;
        }
        r.updated = Time::now();
        self.meta.put(r, None)?;
        Ok(image)
    }

    /// Prepare with the snapshotter locked throughout (tests; the server
    /// uses [`prepare`], which pulls without the lock). With the
    /// remote-snapshotter labels (see [`crate::remote`]) cairn first tries
    /// to pull the layer itself and commit it under the target name,
    /// answering `AlreadyExists` for the target; if that fails, it says
    /// why in the log and prepares as usual, so that containerd fetches
    /// and unpacks the layer itself.
    pub fn prepare(
        &mut self,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<proto::Mount>, SnapError> {
        if let Some(plan) = self.begin_remote(key, parent, &labels)? {
            let done = plan.run();
            self.finish_remote(plan, done)?;
        }
        self.create(Kind::Active, key, parent, labels)
    }

    /// Whether a Prepare takes the remote path: if so, its target name is
    /// reserved and the pull ([`RemotePlan::run`]) runs without the
    /// snapshotter's lock. `AlreadyExists` if the target is there already.
    pub fn begin_remote(
        &mut self,
        key: &str,
        parent: &str,
        labels: &HashMap<String, String>,
    ) -> Result<Option<RemotePlan>, SnapError> {
        let Some(req) = RemoteRequest::from_labels(labels) else {
            return Ok(None);
        };
        if self.meta.get(&req.target).is_some() {
            return Err(SnapError::AlreadyExists(req.target));
        }
        if key.is_empty()
            || self.meta.get(key).is_some()
            || self.reserved.contains(key)
            || self.reserved.contains(&req.target)
        {
            // The usual Prepare gives the error, or the normal path.
            return Ok(None);
        }
        let mut lazy_parent = None;
        let parent_chain = if parent.is_empty() {
            Ok(Vec::new())
        } else {
            match self.meta.get(parent) {
                None => Err(format!("parent {parent:?} does not exist")),
                Some(p) => match &p.layer {
                    None => Err(format!("parent {parent:?} is not committed")),
                    Some(l) => {
                        if let Some(lz) = l.lazy.as_ref().filter(|lz| lz.partial) {
                            lazy_parent = Some((l.image.clone(), lz.manifest_digest.clone()));
                        }
                        Ok(l.chain.clone())
                    }
                },
            }
        };
        let parent_chain = match parent_chain {
            Ok(c) => c,
            Err(why) => {
                warn_fallback(&req, &why);
                return Ok(None);
            }
        };
        // The manifest the layer must be placed in without a pull: the one
        // containerd names, or else the one this image ref resolved to for
        // the parent's layer moments ago (the same pull).
        let manifest = req.manifest_digest.clone().or_else(|| {
            self.resolved
                .get(&req.image_ref)
                .filter(|(_, at)| at.elapsed() < RESOLVED_FOR)
                .map(|(m, _)| m.clone())
        });
        self.reserved.insert(req.target.clone());
        Ok(Some(RemotePlan {
            lazy: self.lazy.is_some(),
            lazy_parent,
            manifest,
            store: self.store.clone(),
            req,
            parent: parent.to_owned(),
            parent_chain,
            labels: labels.clone(),
        }))
    }

    /// Records the outcome of a remote pull: a committed snapshot under the
    /// target name and `AlreadyExists`, or (the failure logged) `Ok` for
    /// the usual Prepare to follow.
    pub fn finish_remote(
        &mut self,
        plan: RemotePlan,
        done: Result<RemoteDone, String>,
    ) -> Result<(), SnapError> {
        self.reserved.remove(&plan.req.target);
        let req = &plan.req;
        let done = match done {
            Ok(d) => d,
            Err(why) => {
                warn_fallback(req, &why);
                return Ok(());
            }
        };
        if crate::stopping() {
            warn_fallback(req, "the snapshotter is stopping: not recorded");
            return Err(SnapError::Internal(format!(
                "remote snapshot {}: the snapshotter is stopping",
                req.target
            )));
        }
        if let (true, Some(lz)) = (done.resolved, &done.lazy) {
            self.resolved
                .retain(|_, (_, at)| at.elapsed() < RESOLVED_FOR);
            self.resolved.insert(
                req.image_ref.clone(),
                (lz.manifest_digest.clone(), Instant::now()),
            );
        }
        let id = self.meta.allocate_id();
        let ref_name = format!("{REF_PREFIX}{id}");
        // The store's lock is still held (in `done`): gc cannot run between
        // the chain image's assembly and its ref.
        if let Err(e) = self.store.set_ref(&ref_name, &done.image) {
            warn_fallback(req, &format!("ref {ref_name}: {e}"));
            return Ok(());
        }
        let now = Time::now();
        let record = Record {
            format: RECORD_FORMAT,
            id,
            key: req.target.clone(),
            kind: Kind::Committed,
            parent: (!plan.parent.is_empty()).then(|| plan.parent.clone()),
            parent_image: None,
            labels: plan.labels.clone().into_iter().collect(),
            created: now,
            updated: now,
            layer: Some(Layer {
                diff_id: done.pulled.diff_id.clone(),
                chain: done.pulled.chain.clone(),
                image: done.image.clone(),
                ref_name: ref_name.clone(),
                size: done.size,
                entries: done.entries,
                lazy: done.lazy.clone(),
            }),
        };
        if let Err(e) = self.meta.put(record, None) {
            let _ = self.store.remove_ref(&ref_name);
            warn_fallback(req, &format!("writing the record: {e}"));
            return Ok(());
        }
        tracing::info!(
            "remote snapshot {} ({} of {}) pulled {}by cairn",
            req.target,
            req.layer_digest,
            req.image_ref,
            if done.incomplete { "lazily " } else { "" }
        );
        Err(SnapError::AlreadyExists(req.target.clone()))
    }

    pub fn view(
        &mut self,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<proto::Mount>, SnapError> {
        self.create(Kind::View, key, parent, labels)
    }

    /// The mounts of an active or view snapshot (see docs/snapshotter.md).
    pub fn mounts(&self, key: &str) -> Result<Vec<proto::Mount>, SnapError> {
        let r = self
            .meta
            .get(key)
            .ok_or_else(|| SnapError::NotFound(key.to_owned()))?;
        let sdir = self.snap_dir(r.id);
        let s = |p: &Path| p.display().to_string();
        let m = match (r.kind, &r.parent_image) {
            (Kind::Committed, _) => {
                return Err(SnapError::FailedPrecondition(format!(
                    "snapshot {key:?} is committed: it has no mounts"
                )))
            }
            (Kind::Active, None) => proto::Mount {
                r#type: "bind".into(),
                source: s(&sdir.join("fs")),
                target: String::new(),
                options: vec!["rbind".into(), "rw".into()],
            },
            (Kind::View, None) => proto::Mount {
                r#type: "bind".into(),
                source: s(&sdir.join("fs")),
                target: String::new(),
                options: vec!["rbind".into(), "ro".into()],
            },
            (Kind::View, Some(img)) => proto::Mount {
                r#type: "bind".into(),
                source: s(&self.chain_dir(img)),
                target: String::new(),
                options: vec!["rbind".into(), "ro".into()],
            },
            (Kind::Active, Some(img)) => proto::Mount {
                r#type: "overlay".into(),
                source: "overlay".into(),
                target: String::new(),
                options: vec![
                    "index=off".into(),
                    format!("workdir={}", s(&sdir.join("work"))),
                    format!("upperdir={}", s(&sdir.join("fs"))),
                    format!("lowerdir={}", s(&self.chain_dir(img))),
                ],
            },
        };
        Ok(vec![m])
    }

    /// Checks a Commit and reserves its key and name; the import itself
    /// ([`CommitPlan::run`]) runs without the snapshotter's lock.
    pub fn begin_commit(
        &mut self,
        name: &str,
        key: &str,
        labels: HashMap<String, String>,
    ) -> Result<CommitPlan, SnapError> {
        if name.is_empty() {
            return Err(SnapError::InvalidArgument("empty snapshot name".into()));
        }
        let r = self
            .meta
            .get(key)
            .ok_or_else(|| SnapError::NotFound(key.to_owned()))?
            .clone();
        if r.kind != Kind::Active || self.committing.contains_key(key) {
            return Err(SnapError::FailedPrecondition(format!(
                "snapshot {key:?} is not active{}",
                if self.committing.contains_key(key) {
                    " (it is being committed)"
                } else {
                    ""
                }
            )));
        }
        if self.meta.get(name).is_some() || self.reserved.contains(name) {
            return Err(SnapError::AlreadyExists(name.to_owned()));
        }
        let (parent_chain, parent_lazy) = match &r.parent {
            Some(p) => self
                .meta
                .get(p)
                .and_then(|p| p.layer.as_ref())
                .map(|l| (l.chain.clone(), l.lazy.clone()))
                .ok_or_else(|| SnapError::Internal(format!("parent {p:?} of {key:?} is gone")))?,
            None => (Vec::new(), None),
        };
        self.committing.insert(key.to_owned(), r.id);
        self.reserved.insert(name.to_owned());
        Ok(CommitPlan {
            store: self.store.clone(),
            fs: self.snap_dir(r.id).join("fs"),
            ref_name: format!("{REF_PREFIX}{}", r.id),
            name: name.to_owned(),
            key: key.to_owned(),
            labels,
            record: r,
            parent_chain,
            parent_lazy,
        })
    }

    /// Records the outcome of a commit begun with [`Self::begin_commit`].
    pub fn finish_commit(
        &mut self,
        plan: CommitPlan,
        done: Result<Committed, SnapError>,
    ) -> Result<(), SnapError> {
        self.committing.remove(&plan.key);
        self.reserved.remove(&plan.name);
        let c = done?;
        let r = plan.record;
        let mut chain = plan.parent_chain;
        chain.push(c.layer.diff_id.clone());
        let mut all_labels = r.labels.clone();
        all_labels.extend(plan.labels);
        let now = Time::now();
        let rec = Record {
            format: RECORD_FORMAT,
            id: r.id,
            key: plan.name,
            kind: Kind::Committed,
            parent: r.parent.clone(),
            parent_image: None,
            labels: all_labels,
            created: now,
            updated: now,
            layer: Some(Layer {
                diff_id: c.layer.diff_id.clone(),
                chain,
                image: c.image.clone(),
                ref_name: plan.ref_name,
                size: c.layer.size,
                entries: c.layer.entries,
                lazy: None,
            }),
        };
        self.meta.put(rec, Some(&plan.key))?;
        self.remove_dir(&self.snap_dir(r.id));
        if let Some(img) = &r.parent_image {
            self.release_chain(img);
        }
        Ok(())
    }

    /// Commit with the snapshotter locked throughout (tests; the server
    /// uses [`commit`], which imports without the lock).
    pub fn commit(
        &mut self,
        name: &str,
        key: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), SnapError> {
        let plan = self.begin_commit(name, key, labels)?;
        let done = plan.run();
        self.finish_commit(plan, done)
    }

    /// Removes a snapshot directory: renamed out of the way under `tmp/`
    /// at once (a crash halfway leaves only `tmp/` debris), its files freed
    /// in the background ([`reaper`]).
    fn remove_dir(&mut self, sdir: &Path) {
        let junk = self.dir.join("tmp").join(format!(
            "rm.{}",
            sdir.file_name().unwrap_or_default().to_string_lossy()
        ));
        self.reaper.remove(sdir, junk);
    }

    pub fn remove(&mut self, key: &str) -> Result<(), SnapError> {
        let r = self
            .meta
            .get(key)
            .ok_or_else(|| SnapError::NotFound(key.to_owned()))?
            .clone();
        if self.committing.contains_key(key) {
            return Err(SnapError::FailedPrecondition(format!(
                "cannot remove snapshot {key:?}: it is being committed"
            )));
        }
        if let Some(child) = self
            .meta
            .records()
            .find(|c| c.parent.as_deref() == Some(key))
        {
            return Err(SnapError::FailedPrecondition(format!(
                "cannot remove snapshot {key:?}: it has children (e.g. {:?})",
                child.key
            )));
        }
        self.meta.remove(key)?;
        self.remove_dir(&self.snap_dir(r.id));
        if let Some(img) = &r.parent_image {
            self.release_chain(img);
        }
        if let Some(l) = &r.layer {
            self.release_chain(&l.image);
            if let Err(e) = self.store.remove_ref(&l.ref_name) {
                tracing::warn!("removing ref {}: {e}", l.ref_name);
            }
        }
        Ok(())
    }

    /// Replaces labels as `paths` say (containerd's field paths: `labels`
    /// or `labels.NAME`; none means all labels).
    pub fn update(
        &mut self,
        info: proto::Info,
        paths: &[String],
    ) -> Result<proto::Info, SnapError> {
        let mut r = self
            .meta
            .get(&info.name)
            .ok_or_else(|| SnapError::NotFound(info.name.clone()))?
            .clone();
        if paths.is_empty() {
            r.labels = info.labels.into_iter().collect();
        } else {
            for p in paths {
                if p == "labels" {
                    r.labels = info.labels.clone().into_iter().collect();
                } else if let Some(l) = p.strip_prefix("labels.") {
                    match info.labels.get(l) {
                        Some(v) => {
                            r.labels.insert(l.to_owned(), v.clone());
                        }
                        None => {
                            r.labels.remove(l);
                        }
                    }
                } else {
                    return Err(SnapError::InvalidArgument(format!(
                        "cannot update {p:?} field on snapshot {:?}",
                        info.name
                    )));
                }
            }
        }
        r.updated = Time::now();
        self.meta.put(r.clone(), None)?;
        Ok(to_info(&r))
    }

    pub fn list(&self) -> Vec<proto::Info> {
        let mut v: Vec<_> = self.meta.records().map(to_info).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn usage(&self, key: &str) -> Result<Usage, SnapError> {
        let r = self
            .meta
            .get(key)
            .ok_or_else(|| SnapError::NotFound(key.to_owned()))?;
        if let Some(l) = &r.layer {
            return Ok(Usage {
                size: l.size as i64,
                inodes: l.entries as i64,
            });
        }
        let fsd = self.snap_dir(r.id).join("fs");
        if !fsd.exists() {
            return Ok(Usage::default());
        }
        disk_usage(&fsd).map_err(internal(fsd.display()))
    }

    /// Removes snapshot directories no record names, and unmounts chain
    /// images nothing keeps (see [`Self::chain_kept`]).
    pub fn cleanup(&mut self) -> Result<(), SnapError> {
        let ids: HashSet<u64> = self.meta.records().map(|r| r.id).collect();
        for e in fs::read_dir(&self.dir).map_err(internal(self.dir.display()))? {
            let e = e.map_err(internal(self.dir.display()))?;
            let name = e.file_name();
            let Some(id) = name.to_str().and_then(|n| n.parse::<u64>().ok()) else {
                continue;
            };
            if !ids.contains(&id) {
                self.remove_dir(&e.path());
            }
        }
        // The space is back when Cleanup returns (containerd calls it for
        // that), also that of the snapshots removed before it.
        self.reaper.wait();
        let chains = self.dir.join("chains");
        for e in fs::read_dir(&chains).map_err(internal(chains.display()))? {
            let e = e.map_err(internal(chains.display()))?;
            let img = e.file_name().to_string_lossy().into_owned();
            self.release_chain(&img);
        }
        // Refs of committed snapshots whose record is gone.
        let live: HashSet<String> = self
            .meta
            .records()
            .filter_map(|r| r.layer.as_ref().map(|l| l.ref_name.clone()))
            .chain(
                self.committing
                    .values()
                    .map(|id| format!("{REF_PREFIX}{id}")),
            )
            .collect();
        let refs = self
            .store
            .list_refs()
            .map_err(|e| SnapError::Internal(format!("listing refs: {e}")))?;
        for (name, _) in refs {
            if name.starts_with(REF_PREFIX) && !live.contains(&name) {
                let _ = self.store.remove_ref(&name);
            }
        }
        Ok(())
    }
}

fn to_ts(t: Time) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.sec,
        nanos: t.nsec as i32,
    }
}

fn to_info(r: &Record) -> proto::Info {
    proto::Info {
        name: r.key.clone(),
        parent: r.parent.clone().unwrap_or_default(),
        kind: match r.kind {
            Kind::Active => proto::Kind::Active,
            Kind::View => proto::Kind::View,
            Kind::Committed => proto::Kind::Committed,
        } as i32,
        created_at: Some(to_ts(r.created)),
        updated_at: Some(to_ts(r.updated)),
        labels: r.labels.clone().into_iter().collect(),
    }
}
/// Bytes (allocated blocks) and inodes under `root`, each inode counted
/// once, as containerd's overlayfs snapshotter counts them.
fn disk_usage(root: &Path) -> io::Result<Usage> {
    let mut seen = HashSet::new();
    let mut u = Usage::default();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = fs::symlink_metadata(&p)?;
        if seen.insert((md.dev(), md.ino())) {
            u.inodes += 1;
            u.size += (md.blocks() * 512) as i64;
        }
        if md.is_dir() {
            for e in fs::read_dir(&p)? {
                stack.push(e?.path());
            }
        }
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of the protocol that need no mount: a parentless
    /// snapshot, its commit into the store, and the error kinds.
    #[test]
    fn parentless_commit_and_errors() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Snapshotter::open(d.path()).unwrap();
        assert!(matches!(
            Snapshotter::open(d.path()),
            Err(SnapError::Internal(m)) if m.contains("another snapshotter")
        ));
        let m = s.prepare("a", "", HashMap::new()).unwrap();
        assert_eq!(m[0].r#type, "bind");
        assert!(matches!(
            s.prepare("a", "", HashMap::new()),
            Err(SnapError::AlreadyExists(_))
        ));
        assert!(matches!(
            s.prepare("b", "nope", HashMap::new()),
            Err(SnapError::NotFound(_))
        ));
        assert!(matches!(
            s.prepare("b", "a", HashMap::new()),
            Err(SnapError::InvalidArgument(_))
        ));
        let fs_dir = PathBuf::from(&m[0].source);
        fs::write(fs_dir.join("hello"), vec![b'x'; 4096]).unwrap();
        fs::create_dir(fs_dir.join("etc")).unwrap();
        fs::write(fs_dir.join("etc/small"), b"hi\n").unwrap();
        let u = s.usage("a").unwrap();
        assert!(u.inodes >= 4 && u.size >= 4096, "{u:?}");
        assert!(matches!(
            s.commit("c", "nope", HashMap::new()),
            Err(SnapError::NotFound(_))
        ));
        s.commit("c", "a", HashMap::from([("l".into(), "1".into())]))
            .unwrap();
        assert!(matches!(s.info("a"), Err(SnapError::NotFound(_))));
        let info = s.info("c").unwrap();
        assert_eq!(info.kind, proto::Kind::Committed as i32);
        assert_eq!(info.labels["l"], "1");
        assert!(!fs_dir.exists());
        assert!(matches!(
            s.mounts("c"),
            Err(SnapError::FailedPrecondition(_))
        ));
        assert!(matches!(
            s.commit("c2", "c", HashMap::new()),
            Err(SnapError::FailedPrecondition(_))
        ));
        let rec = s.meta.get("c").unwrap().clone();
        let layer = rec.layer.unwrap();
        assert_eq!(layer.chain, vec![layer.diff_id.clone()]);
        assert!(s.store.has_image(&layer.image));
        assert_eq!(
            s.store.get_ref(&layer.ref_name).unwrap().as_deref(),
            Some(layer.image.as_str())
        );
        assert_eq!(s.usage("c").unwrap().inodes, layer.entries as i64);
        // Labels: one, then all.
        let mut i = s.info("c").unwrap();
        i.labels = HashMap::from([("m".into(), "2".into())]);
        let got = s.update(i.clone(), &["labels.m".into()]).unwrap();
        assert_eq!(got.labels.len(), 2);
        let got = s.update(i.clone(), &[]).unwrap();
        assert_eq!(got.labels.len(), 1);
        assert!(matches!(
            s.update(i, &["parent".into()]),
            Err(SnapError::InvalidArgument(_))
        ));
        assert_eq!(s.list().len(), 1);
        // Survives a restart.
        drop(s);
        let mut s = Snapshotter::open(d.path()).unwrap();
        assert_eq!(s.info("c").unwrap().labels["m"], "2");
        // Cleanup removes a directory no record names; Remove the ref.
        fs::create_dir_all(d.path().join("snapshots/999/fs")).unwrap();
        s.cleanup().unwrap();
        assert!(!d.path().join("snapshots/999").exists());
        s.remove("c").unwrap();
        assert!(s.store.get_ref(&layer.ref_name).unwrap().is_none());
        assert!(matches!(s.remove("c"), Err(SnapError::NotFound(_))));
    }
}

#[cfg(test)]
mod chain_tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::meta::LazyChain;

    fn put(s: &mut Snapshotter, key: &str, kind: Kind, parent: Option<&str>, image: &str) {
        let id = s.meta.allocate_id();
        let committed = kind == Kind::Committed;
        let rec = Record {
            format: RECORD_FORMAT,
            id,
            key: key.to_owned(),
            kind,
            parent: parent.map(str::to_owned),
            parent_image: (!committed).then(|| image.to_owned()),
            labels: BTreeMap::new(),
            created: Time::now(),
            updated: Time::now(),
            layer: committed.then(|| Layer {
                diff_id: format!("d-{key}"),
                chain: Vec::new(),
                image: image.to_owned(),
                ref_name: format!("{REF_PREFIX}{id}"),
                size: 0,
                entries: 0,
                lazy: None,
            }),
        };
        s.meta.put(rec, None).unwrap();
    }

    /// The snapshot directories are spread over ext4's block groups (see
    /// `spread_subdirectories`), where the filesystem has the flag.
    #[test]
    fn snapshot_directories_are_spread() {
        use rustix::fs::{ioctl_getflags, IFlags};
        let d = tempfile::tempdir().unwrap();
        // ext2/3/4 (one magic number); others may refuse the flag.
        let ext4 = rustix::fs::statfs(d.path()).unwrap().f_type == 0xEF53;
        let _s = Snapshotter::open(d.path()).unwrap();
        let snapshots = File::open(d.path().join("snapshots")).unwrap();
        if ext4 {
            assert!(ioctl_getflags(&snapshots).unwrap().contains(IFlags::TOPDIR));
        }
    }

    /// What keeps a chain mount (no mount needed: the rule reads the
    /// records): an active or view snapshot on it, or its committed
    /// snapshot while that is the top of its chain; an intermediate
    /// chain only while a snapshot is on it.
    #[test]
    fn what_keeps_a_chain_mount() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Snapshotter::open(d.path()).unwrap();
        put(&mut s, "l1", Kind::Committed, None, "i1");
        put(&mut s, "l2", Kind::Committed, Some("l1"), "i2");
        assert!(!s.chain_kept("i1"), "an intermediate layer's chain");
        assert!(s.chain_kept("i2"), "the top's chain");
        put(&mut s, "unpack", Kind::Active, Some("l1"), "i1");
        assert!(s.chain_kept("i1"), "an active snapshot on it");
        s.meta.remove("unpack").unwrap();
        put(&mut s, "c1", Kind::Active, Some("l2"), "i2");
        put(&mut s, "v1", Kind::View, Some("l2"), "i2");
        s.meta.remove("c1").unwrap();
        s.meta.remove("v1").unwrap();
        assert!(s.chain_kept("i2"), "the top's chain, no container left");
        // A container committed as an image: the top has a committed
        // child, its chain is an intermediate one now.
        put(&mut s, "l3", Kind::Committed, Some("l2"), "i3");
        assert!(!s.chain_kept("i2"));
        s.meta.remove("l3").unwrap();
        s.meta.remove("l2").unwrap();
        assert!(!s.chain_kept("i2"), "the image's snapshots removed");
        // l1 is a top now: i1 would stay mounted were it mounted (the
        // rule keeps, it does not mount).
        assert!(s.chain_kept("i1"));
        s.meta.remove("l1").unwrap();
        // A lazily pulled image: every layer names the whole image; the
        // intermediate (partial) ones do not keep it.
        put(&mut s, "z1", Kind::Committed, None, "lz");
        put(&mut s, "z2", Kind::Committed, Some("z1"), "lz");
        for (k, partial) in [("z1", true), ("z2", false)] {
            let mut r = s.meta.get(k).unwrap().clone();
            r.layer.as_mut().unwrap().lazy = Some(LazyChain {
                image_ref: "r".into(),
                manifest_digest: "m".into(),
                partial,
            });
            s.meta.put(r, None).unwrap();
        }
        assert!(s.chain_kept("lz"));
        s.meta.remove("z2").unwrap();
        assert!(!s.chain_kept("lz"), "kept by a partial layer alone");
    }
}

#[cfg(test)]
mod remote_tests {
    use super::*;
    use crate::remote::{IMAGE_REF, LAYER_DIGEST, TARGET_REF};

    /// A remote Prepare whose pull fails (nothing listens on the
    /// registry's port) falls back to the usual Prepare: mounts for
    /// containerd to unpack into, no target snapshot.
    #[test]
    fn remote_prepare_falls_back_when_the_pull_fails() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Snapshotter::open(d.path()).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let labels = HashMap::from([
            (TARGET_REF.to_owned(), "sha256:target".to_owned()),
            (IMAGE_REF.to_owned(), format!("127.0.0.1:{port}/x/y:1")),
            (
                LAYER_DIGEST.to_owned(),
                format!("sha256:{}", "0".repeat(64)),
            ),
        ]);
        let m = s.prepare("extract-1", "", labels.clone()).unwrap();
        assert_eq!(m[0].r#type, "bind");
        assert!(matches!(
            s.info("sha256:target"),
            Err(SnapError::NotFound(_))
        ));
        assert!(s.reserved.is_empty());
        // A parent that is not committed: the usual Prepare's error.
        assert!(matches!(
            s.prepare("extract-2", "extract-1", labels),
            Err(SnapError::InvalidArgument(_))
        ));
    }
}
