//! Fetching missing objects: one fetch in flight per object, a bounded
//! number of fetches at once, a deadline for every open that waits, no
//! worker thread blocked on a source, and nothing published that does not
//! hash to the object's name.
//!
//! An open of a missing object does not wait: it leaves a *waiter* (the
//! rest of the open, which sends the reply) on the object's *flight*, or
//! starts one, and its worker goes back to reading requests. A flight
//!
//! 1. waits in a queue for one of `max_fetches` slots;
//! 2. runs on a fetch thread of its own: takes the store lock shared (so
//!    garbage collection cannot run between publication and use), stages
//!    what the source writes with [`Store::stage_object`] (never more than
//!    the size the object was looked up with), hashing as it goes, and
//!    publishes with [`Store::publish_staged`] only if the fs-verity digest
//!    is the object's id;
//! 3. completes: it leaves the table, then its waiters run, each with the
//!    outcome.
//!
//! One timer thread watches the deadlines (a flight's is set when it
//! starts: `fetch_timeout` later). A flight past it is *abandoned*: it
//! leaves the table (so the next open starts a new one), its waiters run
//! with an error (the open fails with `EIO`), and its writer refuses
//! further bytes, so a source that still writes stops at its next write. A
//! source that blocks without writing keeps its thread and its slot until
//! it returns: such threads can never be more than `max_fetches`.
//!
//! A source may fetch an object together with its *neighbours* (the
//! objects that follow it in its pack, [`ObjectSource::group`]): the
//! flight is then entered in the table under each of them, so an open of
//! a neighbour joins it instead of fetching again, and each waiter is
//! answered by whether *its* object is in the store afterwards.
//!
//! *Background* flights ([`Fetcher::background`]) have no open waiting:
//! they queue behind every open's flight, run in at most
//! `max_background` of the slots, and get a deadline only when they start
//! (or when an open joins one, which also moves it to the front queue).
//!
//! Threads: one timer and at most `max_fetches` fetch threads. Memory: one
//! flight (about 100 bytes, plus one boxed waiter per waiting open) per
//! object being fetched; the data goes to disk, never into a buffer here.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use cairn_store::{ObjectId, ObjectStager, StagedObject, Store};
use sha2::{Digest as _, Sha256};

use crate::partial::Partial;
use crate::{FetchError, ObjectSource};

/// The rest of an open, run once with the flight's outcome (`Err` holds the
/// reason, already logged).
pub(crate) type Waiter = Box<dyn FnOnce(Result<(), String>) + Send>;

struct Flight {
    id: ObjectId,
    size: u64,
    /// Set when the flight starts, or when an open waits for it; `None`
    /// for a background flight still queued (it never expires there).
    deadline: Mutex<Option<Instant>>,
    abandoned: AtomicBool,
    /// No open waits for it (yet): it queues behind every open's flight,
    /// and its thread runs at [`BACKGROUND_NICE`].
    background: AtomicBool,
    /// The thread fetching it, once it runs (0 before): an open that comes
    /// to wait for a background flight gives that thread its priority back.
    tid: AtomicI32,
    /// `None` once completed: the waiters have run. Each waits for the
    /// object named with it (the flight's own, or a neighbour).
    waiters: Mutex<Option<Vec<(ObjectId, Waiter)>>>,
}

impl Flight {
    fn deadline(&self) -> Option<Instant> {
        *self.deadline.lock().expect("flight lock")
    }

    /// On the flight's own thread, as it starts: the background priority
    /// while no open waits for it, else the normal one (set either way: a
    /// thread inherits its creator's, and a background flight's thread
    /// starts the next queued flight as it ends). Checked again after
    /// setting it: an open that came meanwhile found the thread id and may
    /// have reset the priority before it was set.
    fn set_thread_priority(&self) {
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        self.tid.store(tid, Ordering::SeqCst);
        let background = self.background.load(Ordering::SeqCst);
        set_nice(0, if background { BACKGROUND_NICE } else { 0 });
        if background && !self.background.load(Ordering::SeqCst) {
            set_nice(0, 0);
        }
    }

