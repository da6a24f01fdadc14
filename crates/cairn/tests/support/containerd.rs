//! Debian's containerd 1.6 on its own root, state and socket under a
//! temporary directory (no CRI, no proxy snapshotter), with `ctr` and
//! `ctr-remote` (stargz-snapshotter's converter) pointed at it. Stopped,
//! and whatever it left mounted unmounted, on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub struct Containerd {
    dir: tempfile::TempDir,
    child: Child,
}

/// The namespace the tests use.
pub const NAMESPACE: &str = "cairn-test";

impl Containerd {
    pub fn start() -> Containerd {
        let dir = tempfile::Builder::new()
            .prefix("cairn-ctd-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let d = dir.path().display();
        std::fs::write(
            dir.path().join("config.toml"),
            format!(
                "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\n\
                 [grpc]\n  address = \"{d}/containerd.sock\"\n\n\
                 [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{d}/opt\"\n"
            ),
        )
        .unwrap();
        let child = Command::new("/usr/bin/containerd")
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("containerd.log")).unwrap())
            .spawn()
            .expect("starting /usr/bin/containerd (setup.sh installs containerd)");
        let c = Containerd { dir, child };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.out("ctr", &["version"]).status.success() {
            assert!(Instant::now() < deadline, "containerd did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// `ctr` or `ctr-remote` with this containerd's socket and namespace.
    pub fn out(&self, tool: &str, args: &[&str]) -> Output {
        Command::new(tool)
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", NAMESPACE])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running {tool} (setup.sh installs it): {e}"))
    }

    /// Like [`out`](Self::out), panicking with both logs unless it succeeds.
    pub fn ok(&self, tool: &str, args: &[&str]) -> String {
        let o = self.out(tool, args);
        assert!(
            o.status.success(),
            "{tool} {args:?} failed ({}): {}{}\ncontainerd log:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default(),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let prefix = format!("{}/", self.dir.path().display());
        let mut targets: Vec<&str> = mi
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.starts_with(&prefix))
            .collect();
        targets.sort();
        for t in targets.iter().rev() {
            let _ = rustix::mount::unmount(*t, rustix::mount::UnmountFlags::DETACH);
        }
    }
}
