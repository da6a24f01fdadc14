//! The filesystem: the tree it serves, its inode table, open handles and
//! backing ids, and the dispatch of each request.
//!
//! # The tree and its node ids
//!
//! ```text
//! 1                  the root (FUSE_ROOT_ID), 0500 (root's only)
//! 2 + b              the fan-out directory of first byte b ("00".."ff"), 0555
//! 0x1000 and up      objects, one id per object while the kernel knows it,
//!                    never reused (a u64 counter)
//! ```
//!
//! Directories are fixed and never forgotten. An object's node lives from
//! the first LOOKUP that finds it until FORGET brings its lookup count back
//! to zero; then it is dropped, and a later lookup gets a new id.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cairn_store::{ObjectId, Store};
use rustix::io::Errno;

use crate::dev;
use crate::fetch::Fetcher;
use crate::journal::{Journal, FH_SHIFT};
use crate::partial::Partial;
use crate::proto::{self, open_flags, Attr, Op, Reply, Request};

mod chunked;
mod succession;

pub(crate) use succession::{NodeState, ServerState};

/// The first node id given to an object.
pub(crate) const FIRST_OBJECT_ID: u64 = 0x1000;
/// How long the kernel may cache entries and attributes: objects never
/// change, and neither does the directory tree.
const VALID_SECS: u64 = 3600;
/// The largest READ reply (the kernel's default of 32 pages).
pub(crate) const MAX_READ: u32 = 128 * 1024;

/// One object the kernel knows.
#[derive(Debug)]
struct Node {
    id: ObjectId,
    size: u64,
    /// LOOKUPs not yet forgotten.
    nlookup: u64,
    /// Open handles of this node.
    opens: u32,
    /// The backing id its open handles were passed through to.
    backing: Option<i32>,
    /// Open handles served chunk by chunk (by READ): while there are any,
    /// new opens are served by READ too (the kernel does not mix cached
    /// and passthrough opens of one inode).
    chunked: u32,
}

#[derive(Debug, Default)]
struct Nodes {
    nodes: HashMap<u64, Node>,
    by_id: HashMap<ObjectId, u64>,
    next: u64,
}

/// An open object.
#[derive(Debug)]
struct Handle {
    node: u64,
    file: Arc<File>,
    /// The object is being fetched chunk by chunk: READs wait for chunks.
    partial: Option<Arc<Partial>>,
}

/// Counters for tests and `cairn` to report.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub reads: AtomicU64,
    pub passthrough_opens: AtomicU64,
    pub plain_opens: AtomicU64,
    pub backing_opened: AtomicU64,
    pub backing_closed: AtomicU64,
    pub bad_messages: AtomicU64,
    pub chunked_opens: AtomicU64,
}

pub(crate) struct Server {
    pub dev: OwnedFd,
    pub store: Arc<Store>,
    pub fetcher: Arc<Fetcher>,
    pub passthrough: AtomicBool,
    /// Whether a refused backing open was logged already.
    warned_backing: AtomicBool,
    pub max_nodes: usize,
    /// How many workers serve (kept to restart them).
    pub workers: usize,
    nodes: Mutex<Nodes>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// Opens deferred to a fetch and not answered yet (a hand-over waits
    /// for them).
    pub pending_opens: AtomicUsize,
    pub counters: Counters,
    /// Objects in the order of their first open, when recording
    /// ([`crate::ServeOptions::record_opens`]); at most `max_nodes`.
    pub open_log: Mutex<Option<OpenLog>>,
    /// With a fixed list of objects ([`crate::ServeOptions::resumable`]):
    /// node ids from the list, and the state a successor needs.
    pub journal: Option<Arc<Journal>>,
    /// Whether the thread that expires waiting chunked reads runs.
    partial_timer: AtomicBool,
}

/// The objects opened, each once, in first-open order.
#[derive(Default)]
pub(crate) struct OpenLog {
    pub seen: std::collections::HashSet<ObjectId>,
    pub order: Vec<ObjectId>,
    /// Objects larger than this (if not 0) are recorded chunk by chunk.
    pub chunk_size: u64,
    /// Per such object (at most [`MAX_CHUNK_LOGS`]), whether each chunk
    /// was read.
    pub chunks: std::collections::HashMap<ObjectId, Vec<bool>>,
}

/// The most objects recorded chunk by chunk; later ones are recorded whole.
pub(crate) const MAX_CHUNK_LOGS: usize = 1 << 16;
/// The most chunks an object recorded chunk by chunk may have (1 TiB of
/// 1 MiB chunks: 1 MiB of flags).
const MAX_LOGGED_CHUNKS: u64 = 1 << 20;

/// Whether the loop goes on after a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Stop,
}

