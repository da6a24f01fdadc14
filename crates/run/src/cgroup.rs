//! Cgroups for containers, on whatever layout the host has.
//!
//! - **Unified** (pure cgroup2): crun does its normal work with
//!   `--cgroup-manager cgroupfs` and `linux.cgroupsPath = /cairn/<id>`;
//!   limits go into `linux.resources`.
//! - **Legacy** (cgroup v1 only): the same; crun applies the limits
//!   through the v1 controllers.
//! - **Hybrid** (v1 controllers plus an almost empty cgroup2 at
//!   `/sys/fs/cgroup/unified`), which crun 1.8 refuses. cairn makes a
//!   cgroup2 group `unified/<own>/cairn-<id>`, starts crun in it, and runs
//!   crun in a new cgroup and mount namespace with cgroup2 mounted on
//!   `/sys/fs/cgroup`: crun sees a pure cgroup2 host whose root is that
//!   group, and with its cgroup manager off (`crun::global_args`) the
//!   container stays in that group. Limits cannot go
//!   through crun there (the controllers are on v1, and its cgroup2 device
//!   filter needs `CAP_SYS_RESOURCE`), so `--memory`, `--cpus` and
//!   `--pids-limit` are written into v1 groups `<memory|cpu|pids mount>/
//!   <own>/cairn-<id>` that crun joins before it starts the container.
//!   Every crun call for the container (exec, kill, delete) enters the same
//!   view, or crun cannot find the container's cgroup.
//!
//! `<own>` is the caller's cgroup in that hierarchy (`/proc/self/cgroup`),
//! so a container stays inside whatever limits its caller lives under.
//!
//! The hybrid groups sit flat beside the caller's other groups, without a
//! shared `cairn` parent: a parent would have to be made and removed
//! around every container (or left behind), and each cgroup mkdir and
//! rmdir costs tens of microseconds on the way to a container's start and
//! exit.
//!
//! Nothing here changes a `subtree_control` file: controllers are never
//! enabled on cgroup2 in hybrid mode. Groups are removed at teardown,
//! deepest first, and a `cairn` parent (unified and legacy layouts) too
//! once it is empty.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::spec::{Limits, CPU_PERIOD_US};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// How the host's cgroups are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    Unified,
    Hybrid,
    Legacy,
}

/// Finds the layout from the filesystems mounted at `/sys/fs/cgroup`.
pub fn detect() -> Layout {
    // f_type is a c_long, whose width depends on the target.
    #[allow(clippy::unnecessary_cast)]
    let magic = |p: &str| {
        rustix::fs::statfs(p)
            .map(|s| s.f_type as i64)
            .unwrap_or_default()
    };
    classify(magic(CGROUP_ROOT), || magic("/sys/fs/cgroup/unified"))
}

/// The layout from the filesystem type of `/sys/fs/cgroup` and (asked only
/// when that is a tmpfs) of `/sys/fs/cgroup/unified`.
fn classify(root: i64, unified: impl FnOnce() -> i64) -> Layout {
    match root {
        CGROUP2_SUPER_MAGIC => Layout::Unified,
        TMPFS_MAGIC if unified() == CGROUP2_SUPER_MAGIC => Layout::Hybrid,
        _ => Layout::Legacy,
    }
}

/// The cgroups one container uses; recorded in its state so that any
/// process can tear them down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cgroups {
    pub layout: Layout,
    /// Hybrid: the cgroup2 group crun runs in (the root of its view).
    #[serde(default)]
    pub view: Option<PathBuf>,
    /// Hybrid: v1 groups holding the limits; crun joins them.
    #[serde(default)]
    pub v1: Vec<PathBuf>,
    /// Unified/legacy: `linux.cgroupsPath` for crun.
    #[serde(default)]
    pub crun_path: Option<String>,
    /// Groups to remove at teardown (deepest last in this list; removal
    /// walks each recursively), and their `cairn` parents.
    #[serde(default)]
    pub owned: Vec<PathBuf>,
}

/// The caller's cgroup path in the hierarchy whose `/proc/self/cgroup`
/// line matches `pick` (on its controller list).
fn own_path(pick: impl Fn(&str) -> bool) -> String {
    let text = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next(), parts.next(), parts.next());
        if let (Some(c), Some(p)) = (ctrls, path) {
            if pick(c) {
                return p.to_string();
            }
        }
    }
    "/".into()
}

/// Where the v1 hierarchy holding `controller` is mounted.
fn v1_mount(controller: &str) -> Option<PathBuf> {
    let table = cairn_mount::mount_table().ok()?;
    table
        .into_iter()
        .find(|m| m.fs_type == "cgroup" && m.super_options.split(',').any(|o| o == controller))
        .map(|m| m.mount_point)
}

