//! fs-verity file digests computed in userspace, and the [`ObjectId`] they
//! name objects with.
//!
//! This module owns the digest arithmetic only: the Merkle tree the kernel
//! builds for `FS_IOC_ENABLE_VERITY` (SHA-256, 4096-byte blocks, no salt) and
//! the 256-byte `fsverity_descriptor` whose SHA-256 is the file digest. It
//! must never touch the filesystem or the kernel: asking the kernel to
//! enable or measure verity lives in `kernel.rs` and `sys.rs`.
//!
//! The tree, as `Documentation/filesystems/fsverity.rst` defines it: the data
//! is cut into blocks (the last one zero-padded) and each is hashed; the
//! hashes are concatenated and cut into blocks (the last one zero-padded)
//! and hashed again, level after level, until a level is a single block; the
//! root hash is the hash of that block. A file of at most one block has the
//! hash of its (padded) block as root; an empty file has an all-zero root.
//!
//! [`FsVerityHasher`] streams: it keeps one partial block per level, so its
//! memory is O(block size × log n) whatever the file size.
//!
//! Runs of zeros (the holes of sparse files) cost O(log n), not O(n):
//! [`FsVerityHasher::update_zeros`] hashes only the blocks that mix zeros
//! with other bytes. A whole block of zero data has one fixed hash, a hash
//! block full of that hash has another, and so on up the tree; those
//! zero-subtree hashes are computed once per level and pushed in bulk, so a
//! hole of any length costs at most about one block hash per level plus
//! copying up to two partial blocks of hashes per level. The digest is
//! exactly the one the bytes would give (the tests check it against
//! hashing the zeros one by one).

use std::fmt;
use std::io::{self, Read};
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::sha256x2;
use crate::StoreError;

/// Size of a SHA-256 hash, and of an [`ObjectId`].
const HASH_SIZE: usize = 32;
/// Merkle tree block size cairn (and composefs) use.
const BLOCK_SIZE: usize = 4096;
/// `FS_VERITY_HASH_ALG_SHA256`.
const HASH_ALG_SHA256: u8 = 1;
/// Deepest tree the kernel accepts (`FS_VERITY_MAX_LEVELS`); 8 levels of
/// 4096-byte blocks cover far more than any u64 file size.
const MAX_LEVELS: usize = 8;

/// The value of each byte as a hex digit (either case), 0xff if it is not
/// one.
static HEX_DIGIT: [u8; 256] = {
    let mut t = [0xffu8; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        t[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};

/// The identity of a store object: the fs-verity SHA-256 digest of its
/// contents, as the kernel would report it (`fsverity measure`) and as
/// composefs names its objects.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(pub [u8; 32]);

impl ObjectId {
    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses exactly 64 hex digits (either case; the store writes lowercase).
    /// A table lookup per digit: an image's thousands of redirects and a
    /// lazy index's entries are parsed on every lazy pull and mount, and
    /// the `hex` crate's digit-by-digit `match` was 6% of a lazy pull's CPU.
    pub fn from_hex(s: &str) -> Result<Self, StoreError> {
        let b = s.as_bytes();
        if b.len() != 2 * HASH_SIZE {
            return Err(StoreError::InvalidObjectId(s.to_owned()));
        }
        let mut out = [0u8; HASH_SIZE];
        // Every digit's value is at most 15; a non-digit is 0xff.
        let mut seen = 0u8;
        for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
            let (hi, lo) = (HEX_DIGIT[pair[0] as usize], HEX_DIGIT[pair[1] as usize]);
            seen |= hi | lo;
            *o = (hi << 4) | (lo & 0x0f);
        }
        if seen > 0x0f {
            return Err(StoreError::InvalidObjectId(s.to_owned()));
        }
        Ok(ObjectId(out))
    }

    /// The object's path relative to `objects/`: `"ab/cdef…"` (two hex
    /// digits of fan-out directory, then the other 62), as composefs lays it
    /// out and as `trusted.overlay.redirect` names it (after a leading `/`).
    pub fn object_path(&self) -> String {
        let hex = self.to_hex();
        format!("{}/{}", &hex[..2], &hex[2..])
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 2 * HASH_SIZE];
        // Cannot fail: the buffer is exactly twice the input.
        hex::encode_to_slice(self.0, &mut buf).map_err(|_| fmt::Error)?;
        f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({self})")
    }
}

