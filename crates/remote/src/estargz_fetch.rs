//! The files of an incomplete eStargz image, fetched from its layer blobs
//! through their TOCs: the FUSE data layer's source for such an image.
//!
//! The image's files are named by the sha256 of their contents (the TOC's
//! `digest`); a file is fetched chunk by chunk (one range request of its
//! gzip member each, decompressed up to the chunk's length and checked
//! against its `chunkDigest` before a byte of it is returned), and the
//! layer then checks the whole file against its sha256 name and stores it
//! under its fs-verity digest, as every object of the store. This source
//! remembers which fs-verity digest each sha256 name was stored as, in
//! memory and in `images/<digest>.lazy-names` (one line per file:
//! `<sha256 hex> <fs-verity hex>`, appended and synced before the file is
//! published), so a successor server (docs/lazy-fuse.md) finds the stored
//! files again. The TOC file `stargz.index.json` is served from the TOC
//! kept in the store.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use cairn_oci::{ClientOptions, Digest, ImageRef, Registry};
use cairn_store::{ObjectId, Store};
use sha2::{Digest as _, Sha256};

use crate::estargz::{self, Chunk};
use crate::estargz_pull::{decode_tocs, toc_annotations};
use crate::RemoteError;

/// Where one file's bytes are.
#[derive(Debug, Clone)]
enum Source {
    /// Chunks of layer `layer`'s blob.
    Chunks { layer: usize, chunks: Vec<Chunk> },
    /// A TOC, kept in the store.
    Local(usize),
}

#[derive(Debug, Clone)]
struct File {
    size: u64,
    source: Source,
}

/// See the module docs.
pub struct EstargzObjects {
    reg: Registry,
    registry: String,
    repo: String,
    image: String,
    /// Each layer's blob and size, in the manifest's order.
    blobs: Vec<(Digest, u64)>,
    tocs: Vec<Vec<u8>>,
    files: HashMap<ObjectId, File>,
    /// Files before each layer's prefetch landmark, layer by layer.
    prefetch: Vec<ObjectId>,
    /// Every file, layer by layer, in TOC order.
    order: Vec<ObjectId>,
    names: Mutex<HashMap<ObjectId, ObjectId>>,
    names_path: PathBuf,
}

impl std::fmt::Debug for EstargzObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EstargzObjects")
            .field("repository", &self.repo)
            .field("image", &self.image)
            .field("files", &self.files.len())
            .finish()
    }
}

fn parse_names(text: &str) -> HashMap<ObjectId, ObjectId> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let mut it = line.split(' ');
        let (Some(a), Some(b), None) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        let mut x = [0u8; 32];
        let mut y = [0u8; 32];
        if hex::decode_to_slice(a, &mut x).is_ok() && hex::decode_to_slice(b, &mut y).is_ok() {
            out.insert(ObjectId(x), ObjectId(y));
        }
    }
    out
}

impl EstargzObjects {
    /// Whether the store's image `image_digest` is an incomplete eStargz
    /// image.
    pub fn is_estargz(store: &Store, image_digest: &str) -> bool {
        store
            .image_record(image_digest)
            .ok()
            .flatten()
            .and_then(|r| r.lazy)
            .is_some_and(|l| l.estargz)
    }

