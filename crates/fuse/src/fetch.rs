//! Fetching missing objects: one fetch in flight per object, a bounded
//! number of fetches at once, a deadline for everyone who waits, and
//! nothing published that does not hash to the object's name.
//!
//! An open of a missing object joins the object's *flight* (or starts one).
//! The flight runs on a thread of its own: it takes the store lock shared
//! (so garbage collection cannot run between publication and use), stages
//! what the source writes with [`Store::stage_object`] (never more than the
//! size the object was looked up with), hashes it as it goes, and publishes
//! it with [`Store::publish_staged`] only if the fs-verity digest is the
//! object's id. Waiters wait on the flight until their deadline; at the
//! deadline the flight is *abandoned*: taken out of the table (so the next
//! open starts a new one), and its writer refuses further bytes, so a
//! source that still writes stops at its next write. A source that blocks
//! without writing keeps its thread until it returns; such threads are
//! counted against `max_fetches`, so they cannot pile up without bound.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cairn_store::{ObjectId, ObjectStager, Store};

use crate::{FetchError, ObjectSource};

/// How one flight ended.
#[derive(Debug, Clone)]
enum Outcome {
    Running,
    /// Published (or found in the store).
    Ok,
    /// Failed; the reason was logged by the flight.
    Failed(String),
}

#[derive(Debug)]
struct Flight {
    outcome: Mutex<Outcome>,
    done: Condvar,
    abandoned: AtomicBool,
}

/// Counters, read by [`crate::Stats`].
#[derive(Debug, Default)]
pub(crate) struct FetchCounters {
    pub started: AtomicU64,
    pub published: AtomicU64,
    pub failed: AtomicU64,
    pub timed_out: AtomicU64,
}

/// The fetches of one server.
pub(crate) struct Fetcher {
    store: Arc<Store>,
    source: Arc<dyn ObjectSource>,
    timeout: Duration,
    max_fetches: usize,
    inflight: Mutex<HashMap<ObjectId, Arc<Flight>>>,
    /// Fetch threads alive (including abandoned ones still blocked in the
    /// source), at most `max_fetches`.
    running: Mutex<usize>,
    slot_freed: Condvar,
    pub counters: FetchCounters,
}

impl Fetcher {
    pub fn new(
        store: Arc<Store>,
        source: Arc<dyn ObjectSource>,
        timeout: Duration,
        max_fetches: usize,
    ) -> Fetcher {
        Fetcher {
            store,
            source,
            timeout,
            max_fetches: max_fetches.max(1),
            inflight: Mutex::new(HashMap::new()),
            running: Mutex::new(0),
            slot_freed: Condvar::new(),
            counters: FetchCounters::default(),
        }
    }

    pub fn source(&self) -> &dyn ObjectSource {
        &*self.source
    }

