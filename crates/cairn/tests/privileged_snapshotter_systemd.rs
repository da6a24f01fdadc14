//! The shipped systemd unit `contrib/cairn-snapshotter.service`, run by a
//! real systemd: the machine's own systemd booted as PID 1 of a
//! `systemd-nspawn` container (`-D / --volatile=yes`: a tmpfs root with
//! the host's /usr), with containerd (1.6, and 2.4.2 in a second test
//! sharing the code) as a unit inside it. A lazily
//! pulled image's container must survive `systemctl restart` and
//! `systemctl stop` of the snapshotter, lazy data-layer servers included,
//! thanks to the unit's `KillMode=process`; with systemd's default
//! (`KillMode=control-group`) the same restart kills the lazy server, which
//! is what shows that the setting matters. Runs as root and fails loudly
//! (never skips) without root, systemd-nspawn or systemd.

mod common;
mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{cairn_bin, require_root};
use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::snapshotter::{
    build_rpull, push_image, push_lazy_artifact, workspace_root, Ctd, CONTAINERD2_BIN, REPO, TAG,
};

const NAMESPACE: &str = "cairn-systemd";
const UNIT: &str = "cairn-snapshotter";
/// The socket the shipped unit's ExecStart names.
const SOCKET: &str = "/run/cairn/snapshotter.sock";

