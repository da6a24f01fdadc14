//! The threaded import (decompression thread, object workers, batches) and
//! the one-thread import give the same store, byte for byte: the same
//! objects, the same layer records and the same image digest, on layers
//! with many small files (batches of many files), big ones (a file across
//! batches), inline and empty files, duplicates, hardlinks and whiteouts,
//! compressed with gzip, zstd and not at all. The same holds for an image
//! whose tree is built from the record lines the imports send through
//! their taps (as a pull builds it), on one thread and on several.
//!
//! The thread count is forced through `CAIRN_IMPORT_THREADS`; this file
//! holds one test, so setting it races with nothing.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;

/// Bytes that differ from file to file (so objects do too).
fn data(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn fixture() -> Vec<Vec<u8>> {
    let mut base = Layer::new();
    base.dir("./", 0o755)
        .dir("usr/", 0o755)
        .dir("usr/src/", 0o755);
    for i in 0..700u32 {
        // 0 to ~9 KiB: inline, empty and small objects, many per batch.
        let len = (i as usize * 131) % 9000;
        base.file(&format!("usr/src/f{i}"), &data(i, len), 0o644);
    }
    base.file("usr/big", &data(1, 1 << 20), 0o755)
        .file("usr/big-copy", &data(1, 1 << 20), 0o755)
        .file("usr/dup-a", &data(7, 5000), 0o644)
        .file("usr/dup-b", &data(7, 5000), 0o600)
        .hardlink("usr/big-link", "usr/big")
        .symlink("usr/lib", "src");
    let mut mid = Layer::new();
    mid.dir("usr/", 0o755)
        .whiteout("usr/src/.wh.f3")
        .file("usr/src/f4", b"replaced", 0o644);
    for i in 0..300u32 {
        mid.file(
            &format!("opt/g{i}"),
            &data(10_000 + i, 300 + i as usize * 50),
            0o644,
        );
        if i % 50 == 0 {
            mid.file(&format!("opt/large{i}"), &data(20_000 + i, 400_000), 0o644);
        }
    }
    let mut top = Layer::new();
    top.dir("opt/", 0o700)
        .file("opt/.wh..wh..opq", b"", 0o644)
        .file("opt/new", &data(99, 70_000), 0o644)
        .file("tiny", b"0123456789", 0o644);
    vec![gzip(&base.finish()), zstd(&mid.finish()), top.finish()]
}

/// Every file of the store but `tmp/` (path → mode and content), plus the
/// image digest.
fn snapshot(
    root: &Path,
    threads: usize,
    layers: &[Vec<u8>],
) -> (String, BTreeMap<String, (u32, Vec<u8>)>) {
    std::env::set_var("CAIRN_IMPORT_THREADS", threads.to_string());
    let store = open_store(root);
    let img = build(&store, layers, Some("example.com/pipeline:1")).unwrap();
    let mut files = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == "tmp" || rel == "lock" {
                continue;
            }
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                stack.push(p);
            } else if rel.ends_with(".json") && rel.starts_with("images/") {
                // The image record says when it was imported.
                files.insert(rel, (meta.permissions().mode(), Vec::new()));
            } else {
                files.insert(rel, (meta.permissions().mode(), std::fs::read(&p).unwrap()));
            }
        }
    }
    (img.image_digest, files)
}

/// The image of `layers` imported into a fresh store at `root` through
/// taps, as a pull does ([`cairn_image::reports`]): each layer's record
/// lines go through its tap as the import writes them, and the tree is
/// built from them afterwards.
fn tapped_image(root: &Path, threads: usize, layers: &[Vec<u8>]) -> String {
    std::env::set_var("CAIRN_IMPORT_THREADS", threads.to_string());
    let store = open_store(root);
    let (feeds, reports, mut ends) = cairn_image::reports(&vec![true; layers.len()]);
    let mut ids = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let info = reports
            .import(i, |watch| {
                cairn_image::import_layer_with(
                    &store,
                    l.as_slice(),
                    None,
                    None,
                    None,
                    &Default::default(),
                    watch,
                )
            })
            .unwrap();
        ids.push((info.diff_id, l.len() as u64));
    }
    drop(reports);
    let (m, c) = manifest_and_config(&ids);
    let diff_ids: Vec<String> = ids.iter().map(|(d, _)| d.clone()).collect();
    let tree = cairn_image::build_tree_as_imported(&store, &diff_ids, feeds, &mut |i| ends.end(i))
        .unwrap();
    cairn_image::StagedImage::from_tree(&store, &m, &c, None, None, Some(tree))
        .unwrap()
        .publish()
        .unwrap()
        .image_digest
}

#[test]
fn threaded_import_is_byte_identical() {
    let layers = fixture();
    let dir = tempfile::tempdir().unwrap();
    let (digest, one) = snapshot(&dir.path().join("t1"), 1, &layers);
    assert!(one.keys().filter(|k| k.starts_with("objects/")).count() > 500);
    assert_eq!(one.keys().filter(|k| k.starts_with("layers/")).count(), 6);
    for threads in [1, 2, 3] {
        let tapped = tapped_image(&dir.path().join(format!("tap{threads}")), threads, &layers);
        assert_eq!(
            tapped, digest,
            "{threads} threads, through taps: image digest"
        );
    }
    for threads in [2, 3, 5, 16] {
        let (d, many) = snapshot(&dir.path().join(format!("t{threads}")), threads, &layers);
        assert_eq!(d, digest, "{threads} threads: image digest");
        assert_eq!(
            many.keys().collect::<Vec<_>>(),
            one.keys().collect::<Vec<_>>(),
            "{threads} threads: the store's files"
        );
        for (k, v) in &one {
            assert!(many[k] == *v, "{threads} threads: {k} differs");
        }
    }
    std::env::remove_var("CAIRN_IMPORT_THREADS");
}
