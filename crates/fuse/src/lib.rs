//! The lazy data layer: a FUSE filesystem, served by cairn itself, that
//! stands where the store's `objects/` directory stands in the overlay
//! stack (its data-only lower layer) and answers lookups of `ab/cdef…` by
//! object id.
//!
//! - An object in the store is opened with **FUSE passthrough**: the open
//!   reply names a *backing id* registered for the store's file, and from
//!   then on the kernel reads that file itself; reads never reach this
//!   server.
//! - An object missing from the store is fetched from an [`ObjectSource`],
//!   its fs-verity digest checked while it is staged, published into the
//!   store by the store's own staging and rename, and then passed through.
//!   Bytes that do not hash to the object's name are never served and
//!   never stored: the open fails with `EIO` and a log line names the
//!   object.
//!
//! The wire protocol is ours ([`proto`], from the kernel's uapi header);
//! no FUSE library is used, because none speaks passthrough. The design,
//! its invariants and its limits are in `docs/lazy-fuse.md`.
//!
//! Entry points: [`serve`] mounts and serves; [`FuseMount::unmount`] ends
//! it; [`FuseMount::hand_over`] and [`take_over`] move a live connection
//! to a successor process over a unix socket; [`serve_on`] with
//! [`ServeOptions::resumable`] keeps a journal from which [`resume`] goes
//! on serving a connection whose server was killed (another process kept
//! its descriptor).
//!
//! Modules: `proto` parses requests and builds replies (pure), `dev` holds
//! the system calls on `/dev/fuse` (and the crate's only `unsafe`, the two
//! passthrough ioctls), `server` the tree, the node and handle tables and
//! the dispatch, `fetch` the fetches of missing objects, `handover` the
//! hand-over format, `journal` the state that outlives a killed server
//! (fixed size: 64 + 512 × 256 + 8 × objects bytes, in a memfd).
//!
//! # Memory bound
//!
//! With `w` = [`ServeOptions::workers`], `f` = [`ServeOptions::max_fetches`]
//! and `n` = [`ServeOptions::max_nodes`], the server holds:
//!
//! - `w × (REQUEST_BUFFER + 2 × 128 KiB)` of buffers: a request buffer per
//!   worker, and for a READ the bytes read and the reply carrying them
//!   (`server::MAX_READ` each);
//! - at most `n` object nodes, each an entry in two hash tables (72 and 40
//!   bytes and a control byte), at most 7/8 full and doubled as they grow,
//!   the old table alive while the new one fills: at most 400 bytes a
//!   node, 400 MiB at the default `n` = 2^20. With a journal
//!   ([`ServeOptions::resumable`]) the objects served are a fixed list, so
//!   the nodes are also at most its length, and the list costs 32 bytes an
//!   object (the journal itself is a memory file, never mapped);
//! - a handle per open file, and per open waiting for a fetch a flight
//!   (one per object being fetched) and a boxed waiter: under 0.5 KiB
//!   each, as many as the kernel sends;
//! - at most `f` fetch threads: the server's part of a fetch is a staged
//!   file on disk and the stager's hasher (a 4 KiB block per level of the
//!   Merkle tree); what the source holds while it fetches comes on top
//!   (cairn's: one range request's buffer, at most `max(coalesce, 4 MiB)`,
//!   one decompressed frame of at most 1 MiB, one zstd context of about
//!   96 KiB kept per thread by `cairn_remote`'s `unzstd_exact`);
//! - large missing objects read chunk by chunk (`partial`): at most
//!   8 staging files (on disk) and 8 threads, each holding one chunk as the
//!   source returns it (at most 16 MiB; cairn's: its frame, at most 2 MiB
//!   and 4 KiB, and the 1 MiB it decompresses to) while it is fetched and
//!   checked, a 1 MiB copy buffer while publishing, the READ replies it
//!   sends, and 25 bytes of state per chunk of its object; one more timer
//!   thread.
//!
//! Nothing here grows with an object's size but the partials' per-chunk
//! state. What `cairn` adds (the image's parse and index, the background
//! walk's lists) and the resulting bound on a lazy server's resident
//! memory are in `docs/lazy-fuse.md` ("The memory bound, measured").

#![deny(unsafe_code)]

mod dev;
mod fetch;
pub use fetch::BACKGROUND_NICE;
mod handover;
mod journal;
mod partial;
pub mod proto;
mod server;

pub use journal::Resumable;

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cairn_store::{ObjectId, StagedObject, Store};
use rustix::io::Errno;

use crate::fetch::Fetcher;
use crate::proto::{init_flags, InitOut, Op, Reply, Request};
use crate::server::{Flow, Server};

