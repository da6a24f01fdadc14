//! Garbage collection: removes the images, layer records and objects that
//! no ref and no live mount reaches, and the staging debris of writers that
//! are gone.
//!
//! Mark and sweep, under the store lock taken exclusive:
//!
//! - roots: every image a ref names, and every image mounted anywhere (see
//!   the `mounts` module);
//! - mark: each root image; every object its files are backed by (read
//!   from the EROFS image itself); the layer records its image record lists
//!   (they stay as the layer cache of images in use) and every object those
//!   records hold;
//! - sweep: everything else under `images/`, `layers/` and `objects/`,
//!   then `tmp/` entries no live writer holds.
//!
//! Writers (imports, pulls, `mkfs --store`, tagging, mounting) hold the
//! lock shared for their whole operation, from the first object they write
//! or the image they look up to the ref or mount that makes the result a
//! root, so gc never sees a half-built image: it waits for them, and they
//! wait for it.
//!
//! gc refuses to run, removing nothing, when it cannot tell what a root
//! needs: a ref that holds no digest, a root image that cannot be read, a
//! layer record of a root image that cannot be read, a mount of an image
//! that is no longer in the store. `fsck --repair` deals with the first
//! three. A ref naming a missing image is no root and no obstacle.
//!
//! This module holds the store's only remover of published files
//! ([`Store::remove_entry`], which fsck's repair uses too); gc never
//! removes anything a root reaches.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::io;
use std::path::Path;

use crate::graph::{tree_sizes, ImageContents};
use crate::mounts::LiveMount;
use crate::verity::ObjectId;
use crate::{Store, StoreError};

/// What [`Store::gc`] does.
#[derive(Debug, Clone, Copy, Default)]
pub struct GcOptions {
    /// Report what would be removed, remove nothing.
    pub dry_run: bool,
}

/// One removed file (an image or a layer record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// Image digest or layer name.
    pub name: String,
    /// Apparent size, with the files that went with it.
    pub bytes: u64,
}

/// What [`Store::gc`] removed (or, dry, would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub dry_run: bool,
    pub images: Vec<Removed>,
    pub layers: Vec<Removed>,
    pub objects: u64,
    pub object_bytes: u64,
    /// Stale `tmp/` entries removed (0 on a dry run).
    pub tmp_entries: usize,
    pub kept_images: u64,
    pub kept_layers: u64,
    pub kept_objects: u64,
    /// The mounts that kept images alive.
    pub live_mounts: Vec<LiveMount>,
}

impl GcReport {
    pub fn bytes_freed(&self) -> u64 {
        self.images.iter().map(|r| r.bytes).sum::<u64>()
            + self.layers.iter().map(|r| r.bytes).sum::<u64>()
            + self.object_bytes
    }
}

/// What the roots reach.
#[derive(Debug, Default)]
pub(crate) struct Marked {
    pub images: BTreeSet<String>,
    pub layers: BTreeSet<String>,
    pub objects: HashSet<ObjectId>,
}

