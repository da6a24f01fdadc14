//! Reading eStargz layers through their table of contents (TOC).
//!
//! An eStargz layer (`ctr-remote image optimize` / `convert --estargz`) is
//! a valid gzip tar whose gzip *members* are cut so that each chunk of a
//! regular file's contents starts a member of its own, followed by one
//! member holding a tar with a single entry, `stargz.index.json` (the TOC),
//! and a 51-byte footer: an empty gzip member whose extra field says where
//! the TOC member starts:
//!
//! ```text
//! 1f 8b 08 04 00 00 00 00 00 ff   gzip header, FLG = FEXTRA
//! 1a 00                           XLEN = 26
//! 53 47 16 00                     subfield "SG", 22 bytes:
//! %016x STARGZ                      the TOC member's offset, hex, then "STARGZ"
//! 01 00 00 ff ff                  an empty stored block
//! 00 00 00 00 00 00 00 00         CRC32 and ISIZE of nothing
//! ```
//!
//! The TOC is JSON: `{"version": 1, "entries": [...]}`; each entry has a
//! `name`, a `type` (`dir`, `reg`, `symlink`, `hardlink`, `char`, `block`,
//! `fifo`, and `chunk` for the second and later chunks of a `reg`), its
//! metadata (`mode`, `uid`, `gid`, `size`, `modtime`, `linkName`,
//! `devMajor`, `devMinor`, `xattrs`), and for file contents the `offset`
//! of the gzip member where a chunk starts, `chunkOffset` and `chunkSize`
//! (its place in the file; 0 for "to the end"), `chunkDigest` (the sha256
//! of the chunk's bytes) and, on the `reg` entry, `digest` (the sha256 of
//! the whole file). The layer's descriptor carries the sha256 of the TOC
//! JSON in the annotation `containerd.io/snapshot/stargz/toc.digest`.
//!
//! Nothing here trusts the layer: the footer is checked byte for byte,
//! the TOC's compressed and JSON sizes, its entry count and every name are
//! bounded, its digest is checked against the annotation before it is
//! parsed, chunks must tile each file exactly, every chunk must carry a
//! digest, and a chunk's gzip member is read only up to the next member
//! (at most [`MAX_MEMBER`] bytes) and its bytes checked against its
//! `chunkDigest` before they are returned. Errors say which layer and
//! which entry.

use std::collections::BTreeMap;
use std::io::Read;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

/// The footer's length.
pub const FOOTER_LEN: u64 = 51;
/// The largest compressed TOC member read.
pub const MAX_TOC_COMPRESSED: u64 = 64 << 20;
/// The largest TOC JSON accepted.
pub const MAX_TOC_JSON: u64 = 128 << 20;
/// The most entries a TOC may have.
pub const MAX_ENTRIES: usize = 1 << 21;
/// The longest entry name (and link target).
pub const MAX_NAME: usize = 4096;
/// The longest chunk accepted (held in memory while it is checked).
pub const MAX_CHUNK: u64 = 16 << 20;
/// The longest gzip member read for one chunk: the chunk compressed
/// (deflate's worst case is a little over the chunk) plus the tar padding
/// and the next file's header that may share its member.
pub const MAX_MEMBER: u64 = MAX_CHUNK + MAX_CHUNK / 8 + (1 << 20);
/// The TOC's name inside its tar.
pub const TOC_NAME: &str = "stargz.index.json";
/// The layer annotation with the sha256 of the TOC JSON.
pub const TOC_DIGEST_ANNOTATION: &str = "containerd.io/snapshot/stargz/toc.digest";
/// Files before an entry of this name are to be fetched first.
pub const PREFETCH_LANDMARK: &str = ".prefetch.landmark";
/// An entry of this name says: prefetch nothing.
pub const NO_PREFETCH_LANDMARK: &str = ".no.prefetch.landmark";

/// What is wrong with an eStargz layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EstargzError(pub String);

fn bad<T>(msg: impl Into<String>) -> Result<T, EstargzError> {
    Err(EstargzError(msg.into()))
}

