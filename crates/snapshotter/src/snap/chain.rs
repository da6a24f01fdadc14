//! The chain mounts: each image's EROFS metadata image mounted read-only
//! at `chains/<image>`, the lower layer of every container rootfs on it,
//! and when one stays mounted (docs/snapshotter.md, "Mounts").

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cairn_mount::{mount_image, MountOptions, UpperSpec, VerityMode};

use super::{internal, LazyMounter, SnapError, Snapshotter};
use crate::meta::Kind;

/// A chain mount under way without the snapshotter's lock: set once it
/// has ended (mounted or not).
#[derive(Default)]
pub(crate) struct MountFlight {
    done: Mutex<bool>,
    ended: Condvar,
}

impl MountFlight {
    fn end(&self) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.ended.notify_all();
    }

    fn wait(&self) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while !*done {
            done = self.ended.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The mount of an incomplete chain image, begun right after its lazy
/// pull by [`Snapshotter::begin_background_mount`] and run without the
/// snapshotter's lock (docs/snapshotter.md, "The lazy remote path").
pub(crate) struct BackgroundMount {
    image: String,
    root: PathBuf,
    target: PathBuf,
    mounter: Arc<dyn LazyMounter>,
    flight: Arc<MountFlight>,
}

impl Drop for BackgroundMount {
    /// Ends the flight also if the mount never ran or unwound: a Prepare
    /// waiting for it then mounts the chain itself.
    fn drop(&mut self) {
        self.flight.end();
    }
}

impl BackgroundMount {
    /// Mounts the chain image (the lazy server starts and fetches the
    /// prefetch list); how long it took, or why it failed.
    pub fn run(&self) -> Result<Duration, String> {
        let t0 = Instant::now();
        let r = self.mounter.mount(&self.root, &self.image, &self.target);
        self.flight.end();
        r.map(|()| t0.elapsed())
    }
}

impl Snapshotter {
    /// Mounts the chain image `img` read-only at `chains/<img>` unless it
    /// is mounted there already.
    pub(super) fn ensure_chain_mounted(&self, img: &str) -> Result<(), SnapError> {
        let target = self.chain_dir(img);
        match fs::DirBuilder::new().mode(0o755).create(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(internal(target.display())(e)),
        }
        if let Some(f) = self.mounting.get(img) {
            // Mounted right after its pull, and not done yet: wait for
            // it (it needs no lock of ours to end), else mount below.
            f.wait();
        }
        if is_mountpoint(&target) {
            return Ok(());
        }
        if self.incomplete(img) {
            let Some(m) = &self.lazy else {
                return Err(SnapError::Internal(format!(
                    "chain image {img} is incomplete (pulled lazily) and this snapshotter \
                     serves no lazy layers (started with --no-lazy?)"
                )));
            };
            return m
                .mount(self.store.root(), img, &target)
                .map_err(|e| SnapError::Internal(format!("mounting lazy chain image {img}: {e}")));
        }
        let image = self.store.image_path(img);
        let objects = self.store.objects_dir();
        let t0 = Instant::now();
        let r = mount_image(&MountOptions {
            image: &image,
            objects: &objects,
            local_objects: None,
            target: &target,
            upper: UpperSpec::None,
            idmap: None,
            verity: VerityMode::Off,
        });
        tracing::debug!(
            "chain image {img}: mounted in {:.3} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        r.map_err(|e| SnapError::Internal(format!("mounting chain image {img}: {e}")))
    }

    fn incomplete(&self, img: &str) -> bool {
        super::image_incomplete(&self.store, img)
    }

    /// Begins mounting the incomplete chain image `img` at `chains/<img>`
    /// ahead of its first container, when it is neither mounted nor being
    /// mounted: the caller runs the mount without the lock, then calls
    /// [`Self::finish_background_mount`]. Meanwhile a Prepare on the chain
    /// waits for it, and a release leaves the chain to the finish.
    pub(crate) fn begin_background_mount(&mut self, img: &str) -> Option<BackgroundMount> {
        let mounter = self.lazy.clone()?;
        if crate::stopping() || self.mounting.contains_key(img) || !self.incomplete(img) {
            return None;
        }
        let target = self.chain_dir(img);
        match fs::DirBuilder::new().mode(0o755).create(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                tracing::warn!(
                    "chain image {img}: not mounted ahead: {}: {e}",
                    target.display()
                );
                return None;
            }
        }
        if is_mountpoint(&target) {
            return None;
        }
        let flight = Arc::new(MountFlight::default());
        self.mounting.insert(img.to_owned(), flight.clone());
        Some(BackgroundMount {
            image: img.to_owned(),
            root: self.store.root().to_path_buf(),
            target,
            mounter,
            flight,
        })
    }

    /// Ends a mount begun by [`Self::begin_background_mount`]: logs how it
    /// went, and releases the chain if what kept it went meanwhile (its
    /// snapshots removed while it was being mounted).
    pub(crate) fn finish_background_mount(
        &mut self,
        m: BackgroundMount,
        r: Result<Duration, String>,
    ) {
        self.mounting.remove(&m.image);
        match r {
            Ok(t) => tracing::info!(
                "chain image {}: mounted ahead of its first container, in {:.3} ms",
                m.image,
                t.as_secs_f64() * 1e3
            ),
            Err(e) => tracing::warn!(
                "chain image {}: not mounted ahead of its first container ({e}); \
                 its first container's Prepare mounts it",
                m.image
            ),
        }
        self.release_chain(&m.image);
    }

    /// Whether `chains/<img>` stays mounted: an active or view snapshot
    /// is on it, or it is the chain image of a committed snapshot at the
    /// top of its chain (no committed child; an intermediate layer pulled
    /// lazily names the whole image, not its chain, and does not count).
    /// Intermediate chains mounted to unpack the layer above them go once
    /// that layer is committed; an image's top stays mounted between
    /// containers until the image's snapshots are removed
    /// (docs/snapshotter.md, "Mounts").
    pub(super) fn chain_kept(&self, img: &str) -> bool {
        let mut tops = Vec::new();
        for r in self.meta.records() {
            match (&r.kind, &r.layer) {
                (Kind::Committed, Some(l))
                    if l.image == img && !l.lazy.as_ref().is_some_and(|z| z.partial) =>
                {
                    tops.push(r.key.as_str())
                }
                (Kind::Committed, _) => {}
                _ if r.parent_image.as_deref() == Some(img) => return true,
                _ => {}
            }
        }
        if tops.is_empty() {
            return false;
        }
        let parents: HashSet<&str> = self
            .meta
            .records()
            .filter(|c| c.kind == Kind::Committed)
            .filter_map(|c| c.parent.as_deref())
            .collect();
        tops.iter().any(|k| !parents.contains(k))
    }

    /// Unmounts `chains/<img>` unless [`Self::chain_kept`], or being
    /// mounted (the mount's finish releases it then).
    pub(super) fn release_chain(&self, img: &str) {
        if self.mounting.contains_key(img) || self.chain_kept(img) {
            return;
        }
        let target = self.chain_dir(img);
        if is_mountpoint(&target) {
            if let Err(e) = rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH) {
                tracing::warn!("unmounting {}: {e}", target.display());
                return;
            }
        }
        let _ = fs::remove_dir(&target);
    }

    /// The chain mount points under `chains/`, and whether each is mounted.
    pub fn chain_mounts(&self) -> BTreeMap<String, bool> {
        let mut m = BTreeMap::new();
        if let Ok(rd) = fs::read_dir(self.dir.join("chains")) {
            for e in rd.flatten() {
                m.insert(
                    e.file_name().to_string_lossy().into_owned(),
                    is_mountpoint(&e.path()),
                );
            }
        }
        m
    }
}

/// Whether `p` is the root of a mount (its device differs from its parent's).
fn is_mountpoint(p: &Path) -> bool {
    let (Ok(a), Some(Ok(b))) = (
        fs::symlink_metadata(p),
        p.parent().map(fs::symlink_metadata),
    ) else {
        return false;
    };
    a.dev() != b.dev() || a.ino() == b.ino()
}