    /// Opens the source of the store's incomplete eStargz image: the
    /// manifest in its record (checked against its digest), the TOCs of
    /// its lazy index (checked against the record's digest, then each
    /// against its layer's annotation, and parsed). No network yet.
    pub fn open(
        store: &Store,
        image_digest: &str,
        client: &ClientOptions,
    ) -> Result<EstargzObjects, RemoteError> {
        let lazy = crate::fetch::incomplete_source(store, image_digest, true)?;
        let mwhat = format!("manifest {} of image {image_digest}", lazy.artifact_digest);
        let mdigest = Digest::parse(&lazy.artifact_digest)
            .map_err(|e| RemoteError::invalid(&mwhat, e.to_string()))?;
        if Digest::of(lazy.artifact_manifest.as_bytes()) != mdigest {
            return Err(RemoteError::invalid(
                &mwhat,
                "the manifest in the image record does not hash to its digest",
            ));
        }
        let annotations = toc_annotations(lazy.artifact_manifest.as_bytes())
            .ok_or_else(|| RemoteError::invalid(&mwhat, "a layer without a TOC annotation"))?;
        let manifest: serde_json::Value = serde_json::from_str(&lazy.artifact_manifest)
            .map_err(|e| RemoteError::invalid(&mwhat, e.to_string()))?;
        let mut blobs = Vec::new();
        for l in manifest["layers"].as_array().into_iter().flatten() {
            let digest = Digest::parse(l["digest"].as_str().unwrap_or(""))
                .map_err(|e| RemoteError::invalid(&mwhat, e.to_string()))?;
            let size = l["size"]
                .as_u64()
                .ok_or_else(|| RemoteError::invalid(&mwhat, "a layer without a size"))?;
            blobs.push((digest, size));
        }
        let path = store.lazy_index_path(image_digest);
        let iwhat = format!("eStargz TOCs {}", path.display());
        let bytes =
            std::fs::read(&path).map_err(|e| RemoteError::invalid(&iwhat, e.to_string()))?;
        if Digest::of(&bytes).as_str() != lazy.index_digest {
            return Err(RemoteError::invalid(
                &iwhat,
                format!("does not hash to {}", lazy.index_digest),
            ));
        }
        let stored = decode_tocs(&bytes).map_err(|e| RemoteError::invalid(&iwhat, e))?;
        if stored.len() != blobs.len() || annotations.len() != blobs.len() {
            return Err(RemoteError::invalid(
                &iwhat,
                format!("{} TOCs for {} layers", stored.len(), blobs.len()),
            ));
        }
        let mut files = HashMap::new();
        let (mut prefetch, mut order) = (Vec::new(), Vec::new());
        let mut tocs = Vec::new();
        for (i, (s, annotation)) in stored.into_iter().zip(&annotations).enumerate() {
            let toc = estargz::parse_toc(&s.json, s.toc_offset, Some(annotation))
                .map_err(|e| RemoteError::invalid(format!("{iwhat}, layer {i}"), e.0))?;
            for e in toc.prefetch() {
                if let Some(d) = e.digest {
                    prefetch.push(ObjectId(d));
                }
            }
            for e in toc.entries {
                let Some(d) = e.digest else { continue };
                order.push(ObjectId(d));
                files.entry(ObjectId(d)).or_insert(File {
                    size: e.size,
                    source: Source::Chunks {
                        layer: i,
                        chunks: e.chunks,
                    },
                });
            }
            let sha: [u8; 32] = Sha256::digest(&s.json).into();
            order.push(ObjectId(sha));
            files.insert(
                ObjectId(sha),
                File {
                    size: s.json.len() as u64,
                    source: Source::Local(i),
                },
            );
            tocs.push(s.json);
        }
        let names_path = store.lazy_names_path(image_digest);
        let names = parse_names(&std::fs::read_to_string(&names_path).unwrap_or_default());
        let r = ImageRef::parse(&format!("{}/{}", lazy.registry, lazy.repository))?;
        Ok(EstargzObjects {
            reg: Registry::new(&r, client),
            registry: lazy.registry,
            repo: lazy.repository,
            image: image_digest.to_string(),
            blobs,
            tocs,
            files,
            prefetch,
            order,
            names: Mutex::new(names),
            names_path,
        })
    }

    /// The size of file `id`.
    pub fn size(&self, id: &ObjectId) -> Option<u64> {
        self.files.get(id).map(|f| f.size)
    }

    /// Where each chunk of `id` starts in the file, when it has more than
    /// one.
    pub fn chunk_starts(&self, id: &ObjectId) -> Option<Vec<u64>> {
        match &self.files.get(id)?.source {
            Source::Chunks { chunks, .. } if chunks.len() > 1 => {
                Some(chunks.iter().map(|c| c.file_offset).collect())
            }
            _ => None,
        }
    }