impl FromStr for ObjectId {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, StoreError> {
        ObjectId::from_hex(s)
    }
}

/// Computes the fs-verity digest (SHA-256, 4096-byte blocks, no salt) of
/// everything `r` yields, reading it once.
pub fn fsverity_digest(mut r: impl Read) -> io::Result<ObjectId> {
    let mut hasher = FsVerityHasher::new();
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(hasher.finalize())
}

/// Incremental fs-verity digest: feed bytes with [`update`](Self::update) in
/// any pieces, then [`finalize`](Self::finalize).
#[derive(Clone)]
pub struct FsVerityHasher {
    tree: MerkleTree,
}

impl FsVerityHasher {
    pub fn new() -> Self {
        FsVerityHasher {
            tree: MerkleTree::new(BLOCK_SIZE),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        self.tree.update(data);
    }

    /// Feeds `n` zero bytes, in O(log n) time (see the module docs): the
    /// same digest as `update` with `n` zeros.
    pub fn update_zeros(&mut self, n: u64) {
        self.tree.update_zeros(n);
    }

    /// Number of bytes fed so far.
    pub fn len(&self) -> u64 {
        self.tree.data_size
    }

    pub fn is_empty(&self) -> bool {
        self.tree.data_size == 0
    }

    pub fn finalize(self) -> ObjectId {
        ObjectId(self.tree.digest())
    }
}

impl Default for FsVerityHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for FsVerityHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsVerityHasher")
            .field("len", &self.tree.data_size)
            .finish_non_exhaustive()
    }
}

/// One level of the tree: the hashes of the level below that do not fill a
/// block yet, and how many hashes the level has received in all.
#[derive(Clone)]
struct Level {
    partial: Vec<u8>,
    hashes: u64,
}

/// The streaming tree. The block size is a parameter only so the tests can
/// check deep trees against published vectors with small blocks (512-byte
/// blocks need three levels of hash blocks at 1 MB); the public API
/// always uses 4096.
#[derive(Clone)]
struct MerkleTree {
    block_size: usize,
    /// The data block being filled (never a full block between calls).
    data: Vec<u8>,
    data_size: u64,
    /// `levels[0]` collects the hashes of data blocks.
    levels: Vec<Level>,
    /// `zero_hashes[l]`: the hash `levels[l]` receives for a subtree of
    /// nothing but zeros (`[0]`: a zero data block), filled in on demand.
    zero_hashes: Vec<[u8; HASH_SIZE]>,
    /// Whether data blocks are hashed two at a time (4096-byte blocks on a
    /// CPU with SHA extensions: `sha256x2`).
    pairs: bool,
}

fn sha256(block: &[u8]) -> [u8; HASH_SIZE] {
    Sha256::digest(block).into()
}

impl MerkleTree {
    fn new(block_size: usize) -> Self {
        debug_assert!(block_size.is_power_of_two() && (512..=65536).contains(&block_size));
        MerkleTree {
            block_size,
            data: Vec::with_capacity(block_size),
            data_size: 0,
            levels: Vec::new(),
            zero_hashes: Vec::new(),
            pairs: block_size == sha256x2::BLOCK && sha256x2::available(),
        }
    }

    /// The hash of an all-zero subtree as `levels[level]` receives it.
    fn zero_hash(&mut self, level: usize) -> [u8; HASH_SIZE] {
        while self.zero_hashes.len() <= level {
            let hash = match self.zero_hashes.last() {
                None => sha256(&vec![0u8; self.block_size]),
                Some(below) => sha256(&below.repeat(self.block_size / HASH_SIZE)),
            };
            self.zero_hashes.push(hash);
        }
        self.zero_hashes[level]
    }

    fn ensure_level(&mut self, level: usize) {
        while self.levels.len() <= level {
            assert!(
                self.levels.len() < MAX_LEVELS,
                "fs-verity tree deeper than the kernel allows"
            );
            self.levels.push(Level {
                partial: Vec::with_capacity(self.block_size),
                hashes: 0,
            });
        }
    }

