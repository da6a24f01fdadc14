//! Sparse-file bombs: tar members of a few hundred bytes that declare a
//! 1 TiB file (old GNU `S` with base-256 fields, pax sparse 0.0, 0.1 and
//! 1.0), a GNU sparse 1.0 map whose line never ends, and maps of millions
//! of tiny segments. Each is built in memory byte by byte (no writer makes
//! them), imported with [`import_layer`] into a store that already holds a
//! layer, and must fail with an error naming the entry and its byte offset,
//! leaving the store as it was. The work is bounded by construction (the
//! limits stop each bomb before its declared size is touched); the elapsed
//! time is printed, never asserted. A legitimate sparse file (GB of holes,
//! a few segments of data) still imports, with the digest of its dense
//! content.

mod common;

use std::time::Instant;

use cairn_image::{import_layer, Limits};
use common::*;

const TIB: u64 = 1 << 40;

fn octal(field: &mut [u8], v: u64) {
    let w = field.len() - 1;
    let s = format!("{v:0w$o}\0");
    assert_eq!(s.len(), field.len(), "{v} does not fit in octal");
    field.copy_from_slice(s.as_bytes());
}

fn base256(field: &mut [u8], v: u64) {
    field.fill(0);
    field[0] = 0x80;
    let n = field.len();
    field[n - 8..].copy_from_slice(&v.to_be_bytes());
}

/// A header block (ustar, or GNU with `gnu`), checksum not yet set.
fn header(name: &[u8], typeflag: u8, size: u64, gnu: bool) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], 0o644);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 1_600_000_000);
    h[156] = typeflag;
    if gnu {
        h[257..265].copy_from_slice(b"ustar  \0");
    } else {
        h[257..265].copy_from_slice(b"ustar\x0000");
    }
    h
}