fn dir_attr(ino: u64) -> Attr {
    // The root is root's alone, as the store is (0700, read-only here):
    // other users must not read every object on the host through this
    // mount, nor make it fetch. overlayfs reaches its lower layers with
    // the credentials of whoever mounted it (root), and containers read
    // their files through the overlay, as their image's modes allow.
    let perm = if ino == proto::ROOT_ID { 0o500 } else { 0o555 };
    Attr {
        ino,
        mode: libc::S_IFDIR | perm,
        nlink: 2,
        blksize: 4096,
        ..Attr::default()
    }
}

fn file_attr(ino: u64, size: u64) -> Attr {
    Attr {
        ino,
        size,
        blocks: size.div_ceil(512),
        mode: libc::S_IFREG | 0o444,
        nlink: 1,
        blksize: 4096,
        ..Attr::default()
    }
}

fn fanout_node(b: u8) -> u64 {
    2 + b as u64
}

fn node_fanout(node: u64) -> Option<u8> {
    (2..2 + 256).contains(&node).then(|| (node - 2) as u8)
}

/// Two lowercase hex digits.
fn parse_fanout(name: &[u8]) -> Option<u8> {
    if name.len() != 2 || !name.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    u8::from_str_radix(std::str::from_utf8(name).ok()?, 16).ok()
}

/// The 62 lowercase hex digits after fan-out `b`.
fn parse_object(b: u8, name: &[u8]) -> Option<ObjectId> {
    if name.len() != 62 || !name.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let hex = format!("{b:02x}{}", std::str::from_utf8(name).ok()?);
    ObjectId::from_hex(&hex).ok()
}

impl Drop for Server {
    fn drop(&mut self) {
        self.fetcher.shutdown();
    }
}

impl Server {
    pub fn new(
        dev: OwnedFd,
        store: Arc<Store>,
        fetcher: Arc<Fetcher>,
        max_nodes: usize,
        workers: usize,
    ) -> Server {
        Server {
            dev,
            store,
            fetcher,
            passthrough: AtomicBool::new(false),
            warned_backing: AtomicBool::new(false),
            max_nodes,
            workers,
            nodes: Mutex::new(Nodes {
                next: FIRST_OBJECT_ID,
                ..Nodes::default()
            }),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            pending_opens: AtomicUsize::new(0),
            counters: Counters::default(),
            open_log: Mutex::new(None),
            journal: None,
            partial_timer: AtomicBool::new(false),
        }
    }

    /// Serves a fixed list of objects, with node ids from it, and keeps
    /// what a successor needs in `journal`.
    pub fn with_journal(mut self, journal: Arc<Journal>) -> Server {
        self.journal = Some(journal);
        self
    }

    /// The size of object `id`: the store's file, else the source's word.
    fn object_size(&self, id: &ObjectId) -> Option<u64> {
        match std::fs::metadata(crate::local_path(&self.store, self.fetcher.source(), id)) {
            Ok(m) if m.is_file() => Some(m.len()),
            _ => self.fetcher.source().size(id),
        }
    }

    /// Sends a reply; false if the kernel did not take it (the request
    /// is gone: `ENOENT`, or the connection is).
    pub fn reply(&self, r: Reply) -> bool {
        match dev::write(self.dev.as_fd(), &r.finish()) {
            Ok(()) => true,
            // ENOENT: the request was interrupted and is gone.
            Err(Errno::NOENT) => false,
            Err(e) => {
                tracing::debug!("writing a FUSE reply: {e}");
                false
            }
        }
    }

    /// Live backing ids (for tests: zero once everything is closed).
    pub fn live_backing_ids(&self) -> usize {
        let nodes = self.nodes.lock().expect("nodes lock");
        nodes.nodes.values().filter(|n| n.backing.is_some()).count()
    }

    /// Handles one message read from the device (recorded in the journal,
    /// if any, until it is answered).
    pub fn handle(self: &Arc<Self>, msg: &[u8]) -> Flow {
        let slot = self.journal.as_ref().and_then(|j| j.record(msg));
        let (flow, kept) = self.dispatch(msg, slot);
        if let (Some(s), false) = (slot, kept) {
            self.journal.as_ref().expect("journal").clear(s);
        }
        flow
    }

