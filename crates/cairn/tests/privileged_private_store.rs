//! The store is private: an image holding secrets (a 0640 `/etc/shadow`, a
//! 0600 key, a 0600 token small enough to be inlined in the EROFS image)
//! is imported and run, detached with a log, with and without `--userns
//! auto`; then `nobody` can list nothing and read nothing of it (objects,
//! images, records, refs, logs, container state), while inside the
//! containers the same files read as the image's modes allow. And `cairn
//! fsck` reports a store or run root made wider, and `--repair` narrows it.
//! These tests run containers and fail loudly when not run as root.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::containers::*;
use common::*;

/// Longer than the 64 bytes EROFS images inline: an object.
const SHADOW: &str =
    "root:$y$j9T$SECRET-SHADOW-HASH-0123456789abcdefghijklmnopqrstuvwxyz:19000:0:99999:7:::\n";
const KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nSECRET-KEY-b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtz\n-----END OPENSSH PRIVATE KEY-----\n";
/// Short: inlined in the EROFS image itself, not an object.
const TOKEN: &str = "SECRET-TOKEN-42\n";
/// Group 1000 may read it (0640 root:1000).
const SHARED: &str = "SHARED-WITH-GROUP-1000\n";

struct Fixture {
    dir: tempfile::TempDir,
    root: PathBuf,
}

impl Fixture {
    fn base(&self) -> &Path {
        self.dir.path()
    }
    fn runroot(&self) -> PathBuf {
        self.root.join("run")
    }
}

/// Stops and removes the containers a test started, also when it fails.
struct Containers<'a>(&'a Fixture, Vec<&'static str>);

impl Drop for Containers<'_> {
    fn drop(&mut self) {
        for name in &self.1 {
            let _ = out(self.0, &["stop", "-t", "0", name]);
            let _ = out(self.0, &["container", "rm", name]);
        }
    }
}

const APPLETS: [&str; 7] = ["sh", "cat", "id", "sleep", "echo", "ls", "true"];