fn checksum(h: &mut [u8; 512]) {
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

fn pad(v: &mut Vec<u8>) {
    v.resize(v.len().next_multiple_of(512), 0);
}

/// `LEN KEY=VALUE\n` records with their exact lengths.
fn pax_records(records: &[(&str, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in records {
        let body = format!(" {k}={v}\n");
        let mut len = body.len() + 1;
        while len.to_string().len() + body.len() != len {
            len += 1;
        }
        out.extend_from_slice(format!("{len}{body}").as_bytes());
    }
    out
}

fn pax_entry(out: &mut Vec<u8>, records: &[(&str, String)]) {
    let data = pax_records(records);
    let mut h = header(b"././@PaxHeader", b'x', data.len() as u64, false);
    checksum(&mut h);
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    pad(out);
}

fn file_entry(out: &mut Vec<u8>, name: &[u8], data: &[u8]) {
    let mut h = header(name, b'0', data.len() as u64, false);
    checksum(&mut h);
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    pad(out);
}

fn end(mut out: Vec<u8>) -> Vec<u8> {
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// Old GNU sparse (`S`): `segments` as (offset, length), real size `real`,
/// every number in base-256; the segments past the header's four go into
/// extension blocks. `data` is what the archive stores.
fn old_gnu(name: &[u8], real: u64, segments: &[(u64, u64)], data: &[u8]) -> Vec<u8> {
    let mut h = header(name, b'S', data.len() as u64, true);
    base256(&mut h[124..136], data.len() as u64);
    let (first, rest) = segments.split_at(segments.len().min(4));
    for (i, &(off, len)) in first.iter().enumerate() {
        base256(&mut h[386 + i * 24..398 + i * 24], off);
        base256(&mut h[398 + i * 24..410 + i * 24], len);
    }
    h[482] = u8::from(!rest.is_empty());
    base256(&mut h[483..495], real);
    checksum(&mut h);
    let mut out = h.to_vec();
    let chunks: Vec<&[(u64, u64)]> = rest.chunks(21).collect();
    for (c, chunk) in chunks.iter().enumerate() {
        let mut b = [0u8; 512];
        for (i, &(off, len)) in chunk.iter().enumerate() {
            base256(&mut b[i * 24..i * 24 + 12], off);
            base256(&mut b[i * 24 + 12..i * 24 + 24], len);
        }
        b[504] = u8::from(c + 1 < chunks.len());
        out.extend_from_slice(&b);
    }
    out.extend_from_slice(data);
    pad(&mut out);
    end(out)
}

/// Pax sparse 0.0: one offset/numbytes record pair per segment.
fn pax_0_0(real: u64, segments: &[(u64, u64)], data: &[u8]) -> Vec<u8> {
    let mut records = vec![
        ("GNU.sparse.name", "sparse".into()),
        ("GNU.sparse.size", real.to_string()),
        ("GNU.sparse.numblocks", segments.len().to_string()),
    ];
    for &(off, len) in segments {
        records.push(("GNU.sparse.offset", off.to_string()));
        records.push(("GNU.sparse.numbytes", len.to_string()));
    }
    let mut out = Vec::new();
    pax_entry(&mut out, &records);
    file_entry(&mut out, b"GNUSparseFile.0/sparse", data);
    end(out)
}

/// Pax sparse 0.1: the map in one `GNU.sparse.map` record.
fn pax_0_1(real: u64, segments: &[(u64, u64)], data: &[u8]) -> Vec<u8> {
    let map: Vec<String> = segments
        .iter()
        .flat_map(|&(o, l)| [o.to_string(), l.to_string()])
        .collect();
    let mut out = Vec::new();
    pax_entry(
        &mut out,
        &[
            ("GNU.sparse.name", "sparse".into()),
            ("GNU.sparse.size", real.to_string()),
            ("GNU.sparse.numblocks", segments.len().to_string()),
            ("GNU.sparse.map", map.join(",")),
        ],
    );
    file_entry(&mut out, b"GNUSparseFile.0/sparse", data);
    end(out)
}

/// Pax sparse 1.0: the map (`map`, raw) at the start of the entry's data.
fn pax_1_0_raw(real: u64, map: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    pax_entry(
        &mut out,
        &[
            ("GNU.sparse.major", "1".into()),
            ("GNU.sparse.minor", "0".into()),
            ("GNU.sparse.name", "sparse".into()),
            ("GNU.sparse.realsize", real.to_string()),
        ],
    );
    let mut body = map.to_vec();
    pad(&mut body);
    body.extend_from_slice(data);
    file_entry(&mut out, b"GNUSparseFile.0/sparse", &body);
    end(out)
}

fn map_1_0(segments: &[(u64, u64)]) -> Vec<u8> {
    let mut m = format!("{}\n", segments.len()).into_bytes();
    for &(o, l) in segments {
        m.extend_from_slice(format!("{o}\n{l}\n").as_bytes());
    }
    m
}

fn pax_1_0(real: u64, segments: &[(u64, u64)], data: &[u8]) -> Vec<u8> {
    pax_1_0_raw(real, &map_1_0(segments), data)
}

/// One data segment of 512 bytes at the end of a 1 TiB file.
fn tib_segment() -> (Vec<(u64, u64)>, Vec<u8>) {
    (vec![(TIB - 512, 512)], vec![b'x'; 512])
}

/// `n` segments of one byte, one every other byte.
fn tiny_segments(n: u64) -> (Vec<(u64, u64)>, Vec<u8>) {
    ((0..n).map(|i| (2 * i, 1)).collect(), vec![b'y'; n as usize])
}

/// Imports `blob` into a store that holds a layer already; the import must
/// fail with an error containing each of `expect`, and leave the store as
/// it was. Returns the error.
fn rejected(name: &str, blob: &[u8], expect: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    {
        let s = open_store(&root);
        let mut l = Layer::new();
        l.file("base", &[5u8; 4096], 0o644);
        import(&s, &l.finish()).unwrap();
    }
    let before = visible(&root);
    let s = open_store(&root);
    let t = Instant::now();
    let result = import_layer(&s, blob, None, None, None, &Limits::default());
    let elapsed = t.elapsed();
    let err = match result {
        Ok(info) => panic!("{name}: imported: {info:?}"),
        Err(e) => e.to_string(),
    };
    println!(
        "{name:32} {:>9} bytes, rejected in {elapsed:?}: {err}",
        blob.len()
    );
    for x in expect {
        assert!(err.contains(x), "{name}: error {err:?} lacks {x:?}");
    }
    drop(s);
    // Nothing staged is left (the store cleans tmp/ when opened; the
    // import must have removed its own files already) and nothing became
    // visible.
    let after_import = visible(&root);
    assert!(
        after_import.1.is_empty(),
        "{name}: staged files left: {:?}",
        after_import.1
    );
    drop(open_store(&root));
    assert_eq!(visible(&root).0, before.0, "{name}: the store changed");
    err
}

#[test]
fn old_gnu_sparse_tib() {
    let (segs, data) = tib_segment();
    rejected(
        "old-gnu-1TiB",
        &old_gnu(b"sparse", TIB, &segs, &data),
        &["tar entry \"sparse\" at byte 0", "1099511627776"],
    );
}

#[test]
fn pax_0_0_sparse_tib() {
    let (segs, data) = tib_segment();
    rejected(
        "pax-0.0-1TiB",
        &pax_0_0(TIB, &segs, &data),
        &["tar entry \"sparse\" at byte 0", "1099511627776"],
    );
}

#[test]
fn pax_0_1_sparse_tib() {
    let (segs, data) = tib_segment();
    rejected(
        "pax-0.1-1TiB",
        &pax_0_1(TIB, &segs, &data),
        &["tar entry \"sparse\" at byte 0", "1099511627776"],
    );
}

#[test]
fn pax_1_0_sparse_tib() {
    let (segs, data) = tib_segment();
    rejected(
        "pax-1.0-1TiB",
        &pax_1_0(TIB, &segs, &data),
        &["tar entry \"sparse\" at byte 0", "1099511627776"],
    );
}

#[test]
fn pax_1_0_map_line_never_ends() {
    // 16 MiB of digits and no newline, compressed to a few KiB.
    let blob = gzip(&pax_1_0_raw(1 << 20, &vec![b'7'; 16 << 20], b""));
    rejected(
        "pax-1.0-endless-map-line",
        &blob,
        &[
            "tar entry \"sparse\" at byte 0",
            "GNU sparse 1.0 map",
            "byte 1536",
        ],
    );
}

#[test]
fn pax_1_0_millions_of_segments() {
    // The count comes first: 3 million segments, then the map (also there).
    let (segs, data) = tiny_segments(3_000_000);
    let blob = zstd(&pax_1_0(2 * 3_000_000, &segs, &data));
    rejected(
        "pax-1.0-3M-segments",
        &blob,
        &["tar entry \"sparse\" at byte 0", "3000000 segments"],
    );
}

#[test]
fn old_gnu_millions_of_segments() {
    let (segs, data) = tiny_segments(2_000_000);
    let blob = zstd(&old_gnu(b"sparse", 2 * 2_000_000, &segs, &data));
    rejected(
        "old-gnu-2M-segments",
        &blob,
        &["tar entry \"sparse\" at byte 0", "sparse segments"],
    );
}

#[test]
fn pax_0_1_many_segments() {
    // About as many as fit a 1 MiB pax header.
    let (segs, data) = tiny_segments(100_000);
    let blob = zstd(&pax_0_1(2 * 100_000, &segs, &data));
    rejected(
        "pax-0.1-100k-segments",
        &blob,
        &["tar entry \"sparse\" at byte 0", "sparse segments"],
    );
}

/// Imports `blob` (one sparse file, "sparse") and checks the object: its
/// size, its data where `segs` put it, zeros elsewhere; returns its digest.
fn import_sparse(
    s: &cairn_store::Store,
    root: &std::path::Path,
    format: &str,
    blob: &[u8],
    size: u64,
    segs: &[(u64, u64)],
    data: &[u8],
) -> [u8; 32] {
    let t = Instant::now();
    let info = import(s, blob).unwrap_or_else(|e| panic!("{format}: {e}"));
    println!("{format}: {size} bytes imported in {:?}", t.elapsed());
    let (m, c) = manifest_and_config(&[(info.diff_id, blob.len() as u64)]);
    let img = cairn_image::assemble_image(s, &m, &c, None).unwrap();
    let e = entries(&image_tree(s, &img));
    let inode = &e["/sparse"];
    assert_eq!(inode.size, size, "{format}");
    let cairn_erofs::tree::InodeData::Regular(r) = &inode.data else {
        panic!("{format}: not a file")
    };
    let path = root
        .join("objects")
        .join(String::from_utf8_lossy(r.payload.as_ref().unwrap()).as_ref());
    let f = std::fs::File::open(&path).unwrap();
    assert_eq!(f.metadata().unwrap().len(), size, "{format}");
    let mut at = 0usize;
    let mut end = 0u64;
    for &(off, len) in segs {
        let mut got = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, off).unwrap();
        assert!(
            got == data[at..at + len as usize],
            "{format}: data at {off}"
        );
        if off > end {
            let n = (off - end).min(1 << 16);
            let mut gap = vec![1u8; n as usize];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut gap, off - n).unwrap();
            assert!(gap.iter().all(|&b| b == 0), "{format}: hole before {off}");
        }
        at += len as usize;
        end = off + len;
    }
    r.digest.expect("an object")
}

fn formats(size: u64, segs: &[(u64, u64)], data: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("old-gnu", old_gnu(b"sparse", size, segs, data)),
        ("pax-0.0", pax_0_0(size, segs, data)),
        ("pax-0.1", pax_0_1(size, segs, data)),
        ("pax-1.0", pax_1_0(size, segs, data)),
    ]
}

#[test]
fn legitimate_sparse_file_has_its_dense_digest() {
    // 40 MiB (a two-level fs-verity tree), holes at odd offsets, a hole at
    // the end: the object's digest is that of the dense file, hashed here
    // byte by byte.
    let size: u64 = 40 << 20;
    let mut segs = vec![(0, 5000), (3 << 20, 4096), ((17 << 20) + 77, 100_000)];
    // A map longer than a block (and than the old GNU header's four).
    segs.extend((0..300).map(|i| ((20 << 20) + i * 10_000, 7)));
    segs.push((size - (5 << 20), 1));
    let total: u64 = segs.iter().map(|s| s.1).sum();
    let data: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8 | 1).collect();
    let mut dense = vec![0u8; size as usize];
    let mut at = 0usize;
    for &(off, len) in &segs {
        dense[off as usize..(off + len) as usize].copy_from_slice(&data[at..at + len as usize]);
        at += len as usize;
    }
    let want = cairn_store::fsverity_digest(&dense[..]).unwrap().0;
    let dir = tempfile::tempdir().unwrap();
    let s = open_store(dir.path());
    for (format, blob) in formats(size, &segs, &data) {
        let got = import_sparse(&s, dir.path(), format, &blob, size, &segs, &data);
        assert_eq!(hex::encode(got), hex::encode(want), "{format}");
    }
}