impl Store {
    /// Collects garbage; see the module docs. Waits for writers to finish.
    pub fn gc(&self, opts: &GcOptions) -> Result<GcReport, StoreError> {
        let _lock = self.lock_exclusive()?;
        let refused = |reason: String| StoreError::GcRefused {
            root: self.root.clone(),
            reason,
        };
        let mut roots: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in self.scan_refs()? {
            match r.target {
                Ok(digest) if self.has_image(&digest) => roots
                    .entry(digest)
                    .or_default()
                    .push(format!("named {}", r.name)),
                Ok(_) => {}
                Err(reason) => {
                    return Err(refused(format!(
                        "ref {:?} is corrupt ({reason}); `cairn fsck --repair` removes it",
                        r.name
                    )))
                }
            }
        }
        let live = self.live_mounts()?;
        for m in &live {
            if !m.in_store {
                return Err(refused(format!(
                    "image {} is mounted on {} (process {}) but is no longer in the store, so \
                     the objects it uses are unknown; unmount it first",
                    m.digest,
                    m.mount_point.display(),
                    m.pid
                )));
            }
            roots
                .entry(m.digest.clone())
                .or_default()
                .push(format!("mounted on {}", m.mount_point.display()));
        }

        let mut contents = BTreeMap::new();
        for (digest, why) in &roots {
            match self.image_contents(digest) {
                Ok(c) => {
                    contents.insert(digest.clone(), c);
                }
                Err(e) => {
                    return Err(refused(format!(
                        "image {digest} ({}) cannot be read: {e}; `cairn fsck --repair` removes it",
                        why.join(", ")
                    )))
                }
            }
        }
        let marked = self.mark(&contents, false)?;

        let mut report = GcReport {
            dry_run: opts.dry_run,
            live_mounts: live,
            ..GcReport::default()
        };
        // Images first, objects last: at no moment does an image in the
        // store lack an object that was there when it was marked.
        for digest in self.list_images()? {
            let digest = digest?;
            if marked.images.contains(&digest) {
                report.kept_images += 1;
                continue;
            }
            let mut files = vec![self.image_path(&digest)];
            files.extend(self.image_side_files(&digest));
            let bytes = self.sweep(&files, opts.dry_run)?;
            report.images.push(Removed {
                name: digest,
                bytes,
            });
        }
        for digest in self.orphan_image_records()? {
            let bytes = self.sweep(&self.image_side_files(&digest), opts.dry_run)?;
            report.images.push(Removed {
                name: format!("{digest} (record only)"),
                bytes,
            });
        }
        for layer in self.layer_entries()? {
            if marked.layers.contains(&layer.name) {
                report.kept_layers += 1;
                continue;
            }
            let bytes = self.sweep(std::slice::from_ref(&layer.path), opts.dry_run)?;
            report.layers.push(Removed {
                name: layer.name,
                bytes,
            });
        }
        for id in self.list_objects()? {
            let id = id?;
            if marked.objects.contains(&id) {
                report.kept_objects += 1;
                continue;
            }
            report.object_bytes += self.sweep(&[self.object_path(&id)], opts.dry_run)?;
            report.objects += 1;
            tracing::debug!(object = %id, dry_run = opts.dry_run, "unreferenced object");
        }
        if !opts.dry_run {
            for dir in [self.images_dir(), self.layers_dir()] {
                crate::tmp::sync_dir(&dir, &self.root)?;
            }
            report.tmp_entries = self.clean_tmp()?;
        }
        report.images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(report)
    }

    /// Marks what the images in `roots` (already read) reach. Unless
    /// `lenient`, a layer record that cannot be read is an error (its
    /// objects would be unknown); lenient marking skips it.
    pub(crate) fn mark(
        &self,
        roots: &BTreeMap<String, ImageContents>,
        lenient: bool,
    ) -> Result<Marked, StoreError> {
        let mut marked = Marked::default();
        for (digest, c) in roots {
            marked.images.insert(digest.clone());
            marked.objects.extend(c.objects.keys().copied());
            // An incomplete eStargz image names its files by sha256; the
            // ones its lazy layer stored are kept under their object ids.
            marked.objects.extend(self.lazy_named_objects(digest));
            match self.image_layers(digest) {
                Ok(Some(layers)) => marked.layers.extend(layers),
                Ok(None) => {}
                Err(e) if lenient => tracing::debug!("{e}"),
                Err(e) => return Err(e),
            }
        }
        for layer in self.layer_entries()? {
            if !marked.layers.contains(&layer.name) {
                continue;
            }
            match self.layer_objects(&layer) {
                Ok(ids) => marked.objects.extend(ids),
                Err(_) if lenient => {}
                Err(e) => {
                    return Err(StoreError::GcRefused {
                        root: self.root.clone(),
                        reason: format!(
                            "{e}; an image in use lists that layer, so the objects it keeps \
                             are unknown (`cairn fsck --repair` removes the record)"
                        ),
                    })
                }
            }
        }
        Ok(marked)
    }

    /// Removes `files` (unless `dry`), returning their apparent size. Files
    /// already gone count 0.
    fn sweep(&self, files: &[std::path::PathBuf], dry: bool) -> Result<u64, StoreError> {
        let mut bytes = 0;
        for path in files {
            let size = tree_sizes(path)
                .map_err(|e| StoreError::io("measuring", path, &self.root, e))?
                .map_or(0, |(b, _)| b);
            if !dry {
                self.remove_entry(path)?;
            }
            bytes += size;
        }
        Ok(bytes)
    }
}

impl Store {
    /// Removes a published file, or a directory (a layer, or whatever
    /// stands where a file should be); a name already gone is fine.
    ///
    /// A directory is first renamed into this Store's staging directory and
    /// only then emptied, so that a crash halfway never leaves a layer
    /// that looks complete and is not (its record without its dump): the
    /// debris is in `tmp/`, which the next `clean_tmp` removes.
    pub(crate) fn remove_entry(&self, path: &Path) -> Result<(), StoreError> {
        let result = match fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let doomed = self.staging()?.path().join(format!("rm.{name}"));
                fs::rename(path, &doomed).and_then(|()| fs::remove_dir_all(&doomed))
            }
            Ok(_) => fs::remove_file(path),
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("removing", path, &self.root, e)),
        }
    }
}
