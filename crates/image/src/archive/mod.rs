//! Whole images from local sources: an OCI image layout, a `docker save`
//! archive, a directory.
//!
//! Each ends in the same two steps a registry pull does: [`import_layer`]
//! for every layer the store does not have yet (the layer cache), then
//! [`assemble_image_from`].
//!
//! - **OCI layout** (`index.json`, `blobs/<alg>/<hex>`): the manifest is
//!   picked by its `org.opencontainers.image.ref.name` annotation (or is
//!   the only one); an image index is resolved to the requested platform
//!   (default: the host's). Every blob (index, manifest, config, layer) is
//!   checked against its descriptor: its digest parsed by the spec's
//!   grammar (`cairn_spec::parse_digest`: sha256 only, lower-case hex)
//!   before a path is made from it, its size (an index, manifest or config
//!   is read to at most one byte past it; a layer file's length must equal
//!   it, checked for every layer before the first is imported), its digest,
//!   and its media type: a manifest or index whose own `mediaType`
//!   contradicts its descriptor's is refused, a config must be an image
//!   config, a layer a tar, tar+gzip or tar+zstd whose bytes show that
//!   compression.
//! - **docker archive** (`manifest.json`, the config, one tar per layer,
//!   possibly gzipped or symlinked to another): read in two passes over the
//!   archive file without unpacking it: one to find the members, then each
//!   member straight from its offset. Docker archives have no descriptors
//!   and no sizes to check; what is checked: every `rootfs.diff_ids` entry
//!   is parsed as a digest, each layer's tar stream against its diff_id,
//!   the config against its member name when that is a digest
//!   (`<64 hex>.json`, as docker and skopeo name it, or
//!   `blobs/sha256/<hex>`), and a layer named `blobs/sha256/<hex>` (docker
//!   25 and later) against that digest. Docker archives have no OCI
//!   manifest, so one is made: uncompressed layer descriptors whose digests
//!   are the diff_ids.
//! - **directory**: scanned like `cairn mkfs`, written as one tar stream
//!   (in memory, through a pipe to the importer: never on disk) and
//!   imported as a one-layer image with a minimal config for the host.

mod dir;
mod docker;

pub use dir::import_dir;
pub use docker::import_docker_archive;

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cairn_spec::image::ANNOTATION_REF_NAME;
use cairn_spec::limits::{MAX_CONFIG_SIZE, MAX_INDEX_DEPTH, MAX_MANIFEST_SIZE};
use cairn_spec::media_type::{self as mt, DocKind};
use cairn_spec::platform::{self, PlatformSpec};
use cairn_spec::{parse_digest, sha256_digest, Compression, Descriptor};
use cairn_store::Store;
use serde::Deserialize;
use serde_json::Value;

use crate::assemble::{ImportedImage, StagedImage};
use crate::layer::{import_layer_with, LayerInfo, Limits};
use crate::layer_jobs::{first_of_each, import_each_staged, Cancellable, DEFAULT_LAYER_JOBS};
use crate::LayerError;

/// Most members a docker archive may have.
const MAX_ARCHIVE_MEMBERS: usize = 1_000_000;

/// How to import an image from a local source.
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// The name to give it (mapped to a ref); each source has a default.
    pub name: Option<String>,
    /// The platform to pick from an image index (default: the host's),
    /// parsed and matched as a registry pull does (`cairn_spec::platform`).
    pub platform: Option<PlatformSpec>,
    pub limits: Limits,
    /// Layers imported at once (0: [`DEFAULT_LAYER_JOBS`]).
    pub jobs: usize,
}

impl ImportOptions {
    fn layer_jobs(&self) -> usize {
        match self.jobs {
            0 => DEFAULT_LAYER_JOBS,
            n => n,
        }
    }
}

fn archive_err(archive: &str, reason: impl std::fmt::Display) -> LayerError {
    LayerError::Archive {
        archive: archive.to_owned(),
        reason: reason.to_string(),
    }
}