/// The size of each worker's request buffer. The kernel wants at least
/// 8 KiB (`FUSE_MIN_READ_BUFFER`) and room for a WRITE of `max_write`
/// (4 KiB, the minimum, which we announce: the filesystem is read-only).
pub const REQUEST_BUFFER: usize = 64 * 1024;

/// Where missing objects come from (a registry, in `cairn mount --lazy`).
pub trait ObjectSource: Send + Sync {
    /// The size of the object, or `None` if this source does not have it
    /// (the lookup then fails with `ENOENT`). Called on LOOKUP of an
    /// object missing from the store, so it should be cheap (an index).
    fn size(&self, id: &ObjectId) -> Option<u64>;

    /// Writes the object's contents, from the start, into `out`. The
    /// server checks the bytes; a source need not. A write into `out`
    /// fails once the fetch has been abandoned (its deadline passed) or
    /// once more than [`size`](Self::size) bytes were written; the source
    /// should then stop.
    fn fetch(&self, id: &ObjectId, out: &mut dyn io::Write) -> Result<(), FetchError>;

    /// The objects to fetch together with `id` when it is missing (its
    /// read amplification): `id` first, then neighbours that are likely
    /// read soon and not in `store` yet. The server may shorten the list
    /// (it drops a neighbour that another fetch is bringing, and all after
    /// it) and fetches it with [`stage_group`](Self::stage_group).
    /// Default: `id` alone. Called on a fetch thread, under the store lock
    /// (shared); no network.
    fn group(&self, _store: &Store, id: &ObjectId) -> Vec<ObjectId> {
        vec![*id]
    }

    /// Fetches `group` (a prefix of what [`group`](Self::group) gave: two
    /// objects or more, or one for which [`chunks`](Self::chunks) is
    /// `None`) and stages each object with the store's staging
    /// ([`Store::stage_object`], which names a file by the digest of its
    /// bytes, so nothing can be served or stored under a name it does not
    /// hash to), in `group`'s order, handing each to `staged` as soon as
    /// it is staged (a source that streams hands over the first object
    /// before the rest has arrived); it publishes nothing. The server
    /// answers the opens waiting for each object from its staged file as
    /// it is handed over, then publishes what it got
    /// ([`Store::publish_staged`]), also when the source failed on a later
    /// object. The server holds the store lock shared. `None` (the
    /// default): not supported; the server fetches `group[0]` alone with
    /// [`fetch`](Self::fetch), and hashes what it writes to check it.
    fn stage_group(
        &self,
        _store: &Store,
        _group: &[ObjectId],
        _staged: &mut dyn FnMut(StagedObject),
    ) -> Option<Result<(), FetchError>> {
        None
    }

    /// Where the pieces of `id` start, if the source can fetch it piece
    /// by piece and check each piece on its own (a chunked object of
    /// cairn's index, each chunk with its sha256; an eStargz file, each
    /// chunk with its TOC `chunkDigest`): offsets strictly increasing from
    /// 0, each below the object's size; piece `k` ends where `k + 1`
    /// starts (the last at the size). The server then answers reads of a
    /// missing object as soon as the pieces they need are in
    /// ([`fetch_chunk`](Self::fetch_chunk)), instead of waiting for the
    /// whole. `None` (the default), or a single piece: whole objects only.
    /// Called on OPEN, so it must be cheap (an index).
    fn chunks(&self, _id: &ObjectId) -> Option<Vec<u64>> {
        None
    }

    /// Piece `k` of `id` (as [`chunks`](Self::chunks) cuts it), checked
    /// by the source against the digest it has for that piece before it
    /// returns: the server serves these bytes to readers before the whole
    /// object can be checked, so an unchecked piece must never be
    /// returned. Wrong bytes are an error naming the object and where its
    /// bytes came from. The server checks the length and, once every piece
    /// is in, the whole object's fs-verity digest before it stores it.
    fn fetch_chunk(&self, id: &ObjectId, _k: usize) -> Result<Vec<u8>, FetchError> {
        Err(FetchError::NotFound(*id))
    }

    /// Whether this source names objects by something other than their
    /// fs-verity digest (an eStargz file is named by the sha256 of its
    /// contents, the only digest its TOC gives). Then the server hashes
    /// what it fetched with sha256 as well, hands both digests to
    /// [`accept`](Self::accept), and publishes the file under its
    /// fs-verity digest (as every store object) only if the source
    /// accepts; [`local_id`](Self::local_id) says where an id is stored.
    /// Default: `false` (names are the store's).
    fn foreign_names(&self) -> bool {
        false
    }

    /// The store's name of `id`, once known (foreign names only; the
    /// default is `id` itself). Must be cheap: called on every open.
    fn local_id(&self, id: &ObjectId) -> Option<ObjectId> {
        Some(*id)
    }

