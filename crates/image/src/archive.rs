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
//!   (default: the host's). Every blob is checked against its digest.
//! - **docker archive** (`manifest.json`, the config, one tar per layer,
//!   possibly gzipped or symlinked to another): read in two passes over the
//!   archive file without unpacking it: one to find the members, then each
//!   member straight from its offset. Docker archives have no OCI manifest,
//!   so one is made: uncompressed layer descriptors whose digests are the
//!   diff_ids.
//! - **directory**: scanned like `cairn mkfs`, written as one tar stream
//!   (in memory, through a pipe to the importer: never on disk) and
//!   imported as a one-layer image with a minimal config for the host.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use cairn_store::Store;
use serde_json::{json, Value};

use crate::assemble::{
    assemble_image_from, now_rfc3339, sha256_digest, ImportedImage, MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
};
use crate::layer::{clean_path, import_layer, LayerInfo, Limits};
use crate::scan::{scan_dir, ScanOptions};
use crate::tar::{EntryKind, TarLimits, TarReader, TarSource};
use crate::LayerError;

const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Most members a docker archive may have.
const MAX_ARCHIVE_MEMBERS: usize = 1_000_000;

/// An OS and CPU an image is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl Platform {
    /// Parses `os/arch[/variant]`.
    pub fn parse(s: &str) -> Result<Platform, String> {
        let parts: Vec<&str> = s.split('/').collect();
        match parts[..] {
            [os, arch] if !os.is_empty() && !arch.is_empty() => Ok(Platform {
                os: os.into(),
                architecture: arch.into(),
                variant: None,
            }),
            [os, arch, variant] if !os.is_empty() && !arch.is_empty() && !variant.is_empty() => {
                Ok(Platform {
                    os: os.into(),
                    architecture: arch.into(),
                    variant: Some(variant.into()),
                })
            }
            _ => Err(format!(
                "invalid platform {s:?}: expected os/arch[/variant]"
            )),
        }
    }

    fn matches(&self, p: &Value) -> bool {
        let get = |k: &str| p.get(k).and_then(Value::as_str);
        get("os") == Some(self.os.as_str())
            && get("architecture") == Some(self.architecture.as_str())
            && match (&self.variant, get("variant")) {
                (None, _) => true,
                (Some(want), Some(have)) => want == have,
                // arm64 images usually leave out the default variant.
                (Some(want), None) => self.architecture == "arm64" && want == "v8",
            }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// The platform of this machine, in OCI terms.
pub fn host_platform() -> Platform {
    let (architecture, variant) = match std::env::consts::ARCH {
        "x86_64" => ("amd64", None),
        "x86" => ("386", None),
        "aarch64" => ("arm64", None),
        "arm" => ("arm", Some("v7")),
        "powerpc64" if cfg!(target_endian = "little") => ("ppc64le", None),
        "riscv64" => ("riscv64", None),
        "s390x" => ("s390x", None),
        other => (other, None),
    };
    Platform {
        os: "linux".into(),
        architecture: architecture.into(),
        variant: variant.map(str::to_owned),
    }
}

/// How to import an image from a local source.
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// The name to give it (mapped to a ref); each source has a default.
    pub name: Option<String>,
    /// The platform to pick from an image index (default: the host's).
    pub platform: Option<Platform>,
    pub limits: Limits,
}

fn archive_err(archive: &str, reason: impl std::fmt::Display) -> LayerError {
    LayerError::Archive {
        archive: archive.to_owned(),
        reason: reason.to_string(),
    }
}

/// Reads at most `max` bytes of a file.
fn read_capped(path: &Path, max: usize) -> io::Result<Vec<u8>> {
    let f = File::open(path)?;
    let mut data = Vec::new();
    f.take(max as u64 + 1).read_to_end(&mut data)?;
    if data.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than the limit of {max} bytes"),
        ));
    }
    Ok(data)
}

/// An OCI layout on disk.
struct Layout {
    dir: PathBuf,
    what: String,
}

