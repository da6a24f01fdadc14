//! Objects of an incomplete image, from its registry: [`RemoteObjects`]
//! (one object on demand, for the FUSE data layer) and [`fetch_image`]
//! (`cairn fetch IMAGE`: every missing object, then the image is marked
//! complete).
//!
//! Reads are `Range` requests on the packs, with the registry client's
//! authentication, redirects and retries; `fetch_image` keeps
//! [`FetchOptions::jobs`] of them in flight. Neighbouring single-frame
//! objects of one pack are fetched in one request (up to
//! [`FetchOptions::coalesce`] bytes); a chunked object wanted whole is
//! fetched in runs of chunks that lie end to end (up to [`CHUNK_RUN`]
//! bytes a request), each chunk checked on its own. Nothing unverified goes anywhere: a chunk is checked against its
//! sha256 before its bytes are written out, a whole object against its
//! fs-verity digest before it is published (and, for a chunked object
//! handed to a writer, the writer is told by the result). Wrong bytes are
//! an error naming the object and the pack blob, logged as well, and
//! nothing of that object is stored.
//!
//! A fetch publishes what it has verified in batches (each one `syncfs`
//! and renames), so a `kill -9` midway leaves complete objects and `tmp/`
//! debris; the image stays incomplete until every object is present,
//! when its record is rewritten without its lazy source, and a second run
//! fetches only what is still missing.

use std::io::Write;

use cairn_oci::{ClientOptions, Digest, ImageRef, Registry};
use cairn_store::{FsVerityHasher, ObjectId, StagedObject, Store};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::artifact::{self, Artifact, Blob};
use crate::index::{Frame, Index, ObjectEntry, MAX_INDEX_BYTES};
use crate::RemoteError;

/// Default: neighbouring objects fetched in one request up to this many
/// (compressed) bytes.
pub const DEFAULT_COALESCE: u64 = 1 << 20;
/// The largest gap between two neighbours still fetched in one request.
const MAX_GAP: u64 = 64 << 10;
/// Verified objects are published in batches of about this many bytes,
/// by the thread that fills one while the others go on fetching: the
/// batch's `syncfs` writes its data out during the fetch instead of after
/// it (python's prefetch list, 30 MB: one 32 MiB batch left a 55 ms sync
/// and the renames for the end).
const BATCH_BYTES: u64 = 8 << 20;
/// The most (compressed) bytes of one object's chunks fetched with one
/// request when the whole object is wanted.
pub const CHUNK_RUN: u64 = 4 << 20;

/// The chunks of a chunked object in runs that one request each fetches
/// when the whole object is wanted: consecutive chunks of one pack that
/// lie end to end (as `cairn push` writes them), each run at most
/// [`CHUNK_RUN`] compressed bytes (or one chunk). Indexes into `frames`.
pub fn chunk_runs(frames: &[Frame]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    for k in 1..=frames.len() {
        let split = k == frames.len() || {
            let (first, prev, f) = (frames[start], frames[k - 1], frames[k]);
            f.pack != prev.pack
                || f.offset != prev.offset + prev.compressed
                || f.offset + f.compressed - first.offset > CHUNK_RUN
        };
        if split {
            runs.push(start..k);
            start = k;
        }
    }
    runs
}

/// The objects of one incomplete image, fetched from its registry.
pub struct RemoteObjects {
    reg: Registry,
    repo: String,
    index: Index,
    packs: Vec<Blob>,
    /// The artifact's prefetch list, if it has one.
    prefetch: Option<Blob>,
    image: String,
    /// The single-frame objects in pack order, made on first use.
    by_position: std::sync::OnceLock<Vec<(ObjectId, Frame)>>,
    /// The prefetch list once fetched and checked: a lazy server asks for
    /// it twice at start (its chunk entries at once, then the list phase).
    /// Locked while fetching, so the second asker waits for that fetch
    /// instead of making its own; a failure is not kept (the next asker
    /// tries again).
    prefetch_entries: std::sync::Mutex<Option<Vec<crate::prefetch::Entry>>>,
}

impl std::fmt::Debug for RemoteObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteObjects")
            .field("registry", &self.reg.name())
            .field("repository", &self.repo)
            .field("image", &self.image)
            .field("objects", &self.index.len())
            .finish()
    }
}