    /// Foreign names only: the whole object `id` was fetched, its bytes
    /// hash to `sha256` and their fs-verity digest is `stored`. The source
    /// checks `sha256` against `id` and, if it matches, remembers that
    /// `id` is stored as `stored` (durably, if a successor server must
    /// know it) before it returns `Ok`; an `Err` (the reason) means
    /// nothing is stored.
    fn accept(&self, id: &ObjectId, _sha256: &[u8; 32], _stored: &ObjectId) -> Result<(), String> {
        Err(format!(
            "object {id}: this source names objects by their fs-verity digest"
        ))
    }
}

/// Whether the store has object `id` of `source` (under its own name or,
/// for a source with foreign names, under the name the source gives it).
pub(crate) fn has_local(store: &Store, source: &dyn ObjectSource, id: &ObjectId) -> bool {
    source.local_id(id).is_some_and(|l| store.has_object(&l))
}

/// Where the store keeps object `id` of `source` (its own name when the
/// source knows no other: a missing file).
pub(crate) fn local_path(
    store: &Store,
    source: &dyn ObjectSource,
    id: &ObjectId,
) -> std::path::PathBuf {
    store.object_path(&source.local_id(id).unwrap_or(*id))
}

/// A source with nothing: every object must be in the store.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoSource;

impl ObjectSource for NoSource {
    fn size(&self, _: &ObjectId) -> Option<u64> {
        None
    }

    fn fetch(&self, id: &ObjectId, _: &mut dyn io::Write) -> Result<(), FetchError> {
        Err(FetchError::NotFound(*id))
    }
}

/// Why a source could not deliver an object.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the source does not have object {0}")]
    NotFound(ObjectId),
    #[error("{0}")]
    Io(io::Error),
    #[error("{0}")]
    Other(String),
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Threads reading requests from `/dev/fuse`.
    pub workers: usize,
    /// How long an open waits for a missing object before it fails with
    /// `EIO` (a later open tries again).
    pub fetch_timeout: Duration,
    /// Fetches running at once (threads; each holds no buffer of the
    /// server's, only what the source holds while it fetches).
    pub max_fetches: usize,
    /// Of those, at most this many for background fetches
    /// ([`FuseMount::background`]); the rest stay free for opens.
    pub max_background_fetches: usize,
    /// Objects the kernel may hold at once (inodes it looked up and has not
    /// forgotten); a lookup past it fails with `ENFILE`. Each costs at most
    /// 400 bytes (the crate's "Memory bound").
    pub max_nodes: usize,
    /// The mount's source, as mountinfo shows it (name the image served).
    pub source_name: String,
    /// Record the objects opened, in first-open order
    /// ([`FuseMount::open_log`]); at most `max_nodes` of them.
    pub record_opens: bool,
    /// With `record_opens`: objects larger than this many bytes are
    /// recorded chunk by chunk (which pieces of this size were read) and,
    /// so that their reads reach the server, served by READ rather than
    /// passed through while recording. 0: objects only.
    pub record_chunk_size: u64,
    /// Use passthrough where the kernel offers it (the point of this
    /// crate). Off, every read is a READ served by cairn: for kernels or
    /// stores where passthrough misbehaves, and for tests of that path.
    pub passthrough: bool,
    /// Serve exactly these objects, with node ids derived from their
    /// place in the list, and keep in its journal what a successor needs
    /// to go on serving after this server is killed ([`resume`]).
    pub resumable: Option<Resumable>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            workers: 4,
            fetch_timeout: Duration::from_secs(60),
            max_fetches: 16,
            max_background_fetches: 2,
            max_nodes: 1 << 20,
            source_name: "cairn".into(),
            record_opens: false,
            record_chunk_size: 0,
            passthrough: true,
            resumable: None,
        }
    }
}

/// Why serving could not start.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("opening /dev/fuse: {0}")]
    OpenDevice(io::Error),
    #[error("mounting the FUSE data layer at {}: {error}", target.display())]
    Mount { target: PathBuf, error: io::Error },
    #[error("FUSE handshake at {}: {reason}", target.display())]
    Init { target: PathBuf, reason: String },
    #[error("unmounting the FUSE data layer at {}: {error}", target.display())]
    Unmount { target: PathBuf, error: io::Error },
    #[error("starting the FUSE workers: {0}")]
    Spawn(io::Error),
    #[error("handing over the FUSE data layer at {}: {reason}", target.display())]
    HandOver { target: PathBuf, reason: String },
}

