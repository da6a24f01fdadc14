//! Resolving a reference to a manifest, a config and layer descriptors, and
//! pulling an image into the store.
//!
//! Order of trust: the manifest's bytes are checked against the pinned
//! digest, the index entry that named them (its size, digest and media
//! type), or the registry's `Docker-Content-Digest`; the config's size and
//! digest against the manifest; each layer blob's size by the blob reader
//! and its digest and diff_id by the layer importer while it streams,
//! before the layer becomes visible. The image is written from the layers'
//! checked entries (while their last objects and records are published)
//! and published only once every layer is in. Every digest is parsed
//! (`cairn_spec::parse_digest`) before a URL is made from it. An
//! interrupted pull leaves only `tmp/` debris, and the layers it finished
//! are reused by the next one.
//!
//! This module owns the order of a pull and its concurrency (a few threads,
//! one layer each at a time); it never parses tar and never writes to the
//! store except through the importer.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use serde::Serialize;

use crate::client::{BlobEvent, BodySize, ClientOptions, FetchedManifest, Registry};
use crate::digest::Digest;
use crate::platform::{self, PlatformSpec};
use crate::reference::ImageRef;
use crate::spec::{self, media_type, Compression, Manifest, MAX_CONFIG_SIZE, MAX_MANIFEST_SIZE};
use crate::PullError;
use cairn_spec::limits::MAX_INDEX_DEPTH;

/// One layer of a resolved image.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    pub digest: Digest,
    pub diff_id: Digest,
    pub size: u64,
    /// As the manifest spells it.
    pub media_type: String,
    pub compression: Compression,
}

/// What a reference resolves to: verified manifest and config bytes and the
/// layers to fetch.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub reference: ImageRef,
    /// The index the manifest was chosen from, if any.
    pub index_digest: Option<Digest>,
    pub manifest_digest: Digest,
    pub manifest_media_type: String,
    pub manifest_bytes: Vec<u8>,
    /// The index entry's platform (`linux/amd64`), when chosen from an index.
    pub platform: Option<String>,
    pub config_digest: Digest,
    pub config_bytes: Vec<u8>,
    pub layers: Vec<LayerPlan>,
}

/// Fetches and checks the manifest (choosing from an index by `platform`,
/// default the host's), the config, and the layer list of `r`.
pub fn resolve(
    reg: &Registry,
    r: &ImageRef,
    platform: Option<&PlatformSpec>,
) -> Result<Resolved, PullError> {
    let fetched = reg.fetch_manifest(
        &r.repository,
        &r.manifest_reference(),
        &media_type::MANIFEST_ACCEPT,
        BodySize::AtMost(MAX_MANIFEST_SIZE),
        &r.to_string(),
    )?;
    resolve_fetched(reg, r, platform, fetched)
}