    /// Makes sure `id` (of `size` bytes) is in the store, fetching it if
    /// needed; returns when it is, or with an error by the deadline.
    pub fn ensure(self: &Arc<Self>, id: &ObjectId, size: u64) -> Result<(), String> {
        if self.store.has_object(id) {
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        let (flight, leader) = {
            let mut map = self.inflight.lock().expect("fetch table lock");
            match map.get(id) {
                Some(f) => (f.clone(), false),
                None => {
                    let f = Arc::new(Flight {
                        outcome: Mutex::new(Outcome::Running),
                        done: Condvar::new(),
                        abandoned: AtomicBool::new(false),
                    });
                    map.insert(*id, f.clone());
                    (f, true)
                }
            }
        };
        if leader {
            if let Err(reason) = self.launch(id, size, &flight, deadline) {
                self.finish(id, &flight, Outcome::Failed(reason.clone()));
                return Err(reason);
            }
        }
        let mut outcome = flight.outcome.lock().expect("flight lock");
        loop {
            match &*outcome {
                Outcome::Ok => return Ok(()),
                Outcome::Failed(r) => return Err(r.clone()),
                Outcome::Running => {}
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            outcome = flight
                .done
                .wait_timeout(outcome, deadline - now)
                .expect("flight lock")
                .0;
        }
        drop(outcome);
        // Timed out: abandon the flight so the next open starts afresh.
        flight.abandoned.store(true, Ordering::SeqCst);
        self.forget_flight(id, &flight);
        self.counters.timed_out.fetch_add(1, Ordering::Relaxed);
        let reason = format!(
            "fetching object {id} timed out after {:.1}s",
            self.timeout.as_secs_f64()
        );
        tracing::warn!(object = %id, "{reason}");
        Err(reason)
    }

    /// Takes a fetch slot (waiting for one until `deadline`) and starts the
    /// flight's thread.
    fn launch(
        self: &Arc<Self>,
        id: &ObjectId,
        size: u64,
        flight: &Arc<Flight>,
        deadline: Instant,
    ) -> Result<(), String> {
        {
            let mut running = self.running.lock().expect("fetch slots lock");
            while *running >= self.max_fetches {
                let now = Instant::now();
                if now >= deadline {
                    let reason = format!(
                        "fetching object {id}: {} fetches already in flight (the limit)",
                        self.max_fetches
                    );
                    tracing::warn!(object = %id, "{reason}");
                    return Err(reason);
                }
                running = self
                    .slot_freed
                    .wait_timeout(running, deadline - now)
                    .expect("fetch slots lock")
                    .0;
            }
            *running += 1;
        }
        self.counters.started.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        let flight = flight.clone();
        let id = *id;
        let spawned = std::thread::Builder::new()
            .name(format!("cairn-fetch-{}", &id.to_hex()[..8]))
            .spawn(move || {
                let result = me.fetch_and_publish(&id, size, &flight.abandoned);
                let outcome = match result {
                    Ok(()) => {
                        me.counters.published.fetch_add(1, Ordering::Relaxed);
                        Outcome::Ok
                    }
                    Err(reason) => {
                        me.counters.failed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(object = %id, "{reason}");
                        Outcome::Failed(reason)
                    }
                };
                me.finish(&id, &flight, outcome);
                *me.running.lock().expect("fetch slots lock") -= 1;
                me.slot_freed.notify_one();
            });
        if let Err(e) = spawned {
            *self.running.lock().expect("fetch slots lock") -= 1;
            self.slot_freed.notify_one();
            return Err(format!("fetching object {id}: starting a thread: {e}"));
        }
        Ok(())
    }

    fn finish(&self, id: &ObjectId, flight: &Arc<Flight>, outcome: Outcome) {
        // Out of the table first: a waiter woken by the outcome may return
        // and its caller open again at once, and that open must start a new
        // flight, not find this finished one.
        self.forget_flight(id, flight);
        *flight.outcome.lock().expect("flight lock") = outcome;
        flight.done.notify_all();
    }

    /// Removes `flight` from the table if it is still the object's flight.
    fn forget_flight(&self, id: &ObjectId, flight: &Arc<Flight>) {
        let mut map = self.inflight.lock().expect("fetch table lock");
        if map.get(id).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            map.remove(id);
        }
    }

    /// The flight's work: fetch into a staged file, verify, publish.
    fn fetch_and_publish(
        &self,
        id: &ObjectId,
        size: u64,
        abandoned: &AtomicBool,
    ) -> Result<(), String> {
        let store = &*self.store;
        // Shared, as every writer holds it: gc cannot run while we publish.
        let _lock = store
            .lock_shared()
            .map_err(|e| format!("fetching object {id}: {e}"))?;
        if store.has_object(id) {
            return Ok(());
        }
        let stager = store
            .stage_object()
            .map_err(|e| format!("fetching object {id}: {e}"))?;
        let mut w = StagerWriter {
            stager,
            limit: size,
            abandoned,
            error: None,
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
        let staged = w
            .stager
            .finish(store)
            .map_err(|e| format!("fetching object {id}: {e}"))?;
        if staged.id() != *id {
            return Err(format!(
                "object {id}: the source sent {got} bytes whose fs-verity digest is {}; \
                 refused, nothing stored",
                staged.id()
            ));
        }
        store
            .publish_staged([staged])
            .map_err(|e| format!("publishing object {id}: {e}"))?;
        Ok(())
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