impl Layout {
    fn blob_path(&self, digest: &str) -> Result<PathBuf, LayerError> {
        let hex = digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                archive_err(
                    &self.what,
                    format!("digest {digest:?} is not sha256:<64 hex digits>"),
                )
            })?;
        Ok(self.dir.join("blobs/sha256").join(hex))
    }

    /// A small blob (manifest, index, config), checked against its digest.
    fn read_blob(&self, digest: &str, max: usize, what: &str) -> Result<Vec<u8>, LayerError> {
        let path = self.blob_path(digest)?;
        let data = read_capped(&path, max)
            .map_err(|e| archive_err(&self.what, format!("{what} {digest}: {e}")))?;
        let actual = sha256_digest(&data);
        if actual != digest {
            return Err(archive_err(
                &self.what,
                format!("{what} blob {digest} has digest {actual}"),
            ));
        }
        Ok(data)
    }
}

fn tags_of(manifests: &[Value]) -> Vec<String> {
    manifests
        .iter()
        .filter_map(|m| m.pointer("/annotations/org.opencontainers.image.ref.name"))
        .filter_map(Value::as_str)
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
    let index_data = read_capped(&dir.join("index.json"), MAX_MANIFEST_BYTES)
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
            .find(|m| {
                m.pointer("/annotations/org.opencontainers.image.ref.name")
                    .and_then(Value::as_str)
                    == Some(t)
            })
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
    let platform = opts.platform.clone().unwrap_or_else(host_platform);
    let (manifest, _) = resolve_manifest(&layout, chosen, &platform, 0)?;
    let manifest_json: Value = serde_json::from_slice(&manifest)
        .map_err(|e| archive_err(&what, format!("manifest: {e}")))?;
    let config_digest = manifest_json
        .pointer("/config/digest")
        .and_then(Value::as_str)
        .ok_or_else(|| archive_err(&what, "manifest has no config digest"))?;
    let config = layout.read_blob(config_digest, MAX_CONFIG_BYTES, "config")?;
    let (m, c) = crate::assemble::parse_image(&manifest, &config)?;
    let mut infos = Vec::new();
    for (desc, diff_id) in m.layers.iter().zip(&c.rootfs.diff_ids) {
        if crate::layer::has_layer(store, diff_id) {
            infos.push(None);
            continue;
        }
        let path = layout.blob_path(&desc.digest)?;
        let file = File::open(&path)
            .map_err(|e| archive_err(&what, format!("layer blob {}: {e}", desc.digest)))?;
        let info = import_layer(
            store,
            BufReader::with_capacity(1 << 20, file),
            desc.media_type.as_deref(),
            Some(&desc.digest),
            Some(diff_id),
            &opts.limits,
        )?;
        infos.push(Some(info));
    }
    let name = opts.name.clone().or_else(|| match tag {
        Some(t) => Some(t.to_owned()),
        None => dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
    });
    let mut image = assemble_image_from(store, &manifest, &config, name.as_deref(), Some(&what))?;
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

/// Follows a descriptor to an image manifest, through image indexes.
fn resolve_manifest(
    layout: &Layout,
    desc: &Value,
    platform: &Platform,
    depth: usize,
) -> Result<(Vec<u8>, String), LayerError> {
    let digest = desc
        .get("digest")
        .and_then(Value::as_str)
        .ok_or_else(|| archive_err(&layout.what, "a descriptor has no digest"))?;
    let data = layout.read_blob(digest, MAX_MANIFEST_BYTES, "manifest")?;
    let json: Value = serde_json::from_slice(&data)
        .map_err(|e| archive_err(&layout.what, format!("manifest {digest}: {e}")))?;
    let media_type = json
        .get("mediaType")
        .and_then(Value::as_str)
        .or_else(|| desc.get("mediaType").and_then(Value::as_str))
        .unwrap_or("");
    let is_index = media_type == MEDIA_INDEX
        || media_type == MEDIA_DOCKER_LIST
        || (json.get("manifests").is_some() && json.get("layers").is_none());
    if !is_index {
        return Ok((data, digest.to_owned()));
    }
    if depth >= 2 {
        return Err(archive_err(&layout.what, "image indexes nested too deep"));
    }
    let list = json
        .get("manifests")
        .and_then(Value::as_array)
        .ok_or_else(|| archive_err(&layout.what, format!("index {digest} has no manifests")))?;
    let pick = list
        .iter()
        .find(|m| m.get("platform").is_some_and(|p| platform.matches(p)))
        .ok_or_else(|| {
            let have: Vec<String> = list
                .iter()
                .filter_map(|m| m.get("platform"))
                .map(|p| {
                    let g = |k| p.get(k).and_then(Value::as_str).unwrap_or("?");
                    format!("{}/{}", g("os"), g("architecture"))
                })
                .collect();
            archive_err(
                &layout.what,
                format!(
                    "no image for platform {platform} in index {digest} (it has {})",
                    have.join(", ")
                ),
            )
        })?;
    resolve_manifest(layout, pick, platform, depth + 1)
}

/// A file read through a buffer that skips by seeking.
struct Seekable(BufReader<File>);

impl Read for Seekable {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl TarSource for Seekable {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let n = i64::try_from(n).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        self.0.seek_relative(n)
    }
}

/// Where a member of a docker archive is.
#[derive(Debug, Clone)]
struct Member {
    offset: u64,
    size: u64,
    kind: EntryKind,
    link: Vec<u8>,
}

/// Imports the image in a `docker save` archive. The default name is the
/// image's first `RepoTags` entry.
pub fn import_docker_archive(
    store: &Store,
    path: &Path,
    opts: &ImportOptions,
) -> Result<ImportedImage, LayerError> {
    let what = format!("docker-archive:{}", path.display());
    // Held from the first layer to the ref, so gc never takes a layer
    // between its import and the image that needs it.
    let _lock = store
        .lock_shared()
        .map_err(LayerError::store("locking the store"))?;

    let open = || File::open(path).map_err(|e| archive_err(&what, format!("opening: {e}")));
    // Pass 1: where every member is.
    let mut members: HashMap<Vec<u8>, Member> = HashMap::new();
    let mut tar = TarReader::new(
        Seekable(BufReader::with_capacity(64 * 1024, open()?)),
        TarLimits::from(&opts.limits),
    );
    loop {
        let e = match tar.next_entry() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(e) => {
                return Err(archive_err(
                    &what,
                    format!(
                        "byte {}{}: {}",
                        e.offset,
                        e.entry
                            .as_ref()
                            .map(|p| format!(" (member {:?})", String::from_utf8_lossy(p)))
                            .unwrap_or_default(),
                        e.reason()
                    ),
                ))
            }
        };
        if members.len() >= MAX_ARCHIVE_MEMBERS {
            return Err(archive_err(
                &what,
                format!("more than {MAX_ARCHIVE_MEMBERS} members"),
            ));
        }
        let key = clean_path(&e.path)
            .map_err(|r| {
                archive_err(
                    &what,
                    format!("member {:?}: {r}", String::from_utf8_lossy(&e.path)),
                )
            })?
            .join(&b'/');
        members.insert(
            key,
            Member {
                offset: e.data_offset,
                size: e.stored,
                kind: e.kind,
                link: e.link.clone(),
            },
        );
    }
    drop(tar);

    let find = |name: &str| -> Result<Member, LayerError> {
        let mut key = clean_path(name.as_bytes())
            .map_err(|r| archive_err(&what, format!("{name:?}: {r}")))?
            .join(&b'/');
        // Follow symlinks between members (older docker links shared layers).
        for _ in 0..8 {
            let m = members
                .get(&key)
                .ok_or_else(|| archive_err(&what, format!("no member {name:?}")))?;
            match m.kind {
                EntryKind::Regular => return Ok(m.clone()),
                EntryKind::Symlink | EntryKind::Hardlink => {
                    let target = if m.kind == EntryKind::Symlink && !m.link.starts_with(b"/") {
                        let mut base: Vec<&[u8]> = key.split(|&b| b == b'/').collect();
                        base.pop();
                        let mut joined = base.join(&b'/');
                        joined.push(b'/');
                        joined.extend_from_slice(&m.link);
                        joined
                    } else {
                        m.link.clone()
                    };
                    key = clean_path(&target)
                        .map_err(|r| archive_err(&what, format!("{name:?}: link {r}")))?
                        .join(&b'/');
                }
                _ => return Err(archive_err(&what, format!("member {name:?} is not a file"))),
            }
        }
        Err(archive_err(
            &what,
            format!("member {name:?}: too many links"),
        ))
    };
    let read_member = |name: &str, max: usize| -> Result<Vec<u8>, LayerError> {
        let m = find(name)?;
        if m.size > max as u64 {
            return Err(archive_err(
                &what,
                format!("{name}: {} bytes is larger than the limit of {max}", m.size),
            ));
        }
        let mut f = open()?;
        f.seek(SeekFrom::Start(m.offset))
            .map_err(|e| archive_err(&what, format!("{name}: {e}")))?;
        let mut data = Vec::with_capacity(m.size as usize);
        f.take(m.size)
            .read_to_end(&mut data)
            .map_err(|e| archive_err(&what, format!("{name}: {e}")))?;
        if data.len() as u64 != m.size {
            return Err(archive_err(&what, format!("{name}: archive is truncated")));
        }
        Ok(data)
    };

    let manifest_data = read_member("manifest.json", MAX_MANIFEST_BYTES)?;
    let manifest: Value = serde_json::from_slice(&manifest_data)
        .map_err(|e| archive_err(&what, format!("manifest.json: {e}")))?;
    let images = manifest
        .as_array()
        .ok_or_else(|| archive_err(&what, "manifest.json is not a list"))?;
    let image = match (images.as_slice(), &opts.name) {
        ([one], _) => one,
        ([], _) => return Err(archive_err(&what, "manifest.json lists no images")),
        (many, Some(name)) => many
            .iter()
            .find(|i| {
                i.get("RepoTags")
                    .and_then(Value::as_array)
                    .is_some_and(|t| t.iter().any(|t| t.as_str() == Some(name)))
            })
            .ok_or_else(|| {
                archive_err(&what, format!("no image tagged {name:?} in the archive"))
            })?,
        (many, None) => {
            return Err(archive_err(
                &what,
                format!("{} images in the archive: pick one with --name", many.len()),
            ))
        }
    };
    let config_name = image
        .get("Config")
        .and_then(Value::as_str)
        .ok_or_else(|| archive_err(&what, "manifest.json: image without Config"))?;
    let layer_names: Vec<&str> = image
        .get("Layers")
        .and_then(Value::as_array)
        .ok_or_else(|| archive_err(&what, "manifest.json: image without Layers"))?
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| archive_err(&what, "manifest.json: a layer is not a string"))
        })
        .collect::<Result<_, _>>()?;
    let config = read_member(config_name, MAX_CONFIG_BYTES)?;
    let config_json: Value = serde_json::from_slice(&config)
        .map_err(|e| archive_err(&what, format!("config {config_name}: {e}")))?;
    let diff_ids: Vec<String> = config_json
        .pointer("/rootfs/diff_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| archive_err(&what, "config has no rootfs.diff_ids"))?
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    if diff_ids.len() != layer_names.len() {
        return Err(archive_err(
            &what,
            format!(
                "{} layers but {} diff_ids in the config",
                layer_names.len(),
                diff_ids.len()
            ),
        ));
    }
    let mut infos = Vec::new();
    let mut descriptors = Vec::new();
    for (lname, diff_id) in layer_names.iter().zip(&diff_ids) {
        let info = if crate::layer::has_layer(store, diff_id) {
            None
        } else {
            let m = find(lname)?;
            let mut f = open()?;
            f.seek(SeekFrom::Start(m.offset))
                .map_err(|e| archive_err(&what, format!("{lname}: {e}")))?;
            let reader = BufReader::with_capacity(1 << 20, f.take(m.size));
            let info = import_layer(store, reader, None, None, Some(diff_id), &opts.limits)?;
            Some(info)
        };
        let size = match &info {
            Some(i) => i.size,
            None => store
                .layer_record(diff_id)
                .map_err(LayerError::store(format!("reading layer {diff_id}")))?
                .map(|r| r.size)
                .unwrap_or(0),
        };
        descriptors.push(json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": diff_id,
            "size": size,
        }));
        infos.push(info);
    }
    let oci_manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha256_digest(&config),
            "size": config.len(),
        },
        "layers": descriptors,
    }))
    .expect("JSON values serialise");
    let name = opts.name.clone().or_else(|| {
        image
            .get("RepoTags")
            .and_then(Value::as_array)
            .and_then(|t| t.first())
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    let mut result =
        assemble_image_from(store, &oci_manifest, &config, name.as_deref(), Some(&what))?;
    mark_fresh(&mut result.layers, &infos);
    result.name = name;
    Ok(result)
}

/// A `Read` fed by another thread through a channel.
struct ChannelReader {
    rx: mpsc::Receiver<io::Result<Vec<u8>>>,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            match self.rx.recv() {
                Ok(Ok(chunk)) => {
                    self.buf = chunk;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The writing end of a [`ChannelReader`].
struct ChannelWriter {
    tx: mpsc::SyncSender<io::Result<Vec<u8>>>,
    buf: Vec<u8>,
}

const CHANNEL_CHUNK: usize = 256 * 1024;

impl io::Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHANNEL_CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHANNEL_CHUNK));
        self.tx
            .send(Ok(chunk))
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))
    }
}