/// [`resolve`] from `r`'s top manifest or index, already fetched (by its
/// tag or digest, with [`media_type::MANIFEST_ACCEPT`]) by the caller:
/// `cairn pull --lazy` reads it first to see whether it is a cairn
/// artifact, and does not ask the registry for it twice.
pub fn resolve_fetched(
    reg: &Registry,
    r: &ImageRef,
    platform: Option<&PlatformSpec>,
    fetched: FetchedManifest,
) -> Result<Resolved, PullError> {
    let display = r.to_string();
    let repo = &r.repository;
    let what = format!("manifest {display}");
    let mut bytes = fetched.bytes;
    let mut digest = Digest::of(&bytes);
    if let Some(pinned) = &r.digest {
        if digest != *pinned {
            return Err(PullError::DigestMismatch {
                what,
                expected: pinned.to_string(),
                actual: digest.to_string(),
            });
        }
    } else if let Some(said) = fetched
        .docker_digest
        .as_deref()
        .and_then(|h| Digest::parse(h.trim()).ok())
    {
        if said != digest {
            return Err(PullError::DigestMismatch {
                what: format!("{what} (Docker-Content-Digest)"),
                expected: said.to_string(),
                actual: digest.to_string(),
            });
        }
    }
    let (mut mtype, mut manifest) =
        spec::parse_manifest(&bytes, fetched.content_type.as_deref(), &what)?;
    let mut index_digest = None;
    let mut chosen = None;
    let want = platform.cloned().unwrap_or_else(PlatformSpec::host);
    let mut depth = 0;
    let image = loop {
        let index = match manifest {
            Manifest::Image(m) => break m,
            Manifest::Index(index) => index,
        };
        depth += 1;
        if depth > MAX_INDEX_DEPTH {
            return Err(PullError::Invalid {
                what,
                detail: format!("image indexes nested more than {MAX_INDEX_DEPTH} deep"),
            });
        }
        let entry = platform::choose(&index.manifests, &want).map_err(|e| {
            PullError::NoMatchingPlatform {
                reference: display.clone(),
                wanted: e.wanted,
                available: e.available,
            }
        })?;
        let entry_platform = entry.platform.as_ref().map(platform::describe);
        let child_what = format!(
            "manifest {display} for {}",
            entry_platform.as_deref().unwrap_or("its only platform")
        );
        let child = spec::descriptor_digest(entry, &child_what)?;
        spec::check_manifest_media_type(&entry.media_type, &child_what)?;
        if entry.size > MAX_MANIFEST_SIZE {
            return Err(PullError::TooLarge {
                what: child_what,
                size: Some(entry.size),
                limit: MAX_MANIFEST_SIZE,
            });
        }
        let child_fetched = reg.fetch_manifest(
            repo,
            child.as_str(),
            &media_type::MANIFEST_ACCEPT,
            BodySize::Exactly(entry.size),
            &format!(
                "{}/{}@{child} ({} in the index of {display})",
                r.registry,
                r.repository,
                entry_platform.as_deref().unwrap_or("its only entry")
            ),
        )?;
        let child_bytes = child_fetched.bytes;
        check_blob(&child_what, &child, entry.size, &child_bytes)?;
        index_digest.get_or_insert(digest);
        chosen = entry_platform.or(chosen);
        // The entry's media type, not the registry's Content-Type, says
        // what the bytes are: the entry is covered by the index's digest.
        (mtype, manifest) = spec::parse_manifest_for(&child_bytes, entry, &child_what)?;
        bytes = child_bytes;
        digest = child;
    };

    let config_what = format!("config of {display}");
    spec::check_config_media_type(&image.config.media_type, &config_what)?;
    let config_digest = spec::descriptor_digest(&image.config, &config_what)?;
    let config_what = format!("config {config_digest} of {display}");
    if image.config.size > MAX_CONFIG_SIZE {
        return Err(PullError::TooLarge {
            what: config_what,
            size: Some(image.config.size),
            limit: MAX_CONFIG_SIZE,
        });
    }
    let config_bytes = reg.fetch_blob_bytes(
        repo,
        &config_digest,
        BodySize::Exactly(image.config.size),
        &config_what,
    )?;
    check_blob(
        &config_what,
        &config_digest,
        image.config.size,
        &config_bytes,
    )?;
    let config = spec::parse_config(&config_bytes, image.layers.len(), &config_what)?;
    let diff_ids = config.rootfs.as_ref().map_or(&[][..], |r| &r.diff_ids);
    if let (Some(wanted), None, Some(arch)) = (platform, &index_digest, &config.architecture) {
        // A single-platform image for another platform than asked for. Its
        // variant is not compared: configs often leave it out, and the
        // image is the only one there is.
        let os = config.os.clone().unwrap_or_else(|| "linux".to_string());
        let have = spec::Platform {
            architecture: arch.clone(),
            os: os.clone(),
            ..Default::default()
        };
        let wanted_any_variant = PlatformSpec {
            variant: None,
            ..wanted.clone()
        };
        if !wanted_any_variant.matches(&have) {
            let mut have = format!("{os}/{arch}");
            if let Some(v) = config.variant.as_deref().filter(|v| !v.is_empty()) {
                have = format!("{have}/{v}");
            }
            return Err(PullError::NoMatchingPlatform {
                reference: display,
                wanted: wanted.to_string(),
                available: vec![have],
            });
        }
    }

    let mut layers = Vec::with_capacity(image.layers.len());
    for (i, (desc, diff_id)) in image.layers.iter().zip(diff_ids).enumerate() {
        let lwhat = format!("layer {} of {display}", i + 1);
        let digest = spec::descriptor_digest(desc, &lwhat)?;
        let compression =
            spec::layer_compression(&desc.media_type, &format!("layer {digest} of {display}"))?;
        layers.push(LayerPlan {
            digest,
            diff_id: Digest::parse(diff_id).map_err(|e| PullError::Invalid {
                what: lwhat,
                detail: e.to_string(),
            })?,
            size: desc.size,
            media_type: desc.media_type.clone(),
            compression,
        });
    }
    Ok(Resolved {
        reference: r.clone(),
        index_digest,
        manifest_digest: digest,
        manifest_media_type: mtype,
        manifest_bytes: bytes,
        platform: chosen,
        config_digest,
        config_bytes,
        layers,
    })
}