/// Reads at most `max` bytes of a file.
fn read_capped(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let f = File::open(path)?;
    let mut data = Vec::new();
    f.take(max + 1).read_to_end(&mut data)?;
    if data.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than the limit of {max} bytes"),
        ));
    }
    Ok(data)
}

/// A descriptor from an OCI layout's JSON, read as `cairn-spec`'s
/// [`Descriptor`] once the fields cairn relies on are checked one by one
/// (so the message says which is wrong): `mediaType` a string, `digest` a
/// digest cairn verifies (parsed before any path is made from it), `size`
/// a non-negative integer. The error is the reason, for the caller to say
/// whose descriptor it was.
pub(crate) fn descriptor(v: &Value) -> Result<Descriptor, String> {
    let obj = v.as_object().ok_or("the descriptor is not a JSON object")?;
    obj.get("mediaType")
        .and_then(Value::as_str)
        .ok_or("the descriptor has no mediaType string")?;
    let digest = obj
        .get("digest")
        .and_then(Value::as_str)
        .ok_or("the descriptor has no digest string")?;
    parse_digest(digest).map_err(|e| format!("descriptor digest: {e}"))?;
    obj.get("size")
        .and_then(Value::as_u64)
        .ok_or("the descriptor's size is not a non-negative integer")?;
    Descriptor::deserialize(v).map_err(|e| format!("the descriptor: {e}"))
}

/// A manifest's or index's own `mediaType`, when it has one, must be its
/// descriptor's (image-spec: content whose type contradicts its descriptor
/// is not to be trusted); the error is the reason.
pub(crate) fn check_declared_media_type(doc: &Value, desc: &Descriptor) -> Result<(), String> {
    match doc.get("mediaType") {
        None => Ok(()),
        Some(Value::String(declared)) if *declared == desc.media_type => Ok(()),
        Some(Value::String(declared)) => Err(format!(
            "media type mismatch: the descriptor says {:?}, the content says {declared:?}",
            desc.media_type
        )),
        Some(_) => Err("its mediaType is not a string".to_owned()),
    }
}

/// An OCI layout on disk.
struct Layout {
    dir: PathBuf,
    what: String,
}

impl Layout {
    fn blob_path(&self, digest: &str) -> Result<PathBuf, LayerError> {
        let hex = parse_digest(digest).map_err(|e| archive_err(&self.what, e))?;
        Ok(self.dir.join("blobs/sha256").join(hex))
    }

    /// Opens the blob `desc` names and checks that it is a regular file of
    /// the descriptor's size (without reading it). Opened non-blocking, so
    /// a FIFO planted in `blobs/` cannot hang the import.
    fn open_blob(&self, desc: &Descriptor, what: &str) -> Result<File, LayerError> {
        let path = self.blob_path(&desc.digest)?;
        let err =
            |reason: String| archive_err(&self.what, format!("{what} {}: {reason}", desc.digest));
        let file = File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| err(format!("blob {}: {e}", path.display())))?;
        let meta = file
            .metadata()
            .map_err(|e| err(format!("blob {}: {e}", path.display())))?;
        if !meta.is_file() {
            return Err(err(format!(
                "blob {} is not a regular file",
                path.display()
            )));
        }
        if meta.len() != desc.size {
            return Err(err(format!(
                "size mismatch: the descriptor says {} bytes, the blob has {}",
                desc.size,
                meta.len()
            )));
        }
        Ok(file)
    }

    /// A small blob (index, manifest, config), checked against its
    /// descriptor's size and digest; never reads more than one byte past
    /// the size.
    fn read_blob(&self, desc: &Descriptor, max: u64, what: &str) -> Result<Vec<u8>, LayerError> {
        let err =
            |reason: String| archive_err(&self.what, format!("{what} {}: {reason}", desc.digest));
        if desc.size > max {
            return Err(err(format!(
                "the descriptor says {} bytes, larger than the limit of {max}",
                desc.size
            )));
        }
        let file = self.open_blob(desc, what)?;
        let mut data = Vec::with_capacity(desc.size as usize);
        file.take(desc.size + 1)
            .read_to_end(&mut data)
            .map_err(|e| err(format!("reading the blob: {e}")))?;
        if data.len() as u64 != desc.size {
            // The file changed since it was opened.
            return Err(err(format!(
                "size mismatch: the descriptor says {} bytes, read {}{}",
                desc.size,
                data.len(),
                if data.len() as u64 > desc.size {
                    " or more"
                } else {
                    ""
                }
            )));
        }
        let actual = sha256_digest(&data);
        if actual != desc.digest {
            return Err(err(format!(
                "digest mismatch: expected {}, got {actual}",
                desc.digest
            )));
        }
        Ok(data)
    }
}

