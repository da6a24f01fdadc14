//! Handing a live connection to a successor over a unix socket.
//!
//! The old server stops its workers (each finishes the request in hand),
//! waits until no deferred open is left, and sends, on a stream socket:
//!
//! ```text
//! header   "CAIRNFUSE1" (10 bytes), with the /dev/fuse descriptor
//!          attached (SCM_RIGHTS)
//!          passthrough u8, next_node u64, next_fh u64,
//!          nodes u32, handles u32, target_len u32     (all little-endian)
//! target   target_len bytes: the mountpoint
//! nodes    per node: node u64, object id [32], size u64, nlookup u64,
//!          opens u32, backing id i32 (0: none)        64 bytes each
//! handles  per handle: fh u64, node u64               16 bytes each
//! ```
//!
//! The successor checks all of it (counts within its limits, node ids in
//! range and unique, object ids unique, every handle's node present, each
//! node's `opens` equal to its handles), opens each handle's object again
//! from the store, starts its workers and answers one byte, `K`. Only
//! then does the old server let go; without the `K` (an error, or the
//! socket closed) it starts its workers again and keeps serving. Backing
//! ids belong to the connection, not to a process, so they stay valid.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use cairn_store::ObjectId;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::server::{NodeState, ServerState, FIRST_OBJECT_ID};

const MAGIC: &[u8; 10] = b"CAIRNFUSE1";
const HEADER_LEN: usize = 10 + 1 + 8 + 8 + 4 + 4 + 4;
const NODE_LEN: usize = 64;
const HANDLE_LEN: usize = 16;
/// The longest mountpoint path accepted.
const MAX_TARGET: usize = 4096;
/// The answer that the successor serves.
pub(crate) const ACK: u8 = b'K';

/// Sends the connection `dev`, the mountpoint and `state`.
pub(crate) fn send(
    sock: &UnixStream,
    dev: BorrowedFd<'_>,
    target: &std::path::Path,
    state: &ServerState,
) -> io::Result<()> {
    let target = target.as_os_str().as_bytes();
    let mut header = Vec::with_capacity(HEADER_LEN);
    header.extend_from_slice(MAGIC);
    header.push(state.passthrough as u8);
    header.extend_from_slice(&state.next_node.to_le_bytes());
    header.extend_from_slice(&state.next_fh.to_le_bytes());
    header.extend_from_slice(&(state.nodes.len() as u32).to_le_bytes());
    header.extend_from_slice(&(state.handles.len() as u32).to_le_bytes());
    header.extend_from_slice(&(target.len() as u32).to_le_bytes());
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [dev];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the descriptor"));
    }
    // The descriptor travels with the first byte; the rest may follow in
    // plain writes.
    let n = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(&header)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    let mut w = io::BufWriter::new(sock);
    w.write_all(&header[n..])?;
    w.write_all(target)?;
    for n in &state.nodes {
        w.write_all(&n.node.to_le_bytes())?;
        w.write_all(&n.id.0)?;
        w.write_all(&n.size.to_le_bytes())?;
        w.write_all(&n.nlookup.to_le_bytes())?;
        w.write_all(&n.opens.to_le_bytes())?;
        w.write_all(&n.backing.to_le_bytes())?;
    }
    for (fh, node) in &state.handles {
        w.write_all(&fh.to_le_bytes())?;
        w.write_all(&node.to_le_bytes())?;
    }
    w.flush()
}

/// Receives what [`send`] sent: the connection, the mountpoint and the
/// state, checked against `max_nodes` and for consistency.
pub(crate) fn receive(
    sock: &UnixStream,
    max_nodes: usize,
) -> Result<(OwnedFd, PathBuf, ServerState), String> {
    let mut header = [0u8; HEADER_LEN];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut header)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| format!("receiving the connection: {e}"))?
    .bytes;
    let mut dev = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for fd in fds {
                dev.get_or_insert(fd);
            }
        }
    }
    let dev = dev.ok_or("the predecessor sent no descriptor")?;
    if got == 0 {
        return Err("the predecessor closed the socket".into());
    }
    let mut r = io::BufReader::new(sock);
    r.read_exact(&mut header[got..])
        .map_err(|e| format!("reading the hand-over header: {e}"))?;
    let (target, state) = decode(&header, &mut r, max_nodes)?;
    // The descriptor must be a FUSE device.
    let st = rustix::fs::fstat(dev.as_fd()).map_err(|e| format!("fstat: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::CharacterDevice {
        return Err("the descriptor received is not a character device".into());
    }
    Ok((dev, target, state))
}