    /// An open waits for it now (its `background` just cleared): its
    /// thread, if running, gets the normal priority back.
    fn foreground(&self) {
        let tid = self.tid.load(Ordering::SeqCst);
        if tid != 0 {
            set_nice(tid, 0);
        }
    }
}

/// The nice value of a background flight's thread: the prefetch list and
/// the rest of an image are fetched while containers start, and on a
/// small machine their decompression and hashing took the CPU the start
/// wanted; at nice 10 they take what the start leaves (and all of it when
/// nothing else runs). An open's flight keeps the normal priority.
pub const BACKGROUND_NICE: i32 = 10;

/// Sets the nice value of thread `tid` (0: the calling thread; Linux keeps
/// it per thread). Going back to 0 from above needs `CAP_SYS_NICE`, which
/// the root cairn runs as has; without it the thread keeps the lower
/// priority, which costs time and nothing else.
fn set_nice(tid: i32, nice: i32) {
    let _ = rustix::process::setpriority_process(rustix::process::Pid::from_raw(tid), nice);
}

#[derive(Default)]
struct State {
    /// The flight of each object being fetched (queued or running); a
    /// flight that fetches neighbours is here under each of them.
    inflight: HashMap<ObjectId, Arc<Flight>>,
    /// Flights of opens waiting for a slot, oldest first.
    queue: VecDeque<Arc<Flight>>,
    /// Background flights waiting for a slot, oldest first.
    bg_queue: VecDeque<Arc<Flight>>,
    /// Fetch threads alive, abandoned ones still in the source included.
    running: usize,
    /// Of those, the ones started for a background flight.
    running_bg: usize,
    stop: bool,
}

/// Counters, read by [`crate::Stats`].
#[derive(Debug, Default)]
pub(crate) struct FetchCounters {
    pub started: AtomicU64,
    pub published: AtomicU64,
    pub failed: AtomicU64,
    pub timed_out: AtomicU64,
    /// Background flights started.
    pub background: AtomicU64,
    /// Objects published as neighbours of the object a flight was for.
    pub neighbours: AtomicU64,
    /// Chunks fetched, chunk fetches failed, objects stored by partials.
    pub chunks_fetched: AtomicU64,
    pub chunks_failed: AtomicU64,
    pub chunked_published: AtomicU64,
    /// Opens answered from a checked staged file before publication.
    pub staged_opens: AtomicU64,
}

/// The fetches of one server.
pub(crate) struct Fetcher {
    pub store: Arc<Store>,
    source: Arc<dyn ObjectSource>,
    timeout: Duration,
    max_fetches: usize,
    max_background: usize,
    state: Mutex<State>,
    /// Wakes the timer: a new deadline, or stop.
    timer_wake: Condvar,
    pub counters: FetchCounters,
    /// Missing objects served chunk by chunk (`partial.rs`): a fetch of
    /// one of them waits for its partial instead of fetching it again.
    /// Locked after `state`, never before.
    pub partials: Mutex<HashMap<ObjectId, Arc<Partial>>>,
    /// Objects fetched and checked whose publication (the syncs that make
    /// their names durable, then the renames) is under way: each with a
    /// read-only descriptor of its staged file, from which an open is
    /// answered meanwhile. An entry goes once the flight has completed.
    /// Locked after `state` and a flight's waiters, never before.
    verified: Mutex<HashMap<ObjectId, Arc<File>>>,
    /// Signalled when entries leave `verified`.
    verified_gone: Condvar,
}