/// The offset of the TOC member, from the layer's last [`FOOTER_LEN`]
/// bytes.
pub fn parse_footer(footer: &[u8]) -> Result<u64, EstargzError> {
    if footer.len() != FOOTER_LEN as usize {
        return bad(format!("footer: {} bytes, not {FOOTER_LEN}", footer.len()));
    }
    const HEAD: [u8; 16] = [
        0x1f, 0x8b, 0x08, 0x04, 0, 0, 0, 0, 0, 0xff, 0x1a, 0x00, b'S', b'G', 0x16, 0x00,
    ];
    const TAIL: [u8; 13] = [0x01, 0x00, 0x00, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0];
    if footer[..16] != HEAD || footer[38..] != TAIL || &footer[32..38] != b"STARGZ" {
        return bad("footer: not an eStargz footer (no \"SG\" extra field ending in STARGZ)");
    }
    let hex = std::str::from_utf8(&footer[16..32])
        .ok()
        .filter(|h| h.bytes().all(|c| c.is_ascii_hexdigit()))
        .ok_or_else(|| EstargzError("footer: the TOC offset is not 16 hex digits".into()))?;
    u64::from_str_radix(hex, 16)
        .map_err(|e| EstargzError(format!("footer: the TOC offset {hex:?}: {e}")))
}

/// The kind of a TOC entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    Reg,
    Symlink,
    Hardlink,
    Char,
    Block,
    Fifo,
}

/// One checked chunk of a regular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Where its gzip member starts in the layer blob.
    pub offset: u64,
    /// Where the next member starts (or the TOC): read no further.
    pub end: u64,
    /// Where it sits in the file.
    pub file_offset: u64,
    /// Its length.
    pub size: u64,
    /// The sha256 of its bytes.
    pub digest: [u8; 32],
}

/// One checked TOC entry (a `reg` with its chunks folded in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Relative, without `./` or a leading `/`, no `.` or `..` component;
    /// empty for the root.
    pub name: String,
    pub kind: Kind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub modtime: Option<String>,
    /// Symlink target, or the name a hard link links to.
    pub link_name: String,
    pub dev_major: u32,
    pub dev_minor: u32,
    /// As the TOC gives them (values base64).
    pub xattrs: BTreeMap<String, String>,
    /// The sha256 of the whole file (regular files with contents).
    pub digest: Option<[u8; 32]>,
    /// Regular files: chunks tiling `0..size`, in order.
    pub chunks: Vec<Chunk>,
}

/// A checked TOC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toc {
    /// Where the TOC member starts (every chunk lies before it).
    pub toc_offset: u64,
    pub entries: Vec<Entry>,
}

#[derive(Deserialize)]
struct RawToc {
    version: u32,
    entries: Vec<RawEntry>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawEntry {
    name: String,
    #[serde(rename = "type")]
    kind: String,
    size: u64,
    modtime: Option<String>,
    #[serde(rename = "linkName")]
    link_name: String,
    mode: u32,
    uid: u32,
    gid: u32,
    #[serde(rename = "devMajor")]
    dev_major: u32,
    #[serde(rename = "devMinor")]
    dev_minor: u32,
    xattrs: BTreeMap<String, String>,
    digest: String,
    offset: u64,
    #[serde(rename = "chunkOffset")]
    chunk_offset: u64,
    #[serde(rename = "chunkSize")]
    chunk_size: u64,
    #[serde(rename = "chunkDigest")]
    chunk_digest: String,
}

/// A TOC digest, checked as every other digest cairn reads is
/// ([`cairn_spec::parse_digest`]: sha256, lower-case hex), as raw bytes.
fn sha256_of(s: &str, what: &str) -> Result<[u8; 32], EstargzError> {
    let hex = cairn_spec::parse_digest(s).map_err(|e| EstargzError(format!("{what}: {e}")))?;
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex, &mut out).map_err(|e| EstargzError(format!("{what}: {s:?}: {e}")))?;
    Ok(out)
}

