//! `cairn pull` end to end against Debian's docker-registry on 127.0.0.1:
//! what it prints (human, `--json`, the line-per-event progress on a
//! non-terminal stderr, nothing with `-q`), that the pulled image is in the
//! store under its name and reads back, that a second pull reuses layers,
//! and the messages and exit status of the common failures.

#[path = "../../oci/tests/common/registry.rs"]
mod registry;

use std::path::Path;
use std::process::{Command, Output};

use registry::{test_layout, LocalRegistry};

fn cairn(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--root")
        .arg(root)
        .args(args)
        // Keep the user's credentials out of it.
        .env("HOME", root)
        .env_remove("REGISTRY_AUTH_FILE")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("XDG_CONFIG_HOME")
        .env_remove("CAIRN_LOG")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Everything under the store's published directories.
fn published(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["objects", "images", "layers", "refs"] {
        let mut stack = vec![root.join(dir)];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                out.push(e.path().strip_prefix(root).unwrap().display().to_string());
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                }
            }
        }
    }
    out.sort();
    out
}

#[test]
fn pull_json_then_cached_then_dump() {
    let reg = LocalRegistry::start();
    reg.skopeo_push(test_layout(), "base", "cli/busybox:base", &[]);
    reg.skopeo_push(test_layout(), "two", "cli/busybox:two", &[]);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();

    let base = reg.reference("cli/busybox:base");
    let out = cairn(root, &["pull", "--json", &base]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["name"], base.as_str());
    assert_eq!(report["layers"].as_array().unwrap().len(), 1);
    assert_eq!(report["layers"][0]["fetched"], true);
    let image = report["image_digest"].as_str().unwrap().to_string();
    assert_eq!(image.len(), 64);
    // stderr is not a terminal here: one line per event.
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("resolved {base} manifest sha256:")),
        "{err}"
    );
    assert!(
        err.contains("layer 1/1 sha256:") && err.contains(" fetching ") && err.contains(" done"),
        "{err}"
    );
    assert!(err.contains("assembling"), "{err}");

    // The second image shares the base layer: only its own is fetched.
    let two = reg.reference("cli/busybox:two");
    let out = cairn(root, &["pull", "--name", "busybox-two", &two]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("pulled busybox-two: image "), "{stdout}");
    assert!(stdout.contains("2 layers: 1 fetched, 1 cached"), "{stdout}");
    let err = text(&out.stderr);
    assert!(
        err.contains("layer 1/2 sha256:") && err.contains(" cached"),
        "{err}"
    );

    // The images read back by name: the tree has the files of both layers.
    let out = cairn(root, &["dump", "busybox-two"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let dump = text(&out.stdout);
    for path in ["/bin/busybox ", "/hello ", "/etc/two "] {
        assert!(
            dump.lines().any(|l| l.starts_with(path)),
            "{path} not in:\n{dump}"
        );
    }
    let out = cairn(root, &["dump", &base]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).lines().any(|l| l.starts_with("/hello ")));

    // -q: nothing at all, and an unchanged store.
    let before = published(root);
    let out = cairn(root, &["-q", "pull", &base]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        out.stdout.is_empty() && out.stderr.is_empty(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(published(root), before);
}

#[test]
fn pull_failures_say_what_and_leave_the_store_alone() {
    let reg = LocalRegistry::start();
    reg.skopeo_push(test_layout(), "base", "cli/busybox:base", &[]);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let closed = format!("127.0.0.1:{}", registry::free_port());
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec![reg.reference("cli/busybox:nosuchtag")],
            format!("cairn: manifest unknown: {}/cli/busybox:nosuchtag\n", reg.addr),
        ),
        (
            vec![format!("{closed}/foo:bar")],
            format!("cairn: cannot reach registry {closed}: connection refused\n"),
        ),
        (
            vec![reg.reference("cli/busybox:base"), "--platform".into(), "linux/s390x".into()],
            format!(
                "cairn: no image for platform linux/s390x in {} (available: linux/amd64)\n",
                reg.reference("cli/busybox:base")
            ),
        ),
        (
            vec!["foo/Bar:tag".into()],
            "cairn: invalid image reference \"foo/Bar:tag\": repository component \"Bar\": expected".into(),
        ),
        (
            vec![reg.reference("cli/busybox:base"), "--platform".into(), "linux".into()],
            "cairn: invalid platform \"linux\": expected os/arch[/variant]\n".into(),
        ),
    ];
    let _ = cairn(
        root,
        &[
            "-q",
            "pull",
            &reg.reference("cli/busybox:base"),
            "--platform",
            "linux/s390x",
        ],
    );
    let before = published(root);
    for (args, want) in cases {
        let mut a = vec!["pull"];
        a.extend(args.iter().map(String::as_str));
        let out = cairn(root, &a);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string() + "\n";
        assert!(
            last.starts_with(want.trim_end_matches('\n')) || last == want,
            "{args:?}: {err}"
        );
        assert!(out.stdout.is_empty());
        assert_eq!(published(root), before, "{args:?} changed the store");
    }
}
