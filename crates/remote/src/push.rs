//! `cairn push IMAGE REGISTRY/REPO:TAG`: publishes an image of the store as
//! a lazy-image artifact.
//!
//! The objects go into packs in the order the EROFS image's directory
//! walk first meets them (so files that sit together in the tree sit
//! together in a pack, and one range request serves neighbours), the
//! prefetch list's objects first. Each object is read from the store and
//! checked against its name while it is packed: a corrupt object is an
//! error, never a pack that would fail every fetch. Packs are built in
//! memory one at a time (at most `pack_size` plus one chunk) and uploaded
//! as each closes; blobs the repository has already are not uploaded
//! again.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;

use cairn_erofs::tree::InodeData;
use cairn_oci::client::Referrers;
use std::collections::HashMap;

use cairn_oci::{ClientOptions, Digest, ImageRef, Registry};
use cairn_spec::media_type::{
    CAIRN_LAZY_EROFS, CAIRN_LAZY_INDEX, CAIRN_LAZY_PACK, OCI_CONFIG, OCI_MANIFEST,
};
use cairn_store::{FsVerityHasher, ObjectId, Store};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::artifact::{self, Blob};
use crate::index::{Frame, IndexBuilder, CHUNK_SIZE};
use crate::RemoteError;

/// How to push.
#[derive(Debug, Clone)]
pub struct PushOptions {
    pub client: ClientOptions,
    /// A pack is closed once it holds this many bytes.
    pub pack_size: u64,
    /// Paths in the image whose objects are fetched first (and packed
    /// first).
    pub prefetch: Vec<Vec<u8>>,
    /// zstd level of the frames.
    pub level: i32,
    /// zstd level of the prefetch list's frames and of the EROFS
    /// metadata: what a lazy start fetches before it can run, so each
    /// byte saved there is a byte less on the start's path. Decoding
    /// costs the same at any level; encoding at 19 is slower (about
    /// 3 MB/s), paid once at push and only for those bytes.
    pub prefetch_level: i32,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            client: ClientOptions::default(),
            pack_size: 64 << 20,
            prefetch: Vec::new(),
            level: 3,
            prefetch_level: PREFETCH_LEVEL,
        }
    }
}

/// The default zstd level of the prefetch list's objects and of the
/// EROFS metadata ([`PushOptions::prefetch_level`]). On the python+numpy
/// benchmark image the list's objects come to 16.0 MB at level 3 and
/// 13.7 MB at 19 (the metadata 802 KB at 9, 768 KB at 19).
pub const PREFETCH_LEVEL: i32 = 19;

/// What a push did.
#[derive(Debug, Clone, Serialize)]
pub struct PushReport {
    pub image_digest: String,
    /// `registry/repository:tag`.
    pub target: String,
    pub artifact_digest: String,
    pub subject_digest: String,
    pub objects: u64,
    pub object_bytes: u64,
    pub packs: usize,
    /// Bytes of the packs (compressed).
    pub pack_bytes: u64,
    /// Blobs uploaded (others were in the repository already).
    pub uploaded_blobs: usize,
    /// How the referrers were recorded: `api` or `tag-schema`.
    pub referrers: String,
}

/// Each path of an image backed by an object, and that object.
type PathObjects = Vec<(Vec<u8>, ObjectId)>;

/// One object to pack.
struct ToPack {
    id: ObjectId,
    size: u64,
}

/// The tab that ends a line of a prefetch file's path and starts its
/// chunk annotation: `/path<TAB>chunks=0-1,6` (the chunks read of a large
/// file; indices, or ranges of them, increasing). A line without it is a
/// path, the whole file (v1's line).
pub const CHUNKS_TAG: &[u8] = b"\tchunks=";
/// The most chunk indices one line may name.
const MAX_LINE_CHUNKS: u64 = crate::prefetch::MAX_ENTRY_CHUNKS as u64;