/// A snapshot of the server's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Whether the kernel agreed to passthrough at INIT.
    pub passthrough: bool,
    /// READ requests served (zero when everything is passed through).
    pub reads: u64,
    pub passthrough_opens: u64,
    /// Opens served by READ instead (passthrough unavailable).
    pub plain_opens: u64,
    pub backing_opened: u64,
    pub backing_closed: u64,
    /// Backing ids registered now.
    pub live_backing_ids: u64,
    pub fetches_started: u64,
    pub fetches_published: u64,
    pub fetches_failed: u64,
    pub fetches_timed_out: u64,
    /// Background fetches started ([`FuseMount::background`]).
    pub fetches_background: u64,
    /// Objects published as neighbours of the object a fetch was for.
    pub neighbours_published: u64,
    pub bad_messages: u64,
    /// Opens of a missing object served chunk by chunk (READs answered by
    /// cairn from a staging file) while it is fetched.
    pub chunked_opens: u64,
    /// Chunks fetched and checked for such opens.
    pub chunks_fetched: u64,
    /// Chunk fetches that failed (wrong bytes, the source failed).
    pub chunks_failed: u64,
    /// Objects fetched chunk by chunk, verified whole and published.
    pub chunked_published: u64,
    /// Opens answered from a fetched object's checked staged file, before
    /// its publication (the syncs that make its name durable) was done.
    pub staged_opens: u64,
}

/// Fetches objects into the store through a served layer's fetcher, behind
/// every open: a background flight waits while opens' flights queue, runs
/// in at most [`ServeOptions::max_background_fetches`] slots, and is
/// joined (and moved to the front) by an open of its object.
#[derive(Clone)]
pub struct Background {
    fetcher: Arc<Fetcher>,
    server: std::sync::Weak<Server>,
}

impl std::fmt::Debug for Background {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Background").finish()
    }
}

impl Background {
    /// Fetches chunks `chunks` (indices of the source's pieces) of the
    /// missing object `id` into a partial that later opens of the object
    /// read from, pinned while the layer is served; without `read_behind`
    /// the rest of the object is fetched only when read. Returns at once;
    /// false when nothing was started (the object is local or being
    /// fetched, has no chunks, or too many partials are pinned): the
    /// caller may fetch it whole instead.
    pub fn prefetch_chunks(&self, id: &ObjectId, chunks: &[u32], read_behind: bool) -> bool {
        self.server
            .upgrade()
            .is_some_and(|s| s.prefetch_chunks(id, chunks, read_behind))
    }

    /// Fetches `id` (with its neighbours, as an open would) and waits until
    /// it is in the store, or fails (the source does not have it, the
    /// fetch failed or passed its deadline, the layer is going away).
    pub fn fetch(&self, id: &ObjectId) -> Result<(), String> {
        let size = self
            .fetcher
            .source()
            .size(id)
            .ok_or_else(|| format!("the source does not have object {id}"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        self.fetcher.background(
            id,
            size,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv()
            .unwrap_or_else(|_| Err(format!("fetching object {id}: the fetch went away")))?;
        // An open of it may have been answered from its staged file before
        // the publication: wait for that.
        if self.fetcher.wait_stored(id, self.fetcher.timeout()) {
            Ok(())
        } else {
            Err(format!("fetching object {id}: it was not published"))
        }
    }

    /// Starts fetching `id` as [`fetch`](Self::fetch) does, without
    /// waiting for it: a later `fetch` or open of it joins that flight.
    /// False if the source does not have the object.
    pub fn start(&self, id: &ObjectId) -> bool {
        let Some(size) = self.fetcher.source().size(id) else {
            return false;
        };
        self.fetcher.background(id, size, Box::new(|_| {}));
        true
    }

    /// Whether the layer is going away (unmounted): fetch no more.
    pub fn stopped(&self) -> bool {
        self.fetcher.stopped()
    }
}

/// The objects a layer's opens asked for ([`FuseMount::open_log`]).
#[derive(Clone)]
pub struct OpenLog {
    server: Arc<Server>,
}

impl std::fmt::Debug for OpenLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenLog").finish()
    }
}

impl OpenLog {
    /// Each object opened, once, in the order of its first open.
    pub fn objects(&self) -> Vec<ObjectId> {
        self.server
            .open_log
            .lock()
            .expect("open log lock")
            .as_ref()
            .map(|l| l.order.clone())
            .unwrap_or_default()
    }

