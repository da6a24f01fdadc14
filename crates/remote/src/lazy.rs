//! `cairn pull --lazy REF`: the metadata of an image, without its file
//! contents, as an *incomplete* image of the store.
//!
//! REF is resolved to a manifest as `cairn pull` does (index → platform).
//! If that manifest is itself a cairn artifact, it is used; otherwise its
//! referrers are asked for (the referrers API, else the referrers tag
//! schema `sha256-<hex>`), and the last cairn artifact listed is used.
//! Without one the pull fails and says why: never a silent full pull.
//!
//! Fetched and checked: the artifact manifest (by digest; the referrers
//! are asked while the manifest is resolved, see [`find_artifact`]), the
//! config (its digest; the resolution's copy when the artifact names the
//! same config), the EROFS image (the blob's digest, then the decompressed
//! image's sha256 against the annotation), the index (the blob's digest,
//! then parsed with limits), and that every object the image's files use
//! is in the index with the size the image gives it. Under the shared
//! store lock, the image file is written while the image is walked for
//! that last check; its lazy index, its record (which says where the
//! objects come from, and makes it an image of the store) and its name
//! only once the check has passed.

use std::collections::BTreeMap;

use cairn_oci::client::{BodySize, Referrers};
use cairn_oci::spec::{media_type, MAX_MANIFEST_SIZE};
use cairn_oci::{ClientOptions, Digest, ImageRef, PlatformSpec, Registry};
use cairn_store::{ImageRecord, LazySource, ObjectId, Store};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::artifact::{self, Artifact, MAX_ARTIFACT_MANIFEST, MAX_EROFS};
use crate::index::{Index, MAX_INDEX_BYTES};
use crate::RemoteError;

/// How to pull lazily.
#[derive(Debug, Clone)]
pub struct LazyPullOptions {
    pub client: ClientOptions,
    pub platform: Option<PlatformSpec>,
    /// The name to give the image.
    pub name: Option<String>,
    /// Fetch the objects of the artifact's prefetch list (if it has one)
    /// before returning (`cairn pull --lazy`; not with `--no-prefetch`,
    /// nor in the snapshotter's remote path). Without it a lazy mount's
    /// server fetches the list in the background once it serves, while
    /// the container starts (docs/lazy-fuse.md, "The prefetch list: when
    /// it is fetched").
    pub prefetch: bool,
    /// For the prefetch list: neighbouring objects of a pack in one
    /// request up to this many bytes, and this many requests in flight.
    pub coalesce: u64,
    pub jobs: usize,
}

impl Default for LazyPullOptions {
    fn default() -> Self {
        LazyPullOptions {
            client: ClientOptions::default(),
            platform: None,
            name: None,
            prefetch: true,
            coalesce: crate::fetch::FetchOptions::default().coalesce,
            jobs: crate::fetch::FetchOptions::default().jobs,
        }
    }
}

/// The largest prefetch list read (32 bytes an object).
pub(crate) const MAX_PREFETCH: u64 = 32 << 20;

/// What a lazy pull did.
#[derive(Debug, Clone, Serialize)]
pub struct LazyPullReport {
    pub reference: String,
    pub name: Option<String>,
    pub image_digest: String,
    pub artifact_digest: String,
    pub manifest_digest: String,
    pub objects: u64,
    pub object_bytes: u64,
    /// Objects the store has already.
    pub objects_local: u64,
    /// Bytes fetched: manifests, config, EROFS image and index.
    pub bytes_fetched: u64,
    /// The image was complete in the store already.
    pub complete: bool,
    /// Objects of the prefetch list fetched by this pull.
    pub prefetched: u64,
}

/// What a lazy pull found for a reference.
enum Lookup {
    /// A cairn artifact.
    Artifact(Found),
    /// No artifact, but every layer carries an eStargz TOC annotation:
    /// the resolved image and the annotations.
    Estargz(Box<cairn_oci::Resolved>, Vec<String>),
}