    /// Chunk `k` of file `id`: one range request of its gzip member,
    /// checked against its `chunkDigest`. Wrong bytes are logged (the
    /// file, the chunk, the blob) and returned as
    /// [`RemoteError::CorruptObject`].
    pub fn fetch_chunk(&self, id: &ObjectId, k: usize) -> Result<Vec<u8>, RemoteError> {
        let f = self
            .files
            .get(id)
            .ok_or_else(|| RemoteError::NotIncomplete {
                image: self.image.clone(),
                why: format!("it has no file {id}"),
            })?;
        match &f.source {
            Source::Local(i) if k == 0 => Ok(self.tocs[*i].clone()),
            Source::Chunks { layer, chunks } if k < chunks.len() => {
                let c = &chunks[k];
                let (blob, _) = &self.blobs[*layer];
                let what = format!("chunk {k} of file {id} (eStargz layer {blob})");
                let member = self.reg.fetch_blob_range(
                    &self.repo,
                    blob,
                    c.offset,
                    c.end - c.offset,
                    &what,
                )?;
                estargz::read_chunk(&member, c).map_err(|e| {
                    let err = RemoteError::CorruptObject {
                        object: format!(
                            "sha256:{id} (chunk {k}, at {} of the file)",
                            c.file_offset
                        ),
                        blob: blob.to_string(),
                        repository: format!("{}/{}", self.registry, self.repo),
                        detail: e.0,
                    };
                    tracing::error!("{err}");
                    err
                })
            }
            _ => Err(RemoteError::invalid(
                format!("file {id} of image {}", self.image),
                format!("it has no chunk {k}"),
            )),
        }
    }

    /// The whole file `id`, chunk after chunk (each checked), into `out`.
    pub fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), RemoteError> {
        let n = match &self.files.get(id).map(|f| &f.source) {
            Some(Source::Chunks { chunks, .. }) => chunks.len(),
            Some(Source::Local(_)) => 1,
            None => {
                return Err(RemoteError::NotIncomplete {
                    image: self.image.clone(),
                    why: format!("it has no file {id}"),
                })
            }
        };
        for k in 0..n {
            let data = self.fetch_chunk(id, k)?;
            out.write_all(&data).map_err(|error| RemoteError::Write {
                object: id.to_string(),
                error,
            })?;
        }
        Ok(())
    }

    /// The store's name (fs-verity digest) of file `id`, once stored.
    pub fn local_id(&self, id: &ObjectId) -> Option<ObjectId> {
        self.names.lock().expect("names lock").get(id).copied()
    }

    /// File `id` was fetched whole: its bytes hash to `sha256`, their
    /// fs-verity digest is `stored`. Accepted (and remembered, durably)
    /// only if `sha256` is `id`.
    pub fn accept(
        &self,
        id: &ObjectId,
        sha256: &[u8; 32],
        stored: &ObjectId,
    ) -> Result<(), String> {
        if sha256 != &id.0 {
            let msg = format!(
                "file sha256:{id} of image {}: its chunks, each checked, hash together to \
                 sha256:{}",
                self.image,
                hex::encode(sha256)
            );
            tracing::error!("{msg}");
            return Err(msg);
        }
        let mut names = self.names.lock().expect("names lock");
        if names.get(id) != Some(stored) {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.names_path)
                .map_err(|e| format!("{}: {e}", self.names_path.display()))?;
            writeln!(f, "{id} {stored}")
                .and_then(|()| f.sync_data())
                .map_err(|e| format!("{}: {e}", self.names_path.display()))?;
            names.insert(*id, *stored);
        }
        Ok(())
    }

    /// Files before the layers' prefetch landmarks, in TOC order.
    pub fn prefetch_order(&self) -> &[ObjectId] {
        &self.prefetch
    }

    /// Every file with contents, layer by layer in TOC order (each
    /// layer's TOC file last), including files an upper layer deletes.
    pub fn all_files(&self) -> &[ObjectId] {
        &self.order
    }
}

