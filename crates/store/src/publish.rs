//! Publication of a layer's objects by the threads that stage them.
//!
//! [`Store::publish_staged`] publishes a whole layer at the end, renaming
//! each staged file into `objects/` from one thread. On ext4 a rename
//! between two directories takes the filesystem's rename lock, so that pass
//! is serial whatever the number of threads: 78,600 renames took 6.8-8.2 s
//! of a Linux-tree import. A [`Publisher`] instead lets each object worker
//! publish its own objects while the layer streams:
//!
//! 1. an object is staged as an *unnamed* file: `O_TMPFILE` in the worker's
//!    staging directory (same filesystem as `objects/`), kept open;
//! 2. once a `syncfs(2)` that *began after the file was complete* has
//!    returned, its content is durable, and the worker gives it its name
//!    with `linkat(fd, "", objects/ab, "cdef…", AT_EMPTY_PATH)` (never
//!    replacing: `EEXIST` means another writer published the same content,
//!    and ours is dropped). A link takes the target directory's lock only,
//!    so two workers link in parallel unless they hit the same fan-out
//!    directory.
//!
//! The syncs are counted ([`SyncClock`]): each object carries the number of
//! syncs begun when it was complete (its *ticket*), and sync number `k`
//! makes every object with a ticket below `k` durable. The syncs come from
//! the import's flusher (every 64 MiB staged) and, when a worker holds as
//! many unnamed files as its budget allows, from that worker (at most one
//! sync runs at a time; a worker that needs one while another runs waits
//! for the next). [`Publisher::finish`] syncs once more for what is left,
//! links it, and makes the new names durable (one `syncfs`, or an fsync of
//! each changed fan-out directory when there are few).
//!
//! Open files are bounded: [`open_file_budget`] raises the soft
//! `RLIMIT_NOFILE` to the hard limit once per process and lets every
//! publisher of the process together hold at most a quarter of it; each
//! worker's share is its publisher's budget divided by the workers.
//!
//! Invariants (as for [`Store::publish_staged`]): no name appears in
//! `objects/` before its content is on disk, and never a name whose content
//! does not match it. A crash or `kill -9` at any point leaves only
//! complete, durable objects under names: the unnamed files vanish with the
//! process (the kernel frees an unlinked inode when its last descriptor
//! closes). What differs: a failed import may leave some of its objects
//! published (complete, unreferenced: gc removes them), where the serial
//! pass left none. The layer record is committed after
//! [`Publisher::finish`] only.
//!
//! Where the store's filesystem has fs-verity, objects must be closed to be
//! sealed, which an unnamed file cannot be: the publisher then stages named
//! files and leaves them to [`Store::publish_staged`], as before. It does
//! the same where `O_TMPFILE` or the link fails when it is probed.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::object::{entries_estimate, fanout_tail, list_fanout, listing_pays, Fanouts};
use crate::record::{ObjectStager, StagedObject, SYNCFS_DIRS};
use crate::tmp::{sync_dir, Persisted, Staging, TmpFile};
use crate::verity::ObjectId;
use crate::{Store, StoreError};

/// Most unnamed files one publisher holds open, whatever the limit.
pub const MAX_LAYER_OPEN_FILES: usize = 4096;

/// The fan-out directories stay open only when the budget is at least
/// this (a soft limit of 2048 or more): else each is opened per link.
const KEEP_DIRS_BUDGET: usize = 512;

/// Unnamed files all publishers of the process hold open now.
static OPEN_FILES: AtomicUsize = AtomicUsize::new(0);

/// How many unnamed files the publishers of this process may hold open
/// together: a quarter of the soft `RLIMIT_NOFILE`, raised to the hard
/// limit the first time (so that a layer of 80k objects needs a few
/// dozen syncs, not hundreds), and at least 8.
pub fn open_file_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let lim = getrlimit(Resource::Nofile);
        let mut soft = lim.current.unwrap_or(u64::MAX);
        if lim.current != lim.maximum {
            let raised = Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            };
            if setrlimit(Resource::Nofile, raised).is_ok() {
                soft = lim.maximum.unwrap_or(u64::MAX);
            }
        }
        usize::try_from(soft / 4).unwrap_or(usize::MAX).max(8)
    })
}

