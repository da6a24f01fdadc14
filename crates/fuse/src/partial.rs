//! Chunked reads of a large missing object.
//!
//! An OPEN of a missing object that the source can fetch piece by piece
//! ([`ObjectSource::chunks`]) does not wait for the whole object. The open
//! is answered at once, without passthrough, and the object gets a
//! *partial*: a staging file (an unnamed `O_TMPFILE` in the store's `tmp/`,
//! as long as the object) and a state per chunk. READs of its handles are
//! answered by this server from the staging file, each as soon as every
//! chunk it covers is in; a read that needs a missing chunk leaves a
//! *read waiter* (the worker goes back to the device) and puts the chunk
//! at the front of the partial's queue.
//!
//! One fetch thread per partial fetches chunks one at a time: first the
//! chunks reads wait for (in the order they were asked), then the rest in
//! order from the chunk after the last one read ("read-behind"), so the
//! whole object follows the first read. Every chunk comes from the source
//! already checked against its own digest (a sha256 in cairn's index, the
//! `chunkDigest` of an eStargz TOC); the server checks its length, writes
//! it into the staging file, marks it done and answers the reads it
//! completes. A chunk that fails (wrong bytes, a registry error) fails the
//! reads waiting for it with `EIO` and is logged with the source's reason
//! (which names the object and the blob); it is retried when a read needs
//! it again, and in the background after 1 s, 2 s, 4 s, … (at most 30 s
//! apart, 8 times; then only on demand).
//!
//! When every chunk is in, the thread copies the staging file into a
//! store stager (which hashes it), and publishes it only if its fs-verity
//! digest is the object's name; else it is refused and logged, nothing is
//! stored. Handles open on the partial keep reading the staging file (its
//! bytes were checked chunk by chunk); later opens find the object in the
//! store. While any handle of the object is served by READ, new opens of
//! it are too (the kernel does not let passthrough and cached opens of one
//! inode mix); once those are closed, opens pass through.
//!
//! Bounds: at most [`MAX_PARTIALS`] objects at once (more opens take the
//! whole-object path), at most [`MAX_CHUNKS`] chunks an object and
//! [`MAX_CHUNK_LEN`] bytes a chunk. Memory: per partial, a byte or so of
//! state per chunk, one read waiter per READ waiting (the kernel bounds
//! those by its `max_background`), and one chunk in flight (the source's
//! buffer, at most a chunk and its compressed form) plus a 1 MiB copy
//! buffer while publishing: with cairn's 1 MiB chunks, under 4 MiB a
//! partial, 32 MiB in all. Disk: the staging file, freed when the last
//! handle and the thread let go of it.
//!
//! The fetch thread holds the fetcher (source, store) and the server only
//! weakly: it finishes an object after the layer is gone, and the mount's
//! unmount waits for it (`Fetcher::wait_partials`).
//!
//! Deadlines: a read waiter is answered `EIO` once the fetch timeout has
//! passed (the server's partial timer looks every 200 ms); the chunk's
//! fetch goes on, and a later read gets it.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use cairn_store::ObjectId;
use sha2::{Digest as _, Sha256};

use crate::fetch::{Fetcher, Waiter};
use crate::proto::Reply;
use crate::server::{Server, MAX_READ};

/// Objects served chunk by chunk at once.
pub(crate) const MAX_PARTIALS: usize = 8;
/// The most chunks one object may have.
pub(crate) const MAX_CHUNKS: usize = 1 << 22;
/// The longest chunk accepted (its bytes are held in memory).
pub(crate) const MAX_CHUNK_LEN: u64 = 16 << 20;
/// Background retries of a failed chunk (reads retry it any time), after
/// 1 s, 2 s, 4 s, … up to 30 s.
const BACKGROUND_ATTEMPTS: u8 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Missing,
    Fetching,
    Done,
    /// Failed; retried in the background from then on.
    Failed(Instant),
}

/// A READ waiting for chunks.
struct ReadWaiter {
    unique: u64,
    offset: u64,
    len: u32,
    first: usize,
    last: usize,
    deadline: Instant,
    /// The journal slot holding the request, cleared once it is answered
    /// (a successor answers requests whose slot is still set).
    slot: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Pending,
    Published,
    Refused,
}

