//! `docker save` archives: read in two passes over the archive file
//! without unpacking it (the members and their offsets, then each member
//! straight from its offset), checked as the module above says, imported
//! as a registry pull imports its layers.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use cairn_spec::limits::{MAX_CONFIG_SIZE, MAX_MANIFEST_SIZE};
use cairn_spec::media_type as mt;
use cairn_spec::{parse_digest, sha256_digest};
use cairn_store::Store;
use serde_json::{json, Value};

use super::{archive_err, mark_fresh, ImportOptions, MAX_ARCHIVE_MEMBERS};
use crate::assemble::{ImportedImage, StagedImage};
use crate::entry::clean_path;
use crate::layer::import_layer_with;
use crate::layer_jobs::{first_of_each, import_each_staged, Cancellable};
use crate::tar::{EntryKind, TarLimits, TarReader, TarSource};
use crate::LayerError;

/// A file read through a buffer that skips by seeking.
struct Seekable(BufReader<File>);

impl Read for Seekable {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl TarSource for Seekable {
    /// Seeks past `n` bytes, and fails as a read would at an early end: a
    /// seek beyond the end of a file succeeds, and the next header read
    /// would then see a clean end of the archive, not a cut-off member.
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let at = self.0.stream_position()?;
        let len = self.0.get_ref().metadata()?.len();
        if at.checked_add(n).is_none_or(|end| end > len) {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
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
    let read_member = |name: &str, max: u64| -> Result<Vec<u8>, LayerError> {
        let m = find(name)?;
        if m.size > max {
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

    let manifest_data = read_member("manifest.json", MAX_MANIFEST_SIZE)?;
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
    // Digests that member names state, parsed before anything is read.
    let config_named = member_digest(config_name, ".json")
        .map_err(|e| archive_err(&what, format!("config {config_name:?}: {e}")))?;
    let layer_named = layer_names
        .iter()
        .map(|n| {
            member_digest(n, ".tar")
                .map_err(|e| archive_err(&what, format!("manifest.json: layer {n:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let config = read_member(config_name, MAX_CONFIG_SIZE)?;
    if let Some(named) = config_named {
        let actual = sha256_digest(&config);
        if actual != named {
            return Err(archive_err(
                &what,
                format!("config {config_name:?}: digest mismatch: its name says {named}, its content is {actual}"),
            ));
        }
    }
    let config_json: Value = serde_json::from_slice(&config)
        .map_err(|e| archive_err(&what, format!("config {config_name}: {e}")))?;
    let diff_ids: Vec<String> = config_json
        .pointer("/rootfs/diff_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| archive_err(&what, "config has no rootfs.diff_ids"))?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let d = v.as_str().ok_or_else(|| {
                archive_err(
                    &what,
                    format!("config {config_name}: rootfs.diff_ids[{i}] is not a string"),
                )
            })?;
            parse_digest(d).map_err(|e| {
                archive_err(
                    &what,
                    format!("config {config_name}: rootfs.diff_ids[{i}]: {e}"),
                )
            })?;
            Ok(d.to_owned())
        })
        .collect::<Result<_, LayerError>>()?;
    // Before any layer is imported: the image's own check of the limit
    // (assemble.rs) comes only once every layer is in the store.
    if layer_names.len() > cairn_spec::limits::MAX_LAYERS {
        return Err(archive_err(
            &what,
            format!(
                "{} layers (at most {})",
                layer_names.len(),
                cairn_spec::limits::MAX_LAYERS
            ),
        ));
    }
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
    let name = opts.name.clone().or_else(|| {
        image
            .get("RepoTags")
            .and_then(Value::as_array)
            .and_then(|t| t.first())
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    // The archive has no OCI manifest: cairn writes one, whose layer
    // sizes are those of the uncompressed streams (known once each layer
    // is checked, or from the records of layers in the store already).
    let oci_manifest = |sizes: &[Option<u64>]| -> Result<Vec<u8>, LayerError> {
        let mut descriptors = Vec::new();
        for (i, diff_id) in diff_ids.iter().enumerate() {
            let size = match sizes.get(i) {
                Some(Some(size)) => *size,
                _ => store
                    .layer_record(diff_id)
                    .map_err(LayerError::store(format!("reading layer {diff_id}")))?
                    .map(|r| r.size)
                    .unwrap_or(0),
            };
            descriptors.push(json!({
                "mediaType": mt::OCI_LAYER_TAR,
                "digest": diff_id,
                "size": size,
            }));
        }
        Ok(serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": mt::OCI_MANIFEST,
            "config": {
                "mediaType": mt::OCI_CONFIG,
                "digest": sha256_digest(&config),
                "size": config.len(),
            },
            "layers": descriptors,
        }))
        .expect("JSON values serialise"))
    };
    // Each layer member read from its own offset, several at once as a
    // pull does; a repeated layer once. The image is written as the layers
    // are checked, as a pull writes it.
    let first = first_of_each(&diff_ids);
    let (infos, staged) = import_each_staged(
        store,
        &diff_ids,
        opts.layer_jobs(),
        first.iter().all(|&f| f),
        |i, cancel, checked| {
            let (lname, diff_id) = (layer_names[i], &diff_ids[i]);
            if !first[i] || crate::layer::has_layer(store, diff_id) {
                return Ok(None);
            }
            let m = find(lname)?;
            let mut f = open()?;
            f.seek(SeekFrom::Start(m.offset))
                .map_err(|e| archive_err(&what, format!("{lname}: {e}")))?;
            let reader =
                BufReader::with_capacity(1 << 20, Cancellable::new(f.take(m.size), cancel));
            import_layer_with(
                store,
                reader,
                None,
                layer_named[i].as_deref(),
                Some(diff_id),
                &opts.limits,
                checked,
            )
            .map(Some)
            .map_err(|e| {
                // Say which member; a read error (of the archive file, not
                // of its data) stays what it is.
                if matches!(e, LayerError::Read { .. }) {
                    e
                } else {
                    archive_err(&what, format!("layer {lname:?}: {e}"))
                }
            })
        },
        &mut |built| {
            let (tree, sizes) = match built {
                Some((tree, sizes)) => (Some(tree), sizes),
                None => (None, Vec::new()),
            };
            let manifest = oci_manifest(&sizes)?;
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
    let mut result = staged.publish()?;
    mark_fresh(&mut result.layers, &infos);
    result.name = name;
    Ok(result)
}

/// The digest a docker archive member's name states, if it states one:
/// `blobs/<algorithm>/<encoded>` (docker 25 and later, an OCI layout's
/// blob) or `<64 hex digits><suffix>` (docker's and skopeo's config,
/// `<image id>.json`). Layer names of older archives (`<id>/layer.tar`)
/// are not digests of the layer and state none. A `blobs/` name that is
/// not a digest cairn verifies is an error, not ignored.
fn member_digest(name: &str, suffix: &str) -> Result<Option<String>, String> {
    let name = name.strip_prefix("./").unwrap_or(name);
    if let Some(rest) = name.strip_prefix("blobs/") {
        let digest = rest.replacen('/', ":", 1);
        parse_digest(&digest).map_err(|e| e.to_string())?;
        return Ok(Some(digest));
    }
    Ok(name
        .strip_suffix(suffix)
        .filter(|hex| hex.len() == 64)
        .map(|hex| format!("sha256:{hex}"))
        .filter(|d| parse_digest(d).is_ok()))
}
