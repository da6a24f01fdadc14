//! The chain mounts: each image's EROFS metadata image mounted read-only
//! at `chains/<image>`, the lower layer of every container rootfs on it,
//! and when one stays mounted (docs/snapshotter.md, "Mounts").

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;
use std::time::Instant;

use cairn_mount::{mount_image, MountOptions, UpperSpec, VerityMode};

use super::{internal, SnapError, Snapshotter};
use crate::meta::Kind;

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
        if is_mountpoint(&target) {
            return Ok(());
        }
        let incomplete = self
            .store
            .image_record(img)
            .ok()
            .flatten()
            .is_some_and(|r| r.lazy.is_some());
        if incomplete {
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

    /// Unmounts `chains/<img>` unless [`Self::chain_kept`].
    pub(super) fn release_chain(&self, img: &str) {
        if self.chain_kept(img) {
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