struct State {
    chunks: Vec<Chunk>,
    attempts: Vec<u8>,
    /// Chunks reads wait for, oldest first.
    wanted: VecDeque<usize>,
    waiters: Vec<ReadWaiter>,
    /// Where read-behind goes on.
    next: usize,
    done: usize,
    /// A fetch thread runs.
    fetching: bool,
    /// Open handles on the partial.
    handles: u32,
    outcome: Outcome,
    /// Fetches of the object (a background walk's) waiting for it to be
    /// stored.
    stored_waiters: Vec<Waiter>,
    /// Whether the thread goes on past the chunks asked for (to the whole
    /// object). Off only for a partial the prefetch list started in
    /// on-demand mode, until a fetch of the whole object joins it.
    read_behind: bool,
}

/// A missing object being fetched chunk by chunk, with readers.
pub(crate) struct Partial {
    pub id: ObjectId,
    pub size: u64,
    starts: Vec<u64>,
    pub file: Arc<File>,
    state: Mutex<State>,
    wake: Condvar,
}

impl std::fmt::Debug for Partial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partial")
            .field("id", &self.id)
            .field("size", &self.size)
            .field("chunks", &self.starts.len())
            .finish()
    }
}

enum Pick {
    Fetch(usize),
    Wait(Instant),
    Nothing,
}

/// Whether `starts` cuts an object of `size` bytes in pieces this module
/// serves: at least two, from 0, strictly increasing, each below `size`
/// and none longer than [`MAX_CHUNK_LEN`].
pub(crate) fn valid_starts(starts: &[u64], size: u64) -> bool {
    if starts.len() < 2 || starts.len() > MAX_CHUNKS || starts[0] != 0 {
        return false;
    }
    let mut prev = 0u64;
    for &s in &starts[1..] {
        if s <= prev || s >= size || s - prev > MAX_CHUNK_LEN {
            return false;
        }
        prev = s;
    }
    size - prev <= MAX_CHUNK_LEN
}