impl Fetcher {
    /// A fetcher and its timer thread (which holds only a weak reference
    /// and stops at [`shutdown`](Self::shutdown) or when the fetcher goes).
    pub fn start(
        store: Arc<Store>,
        source: Arc<dyn ObjectSource>,
        timeout: Duration,
        max_fetches: usize,
        max_background: usize,
    ) -> io::Result<Arc<Fetcher>> {
        let max_fetches = max_fetches.max(1);
        let f = Arc::new(Fetcher {
            store,
            source,
            timeout,
            max_fetches,
            max_background: max_background.clamp(1, max_fetches),
            state: Mutex::new(State::default()),
            timer_wake: Condvar::new(),
            counters: FetchCounters::default(),
            partials: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashMap::new()),
            verified_gone: Condvar::new(),
        });
        let weak = Arc::downgrade(&f);
        std::thread::Builder::new()
            .name("cairn-fetch-timer".into())
            .spawn(move || timer(weak))?;
        Ok(f)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn stopped(&self) -> bool {
        self.state.lock().expect("fetch state lock").stop
    }

    pub fn source(&self) -> &dyn ObjectSource {
        &*self.source
    }

    /// Stops the timer and refuses new background flights; queued
    /// background flights fail; flights still running complete on their
    /// own.
    pub fn shutdown(&self) {
        let dropped: Vec<Arc<Flight>> = {
            let mut state = self.state.lock().expect("fetch state lock");
            state.stop = true;
            let dropped: Vec<Arc<Flight>> = state.bg_queue.drain(..).collect();
            for f in &dropped {
                f.abandoned.store(true, Ordering::SeqCst);
            }
            state
                .inflight
                .retain(|_, f| !f.abandoned.load(Ordering::SeqCst));
            dropped
        };
        self.timer_wake.notify_all();
        for f in dropped {
            self.complete(&f, Err("the layer is going away".to_string()));
        }
    }

    /// Runs `waiter` once `id` (of `size` bytes) is in the store, or with
    /// an error once that failed or the flight's deadline passed. Runs it
    /// at once, on this thread, if the object is there already; otherwise
    /// later, on a fetch thread or the timer.
    pub fn when_present(self: &Arc<Self>, id: &ObjectId, size: u64, waiter: Waiter) {
        if tracing::enabled!(tracing::Level::DEBUG) && !self.present(id) {
            let began = Instant::now();
            let name = *id;
            let waiter: Waiter = Box::new(move |outcome| {
                tracing::debug!(
                    object = %name,
                    "an open waited {:.1} ms for the object ({size} bytes): {}",
                    began.elapsed().as_secs_f64() * 1e3,
                    outcome.as_ref().map_or_else(|e| e.as_str(), |()| "there"),
                );
                waiter(outcome)
            });
            return self.submit(id, size, waiter, false);
        }
        self.submit(id, size, waiter, false);
    }

    /// Fetches `id` (of `size` bytes) in the background: behind every
    /// open's flight, in at most `max_background` slots, with no deadline
    /// until it starts. `done` runs as a waiter's would. Joins the flight
    /// already fetching `id`, if any. Fails at once after
    /// [`shutdown`](Self::shutdown).
    pub fn background(self: &Arc<Self>, id: &ObjectId, size: u64, done: Waiter) {
        self.submit(id, size, done, true);
    }

    /// Drops the partial of `id` from the table if nothing holds it (no
    /// handle, no fetch thread).
    pub fn forget_partial_if_idle(&self, id: &ObjectId) {
        let mut map = self.partials.lock().expect("partials lock");
        if map.get(id).is_some_and(|p| p.idle()) {
            map.remove(id);
        }
    }

