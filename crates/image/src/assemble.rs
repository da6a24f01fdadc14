//! Image assembly: a manifest and config whose layers are in the store →
//! the EROFS image (`images/<sha256>`), its record (`images/<sha256>.json`)
//! and, last, a ref naming it.
//!
//! The order is what keeps the store consistent: every layer record and
//! object exists before the image is published (they are checked), the
//! image before its record, the record before the ref. The store lock is
//! held shared throughout, so garbage collection cannot take what the image
//! is being made of.
//!
//! Every import path writes the image earlier ([`StagedImage`]): from the
//! entries of the layers it imports, as soon as each is checked, or from a
//! tree built while they streamed ([`crate::build_tree_as_imported`]),
//! while their last objects and records are still being published. It
//! publishes the image once they are. When every layer was imported now,
//! no object is looked up again (each import named or found each of its
//! objects under the shared lock); when any was in the store already,
//! every object the image names is: while the image is written when all
//! of them were, at `publish` otherwise.

use std::fs::File;
use std::io::BufReader;

use cairn_erofs::tree::InodeData;
use cairn_erofs::writer::{mkfs_erofs, WriteOptions};
use cairn_erofs::Tree;
use cairn_spec::limits::{MAX_CONFIG_SIZE, MAX_LAYERS, MAX_MANIFEST_SIZE};
use cairn_spec::media_type::DocKind;
use cairn_spec::{parse_digest, sha256_digest, ImageConfig, ImageManifest};
use cairn_store::{
    ref_name_for, ImageRecord, ImageRecordLayer, ImageWriter, ObjectId, Store, StoreLock,
};

use crate::apply::{apply_layer, compact, empty_image};
use crate::early::BuiltTree;
use crate::layer::LayerInfo;
use crate::LayerError;

/// What [`assemble_image`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedImage {
    /// SHA-256 (hex) of the EROFS image: its name under `images/`.
    pub image_digest: String,
    /// `sha256:<hex>` of the manifest.
    pub manifest_digest: String,
    /// `sha256:<hex>` of the config.
    pub config_digest: String,
    /// The layers, bottom first.
    pub layers: Vec<LayerInfo>,
    /// The image name the store now knows it by, if it was given one.
    pub name: Option<String>,
}

fn image_err(what: &'static str, reason: impl Into<String>) -> LayerError {
    LayerError::Image {
        what,
        reason: reason.into(),
    }
}

/// Parses and checks a manifest and its config: sizes within
/// `cairn_spec::limits`, an image manifest (not an index) of schema 2 whose
/// digests are all digests cairn verifies, the config the one the
/// manifest names, and its `rootfs` one diff_id per layer.
pub(crate) fn parse_image(
    manifest_json: &[u8],
    config_json: &[u8],
) -> Result<(ImageManifest, ImageConfig), LayerError> {
    if manifest_json.len() as u64 > MAX_MANIFEST_SIZE {
        return Err(image_err(
            "manifest",
            format!(
                "{} bytes is larger than the limit of {MAX_MANIFEST_SIZE}",
                manifest_json.len()
            ),
        ));
    }
    if config_json.len() as u64 > MAX_CONFIG_SIZE {
        return Err(image_err(
            "config",
            format!(
                "{} bytes is larger than the limit of {MAX_CONFIG_SIZE}",
                config_json.len()
            ),
        ));
    }
    let manifest: ImageManifest = serde_json::from_slice(manifest_json)
        .map_err(|e| image_err("manifest", format!("not a valid image manifest: {e}")))?;
    if manifest.schema_version != 2 {
        return Err(image_err(
            "manifest",
            format!("schemaVersion {}, expected 2", manifest.schema_version),
        ));
    }
    if let Some(t) = &manifest.media_type {
        if DocKind::of(t) != Some(DocKind::Manifest) {
            return Err(image_err(
                "manifest",
                format!("media type {t:?} is not an image manifest (an index must be resolved to one first)"),
            ));
        }
    }
    if manifest.layers.len() > MAX_LAYERS {
        return Err(image_err(
            "manifest",
            format!("{} layers (at most {MAX_LAYERS})", manifest.layers.len()),
        ));
    }
    parse_digest(&manifest.config.digest)
        .map_err(|e| image_err("manifest", format!("config descriptor: {e}")))?;
    for (i, l) in manifest.layers.iter().enumerate() {
        parse_digest(&l.digest)
            .map_err(|e| image_err("manifest", format!("layer {} descriptor: {e}", i + 1)))?;
    }
    let config_digest = sha256_digest(config_json);
    if manifest.config.digest != config_digest {
        return Err(image_err(
            "config",
            format!(
                "digest mismatch: the manifest says {}, the config is {config_digest}",
                manifest.config.digest
            ),
        ));
    }
    let config: ImageConfig = serde_json::from_slice(config_json)
        .map_err(|e| image_err("config", format!("not a valid image config: {e}")))?;
    config
        .check_rootfs(manifest.layers.len())
        .map_err(|e| image_err("config", e.to_string()))?;
    Ok((manifest, config))
}

