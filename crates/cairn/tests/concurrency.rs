//! Concurrency: several pulls of images that share layers, all at once,
//! with `cairn gc` running in a loop and `mkfs --store --name` writers
//! publishing meanwhile, lose nothing: afterwards every name is there,
//! `cairn fsck` is clean, every image dumps (and, as root, mounts and reads)
//! exactly as the same image pulled alone. And gc, started while a pull is
//! in flight, waits for it and takes nothing the pull uses, even layers no
//! ref reached when the pull began.
//!
//! The images (`support::images`): `a` = base+many, `b` = base+edits,
//! `c` = base+many+top, `d` = base+edits+top, from Debian's
//! `docker-registry` on 127.0.0.1 behind a throttling proxy, so that the
//! pulls overlap each other and the collector.

mod common;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::write_pattern;
use support::images::ImageSet;
use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::{assert_fsck_clean, assert_refs_complete, cairn_cmd, cairn_ok, cairn_out, listing};

const REPO: &str = "conc/img";
/// The images pulled at once, each under its tag as name.
const PULLED: [&str; 4] = ["a", "b", "c", "d"];
/// Rounds of concurrent pulls; between rounds some names are removed so
/// gc has shared layers to take while the next round starts.
const ROUNDS: usize = 6;
/// mkfs writers, and the trees each cycles through.
const WRITERS: u64 = 2;
const TREES: u64 = 4;

struct Fixture {
    _reg: LocalRegistry,
    proxy: SlowProxy,
    dir: tempfile::TempDir,
    /// A store with every image pulled alone (named by tag) and every
    /// writer tree made alone (named `t<w>-<r>`).
    reference: PathBuf,
    dumps: BTreeMap<String, String>,
    trees: BTreeMap<(u64, u64), PathBuf>,
}

impl Fixture {
    fn new(label: &str) -> Fixture {
        let set = ImageSet::get();
        let reg = LocalRegistry::start();
        set.push(&reg, REPO);
        let proxy = SlowProxy::start(&reg.addr, 16 * 1024);
        let dir = tempfile::Builder::new()
            .prefix(&format!("cairn-conc-{label}"))
            .tempdir()
            .unwrap();
        let reference = dir.path().join("reference");
        let mut dumps = BTreeMap::new();
        for tag in PULLED {
            cairn_ok(
                &reference,
                &[
                    "-q",
                    "pull",
                    "--name",
                    tag,
                    &format!("{}/{REPO}:{tag}", reg.addr),
                ],
            );
            dumps.insert(tag.to_string(), cairn_ok(&reference, &["dump", tag]));
        }
        let mut trees = BTreeMap::new();
        for w in 0..WRITERS {
            for r in 0..TREES {
                let t = dir.path().join(format!("tree{w}-{r}"));
                make_tree(&t, w, r);
                let name = format!("t{w}-{r}");
                cairn_ok(
                    &reference,
                    &[
                        "-q",
                        "mkfs",
                        "--store",
                        "--name",
                        &name,
                        t.to_str().unwrap(),
                    ],
                );
                dumps.insert(name.clone(), cairn_ok(&reference, &["dump", &name]));
                trees.insert((w, r), t);
            }
        }
        Fixture {
            _reg: reg,
            proxy,
            dir,
            reference,
            dumps,
            trees,
        }
    }

    fn slow_ref(&self, tag: &str) -> String {
        format!("{}/{REPO}:{tag}", self.proxy.addr)
    }
}

/// A tree of pattern files overlapping with the other writers' and rounds'
/// (so gc keeps removing objects a writer is about to reuse), plus one file
/// of its own.
fn make_tree(dir: &Path, w: u64, r: u64) {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    for i in 0..12 {
        let s = (w + r + i) % 20;
        write_pattern(&dir.join(format!("f{s}")), 1000 + s as usize * 37, s);
    }
    write_pattern(
        &dir.join("sub/own"),
        5000 + (w * 10 + r) as usize,
        1_000_000 + w * 10 + r,
    );
}

/// What the race left: the tree each writer named last.
struct Race {
    last_tree: BTreeMap<u64, u64>,
    gcs: u64,
    /// Images, layers and objects the concurrent gc runs removed.
    removed: [u64; 3],
    pulls: usize,
}

