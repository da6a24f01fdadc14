//! `cairn run -d --listen`: on-demand containers behind cairn's own
//! listening socket. A busybox image made in the test serves a file with
//! `httpd` or echoes with `nc -ll -e cat`; the tests check the first
//! connection starts the container, the idle stop, the restart, the end
//! by `stop`/`container rm`/a killed proxy, and that nothing is left.
//! They run containers and fail loudly when not run as root.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

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

impl Drop for Fixture {
    /// A failed test must not leave proxies and containers running (they
    /// would outlive the store and look like leaks to other tests).
    fn drop(&mut self) {
        let text = out(self, &["--json", "ps", "-a"]).stdout;
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&text).unwrap_or_default();
        for r in rows.iter().filter(|r| r["listen"].is_object()) {
            let _ = out(self, &["stop", "-t", "0", r["id"].as_str().unwrap_or("-")]);
        }
        for r in rows.iter().filter(|r| r["listen"].is_null()) {
            let _ = out(
                self,
                &["container", "rm", "-f", r["id"].as_str().unwrap_or("-")],
            );
        }
    }
}

const APPLETS: [&str; 8] = ["sh", "echo", "cat", "sleep", "true", "httpd", "nc", "ls"];
const BODY: &str = "hello from an on-demand container\n";

/// A store with image `T`: busybox, its applets, and /www/index.html.
fn fixture() -> Fixture {
    require_root();
    assert!(
        Path::new("/usr/bin/crun").exists()
            || Command::new("crun").arg("--version").output().is_ok(),
        "crun is needed (apt-get install crun)"
    );
    // "cairn-run" prefix: privileged_run's cgroup leak check knows these stores.
    let dir = tempfile::Builder::new()
        .prefix("cairn-run-listen")
        .tempdir()
        .unwrap();
    let root = dir.path().join("store");
    let tree = dir.path().join("tree");
    fs::create_dir_all(tree.join("bin")).unwrap();
    fs::create_dir_all(tree.join("www")).unwrap();
    fs::copy("/bin/busybox", tree.join("bin/busybox"))
        .expect("busybox-static is needed (apt-get install busybox-static)");
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(a)).unwrap();
    }
    fs::write(tree.join("www/index.html"), BODY).unwrap();
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

fn out(f: &Fixture, args: &[&str]) -> Output {
    Command::new(cairn_bin())
        .arg("--root")
        .arg(&f.root)
        .arg("-q")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running cairn")
}

fn ok(f: &Fixture, args: &[&str]) -> String {
    let o = out(f, args);
    assert!(
        o.status.success(),
        "cairn {args:?} failed ({:?}): {}{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ps_json(f: &Fixture) -> Vec<serde_json::Value> {
    let text = ok(f, &["--json", "ps", "-a"]);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("ps --json: {e}: {text}"))
}

/// The listener row named `name`.
fn listener(f: &Fixture, name: &str) -> Option<serde_json::Value> {
    ps_json(f)
        .into_iter()
        .find(|r| r["name"] == name && r["listen"].is_object())
}

/// Container rows (not listeners).
fn containers(f: &Fixture) -> Vec<serde_json::Value> {
    ps_json(f)
        .into_iter()
        .filter(|r| r["listen"].is_null())
        .collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether something listens on 127.0.0.1:`port` (without connecting,
/// which would start the container).
fn listening(port: u16) -> bool {
    let text = fs::read_to_string("/proc/net/tcp").unwrap();
    let want = format!("0100007F:{port:04X}");
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            Some((cols.get(1)?.to_string(), cols.get(3)?.to_string()))
        })
        .any(|(local, st)| local == want && st == "0A")
}