/// Checks fetched bytes against their descriptor's size and digest.
fn check_blob(what: &str, digest: &Digest, size: u64, bytes: &[u8]) -> Result<(), PullError> {
    if bytes.len() as u64 != size {
        return Err(PullError::SizeMismatch {
            what: what.to_string(),
            expected: size,
            actual: bytes.len() as u64,
        });
    }
    let actual = Digest::of(bytes);
    if actual != *digest {
        return Err(PullError::DigestMismatch {
            what: what.to_string(),
            expected: digest.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

/// What a pull reports as it goes. Layer indexes are positions in
/// [`Resolved::layers`].
#[derive(Debug)]
pub enum PullEvent<'a> {
    Resolved(&'a Resolved),
    /// Already in the store (by diff_id): neither fetched nor parsed.
    LayerCached {
        index: usize,
        layer: &'a LayerPlan,
    },
    LayerStart {
        index: usize,
        layer: &'a LayerPlan,
    },
    /// Bytes of the blob received so far.
    LayerProgress {
        index: usize,
        bytes: u64,
    },
    LayerRetry {
        index: usize,
        attempt: u32,
        detail: &'a str,
    },
    LayerDone {
        index: usize,
        layer: &'a LayerPlan,
    },
    Assembling,
}

/// Hears [`PullEvent`]s, from several threads at once.
pub trait PullObserver: Sync {
    fn event(&self, event: &PullEvent<'_>);
}

impl<F: Fn(&PullEvent<'_>) + Sync> PullObserver for F {
    fn event(&self, event: &PullEvent<'_>) {
        self(event)
    }
}

/// How to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    pub client: ClientOptions,
    /// Which image of an index; default the host's platform.
    pub platform: Option<PlatformSpec>,
    /// Layers fetched at once.
    pub jobs: usize,
    /// The name (ref) to give the image.
    pub name: Option<String>,
    pub limits: cairn_image::Limits,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions {
            client: ClientOptions::default(),
            platform: None,
            jobs: 3,
            name: None,
            limits: cairn_image::Limits::default(),
        }
    }
}

/// One layer, as pulled.
#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    pub digest: String,
    pub diff_id: String,
    pub size: u64,
    pub media_type: String,
    /// Fetched by this pull (false: it was in the store already).
    pub fetched: bool,
    /// Tar entries, as the importer counted them.
    pub entries: Option<u64>,
    /// Bytes of the uncompressed tar stream.
    pub unpacked_size: Option<u64>,
}

/// What a pull did.
#[derive(Debug, Clone, Serialize)]
pub struct PullReport {
    pub reference: String,
    pub name: Option<String>,
    pub image_digest: String,
    pub manifest_digest: String,
    pub index_digest: Option<String>,
    pub config_digest: String,
    pub platform: Option<String>,
    pub layers: Vec<LayerReport>,
    /// Blob bytes fetched by this pull.
    pub bytes_fetched: u64,
}

/// Pulls `reference` into `store`: resolve, fetch and import the layers the
/// store lacks (`opts.jobs` at a time, each streamed straight into the
/// importer), then assemble the image and name it `opts.name`.
pub fn pull(
    store: &cairn_store::Store,
    reference: &ImageRef,
    opts: &PullOptions,
    observer: &dyn PullObserver,
) -> Result<PullReport, PullError> {
    let reg = Registry::new(reference, &opts.client);
    let resolved = resolve(&reg, reference, opts.platform.as_ref())?;
    observer.event(&PullEvent::Resolved(&resolved));
    // Shared: other pulls and imports go on; gc (exclusive) waits.
    let _lock = store.lock_shared()?;

    let mut todo = Vec::new();
    let mut queued = HashSet::new();
    let mut fetched = vec![false; resolved.layers.len()];
    for (i, l) in resolved.layers.iter().enumerate() {
        if cairn_image::has_layer(store, l.diff_id.as_str()) {
            observer.event(&PullEvent::LayerCached { index: i, layer: l });
        } else if queued.insert(&l.diff_id) {
            todo.push(i);
            fetched[i] = true;
        }
    }
    let source = format!("docker://{reference}");
    let assemble_err = |error| PullError::Assemble {
        reference: reference.to_string(),
        error: Box::new(error),
    };
    // The image's tree is built from the lines of the layers imported now
    // as their imports write them, and the image is written once each is
    // checked, while their last objects and records are published (a sync
    // of each stream's tail: 50-130 ms for the python image); it is
    // published once they are. A layer imported now that the image holds
    // twice is read from its record, after it is published.
    let overlap = todo.iter().all(|&i| {
        let d = &resolved.layers[i].diff_id;
        resolved.layers.iter().filter(|l| &l.diff_id == d).count() == 1
    });
    let stage = |tree: Option<cairn_image::BuiltTree>| {
        observer.event(&PullEvent::Assembling);
        cairn_image::StagedImage::from_tree(
            store,
            &resolved.manifest_bytes,
            &resolved.config_bytes,
            opts.name.as_deref(),
            Some(&source),
            tree,
        )
    };
    // With the overlap, the tree is built on this thread from each
    // fetched layer's lines as its import writes them (a tap per layer),
    // and from the records of the layers in the store.
    let diff_ids: Vec<String> = resolved
        .layers
        .iter()
        .map(|l| l.diff_id.to_string())
        .collect();
    let tapped: Vec<bool> = fetched.iter().map(|&f| overlap && f).collect();
    let (feeds, reports, mut ends) = cairn_image::reports(&tapped);
    let (fetched_layers, staged) = std::thread::scope(|s| {
        // The reports (the taps and their channel) go with the fetcher:
        // once it has ended, the tree below stops waiting for them.
        let (reg, resolved, todo) = (&reg, &resolved, &todo);
        let fetcher =
            s.spawn(move || fetch_layers(store, reg, resolved, todo, opts, observer, &reports));
        let staged = overlap.then(|| {
            cairn_image::build_tree_as_imported(store, &diff_ids, feeds, &mut |i| ends.end(i))
                .and_then(|tree| stage(Some(tree)))
        });
        if matches!(staged, Some(Err(_))) {
            // No image will be written: the fetches need not run on.
            ends.stop();
        }
        let fetched_layers = fetcher
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (fetched_layers, staged)
    });
    match (fetched_layers, &staged) {
        // The tree (or the image) failed first and stopped the fetches:
        // its error, below, is the one.
        (Err(PullError::Cancelled), Some(Err(_))) | (Ok(()), _) => {}
        // A layer's own error says more than the tree's "stopped".
        (Err(e), _) => return Err(e),
    }
    let staged = staged
        .unwrap_or_else(|| stage(None))
        .map_err(assemble_err)?;
    let image = staged.publish().map_err(assemble_err)?;
    let layers = resolved
        .layers
        .iter()
        .zip(&fetched)
        .enumerate()
        .map(|(i, (l, &f))| {
            let info = image.layers.get(i);
            LayerReport {
                digest: l.digest.to_string(),
                diff_id: l.diff_id.to_string(),
                size: l.size,
                media_type: l.media_type.clone(),
                fetched: f,
                entries: info.map(|x| x.entries),
                unpacked_size: info.map(|x| x.size),
            }
        })
        .collect::<Vec<_>>();
    Ok(PullReport {
        reference: reference.to_string(),
        name: opts.name.clone(),
        image_digest: image.image_digest,
        manifest_digest: resolved.manifest_digest.to_string(),
        index_digest: resolved.index_digest.as_ref().map(ToString::to_string),
        config_digest: resolved.config_digest.to_string(),
        platform: resolved.platform.clone(),
        bytes_fetched: layers.iter().filter(|l| l.fetched).map(|l| l.size).sum(),
        layers,
    })
}

/// Fetches and imports the layers at `todo` (indexes into
/// `resolved.layers`), `opts.jobs` at a time. The first failure stops the
/// others and is the one returned; stopped by the pull's tree (which
/// failed), it returns [`PullError::Cancelled`].
/// Each layer's import goes through `reports`, which hands it its tap and
/// tells the pull's tree how it ended; see [`cairn_image::Reports`].
fn fetch_layers(
    store: &cairn_store::Store,
    reg: &Registry,
    resolved: &Resolved,
    todo: &[usize],
    opts: &PullOptions,
    observer: &dyn PullObserver,
    reports: &cairn_image::Reports,
) -> Result<(), PullError> {
    let next = AtomicUsize::new(0);
    // The pull's tree sets it too, when it fails (`Ends::stop`).
    let cancel = reports.stop();
    let first_error: Mutex<Option<PullError>> = Mutex::new(None);
    let jobs = opts.jobs.clamp(1, todo.len().max(1));
    let worker = || {
        while !cancel.load(Ordering::Relaxed) {
            let Some(&index) = todo.get(next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            let layer = &resolved.layers[index];
            observer.event(&PullEvent::LayerStart { index, layer });
            if let Err(e) =
                fetch_layer(store, reg, resolved, index, cancel, opts, observer, reports)
            {
                // Whoever stops the others first has the error that
                // matters. A fetch stopped while it waited on the network
                // may fail with that wait's error (a timeout) rather than
                // `Cancelled`: it is not the pull's error either, nor is
                // any error after the pull's tree stopped the fetches.
                if !cancel.swap(true, Ordering::Relaxed) && !matches!(e, PullError::Cancelled) {
                    let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                }
                break;
            }
            observer.event(&PullEvent::LayerDone { index, layer });
        }
    };
    std::thread::scope(|s| {
        for _ in 1..jobs {
            s.spawn(worker);
        }
        worker();
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None if cancel.load(Ordering::Relaxed) => Err(PullError::Cancelled),
        None => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
fn fetch_layer(
    store: &cairn_store::Store,
    reg: &Registry,
    resolved: &Resolved,
    index: usize,
    cancel: &AtomicBool,
    opts: &PullOptions,
    observer: &dyn PullObserver,
    reports: &cairn_image::Reports,
) -> Result<(), PullError> {
    let layer = &resolved.layers[index];
    let reader = reg.blob_reader(
        &resolved.reference.repository,
        &layer.digest,
        layer.size,
        Some(cancel),
        Box::new(move |ev| match ev {
            BlobEvent::Progress(bytes) => {
                observer.event(&PullEvent::LayerProgress { index, bytes })
            }
            BlobEvent::Retry { attempt, detail } => observer.event(&PullEvent::LayerRetry {
                index,
                attempt,
                detail: &detail,
            }),
        }),
    );
    let slot = reader.error_slot();
    let result = reports.import(index, |watch| {
        cairn_image::import_layer_with(
            store,
            reader,
            Some(layer.compression.oci_media_type()),
            Some(layer.digest.as_str()),
            Some(layer.diff_id.as_str()),
            &opts.limits,
            watch,
        )
    });
    match result {
        Ok(_) => Ok(()),
        Err(error) => {
            // The network error that broke the stream says more than the
            // importer's "reading the blob failed".
            let fetch_error = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
            Err(fetch_error.unwrap_or_else(|| PullError::Layer {
                digest: layer.digest.to_string(),
                error: Box::new(error),
            }))
        }
    }
}
