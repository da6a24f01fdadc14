//! The object index: which pack, where in it and how long each object's
//! frames are, and for a chunked object each chunk's sha256. A versioned
//! little-endian binary format (`docs/lazy-format.md` draws it):
//!
//! ```text
//! header   40 bytes: magic "CAIRNLZI", version u32 = 1, chunk size u32,
//!          object count u64, chunk count u64, pack count u32, reserved u32 = 0
//! packs    pack count × u64: each pack's length in bytes
//! objects  object count × 72 bytes, sorted by id, ids distinct:
//!          id [32], pack u32, chunks u32 (0: one frame), offset u64,
//!          compressed length u64, size u64, first chunk u64
//! chunks   chunk count × 56 bytes, each object's in order, objects in id order:
//!          pack u32, size u32, offset u64, compressed length u64, sha256 [32]
//! ```
//!
//! The index is untrusted input (it came from a registry, reached through
//! digests, but written by whoever pushed it): [`Index::parse`] checks
//! every count against the length of the bytes before anything is
//! allocated, every entry against the packs and the chunk size, and
//! keeps the bytes as they are, looking entries up by binary search, so
//! an index costs its own size in memory and nothing more.

use std::fmt;

use cairn_store::ObjectId;

pub const MAGIC: [u8; 8] = *b"CAIRNLZI";
pub const VERSION: u32 = 1;
/// Objects larger than this are split into chunks of this size, each its
/// own zstd frame with its own sha256.
pub const CHUNK_SIZE: u32 = 1 << 20;
const HEADER_LEN: usize = 40;
const PACK_LEN: usize = 8;
const OBJECT_LEN: usize = 72;
const CHUNK_LEN: usize = 56;
/// The most objects, chunks and packs an index may list.
pub const MAX_OBJECTS: u64 = 1 << 24;
pub const MAX_CHUNKS: u64 = 1 << 26;
pub const MAX_PACKS: u64 = 1 << 20;
/// The largest object an index may describe (1 TiB).
pub const MAX_OBJECT_SIZE: u64 = 1 << 40;
/// The longest one frame may be compressed: zstd's worst case for a chunk
/// is a little over the chunk itself; anything past twice that is a lie.
pub const MAX_FRAME: u64 = 2 * CHUNK_SIZE as u64 + 4096;
/// The largest decompressed index read.
pub const MAX_INDEX_BYTES: u64 = HEADER_LEN as u64
    + MAX_PACKS * PACK_LEN as u64
    + (1 << 21) * OBJECT_LEN as u64
    + (1 << 22) * CHUNK_LEN as u64;

/// Why an index was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexError(pub String);

impl fmt::Display for IndexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad<T>(msg: impl Into<String>) -> Result<T, IndexError> {
    Err(IndexError(msg.into()))
}

/// Where one frame is: a byte range of a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub pack: u32,
    pub offset: u64,
    pub compressed: u64,
    /// Bytes it decompresses to.
    pub size: u64,
    /// For a chunk, its sha256; for a whole object, none (the object's
    /// fs-verity digest checks it).
    pub sha256: Option<[u8; 32]>,
}

/// One object of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectEntry {
    pub id: ObjectId,
    pub size: u64,
    /// One frame (the whole object), or its chunks in order.
    pub frames: Vec<Frame>,
}

impl ObjectEntry {
    pub fn is_chunked(&self) -> bool {
        self.frames.first().is_some_and(|f| f.sha256.is_some())
    }
}

