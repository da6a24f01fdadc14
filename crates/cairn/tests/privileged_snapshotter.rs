//! `cairn snapshotter` judged by containerd's own tests: containerd's
//! snapshotter test suite (`snapshots/testsuite` from Debian's
//! golang-github-containerd-containerd-dev), run through containerd's proxy
//! snapshotter client against the cairn socket by the Go program in
//! `tests/containerd-suite/` (built here in GOPATH mode with the machine's
//! Go). Each of the suite's subtests is reported; any failure fails this
//! test. These tests mount and fail loudly when not run as root.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Subtests the suite itself skips, and why.
const SKIPPED_BY_THE_SUITE: &[(&str, &str)] = &[(
    "Rename",
    "containerd's suite skips it on every snapshotter: \"rename test still fails on some kernels with overlay\"",
)];

/// Builds the suite's test binary for that containerd; returns its path.
fn build_suite(v: Ctd) -> PathBuf {
    match v {
        Ctd::V16 => build_go("containerd-suite", "suite.test", true),
        Ctd::V24 => build_go_module("suite", "suite.test", true),
    }
}

/// `(name, result)` of each `--- PASS/FAIL/SKIP: TEST/NAME` line.
fn subtests(log: &str, test: &str) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for line in log.lines() {
        let l = line.trim_start();
        for result in ["PASS", "FAIL", "SKIP"] {
            if let Some(rest) = l.strip_prefix(&format!("--- {result}: {test}/")) {
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
    containerd_suite(Ctd::V16);
}

/// containerd 2.4.2's own suite (`core/snapshots/testsuite`).
#[test]
fn privileged_snapshotter_containerd2_suite() {
    containerd_suite(Ctd::V24);
}

/// The two suites one after the other (they are the heaviest tests here;
/// each would be slower beside the other on this machine's two cores).
static SUITES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn containerd_suite(v: Ctd) {
    require_root();
    let _one_suite_at_a_time = SUITES.lock().unwrap_or_else(|p| p.into_inner());
    let bin = build_suite(v);
    // The suite makes its directories (`snapshot-suite-<name>-*`) under
    // `TMPDIR`: one of this test's own, so that the check at the end that
    // nothing is left mounted looks at this run's mounts only, not at
    // those of the same test running at the same time elsewhere (another
    // checkout, the other suite).
    let tmp = tempfile::Builder::new()
        .prefix("cairn-snapshot-suite-")
        .tempdir()
        .expect("a temporary directory for the suite");
    let run = |args: &[&str]| {
        Command::new(&bin)
            .args(["-test.v", "-test.timeout", "20m"])
            .args(args)
            .env("CAIRN_BIN", cairn_bin())
            .env("TMPDIR", tmp.path())
            .env_remove("CAIRN_ROOT")
            .output()
            .expect("running the suite")
    };
    // containerd 2.4's suite leaves out the rename of a lower directory
    // only for the snapshotters it knows to be overlays without
    // redirect_dir, by name; cairn's active snapshots are such overlays
    // (tests/containerd2/suite, TestCairnOverlayfsRules). Its Rename runs
    // under that name; everything else under cairn's.
    let out = match v {
        Ctd::V16 => run(&[]),
        Ctd::V24 => run(&[
            "-test.run",
            "^TestCairnSnapshotter$",
            "-test.skip",
            "^TestCairnSnapshotter$/^Rename$",
        ]),
    };
    if v == Ctd::V24 {
        let o = run(&["-test.run", "^TestCairnOverlayfsRules$/^Rename$"]);
        let log = String::from_utf8_lossy(&o.stdout);
        let r = subtests(&log, "TestCairnOverlayfsRules");
        eprintln!("containerd {v:?} snapshotter suite, with overlayfs's rules: {r:?}");
        assert!(
            o.status.success() && r == [("Rename".to_owned(), "PASS".to_owned())],
            "containerd {v:?}'s Rename with overlayfs's rules ({}):\n{log}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let results = subtests(&stdout, "TestCairnSnapshotter");
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
            .filter(|_| v == Ctd::V16)
            .find(|(n, _)| n == name)
            .map(|(_, w)| format!(" ({w})"))
            .unwrap_or_default();
        eprintln!("containerd {v:?} snapshotter suite: {name}: {result}{why}");
        let expected = if why.is_empty() { "PASS" } else { "SKIP" };
        if result != expected {
            failed.push(format!("{name}: {result}, expected {expected}"));
        }
    }
    assert!(
        failed.is_empty() && out.status.success(),
        "containerd {v:?}'s snapshotter suite: {} ({}):\n{stdout}\n{stderr}",
        failed.join("; "),
        out.status
    );
    // Nothing the snapshotters mounted is left behind (under this run's
    // own directory: see `tmp` above).
    let left = mounts_under(tmp.path());
    assert!(left.is_empty(), "mounts left behind: {left:#?}");
}

/// The mount points at or below `dir` (`/proc/self/mountinfo`'s fifth
/// field, with its octal escapes of space, tab, newline and backslash
/// undone).
fn mounts_under(dir: &std::path::Path) -> Vec<String> {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = dir.to_str().expect("a UTF-8 temporary directory");
    mi.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| {
            p.replace("\\040", " ")
                .replace("\\011", "\t")
                .replace("\\012", "\n")
                .replace("\\134", "\\")
        })
        .filter(|p| {
            p.strip_prefix(dir)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
        .collect()
}

// ---------------------------------------------------------------------
// containerd 1.6 with `ctr`: the same image pulled and run with cairn and
// with containerd's own overlayfs snapshotter.
// ---------------------------------------------------------------------

mod support;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use support::registry::LocalRegistry;
use support::snapshotter::{
    build_go, build_go_module, build_rpull, cairn_ok_at, manifest_at, manifest_of, push_image,
    push_lazy_artifact, Ctd, CAP_NET_RAW_EP, CONTAINERD2_BIN, REPO, TAG,
};

#[path = "privileged_snapshotter/fallback.rs"]
mod fallback;
#[path = "privileged_snapshotter/readme_config.rs"]
mod readme_config;

/// containerd and `cairn snapshotter`, on their own root, state and
/// sockets under one temporary directory; stopped, and everything they
/// left mounted unmounted, on drop.
struct Daemons {
    version: Ctd,
    dir: tempfile::TempDir,
    containerd: Child,
    snapshotter: Child,
    /// Extra arguments of `cairn snapshotter`.
    snap_args: Vec<String>,
    /// Extra environment of `cairn snapshotter`.
    snap_env: Vec<(String, String)>,
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < deadline, "{what} did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Daemons {
    fn start(version: Ctd) -> Daemons {
        Daemons::start_with(version, &[])
    }

    fn start_with(version: Ctd, snap_args: &[&str]) -> Daemons {
        Daemons::start_with_env(version, snap_args, &[])
    }

    /// With `env` set for `cairn snapshotter` (and kept for its restarts).
    fn start_with_env(version: Ctd, snap_args: &[&str], env: &[(&str, &str)]) -> Daemons {
        Daemons::start_inner(version, snap_args, env, None)
    }

    /// With containerd's configuration written by `config_of(dir, the
    /// snapshotter's socket)` instead of this file's.
    fn start_with_config(version: Ctd, config_of: fn(&Path, &Path) -> String) -> Daemons {
        Daemons::start_inner(version, &[], &[], Some(config_of))
    }

    fn start_inner(
        version: Ctd,
        snap_args: &[&str],
        env: &[(&str, &str)],
        config_of: Option<fn(&Path, &Path) -> String>,
    ) -> Daemons {
        let snap_args: Vec<String> = snap_args.iter().map(|a| a.to_string()).collect();
        let snap_env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        version.check_installed();
        let dir = tempfile::Builder::new()
            .prefix("cairn-ctr-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let d = dir.path();
        let snap_sock = d.join("cairn/snapshotter.sock");
        let snapshotter = spawn_snapshotter_with_env(d, &snap_args, &snap_env);
        let config = match version {
            Ctd::V16 => format!(
                r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{d}/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"

[proxy_plugins.cairn]
  type = "snapshot"
  address = "{sock}"
"#,
                d = d.display(),
                sock = snap_sock.display()
            ),
            // containerd 2.x reads config version 3 (it migrates 2 too);
            // `proxy_plugins` is a top-level table there as well. The CRI
            // is split into three plugins in 2.x; NRI would listen on a
            // fixed socket shared with other containerds on the machine.
            Ctd::V24 => format!(
                r#"version = 3
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.nri.v1.nri"]

[grpc]
  address = "{d}/containerd.sock"

[ttrpc]
  address = "{d}/containerd.sock.ttrpc"

[proxy_plugins.cairn]
  type = "snapshot"
  address = "{sock}"

# containerd 2.x pulls through its transfer service, which unpacks only
# into the snapshotters listed here (by default its overlayfs alone).
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/{arch}"
  snapshotter = "overlayfs"
  differ = "walking"

[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/{arch}"
  snapshotter = "cairn"
  differ = "walking"
"#,
                d = d.display(),
                sock = snap_sock.display(),
                arch = match std::env::consts::ARCH {
                    "x86_64" => "amd64",
                    "aarch64" => "arm64",
                    a => a,
                },
            ),
        };
        let config = config_of.map_or(config, |f| f(d, &snap_sock));
        std::fs::write(d.join("config.toml"), config).unwrap();
        let bin = version.bin("containerd");
        // containerd 2.4 finds its own shim (and runc) in PATH.
        let path = match version {
            Ctd::V16 => std::env::var("PATH").unwrap_or_default(),
            Ctd::V24 => format!(
                "{CONTAINERD2_BIN}:{}",
                std::env::var("PATH").unwrap_or_default()
            ),
        };
        let containerd = Command::new(&bin)
            .arg("--config")
            .arg(d.join("config.toml"))
            .env("PATH", path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("containerd.log")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {} (setup.sh installs it): {e}", bin.display()));
        let mut ds = Daemons {
            version,
            dir,
            containerd,
            snapshotter,
            snap_args,
            snap_env,
        };
        wait_for("containerd", || ds.ctr_out(&["version"]).status.success());
        let _ = &mut ds;
        ds
    }

    fn ctr_out(&self, args: &[&str]) -> std::process::Output {
        Command::new(self.version.bin("ctr"))
            .arg("--address")
            .arg(self.dir.path().join("containerd.sock"))
            .args(["--namespace", self.version.namespace()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running ctr")
    }

    fn ctr(&self, args: &[&str]) -> String {
        let o = self.ctr_out(args);
        assert!(
            o.status.success(),
            "ctr {args:?} failed ({}): {}{}\ncontainerd log:\n{}\nsnapshotter log:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default(),
            self.log(),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `ctr images pull` of `reference` (plain HTTP, the registry on
    /// 127.0.0.1) into snapshotter `sn`.
    fn pull(&self, sn: &str, reference: &str) {
        self.ctr(&[
            "images",
            "pull",
            "--plain-http",
            "--snapshotter",
            sn,
            reference,
        ]);
    }

    /// `ctr run --rm` with snapshotter `sn` of `shell -c script`; returns
    /// what the script printed on its standard output. That goes to a file
    /// on a bind mount from the host, not through ctr: containerd's copy of
    /// a task's output to `ctr run` can end early when the task exits (seen
    /// with 1.6 and 2.4 on a loaded machine: the first lines only, exit
    /// status 0, with either snapshotter), and what the container printed
    /// is what the tests compare. The mount point (`/.cairn-out`) is made
    /// in the container's upper directory, outside what the scripts list.
    fn run_script(&self, sn: &str, image: &str, id: &str, shell: &[&str], script: &str) -> String {
        let (out, mount) = self.output_mount(id);
        let wrapped = format!("exec >/.cairn-out/stdout; {script}");
        let mut args = vec![
            "run",
            "--rm",
            "--snapshotter",
            sn,
            "--mount",
            &mount,
            image,
            id,
        ];
        args.extend(shell);
        args.extend(["-c", &wrapped]);
        let printed = self.ctr(&args);
        assert!(printed.is_empty(), "ctr run {id} printed {printed:?}");
        std::fs::read_to_string(out.join("stdout"))
            .unwrap_or_else(|e| panic!("{}/stdout: {e}", out.display()))
    }

    /// `ctr run -d` of `sleep 600` in the test image with snapshotter
    /// cairn and the output mount of [`Daemons::run_script`], for
    /// [`Daemons::exec_to_file`].
    fn run_detached(&self, image: &str, id: &str) {
        let (_, mount) = self.output_mount(id);
        self.ctr(&[
            "run",
            "-d",
            "--snapshotter",
            "cairn",
            "--mount",
            &mount,
            image,
            id,
            "/busybox/busybox",
            "sleep",
            "600",
        ]);
    }

    /// A new directory for what container `id` writes, and the `ctr run
    /// --mount` that binds it at `/.cairn-out` in the container.
    fn output_mount(&self, id: &str) -> (PathBuf, String) {
        let out = self.dir.path().join(format!("out-{id}"));
        std::fs::create_dir(&out).unwrap();
        let mount = format!(
            "type=bind,src={},dst=/.cairn-out,options=rbind:rw",
            out.display()
        );
        (out, mount)
    }

    /// `ctr task exec` in container `id` (started by
    /// [`Daemons::run_detached`]) of busybox's `sh -c "cmd"`, its output
    /// written to the output mount, not through ctr (whose copy of an
    /// exec's output can end early: an empty read of a file was seen in
    /// CI); returns what it wrote. Fails if the command fails.
    fn exec_to_file(&self, id: &str, exec_id: &str, cmd: &str) -> Vec<u8> {
        self.ctr(&[
            "task",
            "exec",
            "--exec-id",
            exec_id,
            id,
            "/busybox/busybox",
            "sh",
            "-c",
            &format!("{cmd} > /.cairn-out/{exec_id}"),
        ]);
        let f = self.dir.path().join(format!("out-{id}/{exec_id}"));
        std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
    }

    /// [`Daemons::run_script`] of [`SCRIPT`] in the test image (busybox,
    /// its applets installed first).
    fn run_test_script(&self, sn: &str, image: &str, id: &str) -> String {
        self.run_script(
            sn,
            image,
            id,
            &["/busybox/busybox", "sh"],
            &format!("export PATH=/busybox; /busybox/busybox --install -s /busybox; {SCRIPT}"),
        )
    }
}

/// Fails with the first line where two containers' outputs differ (and
/// their line counts), not with both outputs whole.
fn assert_same_output(a: &str, b: &str, what: &str) {
    if a == b {
        return;
    }
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let i = la.iter().zip(&lb).take_while(|(x, y)| x == y).count();
    panic!(
        "{what}: the outputs differ from line {} on ({} and {} lines): {:?} against {:?}; \
         the lines before it: {:?}",
        i + 1,
        la.len(),
        lb.len(),
        la.get(i),
        lb.get(i),
        &la[i.saturating_sub(3)..i],
    );
}

/// [`assert_same_output`] of what a container of the test image printed
/// on cairn and on containerd's overlayfs snapshotter (its normal path),
/// less the lines of the hard-linked files: cairn's importer keeps the mode
/// of a hard link's target where containerd's applier takes the link
/// entry's (docs/snapshotter.md, "Known differences"), and the test image's
/// bin/tool and bin/sh pairs differ so.
fn assert_same_as_overlayfs(cairn: &str, overlayfs: &str, what: &str) {
    let keep = |out: &str| {
        out.lines()
            .filter(|l| !l.starts_with("/bin/tool") && !l.starts_with("/bin/sh"))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    };
    assert!(overlayfs.contains("hello"), "{overlayfs}");
    assert_same_output(&keep(cairn), &keep(overlayfs), what);
}

fn unmount_under(root: &Path) {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let prefix = format!("{}/", root.display());
    let mut targets: Vec<String> = mi
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_owned)
        .collect();
    targets.sort();
    for t in targets.iter().rev() {
        let _ = rustix::mount::unmount(t.as_str(), rustix::mount::UnmountFlags::DETACH);
    }
}

/// Starts `cairn snapshotter` on `<d>/store`, socket `<d>/cairn/snapshotter.sock`,
/// its log appended to `<d>/snapshotter.log`; returns once the socket is there.
fn spawn_snapshotter(d: &Path, args: &[String]) -> Child {
    spawn_snapshotter_with_env(d, args, &[])
}

/// [`spawn_snapshotter`] with `env` set for the snapshotter.
fn spawn_snapshotter_with_env(d: &Path, args: &[String], env: &[(String, String)]) -> Child {
    let snap_sock = d.join("cairn/snapshotter.sock");
    let _ = std::fs::remove_file(&snap_sock);
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(d.join("snapshotter.log"))
        .unwrap();
    let child = Command::new(cairn_bin())
        .arg("--root")
        .arg(d.join("store"))
        .arg("snapshotter")
        .arg("--address")
        .arg(&snap_sock)
        .args(args)
        .env_remove("CAIRN_ROOT")
        .env("CAIRN_LOG", "info")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting cairn snapshotter");
    wait_for("cairn snapshotter", || snap_sock.exists());
    child
}

impl Daemons {
    /// The snapshotter's log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("snapshotter.log")).unwrap_or_default()
    }

    /// Pulls `reference` with the CRI-label client `rpull` (the remote
    /// snapshotter path), with `env` set; fails the test with the client's
    /// output and the snapshotter's log if the pull fails.
    fn rpull(&self, rpull: &Path, reference: &str, env: &[(&str, &str)]) {
        let o = Command::new(rpull)
            .arg(self.dir.path().join("containerd.sock"))
            .args([self.version.namespace(), "cairn", reference])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "rpull: {}{}\nsnapshotter log:\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            self.log()
        );
    }
}

impl Daemons {
    /// SIGKILL to the snapshotter (no chance to clean up), then a new one
    /// on the same store and socket.
    fn kill_and_restart_snapshotter(&mut self) {
        self.snapshotter.kill().unwrap();
        self.snapshotter.wait().unwrap();
        self.snapshotter =
            spawn_snapshotter_with_env(self.dir.path(), &self.snap_args, &self.snap_env);
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        for c in [&mut self.containerd, &mut self.snapshotter] {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(c.id() as i32).unwrap(),
                rustix::process::Signal::TERM,
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        unmount_under(self.dir.path());
    }
}

/// What the container prints: files from every layer, a listing with
/// owners, modes (setuid, setgid and sticky bits too) and times, digests
/// of large files, and a write. busybox cannot read xattrs (no getfattr,
/// no getcap): the trees compared on the host check them.
/// Directories' sizes and link counts are the filesystem's (EROFS,
/// overlayfs) and their times may be the unpack's (see below), so those
/// are left out.
const SCRIPT: &str = "cat /etc/os-release /etc/motd; \
    find /bin /etc /srv /usr/lib /opt -xdev -type d | sort | xargs stat -c '%n %A %u:%g'; \
    find /bin /etc /srv /usr/lib /opt -xdev ! -type d | sort | xargs stat -c '%n %A %u:%g %s %h %Y'; \
    stat -c '%n %A %u:%g' /tmp; \
    md5sum /bin/tool /bin/sh-again /bin/tool-link /opt/data /usr/share/blob /srv/top; \
    find /usr /srv /opt /etc -xdev | sort | md5sum; \
    echo hello > /srv/written && cat /srv/written; rm /etc/motd && ls /etc; \
    test -e /etc/gone-later || echo gone-later is gone; test -e /etc/hostname || echo hostname is gone";

#[test]
fn privileged_snapshotter_ctr_pull_and_run() {
    ctr_pull_and_run(Ctd::V16);
}

/// The same against containerd 2.4.2.
#[test]
fn privileged_snapshotter_containerd2_ctr_pull_and_run() {
    ctr_pull_and_run(Ctd::V24);
}

fn ctr_pull_and_run(v: Ctd) {
    require_root();
    let reg = LocalRegistry::start();
    let reference = push_image(&reg);
    let ds = Daemons::start(v);
    let mut outputs = Vec::new();
    let mut trees = Vec::new();
    for sn in ["overlayfs", "cairn"] {
        ds.pull(sn, &reference);
        outputs.push(ds.run_test_script(sn, &reference, &format!("run-{sn}")));
        let mnt = ds.dir.path().join(format!("mnt-{sn}"));
        std::fs::create_dir(&mnt).unwrap();
        ds.ctr(&[
            "images",
            "mount",
            "--snapshotter",
            sn,
            &reference,
            mnt.to_str().unwrap(),
        ]);
        trees.push(snapshot(&mnt));
        // `--snapshotter`: without it, `--rm` removes the view from the
        // default snapshotter (overlayfs), and containerd's gc removes
        // cairn's later, once the lease is gone.
        ds.ctr(&[
            "images",
            "unmount",
            "--snapshotter",
            sn,
            "--rm",
            mnt.to_str().unwrap(),
        ]);
    }
    assert!(outputs[0].contains("hello"), "{}", outputs[0]);
    assert_same_output(&outputs[0], &outputs[1], "ctr run with cairn");
    // Directories that a layer's tar does not list (their children's
    // parents) are made by containerd's applier when it unpacks, with the
    // time of the unpack: their mtimes differ between any two pulls. A
    // directory's link count is the filesystem's: containerd 2.4's
    // `ctr images mount` of an overlayfs snapshot is an overlay of several
    // lower layers, whose merged directories report one link.
    for t in &mut trees {
        for e in t.entries.values_mut() {
            if e.kind == "dir" {
                e.mtime = (0, 0);
                e.nlink = 0;
            }
        }
    }
    let d = diff(&trees[0], &trees[1]);
    assert!(
        d.is_empty(),
        "cairn's tree differs from overlayfs's: {d:#?}"
    );
    // Equal, and not for lack of owners, mode bits and xattrs on both.
    check_debian_metadata(&trees[0], "overlayfs");
    check_debian_metadata(&trees[1], "cairn");
    assert!(trees[1].entries.len() > 900, "{}", trees[1].entries.len());

    // The layers containerd unpacked and cairn committed hold the same
    // files as the image pulled by cairn itself: the pull adds no object,
    // and its mount shows the same tree.
    let store = ds.dir.path().join("store");
    let count_objects = || {
        let mut n = 0;
        for d in std::fs::read_dir(store.join("objects")).unwrap() {
            n += std::fs::read_dir(d.unwrap().path()).unwrap().count();
        }
        n
    };
    let before = count_objects();
    assert!(before > 100, "{before} objects after the unpack");
    cairn_ok_at(&store, &["pull", &reference]);
    assert_eq!(
        count_objects(),
        before,
        "cairn pull added objects the snapshotter had not stored"
    );
    let mnt = ds.dir.path().join("mnt-pull");
    std::fs::create_dir(&mnt).unwrap();
    cairn_ok_at(&store, &["mount", &reference, mnt.to_str().unwrap()]);
    let mut pulled = snapshot(&mnt);
    cairn_ok_at(&store, &["umount", mnt.to_str().unwrap()]);
    // Two known differences between containerd's layer applier and
    // cairn's (which applies layers as umoci does, docs/layers.md), not
    // the snapshotter's doing: containerd applies a hard link entry's own
    // mode to the inode it links to (the test set's `bin/tool-link` entry
    // says 0644 where `bin/tool` says 0755), and a merged overlayfs
    // directory reports one link.
    let hardlinked: BTreeSet<Vec<u8>> = pulled.links.iter().flatten().cloned().collect();
    let mut unpacked = trees[1].entries.clone();
    for t in [&mut pulled.entries, &mut unpacked] {
        for (p, e) in t.iter_mut() {
            if e.kind == "dir" {
                e.mtime = (0, 0);
                e.nlink = 0;
            }
            if hardlinked.contains(p) {
                e.mode &= !0o777;
            }
        }
    }
    let d: Vec<String> = pulled
        .entries
        .iter()
        .filter(|(p, e)| unpacked.get(*p) != Some(e))
        .map(|(p, e)| {
            format!(
                "{}: pull {e:?}, snapshotter {:?}",
                String::from_utf8_lossy(p),
                unpacked.get(p)
            )
        })
        .chain(
            unpacked
                .keys()
                .filter(|p| !pulled.entries.contains_key(*p))
                .map(|p| format!("{}: only in the snapshotter's", String::from_utf8_lossy(p))),
        )
        .collect();
    assert!(
        d.is_empty(),
        "the snapshotter's tree differs from cairn pull's: {d:#?}"
    );
    check_debian_metadata(&pulled, "cairn pull");

    // cairn's gc keeps what the snapshotter's committed snapshots need
    // (their refs) once the image cairn pulled is gone, and a container
    // still starts from them.
    cairn_ok_at(&store, &["rm", &reference]);
    cairn_ok_at(&store, &["gc"]);
    let again = ds.run_test_script("cairn", &reference, "run-after-gc");
    assert_same_output(&again, &outputs[1], "ctr run after cairn gc");
    cairn_ok_at(&store, &["fsck"]);

    // Every container and view is gone; the image's top chain stays
    // mounted (for the next container) until the image's snapshots go.
    // The chains mounted to unpack the layers above them went as those
    // were committed.
    assert_eq!(
        chain_mounts(&store).len(),
        1,
        "chain mounts: {:?}",
        chain_mounts(&store)
    );

    usage_through_containerd(&ds);

    // Cleanup through containerd: its gc calls the proxy snapshotter's
    // Cleanup after it removed snapshots. Only Cleanup removes snapshot
    // directories no record names and `containerd-snapshot-*` refs no
    // committed snapshot holds, and the snapshotter is not restarted: the
    // orphan planted here goes only through a Cleanup over gRPC (the one
    // after the image's removal, or one after `usage-probe`'s: containerd
    // runs its gc in the background).
    let refs = store.join("refs");
    let snapshot_refs = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&refs)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("containerd-snapshot-"))
            .collect();
        v.sort();
        v
    };
    let live = snapshot_refs();
    assert_eq!(live.len(), 5, "one ref per committed layer: {live:?}");
    let orphan = store.join("snapshots/987654321");
    std::fs::create_dir_all(orphan.join("fs/etc")).unwrap();
    std::fs::write(orphan.join("fs/etc/left-behind"), b"x").unwrap();
    let stale = refs.join("containerd-snapshot-987654321");
    std::fs::copy(refs.join(&live[0]), &stale).unwrap();
    wait_for_image_removal(&ds, &[&reference]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while orphan.exists() || stale.exists() || !snapshot_refs().is_empty() {
        assert!(
            Instant::now() < deadline,
            "containerd's gc did not get cairn's Cleanup to remove the orphan \
             directory ({}) and the refs of removed snapshots ({:?})\nsnapshotter log:\n{}",
            orphan.exists(),
            snapshot_refs(),
            ds.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        chain_mounts(&store),
        Vec::<String>::new(),
        "chain images left mounted after the image's removal"
    );
    cairn_ok_at(&store, &["fsck"]);
}

/// `ctr snapshots --snapshotter cairn usage -b [keys]`: key, bytes, inodes.
fn usage_rows(ds: &Daemons, keys: &[&str]) -> Vec<(String, i64, i64)> {
    let mut args = vec!["snapshots", "--snapshotter", "cairn", "usage", "-b"];
    args.extend(keys);
    let out = ds.ctr(&args);
    let mut lines = out.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(header, ["KEY", "SIZE", "INODES"], "{out}");
    lines
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "{out}");
            (
                f[0].to_owned(),
                f[1].parse().unwrap_or_else(|e| panic!("{e}: {out}")),
                f[2].parse().unwrap_or_else(|e| panic!("{e}: {out}")),
            )
        })
        .collect()
}

/// Usage through containerd (`ctr snapshots usage`, which calls the
/// snapshotter's Usage for each snapshot): every committed layer of the
/// test image reports its tar's bytes and entries, and an active snapshot
/// on the image grows by what is written into its mount (its upper
/// directory is what cairn counts).
fn usage_through_containerd(ds: &Daemons) {
    let listed = ds.ctr(&["snapshots", "--snapshotter", "cairn", "ls"]);
    let rows = snapshot_rows(&listed);
    let committed: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r.last() == Some(&"Committed"))
        .map(|r| r[0])
        .collect();
    assert_eq!(committed.len(), 5, "the image's five layers: {listed}");
    let usage: std::collections::BTreeMap<String, (i64, i64)> = usage_rows(ds, &[])
        .into_iter()
        .map(|(k, s, i)| (k, (s, i)))
        .collect();
    assert_eq!(
        usage.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        committed,
        "usage lists every snapshot: {usage:?}\n{listed}"
    );
    for (k, (size, inodes)) in &usage {
        assert!(
            *size > 0 && *inodes > 0,
            "{k}: {size} bytes, {inodes} inodes"
        );
    }
    // The top layer (no snapshot's parent) holds busybox: its tar is at
    // least that big.
    let top = *committed
        .iter()
        .find(|k| !rows.iter().any(|r| r.len() == 3 && r[1] == **k))
        .unwrap_or_else(|| panic!("no top layer: {listed}"));
    let busybox = std::fs::metadata("/bin/busybox").unwrap().len() as i64;
    assert!(
        usage[top].0 >= busybox && usage[top].1 >= 3,
        "top layer {top}: {:?}, busybox is {busybox} bytes",
        usage[top]
    );
    // The same numbers when asked for one key.
    let one = usage_rows(ds, &[top]);
    assert_eq!(one, vec![(top.to_owned(), usage[top].0, usage[top].1)]);

    // An active snapshot on the image: empty at first, then 1 MiB more
    // (and two more inodes) once a directory with a 1 MiB file is written
    // through its overlay mount.
    ds.ctr(&[
        "snapshots",
        "--snapshotter",
        "cairn",
        "prepare",
        "usage-probe",
        top,
    ]);
    let active = |ds: &Daemons| {
        let u = usage_rows(ds, &["usage-probe"]);
        assert_eq!(u.len(), 1, "{u:?}");
        (u[0].1, u[0].2)
    };
    let (size0, inodes0) = active(ds);
    assert!(
        (0..=64 * 1024).contains(&size0) && (0..=2).contains(&inodes0),
        "a fresh active snapshot uses {size0} bytes, {inodes0} inodes"
    );
    let mnt = ds.dir.path().join("mnt-usage-probe");
    std::fs::create_dir(&mnt).unwrap();
    let mount = ds.ctr(&[
        "snapshots",
        "--snapshotter",
        "cairn",
        "mounts",
        mnt.to_str().unwrap(),
        "usage-probe",
    ]);
    check_rootfs_mount(ds, &mount, top);
    let o = Command::new("sh").arg("-c").arg(&mount).output().unwrap();
    assert!(o.status.success(), "{mount}: {o:?}");
    assert!(
        mnt.join("busybox/busybox").is_file(),
        "the image under {mount}"
    );
    const MIB: i64 = 1 << 20;
    std::fs::create_dir(mnt.join("grown")).unwrap();
    let data: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8 + 1).collect();
    let mut f = std::fs::File::create(mnt.join("grown/one-mib")).unwrap();
    std::io::Write::write_all(&mut f, &data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty()).unwrap();
    let (size1, inodes1) = active(ds);
    assert!(
        size1 - size0 >= MIB && size1 - size0 < 2 * MIB,
        "1 MiB written: usage {size0} -> {size1} bytes"
    );
    assert!(
        inodes1 - inodes0 >= 2,
        "a directory and a file written: {inodes0} -> {inodes1} inodes"
    );
    // Committed layers are unchanged by it.
    assert_eq!(usage_rows(ds, &[top])[0].1, usage[top].0);
    ds.ctr(&["snapshots", "--snapshotter", "cairn", "rm", "usage-probe"]);
}

/// What containerd is given for a container's root filesystem on the
/// committed snapshot `parent` (`ctr snapshots mounts`, printed as a
/// `mount` command): one `overlay` whose upper and work directories are
/// the snapshot's and whose only lower directory is the parent's chain
/// mount, itself (the second overlay level) a read-only overlay mounted by
/// the snapshotter like `cairn mount`: the chain's EROFS image as a lower
/// layer (by fd, `lowerdir+`), the store's objects as its data-only layer
/// (`datadir+`), metacopy on, the mount's source naming the image file.
fn check_rootfs_mount(ds: &Daemons, mount: &str, parent: &str) {
    let store = ds.dir.path().join("store");
    let (cmd, opts) = mount
        .trim()
        .rsplit_once(" -o ")
        .unwrap_or_else(|| panic!("no options: {mount}"));
    assert!(cmd.starts_with("mount -t overlay overlay "), "{mount}");
    let opts: Vec<&str> = opts.split(',').collect();
    let opt = |k: &str| -> &str {
        let v: Vec<&str> = opts.iter().filter_map(|o| o.strip_prefix(k)).collect();
        assert_eq!(v.len(), 1, "one {k} in {mount}");
        v[0]
    };
    assert!(opts.contains(&"index=off"), "{mount}");
    let upper = Path::new(opt("upperdir="));
    let work = Path::new(opt("workdir="));
    assert!(
        upper.starts_with(store.join("snapshots"))
            && upper.ends_with("fs")
            && work.parent() == upper.parent()
            && work.ends_with("work"),
        "upper and work directories of the snapshot's own: {mount}"
    );
    let lower = opt("lowerdir=");
    assert!(!lower.contains(':'), "one lower directory: {mount}");
    let chains = store.join("snapshots/chains");
    assert_eq!(
        Path::new(lower).parent(),
        Some(chains.as_path()),
        "the lower directory is a chain mount: {mount}"
    );
    // The chain mount, in the mount table (the usage probe's own
    // Prepare mounted it, if no container had).
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mi
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(lower))
        .unwrap_or_else(|| panic!("{lower} (the chain of {parent}) is not mounted"));
    let (_, after) = line.split_once(" - ").unwrap();
    let f: Vec<&str> = after.split(' ').collect();
    let (fstype, source, superopts) = (f[0], f[1], f[2]);
    assert_eq!(fstype, "overlay", "{line}");
    let image = Path::new(lower).file_name().unwrap();
    assert_eq!(
        Path::new(source),
        store.join("images").join(image),
        "the chain mount's source names its image file: {line}"
    );
    let superopts: Vec<&str> = superopts.split(',').collect();
    for want in ["ro", "metacopy=on", "redirect_dir=on"] {
        assert!(superopts.contains(&want), "{want} in {line}");
    }
    for want in ["lowerdir+=", "datadir+="] {
        assert_eq!(
            superopts.iter().filter(|o| o.starts_with(want)).count(),
            1,
            "one {want} in {line}"
        );
    }
}

/// The owners, mode bits (setuid, setgid, sticky) and xattrs the test
/// image's busybox layer gives some entries (`debian_metadata` in
/// support/snapshotter.rs) are in `tree`, the mount of the image by `what`.
fn check_debian_metadata(tree: &Snapshot, what: &str) {
    let xattr = |k: &str, v: &[u8]| (k.as_bytes().to_vec(), v.to_vec());
    // Path, mode, owner, xattrs (sorted by name).
    let want = [
        ("tmp", 0o041777, (0, 0), vec![]),
        ("etc/shadow", 0o100640, (0, 42), vec![]),
        ("bin/su", 0o104755, (0, 0), vec![]),
        ("bin/wall", 0o102755, (0, 5), vec![]),
        (
            "bin/ping",
            0o100755,
            (0, 0),
            vec![
                xattr("security.capability", &CAP_NET_RAW_EP),
                xattr("user.cairn.origin", b"iputils-ping"),
            ],
        ),
        ("srv/shared", 0o041777, (0, 0), vec![]),
        (
            "srv/www",
            0o042775,
            (33, 33),
            vec![xattr("user.cairn.site", b"www")],
        ),
        (
            "srv/www/index.html",
            0o100644,
            (33, 33),
            vec![xattr("user.mime_type", b"text/html")],
        ),
        ("srv/home/user", 0o040750, (1000, 1000), vec![]),
        ("srv/home/user/secret", 0o100600, (1000, 1000), vec![]),
        ("srv/home/user/profile-link", 0o120777, (1000, 1000), vec![]),
    ];
    for (path, mode, (uid, gid), xattrs) in want {
        let e = tree
            .entries
            .get(path.as_bytes())
            .unwrap_or_else(|| panic!("{what}: no {path}"));
        assert_eq!(
            (
                e.mode,
                e.uid,
                e.gid,
                e.xattrs.clone().into_iter().collect::<Vec<_>>()
            ),
            (mode, uid, gid, xattrs),
            "{what}: {path} (mode, uid, gid, xattrs)"
        );
    }
}

/// `ctr images rm --sync` of `references` (every name of the image's
/// manifest: its config blob's gc labels keep the snapshots of every
/// snapshotter), then waits until cairn has no snapshot left (containerd's
/// gc removes them).
fn wait_for_image_removal(ds: &Daemons, references: &[&str]) {
    let mut args = vec!["images", "rm", "--sync"];
    args.extend(references);
    ds.ctr(&args);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listed = ds.ctr(&["snapshots", "--snapshotter", "cairn", "ls"]);
        if listed.lines().nth(1).is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "snapshots left after the image's removal: {listed}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Restart safety: a container started with cairn keeps running, its root
/// filesystem readable, while the snapshotter is killed (SIGKILL) and
/// restarted on the same store; afterwards a new container runs.
#[test]
fn privileged_snapshotter_restart_while_running() {
    restart_while_running(Ctd::V16);
}

/// The same against containerd 2.4.2.
#[test]
fn privileged_snapshotter_containerd2_restart_while_running() {
    restart_while_running(Ctd::V24);
}

fn restart_while_running(v: Ctd) {
    require_root();
    let reg = LocalRegistry::start();
    let reference = push_image(&reg);
    let mut ds = Daemons::start(v);
    ds.pull("cairn", &reference);
    let id = "long-running";
    ds.run_detached(&reference, id);
    // Stops the container whatever happens below.
    struct Stop<'a>(&'a Daemons, &'a str);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            let _ = self.0.ctr_out(&["task", "kill", "-s", "SIGKILL", self.1]);
            for _ in 0..100 {
                if self.0.ctr_out(&["task", "rm", self.1]).status.success() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.0.ctr_out(&["containers", "rm", self.1]);
        }
    }
    let exec = |ds: &Daemons, n: u32| {
        ds.exec_to_file(
            id,
            &format!("cat{n}"),
            "/busybox/busybox cat /etc/os-release /srv/top",
        )
    };
    let before = exec(&ds, 0);
    assert_eq!(before.len(), 27 + 300_000, "/etc/os-release and /srv/top");

    ds.kill_and_restart_snapshotter();
    // Killed and not yet restarted is the harder case: check in between
    // too (a second kill leaves no snapshotter while we look).
    ds.snapshotter.kill().unwrap();
    ds.snapshotter.wait().unwrap();
    let tasks = ds.ctr(&["task", "ls"]);
    assert!(
        tasks
            .lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING")),
        "the container stopped with the snapshotter: {tasks}"
    );
    assert_eq!(exec(&ds, 1), before, "rootfs read with no snapshotter");
    ds.snapshotter = spawn_snapshotter(ds.dir.path(), &ds.snap_args);
    let _stop = Stop(&ds, id);
    assert_eq!(exec(&ds, 2), before, "rootfs read after the restart");
    let tasks = ds.ctr(&["task", "ls"]);
    assert!(
        tasks
            .lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING")),
        "{tasks}"
    );
    // containerd's connection to a proxy snapshotter comes back on its
    // own (gRPC backoff, at most 3 s in containerd 1.6); calls made while
    // it is down fail with `Unavailable`, which clients retry.
    let snaps = |ds: &Daemons| ds.ctr_out(&["snapshots", "--snapshotter", "cairn", "ls"]);
    wait_for(
        "containerd's connection to the restarted snapshotter",
        || snaps(&ds).status.success(),
    );
    let listed = String::from_utf8_lossy(&snaps(&ds).stdout).into_owned();
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with(id) && l.contains("Active")),
        "the running container's snapshot after the restart: {listed}"
    );
    // A new container, on the same chain, after the restart.
    let out = ds.run_test_script("cairn", &reference, "after-restart");
    assert!(out.contains("hello"), "{out}");
    // The chain mount was adopted, not mounted twice.
    let store = ds.dir.path().join("store");
    let mut targets = chain_mounts(&store);
    targets.sort();
    let n = targets.len();
    targets.dedup();
    assert_eq!(n, targets.len(), "a chain image mounted twice: {targets:?}");
    assert!(n >= 1, "no chain mount while the container runs");
}

// ---------------------------------------------------------------------
// The remote path: containerd pulls with the CRI's layer labels and cairn
// pulls the layers itself.
// ---------------------------------------------------------------------

/// A TCP relay on 127.0.0.1 that records each HTTP request passing
/// through it (request line, User-Agent and Range). Registry clients send no
/// bodies with GET and HEAD, so the client-to-server stream is a sequence
/// of header blocks.
struct CountingProxy {
    addr: String,
    requests: std::sync::Arc<std::sync::Mutex<Vec<Request>>>,
    /// While set, requests from cairn (its User-Agent) are held back.
    stall_cairn: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl CountingProxy {
    fn start(upstream: &str) -> CountingProxy {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stall_cairn = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (up, reqs, stall) = (upstream.to_owned(), requests.clone(), stall_cairn.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(mut client) = client else { continue };
                let Ok(mut server) = TcpStream::connect(&up) else {
                    continue;
                };
                let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s2, &mut c2);
                    let _ = c2.shutdown(std::net::Shutdown::Both);
                });
                let reqs = reqs.clone();
                let stall = stall.clone();
                std::thread::spawn(move || {
                    let mut pending = Vec::new();
                    let mut buf = [0u8; 16384];
                    loop {
                        let n = match client.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        pending.extend_from_slice(&buf[..n]);
                        while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&pending[..end]).into_owned();
                            pending.drain(..end + 4);
                            let line = head.lines().next().unwrap_or("").to_owned();
                            let header = |name: &str| {
                                head.lines().find_map(|l| {
                                    l.split_once(':')
                                        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                                        .map(|(_, v)| v.trim().to_owned())
                                })
                            };
                            let ua = header("user-agent").unwrap_or_default();
                            let range = header("range");
                            let held = ua.starts_with("cairn/");
                            reqs.lock().unwrap().push(Request {
                                line,
                                ua,
                                range,
                                at: std::time::SystemTime::now(),
                            });
                            while held && stall.load(std::sync::atomic::Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                        if server.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = server.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        CountingProxy {
            addr,
            requests,
            stall_cairn,
        }
    }

    /// `(user agent, digest)` of every blob GET so far.
    /// The User-Agents of every GET of blob `digest` so far.
    fn fetchers(&self, digest: &str) -> Vec<String> {
        self.blob_gets()
            .into_iter()
            .filter(|(_, d)| d == digest)
            .map(|(ua, _)| ua)
            .collect()
    }

    /// Each of `digests` was fetched exactly once, and by cairn (its
    /// User-Agent).
    fn assert_fetched_once_by_cairn(&self, digests: &[String]) {
        for d in digests {
            let by = self.fetchers(d);
            assert!(
                by.len() == 1 && by[0].starts_with("cairn/"),
                "blob {d} fetched by {by:?}: {:#?}",
                self.blob_gets()
            );
        }
    }

    fn blob_gets(&self) -> Vec<(String, String)> {
        self.blob_range_gets()
            .into_iter()
            .map(|(ua, d, _)| (ua, d))
            .collect()
    }

    /// `(user agent, digest)` of every blob GET that arrived before `t`.
    fn blob_gets_before(&self, t: std::time::SystemTime) -> Vec<(String, String)> {
        let before: Vec<Request> = self
            .requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.at < t)
            .cloned()
            .collect();
        before
            .iter()
            .filter_map(|r| {
                let path = r.line.strip_prefix("GET ")?.split(' ').next()?;
                let (_, d) = path.split_once("/blobs/")?;
                Some((r.ua.clone(), d.to_owned()))
            })
            .collect()
    }

    /// `(user agent, digest, bytes asked for)` of every blob GET so far;
    /// `None` for a GET of the whole blob (no `Range`, or one this does
    /// not read as a single `bytes=FIRST-LAST`).
    fn blob_range_gets(&self) -> Vec<(String, String, Option<u64>)> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter_map(|r| {
                let path = r.line.strip_prefix("GET ")?.split(' ').next()?;
                let (_, d) = path.split_once("/blobs/")?;
                let len = r.range.as_deref().and_then(|v| {
                    let (a, b) = v.strip_prefix("bytes=")?.split_once('-')?;
                    let (a, b) = (a.parse::<u64>().ok()?, b.parse::<u64>().ok()?);
                    (b >= a).then(|| b - a + 1)
                });
                Some((r.ua.clone(), d.to_owned(), len))
            })
            .collect()
    }
}

/// One request through a [`CountingProxy`].
#[derive(Clone)]
struct Request {
    line: String,
    ua: String,
    range: Option<String>,
    /// When its head arrived.
    at: std::time::SystemTime,
}

/// When the last line of the snapshotter's `log` that contains `what` was
/// written (its leading timestamp, `2026-12-03T14:57:00.031205Z`, UTC).
fn last_logged(log: &str, what: &str) -> std::time::SystemTime {
    let line = log
        .lines()
        .rfind(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no {what:?} in the snapshotter's log:\n{log}"));
    let stamp = line.split_whitespace().next().unwrap_or_default();
    let n = |r: std::ops::Range<usize>| -> i64 {
        stamp
            .get(r)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no timestamp at the start of {line:?}"))
    };
    let (y, mo, d, h, mi, sec) = (n(0..4), n(5..7), n(8..10), n(11..13), n(14..16), n(17..19));
    let frac = stamp.get(20..).unwrap_or("").trim_end_matches('Z');
    let nanos: u32 = format!("{frac:0<9}")[..9].parse().unwrap_or(0);
    // Days since 1970-01-01 of a proleptic Gregorian date.
    let (y, mp) = if mo <= 2 {
        (y - 1, mo + 9)
    } else {
        (y, mo - 3)
    };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let secs = days * 86_400 + h * 3_600 + mi * 60 + sec;
    std::time::UNIX_EPOCH + Duration::new(secs as u64, nanos)
}

#[test]
fn privileged_snapshotter_remote_pull() {
    remote_pull(Ctd::V16);
}

/// The same with containerd 2.4.2 and its client.
#[test]
fn privileged_snapshotter_containerd2_remote_pull() {
    remote_pull(Ctd::V24);
}

fn remote_pull(v: Ctd) {
    require_root();
    let rpull = build_rpull(v);
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    let ds = Daemons::start(v);
    let log = || ds.log();
    ds.rpull(&rpull, &reference, &[]);
    // Every layer went through the remote path.
    let pulled = log().matches("pulled by cairn").count();
    assert_eq!(
        pulled,
        5,
        "layers pulled by cairn, snapshotter log:\n{}",
        log()
    );
    // Each layer blob was fetched once, by cairn; containerd fetched only
    // the manifest and the config.
    proxy.assert_fetched_once_by_cairn(&layer_digests(&manifest_at(&upstream, TAG)));
    // The image runs, and prints what the normal path prints.
    let run = |sn: &str, image: &str| ds.run_test_script(sn, image, &format!("remote-{sn}"));
    let remote = run("cairn", &reference);
    ds.pull("overlayfs", &direct);
    let normal = run("overlayfs", &direct);
    assert_same_as_overlayfs(&remote, &normal, "the remote path's container");
    // The layers above the first were placed in the image the first
    // layer's Prepare pulled: a layer below the top gets its own chain
    // image when something mounts it, assembled from the store's layer
    // records without a pull.
    let second = &second_layer(&ds);
    prepare_on_layer_two(&ds, second);
    assert!(
        log().contains("assembling its chain's image")
            && !log().contains("pulling the image in full"),
        "{}",
        log()
    );
    ds.ctr(&["snapshots", "--snapshotter", "cairn", "rm", "on-the-second"]);
    // Only the first layer's Prepare pulled (it tried the lazy path first,
    // the image has no artifact): the four above it were placed in the
    // image it pulled, without a request.
    assert_eq!(
        log().matches("not lazily").count(),
        1,
        "Prepares that pulled, snapshotter log:\n{}",
        log()
    );
    cairn_ok_at(&ds.dir.path().join("store"), &["fsck"]);
}

// ---------------------------------------------------------------------
// The lazy remote path: the image has a cairn lazy artifact (`cairn
// push`), and the remote path pulls only its metadata.
// ---------------------------------------------------------------------

/// The lazy remote path, and a restart of the snapshotter under a
/// container whose rootfs stands on a lazy chain mount: containerd pulls
/// with the CRI's labels (the Go client), every layer is committed from
/// the image's cairn lazy artifact, no layer blob and no pack is fetched
/// by the pull; `ctr run` prints what containerd's overlayfs snapshotter
/// prints, fetching (by range) only what it reads; the snapshotter is
/// SIGKILLed while a container runs, which keeps reading files not
/// fetched before (the lazy server is not the snapshotter's), a new
/// snapshotter adopts the chain mount and a new `ctr run` works.
#[test]
fn privileged_snapshotter_lazy_remote_pull_and_restart() {
    lazy_remote_pull_and_restart(Ctd::V16);
}

/// The same with containerd 2.4.2 and its client.
#[test]
fn privileged_snapshotter_containerd2_lazy_remote_pull_and_restart() {
    lazy_remote_pull_and_restart(Ctd::V24);
}

fn lazy_remote_pull_and_restart(v: Ctd) {
    require_root();
    let rpull = build_rpull(v);
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    let (packs, erofs) = push_lazy_artifact(&direct, &upstream);
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    // On demand and one object a request: what is fetched is what is read.
    let mut ds = Daemons::start_with(v, &["--lazy-fetch", "on-demand", "--coalesce", "0"]);
    let log = |ds: &Daemons| ds.log();
    ds.rpull(&rpull, &reference, &[]);
    assert_eq!(
        log(&ds).matches("pulled lazily by cairn").count(),
        5,
        "layers pulled lazily, snapshotter log:\n{}",
        log(&ds)
    );
    let layers: BTreeSet<String> = manifest_at(&upstream, TAG)["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_owned())
        .collect();
    let gets = |what: &BTreeSet<String>| {
        proxy
            .blob_gets()
            .into_iter()
            .filter(|(_, d)| what.contains(d))
            .count()
    };
    assert_eq!(
        gets(&layers),
        0,
        "layer blobs fetched: {:#?}",
        proxy.blob_gets()
    );
    // No pack by the Prepares. The top layer's chain is mounted as its
    // Prepare answers, and its lazy server fetches the start files at
    // once, maybe before containerd's pull returns: what came after the
    // last layer's lazy pull was logged is the server's.
    let pulled = last_logged(&log(&ds), "pulled lazily by cairn");
    let by_prepare = proxy.blob_gets_before(pulled);
    assert!(
        !by_prepare.iter().any(|(_, d)| packs.contains(d)),
        "packs fetched by the pull: {by_prepare:#?}"
    );
    // The metadata once, by the first layer's Prepare: the layers above it
    // are placed in the image their parent names.
    let erofs: BTreeSet<String> = [erofs].into();
    assert_eq!(
        gets(&erofs),
        1,
        "EROFS blob fetches: {:#?}",
        proxy.blob_gets()
    );

    // The image runs, and prints what the normal path prints.
    let run = |ds: &Daemons, sn: &str, image: &str, id: &str| ds.run_test_script(sn, image, id);
    let lazy = run(&ds, "cairn", &reference, "lazy-1");
    let read_by_run = gets(&packs);
    assert!(read_by_run > 0, "nothing fetched by the run");
    ds.pull("overlayfs", &direct);
    let normal = run(&ds, "overlayfs", &direct, "normal-1");
    assert_same_as_overlayfs(&lazy, &normal, "the lazy remote path's container");
    assert_eq!(gets(&layers), 0, "layer blobs fetched by cairn");

    // A container stays up across a SIGKILL of the snapshotter.
    let id = "lazy-long";
    ds.run_detached(&reference, id);
    let cat = |ds: &Daemons, n: u32, path: &str| {
        String::from_utf8(ds.exec_to_file(
            id,
            &format!("cat{n}"),
            &format!("/busybox/busybox cat {path}"),
        ))
        .unwrap()
    };
    let expect =
        |i: usize| String::from_utf8(support::images::text(500 + i, 20_000 + i as u64)).unwrap();
    // A wrong read fails with what tells a wrong file from lost output:
    // the length read, a second read, the file's size as `wc -c` reads it
    // in the container, and the snapshotter's log (CI once saw an empty
    // read of new000.txt).
    let check = |ds: &Daemons, n: u32, path: &str, i: usize| {
        let (got, want) = (cat(ds, n, path), expect(i));
        if got != want {
            let again = cat(ds, n + 100, path);
            let sum = ds.ctr_out(&[
                "task",
                "exec",
                "--exec-id",
                &format!("wc{n}"),
                id,
                "/busybox/busybox",
                "wc",
                "-c",
                path,
            ]);
            panic!(
                "{path}: read {} bytes, want {}; read again: {} bytes ({}); wc -c in the \
                 container: {}{}\nsnapshotter log:\n{}",
                got.len(),
                want.len(),
                again.len(),
                if again == want { "right" } else { "wrong" },
                String::from_utf8_lossy(&sum.stdout),
                String::from_utf8_lossy(&sum.stderr),
                ds.log()
            );
        }
    };
    check(&ds, 0, "/usr/lib/new000.txt", 0);
    ds.snapshotter.kill().unwrap();
    ds.snapshotter.wait().unwrap();
    let fetched = gets(&packs);
    // Not read before (the script only lists these): fetched now, with no
    // snapshotter running.
    check(&ds, 1, "/usr/lib/new050.txt", 50);
    assert!(
        gets(&packs) > fetched,
        "/usr/lib/new050.txt was not fetched after the kill"
    );
    let tasks = ds.ctr(&["task", "ls"]);
    assert!(
        tasks
            .lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING")),
        "the container stopped with the snapshotter: {tasks}"
    );
    ds.snapshotter = spawn_snapshotter(ds.dir.path(), &ds.snap_args);
    struct Stop<'a>(&'a Daemons, &'a str);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            let _ = self.0.ctr_out(&["task", "kill", "-s", "SIGKILL", self.1]);
            for _ in 0..100 {
                if self.0.ctr_out(&["task", "rm", self.1]).status.success() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.0.ctr_out(&["containers", "rm", self.1]);
        }
    }
    let stop = Stop(&ds, id);
    check(&ds, 2, "/usr/lib/new077.txt", 77);
    let snaps = |ds: &Daemons| ds.ctr_out(&["snapshots", "--snapshotter", "cairn", "ls"]);
    wait_for(
        "containerd's connection to the restarted snapshotter",
        || snaps(&ds).status.success(),
    );
    // A new container on the same chain: the chain mount is adopted, not
    // mounted twice.
    let again = run(&ds, "cairn", &reference, "lazy-2");
    assert_same_as_overlayfs(&again, &normal, "a new container after the restart");
    let mut targets = chain_mounts(&ds.dir.path().join("store"));
    targets.sort();
    let n = targets.len();
    targets.dedup();
    assert_eq!(n, targets.len(), "a chain image mounted twice: {targets:?}");
    assert_eq!(n, 1, "chain mounts while the container runs: {targets:?}");
    drop(stop);
    assert_eq!(gets(&layers), 0, "layer blobs fetched");

    // A snapshot on an intermediate layer (the artifact has the whole image's
    // tree only): the image is pulled in full and the chain's own image
    // mounted.
    let second = &second_layer(&ds);
    let listed = ds.ctr(&["snapshots", "--snapshotter", "cairn", "ls"]);
    let rows = snapshot_rows(&listed);
    // A snapshot committed on the top layer (a container committed as an
    // image): the store has no layer records of a lazily pulled chain, so
    // the commit pulls the image in full first.
    let committed: Vec<&Vec<&str>> = rows
        .iter()
        .filter(|r| r.last() == Some(&"Committed"))
        .collect();
    let top = committed
        .iter()
        .find(|r| !committed.iter().any(|c| c.len() == 3 && c[1] == r[0]))
        .unwrap_or_else(|| panic!("no top layer: {listed}"))[0];
    ds.ctr(&[
        "snapshots",
        "--snapshotter",
        "cairn",
        "prepare",
        "on-top",
        top,
    ]);
    ds.ctr(&[
        "snapshots",
        "--snapshotter",
        "cairn",
        "commit",
        "on-top-committed",
        "on-top",
    ]);
    ds.ctr(&[
        "snapshots",
        "--snapshotter",
        "cairn",
        "rm",
        "on-top-committed",
    ]);
    assert!(
        log(&ds).contains("pulling the image in full for its layer records"),
        "{}",
        log(&ds)
    );
    // An active snapshot on the intermediate layer, not a `ctr snapshots
    // view`: ctr labels what it prepares as a gc root and leaves its views
    // unlabelled and unleased, so containerd's gc (due after the removal
    // above) may take a view between two ctr calls, as it once did in CI.
    prepare_on_layer_two(&ds, second);
    assert!(
        log(&ds).contains("pulling the image in full"),
        "{}",
        log(&ds)
    );
    ds.ctr(&["snapshots", "--snapshotter", "cairn", "rm", "on-the-second"]);
    // The image removed (under both its names: the same manifest): its
    // snapshots go (containerd's gc removes them), the chain mounts with
    // them, and the lazy servers with those (a supervisor removes its pid
    // file as it exits).
    wait_for_image_removal(&ds, &[&reference, &direct]);
    let store = ds.dir.path().join("store");
    let servers = || {
        std::fs::read_dir(store.join("lazy"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(".pid"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let mounted = || chain_mounts(&store);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !servers().is_empty() || !mounted().is_empty() {
        assert!(
            Instant::now() < deadline,
            "with no snapshot using them: chain mounts {:?}, lazy servers {:?}\n{}",
            mounted(),
            servers(),
            ds.ctr(&["snapshots", "--snapshotter", "cairn", "ls"])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    cairn_ok_at(&store, &["fsck"]);
}

/// The lazy remote path when the layers carry no `cri.manifest-digest`
/// (the Go client strips it): the image ref is resolved once, by the
/// bottom layer's Prepare, and the four layers above it are placed in
/// the image that pull made (the snapshotter remembers what the ref
/// resolved to for a minute): cairn asks for the image's manifest and the
/// artifact's EROFS blob once, not once per layer. The image runs.
#[test]
fn privileged_snapshotter_lazy_remote_pull_without_manifest_digest() {
    require_root();
    let v = Ctd::V16;
    let rpull = build_rpull(v);
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    let (_, erofs) = push_lazy_artifact(&direct, &upstream);
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    let ds = Daemons::start_with(v, &["--lazy-fetch", "on-demand"]);
    let log = || ds.log();
    ds.rpull(&rpull, &reference, &[("RPULL_NO_MANIFEST_DIGEST", "1")]);
    assert_eq!(
        log().matches("pulled lazily by cairn").count(),
        5,
        "layers pulled lazily, snapshotter log:\n{}",
        log()
    );
    let manifest_requests = || {
        proxy
            .requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| {
                r.ua.starts_with("cairn/")
                    && r.line.contains(&format!("/v2/{REPO}/manifests/{TAG} "))
            })
            .count()
    };
    // What one lazy pull of the image asks for (a `cairn pull --lazy`
    // into a scratch store, through the same proxy).
    let one_pull = {
        let before = manifest_requests();
        let scratch = tempfile::Builder::new()
            .prefix("cairn-lazy-one-")
            .tempdir_in("/var/tmp")
            .unwrap();
        cairn_ok_at(scratch.path(), &["pull", "-q", "--lazy", &reference]);
        manifest_requests() - before
    };
    assert!(one_pull >= 1);
    assert_eq!(
        manifest_requests() - one_pull,
        one_pull,
        "cairn's requests for the image's manifest: five layers should cost one lazy pull's \
         ({one_pull})"
    );
    let erofs_gets = proxy
        .blob_gets()
        .into_iter()
        .filter(|(_, d)| *d == erofs)
        .count();
    assert_eq!(
        erofs_gets,
        2,
        "EROFS blob fetches (the snapshotter's and the scratch pull's): {:#?}",
        proxy.blob_gets()
    );
    let out = ds.run_script(
        "cairn",
        &reference,
        "no-digest",
        &["/busybox/busybox", "sh"],
        "/busybox/busybox cat /etc/os-release",
    );
    assert!(out.contains("ID=cairn-test"), "{out}");
}

// ---------------------------------------------------------------------
// The lazy remote path for an eStargz image (no cairn artifact; every
// layer annotated with its TOC's digest): the metadata comes from the
// layers' tables of contents, read by range.
// ---------------------------------------------------------------------

/// What the eStargz test image's container prints: the upper layer's
/// files, a whiteout and an opaque directory at work, modes, owners and
/// sizes (of `/data/big` too, which is not read), and a write. (`cairn
/// run` adds /etc/hostname, hosts and resolv.conf; `ctr run` does not.)
const ESGZ_SCRIPT: &str = "cat /etc/msg; ls /usr/lib /bin; \
    ls /etc | grep -vx -e hostname -e hosts -e resolv.conf; \
    stat -c '%n %a %u:%g %s %Y' /etc/msg /usr/lib/new /bin/busybox /bin/ls /data/big; \
    md5sum /usr/lib/new; test -e /etc/gone || echo gone is gone; \
    echo written > /etc/written && cat /etc/written";

/// An eStargz image made by stargz-snapshotter's converter
/// (`support::estargz`), pulled by containerd with the CRI's labels into
/// cairn through the counting proxy, with the snapshotter started
/// `--lazy-fetch on-demand --coalesce 0`: both layers are committed
/// lazily, from the TOCs alone (only ranged GETs of the layer blobs, all
/// by cairn); the top's chain is mounted right after the pull, and its
/// server fetches the prefetch landmark's files with no container
/// running; `ctr run` prints what `cairn run` of a full pull prints,
/// fetching only the other files it reads (not the 5 MiB `/data/big`);
/// once the image is removed from containerd, its snapshots, refs, chain
/// mounts and lazy servers are gone.
#[test]
fn privileged_snapshotter_estargz_lazy_remote_pull() {
    estargz_lazy_remote_pull(Ctd::V16);
}

/// The same with containerd 2.4.2 and its client.
#[test]
fn privileged_snapshotter_containerd2_estargz_lazy_remote_pull() {
    estargz_lazy_remote_pull(Ctd::V24);
}

/// The two versions' eStargz tests run one at a time: they make the same
/// image, so the same chain image digest, and cairn's gc keeps an image of
/// its store that is mounted anywhere (by digest, from any store): the
/// other test's chain mount would keep this one's objects.
static ESTARGZ: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn estargz_lazy_remote_pull(v: Ctd) {
    require_root();
    let _one_at_a_time = ESTARGZ.lock().unwrap_or_else(|p| p.into_inner());
    let t0 = Instant::now();
    let lap = |what: &str| eprintln!("{:6.1}s {what}", t0.elapsed().as_secs_f64());
    let rpull = build_rpull(v);
    lap("rpull built");
    let reg = LocalRegistry::start();
    // Converted on a containerd of its own, stopped once it has pushed.
    let esgz = {
        let conv = support::containerd::Containerd::start();
        support::estargz::publish_estargz(&conv, &reg).1
    };
    lap("eStargz image published");
    let proxy = CountingProxy::start(&reg.addr);
    let reference = esgz.replacen(&reg.addr, &proxy.addr, 1);
    let command = ["/bin/sh", "-c", ESGZ_SCRIPT];

    // What the image prints when pulled in full and run by cairn.
    let scratch = tempfile::Builder::new()
        .prefix("cairn-esgz-full-")
        .tempdir_in("/var/tmp")
        .unwrap();
    support::cairn_ok(scratch.path(), &["pull", "-q", &esgz]);
    let mut args = vec!["run", esgz.as_str()];
    args.extend(command);
    let expected = support::cairn_ok(scratch.path(), &args);
    assert!(
        expected.contains("upper layer") && expected.contains("gone is gone"),
        "{expected}"
    );
    drop(scratch);
    lap("cairn run of the full pull");

    let ds = Daemons::start_with(v, &["--lazy-fetch", "on-demand", "--coalesce", "0"]);
    let log = |ds: &Daemons| ds.log();
    ds.rpull(&rpull, &reference, &[]);
    lap("pulled");
    assert_eq!(
        log(&ds).matches("pulled lazily by cairn").count(),
        2,
        "layers pulled lazily, snapshotter log:\n{}",
        log(&ds)
    );
    let manifest = {
        let (repo, tag) = esgz.split_once('/').unwrap().1.rsplit_once(':').unwrap();
        manifest_of(&reg.addr, repo, tag)
    };
    let layers: BTreeSet<String> = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            assert!(
                l["annotations"]["containerd.io/snapshot/stargz/toc.digest"].is_string(),
                "not an eStargz layer: {l}"
            );
            l["digest"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(layers.len(), 2);
    // Layer blob GETs: (whole-blob GETs, bytes asked for by range).
    let layer_gets = || {
        let mut whole = Vec::new();
        let mut ranged = 0u64;
        for (ua, d, len) in proxy.blob_range_gets() {
            if !layers.contains(&d) {
                continue;
            }
            assert!(ua.starts_with("cairn/"), "layer {d} fetched by {ua:?}");
            match len {
                Some(n) => ranged += n,
                None => whole.push(d),
            }
        }
        (whole, ranged)
    };
    let store = ds.dir.path().join("store");
    let objects = || {
        std::fs::read_dir(store.join("objects"))
            .map(|d| {
                d.flatten()
                    .flat_map(|f| std::fs::read_dir(f.path()).into_iter().flatten().flatten())
                    .count()
            })
            .unwrap_or(0)
    };
    // The top layer's chain is mounted as soon as the pull has placed it,
    // before any container: its lazy server fetches the files before the
    // prefetch landmark (busybox, /etc/msg) with nothing running.
    let deadline = Instant::now() + Duration::from_secs(30);
    while objects() < 2 || !log(&ds).contains("mounted ahead of its first container") {
        assert!(
            Instant::now() < deadline,
            "30 s after the pull, with no container: {} objects stored (want busybox and \
             /etc/msg), snapshotter log:\n{}",
            objects(),
            log(&ds)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (whole, ahead) = layer_gets();
    assert!(
        whole.is_empty(),
        "whole layer blobs fetched by the pull: {whole:?}"
    );
    assert!(
        ahead > 0 && ahead < 5 << 20,
        "the pull and the chain's server asked for {ahead} bytes of the layers (footers and \
         TOCs are a few KB, busybox ~1 MB compressed, /data/big 5 MiB): {:#?}",
        proxy.blob_range_gets()
    );
    assert_eq!(
        objects(),
        2,
        "objects stored before the run: the landmark's"
    );

    // The container prints what cairn's full pull prints, and only what it
    // read came over the wire: /usr/lib/new (md5sum), not the 5 MiB of
    // /data/big.
    let got = ds.run_script("cairn", &reference, "esgz-1", &["/bin/sh"], ESGZ_SCRIPT);
    assert_same_output(&got, &expected, "the lazy eStargz container");
    let (whole, bytes) = layer_gets();
    lap(&format!(
        "ctr run: {ahead} bytes of the layers asked for by the pull and the landmark's fetch, {} \
         by the run",
        bytes - ahead
    ));
    assert!(
        whole.is_empty(),
        "whole layer blobs fetched by the run: {whole:?}"
    );
    let read_by_run = bytes - ahead;
    assert!(
        read_by_run > 0 && read_by_run < 5 << 20,
        "the run asked for {read_by_run} bytes of the layers (/usr/lib/new is small, /data/big \
         5 MiB, not read)"
    );
    assert_eq!(
        objects(),
        3,
        "objects stored: the landmark's and the file read (busybox, msg, new)"
    );

    // The container is gone, its chain mount and lazy server are not: the
    // image's top snapshot keeps them, and the next container of the
    // image starts on the same mount, served by the same process.
    let chains = format!("{}/", store.join("snapshots/chains").display());
    // (mount id, mount point) of the chain mounts.
    let mounted = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 4 && f[4].starts_with(&chains))
                    .then(|| (f[0].to_owned(), f[4].to_owned()))
            })
            .collect::<Vec<_>>()
    };
    // (pid file, supervisor and worker lines) of the lazy servers.
    let servers = || {
        std::fs::read_dir(store.join("lazy"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".pid"))
                    .map(|e| {
                        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                        let pids: Vec<&str> = text
                            .lines()
                            .filter(|l| l.starts_with("supervisor ") || l.starts_with("worker "))
                            .collect();
                        (
                            e.file_name().to_string_lossy().into_owned(),
                            pids.join(", "),
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let (mounts, served) = (mounted(), servers());
    assert_eq!(
        mounts.len(),
        1,
        "chain mounts after ctr run --rm: {mounts:?}"
    );
    assert_eq!(
        served.len(),
        1,
        "lazy servers after ctr run --rm: {served:?}"
    );
    let again = ds.run_script("cairn", &reference, "esgz-2", &["/bin/sh"], ESGZ_SCRIPT);
    assert_same_output(&again, &expected, "the second container");
    assert_eq!(mounted(), mounts, "the second container's chain mount");
    assert_eq!(servers(), served, "the second container's lazy server");
    lap("a second container on the same chain mount and server");
    let released = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !servers().is_empty() || !mounted().is_empty() {
            assert!(
                Instant::now() < deadline,
                "{what}: chain mounts {:?}, lazy servers {:?}",
                mounted(),
                servers()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // The image removed from containerd: its snapshots go (containerd's gc
    // removes them), and with them the refs that kept the image in the
    // store; cairn's gc then frees it.
    wait_for_image_removal(&ds, &[&reference]);
    released("after the image's removal");
    let images = support::cairn_ok(&store, &["images"]);
    assert!(!images.contains("containerd-snapshot-"), "{images}");
    let gc = support::cairn_ok(&store, &["gc"]);
    assert_eq!(
        objects(),
        0,
        "objects left after gc: {gc}\n{}\n{}",
        support::cairn_ok(&store, &["images"]),
        support::cairn_ok(&store, &["lazy", "list"])
    );
    let left: Vec<String> = std::fs::read_dir(store.join("images"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "images left after gc: {left:?}");
    support::assert_fsck_clean(&store, "after the eStargz image's removal and gc");
    lap("done");
}

/// SIGTERM while a remote Prepare waits for its pull (the registry holds
/// cairn's requests back): the snapshotter answers the Prepare (containerd's
/// pull fails), exits within seconds, records nothing of the pull (fsck
/// clean); restarted, the same pull goes through the remote path.
#[test]
fn privileged_snapshotter_sigterm_during_a_remote_pull() {
    require_root();
    let v = Ctd::V16;
    let rpull = build_rpull(v);
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    let mut ds = Daemons::start(v);
    proxy
        .stall_cairn
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let pull = || {
        Command::new(&rpull)
            .arg(ds.dir.path().join("containerd.sock"))
            .args([v.namespace(), "cairn", &reference])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = pull();
    wait_for("cairn's pull reaching the registry", || {
        proxy
            .requests
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.ua.starts_with("cairn/"))
    });
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(ds.snapshotter.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    while ds.snapshotter.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the snapshotter ignores SIGTERM during a remote pull"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = t.elapsed();
    assert!(took < Duration::from_secs(8), "stopped after {took:?}");
    let o = first.wait_with_output().unwrap();
    let dir = ds.dir.path().to_owned();
    let log = || std::fs::read_to_string(dir.join("snapshotter.log")).unwrap_or_default();
    assert!(
        !o.status.success(),
        "the pull went on without the snapshotter: {}",
        log()
    );
    assert!(log().contains("stopping"), "{}", log());
    assert_eq!(log().matches("pulled by cairn").count(), 0, "{}", log());
    let store = ds.dir.path().join("store");
    cairn_ok_at(&store, &["fsck"]);
    proxy
        .stall_cairn
        .store(false, std::sync::atomic::Ordering::SeqCst);
    ds.snapshotter = spawn_snapshotter(ds.dir.path(), &ds.snap_args);
    wait_for(
        "containerd's connection to the restarted snapshotter",
        || {
            ds.ctr_out(&["snapshots", "--snapshotter", "cairn", "ls"])
                .status
                .success()
        },
    );
    // Calls right after a restart may still meet containerd's stale
    // connection ("connection refused"): retried, as the kubelet does.
    let mut o = pull().wait_with_output().unwrap();
    for _ in 0..10 {
        if o.status.success() || !String::from_utf8_lossy(&o.stderr).contains("unavailable") {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
        o = pull().wait_with_output().unwrap();
    }
    assert!(
        o.status.success(),
        "rpull after the restart: {}{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        log()
    );
    assert_eq!(log().matches("pulled by cairn").count(), 5, "{}", log());
    cairn_ok_at(&store, &["fsck"]);
}

/// The lazy remote path with a prefetch list (issue 13, point 2): every
/// layer's Prepare answers with the metadata alone; then, with no
/// container yet, the top layer's chain is mounted and its lazy server
/// makes every listed object local (the list is fetched in the
/// background also with `--lazy-fetch on-demand`); a `ctr run` of
/// `/busybox/busybox true` then uses that mount and that server, not
/// new ones. containerd 1.6.
#[test]
fn privileged_snapshotter_lazy_remote_pull_fetches_the_prefetch_list_after_the_pull() {
    require_root();
    let v = Ctd::V16;
    let rpull = build_rpull(v);
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    // The artifact, with busybox and two more files on its prefetch list.
    let scratch = tempfile::Builder::new()
        .prefix("cairn-lazy-src-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let src = scratch.path().join("store");
    support::cairn_ok(&src, &["pull", "-q", &direct]);
    let dump = support::cairn_ok(&src, &["dump", &direct]);
    let backed: Vec<(String, String)> = dump
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 8 && f[8].len() == 65 && f[8].as_bytes()[2] == b'/')
                .then(|| (f[0].to_owned(), f[8].replace('/', "")))
        })
        .collect();
    let mut listed: Vec<(String, String)> = backed
        .iter()
        .filter(|(p, _)| p == "/busybox/busybox")
        .cloned()
        .collect();
    assert_eq!(listed.len(), 1, "{dump}");
    let busybox = listed[0].1.clone();
    listed.extend(
        backed
            .iter()
            .filter(|(_, h)| *h != busybox)
            .take(2)
            .cloned(),
    );
    assert_eq!(listed.len(), 3, "{dump}");
    let list = scratch.path().join("prefetch.txt");
    std::fs::write(
        &list,
        listed
            .iter()
            .map(|(p, _)| format!("{p}\n"))
            .collect::<String>(),
    )
    .unwrap();
    support::cairn_ok(
        &src,
        &[
            "push",
            "-q",
            "--prefetch",
            list.to_str().unwrap(),
            &direct,
            &format!("{upstream}/{REPO}:{TAG}-lazy"),
        ],
    );
    let packs: BTreeSet<String> = manifest_at(&upstream, &format!("{TAG}-lazy"))["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["mediaType"] == "application/vnd.cairn.lazy.v1.pack")
        .map(|l| l["digest"].as_str().unwrap().to_owned())
        .collect();
    assert!(!packs.is_empty());
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    let ds = Daemons::start_with(v, &["--lazy-fetch", "on-demand"]);
    let log = || ds.log();
    ds.rpull(&rpull, &reference, &[]);
    assert_eq!(
        log().matches("pulled lazily by cairn").count(),
        5,
        "{}",
        log()
    );
    let store = ds.dir.path().join("store");
    let local = || {
        listed
            .iter()
            .filter(|(_, h)| store.join("objects").join(&h[..2]).join(&h[2..]).exists())
            .count()
    };
    let stored = || {
        std::fs::read_dir(store.join("objects"))
            .map(|d| {
                d.flatten()
                    .flat_map(|f| std::fs::read_dir(f.path()).unwrap().flatten())
                    .count()
            })
            .unwrap_or(0)
    };
    let pack_gets = || {
        proxy
            .blob_gets()
            .into_iter()
            .filter(|(_, d)| packs.contains(d))
            .count()
    };
    // Prepare answered with the metadata alone; the top layer's chain is
    // then mounted at once, before any container, and its lazy server
    // fetches the list with nothing running.
    let mounted = || chain_mounts(&store);
    let servers = || {
        std::fs::read_dir(store.join("lazy"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".pid"))
                    .count()
            })
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while local() < listed.len() || mounted().is_empty() {
        assert!(
            Instant::now() < deadline,
            "30 s after the pull, with no container: {} of the listed {listed:?} local, chain \
             mounts {:?} ({} objects stored)\n{}",
            local(),
            mounted(),
            stored(),
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(pack_gets() > 0);
    assert!(
        log().contains("mounted ahead of its first container"),
        "{}",
        log()
    );
    assert_eq!(mounted().len(), 1, "chain mounts: {:?}", mounted());
    assert_eq!(servers(), 1, "lazy servers before the first container");

    // The first container finds the chain mounted: no second mount, no
    // second server.
    let out = ds.ctr(&[
        "run",
        "--rm",
        "--snapshotter",
        "cairn",
        &reference,
        "list-1",
        "/busybox/busybox",
        "true",
    ]);
    assert!(out.is_empty(), "{out}");
    assert_eq!(
        mounted().len(),
        1,
        "chain mounts after the run: {:?}",
        mounted()
    );
    assert_eq!(servers(), 1, "lazy servers after the run");
}

/// `ctr snapshots prepare on-the-second` on the second layer of the test
/// image: its mounts name that layer's chain mount, which holds layer 2's
/// tree and nothing of the layers above.
fn prepare_on_layer_two(ds: &Daemons, second: &str) {
    let prepared = ds.ctr(&[
        "snapshots",
        "--snapshotter",
        "cairn",
        "prepare",
        "--target",
        "/mnt",
        "on-the-second",
        second,
    ]);
    let source = prepared
        .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == ':')
        .find(|w| w.contains("/snapshots/chains/"))
        .unwrap_or_else(|| panic!("no chain mount in {prepared:?}"));
    let tree = std::path::Path::new(source);
    assert!(tree.join("etc").is_dir(), "{source}: {prepared}");
    for later in ["opt/data", "busybox", "srv/top"] {
        assert!(!tree.join(later).exists(), "{later} in a mount of layer 2");
    }
}

/// The mount points under `store`'s `snapshots/chains/` (the chain
/// mounts), as /proc/self/mountinfo lists them, each as often as it is
/// mounted.
fn chain_mounts(store: &std::path::Path) -> Vec<String> {
    let chains = format!("{}/", store.join("snapshots/chains").display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&chains))
        .map(str::to_owned)
        .collect()
}

/// The layer digests a manifest lists.
fn layer_digests(manifest: &serde_json::Value) -> Vec<String> {
    manifest["layers"]
        .as_array()
        .expect("a manifest's layers")
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_owned())
        .collect()
}

/// The rows of `ctr snapshots ls` output (header skipped): key, parent
/// (when it has one), kind.
fn snapshot_rows(listed: &str) -> Vec<Vec<&str>> {
    listed
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect()
}

/// The key of the test image's second layer snapshot (`ctr snapshots ls`:
/// the committed snapshot whose parent is the one without a parent).
fn second_layer(ds: &Daemons) -> String {
    let listed = ds.ctr(&["snapshots", "--snapshotter", "cairn", "ls"]);
    let rows = snapshot_rows(&listed);
    let bottom = rows
        .iter()
        .find(|r| r.len() == 2 && r[1] == "Committed")
        .unwrap_or_else(|| panic!("no bottom layer: {listed}"))[0];
    rows.iter()
        .find(|r| r.len() == 3 && r[1] == bottom)
        .unwrap_or_else(|| panic!("no second layer: {listed}"))[0]
        .to_owned()
}
