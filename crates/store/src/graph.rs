//! What keeps what alive: the edges of the store's graph that garbage
//! collection, fsck and the usage report walk.
//!
//! ```text
//! refs/<name> ──► images/<digest> ──(payload of each regular file)──► objects/ab/cdef…
//!                      │
//!                      └─(image record: layers)──► layers/<diff_id> ──► objects/…
//! live mount (overlay source=images/<digest>) ──► images/<digest>
//! ```
//!
//! This module owns reading those edges and nothing else: it never writes
//! or removes anything. The image→object edges come from the EROFS image
//! itself (read with `cairn_erofs::reader`), so they need no record. The
//! image→layer and layer→object edges come from the image and layer
//! records, whose format the `record` module defines; everything that
//! depends on that format is in the "records" section at the end, so that
//! it is the only part to change with it.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::PathBuf;

use cairn_erofs::tree::InodeData;

use crate::image::is_image_digest;
use crate::record::{is_diff_id, ref_name_for, LAYER_RECORD_FILE};
use crate::verity::ObjectId;
use crate::{Store, StoreError};

/// How one image uses an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectUse {
    /// The file size the image gives the object's file.
    pub size: u64,
    /// A path in the image whose content it is (the first in walk order).
    pub path: Vec<u8>,
    /// The fs-verity digest the image records for it (the metacopy xattr),
    /// when it records one.
    pub digest: Option<ObjectId>,
}

/// A regular file whose payload is not an object path (`ab/cdef…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadPayload {
    pub path: Vec<u8>,
    pub payload: Vec<u8>,
}

/// What an image holds, as far as the store cares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageContents {
    /// Size of the image file.
    pub image_bytes: u64,
    pub inodes: u64,
    /// Regular files (each hardlinked inode once).
    pub regular_files: u64,
    /// Sum of the sizes of those files: what the image shows.
    pub logical_bytes: u64,
    /// The part of `logical_bytes` kept inside the image itself.
    pub inline_bytes: u64,
    /// Every object the image's files are backed by.
    pub objects: BTreeMap<ObjectId, ObjectUse>,
    /// Files backed by something that is not an object of a store.
    pub bad_payloads: Vec<BadPayload>,
}

impl Store {
    /// Reads `images/<digest>` and collects what it holds. An image that
    /// cannot be read or parsed is [`StoreError::CorruptImage`] (a missing
    /// one is an I/O error with `NotFound`).
    pub fn image_contents(&self, digest: &str) -> Result<ImageContents, StoreError> {
        self.image_contents_at(digest, &[]).map(|(c, _)| c)
    }

    /// [`image_contents`](Self::image_contents), and the object behind
    /// each of `paths` (absolute paths in the image, looked up without
    /// following symlinks): `None` where there is no regular file backed
    /// by an object (absent, a directory, a symlink, a file small enough
    /// to be inline). One read and parse of the image for both.
    pub fn image_contents_at(
        &self,
        digest: &str,
        paths: &[&str],
    ) -> Result<(ImageContents, Vec<Option<ObjectId>>), StoreError> {
        if !is_image_digest(digest) {
            return Err(StoreError::InvalidImageDigest(digest.to_owned()));
        }
        let path = self.image_path(digest);
        let data =
            fs::read(&path).map_err(|e| StoreError::io("reading image", &path, &self.root, e))?;
        contents_at(&data, paths).map_err(|reason| StoreError::CorruptImage {
            digest: digest.to_owned(),
            root: self.root.clone(),
            reason,
        })
    }
}

impl ImageContents {
    /// Collects what the image in `data` holds (for an image file outside
    /// the store; [`Store::image_contents`] reads one in it). The error
    /// says what is wrong with the image.
    pub fn from_image_bytes(data: &[u8]) -> Result<ImageContents, String> {
        contents_of(data)
    }
}

/// Collects what the image in `data` holds.
pub(crate) fn contents_of(data: &[u8]) -> Result<ImageContents, String> {
    contents_at(data, &[]).map(|(c, _)| c)
}

