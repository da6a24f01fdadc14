//! A lazily pulled image, once `cairn fetch` has completed it, mounts and
//! reads exactly like the same image pulled whole: same entries, modes,
//! owners, symlinks and file contents. Mounts for real; fails loudly when
//! not run as root.

mod support;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use support::images::ImageSet;
use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::{cairn_ok, cairn_out};

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test mounts and must run as root (it is not skipped)"
    );
}

/// Unmounts on drop, so a failed assertion leaves nothing mounted.
struct Mounted {
    root: PathBuf,
    target: PathBuf,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let out = cairn_out(&self.root, &[Path::new("umount"), &self.target]);
        assert!(
            out.status.success() || std::thread::panicking(),
            "umount {}: {}",
            self.target.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn mount(root: &Path, image: &str, target: &Path) -> Mounted {
    fs::create_dir_all(target).unwrap();
    cairn_ok(root, &[Path::new("mount"), Path::new(image), target]);
    Mounted {
        root: root.to_path_buf(),
        target: target.to_path_buf(),
    }
}

/// Every entry below `dir`: type, mode, owner, size, and the contents of
/// files and targets of symlinks.
fn tree(dir: &Path) -> BTreeMap<PathBuf, (u32, u32, u32, u64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let m = fs::symlink_metadata(&p).unwrap();
            let data = if m.file_type().is_symlink() {
                fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if m.is_file() {
                fs::read(&p).unwrap()
            } else {
                Vec::new()
            };
            if m.is_dir() {
                stack.push(p.clone());
            }
            let size = if m.is_dir() { 0 } else { m.len() };
            out.insert(
                p.strip_prefix(dir).unwrap().to_path_buf(),
                (m.mode(), m.uid(), m.gid(), size, data),
            );
        }
    }
    out
}

#[test]
fn privileged_fetched_lazy_image_mounts_like_a_full_pull() {
    require_root();
    let reg = LocalRegistry::start();
    ImageSet::get().push(&reg, "lazy/set");
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let reference = reg.reference("lazy/set:full");
    cairn_ok(&a, &["pull", "-q", &reference]);
    cairn_ok(
        &a,
        &[
            "push",
            "-q",
            &reference,
            &reg.reference("lazy/set:full-lazy"),
            "--pack-size",
            "1M",
        ],
    );
    cairn_ok(&b, &["pull", "-q", "--lazy", &reference]);
    cairn_ok(&b, &["fetch", "-q", &reference]);

    let full = mount(&a, &reference, &dir.path().join("mnt-a"));
    let lazy = mount(&b, &reference, &dir.path().join("mnt-b"));
    let (ta, tb) = (tree(&full.target), tree(&lazy.target));
    assert!(ta.len() > 900, "{} entries", ta.len());
    assert_eq!(ta.len(), tb.len());
    for (path, want) in &ta {
        let got = tb
            .get(path)
            .unwrap_or_else(|| panic!("{} missing", path.display()));
        assert!(got == want, "{} differs", path.display());
    }
    drop(lazy);
    drop(full);
}

/// Objects in a store's `objects/`.
fn objects_in(root: &Path) -> usize {
    let mut n = 0;
    for fanout in fs::read_dir(root.join("objects")).unwrap() {
        n += fs::read_dir(fanout.unwrap().path()).unwrap().count();
    }
    n
}

/// The objects in the store at `root` once there are more than `than`
/// (waiting at most 20 s): an open is answered from the fetched, checked
/// staged file, and the publication into `objects/` follows it.
fn objects_beyond(root: &Path, than: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let n = objects_in(root);
        if n > than || std::time::Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Waits (at most 20 s) until no FUSE layer of the store at `root` is in
/// the mount table: a served layer is detached once its overlay stands on
/// it. (Other tests' layers, of other stores, may be there meanwhile.)
fn wait_for_no_lazy_mount(root: &Path) {
    let lazy = root.join("lazy");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let ours: Vec<&str> = mountinfo
            .lines()
            .filter(|l| l.contains("fuse.cairn") && l.contains(&*lazy.to_string_lossy()))
            .collect();
        if ours.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still mounted: {ours:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn process_exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn privileged_lazy_mount_fetches_on_first_read_and_its_server_goes_with_the_mount() {
    require_root();
    let reg = LocalRegistry::start();
    ImageSet::get().push(&reg, "lazy/ondemand");
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let reference = reg.reference("lazy/ondemand:full");
    cairn_ok(&a, &["pull", "-q", &reference]);
    cairn_ok(
        &a,
        &[
            "push",
            "-q",
            &reference,
            &reg.reference("lazy/ondemand:full-lazy"),
            "--pack-size",
            "1M",
        ],
    );
    cairn_ok(&b, &["pull", "-q", "--lazy", "--no-prefetch", &reference]);
    let target = dir.path().join("mnt-b");
    fs::create_dir_all(&target).unwrap();

    // Without --lazy an incomplete image is refused, and says what to do.
    let out = cairn_out(&b, &[Path::new("mount"), Path::new(&reference), &target]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mounted an incomplete image");
    assert!(
        err.contains("incomplete") && err.contains("--lazy"),
        "{err}"
    );

    // Nor does it run.
    let out = cairn_out(&b, &["run", &reference, "/bin/true"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ran an incomplete image");
    assert!(
        err.contains("incomplete") && err.contains("cairn fetch"),
        "{err}"
    );

    let before = objects_in(&b);
    let full = mount(&a, &reference, &dir.path().join("mnt-a"));
    let report = cairn_ok(
        &b,
        &[
            Path::new("mount"),
            Path::new("--json"),
            Path::new("--lazy"),
            Path::new("--lazy-fetch"),
            Path::new("on-demand"),
            Path::new(&reference),
            &target,
        ],
    );
    let lazy = Mounted {
        root: b.clone(),
        target: target.clone(),
    };
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    let pid = report["lazy_server"].as_i64().expect("a lazy server pid") as i32;
    assert!(process_exists(pid));
    // The FUSE layer is detached: only the overlay holds it.
    // (The server detaches it once told, just after `cairn mount` returns.)
    wait_for_no_lazy_mount(&b);

    // Reading every file fetches what was missing, into the store; the
    // tree is the full pull's.
    let (ta, tb) = (tree(&full.target), tree(&lazy.target));
    assert_eq!(ta.len(), tb.len());
    for (path, want) in &ta {
        let got = tb
            .get(path)
            .unwrap_or_else(|| panic!("{} missing", path.display()));
        assert!(got == want, "{} differs", path.display());
    }
    let after = objects_beyond(&b, before);
    assert!(
        after > before,
        "no object was fetched ({before} before, {after} after)"
    );
    // A second read is served from the store (through passthrough): the
    // same again.
    assert_eq!(tree(&lazy.target), tb);

    // Unmounting the overlay ends the server, and nothing is left behind.
    drop(lazy);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while process_exists(pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        !process_exists(pid),
        "the lazy server {pid} is still running"
    );
    let left: Vec<_> = fs::read_dir(b.join("lazy"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in lazy/: {left:?}");
    drop(full);
}

fn sha256_hex(d: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(d)))
}

/// Pushes a two-layer image that can run (Debian's static busybox) and
/// holds data files, some of which the test never reads; returns its
/// reference.
fn push_runnable(reg: &LocalRegistry, repo: &str) -> String {
    push_runnable_with(reg, repo, &[])
}

/// [`push_runnable`], with `extra` files (path, contents) in its base
/// layer (their directories must be `etc` or made by the base layer).
fn push_runnable_with(reg: &LocalRegistry, repo: &str, extra: &[(&str, Vec<u8>)]) -> String {
    use support::images::{random_bytes, text, Tar};
    let gzip = |tar: Vec<u8>| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        let blob = gz.finish().unwrap();
        (sha256_hex(&blob), sha256_hex(&tar), blob)
    };
    let mut t = Tar::default();
    t.dir("busybox").file_mode(
        "busybox/busybox",
        &fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)"),
        0o755,
    );
    t.dir("tmp");
    if !extra.is_empty() {
        t.dir("etc");
    }
    for (path, data) in extra {
        t.file(path, data);
    }
    let base = gzip(t.finish());
    let mut t = Tar::default();
    t.dir("data")
        .file("data/read-me.txt", &text(5_000, 1))
        .file("data/read-me.bin", &random_bytes(300_000, 2))
        .file("data/never-read.bin", &random_bytes(2_000_000, 3));
    for i in 0..40u64 {
        t.file(
            &format!("data/unread-{i:02}.txt"),
            &text(2_000 + i as usize, 100 + i),
        );
    }
    let data = gzip(t.finish());
    let layers = [base, data];
    for (d, _, b) in &layers {
        assert_eq!(&reg.push_blob(repo, b), d);
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/busybox"]},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.1.clone()).collect::<Vec<_>>()},
    }))
    .unwrap();
    let cd = reg.push_blob(repo, &config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
        "layers": layers.iter().map(|(d, _, b)| serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": b.len()})).collect::<Vec<_>>(),
    }))
    .unwrap();
    reg.push_manifest(
        repo,
        "1",
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    );
    reg.reference(&format!("{repo}:1"))
}

#[test]
fn privileged_lazy_run_prints_what_a_full_pull_prints_and_fetches_only_what_it_reads() {
    require_root();
    let reg = LocalRegistry::start();
    let reference = push_runnable(&reg, "lazy/run");
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy-run")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    cairn_ok(&a, &["pull", "-q", &reference]);
    cairn_ok(
        &a,
        &["push", "-q", &reference, &reg.reference("lazy/run:1-lazy")],
    );
    cairn_ok(&b, &["pull", "-q", "--lazy", "--no-prefetch", &reference]);
    let command = [
        "/busybox/busybox",
        "sha256sum",
        "/data/read-me.txt",
        "/data/read-me.bin",
    ];
    let mut full_args = vec!["run", reference.as_str()];
    full_args.extend(command);
    let full = cairn_ok(&a, &full_args);
    let total = objects_in(&a);
    let mut lazy_args = vec![
        "run",
        "--lazy",
        "--lazy-fetch",
        "on-demand",
        "--coalesce",
        "0",
        reference.as_str(),
    ];
    lazy_args.extend(command);
    let lazy = cairn_ok(&b, &lazy_args);
    assert_eq!(lazy, full);
    assert!(full.contains("/data/read-me.bin"), "{full}");
    // The server goes when the container's rootfs does (once it has
    // stored what was read chunk by chunk: busybox is over 1 MiB).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let left: Vec<_> = fs::read_dir(b.join("lazy"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "left in lazy/: {left:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    wait_for_no_lazy_mount(&b);
    // What ran was fetched (busybox and the two files), not the rest.
    let fetched = objects_in(&b);
    assert!(
        (3..total).contains(&fetched),
        "{fetched} of {total} objects fetched"
    );
}

/// A store with `push_runnable`'s image pulled whole into `a` and pushed
/// as an artifact, and pulled lazily (no prefetch) into `b` through
/// `via` (the registry itself, or a proxy in front of it).
struct Lazy {
    dir: tempfile::TempDir,
    a: PathBuf,
    b: PathBuf,
    /// The reference `b` pulled.
    reference: String,
}

fn lazy_setup(reg: &LocalRegistry, repo: &str, via: Option<&str>) -> Lazy {
    let reference = push_runnable(reg, repo);
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy-fetch")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    cairn_ok(&a, &["pull", "-q", &reference]);
    cairn_ok(
        &a,
        &[
            "push",
            "-q",
            &reference,
            &reg.reference(&format!("{repo}:1-lazy")),
        ],
    );
    let reference = match via {
        Some(addr) => format!("{addr}/{repo}:1"),
        None => reference,
    };
    cairn_ok(&b, &["pull", "-q", "--lazy", "--no-prefetch", &reference]);
    Lazy {
        dir,
        a,
        b,
        reference,
    }
}

fn lazy_mount(l: &Lazy, name: &str, extra: &[&str]) -> Mounted {
    let target = l.dir.path().join(name);
    fs::create_dir_all(&target).unwrap();
    let mut args: Vec<&Path> = vec![Path::new("mount"), Path::new("--lazy")];
    args.extend(extra.iter().map(Path::new));
    args.push(Path::new(&l.reference));
    args.push(&target);
    cairn_ok(&l.b, &args);
    Mounted {
        root: l.b.clone(),
        target,
    }
}

#[test]
fn privileged_lazy_open_fetches_its_neighbours_in_one_go() {
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/neighbours", None);
    let full = mount(&l.a, &l.reference, &l.dir.path().join("mnt-a"));

    // --coalesce 0: an open fetches its own object and nothing else.
    let alone = lazy_mount(
        &l,
        "alone",
        &["--lazy-fetch", "on-demand", "--coalesce", "0"],
    );
    let before = objects_in(&l.b);
    let file = "data/unread-05.txt";
    assert_eq!(
        fs::read(alone.target.join(file)).unwrap(),
        fs::read(full.target.join(file)).unwrap()
    );
    assert_eq!(
        objects_beyond(&l.b, before),
        before + 1,
        "--coalesce 0 fetched more"
    );
    drop(alone);

    // The default (1 MiB): the objects after it in its pack come along,
    // each checked, and later opens of them are served from the store.
    let near = lazy_mount(&l, "near", &["--lazy-fetch", "on-demand"]);
    let before = objects_in(&l.b);
    let file = "data/unread-20.txt";
    assert_eq!(
        fs::read(near.target.join(file)).unwrap(),
        fs::read(full.target.join(file)).unwrap()
    );
    let after = objects_beyond(&l.b, before + 1);
    assert!(
        after > before + 1,
        "one open fetched {} objects, no neighbours",
        after - before
    );
    // Everything reads as the full pull's, and nothing fetched is wrong.
    let (ta, tb) = (tree(&full.target), tree(&near.target));
    assert!(ta == tb, "the lazy tree differs from the full pull's");
    drop(near);
    support::assert_fsck_clean(&l.b, "after fetching with neighbours");
    drop(full);
}

#[test]
fn privileged_lazy_mount_fetches_the_rest_in_the_background_and_completes_the_image() {
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/background", None);
    let total = objects_in(&l.a);
    assert_eq!(objects_in(&l.b), 0);
    // Nothing is read: the server fetches the whole image by itself.
    let lazy = lazy_mount(&l, "mnt-b", &[]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let lazy_indexes = |root: &Path| {
        fs::read_dir(root.join("images"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".lazy-index")
            })
            .count()
    };
    while lazy_indexes(&l.b) != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the background fetch did not complete the image: {} of {total} objects local",
            objects_in(&l.b)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(objects_in(&l.b), total);
    // Complete: it mounts from the store without --lazy, and both mounts
    // read as the full pull.
    let full = mount(&l.a, &l.reference, &l.dir.path().join("mnt-a"));
    let plain = mount(&l.b, &l.reference, &l.dir.path().join("mnt-plain"));
    let ta = tree(&full.target);
    assert!(ta == tree(&plain.target), "the completed image differs");
    assert!(ta == tree(&lazy.target), "the lazy mount differs");
    drop(plain);
    drop(lazy);
    support::assert_fsck_clean(&l.b, "after the background fetch");
    drop(full);
}

#[test]
fn privileged_lazy_read_fails_with_eio_while_the_registry_stalls_and_works_after() {
    require_root();
    let reg = LocalRegistry::start();
    let proxy = SlowProxy::start(&reg.addr, 16 << 10);
    let l = lazy_setup(&reg, "lazy/stall", Some(&proxy.addr));
    let full = mount(
        &l.a,
        &l.reference.replace(&proxy.addr, &reg.addr),
        &l.dir.path().join("mnt-a"),
    );
    let lazy = lazy_mount(
        &l,
        "mnt-b",
        &[
            "--lazy-fetch",
            "on-demand",
            "--coalesce",
            "0",
            "--fetch-timeout",
            "2s",
        ],
    );
    let (local, missing) = ("data/read-me.txt", "data/unread-07.txt");
    let want_local = fs::read(full.target.join(local)).unwrap();
    let want_missing = fs::read(full.target.join(missing)).unwrap();
    assert_eq!(fs::read(lazy.target.join(local)).unwrap(), want_local);

    proxy.pause();
    let start = std::time::Instant::now();
    let err = fs::read(lazy.target.join(missing))
        .expect_err("read missing data through a stalled registry");
    let took = start.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        took >= std::time::Duration::from_millis(1500) && took < std::time::Duration::from_secs(10),
        "the read failed after {took:?}, not about 2s"
    );
    // Local data is served meanwhile.
    assert_eq!(fs::read(lazy.target.join(local)).unwrap(), want_local);

    proxy.resume();
    assert_eq!(fs::read(lazy.target.join(missing)).unwrap(), want_missing);
    drop(lazy);
    drop(full);
}

#[test]
fn privileged_lazy_run_records_the_files_it_opened_for_push_prefetch() {
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/record", None);
    let list = l.dir.path().join("prefetch.txt");
    let list_arg = list.to_str().unwrap();
    let out = cairn_ok(
        &l.b,
        &[
            "run",
            "--lazy",
            "--lazy-fetch",
            "on-demand",
            "--record-prefetch",
            list_arg,
            &l.reference,
            "/busybox/busybox",
            "sh",
            "-c",
            // 4 KiB of the second 1 MiB chunk of a 2 MB file
            "cat /data/read-me.txt && \
             dd if=/data/never-read.bin bs=4096 skip=300 count=1 status=none | wc -c",
        ],
    );
    assert!(out.trim_end().ends_with("4096"), "{out}");
    // Written by the server when the container's rootfs goes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !list.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no prefetch list written"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let text = fs::read_to_string(&list).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // busybox (2 MB, two chunks) is executed: a chunk list if it was not
    // read whole; the large file read in part names the chunk read.
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0] == "/busybox/busybox" || lines[0].starts_with("/busybox/busybox\tchunks="),
        "{text}"
    );
    assert_eq!(
        lines[1..],
        ["/data/read-me.txt", "/data/never-read.bin\tchunks=1"],
        "{text}"
    );
    // push --prefetch takes it: the artifact lists those objects first,
    // the large file's chunk as a chunk (a v2 list).
    let target = reg.reference("lazy/record:1-prefetch");
    cairn_ok(
        &l.a,
        &["push", "-q", "--prefetch", list_arg, &l.reference, &target],
    );
    let c = l.dir.path().join("c");
    let pulled: serde_json::Value = serde_json::from_str(&cairn_ok(
        &c,
        &["--json", "pull", "--lazy", "--no-prefetch", &target],
    ))
    .unwrap();
    let store = cairn_store::Store::open(&c).unwrap();
    let client = cairn_oci::ClientOptions {
        auth_files: Vec::new(),
        ..cairn_oci::ClientOptions::default()
    };
    let remote = cairn_remote::RemoteObjects::open(
        &store,
        pulled["image_digest"].as_str().unwrap(),
        &client,
    )
    .unwrap();
    let entries = remote.prefetch_entries().unwrap();
    assert_eq!(entries.len(), 3, "{entries:?}");
    assert_eq!(entries[2].chunks, Some(vec![1]), "{entries:?}");
}