fn le_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// Parses and checks the header and what follows it.
pub(crate) fn decode(
    header: &[u8; HEADER_LEN],
    r: &mut impl Read,
    max_nodes: usize,
) -> Result<(PathBuf, ServerState), String> {
    if &header[..10] != MAGIC {
        return Err("not a cairn FUSE hand-over (bad magic)".into());
    }
    let passthrough = match header[10] {
        0 => false,
        1 => true,
        b => return Err(format!("passthrough flag {b} is neither 0 nor 1")),
    };
    let next_node = le_u64(header, 11);
    let next_fh = le_u64(header, 19);
    let n_nodes = le_u32(header, 27) as usize;
    let n_handles = le_u32(header, 31) as usize;
    let target_len = le_u32(header, 35) as usize;
    if n_nodes > max_nodes {
        return Err(format!(
            "{n_nodes} nodes, more than the limit of {max_nodes}"
        ));
    }
    if target_len == 0 || target_len > MAX_TARGET {
        return Err(format!("mountpoint of {target_len} bytes"));
    }
    if next_node < FIRST_OBJECT_ID {
        return Err(format!(
            "next node id {next_node} is below the first object id"
        ));
    }
    let mut target = vec![0u8; target_len];
    r.read_exact(&mut target)
        .map_err(|e| format!("reading the mountpoint: {e}"))?;
    let target = PathBuf::from(std::ffi::OsStr::from_bytes(&target));
    if !target.is_absolute() {
        return Err(format!("mountpoint {} is not absolute", target.display()));
    }
    let mut nodes = Vec::with_capacity(n_nodes.min(1 << 16));
    let mut seen_nodes = std::collections::HashMap::new();
    let mut seen_ids = std::collections::HashSet::new();
    let mut rec = [0u8; NODE_LEN];
    for _ in 0..n_nodes {
        r.read_exact(&mut rec)
            .map_err(|e| format!("reading a node: {e}"))?;
        let node = le_u64(&rec, 0);
        let id = ObjectId(rec[8..40].try_into().expect("32 bytes"));
        let n = NodeState {
            node,
            id,
            size: le_u64(&rec, 40),
            nlookup: le_u64(&rec, 48),
            opens: le_u32(&rec, 56),
            backing: le_u32(&rec, 60) as i32,
        };
        if !(FIRST_OBJECT_ID..next_node).contains(&node) {
            return Err(format!("node id {node} out of range"));
        }
        if n.backing < 0 || (n.backing > 0 && (n.opens == 0 || !passthrough)) {
            return Err(format!(
                "node {node}: backing id {} with {} opens",
                n.backing, n.opens
            ));
        }
        if seen_nodes.insert(node, 0u32).is_some() || !seen_ids.insert(id) {
            return Err(format!("node {node} (object {id}) appears twice"));
        }
        nodes.push(n);
    }
    if n_handles > nodes.iter().map(|n| n.opens as usize).sum::<usize>() {
        return Err(format!("{n_handles} handles, more than the nodes' opens"));
    }
    let mut handles = Vec::with_capacity(n_handles);
    let mut seen_fh = std::collections::HashSet::new();
    let mut rec = [0u8; HANDLE_LEN];
    for _ in 0..n_handles {
        r.read_exact(&mut rec)
            .map_err(|e| format!("reading a handle: {e}"))?;
        let (fh, node) = (le_u64(&rec, 0), le_u64(&rec, 8));
        if fh == 0 || fh >= next_fh || !seen_fh.insert(fh) {
            return Err(format!("handle {fh} out of range or repeated"));
        }
        *seen_nodes
            .get_mut(&node)
            .ok_or_else(|| format!("handle {fh} names unknown node {node}"))? += 1;
        handles.push((fh, node));
    }
    for n in &nodes {
        if seen_nodes[&n.node] != n.opens {
            return Err(format!(
                "node {} has {} opens but {} handles",
                n.node, n.opens, seen_nodes[&n.node]
            ));
        }
    }
    Ok((
        target,
        ServerState {
            passthrough,
            next_node,
            next_fh,
            nodes,
            handles,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> ServerState {
        ServerState {
            passthrough: true,
            next_node: FIRST_OBJECT_ID + 3,
            next_fh: 10,
            nodes: vec![
                NodeState {
                    node: FIRST_OBJECT_ID,
                    id: ObjectId([1; 32]),
                    size: 5,
                    nlookup: 2,
                    opens: 2,
                    backing: 7,
                },
                NodeState {
                    node: FIRST_OBJECT_ID + 2,
                    id: ObjectId([2; 32]),
                    size: 0,
                    nlookup: 1,
                    opens: 0,
                    backing: 0,
                },
            ],
            handles: vec![(3, FIRST_OBJECT_ID), (9, FIRST_OBJECT_ID)],
        }
    }

    fn encode(st: &ServerState) -> Vec<u8> {
        let (a, b) = UnixStream::pair().unwrap();
        let dev = std::fs::File::open("/dev/null").unwrap();
        send(&a, dev.as_fd(), std::path::Path::new("/run/x"), st).unwrap();
        drop(a);
        // Drain, dropping the descriptor.
        let (_fd, target, got) = receive(&b, 100).unwrap();
        assert_eq!(target, PathBuf::from("/run/x"));
        assert_eq!(&got, st);
        let mut out = Vec::new();
        // Re-encode by hand for the corruption tests below.
        out.extend_from_slice(MAGIC);
        out.push(st.passthrough as u8);
        out.extend_from_slice(&st.next_node.to_le_bytes());
        out.extend_from_slice(&st.next_fh.to_le_bytes());
        out.extend_from_slice(&(st.nodes.len() as u32).to_le_bytes());
        out.extend_from_slice(&(st.handles.len() as u32).to_le_bytes());
        out.extend_from_slice(&6u32.to_le_bytes());
        out.extend_from_slice(b"/run/x");
        for n in &st.nodes {
            out.extend_from_slice(&n.node.to_le_bytes());
            out.extend_from_slice(&n.id.0);
            out.extend_from_slice(&n.size.to_le_bytes());
            out.extend_from_slice(&n.nlookup.to_le_bytes());
            out.extend_from_slice(&n.opens.to_le_bytes());
            out.extend_from_slice(&n.backing.to_le_bytes());
        }
        for (fh, node) in &st.handles {
            out.extend_from_slice(&fh.to_le_bytes());
            out.extend_from_slice(&node.to_le_bytes());
        }
        out
    }

    fn decode_bytes(b: &[u8]) -> Result<(PathBuf, ServerState), String> {
        if b.len() < HEADER_LEN {
            return Err("short".into());
        }
        let header: [u8; HEADER_LEN] = b[..HEADER_LEN].try_into().unwrap();
        decode(&header, &mut &b[HEADER_LEN..], 100)
    }

    #[test]
    fn round_trip_over_a_socket() {
        let st = state();
        let bytes = encode(&st);
        assert_eq!(decode_bytes(&bytes).unwrap().1, st);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = encode(&state());
        for n in 0..bytes.len() {
            assert!(decode_bytes(&bytes[..n]).is_err(), "{n} bytes decoded");
        }
    }

    #[test]
    fn inconsistent_states_are_refused() {
        let mut st = state();
        st.handles.pop(); // 2 opens, 1 handle
        assert!(decode_bytes(&encode_unchecked(&st)).is_err());
        let mut st = state();
        st.nodes[1].id = st.nodes[0].id;
        assert!(decode_bytes(&encode_unchecked(&st)).is_err());
        let mut st = state();
        st.handles[1].1 = 12345;
        assert!(decode_bytes(&encode_unchecked(&st)).is_err());
        let mut st = state();
        st.nodes[0].node = st.next_node;
        assert!(decode_bytes(&encode_unchecked(&st)).is_err());
        let mut bytes = encode(&state());
        bytes[0] = b'X';
        assert!(decode_bytes(&bytes).is_err());
        // More nodes than the limit.
        let mut bytes = encode(&state());
        bytes[27..31].copy_from_slice(&1000u32.to_le_bytes());
        assert!(decode_bytes(&bytes).is_err());
    }

    /// Encodes without the round trip (for states `receive` would refuse).
    fn encode_unchecked(st: &ServerState) -> Vec<u8> {
        let (a, mut b) = UnixStream::pair().unwrap();
        let dev = std::fs::File::open("/dev/null").unwrap();
        let st2 = st.clone();
        let t = std::thread::spawn(move || {
            send(&a, dev.as_fd(), std::path::Path::new("/run/x"), &st2).unwrap();
        });
        let mut out = Vec::new();
        b.read_to_end(&mut out).unwrap();
        t.join().unwrap();
        out
    }
}