/// [`contents_of`], and the object behind each of `paths`
/// ([`Store::image_contents_at`]).
fn contents_at(
    data: &[u8],
    paths: &[&str],
) -> Result<(ImageContents, Vec<Option<ObjectId>>), String> {
    let tree = cairn_erofs::reader::read_image(data).map_err(|e| e.to_string())?;
    let at = paths
        .iter()
        .map(|p| {
            let inode = tree.inode(tree.lookup(p.as_bytes())?);
            match &inode.data {
                InodeData::Regular(reg) => reg.payload.as_deref().and_then(object_id_of_payload),
                _ => None,
            }
        })
        .collect();
    let mut c = ImageContents {
        image_bytes: data.len() as u64,
        ..ImageContents::default()
    };
    // Each object's first use in walk order, gathered in a list and sorted
    // once: inserting into the map one by one moved its large entries
    // around for every file (half the walk's time for 8,000 objects).
    let mut uses: Vec<(ObjectId, ObjectUse)> = Vec::new();
    tree.walk(|path, id, entry| {
        if entry.hardlink {
            return;
        }
        c.inodes += 1;
        let inode = tree.inode(id);
        let InodeData::Regular(reg) = &inode.data else {
            return;
        };
        c.regular_files += 1;
        c.logical_bytes = c.logical_bytes.saturating_add(inode.size);
        if let Some(content) = &reg.content {
            c.inline_bytes += content.len() as u64;
        }
        let Some(payload) = &reg.payload else {
            return;
        };
        match object_id_of_payload(payload) {
            Some(id) => uses.push((
                id,
                ObjectUse {
                    size: inode.size,
                    path: path.to_vec(),
                    digest: reg.digest.map(ObjectId),
                },
            )),
            None => c.bad_payloads.push(BadPayload {
                path: path.to_vec(),
                payload: payload.clone(),
            }),
        }
    });
    // Stable: of the uses of one object, the first in walk order stays.
    uses.sort_by_key(|u| u.0);
    uses.dedup_by(|later, first| later.0 == first.0);
    c.objects = uses.into_iter().collect();
    Ok((c, at))
}

/// The object a payload path (`ab/cdef…`, as `trusted.overlay.redirect`
/// holds it, leading `/` optional) names.
pub(crate) fn object_id_of_payload(payload: &[u8]) -> Option<ObjectId> {
    let p = payload.strip_prefix(b"/").unwrap_or(payload);
    let s = std::str::from_utf8(p).ok()?;
    let (fanout, rest) = s.split_once('/')?;
    if fanout.len() != 2 || rest.len() != 62 {
        return None;
    }
    let mut buf = [0u8; 64];
    buf[..2].copy_from_slice(fanout.as_bytes());
    buf[2..].copy_from_slice(rest.as_bytes());
    let hex = std::str::from_utf8(&buf).ok()?;
    if !crate::object::is_lower_hex(hex) {
        return None;
    }
    ObjectId::from_hex(hex).ok()
}

/// Apparent and allocated bytes of everything at `path` (a file, or a
/// directory and all below it, never following symlinks); `None` if it is
/// gone.
pub(crate) fn tree_sizes(path: &std::path::Path) -> io::Result<Option<(u64, u64)>> {
    use std::os::unix::fs::MetadataExt;
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return Ok(Some((meta.len(), meta.blocks() * 512)));
    }
    let mut total = (0, meta.blocks() * 512);
    let rd = match fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    for entry in rd {
        if let Some((b, d)) = tree_sizes(&entry?.path())? {
            total.0 += b;
            total.1 += d;
        }
    }
    Ok(Some(total))
}

