//! Objects served chunk by chunk while they are fetched: the partials of
//! missing large objects, shared by every open of one object, and those
//! the prefetch list starts before anything opens them (docs/lazy-fuse.md,
//! "Chunked reads of large objects").

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_store::ObjectId;

use super::{Handle, Server};
use crate::partial::{self, Partial};
use crate::proto::{open_flags, Reply};

impl Server {
    /// The partial of missing object `id` (joined, or started), if the
    /// source can fetch it chunk by chunk and fewer than
    /// [`partial::MAX_PARTIALS`] are served; counts a handle on it.
    pub(super) fn partial_for(&self, id: &ObjectId, size: u64) -> Option<Arc<Partial>> {
        self.partial_with(id, size, true, partial::MAX_PARTIALS)
    }

    /// Starts (or joins) a partial of missing object `id` for the chunks
    /// `chunks` a prefetch list names, and queues them: a later open finds
    /// them in. The partial is pinned (a handle never released) for the
    /// server's life, so that its chunks stay until it is opened; without
    /// `read_behind` it fetches only what the list and reads ask for. At
    /// most half the partials are taken so: returns false (nothing done)
    /// past that, or if the object is local, being fetched, or cannot be
    /// fetched chunk by chunk.
    pub(crate) fn prefetch_chunks(
        self: &Arc<Self>,
        id: &ObjectId,
        chunks: &[u32],
        read_behind: bool,
    ) -> bool {
        if crate::has_local(&self.store, self.fetcher.source(), id) || self.fetcher.in_flight(id) {
            return false;
        }
        let Some(size) = self.fetcher.source().size(id) else {
            return false;
        };
        let Some(p) = self.partial_with(id, size, read_behind, partial::MAX_PARTIALS / 2) else {
            return false;
        };
        p.want(self, chunks);
        true
    }

    pub(super) fn partial_with(
        &self,
        id: &ObjectId,
        size: u64,
        read_behind: bool,
        max: usize,
    ) -> Option<Arc<Partial>> {
        let mut map = self.fetcher.partials.lock().expect("partials lock");
        if let Some(p) = map.get(id) {
            if p.outcome() == partial::Outcome::Pending {
                p.add_handle();
                return Some(p.clone());
            }
            // Refused (or published and gone from the store since): a
            // new open starts afresh, as after any failed fetch.
            if p.idle() {
                map.remove(id);
            }
            return None;
        }
        if map.len() >= max {
            return None;
        }
        let starts = self.fetcher.source().chunks(id)?;
        if !partial::valid_starts(&starts, size) {
            if starts.len() > 1 {
                tracing::warn!(
                    object = %id,
                    "the source cuts object {id} ({size} bytes) in {} chunks that do not tile it;                      fetching it whole",
                    starts.len()
                );
            }
            return None;
        }
        match Partial::new(&self.store.tmp_dir(), *id, size, starts, read_behind) {
            Ok(p) => {
                let p = Arc::new(p);
                p.add_handle();
                map.insert(*id, p.clone());
                Some(p)
            }
            Err(e) => {
                tracing::warn!(
                    object = %id,
                    "staging object {id} for chunked reads in {}: {e}; fetching it whole",
                    self.store.tmp_dir().display()
                );
                None
            }
        }
    }

    /// Answers an OPEN of a missing object with a handle whose READs are
    /// served from its partial (no passthrough, the page cache kept: its
    /// bytes never change).
    pub(super) fn open_chunked(&self, unique: u64, node: u64, p: Arc<Partial>) {
        let fh = self.new_fh(node);
        {
            let mut nodes = self.nodes.lock().expect("nodes lock");
            let Some(n) = nodes.nodes.get_mut(&node) else {
                drop(nodes);
                if p.drop_handle() {
                    self.forget_partial_if_idle(&p.id);
                }
                self.reply(Reply::error(unique, libc::ENOENT));
                return;
            };
            n.opens += 1;
            n.chunked += 1;
            self.persist(node, n);
        }
        self.counters.chunked_opens.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().expect("handles lock").insert(
            fh,
            Handle {
                node,
                file: p.file.clone(),
                partial: Some(p),
            },
        );
        if !self.reply(Reply::ok(unique).open(fh, open_flags::KEEP_CACHE, 0)) {
            self.release(fh);
        }
    }

    /// Drops the partial of `id` from the table if nothing holds it.
    pub fn forget_partial_if_idle(&self, id: &ObjectId) {
        self.fetcher.forget_partial_if_idle(id);
    }

    /// Starts (once) the thread that fails chunked reads waiting past
    /// their deadline; it holds the server weakly and ends with it.
    pub fn start_partial_timer(self: &Arc<Self>) {
        if self.partial_timer.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("cairn-chunk-timer".into())
            .spawn(move || loop {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let Some(server) = weak.upgrade() else { return };
                let partials: Vec<Arc<Partial>> = server
                    .fetcher
                    .partials
                    .lock()
                    .expect("partials lock")
                    .values()
                    .cloned()
                    .collect();
                let now = std::time::Instant::now();
                for p in partials {
                    p.expire(&server, now);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("starting the chunked read timer: {e}");
            self.partial_timer.store(false, Ordering::SeqCst);
        }
    }
}