impl RemoteObjects {
    /// Opens the lazy source of the store's incomplete image
    /// `image_digest`: its record's artifact manifest (checked against its
    /// digest) and its lazy index file (checked against the digest the
    /// record gives, then parsed with limits). No network yet.
    pub fn open(
        store: &Store,
        image_digest: &str,
        client: &ClientOptions,
    ) -> Result<RemoteObjects, RemoteError> {
        let lazy = incomplete_source(store, image_digest, false)?;
        let awhat = format!("artifact {} of image {image_digest}", lazy.artifact_digest);
        let adigest = Digest::parse(&lazy.artifact_digest)
            .map_err(|e| RemoteError::invalid(&awhat, e.to_string()))?;
        if Digest::of(lazy.artifact_manifest.as_bytes()) != adigest {
            return Err(RemoteError::invalid(
                &awhat,
                "the manifest in the image record does not hash to its digest",
            ));
        }
        let a: Artifact = artifact::parse(lazy.artifact_manifest.as_bytes(), &awhat)?;
        let path = store.lazy_index_path(image_digest);
        let iwhat = format!("lazy index {}", path.display());
        let index_z =
            std::fs::read(&path).map_err(|e| RemoteError::invalid(&iwhat, e.to_string()))?;
        let actual = Digest::of(&index_z);
        if actual.as_str() != lazy.index_digest || actual != a.index.digest {
            return Err(RemoteError::invalid(
                &iwhat,
                format!(
                    "hashes to {actual}; the record says {}, the artifact {}",
                    lazy.index_digest, a.index.digest
                ),
            ));
        }
        let index = Index::parse(artifact::unzstd(&index_z, MAX_INDEX_BYTES, &iwhat)?)
            .map_err(|e| RemoteError::invalid(&iwhat, e.0))?;
        crate::lazy::check_packs(&a, &index, &iwhat)?;
        let r = ImageRef::parse(&format!("{}/{}", lazy.registry, lazy.repository))?;
        Ok(RemoteObjects {
            reg: Registry::new(&r, client),
            repo: lazy.repository,
            index,
            packs: a.packs,
            prefetch: a.prefetch,
            prefetch_entries: std::sync::Mutex::new(None),
            image: image_digest.to_string(),
            by_position: std::sync::OnceLock::new(),
        })
    }

    /// The size of object `id`, if the image's index lists it.
    pub fn size(&self, id: &ObjectId) -> Option<u64> {
        self.index.size(id)
    }

    /// The index entry of `id`.
    pub fn entry(&self, id: &ObjectId) -> Option<ObjectEntry> {
        self.index.get(id)
    }