/// Fuzzing oracle: [`parse_image`] on `manifest_json` and `config_json`.
/// Never panics, whatever the bytes; the answer is whether they were
/// accepted.
#[doc(hidden)]
pub fn fuzz_parse_image(manifest_json: &[u8], config_json: &[u8]) -> bool {
    parse_image(manifest_json, config_json).is_ok()
}

/// Applies `diff_ids` in order, each from its record in the store.
pub fn build_image_tree(store: &Store, diff_ids: &[String]) -> Result<Tree, LayerError> {
    build_tree_from(store, diff_ids, Vec::new())
}

/// Applies `diff_ids` in order, each from the entries file given at its
/// index in `entries`, or where there is none, from its record in the
/// store.
fn build_tree_from(
    store: &Store,
    diff_ids: &[String],
    mut entries: Vec<Option<File>>,
) -> Result<Tree, LayerError> {
    let mut image = empty_image();
    for (i, diff_id) in diff_ids.iter().enumerate() {
        let file = match entries.get_mut(i).and_then(Option::take) {
            Some(file) => file,
            None => {
                let path = store.layer_entries_path(diff_id);
                File::open(&path).map_err(|e| LayerError::Apply {
                    layer: diff_id.to_owned(),
                    path: path.display().to_string(),
                    reason: format!("opening the layer record: {e}"),
                })?
            }
        };
        apply_layer(&mut image, BufReader::with_capacity(1 << 20, file), diff_id)?;
    }
    Ok(compact(image))
}

/// Where [`StagedImage::write`] gets its tree.
enum TreeFrom {
    /// Built from these entries files, or the store's records.
    Entries(Vec<Option<File>>),
    /// Built already.
    Built(BuiltTree),
}

/// Sums regular file sizes (each inode once).
fn content_size(tree: &Tree) -> u64 {
    tree.inodes
        .iter()
        .filter(|inode| matches!(inode.data, InodeData::Regular(_)))
        .fold(0u64, |sum, inode| sum.saturating_add(inode.size))
}

/// Checks that every object the tree names is in the store.
pub(crate) fn check_objects(store: &Store, tree: &Tree) -> Result<(), LayerError> {
    let ids = tree
        .inodes
        .iter()
        .filter_map(|inode| match &inode.data {
            InodeData::Regular(r) => r.digest.map(ObjectId),
            _ => None,
        })
        .collect::<Vec<_>>();
    if let Some(id) = store.object_lookup().first_missing(&ids) {
        return Err(image_err(
            "layers",
            format!("object {id} is missing from the store (re-import the layer)"),
        ));
    }
    Ok(())
}

/// Writes `tree` as an EROFS image into the store's staging area, not yet
/// published; returns the writer and the image's size.
fn stage_image(store: &Store, tree: &Tree) -> Result<(ImageWriter, u64), LayerError> {
    let mut w = store
        .image_writer()
        .map_err(LayerError::store("writing the image"))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, &mut w);
    let info = mkfs_erofs(tree, &WriteOptions::default(), &mut out)
        .map_err(|e| image_err("filesystem", format!("writing the EROFS image: {e}")))?;
    std::io::Write::flush(&mut out)
        .map_err(|e| image_err("filesystem", format!("writing the EROFS image: {e}")))?;
    drop(out);
    Ok((w, info.size))
}

/// Applies the layers named by `config.rootfs.diff_ids`, writes the EROFS
/// image and its record, and points `name` (an image name, mapped with
/// [`ref_name_for`]) at it.
///
/// Every layer must have been imported ([`crate::import_layer`]) already.
/// Hold [`Store::lock_shared`] from the first layer import to this call, so
/// a concurrent garbage collection cannot remove layers no ref reaches yet.
/// The returned layers say `cached: true` (they all come from the store at
/// this point); a caller that imported some just now knows better.
pub fn assemble_image(
    store: &Store,
    manifest_json: &[u8],
    config_json: &[u8],
    name: Option<&str>,
) -> Result<ImportedImage, LayerError> {
    assemble_image_from(store, manifest_json, config_json, name, None)
}