/// A parsed, checked index.
#[derive(Debug, Clone)]
pub struct Index {
    bytes: Vec<u8>,
    objects: u64,
    chunks: u64,
    packs: Vec<u64>,
    chunk_size: u32,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Index {
    /// Parses and checks `bytes` (the decompressed index blob).
    pub fn parse(bytes: Vec<u8>) -> Result<Index, IndexError> {
        if bytes.len() < HEADER_LEN {
            return bad(format!(
                "{} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            ));
        }
        if bytes[..8] != MAGIC {
            return bad("not a cairn lazy index (bad magic)");
        }
        let version = u32_at(&bytes, 8);
        if version != VERSION {
            return bad(format!(
                "index format version {version}; this cairn reads version {VERSION}"
            ));
        }
        let chunk_size = u32_at(&bytes, 12);
        if chunk_size != CHUNK_SIZE {
            return bad(format!(
                "chunk size {chunk_size}; version {VERSION} has {CHUNK_SIZE}"
            ));
        }
        let objects = u64_at(&bytes, 16);
        let chunks = u64_at(&bytes, 24);
        let npacks = u64::from(u32_at(&bytes, 32));
        if u32_at(&bytes, 36) != 0 {
            return bad("reserved header field is not 0");
        }
        if objects > MAX_OBJECTS || chunks > MAX_CHUNKS || npacks > MAX_PACKS {
            return bad(format!(
                "{objects} objects, {chunks} chunks, {npacks} packs: more than an index may hold \
                 ({MAX_OBJECTS}, {MAX_CHUNKS}, {MAX_PACKS})"
            ));
        }
        // The counts are capped, so this cannot overflow.
        let expected = HEADER_LEN as u64
            + npacks * PACK_LEN as u64
            + objects * OBJECT_LEN as u64
            + chunks * CHUNK_LEN as u64;
        if bytes.len() as u64 != expected {
            return bad(format!(
                "{} bytes, but its header ({objects} objects, {chunks} chunks, {npacks} packs) \
                 says {expected}",
                bytes.len()
            ));
        }
        let packs: Vec<u64> = (0..npacks as usize)
            .map(|i| u64_at(&bytes, HEADER_LEN + i * PACK_LEN))
            .collect();
        let index = Index {
            bytes,
            objects,
            chunks,
            packs,
            chunk_size,
        };
        index.check()?;
        Ok(index)
    }

    fn objects_at(&self) -> usize {
        HEADER_LEN + self.packs.len() * PACK_LEN
    }

    fn chunks_at(&self) -> usize {
        self.objects_at() + self.objects as usize * OBJECT_LEN
    }

    /// Every entry in range, ids strictly increasing, chunk runs
    /// contiguous and complete.
    fn check(&self) -> Result<(), IndexError> {
        let mut prev: Option<[u8; 32]> = None;
        let mut next_chunk = 0u64;
        let cs = u64::from(self.chunk_size);
        for i in 0..self.objects as usize {
            let at = self.objects_at() + i * OBJECT_LEN;
            let e = &self.bytes[at..at + OBJECT_LEN];
            let id: [u8; 32] = e[..32].try_into().expect("32 bytes");
            let hexid = || hex::encode(id);
            if prev.is_some_and(|p| p >= id) {
                return bad(format!(
                    "object {} is out of order (ids must increase)",
                    hexid()
                ));
            }
            prev = Some(id);
            let pack = u32_at(e, 32);
            let nchunks = u64::from(u32_at(e, 36));
            let offset = u64_at(e, 40);
            let compressed = u64_at(e, 48);
            let size = u64_at(e, 56);
            let first = u64_at(e, 64);
            if size == 0 || size > MAX_OBJECT_SIZE {
                return bad(format!("object {}: size {size} out of range", hexid()));
            }
            if nchunks == 0 {
                if size > cs {
                    return bad(format!(
                        "object {}: {size} bytes in one frame, more than the chunk size {cs}",
                        hexid()
                    ));
                }
                self.check_frame(pack, offset, compressed)
                    .map_err(|m| IndexError(format!("object {}: {m}", hexid())))?;
                if first != 0 {
                    return bad(format!("object {}: one frame but a first chunk", hexid()));
                }
                continue;
            }
            if nchunks != size.div_ceil(cs) || nchunks < 2 {
                return bad(format!(
                    "object {}: {size} bytes in {nchunks} chunks of {cs}",
                    hexid()
                ));
            }
            if first != next_chunk {
                return bad(format!(
                    "object {}: chunks start at {first}, expected {next_chunk}",
                    hexid()
                ));
            }
            if first + nchunks > self.chunks {
                return bad(format!(
                    "object {}: chunks {first}..{} past the {} listed",
                    hexid(),
                    first + nchunks,
                    self.chunks
                ));
            }
            let mut total = 0u64;
            for k in 0..nchunks {
                let c = self.chunk(first + k);
                let last = k + 1 == nchunks;
                if c.size == 0 || c.size > cs || (!last && c.size != cs) {
                    return bad(format!(
                        "object {}: chunk {k} holds {} bytes (chunks are {cs} bytes, the last at most)",
                        hexid(),
                        c.size
                    ));
                }
                self.check_frame(c.pack, c.offset, c.compressed)
                    .map_err(|m| IndexError(format!("object {} chunk {k}: {m}", hexid())))?;
                total += c.size;
            }
            if total != size {
                return bad(format!(
                    "object {}: chunks hold {total} bytes, the object {size}",
                    hexid()
                ));
            }
            next_chunk = first + nchunks;
        }
        if next_chunk != self.chunks {
            return bad(format!(
                "{} chunks listed, objects use {next_chunk}",
                self.chunks
            ));
        }
        Ok(())
    }

    fn check_frame(&self, pack: u32, offset: u64, compressed: u64) -> Result<(), String> {
        let Some(&len) = self.packs.get(pack as usize) else {
            return Err(format!("pack {pack}, but there are {}", self.packs.len()));
        };
        if compressed == 0 || compressed > MAX_FRAME {
            return Err(format!("frame of {compressed} bytes out of range"));
        }
        match offset.checked_add(compressed) {
            Some(end) if end <= len => Ok(()),
            _ => Err(format!(
                "frame {offset}+{compressed} past the end of pack {pack} ({len} bytes)"
            )),
        }
    }

    fn chunk(&self, n: u64) -> Frame {
        let at = self.chunks_at() + n as usize * CHUNK_LEN;
        let c = &self.bytes[at..at + CHUNK_LEN];
        Frame {
            pack: u32_at(c, 0),
            size: u64::from(u32_at(c, 4)),
            offset: u64_at(c, 8),
            compressed: u64_at(c, 16),
            sha256: Some(c[24..56].try_into().expect("32 bytes")),
        }
    }

    fn entry_at(&self, i: usize) -> ObjectEntry {
        let at = self.objects_at() + i * OBJECT_LEN;
        let e = &self.bytes[at..at + OBJECT_LEN];
        let id = ObjectId(e[..32].try_into().expect("32 bytes"));
        let nchunks = u64::from(u32_at(e, 36));
        let size = u64_at(e, 56);
        let frames = if nchunks == 0 {
            vec![Frame {
                pack: u32_at(e, 32),
                offset: u64_at(e, 40),
                compressed: u64_at(e, 48),
                size,
                sha256: None,
            }]
        } else {
            let first = u64_at(e, 64);
            (first..first + nchunks).map(|n| self.chunk(n)).collect()
        };
        ObjectEntry { id, size, frames }
    }

    /// The entry of object `id`, if the index lists it.
    pub fn get(&self, id: &ObjectId) -> Option<ObjectEntry> {
        let (mut lo, mut hi) = (0usize, self.objects as usize);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let at = self.objects_at() + mid * OBJECT_LEN;
            match self.bytes[at..at + 32].cmp(&id.0[..]) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.entry_at(mid)),
            }
        }
        None
    }