    /// The whole index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    fn corrupt(&self, id: &ObjectId, pack: u32, detail: String) -> RemoteError {
        let blob = self
            .packs
            .get(pack as usize)
            .map_or_else(|| format!("pack {pack}"), |b| b.digest.to_string());
        let e = RemoteError::CorruptObject {
            object: id.to_string(),
            blob,
            repository: format!("{}/{}", self.reg.name(), self.repo),
            detail,
        };
        tracing::error!("{e}");
        e
    }

    /// Bytes `offset..offset+len` of pack `pack`.
    fn range(&self, pack: u32, offset: u64, len: u64) -> Result<Vec<u8>, RemoteError> {
        self.range_progress(pack, offset, len, &mut |_| {})
    }

    /// [`range`](Self::range), calling `progress` with the bytes that have
    /// arrived so far (a growing prefix; after a retry, from the start
    /// again) each time more arrive.
    fn range_progress(
        &self,
        pack: u32,
        offset: u64,
        len: u64,
        progress: &mut dyn FnMut(&[u8]),
    ) -> Result<Vec<u8>, RemoteError> {
        let blob = &self.packs[pack as usize];
        Ok(self.reg.fetch_blob_range_progress(
            &self.repo,
            &blob.digest,
            offset,
            len,
            &format!("pack {} bytes {offset}+{len}", blob.digest),
            progress,
        )?)
    }

    /// Fetches one chunk and checks it against its sha256.
    fn chunk(&self, id: &ObjectId, k: usize, f: &Frame) -> Result<Vec<u8>, RemoteError> {
        let z = self.range(f.pack, f.offset, f.compressed)?;
        self.check_chunk(id, k, f, &z)
    }

    /// Decodes chunk `k` (frame `f`) of `id` from its compressed bytes `z`
    /// and checks it against its sha256.
    fn check_chunk(
        &self,
        id: &ObjectId,
        k: usize,
        f: &Frame,
        z: &[u8],
    ) -> Result<Vec<u8>, RemoteError> {
        let data = artifact::unzstd_exact(z, f.size)
            .map_err(|d| self.corrupt(id, f.pack, format!("chunk {k}: {d}")))?;
        let sha: [u8; 32] = Sha256::digest(&data).into();
        if Some(sha) != f.sha256 {
            return Err(self.corrupt(
                id,
                f.pack,
                format!("chunk {k} does not hash to the sha256 the index gives it"),
            ));
        }
        Ok(data)
    }

    /// Chunk `k` of the chunked object `id` (1 MiB of it, the last
    /// possibly less), fetched and checked against its sha256: for a
    /// reader that wants an answer before the whole object is in. `None`
    /// when `id` is not chunked or has no chunk `k`.
    pub fn fetch_chunk(&self, id: &ObjectId, k: usize) -> Result<Option<Vec<u8>>, RemoteError> {
        let Some(e) = self.index.get(id).filter(ObjectEntry::is_chunked) else {
            return Ok(None);
        };
        match e.frames.get(k) {
            Some(f) => self.chunk(id, k, f).map(Some),
            None => Ok(None),
        }
    }

    /// Where the chunks of object `id` start (0, 1 MiB, 2 MiB, …), if it
    /// is chunked: each is fetched and checked on its own by
    /// [`fetch_chunk`](Self::fetch_chunk). No network.
    pub fn chunk_starts(&self, id: &ObjectId) -> Option<Vec<u64>> {
        let e = self.index.get(id).filter(ObjectEntry::is_chunked)?;
        let mut at = 0u64;
        let mut starts = Vec::with_capacity(e.frames.len());
        for f in &e.frames {
            starts.push(at);
            at += f.size;
        }
        Some(starts)
    }

    /// Fetches object `id`, checks it, and writes its plain bytes to
    /// `out`; returns its size. A small object is checked whole against
    /// its fs-verity digest before any byte is written. A chunked object
    /// is written chunk by chunk, each checked against its sha256 first
    /// (so `out` never sees an unverified byte), and the whole against
    /// its fs-verity digest at the end: publish what `out` received only
    /// if this returns `Ok`.
    pub fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<u64, RemoteError> {
        self.fetch_checking(id, out, true)
    }

    /// As [`fetch`](Self::fetch), for a caller that hashes what `out`
    /// receives itself and refuses it unless its fs-verity digest is
    /// `id`: a store stager, whose file is served or published only under
    /// the digest of its bytes (the lazy layer's server). Each chunk of a
    /// chunked object is still checked against its sha256 before `out`
    /// gets it (a corrupt chunk stops the fetch there, and is named), but
    /// the whole is not hashed a second time here: that pass was a third
    /// of the CPU the server spent on a large object.
    pub fn fetch_for_stager(&self, id: &ObjectId, out: &mut dyn Write) -> Result<u64, RemoteError> {
        self.fetch_checking(id, out, false)
    }

    fn fetch_checking(
        &self,
        id: &ObjectId,
        out: &mut dyn Write,
        whole: bool,
    ) -> Result<u64, RemoteError> {
        let e = self.index.get(id).ok_or_else(|| {
            RemoteError::invalid(
                format!("object index of image {}", self.image),
                format!("object {id} is not in it"),
            )
        })?;
        let write_err = |error| RemoteError::Write {
            object: id.to_string(),
            error,
        };
        if !e.is_chunked() {
            let f = e.frames[0];
            let z = self.range(f.pack, f.offset, f.compressed)?;
            let data = if whole {
                self.verify_frame(id, &f, &z)?
            } else {
                self.decode_frame(id, &f, &z)?
            };
            out.write_all(&data).map_err(write_err)?;
            return Ok(e.size);
        }
        let mut hasher = whole.then(FsVerityHasher::new);
        self.each_chunk(id, &e, |data| {
            if let Some(h) = hasher.as_mut() {
                h.update(data);
            }
            out.write_all(data).map_err(write_err)
        })?;
        if let Some(h) = hasher {
            let actual = h.finalize();
            if actual != *id {
                return Err(self.corrupt(
                    id,
                    e.frames[0].pack,
                    format!("its chunks hash to object {actual}"),
                ));
            }
        }
        Ok(e.size)
    }

    /// The chunks of the chunked object `e` (`id`), in order, each checked
    /// against its sha256 before `f` gets it: a request a run of chunks
    /// (they lie end to end in a pack).
    fn each_chunk(
        &self,
        id: &ObjectId,
        e: &ObjectEntry,
        mut f: impl FnMut(&[u8]) -> Result<(), RemoteError>,
    ) -> Result<(), RemoteError> {
        for run in chunk_runs(&e.frames) {
            let (first, last) = (e.frames[run.start], e.frames[run.end - 1]);
            let z = self.range(
                first.pack,
                first.offset,
                last.offset + last.compressed - first.offset,
            )?;
            for k in run {
                let frame = &e.frames[k];
                let at = (frame.offset - first.offset) as usize;
                let Some(bytes) = z.get(at..at + frame.compressed as usize) else {
                    return Err(self.corrupt(id, frame.pack, format!("chunk {k}: a short range")));
                };
                f(&self.check_chunk(id, k, frame, bytes)?)?;
            }
        }
        Ok(())
    }

    /// Stages the single-frame object `id` from its compressed bytes `z`,
    /// checked: the stager computes the fs-verity digest of what it
    /// writes (the one pass over the bytes that names the file), and a
    /// staged file that is not `id` is dropped with an error, never
    /// published or served.
    fn stage_frame(
        &self,
        store: &Store,
        id: &ObjectId,
        f: &Frame,
        z: &[u8],
    ) -> Result<StagedObject, RemoteError> {
        let data = self.decode_frame(id, f, z)?;
        let mut stager = store.stage_object()?;
        stager.write(&data)?;
        let staged = stager.finish(store)?;
        if staged.id() != *id {
            return Err(self.corrupt(
                id,
                f.pack,
                format!("its bytes hash to object {}", staged.id()),
            ));
        }
        Ok(staged)
    }

    /// Decompresses the single frame `f` of object `id` to exactly its
    /// size, unchecked; an error names the object and its pack.
    fn decode_frame(&self, id: &ObjectId, f: &Frame, z: &[u8]) -> Result<Vec<u8>, RemoteError> {
        artifact::unzstd_exact(z, f.size).map_err(|d| self.corrupt(id, f.pack, d))
    }

    /// Decompresses a single-frame object and checks its fs-verity digest.
    fn verify_frame(&self, id: &ObjectId, f: &Frame, z: &[u8]) -> Result<Vec<u8>, RemoteError> {
        let data = self.decode_frame(id, f, z)?;
        let mut h = FsVerityHasher::new();
        h.update(&data);
        let actual = h.finalize();
        if actual != *id {
            return Err(self.corrupt(id, f.pack, format!("its bytes hash to object {actual}")));
        }
        Ok(data)
    }

    /// Fetches object `id` into the store (staged, checked, published).
    /// The caller holds the store lock shared, as every writer does.
    pub fn publish(&self, store: &Store, id: &ObjectId) -> Result<u64, RemoteError> {
        let staged = self.stage(store, id)?;
        let size = staged.size();
        store.publish_staged([staged])?;
        Ok(size)
    }

    /// Fetches object `id` into the store together with the objects that
    /// follow it in its pack and are not local yet, in one range request
    /// of at most `coalesce` bytes (the read amplification a lazy mount
    /// wants: what sits next to a file in the tree is likely read next).
    /// Each is checked before it is published. Returns the objects
    /// published, `id` first. A chunked object is fetched alone. The
    /// caller holds the store lock shared, as every writer does.
    pub fn publish_with_neighbours(
        &self,
        store: &Store,
        id: &ObjectId,
        coalesce: u64,
    ) -> Result<Vec<ObjectId>, RemoteError> {
        let group = self.neighbours(store, id, coalesce)?;
        self.publish_group(store, &group)?;
        Ok(group)
    }

    /// The objects [`publish_with_neighbours`](Self::publish_with_neighbours)
    /// would fetch for `id`: `id` first, then the single-frame objects that
    /// follow it in its pack, are not in the store, lie at most 64 KiB
    /// apart, and end within `coalesce` bytes of `id`'s start. Just `id`
    /// when it is chunked. No network.
    pub fn neighbours(
        &self,
        store: &Store,
        id: &ObjectId,
        coalesce: u64,
    ) -> Result<Vec<ObjectId>, RemoteError> {
        let Some(e) = self.index.get(id) else {
            return Err(self.not_listed(id));
        };
        if e.is_chunked() {
            return Ok(vec![*id]);
        }
        let list = self.by_position();
        let first = e.frames[0];
        let at = list.partition_point(|(_, f)| (f.pack, f.offset) < (first.pack, first.offset));
        let mut end = at + 1;
        let mut lookup = store.object_lookup();
        while let Some((nid, next)) = list.get(end) {
            let prev = list[end - 1].1;
            let prev_end = prev.offset + prev.compressed;
            if next.pack != first.pack
                || next.offset < prev_end
                || next.offset - prev_end > MAX_GAP
                || next.offset + next.compressed - first.offset > coalesce.max(1)
                || lookup.has(nid)
            {
                break;
            }
            end += 1;
        }
        Ok(list[at..end].iter().map(|(id, _)| *id).collect())
    }

    /// Fetches `group` into the store: one object (chunked or not), or
    /// single-frame objects of one pack in offset order (as
    /// [`neighbours`](Self::neighbours) gives them, or a prefix of that),
    /// fetched with one range request. Each object is checked against its
    /// fs-verity digest before it is staged; all are published, or none.
    /// The caller holds the store lock shared, as every writer does.
    pub fn publish_group(&self, store: &Store, group: &[ObjectId]) -> Result<(), RemoteError> {
        match group {
            [] => Ok(()),
            [one] => self.publish(store, one).map(|_| ()),
            _ => {
                let mut staged = Vec::with_capacity(group.len());
                self.stage_run(store, group, &mut |s| staged.push(s))?;
                store.publish_staged(staged)?;
                Ok(())
            }
        }
    }

    /// Fetches a run of one or more single-frame objects of one pack (as
    /// [`publish_group`](Self::publish_group) takes them) with one range
    /// request and stages each, checked against its fs-verity digest, in
    /// `group`'s order, handing each to `staged` as soon as it is (while
    /// the rest of the range is still arriving); publishes nothing. The
    /// caller publishes them ([`Store::publish_staged`]), and may read
    /// each staged file first ([`StagedObject::open_staged`]): a lazy
    /// mount answers the open that asked for the first one before the
    /// rest of the run is in, and before any name is made durable. On an
    /// error, the objects handed over before it are good (each was
    /// checked); the caller may keep them.
    pub fn stage_run(
        &self,
        store: &Store,
        group: &[ObjectId],
        staged: &mut dyn FnMut(StagedObject),
    ) -> Result<(), RemoteError> {
        let mut frames = Vec::with_capacity(group.len());
        for id in group {
            let e = self.index.get(id).ok_or_else(|| self.not_listed(id))?;
            let f = e.frames[0];
            if e.is_chunked() {
                return Err(RemoteError::invalid(
                    format!("a group of objects of image {}", self.image),
                    format!("object {id} is chunked; it is fetched alone"),
                ));
            }
            if let Some((_, prev)) = frames.last() {
                let prev: &Frame = prev;
                let prev_end = prev.offset + prev.compressed;
                if f.pack != prev.pack || f.offset < prev_end || f.offset - prev_end > MAX_GAP {
                    return Err(RemoteError::invalid(
                        format!("a group of objects of image {}", self.image),
                        format!("object {id} does not follow the one before it in its pack"),
                    ));
                }
            }
            frames.push((*id, f));
        }
        if frames.is_empty() {
            return Ok(());
        }
        self.stage_group(store, &frames, staged)
    }

    /// Every object of the index in pack order (a chunked object at its
    /// first chunk): the order a background fetch reads the packs in.
    pub fn pack_order(&self) -> Vec<ObjectId> {
        let mut v: Vec<(u32, u64, ObjectId)> = self
            .index
            .entries()
            .map(|e| (e.frames[0].pack, e.frames[0].offset, e.id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, _, id)| id).collect()
    }

    /// The artifact's prefetch list (objects to fetch first), fetched and
    /// checked against its digest; empty when the artifact has none. Ids
    /// the index does not list are left out (the list is a hint). An
    /// entry that names chunks (a v2 list) is given as its object, for a
    /// caller that fetches whole objects ([`Self::prefetch_entries`] has
    /// the chunks).
    pub fn prefetch_list(&self) -> Result<Vec<ObjectId>, RemoteError> {
        Ok(self.prefetch_entries()?.into_iter().map(|e| e.id).collect())
    }

    /// Whether the artifact's prefetch list may name chunks (a v2 list).
    pub fn prefetch_names_chunks(&self) -> bool {
        self.prefetch
            .as_ref()
            .is_some_and(|b| b.media_type == cairn_spec::media_type::CAIRN_LAZY_PREFETCH_V2)
    }

    /// The artifact's prefetch list as entries (`crate::prefetch`):
    /// fetched, checked against its digest, parsed with its limits, and
    /// resolved against the index (unknown ids dropped, chunk indices
    /// checked); once, then kept.
    pub fn prefetch_entries(&self) -> Result<Vec<crate::prefetch::Entry>, RemoteError> {
        let Some(list) = &self.prefetch else {
            return Ok(Vec::new());
        };
        let mut cached = self
            .prefetch_entries
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(entries) = &*cached {
            return Ok(entries.clone());
        }
        let what = format!("prefetch list {} of image {}", list.digest, self.image);
        if list.size > crate::lazy::MAX_PREFETCH {
            return Err(RemoteError::invalid(
                &what,
                format!(
                    "{} bytes, more than {}",
                    list.size,
                    crate::lazy::MAX_PREFETCH
                ),
            ));
        }
        let bytes = self.reg.fetch_blob_bytes(
            &self.repo,
            &list.digest,
            cairn_oci::client::BodySize::Exactly(list.size),
            &what,
        )?;
        if Digest::of(&bytes) != list.digest {
            return Err(RemoteError::invalid(&what, "does not hash to its digest"));
        }
        let entries = crate::prefetch::parse(&list.media_type, &bytes, &what)?;
        let entries = crate::prefetch::resolve(entries, &self.index, &what)?;
        *cached = Some(entries.clone());
        Ok(entries)
    }

    fn not_listed(&self, id: &ObjectId) -> RemoteError {
        RemoteError::invalid(
            format!("object index of image {}", self.image),
            format!("object {id} is not in it"),
        )
    }

    fn by_position(&self) -> &[(ObjectId, Frame)] {
        self.by_position.get_or_init(|| {
            let mut v: Vec<(ObjectId, Frame)> = self
                .index
                .entries()
                .filter(|e| !e.is_chunked())
                .map(|e| (e.id, e.frames[0]))
                .collect();
            v.sort_by_key(|(_, f)| (f.pack, f.offset));
            v
        })
    }

    /// Stages object `id`, fetched and checked, for publication: its
    /// bytes are hashed once, by the stager (a chunked object's chunks
    /// are also checked against their sha256 as they arrive).
    fn stage(&self, store: &Store, id: &ObjectId) -> Result<StagedObject, RemoteError> {
        let e = self.index.get(id).ok_or_else(|| self.not_listed(id))?;
        if !e.is_chunked() {
            let f = e.frames[0];
            let z = self.range(f.pack, f.offset, f.compressed)?;
            return self.stage_frame(store, id, &f, &z);
        }
        let mut stager = store.stage_object()?;
        self.each_chunk(id, &e, |data| Ok(stager.write(data)?))?;
        let staged = stager.finish(store)?;
        if staged.id() != *id {
            return Err(self.corrupt(
                id,
                e.frames[0].pack,
                format!("its chunks hash to object {}", staged.id()),
            ));
        }
        Ok(staged)
    }

    /// Fetches the single-frame objects `group` (same pack, in offset
    /// order) with one range request and stages each, checked, handing it
    /// to `staged`. Each is staged as soon as its frame has arrived, while
    /// the rest of the range is still on its way: the first object of a
    /// run of a megabyte is ready once its own bytes are in, and decoding
    /// overlaps the transfer. Stops at the first object that fails its
    /// check (the ones before it were handed over).
    fn stage_group(
        &self,
        store: &Store,
        group: &[(ObjectId, Frame)],
        staged: &mut dyn FnMut(StagedObject),
    ) -> Result<(), RemoteError> {
        let first = group[0].1;
        let last = group[group.len() - 1].1;
        let span = last.offset + last.compressed - first.offset;
        // The objects staged so far (a retried request starts from the
        // range's first byte again: those are not staged twice).
        let mut done = 0usize;
        let mut failed: Option<RemoteError> = None;
        let mut stage_ready = |bytes: &[u8], done: &mut usize, failed: &mut Option<RemoteError>| {
            while failed.is_none() && *done < group.len() {
                let (id, f) = &group[*done];
                let at = (f.offset - first.offset) as usize;
                let end = at + f.compressed as usize;
                let Some(z) = bytes.get(at..end) else { break };
                match self.stage_frame(store, id, f, z) {
                    Ok(s) => {
                        *done += 1;
                        staged(s);
                    }
                    Err(e) => *failed = Some(e),
                }
            }
        };
        let bytes = self.range_progress(first.pack, first.offset, span, &mut |prefix| {
            stage_ready(prefix, &mut done, &mut failed)
        })?;
        // The reader calls `progress` with the whole range last, so this
        // finds nothing left; it keeps the contract (every object handed
        // over, or an error) independent of that.
        stage_ready(&bytes, &mut done, &mut failed);
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The lazy source in the record of the store's incomplete image
/// `image_digest`, if it is of the kind asked for: pulled from an eStargz
/// image's tables of contents (`estargz`, served by
/// [`EstargzObjects`](crate::EstargzObjects)) or from a cairn artifact
/// (served by [`RemoteObjects`]). Anything else is named in the error.
pub(crate) fn incomplete_source(
    store: &Store,
    image_digest: &str,
    estargz: bool,
) -> Result<cairn_store::LazySource, RemoteError> {
    let not = |why: &str| RemoteError::NotIncomplete {
        image: image_digest.to_string(),
        why: why.to_string(),
    };
    let record = store
        .image_record(image_digest)?
        .ok_or_else(|| not("it has no image record"))?;
    let lazy = record
        .lazy
        .ok_or_else(|| not("its record names no lazy source (it is complete)"))?;
    match (lazy.estargz, estargz) {
        (true, false) => Err(not(
            "it was pulled from an eStargz image's tables of contents, not from a cairn \
             artifact: its files are fetched by the eStargz source",
        )),
        (false, true) => Err(not(
            "it was pulled from a cairn artifact, not from an eStargz image",
        )),
        _ => Ok(lazy),
    }
}

/// How `cairn fetch` fetches.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    pub client: ClientOptions,
    /// Neighbouring objects of a pack are fetched in one request up to
    /// this many bytes.
    pub coalesce: u64,
    /// Requests in flight at once.
    pub jobs: usize,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            client: ClientOptions::default(),
            coalesce: DEFAULT_COALESCE,
            jobs: 3,
        }
    }
}