/// [`assemble_image`], also recording where the image came from.
pub fn assemble_image_from(
    store: &Store,
    manifest_json: &[u8],
    config_json: &[u8],
    name: Option<&str>,
    source: Option<&str>,
) -> Result<ImportedImage, LayerError> {
    StagedImage::write(
        store,
        manifest_json,
        config_json,
        name,
        source,
        TreeFrom::Entries(Vec::new()),
        true,
    )?
    .publish()
}

fn checked_ref_name(name: Option<&str>) -> Result<Option<String>, LayerError> {
    let ref_name = name.map(ref_name_for);
    if let Some(r) = &ref_name {
        cairn_store::validate_ref_name(r).map_err(LayerError::store("naming the image"))?;
    }
    Ok(ref_name)
}

/// An image written into the store's staging area from its layers'
/// entries, before (some of) those layers are published; see
/// [`StagedImage::stage`]. Dropped, it leaves nothing behind.
pub struct StagedImage<'a> {
    store: &'a Store,
    /// Shared: garbage collection waits until the image is published.
    _lock: StoreLock,
    manifest_json: Vec<u8>,
    config_json: Vec<u8>,
    manifest: ImageManifest,
    config: ImageConfig,
    name: Option<String>,
    ref_name: Option<String>,
    source: Option<String>,
    content_size: u64,
    /// The tree, while its objects are still to be looked up.
    tree: Option<Tree>,
    writer: ImageWriter,
    image_size: u64,
}

