//! The store management commands end to end, through the `cairn` binary,
//! without mounting: images named by `mkfs --store --name`, resolved by
//! name, digest, prefix and path; `images` and `df` numbers; `tag`, `rm`,
//! `inspect`; `gc` and `fsck` (with `--repair`); and gc racing concurrent
//! writers.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::{cairn, cairn_raw, os, write_pattern};
use serde_json::Value;

/// A tree holding the pattern files `seeds` (name `f<seed>`, `1000 + seed *
/// 37` bytes, all above the inline threshold), plus one file only it has.
fn tree(dir: &Path, seeds: &[u64], own: u64) -> u64 {
    fs::create_dir_all(dir.join("sub")).unwrap();
    let mut logical = 0;
    for &s in seeds {
        let len = 1000 + s as usize * 37;
        write_pattern(&dir.join(format!("f{s}")), len, s);
        logical += len as u64;
    }
    let len = 5000 + own as usize;
    write_pattern(&dir.join("sub").join("own"), len, 1_000_000 + own);
    logical + len as u64
}

fn json(root: &Path, args: &[&str]) -> Value {
    let mut a: Vec<&OsStr> = vec![os("--json")];
    a.extend(args.iter().map(|s| os(s)));
    let out = cairn(root, &a);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn mkfs_named(root: &Path, tree: &Path, name: &str) -> String {
    let v = json(
        root,
        &["mkfs", "--store", "--name", name, tree.to_str().unwrap()],
    );
    v["sha256"].as_str().unwrap().to_owned()
}

fn stdout(root: &Path, args: &[&str]) -> String {
    let a: Vec<&OsStr> = args.iter().map(|s| os(s)).collect();
    String::from_utf8(cairn(root, &a).stdout).unwrap()
}

/// Runs cairn expecting failure; returns stderr.
fn fails(root: &Path, args: &[&str]) -> String {
    let a: Vec<&OsStr> = args.iter().map(|s| os(s)).collect();
    let out = cairn_raw(root, &a);
    assert!(!out.status.success(), "cairn {args:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

fn object_files(root: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    for fan in fs::read_dir(root.join("objects")).unwrap() {
        for o in fs::read_dir(fan.unwrap().path()).unwrap() {
            out.insert(o.unwrap().path());
        }
    }
    out
}

fn image_files(root: &Path) -> BTreeSet<String> {
    fs::read_dir(root.join("images"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

struct Three {
    _dir: tempfile::TempDir,
    base: PathBuf,
    root: PathBuf,
    digests: BTreeMap<&'static str, String>,
    logical: BTreeMap<&'static str, u64>,
}

/// Three images sharing files: a = {1,2,3}+own, b = {1,2,4}+own,
/// c = {1,5}+own.
fn three_images() -> Three {
    let dir = tempfile::Builder::new()
        .prefix("cairn-store-cli")
        .tempdir()
        .unwrap();
    let base = dir.path().to_path_buf();
    let root = base.join("store");
    let mut digests = BTreeMap::new();
    let mut logical = BTreeMap::new();
    for (name, seeds, own) in [
        ("a", &[1u64, 2, 3][..], 1),
        ("b", &[1, 2, 4][..], 2),
        ("reg:5000/lib/c:1", &[1, 5][..], 3),
    ] {
        let t = base.join(format!("tree-{own}"));
        logical.insert(name, tree(&t, seeds, own));
        digests.insert(name, mkfs_named(&root, &t, name));
    }
    Three {
        _dir: dir,
        base,
        root,
        digests,
        logical,
    }
}

fn size_of_file(seed: u64) -> u64 {
    1000 + seed * 37
}

#[test]
fn images_and_df_count_shared_and_unique_bytes() {
    let t = three_images();
    let rows = json(&t.root, &["images"]);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3);
    let row = |name: &str| {
        rows.iter()
            .find(|r| r["names"].as_array().unwrap().iter().any(|n| n == name))
            .unwrap_or_else(|| panic!("no row for {name}: {rows:#?}"))
    };
    let image_size = |d: &str| fs::metadata(t.root.join("images").join(d)).unwrap().len();
    let own = |n: u64| 5000 + n;
    for (name, shared_seeds, unique_seeds, own_n) in [
        ("a", &[1u64, 2][..], &[3u64][..], 1),
        ("b", &[1, 2][..], &[4][..], 2),
        ("reg:5000/lib/c:1", &[1][..], &[5][..], 3),
    ] {
        let r = row(name);
        let d = &t.digests[name];
        assert_eq!(r["digest"], d.as_str());
        let shared: u64 = shared_seeds.iter().map(|&s| size_of_file(s)).sum();
        let unique: u64 = unique_seeds.iter().map(|&s| size_of_file(s)).sum::<u64>() + own(own_n);
        assert_eq!(r["shared_bytes"], shared, "{name}");
        assert_eq!(r["unique_bytes"], unique + image_size(d), "{name}");
        assert_eq!(r["object_bytes"], shared + unique, "{name}");
        assert_eq!(r["size"], shared + unique + image_size(d), "{name}");
        assert_eq!(r["logical_bytes"], t.logical[name], "{name}");
        assert_eq!(r["image_bytes"], image_size(d), "{name}");
        assert!(r["stored"].as_str().unwrap().ends_with('Z'));
        assert_eq!(r["created"], Value::Null, "mkfs images have no config");
    }

    let df = json(&t.root, &["df"]);
    let cat = |name: &str| {
        df["categories"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["category"] == name)
            .unwrap()
            .clone()
    };
    let distinct: u64 = [1, 2, 3, 4, 5]
        .iter()
        .map(|&s| size_of_file(s))
        .sum::<u64>()
        + own(1)
        + own(2)
        + own(3);
    assert_eq!(cat("objects")["count"], 8);
    assert_eq!(cat("objects")["bytes"], distinct);
    let images: u64 = t.digests.values().map(|d| image_size(d)).sum();
    assert_eq!(cat("images")["count"], 3);
    assert_eq!(cat("images")["bytes"], images);
    assert_eq!(cat("layers")["count"], 0);
    let logical: u64 = t.logical.values().sum();
    assert_eq!(df["logical_bytes"], logical);
    assert_eq!(df["physical_bytes"], distinct + images);
    let ratio = df["dedup_ratio"].as_f64().unwrap();
    assert!((ratio - logical as f64 / (distinct + images) as f64).abs() < 1e-9);
    assert_eq!(df["reclaimable"]["count"], 0);

    // The human forms name the same things.
    let text = stdout(&t.root, &["images"]);
    assert!(text.lines().next().unwrap().starts_with("NAME"), "{text}");
    assert!(text.contains("reg:5000/lib/c:1"), "{text}");
    assert!(text.contains(&t.digests["a"][..12]), "{text}");
    let text = stdout(&t.root, &["df"]);
    assert!(text.contains("dedup ratio"), "{text}");
}

#[test]
fn commands_take_names_digests_prefixes_and_paths() {
    let t = three_images();
    let a = &t.digests["a"];
    let by_name = stdout(&t.root, &["dump", "a"]);
    assert!(by_name.contains("/f3 "), "{by_name}");
    for arg in [
        a.clone(),
        format!("sha256:{a}"),
        a[..12].to_string(),
        t.root.join("images").join(a).to_str().unwrap().to_string(),
    ] {
        assert_eq!(stdout(&t.root, &["dump", &arg]), by_name, "{arg}");
    }
    assert_eq!(
        stdout(&t.root, &["dump", "reg:5000/lib/c:1"]),
        stdout(&t.root, &["dump", &t.digests["reg:5000/lib/c:1"][..16]])
    );
    let err = fails(&t.root, &["dump", "nosuch"]);
    assert!(err.contains("no image \"nosuch\""), "{err}");
    let err = fails(&t.root, &["dump", &a[..8]]);
    assert!(err.contains("at least 12"), "{err}");

    // dump of a file works without any store.
    let img = t.base.join("plain.img");
    cairn(
        &t.root,
        &[
            os("mkfs"),
            t.base.join("tree-1").as_os_str(),
            img.as_os_str(),
        ],
    );
    let out = common::cairn(&t.base.join("no-store"), &[os("dump"), img.as_os_str()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("/f3 "));
    assert!(
        !t.base.join("no-store").exists(),
        "reading creates no store"
    );

    // inspect: what a mkfs image has (no record).
    let v = json(&t.root, &["inspect", &a[..12]]);
    assert_eq!(v["digest"], a.as_str());
    assert_eq!(v["names"], serde_json::json!(["a"]));
    assert_eq!(v["in_store"], true);
    assert_eq!(v["files"], 4);
    assert_eq!(v["objects"], 4);
    assert_eq!(v["missing_objects"], 0);
    assert_eq!(v["logical_bytes"], t.logical["a"]);
    assert_eq!(v["record"], Value::Null);
    // The file holds the same tree as "a": it is that image.
    let v = json(&t.root, &["inspect", img.to_str().unwrap()]);
    assert_eq!(v["digest"], a.as_str(), "same tree, same image");
    assert_eq!(v["names"], serde_json::json!(["a"]));
    // A file of a tree the store has not seen: what the file tells.
    let new_tree = t.base.join("tree-new");
    tree(&new_tree, &[7, 8], 9);
    let img = t.base.join("new.img");
    cairn(
        &t.root,
        &[os("mkfs"), new_tree.as_os_str(), img.as_os_str()],
    );
    let v = json(&t.root, &["inspect", img.to_str().unwrap()]);
    assert_eq!(v["in_store"], false, "{v:#}");
    assert_eq!(v["path"], img.to_str().unwrap());
    assert_eq!(v["files"], 3);
    assert_eq!(v["objects"], 3);
    assert_eq!(
        v["missing_objects"], 3,
        "mkfs without --store stores nothing"
    );
    assert_eq!(v["names"], serde_json::json!([]));
}

#[test]
fn tag_rm_and_gc() {
    let t = three_images();
    let a = t.digests["a"].clone();
    let b = t.digests["b"].clone();
    let c = t.digests["reg:5000/lib/c:1"].clone();
    let v = json(&t.root, &["tag", "a", "other/name:2"]);
    assert_eq!(v["digest"], a.as_str());
    let names = json(&t.root, &["inspect", "other/name:2"]);
    assert_eq!(names["names"], serde_json::json!(["a", "other/name:2"]));

    // By digest, an image with two names needs --force.
    let err = fails(&t.root, &["rm", &a[..12]]);
    assert!(err.contains("--force"), "{err}");
    let v = json(&t.root, &["rm", "--force", &a[..12]]);
    assert_eq!(v["removed"].as_array().unwrap().len(), 2);
    assert_eq!(v["unnamed"], serde_json::json!([a.clone()]));
    // Several names at once; a missing one fails the command but not the others.
    let err = fails(&t.root, &["rm", "reg:5000/lib/c:1", "nosuch"]);
    assert!(err.contains("nosuch"), "{err}");
    assert!(fails(&t.root, &["dump", "reg:5000/lib/c:1"]).contains("no image"));

    // Before gc: everything is still there.
    assert_eq!(image_files(&t.root).len(), 3);
    let before = object_files(&t.root);
    assert_eq!(before.len(), 8);
    let dry = json(&t.root, &["gc", "--dry-run"]);
    assert_eq!(object_files(&t.root), before);
    let v = json(&t.root, &["gc"]);
    assert_eq!(v["objects"], dry["objects"]);
    assert_eq!(v["bytes_freed"], dry["bytes_freed"]);
    let gone: BTreeSet<String> = v["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(gone, BTreeSet::from([a.clone(), c.clone()]));
    assert_eq!(image_files(&t.root), BTreeSet::from([b.clone()]));
    // Left: b's objects (1, 2, 4 and its own); gone: 3, 5, a's and c's own.
    assert_eq!(v["objects"], 4);
    let freed_objects = size_of_file(3) + size_of_file(5) + 5001 + 5003;
    assert_eq!(v["object_bytes"], freed_objects);
    assert_eq!(object_files(&t.root).len(), 4);
    let text = stdout(&t.root, &["fsck"]);
    assert!(text.contains("clean"), "{text}");
    assert!(stdout(&t.root, &["dump", "b"]).contains("/f4 "));
    let text = stdout(&t.root, &["gc"]);
    assert!(text.contains("freed 0 B"), "{text}");
}

fn make_writable(p: &Path) {
    fs::set_permissions(p, fs::Permissions::from_mode(0o644)).unwrap();
}

#[test]
fn fsck_reports_every_problem_and_repair_fixes_them() {
    let t = three_images();
    let a = t.digests["a"].clone();
    let b = t.digests["b"].clone();
    // Flip a byte of a's own file; remove b's own; truncate c; add a
    // dangling ref.
    let obj_of = |digest: &str, file: &str| -> PathBuf {
        let dump = stdout(&t.root, &["dump", digest]);
        let line = dump.lines().find(|l| l.starts_with(file)).unwrap();
        let payload = line.split(' ').nth(8).unwrap();
        t.root.join("objects").join(payload)
    };
    let flipped = obj_of(&a, "/sub/own ");
    make_writable(&flipped);
    let mut bytes = fs::read(&flipped).unwrap();
    bytes[100] ^= 0x80;
    fs::write(&flipped, bytes).unwrap();
    let missing = obj_of(&b, "/sub/own ");
    fs::remove_file(&missing).unwrap();
    let c_img = t.root.join("images").join(&t.digests["reg:5000/lib/c:1"]);
    make_writable(&c_img);
    let len = fs::metadata(&c_img).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&c_img)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    fs::write(
        t.root.join("refs/dangling"),
        format!("{}\n", "0".repeat(64)),
    )
    .unwrap();

    let out = cairn_raw(&t.root, &[os("fsck")]);
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--repair"), "{err}");
    let flipped_name = flipped
        .strip_prefix(t.root.join("objects"))
        .unwrap()
        .to_str()
        .unwrap()
        .replace('/', "");
    assert!(
        text.contains(&format!("object {flipped_name}: content hashes to")),
        "{text}"
    );
    assert!(
        text.contains(&format!("image {b}: /sub/own: object")),
        "{text}"
    );
    assert!(text.contains("is missing"), "{text}");
    assert!(
        text.contains(&format!("image {}", t.digests["reg:5000/lib/c:1"])),
        "{text}"
    );
    assert!(text.contains("ref \"dangling\""), "{text}");
    let v: Value =
        serde_json::from_slice(&cairn_raw(&t.root, &[os("--json"), os("fsck")]).stdout).unwrap();
    assert_eq!(v["clean"], false);
    assert!(v["problems"].as_array().unwrap().len() >= 7, "{v:#}");

    let out = cairn_raw(&t.root, &[os("fsck"), os("--repair")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("repair: removed object {flipped_name}")),
        "{text}"
    );
    assert!(text.contains("repair: removed ref \"dangling\""), "{text}");
    assert!(!flipped.exists());
    let text = stdout(&t.root, &["fsck"]);
    assert!(text.ends_with("clean\n"), "{text}");
    // All three images were broken: their names are gone, so a new import
    // of the same trees writes them again.
    assert_eq!(json(&t.root, &["images"]).as_array().unwrap().len(), 0);
    let again = mkfs_named(&t.root, &t.base.join("tree-1"), "a");
    assert_eq!(again, a);
    assert!(flipped.exists(), "the next import wrote the object again");
    assert!(stdout(&t.root, &["fsck"]).ends_with("clean\n"));
}

/// Four writers publish named images over and over while gc runs in a
/// loop; every name must afterwards point at an image whose every object
/// is there and sound.
#[test]
fn gc_racing_concurrent_mkfs_loses_nothing() {
    let dir = tempfile::Builder::new()
        .prefix("cairn-gc-race")
        .tempdir()
        .unwrap();
    let root = dir.path().join("store");
    const WRITERS: u64 = 4;
    const ROUNDS: u64 = 10;
    // Trees per writer and round, overlapping across writers and rounds so
    // gc keeps deleting objects the next writer is about to reuse.
    let mut trees = BTreeMap::new();
    for w in 0..WRITERS {
        for r in 0..ROUNDS {
            let t = dir.path().join(format!("t{w}-{r}"));
            let seeds: Vec<u64> = (0..12).map(|i| (w + r + i) % 20).collect();
            tree(&t, &seeds, w * 100 + r);
            trees.insert((w, r), t);
        }
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let gcs = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        let collector = s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = cairn_raw(&root, &[os("gc")]);
                assert!(
                    out.status.success(),
                    "gc failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                gcs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let trees = &trees;
                let root = &root;
                s.spawn(move || {
                    for r in 0..ROUNDS {
                        // Each round renames this writer's image to a new tree,
                        // leaving the previous one to gc.
                        mkfs_named(root, &trees[&(w, r)], &format!("w{w}"));
                        mkfs_named(root, &trees[&(w, r)], &format!("w{w}-r{r}"));
                        if r > 0 {
                            cairn(root, &[os("rm"), os(&format!("w{w}-r{}", r - 1))]);
                        }
                    }
                })
            })
            .collect();
        // Stop the collector whatever the writers did, then report.
        let results: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        collector.join().unwrap();
        for r in results {
            if let Err(panic) = r {
                std::panic::resume_unwind(panic);
            }
        }
    });
    assert!(
        gcs.load(std::sync::atomic::Ordering::Relaxed) >= 2,
        "gc ran during the writes"
    );
    let v = json(&root, &["fsck"]);
    assert_eq!(v["clean"], true, "{v:#}");
    for w in 0..WRITERS {
        let last = ROUNDS - 1;
        // Both names of the last round point at the last tree's image, and
        // its content reads back.
        let dump = stdout(&root, &["dump", &format!("w{w}")]);
        assert_eq!(dump, stdout(&root, &["dump", &format!("w{w}-r{last}")]));
        assert!(dump.contains(&format!("/f{} ", (w + last) % 20)), "{dump}");
    }
    // One more gc leaves exactly the named images.
    cairn(&root, &[os("gc")]);
    assert_eq!(image_files(&root).len(), WRITERS as usize);
    assert_eq!(json(&root, &["fsck"])["clean"], true);
}