/// One unit of a fetch.
enum Work<'a> {
    /// Neighbouring single-frame objects of one pack, in offset order.
    Group(&'a [(ObjectId, Frame)]),
    Chunked(&'a ObjectEntry),
}

impl Work<'_> {
    /// The bytes its requests ask for (gaps between a group's frames
    /// included).
    fn compressed_bytes(&self) -> u64 {
        match self {
            Work::Group(g) => {
                let (first, last) = (g[0].1, g[g.len() - 1].1);
                last.offset + last.compressed - first.offset
            }
            Work::Chunked(e) => e.frames.iter().map(|f| f.compressed).sum(),
        }
    }
}

/// Runs `work` on `jobs` threads; verified objects are published in
/// batches of about [`BATCH_BYTES`] (one `syncfs` each). The first error
/// stops the others and is the one returned; what was staged and not
/// published is dropped with its staging files. Returns objects, bytes
/// and requests.
fn run_work(
    store: &Store,
    remote: &RemoteObjects,
    work: &[Work<'_>],
    jobs: usize,
) -> Result<(u64, u64, u64), RemoteError> {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (objects, bytes, requests) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let batch: Mutex<(Vec<StagedObject>, u64)> = Mutex::new((Vec::new(), 0));
    let first_error: Mutex<Option<RemoteError>> = Mutex::new(None);
    let lock = |m: &Mutex<(Vec<StagedObject>, u64)>| {
        std::mem::take(&mut *m.lock().unwrap_or_else(|p| p.into_inner()))
    };
    let one = |w: &Work<'_>| -> Result<(), RemoteError> {
        let staged = match w {
            Work::Group(group) => {
                requests.fetch_add(1, Ordering::Relaxed);
                let mut staged = Vec::with_capacity(group.len());
                remote.stage_group(store, group, &mut |s| staged.push(s))?;
                staged
            }
            Work::Chunked(e) => {
                requests.fetch_add(chunk_runs(&e.frames).len() as u64, Ordering::Relaxed);
                vec![remote.stage(store, &e.id)?]
            }
        };
        let full = {
            let mut b = batch.lock().unwrap_or_else(|p| p.into_inner());
            for s in staged {
                objects.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(s.size(), Ordering::Relaxed);
                b.1 += s.size();
                b.0.push(s);
            }
            b.1 >= BATCH_BYTES
        };
        if full {
            store.publish_staged(lock(&batch).0)?;
        }
        Ok(())
    };
    let worker = || {
        while !stop.load(Ordering::Relaxed) {
            let Some(w) = work.get(next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            if let Err(e) = one(w) {
                stop.store(true, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                break;
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..jobs.clamp(1, work.len().max(1)) {
            s.spawn(worker);
        }
        worker();
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        // Objects verified before the error are kept: publishing them is
        // sound, and the next run need not fetch them again.
        store.publish_staged(lock(&batch).0)?;
        return Err(e);
    }
    store.publish_staged(lock(&batch).0)?;
    Ok((
        objects.into_inner(),
        bytes.into_inner(),
        requests.into_inner(),
    ))
}

/// What a fetch did.
#[derive(Debug, Clone, Serialize)]
pub struct FetchReport {
    pub image_digest: String,
    pub objects: u64,
    /// Objects fetched by this run (the rest were local).
    pub fetched_objects: u64,
    /// Their bytes, uncompressed.
    pub fetched_bytes: u64,
    /// Range requests made.
    pub requests: u64,
    /// The image was complete already.
    pub was_complete: bool,
    /// An eStargz image is completed by a full pull of its layers, which
    /// makes another image (named by fs-verity digests): its digest. The
    /// names of the lazy image now name it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completed_as: Option<String>,
}

/// Fetches those of `ids` that are not in the store, each checked before
/// it is published: neighbouring single-frame objects of a pack in one
/// range request of at most `coalesce` bytes, chunked objects a request
/// a run of chunks ([`chunk_runs`]), `jobs` requests in flight. Returns the objects and bytes
/// fetched and the requests made. Used by `cairn fetch` (every object of
/// an image) and by `pull --lazy` (its prefetch list).
pub(crate) fn fetch_objects<'i>(
    store: &Store,
    remote: &RemoteObjects,
    ids: impl IntoIterator<Item = &'i ObjectId>,
    coalesce: u64,
    jobs: usize,
) -> Result<(u64, u64, u64), RemoteError> {
    let image_digest = remote.image.as_str();
    let mut lookup = store.object_lookup();
    let mut singles = Vec::new();
    let mut chunked = Vec::new();
    for id in ids {
        if lookup.has(id) {
            continue;
        }
        let e = remote.entry(id).ok_or_else(|| {
            RemoteError::invalid(
                format!("object index of image {image_digest}"),
                format!("object {id}, which the image uses, is not in it"),
            )
        })?;
        if e.is_chunked() {
            chunked.push(e);
        } else {
            singles.push((e.id, e.frames[0]));
        }
    }
    singles.sort_by_key(|(_, f)| (f.pack, f.offset));
    singles.dedup_by_key(|(id, _)| *id);
    chunked.sort_by_key(|e| e.id);
    chunked.dedup_by_key(|e| e.id);
    // The work: groups of neighbouring single-frame objects (one request
    // each), then the chunked objects (one request a run of chunks).
    let coalesce = coalesce.max(1);
    let mut work: Vec<Work<'_>> = Vec::new();
    let mut i = 0;
    while i < singles.len() {
        let start = singles[i].1;
        let mut j = i + 1;
        while j < singles.len() {
            let (prev, next) = (singles[j - 1].1, singles[j].1);
            let prev_end = prev.offset + prev.compressed;
            if next.pack != start.pack
                || next.offset < prev_end
                || next.offset - prev_end > MAX_GAP
                || next.offset + next.compressed - start.offset > coalesce
            {
                break;
            }
            j += 1;
        }
        work.push(Work::Group(&singles[i..j]));
        i = j;
    }
    work.extend(chunked.iter().map(Work::Chunked));
    // Largest first: a chunked object is one thread's work from its first
    // request to its last chunk checked, so one left for the end kept the
    // other threads idle while it ran (the python image's list: about
    // 90 ms of tail after the last request was sent).
    work.sort_by_key(|w| std::cmp::Reverse(w.compressed_bytes()));
    run_work(store, remote, &work, jobs)
}

/// Fetches every object the incomplete image `image_digest` lacks, then
/// marks it complete; see the module docs.
pub fn fetch_image(
    store: &Store,
    image_digest: &str,
    opts: &FetchOptions,
) -> Result<FetchReport, RemoteError> {
    // Shared: gc waits until the image is complete or this stops.
    let _lock = store.lock_shared()?;
    let Some(mut record) = store.image_record(image_digest)? else {
        return Err(RemoteError::NotIncomplete {
            image: image_digest.to_string(),
            why: "it has no image record".to_string(),
        });
    };
    let image = store.read_image(image_digest)?;
    let objects = crate::lazy::image_objects(&image, &format!("image {image_digest}"))?;
    let mut report = FetchReport {
        image_digest: image_digest.to_string(),
        objects: objects.len() as u64,
        fetched_objects: 0,
        fetched_bytes: 0,
        requests: 0,
        was_complete: record.lazy.is_none(),
        completed_as: None,
    };
    let Some(lazy) = &record.lazy else {
        return Ok(report);
    };
    if lazy.estargz {
        let done = crate::estargz_fetch::complete(store, image_digest, lazy, opts)?;
        report.completed_as = Some(done);
        return Ok(report);
    }
    let remote = RemoteObjects::open(store, image_digest, &opts.client)?;
    let (objects_done, bytes_done, requests) =
        fetch_objects(store, &remote, objects.keys(), opts.coalesce, opts.jobs)?;
    report.fetched_objects = objects_done;
    report.fetched_bytes = bytes_done;
    report.requests = requests;
    // Every object present (a fresh look: nothing may be assumed), then
    // the record says complete, then the index goes.
    let mut lookup = store.object_lookup();
    if let Some(missing) = objects.keys().find(|id| !lookup.has(id)) {
        return Err(RemoteError::invalid(
            format!("image {image_digest}"),
            format!("object {missing} is still missing after the fetch"),
        ));
    }
    record.lazy = None;
    store.write_image_record(&record)?;
    store.remove_lazy_index(image_digest)?;
    Ok(report)
}