    /// Handles one message; true in the second place if an open waiting
    /// for a fetch took over `slot` (it clears it once answered).
    fn dispatch(self: &Arc<Self>, msg: &[u8], slot: Option<u32>) -> (Flow, bool) {
        let req = match Request::parse(msg) {
            Ok(r) => r,
            Err(e) => {
                self.counters.bad_messages.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("malformed FUSE request: {e}");
                // Answer it if at least the header was readable, so the
                // caller in the kernel is not left waiting.
                if let Ok(h) = proto::InHeader::parse(msg) {
                    if !matches!(
                        h.opcode,
                        proto::opcode::FORGET | proto::opcode::BATCH_FORGET
                    ) {
                        self.reply(Reply::error(h.unique, libc::EIO));
                    }
                }
                return (Flow::Continue, false);
            }
        };
        let unique = req.header.unique;
        let node = req.header.nodeid;
        match req.op {
            Op::Forget { nlookup } => self.forget(node, nlookup),
            Op::BatchForget(list) => {
                for (node, n) in list {
                    self.forget(node, n);
                }
            }
            Op::Interrupt { .. } => {
                // Nothing we do waits without a deadline; the request
                // finishes on its own.
            }
            Op::Destroy => {
                self.reply(Reply::ok(unique));
                return (Flow::Stop, false);
            }
            Op::Open { flags } => {
                if flags as i32 & libc::O_ACCMODE != libc::O_RDONLY {
                    self.reply(Reply::error(unique, libc::EROFS));
                } else {
                    // Replies itself, now or once the object is fetched.
                    return (Flow::Continue, self.open(unique, node, slot));
                }
            }
            // Replies itself, now or once its chunks are in.
            Op::Read { fh, offset, size } => {
                return (Flow::Continue, self.read(unique, fh, offset, size, slot))
            }
            op => {
                let r = self.answer(unique, node, op);
                self.reply(r);
            }
        }
        (Flow::Continue, false)
    }

    fn answer(&self, unique: u64, node: u64, op: Op<'_>) -> Reply {
        use std::os::unix::ffi::OsStrExt;
        let err = |e: i32| Reply::error(unique, e);
        match op {
            Op::Init(_) => err(libc::EPROTO),
            Op::Lookup { name } => match self.lookup(node, name.as_bytes()) {
                Ok((ino, attr)) => Reply::ok(unique).entry(ino, VALID_SECS, &attr),
                Err(e) => err(e),
            },
            Op::Getattr => match self.attr(node) {
                Some(a) => Reply::ok(unique).attr(VALID_SECS, &a),
                None => err(libc::ENOENT),
            },
            Op::Release { fh } => {
                self.release(fh);
                Reply::ok(unique)
            }
            Op::Opendir => {
                if node == proto::ROOT_ID || node_fanout(node).is_some() {
                    Reply::ok(unique).open(0, open_flags::CACHE_DIR, 0)
                } else {
                    err(libc::ENOTDIR)
                }
            }
            Op::Readdir { offset, size, .. } => self.readdir(unique, node, offset, size),
            Op::Releasedir { .. } | Op::Flush => Reply::ok(unique),
            Op::Getxattr { .. } => err(libc::ENODATA),
            Op::Listxattr { size } => {
                if size == 0 {
                    Reply::ok(unique).xattr_size(0)
                } else {
                    Reply::ok(unique)
                }
            }
            Op::Statfs => {
                let files = self.nodes.lock().expect("nodes lock").nodes.len() as u64;
                Reply::ok(unique).statfs(0, files, 4096, 255)
            }
            Op::Access { mask } => {
                if mask as i32 & libc::W_OK != 0 {
                    err(libc::EROFS)
                } else {
                    Reply::ok(unique)
                }
            }
            Op::Other => err(libc::ENOSYS),
            // Handled by the caller.
            Op::Open { .. }
            | Op::Read { .. }
            | Op::Forget { .. }
            | Op::BatchForget(_)
            | Op::Interrupt { .. }
            | Op::Destroy => err(libc::ENOSYS),
        }
    }

    fn attr(&self, node: u64) -> Option<Attr> {
        if node == proto::ROOT_ID || node_fanout(node).is_some() {
            return Some(dir_attr(node));
        }
        self.materialize(node);
        let nodes = self.nodes.lock().expect("nodes lock");
        nodes.nodes.get(&node).map(|n| file_attr(node, n.size))
    }