/// An index entry's `org.opencontainers.image.ref.name` annotation: the
/// name an OCI layout gives the image.
pub(crate) fn ref_name(entry: &Value) -> Option<&str> {
    entry.get("annotations")?.get(ANNOTATION_REF_NAME)?.as_str()
}

fn tags_of(manifests: &[Value]) -> Vec<String> {
    manifests
        .iter()
        .filter_map(ref_name)
        .map(str::to_owned)
        .collect()
}

/// Imports the image `tag` (or the only one) of the OCI layout at `dir`.
/// The default name is the tag, else the layout directory's name.
pub fn import_oci_layout(
    store: &Store,
    dir: &Path,
    tag: Option<&str>,
    opts: &ImportOptions,
) -> Result<ImportedImage, LayerError> {
    let what = match tag {
        Some(t) => format!("oci-layout:{}:{t}", dir.display()),
        None => format!("oci-layout:{}", dir.display()),
    };
    let layout = Layout {
        dir: dir.to_path_buf(),
        what: what.clone(),
    };
    // Held from the first layer to the ref, so gc never takes a layer
    // between its import and the image that needs it.
    let _lock = store
        .lock_shared()
        .map_err(LayerError::store("locking the store"))?;

    let layout_file = read_capped(&dir.join("oci-layout"), 1 << 16).map_err(|e| {
        archive_err(
            &what,
            format!("oci-layout file: {e} (is this an OCI image layout?)"),
        )
    })?;
    let layout_json: Value = serde_json::from_slice(&layout_file)
        .map_err(|e| archive_err(&what, format!("oci-layout file: {e}")))?;
    if layout_json
        .get("imageLayoutVersion")
        .and_then(Value::as_str)
        != Some("1.0.0")
    {
        return Err(archive_err(
            &what,
            "oci-layout: imageLayoutVersion is not 1.0.0",
        ));
    }
    let index_data = read_capped(&dir.join("index.json"), MAX_MANIFEST_SIZE)
        .map_err(|e| archive_err(&what, format!("index.json: {e}")))?;
    let index: Value = serde_json::from_slice(&index_data)
        .map_err(|e| archive_err(&what, format!("index.json: {e}")))?;
    let manifests = index
        .get("manifests")
        .and_then(Value::as_array)
        .ok_or_else(|| archive_err(&what, "index.json has no manifests list"))?;
    let chosen = match tag {
        Some(t) => manifests
            .iter()
            .find(|m| ref_name(m) == Some(t))
            .ok_or_else(|| {
                archive_err(
                    &what,
                    format!(
                        "no image tagged {t:?} (tags: {})",
                        tags_of(manifests).join(", ")
                    ),
                )
            })?,
        None => match manifests.as_slice() {
            [one] => one,
            [] => return Err(archive_err(&what, "index.json lists no images")),
            _ => {
                return Err(archive_err(
                    &what,
                    format!(
                        "{} images in the layout: name one with :TAG (tags: {})",
                        manifests.len(),
                        tags_of(manifests).join(", ")
                    ),
                ))
            }
        },
    };
    let chosen = descriptor(chosen).map_err(|e| archive_err(&what, format!("index.json: {e}")))?;
    let platform = opts.platform.clone().unwrap_or_else(PlatformSpec::host);
    let (manifest, manifest_desc) = resolve_manifest(&layout, &chosen, &platform, 0)?;
    let manifest_json: Value = serde_json::from_slice(&manifest)
        .map_err(|e| archive_err(&what, format!("manifest {}: {e}", manifest_desc.digest)))?;
    let in_manifest = |reason: String| {
        archive_err(
            &what,
            format!("manifest {}: {reason}", manifest_desc.digest),
        )
    };
    let config_desc = manifest_json
        .get("config")
        .ok_or_else(|| in_manifest("no config descriptor".into()))
        .and_then(|v| descriptor(v).map_err(|e| in_manifest(format!("config: {e}"))))?;
    if !mt::is_image_config(&config_desc.media_type) {
        return Err(in_manifest(format!(
            "config {}: unsupported media type {:?} (not a container image: expected an OCI or Docker image config)",
            config_desc.digest, config_desc.media_type
        )));
    }
    let layer_descs = manifest_json
        .get("layers")
        .and_then(Value::as_array)
        .ok_or_else(|| in_manifest("no layers list".into()))?
        .iter()
        .enumerate()
        .map(|(i, v)| descriptor(v).map_err(|e| in_manifest(format!("layer {}: {e}", i + 1))))
        .collect::<Result<Vec<_>, _>>()?;
    let config = layout.read_blob(&config_desc, MAX_CONFIG_SIZE, "config")?;
    let (_, c) = crate::assemble::parse_image(&manifest, &config)?;
    let diff_ids = c.rootfs.as_ref().map_or(&[][..], |r| &r.diff_ids);
    // Every layer blob is checked against its descriptor (media type, a
    // regular file of its size) before the first is imported, so a bad one
    // fails the import before anything is published.
    let mut blobs = Vec::with_capacity(layer_descs.len());
    for (desc, diff_id) in layer_descs.iter().zip(diff_ids) {
        if Compression::of_layer(&desc.media_type).is_none() {
            return Err(LayerError::MediaType {
                layer: desc.digest.clone(),
                media_type: desc.media_type.clone(),
            });
        }
        let cached = crate::layer::has_layer(store, diff_id);
        blobs.push(match layout.open_blob(desc, "layer") {
            Ok(f) if !cached => Some(f),
            Ok(_) => None,
            // A cached layer's blob is not needed, only checked if there.
            Err(_) if cached && !layout.blob_path(&desc.digest)?.exists() => None,
            Err(e) => return Err(e),
        });
    }
    let name = opts.name.clone().or_else(|| match tag {
        Some(t) => Some(t.to_owned()),
        None => dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
    });
    // Several layers at once, as a pull does; a repeated layer once. The
    // image is written as the layers are checked, as a pull writes it.
    let first = first_of_each(&diff_ids[..layer_descs.len().min(diff_ids.len())]);
    let (infos, staged) = import_each_staged(
        store,
        &diff_ids[..blobs.len()],
        opts.layer_jobs(),
        first.iter().all(|&f| f),
        |i, cancel, checked| {
            let (Some(file), true) = (&blobs[i], first[i]) else {
                return Ok(None);
            };
            let desc = &layer_descs[i];
            import_layer_with(
                store,
                BufReader::with_capacity(
                    1 << 20,
                    Cancellable::new(Read::take(file, desc.size), cancel),
                ),
                Some(&desc.media_type),
                Some(&desc.digest),
                Some(&diff_ids[i]),
                &opts.limits,
                checked,
            )
            .map(Some)
        },
        &mut |built| {
            let tree = built.map(|(tree, _)| tree);
            StagedImage::from_tree(
                store,
                &manifest,
                &config,
                name.as_deref(),
                Some(&what),
                tree,
            )
        },
    )?;
    let mut image = staged.publish()?;
    mark_fresh(&mut image.layers, &infos);
    image.name = name;
    Ok(image)
}