/// Most descriptors [`reserve_descriptors`] makes room for: three layers'
/// budgets and their fan-out directories, with room to spare.
const RESERVED_DESCRIPTORS: usize = 16 * 1024;

/// Grows the process's descriptor table, once, to what imports will use:
/// the open-file budget plus some, at most [`RESERVED_DESCRIPTORS`]. Call
/// it before any thread starts. The kernel grows the table by doublings
/// as descriptors are opened (7 of them from 64 to 8192), and once
/// threads share the table each growth waits for an RCU grace period,
/// during which no thread of the process can open a file: object workers
/// were blocked 110 ms in all during a 1 s pull of the python image. In a
/// process of one thread the growth costs no wait. Best effort: a table
/// that cannot grow now grows later, as it would have. Returns the
/// descriptor it opened and closed to grow the table, if it did.
pub fn reserve_descriptors() -> Option<i32> {
    use rustix::fs::{open, Mode, OFlags};
    use rustix::io::fcntl_dupfd_cloexec;
    let want = open_file_budget()
        .saturating_add(1024)
        .min(RESERVED_DESCRIPTORS);
    let root = open("/", OFlags::PATH | OFlags::CLOEXEC, Mode::empty()).ok()?;
    // The lowest free descriptor from `want - 1` on: that one, as nothing
    // above it is open yet. Closed at once; the table keeps its size.
    let high = fcntl_dupfd_cloexec(&root, want.saturating_sub(1) as i32).ok()?;
    Some(std::os::fd::AsRawFd::as_raw_fd(&high))
}

/// Counts `syncfs(2)` calls: see the module docs.
#[derive(Debug, Default)]
struct SyncClock {
    state: Mutex<Clock>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct Clock {
    /// Syncs begun.
    started: u64,
    /// The number of the last sync that returned successfully.
    completed: u64,
    running: bool,
}

impl SyncClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ticket of a file complete now: the syncs begun so far.
    fn ticket(&self) -> u64 {
        self.lock().started
    }

    /// The number of the last sync that returned.
    fn completed(&self) -> u64 {
        self.lock().completed
    }