/// Size and allocated bytes of a file, `None` if it is gone.
pub(crate) fn file_sizes(path: &std::path::Path) -> io::Result<Option<(u64, u64)>> {
    use std::os::unix::fs::MetadataExt;
    match fs::symlink_metadata(path) {
        Ok(m) => Ok(Some((m.len(), m.blocks() * 512))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// One entry of `refs/`, read without failing on a corrupt one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RefEntry {
    pub name: String,
    /// The image digest, or why the ref holds none.
    pub target: Result<String, String>,
}

impl Store {
    /// Every ref, sorted by name; a ref that holds no digest is reported in
    /// its entry rather than failing the scan. Names that are not ref names
    /// are skipped, as [`Store::list_refs`] does.
    pub(crate) fn scan_refs(&self) -> Result<Vec<RefEntry>, StoreError> {
        let dir = self.refs_dir();
        let rd = fs::read_dir(&dir).map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if crate::refs::validate_ref_name(&name).is_err() {
                continue;
            }
            let target = match self.get_ref(&name) {
                Ok(Some(d)) => Ok(d),
                Ok(None) => continue,
                Err(StoreError::CorruptRef { reason, .. }) => Err(reason),
                Err(e) => return Err(e),
            };
            out.push(RefEntry { name, target });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

// ---------------------------------------------------------------------------
// Records: the only part of this module that knows the image and layer
// record format (the `record` module: `images/<digest>.json`,
// `layers/sha256:<hex>/{layer.json,dump}`).
// ---------------------------------------------------------------------------

/// One entry of `layers/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LayerEntry {
    /// The layer's diff_id (`sha256:<hex>`), its name under `layers/`.
    pub name: String,
    /// `layers/<diff_id>` (a directory).
    pub path: PathBuf,
}

impl Store {
    /// The layers (diff_ids) the image was assembled from, from its image
    /// record; `None` for an image without a record (made by `mkfs` or
    /// from a directory). A record that cannot be read, describes another
    /// image or names something that is not a diff_id is an error.
    pub(crate) fn image_layers(&self, digest: &str) -> Result<Option<Vec<String>>, StoreError> {
        let Some(record) = self.image_record(digest)? else {
            return Ok(None);
        };
        let corrupt = |reason: String| StoreError::CorruptImage {
            digest: digest.to_owned(),
            root: self.root.clone(),
            reason: format!("image record {digest}.json: {reason}"),
        };
        if record.image_digest != digest {
            return Err(corrupt(format!(
                "describes image {:?}",
                record.image_digest.chars().take(80).collect::<String>()
            )));
        }
        let mut layers = Vec::with_capacity(record.layers.len());
        for l in record.layers {
            if !is_diff_id(&l.diff_id) {
                return Err(corrupt(format!(
                    "lists layer {:?}, which is not a diff_id",
                    l.diff_id.chars().take(80).collect::<String>()
                )));
            }
            layers.push(l.diff_id);
        }
        Ok(Some(layers))
    }

    /// Files that belong to the image besides `images/<digest>` (its
    /// record), to be removed with it.
    pub(crate) fn image_side_files(&self, digest: &str) -> Vec<PathBuf> {
        vec![
            self.image_record_path(digest),
            self.lazy_index_path(digest),
            self.lazy_names_path(digest),
        ]
    }

    /// Image records in `images/` whose image is not there (`<digest>` of
    /// each).
    pub(crate) fn orphan_image_records(&self) -> Result<Vec<String>, StoreError> {
        let dir = self.images_dir();
        let rd = fs::read_dir(&dir).map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
            let name = entry.file_name();
            let Some(digest) = name.to_str().and_then(|n| {
                n.strip_suffix(".json")
                    .or_else(|| n.strip_suffix(".lazy-index"))
                    .or_else(|| n.strip_suffix(".lazy-names"))
            }) else {
                continue;
            };
            if is_image_digest(digest) && !self.has_image(digest) {
                out.push(digest.to_owned());
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Every layer under `layers/` (entries not named by a diff_id are not
    /// the store's and are left out).
    pub(crate) fn layer_entries(&self) -> Result<Vec<LayerEntry>, StoreError> {
        let dir = self.layers_dir();
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::io("listing", &dir, &self.root, e)),
        };
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if !is_diff_id(&name) {
                continue;
            }
            out.push(LayerEntry {
                path: entry.path(),
                name,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The objects a layer record says the layer holds. A layer whose
    /// record is missing or cannot be read is an error.
    pub(crate) fn layer_objects(&self, layer: &LayerEntry) -> Result<Vec<ObjectId>, StoreError> {
        if self.layer_record(&layer.name)?.is_none() {
            return Err(StoreError::CorruptLayer {
                diff_id: layer.name.clone(),
                root: self.root.clone(),
                reason: format!("no {LAYER_RECORD_FILE}"),
            });
        }
        self.layer_record_objects(&layer.name)
    }
}

/// The ref name an image name (`registry/repo:tag`, which holds `/`) is
/// stored under, when it differs from the name itself.
pub(crate) fn mapped_ref_name(image_name: &str) -> Option<String> {
    let mapped = ref_name_for(image_name);
    (mapped != image_name).then_some(mapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_paths_name_objects() {
        let hex = "ab".to_string() + &"c".repeat(62);
        let id = ObjectId::from_hex(&hex).unwrap();
        let p = id.object_path();
        assert_eq!(object_id_of_payload(p.as_bytes()), Some(id));
        assert_eq!(object_id_of_payload(format!("/{p}").as_bytes()), Some(id));
        for bad in [
            "abc".to_string(),
            hex.clone(),
            format!("ab/{}", "C".repeat(62)),
            format!("ab/{}", "c".repeat(61)),
            format!("a/b{}", "c".repeat(62)),
            format!("../{}", "c".repeat(62)),
        ] {
            assert_eq!(object_id_of_payload(bad.as_bytes()), None, "{bad}");
        }
    }
}
