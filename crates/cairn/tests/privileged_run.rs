//! End-to-end `cairn run` on crun: a busybox image made in the test, flags,
//! exit codes and signals, uppers, user namespaces, the detached
//! lifecycle, and 500 containers (some killed) that must leave nothing
//! behind. These tests run containers and fail loudly when not run as root.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::containers::*;
use common::*;

struct Fixture {
    dir: tempfile::TempDir,
    root: PathBuf,
}

impl Fixture {
    fn base(&self) -> &Path {
        self.dir.path()
    }
}

const APPLETS: [&str; 22] = [
    "sh", "echo", "cat", "id", "sleep", "true", "false", "ls", "hostname", "ip", "touch", "mkdir",
    "dd", "df", "pwd", "env", "stat", "kill", "rm", "wc", "head", "grep",
];

/// A store with image `T`: /bin/busybox with applet symlinks, /etc/passwd
/// and /etc/group with a user `alice`.
fn fixture() -> Fixture {
    require_root();
    assert!(
        Path::new("/usr/bin/crun").exists()
            || Command::new("crun").arg("--version").output().is_ok(),
        "crun is needed (apt-get install crun)"
    );
    let dir = tempfile::Builder::new()
        .prefix("cairn-run")
        .tempdir()
        .unwrap();
    let root = dir.path().join("store");
    let tree = dir.path().join("tree");
    fs::create_dir_all(tree.join("bin")).unwrap();
    fs::create_dir_all(tree.join("etc")).unwrap();
    fs::copy("/bin/busybox", tree.join("bin/busybox"))
        .expect("busybox-static is needed (apt-get install busybox-static)");
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(a)).unwrap();
    }
    fs::write(
        tree.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n",
    )
    .unwrap();
    fs::write(
        tree.join("etc/group"),
        "root:x:0:\nwheel:x:10:alice\nalice:x:1000:\n",
    )
    .unwrap();
    cairn(
        &root,
        &[
            os("mkfs"),
            os("--store"),
            os("--name"),
            os("T"),
            tree.as_os_str(),
        ],
    );
    Fixture { dir, root }
}

fn cmd(f: &Fixture, args: &[&str]) -> Command {
    let mut c = Command::new(cairn_bin());
    c.arg("--root")
        .arg(&f.root)
        .arg("-q")
        .args(args)
        .env_remove("CAIRN_RUNROOT");
    c
}

fn out(f: &Fixture, args: &[&str]) -> Output {
    cmd(f, args)
        .stdin(Stdio::null())
        .output()
        .expect("running cairn")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ok(f: &Fixture, args: &[&str]) -> String {
    let o = out(f, args);
    assert!(
        o.status.success(),
        "cairn {args:?} failed ({:?}): {}{}",
        o.status.code(),
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    stdout(&o)
}

fn ps_json(f: &Fixture, all: bool) -> Vec<serde_json::Value> {
    let mut args = vec!["--json", "ps"];
    if all {
        args.push("-a");
    }
    let o = cmd(f, &args).output().unwrap();
    let text = stdout(&o);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("ps --json: {e}: {text}"))
}

/// What `du -sk` says of `path`, in KiB.
fn du_kib(path: &Path) -> u64 {
    let du = Command::new("du").arg("-sk").arg(path).output().unwrap();
    stdout(&du)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("du -sk {}: {}", path.display(), stdout(&du)))
}

/// The pid of the running container named `name`.
fn container_pid(f: &Fixture, name: &str) -> i32 {
    let mut pid = 0;
    wait_for(10, &format!("container {name} to run"), || {
        ps_json(f, false).iter().any(|c| {
            if c["name"] == name && c["pid"].is_i64() {
                pid = c["pid"].as_i64().unwrap() as i32;
                true
            } else {
                false
            }
        })
    });
    pid
}

fn kill9(pid: i32) {
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    );
}

