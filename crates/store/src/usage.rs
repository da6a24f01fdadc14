//! Where the bytes go: per-image sizes (what each image holds, what it
//! shares with other images and what only it uses) and the store's totals
//! by category, logical against physical.
//!
//! This module only reads (no lock: a report taken while an import runs is
//! simply a moment of it). It never fails on one bad image or ref: those
//! are noted in the report for `fsck` to deal with.
//!
//! Sizes are apparent sizes (`st_size`), which add up the same on every
//! filesystem; `disk_bytes` (allocated blocks) is given beside them, and is
//! what `du` shows.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::SystemTime;

use crate::graph::{file_sizes, tree_sizes, ImageContents};
use crate::mounts::LiveMount;
use crate::verity::ObjectId;
use crate::{Store, StoreError};

/// How many files and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Category {
    pub count: u64,
    /// Apparent size.
    pub bytes: u64,
    /// Allocated size (`st_blocks` × 512).
    pub disk_bytes: u64,
}

impl Category {
    fn add(&mut self, bytes: u64, disk_bytes: u64) {
        self.count += 1;
        self.bytes += bytes;
        self.disk_bytes += disk_bytes;
    }
}

/// One image of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageUsage {
    pub digest: String,
    /// Refs pointing at it, sorted.
    pub names: Vec<String>,
    /// When it entered the store (the image file's mtime).
    pub stored: Option<SystemTime>,
    pub image_bytes: u64,
    /// Distinct objects its files use.
    pub objects: u64,
    /// Their bytes (those present).
    pub object_bytes: u64,
    /// Objects it uses that are not in the store.
    pub missing_objects: u64,
    /// Object bytes other images use too.
    pub shared_bytes: u64,
    /// The image file plus the objects no other image uses: what removing
    /// only this image would free.
    pub unique_bytes: u64,
    /// Sum of its regular files' sizes: what a mount shows.
    pub logical_bytes: u64,
    pub regular_files: u64,
    pub inodes: u64,
    /// Where it is mounted now.
    pub mounts: Vec<PathBuf>,
    /// Why the image could not be read, if it could not (all counts 0).
    pub error: Option<String>,
}

impl ImageUsage {
    /// The image file and its objects.
    pub fn total_bytes(&self) -> u64 {
        self.image_bytes + self.object_bytes
    }
}

/// The whole store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Every image, named ones first, each group by digest.
    pub images: Vec<ImageUsage>,
    pub objects: Category,
    pub image_files: Category,
    pub layers: Category,
    /// Staging debris and writes in progress.
    pub tmp: Category,
    pub refs: u64,
    /// Sum over images of their files' sizes.
    pub logical_bytes: u64,
    /// What no name and no live mount reaches: what `gc` would free.
    pub unreferenced: Category,
    /// Refs that do not point at a readable image (see `fsck`).
    pub broken_refs: Vec<String>,
}

impl StoreUsage {
    /// Objects, images and layer records: what the store holds on disk.
    pub fn physical_bytes(&self) -> u64 {
        self.objects.bytes + self.image_files.bytes + self.layers.bytes
    }

    /// Logical bytes per physical byte (1.0 for an empty store).
    pub fn dedup_ratio(&self) -> f64 {
        match self.physical_bytes() {
            0 => 1.0,
            p => self.logical_bytes as f64 / p as f64,
        }
    }
}

