//! The reader and the dump parser treat their input as hostile: whatever the
//! bytes, they return a value or an error and never panic. This runs the
//! committed fuzz reproducers (`fuzz/regressions/<target>/*`) and a seeded
//! mutation sweep over images of the composefs vectors.

use std::io::Read;
use std::path::{Path, PathBuf};

use cairn_erofs::dump::{parse_dump, print_dump, ParseOptions};
use cairn_erofs::reader::read_image;
use cairn_erofs::writer::{mkfs_erofs_to_vec, WriteOptions};

#[path = "common/vectors.rs"]
mod vectors;
use vectors::vectors_dir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The checks each fuzz target makes, for one input.
fn check_dump_input(data: &[u8]) {
    for strict in [true, false] {
        if let Ok(tree) = parse_dump(data, &ParseOptions { strict }) {
            if let Ok(image) = mkfs_erofs_to_vec(&tree, &WriteOptions::default()) {
                // The first read-back may lose what the format does not keep
                // (a fifo's declared size still decides the inode format, as
                // in mkcomposefs); from then on it is a fixed point.
                let back = read_image(&image).expect("reading back our own image");
                let again = mkfs_erofs_to_vec(&back, &WriteOptions::default()).expect("rewrite");
                let back2 = read_image(&again).expect("reading back again");
                let third = mkfs_erofs_to_vec(&back2, &WriteOptions::default()).expect("rewrite");
                assert!(third == again, "image changed after read + write");
            }
        }
    }
}

fn check_image_input(data: &[u8]) {
    if let Ok(tree) = read_image(data) {
        let _ = mkfs_erofs_to_vec(&tree, &WriteOptions::default());
        let mut out = Vec::new();
        let _ = print_dump(&tree, &mut out);
    }
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn fuzz_regressions_do_not_panic() {
    for p in files_in(&repo().join("fuzz/regressions/dump_parse")) {
        check_dump_input(&std::fs::read(&p).unwrap());
    }
    for p in files_in(&repo().join("fuzz/regressions/erofs_read")) {
        check_image_input(&std::fs::read(&p).unwrap());
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn vector_images() -> Vec<Vec<u8>> {
    let dir = vectors_dir();
    let mut out = Vec::new();
    for p in files_in(&dir) {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("should-fail")
            || !(name.ends_with(".dump") || name.ends_with(".dump.gz"))
        {
            continue;
        }
        let raw = std::fs::read(&p).unwrap();
        let dump = if name.ends_with(".gz") {
            let mut d = Vec::new();
            flate2::read::GzDecoder::new(&raw[..])
                .read_to_end(&mut d)
                .unwrap();
            d
        } else {
            raw
        };
        if dump.len() > 1 << 20 {
            continue; // keep the sweep fast
        }
        if let Ok(tree) = parse_dump(&dump[..], &ParseOptions { strict: false }) {
            out.push(mkfs_erofs_to_vec(&tree, &WriteOptions::default()).unwrap());
        }
    }
    assert!(!out.is_empty());
    out
}

#[test]
fn mutated_images_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for image in vector_images() {
        for _ in 0..400 {
            let mut m = image.clone();
            match rng.below(4) {
                0 => {
                    let n = 1 + rng.below(8);
                    for _ in 0..n {
                        let i = rng.below(m.len());
                        m[i] ^= 1 << rng.below(8);
                    }
                }
                1 => m.truncate(rng.below(m.len())),
                2 => {
                    // Clobber a 32-byte slot (an inode or dirent) with noise.
                    let i = rng.below(m.len() / 32) * 32;
                    for b in m.iter_mut().skip(i).take(32) {
                        *b = rng.next() as u8;
                    }
                }
                _ => {
                    let i = rng.below(m.len());
                    let v = rng.next() as u8;
                    m[i] = v;
                }
            }
            check_image_input(&m);
        }
    }
}

#[test]
fn mutated_dumps_never_panic() {
    let mut rng = Rng(42);
    let dump = std::fs::read(vectors_dir().join("special.dump")).unwrap();
    for _ in 0..300 {
        let mut m = dump.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(m.len());
            m[i] = b" \n\\x@-=0a/."[rng.below(11)];
        }
        check_dump_input(&m);
    }
}
