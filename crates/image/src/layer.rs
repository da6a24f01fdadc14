//! Layer import: one layer blob (as fetched) → objects in the store and a
//! layer record under `layers/<diff_id>`.
//!
//! The blob streams through the reader stack of `decompress` into the tar
//! parser of `tar`; each entry becomes a line of the layer record as it
//! comes (metadata only), each regular file's content a staged object.
//! Objects are published while the stream is read, each once a sync has
//! made it durable (`cairn_store::Publisher`); only when the stream has
//! ended, and its blob digest and diff_id match what the caller expects, is
//! the record published. An error at any point drops everything not yet
//! published; what was (whole objects, named by their content) is garbage
//! that no record names, for gc.
//!
//! # What the record keeps
//!
//! The record (`layers/<diff_id>/entries`, see `cairn_store::record`) is
//! the tar stream's entries in their order, one dumpfile line each, with
//! file contents replaced by their objects. How each entry is checked and
//! what line it becomes is `crate::entry`'s.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read};

use cairn_erofs::tree::{InodeData, RegularFile, DEFAULT_INLINE_THRESHOLD};
use cairn_erofs::Inode;
use cairn_store::{
    is_diff_id, LayerRecord, LayerRecordWriter, ObjectId, PublishShard, StagedObject, Store,
    StoreError,
};

use crate::decompress::{
    open_blob, Compression, DecompressError, LimitError, OpenError, SourceError,
};
use crate::early::LineTap;
use crate::entry::{lossy, prepare, AddError, Prepared};
use crate::tar::{Chunk, TarEntry, TarError, TarErrorKind, TarLimits, TarReader};
use crate::{pipeline, LayerError};

/// What a layer may hold before its import is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest uncompressed tar stream (default 64 GiB).
    pub max_layer_bytes: u64,
    /// Largest uncompressed/compressed ratio once past 64 MiB (default 200).
    pub max_ratio: u64,
    /// Most tar entries (default 10 million).
    pub max_entries: u64,
    /// Longest path or link target in the tar stream (default 4096).
    pub max_path: usize,
    /// Largest total of one entry's xattr names and values (default 32767,
    /// what composefs can store).
    pub max_xattr_bytes: usize,
    /// Largest pax extended header or GNU long name (default 1 MiB).
    pub max_pax_header: usize,
    /// Most segments the sparse files of a layer may list together
    /// (default 65536). Each costs at least one block hash, whatever its
    /// size; see the `tar` module's docs.
    pub max_sparse_segments: u64,
    /// Most bytes of holes (real size minus stored data) the sparse files
    /// of a layer may declare together (default 8 GiB). Holes are free in
    /// the tar stream but the kernel reads every byte of them when it
    /// enables fs-verity, and so does anything that reads the file.
    pub max_hole_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_layer_bytes: 64 << 30,
            max_ratio: 200,
            max_entries: 10_000_000,
            max_path: 4096,
            max_xattr_bytes: u16::MAX as usize / 2,
            max_pax_header: 1 << 20,
            max_sparse_segments: 1 << 16,
            max_hole_bytes: 8 << 30,
        }
    }
}

impl From<&Limits> for TarLimits {
    fn from(l: &Limits) -> Self {
        TarLimits {
            max_path: l.max_path,
            max_pax_header: l.max_pax_header,
            max_xattr_bytes: l.max_xattr_bytes,
            max_sparse_segments: l.max_sparse_segments,
            max_hole_bytes: l.max_hole_bytes,
        }
    }
}

/// What an imported layer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// `sha256:<hex>` of the uncompressed tar stream.
    pub diff_id: String,
    /// `sha256:<hex>` of the blob as read (or as recorded, for a cached
    /// layer).
    pub blob_digest: Option<String>,
    /// Tar entries.
    pub entries: u64,
    /// Uncompressed bytes.
    pub size: u64,
    /// Bytes of the blob.
    pub compressed_size: u64,
    /// True when the layer was in the store already and the blob was not
    /// read at all.
    pub cached: bool,
}