/// A v2 list entry for a large file read in part (`never-read.bin`, 2 MB,
/// two chunks; the list names chunk 1): `pull --lazy` leaves it out; an
/// on-demand lazy mount's server fetches that chunk alone (one range
/// request, and no other after it: no read-behind) into the object's
/// partial; a read in it is then answered with no request, a read of
/// chunk 0 makes one, both right; with both chunks in, the object is
/// stored (checked whole) and fsck is clean; the list itself is fetched
/// once. Counted through a proxy that records blob requests.
#[test]
fn privileged_lazy_list_chunks_are_fetched_alone_and_read_without_a_fetch() {
    use std::os::unix::fs::FileExt;
    require_root();
    let reg = LocalRegistry::start();
    let reference = push_runnable(&reg, "lazy/pchunks");
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy-pchunks")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    cairn_ok(&a, &["pull", "-q", &reference]);
    let list = dir.path().join("list");
    fs::write(&list, "/data/read-me.txt\n/data/never-read.bin\tchunks=1\n").unwrap();
    cairn_ok(
        &a,
        &[
            "push",
            "-q",
            "--prefetch",
            list.to_str().unwrap(),
            &reference,
            &reg.reference("lazy/pchunks:1-lazy"),
        ],
    );
    let proxy = support::range_proxy::RangeProxy::start(&reg.addr, std::time::Duration::ZERO);
    let via = format!("{}/lazy/pchunks:1", proxy.addr);
    let pulled: serde_json::Value =
        serde_json::from_str(&cairn_ok(&b, &["--json", "pull", "--lazy", &via])).unwrap();
    assert_eq!(pulled["prefetched"], 1, "{pulled:#}");
    let big = support::images::random_bytes(2_000_000, 3);
    let id = cairn_store::fsverity_digest(&big[..]).unwrap();
    let store = cairn_store::Store::open(&b).unwrap();
    assert!(
        !store.has_object(&id),
        "the pull fetched the chunk entry's object"
    );

    let ranges = || proxy.blob_ranges().len();
    let before = ranges();
    let gets_before = proxy.blob_gets().len();
    let target = dir.path().join("mnt");
    let _mounted = mount_on_demand(&b, &via, &target);
    // The list phase: chunk 1's one range request.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while ranges() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "the server fetched no chunk; logs: {}",
            lazy_logs(&b)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        ranges(),
        before + 1,
        "{:?}; logs: {}",
        proxy.blob_ranges(),
        lazy_logs(&b)
    );
    // The mount and its server asked for each whole blob (the index, the
    // list) once: the server's two readers of the list at start (its
    // chunk entries at once, then the list phase) share one fetch.
    let gets = proxy.blob_gets()[gets_before..].to_vec();
    let distinct: std::collections::BTreeSet<&String> = gets.iter().collect();
    assert_eq!(distinct.len(), gets.len(), "a blob fetched twice: {gets:?}");
    let f = fs::File::open(target.join("data/never-read.bin")).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 1_200_000).unwrap();
    assert!(buf == big[1_200_000..1_204_096], "wrong bytes in chunk 1");
    assert_eq!(ranges(), before + 1, "a read of the listed chunk fetched");
    assert!(!store.has_object(&id), "a partial object was stored");
    f.read_exact_at(&mut buf, 1000).unwrap();
    assert!(buf == big[1000..5096], "wrong bytes in chunk 0");
    assert_eq!(ranges(), before + 2, "{:?}", proxy.blob_ranges());
    // Both chunks in: checked whole and stored.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !store.has_object(&id) {
        assert!(
            std::time::Instant::now() < deadline,
            "never stored; logs: {}",
            lazy_logs(&b)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut all = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut all).unwrap();
    assert!(all == big, "the whole file reads wrong");
    drop(f);
    drop(_mounted);
    let out = cairn_out(&b, &["fsck"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The same through a foreground `cairn run`, which tells its server
    // that the overlay is attached only when the container has exited:
    // the server starts the chunk entries at once, so the container's
    // read of chunk 1 fetches nothing more, and chunk 0 never moves.
    let client = cairn_oci::ClientOptions {
        auth_files: Vec::new(),
        ..cairn_oci::ClientOptions::default()
    };
    let digest = pulled["image_digest"].as_str().unwrap();
    let c = dir.path().join("c");
    cairn_ok(&c, &["pull", "-q", "--lazy", &via]);
    let frames =
        cairn_remote::RemoteObjects::open(&cairn_store::Store::open(&c).unwrap(), digest, &client)
            .unwrap()
            .entry(&id)
            .unwrap()
            .frames;
    let chunk_requests = |k: usize| {
        let start = format!("bytes={}-", frames[k].offset);
        proxy
            .blob_ranges()
            .iter()
            .filter(|(_, r)| r.starts_with(&start))
            .count()
    };
    let (c0, c1) = (chunk_requests(0), chunk_requests(1));
    let out = cairn_ok(
        &c,
        &[
            "run",
            "--lazy",
            "--lazy-fetch",
            "on-demand",
            &via,
            "/busybox/busybox",
            "sh",
            "-c",
            "sleep 1; dd if=/data/never-read.bin bs=4096 skip=300 count=1 status=none | wc -c",
        ],
    );
    assert!(out.trim_end().ends_with("4096"), "{out}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !lazy_servers(&c).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the lazy server stays"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        (chunk_requests(0) - c0, chunk_requests(1) - c1),
        (0, 1),
        "{:?}; logs: {}",
        proxy.blob_ranges(),
        lazy_logs(&c)
    );
    assert!(!cairn_store::Store::open(&c).unwrap().has_object(&id));
}

/// The lazy servers of the store at `root`, as `cairn lazy list --json`
/// shows them.
fn lazy_servers(root: &Path) -> Vec<serde_json::Value> {
    let out = cairn_ok(root, &["lazy", "list", "--json"]);
    serde_json::from_str::<serde_json::Value>(&out)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// Waits (at most 20 s) until the store's only lazy server satisfies `f`.
fn wait_for_server(
    root: &Path,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let list = lazy_servers(root);
        if list.len() == 1 && f(&list[0]) {
            return list[0].clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no lazy server {what}: {list:?}; logs: {}",
            lazy_logs(root)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
/// `cairn mount --lazy --lazy-fetch on-demand REFERENCE TARGET` in the
/// store at `root` (TARGET made first), unmounted when the result drops.
fn mount_on_demand(root: &Path, reference: &str, target: &Path) -> Mounted {
    fs::create_dir_all(target).unwrap();
    cairn_ok(
        root,
        &[
            Path::new("mount"),
            Path::new("--lazy"),
            Path::new("--lazy-fetch"),
            Path::new("on-demand"),
            Path::new(reference),
            target,
        ],
    );
    Mounted {
        root: root.to_path_buf(),
        target: target.to_path_buf(),
    }
}

/// The lazy servers' logs left in the store at `root`, for a failure's
/// message.
fn lazy_logs(root: &Path) -> String {
    let mut out = String::new();
    for e in fs::read_dir(root.join("lazy"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.path().extension().is_some_and(|x| x == "log") {
            out.push_str(&format!(
                "\n{}:\n{}",
                e.path().display(),
                fs::read_to_string(e.path()).unwrap_or_default()
            ));
        }
    }
    out
}

/// How a test ends the serving worker mid-run.
#[derive(Clone, Copy, Debug)]
enum Interrupt {
    /// SIGKILL: no chance to hand anything over.
    Kill,
    /// `cairn lazy restart` after the binary the mount was started from
    /// was replaced (an upgrade): the successor runs the new one.
    Upgrade,
}

/// `cairn run --lazy` of a loop that reads the 40 small files of the image
/// (missing, so each is fetched on its open) with a pause between them,
/// then all of them again (local now). Mid-way the worker serving the
/// layer is ended (`how`); the run's output must be the full pull's, the
/// successor must serve the rest, gc meanwhile must keep what the mount
/// published and the incomplete image, and at the end nothing is left:
/// no server process, no mount, nothing in lazy/.
fn run_through_a_worker_restart(l: &Lazy, store: &Path, how: Interrupt, full_out: &str) {
    use std::io::BufRead;
    let script = script();
    // An upgrade replaces the binary the mount was started from: a copy.
    let exe = l.dir.path().join("bin/cairn");
    fs::create_dir_all(exe.parent().unwrap()).unwrap();
    fs::copy(env!("CARGO_BIN_EXE_cairn"), &exe).unwrap();
    let like = support::cairn_cmd(store);
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(like.get_args());
    for (k, v) in like.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.args([
        "run",
        "--lazy",
        "--lazy-fetch",
        "on-demand",
        "--coalesce",
        "0",
        &l.reference,
        "/busybox/busybox",
        "sh",
        "-c",
        &script,
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    // The copy was just written: another test thread's fork may still hold
    // its write descriptor for a moment (until that child execs), and
    // exec refuses a file open for writing (ETXTBSY). Retry briefly.
    let mut tries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => break r.unwrap(),
        }
    };
    let stdout = child.stdout.take().unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(stdout).lines() {
                lines.lock().unwrap().push(l.unwrap());
            }
        })
    };
    // Wait until the container has read a few files.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while lines.lock().unwrap().len() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the container read nothing"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let server = wait_for_server(store, "serving", |s| s["restarts"] == 0);
    let (supervisor, worker) = (
        server["supervisor"].as_i64().unwrap() as i32,
        server["worker"].as_i64().unwrap() as i32,
    );
    let before = objects_in(store);
    match how {
        Interrupt::Kill => rustix::process::kill_process(
            rustix::process::Pid::from_raw(worker).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap(),
        Interrupt::Upgrade => {
            let new = exe.with_extension("new");
            fs::copy(env!("CARGO_BIN_EXE_cairn"), &new).unwrap();
            fs::rename(&new, &exe).unwrap();
            let out = cairn_ok(
                store,
                &["lazy", "restart", server["name"].as_str().unwrap()],
            );
            assert!(out.contains("restarted"), "{out}");
        }
    }
    let read_at_interrupt = lines.lock().unwrap().len();
    assert!(
        read_at_interrupt < 60,
        "the container had read {read_at_interrupt} files already: not mid-way"
    );
    let successor = wait_for_server(store, "restarted", |s| s["restarts"] == 1);
    assert_eq!(successor["supervisor"], supervisor);
    assert_ne!(successor["worker"], worker);
    assert!(!process_exists(worker), "the old worker {worker} lives on");
    // The successor runs the binary now at the path the mount was started
    // from (after an upgrade: the new file; the supervisor still runs the
    // old, replaced one).
    let successor_exe = fs::read_link(format!("/proc/{}/exe", successor["worker"])).unwrap();
    assert_eq!(
        successor_exe, exe,
        "{how:?}: the successor runs {successor_exe:?}"
    );
    if let Interrupt::Upgrade = how {
        let supervisor_exe = fs::read_link(format!("/proc/{supervisor}/exe")).unwrap();
        assert!(
            supervisor_exe.to_string_lossy().ends_with(" (deleted)"),
            "{supervisor_exe:?}"
        );
        // With no binary at the path any more, the successor is a fork of
        // the supervisor (its old code), and serves all the same.
        fs::remove_file(&exe).unwrap();
        cairn_ok(
            store,
            &["lazy", "restart", successor["name"].as_str().unwrap()],
        );
        // (The worker that failed to exec is listed for a moment.)
        wait_for_server(store, "restarted again as a fork", |s| {
            s["restarts"] == 2
                && fs::read_link(format!("/proc/{}/exe", s["worker"]))
                    .ok()
                    .as_ref()
                    == Some(&supervisor_exe)
        });
    }

    // gc while mounted keeps the incomplete image and what the mount
    // published.
    cairn_ok(store, &["gc"]);
    assert!(objects_in(store) >= before, "gc removed fetched objects");
    cairn_ok(store, &["inspect", &l.reference]);

    let status = child.wait().unwrap();
    reader.join().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "cairn run --lazy: {status}: {stderr}");
    let got = lines.lock().unwrap().join("\n") + "\n";
    assert_eq!(
        got, full_out,
        "{how:?}: the output differs from the full pull's"
    );
    // The successor fetched the files read after the interrupt.
    assert!(
        objects_beyond(store, before) > before,
        "{how:?}: nothing was fetched after the worker was ended"
    );

    // The server goes with the container, and leaves nothing.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while process_exists(supervisor) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        !process_exists(supervisor),
        "the supervisor {supervisor} is still running"
    );
    let left: Vec<_> = fs::read_dir(store.join("lazy"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{how:?}: left in lazy/: {left:?}");
    wait_for_no_lazy_mount(store);
    assert!(lazy_servers(store).is_empty());
}

/// The container's loop: each small file once with a pause (fetched on
/// open), then each again (local).
fn script() -> String {
    let mut s = String::new();
    for pass in [1, 2] {
        s.push_str("for i in");
        for i in 0..40 {
            s.push_str(&format!(" {i:02}"));
        }
        s.push_str("; do /busybox/busybox sha256sum /data/unread-$i.txt || exit 1;");
        if pass == 1 {
            s.push_str(" /busybox/busybox usleep 100000;");
        }
        s.push_str(" done; ");
    }
    s.push_str("/busybox/busybox sha256sum /data/read-me.bin");
    s
}

#[test]
fn privileged_lazy_run_reads_on_when_its_server_is_killed_or_upgraded() {
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/restart", None);
    let script = script();
    let full = cairn_ok(
        &l.a,
        &["run", &l.reference, "/busybox/busybox", "sh", "-c", &script],
    );
    assert_eq!(full.lines().count(), 81, "{full}");
    run_through_a_worker_restart(&l, &l.b, Interrupt::Kill, &full);
    // A second store, pulled lazily afresh, for a requested restart.
    let c = l.dir.path().join("c");
    cairn_ok(&c, &["pull", "-q", "--lazy", "--no-prefetch", &l.reference]);
    run_through_a_worker_restart(&l, &c, Interrupt::Upgrade, &full);
    support::assert_fsck_clean(&l.b, "after the killed server");
    support::assert_fsck_clean(&c, "after the restarted server");
}

/// `cairn mount --lazy` (the layer detached, the overlay alone holding
/// it): an open waits for a fetch that cannot finish (the registry is
/// paused) when the worker is killed; the successor answers that open
/// once the registry is back, the data read is right, files opened before
/// read on, and unmounting ends the server and leaves nothing.
#[test]
fn privileged_lazy_mount_answers_an_open_its_killed_server_left_waiting() {
    require_root();
    let reg = LocalRegistry::start();
    let proxy = SlowProxy::start(&reg.addr, 64 << 10);
    let l = lazy_setup(&reg, "lazy/killed", Some(&proxy.addr));
    let full = mount(
        &l.a,
        &l.reference.replace(&proxy.addr, &reg.addr),
        &l.dir.path().join("mnt-a"),
    );
    let lazy = lazy_mount(
        &l,
        "mnt-b",
        &[
            "--lazy-fetch",
            "on-demand",
            "--coalesce",
            "0",
            "--fetch-timeout",
            "60s",
        ],
    );
    wait_for_no_lazy_mount(&l.b);
    let (early, missing) = ("data/read-me.bin", "data/unread-11.txt");
    let want_early = fs::read(full.target.join(early)).unwrap();
    let want_missing = fs::read(full.target.join(missing)).unwrap();
    // Open before the kill, read after it.
    let mut held = fs::File::open(lazy.target.join(early)).unwrap();
    let server = wait_for_server(&l.b, "serving", |s| s["restarts"] == 0);
    let worker = server["worker"].as_i64().unwrap() as i32;

    proxy.pause();
    let (tx, rx) = std::sync::mpsc::channel();
    let path = lazy.target.join(missing);
    let reader = std::thread::spawn(move || {
        let _ = tx.send(fs::read(path));
    });
    // The open is waiting for its fetch.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        rx.try_recv().is_err(),
        "the read did not wait for the registry"
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(worker).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let successor = wait_for_server(&l.b, "restarted", |s| s["restarts"] == 1);
    assert_ne!(successor["worker"], server["worker"]);
    proxy.resume();
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the open left waiting was never answered")
        .expect("reading through the successor");
    reader.join().unwrap();
    assert!(got == want_missing, "{missing} differs");
    let logs = lazy_logs(&l.b);
    assert!(
        logs.contains("requests a killed predecessor left"),
        "the successor answered no request left: {logs}"
    );
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut held, &mut bytes).unwrap();
    assert!(bytes == want_early, "{early} differs");
    drop(held);
    // Everything reads as the full pull.
    let (ta, tb) = (tree(&full.target), tree(&lazy.target));
    assert!(ta == tb, "the trees differ");

    let supervisor = server["supervisor"].as_i64().unwrap() as i32;
    drop(lazy);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while process_exists(supervisor) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        !process_exists(supervisor),
        "the supervisor {supervisor} is still running"
    );
    let left: Vec<_> = fs::read_dir(l.b.join("lazy"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in lazy/: {left:?}");
    drop(full);
}

/// A worker that dies again and again right after its start is not
/// restarted forever: the successors come slower and slower, and after 8
/// quick deaths in a row the supervisor gives up, says so in its log, and
/// the layer's connection ends (opens of missing files then fail); the
/// overlay still unmounts.
#[test]
fn privileged_lazy_server_crash_loop_backs_off_and_gives_up() {
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/crashloop", None);
    let lazy = lazy_mount(&l, "mnt-b", &["--lazy-fetch", "on-demand"]);
    let start = std::time::Instant::now();
    let mut gaps = Vec::new();
    let mut last = wait_for_server(&l.b, "serving", |_| true);
    let supervisor = last["supervisor"].as_i64().unwrap() as i32;
    loop {
        let worker = last["worker"].as_i64().unwrap() as i32;
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(worker).unwrap(),
            rustix::process::Signal::KILL,
        );
        let killed = std::time::Instant::now();
        // The next worker, or the end.
        let deadline = killed + std::time::Duration::from_secs(30);
        let next = loop {
            let list = lazy_servers(&l.b);
            // The end is the supervisor's exit: a listing can miss the
            // status file while the supervisor renames a new one over it
            // (readdir on tmpfs during a rename).
            if list.is_empty() && !process_exists(supervisor) {
                break None;
            }
            if list.is_empty() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no status file, the supervisor {supervisor} alive"
                );
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            if list[0]["worker"].as_i64() != Some(worker as i64) {
                break Some(list[0].clone());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no successor: {list:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        match next {
            Some(n) => {
                gaps.push(killed.elapsed());
                last = n;
            }
            None => break,
        }
    }
    assert_eq!(gaps.len(), 8, "{gaps:?}; logs: {}", lazy_logs(&l.b));
    // Backing off: the last successors came later than the first.
    assert!(
        gaps[7] >= std::time::Duration::from_millis(1500) && gaps[7] > gaps[1] * 4,
        "{gaps:?}"
    );
    assert!(start.elapsed() < std::time::Duration::from_secs(60));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while process_exists(supervisor) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!process_exists(supervisor));
    let logs = lazy_logs(&l.b);
    assert!(logs.contains("giving up"), "{logs}");
    let err = fs::read(lazy.target.join("data/unread-03.txt")).expect_err("read after the end");
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");
    drop(lazy);
}

/// Sends SIGCONT to its processes when dropped: a failed assertion does
/// not leave a lazy server stopped under a mount.
struct Stopped(Vec<i32>);

impl Stopped {
    fn stop(pids: Vec<i32>) -> Stopped {
        for &p in &pids {
            rustix::process::kill_process(
                rustix::process::Pid::from_raw(p).expect("a pid"),
                rustix::process::Signal::STOP,
            )
            .unwrap_or_else(|e| panic!("SIGSTOP {p}: {e}"));
        }
        Stopped(pids)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for &p in &self.0 {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(p).expect("a pid"),
                rustix::process::Signal::CONT,
            );
        }
    }
}

/// Reads `path` on a thread of its own; the answer comes on the channel.
fn read_on_a_thread(path: PathBuf) -> std::sync::mpsc::Receiver<std::io::Result<Vec<u8>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(fs::read(&path));
    });
    rx
}