impl Store {
    /// Measures the store; see [`StoreUsage`].
    pub fn usage(&self) -> Result<StoreUsage, StoreError> {
        let mut u = StoreUsage::default();
        let refs = self.scan_refs()?;
        u.refs = refs.len() as u64;
        let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in &refs {
            match &r.target {
                Ok(d) if self.has_image(d) => {
                    names.entry(d.clone()).or_default().push(r.name.clone())
                }
                _ => u.broken_refs.push(r.name.clone()),
            }
        }
        let live = self.live_mounts()?;

        let mut objects: HashMap<ObjectId, (u64, u64)> = HashMap::new();
        for id in self.list_objects()? {
            let id = id?;
            let path = self.object_path(&id);
            if let Some((bytes, disk)) =
                file_sizes(&path).map_err(|e| StoreError::io("measuring", &path, &self.root, e))?
            {
                objects.insert(id, (bytes, disk));
                u.objects.add(bytes, disk);
            }
        }

        let mut contents: BTreeMap<String, Result<ImageContents, StoreError>> = BTreeMap::new();
        let mut image_disk: BTreeMap<String, (u64, u64, Option<SystemTime>)> = BTreeMap::new();
        let mut record_sizes: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut lazy_names: BTreeMap<String, HashMap<ObjectId, ObjectId>> = BTreeMap::new();
        for digest in self.list_images()? {
            let digest = digest?;
            let path = self.image_path(&digest);
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io("measuring", &path, &self.root, e)),
            };
            use std::os::unix::fs::MetadataExt;
            u.image_files.add(meta.len(), meta.blocks() * 512);
            // Its record is part of it (counted in bytes, not in images).
            for side in self.image_side_files(&digest) {
                if let Ok(Some((bytes, disk))) = file_sizes(&side) {
                    u.image_files.bytes += bytes;
                    u.image_files.disk_bytes += disk;
                    let r = record_sizes.entry(digest.clone()).or_insert((0, 0));
                    r.0 += bytes;
                    r.1 += disk;
                }
            }
            image_disk.insert(
                digest.clone(),
                (meta.len(), meta.blocks() * 512, meta.modified().ok()),
            );
            contents.insert(digest.clone(), self.image_contents(&digest));
            // An incomplete eStargz image names its files by sha256; the
            // ones its lazy layer stored are objects named otherwise.
            let names = self.lazy_names(&digest);
            if !names.is_empty() {
                lazy_names.insert(digest.clone(), names);
            }
        }
        // The object that holds each of an image's files, if stored.
        let stored_as = |digest: &str, id: &ObjectId| -> ObjectId {
            lazy_names
                .get(digest)
                .and_then(|n| n.get(id))
                .copied()
                .unwrap_or(*id)
        };

        // How many images use each object.
        let mut users: HashMap<ObjectId, u32> = HashMap::new();
        for (digest, c) in &contents {
            let Ok(c) = c else { continue };
            for id in c.objects.keys() {
                *users.entry(stored_as(digest, id)).or_default() += 1;
            }
        }

        for (digest, c) in &contents {
            let (image_bytes, _, stored) = image_disk[digest];
            let mut iu = ImageUsage {
                digest: digest.clone(),
                names: names.get(digest).cloned().unwrap_or_default(),
                stored,
                image_bytes,
                objects: 0,
                object_bytes: 0,
                missing_objects: 0,
                shared_bytes: 0,
                unique_bytes: image_bytes,
                logical_bytes: 0,
                regular_files: 0,
                inodes: 0,
                // One path once: a mount namespace made while the image was
                // mounted holds a copy of the same mount point.
                mounts: live
                    .iter()
                    .filter(|m| &m.digest == digest)
                    .map(|m| m.mount_point.clone())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect(),
                error: None,
            };
            match c {
                Ok(c) => {
                    iu.logical_bytes = c.logical_bytes;
                    iu.regular_files = c.regular_files;
                    iu.inodes = c.inodes;
                    iu.objects = c.objects.len() as u64;
                    for id in c.objects.keys() {
                        let id = &stored_as(digest, id);
                        let Some(&(bytes, _)) = objects.get(id) else {
                            iu.missing_objects += 1;
                            continue;
                        };
                        iu.object_bytes += bytes;
                        if users.get(id).copied().unwrap_or(0) > 1 {
                            iu.shared_bytes += bytes;
                        } else {
                            iu.unique_bytes += bytes;
                        }
                    }
                    u.logical_bytes += c.logical_bytes;
                }
                Err(e) => iu.error = Some(e.to_string()),
            }
            u.images.push(iu);
        }
        u.images.sort_by(|a, b| {
            (a.names.is_empty(), &a.names, &a.digest).cmp(&(
                b.names.is_empty(),
                &b.names,
                &b.digest,
            ))
        });

        let mut layer_sizes = BTreeMap::new();
        for layer in self.layer_entries()? {
            // Racing an import or a gc: what vanished meanwhile counts 0.
            if let Ok(Some((bytes, disk))) = tree_sizes(&layer.path) {
                u.layers.add(bytes, disk);
                layer_sizes.insert(layer.name, (bytes, disk));
            }
        }
        let tmp = self.tmp_dir();
        for entry in std::fs::read_dir(&tmp)
            .map_err(|e| StoreError::io("listing", &tmp, &self.root, e))?
            .flatten()
        {
            if let Ok(Some((bytes, disk))) = tree_sizes(&entry.path()) {
                u.tmp.add(bytes, disk);
            }
        }

        // What gc would take: everything the roots do not reach. An image
        // that cannot be read reaches nothing here (gc refuses to run then).
        let roots = root_images(&names, &live);
        let readable: BTreeMap<String, ImageContents> = contents
            .into_iter()
            .filter(|(d, _)| roots.contains(d))
            .filter_map(|(d, c)| c.ok().map(|c| (d, c)))
            .collect();
        let marked = self.mark(&readable, true)?;
        for (digest, (bytes, disk, _)) in &image_disk {
            if !marked.images.contains(digest) {
                let (rb, rd) = record_sizes.get(digest).copied().unwrap_or((0, 0));
                u.unreferenced.add(*bytes + rb, *disk + rd);
            }
        }
        for (id, (bytes, disk)) in &objects {
            if !marked.objects.contains(id) {
                u.unreferenced.add(*bytes, *disk);
            }
        }
        for (name, (bytes, disk)) in &layer_sizes {
            if !marked.layers.contains(name) {
                u.unreferenced.add(*bytes, *disk);
            }
        }
        Ok(u)
    }
}

/// The images refs and live mounts keep.
pub(crate) fn root_images(
    named: &BTreeMap<String, Vec<String>>,
    live: &[LiveMount],
) -> BTreeSet<String> {
    named
        .keys()
        .cloned()
        .chain(live.iter().map(|m| m.digest.clone()))
        .collect()
}
