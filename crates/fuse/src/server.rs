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
use crate::partial::{self, Partial};
use crate::proto::{self, open_flags, Attr, Op, Reply, Request};

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
    /// Whether the thread that expires waiting chunked reads runs.
    partial_timer: AtomicBool,
}

/// The objects opened, each once, in first-open order.
#[derive(Default)]
pub(crate) struct OpenLog {
    pub seen: std::collections::HashSet<ObjectId>,
    pub order: Vec<ObjectId>,
}

/// One object node, as handed to a successor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeState {
    pub node: u64,
    pub id: ObjectId,
    pub size: u64,
    pub nlookup: u64,
    pub opens: u32,
    /// 0 for none.
    pub backing: i32,
}

/// Everything a successor needs to serve the same connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerState {
    pub passthrough: bool,
    pub next_node: u64,
    pub next_fh: u64,
    pub nodes: Vec<NodeState>,
    /// (handle, node).
    pub handles: Vec<(u64, u64)>,
}

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
            partial_timer: AtomicBool::new(false),
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

    /// The state a successor needs. Call only once no worker runs and no
    /// open is pending.
    pub fn export_state(&self) -> ServerState {
        let nodes = self.nodes.lock().expect("nodes lock");
        let handles = self.handles.lock().expect("handles lock");
        let mut ns: Vec<NodeState> = nodes
            .nodes
            .iter()
            .map(|(&node, n)| NodeState {
                node,
                id: n.id,
                size: n.size,
                nlookup: n.nlookup,
                opens: n.opens,
                backing: n.backing.unwrap_or(0),
            })
            .collect();
        ns.sort_by_key(|n| n.node);
        let mut hs: Vec<(u64, u64)> = handles.iter().map(|(&fh, h)| (fh, h.node)).collect();
        hs.sort();
        ServerState {
            passthrough: self.passthrough.load(Ordering::Relaxed),
            next_node: nodes.next,
            next_fh: self.next_fh.load(Ordering::Relaxed),
            nodes: ns,
            handles: hs,
        }
    }

    /// Takes over a predecessor's state (already validated by
    /// `handover::decode`): nodes as they were, and each handle's file
    /// opened again from the store.
    pub fn import_state(&self, st: ServerState) -> Result<(), String> {
        let by_node: HashMap<u64, ObjectId> = st.nodes.iter().map(|n| (n.node, n.id)).collect();
        let mut handles = HashMap::with_capacity(st.handles.len());
        for &(fh, node) in &st.handles {
            let id = by_node[&node];
            let path = self.store.object_path(&id);
            let file = File::open(&path).map_err(|e| {
                format!(
                    "handle {fh} of object {id}: opening {}: {e}",
                    path.display()
                )
            })?;
            handles.insert(
                fh,
                Handle {
                    node,
                    file: Arc::new(file),
                    partial: None,
                },
            );
        }
        let mut nodes = self.nodes.lock().expect("nodes lock");
        nodes.next = st.next_node;
        for n in st.nodes {
            nodes.by_id.insert(n.id, n.node);
            nodes.nodes.insert(
                n.node,
                Node {
                    id: n.id,
                    size: n.size,
                    nlookup: n.nlookup,
                    opens: n.opens,
                    backing: (n.backing != 0).then_some(n.backing),
                    chunked: 0,
                },
            );
        }
        *self.handles.lock().expect("handles lock") = handles;
        self.next_fh.store(st.next_fh, Ordering::Relaxed);
        self.passthrough.store(st.passthrough, Ordering::Relaxed);
        Ok(())
    }

    /// Live backing ids (for tests: zero once everything is closed).
    pub fn live_backing_ids(&self) -> usize {
        let nodes = self.nodes.lock().expect("nodes lock");
        nodes.nodes.values().filter(|n| n.backing.is_some()).count()
    }

    /// Handles one message read from the device.
    pub fn handle(self: &Arc<Self>, msg: &[u8]) -> Flow {
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
                return Flow::Continue;
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
                return Flow::Stop;
            }
            Op::Open { flags } => {
                if flags as i32 & libc::O_ACCMODE != libc::O_RDONLY {
                    self.reply(Reply::error(unique, libc::EROFS));
                } else {
                    // Replies itself, now or once the object is fetched.
                    self.open(unique, node);
                }
            }
            Op::Read { fh, offset, size } => self.read(unique, fh, offset, size),
            op => {
                let r = self.answer(unique, node, op);
                self.reply(r);
            }
        }
        Flow::Continue
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
        {
            let mut nodes = self.nodes.lock().expect("nodes lock");
            if let Some(&ino) = nodes.by_id.get(&id) {
                let n = nodes.nodes.get_mut(&ino).expect("by_id and nodes agree");
                n.nlookup += 1;
                return Ok((ino, file_attr(ino, n.size)));
            }
        }
        // Not known yet: the store says its size, else the source does.
        let size = match std::fs::metadata(self.store.object_path(&id)) {
            Ok(m) if m.is_file() => m.len(),
            _ => self.fetcher.source().size(&id).ok_or(libc::ENOENT)?,
        };
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
        let ino = nodes.next;
        nodes.next += 1;
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
        if entry.nlookup > 0 {
            return;
        }
        let entry = nodes.nodes.remove(&node).expect("present");
        nodes.by_id.remove(&entry.id);
        // The kernel forgets an inode only once it has no open files, so
        // no backing id should be left; close any all the same.
        if let Some(id) = entry.backing {
            self.close_backing(id);
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
    fn open(self: &Arc<Self>, unique: u64, node: u64) {
        let (id, size) = {
            let nodes = self.nodes.lock().expect("nodes lock");
            match nodes.nodes.get(&node) {
                Some(n) => (n.id, n.size),
                None if node == proto::ROOT_ID || node_fanout(node).is_some() => {
                    self.reply(Reply::error(unique, libc::EISDIR));
                    return;
                }
                None => {
                    self.reply(Reply::error(unique, libc::ENOENT));
                    return;
                }
            }
        };
        if let Some(log) = self.open_log.lock().expect("open log lock").as_mut() {
            if log.order.len() < self.max_nodes && log.seen.insert(id) {
                log.order.push(id);
            }
        }
        // A missing object that a fetch is bringing already (a background
        // one, say) is waited for; otherwise, if it can be, it is served
        // chunk by chunk.
        if !self.store.has_object(&id) && !self.fetcher.in_flight(&id) {
            if let Some(p) = self.partial_for(&id, size) {
                self.open_chunked(unique, node, p);
                return;
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
            me.pending_opens.fetch_sub(1, Ordering::SeqCst);
        });
        self.fetcher.when_present(&id, size, waiter);
    }

    /// Opens an object that is in the store. Returns the handle, the open
    /// flags and the backing id (0 without passthrough).
    fn open_present(&self, node: u64, id: &ObjectId, size: u64) -> Result<(u64, u32, i32), i32> {
        let id = *id;
        let path = self.store.object_path(&id);
        let file = File::open(&path).map_err(|e| {
            tracing::warn!(object = %id, "opening {}: {e}", path.display());
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
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let mut flags = open_flags::KEEP_CACHE;
        let mut backing_id = 0;
        {
            let mut nodes = self.nodes.lock().expect("nodes lock");
            let n = nodes.nodes.get_mut(&node).ok_or(libc::ENOENT)?;
            if self.passthrough.load(Ordering::Relaxed) && n.chunked == 0 {
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
        let Some(h) = self.handles.lock().expect("handles lock").remove(&fh) else {
            return;
        };
        if let Some(p) = &h.partial {
            if p.drop_handle() {
                self.forget_partial_if_idle(&p.id);
            }
        }
        let mut nodes = self.nodes.lock().expect("nodes lock");
        let Some(n) = nodes.nodes.get_mut(&h.node) else {
            return;
        };
        n.opens = n.opens.saturating_sub(1);
        if h.partial.is_some() {
            n.chunked = n.chunked.saturating_sub(1);
        }
        if n.opens == 0 {
            if let Some(id) = n.backing.take() {
                // The last open of the inode is gone, and the kernel let go
                // of the backing file before sending RELEASE.
                self.close_backing(id);
            }
        }
    }

    /// Answers a READ: from the handle's file, or for an object being
    /// fetched chunk by chunk once the chunks it needs are in.
    fn read(self: &Arc<Self>, unique: u64, fh: u64, offset: u64, size: u32) {
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let (file, partial) = match self.handles.lock().expect("handles lock").get(&fh) {
            Some(h) => (h.file.clone(), h.partial.clone()),
            None => {
                self.reply(Reply::error(unique, libc::EBADF));
                return;
            }
        };
        if let Some(p) = partial {
            p.read(self, unique, offset, size);
            return;
        }
        self.reply(Self::read_file(unique, &file, offset, size));
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

    /// The partial of missing object `id` (joined, or started), if the
    /// source can fetch it chunk by chunk and fewer than
    /// [`partial::MAX_PARTIALS`] are served; counts a handle on it.
    fn partial_for(&self, id: &ObjectId, size: u64) -> Option<Arc<Partial>> {
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
        if map.len() >= partial::MAX_PARTIALS {
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
        match Partial::new(&self.store.tmp_dir(), *id, size, starts) {
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
    fn open_chunked(&self, unique: u64, node: u64, p: Arc<Partial>) {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
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