    /// Returns once a sync numbered above `ticket` has returned, running
    /// one if none is under way (else waiting for the one that is, and
    /// then maybe running the next).
    fn sync_covering(&self, ticket: u64, fs: &File) -> io::Result<()> {
        let mut st = self.lock();
        loop {
            if st.completed > ticket {
                return Ok(());
            }
            if st.running {
                st = self.done.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            st.running = true;
            st.started += 1;
            let me = st.started;
            drop(st);
            let r = rustix::fs::syncfs(fs);
            st = self.lock();
            st.running = false;
            if r.is_ok() && me > st.completed {
                st.completed = me;
            }
            self.done.notify_all();
            r?;
        }
    }
}

/// A staged unnamed object waiting for a sync, then its name.
#[derive(Debug)]
struct Pending {
    id: ObjectId,
    tmp: TmpFile,
    ticket: u64,
    _open: OpenFile,
}

/// One unnamed file counted in [`OPEN_FILES`] until dropped.
#[derive(Debug)]
struct OpenFile;

impl OpenFile {
    fn new() -> OpenFile {
        OPEN_FILES.fetch_add(1, Ordering::Relaxed);
        OpenFile
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        OPEN_FILES.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a publisher knows of the names in one fan-out directory, to tell
/// whether an object it staged is in the store already (then the staged
/// copy is dropped before a sync writes it out).
///
/// A `statat` per object was 6% of a Linux-tree pull's CPU (78,600
/// objects, all new): the kernel searching the directory's index for a
/// name that is not there. So, as [`crate::ObjectLookup::first_missing`]
/// does, a directory is listed once the objects asked about in it are a
/// sixteenth of its estimated entries: at the fourth object in an empty
/// or new directory, never for a few objects in a large store. A listing
/// is a snapshot: an object another process links after it is not in it,
/// so this publisher stages and syncs its own copy, whose link then finds
/// the name taken (`EEXIST`) and drops it, as when two imports race
/// today. The objects this publisher links are added as it links them.
#[derive(Debug)]
enum Known {
    /// Not listed (yet): each object is looked up by name.
    Lookups {
        /// Objects asked about so far.
        asked: u64,
        /// The directory's estimated entries, once its size was read.
        entries: Option<u64>,
    },
    /// Listed: the names of regular files in it, and names whose type the
    /// listing did not give (a lookup decides those).
    Listed {
        names: HashSet<[u8; 31]>,
        unknown: Vec<[u8; 31]>,
    },
}

impl Default for Known {
    fn default() -> Known {
        Known::Lookups {
            asked: 0,
            entries: None,
        }
    }
}

#[derive(Debug)]
struct Inner<'s> {
    store: &'s Store,
    /// The store's staging directory: where shards are made, and the
    /// descriptor `syncfs` is called on.
    staging: Arc<Staging>,
    clock: SyncClock,
    /// Whether objects are staged unnamed and linked by the workers.
    anonymous: bool,
    /// Unnamed files one shard may hold.
    per_shard: usize,
    /// The objects this publisher's shards hold unnamed (at most their
    /// budget). A second copy in the same layer (a file the layer holds
    /// twice) is dropped when it is complete, before a sync writes it out:
    /// else it would be written, synced, found present at its link, and
    /// its blocks freed again (a discard, where the filesystem is mounted
    /// `discard`). A copy completed after the first is linked is dropped
    /// by [`ObjectStager::finish`], which finds the object in the store.
    unnamed: Mutex<HashSet<ObjectId>>,
    /// Each fan-out directory, once opened (and made if missing).
    dirs: Mutex<Vec<Option<Arc<File>>>>,
    /// What this publisher knows of each fan-out directory's names.
    known: Vec<Mutex<Known>>,
    /// Fan-out directories that got a new name.
    changed: Fanouts,
    /// Whether a fan-out directory was made (`objects/` changed).
    new_fanout: AtomicBool,
    /// Objects linked by this publisher.
    linked: AtomicUsize,
    /// What shards left unlinked when they ended.
    leftovers: Mutex<Vec<Pending>>,
    /// Whether the caller said every object is staged (see
    /// [`Publisher::staging_done`]).
    staging_done: AtomicBool,
    /// The first error a shard met while publishing (reported by
    /// [`Publisher::finish`]).
    failed: Mutex<Option<StoreError>>,
}

/// Publishes a layer's objects from the threads that stage them: see the
/// module docs. Make one per layer with [`Store::publisher`], one
/// [`PublishShard`] per thread, and call [`finish`](Self::finish) after
/// every shard is dropped and before anything names the objects.
#[derive(Debug, Clone)]
pub struct Publisher<'s>(Arc<Inner<'s>>);

impl Store {
    /// A [`Publisher`] for `shards` threads.
    pub fn publisher(&self, shards: usize) -> Result<Publisher<'_>, StoreError> {
        let staging = self.staging()?;
        let anonymous = !self.verity_supported() && self.probe_anonymous(&staging);
        let budget = open_file_budget().min(MAX_LAYER_OPEN_FILES);
        let per_shard = (budget / shards.max(1)).max(1);
        Ok(Publisher(Arc::new(Inner {
            store: self,
            staging,
            clock: SyncClock::default(),
            anonymous,
            per_shard,
            unnamed: Mutex::new(HashSet::new()),
            dirs: Mutex::new((0..256).map(|_| None).collect()),
            known: (0..256).map(|_| Mutex::new(Known::default())).collect(),
            changed: Fanouts::default(),
            new_fanout: AtomicBool::new(false),
            linked: AtomicUsize::new(0),
            leftovers: Mutex::new(Vec::new()),
            staging_done: AtomicBool::new(false),
            failed: Mutex::new(None),
        })))
    }