impl LayerInfo {
    fn from_record(r: &LayerRecord, cached: bool) -> LayerInfo {
        LayerInfo {
            diff_id: r.diff_id.clone(),
            blob_digest: r.blob_digest.clone(),
            entries: r.entries,
            size: r.size,
            compressed_size: r.compressed_size,
            cached,
        }
    }
}

/// Whether the store has the layer (a complete record of it).
pub fn has_layer(store: &Store, diff_id: &str) -> bool {
    store.has_layer_record(diff_id)
}

/// Streams one layer blob into the store; see the module docs.
///
/// `expected_blob_digest` is checked against the SHA-256 of the bytes read
/// from `blob`, `expected_diff_id` against that of the uncompressed tar
/// stream, both before the layer record becomes visible (objects, which
/// are named by their content, may be published before). If `expected_diff_id` is
/// given and the store has that layer already, `blob` is not read at all.
pub fn import_layer(
    store: &Store,
    blob: impl Read + Send,
    media_type: Option<&str>,
    expected_blob_digest: Option<&str>,
    expected_diff_id: Option<&str>,
    limits: &Limits,
) -> Result<LayerInfo, LayerError> {
    import_layer_with(
        store,
        blob,
        media_type,
        expected_blob_digest,
        expected_diff_id,
        limits,
        &mut |_| {},
    )
}

/// A layer whose stream is read and checked, before its last objects and
/// its record are published: what [`import_layer_with`] hands over.
#[derive(Debug)]
pub struct CheckedLayer {
    /// The layer record's entries file, read-only, at its start.
    pub entries: std::fs::File,
    /// The layer's diff_id (`sha256:<hex>`), checked against the one
    /// expected, if one was.
    pub diff_id: String,
    /// The size of the uncompressed tar stream, as the record will say.
    pub size: u64,
}

/// What an import reports while it runs; see [`import_layer_with`]. A
/// closure taking a [`CheckedLayer`] is one.
pub trait LayerWatch {
    /// Called once, as the import starts writing its record: where its
    /// entry lines go as they are written, if anywhere.
    fn tap(&mut self) -> Option<LineTap> {
        None
    }

    /// The layer is checked; see [`import_layer_with`].
    fn checked(&mut self, layer: CheckedLayer);
}

impl<F: FnMut(CheckedLayer)> LayerWatch for F {
    fn checked(&mut self, layer: CheckedLayer) {
        self(layer)
    }
}