    /// Waits (at most `limit`) until no partial has a fetch thread: what
    /// a reader started is stored before the server exits.
    pub fn wait_partials(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let busy = {
                let map = self.partials.lock().expect("partials lock");
                map.values().filter(|p| p.fetching()).count()
            };
            if busy == 0 {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    "{busy} objects read chunk by chunk are still incomplete as the layer goes; \
                     they are not stored"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Opens object `id` for reading: its staged file while it is being
    /// published (checked, not yet durable under its name), else the
    /// store's file. The staged file's descriptor is shared (a `dup`), so
    /// its users must read at explicit offsets.
    pub fn open_object(&self, id: &ObjectId) -> io::Result<File> {
        if let Some(f) = self.verified.lock().expect("verified lock").get(id) {
            let f = f.try_clone()?;
            self.counters.staged_opens.fetch_add(1, Ordering::Relaxed);
            return Ok(f);
        }
        File::open(crate::local_path(&self.store, &*self.source, id))
    }

    /// Whether `id` can be opened: in the store, or checked and being
    /// published.
    fn present(&self, id: &ObjectId) -> bool {
        self.verified
            .lock()
            .expect("verified lock")
            .contains_key(id)
            || crate::has_local(&self.store, &*self.source, id)
    }

    /// Waits (at most `limit`) until no object whose opens were answered
    /// from its staged file still awaits its publication. Whether it got
    /// there. (Flights that answered nobody yet are not waited for: a
    /// background fetch of a large object may run long.)
    pub fn wait_published(&self, limit: Duration) -> bool {
        self.wait_verified_gone(limit, |v| v.is_empty())
    }

    /// Waits (at most `limit`) until `id` no longer awaits its
    /// publication; then whether it is in the store.
    pub fn wait_stored(&self, id: &ObjectId, limit: Duration) -> bool {
        self.wait_verified_gone(limit, |v| !v.contains_key(id))
            && crate::has_local(&self.store, &*self.source, id)
    }

    fn wait_verified_gone(
        &self,
        limit: Duration,
        done: impl Fn(&HashMap<ObjectId, Arc<File>>) -> bool,
    ) -> bool {
        let deadline = Instant::now() + limit;
        let mut v = self.verified.lock().expect("verified lock");
        while !done(&v) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            v = self
                .verified_gone
                .wait_timeout(v, deadline - now)
                .expect("verified lock")
                .0;
        }
        true
    }

    /// Whether a flight is fetching `id` (queued or running).
    pub fn in_flight(&self, id: &ObjectId) -> bool {
        self.state
            .lock()
            .expect("fetch state lock")
            .inflight
            .contains_key(id)
    }

    fn submit(self: &Arc<Self>, id: &ObjectId, size: u64, waiter: Waiter, background: bool) {
        if self.present(id) {
            return waiter(Ok(()));
        }
        let mut state = self.state.lock().expect("fetch state lock");
        if background && state.stop {
            drop(state);
            return waiter(Err("the layer is going away".to_string()));
        }
        if let Some(f) = state.inflight.get(id).cloned() {
            // Completion takes a flight out of the table (under this lock)
            // before it takes the waiters: one in the table takes more.
            let mut waiters = f.waiters.lock().expect("flight lock");
            if let Some(w) = waiters.as_mut() {
                w.push((*id, waiter));
                drop(waiters);
                if !background && f.background.swap(false, Ordering::SeqCst) {
                    // An open waits for it now: its deadline runs, its
                    // thread gets the normal priority, and it goes to the
                    // front queue if it has not started.
                    f.foreground();
                    f.deadline
                        .lock()
                        .expect("flight lock")
                        .get_or_insert_with(|| Instant::now() + self.timeout);
                    if let Some(at) = state.bg_queue.iter().position(|q| Arc::ptr_eq(q, &f)) {
                        state.bg_queue.remove(at);
                        if state.running < self.max_fetches {
                            state.running += 1;
                            drop(state);
                            self.spawn(f, false);
                        } else {
                            state.queue.push_back(f);
                            drop(state);
                        }
                    } else {
                        drop(state);
                    }
                    self.timer_wake.notify_all();
                }
                return;
            }
        }
        // Being fetched chunk by chunk for a reader: wait for that.
        let partial = self
            .partials
            .lock()
            .expect("partials lock")
            .get(id)
            .cloned();
        let waiter = match partial {
            Some(p) => match p.when_done(waiter) {
                Ok(()) => return,
                Err(w) => w,
            },
            None => waiter,
        };
        let flight = Arc::new(Flight {
            id: *id,
            size,
            deadline: Mutex::new((!background).then(|| Instant::now() + self.timeout)),
            abandoned: AtomicBool::new(false),
            background: AtomicBool::new(background),
            tid: AtomicI32::new(0),
            waiters: Mutex::new(Some(vec![(*id, waiter)])),
        });
        state.inflight.insert(*id, flight.clone());
        if background {
            if state.running < self.max_fetches && state.running_bg < self.max_background {
                state.running += 1;
                state.running_bg += 1;
                drop(state);
                self.spawn(flight, true);
            } else {
                state.bg_queue.push_back(flight);
            }
            return;
        }
        if state.running < self.max_fetches {
            state.running += 1;
            drop(state);
            self.spawn(flight, false);
        } else {
            state.queue.push_back(flight);
            drop(state);
        }
        self.timer_wake.notify_all();
    }

    /// Starts a fetch thread for `flight` (its slot already counted, as a
    /// background slot if `bg`).
    fn spawn(self: &Arc<Self>, flight: Arc<Flight>, bg: bool) {
        self.counters.started.fetch_add(1, Ordering::Relaxed);
        if bg {
            self.counters.background.fetch_add(1, Ordering::Relaxed);
        }
        let me = self.clone();
        let f = flight.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("cairn-fetch-{}", &flight.id.to_hex()[..8]))
            .spawn(move || {
                f.set_thread_priority();
                me.run(&f);
                me.slot_done(bg);
            });
        if let Err(e) = spawned {
            let reason = format!("fetching object {}: starting a thread: {e}", flight.id);
            tracing::warn!(object = %flight.id, "{reason}");
            self.complete(&flight, Err(reason));
            self.slot_done(bg);
        }
    }

