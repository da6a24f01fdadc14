//! `cairn snapshotter` judged by containerd's own tests: containerd's
//! snapshotter test suite (`snapshots/testsuite` from Debian's
//! golang-github-containerd-containerd-dev), run through containerd's proxy
//! snapshotter client against the cairn socket by the Go program in
//! `tests/containerd-suite/` (built here in GOPATH mode with the machine's
//! Go). Each of the suite's subtests is reported; any failure fails this
//! test. These tests mount and fail loudly when not run as root.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Subtests the suite itself skips, and why.
const SKIPPED_BY_THE_SUITE: &[(&str, &str)] = &[(
    "Rename",
    "containerd's suite skips it on every snapshotter: \"rename test still fails on some kernels with overlay\"",
)];

fn go_bin() -> PathBuf {
    for p in ["/usr/local/go/bin/go", "/usr/lib/go/bin/go", "/usr/bin/go"] {
        if Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    panic!("no Go toolchain (/usr/local/go/bin/go or Debian's golang-go): setup.sh installs golang-go");
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// Builds the suite's test binary; returns its path.
fn build_suite() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("containerd-suite");
    std::fs::create_dir_all(&out).unwrap();
    let bin = out.join("suite.test");
    let src = workspace_root().join("tests/containerd-suite");
    let gopath = "/usr/share/gocode";
    assert!(
        Path::new(gopath)
            .join("src/github.com/containerd/containerd/snapshots/testsuite")
            .exists(),
        "{gopath} has no containerd testsuite: setup.sh installs golang-github-containerd-containerd-dev"
    );
    let o = Command::new(go_bin())
        .args(["test", "-c", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(&src)
        .env("GO111MODULE", "off")
        .env("GOPATH", gopath)
        .env("GOCACHE", out.join("cache"))
        .env("GOFLAGS", "")
        .output()
        .expect("running go");
    assert!(
        o.status.success(),
        "building {}: {}{}",
        src.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    bin
}

/// `(name, result)` of each `--- PASS/FAIL/SKIP: Test/NAME` line.
fn subtests(log: &str) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for line in log.lines() {
        let l = line.trim_start();
        for result in ["PASS", "FAIL", "SKIP"] {
            if let Some(rest) = l.strip_prefix(&format!("--- {result}: TestCairnSnapshotter/")) {
                let name = rest.split_whitespace().next().unwrap_or("").to_owned();
                if !v.iter().any(|(n, _)| *n == name) {
                    v.push((name, result.to_owned()));
                }
            }
        }
    }
    v
}

#[test]
fn privileged_snapshotter_containerd_suite() {
    require_root();
    let bin = build_suite();
    let out = Command::new(&bin)
        .args(["-test.v", "-test.timeout", "20m"])
        .env("CAIRN_BIN", cairn_bin())
        .env_remove("CAIRN_ROOT")
        .output()
        .expect("running the suite");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let results = subtests(&stdout);
    assert!(
        results.len() >= 20,
        "the suite ran {} subtests ({}):\n{stdout}\n{stderr}",
        results.len(),
        out.status
    );
    let mut failed = Vec::new();
    for (name, result) in &results {
        let why = SKIPPED_BY_THE_SUITE
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, w)| format!(" ({w})"))
            .unwrap_or_default();
        eprintln!("containerd snapshotter suite: {name}: {result}{why}");
        let expected = if why.is_empty() { "PASS" } else { "SKIP" };
        if result != expected {
            failed.push(format!("{name}: {result}, expected {expected}"));
        }
    }
    assert!(
        failed.is_empty() && out.status.success(),
        "containerd's snapshotter suite: {} ({}):\n{stdout}\n{stderr}",
        failed.join("; "),
        out.status
    );
    // Nothing the snapshotters mounted is left behind.
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let left: Vec<_> = mi
        .lines()
        .filter(|l| l.contains("/snapshot-suite-cairn-"))
        .collect();
    assert!(left.is_empty(), "mounts left behind: {left:#?}");
}