fn wait_for(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A booted systemd in `systemd-nspawn`, in a cgroup of its own; powered
/// off, its cgroups removed and its scratch directory unmounted on drop.
struct Machine {
    nspawn: Child,
    /// The container's PID 1, as the host sees it.
    pid1: u32,
    /// The cgroup2 group the container runs in (`payload/` and
    /// `supervisor/` under it), and where nspawn mirrors it in the v1
    /// `name=systemd` hierarchy of a hybrid host.
    cgroups: Vec<PathBuf>,
    scratch: PathBuf,
    log: PathBuf,
    ctr: PathBuf,
}

/// Where a cgroup2 group of our own can be made: the cgroup2 root on a
/// pure cgroup2 host, `/sys/fs/cgroup/unified` on a hybrid one.
fn cgroup2_root() -> (PathBuf, bool) {
    // CGROUP2_SUPER_MAGIC (the field's type differs between libcs).
    let is_cg2 = |p: &str| rustix::fs::statfs(p).is_ok_and(|s| s.f_type == 0x6367_7270);
    if is_cg2("/sys/fs/cgroup") {
        (PathBuf::from("/sys/fs/cgroup"), false)
    } else if is_cg2("/sys/fs/cgroup/unified") {
        (PathBuf::from("/sys/fs/cgroup/unified"), true)
    } else {
        panic!("neither a cgroup2 nor a hybrid cgroup layout (/sys/fs/cgroup/unified)")
    }
}

impl Machine {
    /// `name`: the machine's and its cgroup's name ([`machine_name`]);
    /// `ctr`: the `ctr` binary of the containerd the test runs.
    fn boot(scratch: &Path, binds_ro: &[&Path], name: &str, ctr: &Path) -> Machine {
        for tool in [
            "/usr/bin/systemd-nspawn",
            "/lib/systemd/systemd",
            "/usr/bin/nsenter",
        ] {
            assert!(
                Path::new(tool).exists(),
                "{tool} is missing: this test boots systemd in systemd-nspawn (setup.sh installs systemd-container)"
            );
        }
        let (cg_root, hybrid) = cgroup2_root();
        let cg = cg_root.join(name);
        std::fs::create_dir(&cg).unwrap_or_else(|e| panic!("creating {}: {e}", cg.display()));
        let mut cgroups = vec![cg.clone()];
        if hybrid {
            cgroups.push(Path::new("/sys/fs/cgroup/systemd").join(name));
        }
        let log = scratch.join("nspawn.log");
        // In a private mount namespace with a tmpfs on /run/systemd/nspawn:
        // nspawn refuses to clean up its propagation directory when /run is
        // not a tmpfs (PID 1 is not systemd here).
        let mut nspawn_args: Vec<String> = [
            "-D",
            "/",
            "--volatile=yes",
            "--register=no",
            "--keep-unit",
            "--console=passive",
            // containerd's runc sets capabilities nspawn drops by default
            // (its container init fails with EPERM), joins a session keyring
            // and loads a BPF device program into the container's cgroup.
            "--capability=all",
            "--system-call-filter=add_key keyctl request_key bpf",
            "--bind=/dev/fuse",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        nspawn_args.push(format!("--machine={name}"));
        nspawn_args.push(format!("--bind={}", scratch.display()));
        for b in binds_ro {
            nspawn_args.push(format!("--bind-ro={}", b.display()));
        }
        nspawn_args.extend(
            [
                "-b",
                "--",
                "systemd.unit=basic.target",
                "systemd.firstboot=off",
            ]
            .map(String::from),
        );
        let nspawn = Command::new("/bin/sh")
            .arg("-c")
            .arg(
                r#"echo $$ >"$1/cgroup.procs" || exit 1; shift
                exec unshare -m --propagation private /bin/sh -c '
                  if [ "$(stat -fc %T /run)" != tmpfs ]; then
                    mkdir -p /run/systemd/nspawn &&
                    mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn || exit 1
                  fi
                  exec systemd-nspawn "$@"' sh "$@""#,
            )
            .arg("sh")
            .arg(&cg)
            .args(&nspawn_args)
            // On a hybrid host nspawn would give the container the hybrid
            // layout too, with the v1 controllers read-only: runc could not
            // make its groups there. A unified hierarchy inside.
            .env("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", "1")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .unwrap_or_else(|e| {
                let _ = std::fs::remove_dir(&cg);
                panic!("starting systemd-nspawn: {e}")
            });
        let mut m = Machine {
            nspawn,
            pid1: 0,
            cgroups,
            scratch: scratch.to_owned(),
            log,
            ctr: ctr.to_owned(),
        };
        let init = cg.join("payload/init.scope/cgroup.procs");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(p) = std::fs::read_to_string(&init)
                .ok()
                .and_then(|s| s.lines().next().and_then(|l| l.parse().ok()))
            {
                m.pid1 = p;
                break;
            }
            if let Ok(Some(st)) = m.nspawn.try_wait() {
                panic!("systemd-nspawn exited ({st}):\n{}", m.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "the container's systemd did not start:\n{}",
                m.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        wait_for("the container's systemd reaching basic.target", 30, || {
            let o = m.out(&["systemctl", "is-system-running"]);
            let s = String::from_utf8_lossy(&o.stdout);
            s.trim() == "running" || s.trim() == "degraded"
        });
        m
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A command inside the container (all its namespaces).
    fn out(&self, args: &[&str]) -> Output {
        Command::new("/usr/bin/nsenter")
            .arg("-t")
            .arg(self.pid1.to_string())
            .arg("-a")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running nsenter")
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.out(args);
        assert!(
            o.status.success(),
            "{args:?} in the container failed ({}): {}{}\nsnapshotter journal:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            self.journal(UNIT),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn journal(&self, unit: &str) -> String {
        let o = self.out(&["journalctl", "--no-pager", "-o", "cat", "-u", unit]);
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// A path inside the container, seen from the host.
    fn path(&self, p: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{p}", self.pid1))
    }

    fn ctr_out(&self, args: &[&str]) -> Output {
        let sock = self.scratch.join("containerd.sock");
        let mut v = vec![
            self.ctr.to_str().unwrap(),
            "--address",
            sock.to_str().unwrap(),
            "--namespace",
            NAMESPACE,
        ];
        v.extend_from_slice(args);
        self.out(&v)
    }

    fn ctr(&self, args: &[&str]) -> String {
        let o = self.ctr_out(args);
        assert!(
            o.status.success(),
            "ctr {args:?} failed ({}): {}{}\nsnapshotter journal:\n{}\ncontainerd journal:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            self.journal(UNIT),
            self.journal("cairn-test-containerd"),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The processes of a unit's cgroup (host PIDs) with their command lines.
    fn unit_procs(&self, unit: &str) -> Vec<(u32, String)> {
        let f = self.cgroups[0].join(format!("payload/system.slice/{unit}.service/cgroup.procs"));
        std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .map(|p: u32| {
                let cmd = std::fs::read(format!("/proc/{p}/cmdline"))
                    .unwrap_or_default()
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect::<Vec<_>>()
                    .join(" ");
                (p, cmd)
            })
            .collect()
    }

    /// The lazy data-layer servers (`cairn … mount --lazy …`) in the
    /// snapshotter's cgroup.
    fn lazy_servers(&self) -> BTreeSet<u32> {
        self.unit_procs(UNIT)
            .into_iter()
            .filter(|(_, c)| c.contains(" mount --lazy "))
            .map(|(p, _)| p)
            .collect()
    }

    /// `(mount id, mount point)` of the chain mounts in the container.
    fn chain_mounts(&self, chains: &str) -> Vec<(String, String)> {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid1))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 4 && f[4].starts_with(chains))
                    .then(|| (f[0].to_owned(), f[4].to_owned()))
            })
            .collect()
    }

    fn main_pid(&self) -> String {
        self.ok(&["systemctl", "show", "-p", "MainPID", "--value", UNIT])
            .trim()
            .to_owned()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        if self.pid1 != 0 {
            let _ = self.out(&["systemctl", "poweroff"]);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.nspawn.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.nspawn.try_wait().ok().flatten().is_none() {
            eprintln!("the container did not power off; killing systemd-nspawn");
            let _ = self.nspawn.kill();
            let _ = self.nspawn.wait();
        }
        // Empty groups left: nspawn's payload/ and supervisor/, the unit
        // groups of the container's systemd, runc's; deepest first.
        for cg in &self.cgroups {
            let mut dirs = Vec::new();
            let mut stack = vec![cg.clone()];
            while let Some(d) = stack.pop() {
                if let Ok(rd) = std::fs::read_dir(&d) {
                    for e in rd.flatten() {
                        if e.file_type().is_ok_and(|t| t.is_dir()) {
                            stack.push(e.path());
                        }
                    }
                }
                dirs.push(d);
            }
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                let mut tries = 0;
                while let Err(e) = std::fs::remove_dir(&d) {
                    if e.kind() == std::io::ErrorKind::NotFound || tries == 50 {
                        break;
                    }
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

/// The machine's (and its cgroup's) name: one per test process and
/// containerd version.
fn machine_name(v: Ctd) -> String {
    format!("cairn-sd-{}-{}", std::process::id(), v.namespace())
}

/// `KillMode=process` under a real systemd, with containerd 1.6: see the
/// module's comment.
#[test]
fn privileged_snapshotter_systemd_unit() {
    systemd_unit(Ctd::V16);
}

/// The same with containerd 2.4.2 (its `ctr` and its client).
#[test]
fn privileged_snapshotter_containerd2_systemd_unit() {
    systemd_unit(Ctd::V24);
}

fn systemd_unit(v: Ctd) {
    require_root();
    v.check_installed();
    let started = Instant::now();
    let phase = |what: &str| eprintln!("{v:?} {:>6.1?} {what}", started.elapsed());
    let rpull = build_rpull(v);
    phase("rpull built");
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    push_lazy_artifact(&direct, &upstream);
    // Counts the bytes fetched: what the lazy server fetches on demand.
    let proxy = SlowProxy::start(&upstream, 1 << 20);
    let proxy_addr = proxy.addr.clone();
    let reference = format!("{proxy_addr}/{REPO}:{TAG}");

    phase("image and lazy artifact pushed");
    let scratch = tempfile::Builder::new()
        .prefix("cairn-sd-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let d = scratch.path();
    let store = d.join("store");
    let cairn = Path::new(cairn_bin());
    let machine = Machine::boot(
        d,
        &[cairn.parent().unwrap(), rpull.parent().unwrap()],
        &machine_name(v),
        &v.bin("ctr"),
    );
    phase("systemd booted");
    let m = &machine;

    // The shipped unit, unchanged; a drop-in sets the binary, the store,
    // the log level and on-demand fetching (so that what is fetched is
    // what is read).
    let shipped =
        std::fs::read_to_string(workspace_root().join("contrib/cairn-snapshotter.service"))
            .unwrap();
    let exec = shipped
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart");
    assert!(exec.contains(SOCKET), "{exec}");
    let exec = exec.replacen("/usr/local/bin/cairn", cairn.to_str().unwrap(), 1);
    assert!(shipped.contains("\nKillMode=process\n"), "{shipped}");
    std::fs::write(
        m.path("/etc/systemd/system/cairn-snapshotter.service"),
        &shipped,
    )
    .unwrap();
    let dropins = m.path("/etc/systemd/system/cairn-snapshotter.service.d");
    std::fs::create_dir_all(&dropins).unwrap();
    std::fs::write(
        dropins.join("test.conf"),
        format!(
            "[Service]\nEnvironment=CAIRN_ROOT={}\nEnvironment=CAIRN_LOG=info\nExecStart=\nExecStart={exec} --lazy-fetch on-demand --coalesce 0\n",
            store.display()
        ),
    )
    .unwrap();
    m.ok(&["systemctl", "daemon-reload"]);
    m.ok(&["systemctl", "start", UNIT]);
    let sock = m.path(SOCKET);
    wait_for("the snapshotter's socket", 30, || sock.exists());

    phase("snapshotter unit started");
    // containerd as a unit of its own, on its own root, with cairn as a
    // proxy snapshotter at the unit's socket. 2.4 reads config version 3
    // (the same settings as privileged_snapshotter.rs's) and finds its
    // shim in PATH.
    let config = match v {
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
  address = "{SOCKET}"
"#,
            d = d.display()
        ),
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
  address = "{SOCKET}"
"#,
            d = d.display()
        ),
    };
    std::fs::write(d.join("config.toml"), config).unwrap();
    let config = d.join("config.toml");
    let containerd = v.bin("containerd");
    let path = format!("--setenv=PATH={CONTAINERD2_BIN}:/usr/sbin:/usr/bin:/sbin:/bin");
    let mut run = vec!["systemd-run", "--unit=cairn-test-containerd"];
    if v == Ctd::V24 {
        run.push(&path);
    }
    run.extend([
        containerd.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]);
    m.ok(&run);
    wait_for("containerd", 30, || {
        m.ctr_out(&["version"]).status.success()
    });

    phase("containerd up");
    // The lazy remote path: the CRI-label client pulls, the snapshotter
    // commits every layer from the lazy artifact.
    let sock = d.join("containerd.sock");
    m.ok(&[
        rpull.to_str().unwrap(),
        sock.to_str().unwrap(),
        NAMESPACE,
        "cairn",
        &reference,
    ]);
    assert_eq!(
        m.journal(UNIT).matches("pulled lazily by cairn").count(),
        5,
        "layers pulled lazily, snapshotter journal:\n{}",
        m.journal(UNIT)
    );

    phase("pulled");
    // ctr run: --cpu-shares 0, as the cpu controller may be on cgroup v1
    // (hybrid host) and so missing from the container's cgroup2 tree.
    let id = "long";
    // What the containers read is written to a directory of the scratch
    // directory (bound into the machine at the same path) mounted into
    // them, not read from ctr's output, which can end early on a loaded
    // machine (docs/snapshotter.md, "Tests").
    let out = scratch.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let out_mount = format!(
        "type=bind,src={},dst=/.cairn-out,options=rbind:rw",
        out.display()
    );
    m.ctr(&[
        "run",
        "-d",
        "--cpu-shares",
        "0",
        "--snapshotter",
        "cairn",
        "--mount",
        &out_mount,
        &reference,
        id,
        "/busybox/busybox",
        "sleep",
        "600",
    ]);
    let cat = |n: u32, path: &str| {
        let o = m.ctr_out(&[
            "task",
            "exec",
            "--exec-id",
            &format!("cat{n}"),
            id,
            "/busybox/busybox",
            "sh",
            "-c",
            &format!("/busybox/busybox cat {path} > /.cairn-out/cat{n}"),
        ]);
        (
            o,
            std::fs::read(out.join(format!("cat{n}"))).unwrap_or_default(),
        )
    };
    let expect = |i: usize| support::images::text(500 + i, 20_000 + i as u64);
    let cat_ok = |n: u32, i: usize| {
        let path = format!("/usr/lib/new{i:03}.txt");
        let (o, read) = cat(n, &path);
        assert!(
            o.status.success() && read == expect(i),
            "the container reading {path}: {} ({} bytes) {}\nsnapshotter journal:\n{}",
            o.status,
            read.len(),
            String::from_utf8_lossy(&o.stderr),
            m.journal(UNIT)
        );
    };
    cat_ok(0, 0);
    let chains = format!("{}/", store.join("snapshots/chains").display());
    let servers = m.lazy_servers();
    let mounts = m.chain_mounts(&chains);
    assert_eq!(mounts.len(), 1, "chain mounts: {mounts:?}");
    assert!(
        !servers.is_empty(),
        "no lazy server in the snapshotter's cgroup: {:?}",
        m.unit_procs(UNIT)
    );
    let running = || {
        let tasks = m.ctr(&["task", "ls"]);
        tasks
            .lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING"))
    };

    phase("container running");
    // systemctl restart: the lazy servers and the chain mount stay (same
    // PIDs, same mount), the container reads a file not fetched before.
    let main = m.main_pid();
    m.ok(&["systemctl", "restart", UNIT]);
    assert_ne!(m.main_pid(), main, "the snapshotter was not restarted");
    assert_eq!(m.lazy_servers(), servers, "lazy servers after the restart");
    assert_eq!(
        m.chain_mounts(&chains),
        mounts,
        "chain mounts after the restart"
    );
    assert!(running(), "the container stopped with the snapshotter");
    let fetched = proxy.bytes_down();
    cat_ok(1, 50);
    assert!(
        proxy.bytes_down() > fetched,
        "/usr/lib/new050.txt was not fetched after the restart"
    );
    phase("restarted");
    // The restarted snapshotter adopts the chain: a new container works,
    // the chain is still mounted once.
    wait_for(
        "containerd's connection to the restarted snapshotter",
        30,
        || {
            m.ctr_out(&["snapshots", "--snapshotter", "cairn", "ls"])
                .status
                .success()
        },
    );
    m.ctr(&[
        "run",
        "--rm",
        "--cpu-shares",
        "0",
        "--snapshotter",
        "cairn",
        "--mount",
        &out_mount,
        &reference,
        "second",
        "/busybox/busybox",
        "sh",
        "-c",
        "/busybox/busybox cat /usr/lib/new010.txt > /.cairn-out/second",
    ]);
    assert!(
        std::fs::read(out.join("second")).unwrap() == expect(10),
        "the second container's read of /usr/lib/new010.txt"
    );
    assert_eq!(
        m.chain_mounts(&chains),
        mounts,
        "chain mounts after a new run"
    );
    assert_eq!(m.lazy_servers(), servers, "lazy servers after a new run");

    phase("second container ran");
    // systemctl stop: the same.
    m.ok(&["systemctl", "stop", UNIT]);
    assert_eq!(m.lazy_servers(), servers, "lazy servers after the stop");
    assert_eq!(
        m.chain_mounts(&chains),
        mounts,
        "chain mounts after the stop"
    );
    assert!(running(), "the container stopped with the snapshotter");
    let fetched = proxy.bytes_down();
    cat_ok(2, 60);
    assert!(
        proxy.bytes_down() > fetched,
        "new060 not fetched after the stop"
    );

    phase("stopped");
    // What systemd says of the processes KillMode=process leaves.
    for l in m
        .out(&["journalctl", "--no-pager", "-o", "cat", "-u", UNIT])
        .stdout
        .split(|b| *b == b'\n')
        .map(String::from_utf8_lossy)
        .filter(|l| {
            l.contains("left-over") || l.contains("remains running") || l.contains("KillMode")
        })
    {
        eprintln!("systemd: {l}");
    }
    // A crash: SIGKILL to the main process alone; Restart=always starts a
    // new one (after RestartSec), and again the lazy servers stay.
    m.ok(&["systemctl", "start", UNIT]);
    let main = m.main_pid();
    m.ok(&[
        "systemctl",
        "kill",
        "--kill-whom=main",
        "-s",
        "SIGKILL",
        UNIT,
    ]);
    wait_for("systemd restarting the killed snapshotter", 30, || {
        let now = m.main_pid();
        now != main && now != "0"
    });
    assert_eq!(m.lazy_servers(), servers, "lazy servers after a crash");
    assert_eq!(
        m.chain_mounts(&chains),
        mounts,
        "chain mounts after a crash"
    );
    assert!(running(), "the container stopped with the snapshotter");
    cat_ok(3, 65);
    phase("restarted by systemd after a SIGKILL");

    // The contrast: systemd's default KillMode=control-group kills the
    // lazy server with the snapshotter, and the container's reads fail.
    std::fs::write(
        dropins.join("killmode.conf"),
        "[Service]\nKillMode=control-group\n",
    )
    .unwrap();
    m.ok(&["systemctl", "daemon-reload"]);
    m.ok(&["systemctl", "restart", UNIT]);
    let left: Vec<u32> = servers
        .iter()
        .copied()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists())
        .collect();
    assert!(
        left.is_empty(),
        "with KillMode=control-group, the lazy servers {left:?} survived the restart"
    );
    phase("restarted with KillMode=control-group");
    let (o, read) = cat(4, "/usr/lib/new070.txt");
    assert!(
        !o.status.success(),
        "with the lazy server killed, the container still read a file not fetched before ({} bytes)",
        read.len()
    );
    eprintln!(
        "with KillMode=control-group, the container's read after a restart: {} {}",
        o.status,
        String::from_utf8_lossy(&o.stderr).trim()
    );

    let _ = m.ctr_out(&["task", "kill", "-s", "SIGKILL", id]);
    phase("powering off");
    drop(machine);
    // Nothing left: no mount under the scratch directory (everything was
    // mounted in the container's mount namespace), no cgroup.
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let prefix = format!("{}/", d.display());
    let left: Vec<&str> = mi.lines().filter(|l| l.contains(&prefix)).collect();
    assert!(left.is_empty(), "mounts left behind: {left:#?}");
    let (cg_root, _) = cgroup2_root();
    let name = machine_name(v);
    for g in [
        cg_root.join(&name),
        Path::new("/sys/fs/cgroup/systemd").join(&name),
    ] {
        assert!(!g.exists(), "cgroup left behind: {}", g.display());
    }
    eprintln!(
        "privileged_snapshotter_systemd_unit: {:?}",
        started.elapsed()
    );
}