fn http_get(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// crun's state dir: one entry per container crun knows.
fn crun_containers(f: &Fixture) -> Vec<String> {
    entries(&f.root.join("run/crun"))
}

/// Nothing of a container or a listener may be left.
fn assert_nothing_left(f: &Fixture) {
    let containers = f.root.join("run/containers");
    let listeners = f.root.join("listeners");
    wait_for(20, "containers and listeners to be torn down", || {
        entries(&containers)
            .iter()
            .all(|e| e == "names" || e == "userns")
            && entries(&containers.join("names")).is_empty()
            && entries(&containers.join("userns")).is_empty()
            && entries(&listeners).iter().all(|e| e == "names")
            && entries(&listeners.join("names")).is_empty()
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
    assert!(
        crun_containers(f).is_empty(),
        "crun state left: {:?}",
        crun_containers(f)
    );
    assert!(ps_json(f).is_empty());
    let leaked = leaked_cgroups();
    assert!(leaked.is_empty(), "cgroups left: {leaked:?}");
}

fn proxy_pid(f: &Fixture, name: &str) -> i32 {
    listener(f, name).expect("listener")["listen"]["proxy_pid"]
        .as_i64()
        .expect("proxy pid") as i32
}

#[test]
fn privileged_listen_starts_on_demand_idles_and_restarts() {
    let f = fixture();
    let (hp, cp) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{hp}:{cp}");
    let serve = format!("127.0.0.1:{cp}");
    ok(
        &f,
        &[
            "run",
            "-d",
            "--name",
            "web",
            "--listen",
            &listen,
            "--idle-stop",
            "1s",
            "--stop-timeout",
            "1",
            "T",
            "httpd",
            "-f",
            "-p",
            &serve,
            "-h",
            "/www",
        ],
    );
    // Waiting: cairn holds the port, no container exists.
    let l = listener(&f, "web").expect("ps shows the listener");
    assert_eq!(l["status"], "waiting");
    assert!(containers(&f).is_empty());
    assert!(crun_containers(&f).is_empty());
    assert!(listening(hp));
    let pid = proxy_pid(&f, "web");

    // The first connection starts it and gets the file.
    let resp = http_get(hp);
    assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
    assert!(resp.ends_with(BODY), "{resp}");
    let running = containers(&f);
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0]["name"], "web");
    assert_eq!(running[0]["status"], "running");
    assert_eq!(listener(&f, "web").unwrap()["status"], "active");
    // A second request to the running container.
    assert!(http_get(hp).ends_with(BODY));
    // `exec` reaches the running container by the listener's name.
    assert_eq!(ok(&f, &["exec", "web", "cat", "/www/index.html"]), BODY);

    // Idle: stopped, gone from ps and crun, the proxy still listens.
    wait_for(20, "the idle stop", || {
        containers(&f).is_empty() && listener(&f, "web").unwrap()["status"] == "waiting"
    });
    let l = listener(&f, "web").unwrap();
    assert_eq!(l["status"], "waiting");
    assert_eq!(l["listen"]["starts"], 1);
    assert_eq!(l["listen"]["proxy_pid"], pid);
    assert!(crun_containers(&f).is_empty());
    assert!(entries(&f.root.join("run/containers/names")).is_empty());
    assert!(listening(hp));

    // The next connection starts it again.
    assert!(http_get(hp).ends_with(BODY));
    let l = listener(&f, "web").unwrap();
    assert_eq!(l["listen"]["starts"], 2);
    assert_eq!(l["listen"]["connections"], 3);
    assert_eq!(containers(&f).len(), 1);

    // `stop` ends proxy and container and frees the port.
    ok(&f, &["stop", "-t", "1", "web"]);
    assert!(!listening(hp));
    TcpListener::bind(("127.0.0.1", hp)).expect("the port is free again");
    assert!(
        !Path::new(&format!("/proc/{pid}/cmdline")).exists() || {
            // A zombie until its reaper gets to it: no longer running.
            fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z"))
        }
    );
    assert_nothing_left(&f);
}

#[test]
fn privileged_listen_forwards_both_ways_with_half_close() {
    let f = fixture();
    let (hp, cp) = (free_port(), free_port());
    let listen = format!("{hp}:{cp}");
    let port = cp.to_string();
    ok(
        &f,
        &[
            "run",
            "-d",
            "--name",
            "echo",
            "--listen",
            &listen,
            "--idle-stop",
            "5m",
            "T",
            "nc",
            "-ll",
            "-p",
            &port,
            "-e",
            "cat",
        ],
    );
    // Parallel connections (the first one starts the container, the others
    // wait in the backlog), each sends 1 MiB, half-closes, reads it back.
    let workers: Vec<_> = (0..4u8)
        .map(|w| {
            std::thread::spawn(move || {
                let data: Vec<u8> = (0..1usize << 20)
                    .map(|i| (i as u8).wrapping_mul(31).wrapping_add(w))
                    .collect();
                let s = TcpStream::connect(("127.0.0.1", hp)).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let mut writer = s.try_clone().unwrap();
                let sent = data.clone();
                let t = std::thread::spawn(move || {
                    writer.write_all(&sent).unwrap();
                    writer.shutdown(Shutdown::Write).unwrap();
                });
                let mut back = Vec::new();
                (&s).read_to_end(&mut back).unwrap();
                t.join().unwrap();
                assert!(back == data, "worker {w}: {} bytes back", back.len());
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let l = listener(&f, "echo").unwrap();
    assert_eq!(l["listen"]["starts"], 1);
    assert_eq!(l["listen"]["connections"], 4);
    // `container rm` ends it too.
    ok(&f, &["container", "rm", "echo"]);
    assert!(!listening(hp));
    assert_nothing_left(&f);
}

#[test]
fn privileged_listen_errors_and_a_killed_proxy_leave_nothing() {
    let f = fixture();
    // A busy port: cairn's error, nothing started.
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let bp = busy.local_addr().unwrap().port();
    let o = out(
        &f,
        &["run", "-d", "--listen", &format!("{bp}:1"), "T", "true"],
    );
    assert_eq!(o.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&o.stderr).contains("binding"));
    drop(busy);
    // Same ports, no -d, --network none, a missing image.
    assert_eq!(
        out(&f, &["run", "-d", "--listen", "9:9", "T", "true"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        out(&f, &["run", "--listen", "9:10", "T", "true"])
            .status
            .code(),
        Some(125)
    );
    assert_eq!(
        out(
            &f,
            &[
                "run",
                "-d",
                "--network",
                "none",
                "--listen",
                "9:10",
                "T",
                "true"
            ]
        )
        .status
        .code(),
        Some(125)
    );
    assert_eq!(
        out(&f, &["run", "-d", "--listen", "9:10", "nope", "true"])
            .status
            .code(),
        Some(125)
    );
    assert!(ps_json(&f).is_empty());

    // A container that never opens its port: the connection is dropped,
    // the container stopped, the listener waits again.
    let (hp, cp) = (free_port(), free_port());
    ok(
        &f,
        &[
            "run",
            "-d",
            "--name",
            "dud",
            "--listen",
            &format!("{hp}:{cp}"),
            "T",
            "true",
        ],
    );
    let mut s = TcpStream::connect(("127.0.0.1", hp)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(buf.is_empty());
    let l = listener(&f, "dud").unwrap();
    assert_eq!(l["status"], "waiting");
    assert!(l["listen"]["last_error"]
        .as_str()
        .is_some_and(|e| e.contains("exited")));
    assert!(containers(&f).is_empty());

    // A killed proxy: the next ps stops its container and removes it.
    let (hp, cp) = (free_port(), free_port());
    ok(
        &f,
        &[
            "run",
            "-d",
            "--name",
            "web",
            "--listen",
            &format!("{hp}:{cp}"),
            "--stop-timeout",
            "0",
            "T",
            "httpd",
            "-f",
            "-p",
            &format!("127.0.0.1:{cp}"),
            "-h",
            "/www",
        ],
    );
    assert!(http_get(hp).ends_with(BODY));
    assert_eq!(containers(&f).len(), 1);
    let pid = proxy_pid(&f, "web");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_for(20, "the killed proxy's port to close", || !listening(hp));
    wait_for(30, "the reaper", || {
        ps_json(&f).iter().all(|r| r["name"] != "web")
    });
    ok(&f, &["stop", "dud"]);
    assert_nothing_left(&f);
}