/// Marks the layers imported just now (the others came from the cache).
fn mark_fresh(layers: &mut [LayerInfo], infos: &[Option<LayerInfo>]) {
    for (l, i) in layers.iter_mut().zip(infos) {
        l.cached = i.as_ref().is_none_or(|i| i.cached);
    }
}

/// Follows a descriptor to an image manifest, through image indexes;
/// returns the manifest and its descriptor.
fn resolve_manifest(
    layout: &Layout,
    desc: &Descriptor,
    platform: &PlatformSpec,
    depth: usize,
) -> Result<(Vec<u8>, Descriptor), LayerError> {
    let kind = DocKind::of(&desc.media_type).ok_or_else(|| {
        archive_err(
            &layout.what,
            format!(
                "{}: unsupported media type {:?} (expected an OCI image index or manifest, or a Docker schema 2 manifest or manifest list)",
                desc.digest, desc.media_type
            ),
        )
    })?;
    let data = layout.read_blob(desc, MAX_MANIFEST_SIZE, kind.name())?;
    let json: Value = serde_json::from_slice(&data).map_err(|e| {
        archive_err(
            &layout.what,
            format!("{} {}: {e}", kind.name(), desc.digest),
        )
    })?;
    check_declared_media_type(&json, desc).map_err(|e| {
        archive_err(
            &layout.what,
            format!("{} {}: {e}", kind.name(), desc.digest),
        )
    })?;
    if kind == DocKind::Manifest {
        return Ok((data, desc.clone()));
    }
    if depth >= MAX_INDEX_DEPTH {
        return Err(archive_err(&layout.what, "image indexes nested too deep"));
    }
    let digest = &desc.digest;
    let list = json
        .get("manifests")
        .and_then(Value::as_array)
        .ok_or_else(|| archive_err(&layout.what, format!("index {digest} has no manifests")))?;
    // Each entry's platform is read on its own (one malformed entry does
    // not spoil the others); the chosen entry is then checked whole.
    let entries: Vec<(&Value, Option<platform::Platform>)> = list
        .iter()
        .map(|m| {
            let p = m
                .get("platform")
                .and_then(|p| serde_json::from_value(p.clone()).ok());
            (m, p)
        })
        .collect();
    let (pick, _) = platform::choose_by(&entries, |(_, p)| p.as_ref(), platform).map_err(|e| {
        archive_err(
            &layout.what,
            format!(
                "no image for platform {} in index {digest} (available: {})",
                e.wanted,
                if e.available.is_empty() {
                    "none".to_owned()
                } else {
                    e.available.join(", ")
                }
            ),
        )
    })?;
    let pick = descriptor(pick).map_err(|e| {
        archive_err(
            &layout.what,
            format!("index {digest}: entry for {platform}: {e}"),
        )
    })?;
    resolve_manifest(layout, &pick, platform, depth + 1)
}