/// `./a/b`, `/a/b/`, `a/b` → `a/b`; `.` and `./` → the root (empty).
fn clean_name(raw: &str) -> Result<String, EstargzError> {
    if raw.len() > MAX_NAME || raw.contains('\0') {
        return bad(format!(
            "entry name of {} bytes (or with a NUL): at most {MAX_NAME}",
            raw.len()
        ));
    }
    let mut parts = Vec::new();
    for p in raw.split('/') {
        match p {
            "" | "." => {}
            ".." => return bad(format!("entry {raw:?}: a \"..\" component")),
            p => parts.push(p),
        }
    }
    Ok(parts.join("/"))
}

/// Reads the TOC JSON out of the decompressed TOC member (a tar whose one
/// entry is [`TOC_NAME`]).
fn toc_json_from_tar(tar: &[u8]) -> Result<&[u8], EstargzError> {
    if tar.len() < 512 {
        return bad(format!(
            "TOC tar: {} bytes, shorter than a header",
            tar.len()
        ));
    }
    let h = &tar[..512];
    let name_end = h[..100].iter().position(|&c| c == 0).unwrap_or(100);
    if &h[..name_end] != TOC_NAME.as_bytes() {
        return bad(format!(
            "TOC tar: its entry is {:?}, not {TOC_NAME}",
            String::from_utf8_lossy(&h[..name_end])
        ));
    }
    let sum: u32 = h
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            if (148..156).contains(&i) {
                32
            } else {
                c as u32
            }
        })
        .sum();
    let field = |r: std::ops::Range<usize>| {
        let s = std::str::from_utf8(&h[r]).unwrap_or("");
        let s = s.trim_matches(|c: char| c == '\0' || c == ' ');
        u64::from_str_radix(s, 8).ok()
    };
    if field(148..156) != Some(sum as u64) {
        return bad("TOC tar: its header checksum is wrong");
    }
    let size = field(124..136).ok_or_else(|| EstargzError("TOC tar: bad size field".into()))?;
    if size > MAX_TOC_JSON || 512 + size > tar.len() as u64 {
        return bad(format!(
            "TOC tar: {TOC_NAME} of {size} bytes, the tar has {} (at most {MAX_TOC_JSON})",
            tar.len()
        ));
    }
    Ok(&tar[512..512 + size as usize])
}

/// The metadata of the TOC's own tar header (a full pull unpacks the TOC
/// as the file `stargz.index.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TocHeader {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch; 0 where the field is not plain octal.
    pub mtime: i64,
}

/// Like [`toc_json`], and the TOC entry's header fields.
pub fn toc_json_and_header(member: &[u8]) -> Result<(Vec<u8>, TocHeader), EstargzError> {
    let tar = toc_tar(member)?;
    let json = toc_json_from_tar(&tar)?.to_vec();
    let octal = |r: std::ops::Range<usize>| {
        let s = std::str::from_utf8(&tar[r]).unwrap_or("");
        u64::from_str_radix(s.trim_matches(|c: char| c == '\0' || c == ' '), 8).unwrap_or(0)
    };
    let header = TocHeader {
        mode: (octal(100..108) & 0o7777) as u32,
        uid: octal(108..116).min(u32::MAX as u64) as u32,
        gid: octal(116..124).min(u32::MAX as u64) as u32,
        mtime: octal(136..148).min(i64::MAX as u64) as i64,
    };
    Ok((json, header))
}

fn toc_tar(member: &[u8]) -> Result<Vec<u8>, EstargzError> {
    if member.len() as u64 > MAX_TOC_COMPRESSED {
        return bad(format!(
            "TOC: {} compressed bytes, more than {MAX_TOC_COMPRESSED}",
            member.len()
        ));
    }
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(member)
        .take(MAX_TOC_JSON + 2048)
        .read_to_end(&mut tar)
        .map_err(|e| EstargzError(format!("TOC: decompressing: {e}")))?;
    Ok(tar)
}