    /// A fetch thread ends: its slot goes to the oldest queued flight of
    /// an open that is still wanted, else to the oldest background flight
    /// (if background flights may have another slot).
    fn slot_done(self: &Arc<Self>, bg: bool) {
        let next = {
            let mut state = self.state.lock().expect("fetch state lock");
            state.running -= 1;
            if bg {
                state.running_bg -= 1;
            }
            let next = loop {
                match state.queue.pop_front() {
                    Some(f) if f.abandoned.load(Ordering::SeqCst) => continue,
                    Some(f) => break Some((f, false)),
                    None => break None,
                }
            };
            let next = next.or_else(|| {
                if state.running_bg < self.max_background && !state.stop {
                    state.bg_queue.pop_front().map(|f| (f, true))
                } else {
                    None
                }
            });
            if let Some((_, b)) = &next {
                state.running += 1;
                if *b {
                    state.running_bg += 1;
                }
            }
            next
        };
        if let Some((f, b)) = next {
            self.spawn(f, b);
        }
    }

    /// The fetch thread's work, then completion.
    fn run(&self, flight: &Arc<Flight>) {
        let id = flight.id;
        if flight.abandoned.load(Ordering::SeqCst) {
            // Expired while queued: the timer ran its waiters.
            return;
        }
        flight
            .deadline
            .lock()
            .expect("flight lock")
            .get_or_insert_with(|| Instant::now() + self.timeout);
        self.timer_wake.notify_all();
        let (outcome, staged_ids) = self.fetch_and_publish(flight);
        match &outcome {
            Ok(()) => {
                self.counters.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(reason) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(object = %id, "{reason}");
            }
        }
        // Opens that joined after the early answer, or wait for an object
        // whose publication failed, are still answered from the staged
        // files (their bytes were checked); only then do those go.
        let outcome = match outcome {
            Err(_) if self.present(&id) => Ok(()),
            o => o,
        };
        self.complete(flight, outcome);
        if !staged_ids.is_empty() {
            let mut verified = self.verified.lock().expect("verified lock");
            for s in &staged_ids {
                verified.remove(s);
            }
            self.verified_gone.notify_all();
        }
    }