/// Everything a finished container could leave: none of it may be there.
fn assert_nothing_left(f: &Fixture) {
    let containers = f.root.join("run/containers");
    wait_for(20, "containers to be torn down", || {
        entries(&containers)
            .iter()
            .all(|e| e == "names" || e == "userns")
            && entries(&containers.join("names")).is_empty()
            && entries(&containers.join("userns")).is_empty()
    });
    assert!(
        mounts_under(f.base()).is_empty(),
        "mounts left: {:?}",
        mounts_under(f.base())
    );
    assert!(
        entries(&f.root.join("tmp")).is_empty(),
        "store tmp/: {:?}",
        entries(&f.root.join("tmp"))
    );
    for d in ["run/crun", "containers"] {
        assert!(
            entries(&f.root.join(d)).is_empty(),
            "runtime state left in {d}: {:?}",
            entries(&f.root.join(d))
        );
    }
    assert!(ps_json(f, true).is_empty());
    let loops = Command::new("losetup")
        .args(["-n", "-l", "-O", "NAME,BACK-FILE"])
        .output()
        .unwrap();
    let base = f.base().display().to_string();
    let loops: Vec<String> = stdout(&loops)
        .lines()
        .filter(|l| l.contains(&base))
        .map(String::from)
        .collect();
    assert!(loops.is_empty(), "loop devices left: {loops:?}");
    // Another test's container may be between its record's removal and
    // its cgroups' (its monitor removes the record first): such a group
    // is gone within moments, a leaked one stays.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut leaked = leaked_cgroups();
    while !leaked.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        leaked = leaked_cgroups();
    }
    assert!(leaked.is_empty(), "cgroups left: {leaked:?}");
}

#[test]
fn privileged_run_echo_exit_codes_and_signals() {
    let f = fixture();
    let o = out(&f, &["run", "T", "echo", "hello"]);
    assert_eq!(stdout(&o), "hello\n");
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        out(&f, &["run", "T", "sh", "-c", "exit 7"]).status.code(),
        Some(7)
    );
    assert_eq!(out(&f, &["run", "T", "false"]).status.code(), Some(1));
    // A command that is not there: crun's error, a non-zero code.
    assert_ne!(out(&f, &["run", "T", "/no/such"]).status.code(), Some(0));
    // Not an image: cairn's own error code, as podman's.
    assert_eq!(out(&f, &["run", "nope", "true"]).status.code(), Some(125));

    // SIGKILL of the container's init from the host: 128+9.
    let child = cmd(&f, &["run", "--name", "k", "T", "sleep", "30"])
        .spawn()
        .unwrap();
    kill9(container_pid(&f, "k"));
    assert_eq!(child.wait_with_output().unwrap().status.code(), Some(137));

    // SIGTERM to a foreground `cairn run` reaches the container. The
    // container says `ready` once its trap is set, and only then is the
    // signal sent: earlier, it would kill the shell before the trap.
    let mut child = cmd(
        &f,
        &[
            "run",
            "--name",
            "t",
            "T",
            "sh",
            "-c",
            "trap 'echo got TERM; exit 4' TERM; echo ready; while true; do sleep 0.05; done",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut output = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    output.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let mut rest = String::new();
    output.read_to_string(&mut rest).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(4));
    assert_eq!(rest, "got TERM\n");
    assert_nothing_left(&f);
}