/// A file the store already has is read from the store by the kernel
/// alone: the store's objects/ is the first data-only layer of a lazy
/// mount and the lazy layer the second. With the lazy server stopped
/// (SIGSTOP, so it answers nothing), a fresh mount still reads a file an
/// earlier mount fetched, at once; an open of a missing file waits for the
/// server and completes once it runs again.
#[test]
fn privileged_lazy_mount_reads_local_files_without_its_server() {
    use support::images::text;
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/local-first", None);
    let (local, missing) = ("data/read-me.txt", "data/unread-05.txt");
    {
        // Alone (no neighbours), so that `missing` stays missing.
        let m = lazy_mount(
            &l,
            "first",
            &["--lazy-fetch", "on-demand", "--coalesce", "0"],
        );
        assert_eq!(fs::read(m.target.join(local)).unwrap(), text(5_000, 1));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !lazy_servers(&l.b).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the first mount's server is still running: {:?}",
            lazy_servers(&l.b)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    let m = lazy_mount(
        &l,
        "second",
        &["--lazy-fetch", "on-demand", "--coalesce", "0"],
    );
    let server = wait_for_server(&l.b, "serving", |_| true);
    let pids: Vec<i32> = ["supervisor", "worker"]
        .iter()
        .map(|k| {
            server[k]
                .as_i64()
                .unwrap_or_else(|| panic!("no {k}: {server}")) as i32
        })
        .collect();
    let stopped = Stopped::stop(pids);
    let from_store = read_on_a_thread(m.target.join(local));
    let got = from_store.recv_timeout(std::time::Duration::from_secs(10));
    let through_server = read_on_a_thread(m.target.join(missing));
    let early = through_server.recv_timeout(std::time::Duration::from_millis(1500));
    drop(stopped);
    match got {
        Ok(r) => assert_eq!(r.unwrap(), text(5_000, 1), "{local}"),
        Err(_) => panic!("{local}, already in the store, waited for the stopped lazy server"),
    }
    assert!(
        early.is_err(),
        "{missing}, not in the store, was read while its lazy server was stopped: {early:?}"
    );
    let late = through_server
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the missing file once the server runs again");
    assert_eq!(late.unwrap(), text(2_005, 105), "{missing}");
    drop(m);
    support::assert_fsck_clean(&l.b, "after reads from the store and the lazy layer");
}

/// The object ids (hex) of the image's files at `paths`, from the dump of
/// the image in the store at `root`.
fn object_ids(root: &Path, image: &str, paths: &[&str]) -> Vec<String> {
    let dump = cairn_ok(root, &["dump", image]);
    paths
        .iter()
        .map(|p| {
            dump.lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    (f[0] == *p && f.len() > 8 && f[8].len() == 65).then(|| f[8].replace('/', ""))
                })
                .unwrap_or_else(|| panic!("{p} is not a file backed by an object:\n{dump}"))
        })
        .collect()
}