/// The artifact found for a reference, and the manifest it is for.
struct Found {
    artifact_digest: Digest,
    artifact_bytes: Vec<u8>,
    /// The source image's manifest (digest, bytes), when it could be read.
    source: Option<(Digest, Vec<u8>)>,
    /// Its config (digest, bytes), fetched and checked as it was resolved:
    /// not fetched again if the artifact names the same.
    config: Option<(Digest, Vec<u8>)>,
}

fn fetch_artifact(
    reg: &Registry,
    repo: &str,
    blob: &artifact::Blob,
    display: &str,
) -> Result<Vec<u8>, RemoteError> {
    if blob.size > MAX_ARTIFACT_MANIFEST {
        return Err(RemoteError::invalid(
            format!("artifact {}", blob.digest),
            format!("{} bytes, more than {MAX_ARTIFACT_MANIFEST}", blob.size),
        ));
    }
    let m = reg.fetch_manifest(
        repo,
        blob.digest.as_str(),
        &[media_type::OCI_MANIFEST],
        BodySize::Exactly(blob.size),
        &format!("{display} (cairn artifact {})", blob.digest),
    )?;
    let actual = Digest::of(&m.bytes);
    if actual != blob.digest {
        return Err(cairn_oci::PullError::DigestMismatch {
            what: format!("artifact manifest of {display}"),
            expected: blob.digest.to_string(),
            actual: actual.to_string(),
        }
        .into());
    }
    Ok(m.bytes)
}

/// What the referrers of a manifest hold for a lazy pull: the last cairn
/// artifact they list with its manifest's bytes (or none), how they were
/// looked up, and the bytes fetched for that.
struct Referring {
    artifact: Option<(Digest, Vec<u8>)>,
    how: &'static str,
    fetched: u64,
}