#[test]
fn legitimate_big_sparse_file_imports() {
    // 3 GiB with three 1 MiB runs of data (start, middle, end): a sparse
    // database file. Every format gives the same object.
    let size: u64 = 3 << 30;
    let run = 1u64 << 20;
    let segs = vec![(0, run), (size / 2, run), (size - run, run)];
    let data: Vec<u8> = (0..3 * run).map(|i| (i * 31 % 251) as u8 | 1).collect();
    let dir = tempfile::tempdir().unwrap();
    let s = open_store(dir.path());
    let digests: Vec<[u8; 32]> = formats(size, &segs, &data)
        .into_iter()
        .map(|(format, blob)| import_sparse(&s, dir.path(), format, &blob, size, &segs, &data))
        .collect();
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");
}

#[test]
fn hole_limit_counts_the_whole_layer() {
    // Two sparse files of 5 GiB (one 512-byte segment each): each fits
    // the 8 GiB limit, both do not.
    let five = 5u64 << 30;
    let segs = vec![(five - 512, 512)];
    let mut blob = old_gnu(b"a", five, &segs, &[b'a'; 512]);
    blob.truncate(blob.len() - 1024);
    let second_at = blob.len();
    blob.extend_from_slice(&pax_1_0(five, &segs, &[b'b'; 512]));
    rejected(
        "two-5GiB-sparse-files",
        &blob,
        &[
            &format!("tar entry \"sparse\" at byte {second_at}"),
            "with the 5368708608 bytes of holes before it",
            "8589934592",
        ],
    );
}