/// [`import_layer`], telling `checked` when the layer's entries are final:
/// the stream has been read to its end, its blob digest and diff_id match
/// what was expected, and every entry line is written. `checked` gets the
/// entries file and the stream's size ([`CheckedLayer`]), before the
/// layer's last objects and its record are published, so that a caller
/// can build an image from it meanwhile (`crate::assemble::StagedImage`).
/// It is called at most once. Before the first entry line, the import asks
/// `checked` for a tap ([`LayerWatch::tap`]) and sends its record lines
/// through it as it writes them (see [`crate::LineTap`]). Neither is done
/// when the store had the layer already.
pub fn import_layer_with(
    store: &Store,
    blob: impl Read + Send,
    media_type: Option<&str>,
    expected_blob_digest: Option<&str>,
    expected_diff_id: Option<&str>,
    limits: &Limits,
    checked: &mut dyn LayerWatch,
) -> Result<LayerInfo, LayerError> {
    let layer = expected_blob_digest
        .or(expected_diff_id)
        .unwrap_or("(unnamed)")
        .to_owned();
    for (what, d) in [
        ("blob digest", expected_blob_digest),
        ("diff_id", expected_diff_id),
    ] {
        if let Some(d) = d {
            if !is_diff_id(d) {
                return Err(LayerError::Invalid {
                    layer,
                    reason: format!(
                        "expected {what} {d:?} is not sha256:<64 lowercase hex digits> (the only digest cairn checks)"
                    ),
                });
            }
        }
    }
    if let Some(diff_id) = expected_diff_id {
        if let Some(rec) = cached_record(store, diff_id)? {
            return Ok(LayerInfo::from_record(&rec, true));
        }
    }
    let declared = match media_type {
        Some(mt) => Some(
            Compression::of_layer(mt).ok_or_else(|| LayerError::MediaType {
                layer: layer.clone(),
                media_type: mt.to_owned(),
            })?,
        ),
        None => None,
    };
    let _lock = store.lock_shared().map_err(LayerError::store(format!(
        "layer {layer}: locking the store"
    )))?;
    let started = std::time::Instant::now();

    let open_err = |e: OpenError| match e {
        OpenError::Read(source) => classify_io(&layer, source, None),
        OpenError::Mismatch(reason) => LayerError::Invalid {
            layer: layer.clone(),
            reason,
        },
    };
    let threads = pipeline::parallelism();
    let workers = threads.clamp(1, pipeline::MAX_WORKERS);
    // Objects are named by the threads that stage them, as each becomes
    // durable (see `cairn_store::Publisher`), not in one pass at the end.
    let publisher = store
        .publisher(workers)
        .map_err(|e| store_err(&layer, "starting the object publisher", e))?;
    let (b, compression, totals) = if threads <= 1 {
        // One CPU: every stage in this thread, one after the other.
        let (stream, compression, meter) = open_blob(
            blob,
            declared,
            limits.max_layer_bytes,
            limits.max_ratio,
            true,
        )
        .map_err(open_err)?;
        let mut tar = TarReader::new(
            BufReader::with_capacity(64 * 1024, stream),
            TarLimits::from(limits),
        );
        // Named staging files, renamed at the end: with one thread, a sync
        // each time the open-file budget is reached stops all the work
        // while the disk writes (taskset -c 0: 47.3 s against 27.7 s for
        // the Linux-tree layer), where the kernel's own writeback overlaps.
        let mut b = LayerBuilder::new(store, None, None)
            .map_err(|e| store_err(&layer, "starting the layer record", e))?;
        b.tap = checked.tap();
        parse_layer(&mut tar, compression, &mut b, limits, &layer)?;
        drop(tar);
        let totals = pipeline::Totals::of(&meter);
        check_digests(&layer, expected_blob_digest, expected_diff_id, &totals)?;
        entries_done(&mut b, &layer, &totals, checked)?;
        (b, compression, totals)
    } else {
        std::thread::scope(|s| {
            let at = pipeline::DiffIdStage::for_threads(threads);
            let q = pipeline::stream_queues(at);
            let (max_bytes, max_ratio) = (limits.max_layer_bytes, limits.max_ratio);
            // Named, for `perf`, `top -H` and `ps -L`.
            let decompressor = spawn_named(s, "cairn-decompress", move || {
                pipeline::decompress(
                    blob,
                    declared,
                    max_bytes,
                    max_ratio,
                    at,
                    q.opened_tx,
                    q.tx,
                    q.free_rx,
                )
            })
            .map_err(|e| LayerError::Invalid {
                layer: layer.clone(),
                reason: format!("starting the decompression thread: {e}"),
            })?;
            let compression = match q.opened_rx.recv() {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(open_err(e)),
                Err(_) => {
                    return Err(LayerError::Invalid {
                        layer: layer.clone(),
                        reason: "the decompression thread stopped".into(),
                    })
                }
            };
            let (objects, ends) = pipeline::Objects::new(workers);
            let (flush_tx, flush_rx) = std::sync::mpsc::sync_channel(1);
            let publisher = &publisher;
            let thread_err = |what: &str, e: std::io::Error| LayerError::Invalid {
                layer: layer.clone(),
                reason: format!("starting {what}: {e}"),
            };
            for (jobs, done, free) in ends {
                let flush = flush_tx.clone();
                let chunks = q.reader.recycler();
                spawn_named(s, "cairn-objects", move || {
                    pipeline::object_worker(publisher, jobs, done, free, chunks, flush)
                })
                .map_err(|e| thread_err("an object worker", e))?;
            }
            drop(flush_tx);
            spawn_named(s, "cairn-flush", move || {
                pipeline::flusher(publisher, flush_rx)
            })
            .map_err(|e| thread_err("the flusher thread", e))?;
            let mut b = LayerBuilder::new(store, Some(objects), None)
                .map_err(|e| store_err(&layer, "starting the layer record", e))?;
            b.tap = checked.tap();
            // The chunks are the buffer: no BufReader (and no copy) between.
            let mut tar = TarReader::new(q.reader, TarLimits::from(limits));
            parse_layer(&mut tar, compression, &mut b, limits, &layer)?;
            let diff_id = tar.into_inner().diff_id();
            b.settle_all().map_err(|e| add_err(&layer, b"", 0, e))?;
            let totals = decompressor
                .join()
                .map_err(|_| LayerError::Invalid {
                    layer: layer.clone(),
                    reason: "the decompression thread panicked".into(),
                })?
                .ok_or_else(|| LayerError::Invalid {
                    layer: layer.clone(),
                    reason: "the decompression thread ended without totals".into(),
                })?
                .with_diff_id(diff_id)
                .ok_or_else(|| LayerError::Invalid {
                    layer: layer.clone(),
                    reason: format!("no stage of the import took the stream's diff_id ({at:?})"),
                })?;
            check_digests(&layer, expected_blob_digest, expected_diff_id, &totals)?;
            // Every object is staged, and the layer is the one expected:
            // the workers name their last objects as they end, which they
            // do when their queues close.
            publisher.staging_done();
            tracing::debug!(
                "layer {layer}: stream parsed and checked at {:?}",
                started.elapsed()
            );
            b.objects = None;
            // The workers are still naming their last objects (a sync of
            // the stream's tail, then links): the entries need not wait.
            entries_done(&mut b, &layer, &totals, checked)?;
            Ok((b, compression, totals))
        })?
    };
    tracing::debug!(
        "layer {layer}: {} entries, {} bytes read in {:?}",
        b.entries,
        totals.uncompressed,
        started.elapsed()
    );

    let pipeline::Totals {
        blob_digest,
        diff_id,
        compressed,
        uncompressed,
    } = totals;
    let record = LayerRecord {
        format: cairn_store::LAYER_FORMAT,
        diff_id: diff_id.clone(),
        blob_digest: Some(blob_digest),
        media_type: media_type.map(str::to_owned),
        compression: compression.name().to_owned(),
        size: uncompressed,
        compressed_size: compressed,
        entries: b.entries,
        objects: b.staged.len() as u64,
    };
    // Someone else (another pull) may have finished it meanwhile.
    if let Some(rec) = cached_record(store, &diff_id)? {
        return Ok(LayerInfo::from_record(&rec, false));
    }
    let LayerBuilder {
        staged,
        writer,
        shard,
        ..
    } = b;
    // Every shard gone (the workers' with their threads): what they hold
    // goes to finish, which names it and makes every new name durable.
    drop(shard);
    publisher
        .finish()
        .map_err(|e| store_err(&diff_id, "publishing objects", e))?;
    // Objects staged with names (where fs-verity seals them): renamed here.
    store
        .publish_staged(staged.into_values())
        .map_err(|e| store_err(&diff_id, "publishing objects", e))?;
    tracing::debug!(
        "layer {diff_id}: objects published at {:?}",
        started.elapsed()
    );
    writer
        .commit(store, &record)
        .map_err(|e| store_err(&diff_id, "publishing the layer record", e))?;
    tracing::debug!(
        "layer {diff_id}: record published at {:?}",
        started.elapsed()
    );
    Ok(LayerInfo::from_record(&record, false))
}

