//! A `cairn pull` killed with SIGKILL half way leaves only what it had
//! verified (a finished layer) and `tmp/` debris that the next command
//! removes; the retried pull succeeds and fetches only what was missing.
//! The registry is the in-test fake from the cairn-oci tests, with one
//! layer stalled until the pull is killed.

#[path = "../../oci/tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::fake::{FakeServer, Reply};
use common::FakeImage;

fn cairn(root: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cairn"));
    c.arg("--root")
        .arg(root)
        .env("HOME", root)
        .env_remove("REGISTRY_AUTH_FILE");
    c
}

#[test]
fn killed_pull_leaves_only_verified_layers_and_a_retry_finishes() {
    let img = FakeImage::new();
    let stall = Arc::new(AtomicBool::new(true));
    let server = {
        let img = img.clone();
        let stall = Arc::clone(&stall);
        FakeServer::start(move |req| {
            let big = &img.layers[0];
            if stall.load(Ordering::Relaxed) && req.path.ends_with(&format!("/blobs/{}", big.0)) {
                return Reply::StallAfter(
                    vec![],
                    big.1[..100_000].to_vec(),
                    big.1.len() as u64,
                    Duration::from_secs(20),
                );
            }
            img.serve(req)
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let reference = img.reference(&server.addr);

    let mut child = cairn(root)
        .args(["pull", "--name", "interrupted", &reference])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the small layer is in, then kill.
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let small = &img.layers[1].0;
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line.starts_with("layer 2/2 ")
            && line.contains(small.as_str())
            && line.ends_with(" done")
        {
            break;
        }
    }
    assert!(
        seen.iter().any(|l| l.ends_with(" done")),
        "the pull never finished a layer: {seen:?}"
    );
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success());

    // Only the verified layer is visible; no image, no name.
    let listing = |d: &str| -> Vec<String> {
        std::fs::read_dir(root.join(d))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(listing("layers"), vec![img.layers[1].2.clone()]);
    assert!(listing("images").is_empty());
    assert!(listing("refs").is_empty());
    assert!(
        common::tmp_after_reopen(root).is_empty(),
        "debris survived a reopen"
    );

    // The registry recovers; the retry fetches the big layer only.
    stall.store(false, Ordering::Relaxed);
    let before = server.count(|r| r.path.ends_with(&format!("/blobs/{small}")));
    let out = cairn(root)
        .args(["pull", "--name", "interrupted", &reference])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("2 layers: 1 fetched, 1 cached"), "{stdout}");
    assert_eq!(
        server.count(|r| r.path.ends_with(&format!("/blobs/{small}"))),
        before
    );
    let out = cairn(root).args(["dump", "interrupted"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump = String::from_utf8_lossy(&out.stdout);
    assert!(dump.lines().any(|l| l.starts_with("/hello ")), "{dump}");
    assert!(dump.lines().any(|l| l.starts_with("/data.bin ")), "{dump}");
}
