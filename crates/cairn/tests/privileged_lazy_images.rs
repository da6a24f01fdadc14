//! Issue 13, point 6: real images started lazily. The demo image (the tree
//! `scripts/make-demo-image.sh` builds, as one layer) and a multi-layer
//! Debian image (one layer per package, from Debian's own .debs) are pushed
//! to Debian's docker-registry on 127.0.0.1, pulled whole and published as
//! lazy artifacts; then a store that pulled them with `--lazy` runs a
//! command that reads some files, through a counting proxy:
//!
//! - the output is the full pull's, byte for byte;
//! - the bytes fetched during the run stay within what the command opened
//!   plus the stated amplification: with `--coalesce 0` each opened file's
//!   own frame (zstd, never larger than the file plus a frame header) and
//!   the HTTP headers of its request; with `--coalesce C` at most
//!   `max(file, C)` per opened file (docs/lazy-fuse.md, "Neighbours");
//! - after every file of the image was read through a lazy mount, the
//!   peak resident memory (VmHWM) of the lazy server's worker (the process
//!   that serves, found with `cairn lazy list --json`; `cairn mount`
//!   reports its supervisor) is below the bound docs/lazy-fuse.md states
//!   ("The memory bound, measured") for that image; the supervisor's is
//!   reported (and held to the same bound).
//!
//! Mounts for real; fails loudly when not run as root.

mod support;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::{cairn_ok, cairn_out};

/// The bound docs/lazy-fuse.md ("The memory bound, measured") states for
/// the peak RSS of a lazy server's worker, in KiB, with the default
/// options (4 workers, 16 fetch threads, `--coalesce 1M`), for an image
/// pulled from a cairn artifact whose EROFS file has `image_bytes` bytes,
/// with `entries` entries (the root included), `path_bytes` bytes of
/// absolute paths and `file_bytes` bytes of file contents, read through
/// `open_files` files open at once.
fn server_bound_kib(
    entries: u64,
    image_bytes: u64,
    path_bytes: u64,
    file_bytes: u64,
    open_files: u64,
) -> u64 {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    let (workers, fetches, coalesce) = (4, 16, MIB);
    // The binary, the other threads' stacks and the allocator; per
    // worker thread; per fetch thread (its range buffer, its frame); per
    // partial (chunked reads).
    let fixed = 24 * MIB
        + workers * MIB / 2
        + fetches * (coalesce.max(4 * MIB) + 3 * MIB / 2)
        + 8 * 5 * MIB;
    let image = 4 * image_bytes
        + 5 * KIB * entries
        + 2 * path_bytes
        + KIB / 2 * file_bytes.div_ceil(MIB)
        + KIB / 2 * open_files;
    (fixed + image).div_ceil(KIB)
}

/// What one request costs beyond its body: HTTP request and response
/// headers through the proxy (about 600 bytes each way here), generously.
const PER_REQUEST: u64 = 2048;

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test mounts and must run as root (it is not skipped)"
    );
}

fn sha256_hex(d: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(d)))
}

fn run_tool(cmd: &mut Command) -> Vec<u8> {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Debian packages, downloaded once per machine with apt-get into the
/// cache the import tests use.
fn debs(names: &[&str]) -> Vec<PathBuf> {
    let cache = Path::new("/var/tmp/cairn-test-debs");
    fs::create_dir_all(cache).unwrap();
    let find = |name: &str| {
        fs::read_dir(cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("{name}_"))
            })
    };
    names
        .iter()
        .map(|name| {
            if find(name).is_none() {
                let download = || {
                    Command::new("apt-get")
                        .args(["download", name])
                        .current_dir(cache)
                        .status()
                        .expect("apt-get")
                        .success()
                };
                if !download() {
                    // A machine whose package lists are not fetched yet.
                    let _ = Command::new("apt-get").args(["update", "-qq"]).status();
                    assert!(download(), "apt-get download {name} failed");
                }
            }
            find(name).unwrap()
        })
        .collect()
}

