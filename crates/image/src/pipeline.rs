//! The threads of a layer import, so that one layer keeps every core busy.
//!
//! ```text
//!  blob ──► [decompress]  read, blob digest, inflate, limits
//!                │  chunks of 256 KiB (bounded queue, buffers recycled)
//!                ▼
//!           [parse]       diff_id, tar headers, layer record lines, inline files
//!                │        (the caller's thread)
//!                │  batches: up to 256 KiB of data or 64 files each
//!                │  (a bounded queue per worker, buffers recycled)
//!                ▼
//!           [objects] ×N  fs-verity digest, unnamed object file (O_TMPFILE),
//!                │  │       linked into objects/ once a sync made it durable
//!                │  └──►  [flusher]  syncfs every 64 MiB staged (or when a
//!                │                   worker holds half its open-file budget)
//!                │  the objects each batch completed, in one message
//!                ▼
//!           [parse]       record lines written in stream order
//! ```
//!
//! The flusher makes the disk write the staged objects while the CPUs
//! make the next ones: the kernel would otherwise begin only when a tenth
//! or so of memory is dirty, so that the one sync before publishing (which
//! durability needs) wrote the whole layer while every CPU waited. Each
//! sync also lets the workers name the objects it made durable, so that
//! publication happens on every worker during the stream instead of in a
//! serial pass of renames at the end (`cairn_store::Publisher` has the
//! protocol). A worker's own staging directory spares it the lock of a
//! directory that another worker is creating files in (where objects are
//! staged with names, with fs-verity).
//!
//! Where the decompression thread's time goes (the Linux-tree layer, 1.36
//! GB of tar, on a 2-core EPYC with SHA-NI; `bench/results/
//! publish-strategies.md`, round 3): about 1.7 CPU-s of zlib-rs inflate
//! for gzip, 2.1 CPU-s of libzstd for the same tar at `zstd -3` plus 0.4
//! CPU-s copying out of zstd's window buffer (its streaming API decodes
//! into its own buffer; decoding into ours would need the whole frame in
//! one buffer), and 1 CPU-s of sha256 for the blob digest and the diff_id
//! either way (an uncompressed blob is hashed once: its digest is its
//! diff_id). So a zstd layer costs a little more CPU than a gzip one
//! here, not less: zlib-rs is some four times faster than GNU gzip, which
//! is what `zstd -d` is usually compared with. The thread is not the
//! bound on 2 cores (the disk, or the sum of every thread's CPU, is).
//!
//! Where the diff_id (sha256 of the uncompressed stream, some 0.8 CPU-s
//! of that second) is computed depends on the CPUs ([`DiffIdStage`]).
//! With more than two, the parse stage hashes each chunk as it arrives:
//! the parse stage mostly waits for chunks and for the object workers (a
//! profile of the Linux-tree layer: decompression 28% of the import's
//! CPU, parsing 15%), so the longest serial chain is shorter. With two or
//! fewer, every CPU is busy and the sum of the threads' CPU is the bound,
//! so the decompression thread hashes each piece right after inflating
//! it, while it is in that core's cache: the parse stage's hash read the
//! chunk from another core's cache or from memory, after up to
//! [`CHUNK_QUEUE`] others, and took about 25% longer for the same bytes
//! (Linux-tree pull on 2 cores, `perf record`: the two digests of the
//! decompression thread 1.06 CPU-s, against 1.19-1.21 s for the diff_id
//! in the parse stage plus 0.14-0.17 s for the blob digest).
//!
//! Messages carry batches, not files: the data of many small files (and
//! the beginnings, ends and holes of each) travel in one buffer, so a
//! thread is woken once per batch rather than once per file, and a small
//! file costs no message of its own (nor is it split between two). The
//! tar parser copies small pieces of file data (under [`LEND_MIN`]) from
//! the chunk straight into the batch; larger pieces are lent: the batch
//! holds a reference to the chunk and the piece's place in it, and the
//! worker writes the object file from the chunk itself, so the data of
//! large files is not copied between the decompressor's output and the
//! object file at all. A chunk is reused once the parser and every worker
//! are done with it. A batch goes to the next worker whose
//! queue has room, so one big file (whose later batches must go to the
//! worker that has its beginning) does not hold up the files after it
//! while another worker is free.
//!
//! Every queue is bounded, so memory is too: at most [`CHUNK_QUEUE`] chunks
//! between decompression and parsing and [`WORKER_QUEUE`] batches waiting
//! for each object worker, whatever the layer. A batch carries at most
//! [`BATCH_BYTES`] of data, copied or lent, and its lent pieces lie in at
//! most [`BATCH_CHUNKS`] chunks: with 8 workers, the queued batches keep
//! at most 8 x 9 x 3 chunks (54 MiB) alive. The record lines keep the
//! order of the tar stream: a line whose object is still being written
//! waits (with every line after it) until its worker reports the object's
//! digest, so the record, the objects and the image are the same bytes as
//! with one thread.
//!
//! Errors travel with the data: a failed read or decompression ends the
//! chunk stream with that error, a failed object write comes back as that
//! file's result. Whoever stops first drops its end of the queues, so the
//! other stages stop at their next send or receive; staged objects of a
//! failed import are dropped, and nothing is published.
//!
//! On a machine (or cgroup, or `taskset`) with one CPU no thread is
//! started: the stages run one after the other in the caller's thread, as
//! they would in any case. `CAIRN_IMPORT_THREADS` (a number, 1 or more)
//! overrides the CPU count, for tests and measurements.