/// The prefix of a hybrid host's container groups: `cairn-<id>`.
pub const GROUP_PREFIX: &str = "cairn-";

/// `base/own/cairn-<id>`: container `id`'s group beside the caller's.
fn join(base: &Path, own: &str, id: &str) -> PathBuf {
    base.join(own.trim_start_matches('/'))
        .join(format!("{GROUP_PREFIX}{id}"))
}

/// Plans the groups for container `id` with `limits` (nothing is made).
pub fn plan(id: &str, layout: Layout, limits: &Limits) -> io::Result<Cgroups> {
    let mut cg = Cgroups {
        layout,
        view: None,
        v1: Vec::new(),
        crun_path: None,
        owned: Vec::new(),
    };
    match layout {
        Layout::Unified => {
            cg.crun_path = Some(format!("/cairn/{id}"));
            cg.owned.push(Path::new(CGROUP_ROOT).join("cairn").join(id));
        }
        Layout::Legacy => {
            cg.crun_path = Some(format!("/cairn/{id}"));
            for c in [
                "memory", "cpu", "pids", "cpuset", "cpuacct", "devices", "freezer", "blkio",
            ] {
                if let Some(m) = v1_mount(c) {
                    let g = m.join("cairn").join(id);
                    if !cg.owned.contains(&g) {
                        cg.owned.push(g);
                    }
                }
            }
            let named = Path::new(CGROUP_ROOT).join("systemd/cairn").join(id);
            cg.owned.push(named);
        }
        Layout::Hybrid => {
            let view = join(
                &Path::new(CGROUP_ROOT).join("unified"),
                &own_path(|c| c.is_empty()),
                id,
            );
            cg.owned.push(view.clone());
            cg.view = Some(view);
            let wanted = [
                ("memory", limits.memory.is_some()),
                ("cpu", limits.cpus.is_some()),
                ("pids", limits.pids.is_some()),
            ];
            for (controller, want) in wanted {
                if !want {
                    continue;
                }
                let mount = v1_mount(controller).ok_or_else(|| {
                    io::Error::other(format!(
                        "--{} needs the cgroup v1 {controller} controller, which is not mounted",
                        match controller {
                            "memory" => "memory",
                            "cpu" => "cpus",
                            _ => "pids-limit",
                        }
                    ))
                })?;
                let own = own_path(|c| c.split(',').any(|x| x == controller));
                let g = join(&mount, &own, id);
                cg.owned.push(g.clone());
                cg.v1.push(g);
            }
        }
    }
    Ok(cg)
}

/// Makes the groups `plan` chose and writes the limits into them. On
/// error whatever was made is removed again.
pub fn make(cg: &Cgroups, limits: &Limits) -> io::Result<()> {
    let made = make_groups(cg, limits);
    if made.is_err() {
        remove(cg);
    }
    made
}

fn make_groups(cg: &Cgroups, limits: &Limits) -> io::Result<()> {
    if cg.layout != Layout::Hybrid {
        // crun makes them.
        return Ok(());
    }
    let mut groups: Vec<&PathBuf> = cg.view.iter().collect();
    groups.extend(cg.v1.iter());
    for g in groups {
        mkdir_group(g)?;
    }
    for g in &cg.v1 {
        let write = |file: &str, value: String| {
            fs::write(g.join(file), &value).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("writing {value} to {}: {e}", g.join(file).display()),
                )
            })
        };
        if g.join("memory.limit_in_bytes").exists() {
            if let Some(m) = limits.memory {
                write("memory.limit_in_bytes", m.to_string())?;
            }
        }
        if g.join("cpu.cfs_quota_us").exists() {
            if let Some(q) = limits.cpu_quota_us() {
                write("cpu.cfs_period_us", CPU_PERIOD_US.to_string())?;
                write("cpu.cfs_quota_us", q.to_string())?;
            }
        }
        if g.join("pids.max").exists() {
            if let Some(p) = limits.pids {
                write("pids.max", p.to_string())?;
            }
        }
    }
    Ok(())
}

/// Makes the group `path` (and, like `mkdir -p`, any missing parent).
/// The parent is the caller's own group, so no other container's teardown
/// can remove it meanwhile.
fn mkdir_group(path: &Path) -> io::Result<()> {
    fs::create_dir_all(path)
        .map_err(|e| io::Error::new(e.kind(), format!("creating cgroup {}: {e}", path.display())))
}

/// The `cgroup.procs` files a crun process for this container joins.
pub fn procs_files(cg: &Cgroups) -> Vec<PathBuf> {
    cg.view
        .iter()
        .chain(cg.v1.iter())
        .map(|g| g.join("cgroup.procs"))
        .collect()
}