    fn lookup(&self, parent: u64, name: &[u8]) -> Result<(u64, Attr), i32> {
        if parent == proto::ROOT_ID {
            let b = parse_fanout(name).ok_or(libc::ENOENT)?;
            return Ok((fanout_node(b), dir_attr(fanout_node(b))));
        }
        let b = node_fanout(parent).ok_or(libc::ENOTDIR)?;
        let id = parse_object(b, name).ok_or(libc::ENOENT)?;
        // With a fixed list, only its objects exist, and each has its node.
        let fixed = match &self.journal {
            Some(j) => Some(FIRST_OBJECT_ID + j.index(&id).ok_or(libc::ENOENT)? as u64),
            None => None,
        };
        {
            let mut nodes = self.nodes.lock().expect("nodes lock");
            if let Some(&ino) = nodes.by_id.get(&id) {
                let n = nodes.nodes.get_mut(&ino).expect("by_id and nodes agree");
                n.nlookup += 1;
                return Ok((ino, file_attr(ino, n.size)));
            }
        }
        // Not known yet: the store says its size, else the source does.
        let size = self.object_size(&id).ok_or(libc::ENOENT)?;
        let mut nodes = self.nodes.lock().expect("nodes lock");
        // Another worker may have added it meanwhile.
        if let Some(&ino) = nodes.by_id.get(&id) {
            let n = nodes.nodes.get_mut(&ino).expect("by_id and nodes agree");
            n.nlookup += 1;
            return Ok((ino, file_attr(ino, n.size)));
        }
        if nodes.nodes.len() >= self.max_nodes {
            tracing::warn!(
                object = %id,
                "the kernel holds {} objects, the limit; refusing another",
                self.max_nodes
            );
            return Err(libc::ENFILE);
        }
        let ino = match fixed {
            Some(ino) => ino,
            None => {
                nodes.next += 1;
                nodes.next - 1
            }
        };
        nodes.nodes.insert(
            ino,
            Node {
                id,
                size,
                nlookup: 1,
                opens: 0,
                backing: None,
                chunked: 0,
            },
        );
        nodes.by_id.insert(id, ino);
        Ok((ino, file_attr(ino, size)))
    }

    fn forget(&self, node: u64, n: u64) {
        let mut nodes = self.nodes.lock().expect("nodes lock");
        let Some(entry) = nodes.nodes.get_mut(&node) else {
            return;
        };
        entry.nlookup = entry.nlookup.saturating_sub(n);
        // A journal's node stays while open: a successor may have learnt
        // of it from the journal, with its lookups unknown.
        if entry.nlookup > 0 || (self.journal.is_some() && entry.opens > 0) {
            return;
        }
        let entry = nodes.nodes.remove(&node).expect("present");
        nodes.by_id.remove(&entry.id);
        // The kernel forgets an inode only once it has no open files, so
        // no backing id should be left; close any all the same.
        if let Some(id) = entry.backing {
            self.close_backing(id);
            if let (Some(j), Some(i)) = (&self.journal, self.journal_index(node)) {
                j.write_node(i, 0, None);
            }
        }
    }

    fn close_backing(&self, id: i32) {
        match dev::backing_close(self.dev.as_fd(), id) {
            Ok(()) => {
                self.counters.backing_closed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!("closing FUSE backing id {id}: {e}"),
        }
    }

    /// Opens an object and replies: at once if it is in the store,
    /// otherwise once it has been fetched and verified (or with `EIO` when
    /// that failed or timed out). The worker never waits for a fetch.
    /// Returns whether the reply was left to a waiter, which then clears
    /// the journal's `slot` once it has replied.
    fn open(self: &Arc<Self>, unique: u64, node: u64, slot: Option<u32>) -> bool {
        self.materialize(node);
        let (id, size) = {
            let nodes = self.nodes.lock().expect("nodes lock");
            match nodes.nodes.get(&node) {
                Some(n) => (n.id, n.size),
                None if node == proto::ROOT_ID || node_fanout(node).is_some() => {
                    self.reply(Reply::error(unique, libc::EISDIR));
                    return false;
                }
                None => {
                    self.reply(Reply::error(unique, libc::ENOENT));
                    return false;
                }
            }
        };
        if let Some(log) = self.open_log.lock().expect("open log lock").as_mut() {
            if log.order.len() < self.max_nodes && log.seen.insert(id) {
                log.order.push(id);
                let cs = log.chunk_size;
                if cs > 0
                    && size > cs
                    && size.div_ceil(cs) <= MAX_LOGGED_CHUNKS
                    && log.chunks.len() < MAX_CHUNK_LOGS
                {
                    log.chunks
                        .insert(id, vec![false; size.div_ceil(cs) as usize]);
                }
            }
        }
        // A missing object that a fetch is bringing already (a background
        // one, say) is waited for; otherwise, if it can be, it is served
        // chunk by chunk.
        if !crate::has_local(&self.store, self.fetcher.source(), &id)
            && !self.fetcher.in_flight(&id)
        {
            if let Some(p) = self.partial_for(&id, size) {
                self.open_chunked(unique, node, p);
                return false;
            }
        }
        let me = self.clone();
        self.pending_opens.fetch_add(1, Ordering::SeqCst);
        let waiter = Box::new(move |present: Result<(), String>| {
            let opened = present
                .map_err(|reason| {
                    tracing::debug!(object = %id, "open fails with EIO: {reason}");
                    libc::EIO
                })
                .and_then(|()| me.open_present(node, &id, size));
            match opened {
                Ok((fh, flags, backing)) => {
                    if !me.reply(Reply::ok(unique).open(fh, flags, backing)) {
                        // The kernel will never release a handle it did
                        // not get: undo the open (and its backing id).
                        me.release(fh);
                    }
                }
                Err(e) => {
                    me.reply(Reply::error(unique, e));
                }
            }
            if let (Some(j), Some(s)) = (&me.journal, slot) {
                j.clear(s);
            }
            me.pending_opens.fetch_sub(1, Ordering::SeqCst);
        });
        self.fetcher.when_present(&id, size, waiter);
        true
    }

    /// A new file handle for `node`; with a journal it names its node, for
    /// a successor.
    fn new_fh(&self, node: u64) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        if self.journal.is_some() {
            node << FH_SHIFT | (fh & ((1 << FH_SHIFT) - 1))
        } else {
            fh
        }
    }

