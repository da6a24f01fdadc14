//! The threads of a layer import, so that one layer keeps every core busy.
//!
//! ```text
//!  blob ──► [decompress]  read, blob digest, inflate, limits, diff_id
//!                │  chunks of 256 KiB (bounded queue, buffers recycled)
//!                ▼
//!           [parse]       tar headers, layer record lines, inline files  (the caller's thread)
//!                │  file contents, one worker each file (bounded queues)
//!                ▼
//!           [objects] ×N  fs-verity digest, staged object file
//! ```
//!
//! Every queue is bounded, so memory is too: at most [`CHUNK_QUEUE`] chunks
//! between decompression and parsing and [`WORKER_QUEUE`] chunks waiting
//! for each object worker, whatever the layer. The record lines keep the
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
//! they would in any case.

use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;

use cairn_store::{StagedObject, Store, StoreError};

use crate::decompress::{open_blob, Compression, Meter, OpenError};

/// Bytes handed from decompression to parsing at a time.
pub(crate) const CHUNK: usize = 256 * 1024;
/// Chunks that may wait between decompression and parsing (4 MiB).
pub(crate) const CHUNK_QUEUE: usize = 16;
/// Messages that may wait for one object worker (at most 2 MiB of data).
pub(crate) const WORKER_QUEUE: usize = 8;
/// Most object workers.
pub(crate) const MAX_WORKERS: usize = 8;

/// How many threads an import may use: the CPUs this process may run on.
pub(crate) fn parallelism() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// What the decompression stage counted and hashed, once it ended.
#[derive(Debug, Clone)]
pub(crate) struct Totals {
    pub blob_digest: String,
    pub diff_id: String,
    pub compressed: u64,
    pub uncompressed: u64,
}

impl Totals {
    pub(crate) fn of(meter: &Meter) -> Totals {
        Totals {
            blob_digest: meter.blob_digest(),
            diff_id: meter.diff_id(),
            compressed: meter.compressed.get(),
            uncompressed: meter.uncompressed.get(),
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
    cur: Vec<u8>,
    pos: usize,
    /// How the stream failed, given again to every later read (as a
    /// decompressor would).
    failed: Option<Arc<io::Error>>,
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
        if let Some(e) = &self.failed {
            return Err(StreamError(Arc::clone(e)).to_io());
        }
        while self.pos == self.cur.len() {
            match self.rx.recv() {
                Ok(Chunk::Data(d)) => {
                    let old = std::mem::replace(&mut self.cur, d);
                    self.pos = 0;
                    if old.capacity() == CHUNK {
                        let _ = self.free.try_send(old);
                    }
                }
                Ok(Chunk::Failed(e)) => {
                    let e = Arc::new(e);
                    self.failed = Some(Arc::clone(&e));
                    return Err(StreamError(e).to_io());
                }
                // The sender is gone: the stream ended.
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
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
/// into `tx` until they end, fail, or nobody listens any more.
pub(crate) fn decompress(
    blob: impl Read,
    declared: Option<Compression>,
    max_bytes: u64,
    max_ratio: u64,
    opened: SyncSender<Result<Compression, OpenError>>,
    tx: SyncSender<Chunk>,
    free: Receiver<Vec<u8>>,
) -> Option<Totals> {
    let (mut stream, compression, meter) = match open_blob(blob, declared, max_bytes, max_ratio) {
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
    Some(Totals::of(&meter))
}

/// The queues between the parse stage and a decompression thread.
pub(crate) struct StreamQueues {
    pub opened_tx: SyncSender<Result<Compression, OpenError>>,
    pub opened_rx: Receiver<Result<Compression, OpenError>>,
    pub tx: SyncSender<Chunk>,
    pub free_rx: Receiver<Vec<u8>>,
    pub reader: ChunkReader,
}

pub(crate) fn stream_queues() -> StreamQueues {
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
            cur: Vec::new(),
            pos: 0,
            failed: None,
        },
    }
}

/// One message to an object worker.
pub(crate) enum Job {
    /// A new object starts; its number in the layer.
    Begin(u64),
    Data(Vec<u8>),
    Hole(u64),
    /// The object is complete.
    End,
}

/// A worker's answer: the object's number and what became of it.
pub(crate) type Done = (u64, Result<StagedObject, StoreError>);

/// The object worker: stages each object it is sent, hashing it, and
/// reports it.
pub(crate) fn object_worker(store: &Store, jobs: Receiver<Job>, done: mpsc::Sender<Done>) {
    let mut current: Option<(u64, Result<cairn_store::ObjectStager, StoreError>)> = None;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Begin(seq) => current = Some((seq, store.stage_object())),
            Job::Data(d) => {
                if let Some((_, Ok(s))) = &mut current {
                    if let Err(e) = s.write(&d) {
                        let seq = current.take().map(|(n, _)| n).unwrap_or_default();
                        current = Some((seq, Err(e)));
                    }
                }
            }
            Job::Hole(n) => {
                if let Some((_, Ok(s))) = &mut current {
                    if let Err(e) = s.hole(n) {
                        let seq = current.take().map(|(n, _)| n).unwrap_or_default();
                        current = Some((seq, Err(e)));
                    }
                }
            }
            Job::End => {
                if let Some((seq, stager)) = current.take() {
                    let staged = stager.and_then(|s| s.finish(store));
                    if done.send((seq, staged)).is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// The parse stage's side of the object workers.
pub(crate) struct Objects {
    workers: Vec<SyncSender<Job>>,
    done: Receiver<Done>,
    next_worker: usize,
    next_seq: u64,
    /// Objects reported and not yet claimed, by number.
    ready: HashMap<u64, Result<StagedObject, StoreError>>,
}

impl Objects {
    pub(crate) fn new(workers: Vec<SyncSender<Job>>, done: Receiver<Done>) -> Objects {
        Objects {
            workers,
            done,
            next_worker: 0,
            next_seq: 0,
            ready: HashMap::new(),
        }
    }

    /// Starts a new object on the next worker; its number.
    pub(crate) fn begin(&mut self) -> (u64, &SyncSender<Job>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let w = self.next_worker;
        self.next_worker = (w + 1) % self.workers.len();
        (seq, &self.workers[w])
    }

    /// The object numbered `seq`, waiting for it if `wait`.
    pub(crate) fn take(&mut self, seq: u64, wait: bool) -> Option<Result<StagedObject, StoreError>> {
        while let Ok(d) = self.done.try_recv() {
            self.ready.insert(d.0, d.1);
        }
        loop {
            if let Some(r) = self.ready.remove(&seq) {
                return Some(r);
            }
            if !wait {
                return None;
            }
            match self.done.recv() {
                Ok(d) => {
                    self.ready.insert(d.0, d.1);
                }
                Err(_) => return None,
            }
        }
    }
}