/// A line of a prefetch file (`cairn run --record-prefetch` writes them,
/// `cairn push --prefetch` reads them): the path, and the chunks read if
/// the line names any.
pub fn parse_prefetch_line(line: &[u8]) -> Result<(Vec<u8>, Option<Vec<u32>>), String> {
    let Some(at) = line
        .windows(CHUNKS_TAG.len())
        .rposition(|w| w == CHUNKS_TAG)
    else {
        return Ok((line.to_vec(), None));
    };
    let (path, rest) = (&line[..at], &line[at + CHUNKS_TAG.len()..]);
    let rest = std::str::from_utf8(rest).map_err(|_| "chunks are not text".to_string())?;
    let mut chunks: Vec<u32> = Vec::new();
    for part in rest.split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let num = |t: &str| {
            t.parse::<u32>()
                .map_err(|_| format!("{t:?} is not a chunk index"))
        };
        let (a, b) = (num(a)?, num(b)?);
        if b < a || chunks.last().is_some_and(|&l| a <= l) {
            return Err(format!("chunks {rest:?} are not increasing"));
        }
        if chunks.len() as u64 + u64::from(b - a) + 1 > MAX_LINE_CHUNKS {
            return Err(format!("more than {MAX_LINE_CHUNKS} chunks"));
        }
        chunks.extend(a..=b);
    }
    Ok((path.to_vec(), Some(chunks)))
}

/// `chunks` (increasing) as a prefetch file writes them: `0-1,6`.
pub fn format_chunks(chunks: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < chunks.len() {
        let mut j = i;
        while j + 1 < chunks.len() && chunks[j + 1] == chunks[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if j == i {
            out += &chunks[i].to_string();
        } else {
            out += &format!("{}-{}", chunks[i], chunks[j]);
        }
        i = j + 1;
    }
    out
}

/// The objects of an EROFS image in walk order (each once), and the
/// object of each path.
fn objects_in_walk_order(
    image: &[u8],
    digest: &str,
) -> Result<(Vec<ToPack>, PathObjects), RemoteError> {
    let tree = cairn_erofs::reader::read_image(image).map_err(|e| RemoteError::CannotPush {
        image: digest.to_string(),
        why: format!("its EROFS image cannot be read: {e}"),
    })?;
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut paths = Vec::new();
    let mut bad = None;
    tree.walk(|path, id, entry| {
        if entry.hardlink {
            return;
        }
        let inode = tree.inode(id);
        let InodeData::Regular(reg) = &inode.data else {
            return;
        };
        let Some(payload) = &reg.payload else {
            return;
        };
        match object_id_of_payload(payload) {
            Some(oid) => {
                paths.push((path.to_vec(), oid));
                if seen.insert(oid) {
                    out.push(ToPack {
                        id: oid,
                        size: inode.size,
                    });
                }
            }
            None => {
                bad.get_or_insert_with(|| String::from_utf8_lossy(path).into_owned());
            }
        }
    });
    if let Some(path) = bad {
        return Err(RemoteError::CannotPush {
            image: digest.to_string(),
            why: format!("{path} is backed by something that is not an object of the store"),
        });
    }
    Ok((out, paths))
}

/// The object a payload (`ab/cdef…`, leading `/` optional) names.
pub(crate) fn object_id_of_payload(payload: &[u8]) -> Option<ObjectId> {
    let p = payload.strip_prefix(b"/").unwrap_or(payload);
    if p.len() != 65 || p[2] != b'/' {
        return None;
    }
    let hex: Vec<u8> = p[..2].iter().chain(&p[3..]).copied().collect();
    if !hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    ObjectId::from_hex(std::str::from_utf8(&hex).ok()?).ok()
}

/// Builds packs and the index as objects are added; hands each pack to
/// `upload` as it closes.
struct Packer<'a> {
    pack_size: u64,
    current: Vec<u8>,
    index: IndexBuilder,
    packs: Vec<Blob>,
    upload: &'a mut dyn FnMut(&[u8]) -> Result<Blob, RemoteError>,
}