/// Writes the entry lines still buffered and hands `checked` the entries
/// file: the layer's stream is read and its digests match.
fn entries_done(
    b: &mut LayerBuilder<'_>,
    layer: &str,
    totals: &pipeline::Totals,
    checked: &mut dyn LayerWatch,
) -> Result<(), LayerError> {
    b.flush().map_err(|e| match e {
        AddError::Reason(reason) => LayerError::Invalid {
            layer: layer.to_owned(),
            reason,
        },
        AddError::Tar(e) => tar_err(layer, e),
        AddError::Store(e) => store_err(layer, "writing the layer record", e),
    })?;
    // Every line is in the file: the tap's reader reads the rest there.
    b.tap = None;
    let entries = b
        .writer
        .open_entries()
        .map_err(|e| store_err(layer, "reading back the layer record", e))?;
    checked.checked(CheckedLayer {
        entries,
        diff_id: totals.diff_id.clone(),
        size: totals.uncompressed,
    });
    Ok(())
}

/// Checks the digests of what was read against those expected.
fn check_digests(
    layer: &str,
    expected_blob_digest: Option<&str>,
    expected_diff_id: Option<&str>,
    totals: &pipeline::Totals,
) -> Result<(), LayerError> {
    for (what, expected, actual) in [
        ("blob digest", expected_blob_digest, &totals.blob_digest),
        ("diff_id", expected_diff_id, &totals.diff_id),
    ] {
        if let Some(expected) = expected {
            if expected != actual {
                return Err(LayerError::Digest {
                    layer: layer.to_owned(),
                    what,
                    expected: expected.to_owned(),
                    actual: actual.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Reads every entry of the tar stream into `b`.
fn parse_layer<R: crate::tar::TarSource>(
    tar: &mut TarReader<R>,
    compression: Compression,
    b: &mut LayerBuilder<'_>,
    limits: &Limits,
    layer: &str,
) -> Result<(), LayerError> {
    loop {
        let entry = match tar.next_entry() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            // A limit is about what parsed fine: no reason to read on.
            Err(e) if matches!(e.kind, TarErrorKind::Limit(_)) => return Err(tar_err(layer, e)),
            Err(e) => return Err(explain(tar, compression, tar_err(layer, e), layer)),
        };
        b.entries += 1;
        if b.entries > limits.max_entries {
            return Err(LayerError::Limit {
                layer: layer.to_owned(),
                reason: format!("more than {} tar entries", limits.max_entries),
            });
        }
        let (path, offset) = (entry.path.clone(), entry.offset);
        if let Err(e) = b.add(tar, entry) {
            let e = add_err(layer, &path, offset, e);
            return Err(explain(tar, compression, e, layer));
        }
    }
    tar.drain().map_err(|e| tar_err(layer, e))?;
    Ok(())
}

fn add_err(layer: &str, path: &[u8], offset: u64, e: AddError) -> LayerError {
    match e {
        AddError::Reason(reason) => LayerError::Entry {
            layer: layer.to_owned(),
            entry: lossy(path),
            offset,
            reason,
        },
        AddError::Tar(e) => tar_err(layer, e),
        AddError::Store(e) => store_err(layer, &format!("storing {}", lossy(path)), e),
    }
}

/// A compressed stream that does not parse as tar is more often corrupt
/// than a bad archive: if reading on to its end shows the compression is
/// broken (a checksum, a bad block), that is the error to report.
fn explain<R: crate::tar::TarSource>(
    tar: &mut TarReader<R>,
    compression: Compression,
    err: LayerError,
    layer: &str,
) -> LayerError {
    let parse_error = matches!(err, LayerError::Invalid { .. } | LayerError::Entry { .. });
    if !parse_error || compression == Compression::None {
        return err;
    }
    match tar.drain() {
        Err(e) => match tar_err(layer, e) {
            decompress @ LayerError::Invalid { .. } => decompress,
            _ => err,
        },
        Ok(_) => err,
    }
}

fn cached_record(store: &Store, diff_id: &str) -> Result<Option<LayerRecord>, LayerError> {
    if !store.has_layer_record(diff_id) {
        return Ok(None);
    }
    store
        .layer_record(diff_id)
        .map_err(|e| store_err(diff_id, "reading the cached layer record", e))
}

fn store_err(layer: &str, what: &str, e: StoreError) -> LayerError {
    LayerError::store(format!("layer {layer}: {what}"))(e)
}

/// Sorts an I/O error from the reader stack by where it came from.
fn classify_io(layer: &str, e: std::io::Error, at: Option<u64>) -> LayerError {
    let layer = layer.to_owned();
    let at = at
        .map(|o| format!(" at byte {o} of the tar stream"))
        .unwrap_or_default();
    // What the reader stack said, also when another thread ran it.
    let inner = pipeline::original(&e).get_ref();
    if inner.is_some_and(|i| i.is::<SourceError>()) {
        return LayerError::Read { layer, source: e };
    }
    if let Some(d) = inner.and_then(|i| i.downcast_ref::<DecompressError>()) {
        return LayerError::Invalid {
            layer,
            reason: format!("{d}{at}"),
        };
    }
    if let Some(l) = inner.and_then(|i| i.downcast_ref::<LimitError>()) {
        return LayerError::Limit {
            layer,
            reason: format!("{l}{at}"),
        };
    }
    LayerError::Invalid {
        layer,
        reason: format!("reading the tar stream{at}: {e}"),
    }
}

fn tar_err(layer: &str, e: TarError) -> LayerError {
    match e.kind {
        TarErrorKind::Read(io) => classify_io(layer, io, Some(e.offset)),
        kind => {
            let reason = TarError {
                offset: e.offset,
                entry: None,
                kind,
            }
            .reason();
            match e.entry {
                Some(entry) => LayerError::Entry {
                    layer: layer.to_owned(),
                    entry: lossy(&entry),
                    offset: e.offset,
                    reason,
                },
                None => LayerError::Invalid {
                    layer: layer.to_owned(),
                    reason: format!("tar stream at byte {}: {reason}", e.offset),
                },
            }
        }
    }
}

/// The layer's record, written entry by entry as the stream is read.
struct LayerBuilder<'s> {
    store: &'s Store,
    writer: LayerRecordWriter,
    /// Lines not yet written to the record file.
    pending: Vec<u8>,
    /// Objects staged so far, by id (each content once).
    staged: HashMap<ObjectId, StagedObject>,
    entries: u64,
    /// The object workers, if objects are staged in other threads.
    objects: Option<pipeline::Objects>,
    /// Where objects are staged and published, if in this thread.
    shard: Option<PublishShard<'s>>,
    /// Entries whose line waits for an object a worker is writing (the
    /// first one does), in stream order.
    waiting: VecDeque<Waiting>,
    /// What the waiting lines hold, about ([`Waiting::weight`]).
    waiting_bytes: usize,
    /// Where the lines go as they are written, besides the record.
    tap: Option<LineTap>,
}

fn worker_gone(_: pipeline::WorkerGone) -> AddError {
    AddError::Reason("the object worker stopped".into())
}

/// A file's data, read by the tar parser straight into the object
/// workers' batch.
struct ToWorkers<'o>(&'o mut pipeline::Objects);

impl crate::tar::DataSink<AddError> for ToWorkers<'_> {
    fn room(&mut self, want: usize) -> Result<&mut [u8], AddError> {
        self.0.room(want).map_err(worker_gone)
    }

    fn filled(&mut self, n: usize) -> Result<(), AddError> {
        self.0.filled(n);
        Ok(())
    }

    fn hole(&mut self, n: u64) -> Result<(), AddError> {
        self.0.hole(n);
        Ok(())
    }

    fn takes_lent(&self, n: usize) -> bool {
        self.0.takes_lent(n)
    }

    fn lent(&mut self, piece: crate::tar::Lent) -> Result<(), AddError> {
        self.0.lent(piece).map_err(worker_gone)
    }
}

/// A record line that waits for its object.
struct Waiting {
    path: Vec<u8>,
    inode: Inode,
    hardlink: Option<Vec<u8>>,
    /// The object's number, for a regular file staged by a worker.
    object: Option<u64>,
}

impl Waiting {
    /// The memory a waiting line holds, about: its names, link target and
    /// xattrs, a part for each xattr's allocations and tree node, and a
    /// fixed part for the rest.
    fn weight(&self) -> usize {
        let xattrs: usize = self
            .inode
            .xattrs
            .iter()
            .map(|(k, v)| 96 + k.len() + v.len())
            .sum();
        let target = match &self.inode.data {
            InodeData::Symlink(t) => t.len(),
            _ => 0,
        };
        256 + self.path.len() + self.hardlink.as_ref().map_or(0, Vec::len) + target + xattrs
    }
}

/// Lines that may wait for objects before the parser waits for them too.
const MAX_WAITING: usize = 1 << 16;

/// The memory they may hold: a line can carry a path and xattrs of tens
/// of KiB, so the count alone would let 65,536 of them take gigabytes
/// while one large object is written.
const MAX_WAITING_BYTES: usize = 64 << 20;

/// Flush the record's pending lines once they reach this size.
const RECORD_BUFFER: usize = 1 << 20;

impl<'s> LayerBuilder<'s> {
    fn new(
        store: &'s Store,
        objects: Option<pipeline::Objects>,
        shard: Option<PublishShard<'s>>,
    ) -> Result<Self, StoreError> {
        Ok(LayerBuilder {
            shard,
            store,
            writer: store.layer_writer()?,
            pending: Vec::with_capacity(RECORD_BUFFER + 64 * 1024),
            staged: HashMap::new(),
            entries: 0,
            objects,
            waiting: VecDeque::new(),
            waiting_bytes: 0,
            tap: None,
        })
    }

    fn write_line(
        &mut self,
        path: &[u8],
        inode: &Inode,
        hardlink: Option<&[u8]>,
    ) -> Result<(), AddError> {
        if !self.waiting.is_empty() {
            self.wait_line(Waiting {
                path: path.to_vec(),
                inode: inode.clone(),
                hardlink: hardlink.map(<[u8]>::to_vec),
                object: None,
            });
            return self.settle(false);
        }
        self.format_line(path, inode, hardlink)
    }

    fn format_line(
        &mut self,
        path: &[u8],
        inode: &Inode,
        hardlink: Option<&[u8]>,
    ) -> Result<(), AddError> {
        cairn_erofs::dump::format_entry_line(&mut self.pending, path, inode, hardlink);
        if self.pending.len() >= RECORD_BUFFER {
            self.flush()?;
        }
        Ok(())
    }

    fn wait_line(&mut self, w: Waiting) {
        self.waiting_bytes += w.weight();
        self.waiting.push_back(w);
    }

    fn unwait_line(&mut self) -> Waiting {
        let w = self.waiting.pop_front().expect("the front");
        self.waiting_bytes -= w.weight();
        debug_assert!(!self.waiting.is_empty() || self.waiting_bytes == 0);
        w
    }

    /// Writes the waiting lines whose objects are done, from the first on;
    /// with `wait` (or too many waiting, or too much), waits for the first
    /// one's.
    fn settle(&mut self, wait: bool) -> Result<(), AddError> {
        while let Some(front) = self.waiting.front() {
            let mut w = if let Some(seq) = front.object {
                let must = wait
                    || self.waiting.len() > MAX_WAITING
                    || self.waiting_bytes > MAX_WAITING_BYTES;
                let objects = self.objects.as_mut().expect("objects while lines wait");
                let gone = |_| {
                    AddError::Reason(format!(
                        "storing {}: the object worker stopped",
                        lossy(&front.path)
                    ))
                };
                let Some(done) = objects.take(seq, must).map_err(gone)? else {
                    if must {
                        return Err(AddError::Reason(format!(
                            "storing {}: the object worker stopped",
                            lossy(&front.path)
                        )));
                    }
                    return Ok(());
                };
                let staged = done.map_err(|e| {
                    AddError::Reason(format!("storing {}: {e}", lossy(&front.path)))
                })?;
                let mut w = self.unwait_line();
                let id = staged.id();
                w.inode.data = InodeData::Regular(RegularFile {
                    content: None,
                    payload: Some(id.object_path().into_bytes()),
                    digest: Some(id.0),
                });
                self.staged.entry(id).or_insert(staged);
                w
            } else {
                self.unwait_line()
            };
            let hardlink = w.hardlink.take();
            self.format_line(&w.path, &w.inode, hardlink.as_deref())?;
        }
        Ok(())
    }

    /// Waits for every object and writes every waiting line.
    fn settle_all(&mut self) -> Result<(), AddError> {
        self.settle(true)
    }

    fn flush(&mut self) -> Result<(), AddError> {
        use std::io::Write;
        self.writer
            .entries()
            .write_all(&self.pending)
            .map_err(|e| AddError::Reason(format!("writing the layer record: {e}")))?;
        if let Some(tap) = &mut self.tap {
            if !self.pending.is_empty() {
                // Refused, it stops: the reader reads the rest from the file.
                tap.send(&self.pending);
            }
        }
        self.pending.clear();
        Ok(())
    }

    fn add<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: TarEntry,
    ) -> Result<(), AddError> {
        let (path, mut inode) = match prepare(&e)? {
            Prepared::Skip => return Ok(()),
            Prepared::Line(path, inode, hardlink) => {
                return self.write_line(&path, &inode, hardlink.as_deref())
            }
            Prepared::Regular(path, inode) => (path, inode),
        };
        if self.objects.is_some() && e.size > DEFAULT_INLINE_THRESHOLD {
            let seq = self.send_content(tar, &e)?;
            self.wait_line(Waiting {
                path,
                inode,
                hardlink: None,
                object: Some(seq),
            });
            return self.settle(false);
        }
        inode.data = InodeData::Regular(self.read_content(tar, &e)?);
        self.write_line(&path, &inode, None)
    }

    /// Hands a regular file's content to an object worker; the object's
    /// number.
    fn send_content<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: &TarEntry,
    ) -> Result<u64, AddError> {
        let objects = self.objects.as_mut().expect("object workers");
        let seq = objects.begin(e.size).map_err(worker_gone)?;
        tar.copy_data_into(e, &mut ToWorkers(objects))?;
        objects.end();
        Ok(seq)
    }

    /// Reads a regular file's content: inline if small, else into a staged
    /// object.
    fn read_content<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: &TarEntry,
    ) -> Result<RegularFile, AddError> {
        if e.size == 0 {
            return Ok(RegularFile::default());
        }
        if e.size <= DEFAULT_INLINE_THRESHOLD {
            let mut content = Vec::with_capacity(e.size as usize);
            tar.copy_data::<AddError>(e, |c| {
                match c {
                    Chunk::Data(d) => content.extend_from_slice(d),
                    Chunk::Hole(n) => content.resize(content.len() + n as usize, 0),
                }
                Ok(())
            })?;
            return Ok(RegularFile {
                content: Some(content),
                ..Default::default()
            });
        }
        let mut stager = match &self.shard {
            Some(shard) => shard.stage_object(),
            None => self.store.stage_object(),
        }
        .map_err(AddError::Store)?;
        tar.copy_data::<AddError>(e, |c| {
            match c {
                Chunk::Data(d) => stager.write(d),
                Chunk::Hole(n) => stager.hole(n),
            }
            .map_err(AddError::Store)
        })?;
        let staged = match &mut self.shard {
            Some(shard) => {
                let staged = shard.finish(stager).map_err(AddError::Store)?;
                shard.publish_ready();
                staged
            }
            None => stager.finish(self.store).map_err(AddError::Store)?,
        };
        let id = staged.id();
        self.staged.entry(id).or_insert(staged);
        Ok(RegularFile {
            content: None,
            payload: Some(id.object_path().into_bytes()),
            digest: Some(id.0),
        })
    }
}

/// A scoped thread with a name (what `ps -L` and `perf` show).
fn spawn_named<'scope, 'env, T: Send + 'scope>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, T>> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn_scoped(s, f)
}
