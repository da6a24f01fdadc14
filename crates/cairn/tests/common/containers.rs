//! Helpers for the container tests (`privileged_run`, `privileged_listen`):
//! waiting for a condition, listing a directory, finding leaked cgroups.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Temporary directories of the container tests (privileged_run, and
/// privileged_listen as cairn-run-listen): containers of their stores are live.
const TEST_DIR_PREFIXES: &[&str] = &["cairn-run"];

/// Waits until `cond` holds, up to `secs`.
pub fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Container cgroups (`cairn/<id>`, or flat `cairn-<id>` on a hybrid
/// host; any hierarchy) whose container record exists in no test store:
/// leaked ones.
pub fn leaked_cgroups() -> Vec<PathBuf> {
    fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
        if depth > 6 {
            return;
        }
        let Ok(rd) = fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if e.file_name() == "cairn" {
                for g in fs::read_dir(e.path()).into_iter().flatten().flatten() {
                    if g.file_type().is_ok_and(|t| t.is_dir()) {
                        out.push(g.path());
                    }
                }
            } else if cairn_run::cgroup::is_container_group(&e.file_name().to_string_lossy()) {
                out.push(e.path());
            } else {
                walk(&e.path(), depth + 1, out);
            }
        }
    }
    let mut groups = Vec::new();
    walk(Path::new("/sys/fs/cgroup"), 0, &mut groups);
    let live: BTreeSet<String> = fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            TEST_DIR_PREFIXES.iter().any(|p| n.starts_with(p))
        })
        .flat_map(|e| {
            // Records in a store's own run root, or in a test's other one.
            ["store/run/containers", "runroot/containers"]
                .into_iter()
                .flat_map(move |d| {
                    fs::read_dir(e.path().join(d))
                        .into_iter()
                        .flatten()
                        .flatten()
                })
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    groups
        .into_iter()
        .filter(|g| {
            let name = g.file_name().unwrap().to_string_lossy().into_owned();
            let id = name
                .strip_prefix(cairn_run::cgroup::GROUP_PREFIX)
                .unwrap_or(&name);
            !live.contains(id)
        })
        .collect()
}