#[test]
fn privileged_run_flags_shape_the_process() {
    let f = fixture();
    let o = ok(
        &f,
        &[
            "run",
            "-e",
            "A=1",
            "-e",
            "B=x y",
            "-w",
            "/work/dir",
            "-u",
            "alice",
            "--hostname",
            "box",
            "T",
            "sh",
            "-c",
            "echo $A; echo $B; pwd; id; hostname; cat /etc/hostname; echo $HOME",
        ],
    );
    assert_eq!(
        o,
        "1\nx y\n/work/dir\nuid=1000(alice) gid=1000(alice) groups=10(wheel)\nbox\nbox\n/home/alice\n"
    );
    assert_eq!(ok(&f, &["run", "-u", "1234:55", "T", "id", "-u"]), "1234\n");
    assert_eq!(
        ok(&f, &["run", "--entrypoint", "/bin/echo", "T", "a", "b"]),
        "a b\n"
    );
    assert_eq!(
        ok(
            &f,
            &["run", "--entrypoint", r#"["/bin/sh","-c"]"#, "T", "echo e"]
        ),
        "e\n"
    );
    // Env from the host and from a file.
    let env_file = f.base().join("env");
    fs::write(&env_file, "# comment\nF=from-file\n").unwrap();
    let o = cmd(
        &f,
        &[
            "run",
            "-e",
            "HOSTVAR",
            "--env-file",
            env_file.to_str().unwrap(),
            "T",
            "sh",
            "-c",
            "echo $HOSTVAR $F",
        ],
    )
    .env("HOSTVAR", "from-host")
    .output()
    .unwrap();
    assert_eq!(stdout(&o), "from-host from-file\n");

    // Bind mounts: read-only and read-write; a missing mountpoint is made.
    let vol = f.base().join("vol");
    fs::create_dir(&vol).unwrap();
    fs::write(vol.join("f"), "data\n").unwrap();
    let ro = format!("{}:/v:ro", vol.display());
    let o = out(
        &f,
        &["run", "-v", &ro, "T", "sh", "-c", "cat /v/f; touch /v/g"],
    );
    assert_eq!(stdout(&o), "data\n");
    assert_ne!(o.status.code(), Some(0));
    assert!(!vol.join("g").exists());
    let rw = format!("{}:/deep/v", vol.display());
    ok(&f, &["run", "-v", &rw, "T", "touch", "/deep/v/g"]);
    assert!(vol.join("g").exists());

    // --read-only: the root cannot be written, /dev/shm and binds can.
    let o = out(&f, &["run", "--read-only", "T", "touch", "/x"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stderr).contains("Read-only"));
    ok(&f, &["run", "--read-only", "T", "touch", "/dev/shm/x"]);

    // -t: a pty from crun's console socket, proxied to ours (script(1)
    // gives the test one); the exit code still comes through.
    let line = format!(
        "{} --root {} run -t T sh -c 'tty; stty size; exit 3'",
        cairn_bin(),
        f.root.display()
    );
    let o = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .expect("script(1) from util-linux");
    let text = stdout(&o);
    assert!(text.contains("/dev/pts/0"), "{text}");
    assert_eq!(o.status.code(), Some(3), "{text}");

    // --network none: only lo, and it is up.
    let links = ok(&f, &["run", "T", "ip", "-o", "link"]);
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(links.contains("lo:") && links.contains("UP"), "{links}");
    assert!(ok(&f, &["run", "T", "cat", "/etc/resolv.conf"]).contains("no name servers"));
    assert_nothing_left(&f);
}

#[test]
fn privileged_run_uppers_tmpfs_cap_disk_and_keep() {
    let f = fixture();
    // A full tmpfs upper: ENOSPC in the container, nothing on the host.
    let o = out(
        &f,
        &[
            "run",
            "--upper",
            "tmpfs:8M",
            "T",
            "sh",
            "-c",
            "dd if=/dev/zero of=/big bs=1M count=32 2>&1; echo rc=$?",
        ],
    );
    let text = stdout(&o);
    assert!(text.contains("No space left on device"), "{text}");
    assert!(text.contains("rc=1"), "{text}");
    assert!(
        ok(&f, &["run", "T", "df", "/"]).contains("1048576"),
        "default cap is 1G"
    );

    // A size-capped disk upper: ENOSPC in the container at the cap; du on
    // the host sees what it wrote while it runs; nothing left afterwards.
    let o = out(&f, &["run", "--upper", "disk:1M", "T", "true"]);
    assert_eq!(o.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least 8 MiB"));
    let id = ok(
        &f,
        &[
            "run",
            "-d",
            "--upper",
            "disk:16M",
            "T",
            "sh",
            "-c",
            "dd if=/dev/zero of=/big bs=1M count=64 2>/dev/null; echo rc=$?; \
             dd if=/dev/zero of=/small bs=1M count=4 2>/dev/null; \
             rm /big; dd if=/dev/zero of=/small bs=1M count=4 2>/dev/null; touch /done; sleep 30",
        ],
    );
    let id = id.trim().to_string();
    let cdir = f.root.join("containers").join(&id);
    let upper = cdir.join("upperfs/upper");
    wait_for(20, "the container to fill its disk upper", || {
        upper.join("done").exists()
    });
    let kb = du_kib(&upper);
    assert!((4 * 1024..16 * 1024).contains(&kb), "du sees {kb} KiB");
    let ps = ps_json(&f, false);
    assert_eq!(ps[0]["upper"], "disk:16.8 MB", "{ps:?}");
    ok(&f, &["stop", "-t", "0", &id]);
    let log = ok(&f, &["logs", &id]);
    assert!(
        log.contains("rc=1"),
        "the 64M write must fail at the 16M cap: {log}"
    );
    assert!(!cdir.join("upperfs").exists() && !cdir.join("upper.img").exists());
    ok(&f, &["container", "rm", &id]);

    // A disk upper: usage visible to du under the store while it runs.
    let id = ok(
        &f,
        &[
            "run",
            "-d",
            "--upper",
            "disk",
            "T",
            "sh",
            "-c",
            "dd if=/dev/zero of=/big bs=1M count=5 2>/dev/null; touch /done; sleep 30",
        ],
    );
    let id = id.trim().to_string();
    let upper = f.root.join("containers").join(&id).join("upper");
    wait_for(10, "the container to write", || upper.join("done").exists());
    let kb = du_kib(&upper);
    assert!(kb >= 5 * 1024, "du sees {kb} KiB");
    ok(&f, &["stop", "-t", "0", &id]);
    assert!(!upper.exists(), "the upper goes with the container");
    ok(&f, &["container", "rm", &id]);

    // --keep: the upper stays (tmpfs: mounted under the container dir).
    ok(
        &f,
        &[
            "run",
            "--keep",
            "--name",
            "kt",
            "T",
            "sh",
            "-c",
            "echo kept > /k",
        ],
    );
    ok(
        &f,
        &[
            "run",
            "--keep",
            "--upper",
            "disk",
            "--name",
            "kd",
            "T",
            "sh",
            "-c",
            "echo kept > /k",
        ],
    );
    ok(
        &f,
        &[
            "run",
            "--keep",
            "--upper",
            "disk:16M",
            "--name",
            "kds",
            "T",
            "sh",
            "-c",
            "echo kept > /k",
        ],
    );
    let all = ps_json(&f, true);
    assert_eq!(all.len(), 3);
    for c in &all {
        let kept = PathBuf::from(c["kept_upper"].as_str().unwrap());
        assert_eq!(fs::read_to_string(kept.join("k")).unwrap(), "kept\n");
    }
    ok(&f, &["container", "rm", "kt", "kd", "kds"]);
    assert_nothing_left(&f);
}

#[test]
fn privileged_run_userns_auto_ranges_and_ownership() {
    let f = fixture();
    // Two at once: distinct ranges; inside, root and root-owned files.
    let a = cmd(
        &f,
        &[
            "run",
            "-d",
            "--userns",
            "auto",
            "--upper",
            "disk",
            "--name",
            "ua",
            "T",
            "sh",
            "-c",
            "id -u > /id; ls -ln /bin/busybox > /ls; sleep 30",
        ],
    )
    .output()
    .unwrap();
    let b = cmd(
        &f,
        &[
            "run",
            "-d",
            "--userns",
            "auto",
            "--upper",
            "disk",
            "--name",
            "ub",
            "T",
            "sh",
            "-c",
            "id -u > /id; ls -ln /bin/busybox > /ls; sleep 30",
        ],
    )
    .output()
    .unwrap();
    assert!(a.status.success() && b.status.success());
    let running = ps_json(&f, false);
    let ranges: BTreeSet<String> = running
        .iter()
        .map(|c| c["userns"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ranges.len(), 2, "distinct ranges: {ranges:?}");
    for c in &running {
        let id = c["id"].as_str().unwrap();
        let start: u32 = c["userns"]
            .as_str()
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let upper = f.root.join("containers").join(id).join("upper");
        wait_for(10, "the container to write", || {
            upper.join("ls").exists() && fs::metadata(upper.join("ls")).unwrap().len() > 0
        });
        assert_eq!(fs::read_to_string(upper.join("id")).unwrap(), "0\n");
        let ls = fs::read_to_string(upper.join("ls")).unwrap();
        assert!(
            ls.split_whitespace().nth(2) == Some("0") && ls.split_whitespace().nth(3) == Some("0"),
            "{ls}"
        );
        // The host sees the container's files with the shifted owner.
        let m = fs::metadata(upper.join("id")).unwrap();
        assert_eq!((m.uid(), m.gid()), (start, start));
        assert!(start >= 100_000);
    }
    assert_eq!(entries(&f.root.join("run/containers/userns")).len(), 2);
    // Nothing in the store was chowned.
    for e in fs::read_dir(f.root.join("objects")).unwrap().flatten() {
        for o in fs::read_dir(e.path()).unwrap().flatten() {
            assert_eq!(o.metadata().unwrap().uid(), 0);
        }
    }
    ok(&f, &["stop", "-t", "0", "ua", "ub"]);
    ok(&f, &["container", "rm", "ua", "ub"]);
    assert_eq!(ok(&f, &["run", "--userns", "auto", "T", "id", "-u"]), "0\n");
    // crun chowns the stdio it is given to the container's root: cairn
    // gives it pipes, so the caller's files and the host's /dev/null keep
    // their owners.
    let out_file = f.base().join("out");
    fs::write(&out_file, "").unwrap();
    std::os::unix::fs::chown(&out_file, Some(1000), Some(1000)).unwrap();
    let status = cmd(
        &f,
        &[
            "run",
            "--userns",
            "auto",
            "T",
            "sh",
            "-c",
            "echo out; cat /dev/null",
        ],
    )
    .stdin(Stdio::null())
    .stdout(fs::File::options().append(true).open(&out_file).unwrap())
    .status()
    .unwrap();
    assert!(status.success());
    assert_eq!(fs::read_to_string(&out_file).unwrap(), "out\n");
    let m = fs::metadata(&out_file).unwrap();
    assert_eq!((m.uid(), m.gid()), (1000, 1000));
    let null = fs::metadata("/dev/null").unwrap();
    assert_eq!((null.uid(), null.gid(), null.mode() & 0o777), (0, 0, 0o666));
    assert_nothing_left(&f);
}

#[test]
fn privileged_run_detached_lifecycle() {
    let f = fixture();
    let id = ok(
        &f,
        &[
            "run",
            "-d",
            "--name",
            "web",
            "--memory",
            "64m",
            "--cpus",
            "0.5",
            "--pids-limit",
            "50",
            "T",
            "sh",
            "-c",
            "trap 'echo bye; exit 3' TERM; echo started; while true; do sleep 0.05; done",
        ],
    );
    let id = id.trim();
    assert_eq!(id.len(), 64);
    let ps = ps_json(&f, false);
    assert_eq!(ps.len(), 1);
    assert_eq!(ps[0]["name"], "web");
    assert_eq!(ps[0]["status"], "running");
    assert_eq!(
        ok(&f, &["exec", "web", "sh", "-c", "echo in; hostname"]),
        format!("in\n{}\n", &id[..12])
    );
    assert_eq!(
        out(&f, &["exec", "web", "sh", "-c", "exit 9"])
            .status
            .code(),
        Some(9)
    );
    assert_eq!(
        ok(&f, &["exec", "-u", "alice", "web", "id", "-u"]),
        "1000\n"
    );
    // The bundle (config.json, the /etc files, the rootfs mount point) is a
    // tmpfs in crun's namespace only, attached at run/bundle there: on the
    // host the container directory holds just the record, no mount point,
    // and run/bundle is empty.
    let dir = f.root.join("run/containers").join(id);
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["lock", "pid", "state.json"], "{}", dir.display());
    // The log is data, in the store.
    assert_eq!(entries(&f.root.join("containers").join(id)), ["ctr.log"]);
    assert_eq!(fs::read_dir(f.root.join("run/bundle")).unwrap().count(), 0);
    // Limits are in place, in v1 groups on a hybrid host (flat
    // `cairn-<id>` groups there, `cairn/<id>` made by crun elsewhere).
    let pid = container_pid(&f, "web");
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        cgroups.contains(&format!("cairn-{id}")) || cgroups.contains(&format!("cairn/{id}")),
        "{cgroups}"
    );
    // `started` comes after the trap is set: once it is in the log, `stop`
    // reaches the trap.
    wait_for(5, "output", || ok(&f, &["logs", "web"]).contains("started"));
    // A second container may not take the name.
    assert_eq!(
        out(&f, &["run", "--name", "web", "T", "true"])
            .status
            .code(),
        Some(125)
    );
    ok(&f, &["stop", "web"]);
    let ps = ps_json(&f, true);
    assert_eq!(ps[0]["status"], "exited");
    assert_eq!(ps[0]["exit_code"], 3);
    assert!(ps_json(&f, false).is_empty());
    assert_eq!(ok(&f, &["logs", "web"]), "started\nbye\n");
    assert_ne!(out(&f, &["exec", "web", "true"]).status.code(), Some(0));
    ok(&f, &["container", "rm", "web"]);
    // A default name is the short id: no claim under names/, and the
    // container is found by it (an id prefix).
    let id = ok(&f, &["run", "-d", "T", "sleep", "30"]);
    let short = &id.trim()[..12];
    assert_eq!(ps_json(&f, false)[0]["name"], short);
    assert_eq!(
        fs::read_dir(f.root.join("run/containers/names"))
            .unwrap()
            .count(),
        0
    );
    assert_eq!(ok(&f, &["exec", short, "hostname"]), format!("{short}\n"));
    ok(&f, &["stop", "-t", "1", short]);
    ok(&f, &["container", "rm", short]);
    // kill and --rm: the record goes by itself.
    ok(
        &f,
        &["run", "-d", "--rm", "--name", "gone", "T", "sleep", "30"],
    );
    ok(&f, &["kill", "gone"]);
    assert_nothing_left(&f);
}

/// A run root elsewhere (`--runroot`, as /run/cairn for the default store):
/// the records and crun's state go there, the data of a container (here a
/// detached one's log) stays in the store, and data whose record is gone
/// (the run root emptied by a reboot) is removed unless it is a kept upper.
#[test]
fn privileged_run_runroot_elsewhere_holds_records_and_orphaned_data_goes() {
    let f = fixture();
    let rr = f.base().join("runroot");
    let rcmd = |args: &[&str]| {
        let mut c = cmd(&f, args);
        c.env("CAIRN_RUNROOT", &rr).stdin(Stdio::null());
        c.output().unwrap()
    };
    let o = rcmd(&["run", "-d", "--name", "r", "T", "sleep", "30"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    assert!(rr.join("crun").join(&id).join("status").is_file());
    let record = rr.join("containers").join(&id);
    assert!(record.join("state.json").is_file() && record.join("pid").is_file());
    assert_eq!(entries(&f.root.join("containers").join(&id)), ["ctr.log"]);
    assert!(!f.root.join("run/containers").join(&id).exists());
    // Another run root does not see it.
    assert!(ps_json(&f, false).is_empty());
    assert_eq!(stdout(&rcmd(&["exec", "r", "echo", "in"])), "in\n");
    assert!(rcmd(&["stop", "-t", "1", "r"]).status.success());
    assert!(rcmd(&["container", "rm", "r"]).status.success());
    assert!(entries(&rr.join("crun")).is_empty());
    assert!(!f.root.join("containers").join(&id).exists());
    assert_eq!(stdout(&rcmd(&["run", "T", "echo", "fg"])), "fg\n");
    assert!(entries(&rr.join("containers"))
        .iter()
        .all(|e| e == "names" || e == "userns"));

    // A reboot empties the run root: the log goes at the next reap, a kept
    // upper stays.
    let o = rcmd(&["run", "-d", "T", "true"]);
    let gone = stdout(&o).trim().to_string();
    let o = rcmd(&["run", "--keep", "--upper", "disk", "T", "touch", "/kept"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let kept = entries(&f.root.join("containers"))
        .into_iter()
        .find(|e| *e != gone)
        .unwrap();
    wait_for(10, "the detached container to exit", || {
        rcmd(&["--json", "ps"]).stdout.starts_with(b"[]")
    });
    fs::remove_dir_all(&rr).unwrap();
    // A record of the layout before the run root (an older cairn) with a
    // disk upper: not orphaned data, left alone.
    let old = f.root.join("containers").join("ab".repeat(32));
    fs::create_dir_all(old.join("upper")).unwrap();
    fs::write(old.join("state.json"), "{}").unwrap();
    assert!(rcmd(&["ps", "-a"]).status.success());
    assert!(old.join("upper").is_dir());
    fs::remove_dir_all(&old).unwrap();
    assert!(!f.root.join("containers").join(&gone).exists());
    assert!(f
        .root
        .join("containers")
        .join(&kept)
        .join("upper/kept")
        .exists());
    fs::remove_dir_all(f.root.join("containers").join(&kept)).unwrap();
    assert_nothing_left(&f);
}

/// 500 short containers, sequential and in parallel batches of 10, some
/// killed (the container's init, or `cairn run` itself): afterwards no
/// mount, staging file, container record, crun state, cgroup or userns
/// range may be left.
#[test]
fn privileged_run_500_containers_leave_nothing() {
    let f = fixture();
    let start = Instant::now();
    let variants: [&[&str]; 5] = [
        &[],
        &["--userns", "auto"],
        &["--memory", "32m", "--pids-limit", "50"],
        &["--upper", "disk"],
        &["--read-only", "--network", "host"],
    ];
    // 200 one after another.
    for i in 0..200 {
        let mut args = vec!["run"];
        args.extend_from_slice(variants[i % variants.len()]);
        args.extend_from_slice(&["T", "true"]);
        let o = out(&f, &args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // 300 in 30 batches of 10; every third batch loses three containers to
    // kill -9 of their init and two `cairn run`s to kill -9.
    for batch in 0..30 {
        let killing = batch % 3 == 0;
        let names: Vec<String> = (0..10).map(|i| format!("b{batch}c{i}")).collect();
        let mut children: Vec<Child> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut args = vec!["run", "--name", name.as_str()];
                args.extend_from_slice(variants[(batch + i) % variants.len()]);
                // Victims sleep long enough to still run when their turn comes.
                let victim = killing && [0, 1, 3, 6, 8].contains(&i);
                args.extend_from_slice(&["T", "sleep", if victim { "5" } else { "0.1" }]);
                cmd(&f, &args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut killed_init = BTreeSet::new();
        let mut killed_client = BTreeSet::new();
        if killing {
            for i in [0usize, 3, 6] {
                kill9(container_pid(&f, &names[i]));
                killed_init.insert(i);
            }
            for i in [1usize, 8] {
                container_pid(&f, &names[i]);
                kill9(children[i].id() as i32);
                killed_client.insert(i);
            }
        }
        for (i, c) in children.iter_mut().enumerate() {
            let status = c.wait().unwrap();
            let code = status.code();
            let mut err = String::new();
            if !killed_client.contains(&i) {
                c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            }
            if killed_client.contains(&i) {
                assert_eq!(code, None, "killed by SIGKILL");
            } else if killed_init.contains(&i) {
                assert_eq!(code, Some(137), "{}: {err}", names[i]);
            } else {
                assert_eq!(code, Some(0), "{}: {err}", names[i]);
            }
        }
    }
    assert_nothing_left(&f);
    let took = start.elapsed();
    eprintln!("500 containers in {took:?}");
    assert!(
        took < Duration::from_secs(180),
        "500 containers took {took:?}"
    );
}
