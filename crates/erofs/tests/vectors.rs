//! The composefs test vectors (`common/vectors.rs` says where they are):
//! every dumpfile must give an image whose sha256 is the one the reference `mkcomposefs`
//! gives; `fsck.erofs` must accept every image; reading an image back and
//! writing it again must give the same bytes.

use std::io::{BufReader, Read};
use std::process::Command;

use cairn_erofs::dump::{parse_dump, print_dump, ParseOptions};
use cairn_erofs::reader::read_image;
use cairn_erofs::writer::{mkfs_erofs_to_vec, WriteOptions};
use sha2::{Digest, Sha256};

#[path = "common/vectors.rs"]
mod vectors;
use vectors::vectors_dir;

/// Vectors the reference parses in its lenient mode.
const LENIENT: &[&str] = &[
    "no-newline.dump",
    "longlink.dump",
    "honggfuzz-longlink-unterminated.dump",
];

struct Vector {
    name: String,
    dump: Vec<u8>,
    sha256: String,
    opts: WriteOptions,
}

fn vectors() -> Vec<Vector> {
    let dir = vectors_dir();
    let mut out = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".sha256"))
        .collect();
    names.sort();
    for sha_name in names {
        let name = sha_name.trim_end_matches(".sha256").to_string();
        let raw = std::fs::read(dir.join(&name)).unwrap();
        let dump = if name.ends_with(".gz") {
            let mut d = Vec::new();
            flate2::read::GzDecoder::new(&raw[..])
                .read_to_end(&mut d)
                .unwrap();
            d
        } else {
            raw
        };
        let sha256 = std::fs::read_to_string(dir.join(&sha_name))
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        let opts = match std::fs::read_to_string(dir.join(format!("{name}.version"))) {
            Ok(v) => WriteOptions::pinned(v.trim().parse().unwrap()),
            Err(_) => WriteOptions::default(),
        };
        out.push(Vector {
            name,
            dump,
            sha256,
            opts,
        });
    }
    assert!(
        out.len() >= 12,
        "expected the composefs vectors, found {}",
        out.len()
    );
    out
}

fn parse(v: &Vector) -> cairn_erofs::Tree {
    let strict = !LENIENT.contains(&v.name.as_str());
    parse_dump(BufReader::new(&v.dump[..]), &ParseOptions { strict })
        .unwrap_or_else(|e| panic!("{}: {e}", v.name))
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

#[test]
fn every_vector_reproduces_the_reference_digest() {
    let mut failures = Vec::new();
    for v in vectors() {
        let strict = !LENIENT.contains(&v.name.as_str());
        let tree = match parse_dump(BufReader::new(&v.dump[..]), &ParseOptions { strict }) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{}: parse: {e}", v.name));
                continue;
            }
        };
        let image = match mkfs_erofs_to_vec(&tree, &v.opts) {
            Ok(i) => i,
            Err(e) => {
                failures.push(format!("{}: write: {e}", v.name));
                continue;
            }
        };
        let got = sha256_hex(&image);
        if got != v.sha256 {
            failures.push(format!("{}: got {got}, want {}", v.name, v.sha256));
        }
    }
    assert!(
        failures.is_empty(),
        "digest mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn read_back_and_rewrite_gives_the_same_bytes() {
    for v in vectors() {
        let tree = parse(&v);
        let image = mkfs_erofs_to_vec(&tree, &v.opts).unwrap();
        let back = read_image(&image).unwrap_or_else(|e| panic!("{}: reading back: {e}", v.name));
        let again = mkfs_erofs_to_vec(&back, &v.opts).unwrap();
        assert!(
            image == again,
            "{}: image differs after read + write",
            v.name
        );
        // The dump of the read-back tree parses and writes the same image too.
        let mut text = Vec::new();
        print_dump(&back, &mut text).unwrap();
        let reparsed = parse_dump(BufReader::new(&text[..]), &ParseOptions { strict: true })
            .unwrap_or_else(|e| panic!("{}: reparsing our dump: {e}", v.name));
        assert!(
            mkfs_erofs_to_vec(&reparsed, &v.opts).unwrap() == image,
            "{}: dump round trip",
            v.name
        );
    }
}

#[test]
fn fsck_erofs_accepts_every_image() {
    let fsck = Command::new("fsck.erofs").arg("--help").output();
    assert!(
        fsck.is_ok(),
        "fsck.erofs (erofs-utils) must be installed: run setup.sh"
    );
    let dir = tempfile::tempdir().unwrap();
    for v in vectors() {
        let image = mkfs_erofs_to_vec(&parse(&v), &v.opts).unwrap();
        let path = dir.path().join(format!("{}.img", v.name));
        std::fs::write(&path, &image).unwrap();
        let out = Command::new("fsck.erofs").arg(&path).output().unwrap();
        assert!(
            out.status.success(),
            "{}: fsck.erofs: {}{}",
            v.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