    /// Opens an object that is in the store, or checked and being
    /// published. Returns the handle, the open flags and the backing id
    /// (0 without passthrough).
    fn open_present(&self, node: u64, id: &ObjectId, size: u64) -> Result<(u64, u32, i32), i32> {
        let id = *id;
        // The store's file, or while it is being published the checked
        // staged file (the same inode the store will name).
        let file = self.fetcher.open_object(&id).map_err(|e| {
            tracing::warn!(
                object = %id,
                "opening {}: {e}",
                crate::local_path(&self.store, self.fetcher.source(), &id).display()
            );
            libc::EIO
        })?;
        let actual = file.metadata().map(|m| m.len()).map_err(|_| libc::EIO)?;
        if actual != size {
            tracing::warn!(
                object = %id,
                "the object has {actual} bytes but was announced with {size}; refusing to serve it"
            );
            return Err(libc::EIO);
        }
        let file = Arc::new(file);
        let fh = self.new_fh(node);
        let mut flags = open_flags::KEEP_CACHE;
        let mut backing_id = 0;
        // An object recorded chunk by chunk is served by READ, so that
        // the server sees which chunks are read.
        let recorded = self.records_reads(&id);
        {
            let mut nodes = self.nodes.lock().expect("nodes lock");
            let n = nodes.nodes.get_mut(&node).ok_or(libc::ENOENT)?;
            if self.passthrough.load(Ordering::Relaxed) && n.chunked == 0 && !recorded {
                let bid = match n.backing {
                    Some(b) => Some(b),
                    None => match dev::backing_open(self.dev.as_fd(), &file) {
                        Ok(b) => {
                            self.counters.backing_opened.fetch_add(1, Ordering::Relaxed);
                            n.backing = Some(b);
                            Some(b)
                        }
                        Err(e) => {
                            // Once per server: a store on a stacked
                            // filesystem (ELOOP) would say it every open.
                            if !self.warned_backing.swap(true, Ordering::Relaxed) {
                                tracing::warn!(
                                    object = %id,
                                    "FUSE passthrough refused ({e}); serving reads instead"
                                );
                            }
                            None
                        }
                    },
                };
                if let Some(b) = bid {
                    flags = open_flags::PASSTHROUGH;
                    backing_id = b;
                }
            }
            n.opens += 1;
            self.persist(node, n);
        }
        if backing_id != 0 {
            self.counters
                .passthrough_opens
                .fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.plain_opens.fetch_add(1, Ordering::Relaxed);
        }
        self.handles.lock().expect("handles lock").insert(
            fh,
            Handle {
                node,
                file,
                partial: None,
            },
        );
        Ok((fh, flags, backing_id))
    }

    fn release(&self, fh: u64) {
        let (node, partial, predecessor) =
            match self.handles.lock().expect("handles lock").remove(&fh) {
                Some(h) => (h.node, h.partial, false),
                // A predecessor's handle: it names its node.
                None if self.journal_index(fh >> FH_SHIFT).is_some() => {
                    (fh >> FH_SHIFT, None, true)
                }
                None => return,
            };
        if let Some(p) = &partial {
            if p.drop_handle() {
                self.forget_partial_if_idle(&p.id);
            }
        }
        self.materialize(node);
        let mut nodes = self.nodes.lock().expect("nodes lock");
        let Some(n) = nodes.nodes.get_mut(&node) else {
            return;
        };
        n.opens = n.opens.saturating_sub(1);
        if partial.is_some() || (predecessor && n.backing.is_none()) {
            n.chunked = n.chunked.saturating_sub(1);
        }
        if n.opens == 0 {
            if let Some(id) = n.backing.take() {
                // The last open of the inode is gone, and the kernel let go
                // of the backing file before sending RELEASE.
                self.close_backing(id);
            }
        }
        self.persist(node, n);
    }