    /// Each object opened, once, in the order of its first open, with the
    /// chunks of it that were read (indices of pieces of
    /// [`ServeOptions::record_chunk_size`] bytes, increasing) for an object
    /// larger than that which was not read whole; None: the whole object.
    pub fn entries(&self) -> Vec<(ObjectId, Option<Vec<u32>>)> {
        let log = self.server.open_log.lock().expect("open log lock");
        let Some(l) = log.as_ref() else {
            return Vec::new();
        };
        l.order
            .iter()
            .map(|id| {
                let chunks = l.chunks.get(id).and_then(|read| {
                    let got: Vec<u32> = (0..read.len() as u32)
                        .filter(|&k| read[k as usize])
                        .collect();
                    (got.len() < read.len()).then_some(got)
                });
                (*id, chunks)
            })
            .collect()
    }
}

/// A mounted, served FUSE data layer. [`unmount`](Self::unmount) it; if it
/// is dropped instead, it is detached lazily and its workers serve until
/// the last user (an overlay stacked on it) is gone.
pub struct FuseMount {
    target: PathBuf,
    server: Arc<Server>,
    workers: Workers,
    mounted: bool,
}

/// The worker threads and the write end of the pipe that stops them
/// (closing it wakes every worker's `poll`).
struct Workers {
    stop: Option<OwnedFd>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    fn start(server: &Arc<Server>, n: usize) -> Result<Workers, FuseError> {
        let (stop_r, stop_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| FuseError::Spawn(e.into()))?;
        let stop_r = Arc::new(stop_r);
        let mut w = Workers {
            stop: Some(stop_w),
            threads: Vec::new(),
        };
        for i in 0..n.max(1) {
            let (s, r) = (server.clone(), stop_r.clone());
            let t = std::thread::Builder::new()
                .name(format!("cairn-fuse-{i}"))
                .spawn(move || worker(&s, &r))
                .map_err(FuseError::Spawn)?;
            w.threads.push(t);
        }
        Ok(w)
    }

    /// Stops the workers (each finishes the request in hand) and waits.
    fn stop(&mut self) {
        self.stop = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Waits for workers that stop by themselves (the connection ended).
    fn join(&mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.stop = None;
    }
}

impl std::fmt::Debug for FuseMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseMount")
            .field("target", &self.target)
            .field("mounted", &self.mounted)
            .finish()
    }
}

impl FuseMount {
    /// The mountpoint: pass it as `MountOptions::objects`.
    pub fn path(&self) -> &Path {
        &self.target
    }

    pub fn stats(&self) -> Stats {
        let c = &self.server.counters;
        let f = &self.server.fetcher.counters;
        Stats {
            passthrough: self.server.passthrough.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            passthrough_opens: c.passthrough_opens.load(Ordering::Relaxed),
            plain_opens: c.plain_opens.load(Ordering::Relaxed),
            backing_opened: c.backing_opened.load(Ordering::Relaxed),
            backing_closed: c.backing_closed.load(Ordering::Relaxed),
            live_backing_ids: self.server.live_backing_ids() as u64,
            fetches_started: f.started.load(Ordering::Relaxed),
            fetches_published: f.published.load(Ordering::Relaxed),
            fetches_failed: f.failed.load(Ordering::Relaxed),
            fetches_timed_out: f.timed_out.load(Ordering::Relaxed),
            fetches_background: f.background.load(Ordering::Relaxed),
            neighbours_published: f.neighbours.load(Ordering::Relaxed),
            bad_messages: c.bad_messages.load(Ordering::Relaxed),
            chunked_opens: c.chunked_opens.load(Ordering::Relaxed),
            chunks_fetched: f.chunks_fetched.load(Ordering::Relaxed),
            chunks_failed: f.chunks_failed.load(Ordering::Relaxed),
            chunked_published: f.chunked_published.load(Ordering::Relaxed),
            staged_opens: f.staged_opens.load(Ordering::Relaxed),
        }
    }

    /// Waits (at most `limit`) until every object whose opens were
    /// answered from its checked staged file is published (or its
    /// publication failed). Whether that happened within `limit`.
    pub fn settle(&self, limit: Duration) -> bool {
        self.server.fetcher.wait_published(limit)
    }

    /// A handle on the objects opened so far, in first-open order (empty
    /// unless [`ServeOptions::record_opens`]); it outlives the mount.
    pub fn open_log(&self) -> OpenLog {
        OpenLog {
            server: self.server.clone(),
        }
    }

    /// A handle that fetches objects in the background, for as long as
    /// the layer is served.
    pub fn background(&self) -> Background {
        Background {
            fetcher: self.server.fetcher.clone(),
            server: Arc::downgrade(&self.server),
        }
    }

    /// Unmounts (not lazily: `EBUSY` while an overlay still uses it, and
    /// then nothing changes) and waits for the workers, which stop when the
    /// kernel ends the connection. Returns the final counters.
    pub fn unmount(&mut self) -> Result<Stats, FuseError> {
        if self.mounted {
            dev::unmount(&self.target, false).map_err(|error| FuseError::Unmount {
                target: self.target.clone(),
                error,
            })?;
            self.mounted = false;
        }
        self.workers.join();
        // Large files a reader started, and files whose opens were
        // answered before their publication, are stored before we return.
        let f = &self.server.fetcher;
        f.wait_partials(f.timeout());
        f.wait_published(f.timeout());
        Ok(self.stats())
    }

    /// Detaches the mount (lazily, as [`detach_and_serve`](Self::detach_and_serve)
    /// does) and goes on serving.
    pub fn detach(&mut self) -> Result<(), FuseError> {
        if self.mounted {
            dev::unmount(&self.target, true).map_err(|error| FuseError::Unmount {
                target: self.target.clone(),
                error,
            })?;
            self.mounted = false;
        }
        Ok(())
    }