impl<'a> StagedImage<'a> {
    /// Parses the manifest and config as [`assemble_image`] does and writes
    /// the image into the staging area, reading each layer's entries from
    /// `entries[i]` (as [`crate::import_layer_with`] hands them over) or,
    /// where that is `None`, from the layer's record in the store. Nothing
    /// is published: [`publish`](Self::publish) does that once every layer
    /// is.
    ///
    /// A layer given by its entries must be one whose import has not
    /// failed by the time of `publish`: such a layer's objects are then in
    /// the store (its import named or found each of them, under the
    /// store's shared lock, which the caller holds from that import on).
    /// So when every layer is given by its entries, no object is looked
    /// up; when any is read from the store, every object the image names
    /// is, as [`assemble_image`] does (while the image is written when
    /// every layer is read from the store, at `publish` otherwise).
    pub fn stage(
        store: &'a Store,
        manifest_json: &[u8],
        config_json: &[u8],
        name: Option<&str>,
        source: Option<&str>,
        entries: Vec<Option<File>>,
    ) -> Result<StagedImage<'a>, LayerError> {
        // Every layer from the store: the objects are looked up while the
        // image is written, not after.
        let check_now = entries.iter().all(Option::is_none);
        Self::write(
            store,
            manifest_json,
            config_json,
            name,
            source,
            TreeFrom::Entries(entries),
            check_now,
        )
    }

    /// [`stage`](Self::stage) from a tree built as the layers were
    /// imported ([`crate::build_tree_as_imported`]), or with `None`, from
    /// the store's records once every layer is published.
    pub fn from_tree(
        store: &'a Store,
        manifest_json: &[u8],
        config_json: &[u8],
        name: Option<&str>,
        source: Option<&str>,
        tree: Option<BuiltTree>,
    ) -> Result<StagedImage<'a>, LayerError> {
        let (from, check_now) = match tree {
            Some(tree) => (TreeFrom::Built(tree), false),
            None => (TreeFrom::Entries(Vec::new()), true),
        };
        Self::write(
            store,
            manifest_json,
            config_json,
            name,
            source,
            from,
            check_now,
        )
    }

    /// [`stage`](Self::stage); with `check_now`, the objects are looked
    /// up while the image is written (a listing of each fan-out directory
    /// the image uses: a tenth of a second for the Linux tree's 78,600),
    /// both only reading the tree, instead of at [`publish`](Self::publish).
    fn write(
        store: &'a Store,
        manifest_json: &[u8],
        config_json: &[u8],
        name: Option<&str>,
        source: Option<&str>,
        from: TreeFrom,
        check_now: bool,
    ) -> Result<StagedImage<'a>, LayerError> {
        let (manifest, config) = parse_image(manifest_json, config_json)?;
        let ref_name = checked_ref_name(name)?;
        let lock = store
            .lock_shared()
            .map_err(LayerError::store("locking the store"))?;
        let diff_ids = config.rootfs.as_ref().map_or(&[][..], |r| &r.diff_ids);
        let started = std::time::Instant::now();
        let (tree, from_store) = match from {
            TreeFrom::Entries(entries) => {
                let from_store =
                    (0..diff_ids.len()).any(|i| !matches!(entries.get(i), Some(Some(_))));
                let tree = build_tree_from(store, diff_ids, entries)?;
                tracing::debug!(
                    "image: {} inodes from {} layers in {:?}",
                    tree.inodes.len(),
                    diff_ids.len(),
                    started.elapsed()
                );
                (tree, from_store)
            }
            TreeFrom::Built(built) => {
                if built.diff_ids != diff_ids {
                    return Err(image_err(
                        "layers",
                        "the tree was built from other layers than the config names",
                    ));
                }
                (built.tree, built.from_store)
            }
        };
        let content_size = content_size(&tree);
        let (writer, image_size, tree) = if check_now {
            let (checked, staged) = std::thread::scope(|s| {
                let check = s.spawn(|| check_objects(store, &tree));
                let staged = stage_image(store, &tree);
                let checked = check
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (checked, staged)
            });
            checked?;
            let (writer, image_size) = staged?;
            (writer, image_size, None)
        } else {
            let (writer, image_size) = stage_image(store, &tree)?;
            (writer, image_size, from_store.then_some(tree))
        };
        tracing::debug!("image: written at {:?}", started.elapsed());
        Ok(StagedImage {
            store,
            _lock: lock,
            manifest_json: manifest_json.to_vec(),
            config_json: config_json.to_vec(),
            manifest,
            config,
            name: name.map(str::to_owned),
            ref_name,
            source: source.map(str::to_owned),
            content_size,
            tree,
            writer,
            image_size,
        })
    }

    /// Looks up the objects still to check, then publishes the image, its
    /// record and its name (as [`assemble_image_from`] does). Every layer
    /// must be published by now.
    pub fn publish(self) -> Result<ImportedImage, LayerError> {
        let store = self.store;
        let diff_ids = self.config.rootfs.as_ref().map_or(&[][..], |r| &r.diff_ids);
        let mut layers = Vec::new();
        for (diff_id, desc) in diff_ids.iter().zip(&self.manifest.layers) {
            let rec = store
                .layer_record(diff_id)
                .map_err(LayerError::store(format!("reading layer {diff_id}")))?
                .ok_or_else(|| LayerError::MissingLayer {
                    diff_id: diff_id.clone(),
                })?;
            layers.push(LayerInfo {
                diff_id: diff_id.clone(),
                blob_digest: Some(desc.digest.clone()),
                entries: rec.entries,
                size: rec.size,
                compressed_size: desc.size,
                cached: true,
            });
        }
        if let Some(tree) = &self.tree {
            check_objects(store, tree)?;
        }
        let image_digest = self
            .writer
            .commit()
            .map_err(LayerError::store("publishing the image"))?;
        tracing::debug!("image: published as {image_digest}");
        let record = ImageRecord {
            image_digest: image_digest.clone(),
            manifest_digest: sha256_digest(&self.manifest_json),
            config_digest: self.manifest.config.digest.clone(),
            manifest: String::from_utf8_lossy(&self.manifest_json).into_owned(),
            config: String::from_utf8_lossy(&self.config_json).into_owned(),
            layers: layers
                .iter()
                .map(|l| ImageRecordLayer {
                    diff_id: l.diff_id.clone(),
                    blob_digest: l.blob_digest.clone(),
                    size: l.size,
                })
                .collect(),
            created: self.config.created.clone(),
            architecture: self.config.architecture.clone(),
            os: self.config.os.clone(),
            imported: now_rfc3339(),
            image_size: self.image_size,
            content_size: self.content_size,
            source: self.source.clone(),
            lazy: None,
        };
        store
            .write_image_record(&record)
            .map_err(LayerError::store("writing the image record"))?;
        if let Some(r) = &self.ref_name {
            store
                .set_ref(r, &image_digest)
                .map_err(LayerError::store(format!(
                    "naming the image {}",
                    self.name.as_deref().unwrap_or("")
                )))?;
        }
        Ok(ImportedImage {
            image_digest,
            manifest_digest: record.manifest_digest,
            config_digest: record.config_digest,
            layers,
            name: self.name,
        })
    }
}

/// The current time as RFC 3339 UTC (`2024-05-01T12:34:56Z`), as image
/// records write it.
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    rfc3339(secs)
}

/// Seconds since the epoch as RFC 3339 UTC.
pub(crate) fn rfc3339(secs: i64) -> String {
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