/// Imports the directory at `dir` as a one-layer image. The default name
/// is the directory's name.
pub fn import_dir(
    store: &Store,
    dir: &Path,
    opts: &ImportOptions,
) -> Result<ImportedImage, LayerError> {
    let what = format!("dir:{}", dir.display());
    // Held from the first layer to the ref, so gc never takes a layer
    // between its import and the image that needs it.
    let _lock = store
        .lock_shared()
        .map_err(LayerError::store("locking the store"))?;

    let scan = ScanOptions {
        store: Some(store),
        ..ScanOptions::default()
    };
    let (tree, _) = scan_dir(dir, &scan).map_err(|e| archive_err(&what, e))?;
    let (tx, rx) = mpsc::sync_channel(4);
    let info = std::thread::scope(|s| {
        let tree = &tree;
        s.spawn(move || {
            let mut w = ChannelWriter {
                tx: tx.clone(),
                buf: Vec::with_capacity(CHANNEL_CHUNK),
            };
            let r = crate::export::write_tar(tree, store, &mut w)
                .and_then(|_| io::Write::flush(&mut w));
            if let Err(e) = r {
                let _ = tx.send(Err(e));
            }
        });
        let reader = ChannelReader {
            rx,
            buf: Vec::new(),
            pos: 0,
        };
        import_layer(
            store,
            reader,
            Some("application/vnd.oci.image.layer.v1.tar"),
            None,
            None,
            &opts.limits,
        )
    })?;
    let platform = host_platform();
    let mut config = json!({
        "created": now_rfc3339(),
        "architecture": platform.architecture,
        "os": platform.os,
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [info.diff_id]},
        "history": [{"created_by": format!("cairn import {what}")}],
    });
    if let Some(v) = platform.variant {
        config["variant"] = json!(v);
    }
    let config = serde_json::to_vec(&config).expect("JSON values serialise");
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha256_digest(&config),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": info.diff_id,
            "size": info.size,
        }],
    }))
    .expect("JSON values serialise");
    let name = opts.name.clone().or_else(|| {
        dir.canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    });
    let mut result = assemble_image_from(store, &manifest, &config, name.as_deref(), Some(&what))?;
    mark_fresh(&mut result.layers, &[Some(info)]);
    result.name = name;
    Ok(result)
}