/// Decompresses the TOC member (the bytes from the footer's offset up to
/// the footer) and returns the TOC JSON, at most [`MAX_TOC_JSON`] bytes.
pub fn toc_json(member: &[u8]) -> Result<Vec<u8>, EstargzError> {
    if member.len() as u64 > MAX_TOC_COMPRESSED {
        return bad(format!(
            "TOC: {} compressed bytes, more than {MAX_TOC_COMPRESSED}",
            member.len()
        ));
    }
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(member)
        .take(MAX_TOC_JSON + 2048)
        .read_to_end(&mut tar)
        .map_err(|e| EstargzError(format!("TOC: decompressing: {e}")))?;
    Ok(toc_json_from_tar(&tar)?.to_vec())
}

/// Parses and checks the TOC JSON of a layer whose TOC member starts at
/// `toc_offset`. `expected` is the annotation's digest (`sha256:…`), if
/// the descriptor has one: the JSON must hash to it.
pub fn parse_toc(
    json: &[u8],
    toc_offset: u64,
    expected: Option<&str>,
) -> Result<Toc, EstargzError> {
    if json.len() as u64 > MAX_TOC_JSON {
        return bad(format!(
            "TOC: {} bytes of JSON, more than {MAX_TOC_JSON}",
            json.len()
        ));
    }
    if let Some(want) = expected {
        let want = sha256_of(want, "the TOC digest annotation")?;
        let got: [u8; 32] = Sha256::digest(json).into();
        if got != want {
            return bad(format!(
                "TOC: its JSON hashes to sha256:{}, the layer's annotation says sha256:{}",
                hex::encode(got),
                hex::encode(want)
            ));
        }
    }
    let raw: RawToc =
        serde_json::from_slice(json).map_err(|e| EstargzError(format!("TOC: {e}")))?;
    if raw.version != 1 {
        return bad(format!("TOC: version {}, not 1", raw.version));
    }
    if raw.entries.len() > MAX_ENTRIES {
        return bad(format!(
            "TOC: {} entries, more than {MAX_ENTRIES}",
            raw.entries.len()
        ));
    }
    let mut entries: Vec<Entry> = Vec::with_capacity(raw.entries.len());
    // Every member offset, to know where each member ends.
    let mut offsets: Vec<u64> = Vec::new();
    for (i, r) in raw.entries.into_iter().enumerate() {
        let what = || format!("TOC entry {i} ({:?})", r.name);
        let name = clean_name(&r.name).map_err(|e| EstargzError(format!("TOC entry {i}: {e}")))?;
        if r.link_name.len() > MAX_NAME {
            return bad(format!(
                "{}: a link target of {} bytes",
                what(),
                r.link_name.len()
            ));
        }
        let kind = match r.kind.as_str() {
            "dir" => Kind::Dir,
            "reg" => Kind::Reg,
            "symlink" => Kind::Symlink,
            "hardlink" => Kind::Hardlink,
            "char" => Kind::Char,
            "block" => Kind::Block,
            "fifo" => Kind::Fifo,
            "chunk" => {
                let Some(file) = entries.last_mut().filter(|e| e.kind == Kind::Reg) else {
                    return bad(format!("{}: a chunk that follows no regular file", what()));
                };
                if file.name != name {
                    return bad(format!(
                        "{}: a chunk of {name:?} after the file {:?}",
                        what(),
                        file.name
                    ));
                }
                let c = chunk_of(&r, file.size, what)?;
                let expected_at = file.chunks.last().map_or(0, |c| c.file_offset + c.size);
                if c.file_offset != expected_at {
                    return bad(format!(
                        "{}: a chunk at {} of the file, the chunks before it end at {expected_at}",
                        what(),
                        c.file_offset
                    ));
                }
                offsets.push(c.offset);
                file.chunks.push(c);
                continue;
            }
            k => return bad(format!("{}: unknown type {k:?}", what())),
        };
        let mut e = Entry {
            name,
            kind,
            mode: r.mode,
            uid: r.uid,
            gid: r.gid,
            size: if kind == Kind::Reg { r.size } else { 0 },
            modtime: r.modtime.clone(),
            link_name: r.link_name.clone(),
            dev_major: r.dev_major,
            dev_minor: r.dev_minor,
            xattrs: r.xattrs.clone(),
            digest: None,
            chunks: Vec::new(),
        };
        if kind == Kind::Reg && r.size > 0 {
            e.digest = Some(sha256_of(&r.digest, &format!("{}: digest", what()))?);
            let c = chunk_of(&r, r.size, what)?;
            if c.file_offset != 0 {
                return bad(format!(
                    "{}: its first chunk starts at {}",
                    what(),
                    c.file_offset
                ));
            }
            offsets.push(c.offset);
            e.chunks.push(c);
        }
        if let Some(prev) = entries.last() {
            check_tiled(prev)?;
        }
        entries.push(e);
    }
    if let Some(prev) = entries.last() {
        check_tiled(prev)?;
    }
    // Each member ends where the next one (of a higher offset) starts, or
    // at the TOC.
    offsets.sort_unstable();
    offsets.dedup();
    if offsets.last().is_some_and(|&o| o >= toc_offset) {
        return bad(format!(
            "TOC: a chunk at offset {}, not before the TOC at {toc_offset}",
            offsets.last().unwrap_or(&0)
        ));
    }
    for e in &mut entries {
        for c in &mut e.chunks {
            let at = offsets.partition_point(|&o| o <= c.offset);
            c.end = offsets.get(at).copied().unwrap_or(toc_offset);
            if c.end - c.offset > MAX_MEMBER {
                return bad(format!(
                    "TOC entry {:?}: the chunk at {} of the file spans {} compressed bytes, more \
                     than {MAX_MEMBER}",
                    e.name,
                    c.file_offset,
                    c.end - c.offset
                ));
            }
        }
    }
    Ok(Toc {
        toc_offset,
        entries,
    })
}