impl Packer<'_> {
    fn pack_no(&self) -> u32 {
        self.packs.len() as u32
    }

    fn frame(
        &mut self,
        data: &[u8],
        sha256: Option<[u8; 32]>,
        level: i32,
    ) -> Result<Frame, RemoteError> {
        let z = zstd::bulk::compress(data, level)
            .map_err(|e| RemoteError::invalid("a pack frame", format!("zstd: {e}")))?;
        let f = Frame {
            pack: self.pack_no(),
            offset: self.current.len() as u64,
            compressed: z.len() as u64,
            size: data.len() as u64,
            sha256,
        };
        self.current.extend_from_slice(&z);
        Ok(f)
    }

    fn close_if_full(&mut self) -> Result<(), RemoteError> {
        if self.current.len() as u64 >= self.pack_size {
            self.close()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<(), RemoteError> {
        if self.current.is_empty() {
            return Ok(());
        }
        let blob = (self.upload)(&self.current)?;
        self.index.add_pack(self.current.len() as u64);
        self.packs.push(blob);
        self.current.clear();
        Ok(())
    }

    /// Packs the object `o` from `store` with zstd level `level`, checking
    /// it against its name.
    fn add(&mut self, store: &Store, o: &ToPack, level: i32) -> Result<(), RemoteError> {
        self.add_rest(store, o, level, &[])
    }

    /// Packs the chunks `chunks` (indices, increasing) of the chunked
    /// object `o` only: the chunks a recorded start read, packed ahead of
    /// everything else. The object is finished by [`Packer::add_rest`],
    /// given the frames returned here, which checks it whole.
    fn add_chunks(
        &mut self,
        store: &Store,
        o: &ToPack,
        chunks: &[u32],
        level: i32,
    ) -> Result<Vec<(u32, Frame)>, RemoteError> {
        let path = store.object_path(&o.id);
        let corrupt = |why: String| RemoteError::CannotPush {
            image: String::new(),
            why: format!("object {} in the store: {why} (run `cairn fsck`)", o.id),
        };
        let file = File::open(&path).map_err(|e| corrupt(format!("opening: {e}")))?;
        let cs = u64::from(CHUNK_SIZE);
        let mut out = Vec::with_capacity(chunks.len());
        for &k in chunks {
            let at = u64::from(k) * cs;
            let n = usize::try_from(o.size.saturating_sub(at).min(cs)).unwrap_or(0);
            if n == 0 {
                return Err(corrupt(format!("no chunk {k} in {} bytes", o.size)));
            }
            let mut buf = vec![0u8; n];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, at)
                .map_err(|e| corrupt(format!("reading at {at}: {e}")))?;
            let sha: [u8; 32] = Sha256::digest(&buf).into();
            out.push((k, self.frame(&buf, Some(sha), level)?));
            self.close_if_full()?;
        }
        Ok(out)
    }

    /// Packs `o`, but for the chunks in `done` (packed earlier by
    /// [`Packer::add_chunks`]), whose frames it takes if the chunk still
    /// hashes to what they hold; checks the whole object against its name.
    fn add_rest(
        &mut self,
        store: &Store,
        o: &ToPack,
        level: i32,
        done: &[(u32, Frame)],
    ) -> Result<(), RemoteError> {
        let path = store.object_path(&o.id);
        let corrupt = |why: String| RemoteError::CannotPush {
            image: String::new(),
            why: format!("object {} in the store: {why} (run `cairn fsck`)", o.id),
        };
        let mut file = File::open(&path).map_err(|e| corrupt(format!("opening: {e}")))?;
        let mut hasher = FsVerityHasher::new();
        let cs = u64::from(CHUNK_SIZE);
        let mut buf = vec![0u8; usize::try_from(o.size.min(cs)).unwrap_or(0)];
        if o.size <= cs {
            file.read_exact(&mut buf)
                .map_err(|e| corrupt(format!("reading {} bytes: {e}", o.size)))?;
            hasher.update(&buf);
            let f = self.frame(&buf, None, level)?;
            self.finish_object(&mut file, hasher, o, vec![f])?;
            return self.close_if_full();
        }
        let mut frames = Vec::new();
        let mut left = o.size;
        while left > 0 {
            let n = usize::try_from(left.min(cs)).unwrap_or(0);
            file.read_exact(&mut buf[..n])
                .map_err(|e| corrupt(format!("reading at {}: {e}", o.size - left)))?;
            hasher.update(&buf[..n]);
            let sha: [u8; 32] = Sha256::digest(&buf[..n]).into();
            let k = frames.len() as u32;
            match done.iter().find(|(d, _)| *d == k) {
                Some((_, f)) if f.sha256 == Some(sha) => frames.push(*f),
                Some(_) => return Err(corrupt(format!("chunk {k} changed while it was packed"))),
                None => {
                    let chunk = buf[..n].to_vec();
                    frames.push(self.frame(&chunk, Some(sha), level)?);
                }
            }
            left -= n as u64;
            self.close_if_full()?;
        }
        self.finish_object(&mut file, hasher, o, frames)
    }

    fn finish_object(
        &mut self,
        file: &mut File,
        hasher: FsVerityHasher,
        o: &ToPack,
        frames: Vec<Frame>,
    ) -> Result<(), RemoteError> {
        let mut probe = [0u8; 1];
        if matches!(file.read(&mut probe), Ok(1)) {
            return Err(RemoteError::CannotPush {
                image: String::new(),
                why: format!(
                    "object {} in the store is longer than the {} bytes the image gives it \
                     (run `cairn fsck`)",
                    o.id, o.size
                ),
            });
        }
        let actual = hasher.finalize();
        if actual != o.id {
            return Err(RemoteError::CannotPush {
                image: String::new(),
                why: format!(
                    "object {} in the store hashes to {actual} (run `cairn fsck`)",
                    o.id
                ),
            });
        }
        self.index.add_object(o.id, o.size, frames);
        Ok(())
    }
}

