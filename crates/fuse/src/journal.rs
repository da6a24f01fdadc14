//! State that outlives a serving process: what a successor needs to answer
//! a connection whose server was killed (SIGKILL: no hand-over).
//!
//! A [`Resumable`] layer serves a fixed, sorted list of objects (an
//! image's), so node ids need no table: object `i` of the list is node
//! `FIRST_OBJECT_ID + i`, and any process given the same list answers
//! for every node id the kernel holds. What does change is kept in a
//! memory file (`memfd`) that the supervisor holds and every worker
//! inherits:
//!
//! ```text
//! header   64 bytes: "CAIRNJ01", passthrough u8 (at 8), objects u64 (at
//!          16), FNV-1a of the sorted list u64 (at 24), eight marks of the
//!          caller's, a byte each (at 40)
//! slots    SLOTS × SLOT_LEN: len u32, then the request as read (len bytes)
//! nodes    objects × 8: opens u32, backing id i32 (0: none), little-endian
//! ```
//!
//! A worker writes each request into a free slot before it handles it and
//! clears the slot once it has replied (an open waiting for a fetch keeps
//! its slot until its reply). A successor reads the slots left behind and
//! handles those requests again: the kernel still waits for their replies
//! (a reply to one that was answered already is refused by the kernel,
//! which is harmless). Each node's open count and backing id are written
//! through on every change, so a successor reuses the backing id the
//! kernel's inode already passes through to (a second one would be
//! refused) and closes it at the last RELEASE. Handles name their node
//! (`fh >> FH_SHIFT`), so a successor needs no handle table either.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use cairn_store::ObjectId;

const MAGIC: &[u8; 8] = b"CAIRNJ01";
const HEADER_LEN: u64 = 64;
/// Eight bytes of marks ([`Resumable::set_mark`]).
const MARKS: u64 = 40;
/// Requests recorded at once (workers' requests in hand plus opens
/// waiting for fetches); past it a request is served unrecorded.
pub(crate) const SLOTS: u32 = 512;
/// A slot: a length and a request of at most `SLOT_LEN - 4` bytes (a
/// LOOKUP of an object is 103).
pub(crate) const SLOT_LEN: u64 = 256;
const NODE_LEN: u64 = 8;
/// A handle is `node << FH_SHIFT | sequence`.
pub(crate) const FH_SHIFT: u32 = 20;

/// The objects a layer serves and the state that survives its server
/// ([`crate::ServeOptions::resumable`]); create it in the process that
/// outlives the servers (it holds the memory file) before forking them.
#[derive(Clone)]
pub struct Resumable(pub(crate) Arc<Journal>);

impl std::fmt::Debug for Resumable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resumable")
            .field("objects", &self.0.objects.len())
            .finish()
    }
}

impl Resumable {
    /// A journal for a layer that serves exactly `objects` (sorted and
    /// deduplicated here; a lookup of anything else is `ENOENT`).
    pub fn create(mut objects: Vec<ObjectId>) -> std::io::Result<Resumable> {
        objects.sort();
        objects.dedup();
        let fd = rustix::fs::memfd_create("cairn-lazy-journal", rustix::fs::MemfdFlags::CLOEXEC)?;
        let file = File::from(fd);
        let len = nodes_at() + objects.len() as u64 * NODE_LEN;
        file.set_len(len)?;
        let mut header = [0u8; HEADER_LEN as usize];
        header[..8].copy_from_slice(MAGIC);
        header[16..24].copy_from_slice(&(objects.len() as u64).to_le_bytes());
        header[24..32].copy_from_slice(&list_hash(&objects).to_le_bytes());
        file.write_all_at(&header, 0)?;
        Ok(Resumable(Arc::new(Journal {
            file,
            objects: objects.into(),
            free: Mutex::new((0..SLOTS).rev().collect()),
        })))
    }

    /// Sets mark `n` (0 to 7), for the caller's own use (say, "the
    /// overlay stands on the layer"); every process sharing the journal
    /// sees it.
    pub fn set_mark(&self, n: u8) {
        if let Err(e) = self.0.file.write_all_at(&[1], MARKS + (n & 7) as u64) {
            Journal::warn("writing a mark", e);
        }
    }

