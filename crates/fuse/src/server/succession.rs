//! What a successor takes over from the worker before it: the node table
//! and handles as state handed over (`handover`), or rebuilt from the
//! journal's open counts and backing ids, and the requests left
//! unanswered (docs/lazy-fuse.md, "Surviving the server").

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_store::ObjectId;

use super::{Handle, Node, Server, FIRST_OBJECT_ID};
use crate::proto::{self, Reply};

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

impl Server {
    /// The journal's index of `node`, if it names an object of the list.
    pub(super) fn journal_index(&self, node: u64) -> Option<usize> {
        let j = self.journal.as_ref()?;
        let i = node.checked_sub(FIRST_OBJECT_ID)? as usize;
        (i < j.objects.len()).then_some(i)
    }

    /// Writes `node`'s opens and backing id through to the journal.
    pub(super) fn persist(&self, node: u64, n: &Node) {
        if let (Some(j), Some(i)) = (&self.journal, self.journal_index(node)) {
            j.write_node(i, n.opens, n.backing);
        }
    }

    /// Makes sure the node table holds `node` when it is one of the
    /// journal's objects that a predecessor gave the kernel (its lookup
    /// count is then unknown: 0, so it stays until its opens are gone).
    pub(super) fn materialize(&self, node: u64) {
        let Some(i) = self.journal_index(node) else {
            return;
        };
        if self
            .nodes
            .lock()
            .expect("nodes lock")
            .nodes
            .contains_key(&node)
        {
            return;
        }
        let id = self.journal.as_ref().expect("journal").objects[i];
        let Some(size) = self.object_size(&id) else {
            return;
        };
        let mut nodes = self.nodes.lock().expect("nodes lock");
        if !nodes.nodes.contains_key(&node) {
            nodes.by_id.insert(id, node);
            nodes.nodes.insert(
                node,
                Node {
                    id,
                    size,
                    nlookup: 0,
                    opens: 0,
                    chunked: 0,
                    backing: None,
                },
            );
        }
    }

    /// A successor's start: the journal's open counts and backing ids
    /// into the node table, then the requests the predecessor left
    /// unanswered handled again (a RELEASE is only answered: whether the
    /// predecessor applied it is unknown, and an open count too high only
    /// keeps a backing id registered until the connection ends).
    pub fn resume(self: &Arc<Self>) {
        let Some(j) = self.journal.clone() else {
            return;
        };
        self.passthrough.store(j.passthrough(), Ordering::Relaxed);
        let live = j.live_nodes();
        for &(i, _, _) in &live {
            self.materialize(FIRST_OBJECT_ID + i as u64);
        }
        {
            let mut nodes = self.nodes.lock().expect("nodes lock");
            for (i, opens, backing) in live {
                if let Some(n) = nodes.nodes.get_mut(&(FIRST_OBJECT_ID + i as u64)) {
                    n.opens = opens;
                    n.backing = backing;
                    // Opens without a backing id were served by READ (the
                    // object was being fetched chunk by chunk); the kernel
                    // refuses passthrough opens of the inode until they are
                    // released.
                    n.chunked = if backing.is_none() { opens } else { 0 };
                }
            }
        }
        let left = j.take_requests();
        if !left.is_empty() {
            tracing::warn!(
                "answering {} requests a killed predecessor left",
                left.len()
            );
        }
        for msg in left {
            match proto::InHeader::parse(&msg) {
                Ok(h) if h.opcode == proto::opcode::RELEASE => {
                    self.reply(Reply::ok(h.unique));
                }
                Ok(h)
                    if matches!(
                        h.opcode,
                        proto::opcode::FORGET
                            | proto::opcode::BATCH_FORGET
                            | proto::opcode::INTERRUPT
                            | proto::opcode::DESTROY
                            | proto::opcode::INIT
                    ) => {}
                Ok(_) => {
                    self.handle(&msg);
                }
                Err(_) => {}
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
            let path = crate::local_path(&self.store, self.fetcher.source(), &id);
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
}