    /// `n` zero bytes: the partial data block is completed byte-wise, the
    /// whole zero blocks go up as zero-subtree hashes in bulk, the rest
    /// starts a new partial block.
    fn update_zeros(&mut self, mut n: u64) {
        let bs = self.block_size as u64;
        if !self.data.is_empty() {
            let take = (bs - self.data.len() as u64).min(n);
            self.data.resize(self.data.len() + take as usize, 0);
            self.data_size += take;
            n -= take;
            if self.data.len() < self.block_size {
                return;
            }
            let hash = sha256(&self.data);
            self.data.clear();
            self.push_hash(0, hash);
        }
        self.data_size += n;
        self.push_zero_hashes(0, n / bs);
        self.data.resize((n % bs) as usize, 0);
    }

    /// Pushes `count` zero-subtree hashes at `level`: one by one up to the
    /// next block boundary of the level, then whole blocks of them as
    /// zero-subtree hashes of the level above, then the rest one by one.
    fn push_zero_hashes(&mut self, level: usize, mut count: u64) {
        if count == 0 {
            return;
        }
        let hash = self.zero_hash(level);
        self.ensure_level(level);
        while count > 0 && !self.levels[level].partial.is_empty() {
            self.push_hash(level, hash);
            count -= 1;
        }
        let per_block = (self.block_size / HASH_SIZE) as u64;
        let full = count / per_block;
        if full > 0 {
            self.levels[level].hashes += full * per_block;
            self.push_zero_hashes(level + 1, full);
        }
        for _ in 0..count % per_block {
            self.push_hash(level, hash);
        }
    }

    fn update(&mut self, mut input: &[u8]) {
        self.data_size += input.len() as u64;
        if !self.data.is_empty() {
            let take = (self.block_size - self.data.len()).min(input.len());
            self.data.extend_from_slice(&input[..take]);
            input = &input[take..];
            if self.data.len() < self.block_size {
                return;
            }
            // The completed block goes with the caller's first whole block
            // where the two can be hashed together.
            let paired = match (self.pairs, input.split_first_chunk::<{ sha256x2::BLOCK }>()) {
                (true, Some((first, rest))) => self
                    .data
                    .as_slice()
                    .try_into()
                    .ok()
                    .and_then(|done| sha256x2::hash_pair(done, first))
                    .map(|hashes| (hashes, rest)),
                _ => None,
            };
            let done = match paired {
                Some(((h1, h2), rest)) => {
                    input = rest;
                    [Some(h1), Some(h2)]
                }
                None => [Some(sha256(&self.data)), None],
            };
            self.data.clear();
            for hash in done.into_iter().flatten() {
                self.push_hash(0, hash);
            }
        }
        // Whole blocks straight from the caller's buffer, without copying:
        // two at a time where the CPU can (see `sha256x2`).
        if self.pairs {
            let (blocks, rest) = input.as_chunks::<{ sha256x2::BLOCK }>();
            let mut pairs = blocks.chunks_exact(2);
            for pair in &mut pairs {
                match sha256x2::hash_pair(&pair[0], &pair[1]) {
                    Some((h1, h2)) => {
                        self.push_hash(0, h1);
                        self.push_hash(0, h2);
                    }
                    None => {
                        for block in pair {
                            let hash = sha256(block);
                            self.push_hash(0, hash);
                        }
                    }
                }
            }
            for block in pairs.remainder() {
                let hash = sha256(block);
                self.push_hash(0, hash);
            }
            self.data.extend_from_slice(rest);
            return;
        }
        let mut blocks = input.chunks_exact(self.block_size);
        for block in &mut blocks {
            let hash = sha256(block);
            self.push_hash(0, hash);
        }
        self.data.extend_from_slice(blocks.remainder());
    }

    fn push_hash(&mut self, mut level: usize, mut hash: [u8; HASH_SIZE]) {
        loop {
            self.ensure_level(level);
            let l = &mut self.levels[level];
            l.partial.extend_from_slice(&hash);
            l.hashes += 1;
            if l.partial.len() < self.block_size {
                return;
            }
            hash = sha256(&l.partial);
            l.partial.clear();
            level += 1;
        }
    }