    /// Whether unnamed files can be made and linked here: one is made in
    /// the staging directory, linked there and removed (once per store).
    fn probe_anonymous(&self, staging: &Arc<Staging>) -> bool {
        // For measurements: the named files and one rename pass of before.
        if std::env::var_os("CAIRN_NO_TMPFILE").is_some() {
            return false;
        }
        *self.anonymous.get_or_init(|| {
            let Ok(tmp) = staging.anon_file(0o600) else {
                return false;
            };
            let name = format!("probe.{}", std::process::id());
            let path = staging.path().join(&name);
            let ok = matches!(
                tmp.link_at(staging.dir(), Path::new(&name), &path),
                Ok(Persisted::Created)
            );
            let _ = fs::remove_file(&path);
            ok
        })
    }
}

impl<'s> Publisher<'s> {
    /// Whether objects are linked by the shards (else they come back
    /// named, for [`Store::publish_staged`]).
    pub fn is_anonymous(&self) -> bool {
        self.0.anonymous
    }

    /// Unnamed files one shard may hold open.
    pub fn per_shard(&self) -> usize {
        self.0.per_shard
    }

    /// A shard for one thread, staging in a directory of its own (or, if
    /// that cannot be made, in the store's).
    pub fn shard(&self) -> PublishShard<'s> {
        PublishShard {
            publisher: self.clone(),
            staging: self.0.staging.shard().ok(),
            pending: Vec::new(),
        }
    }

    /// Says that every object is staged and the import goes on: the
    /// shards' [`publish_all`](PublishShard::publish_all) links their last
    /// objects (without it, as when an import fails, it does nothing and
    /// the unnamed files are dropped).
    pub fn staging_done(&self) {
        self.0.staging_done.store(true, Ordering::Release);
    }

    /// Syncs the filesystem now (or waits for a sync begun after this call):
    /// every object complete before the call becomes linkable.
    pub fn sync(&self) -> Result<(), StoreError> {
        let ticket = self.0.clock.ticket();
        self.sync_covering(ticket)
    }

    fn sync_covering(&self, ticket: u64) -> Result<(), StoreError> {
        let s = &self.0;
        s.clock
            .sync_covering(ticket, s.staging.dir())
            .map_err(|e| StoreError::io("syncing", s.staging.path(), &s.store.root, e))
    }

    fn fail(&self, e: StoreError) {
        let mut f = self.0.failed.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some(e);
        }
    }

    /// Whether the store has the object already: looked up in its fan-out
    /// directory's descriptor, which the link will use too, rather than by
    /// a path walked from `/` for every object of the layer; or, once this
    /// publisher has asked about enough objects of that directory, in one
    /// listing of it (see [`Known`]).
    fn has_object(&self, id: &ObjectId) -> bool {
        let store = self.0.store;
        let b = id.0[0];
        if !store.fanouts().has(b) {
            return false;
        }
        let dir = match self.fanout_dir(b) {
            Ok(dir) => dir,
            Err(_) => return store.has_object(id),
        };
        let tail = fanout_tail(id);
        let mut known = self.0.known[b as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Known::Lookups { asked, entries } = &mut *known {
            *asked += 1;
            let estimate = *entries.get_or_insert_with(|| {
                rustix::fs::fstat(&*dir).map_or(u64::MAX, |st| {
                    entries_estimate(u64::try_from(st.st_size).unwrap_or(u64::MAX))
                })
            });
            if listing_pays(*asked, estimate) {
                let path = store.objects_dir().join(format!("{b:02x}"));
                match list_fanout(&path) {
                    Some(l) => {
                        *known = Known::Listed {
                            names: l.regular.into_iter().collect(),
                            unknown: l.unknown,
                        }
                    }
                    // Not listable (e.g. EMFILE): looked up by name from
                    // now on, not listed again for every later object.
                    None => *entries = Some(u64::MAX),
                }
            }
        }
        let look_up = match &*known {
            Known::Listed { names, unknown } => {
                if names.contains(&tail) {
                    return true;
                }
                unknown.binary_search(&tail).is_ok()
            }
            Known::Lookups { .. } => true,
        };
        drop(known);
        look_up && crate::object::object_in(&dir, id)
    }

    /// Notes that the object is in the store now (this publisher linked it,
    /// or found it there when linking).
    fn note_present(&self, id: &ObjectId) {
        let mut known = self.0.known[id.0[0] as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Known::Listed { names, .. } = &mut *known {
            names.insert(fanout_tail(id));
        }
    }

    /// The fan-out directory of `b`, opened once (and made if missing).
    fn fanout_dir(&self, b: u8) -> Result<Arc<File>, StoreError> {
        let s = &self.0;
        let mut dirs = s.dirs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = &dirs[b as usize] {
            return Ok(Arc::clone(d));
        }
        let store = s.store;
        let fanout = store.objects_dir().join(format!("{b:02x}"));
        match fs::DirBuilder::new().mode(0o755).create(&fanout) {
            Ok(()) => {
                fs::set_permissions(&fanout, fs::Permissions::from_mode(0o755))
                    .map_err(|e| StoreError::io("setting mode of", &fanout, &store.root, e))?;
                s.new_fanout.store(true, Ordering::Relaxed);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::io("creating", &fanout, &store.root, e)),
        }
        store.fanouts().set(b);
        let dir =
            File::open(&fanout).map_err(|e| StoreError::io("opening", &fanout, &store.root, e))?;
        let dir = Arc::new(dir);
        // Kept open (256 at most) unless descriptors are scarce.
        if open_file_budget() >= KEEP_DIRS_BUDGET {
            dirs[b as usize] = Some(Arc::clone(&dir));
        }
        Ok(dir)
    }

    /// Names one durable unnamed object.
    fn link(&self, p: Pending) -> Result<(), StoreError> {
        let b = p.id.0[0];
        let dir = self.fanout_dir(b)?;
        let hex = p.id.to_hex();
        let name = Path::new(&hex[2..]);
        let dest = self.0.store.object_path(&p.id);
        // The count goes when the file is linked or dropped.
        let Pending { id, tmp, _open, .. } = p;
        let linked = tmp.link_at(&*dir, name, &dest)?;
        if linked == Persisted::Created {
            self.0.changed.set(b);
            self.0.linked.fetch_add(1, Ordering::Relaxed);
        }
        self.note_present(&id);
        (self.0.unnamed.lock())
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        Ok(())
    }

    /// Links what the shards left, then makes every new name durable.
    /// Returns how many objects this publisher linked. Call it once every
    /// shard is dropped.
    pub fn finish(&self) -> Result<usize, StoreError> {
        let s = &self.0;
        if let Some(e) = s.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        let left = std::mem::take(&mut *s.leftovers.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(last) = left.iter().map(|p| p.ticket).max() {
            self.sync_covering(last)?;
        }
        for p in left {
            self.link(p)?;
        }
        let changed: Vec<u8> = (0..=255u8).filter(|&b| s.changed.has(b)).collect();
        let store = s.store;
        if changed.len() > SYNCFS_DIRS {
            self.sync()?;
        } else {
            if s.new_fanout.load(Ordering::Relaxed) {
                sync_dir(&store.objects_dir(), &store.root)?;
            }
            for b in changed {
                let dir = self.fanout_dir(b)?;
                dir.sync_all().map_err(|e| {
                    StoreError::io(
                        "syncing directory",
                        &store.objects_dir().join(format!("{b:02x}")),
                        &store.root,
                        e,
                    )
                })?;
            }
        }
        Ok(s.linked.load(Ordering::Relaxed))
    }
}

/// One thread's side of a [`Publisher`]: stages objects and links them
/// once they are durable. Dropped, it hands what it still holds to the
/// publisher's [`finish`](Publisher::finish).
#[derive(Debug)]
pub struct PublishShard<'s> {
    publisher: Publisher<'s>,
    staging: Option<Arc<Staging>>,
    /// Unnamed objects waiting for a sync, in ticket order.
    pending: Vec<Pending>,
}

impl PublishShard<'_> {
    /// Starts staging an object (as [`Store::stage_object`]).
    pub fn stage_object(&self) -> Result<ObjectStager, StoreError> {
        let staging = match &self.staging {
            Some(s) => Arc::clone(s),
            None => self.publisher.0.store.staging()?,
        };
        ObjectStager::new_in(&staging, self.publisher.0.anonymous)
    }

    /// Completes an object (as [`ObjectStager::finish`]). An unnamed one
    /// stays with the shard, to be linked once durable: the result then
    /// holds no file, and [`Store::publish_staged`] skips it. When the
    /// shard holds its budget, this syncs and links them all first.
    pub fn finish(&mut self, stager: ObjectStager) -> Result<StagedObject, StoreError> {
        let publisher = &self.publisher;
        let mut staged = stager.finish_with(|id| publisher.has_object(id))?;
        if staged.tmp.as_ref().is_some_and(TmpFile::is_anonymous) {
            let tmp = staged.tmp.take().expect("checked");
            let first = (self.publisher.0.unnamed.lock())
                .unwrap_or_else(|p| p.into_inner())
                .insert(staged.id);
            if !first {
                // Another shard of this layer holds (or linked) the same
                // content: this copy goes now, unnamed and unsynced.
                drop(tmp);
                return Ok(staged);
            }
            self.pending.push(Pending {
                id: staged.id,
                tmp,
                ticket: self.publisher.0.clock.ticket(),
                _open: OpenFile::new(),
            });
            if self.pending.len() >= self.publisher.0.per_shard
                || OPEN_FILES.load(Ordering::Relaxed) >= open_file_budget()
            {
                self.publish_ready();
            }
        }
        Ok(staged)
    }

    /// Unnamed objects held now.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Links every object a finished sync made durable; when the shard
    /// holds its budget (or the process all it may), syncs first and links
    /// them all. Returns whether the caller should ask for a sync soon
    /// (half the budget held). Errors are kept for
    /// [`Publisher::finish`]: the objects stay unnamed.
    pub fn publish_ready(&mut self) -> bool {
        if self.pending.is_empty() {
            return false;
        }
        let publisher = self.publisher.clone();
        let per_shard = publisher.0.per_shard;
        if self.pending.len() >= per_shard
            || OPEN_FILES.load(Ordering::Relaxed) >= open_file_budget()
        {
            let last = self.pending.last().map_or(0, |p| p.ticket);
            if let Err(e) = publisher.sync_covering(last) {
                publisher.fail(e);
                // Nothing can be linked; keep holding no more than this.
                self.pending.clear();
                return false;
            }
        }
        let completed = publisher.0.clock.completed();
        let ready = self.pending.partition_point(|p| p.ticket < completed);
        for p in self.pending.drain(..ready) {
            if let Err(e) = publisher.link(p) {
                publisher.fail(e);
            }
        }
        self.pending.len() * 2 >= per_shard
    }
}