/// Pushes an image of these uncompressed layer tars (gzipped here) with
/// `PATH=/bin:/usr/bin`; returns its reference.
fn push_image(reg: &LocalRegistry, repo: &str, tars: &[Vec<u8>]) -> String {
    let layers: Vec<(String, String, Vec<u8>)> = tars
        .iter()
        .map(|tar| {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut gz, tar).unwrap();
            let blob = gz.finish().unwrap();
            (sha256_hex(&blob), sha256_hex(tar), blob)
        })
        .collect();
    for (d, _, b) in &layers {
        assert_eq!(&reg.push_blob(repo, b), d);
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
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

/// The demo image as `scripts/make-demo-image.sh` builds its tree, as one
/// layer.
fn push_demo(reg: &LocalRegistry, work: &Path) -> String {
    let tree = work.join("demo-tree");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/make-demo-image.sh");
    run_tool(
        Command::new(&script)
            .arg(env!("CARGO_BIN_EXE_cairn"))
            .arg("--tree")
            .arg(&tree)
            .arg("--tree-only"),
    );
    let tar = run_tool(Command::new("tar").arg("-C").arg(&tree).args([
        "--sort=name",
        "--numeric-owner",
        "-cf",
        "-",
        ".",
    ]));
    push_image(reg, "lazy/demo", &[tar])
}

/// A Debian image, one layer per package (dpkg-deb's own tar of its
/// files): base-files, libc6, libtinfo6, bash, busybox-static, tzdata.
fn push_debian(reg: &LocalRegistry) -> String {
    let pkgs = debs(&[
        "base-files",
        "libc6",
        "libtinfo6",
        "bash",
        "busybox-static",
        "tzdata",
    ]);
    let tars: Vec<Vec<u8>> = pkgs
        .iter()
        .map(|p| run_tool(Command::new("dpkg-deb").arg("--fsys-tarfile").arg(p)))
        .collect();
    push_image(reg, "lazy/debian", &tars)
}

/// Every entry below `dir`: mode, owner, size, and the contents of files
/// and targets of symlinks.
type Tree = BTreeMap<PathBuf, (u32, u32, u32, u64, Vec<u8>)>;

fn tree(dir: &Path) -> Tree {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let data = if m.file_type().is_symlink() {
                fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if m.is_file() {
                fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
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

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "waited 20 s for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn lazy_dir_empty(root: &Path) -> bool {
    fs::read_dir(root.join("lazy"))
        .map(|d| d.count() == 0)
        .unwrap_or(true)
}

/// An image pulled whole into `full` (and pushed as a lazy artifact),
/// and the same reference through a counting proxy.
struct Published {
    dir: tempfile::TempDir,
    full: PathBuf,
    reference: String,
    via_proxy: String,
}

fn publish(reg: &LocalRegistry, proxy: &SlowProxy, reference: String) -> Published {
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy-images")
        .tempdir()
        .unwrap();
    let full = dir.path().join("full");
    cairn_ok(&full, &["pull", "-q", &reference]);
    cairn_ok(
        &full,
        &["push", "-q", &reference, &format!("{reference}-lazy")],
    );
    let via_proxy = reference.replacen(&reg.addr, &proxy.addr, 1);
    Published {
        dir,
        full,
        reference,
        via_proxy,
    }
}

/// What one lazy run printed, fetched and opened.
struct LazyRun {
    stdout: String,
    /// Bytes the proxy relayed to cairn while the command ran.
    fetched: u64,
    /// The paths the command opened (its `--record-prefetch` list).
    opened: Vec<String>,
}

/// `cairn pull --lazy --no-prefetch` into a fresh store `name`, then
/// `cairn run --lazy --lazy-fetch on-demand --coalesce COALESCE` of
/// `command`, counting the bytes through the proxy.
fn lazy_run(
    p: &Published,
    proxy: &SlowProxy,
    name: &str,
    coalesce: &str,
    command: &[&str],
) -> LazyRun {
    let root = p.dir.path().join(name);
    cairn_ok(
        &root,
        &["pull", "-q", "--lazy", "--no-prefetch", &p.via_proxy],
    );
    let list = p.dir.path().join(format!("{name}.opened"));
    let list_arg = list.to_str().unwrap();
    let mut args = vec![
        "run",
        "--lazy",
        "--lazy-fetch",
        "on-demand",
        "--coalesce",
        coalesce,
        "--record-prefetch",
        list_arg,
        p.via_proxy.as_str(),
    ];
    args.extend(command);
    let before = proxy.bytes_down();
    let stdout = cairn_ok(&root, &args);
    // The server writes the list as it exits, just after the run returns.
    wait_for("the server to exit", || {
        list.exists() && lazy_dir_empty(&root)
    });
    let fetched = proxy.bytes_down() - before;
    let opened = fs::read_to_string(&list)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    LazyRun {
        stdout,
        fetched,
        opened,
    }
}

/// The sizes of the opened paths, from the full pull's tree.
fn opened_sizes(full: &Tree, opened: &[String]) -> Vec<u64> {
    opened
        .iter()
        .map(|path| {
            let rel = Path::new(path.trim_start_matches('/'));
            full.get(rel)
                .unwrap_or_else(|| panic!("{path} opened but not in the image"))
                .3
        })
        .collect()
}

/// Runs `command` from a full pull and lazily (`--coalesce 0`, then
/// `--coalesce 64K`), and checks the output and the bytes fetched.
/// Returns the published image and its proxy.
fn check_lazy_runs(
    reg: &LocalRegistry,
    reference: String,
    command: &[&str],
    want: &str,
) -> (Published, SlowProxy) {
    let proxy = SlowProxy::start(&reg.addr, 64 << 10);
    let start = Instant::now();
    let p = publish(reg, &proxy, reference);
    println!("published in {:?}", start.elapsed());
    let mut full_args = vec!["run", p.reference.as_str()];
    full_args.extend(command);
    let full_out = cairn_ok(&p.full, &full_args);
    assert!(full_out.contains(want), "{full_out}");

    // The full pull's tree, to know the sizes of what was opened.
    let mnt = p.dir.path().join("mnt-full");
    fs::create_dir_all(&mnt).unwrap();
    cairn_ok(
        &p.full,
        &[Path::new("mount"), Path::new(&p.reference), &mnt],
    );
    let full_tree = tree(&mnt);
    let out = cairn_out(&p.full, &[Path::new("umount"), &mnt]);
    assert!(out.status.success(), "{out:?}");
    let image_bytes: u64 = full_tree.values().map(|e| e.3).sum();

    println!("full run and tree in {:?}", start.elapsed());
    let alone = lazy_run(&p, &proxy, "lazy0", "0", command);
    assert_eq!(alone.stdout, full_out, "the lazy run printed otherwise");
    let sizes = opened_sizes(&full_tree, &alone.opened);
    assert!(!sizes.is_empty(), "no file opened?");
    // zstd never grows a frame by more than its header and block headers.
    let bound: u64 = sizes
        .iter()
        .map(|s| s + s / 1000 + 64 + PER_REQUEST)
        .sum::<u64>()
        + 4 * PER_REQUEST;
    let read: u64 = sizes.iter().sum();
    println!(
        "{}: --coalesce 0: {} files opened ({read} bytes), {} bytes fetched (bound {bound}); image {image_bytes} bytes",
        p.reference,
        sizes.len(),
        alone.fetched
    );
    assert!(
        alone.fetched <= bound,
        "fetched {} bytes for {} opened files of {read} bytes (bound {bound})",
        alone.fetched,
        sizes.len()
    );

    let coalesce = 64u64 << 10;
    let near = lazy_run(&p, &proxy, "lazy64k", "64K", command);
    assert_eq!(near.stdout, full_out, "the lazy run printed otherwise");
    let sizes = opened_sizes(&full_tree, &near.opened);
    let bound: u64 = sizes
        .iter()
        .map(|&s| (s + s / 1000 + 64).max(coalesce) + PER_REQUEST)
        .sum::<u64>()
        + 4 * PER_REQUEST;
    println!(
        "{}: --coalesce 64K: {} files opened, {} bytes fetched (bound {bound})",
        p.reference,
        sizes.len(),
        near.fetched
    );
    assert!(
        near.fetched <= bound,
        "fetched {} bytes for {} opened files (bound {bound})",
        near.fetched,
        sizes.len()
    );
    assert!(
        near.fetched < image_bytes,
        "fetched {} bytes: the whole image is {image_bytes}",
        near.fetched
    );
    (p, proxy)
}

/// The demo image: the lazy runs, then the lazy server's memory with
/// every file read through a lazy mount (as for the Debian image).
#[test]
fn privileged_lazy_demo_image_runs_like_a_full_pull_and_fetches_what_it_reads() {
    require_root();
    let reg = LocalRegistry::start();
    let work = tempfile::Builder::new()
        .prefix("cairn-lazy-demo")
        .tempdir()
        .unwrap();
    let reference = push_demo(&reg, work.path());
    let (p, proxy) = check_lazy_runs(
        &reg,
        reference,
        &[
            "/bin/sh",
            "-c",
            "echo hello; cat /etc/motd /etc/os-release; ls /bin | wc -l",
        ],
        "hello\ncairn demo image",
    );
    check_server_memory(&p, &proxy, 100);
}

/// The Debian image, the largest here: the lazy runs as for the demo, then
/// the lazy server's memory with every file read through a lazy mount.
#[test]
fn privileged_lazy_debian_image_runs_like_a_full_pull_and_its_server_memory_stays_bounded() {
    require_root();
    let reg = LocalRegistry::start();
    let start = Instant::now();
    let reference = push_debian(&reg);
    println!("pushed in {:?}", start.elapsed());
    let (p, proxy) = check_lazy_runs(
        &reg,
        reference,
        &[
            "/bin/bash",
            "-c",
            "echo \"bash $BASH_VERSION\"; /bin/busybox cat /etc/debian_version; \
             /bin/busybox sha256sum /usr/share/zoneinfo/Europe/Paris /usr/share/zoneinfo/Asia/Tokyo \
             /lib/x86_64-linux-gnu/libc.so.6; /bin/busybox ls /usr/share/zoneinfo/America | /bin/busybox wc -l",
        ],
        "bash 5.",
    );
    println!("ran in {:?}", start.elapsed());
    check_server_memory(&p, &proxy, 1000);
    println!("read all in {:?}", start.elapsed());
}

/// A line of `/proc/PID/status` as a number (`VmHWM`, `PPid`, …): the
/// first word after the colon.
fn status_field(pid: i32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Peak resident memory of a process, in KiB (`VmHWM`).
fn vm_hwm_kib(pid: i32) -> u64 {
    status_field(pid, "VmHWM").unwrap_or_else(|| panic!("no VmHWM for process {pid}"))
}

/// The lazy server whose supervisor is `supervisor` (the pid `cairn mount
/// --json` reports as `lazy_server`), as `cairn lazy list --json` shows
/// it: `(worker, restarts)`. The worker, a child of the supervisor, is
/// the process that serves; `None` until the supervisor has noted it.
fn lazy_server(root: &Path, supervisor: i32) -> Option<(i32, u64)> {
    let out = cairn_ok(root, &["lazy", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    let s = list
        .as_array()?
        .iter()
        .find(|s| s["supervisor"].as_i64() == Some(supervisor.into()))?;
    let worker = s["worker"].as_i64()? as i32;
    (status_field(worker, "PPid") == Some(supervisor as u64))
        .then(|| (worker, s["restarts"].as_u64().unwrap_or(0)))
}

/// Reads every file of `p`'s image through a lazy mount of a fresh lazy
/// pull (`--lazy-fetch on-demand`), checks it against the full pull's, and
/// the peak RSS of the server's worker (the process that serves; its
/// supervisor is reported too) against the bound docs/lazy-fuse.md states
/// ([`server_bound_kib`]). The image must have more than `min_entries`
/// entries.
fn check_server_memory(p: &Published, proxy: &SlowProxy, min_entries: usize) {
    let mnt_full = p.dir.path().join("mnt-full");
    fs::create_dir_all(&mnt_full).unwrap();
    cairn_ok(
        &p.full,
        &[Path::new("mount"), Path::new(&p.reference), &mnt_full],
    );
    let root = p.dir.path().join("lazy");
    let pulled = cairn_ok(
        &root,
        &["--json", "pull", "--lazy", "--no-prefetch", &p.via_proxy],
    );
    let pulled: serde_json::Value = serde_json::from_str(&pulled).unwrap();
    let digest = pulled["image_digest"].as_str().expect("an image digest");
    let image_bytes = fs::metadata(root.join("images").join(digest))
        .unwrap_or_else(|e| panic!("the image file of {digest}: {e}"))
        .len();
    let mnt = p.dir.path().join("mnt-lazy");
    fs::create_dir_all(&mnt).unwrap();
    let report = cairn_ok(
        &root,
        &[
            Path::new("--json"),
            Path::new("mount"),
            Path::new("--lazy"),
            Path::new("--lazy-fetch"),
            Path::new("on-demand"),
            Path::new(&p.via_proxy),
            &mnt,
        ],
    );
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    // The supervisor: it forks the worker, which serves.
    let supervisor = report["lazy_server"].as_i64().expect("a lazy server pid") as i32;
    let mut server = None;
    wait_for("the lazy server's worker in `cairn lazy list`", || {
        server = lazy_server(&root, supervisor);
        server.is_some()
    });
    let (worker, restarts) = server.unwrap();
    assert_eq!(restarts, 0, "the worker was restarted before it served");
    let (worker_start, supervisor_start) = (vm_hwm_kib(worker), vm_hwm_kib(supervisor));
    let before = proxy.bytes_down();
    let (want, got) = (tree(&mnt_full), tree(&mnt));
    let fetched = proxy.bytes_down() - before;
    let (worker_peak, supervisor_peak) = (vm_hwm_kib(worker), vm_hwm_kib(supervisor));
    // The same worker served every read: its peak is the server's.
    assert_eq!(
        lazy_server(&root, supervisor),
        Some((worker, 0)),
        "the worker changed while the files were read"
    );
    let umount = |root: &Path, mnt: &Path| {
        let out = cairn_out(root, &[Path::new("umount"), mnt]);
        assert!(out.status.success(), "{out:?}");
    };
    umount(&root, &mnt);
    umount(&p.full, &mnt_full);
    let bytes: u64 = want.values().map(|e| e.3).sum();
    // Paths as the image has them: absolute (the root is "/").
    let path_bytes: u64 = 1 + want
        .keys()
        .map(|p| 1 + p.as_os_str().len() as u64)
        .sum::<u64>();
    // `tree` reads one file at a time.
    let bound = server_bound_kib(want.len() as u64 + 1, image_bytes, path_bytes, bytes, 1);
    println!(
        "{}: lazy server worker (pid {worker}): VmHWM {worker_start} KiB after mounting, \
         {worker_peak} KiB after reading all {} entries ({bytes} bytes; {fetched} bytes \
         fetched; image file {image_bytes} bytes); supervisor (pid {supervisor}): VmHWM \
         {supervisor_start} KiB, then {supervisor_peak} KiB; stated bound {bound} KiB",
        p.reference,
        want.len()
    );
    assert!(
        want.len() > min_entries,
        "{} entries, expected more than {min_entries}",
        want.len()
    );
    assert_eq!(want.len(), got.len());
    for (path, w) in &want {
        let g = got
            .get(path)
            .unwrap_or_else(|| panic!("{} missing", path.display()));
        assert!(g == w, "{} differs", path.display());
    }
    assert!(
        worker_peak < bound,
        "the lazy server's worker peaked at {worker_peak} KiB, over the stated bound {bound} KiB"
    );
    assert!(
        supervisor_peak < bound,
        "the lazy server's supervisor peaked at {supervisor_peak} KiB, over the stated bound \
         {bound} KiB"
    );
    for pid in [worker, supervisor] {
        wait_for("the server to exit", || {
            !Path::new(&format!("/proc/{pid}")).exists()
        });
    }
}
