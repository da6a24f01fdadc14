//! The prefetch list: the objects (and, for large objects, the chunks) a
//! recorded start read, in the order it read them (docs/lazy-fuse.md,
//! "The prefetch list"; docs/lazy-format.md).
//!
//! Two versions, told apart by the layer's media type:
//!
//! ```text
//! v1  application/vnd.cairn.lazy.v1.prefetch   object ids, 32 bytes each, end to end
//! v2  application/vnd.cairn.lazy.v2.prefetch
//!     header   16 bytes: magic "CAIRNPF2", entry count u32, reserved u32 = 0
//!     entries  entry count × (id [32], chunk count u32, chunk count × u32),
//!              little-endian; chunk count 0: the whole object; otherwise
//!              the indices of the chunks read, strictly increasing
//! ```
//!
//! `cairn push` writes v2 only when some entry names chunks, so a list of
//! whole objects stays readable by a cairn that knows only v1.
//!
//! The list comes from a registry: [`parse`] checks every count against
//! the bytes left before it allocates, caps the entries and the chunk
//! indices, refuses an id listed twice, and names the list and the entry
//! in its errors. [`resolve`] then checks the chunk indices against the
//! index (a chunk entry must be a chunked object, its indices below its
//! chunk count) and drops the ids the index lacks (the list is a hint).

use cairn_spec::media_type::{CAIRN_LAZY_PREFETCH, CAIRN_LAZY_PREFETCH_V2};
use cairn_store::ObjectId;

use crate::index::Index;
use crate::RemoteError;

pub const MAGIC_V2: [u8; 8] = *b"CAIRNPF2";
const HEADER_LEN: usize = 16;
/// The most entries a list may hold (either version).
pub const MAX_ENTRIES: usize = 1 << 20;
/// The most chunk indices one entry may name (a 4 TiB object read
/// everywhere; the index caps objects at 1 TiB).
pub const MAX_ENTRY_CHUNKS: usize = 1 << 22;
/// The most chunk indices a whole list may name.
pub const MAX_LIST_CHUNKS: usize = 1 << 22;

/// One entry: an object, and for a large object read in part, the chunks
/// that were read (None: the whole object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub id: ObjectId,
    pub chunks: Option<Vec<u32>>,
}

impl Entry {
    pub fn whole(id: ObjectId) -> Entry {
        Entry { id, chunks: None }
    }
}

/// The media type and bytes of `entries`: v1 if every entry is a whole
/// object, v2 otherwise. Chunk lists are written sorted and without
/// duplicates; an empty chunk list means the whole object.
pub fn encode(entries: &[Entry]) -> (&'static str, Vec<u8>) {
    if entries
        .iter()
        .all(|e| e.chunks.as_ref().is_none_or(|c| c.is_empty()))
    {
        return (
            CAIRN_LAZY_PREFETCH,
            entries.iter().flat_map(|e| e.id.0).collect(),
        );
    }
    let mut out = Vec::with_capacity(HEADER_LEN + entries.len() * 36);
    out.extend_from_slice(&MAGIC_V2);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for e in entries {
        out.extend_from_slice(&e.id.0);
        let mut c = e.chunks.clone().unwrap_or_default();
        c.sort_unstable();
        c.dedup();
        out.extend_from_slice(&(c.len() as u32).to_le_bytes());
        for k in c {
            out.extend_from_slice(&k.to_le_bytes());
        }
    }
    (CAIRN_LAZY_PREFETCH_V2, out)
}