    /// The size of object `id`, if listed.
    pub fn size(&self, id: &ObjectId) -> Option<u64> {
        self.get(id).map(|e| e.size)
    }

    /// Every entry, in id order.
    pub fn entries(&self) -> impl Iterator<Item = ObjectEntry> + '_ {
        (0..self.objects as usize).map(|i| self.entry_at(i))
    }

    pub fn len(&self) -> u64 {
        self.objects
    }

    pub fn is_empty(&self) -> bool {
        self.objects == 0
    }

    /// Each pack's length.
    pub fn packs(&self) -> &[u64] {
        &self.packs
    }
}

/// Builds an index: objects are added as they are packed, in any order.
#[derive(Debug, Default)]
pub struct IndexBuilder {
    packs: Vec<u64>,
    objects: Vec<(ObjectId, u64, Vec<Frame>)>,
}

impl IndexBuilder {
    pub fn new() -> IndexBuilder {
        IndexBuilder::default()
    }

    /// Records that pack `n` (the next one) is `len` bytes long.
    pub fn add_pack(&mut self, len: u64) {
        self.packs.push(len);
    }

    /// Adds an object: one frame without a sha256, or chunk frames each
    /// with its sha256.
    pub fn add_object(&mut self, id: ObjectId, size: u64, frames: Vec<Frame>) {
        self.objects.push((id, size, frames));
    }