impl PublishShard<'_> {
    /// Once [`Publisher::staging_done`] was called: syncs (or waits for a
    /// sync that covers them) and links everything the shard holds: its
    /// thread's last work, so that the threads name
    /// their last objects in parallel rather than [`Publisher::finish`]
    /// alone. Errors are kept for [`Publisher::finish`].
    pub fn publish_all(&mut self) {
        if !self.publisher.0.staging_done.load(Ordering::Acquire) {
            return;
        }
        let Some(last) = self.pending.last().map(|p| p.ticket) else {
            return;
        };
        let publisher = self.publisher.clone();
        if let Err(e) = publisher.sync_covering(last) {
            publisher.fail(e);
            self.pending.clear();
            return;
        }
        for p in self.pending.drain(..) {
            if let Err(e) = publisher.link(p) {
                publisher.fail(e);
            }
        }
    }
}

impl Drop for PublishShard<'_> {
    fn drop(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut left = self
            .publisher
            .0
            .leftovers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        left.append(&mut self.pending);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reservation leaves no descriptor open (the table keeps its size,
    /// which /proc does not show). It may only decline where the soft
    /// limit is below the descriptor it would need.
    #[test]
    fn reserving_descriptors_leaves_none_open() {
        let want = open_file_budget()
            .saturating_add(1024)
            .min(RESERVED_DESCRIPTORS);
        let Some(fd) = reserve_descriptors() else {
            let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
            assert!(
                soft.is_some_and(|s| s < want as u64),
                "declined with a soft limit of {soft:?} (needs {want})"
            );
            return;
        };
        assert_eq!(fd as usize, want - 1);
        let path = format!("/proc/self/fd/{fd}");
        assert!(fs::symlink_metadata(&path).is_err(), "{path} is open");
    }

    /// A layer that holds the same content twice, staged by two shards:
    /// the second copy is dropped as it completes (it never waits for a
    /// sync), and the object is published once, whole.
    #[test]
    fn a_second_copy_in_a_layer_is_dropped_before_any_sync() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap();
        let publisher = store.publisher(2).unwrap();
        let (mut a, mut b) = (publisher.shard(), publisher.shard());
        let data = b"the same content, twice in one layer\n".repeat(100);
        let stage = |shard: &mut PublishShard<'_>| {
            let mut stager = shard.stage_object().unwrap();
            stager.write(&data).unwrap();
            shard.finish(stager).unwrap()
        };
        let first = stage(&mut a);
        let second = stage(&mut b);
        assert_eq!(first.id, second.id);
        // Unnamed files are used wherever the store has no fs-verity.
        assert!(publisher.0.anonymous || store.verity_supported());
        if publisher.0.anonymous {
            assert_eq!(a.pending(), 1, "the first copy waits for a sync");
            assert_eq!(b.pending(), 0, "the second copy is gone");
            // Once the first copy is linked, a third copy finds the object
            // in the store and is dropped too.
            publisher
                .sync_covering(a.pending.last().unwrap().ticket)
                .unwrap();
            a.publish_ready();
            assert_eq!(a.pending(), 0);
            assert!(publisher.0.unnamed.lock().unwrap().is_empty());
            assert_eq!(stage(&mut b).id, first.id);
            assert_eq!(b.pending(), 0);
        }
        // A different object on the second shard is kept.
        let mut stager = b.stage_object().unwrap();
        stager.write(b"other").unwrap();
        let other = b.finish(stager).unwrap();
        publisher.staging_done();
        a.publish_all();
        b.publish_all();
        drop((a, b));
        let ids = [first.id, other.id];
        publisher.finish().unwrap();
        store.publish_staged([first, second, other]).unwrap();
        assert_eq!(fs::read(store.object_path(&ids[0])).unwrap(), data);
        assert_eq!(fs::read(store.object_path(&ids[1])).unwrap(), b"other");
    }

    fn fanout_id(b: u8, i: u8) -> ObjectId {
        let mut id = [0u8; 32];
        id[0] = b;
        id[31] = i;
        ObjectId(id)
    }

    /// Asked about enough objects of one fan-out directory, a publisher
    /// lists it once and answers from the listing, as the lookups did;
    /// what it links later counts as present.
    #[test]
    fn a_fanout_asked_about_enough_is_listed_once_and_agrees_with_lookups() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap();
        let ids: Vec<ObjectId> = (0..40).map(|i| fanout_id(0xab, i)).collect();
        fs::create_dir_all(store.objects_dir().join("ab")).unwrap();
        for id in ids.iter().step_by(2) {
            fs::write(store.object_path(id), b"x").unwrap();
        }
        // Not a regular file: not an object, listed or looked up.
        fs::create_dir(store.object_path(&fanout_id(0xab, 41))).unwrap();
        let publisher = store.publisher(1).unwrap();
        let known =
            |p: &Publisher<'_>| matches!(*p.0.known[0xab].lock().unwrap(), Known::Listed { .. });
        assert!(!publisher.has_object(&ids[1]));
        assert!(!known(&publisher), "listed after one lookup");
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(publisher.has_object(id), i % 2 == 0, "{id}");
        }
        assert!(known(&publisher), "never listed");
        assert!(!publisher.has_object(&fanout_id(0xab, 41)));
        // A fan-out directory that does not exist is not looked at.
        assert!(!publisher.has_object(&fanout_id(0xcd, 0)));
        publisher.note_present(&ids[1]);
        assert!(publisher.has_object(&ids[1]));
        // In a larger directory a few lookups do not list it (the store
        // opened again: the first one knows its fan-outs from before).
        let many: Vec<ObjectId> = (0..=255).map(|i| fanout_id(0x12, i)).collect();
        fs::create_dir_all(store.objects_dir().join("12")).unwrap();
        for id in &many {
            fs::write(store.object_path(id), b"y").unwrap();
        }
        let fresh = Store::open(&dir.path().join("store")).unwrap();
        let big_fresh = fresh.publisher(1).unwrap();
        for id in &many[..4] {
            assert!(big_fresh.has_object(id));
        }
        assert!(
            matches!(
                *big_fresh.0.known[0x12].lock().unwrap(),
                Known::Lookups { asked: 4, .. }
            ),
            "a directory of 256 names listed after 4 lookups"
        );
    }

    /// A fan-out directory whose listing fails is not listed again for each
    /// later object: they are looked up by name, and found as before.
    #[test]
    fn a_fanout_that_cannot_be_listed_is_looked_up_and_not_listed_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap();
        let ids: Vec<ObjectId> = (0..20).map(|i| fanout_id(0x5e, i)).collect();
        fs::create_dir_all(store.objects_dir().join("5e")).unwrap();
        for id in ids.iter().step_by(2) {
            fs::write(store.object_path(id), b"z").unwrap();
        }
        let publisher = store.publisher(1).unwrap();
        // The publisher holds the directory open; its path is gone, so a
        // listing (by path) fails while lookups (by descriptor) work.
        publisher.fanout_dir(0x5e).unwrap();
        let moved = dir.path().join("moved-5e");
        fs::rename(store.objects_dir().join("5e"), &moved).unwrap();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(publisher.has_object(id), i % 2 == 0, "{id}");
        }
        assert!(
            matches!(
                *publisher.0.known[0x5e].lock().unwrap(),
                Known::Lookups {
                    asked: 20,
                    entries: Some(u64::MAX)
                }
            ),
            "after a failed listing: lookups only, and no further listing"
        );
        fs::rename(&moved, store.objects_dir().join("5e")).unwrap();
    }

    /// A listing is a snapshot: an object another import links after it is
    /// staged again by this one, whose link then finds the name taken and
    /// drops its copy; the object stays whole, counted once.
    #[test]
    fn an_object_linked_by_another_import_after_the_listing_is_dropped_at_the_link() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store")).unwrap();
        let data = b"published by two imports at once\n".repeat(200);
        let mut hasher = crate::verity::FsVerityHasher::new();
        hasher.update(&data);
        let id = hasher.finalize();
        let first = store.publisher(1).unwrap();
        first.fanout_dir(id.0[0]).unwrap();
        for _ in 0..8 {
            assert!(!first.has_object(&id));
        }
        assert!(matches!(
            *first.0.known[id.0[0] as usize].lock().unwrap(),
            Known::Listed { .. }
        ));
        let publish = |p: &Publisher<'_>| {
            let mut shard = p.shard();
            let mut stager = shard.stage_object().unwrap();
            stager.write(&data).unwrap();
            let staged = shard.finish(stager).unwrap();
            assert_eq!(staged.id, id);
            p.staging_done();
            shard.publish_all();
            drop(shard);
            let linked = p.finish().unwrap();
            store.publish_staged([staged]).unwrap();
            linked
        };
        let second = store.publisher(1).unwrap();
        let by_second = publish(&second);
        let by_first = publish(&first);
        if first.0.anonymous {
            assert_eq!((by_second, by_first), (1, 0));
        }
        assert_eq!(fs::read(store.object_path(&id)).unwrap(), data);
        assert!(first.has_object(&id), "not noted as present");
    }
}