/// Fuzzing oracle for the OCI layout's JSON: `data` read as `index.json`
/// (its descriptors, an image index's media type check, platform choice)
/// and as an image manifest (its config and layer descriptors). Never
/// panics, whatever `data` is; the answer is whether it was accepted.
#[doc(hidden)]
pub fn fuzz_layout_json(data: &[u8]) -> bool {
    let Ok(json) = serde_json::from_slice::<Value>(data) else {
        return false;
    };
    let as_index = Descriptor {
        media_type: mt::OCI_INDEX.to_owned(),
        digest: sha256_digest(data),
        size: data.len() as u64,
        urls: Vec::new(),
        platform: None,
        annotations: Default::default(),
    };
    let mut ok = check_declared_media_type(&json, &as_index).is_ok();
    if let Some(list) = json.get("manifests").and_then(Value::as_array) {
        let _ = tags_of(list);
        let host = PlatformSpec::host();
        for m in list {
            let desc = descriptor(m);
            ok &= desc
                .as_ref()
                .is_ok_and(|d| DocKind::of(&d.media_type).is_some());
            let _ = m
                .get("platform")
                .and_then(|p| serde_json::from_value::<platform::Platform>(p.clone()).ok())
                .is_some_and(|p| host.matches(&p));
        }
    }
    if let Some(c) = json.get("config") {
        ok &= descriptor(c).is_ok();
    }
    if let Some(layers) = json.get("layers").and_then(Value::as_array) {
        for l in layers {
            ok &= descriptor(l).is_ok_and(|d| Compression::of_layer(&d.media_type).is_some());
        }
    }
    ok
}