    /// Makes the checked, staged objects readable at once (the
    /// [`verified`](Self::verified) table) and runs the waiters of those
    /// that are, or that are in the store: their opens are answered
    /// before the publication's syncs. Waiters of other objects stay on
    /// the flight. Returns the ids entered in the table.
    fn answer_early(
        &self,
        flight: &Arc<Flight>,
        staged: &[(ObjectId, StagedObject)],
    ) -> Vec<ObjectId> {
        let mut entered = Vec::new();
        for (name, s) in staged {
            match s.open_staged() {
                None => {}
                Some(Ok(f)) => {
                    self.verified
                        .lock()
                        .expect("verified lock")
                        .insert(*name, Arc::new(f));
                    entered.push(*name);
                }
                // Not fatal: its opens wait for the publication instead.
                Some(Err(e)) => tracing::debug!(object = %name, "{e}"),
            }
        }
        let ready: Vec<(ObjectId, Waiter)> = {
            let mut waiters = flight.waiters.lock().expect("flight lock");
            let Some(list) = waiters.as_mut() else {
                // The timer abandoned the flight and ran them already.
                return entered;
            };
            let (ready, wait): (Vec<_>, Vec<_>) =
                list.drain(..).partition(|(id, _)| self.present(id));
            *list = wait;
            ready
        };
        for (_, w) in ready {
            w(Ok(()));
        }
        entered
    }

    /// Takes `flight` out of the table (under each object it is there
    /// for), then runs its waiters with `outcome`, unless they ran
    /// already: a waiter for a neighbour that is not in the store after
    /// all gets an error.
    fn complete(&self, flight: &Arc<Flight>, outcome: Result<(), String>) {
        {
            let mut state = self.state.lock().expect("fetch state lock");
            state.inflight.retain(|_, f| !Arc::ptr_eq(f, flight));
        }
        let waiters = flight.waiters.lock().expect("flight lock").take();
        for (id, w) in waiters.into_iter().flatten() {
            let outcome = match &outcome {
                Ok(()) if id != flight.id && !self.present(&id) => Err(format!(
                    "object {id} was not published by the fetch of {} with its neighbours",
                    flight.id
                )),
                o => o.clone(),
            };
            w(outcome);
        }
    }

    /// The flight's work: the object with its neighbours, staged by the
    /// source (the store names each file by its own digest); or the object
    /// alone, fetched into a staged file and checked. The opens waiting
    /// for what was staged are answered from the staged files, then the
    /// objects are published. Returns the outcome and the objects entered
    /// in the [`verified`](Self::verified) table meanwhile.
    fn fetch_and_publish(&self, flight: &Arc<Flight>) -> (Result<(), String>, Vec<ObjectId>) {
        let id = &flight.id;
        let store = &*self.store;
        // Shared, as every writer holds it: gc cannot run while we publish.
        let _lock = match store.lock_shared() {
            Ok(l) => l,
            Err(e) => return (Err(format!("fetching object {id}: {e}")), Vec::new()),
        };
        if crate::has_local(store, &*self.source, id) {
            return (Ok(()), Vec::new());
        }
        let mut entered = Vec::new();
        let staged = match self.fetch_staged(flight, &mut entered) {
            Ok(s) => s,
            Err(e) => return (Err(e), entered),
        };
        let neighbours = staged.len().saturating_sub(1);
        let published = store
            .publish_staged(staged.into_iter().map(|(_, s)| s))
            .map_err(|e| format!("publishing object {id}: {e}"));
        if published.is_ok() && neighbours > 0 {
            self.counters
                .neighbours
                .fetch_add(neighbours as u64, Ordering::Relaxed);
        }
        (published, entered)
    }