use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;

use cairn_store::{Publisher, StagedObject, StoreError};
use sha2::{Digest, Sha256};

use crate::decompress::{open_blob, Compression, Meter, OpenError};

/// Bytes handed from decompression to parsing at a time.
pub(crate) const CHUNK: usize = 256 * 1024;
/// Chunks that may wait between decompression and parsing (4 MiB).
pub(crate) const CHUNK_QUEUE: usize = 16;
/// Batches that may wait for one object worker (at most 2 MiB of data).
pub(crate) const WORKER_QUEUE: usize = 8;
/// Most object workers.
pub(crate) const MAX_WORKERS: usize = 8;

/// How many threads an import may use: the CPUs this process may run on,
/// or what `CAIRN_IMPORT_THREADS` says (1: no thread at all, every stage
/// in the caller's; more: a decompression thread and that many object
/// workers, the parse stage staying in the caller's thread). An object
/// worker spends much of its time in the kernel creating files and waiting
/// for the filesystem's journal, so one per CPU (not one less, for the
/// other stages) keeps the CPUs busier: on 2 cores, a Linux-tree layer
/// kept 1.36-1.41 CPUs busy with two workers against 1.18-1.28 with one,
/// and imported in 8.3-10.5 s against 9.3-13.6 s (3 interleaved runs
/// each). A value that is not a positive number is ignored.
pub(crate) fn parallelism() -> usize {
    if let Some(n) = std::env::var("CAIRN_IMPORT_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// What the decompression stage counted and hashed, once it ended, and
/// the diff_id of the stream.
#[derive(Debug, Clone)]
pub(crate) struct Totals {
    pub blob_digest: String,
    pub diff_id: String,
    pub compressed: u64,
    pub uncompressed: u64,
}

impl Totals {
    /// The totals of a stack that hashed the stream itself.
    pub(crate) fn of(meter: &Meter) -> Totals {
        let diff_id = meter.diff_id();
        Totals {
            blob_digest: meter.blob_digest().unwrap_or_else(|| diff_id.clone()),
            diff_id,
            compressed: meter.compressed.get(),
            uncompressed: meter.uncompressed.get(),
        }
    }
}

/// What the decompression stage counted and hashed, once it ended; the
/// diff_id is its own or the parse stage's ([`DiffIdStage`]).
#[derive(Debug, Clone)]
pub(crate) struct Counted {
    /// `None`: the blob is uncompressed, and its digest is the diff_id.
    blob_digest: Option<String>,
    /// The stream's digest, where the decompression stage took it.
    diff_id: Option<String>,
    compressed: u64,
    uncompressed: u64,
}

impl Counted {
    pub(crate) fn of(meter: &Meter) -> Counted {
        Counted {
            blob_digest: meter.blob_digest(),
            diff_id: None,
            compressed: meter.compressed.get(),
            uncompressed: meter.uncompressed.get(),
        }
    }

    /// The totals, with the diff_id of the stream (read to its end): this
    /// stage's, or else the parse stage's. `None` if neither hashed it.
    pub(crate) fn with_diff_id(self, parsed: Option<String>) -> Option<Totals> {
        let diff_id = self.diff_id.or(parsed)?;
        Some(Totals {
            blob_digest: self.blob_digest.unwrap_or_else(|| diff_id.clone()),
            diff_id,
            compressed: self.compressed,
            uncompressed: self.uncompressed,
        })
    }
}

/// Which stage of a threaded import hashes the uncompressed stream (its
/// diff_id): see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DiffIdStage {
    /// As it inflates each piece, while the piece is in its core's cache.
    Decompression,
    /// As each chunk arrives, off the decompression thread's serial chain.
    Parse,
}

impl DiffIdStage {
    /// [`Decompression`](Self::Decompression) on at most two CPUs, where
    /// the threads' summed CPU is the bound; [`Parse`](Self::Parse) on
    /// more. It counts the CPUs, not the layers imported beside this one
    /// (`--jobs`): several layers at once on more than two CPUs may be
    /// bound by the summed CPU too, which was not measured.
    pub(crate) fn for_threads(threads: usize) -> DiffIdStage {
        if threads <= 2 {
            DiffIdStage::Decompression
        } else {
            DiffIdStage::Parse
        }
    }
}

/// One message from decompression to parsing.
pub(crate) enum Chunk {
    Data(Vec<u8>),
    Failed(io::Error),
}

/// The uncompressed stream, as another thread decompresses it.
pub(crate) struct ChunkReader {
    rx: Receiver<Chunk>,
    /// Where finished buffers go back for reuse.
    free: SyncSender<Vec<u8>>,
    /// The chunk being read: shared with the object workers that were lent
    /// pieces of it, and reused once the last of them is done with it.
    cur: Arc<Vec<u8>>,
    pos: usize,
    /// How the stream failed, given again to every later read (as a
    /// decompressor would).
    failed: Option<Arc<io::Error>>,
    /// The stream's bytes as they arrived: the diff_id, where this stage
    /// takes it ([`DiffIdStage::Parse`]).
    hash: Option<Sha256>,
}

impl ChunkReader {
    /// The diff_id of what arrived, if this stage hashed it; the whole
    /// stream once a read returned 0 (the tar parser drains the stream
    /// after its end marker).
    pub(crate) fn diff_id(&self) -> Option<String> {
        let h = self.hash.as_ref()?;
        Some(format!("sha256:{}", hex::encode(h.clone().finalize())))
    }
}

/// An error of the decompression stage, as the parse stage sees it (maybe
/// more than once): the original is inside.
#[derive(Debug, Clone)]
pub(crate) struct StreamError(pub Arc<io::Error>);

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for StreamError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl StreamError {
    fn to_io(&self) -> io::Error {
        io::Error::new(self.0.kind(), self.clone())
    }
}

/// The error inside `e`, if it came from the decompression stage.
pub(crate) fn original(e: &io::Error) -> &io::Error {
    match e.get_ref().and_then(|i| i.downcast_ref::<StreamError>()) {
        Some(s) => &s.0,
        None => e,
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.next_chunk()? {
            return Ok(0);
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl ChunkReader {
    /// Makes sure the current chunk has bytes left, receiving the next one
    /// if not; false at the end of the stream.
    fn next_chunk(&mut self) -> io::Result<bool> {
        if let Some(e) = &self.failed {
            return Err(StreamError(Arc::clone(e)).to_io());
        }
        while self.pos == self.cur.len() {
            match self.rx.recv() {
                Ok(Chunk::Data(d)) => {
                    if let Some(h) = &mut self.hash {
                        h.update(&d);
                    }
                    let old = std::mem::replace(&mut self.cur, Arc::new(d));
                    self.pos = 0;
                    recycle(old, &self.free);
                }
                Ok(Chunk::Failed(e)) => {
                    let e = Arc::new(e);
                    self.failed = Some(Arc::clone(&e));
                    return Err(StreamError(e).to_io());
                }
                // The sender is gone: the stream ended.
                Err(_) => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Where the object workers give back the chunks they were lent
    /// pieces of.
    pub(crate) fn recycler(&self) -> SyncSender<Vec<u8>> {
        self.free.clone()
    }
}

/// Gives a chunk buffer back for reuse if this was its last holder (and
/// the queue has room; otherwise it is freed).
pub(crate) fn recycle(chunk: Arc<Vec<u8>>, free: &SyncSender<Vec<u8>>) {
    if let Some(buf) = Arc::into_inner(chunk) {
        if buf.capacity() == CHUNK {
            let _ = free.try_send(buf);
        }
    }
}

/// The tar parser reads the chunks straight, each 256 KiB chunk being
/// buffer enough, and lends file data from them.
impl crate::tar::TarSource for ChunkReader {
    fn lend(&mut self, max: usize) -> io::Result<crate::tar::Lend> {
        use crate::tar::{Lend, Lent};
        if !self.next_chunk()? {
            return Ok(Lend::End);
        }
        let len = max.min(self.cur.len() - self.pos);
        let piece = Lent {
            buf: Arc::clone(&self.cur),
            start: self.pos,
            len,
        };
        self.pos += len;
        Ok(Lend::Bytes(piece))
    }
}

/// Fills `buf` from `r` as far as it goes; the bytes read (0 at the end).
fn fill(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The decompression stage, run in its own thread: opens `blob`, tells
/// `opened` the compression it found, then streams the uncompressed bytes
/// into `tx` until they end, fail, or nobody listens any more. What it
/// counted has the diff_id if `at` is [`DiffIdStage::Decompression`];
/// otherwise the [`ChunkReader`] hashes the stream.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decompress(
    blob: impl Read,
    declared: Option<Compression>,
    max_bytes: u64,
    max_ratio: u64,
    at: DiffIdStage,
    opened: SyncSender<Result<Compression, OpenError>>,
    tx: SyncSender<Chunk>,
    free: Receiver<Vec<u8>>,
) -> Option<Counted> {
    let hash_here = at == DiffIdStage::Decompression;
    let (mut stream, compression, meter) =
        match open_blob(blob, declared, max_bytes, max_ratio, hash_here) {
            Ok(s) => s,
            Err(e) => {
                let _ = opened.send(Err(e));
                return None;
            }
        };
    if opened.send(Ok(compression)).is_err() {
        return None;
    }
    loop {
        let mut buf = free.try_recv().unwrap_or_else(|_| vec![0; CHUNK]);
        buf.resize(CHUNK, 0);
        match fill(&mut stream, &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                buf.truncate(n);
                if tx.send(Chunk::Data(buf)).is_err() {
                    return None;
                }
            }
            Err(e) => {
                let _ = tx.send(Chunk::Failed(e));
                return None;
            }
        }
    }
    drop(stream);
    let mut counted = Counted::of(&meter);
    if hash_here {
        counted.diff_id = Some(meter.diff_id());
    }
    Some(counted)
}

/// The queues between the parse stage and a decompression thread.
pub(crate) struct StreamQueues {
    pub opened_tx: SyncSender<Result<Compression, OpenError>>,
    pub opened_rx: Receiver<Result<Compression, OpenError>>,
    pub tx: SyncSender<Chunk>,
    pub free_rx: Receiver<Vec<u8>>,
    pub reader: ChunkReader,
}

/// The queues, with the [`ChunkReader`] hashing the stream if `at` is
/// [`DiffIdStage::Parse`].
pub(crate) fn stream_queues(at: DiffIdStage) -> StreamQueues {
    let (opened_tx, opened_rx) = mpsc::sync_channel(1);
    let (tx, rx) = mpsc::sync_channel(CHUNK_QUEUE);
    let (free_tx, free_rx) = mpsc::sync_channel(CHUNK_QUEUE + 2);
    StreamQueues {
        opened_tx,
        opened_rx,
        tx,
        free_rx,
        reader: ChunkReader {
            rx,
            free: free_tx,
            cur: Arc::new(Vec::new()),
            pos: 0,
            failed: None,
            hash: (at == DiffIdStage::Parse).then(Sha256::new),
        },
    }
}

/// Most bytes of file data in one [`Batch`] (a small file's data and the
/// files after it go together; a larger file spans several batches).
pub(crate) const BATCH_BYTES: usize = 256 * 1024;
/// Most files one [`Batch`] ends.
pub(crate) const BATCH_FILES: usize = 64;
/// Smallest piece of file data lent to a worker in the decompressor's
/// chunk rather than copied into its batch.
pub(crate) const LEND_MIN: usize = 4 * 1024;
/// Most chunks the lent pieces of one [`Batch`] may be in, so that what
/// the queued batches keep alive stays bounded (3 x 256 KiB each) however
/// far apart in the stream a layer puts its large files.
pub(crate) const BATCH_CHUNKS: usize = 3;

/// One step of a [`Batch`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// A new object starts; its number in the layer.
    Begin(u64),
    /// The next `n` bytes of the batch's data are the object's.
    Data(usize),
    /// A hole (zeros) of this many bytes.
    Hole(u64),
    /// The batch's next lent piece is the object's next data.
    Lent,
    /// The object is complete.
    End,
}

/// One message to an object worker: the pieces of one or more objects,
/// their data in one buffer. Several small files go in one message, so a
/// worker is woken per batch, not per file.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    ops: Vec<Op>,
    /// [`BATCH_BYTES`] long once used (zeroed once, when first allocated,
    /// then reused as it is): the tar parser reads file data straight into
    /// it, the worker writes it from there.
    data: Vec<u8>,
    /// Bytes of `data` in use.
    len: usize,
    /// Pieces of file data lent from the decompressor's chunks (larger
    /// pieces, which are not copied into `data`), in order.
    lent: Vec<crate::tar::Lent>,
    /// Their bytes.
    lent_len: usize,
    /// The chunks they are in (at most [`BATCH_CHUNKS`]).
    chunks: usize,
    /// Files the batch ends.
    files: usize,
}

impl Batch {
    /// File data the batch carries, copied or lent.
    fn bytes(&self) -> usize {
        self.len + self.lent_len
    }

    fn is_full(&self) -> bool {
        self.bytes() >= BATCH_BYTES || self.files >= BATCH_FILES
    }

    /// Whether its first step continues an object begun in an earlier
    /// batch (which only that batch's worker can take).
    fn continues(&self) -> bool {
        !matches!(self.ops.first(), None | Some(Op::Begin(_)))
    }
}

/// A worker's answer: the object's number and what became of it.
pub(crate) type Done = (u64, Result<StagedObject, StoreError>);

/// The object worker: stages each object it is sent, hashing it, and
/// reports the objects each batch completed in one message. Emptied
/// batches go back through `free` for reuse.
pub(crate) fn object_worker(
    publisher: &Publisher<'_>,
    jobs: Receiver<Batch>,
    done: mpsc::Sender<Vec<Done>>,
    free: SyncSender<Batch>,
    chunks: SyncSender<Vec<u8>>,
    flush: SyncSender<()>,
) {
    // Its own staging directory, so that the workers' file creations do
    // not wait for each other's directory lock (see `Publisher::shard`),
    // and its own objects to link once durable.
    let mut shard = publisher.shard();
    let mut unflushed = 0usize;
    let mut current: Option<(u64, Result<cairn_store::ObjectStager, StoreError>)> = None;
    while let Ok(mut batch) = jobs.recv() {
        let mut results = Vec::new();
        let mut off = 0;
        let mut lent = batch.lent.drain(..);
        for op in batch.ops.drain(..) {
            match op {
                Op::Begin(seq) => {
                    current = Some((seq, shard.stage_object()));
                }
                Op::Data(n) => {
                    let d = &batch.data[off..off + n];
                    off += n;
                    unflushed += n;
                    if let Some((seq, Ok(s))) = &mut current {
                        if let Err(e) = s.write(d) {
                            current = Some((*seq, Err(e)));
                        }
                    }
                }
                Op::Lent => {
                    let piece = lent.next().expect("a lent piece for each Op::Lent");
                    unflushed += piece.len;
                    if let Some((seq, Ok(s))) = &mut current {
                        if let Err(e) = s.write(piece.bytes()) {
                            current = Some((*seq, Err(e)));
                        }
                    }
                    recycle(piece.buf, &chunks);
                }
                Op::Hole(n) => {
                    if let Some((seq, Ok(s))) = &mut current {
                        if let Err(e) = s.hole(n) {
                            current = Some((*seq, Err(e)));
                        }
                    }
                }
                Op::End => {
                    if let Some((seq, stager)) = current.take() {
                        results.push((seq, stager.and_then(|s| shard.finish(s))));
                    }
                }
            }
        }
        if !results.is_empty() && done.send(results).is_err() {
            return;
        }
        // Names what the last syncs made durable; holding half its budget
        // of unnamed files, the worker asks for a sync.
        if shard.publish_ready() || unflushed >= FLUSH_BYTES {
            // Full (a sync is under way or asked for already): it will
            // take these bytes too.
            let _ = flush.try_send(());
            unflushed = 0;
        }
        drop(lent);
        batch.len = 0;
        batch.lent_len = 0;
        batch.chunks = 0;
        batch.files = 0;
        let _ = free.try_send(batch);
    }
    // The stream ended (or the import failed): name what is left, in
    // parallel with the other workers.
    shard.publish_all();
}

/// Staged bytes after which an object worker asks the flusher for a sync.
pub(crate) const FLUSH_BYTES: usize = 64 << 20;

/// The flusher: syncs the store's filesystem whenever an object worker
/// asks (every [`FLUSH_BYTES`] it staged), so that the disk writes the
/// objects while the CPUs make the next ones, and the sync before
/// publishing finds little left to write. Without it the kernel would
/// start writing only once a tenth or so of the machine's memory is
/// dirty: for most layers, never before that last sync. Errors are left
/// to that sync, which reports them.
pub(crate) fn flusher(publisher: &Publisher<'_>, asks: Receiver<()>) {
    while asks.recv().is_ok() {
        let _ = publisher.sync();
    }
}

/// The parse stage's side of the object workers: fills batches and hands
/// each, when full, to a worker whose queue has room (a big file's later
/// batches to the worker that has its beginning); collects the results.
pub(crate) struct Objects {
    workers: Vec<SyncSender<Batch>>,
    done: Receiver<Vec<Done>>,
    free: Receiver<Batch>,
    /// The batch being filled.
    cur: Batch,
    /// The worker the last batch went to: the next one sent goes to the
    /// next worker with room, or here if it continues an object.
    last_worker: usize,
    next_seq: u64,
    /// Objects reported and not yet claimed, by number.
    ready: HashMap<u64, Result<StagedObject, StoreError>>,
}

/// The queues between the parse stage and `n` object workers: the
/// workers' ends (jobs, results, returned batches) and the parse stage's.
pub(crate) type WorkerEnds = (Receiver<Batch>, mpsc::Sender<Vec<Done>>, SyncSender<Batch>);

impl Objects {
    /// The parse stage's end and each worker's.
    pub(crate) fn new(n: usize) -> (Objects, Vec<WorkerEnds>) {
        let (done_tx, done_rx) = mpsc::channel();
        let (free_tx, free_rx) = mpsc::sync_channel(n * (WORKER_QUEUE + 1));
        let mut workers = Vec::with_capacity(n);
        let mut ends = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = mpsc::sync_channel(WORKER_QUEUE);
            workers.push(tx);
            ends.push((rx, done_tx.clone(), free_tx.clone()));
        }
        let objects = Objects {
            workers,
            done: done_rx,
            free: free_rx,
            cur: Batch::default(),
            last_worker: n - 1,
            next_seq: 0,
            ready: HashMap::new(),
        };
        (objects, ends)
    }

    /// Starts a new object of `size` bytes (data and holes); its number.
    /// An object that fits in a batch is not split between two.
    pub(crate) fn begin(&mut self, size: u64) -> Result<u64, WorkerGone> {
        if self.cur.is_full() || (self.cur.bytes() as u64).saturating_add(size) > BATCH_BYTES as u64
        {
            self.send()?;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.cur.ops.push(Op::Begin(seq));
        Ok(seq)
    }

    /// Room in the batch for up to `want` more bytes of the object begun
    /// last (handing a full batch on first); [`filled`](Self::filled)
    /// says how much of it was used.
    pub(crate) fn room(&mut self, want: usize) -> Result<&mut [u8], WorkerGone> {
        if self.cur.bytes() >= BATCH_BYTES {
            self.send()?;
        }
        if self.cur.data.len() < BATCH_BYTES {
            self.cur.data.resize(BATCH_BYTES, 0);
        }
        let end = self.cur.len + want.min(BATCH_BYTES - self.cur.bytes());
        Ok(&mut self.cur.data[self.cur.len..end])
    }

    /// Whether a piece of `n` bytes is lent rather than copied: from
    /// [`LEND_MIN`] on. Smaller pieces (most files are small) are copied,
    /// as a lent piece holds its whole chunk until the worker has written
    /// it.
    pub(crate) fn takes_lent(&self, n: usize) -> bool {
        n >= LEND_MIN
    }

    /// The object begun last continues with `piece` (handing a full batch
    /// on first).
    pub(crate) fn lent(&mut self, piece: crate::tar::Lent) -> Result<(), WorkerGone> {
        let mut new_chunk = self
            .cur
            .lent
            .last()
            .is_none_or(|l| !Arc::ptr_eq(&l.buf, &piece.buf));
        if self.cur.bytes() >= BATCH_BYTES || (new_chunk && self.cur.chunks >= BATCH_CHUNKS) {
            self.send()?;
            // A fresh batch: the piece's chunk is its first.
            new_chunk = true;
        }
        if new_chunk {
            self.cur.chunks += 1;
        }
        self.cur.lent_len += piece.len;
        self.cur.lent.push(piece);
        self.cur.ops.push(Op::Lent);
        Ok(())
    }

    /// The first `n` bytes of the last [`room`](Self::room) are the
    /// object's next data.
    pub(crate) fn filled(&mut self, n: usize) {
        self.cur.len += n;
        match self.cur.ops.last_mut() {
            Some(Op::Data(k)) => *k += n,
            _ => self.cur.ops.push(Op::Data(n)),
        }
    }

    /// Appends a hole to the object begun last.
    pub(crate) fn hole(&mut self, n: u64) {
        self.cur.ops.push(Op::Hole(n));
    }

    /// Ends the object begun last.
    pub(crate) fn end(&mut self) {
        self.cur.ops.push(Op::End);
        self.cur.files += 1;
    }

    /// Hands the current batch to a worker (blocking while the one it
    /// must go to, or every one, has a full queue).
    fn send(&mut self) -> Result<(), WorkerGone> {
        if self.cur.ops.is_empty() {
            return Ok(());
        }
        let fresh = self.free.try_recv().unwrap_or_default();
        let mut batch = std::mem::replace(&mut self.cur, fresh);
        let n = self.workers.len();
        if !batch.continues() {
            for i in 1..=n {
                let w = (self.last_worker + i) % n;
                match self.workers[w].try_send(batch) {
                    Ok(()) => {
                        self.last_worker = w;
                        return Ok(());
                    }
                    Err(mpsc::TrySendError::Full(b)) => batch = b,
                    Err(mpsc::TrySendError::Disconnected(_)) => return Err(WorkerGone),
                }
            }
            // Every queue is full: wait for the next worker in turn.
            self.last_worker = (self.last_worker + 1) % n;
        }
        self.workers[self.last_worker]
            .send(batch)
            .map_err(|_| WorkerGone)
    }

    /// The object numbered `seq`, waiting for it if `wait` (after handing
    /// out the batch being filled, which may hold it).
    pub(crate) fn take(
        &mut self,
        seq: u64,
        wait: bool,
    ) -> Result<Option<Result<StagedObject, StoreError>>, WorkerGone> {
        while let Ok(d) = self.done.try_recv() {
            self.ready.extend(d);
        }
        if wait {
            self.send()?;
        }
        loop {
            if let Some(r) = self.ready.remove(&seq) {
                return Ok(Some(r));
            }
            if !wait {
                return Ok(None);
            }
            match self.done.recv() {
                Ok(d) => self.ready.extend(d),
                Err(_) => return Err(WorkerGone),
            }
        }
    }
}

/// An object worker stopped before its queue was closed.
#[derive(Debug)]
pub(crate) struct WorkerGone;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tar::Lent;

    fn piece(fill: u8, len: usize) -> Lent {
        Lent {
            buf: Arc::new(vec![fill; len]),
            start: 0,
            len,
        }
    }

    #[test]
    fn a_batch_holds_lent_pieces_of_at_most_batch_chunks_chunks() {
        let (mut objects, mut ends) = Objects::new(1);
        let (jobs, _done, _free) = ends.pop().unwrap();
        objects.begin(4 * 20_000).unwrap();
        for i in 0..4 {
            objects.lent(piece(i, 20_000)).unwrap();
        }
        let first = jobs.try_recv().expect("the fourth chunk sent the batch on");
        assert_eq!(first.chunks, BATCH_CHUNKS);
        assert_eq!(first.lent.len(), BATCH_CHUNKS);
        assert_eq!(first.lent_len, 3 * 20_000);
        assert!(jobs.try_recv().is_err(), "one batch only so far");
        // Two pieces of one chunk count once.
        let shared = piece(9, 40_000);
        let (a, b) = (
            Lent {
                len: 20_000,
                ..shared.clone()
            },
            Lent {
                start: 20_000,
                len: 20_000,
                ..shared
            },
        );
        objects.lent(a).unwrap();
        objects.lent(b).unwrap();
        assert_eq!(objects.cur.chunks, 2);
        assert_eq!(objects.cur.lent_len, 60_000);
        // A full batch goes on even when the next piece is of a chunk it
        // has: that chunk is the new batch's first.
        objects.cur.len = BATCH_BYTES - objects.cur.lent_len;
        let last = objects.cur.lent.last().unwrap().clone();
        objects.lent(Lent { len: 1, ..last }).unwrap();
        assert!(jobs.try_recv().is_ok(), "the full batch went on");
        assert_eq!(objects.cur.chunks, 1);
    }

    #[test]
    fn a_chunk_goes_back_for_reuse_once_its_last_holder_is_done() {
        let (free_tx, free_rx) = mpsc::sync_channel(2);
        let chunk = Arc::new(vec![0u8; CHUNK]);
        let lent = Arc::clone(&chunk);
        recycle(chunk, &free_tx);
        assert!(free_rx.try_recv().is_err(), "still lent");
        recycle(lent, &free_tx);
        assert_eq!(free_rx.try_recv().unwrap().capacity(), CHUNK);
    }
}