/// Pushes the store's image `image_digest` to `target` as a lazy-image
/// artifact tagged as `target` says, and records it as a referrer of the
/// image's manifest.
pub fn push(
    store: &Store,
    image_digest: &str,
    target: &ImageRef,
    opts: &PushOptions,
) -> Result<PushReport, RemoteError> {
    let cannot = |why: String| RemoteError::CannotPush {
        image: image_digest.to_string(),
        why,
    };
    let unwrap_cannot = |e: RemoteError| match e {
        RemoteError::CannotPush { why, .. } => cannot(why),
        e => e,
    };
    let record = store.image_record(image_digest)?.ok_or_else(|| {
        cannot(
            "it has no image record (made by `cairn mkfs`?), so there is no manifest to name as \
             the artifact's subject; pull or import the image first"
                .to_string(),
        )
    })?;
    if record.lazy.is_some() {
        return Err(cannot(
            "it is incomplete (pulled with --lazy); `cairn fetch` it first".to_string(),
        ));
    }
    let manifest_digest = Digest::parse(&record.manifest_digest)
        .map_err(|e| cannot(format!("its record's manifest digest: {e}")))?;
    if Digest::of(record.manifest.as_bytes()) != manifest_digest {
        return Err(cannot(format!(
            "its record's manifest does not hash to {manifest_digest} (run `cairn fsck`)"
        )));
    }
    let manifest: serde_json::Value = serde_json::from_str(&record.manifest)
        .map_err(|e| cannot(format!("its record's manifest: {e}")))?;
    let subject = Blob {
        media_type: manifest["mediaType"]
            .as_str()
            .unwrap_or(OCI_MANIFEST)
            .to_string(),
        digest: manifest_digest.clone(),
        size: record.manifest.len() as u64,
    };
    let config = Blob {
        media_type: manifest["config"]["mediaType"]
            .as_str()
            .unwrap_or(OCI_CONFIG)
            .to_string(),
        digest: Digest::of(record.config.as_bytes()),
        size: record.config.len() as u64,
    };
    if config.digest.as_str() != record.config_digest {
        return Err(cannot(format!(
            "its record's config does not hash to {} (run `cairn fsck`)",
            record.config_digest
        )));
    }

    // Shared, as a writer would: gc cannot remove the image or its
    // objects while they are read.
    let _lock = store.lock_shared()?;
    let image = std::fs::read(store.image_path(image_digest))
        .map_err(|e| cannot(format!("reading its EROFS image: {e}")))?;
    let (mut objects, paths) = objects_in_walk_order(&image, image_digest)?;
    // The list's entries, each object once (chunk sets of one object
    // named by several paths are merged; a whole entry wins).
    let mut entries: Vec<crate::prefetch::Entry> = Vec::new();
    for line in &opts.prefetch {
        let (p, chunks) = parse_prefetch_line(line).map_err(|why| {
            cannot(format!(
                "prefetch line {:?}: {why}",
                String::from_utf8_lossy(line)
            ))
        })?;
        let Some((_, id)) = paths.iter().find(|(q, _)| *q == p) else {
            return Err(cannot(format!(
                "prefetch path {} is not a file backed by an object in the image",
                String::from_utf8_lossy(&p)
            )));
        };
        let size = objects.iter().find(|o| o.id == *id).map_or(0, |o| o.size);
        let nchunks = size.div_ceil(u64::from(CHUNK_SIZE));
        if let Some(k) = chunks
            .iter()
            .flatten()
            .find(|&&k| u64::from(k) >= nchunks.max(1))
        {
            return Err(cannot(format!(
                "prefetch path {}: chunk {k}, but its object has {} chunks",
                String::from_utf8_lossy(&p),
                nchunks.max(1)
            )));
        }
        // Chunks of an object of one frame, or every chunk: the whole object.
        let chunks = chunks.filter(|c| nchunks >= 2 && (c.len() as u64) < nchunks);
        match entries.iter_mut().find(|e| e.id == *id) {
            None => entries.push(crate::prefetch::Entry { id: *id, chunks }),
            Some(e) => match (&mut e.chunks, chunks) {
                (Some(have), Some(more)) => {
                    have.extend(more);
                    have.sort_unstable();
                    have.dedup();
                    if have.len() as u64 >= nchunks {
                        e.chunks = None;
                    }
                }
                (have, None) => *have = None,
                (None, Some(_)) => {}
            },
        }
    }
    let prefetch_ids: Vec<ObjectId> = entries
        .iter()
        .filter(|e| e.chunks.is_none())
        .map(|e| e.id)
        .collect();
    // Prefetched whole objects first, the rest in walk order (the listed
    // chunks of partly read objects are packed before all of them, below).
    objects.sort_by_key(|o| {
        prefetch_ids
            .iter()
            .position(|p| *p == o.id)
            .unwrap_or(usize::MAX)
    });

    let reg = Registry::for_push(target, &opts.client);
    let repo = target.repository.clone();
    // Never replace an image with the artifact: a tag that names anything
    // but a cairn artifact is left alone.
    if let Some(tag) = &target.tag {
        let what = format!("{}/{repo}:{tag}", reg.name());
        match reg.fetch_manifest(
            &repo,
            tag,
            &cairn_spec::media_type::MANIFEST_ACCEPT,
            cairn_oci::client::BodySize::AtMost(cairn_spec::limits::MAX_MANIFEST_SIZE),
            &what,
        ) {
            Ok(m) if !artifact::is_artifact(&m.bytes) => {
                return Err(cannot(format!(
                    "{what} names an image (manifest {}), which the artifact would replace; \
                     push to another tag, such as {tag}-lazy",
                    Digest::of(&m.bytes)
                )))
            }
            Ok(_) | Err(cairn_oci::PullError::ManifestUnknown { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut uploaded = 0usize;
    let mut upload = |data: &[u8], media_type: &str, what: &str| -> Result<Blob, RemoteError> {
        let digest = Digest::of(data);
        if reg.push_blob(&repo, &digest, data, &format!("{what} {digest}"))? {
            uploaded += 1;
        }
        Ok(Blob {
            media_type: media_type.to_string(),
            digest,
            size: data.len() as u64,
        })
    };
    let config = Blob {
        media_type: config.media_type.clone(),
        ..upload(record.config.as_bytes(), &config.media_type, "config")?
    };
    let erofs_z = zstd::bulk::compress(&image, opts.prefetch_level.max(9))
        .map_err(|e| RemoteError::invalid("the EROFS image", format!("zstd: {e}")))?;
    let erofs = upload(&erofs_z, CAIRN_LAZY_EROFS, "EROFS metadata")?;
    drop(erofs_z);

    let mut upload_pack = |data: &[u8]| upload(data, CAIRN_LAZY_PACK, "pack");
    let mut packer = Packer {
        pack_size: opts.pack_size.max(1),
        current: Vec::new(),
        index: IndexBuilder::new(),
        packs: Vec::new(),
        upload: &mut upload_pack,
    };
    // The list in its order: whole objects whole, partly read objects
    // only the chunks that were read; the rest of those objects is packed
    // where the walk meets them.
    let mut early: HashMap<ObjectId, Vec<(u32, Frame)>> = HashMap::new();
    let mut packed_whole = 0usize;
    for e in &entries {
        let o = objects
            .iter()
            .find(|o| o.id == e.id)
            .expect("listed objects are the image's");
        match &e.chunks {
            None => {
                // The sorted `objects` start with the whole entries, in
                // this order: pack them here, and skip them below.
                packer
                    .add(store, o, opts.prefetch_level)
                    .map_err(unwrap_cannot)?;
                packed_whole += 1;
            }
            Some(c) => {
                let frames = packer
                    .add_chunks(store, o, c, opts.prefetch_level)
                    .map_err(unwrap_cannot)?;
                early.insert(o.id, frames);
            }
        }
    }
    let mut object_bytes = 0u64;
    for o in &objects[..packed_whole] {
        object_bytes += o.size;
    }
    for o in &objects[packed_whole..] {
        let done = early.remove(&o.id).unwrap_or_default();
        packer
            .add_rest(store, o, opts.level, &done)
            .map_err(unwrap_cannot)?;
        object_bytes += o.size;
    }
    packer.close()?;
    let Packer {
        index: builder,
        packs,
        ..
    } = packer;
    let index_bytes = builder.finish();
    let index_z = zstd::bulk::compress(&index_bytes, 3)
        .map_err(|e| RemoteError::invalid("the index", format!("zstd: {e}")))?;
    let index = upload(&index_z, CAIRN_LAZY_INDEX, "index")?;
    // v1 (ids) when every entry is a whole object, v2 otherwise.
    let prefetch = if entries.is_empty() {
        None
    } else {
        let (media_type, list) = crate::prefetch::encode(&entries);
        Some(upload(&list, media_type, "prefetch list")?)
    };
    let erofs_sha = hex::encode(Sha256::digest(&image));
    let manifest_bytes = artifact::manifest_bytes(&artifact::Parts {
        config: &config,
        subject: &subject,
        erofs: &erofs,
        erofs_sha256: &erofs_sha,
        erofs_size: image.len() as u64,
        index: &index,
        prefetch: prefetch.as_ref(),
        packs: &packs,
        objects: objects.len() as u64,
    });
    let artifact_blob = Blob {
        media_type: OCI_MANIFEST.to_string(),
        digest: Digest::of(&manifest_bytes),
        size: manifest_bytes.len() as u64,
    };
    let reference = target
        .tag
        .clone()
        .unwrap_or_else(|| artifact_blob.digest.to_string());
    reg.put_manifest(
        &repo,
        &reference,
        OCI_MANIFEST,
        &manifest_bytes,
        &format!("artifact {}", artifact_blob.digest),
    )?;
    let referrers = match reg.referrers(&repo, &manifest_digest, None)? {
        // The registry indexes the subject itself.
        Referrers::Index(_) => "api",
        Referrers::NoApi => {
            let tag = artifact::referrers_tag(&manifest_digest);
            let what = format!("referrers index {}/{repo}:{tag}", reg.name());
            let existing = match reg.fetch_manifest(
                &repo,
                &tag,
                &[cairn_spec::media_type::OCI_INDEX],
                cairn_oci::client::BodySize::AtMost(artifact::MAX_ARTIFACT_MANIFEST),
                &what,
            ) {
                Ok(m) => Some(m.bytes),
                Err(cairn_oci::PullError::ManifestUnknown { .. }) => None,
                Err(e) => return Err(e.into()),
            };
            if let Some(updated) =
                artifact::add_referrer(existing.as_deref(), &artifact_blob, &what)?
            {
                reg.put_manifest(
                    &repo,
                    &tag,
                    cairn_spec::media_type::OCI_INDEX,
                    &updated,
                    &what,
                )?;
            }
            "tag-schema"
        }
    };
    Ok(PushReport {
        image_digest: image_digest.to_string(),
        target: format!("{}/{repo}:{reference}", reg.name()),
        artifact_digest: artifact_blob.digest.to_string(),
        subject_digest: manifest_digest.to_string(),
        objects: objects.len() as u64,
        object_bytes,
        packs: packs.len(),
        pack_bytes: packs.iter().map(|p| p.size).sum(),
        uploaded_blobs: uploaded,
        referrers: referrers.to_string(),
    })
}

#[cfg(test)]
mod line_tests {
    use super::*;

    #[test]
    fn prefetch_lines_with_and_without_chunks() {
        assert_eq!(
            parse_prefetch_line(b"/a b").unwrap(),
            (b"/a b".to_vec(), None)
        );
        assert_eq!(
            parse_prefetch_line(b"/lib/x.so\tchunks=0-2,6").unwrap(),
            (b"/lib/x.so".to_vec(), Some(vec![0, 1, 2, 6]))
        );
        assert_eq!(format_chunks(&[0, 1, 2, 6, 8, 9]), "0-2,6,8-9");
        for bad in [
            &b"/x\tchunks="[..],
            b"/x\tchunks=3,1",
            b"/x\tchunks=1-0",
            b"/x\tchunks=1,1",
            b"/x\tchunks=a",
            b"/x\tchunks=0-4294967295",
        ] {
            assert!(parse_prefetch_line(bad).is_err(), "{bad:?}");
        }
    }
}
