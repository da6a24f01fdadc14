//! gc against live mounts, for real: an image mounted and then stripped of
//! its name keeps every object while the mount lives (in this mount
//! namespace or another one) and goes at the first gc after `umount`;
//! `mount` takes names, digest prefixes and files (which it copies into
//! the store so the mount traces back to it). These tests mount and fail
//! loudly when not run as root.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::Value;

fn json(root: &Path, args: &[&str]) -> Value {
    let mut a = vec![os("--json")];
    a.extend(args.iter().map(|s| os(s)));
    serde_json::from_slice(&cairn(root, &a).stdout).unwrap()
}

fn object_count(root: &Path) -> usize {
    fs::read_dir(root.join("objects"))
        .unwrap()
        .map(|f| fs::read_dir(f.unwrap().path()).unwrap().count())
        .sum()
}

fn images_in(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root.join("images"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

struct Fixture {
    _dir: tempfile::TempDir,
    base: PathBuf,
    root: PathBuf,
    tree: PathBuf,
    digest: String,
}

fn fixture() -> Fixture {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-store-priv")
        .tempdir()
        .unwrap();
    let base = dir.path().to_path_buf();
    let root = base.join("store");
    let tree = base.join("tree");
    build_full_tree(&tree);
    let v = json(
        &root,
        &[
            "mkfs",
            "--store",
            "--name",
            "full:1",
            tree.to_str().unwrap(),
        ],
    );
    Fixture {
        digest: v["sha256"].as_str().unwrap().to_owned(),
        _dir: dir,
        base,
        root,
        tree,
    }
}

fn assert_same_tree(source: &Path, mounted: &Path) {
    let differences = diff(&snapshot(source), &snapshot(mounted));
    assert!(
        differences.is_empty(),
        "mounted tree differs from the source:\n{}",
        differences.join("\n")
    );
}

#[test]
fn privileged_gc_keeps_what_a_live_mount_uses() {
    let f = fixture();
    let objects = object_count(&f.root);
    assert!(objects > 0);
    let target = f.base.join("mnt");
    let m = mount(&f.root, Path::new("full:1"), &target, &[]);
    let entry = cairn_mount::find_mount(&target).unwrap().expect("mounted");
    assert_eq!(
        entry.source,
        f.root.join("images").join(&f.digest).to_str().unwrap()
    );

    let rm = json(&f.root, &["rm", "full:1"]);
    assert_eq!(rm["unnamed"], serde_json::json!([f.digest.clone()]));
    let images = json(&f.root, &["images"]);
    assert_eq!(images[0]["mounted_on"], serde_json::json!([target.clone()]));
    let gc = json(&f.root, &["gc"]);
    assert_eq!(gc["objects"], 0, "{gc:#}");
    assert_eq!(gc["images"], serde_json::json!([]));
    assert_eq!(gc["live_mounts"][0]["digest"], f.digest.as_str());
    assert_eq!(object_count(&f.root), objects);
    // The mount still reads every file, byte for byte.
    assert_same_tree(&f.tree, &target);
    let human = String::from_utf8(cairn(&f.root, &[os("gc")]).stdout).unwrap();
    assert!(
        human.contains(&format!("kept image {}", &f.digest[..12])),
        "{human}"
    );

    drop(m);
    assert!(cairn_mount::find_mount(&target).unwrap().is_none());
    let gc = json(&f.root, &["gc"]);
    assert_eq!(gc["images"][0]["name"], f.digest.as_str());
    assert_eq!(gc["objects"], objects);
    assert_eq!(object_count(&f.root), 0);
    assert!(images_in(&f.root).is_empty());
}

/// A child process killed (and reaped) when dropped, also on a failed assert.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn privileged_gc_sees_mounts_in_other_mount_namespaces() {
    let f = fixture();
    let objects = object_count(&f.root);
    let target = f.base.join("mnt-ns");
    fs::create_dir_all(&target).unwrap();
    // A process in a private mount namespace mounts the image and waits;
    // the mount never shows in ours.
    let ready = f.base.join("ready");
    let script = format!(
        "set -e; {cairn} --root {root} mount full:1 {target}; touch {ready}; exec sleep 600",
        cairn = cairn_bin(),
        root = f.root.display(),
        target = target.display(),
        ready = ready.display(),
    );
    let mut child = Killed(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .spawn()
            .expect("running unshare (util-linux)"),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the namespaced mount did not come up"
        );
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("the namespaced mounter exited: {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        cairn_mount::find_mount(&target).unwrap().is_none(),
        "not in our namespace"
    );
    cairn(&f.root, &[os("rm"), os("full:1")]);
    let gc = json(&f.root, &["gc"]);
    assert_eq!(
        gc["objects"], 0,
        "gc removed objects a mount in another namespace uses: {gc:#}"
    );
    assert_eq!(object_count(&f.root), objects);
    assert_eq!(gc["live_mounts"][0]["pid"], child.0.id());
    // The namespace dies with its last process, and the mount with it.
    drop(child);
    let gc = json(&f.root, &["gc"]);
    assert_eq!(gc["objects"], objects, "{gc:#}");
}

#[test]
fn privileged_mount_takes_digest_prefixes_and_copies_files_into_the_store() {
    let f = fixture();
    let target = f.base.join("mnt-prefix");
    {
        let _m = mount(&f.root, Path::new(&f.digest[..12]), &target, &[]);
        assert_same_tree(&f.tree, &target);
    }
    // An image file outside the store, of another tree over the same store.
    let other = f.base.join("other");
    fs::create_dir_all(&other).unwrap();
    write_pattern(&other.join("big"), 300_000, 7);
    let img = f.base.join("other.img");
    cairn(
        &f.root,
        &[
            os("mkfs"),
            os("--store"),
            other.as_os_str(),
            img.as_os_str(),
        ],
    );
    let target = f.base.join("mnt-file");
    let m = mount(&f.root, &img, &target, &[]);
    let entry = cairn_mount::find_mount(&target).unwrap().expect("mounted");
    let src = PathBuf::from(&entry.source);
    assert_eq!(src.parent().unwrap(), f.root.join("images"), "{entry:?}");
    let copied = src.file_name().unwrap().to_str().unwrap().to_owned();
    assert_eq!(fs::read(&src).unwrap(), fs::read(&img).unwrap());
    // Unnamed but mounted: gc keeps it and its object.
    let gc = json(&f.root, &["gc"]);
    assert_eq!(gc["objects"], 0, "{gc:#}");
    assert_eq!(
        fs::read(target.join("big")).unwrap(),
        fs::read(other.join("big")).unwrap()
    );
    drop(m);
    let gc = json(&f.root, &["gc"]);
    let gone: Vec<&str> = gc["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(gone, vec![copied.as_str()]);
    assert_eq!(gc["objects"], 1);
    assert_eq!(
        images_in(&f.root),
        vec![f.digest.clone()],
        "the named image stays"
    );
}