/// The chunk a `reg` or `chunk` entry describes, in a file of `size`.
fn chunk_of(r: &RawEntry, size: u64, what: impl Fn() -> String) -> Result<Chunk, EstargzError> {
    if r.chunk_offset >= size {
        return bad(format!(
            "{}: a chunk at {} of a file of {size} bytes",
            what(),
            r.chunk_offset
        ));
    }
    let len = if r.chunk_size == 0 {
        size - r.chunk_offset
    } else {
        r.chunk_size
    };
    if len > MAX_CHUNK || len > size - r.chunk_offset {
        return bad(format!(
            "{}: a chunk of {len} bytes at {} of a file of {size} (chunks at most {MAX_CHUNK})",
            what(),
            r.chunk_offset
        ));
    }
    Ok(Chunk {
        offset: r.offset,
        end: 0,
        file_offset: r.chunk_offset,
        size: len,
        digest: sha256_of(&r.chunk_digest, &format!("{}: chunkDigest", what()))?,
    })
}

fn check_tiled(e: &Entry) -> Result<(), EstargzError> {
    if e.kind != Kind::Reg {
        return Ok(());
    }
    let end = e.chunks.last().map_or(0, |c| c.file_offset + c.size);
    if end != e.size {
        return bad(format!(
            "TOC entry {:?}: its chunks cover {end} of its {} bytes",
            e.name, e.size
        ));
    }
    Ok(())
}

impl Toc {
    /// The regular files before the prefetch landmark, in TOC order (the
    /// order `ctr-remote image optimize` wrote what the image read at its
    /// start); none without a landmark, or with the no-prefetch one.
    pub fn prefetch(&self) -> Vec<&Entry> {
        let Some(at) = self
            .entries
            .iter()
            .position(|e| e.name == PREFETCH_LANDMARK)
        else {
            return Vec::new();
        };
        self.entries[..at]
            .iter()
            .filter(|e| e.kind == Kind::Reg && e.size > 0)
            .collect()
    }
}