    /// Answers a READ: from the handle's file, or for an object being
    /// fetched chunk by chunk once the chunks it needs are in.
    /// Returns true when the read waits for chunks and took over `slot`.
    fn read(
        self: &Arc<Self>,
        unique: u64,
        fh: u64,
        offset: u64,
        size: u32,
        slot: Option<u32>,
    ) -> bool {
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let (file, partial) = match self.handles.lock().expect("handles lock").get(&fh) {
            Some(h) => (h.file.clone(), h.partial.clone()),
            None => match self.predecessor_file(fh) {
                Some(f) => (f, None),
                None => match self.predecessor_partial(fh) {
                    Some(p) => (p.file.clone(), Some(p)),
                    None => {
                        self.reply(Reply::error(unique, libc::EBADF));
                        return false;
                    }
                },
            },
        };
        if self.open_log.lock().expect("open log lock").is_some() {
            self.note_read(fh, offset, size);
        }
        if let Some(p) = partial {
            return p.read(self, unique, offset, size, slot);
        }
        self.reply(Self::read_file(unique, &file, offset, size));
        false
    }

    /// Whether `id` is recorded chunk by chunk (and so must not be passed
    /// through).
    fn records_reads(&self, id: &ObjectId) -> bool {
        self.open_log
            .lock()
            .expect("open log lock")
            .as_ref()
            .is_some_and(|l| l.chunks.contains_key(id))
    }

    /// Records the chunks a READ of handle `fh` covers, if its object is
    /// recorded chunk by chunk.
    fn note_read(&self, fh: u64, offset: u64, size: u32) {
        let node = match self.handles.lock().expect("handles lock").get(&fh) {
            Some(h) => h.node,
            None => fh >> FH_SHIFT,
        };
        let Some(id) = self
            .nodes
            .lock()
            .expect("nodes lock")
            .nodes
            .get(&node)
            .map(|n| n.id)
        else {
            return;
        };
        let mut log = self.open_log.lock().expect("open log lock");
        let Some(l) = log.as_mut() else { return };
        let cs = l.chunk_size;
        let Some(read) = l.chunks.get_mut(&id) else {
            return;
        };
        if size == 0 || cs == 0 {
            return;
        }
        let first = offset / cs;
        let last = (offset.saturating_add(u64::from(size)) - 1) / cs;
        for k in first..=last.min(read.len() as u64 - 1) {
            read[k as usize] = true;
        }
    }

    /// Clears a journal slot whose request has been answered.
    pub(crate) fn clear_slot(&self, slot: Option<u32>) {
        if let (Some(j), Some(s)) = (&self.journal, slot) {
            j.clear(s);
        }
    }