/// Parses a list of media type `media_type`; `what` names it in errors
/// (the blob's digest and the image).
pub fn parse(media_type: &str, bytes: &[u8], what: &str) -> Result<Vec<Entry>, RemoteError> {
    let bad = |detail: String| RemoteError::invalid(what, detail);
    match media_type {
        CAIRN_LAZY_PREFETCH => {
            if !bytes.len().is_multiple_of(32) {
                return Err(bad(format!(
                    "{} bytes, not a whole number of 32-byte ids",
                    bytes.len()
                )));
            }
            if bytes.len() / 32 > MAX_ENTRIES {
                return Err(bad(format!(
                    "{} ids, more than {MAX_ENTRIES}",
                    bytes.len() / 32
                )));
            }
            let entries: Vec<Entry> = bytes
                .chunks_exact(32)
                .map(|raw| Entry::whole(ObjectId(raw.try_into().expect("32 bytes"))))
                .collect();
            no_repeats(&entries).map_err(bad)?;
            Ok(entries)
        }
        CAIRN_LAZY_PREFETCH_V2 => parse_v2(bytes).map_err(bad),
        other => Err(bad(format!("unknown media type {other:?}"))),
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn parse_v2(b: &[u8]) -> Result<Vec<Entry>, String> {
    if b.len() < HEADER_LEN {
        return Err(format!("{} bytes, shorter than its header", b.len()));
    }
    if b[..8] != MAGIC_V2 {
        return Err("no CAIRNPF2 magic".to_string());
    }
    let count = u32_at(b, 8) as usize;
    if u32_at(b, 12) != 0 {
        return Err("reserved header field is not 0".to_string());
    }
    if count > MAX_ENTRIES {
        return Err(format!("{count} entries, more than {MAX_ENTRIES}"));
    }
    // Every entry takes at least 36 bytes: the count must fit the bytes
    // before anything is allocated for it.
    if count > (b.len() - HEADER_LEN) / 36 {
        return Err(format!(
            "{count} entries, but only {} bytes follow the header",
            b.len() - HEADER_LEN
        ));
    }
    let mut entries = Vec::with_capacity(count);
    let mut at = HEADER_LEN;
    let mut total_chunks = 0usize;
    for i in 0..count {
        if b.len() - at < 36 {
            return Err(format!("entry {i}: truncated at byte {at}"));
        }
        let id = ObjectId(b[at..at + 32].try_into().expect("32 bytes"));
        let n = u32_at(b, at + 32) as usize;
        at += 36;
        if n > MAX_ENTRY_CHUNKS {
            return Err(format!(
                "entry {i} (object {id}): {n} chunks, more than {MAX_ENTRY_CHUNKS}"
            ));
        }
        if n > (b.len() - at) / 4 {
            return Err(format!(
                "entry {i} (object {id}): {n} chunks, but only {} bytes are left",
                b.len() - at
            ));
        }
        total_chunks += n;
        if total_chunks > MAX_LIST_CHUNKS {
            return Err(format!(
                "entry {i} (object {id}): more than {MAX_LIST_CHUNKS} chunks in the list"
            ));
        }
        let chunks = if n == 0 {
            None
        } else {
            let c: Vec<u32> = (0..n).map(|k| u32_at(b, at + 4 * k)).collect();
            if let Some(w) = c.windows(2).find(|w| w[0] >= w[1]) {
                return Err(format!(
                    "entry {i} (object {id}): chunk indices not strictly increasing ({} then {})",
                    w[0], w[1]
                ));
            }
            at += 4 * n;
            Some(c)
        };
        entries.push(Entry { id, chunks });
    }
    if at != b.len() {
        return Err(format!("{} bytes after its {count} entries", b.len() - at));
    }
    no_repeats(&entries)?;
    Ok(entries)
}

fn no_repeats(entries: &[Entry]) -> Result<(), String> {
    let mut ids: Vec<(ObjectId, usize)> =
        entries.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
    ids.sort_unstable_by_key(|(id, _)| id.0);
    match ids.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(format!(
            "object {} is listed twice (entries {} and {})",
            w[0].0,
            w[0].1.min(w[1].1),
            w[0].1.max(w[1].1)
        )),
        None => Ok(()),
    }
}

/// The entries whose objects `index` lists, in list order; a chunk entry
/// must be a chunked object of the index, its indices below its chunk
/// count (else the list does not belong to this index: an error naming
/// the list, `what`). A chunk entry that names every chunk becomes a
/// whole entry.
pub fn resolve(entries: Vec<Entry>, index: &Index, what: &str) -> Result<Vec<Entry>, RemoteError> {
    let mut out = Vec::with_capacity(entries.len());
    for (i, e) in entries.into_iter().enumerate() {
        let Some(obj) = index.get(&e.id) else {
            continue;
        };
        let Some(chunks) = e.chunks else {
            out.push(e);
            continue;
        };
        if !obj.is_chunked() {
            return Err(RemoteError::invalid(
                what,
                format!(
                    "entry {i}: object {} is one frame in the index, but the list names chunks of it",
                    e.id
                ),
            ));
        }
        let n = obj.frames.len();
        if let Some(k) = chunks.iter().find(|&&k| k as usize >= n) {
            return Err(RemoteError::invalid(
                what,
                format!(
                    "entry {i}: chunk {k} of object {}, which has {n} chunks",
                    e.id
                ),
            ));
        }
        out.push(Entry {
            id: e.id,
            chunks: (chunks.len() < n).then_some(chunks),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ObjectId {
        ObjectId([n; 32])
    }

    fn sample() -> Vec<Entry> {
        vec![
            Entry::whole(id(1)),
            Entry {
                id: id(2),
                chunks: Some(vec![0, 6]),
            },
            Entry::whole(id(3)),
        ]
    }

    #[test]
    fn whole_objects_are_written_as_v1_and_chunks_as_v2() {
        let whole = vec![Entry::whole(id(1)), Entry::whole(id(3))];
        let (mt, bytes) = encode(&whole);
        assert_eq!(mt, CAIRN_LAZY_PREFETCH);
        assert_eq!(bytes.len(), 64);
        assert_eq!(parse(mt, &bytes, "list").unwrap(), whole);

        let (mt, bytes) = encode(&sample());
        assert_eq!(mt, CAIRN_LAZY_PREFETCH_V2);
        assert_eq!(bytes.len(), 16 + 3 * 36 + 8);
        assert_eq!(parse(mt, &bytes, "list").unwrap(), sample());
    }

    #[test]
    fn every_truncation_and_every_corrupted_byte_is_refused_or_parsed() {
        let (mt, bytes) = encode(&sample());
        for n in 0..bytes.len() {
            let e = parse(mt, &bytes[..n], "prefetch list sha256:ab of image x").unwrap_err();
            assert!(e.to_string().contains("prefetch list sha256:ab"), "{e}");
        }
        for at in 0..bytes.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = bytes.clone();
                b[at] = v;
                let _ = parse(mt, &b, "list");
            }
        }
    }

    #[test]
    fn malformed_v2_lists_are_refused_with_what_was_wrong() {
        let err = |b: &[u8]| {
            parse(CAIRN_LAZY_PREFETCH_V2, b, "prefetch list L")
                .unwrap_err()
                .to_string()
        };
        let (_, good) = encode(&sample());
        let mut b = good.clone();
        b[0] = b'X';
        assert!(err(&b).contains("magic"), "{}", err(&b));
        // a huge entry count with few bytes: refused before allocating
        let mut b = good.clone();
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&b).contains("entries"), "{}", err(&b));
        let mut b = good.clone();
        b[8..12].copy_from_slice(&1000u32.to_le_bytes());
        assert!(err(&b).contains("only"), "{}", err(&b));
        // a huge chunk count in entry 1
        let mut b = good.clone();
        let at = 16 + 36 + 32;
        b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&b).contains("entry 1"), "{}", err(&b));
        // chunk indices out of order
        let mut b = good.clone();
        b[at + 4..at + 8].copy_from_slice(&7u32.to_le_bytes());
        assert!(err(&b).contains("strictly increasing"), "{}", err(&b));
        // trailing bytes
        let mut b = good.clone();
        b.push(0);
        assert!(err(&b).contains("after its 3 entries"), "{}", err(&b));
        // an id twice
        let (_, b) = encode(&[
            Entry::whole(id(1)),
            Entry {
                id: id(1),
                chunks: Some(vec![1]),
            },
        ]);
        assert!(err(&b).contains("listed twice"), "{}", err(&b));
        // an unknown media type
        let e = parse("application/x-other", &good, "prefetch list L").unwrap_err();
        assert!(e.to_string().contains("unknown media type"), "{e}");
        // v1 whose length is not a multiple of 32
        let e = parse(CAIRN_LAZY_PREFETCH, &[0; 33], "prefetch list L").unwrap_err();
        assert!(e.to_string().contains("32-byte ids"), "{e}");
    }
}