    /// Flushes the partial blocks bottom-up and returns the root hash.
    fn root_hash(&mut self) -> [u8; HASH_SIZE] {
        if self.data_size == 0 {
            return [0; HASH_SIZE];
        }
        if !self.data.is_empty() {
            self.data.resize(self.block_size, 0);
            let hash = sha256(&self.data);
            self.data.clear();
            self.push_hash(0, hash);
        }
        let bs = self.block_size as u64;
        // Items (blocks) at the level below the one being looked at: the
        // data blocks first. When that count is one, the level above holds
        // exactly the root.
        let mut below = self.data_size.div_ceil(bs);
        let mut level = 0;
        loop {
            if below == 1 {
                let l = &self.levels[level];
                debug_assert_eq!(l.hashes, 1);
                let mut root = [0; HASH_SIZE];
                root.copy_from_slice(&l.partial[..HASH_SIZE]);
                return root;
            }
            let hashes_per_block = bs / HASH_SIZE as u64;
            let hashes = self.levels[level].hashes;
            debug_assert_eq!(hashes, below);
            if !self.levels[level].partial.is_empty() {
                let l = &mut self.levels[level];
                l.partial.resize(self.block_size, 0);
                let hash = sha256(&l.partial);
                l.partial.clear();
                self.push_hash(level + 1, hash);
            }
            below = hashes.div_ceil(hashes_per_block);
            level += 1;
        }
    }