    fn read_file(unique: u64, file: &File, offset: u64, size: u32) -> Reply {
        let mut buf = vec![0u8; size.min(MAX_READ) as usize];
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("reading an object for FUSE READ: {e}");
                    return Reply::error(unique, libc::EIO);
                }
            }
        }
        Reply::ok(unique).bytes(&buf[..done])
    }

    /// The file of a handle a predecessor opened (it names its node, whose
    /// object was in the store when it was opened), opened again.
    fn predecessor_file(&self, fh: u64) -> Option<Arc<File>> {
        let i = self.journal_index(fh >> FH_SHIFT)?;
        let id = self.journal.as_ref()?.objects[i];
        File::open(crate::local_path(&self.store, self.fetcher.source(), &id))
            .ok()
            .map(Arc::new)
    }

    /// A handle a predecessor opened on an object it was serving chunk by
    /// chunk (still missing from the store): served the same way again,
    /// the chunks fetched afresh, and kept as this server's handle so that
    /// its RELEASE lets go of the partial.
    fn predecessor_partial(&self, fh: u64) -> Option<Arc<Partial>> {
        let node = fh >> FH_SHIFT;
        let i = self.journal_index(node)?;
        let id = self.journal.as_ref()?.objects[i];
        self.materialize(node);
        let size = self.object_size(&id)?;
        let p = self.partial_for(&id, size)?;
        if let Some(n) = self.nodes.lock().expect("nodes lock").nodes.get_mut(&node) {
            n.chunked += 1;
        }
        self.handles.lock().expect("handles lock").insert(
            fh,
            Handle {
                node,
                file: p.file.clone(),
                partial: Some(p.clone()),
            },
        );
        Some(p)
    }

    /// Directory listings: ".", "..", and for the root the 256 fan-out
    /// directories. Fan-out directories list nothing else (overlayfs only
    /// looks objects up).
    fn readdir(&self, unique: u64, node: u64, offset: u64, size: u32) -> Reply {
        let count: u64 = if node == proto::ROOT_ID {
            2 + 256
        } else if node_fanout(node).is_some() {
            2
        } else {
            return Reply::error(unique, libc::ENOTDIR);
        };
        let max = size.min(MAX_READ) as usize;
        let mut r = Reply::ok(unique);
        let dt_dir = libc::DT_DIR as u32;
        for i in offset..count {
            let (ino, name) = match i {
                0 => (node, ".".to_string()),
                1 => (proto::ROOT_ID, "..".to_string()),
                _ => (fanout_node((i - 2) as u8), format!("{:02x}", i - 2)),
            };
            if !r.dirent(max, ino, i + 1, dt_dir, name.as_bytes()) {
                break;
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests with a well-formed header and anything after it, of every
    /// opcode, to a server whose device is /dev/null (replies vanish):
    /// the dispatch never panics, and the tables stay consistent.
    #[test]
    fn garbage_requests_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("store")).unwrap());
        let obj = store.import_bytes(&[7u8; 1000]).unwrap();
        let fetcher = Fetcher::start(
            store.clone(),
            Arc::new(crate::NoSource),
            std::time::Duration::from_secs(1),
            2,
            1,
        )
        .unwrap();
        let dev: OwnedFd = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap()
            .into();
        let server = Arc::new(Server::new(dev, store, fetcher, 64, 1));
        let mut x: u64 = 0x1234_5678_9abc_def1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let hex = obj.to_hex();
        let names: [&[u8]; 4] = [&hex.as_bytes()[..2], &hex.as_bytes()[2..], b"zz", b""];
        use proto::opcode::*;
        let known = [
            LOOKUP,
            LOOKUP,
            LOOKUP,
            GETATTR,
            OPEN,
            OPEN,
            OPEN,
            READ,
            RELEASE,
            OPENDIR,
            READDIR,
            GETXATTR,
            LISTXATTR,
            STATFS,
            ACCESS,
            FLUSH,
            FORGET,
            BATCH_FORGET,
        ];
        for _ in 0..20_000 {
            let opcode = if next() % 2 == 0 {
                known[(next() % known.len() as u64) as usize]
            } else {
                (next() % 56) as u32
            };
            let nodeid = match next() % 4 {
                0 => proto::ROOT_ID,
                1 => 2 + hex_byte(&hex),
                2 => FIRST_OBJECT_ID + next() % 4,
                _ => next(),
            };
            let mut body: Vec<u8> = match (opcode, next() % 3) {
                (LOOKUP, 0 | 1) => {
                    let mut n = names[(next() % 4) as usize].to_vec();
                    n.push(0);
                    n
                }
                (OPEN, 0 | 1) => vec![0u8; 8],
                _ => (0..next() % 80).map(|_| next() as u8).collect(),
            };
            if opcode == INIT {
                body.truncate(8);
            }
            let mut m = Vec::new();
            m.extend_from_slice(&((proto::IN_HEADER_LEN + body.len()) as u32).to_ne_bytes());
            m.extend_from_slice(&opcode.to_ne_bytes());
            m.extend_from_slice(&next().to_ne_bytes());
            m.extend_from_slice(&nodeid.to_ne_bytes());
            m.extend_from_slice(&[0u8; 16]);
            m.extend_from_slice(&body);
            let _ = server.handle(&m);
        }
        // The object was found and opened now and then.
        assert!(server.counters.plain_opens.load(Ordering::Relaxed) > 0);
        let nodes = server.nodes.lock().unwrap();
        assert!(nodes.next > FIRST_OBJECT_ID);
        assert!(nodes.nodes.len() <= 64);
        for (&ino, n) in &nodes.nodes {
            assert_eq!(nodes.by_id.get(&n.id), Some(&ino));
        }
        assert_eq!(nodes.by_id.len(), nodes.nodes.len());
    }

    /// A request as the kernel frames it.
    fn request(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((proto::IN_HEADER_LEN + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&opcode.to_ne_bytes());
        m.extend_from_slice(&unique.to_ne_bytes());
        m.extend_from_slice(&nodeid.to_ne_bytes());
        m.extend_from_slice(&[0u8; 16]);
        m.extend_from_slice(body);
        m
    }

    /// The replies written so far: (unique, error, body).
    fn replies(r: &OwnedFd) -> Vec<(u64, i32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        rustix::fs::fcntl_setfl(r, rustix::fs::OFlags::NONBLOCK).unwrap();
        let mut all = Vec::new();
        while let Ok(n) = rustix::io::read(r, &mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        let mut at = 0;
        while at + 16 <= all.len() {
            let len = u32::from_ne_bytes(all[at..at + 4].try_into().unwrap()) as usize;
            let err = i32::from_ne_bytes(all[at + 4..at + 8].try_into().unwrap());
            let unique = u64::from_ne_bytes(all[at + 8..at + 16].try_into().unwrap());
            out.push((unique, err, all[at + 16..at + len].to_vec()));
            at += len;
        }
        out
    }

    /// A server with a journal, then a successor on the same journal (as
    /// after the first was killed): the successor answers for the first
    /// one's node ids and handles, answers the request it left, and keeps
    /// the open counts.
    #[test]
    fn a_successor_answers_for_its_predecessor() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("store")).unwrap());
        let a = store.import_bytes(&[1u8; 100]).unwrap();
        let b = store.import_bytes(&[2u8; 200]).unwrap();
        let stranger = store.import_bytes(&[3u8; 300]).unwrap();
        let journal = crate::Resumable::create(vec![b, a]).unwrap().0;
        let start = |dev: OwnedFd| {
            let fetcher = Fetcher::start(
                store.clone(),
                Arc::new(crate::NoSource),
                std::time::Duration::from_secs(1),
                2,
                1,
            )
            .unwrap();
            Arc::new(Server::new(dev, store.clone(), fetcher, 64, 1).with_journal(journal.clone()))
        };
        let lookup = |unique, id: &ObjectId| {
            let hex = id.to_hex();
            let mut name = hex.as_bytes()[2..].to_vec();
            name.push(0);
            request(proto::opcode::LOOKUP, unique, 2 + hex_byte(&hex), &name)
        };
        let (r1, w1) = rustix::pipe::pipe().unwrap();
        let first = start(w1);
        first.handle(&lookup(1, &a));
        first.handle(&request(proto::opcode::OPEN, 2, 0, &[0u8; 8]));
        let node = FIRST_OBJECT_ID + journal.index(&a).unwrap() as u64;
        first.handle(&request(proto::opcode::OPEN, 3, node, &[0u8; 8]));
        let got = replies(&r1);
        assert_eq!(got[0].1, 0);
        assert_eq!(u64::from_ne_bytes(got[0].2[..8].try_into().unwrap()), node);
        assert_eq!(got[1].1, -libc::ENOENT);
        assert_eq!(got[2].1, 0, "{got:?}");
        let fh = u64::from_ne_bytes(got[2].2[..8].try_into().unwrap());
        assert_eq!(fh >> FH_SHIFT, node);
        assert_eq!(
            journal.live_nodes(),
            vec![(journal.index(&a).unwrap(), 1, None)]
        );
        // Killed with a GETATTR in hand.
        journal.record(&request(proto::opcode::GETATTR, 4, node, &[0u8; 16]));
        drop(first);

        let (r2, w2) = rustix::pipe::pipe().unwrap();
        let successor = start(w2);
        successor.resume();
        let got = replies(&r2);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].0, got[0].1), (4, 0));
        // Its lookups give the same node; a READ and a RELEASE of the
        // predecessor's handle work.
        successor.handle(&lookup(5, &a));
        successor.handle(&lookup(6, &stranger));
        let mut read = fh.to_ne_bytes().to_vec();
        read.extend_from_slice(&0u64.to_ne_bytes());
        read.extend_from_slice(&10u32.to_ne_bytes());
        read.extend_from_slice(&[0u8; 20]);
        successor.handle(&request(proto::opcode::READ, 7, node, &read));
        let mut release = fh.to_ne_bytes().to_vec();
        release.extend_from_slice(&[0u8; 16]);
        successor.handle(&request(proto::opcode::RELEASE, 8, node, &release));
        let got = replies(&r2);
        assert_eq!(u64::from_ne_bytes(got[0].2[..8].try_into().unwrap()), node);
        assert_eq!(got[1].1, -libc::ENOENT, "not in the list");
        assert_eq!((got[2].1, &got[2].2[..]), (0, &[1u8; 10][..]));
        assert_eq!(got[3].1, 0);
        assert!(journal.live_nodes().is_empty());
        // Nothing is left recorded.
        assert!(journal.take_requests().is_empty());
    }

    fn hex_byte(hex: &str) -> u64 {
        u64::from_str_radix(&hex[..2], 16).unwrap()
    }

    #[test]
    fn names_parse_strictly() {
        assert_eq!(parse_fanout(b"ab"), Some(0xab));
        assert_eq!(parse_fanout(b"AB"), None);
        assert_eq!(parse_fanout(b"a"), None);
        assert_eq!(parse_fanout(b"abc"), None);
        assert_eq!(parse_fanout(b"g0"), None);
        let rest = "cd".repeat(31);
        let id = parse_object(0xab, rest.as_bytes()).unwrap();
        assert_eq!(id.to_hex(), format!("ab{rest}"));
        assert_eq!(parse_object(0xab, rest.to_uppercase().as_bytes()), None);
        assert_eq!(parse_object(0xab, &rest.as_bytes()[1..]), None);
        assert_eq!(node_fanout(1), None);
        assert_eq!(node_fanout(2), Some(0));
        assert_eq!(node_fanout(257), Some(255));
        assert_eq!(node_fanout(258), None);
    }
}