    /// Detaches the mount (lazily: it stays usable by what is stacked on
    /// it, an overlay, but is gone from the mount table and its directory
    /// may be removed) and serves until the kernel ends the connection,
    /// which it does when the last user is unmounted. Returns the final
    /// counters. For a server whose only job is one overlay's data layer.
    pub fn detach_and_serve(mut self) -> Result<Stats, FuseError> {
        if self.mounted {
            dev::unmount(&self.target, true).map_err(|error| FuseError::Unmount {
                target: self.target.clone(),
                error,
            })?;
            self.mounted = false;
        }
        self.workers.join();
        // Large files a reader started, and files whose opens were
        // answered before their publication, are stored before we return.
        let f = &self.server.fetcher;
        f.wait_partials(f.timeout());
        f.wait_published(f.timeout());
        Ok(self.stats())
    }

    /// Hands the connection, the mountpoint and the server's state to a
    /// successor ([`take_over`]) over `sock`, and stops serving once the
    /// successor has said it serves. The mount stays as it is: nothing in
    /// the kernel notices, files open stay open, and requests that arrive
    /// meanwhile wait in the kernel's queue. If the successor fails, this
    /// server serves on and is given back with the error.
    ///
    /// Opens waiting for a fetch are answered first (at worst at their
    /// deadline, `fetch_timeout`), so none is lost in the hand-over, and
    /// objects whose opens were answered from their staged files are
    /// published first (the successor opens its handles in the store).
    #[allow(clippy::result_large_err)]
    pub fn hand_over(mut self, sock: &UnixStream) -> Result<(), (FuseMount, FuseError)> {
        self.workers.stop();
        let deadline =
            std::time::Instant::now() + self.server.fetcher.timeout() + Duration::from_secs(1);
        while self.server.pending_opens.load(Ordering::SeqCst) != 0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Handles opened on staged files: their objects must be in the
        // store, where the successor opens them again.
        let published = self
            .server
            .fetcher
            .wait_published(deadline.saturating_duration_since(std::time::Instant::now()));
        let result = if self.server.pending_opens.load(Ordering::SeqCst) != 0 {
            Err("opens waiting for fetches did not finish".to_string())
        } else if !published {
            Err("fetched objects whose opens were answered are not published yet".to_string())
        } else {
            let state = self.server.export_state();
            handover::send(sock, self.server.dev.as_fd(), &self.target, &state)
                .map_err(|e| format!("sending the connection: {e}"))
                .and_then(|()| {
                    let mut ack = [0u8; 1];
                    match (&*sock).read_exact(&mut ack) {
                        Ok(()) if ack[0] == handover::ACK => Ok(()),
                        Ok(()) => Err(format!("the successor answered {:?}", ack[0] as char)),
                        Err(e) => Err(format!("the successor did not take over: {e}")),
                    }
                })
        };
        match result {
            Ok(()) => {
                // The successor owns the mount now.
                self.mounted = false;
                Ok(())
            }
            Err(reason) => {
                let err = FuseError::HandOver {
                    target: self.target.clone(),
                    reason,
                };
                let n = self.server.workers;
                match Workers::start(&self.server, n) {
                    Ok(w) => self.workers = w,
                    Err(e) => {
                        tracing::warn!("restarting FUSE workers after a failed hand-over: {e}")
                    }
                }
                Err((self, err))
            }
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if self.mounted {
            // Detached: the connection lives while anything uses it, and
            // the (detached) workers serve it until the kernel ends it. So
            // their stop pipe must stay open: its write end is left behind
            // (one descriptor for the life of the process).
            let _ = dev::unmount(&self.target, true);
            if let Some(stop) = self.workers.stop.take() {
                std::mem::forget(stop);
            }
        }
    }
}

/// Mounts the lazy data layer at `mountpoint` (an existing directory) and
/// serves it from `store`, fetching missing objects from `source`.
///
/// Returns once the kernel's INIT has been answered, so the mount is usable
/// at once (as `MountOptions::objects` of `cairn_mount`). Passthrough is
/// used when the kernel offers it (Linux 6.9 and later, protocol 7.40);
/// otherwise reads are served by READ (and counted). The caller must be
/// root (mounting, and registering backing files, need `CAP_SYS_ADMIN`).
pub fn serve(
    store: Arc<Store>,
    source: Arc<dyn ObjectSource>,
    mountpoint: &Path,
    options: ServeOptions,
) -> Result<FuseMount, FuseError> {
    let devfd = open_device()?;
    serve_on(devfd, store, source, mountpoint, options)
}

/// Opens `/dev/fuse` for a new connection, for [`serve_on`]: a process
/// that keeps a duplicate keeps the connection (and the kernel queues its
/// requests) while no server runs.
pub fn open_device() -> Result<OwnedFd, FuseError> {
    dev::open_dev().map_err(FuseError::OpenDevice)
}

/// [`serve`] on a connection opened with [`open_device`].
pub fn serve_on(
    devfd: OwnedFd,
    store: Arc<Store>,
    source: Arc<dyn ObjectSource>,
    mountpoint: &Path,
    options: ServeOptions,
) -> Result<FuseMount, FuseError> {
    let target = mountpoint.to_path_buf();
    let fetcher = Fetcher::start(
        store.clone(),
        source,
        options.fetch_timeout,
        options.max_fetches,
        options.max_background_fetches,
    )
    .map_err(FuseError::Spawn)?;
    dev::mount(devfd.as_fd(), &target, &options.source_name).map_err(|error| FuseError::Mount {
        target: target.clone(),
        error,
    })?;
    let mut server = Server::new(devfd, store, fetcher, options.max_nodes, options.workers);
    if let Some(r) = &options.resumable {
        server = server.with_journal(r.0.clone());
    }
    let server = Arc::new(server);
    if options.record_opens {
        *server.open_log.lock().expect("open log lock") = Some(server::OpenLog {
            chunk_size: options.record_chunk_size,
            ..Default::default()
        });
    }
    let mut mount = FuseMount {
        target: target.clone(),
        server: server.clone(),
        workers: Workers {
            stop: None,
            threads: Vec::new(),
        },
        mounted: true,
    };
    // From here on, dropping `mount` detaches it again.
    handshake(&server, options.passthrough).map_err(|reason| FuseError::Init {
        target: target.clone(),
        reason,
    })?;
    dev::set_nonblocking(server.dev.as_fd()).map_err(FuseError::OpenDevice)?;
    mount.workers = Workers::start(&server, options.workers)?;
    Ok(mount)
}

/// Goes on serving a connection whose server died without a hand-over
/// (killed): `devfd` is a duplicate of its `/dev/fuse` descriptor, kept by
/// a process that outlived it, and `options.resumable` the journal it was
/// served with ([`serve_on`]). Node ids come from the journal's list of
/// objects, open counts and backing ids from its records; the requests
/// the predecessor read and did not answer are handled again (opens of
/// objects it was fetching start their fetch afresh). `mounted` says
/// whether the mount at `mountpoint` is still attached (then the returned
/// `FuseMount` detaches or unmounts it as one from [`serve`] would); it
/// serves until the kernel ends the connection.
pub fn resume(
    devfd: OwnedFd,
    store: Arc<Store>,
    source: Arc<dyn ObjectSource>,
    mountpoint: &Path,
    mounted: bool,
    options: ServeOptions,
) -> Result<FuseMount, FuseError> {
    let target = mountpoint.to_path_buf();
    let Some(resumable) = &options.resumable else {
        return Err(FuseError::HandOver {
            target,
            reason: "resuming needs the predecessor's journal".into(),
        });
    };
    let fetcher = Fetcher::start(
        store.clone(),
        source,
        options.fetch_timeout,
        options.max_fetches,
        options.max_background_fetches,
    )
    .map_err(FuseError::Spawn)?;
    let server = Server::new(devfd, store, fetcher, options.max_nodes, options.workers)
        .with_journal(resumable.0.clone());
    let server = Arc::new(server);
    if options.record_opens {
        *server.open_log.lock().expect("open log lock") = Some(server::OpenLog {
            chunk_size: options.record_chunk_size,
            ..Default::default()
        });
    }
    dev::set_nonblocking(server.dev.as_fd()).map_err(FuseError::OpenDevice)?;
    server.resume();
    let workers = Workers::start(&server, options.workers)?;
    Ok(FuseMount {
        target,
        server,
        workers,
        mounted,
    })
}

/// Takes over a connection that a predecessor hands over on `sock`
/// ([`FuseMount::hand_over`]): receives the `/dev/fuse` descriptor, the
/// mountpoint and the server's state, checks the state, opens the files of
/// the handles open in the kernel again from `store`, starts serving and
/// tells the predecessor so. `options.source_name` is not used (the mount
/// exists already).
pub fn take_over(
    store: Arc<Store>,
    source: Arc<dyn ObjectSource>,
    sock: &UnixStream,
    options: ServeOptions,
) -> Result<FuseMount, FuseError> {
    let fail = |target: &Path, reason: String| FuseError::HandOver {
        target: target.to_path_buf(),
        reason,
    };
    let (devfd, target, state) =
        handover::receive(sock, options.max_nodes).map_err(|r| fail(Path::new("?"), r))?;
    let fetcher = Fetcher::start(
        store.clone(),
        source,
        options.fetch_timeout,
        options.max_fetches,
        options.max_background_fetches,
    )
    .map_err(FuseError::Spawn)?;
    let server = Arc::new(Server::new(
        devfd,
        store,
        fetcher,
        options.max_nodes,
        options.workers,
    ));
    server.import_state(state).map_err(|r| fail(&target, r))?;
    let workers = Workers::start(&server, options.workers)?;
    (&*sock)
        .write_all(&[handover::ACK])
        .map_err(|e| fail(&target, format!("telling the predecessor: {e}")))?;
    Ok(FuseMount {
        target,
        server,
        workers,
        mounted: true,
    })
}

/// Reads the kernel's INIT and answers it: passthrough with a stack depth
/// of 1 when offered, so that overlayfs (one more level) can stack on top.
fn handshake(server: &Server, allow_passthrough: bool) -> Result<(), String> {
    let mut buf = vec![0u8; REQUEST_BUFFER];
    let n = loop {
        match dev::read(server.dev.as_fd(), &mut buf) {
            Ok(n) => break n,
            Err(Errno::INTR | Errno::AGAIN) => continue,
            Err(e) => return Err(format!("reading INIT: {e}")),
        }
    };
    let req = Request::parse(&buf[..n]).map_err(|e| format!("reading INIT: {e}"))?;
    let Op::Init(init) = req.op else {
        return Err(format!(
            "the first request was opcode {}, not INIT",
            req.header.opcode
        ));
    };
    if init.major != proto::KERNEL_VERSION {
        server.reply(Reply::error(req.header.unique, libc::EPROTO));
        return Err(format!(
            "the kernel speaks FUSE {}.{}, we speak 7.x",
            init.major, init.minor
        ));
    }
    let offered = init.flags;
    let passthrough_bit = (init_flags::PASSTHROUGH2 as u64) << 32;
    let mut wanted = (init_flags::ASYNC_READ
        | init_flags::BIG_WRITES
        | init_flags::PARALLEL_DIROPS
        | init_flags::MAX_PAGES
        | init_flags::INIT_EXT) as u64
        // An idmapped clone of the layer (`cairn mount --idmap`) needs it;
        // the kernel honours it only with default_permissions, which we
        // mount with.
        | (init_flags::ALLOW_IDMAP2 as u64) << 32;
    let offered_passthrough =
        init.minor >= proto::PASSTHROUGH_MINOR && offered & passthrough_bit != 0;
    let passthrough = allow_passthrough && offered_passthrough;
    if passthrough {
        wanted |= passthrough_bit;
    } else if offered_passthrough {
        tracing::info!("passthrough turned off: every read of the lazy layer goes through cairn");
    } else {
        tracing::warn!(
            "the kernel (FUSE 7.{}) offers no passthrough: every read of the lazy layer goes through cairn",
            init.minor
        );
    }
    let out = InitOut {
        major: proto::KERNEL_VERSION,
        minor: proto::KERNEL_MINOR,
        max_readahead: init.max_readahead,
        flags: offered & wanted,
        max_background: 16,
        congestion_threshold: 12,
        max_write: 4096,
        max_pages: (server::MAX_READ / 4096) as u16,
        max_stack_depth: if passthrough { 1 } else { 0 },
    };
    server.passthrough.store(passthrough, Ordering::Relaxed);
    if let Some(j) = &server.journal {
        j.set_passthrough(passthrough);
    }
    server.reply(Reply::ok(req.header.unique).init(&out));
    Ok(())
}

/// One worker: wait for a request (or the stop pipe), read it, answer it,
/// until the connection ends or the workers are stopped. The device is
/// non-blocking: every worker wakes for a request, one reads it, the
/// others find nothing (`EAGAIN`) and wait again.
fn worker(server: &Arc<Server>, stop: &OwnedFd) {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut buf = vec![0u8; REQUEST_BUFFER];
    loop {
        let mut fds = [
            PollFd::new(&server.dev, PollFlags::IN),
            PollFd::new(stop, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(Errno::INTR | Errno::AGAIN) => continue,
            Err(e) => {
                tracing::warn!("polling /dev/fuse: {e}; worker stops");
                return;
            }
        }
        if !fds[1].revents().is_empty() {
            return;
        }
        match dev::read(server.dev.as_fd(), &mut buf) {
            Ok(n) => {
                if server.handle(&buf[..n]) == Flow::Stop {
                    return;
                }
            }
            // ENOENT: the request was interrupted before we read it.
            Err(Errno::INTR | Errno::AGAIN | Errno::NOENT) => continue,
            // The filesystem was unmounted (or the connection aborted).
            Err(Errno::NODEV) => return,
            Err(e) => {
                tracing::warn!("reading /dev/fuse: {e}; worker stops");
                return;
            }
        }
    }
}