/// Which of `ids` are in the store at `root`.
fn local_ids(root: &Path, ids: &[String]) -> usize {
    ids.iter()
        .filter(|h| root.join("objects").join(&h[..2]).join(&h[2..]).exists())
        .count()
}

/// Issue 13, point 2: a lazy layer's server fetches the prefetch list in
/// the background when the pull did not. `cairn pull --lazy --no-prefetch`
/// of an image whose artifact has a list fetches no object (the metadata
/// only); a `cairn mount --lazy --lazy-fetch on-demand` of it makes every
/// listed object local with nothing opening them, and the files every
/// container start reads (the user database, `/etc/passwd` and
/// `/etc/group`, not on the list), and nothing else; while the list comes
/// through a slow link, a read of an unlisted file is answered before the
/// list is done (its fetch does not queue behind it), and the start files
/// come before the list's objects. A plain `pull --lazy` fetches the list
/// at pull time.
#[test]
fn privileged_lazy_mount_fetches_the_prefetch_list_in_the_background_after_the_pull() {
    require_root();
    let reg = LocalRegistry::start();
    let passwd =
        b"root:x:0:0:root:/root:/bin/sh\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n";
    let group =
        b"root:x:0:\ndaemon:x:1:\nbin:x:2:\nsys:x:3:\nadm:x:4:\ntty:x:5:\ndisk:x:6:\nlp:x:7:\n";
    let reference = push_runnable_with(
        &reg,
        "lazy/list",
        &[
            ("etc/passwd", passwd.to_vec()),
            ("etc/group", group.to_vec()),
        ],
    );
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy-list")
        .tempdir()
        .unwrap();
    let a = dir.path().join("a");
    cairn_ok(&a, &["pull", "-q", &reference]);
    // What a start would read: busybox (two chunks), and the larger data
    // files (incompressible: they take a while through the slow proxy).
    let paths = [
        "/busybox/busybox",
        "/data/read-me.txt",
        "/data/read-me.bin",
        "/data/never-read.bin",
    ];
    let listed = object_ids(&a, &reference, &paths);
    let start_files = object_ids(&a, &reference, &["/etc/passwd", "/etc/group"]);
    let list = dir.path().join("prefetch.txt");
    fs::write(&list, paths.join("\n") + "\n").unwrap();
    cairn_ok(
        &a,
        &[
            "push",
            "-q",
            "--prefetch",
            list.to_str().unwrap(),
            &reference,
            &reg.reference("lazy/list:1-lazy"),
        ],
    );
    let total = objects_in(&a);
    let proxy = SlowProxy::start(&reg.addr, 16 << 10);
    let via = reference.replace(&reg.addr, &proxy.addr);

    // The pull: metadata only, no object.
    let (b, c, d) = (
        dir.path().join("b"),
        dir.path().join("c"),
        dir.path().join("d"),
    );
    let before = proxy.bytes_down();
    let pulled: serde_json::Value = serde_json::from_str(&cairn_ok(
        &b,
        &["--json", "pull", "--lazy", "--no-prefetch", &via],
    ))
    .unwrap();
    let pull_bytes = proxy.bytes_down() - before;
    assert_eq!(pulled["prefetched"], 0, "{pulled:#}");
    assert_eq!(pulled["objects_local"], 0, "{pulled:#}");
    assert_eq!(objects_in(&b), 0, "the lazy pull fetched objects");
    assert!(
        pull_bytes < 500_000,
        "the lazy pull fetched {pull_bytes} bytes (the listed objects are over 2 MB)"
    );

    // A mount, on demand, with nothing read: the list comes, and nothing
    // else.
    let target = dir.path().join("mnt-b");
    let mounted = mount_on_demand(&b, &via, &target);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while local_ids(&b, &listed) < listed.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} listed objects local after 30 s; logs: {}",
            local_ids(&b, &listed),
            listed.len(),
            lazy_logs(&b)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(
        local_ids(&b, &start_files),
        2,
        "the user database was not fetched with the list; logs: {}",
        lazy_logs(&b)
    );
    // Anything else would come with the list's requests.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(
        objects_in(&b),
        listed.len() + 2,
        "objects beyond the list and the user database were fetched ({total} in the image)"
    );
    drop(mounted);

    // The same through a slow link: an unlisted file read while the list
    // is still coming is answered before the list is done.
    cairn_ok(&c, &["pull", "-q", "--lazy", "--no-prefetch", &via]);
    proxy.set_delay(std::time::Duration::from_millis(25));
    let flowing = proxy.bytes_down();
    let target = dir.path().join("mnt-c");
    let mounted = mount_on_demand(&c, &via, &target);
    // The start files come first, in a request of their own sent as the
    // layer begins to serve (one round trip; the list's objects need two:
    // the list, then its packs): when a listed object is local, they are.
    // (Counted in that order, so that a start file that came later than a
    // listed object cannot pass for one that came before.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let listed_now = local_ids(&c, &listed);
        let start_now = local_ids(&c, &start_files);
        if listed_now > 0 {
            assert_eq!(
                start_now,
                2,
                "a listed object was local before the start files; logs: {}",
                lazy_logs(&c)
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no listed object local after 30 s; logs: {}",
            lazy_logs(&c)
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // Once the list is under way (its bytes flowing), read.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while proxy.bytes_down() - flowing < 100_000 {
        assert!(
            std::time::Instant::now() < deadline,
            "the list is not fetched; logs: {}",
            lazy_logs(&c)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let start = std::time::Instant::now();
    let file = "data/unread-05.txt";
    let got = fs::read(target.join(file)).unwrap();
    let took = start.elapsed();
    let listed_then = local_ids(&c, &listed);
    assert_eq!(
        got,
        support::images::text(2_005, 105),
        "{file} read wrong through the lazy mount"
    );
    assert!(
        listed_then < listed.len(),
        "the list was done ({listed_then} of {}) before the read of an unlisted file was \
         answered ({took:?}): it queued behind the list",
        listed.len()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while local_ids(&c, &listed) < listed.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} listed objects local after 60 s on the slow link; logs: {}",
            local_ids(&c, &listed),
            listed.len(),
            lazy_logs(&c)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let list_took = start.elapsed();
    assert!(
        took < list_took,
        "the read took {took:?}, the list {list_took:?}"
    );
    println!("unlisted read answered in {took:?}; the list was local after {list_took:?}");
    drop(mounted);
    proxy.set_delay(std::time::Duration::ZERO);

    // Without `--no-prefetch`: the list at pull time.
    let pulled: serde_json::Value =
        serde_json::from_str(&cairn_ok(&d, &["--json", "pull", "--lazy", &via])).unwrap();
    assert_eq!(pulled["prefetched"].as_u64(), Some(listed.len() as u64));
    assert_eq!(local_ids(&d, &listed), listed.len());
    assert_eq!(objects_in(&d), listed.len());
    support::assert_fsck_clean(&b, "after the list fetched by a lazy mount");
    support::assert_fsck_clean(&c, "after the list fetched on a slow link");
}

/// Issue 13, point 3: gc never removes an object a lazy mount has
/// published, and keeps the partially fetched image while it is mounted,
/// on the strength of the mount alone. An image pulled `--lazy
/// --no-prefetch` and mounted on demand has one file read (its object
/// published by the lazy server); then its only name is removed and gc
/// runs: it reports the mount as what kept the image, and the published
/// object, the EROFS image, its record and its lazy index all stay; the
/// file read reads right again, and so does a file never read before
/// (fetched after the gc, through the same server). Once unmounted, gc
/// removes the image, its side files and every object it had fetched.
#[test]
fn privileged_gc_keeps_an_unnamed_lazy_image_and_what_it_fetched_while_mounted() {
    use support::images::text;
    require_root();
    let reg = LocalRegistry::start();
    let l = lazy_setup(&reg, "lazy/gc", None);
    let inspected: serde_json::Value =
        serde_json::from_str(&cairn_ok(&l.b, &["--json", "inspect", &l.reference])).unwrap();
    let digest = inspected["digest"].as_str().unwrap().to_owned();
    let (read, unread) = ("data/read-me.txt", "data/unread-07.txt");
    let ids = object_ids(
        &l.b,
        &l.reference,
        &["/data/read-me.txt", "/data/unread-07.txt"],
    );
    let images = l.b.join("images");
    let kept_files = [
        images.join(&digest),
        images.join(format!("{digest}.json")),
        images.join(format!("{digest}.lazy-index")),
    ];
    for f in &kept_files {
        assert!(f.is_file(), "the lazy pull left no {}", f.display());
    }
    assert_eq!(objects_in(&l.b), 0, "the lazy pull fetched objects");

    // Alone (no neighbours): `unread` stays missing until it is read.
    let lazy = lazy_mount(
        &l,
        "mnt-b",
        &["--lazy-fetch", "on-demand", "--coalesce", "0"],
    );
    assert_eq!(fs::read(lazy.target.join(read)).unwrap(), text(5_000, 1));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while local_ids(&l.b, &ids[..1]) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{read} was read but its object never published; logs: {}",
            lazy_logs(&l.b)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(local_ids(&l.b, &ids[1..]), 0, "{unread} was fetched unread");
    let fetched = objects_in(&l.b);

    // No name left: only the mount keeps the image.
    cairn_ok(&l.b, &["rm", &l.reference]);
    let inspected: serde_json::Value =
        serde_json::from_str(&cairn_ok(&l.b, &["--json", "inspect", &digest])).unwrap();
    assert_eq!(inspected["names"], serde_json::json!([]), "{inspected:#}");
    let gc: serde_json::Value = serde_json::from_str(&cairn_ok(&l.b, &["--json", "gc"])).unwrap();
    assert_eq!(gc["images"], serde_json::json!([]), "{gc:#}");
    assert_eq!(gc["objects"], 0, "{gc:#}");
    let live = gc["live_mounts"].as_array().unwrap();
    assert!(
        live.iter()
            .any(|m| m["digest"] == digest.as_str()
                && m["mount_point"] == lazy.target.to_str().unwrap()),
        "gc did not see the lazy mount keeping {digest}: {gc:#}"
    );
    assert_eq!(
        local_ids(&l.b, &ids[..1]),
        1,
        "gc removed the fetched object"
    );
    assert_eq!(objects_in(&l.b), fetched, "gc removed fetched objects");
    for f in &kept_files {
        assert!(f.is_file(), "gc removed {} while mounted", f.display());
    }

    // Both the fetched file and a missing one read right after the gc.
    assert_eq!(fs::read(lazy.target.join(read)).unwrap(), text(5_000, 1));
    assert_eq!(
        fs::read(lazy.target.join(unread)).unwrap(),
        text(2_007, 107),
        "{unread} through the lazy mount after gc; logs: {}",
        lazy_logs(&l.b)
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while local_ids(&l.b, &ids) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "{unread}, read after gc, was never published; logs: {}",
            lazy_logs(&l.b)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // A second gc, with both published, still keeps them.
    cairn_ok(&l.b, &["gc"]);
    assert_eq!(
        local_ids(&l.b, &ids),
        2,
        "the second gc removed fetched objects"
    );
    assert_eq!(
        fs::read(lazy.target.join(unread)).unwrap(),
        text(2_007, 107)
    );

    // Unmounted (the server gone), the image is garbage.
    drop(lazy);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !lazy_servers(&l.b).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the lazy server stays: {:?}",
            lazy_servers(&l.b)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let fetched = objects_in(&l.b);
    let gc: serde_json::Value = serde_json::from_str(&cairn_ok(&l.b, &["--json", "gc"])).unwrap();
    assert_eq!(gc["live_mounts"], serde_json::json!([]), "{gc:#}");
    assert_eq!(gc["images"].as_array().map(Vec::len), Some(1), "{gc:#}");
    assert_eq!(gc["objects"].as_u64(), Some(fetched as u64), "{gc:#}");
    assert_eq!(objects_in(&l.b), 0, "objects left after the unmount and gc");
    for f in &kept_files {
        assert!(!f.exists(), "{} left after the unmount and gc", f.display());
    }
    support::assert_fsck_clean(&l.b, "after gc of the unmounted lazy image");
}