    /// The fs-verity file digest: SHA-256 of the `fsverity_descriptor`.
    fn digest(mut self) -> [u8; HASH_SIZE] {
        let root = self.root_hash();
        let mut desc = [0u8; 256];
        desc[0] = 1; // version
        desc[1] = HASH_ALG_SHA256;
        desc[2] = self.block_size.trailing_zeros() as u8; // log_blocksize
                                                          // desc[3] (salt_size) and desc[4..8] (sig_size, reserved) stay zero.
        desc[8..16].copy_from_slice(&self.data_size.to_le_bytes());
        desc[16..16 + HASH_SIZE].copy_from_slice(&root);
        // root_hash is 64 bytes, then salt[32] and reserved[144]: all zero.
        sha256(&desc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pattern fsverity-utils' `lib/test_compute_digest.c` hashes.
    fn fsverity_utils_data(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| ((i % 11) + (i % 439) + (i % 1103)) as u8)
            .collect()
    }

    fn digest_with(block_size: usize, data: &[u8]) -> String {
        let mut t = MerkleTree::new(block_size);
        t.update(data);
        hex::encode(t.digest())
    }

    fn hex_of(data: &[u8]) -> String {
        fsverity_digest(data).unwrap().to_hex()
    }

    #[test]
    fn empty_file_digest_is_the_known_one() {
        assert_eq!(
            hex_of(b""),
            "3d248ca542a24fc62d1c43b916eae5016878e2533c88238480b26128a1f1af95"
        );
        assert_eq!(
            FsVerityHasher::new().finalize().to_hex(),
            "3d248ca542a24fc62d1c43b916eae5016878e2533c88238480b26128a1f1af95"
        );
    }

    /// The SHA-256, 4096-byte-block, unsalted vectors published with
    /// fsverity-utils (`lib/test_compute_digest.c`): 0, 1, 4096, 100000 and
    /// 1000000 bytes (the last two have two-level trees).
    #[test]
    fn fsverity_utils_vectors() {
        let data = fsverity_utils_data(1_000_000);
        let cases = [
            (
                1_000_000,
                "48df0c462329cd879661bd05b39aa81b05cc16afd27a7196a559da83531d39d9",
            ),
            (
                100_000,
                "f2096a36c5cdca4fa33ee8852833150bb324992e5417a9d571f1bffff73b9efc",
            ),
            (
                4096,
                "6ac39979016e3ddf3d39fff6cb984f7c118acdf1852919f5c100c4b142c1818e",
            ),
            (
                1,
                "b803429503d95915829b29fdbc8bbad142f3abfd11b1cadf5526582e685c0551",
            ),
            (
                0,
                "3d248ca542a24fc62d1c43b916eae5016878e2533c88238480b26128a1f1af95",
            ),
        ];
        for (len, want) in cases {
            assert_eq!(hex_of(&data[..len]), want, "{len} bytes");
        }
    }

    /// Same source, other block sizes: with 512-byte blocks (16 hashes per
    /// block) 1000000 bytes need three levels of hash blocks, which checks
    /// the level logic that 4096-byte blocks reach only past 64 MiB.
    #[test]
    fn fsverity_utils_vectors_other_block_sizes() {
        let data = fsverity_utils_data(1_000_000);
        let cases = [
            (
                512,
                "0393ee3dfd4a28966e2af4e07cfa5b032c30da5bb8e8ef63b9a55bf963262334",
            ),
            (
                1024,
                "e9df927c14fcb961d5f51c666d8ae4c14fe4ff98a374c733e898d00c9e74a8e3",
            ),
            (
                65536,
                "f3b6418f26d4d0e74728193bae76f15cb4bb2ce9777448d76bd8138b69ec61c2",
            ),
        ];
        for (bs, want) in cases {
            assert_eq!(digest_with(bs, &data), want, "block size {bs}");
        }
    }

    /// Boundaries around one block and one full hash block (128 hashes), with
    /// values from an independent whole-tree (non-streaming) implementation
    /// that reproduces the fsverity-utils vectors above.
    #[test]
    fn block_boundaries() {
        let pat = |n: usize| -> Vec<u8> { (0..n).map(|i| ((i * 31 + 7) % 251) as u8).collect() };
        let cases: [(Vec<u8>, &str); 6] = [
            (
                b"a".to_vec(),
                "bce75948b9e7510293f8f2720412af9697c1479281323f3f220623fb8e94b557",
            ),
            (
                vec![0; 4096],
                "babc284ee4ffe7f449377fbf6692715b43aec7bc39c094a95878904d34bac97e",
            ),
            (
                pat(4096),
                "c08bc67f36b96127139d2f5746831996f90fb2cfb4e3a58d920cbd75ffeedaf6",
            ),
            (
                pat(4097),
                "a5250fbdd10ee3c2aeee355361e2c43971460e7cbe4cba426653c5597cdedbbf",
            ),
            (
                pat(128 * 4096 + 1),
                "41a2ee76be9e29bd8f583ad3561deb2bf86b6d65fe72e14e8efa544c064d815f",
            ),
            (
                b"hello world\n".to_vec(),
                "37061ef2ac4c21bec68489b56138c5780306a4ad7fe6676236ecdf2c9027cd92",
            ),
        ];
        for (data, want) in cases {
            assert_eq!(hex_of(&data), want, "{} bytes", data.len());
        }
    }

    /// Feeding the same bytes in odd pieces gives the same digest as one
    /// call: the partial-block bookkeeping is right at every offset.
    #[test]
    fn streaming_in_pieces_matches_one_shot() {
        let data = fsverity_utils_data(300_000);
        let want = hex_of(&data);
        for piece in [1usize, 7, 31, 4095, 4096, 4097, 65536 + 3] {
            let mut h = FsVerityHasher::new();
            for chunk in data.chunks(piece) {
                h.update(chunk);
            }
            assert_eq!(h.len(), data.len() as u64);
            assert_eq!(h.finalize().to_hex(), want, "pieces of {piece}");
        }
    }

    /// The leaves hashed two at a time (`sha256x2`, where the CPU has SHA
    /// extensions) give the tree that hashing them one by one gives, for
    /// every way of cutting the input: a partial block completed by a
    /// piece that holds whole blocks after it, odd and even runs of whole
    /// blocks, pieces smaller than a block.
    #[test]
    fn leaves_hashed_in_pairs_make_the_same_tree() {
        let data = fsverity_utils_data(9 * 4096 + 123);
        let mut single = MerkleTree::new(4096);
        single.pairs = false;
        single.update(&data);
        let want = single.digest();
        for cuts in [
            &[4096usize][..],
            &[1, 8192],
            &[100, 4096 * 2 + 50, 4096],
            &[4095, 4097, 3 * 4096],
            &[3 * 4096, 1, 4096 - 1, 4096],
            &[5, 5, 5],
        ] {
            let mut t = MerkleTree::new(4096);
            let mut rest = &data[..];
            for &cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (piece, tail) = rest.split_at(cut.min(rest.len()));
                t.update(piece);
                rest = tail;
            }
            assert_eq!(hex::encode(t.digest()), hex::encode(want), "cuts {cuts:?}");
        }
    }