    /// Whether mark `n` was set.
    pub fn marked(&self, n: u8) -> bool {
        let mut b = [0u8; 1];
        self.0
            .file
            .read_exact_at(&mut b, MARKS + (n & 7) as u64)
            .is_ok()
            && b[0] == 1
    }

    /// The journal of a predecessor, from its memory file `fd` (passed
    /// across `exec` to a successor running a new binary), for the list of
    /// `objects` the successor derived itself: refused unless the list is
    /// the one the journal was made for.
    pub fn open(
        fd: std::os::fd::OwnedFd,
        mut objects: Vec<ObjectId>,
    ) -> std::io::Result<Resumable> {
        objects.sort();
        objects.dedup();
        let file = File::from(fd);
        let mut header = [0u8; HEADER_LEN as usize];
        file.read_exact_at(&mut header, 0)?;
        let n = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        let hash = u64::from_le_bytes(header[24..32].try_into().expect("8 bytes"));
        if &header[..8] != MAGIC {
            return Err(std::io::Error::other(
                "not a cairn lazy journal (bad magic)",
            ));
        }
        if n != objects.len() as u64 || hash != list_hash(&objects) {
            return Err(std::io::Error::other(format!(
                "the journal is for another list of objects ({n} objects, not {})",
                objects.len()
            )));
        }
        if file.metadata()?.len() < nodes_at() + n * NODE_LEN {
            return Err(std::io::Error::other("the journal is too short"));
        }
        Ok(Resumable(Arc::new(Journal {
            file,
            objects: objects.into(),
            free: Mutex::new((0..SLOTS).rev().collect()),
        })))
    }

    /// The journal's memory file (to pass to a successor across `exec`).
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.file.as_fd()
    }

    /// How many objects the layer serves.
    pub fn objects(&self) -> usize {
        self.0.objects.len()
    }
}

