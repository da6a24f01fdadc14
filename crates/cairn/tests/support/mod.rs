//! Helpers for the crash and concurrency tests (`crash_trials.rs`,
//! `concurrency.rs`): a multi-layer test image set written as an OCI
//! layout and pushed to a real registry, a throttling TCP proxy in front of
//! that registry, a seeded RNG, and running `cairn` against a store.
//!
//! The registry itself is the cairn-oci fixture (Debian's `docker-registry`
//! on 127.0.0.1), included by path.
#![allow(dead_code)]

#[path = "../../../oci/tests/common/registry.rs"]
pub mod registry;

pub mod artifact;
pub mod containerd;
pub mod estargz;
pub mod images;
pub mod proxy;
pub mod range_proxy;
pub mod snapshotter;

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// splitmix64: small, seedable, good enough to pick kill delays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// The seed from `$var` if set (to replay a failure), else a fresh one.
pub fn seed_from_env(var: &str) -> u64 {
    match std::env::var(var) {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{var}={s:?} is not a u64")),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)
        }
    }
}

/// `cairn --root ROOT`, with no credentials or log settings from the
/// environment.
pub fn cairn_cmd(root: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cairn"));
    c.arg("--root")
        .arg(root)
        .env("HOME", root.parent().unwrap_or(root))
        .env_remove("REGISTRY_AUTH_FILE")
        .env_remove("CAIRN_LOG")
        .env_remove("CAIRN_ROOT");
    c
}

pub fn cairn_out<S: AsRef<OsStr>>(root: &Path, args: &[S]) -> Output {
    cairn_cmd(root).args(args).output().expect("running cairn")
}

/// Runs cairn, panicking with its output unless it succeeds; returns stdout.
pub fn cairn_ok<S: AsRef<OsStr>>(root: &Path, args: &[S]) -> String {
    let out = cairn_out(root, args);
    assert!(
        out.status.success(),
        "cairn {:?} failed ({}): {}{}",
        args.iter().map(|a| a.as_ref()).collect::<Vec<_>>(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("cairn prints UTF-8")
}

/// `cairn --json fsck` must exit 0 and report no problem; returns the report.
pub fn assert_fsck_clean(root: &Path, context: &str) -> serde_json::Value {
    let out = cairn_out(root, &["--json", "fsck"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{context}: fsck failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{context}: fsck --json: {e}: {stdout}"));
    assert_eq!(v["clean"], true, "{context}: fsck: {v:#}");
    assert_eq!(
        v["problems"].as_array().map(Vec::len),
        Some(0),
        "{context}: fsck: {v:#}"
    );
    v
}

/// Names directly under `root/dir`, sorted.
pub fn listing(root: &Path, dir: &str) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root.join(dir))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Every entry under `root/tmp`, recursively, as paths relative to `tmp/`.
pub fn tmp_tree(root: &Path) -> Vec<PathBuf> {
    fn walk(d: &Path, base: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = fs::read_dir(d) else { return };
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.strip_prefix(base).unwrap().to_path_buf());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                walk(&p, base, out);
            }
        }
    }
    let base = root.join("tmp");
    let mut out = Vec::new();
    walk(&base, &base, &mut out);
    out.sort();
    out
}

/// Every ref must name an image that is in `images/`, and every image a
/// ref names must read back: no ref ever points at an incomplete image.
/// Returns `(ref, digest)` pairs.
pub fn assert_refs_complete(root: &Path, context: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in listing(root, "refs") {
        let text = fs::read_to_string(root.join("refs").join(&name))
            .unwrap_or_else(|e| panic!("{context}: ref {name}: {e}"));
        let digest = text.trim_end().to_owned();
        assert!(
            digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
            "{context}: ref {name} holds {text:?}"
        );
        assert!(
            root.join("images").join(&digest).is_file(),
            "{context}: ref {name} names image {digest}, which is not in the store"
        );
        out.push((name, digest));
    }
    out
}

/// Copies a store directory (`cp -a`), to start a trial from a prepared
/// store.
pub fn copy_store(from: &Path, to: &Path) {
    let out = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .output()
        .expect("running cp");
    assert!(
        out.status.success(),
        "cp -a {} {}: {}",
        from.display(),
        to.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