/// Removes the container's groups (children first) and each `cairn` parent
/// left empty. Idempotent; groups still holding processes stay (EBUSY) and
/// are reported.
pub fn remove(cg: &Cgroups) -> Vec<String> {
    let mut problems = Vec::new();
    for g in &cg.owned {
        if let Err(e) = rmdir_tree(g) {
            if e.kind() != io::ErrorKind::NotFound {
                problems.push(format!("removing cgroup {}: {e}", g.display()));
            }
        }
        if let Some(parent) = g.parent() {
            if parent.file_name().is_some_and(|n| n == "cairn") {
                // Fails while other containers use it: fine.
                let _ = fs::remove_dir(parent);
            }
        }
    }
    problems
}

fn rmdir_tree(g: &Path) -> io::Result<()> {
    // Usually the group is empty (crun removed its own below it): one
    // rmdir. Child groups or an exiting process make it EBUSY.
    match fs::remove_dir(g) {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
        r => return r,
    }
    for e in fs::read_dir(g)?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            rmdir_tree(&e.path())?;
        }
    }
    // A group empties asynchronously after its last process was reaped;
    // give it a moment: 2 ms, doubling up to 100 ms, about 1.5 s in all
    // (100 ms was too little for a loaded machine: CI saw a group left).
    let mut wait = std::time::Duration::from_millis(2);
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    loop {
        match fs::remove_dir(g) {
            Err(e)
                if e.raw_os_error() == Some(libc::EBUSY)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(wait);
                wait = (wait * 2).min(std::time::Duration::from_millis(100));
            }
            r => return r,
        }
    }
}

/// Whether `name` is a flat container group, `cairn-<64 hex digits>`.
pub fn is_container_group(name: &str) -> bool {
    name.strip_prefix(GROUP_PREFIX)
        .is_some_and(|id| id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_the_three_layouts() {
        let never = || panic!("/sys/fs/cgroup/unified looked at");
        assert_eq!(classify(CGROUP2_SUPER_MAGIC, never), Layout::Unified);
        assert_eq!(
            classify(TMPFS_MAGIC, || CGROUP2_SUPER_MAGIC),
            Layout::Hybrid
        );
        assert_eq!(classify(TMPFS_MAGIC, || TMPFS_MAGIC), Layout::Legacy);
        assert_eq!(classify(TMPFS_MAGIC, || 0), Layout::Legacy);
    }

    /// statfs (what `detect` asks) and the mount table (what this test
    /// reads) must tell the same story about this host, whichever it is.
    #[test]
    fn detect_agrees_with_the_mount_table() {
        let table = cairn_mount::mount_table().expect("reading the mount table");
        let fs_at = |p: &str| {
            table
                .iter()
                .rev()
                .find(|m| m.mount_point == Path::new(p))
                .map(|m| m.fs_type.as_str())
        };
        let expected = match (fs_at(CGROUP_ROOT), fs_at("/sys/fs/cgroup/unified")) {
            (Some("cgroup2"), _) => Layout::Unified,
            (Some("tmpfs"), Some("cgroup2")) => Layout::Hybrid,
            _ => Layout::Legacy,
        };
        assert_eq!(detect(), expected);
    }

    /// The group this process is in, as `own_path` reads it, is a directory
    /// of the hierarchy it names.
    #[test]
    fn own_path_names_a_group_that_exists() {
        let (base, own) = match detect() {
            Layout::Unified => (PathBuf::from(CGROUP_ROOT), own_path(|c| c.is_empty())),
            Layout::Hybrid => (
                PathBuf::from("/sys/fs/cgroup/unified"),
                own_path(|c| c.is_empty()),
            ),
            Layout::Legacy => (
                v1_mount("pids").expect("a legacy host has a pids hierarchy"),
                own_path(|c| c.split(',').any(|x| x == "pids")),
            ),
        };
        let group = base.join(own.trim_start_matches('/'));
        assert!(group.is_dir(), "{} is not a directory", group.display());
    }

    #[test]
    fn join_nests_under_own_group() {
        assert_eq!(
            join(Path::new("/sys/fs/cgroup/memory"), "/a/b", "x"),
            Path::new("/sys/fs/cgroup/memory/a/b/cairn-x")
        );
        assert_eq!(
            join(Path::new("/sys/fs/cgroup/unified"), "/", "x"),
            Path::new("/sys/fs/cgroup/unified/cairn-x")
        );
        let id = "ab".repeat(32);
        assert!(is_container_group(&format!("cairn-{id}")));
        assert!(!is_container_group("cairn-bench3-123"));
        assert!(!is_container_group(&id));
    }
}