/// `ROUNDS` rounds of the four pulls at once (through the proxy, slowed so
/// they overlap), with gc in a loop and `WRITERS` mkfs writers throughout.
/// Between rounds two names are removed, so their layers (some shared with
/// the images still named) are garbage when the next round starts.
fn race(fx: &Fixture, root: &Path) -> Race {
    fx.proxy.set_delay(Duration::from_millis(2));
    let stop = AtomicBool::new(false);
    let gcs = AtomicU64::new(0);
    let (removed_images, removed_layers, removed_objects) =
        (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let last_tree = Mutex::new(BTreeMap::new());
    let mut pulls = 0;
    std::thread::scope(|s| {
        let collector = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let out = cairn_out(root, &["--json", "gc"]);
                assert!(
                    out.status.success(),
                    "gc failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                let n = |k: &str| v[k].as_array().map_or(0, Vec::len) as u64;
                removed_images.fetch_add(n("images"), Ordering::Relaxed);
                removed_layers.fetch_add(n("layers"), Ordering::Relaxed);
                removed_objects.fetch_add(v["objects"].as_u64().unwrap(), Ordering::Relaxed);
                gcs.fetch_add(1, Ordering::Relaxed);
            }
        });
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (stop, last_tree) = (&stop, &last_tree);
                s.spawn(move || {
                    let mut r = 0;
                    // At least one pass over the trees, then on until the
                    // pulls are done.
                    while r < TREES || !stop.load(Ordering::Relaxed) {
                        let t = fx.trees[&(w, r % TREES)].to_str().unwrap();
                        cairn_ok(
                            root,
                            &["-q", "mkfs", "--store", "--name", &format!("w{w}"), t],
                        );
                        last_tree.lock().unwrap().insert(w, r % TREES);
                        r += 1;
                    }
                })
            })
            .collect();
        for round in 0..ROUNDS {
            let handles: Vec<_> = PULLED
                .iter()
                .enumerate()
                .map(|(i, &tag)| {
                    s.spawn(move || {
                        // Staggered, so gc gets in between some of them.
                        let stagger = (i * 97 + round * 31) % 250;
                        std::thread::sleep(Duration::from_millis(stagger as u64));
                        let out =
                            cairn_out(root, &["-q", "pull", "--name", tag, &fx.slow_ref(tag)]);
                        assert!(
                            out.status.success(),
                            "round {round}: pull {tag} failed: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
                pulls += 1;
            }
            if round + 1 < ROUNDS {
                // Even rounds drop a and c (many and top are then reachable
                // by no name, base still is), odd rounds b and d (edits).
                let gone = if round % 2 == 0 {
                    ["a", "c"]
                } else {
                    ["b", "d"]
                };
                cairn_ok(root, &["rm", gone[0], gone[1]]);
                if round % 2 == 1 {
                    // Let one whole gc run first, so the next round fetches
                    // again what it took; after even rounds they race.
                    let seen = gcs.load(Ordering::Relaxed);
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while gcs.load(Ordering::Relaxed) < seen + 2
                        && !collector.is_finished()
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let results: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        collector.join().unwrap();
        for r in results {
            if let Err(p) = r {
                std::panic::resume_unwind(p);
            }
        }
    });
    fx.proxy.set_delay(Duration::ZERO);
    Race {
        last_tree: last_tree.into_inner().unwrap(),
        gcs: gcs.into_inner(),
        removed: [
            removed_images.into_inner(),
            removed_layers.into_inner(),
            removed_objects.into_inner(),
        ],
        pulls,
    }
}

/// Every name is there and complete, fsck is clean, every image dumps as
/// its reference; and so again after one more gc.
fn check_after_race(fx: &Fixture, root: &Path, race: &Race) {
    assert!(
        race.removed[1] > 0,
        "gc removed no layer during the race: {:?}",
        race.removed
    );
    assert!(
        race.gcs >= 2,
        "gc ran only {} times during the race",
        race.gcs
    );
    let mut want: BTreeSet<String> = PULLED.iter().map(|s| s.to_string()).collect();
    want.extend((0..WRITERS).map(|w| format!("w{w}")));
    for pass in ["after the race", "after a final gc"] {
        let refs = assert_refs_complete(root, pass);
        let names: BTreeSet<String> = refs.into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, want, "{pass}");
        assert_fsck_clean(root, pass);
        for tag in PULLED {
            assert_eq!(
                cairn_ok(root, &["dump", tag]),
                fx.dumps[tag],
                "{pass}: image {tag} differs from the same image pulled alone"
            );
        }
        for (w, r) in &race.last_tree {
            assert_eq!(
                cairn_ok(root, &["dump", &format!("w{w}")]),
                fx.dumps[&format!("t{w}-{r}")],
                "{pass}: writer {w}'s image differs from its tree {r}"
            );
        }
        cairn_ok(root, &["gc"]);
    }
    // Only what the names reach is left.
    assert_eq!(
        listing(root, "images")
            .iter()
            .filter(|n| !n.ends_with(".json"))
            .count(),
        PULLED.len() + WRITERS as usize
    );
}

#[test]
fn concurrent_pulls_of_shared_layers_with_gc_and_mkfs_lose_nothing() {
    let started = Instant::now();
    let fx = Fixture::new("race");
    let root = fx.dir.path().join("store");
    let race = race(&fx, &root);
    check_after_race(&fx, &root, &race);
    println!(
        "{} pulls in {ROUNDS} rounds of {}, {WRITERS} mkfs writers, {} gc runs meanwhile \
         (removing {} images, {} layers, {} objects): {:.1} s",
        race.pulls,
        PULLED.len(),
        race.gcs,
        race.removed[0],
        race.removed[1],
        race.removed[2],
        started.elapsed().as_secs_f64()
    );
}

/// The same race, then every image is mounted and must read back (content,
/// stat fields, xattrs, hardlinks) exactly as the image pulled or made
/// alone, mounted from the reference store.
#[test]
fn privileged_images_pulled_during_gc_mount_and_read_back() {
    common::require_root();
    let fx = Fixture::new("mount");
    let root = fx.dir.path().join("store");
    let race = race(&fx, &root);
    check_after_race(&fx, &root, &race);
    let mnt = fx.dir.path().join("mnt");
    let mut names: Vec<(String, String)> = PULLED
        .iter()
        .map(|t| (t.to_string(), t.to_string()))
        .collect();
    names.extend(
        race.last_tree
            .iter()
            .map(|(w, r)| (format!("w{w}"), format!("t{w}-{r}"))),
    );
    for (name, reference) in names {
        let ours = common::mount(
            &root,
            Path::new(&name),
            &mnt.join(format!("race-{name}")),
            &[],
        );
        let theirs = common::mount(
            &fx.reference,
            Path::new(&reference),
            &mnt.join(format!("ref-{name}")),
            &[],
        );
        let d = common::diff(
            &common::snapshot(&theirs.target),
            &common::snapshot(&ours.target),
        );
        assert!(
            d.is_empty(),
            "image {name} reads back differently:\n{}",
            d.join("\n")
        );
        let files = common::snapshot(&ours.target).entries.len();
        assert!(
            files > 10,
            "image {name} mounted almost empty ({files} entries)"
        );
    }
    // Mounts keep their images alive; unmounted, everything is still named.
    cairn_ok(&root, &["gc"]);
    assert_fsck_clean(&root, "after unmounting");
    assert!(common::mounts_under(fx.dir.path()).is_empty());
}

/// A pull holds the store lock from its first layer to its ref: gc started
/// meanwhile waits for it, then keeps everything the pulled image uses,
/// including the layers that were garbage (no ref reached them) when the
/// pull began and that it reused from the store instead of fetching.
#[test]
fn gc_started_during_a_pull_waits_and_takes_nothing_the_pull_uses() {
    let fx = Fixture::new("wait");
    let set = ImageSet::get();
    let root = fx.dir.path().join("store");
    // `a` (base+many) in, then unnamed: both layers are garbage now.
    cairn_ok(&root, &["-q", "pull", "--name", "a", &fx.slow_ref("a")]);
    cairn_ok(&root, &["rm", "a"]);
    let reused: Vec<&str> = set
        .image("a")
        .layers
        .iter()
        .map(|&i| set.layers[i].diff_id.as_str())
        .collect();

    // `c` = base+many+top: the first two come from the store, `top` (about
    // 330 KB) trickles in at 16 KB per 100 ms.
    fx.proxy.set_delay(Duration::from_millis(100));
    let mut pull = cairn_cmd(&root)
        .args(["pull", "--name", "c", &fx.slow_ref("c")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(pull.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line.starts_with("layer 3/3 ") && line.contains(" fetching ") {
            break;
        }
    }
    assert_eq!(
        seen.iter().filter(|l| l.ends_with(" cached")).count(),
        2,
        "base and many should come from the store: {seen:?}"
    );
    // The pull stays mid-layer, holding the store lock, until resumed.
    fx.proxy.pause();
    let drain = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());

    let gc_started = Instant::now();
    let mut gc = cairn_cmd(&root)
        .args(["--json", "gc"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // gc shows in /proc/locks as blocked on the store lock; had the pull not
    // held it, gc would have finished instead.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !cairn_store::flock_waiters(&root.join("lock")).contains(&gc.id()) {
        assert!(
            gc.try_wait().unwrap().is_none(),
            "gc finished while the pull was still running: the pull does not hold the store lock"
        );
        assert!(
            pull.try_wait().unwrap().is_none(),
            "the pull finished too soon for the test to mean anything"
        );
        assert!(
            Instant::now() < deadline,
            "gc never blocked on the store lock"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for d in &reused {
        assert!(
            root.join("layers").join(d).is_dir(),
            "layer {d} gone mid-pull"
        );
    }
    fx.proxy.set_delay(Duration::ZERO);
    fx.proxy.resume();
    let st = pull.wait().unwrap();
    let rest = drain.join().unwrap();
    assert!(st.success(), "pull failed: {seen:?} {rest:?}");
    let pull_done = gc_started.elapsed();
    let out = gc.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "gc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(gc_started.elapsed() >= pull_done);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let removed: Vec<&str> = report["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    for d in &reused {
        assert!(
            !removed.contains(d),
            "gc removed layer {d} the pull used: {report:#}"
        );
    }
    assert_eq!(report["kept_layers"], 3, "{report:#}");
    assert_fsck_clean(&root, "after the pull and gc");
    assert_eq!(cairn_ok(&root, &["dump", "c"]), fx.dumps["c"]);
}

/// The same, from inside: at every event of a pull after it resolved the
/// manifest (layers found in the store, layers started, progress, layers
/// done, assembling), another open of the store cannot take the lock
/// exclusive; once the pull has returned, it can.
#[test]
fn pull_holds_the_store_lock_at_every_step() {
    let set = ImageSet::get();
    let reg = LocalRegistry::start();
    set.push(&reg, REPO);
    let dir = tempfile::tempdir().unwrap();
    let store = cairn_store::Store::open(dir.path()).unwrap();
    let other = cairn_store::Store::open(dir.path()).unwrap();
    let opts = |name: &str| cairn_oci::PullOptions {
        client: cairn_oci::ClientOptions {
            auth_files: Vec::new(),
            ..cairn_oci::ClientOptions::default()
        },
        name: Some(name.to_string()),
        ..cairn_oci::PullOptions::default()
    };
    for tag in ["a", "c"] {
        let events = Mutex::new(Vec::new());
        let free = Mutex::new(Vec::new());
        let observer = |e: &cairn_oci::PullEvent<'_>| {
            let kind = format!("{e:?}")
                .split([' ', '(', '{'])
                .next()
                .unwrap_or("")
                .to_string();
            if matches!(e, cairn_oci::PullEvent::Resolved(_)) {
                return;
            }
            if other.try_lock_exclusive().unwrap().is_some() {
                free.lock().unwrap().push(kind.clone());
            }
            events.lock().unwrap().push(kind);
        };
        let r = cairn_oci::ImageRef::parse(&format!("{}/{REPO}:{tag}", reg.addr)).unwrap();
        cairn_oci::pull(&store, &r, &opts(tag), &observer).unwrap();
        let events = events.into_inner().unwrap();
        let free = free.into_inner().unwrap();
        assert!(
            free.is_empty(),
            "{tag}: the store lock was free at {free:?} (events {events:?})"
        );
        for want in ["LayerStart", "LayerDone", "Assembling"] {
            assert!(
                events.iter().any(|e| e == want),
                "{tag}: no {want} in {events:?}"
            );
        }
        if tag == "c" {
            assert!(events.iter().any(|e| e == "LayerCached"), "{events:?}");
        }
        // Retried briefly: a process another test forks at this moment holds
        // a copy of every open descriptor (lock files included) until it
        // reaches exec.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while other.try_lock_exclusive().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "{tag}: lock still held"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