    /// Fetches the flight's object (with its neighbours, where the source
    /// can) into staged files, each checked, and answers the opens waiting
    /// for each from its staged file as soon as it is there
    /// ([`answer_early`](Self::answer_early); the ids entered in the
    /// [`verified`](Self::verified) table are added to `entered`, also on
    /// an error). Returns the staged files to publish: the object first,
    /// each with the name it was asked for (for a source with foreign
    /// names, not the digest the store gives the file). A source that
    /// fails on a neighbour after it brought the object: what it brought
    /// is kept, and the failure logged.
    fn fetch_staged(
        &self,
        flight: &Arc<Flight>,
        entered: &mut Vec<ObjectId>,
    ) -> Result<Vec<(ObjectId, StagedObject)>, String> {
        let (id, size, abandoned) = (&flight.id, flight.size, &flight.abandoned);
        let store = &*self.store;
        let mut group = self.source.group(store, id);
        if group.first() != Some(id) {
            group = vec![*id];
        }
        if group.len() > 1 {
            // Enter the flight under each neighbour no other flight has,
            // up to the first one that has one (the group must stay one
            // run of its pack).
            let mut state = self.state.lock().expect("fetch state lock");
            let keep = group[1..]
                .iter()
                .position(|n| state.inflight.contains_key(n) || store.has_object(n))
                .map_or(group.len(), |p| p + 1);
            group.truncate(keep);
            if !abandoned.load(Ordering::SeqCst) {
                for n in &group[1..] {
                    state.inflight.insert(*n, flight.clone());
                }
            }
        }
        // A single object goes through `stage_group` too where the source
        // has it (the source checks what it stages once, as the stager
        // hashes it; through `fetch`, its check and the stager's would be
        // two passes over the bytes), unless it comes in pieces: streamed
        // through `fetch`, an abandoned flight stops at its next write.
        if group.len() > 1 || self.source.chunks(id).is_none() {
            let mut got: Vec<(ObjectId, StagedObject)> = Vec::with_capacity(group.len());
            let r = self.source.stage_group(store, &group, &mut |s| {
                let name = s.id();
                // The store named each staged file by its digest: a file
                // named otherwise than asked is a neighbour the source
                // got wrong, and is dropped (never served, never stored).
                if !group.contains(&name) || got.iter().any(|(g, _)| *g == name) {
                    return;
                }
                let one = [(name, s)];
                if !abandoned.load(Ordering::SeqCst) {
                    entered.extend(self.answer_early(flight, &one));
                }
                let [one] = one;
                got.push(one);
            });
            if let Some(r) = r {
                let what = if group.len() > 1 {
                    format!("fetching object {id} with its neighbours")
                } else {
                    format!("fetching object {id}")
                };
                if abandoned.load(Ordering::SeqCst) {
                    return Err(format!(
                        "{what}: abandoned after the deadline; nothing stored"
                    ));
                }
                let at = got.iter().position(|(g, _)| g == id);
                match (r, at) {
                    (Err(e), None) => return Err(format!("{what}: {e}")),
                    (Ok(()), None) => return Err(format!("{what}: the source did not bring it")),
                    (Err(e), Some(_)) => tracing::warn!(
                        object = %id,
                        "{what}: {e}; keeping the {} object(s) checked before that",
                        got.len()
                    ),
                    (Ok(()), Some(_)) => {}
                }
                if let Some(at) = at {
                    got.swap(0, at);
                }
                return Ok(got);
            }
        }
        let stager = store
            .stage_object()
            .map_err(|e| format!("fetching object {id}: {e}"))?;
        let foreign = self.source.foreign_names();
        let mut w = StagerWriter {
            stager,
            limit: size,
            abandoned,
            error: None,
            sha256: foreign.then(Sha256::new),
        };
        let fetched = self.source.fetch(id, &mut w);
        if abandoned.load(Ordering::SeqCst) {
            return Err(format!(
                "fetching object {id}: abandoned after the deadline; nothing stored"
            ));
        }
        if let Some(e) = w.error.take() {
            return Err(format!("fetching object {id}: {e}; nothing stored"));
        }
        fetched.map_err(|e| format!("fetching object {id}: {e}; nothing stored"))?;
        let got = w.stager.len();
        if got != size {
            return Err(format!(
                "fetching object {id}: the source sent {got} bytes, the object has {size}; \
                 nothing stored"
            ));
        }
        let staged = w
            .stager
            .finish(store)
            .map_err(|e| format!("fetching object {id}: {e}"))?;
        if let Some(h) = w.sha256.take() {
            let sha: [u8; 32] = h.finalize().into();
            self.source
                .accept(id, &sha, &staged.id())
                .map_err(|e| format!("{e}; refused, nothing stored"))?;
        } else if staged.id() != *id {
            return Err(format!(
                "object {id}: the source sent {got} bytes whose fs-verity digest is {}; \
                 refused, nothing stored",
                staged.id()
            ));
        }
        let staged = vec![(*id, staged)];
        entered.extend(self.answer_early(flight, &staged));
        Ok(staged)
    }
}