/// FNV-1a over the sorted list: that a successor derived the same list.
fn list_hash(objects: &[ObjectId]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in objects {
        for &b in &id.0 {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn nodes_at() -> u64 {
    HEADER_LEN + SLOTS as u64 * SLOT_LEN
}

pub(crate) struct Journal {
    file: File,
    pub objects: Arc<[ObjectId]>,
    free: Mutex<Vec<u32>>,
}

impl Journal {
    fn warn(what: &str, e: std::io::Error) {
        tracing::warn!("the lazy layer's journal: {what}: {e}");
    }

    /// The index of `id` in the list.
    pub fn index(&self, id: &ObjectId) -> Option<usize> {
        self.objects.binary_search(id).ok()
    }

    pub fn set_passthrough(&self, on: bool) {
        if let Err(e) = self.file.write_all_at(&[on as u8], 8) {
            Self::warn("writing the header", e);
        }
    }

    pub fn passthrough(&self) -> bool {
        let mut b = [0u8; 1];
        self.file.read_exact_at(&mut b, 8).is_ok() && b[0] == 1
    }

    /// Records a request before it is handled; `None` if it is too long
    /// or every slot is taken (it is then served unrecorded).
    pub fn record(&self, msg: &[u8]) -> Option<u32> {
        if msg.len() as u64 > SLOT_LEN - 4 {
            return None;
        }
        let slot = self.free.lock().expect("journal lock").pop()?;
        let mut buf = Vec::with_capacity(4 + msg.len());
        buf.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        buf.extend_from_slice(msg);
        // The request first, then its length, so that a slot is never seen
        // with a length and half a request.
        let at = HEADER_LEN + slot as u64 * SLOT_LEN;
        if let Err(e) = self
            .file
            .write_all_at(&buf[4..], at + 4)
            .and_then(|()| self.file.write_all_at(&buf[..4], at))
        {
            Self::warn("recording a request", e);
        }
        Some(slot)
    }

    /// The request in `slot` was answered.
    pub fn clear(&self, slot: u32) {
        let at = HEADER_LEN + slot as u64 * SLOT_LEN;
        if let Err(e) = self.file.write_all_at(&[0u8; 4], at) {
            Self::warn("clearing a request", e);
        }
        self.free.lock().expect("journal lock").push(slot);
    }

    /// The requests a predecessor left unanswered, in slot order; their
    /// slots are cleared.
    pub fn take_requests(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut all = vec![0u8; (SLOTS as u64 * SLOT_LEN) as usize];
        if let Err(e) = self.file.read_exact_at(&mut all, HEADER_LEN) {
            Self::warn("reading the requests left", e);
            return out;
        }
        for (i, slot) in all.chunks(SLOT_LEN as usize).enumerate() {
            let len = u32::from_le_bytes(slot[..4].try_into().expect("4 bytes")) as usize;
            if len == 0 {
                continue;
            }
            if len as u64 <= SLOT_LEN - 4 {
                out.push(slot[4..4 + len].to_vec());
            }
            let at = HEADER_LEN + i as u64 * SLOT_LEN;
            if let Err(e) = self.file.write_all_at(&[0u8; 4], at) {
                Self::warn("clearing a request", e);
            }
        }
        out
    }

    /// Writes node `index`'s open count and backing id through.
    pub fn write_node(&self, index: usize, opens: u32, backing: Option<i32>) {
        let mut rec = [0u8; NODE_LEN as usize];
        rec[..4].copy_from_slice(&opens.to_le_bytes());
        rec[4..].copy_from_slice(&backing.unwrap_or(0).to_le_bytes());
        if let Err(e) = self
            .file
            .write_all_at(&rec, nodes_at() + index as u64 * NODE_LEN)
        {
            Self::warn("writing a node", e);
        }
    }

    /// Nodes with opens or a backing id: (index, opens, backing id).
    pub fn live_nodes(&self) -> Vec<(usize, u32, Option<i32>)> {
        let mut out = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let total = self.objects.len() as u64 * NODE_LEN;
        let mut off = 0u64;
        while off < total {
            let n = chunk.len().min((total - off) as usize);
            if let Err(e) = self.file.read_exact_at(&mut chunk[..n], nodes_at() + off) {
                Self::warn("reading the nodes", e);
                return out;
            }
            for (i, rec) in chunk[..n].chunks(NODE_LEN as usize).enumerate() {
                let opens = u32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
                let backing = i32::from_le_bytes(rec[4..].try_into().expect("4 bytes"));
                if opens != 0 || backing > 0 {
                    let index = (off / NODE_LEN) as usize + i;
                    out.push((index, opens, (backing > 0).then_some(backing)));
                }
            }
            off += n as u64;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_nodes_round_trip() {
        let ids: Vec<ObjectId> = (0..5u8).rev().map(|b| ObjectId([b; 32])).collect();
        let r = Resumable::create(ids).unwrap();
        let j = &r.0;
        assert_eq!(j.index(&ObjectId([0; 32])), Some(0));
        assert_eq!(j.index(&ObjectId([4; 32])), Some(4));
        assert_eq!(j.index(&ObjectId([9; 32])), None);
        let a = j.record(b"first").unwrap();
        let b = j.record(b"second").unwrap();
        assert!(j.record(&[0u8; 300]).is_none());
        j.clear(a);
        j.write_node(3, 2, Some(7));
        j.write_node(1, 0, None);
        j.set_passthrough(true);
        assert!(j.passthrough());
        assert_eq!(j.take_requests(), vec![b"second".to_vec()]);
        assert!(j.take_requests().is_empty());
        assert_eq!(j.live_nodes(), vec![(3, 2, Some(7))]);
        let _ = b;
        // Every slot can be taken, and then none.
        let mut n = 0;
        while j.record(b"x").is_some() {
            n += 1;
        }
        assert_eq!(n, SLOTS - 1);
        // Reopened from its descriptor: only for the same list.
        let fd = || r.as_fd().try_clone_to_owned().unwrap();
        let ids: Vec<ObjectId> = (0..5u8).map(|b| ObjectId([b; 32])).collect();
        let again = Resumable::open(fd(), ids.clone()).unwrap();
        assert_eq!(again.0.live_nodes(), vec![(3, 2, Some(7))]);
        assert!(Resumable::open(fd(), ids[1..].to_vec()).is_err());
        let mut other = ids.clone();
        other[4] = ObjectId([9; 32]);
        assert!(Resumable::open(fd(), other).is_err());
    }
}