/// Completes the incomplete eStargz image `image_digest` (whose record's
/// lazy source is `lazy`): an ordinary pull of the image by its manifest
/// digest (each eStargz layer is a valid gzip tar), which imports the
/// layers and builds the image named by fs-verity digests; then every
/// name of the lazy image names that one, and the lazy image, nameless,
/// goes at the next gc. Returns the complete image's digest. The caller
/// holds the store lock shared.
pub(crate) fn complete(
    store: &Store,
    image_digest: &str,
    lazy: &cairn_store::LazySource,
    opts: &crate::FetchOptions,
) -> Result<String, RemoteError> {
    let r = ImageRef::parse(&format!(
        "{}/{}@{}",
        lazy.registry, lazy.repository, lazy.artifact_digest
    ))?;
    let pull_opts = cairn_oci::PullOptions {
        client: opts.client.clone(),
        jobs: opts.jobs.max(1),
        ..cairn_oci::PullOptions::default()
    };
    let quiet = |_: &cairn_oci::PullEvent<'_>| {};
    let report = cairn_oci::pull(store, &r, &pull_opts, &quiet)?;
    for (name, digest) in store.list_refs()? {
        if digest == image_digest {
            store.set_ref(&name, &report.image_digest)?;
        }
    }
    Ok(report.image_digest)
}

/// Completes the incomplete eStargz image `image_digest` from what its
/// lazy layer stored, without a request: once every file it names (by
/// sha256) maps through its lazy-names file to an object that is present,
/// its EROFS image is written again with each file backed by that object
/// (payload and fs-verity digest, as an import writes them), stored as a
/// complete image with the lazy image's record (its lazy source dropped),
/// and every name of the lazy image names it; the lazy image, nameless,
/// goes at the next gc unless mounted. Returns the complete image's
/// digest, or `None` when a file is not local yet (nothing is written).
/// Unlike [`complete`] (a full pull of the layers), the result is not
/// byte for byte a full pull's image: small files stay in the object
/// store rather than inline. The caller holds the store lock shared.
pub fn complete_from_local(
    store: &Store,
    image_digest: &str,
) -> Result<Option<String>, RemoteError> {
    crate::fetch::incomplete_source(store, image_digest, true)?;
    let what = format!("eStargz image {image_digest}");
    let image = store.read_image(image_digest)?;
    let mut tree = cairn_erofs::reader::read_image(&image)
        .map_err(|e| RemoteError::invalid(&what, format!("its EROFS image: {e}")))?;
    let names = store.lazy_names(image_digest);
    let mut lookup = store.object_lookup();
    let mut files = Vec::new();
    tree.walk(|_, id, _| files.push(id));
    files.sort_unstable();
    files.dedup();
    for id in files {
        let cairn_erofs::tree::InodeData::Regular(reg) = &mut tree.inode_mut(id).data else {
            continue;
        };
        let Some(payload) = &reg.payload else {
            continue;
        };
        let Some(name) = crate::push::object_id_of_payload(payload) else {
            return Err(RemoteError::invalid(
                &what,
                format!(
                    "a file is backed by {:?}, not a file name",
                    String::from_utf8_lossy(payload)
                ),
            ));
        };
        let Some(stored) = names.get(&name).filter(|s| lookup.has(s)) else {
            return Ok(None);
        };
        reg.payload = Some(stored.object_path().into_bytes());
        reg.digest = Some(stored.0);
    }
    let bytes = cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default())
        .map_err(|e| RemoteError::invalid(&what, format!("writing its complete image: {e}")))?;
    let mut w = store.image_writer()?;
    std::io::Write::write_all(&mut w, &bytes).map_err(|e| cairn_store::StoreError::Source {
        op: "writing",
        what: "the EROFS image".into(),
        error: e,
    })?;
    let complete = w.commit()?;
    let mut record = store
        .image_record(image_digest)?
        .ok_or_else(|| RemoteError::invalid(&what, "its record went away"))?;
    record.image_digest = complete.clone();
    record.image_size = bytes.len() as u64;
    record.lazy = None;
    store.write_image_record(&record)?;
    for (name, digest) in store.list_refs()? {
        if digest == image_digest {
            store.set_ref(&name, &complete)?;
        }
    }
    Ok(Some(complete))
}