/// Looks up the cairn artifacts that refer to the manifest `subject` (the
/// referrers API, else the referrers tag schema) and fetches the last
/// one's manifest.
fn referring_artifact(
    reg: &Registry,
    r: &ImageRef,
    subject: &Digest,
    display: &str,
) -> Result<Referring, RemoteError> {
    let repo = &r.repository;
    let mut fetched = 0u64;
    let (listed, how) = match reg.referrers(repo, subject, Some(media_type::CAIRN_LAZY_ARTIFACT))? {
        Referrers::Index(bytes) => {
            fetched += bytes.len() as u64;
            (
                artifact::artifacts_in(&bytes, &format!("referrers of {subject}"))?,
                "the referrers API",
            )
        }
        Referrers::NoApi => {
            let tag = artifact::referrers_tag(subject);
            match reg.fetch_manifest(
                repo,
                &tag,
                &[media_type::OCI_INDEX],
                BodySize::AtMost(MAX_ARTIFACT_MANIFEST),
                &format!("{}/{repo}:{tag}", r.registry),
            ) {
                Ok(m) => {
                    fetched += m.bytes.len() as u64;
                    (
                        artifact::artifacts_in(&m.bytes, &format!("referrers index {tag}"))?,
                        "the referrers tag schema",
                    )
                }
                Err(cairn_oci::PullError::ManifestUnknown { .. }) => {
                    (Vec::new(), "the referrers tag schema")
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let artifact = match listed.last() {
        Some(chosen) => {
            let bytes = fetch_artifact(reg, repo, chosen, display)?;
            fetched += bytes.len() as u64;
            Some((chosen.digest.clone(), bytes))
        }
        None => None,
    };
    Ok(Referring {
        artifact,
        how,
        fetched,
    })
}

/// A scoped thread's result (its panic goes on in the caller).
fn join<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Whether `bytes` (fetched with `content_type`) are an image manifest,
/// not an index: its digest is then the referrers' subject.
fn is_image_manifest(bytes: &[u8], content_type: Option<&str>) -> bool {
    matches!(
        cairn_oci::spec::parse_manifest(bytes, content_type, "manifest"),
        Ok((_, cairn_oci::spec::Manifest::Image(_)))
    )
}

/// Finds the cairn artifact for `r`: `r` itself, or a referrer of the
/// manifest `r` resolves to.
///
/// The referrers are looked up while the manifest is resolved (its config
/// fetched), not after: for a reference pinned to a digest (the
/// snapshotter's, from containerd's `cri.manifest-digest` label) from the
/// start, with that digest as the subject; otherwise once the manifest is
/// read, if it is an image manifest (an index's platform manifest is known
/// only once resolved). A lookup for a subject the resolution does not
/// end at is dropped, and the right one made then.
fn find_artifact(
    reg: &Registry,
    r: &ImageRef,
    platform: Option<&PlatformSpec>,
    fetched: &mut u64,
) -> Result<Lookup, RemoteError> {
    let display = r.to_string();
    let repo = &r.repository;
    std::thread::scope(|s| {
        let early = r.digest.as_ref().map(|subject| {
            let display = &display;
            (
                subject.clone(),
                s.spawn(move || referring_artifact(reg, r, subject, display)),
            )
        });
        // Read once: an artifact is used as it is, anything else is
        // resolved from these bytes as `cairn pull` resolves it.
        let top = reg.fetch_manifest(
            repo,
            &r.manifest_reference(),
            &media_type::MANIFEST_ACCEPT,
            BodySize::AtMost(MAX_MANIFEST_SIZE),
            &display,
        )?;
        *fetched += top.bytes.len() as u64;
        if artifact::is_artifact(&top.bytes) {
            let digest = Digest::of(&top.bytes);
            if let Some(pinned) = &r.digest {
                if *pinned != digest {
                    return Err(cairn_oci::PullError::DigestMismatch {
                        what: format!("manifest {display}"),
                        expected: pinned.to_string(),
                        actual: digest.to_string(),
                    }
                    .into());
                }
            }
            // The source manifest, for the record, if the repository has it.
            let a = artifact::parse(&top.bytes, &format!("artifact {display}"))?;
            let source = a.subject.as_ref().and_then(|s| {
                let m = reg
                    .fetch_manifest(
                        repo,
                        s.digest.as_str(),
                        &media_type::MANIFEST_ACCEPT,
                        BodySize::Exactly(s.size),
                        &format!("subject {} of {display}", s.digest),
                    )
                    .ok()?;
                (Digest::of(&m.bytes) == s.digest).then(|| (s.digest.clone(), m.bytes))
            });
            return Ok(Lookup::Artifact(Found {
                artifact_digest: digest,
                artifact_bytes: top.bytes,
                source,
                config: None,
            }));
        }
        let late = match &early {
            None if is_image_manifest(&top.bytes, top.content_type.as_deref()) => {
                let subject = Digest::of(&top.bytes);
                let display = &display;
                let for_subject = subject.clone();
                Some((
                    subject,
                    s.spawn(move || referring_artifact(reg, r, &for_subject, display)),
                ))
            }
            _ => None,
        };
        let resolved = cairn_oci::resolve_fetched(reg, r, platform, top)?;
        if resolved.index_digest.is_some() {
            // Chosen from an index: the platform's manifest was fetched too.
            *fetched += resolved.manifest_bytes.len() as u64;
        }
        let subject = &resolved.manifest_digest;
        let mut looked = None;
        for (for_subject, h) in early.into_iter().chain(late) {
            let got = join(h);
            if for_subject == *subject {
                looked = Some(got?);
            } else if let Ok(dropped) = got {
                // Not used, but fetched all the same.
                *fetched += dropped.fetched;
            }
        }
        let looked = match looked {
            Some(l) => l,
            None => referring_artifact(reg, r, subject, &display)?,
        };
        *fetched += looked.fetched;
        let Some((artifact_digest, artifact_bytes)) = looked.artifact else {
            if let Some(annotations) =
                crate::estargz_pull::toc_annotations(&resolved.manifest_bytes)
            {
                return Ok(Lookup::Estargz(Box::new(resolved), annotations));
            }
            let layers: Vec<&str> = resolved
                .layers
                .iter()
                .map(|l| l.media_type.as_str())
                .collect();
            let stargz = has_stargz_toc(&resolved.manifest_bytes);
            let toc = if stargz {
                "only some of its layers carry eStargz table-of-contents annotations (cairn reads \
                 an eStargz image lazily only when every layer has one)"
                    .to_string()
            } else {
                format!(
                    "it has no eStargz table of contents either (its layers are plain {})",
                    layers.join(", ")
                )
            };
            return Err(RemoteError::NotLazy {
                reference: display.clone(),
                why: format!(
                    "no cairn lazy artifact ({}) refers to its manifest {subject} in {}/{repo} \
                     (looked up through {}), and {toc}; `cairn pull {display}` pulls it whole, \
                     and `cairn push` publishes an artifact for it",
                    media_type::CAIRN_LAZY_ARTIFACT,
                    r.registry,
                    looked.how,
                ),
            });
        };
        Ok(Lookup::Artifact(Found {
            artifact_digest,
            artifact_bytes,
            source: Some((subject.clone(), resolved.manifest_bytes)),
            config: Some((resolved.config_digest, resolved.config_bytes)),
        }))
    })
}

/// The layer annotation eStargz images carry (the digest of each layer's
/// table of contents).
const STARGZ_TOC_ANNOTATION: &str = "containerd.io/snapshot/stargz/toc.digest";

/// Whether any layer of the manifest says it is eStargz.
fn has_stargz_toc(manifest: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(manifest)
        .ok()
        .and_then(|m| {
            m["layers"].as_array().map(|ls| {
                ls.iter()
                    .any(|l| l["annotations"][STARGZ_TOC_ANNOTATION].is_string())
            })
        })
        .unwrap_or(false)
}

/// Fetches a whole blob of the artifact and checks its digest.
fn fetch_blob(
    reg: &Registry,
    repo: &str,
    blob: &artifact::Blob,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, RemoteError> {
    if blob.size > limit {
        return Err(cairn_oci::PullError::TooLarge {
            what: what.to_string(),
            size: Some(blob.size),
            limit,
        }
        .into());
    }
    let bytes = reg.fetch_blob_bytes(repo, &blob.digest, BodySize::Exactly(blob.size), what)?;
    let actual = Digest::of(&bytes);
    if actual != blob.digest {
        return Err(cairn_oci::PullError::DigestMismatch {
            what: what.to_string(),
            expected: blob.digest.to_string(),
            actual: actual.to_string(),
        }
        .into());
    }
    Ok(bytes)
}

/// The objects an EROFS image uses, with the size it gives each.
pub(crate) fn image_objects(
    image: &[u8],
    what: &str,
) -> Result<BTreeMap<ObjectId, u64>, RemoteError> {
    let c = cairn_store::ImageContents::from_image_bytes(image)
        .map_err(|e| RemoteError::invalid(what, e))?;
    if let Some(bad) = c.bad_payloads.first() {
        return Err(RemoteError::invalid(
            what,
            format!(
                "{} is backed by {:?}, which is not an object",
                String::from_utf8_lossy(&bad.path),
                String::from_utf8_lossy(&bad.payload)
            ),
        ));
    }
    Ok(c.objects.into_iter().map(|(id, u)| (id, u.size)).collect())
}

/// Pulls the metadata of `r` lazily into `store`; see the module docs.
pub fn pull_lazy(
    store: &Store,
    r: &ImageRef,
    opts: &LazyPullOptions,
) -> Result<LazyPullReport, RemoteError> {
    let reg = Registry::new(r, &opts.client);
    let repo = r.repository.clone();
    let display = r.to_string();
    let mut fetched = 0u64;
    let found = match find_artifact(&reg, r, opts.platform.as_ref(), &mut fetched)? {
        Lookup::Artifact(found) => found,
        Lookup::Estargz(resolved, annotations) => {
            return crate::estargz_pull::pull_estargz(
                store,
                r,
                opts,
                &reg,
                *resolved,
                annotations,
                fetched,
            )
        }
    };
    let awhat = format!("cairn artifact {} of {display}", found.artifact_digest);
    let a: Artifact = artifact::parse(&found.artifact_bytes, &awhat)?;
    if let (Some(subject), Some((digest, _))) = (&a.subject, &found.source) {
        if subject.digest != *digest {
            return Err(RemoteError::invalid(
                &awhat,
                format!("its subject is {}, not {digest}", subject.digest),
            ));
        }
    }

    // The EROFS image and the object index at once, and the config unless
    // the resolution fetched the same one already: one round trip.
    let ewhat = format!("EROFS metadata {} of {display}", a.erofs.digest);
    let iwhat = format!("object index {} of {display}", a.index.digest);
    let cwhat = format!("config {} of {display}", a.config.digest);
    let known_config = found
        .config
        .as_ref()
        .filter(|(d, _)| *d == a.config.digest)
        .map(|(_, b)| b.clone());
    let (config, erofs_z, index_z) = std::thread::scope(|s| {
        let erofs = s.spawn(|| fetch_blob(&reg, &repo, &a.erofs, MAX_EROFS, &ewhat));
        let index = s.spawn(|| fetch_blob(&reg, &repo, &a.index, MAX_INDEX_BYTES, &iwhat));
        let config = match known_config {
            Some(bytes) => Ok(bytes),
            None => fetch_blob(
                &reg,
                &repo,
                &a.config,
                cairn_oci::spec::MAX_CONFIG_SIZE,
                &cwhat,
            ),
        };
        (config, join(erofs), join(index))
    });
    let (config, erofs_z, index_z) = (config?, erofs_z?, index_z?);
    fetched += (config.len() + erofs_z.len() + index_z.len()) as u64;
    let parsed_config: cairn_spec::ImageConfig = serde_json::from_slice(&config)
        .map_err(|e| RemoteError::invalid(format!("config of {display}"), e.to_string()))?;
    let image = artifact::unzstd(
        &erofs_z,
        a.erofs_size.unwrap_or(MAX_EROFS).min(MAX_EROFS),
        &ewhat,
    )?;
    drop(erofs_z);

    // Two threads from here. One walks the whole image for the objects it
    // uses (the longest step); the other checks the image's digest, reads
    // the index, and puts the image file into the store. The lazy index
    // and the record, which makes the image an image of the store, are
    // written only once both are done and the index has every object the
    // image uses: until then a new image file is unnamed and unrecorded,
    // as after a crash between the writes, and gc removes it.
    let _lock = store.lock_shared()?;
    let (objects, checked) = std::thread::scope(|s| {
        let walk = s.spawn(|| image_objects(&image, &ewhat));
        let checked = (|| -> Result<(String, Index, bool), RemoteError> {
            let image_sha = hex::encode(Sha256::digest(&image));
            if let Some(expected) = &a.erofs_sha256 {
                if *expected != image_sha {
                    return Err(cairn_oci::PullError::DigestMismatch {
                        what: format!("{ewhat} (decompressed)"),
                        expected: format!("sha256:{expected}"),
                        actual: format!("sha256:{image_sha}"),
                    }
                    .into());
                }
            }
            let index = Index::parse(artifact::unzstd(&index_z, MAX_INDEX_BYTES, &iwhat)?)
                .map_err(|e| RemoteError::invalid(&iwhat, e.0))?;
            check_packs(&a, &index, &iwhat)?;
            let complete = complete_in_store(store, &image_sha);
            if !complete {
                // The image file only: it is named by its bytes, so an
                // earlier pull's copy stays as it was. The lazy index
                // goes with the record, after the check: an incomplete
                // image already here keeps the index its record names
                // if this pull's artifact turns out bad.
                write_image_file(store, &image)?;
            }
            Ok((image_sha, index, complete))
        })();
        (join(walk), checked)
    });
    let (image_sha, index, complete) = checked?;
    let objects = objects?;
    for (id, size) in &objects {
        match index.size(id) {
            Some(s) if s == *size => {}
            Some(s) => {
                return Err(RemoteError::invalid(
                    &iwhat,
                    format!("object {id} is {s} bytes, the image says {size}"),
                ))
            }
            None => {
                return Err(RemoteError::invalid(
                    &iwhat,
                    format!("object {id}, which the image uses, is not in it"),
                ))
            }
        }
    }
    let object_bytes: u64 = objects.values().sum();

    // The record, and the name.
    let mut lookup = store.object_lookup();
    let objects_local = objects.keys().filter(|id| lookup.has(id)).count() as u64;
    if !complete {
        let (manifest_digest, manifest) = match &found.source {
            Some((d, b)) => (d.to_string(), String::from_utf8_lossy(b).into_owned()),
            None => (
                found.artifact_digest.to_string(),
                String::from_utf8_lossy(&found.artifact_bytes).into_owned(),
            ),
        };
        let record = ImageRecord {
            manifest_digest,
            config_digest: a.config.digest.to_string(),
            manifest,
            image_size: image.len() as u64,
            ..incomplete_record(
                &image_sha,
                &config,
                &parsed_config,
                &display,
                LazySource {
                    registry: r.registry.clone(),
                    repository: repo.clone(),
                    artifact_digest: found.artifact_digest.to_string(),
                    artifact_manifest: String::from_utf8_lossy(&found.artifact_bytes).into_owned(),
                    index_digest: a.index.digest.to_string(),
                    objects: objects.len() as u64,
                    object_bytes,
                    estargz: false,
                },
            )
        };
        store.write_lazy_index(&image_sha, &index_z)?;
        store.write_image_record(&record)?;
    }
    if let Some(name) = &opts.name {
        store.set_ref(&cairn_store::ref_name_for(name), &image_sha)?;
    }
    let mut prefetched = 0;
    if let (Some(list), false, true) = (&a.prefetch, complete, opts.prefetch) {
        let pwhat = format!("prefetch list {} of {display}", list.digest);
        let bytes = fetch_blob(&reg, &repo, list, MAX_PREFETCH, &pwhat)?;
        fetched += bytes.len() as u64;
        let entries = crate::prefetch::parse(&list.media_type, &bytes, &pwhat)?;
        let remote = crate::fetch::RemoteObjects::open(store, &image_sha, &opts.client)?;
        // Only objects the image uses: the list is a hint, not a command.
        // Fetched as `cairn fetch` fetches (neighbours of a pack in one
        // request, a few requests in flight, one publication a group):
        // `cairn push` puts the list's objects first in the packs, in its
        // order, so they come in a few large requests.
        // A v2 entry that names chunks of a large object is left to the
        // lazy layer's server, which fetches only those chunks into the
        // partial object its opens read: a partial object is not stored
        // (only whole, checked objects are), so the pull has nowhere to
        // keep them (docs/lazy-fuse.md, "Chunk entries of the list").
        let listed: Vec<ObjectId> = crate::prefetch::resolve(entries, remote.index(), &pwhat)?
            .into_iter()
            .filter(|e| e.chunks.is_none())
            .map(|e| e.id)
            .filter(|id| objects.contains_key(id))
            .collect();
        let (n, _, _) =
            crate::fetch::fetch_objects(store, &remote, &listed, opts.coalesce, opts.jobs)?;
        prefetched = n;
    }
    Ok(LazyPullReport {
        reference: display,
        name: opts.name.clone(),
        image_digest: image_sha,
        artifact_digest: found.artifact_digest.to_string(),
        manifest_digest: found
            .source
            .map_or_else(|| found.artifact_digest.to_string(), |(d, _)| d.to_string()),
        objects: objects.len() as u64,
        object_bytes,
        objects_local,
        bytes_fetched: fetched,
        complete,
        prefetched,
    })
}

/// The index's packs must be the artifact's, length for length.
pub(crate) fn check_packs(a: &Artifact, index: &Index, what: &str) -> Result<(), RemoteError> {
    if index.packs().len() != a.packs.len() {
        return Err(RemoteError::invalid(
            what,
            format!(
                "lists {} packs, the artifact has {}",
                index.packs().len(),
                a.packs.len()
            ),
        ));
    }
    for (i, (len, blob)) in index.packs().iter().zip(&a.packs).enumerate() {
        if *len != blob.size {
            return Err(RemoteError::invalid(
                what,
                format!(
                    "pack {i} is {len} bytes, the artifact says {} ({})",
                    blob.size, blob.digest
                ),
            ));
        }
    }
    Ok(())
}

/// The record of an incomplete image, as both kinds of lazy pull write it
/// (a cairn artifact's, an eStargz image's): no layers, the config's
/// creation time and platform, the size of its objects. The caller sets
/// the manifest fields.
pub(crate) fn incomplete_record(
    image_sha: &str,
    config: &[u8],
    parsed_config: &cairn_spec::ImageConfig,
    display: &str,
    lazy: LazySource,
) -> ImageRecord {
    ImageRecord {
        image_digest: image_sha.to_owned(),
        manifest_digest: String::new(),
        config_digest: String::new(),
        manifest: String::new(),
        config: String::from_utf8_lossy(config).into_owned(),
        layers: Vec::new(),
        created: parsed_config.created.clone(),
        architecture: parsed_config.architecture.clone(),
        os: parsed_config.os.clone(),
        imported: cairn_image::now_rfc3339(),
        image_size: 0,
        content_size: lazy.object_bytes,
        source: Some(format!("docker://{display}")),
        lazy: Some(lazy),
    }
}

/// Writes an incomplete image in the order docs/lazy-format.md gives ("The
/// incomplete image in the store"): the EROFS image (staged, synced,
/// renamed), its lazy index, then its record. The caller holds the store
/// lock shared and has found the image not complete in the store.
pub(crate) fn write_incomplete(
    store: &Store,
    image: &[u8],
    index: &[u8],
    mut record: ImageRecord,
) -> Result<(), RemoteError> {
    let digest = stage_incomplete(store, image, index)?;
    debug_assert_eq!(digest, record.image_digest);
    record.image_size = image.len() as u64;
    store.write_image_record(&record)?;
    Ok(())
}

/// Whether the store has the image `image_sha` complete already (a lazy
/// pull of it then writes nothing).
pub(crate) fn complete_in_store(store: &Store, image_sha: &str) -> bool {
    store
        .image_record(image_sha)
        .ok()
        .flatten()
        .is_some_and(|rec| store.has_image(image_sha) && rec.lazy.is_none())
}

/// The files of an incomplete image without its record: the image file,
/// then its lazy index. Returns the image's digest.
fn stage_incomplete(store: &Store, image: &[u8], index: &[u8]) -> Result<String, RemoteError> {
    let digest = write_image_file(store, image)?;
    store.write_lazy_index(&digest, index)?;
    Ok(digest)
}

/// Writes `image` into the store's images (kept as it is if there);
/// returns its digest.
fn write_image_file(store: &Store, image: &[u8]) -> Result<String, RemoteError> {
    let mut w = store.image_writer()?;
    std::io::Write::write_all(&mut w, image).map_err(|e| cairn_store::StoreError::Source {
        op: "writing",
        what: "the EROFS image".into(),
        error: e,
    })?;
    Ok(w.commit()?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn stargz_annotations_are_seen() {
        let plain = br#"{"layers":[{"mediaType":"x","digest":"d","size":1}]}"#;
        assert!(!super::has_stargz_toc(plain));
        let stargz = br#"{"layers":[{"annotations":{"containerd.io/snapshot/stargz/toc.digest":"sha256:00"}}]}"#;
        assert!(super::has_stargz_toc(stargz));
        assert!(!super::has_stargz_toc(b"not json"));
    }
}