impl Partial {
    /// A partial for `id` with its staging file in `tmp` (the store's
    /// `tmp/`); `starts` as [`valid_starts`] accepts.
    pub fn new(
        tmp: &std::path::Path,
        id: ObjectId,
        size: u64,
        starts: Vec<u64>,
        read_behind: bool,
    ) -> std::io::Result<Partial> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(
            tmp,
            OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        let file = File::from(fd);
        file.set_len(size)?;
        let n = starts.len();
        Ok(Partial {
            id,
            size,
            starts,
            file: Arc::new(file),
            state: Mutex::new(State {
                chunks: vec![Chunk::Missing; n],
                attempts: vec![0; n],
                wanted: VecDeque::new(),
                waiters: Vec::new(),
                next: 0,
                done: 0,
                fetching: false,
                handles: 0,
                outcome: Outcome::Pending,
                stored_waiters: Vec::new(),
                read_behind,
            }),
            wake: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("partial lock")
    }

    pub fn outcome(&self) -> Outcome {
        self.lock().outcome
    }

    /// Bytes `start..end` of chunk `k`.
    fn range(&self, k: usize) -> (u64, u64) {
        let end = self.starts.get(k + 1).copied().unwrap_or(self.size);
        (self.starts[k], end)
    }

    /// The chunk holding byte `at` (< size).
    fn chunk_of(&self, at: u64) -> usize {
        self.starts.partition_point(|&s| s <= at) - 1
    }

    /// Runs `waiter` once this partial has stored the object (or failed
    /// to); gives it back if no fetch thread runs to do that.
    pub fn when_done(&self, waiter: Waiter) -> Result<(), Waiter> {
        let mut st = self.lock();
        if !st.fetching || st.outcome != Outcome::Pending {
            return Err(waiter);
        }
        st.stored_waiters.push(waiter);
        // Someone wants it whole: the thread goes on to the end.
        st.read_behind = true;
        drop(st);
        self.wake.notify_all();
        Ok(())
    }

    /// Queues chunks `chunks` (indices; those past the object's are
    /// ignored) for the fetch thread, starting it if none runs: what a
    /// prefetch list names of the object, fetched before anyone reads it.
    pub fn want(self: &Arc<Self>, server: &Arc<Server>, chunks: &[u32]) {
        let mut st = self.lock();
        for &k in chunks {
            let k = k as usize;
            if k < st.chunks.len() && st.chunks[k] == Chunk::Missing && !st.wanted.contains(&k) {
                st.wanted.push_back(k);
            }
        }
        self.ensure_thread(server, &mut st);
        drop(st);
        self.wake.notify_all();
    }

    pub fn add_handle(&self) {
        self.lock().handles += 1;
    }

    /// One handle fewer; whether the partial may go (no handle, no
    /// thread).
    pub fn drop_handle(&self) -> bool {
        let mut st = self.lock();
        st.handles = st.handles.saturating_sub(1);
        st.handles == 0 && !st.fetching
    }

    /// Whether a fetch thread runs for it.
    pub fn fetching(&self) -> bool {
        self.lock().fetching
    }

    /// Whether the partial may go (no handle, no thread).
    pub fn idle(&self) -> bool {
        let st = self.lock();
        st.handles == 0 && !st.fetching
    }

    /// Answers READ `unique` of `size` bytes at `offset`: now if its
    /// chunks are in, else once they are (or `EIO` when one fails or the
    /// deadline passes).
    /// Answers a READ now, or returns true when it waits for chunks (it
    /// then owns `slot`, which is cleared once it is answered).
    pub fn read(
        self: &Arc<Self>,
        server: &Arc<Server>,
        unique: u64,
        offset: u64,
        size: u32,
        slot: Option<u32>,
    ) -> bool {
        if offset >= self.size || size == 0 {
            server.reply(Reply::ok(unique).bytes(&[]));
            return false;
        }
        let len = (size.min(MAX_READ) as u64).min(self.size - offset) as u32;
        let (first, last) = (
            self.chunk_of(offset),
            self.chunk_of(offset + len as u64 - 1),
        );
        {
            let mut st = self.lock();
            if !(first..=last).all(|k| st.chunks[k] == Chunk::Done) {
                for k in first..=last {
                    match st.chunks[k] {
                        Chunk::Missing | Chunk::Failed(_) => {
                            st.chunks[k] = Chunk::Missing;
                            if !st.wanted.contains(&k) {
                                st.wanted.push_back(k);
                            }
                        }
                        Chunk::Fetching | Chunk::Done => {}
                    }
                }
                st.waiters.push(ReadWaiter {
                    unique,
                    offset,
                    len,
                    first,
                    last,
                    deadline: Instant::now() + server.fetcher.timeout(),
                    slot,
                });
                self.ensure_thread(server, &mut st);
                drop(st);
                self.wake.notify_all();
                server.start_partial_timer();
                return true;
            }
        }
        server.reply(self.answer(unique, offset, len));
        false
    }

    /// The READ reply from the staging file (its range is in).
    fn answer(&self, unique: u64, offset: u64, len: u32) -> Reply {
        let mut buf = vec![0u8; len as usize];
        match self.file.read_exact_at(&mut buf, offset) {
            Ok(()) => Reply::ok(unique).bytes(&buf),
            Err(e) => {
                tracing::warn!(object = %self.id, "reading the staging file: {e}");
                Reply::error(unique, libc::EIO)
            }
        }
    }

    fn ensure_thread(self: &Arc<Self>, server: &Arc<Server>, st: &mut State) {
        if st.fetching || st.outcome != Outcome::Pending {
            return;
        }
        st.fetching = true;
        let (me, fetcher, weak) = (self.clone(), server.fetcher.clone(), Arc::downgrade(server));
        let spawned = std::thread::Builder::new()
            .name(format!("cairn-chunks-{}", &self.id.to_hex()[..8]))
            .spawn(move || me.run(fetcher, weak));
        if let Err(e) = spawned {
            tracing::warn!(object = %self.id, "starting a chunk fetch thread: {e}");
            st.fetching = false;
            let failed: Vec<ReadWaiter> = st.waiters.drain(..).collect();
            for w in failed {
                server.reply(Reply::error(w.unique, libc::EIO));
                server.clear_slot(w.slot);
            }
        }
    }

    fn pick(&self, st: &mut State, now: Instant) -> Pick {
        while let Some(k) = st.wanted.pop_front() {
            if st.chunks[k] == Chunk::Missing {
                return Pick::Fetch(k);
            }
        }
        if !st.read_behind {
            // Only what reads (and the list) ask for: a failed chunk is
            // tried again when a read needs it.
            return Pick::Nothing;
        }
        let n = st.chunks.len();
        let mut earliest: Option<Instant> = None;
        for i in 0..n {
            let k = (st.next + i) % n;
            match st.chunks[k] {
                Chunk::Missing => return Pick::Fetch(k),
                Chunk::Failed(at) if st.attempts[k] < BACKGROUND_ATTEMPTS => {
                    if at <= now {
                        return Pick::Fetch(k);
                    }
                    earliest = Some(earliest.map_or(at, |e| e.min(at)));
                }
                _ => {}
            }
        }
        earliest.map_or(Pick::Nothing, Pick::Wait)
    }

    /// The fetch thread: chunks until every one is in (then publication)
    /// or none is left to try. It goes on after the layer is gone (the
    /// server then waits for it, up to its fetch timeout, before it
    /// exits), so that a file read by a short-lived process is still
    /// stored; it answers reads while the server is there.
    fn run(self: Arc<Self>, fetcher: Arc<Fetcher>, server: Weak<Server>) {
        loop {
            let k = {
                let mut st = self.lock();
                match self.pick(&mut st, Instant::now()) {
                    Pick::Fetch(k) => {
                        st.chunks[k] = Chunk::Fetching;
                        k
                    }
                    Pick::Wait(at) => {
                        if server.strong_count() == 0 {
                            // Only failed chunks are left, and no reader.
                            drop(st);
                            self.stop(&fetcher, &server);
                            return;
                        }
                        let wait = at.saturating_duration_since(Instant::now());
                        let _ = self.wake.wait_timeout(st, wait).expect("partial lock");
                        continue;
                    }
                    Pick::Nothing if st.done == st.chunks.len() => break,
                    Pick::Nothing => {
                        // Chunks failed more often than the background
                        // retries: reads may still ask for them (and
                        // start a thread again).
                        drop(st);
                        self.stop(&fetcher, &server);
                        return;
                    }
                }
            };
            let (start, end) = self.range(k);
            let result = fetcher
                .source()
                .fetch_chunk(&self.id, k)
                .map_err(|e| e.to_string())
                .and_then(|data| {
                    if data.len() as u64 != end - start {
                        return Err(format!(
                            "the source sent {} bytes for a chunk of {}",
                            data.len(),
                            end - start
                        ));
                    }
                    self.file
                        .write_all_at(&data, start)
                        .map_err(|e| format!("writing the staging file: {e}"))
                });
            let c = &fetcher.counters;
            let (ready, failed) = {
                let mut st = self.lock();
                match &result {
                    Ok(()) => {
                        st.chunks[k] = Chunk::Done;
                        st.done += 1;
                        st.next = k + 1;
                        c.chunks_fetched.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(reason) => {
                        st.attempts[k] = st.attempts[k].saturating_add(1);
                        let backoff =
                            Duration::from_secs((1u64 << (st.attempts[k] - 1).min(5)).min(30));
                        st.chunks[k] = Chunk::Failed(Instant::now() + backoff);
                        c.chunks_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(
                            object = %self.id,
                            "object {}: chunk {k} (bytes {start}..{end}): {reason}; reads of it \
                             fail with EIO, nothing of the object is stored",
                            self.id
                        );
                    }
                }
                let waiters = std::mem::take(&mut st.waiters);
                let (mut ready, mut failed) = (Vec::new(), Vec::new());
                for w in waiters {
                    if (w.first..=w.last).all(|c| st.chunks[c] == Chunk::Done) {
                        ready.push(w);
                    } else if result.is_err() && (w.first..=w.last).contains(&k) {
                        failed.push(w);
                    } else {
                        st.waiters.push(w);
                    }
                }
                (ready, failed)
            };
            if let Some(srv) = server.upgrade() {
                for w in ready {
                    srv.reply(self.answer(w.unique, w.offset, w.len));
                    srv.clear_slot(w.slot);
                }
                for w in failed {
                    srv.reply(Reply::error(w.unique, libc::EIO));
                    srv.clear_slot(w.slot);
                    srv.clear_slot(w.slot);
                }
            }
        }
        let outcome = match self.publish(&fetcher.store, fetcher.source()) {
            Ok(()) => {
                fetcher
                    .counters
                    .chunked_published
                    .fetch_add(1, Ordering::Relaxed);
                Outcome::Published
            }
            Err(reason) => {
                tracing::error!(object = %self.id, "{reason}");
                Outcome::Refused
            }
        };
        self.lock().outcome = outcome;
        self.stop(&fetcher, &server);
    }

    /// The thread ends: reads still waiting (none should be) fail, fetches
    /// waiting for the object are told, and the partial leaves the table
    /// if no handle holds it.
    fn stop(&self, fetcher: &Fetcher, server: &Weak<Server>) {
        let (waiters, done, outcome) = {
            let mut st = self.lock();
            st.fetching = false;
            (
                std::mem::take(&mut st.waiters),
                std::mem::take(&mut st.stored_waiters),
                st.outcome,
            )
        };
        for w in done {
            w(match outcome {
                Outcome::Published => Ok(()),
                _ => Err(format!(
                    "object {}: its chunked fetch ended without storing it",
                    self.id
                )),
            });
        }
        if let Some(srv) = server.upgrade() {
            for w in waiters {
                srv.reply(Reply::error(w.unique, libc::EIO));
                srv.clear_slot(w.slot);
            }
        }
        fetcher.forget_partial_if_idle(&self.id);
    }

    /// Copies the staging file into the store's staging (which hashes it)
    /// and publishes it if it hashes to the object's name.
    fn publish(
        &self,
        store: &cairn_store::Store,
        source: &dyn crate::ObjectSource,
    ) -> Result<(), String> {
        let id = self.id;
        let _lock = store
            .lock_shared()
            .map_err(|e| format!("publishing object {id}: {e}"))?;
        if crate::has_local(store, source, &id) {
            return Ok(());
        }
        let mut sha256 = source.foreign_names().then(Sha256::new);
        let mut stager = store
            .stage_object()
            .map_err(|e| format!("publishing object {id}: {e}"))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0u64;
        while at < self.size {
            let n = ((self.size - at) as usize).min(buf.len());
            self.file
                .read_exact_at(&mut buf[..n], at)
                .map_err(|e| format!("object {id}: reading its staging file: {e}"))?;
            stager
                .write(&buf[..n])
                .map_err(|e| format!("publishing object {id}: {e}"))?;
            if let Some(h) = &mut sha256 {
                h.update(&buf[..n]);
            }
            at += n as u64;
        }
        let staged = stager
            .finish(store)
            .map_err(|e| format!("publishing object {id}: {e}"))?;
        if let Some(h) = sha256 {
            let sha: [u8; 32] = h.finalize().into();
            source
                .accept(&id, &sha, &staged.id())
                .map_err(|e| format!("{e}; refused, nothing stored"))?;
        } else if staged.id() != id {
            return Err(format!(
                "object {id}: its chunks, each checked, hash together to {}; refused, nothing \
                 stored",
                staged.id()
            ));
        }
        store
            .publish_staged([staged])
            .map_err(|e| format!("publishing object {id}: {e}"))
    }

    /// Answers `EIO` to reads past their deadline.
    pub fn expire(&self, server: &Server, now: Instant) {
        let expired: Vec<ReadWaiter> = {
            let mut st = self.lock();
            if st.waiters.is_empty() {
                return;
            }
            let (expired, kept) = std::mem::take(&mut st.waiters)
                .into_iter()
                .partition(|w| w.deadline <= now);
            st.waiters = kept;
            expired
        };
        for w in expired {
            tracing::warn!(
                object = %self.id,
                "object {}: a read of bytes {}+{} waited longer than {:.1}s for its chunks; EIO",
                self.id,
                w.offset,
                w.len,
                server.fetcher.timeout().as_secs_f64()
            );
            server.reply(Reply::error(w.unique, libc::EIO));
            server.clear_slot(w.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_are_checked() {
        assert!(valid_starts(&[0, 10], 20));
        assert!(!valid_starts(&[0], 20));
        assert!(!valid_starts(&[1, 10], 20));
        assert!(!valid_starts(&[0, 10, 10], 20));
        assert!(!valid_starts(&[0, 20], 20));
        assert!(!valid_starts(&[0, 5, 3], 20));
        assert!(!valid_starts(&[0, MAX_CHUNK_LEN + 1], MAX_CHUNK_LEN + 2));
        assert!(!valid_starts(&[0, 1], MAX_CHUNK_LEN + 2));
    }
}