/// The timer: abandons flights past their deadline.
fn timer(fetcher: Weak<Fetcher>) {
    loop {
        let Some(f) = fetcher.upgrade() else { return };
        let expired = {
            let mut state = f.state.lock().expect("fetch state lock");
            if state.stop {
                return;
            }
            let now = Instant::now();
            let mut expired: Vec<Arc<Flight>> = Vec::new();
            for fl in state.inflight.values() {
                if fl.deadline().is_some_and(|d| d <= now)
                    && !expired.iter().any(|e| Arc::ptr_eq(e, fl))
                {
                    expired.push(fl.clone());
                }
            }
            if expired.is_empty() {
                // Sleep to the next deadline (or a while, to notice the
                // fetcher going away), unless woken by a new flight.
                let next = state
                    .inflight
                    .values()
                    .filter_map(|fl| fl.deadline())
                    .min()
                    .map_or(Duration::from_secs(1), |d| {
                        d.saturating_duration_since(now).min(Duration::from_secs(1))
                    });
                drop(
                    f.timer_wake
                        .wait_timeout(state, next)
                        .expect("fetch state lock"),
                );
                continue;
            }
            for fl in &expired {
                fl.abandoned.store(true, Ordering::SeqCst);
            }
            state
                .inflight
                .retain(|_, fl| !fl.abandoned.load(Ordering::SeqCst));
            state
                .queue
                .retain(|fl| !fl.abandoned.load(Ordering::SeqCst));
            expired
        };
        for fl in expired {
            f.counters.timed_out.fetch_add(1, Ordering::Relaxed);
            let reason = format!(
                "fetching object {} timed out after {:.1}s",
                fl.id,
                f.timeout.as_secs_f64()
            );
            tracing::warn!(object = %fl.id, "{reason}");
            f.complete(&fl, Err(reason));
        }
    }
}

/// What the source writes into: the staged object, with a size limit and
/// the flight's abandonment checked at every write.
struct StagerWriter<'a> {
    stager: ObjectStager,
    limit: u64,
    abandoned: &'a AtomicBool,
    /// The first failure, kept to say what it was (the source may swallow
    /// the io::Error we return).
    error: Option<String>,
    /// For a source with foreign names: the sha256 of what was written.
    sha256: Option<Sha256>,
}

impl io::Write for StagerWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.abandoned.load(Ordering::SeqCst) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "fetch abandoned"));
        }
        if self.stager.len() + buf.len() as u64 > self.limit {
            let msg = format!(
                "the source sent more than the object's {} bytes",
                self.limit
            );
            self.error.get_or_insert(msg.clone());
            return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
        }
        if let Err(e) = self.stager.write(buf) {
            let msg = e.to_string();
            self.error.get_or_insert(msg.clone());
            return Err(io::Error::other(msg));
        }
        if let Some(h) = &mut self.sha256 {
            h.update(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl From<io::Error> for FetchError {
    fn from(e: io::Error) -> FetchError {
        FetchError::Io(e)
    }
}