    /// 4096-byte blocks across three levels (128 × 128 data blocks + 1
    /// byte, just over 64 MiB; about a second in a debug build).
    #[test]
    fn three_levels_of_4096_byte_blocks() {
        let n = 128 * 128 * 4096 + 1;
        // 251 × 261 bytes: repeating it keeps the `i % 251` pattern.
        let chunk: Vec<u8> = (0..251 * 261).map(|i| (i % 251) as u8).collect();
        let mut h = FsVerityHasher::new();
        let mut fed = 0;
        while fed < n {
            let take = (n - fed).min(chunk.len());
            h.update(&chunk[..take]);
            fed += take;
        }
        assert_eq!(
            h.finalize().to_hex(),
            "acba6554fbff4e8b2fc0361086b9e8ed6afbbd3196ade159c0f3e2bf9ecb2ed1"
        );
    }

    /// Zeros fed with `update_zeros` give the digest of the same zeros fed
    /// byte for byte, for holes at every kind of offset and of lengths that
    /// reach several levels (512-byte blocks: 16 hashes per block, so a few
    /// MB span four levels).
    #[test]
    fn zeros_in_bulk_match_zeros_fed() {
        let zeros = vec![0u8; 6 << 20];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let lens = [
            0u64,
            1,
            511,
            512,
            513,
            8191,
            8192,
            8193,
            16 * 8192,
            16 * 8192 + 3,
        ];
        for bs in [512usize, 4096] {
            for round in 0..60usize {
                let mut fast = MerkleTree::new(bs);
                let mut slow = MerkleTree::new(bs);
                let pieces = 1 + rand(5);
                for p in 0..pieces {
                    let data_len = rand(3000) as usize * usize::from(p % 2 == round as u64 % 2);
                    let data: Vec<u8> = (0..data_len).map(|i| (i % 251) as u8 + 1).collect();
                    fast.update(&data);
                    slow.update(&data);
                    let hole = if round < lens.len() {
                        lens[round]
                    } else {
                        let max = if rand(2) == 0 { 20_000 } else { 6 << 20 };
                        rand(max)
                    };
                    fast.update_zeros(hole);
                    slow.update(&zeros[..hole as usize]);
                }
                assert_eq!(fast.data_size, slow.data_size);
                assert_eq!(
                    hex::encode(fast.digest()),
                    hex::encode(slow.digest()),
                    "block size {bs}, round {round}"
                );
            }
        }
    }

    /// A file of nothing but zeros, whose tree is all zero subtrees.
    #[test]
    fn all_zero_file() {
        for n in [1u64, 4096, 4097, 128 * 4096, 128 * 4096 + 1, 3 << 20] {
            let mut h = FsVerityHasher::new();
            h.update_zeros(n);
            assert_eq!(h.len(), n);
            assert_eq!(
                h.finalize(),
                fsverity_digest(&vec![0u8; n as usize][..]).unwrap(),
                "{n} zeros"
            );
        }
        // Large holes are cheap: 1 EiB of zeros.
        let mut h = FsVerityHasher::new();
        h.update(b"x");
        h.update_zeros(1 << 60);
        h.update(b"y");
        assert_eq!(h.len(), (1 << 60) + 2);
        let _ = h.finalize();
    }

    #[test]
    fn object_id_hex_round_trip() {
        let id = fsverity_digest(&b"x"[..]).unwrap();
        let hex = id.to_hex();
        assert_eq!(hex.len(), 64);
        assert_eq!(id.to_string(), hex);
        assert_eq!(hex.parse::<ObjectId>().unwrap(), id);
        assert_eq!(ObjectId::from_hex(&hex.to_uppercase()).unwrap(), id);
        assert_eq!(id.object_path(), format!("{}/{}", &hex[..2], &hex[2..]));
        for bad in [
            "",
            "ab",
            &hex[1..],
            &format!("{hex}0"),
            &hex.replace('a', "g"),
        ] {
            if bad != hex {
                assert!(ObjectId::from_hex(bad).is_err(), "{bad:?}");
            }
        }
        // Every byte in the first and the last place parses as the `hex`
        // crate decodes it, or is refused as it refuses it.
        for c in 0u8..=255 {
            for at in [0, 63] {
                let mut b = hex.clone().into_bytes();
                b[at] = c;
                let Ok(s) = String::from_utf8(b) else {
                    continue;
                };
                let mut want = [0u8; 32];
                match hex::decode_to_slice(&s, &mut want) {
                    Ok(()) => assert_eq!(ObjectId::from_hex(&s).unwrap().0, want, "{s}"),
                    Err(_) => assert!(ObjectId::from_hex(&s).is_err(), "{s:?}"),
                }
            }
        }
    }
}