    /// The index's bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.objects.sort_by_key(|a| a.0);
        self.objects.dedup_by(|a, b| a.0 == b.0);
        let nchunks: usize = self
            .objects
            .iter()
            .filter(|o| o.2.len() > 1 || o.2.first().is_some_and(|f| f.sha256.is_some()))
            .map(|o| o.2.len())
            .sum();
        let mut out = Vec::with_capacity(
            HEADER_LEN
                + self.packs.len() * PACK_LEN
                + self.objects.len() * OBJECT_LEN
                + nchunks * CHUNK_LEN,
        );
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&CHUNK_SIZE.to_le_bytes());
        out.extend_from_slice(&(self.objects.len() as u64).to_le_bytes());
        out.extend_from_slice(&(nchunks as u64).to_le_bytes());
        out.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for p in &self.packs {
            out.extend_from_slice(&p.to_le_bytes());
        }
        let mut chunks = Vec::new();
        for (id, size, frames) in &self.objects {
            out.extend_from_slice(&id.0);
            let chunked = frames.first().is_some_and(|f| f.sha256.is_some());
            if chunked {
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&(frames.len() as u32).to_le_bytes());
                out.extend_from_slice(&0u64.to_le_bytes());
                out.extend_from_slice(&0u64.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&((chunks.len() / CHUNK_LEN) as u64).to_le_bytes());
                for f in frames {
                    chunks.extend_from_slice(&f.pack.to_le_bytes());
                    chunks.extend_from_slice(&(f.size as u32).to_le_bytes());
                    chunks.extend_from_slice(&f.offset.to_le_bytes());
                    chunks.extend_from_slice(&f.compressed.to_le_bytes());
                    chunks.extend_from_slice(&f.sha256.unwrap_or([0; 32]));
                }
            } else {
                let f = frames[0];
                out.extend_from_slice(&f.pack.to_le_bytes());
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&f.offset.to_le_bytes());
                out.extend_from_slice(&f.compressed.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&0u64.to_le_bytes());
            }
        }
        out.extend_from_slice(&chunks);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ObjectId {
        ObjectId([n; 32])
    }

    fn frame(pack: u32, offset: u64, compressed: u64, size: u64) -> Frame {
        Frame {
            pack,
            offset,
            compressed,
            size,
            sha256: None,
        }
    }

    fn sample() -> Vec<u8> {
        let mut b = IndexBuilder::new();
        b.add_pack(1000);
        b.add_pack(3 << 20);
        b.add_object(id(9), 500, vec![frame(0, 0, 100, 500)]);
        b.add_object(id(3), 4096, vec![frame(0, 100, 200, 4096)]);
        let cs = u64::from(CHUNK_SIZE);
        let chunks = vec![
            Frame {
                sha256: Some([1; 32]),
                ..frame(1, 0, cs, cs)
            },
            Frame {
                sha256: Some([2; 32]),
                ..frame(1, cs, 10, 7)
            },
        ];
        b.add_object(id(5), cs + 7, chunks);
        b.finish()
    }

    #[test]
    fn round_trip() {
        let index = Index::parse(sample()).unwrap();
        assert_eq!(index.len(), 3);
        assert_eq!(index.packs(), &[1000, 3 << 20]);
        let e = index.get(&id(3)).unwrap();
        assert_eq!(e.size, 4096);
        assert_eq!(e.frames, vec![frame(0, 100, 200, 4096)]);
        assert!(!e.is_chunked());
        let big = index.get(&id(5)).unwrap();
        assert!(big.is_chunked());
        assert_eq!(big.frames.len(), 2);
        assert_eq!(big.frames[1].sha256, Some([2; 32]));
        assert_eq!(big.frames[1].size, 7);
        assert!(index.get(&id(4)).is_none());
        assert_eq!(index.size(&id(9)), Some(500));
        let ids: Vec<_> = index.entries().map(|e| e.id).collect();
        assert_eq!(ids, vec![id(3), id(5), id(9)]);
    }

    #[test]
    fn every_truncation_is_refused() {
        let good = sample();
        for len in 0..good.len() {
            let e = Index::parse(good[..len].to_vec()).unwrap_err();
            assert!(!e.0.is_empty());
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(Index::parse(longer).is_err());
    }

    /// Every single-byte change either is refused or still parses to
    /// entries that stay inside their packs (never a panic).
    #[test]
    fn hostile_bytes_never_panic() {
        let good = sample();
        for i in 0..good.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = good.clone();
                b[i] = v;
                if let Ok(index) = Index::parse(b) {
                    for e in index.entries() {
                        for f in e.frames {
                            assert!(f.offset + f.compressed <= index.packs()[f.pack as usize]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lies_are_named() {
        let good = sample();
        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Index::parse(huge).unwrap_err().0.contains("more than"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(Index::parse(magic).unwrap_err().0.contains("magic"));
        let mut version = good.clone();
        version[8] = 2;
        assert!(Index::parse(version).unwrap_err().0.contains("version 2"));
        // A frame past its pack.
        let mut b = IndexBuilder::new();
        b.add_pack(100);
        b.add_object(id(1), 50, vec![frame(0, 90, 20, 50)]);
        let e = Index::parse(b.finish()).unwrap_err();
        assert!(e.0.contains("past the end of pack 0"), "{e}");
        // A pack that is not there.
        let mut b = IndexBuilder::new();
        b.add_pack(100);
        b.add_object(id(1), 50, vec![frame(3, 0, 20, 50)]);
        assert!(Index::parse(b.finish()).unwrap_err().0.contains("pack 3"));
        // One frame bigger than a chunk.
        let mut b = IndexBuilder::new();
        b.add_pack(100);
        b.add_object(id(1), 5 << 20, vec![frame(0, 0, 20, 5 << 20)]);
        assert!(Index::parse(b.finish())
            .unwrap_err()
            .0
            .contains("one frame"));
    }
}