/// The bytes of `chunk`, from its gzip member (`member`, the layer's bytes
/// `chunk.offset..chunk.end`), checked against its `chunkDigest`.
pub fn read_chunk(member: &[u8], chunk: &Chunk) -> Result<Vec<u8>, EstargzError> {
    if member.len() as u64 != chunk.end - chunk.offset {
        return bad(format!(
            "chunk at {}: {} bytes of its member, not {}",
            chunk.offset,
            member.len(),
            chunk.end - chunk.offset
        ));
    }
    let mut data = Vec::with_capacity(chunk.size as usize);
    flate2::read::GzDecoder::new(member)
        .take(chunk.size)
        .read_to_end(&mut data)
        .map_err(|e| EstargzError(format!("chunk at {}: decompressing: {e}", chunk.offset)))?;
    if data.len() as u64 != chunk.size {
        return bad(format!(
            "chunk at {}: {} bytes, the TOC says {}",
            chunk.offset,
            data.len(),
            chunk.size
        ));
    }
    let got: [u8; 32] = Sha256::digest(&data).into();
    if got != chunk.digest {
        return bad(format!(
            "chunk at {}: its bytes hash to sha256:{}, the TOC's chunkDigest is sha256:{}",
            chunk.offset,
            hex::encode(got),
            hex::encode(chunk.digest)
        ));
    }
    Ok(data)
}

/// Reads the TOC of a layer of `blob_size` bytes through `range(offset,
/// len)` (a registry range request): the footer, then the TOC member,
/// checked against `expected` (the annotation) when given.
pub fn read_toc(
    blob_size: u64,
    expected: Option<&str>,
    mut range: impl FnMut(u64, u64) -> Result<Vec<u8>, String>,
) -> Result<Toc, EstargzError> {
    if blob_size < FOOTER_LEN {
        return bad(format!("{blob_size} bytes: shorter than an eStargz footer"));
    }
    let footer_at = blob_size - FOOTER_LEN;
    let footer = range(footer_at, FOOTER_LEN).map_err(EstargzError)?;
    let toc_offset = parse_footer(&footer)?;
    if toc_offset >= footer_at {
        return bad(format!(
            "footer: the TOC at {toc_offset}, not before the footer at {footer_at}"
        ));
    }
    let len = footer_at - toc_offset;
    if len > MAX_TOC_COMPRESSED {
        return bad(format!(
            "TOC: {len} compressed bytes, more than {MAX_TOC_COMPRESSED}"
        ));
    }
    let member = range(toc_offset, len).map_err(EstargzError)?;
    let json = toc_json(&member)?;
    parse_toc(&json, toc_offset, expected)
}

/// Builds eStargz layers for tests: each chunk a gzip member, then the
/// TOC member and the footer (tar headers are left out: the reader never
/// looks at them).
#[cfg(test)]
pub(crate) mod build {
    use std::io::Write;