/// A store (under a directory `nobody` may traverse, so that only the
/// store's own modes keep it out) with the image `secret` imported from a
/// directory: busybox, users root and alice (1000), and the secrets.
fn fixture() -> Fixture {
    require_root();
    assert!(
        Path::new("/usr/bin/crun").exists()
            || Command::new("crun").arg("--version").output().is_ok(),
        "crun is needed (apt-get install crun)"
    );
    assert!(
        Command::new("setpriv").arg("--version").output().is_ok(),
        "setpriv is needed (util-linux)"
    );
    // cairn-run…: the container tests' prefix (see common::containers).
    let dir = tempfile::Builder::new()
        .prefix("cairn-run-private")
        .tempdir()
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let root = dir.path().join("store");
    let tree = dir.path().join("tree");
    for d in ["bin", "etc", "root", "tmp"] {
        fs::create_dir_all(tree.join(d)).unwrap();
    }
    fs::set_permissions(tree.join("root"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(tree.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::copy("/bin/busybox", tree.join("bin/busybox"))
        .expect("busybox-static is needed (apt-get install busybox-static)");
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(a)).unwrap();
    }
    fs::write(
        tree.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/tmp:/bin/sh\n",
    )
    .unwrap();
    fs::write(tree.join("etc/group"), "root:x:0:\nalice:x:1000:\n").unwrap();
    let secret = |rel: &str, data: &str, mode: u32, gid: u32| {
        let p = tree.join(rel);
        fs::write(&p, data).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        rustix::fs::chown(&p, None, Some(rustix::fs::Gid::from_raw(gid))).unwrap();
    };
    secret("etc/shadow", SHADOW, 0o640, 0);
    secret("root/key", KEY, 0o600, 0);
    secret("etc/token", TOKEN, 0o600, 0);
    secret("etc/shared", SHARED, 0o640, 1000);
    cairn(
        &root,
        &[
            os("import"),
            os(&format!("dir:{}", tree.display())),
            os("--name"),
            os("secret"),
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
        .env_remove("CAIRN_RUNROOT")
        .stdin(Stdio::null());
    c
}

fn out(f: &Fixture, args: &[&str]) -> Output {
    cmd(f, args).output().expect("running cairn")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(f: &Fixture, args: &[&str]) -> String {
    let o = out(f, args);
    assert!(
        o.status.success(),
        "cairn {args:?} failed ({:?}): {}{}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// Runs `argv` as nobody:nogroup with no supplementary groups.
fn as_nobody(argv: &[&OsStrRef]) -> Output {
    Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "--inh-caps=-all",
            "--",
        ])
        .args(argv)
        .stdin(Stdio::null())
        .output()
        .expect("running setpriv")
}

type OsStrRef = std::ffi::OsStr;

/// `nobody` must fail to `tool` `path`, and for want of permission.
fn assert_nobody_denied(tool: &str, path: &Path) {
    let o = as_nobody(&[os(tool), path.as_os_str()]);
    let err = text(&o.stderr);
    assert!(
        !o.status.success() && err.contains("Permission denied"),
        "nobody could {tool} {} (exit {:?}): {}{err}",
        path.display(),
        o.status.code(),
        text(&o.stdout)
    );
    assert!(
        !text(&o.stdout).contains("SECRET") && !text(&o.stdout).contains("LOG-LINE"),
        "{tool} {} showed a secret",
        path.display()
    );
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
        & 0o7777
}

/// The only entry of `dir` that passes `keep`.
fn one_entry(dir: &Path, keep: impl Fn(&str) -> bool) -> PathBuf {
    let found: Vec<String> = entries(dir).into_iter().filter(|e| keep(e)).collect();
    assert_eq!(found.len(), 1, "{}: {found:?}", dir.display());
    dir.join(&found[0])
}

/// Inside a container of `secret` (with `extra` flags): root reads every
/// secret, alice (1000) only what the modes give her.
fn assert_modes_hold_inside(f: &Fixture, extra: &[&str]) {
    let run = |user: &str, file: &str| -> Output {
        let mut args = vec!["run"];
        args.extend_from_slice(extra);
        args.extend(["-u", user, "secret", "cat", file]);
        out(f, &args)
    };
    for (file, want) in [
        ("/etc/shadow", SHADOW),
        ("/root/key", KEY),
        ("/etc/token", TOKEN),
        ("/etc/shared", SHARED),
    ] {
        let o = run("0", file);
        assert!(
            o.status.success() && text(&o.stdout) == want,
            "{extra:?}: root could not read {file} ({:?}): {}{}",
            o.status.code(),
            text(&o.stdout),
            text(&o.stderr)
        );
    }
    for file in ["/etc/shadow", "/root/key", "/etc/token"] {
        let o = run("1000", file);
        assert!(
            !o.status.success()
                && text(&o.stderr).contains("Permission denied")
                && !text(&o.stdout).contains("SECRET"),
            "{extra:?}: alice read {file} ({:?}): {}{}",
            o.status.code(),
            text(&o.stdout),
            text(&o.stderr)
        );
    }
    for (file, want) in [
        ("/etc/shared", SHARED),
        (
            "/etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/tmp:/bin/sh\n",
        ),
    ] {
        let o = run("1000", file);
        assert!(
            o.status.success() && text(&o.stdout) == want,
            "{extra:?}: alice could not read {file} ({:?}): {}",
            o.status.code(),
            text(&o.stderr)
        );
    }
    // What the container writes goes to its upper, which the container
    // reads back through the overlay; on a disk upper that lives in the
    // private containers/ directory.
    for upper in ["tmpfs", "disk"] {
        let mut args = vec!["run", "--upper", upper];
        args.extend_from_slice(extra);
        args.extend([
            "-u",
            "1000",
            "secret",
            "sh",
            "-c",
            "echo written > /tmp/new && cat /tmp/new",
        ]);
        assert_eq!(ok(f, &args), "written\n", "{extra:?} --upper {upper}");
    }
}

#[test]
fn privileged_private_store_keeps_other_users_out_and_containers_in() {
    let f = fixture();
    let mut started = Containers(&f, Vec::new());
    let mut logs = Vec::new();
    for (name, extra) in [
        ("logger", &[][..]),
        ("logger-ns", &["--userns", "auto"][..]),
    ] {
        let mut args = vec!["run", "-d", "--name", name];
        args.extend_from_slice(extra);
        args.extend([
            "secret",
            "sh",
            "-c",
            "echo LOG-LINE; cat /etc/token; exec sleep 600",
        ]);
        let id = ok(&f, &args).trim().to_string();
        started.1.push(name);
        assert_eq!(id.len(), 64, "{id}");
        wait_for(20, &format!("{name}'s log"), || {
            text(&out(&f, &["logs", name]).stdout).contains("SECRET-TOKEN")
        });
        logs.push((
            f.root.join("containers").join(&id).join("ctr.log"),
            f.runroot().join("containers").join(&id).join("state.json"),
        ));
    }

    // The modes, as root sees them.
    let run = f.runroot();
    for d in [
        f.root.clone(),
        f.root.join("objects"),
        f.root.join("images"),
        f.root.join("layers"),
        f.root.join("refs"),
        f.root.join("tmp"),
        f.root.join("containers"),
        run.clone(),
    ] {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
    }
    let image = one_entry(&f.root.join("images"), |e| !e.ends_with(".json"));
    let record = image.with_extension("json");
    let layer = one_entry(&f.root.join("layers"), |e| e.starts_with("sha256:"));
    let layer_record = layer.join("layer.json");
    let dump = layer.join("entries");
    let refs = f.root.join("refs/secret");
    for p in [&image, &record, &layer_record, &dump, &refs] {
        assert_eq!(mode(p), 0o600, "{}", p.display());
    }
    for (log, state) in &logs {
        assert_eq!(mode(log), 0o600, "{}", log.display());
        assert_eq!(mode(state), 0o600, "{}", state.display());
        assert!(fs::read_to_string(log).unwrap().contains("LOG-LINE"));
    }
    // The object of /etc/shadow: found by its content.
    let objects = objects_fingerprint(&f.root);
    let shadow_hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(SHADOW));
    let shadow_object = objects
        .iter()
        .find(|(_, (_, h))| *h == shadow_hash)
        .map(|(p, _)| f.root.join("objects").join(p))
        .expect("the shadow file is an object");
    assert!(
        fs::read(&image)
            .unwrap()
            .windows(TOKEN.len())
            .any(|w| w == TOKEN.as_bytes()),
        "the token is inlined in the image"
    );

    // The premise: nobody reaches the store's parent, so only the store's
    // own modes can keep it out.
    let o = as_nobody(&[os("ls"), f.base().as_os_str()]);
    assert!(
        o.status.success() && text(&o.stdout).contains("store"),
        "nobody cannot list {}: {}",
        f.base().display(),
        text(&o.stderr)
    );

    // nobody lists nothing and reads nothing.
    for dir in [
        &f.root,
        &f.root.join("objects"),
        &f.root.join("images"),
        &f.root.join("containers"),
        &run,
        &run.join("containers"),
    ] {
        assert_nobody_denied("ls", dir);
    }
    for file in [
        &shadow_object,
        &image,
        &record,
        &layer_record,
        &dump,
        &refs,
        &logs[0].0,
        &logs[0].1,
        &logs[1].0,
        &logs[1].1,
    ] {
        assert_nobody_denied("cat", file);
    }
    // Not even what a directory holds by name (stat needs search permission).
    assert_nobody_denied("stat", &shadow_object);

    // Inside containers, the image's modes hold: with host ids and in a
    // user namespace (idmapped layers; container root is an unprivileged
    // host uid, which cannot traverse the store itself).
    assert_modes_hold_inside(&f, &[]);
    assert_modes_hold_inside(&f, &["--userns", "auto"]);
    // And in the running detached containers.
    for name in ["logger", "logger-ns"] {
        assert_eq!(ok(&f, &["exec", name, "cat", "/etc/shadow"]), SHADOW);
        let o = out(&f, &["exec", "-u", "1000", name, "cat", "/root/key"]);
        assert!(
            !o.status.success() && text(&o.stderr).contains("Permission denied"),
            "{name}: alice read /root/key: {}",
            text(&o.stdout)
        );
    }
    drop(started);
}

/// A store made by an older cairn (0755 directories, 0644 records) is
/// private again after its next write; fsck reports a store or run root
/// made wider, and a repair narrows them.
#[test]
fn privileged_private_store_fsck_reports_and_repairs_wide_directories() {
    let f = fixture();
    let run = f.runroot();
    // A container makes the run root.
    ok(&f, &["run", "secret", "true"]);
    assert_eq!(mode(&run), 0o700);
    assert!(
        out(&f, &["fsck"]).status.success(),
        "a fresh store checks clean"
    );

    fs::set_permissions(&f.root, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(f.root.join("objects"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(&run, fs::Permissions::from_mode(0o755)).unwrap();
    let o = out(&f, &["--json", "fsck"]);
    assert!(!o.status.success(), "fsck passed a wide store");
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("fsck --json: {e}: {}", text(&o.stdout)));
    let wide: Vec<String> = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert_eq!(p["kind"], "wide-directory", "{p}");
            p["message"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(wide.len(), 3, "{wide:?}");
    for (p, msg) in [&f.root, &f.root.join("objects"), &run].iter().zip(&wide) {
        assert!(
            msg.starts_with(&format!("{}: mode 0755", p.display())),
            "{msg}"
        );
    }
    // Checking changed nothing.
    assert_eq!(mode(&f.root), 0o755);

    let o = out(&f, &["--json", "fsck", "--repair"]);
    assert!(
        o.status.success(),
        "fsck --repair: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let repairs = report["repairs"].as_array().unwrap();
    assert_eq!(repairs.len(), 3, "{repairs:?}");
    assert_eq!(
        repairs[0].as_str().unwrap(),
        format!("made {} private (mode 0700, was 0755)", f.root.display())
    );
    for d in [&f.root, &f.root.join("objects"), &run] {
        assert_eq!(mode(d), 0o700, "{}", d.display());
    }
    assert!(out(&f, &["fsck"]).status.success());

    // The next write narrows a store made wider: an import (tag) and a run.
    for (how, args) in [
        ("tag", &["tag", "secret", "again"][..]),
        ("run", &["run", "secret", "true"][..]),
    ] {
        for d in [
            &f.root,
            &f.root.join("images"),
            &f.root.join("containers"),
            &run,
        ] {
            if d.exists() {
                fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        ok(&f, args);
        assert_eq!(mode(&f.root), 0o700, "after {how}");
        assert_eq!(mode(&f.root.join("images")), 0o700, "after {how}");
        if how == "run" {
            assert_eq!(mode(&run), 0o700, "after {how}");
        }
    }
    assert!(out(&f, &["fsck"]).status.success());
}