    use super::*;

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn sha(d: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(d)))
    }

    pub fn footer(toc_offset: u64) -> Vec<u8> {
        let mut f = vec![
            0x1f, 0x8b, 0x08, 0x04, 0, 0, 0, 0, 0, 0xff, 0x1a, 0x00, b'S', b'G', 0x16, 0x00,
        ];
        f.extend_from_slice(format!("{toc_offset:016x}STARGZ").as_bytes());
        f.extend_from_slice(&[0x01, 0x00, 0x00, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0]);
        f
    }

    pub fn tar_of(name: &str, data: &[u8]) -> Vec<u8> {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..108].copy_from_slice(b"0000644\0");
        h[124..136].copy_from_slice(format!("{:011o}\0", data.len()).as_bytes());
        h[156] = b'0';
        h[257..263].copy_from_slice(b"ustar\0");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&c| c as u32).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        let mut t = h.to_vec();
        t.extend_from_slice(data);
        t.resize(t.len().div_ceil(512) * 512 + 1024, 0);
        t
    }

    /// A layer of `files` (name, contents) cut in chunks of `chunk`
    /// bytes, plus a directory and a symlink; `landmark` puts the prefetch
    /// landmark after the first file. Returns the blob and the TOC digest.
    pub fn layer(files: &[(&str, &[u8])], chunk: usize, landmark: bool) -> (Vec<u8>, String) {
        let mut blob = Vec::new();
        let mut entries = vec![serde_json::json!({"name": "./", "type": "dir", "mode": 0o755})];
        for (i, (name, data)) in files.iter().enumerate() {
            let mut first = true;
            for (k, piece) in data.chunks(chunk).enumerate() {
                let offset = blob.len();
                blob.extend_from_slice(&gz(piece));
                let mut e = serde_json::json!({
                    "name": name,
                    "type": if first { "reg" } else { "chunk" },
                    "offset": offset,
                    "chunkOffset": k * chunk,
                    "chunkSize": if data.len() > chunk { piece.len() } else { 0 },
                    "chunkDigest": sha(piece),
                });
                if first {
                    e["size"] = data.len().into();
                    e["mode"] = 0o644.into();
                    e["uid"] = 1000.into();
                    e["digest"] = sha(data).into();
                }
                entries.push(e);
                first = false;
            }
            if data.is_empty() {
                entries.push(serde_json::json!({"name": name, "type": "reg", "size": 0}));
            }
            if landmark && i == 0 {
                let offset = blob.len();
                blob.extend_from_slice(&gz(&[0xf]));
                entries.push(serde_json::json!({
                    "name": PREFETCH_LANDMARK, "type": "reg", "size": 1, "offset": offset,
                    "digest": sha(&[0xf]), "chunkDigest": sha(&[0xf])}));
            }
        }
        entries.push(serde_json::json!({"name": "link", "type": "symlink", "linkName": "a"}));
        let json =
            serde_json::to_vec(&serde_json::json!({"version": 1, "entries": entries})).unwrap();
        let toc_offset = blob.len() as u64;
        blob.extend_from_slice(&gz(&tar_of(TOC_NAME, &json)));
        blob.extend_from_slice(&footer(toc_offset));
        (blob, sha(&json))
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;

    fn ranged(blob: &[u8]) -> impl FnMut(u64, u64) -> Result<Vec<u8>, String> + '_ {
        move |off, len| {
            let (s, e) = (off as usize, (off + len) as usize);
            blob.get(s..e)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| format!("range {off}+{len} past the blob's {}", blob.len()))
        }
    }

    fn data(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_layer_reads_back_through_its_toc() {
        let a = data(10_000, 1);
        let b = data(2500, 2);
        let (blob, digest) = layer(&[("a", &a), ("dir/b", &b), ("empty", &[])], 4096, true);
        let toc = read_toc(blob.len() as u64, Some(&digest), ranged(&blob)).unwrap();
        let names: Vec<&str> = toc.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["", "a", PREFETCH_LANDMARK, "dir/b", "empty", "link"]
        );
        let e = &toc.entries[1];
        assert_eq!(
            (e.kind, e.size, e.uid, e.chunks.len()),
            (Kind::Reg, 10_000, 1000, 3)
        );
        let mut back = Vec::new();
        for c in &e.chunks {
            let m = &blob[c.offset as usize..c.end as usize];
            back.extend(read_chunk(m, c).unwrap());
        }
        assert_eq!(back, a);
        let got: [u8; 32] = Sha256::digest(&back).into();
        assert_eq!(Some(got), e.digest);
        assert_eq!(toc.entries[5].link_name, "a");
        let pre: Vec<&str> = toc.prefetch().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(pre, ["a"]);
        // A wrong annotation is refused.
        let wrong = format!("sha256:{}", "0".repeat(64));
        let err = read_toc(blob.len() as u64, Some(&wrong), ranged(&blob)).unwrap_err();
        assert!(err.0.contains("annotation"), "{err}");
    }

    #[test]
    fn a_corrupt_chunk_is_refused() {
        let a = data(10_000, 3);
        let (mut blob, _) = layer(&[("a", &a)], 4096, false);
        let toc = read_toc(blob.len() as u64, None, ranged(&blob)).unwrap();
        assert!(toc.prefetch().is_empty());
        let c = toc.entries[1].chunks[1];
        let mid = ((c.offset + c.end) / 2) as usize;
        blob[mid] ^= 0x40;
        let err = read_chunk(&blob[c.offset as usize..c.end as usize], &c).unwrap_err();
        assert!(err.0.contains("chunk at"), "{err}");
    }

    /// Every truncation of the layer's tail, and every single-byte change
    /// of its footer and TOC member, is an error or a TOC, never a panic;
    /// truncations are errors.
    #[test]
    fn truncated_and_damaged_layers_never_panic() {
        let a = data(9000, 4);
        let (blob, digest) = layer(&[("a", &a), ("b", &a[..100])], 4096, true);
        let toc = read_toc(blob.len() as u64, None, ranged(&blob)).unwrap();
        for cut in (toc.toc_offset as usize)..blob.len() {
            let short = &blob[..cut];
            assert!(
                read_toc(cut as u64, None, ranged(short)).is_err(),
                "cut at {cut}"
            );
        }
        let mut x = 0x1234_5678u64;
        for i in (toc.toc_offset as usize)..blob.len() {
            for _ in 0..4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mut bad = blob.clone();
                bad[i] ^= (x as u8) | 1;
                let _ = read_toc(bad.len() as u64, None, ranged(&bad));
                // With the annotation, only the right TOC passes.
                if let Ok(t) = read_toc(bad.len() as u64, Some(&digest), ranged(&bad)) {
                    assert_eq!(t.entries, toc.entries);
                }
            }
        }
    }

    #[test]
    fn bad_tocs_are_refused_with_a_reason() {
        let d = format!("sha256:{}", "a".repeat(64));
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (serde_json::json!({"version": 2, "entries": []}), "version"),
            (
                serde_json::json!({"version": 1, "entries": [{"name": "../x", "type": "dir"}]}),
                "..",
            ),
            (
                serde_json::json!({"version": 1, "entries": [{"name": "x", "type": "what"}]}),
                "unknown type",
            ),
            (
                serde_json::json!({"version": 1, "entries": [{"name": "x", "type": "chunk"}]}),
                "follows no regular file",
            ),
            (
                serde_json::json!({"version": 1, "entries": [
                    {"name": "x", "type": "reg", "size": 10, "digest": d, "chunkDigest": d, "chunkSize": 4}]}),
                "cover 4",
            ),
            (
                serde_json::json!({"version": 1, "entries": [
                    {"name": "x", "type": "reg", "size": 10, "digest": d}]}),
                "chunkDigest",
            ),
            (
                serde_json::json!({"version": 1, "entries": [
                    {"name": "x", "type": "reg", "size": 10, "digest": d, "chunkDigest": d, "offset": 500}]}),
                "not before the TOC",
            ),
            (
                serde_json::json!({"version": 1, "entries": [
                    {"name": "x", "type": "reg", "size": 10, "digest": d, "chunkDigest": d, "chunkSize": 4},
                    {"name": "x", "type": "chunk", "chunkOffset": 5, "chunkSize": 5, "chunkDigest": d}]}),
                "end at 4",
            ),
            (
                serde_json::json!({"version": 1, "entries": [{"name": "x".repeat(5000), "type": "dir"}]}),
                "at most",
            ),
            // Upper-case hex is refused here as in every other digest cairn
            // reads (cairn_spec::parse_digest).
            (
                serde_json::json!({"version": 1, "entries": [
                    {"name": "x", "type": "reg", "size": 10, "digest": format!("sha256:{}", "A".repeat(64)), "chunkDigest": d}]}),
                "64 lower-case hex digits",
            ),
        ];
        for (json, want) in cases {
            let bytes = serde_json::to_vec(&json).unwrap();
            let err = parse_toc(&bytes, 100, None).unwrap_err();
            assert!(err.0.contains(want), "{json}: {err}");
        }
        assert!(parse_toc(b"{", 100, None).is_err());
        assert!(parse_toc(b"[]", 100, None).is_err());
    }

    #[test]
    fn footers_are_checked() {
        let f = footer(0x1234);
        assert_eq!(parse_footer(&f), Ok(0x1234));
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x80;
            assert!(parse_footer(&g).is_err(), "byte {i}");
        }
        assert!(parse_footer(&f[1..]).is_err());
        // A plain gzip layer's tail is not a footer.
        assert!(parse_footer(&[0u8; 51]).is_err());
    }
}
