//! Containers: one record per container (its `state.json`, the lock that
//! tells a live container from a dead one), names, and what a container
//! keeps on disk.
//!
//! ```text
//! <runroot>/                runtime state (`--runroot`): /run/cairn for the
//! │                         default store, <root>/run for another one;
//! │                         mode 0700, as the store is private (below)
//! ├── containers/
//! │   ├── <id>/             the record; 64 hex digits
//! │   │   ├── lock          flock'ed exclusively by the container's monitor
//! │   │   │                 (and its launcher) for as long as it runs
//! │   │   ├── state.json    State (see `write_state`: for an instant, or after
//! │   │   │                 a crash then, a complete .state.json.tmp stands in)
//! │   │   └── pid           the container's init pid (crun --pid-file)
//! │   ├── names/<name> → <id>  symlinks; creating one is the name's claim (a
//! │   │                     --name; a default name, the id's first 12 digits,
//! │   │                     is found as an id prefix)
//! │   └── userns/<slot>     one file per allocated --userns auto range
//! ├── crun/                 crun's own state (--root)
//! └── bundle/               empty here; in each crun's private mount namespace
//!                           the container's OCI bundle, a tmpfs of its own
//!                           (config.json; hosts, resolv.conf, hostname, bind-
//!                           mounted into /etc), with the overlay on its rootfs/
//!
//! <root>/containers/<id>/   data, only for containers that have some
//! │                         (<root>/containers/ is mode 0700)
//! ├── ctr.log               stdout+stderr of a detached container (0600)
//! ├── keep                  --keep: the upper stays when the record goes
//! ├── upper/ work/          --upper disk
//! ├── upper.img             --upper disk:SIZE: the sparse ext4 file behind upperfs/
//! └── upperfs/              a kept tmpfs upper (a host tmpfs mount, until rm),
//!                           or a disk:SIZE upper (its loop-mounted ext4)
//! ```
//!
//! The records and crun's state are written and removed by every container
//! start and are meant for a tmpfs, as containerd's and podman's runtime
//! state under /run is; they go with a reboot, as the containers do. On a
//! disk filesystem each of those files is an inode and a block allocated
//! and freed (on this project's test machine, ext4 without a journal, also
//! slow to reuse the inode): about 0.5 ms of a `cairn run`
//! (bench/README.md). What must outlive a reboot or may grow (disk uppers,
//! logs) is in the store; data without a record is removed by the reaper,
//! kept uppers excepted. Every command on a store must use the same run
//! root (as with podman's `--runroot`).
//!
//! Both are private (see `cairn_store`'s `private` module): the run root
//! and `<root>/containers/` are mode 0700, made so (or narrowed) by every
//! container start; records and logs are 0600. Nothing there is for other
//! users: the console sockets are crun's (root's), the on-demand listeners
//! take TCP connections, and a container reaches its rootfs and upper only
//! through the overlay, which reads them with root's credentials.
//!
//! "Is this container alive?" is answered by the lock, not by a pid: the
//! kernel drops a `flock` when its holder dies however it dies, so a
//! container whose lock can be taken and whose state still says running
//! was abandoned, and is torn down by whoever notices (see `reap`).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};

use crate::cgroup::Cgroups;
use crate::spec::Limits;
use crate::RunError;

/// Where everything of `cairn run` lives: records, names, crun's state and
/// the bundle mount point below the run root; what a container keeps on
/// disk below the store root.
#[derive(Debug, Clone)]
pub struct Paths {
    root: PathBuf,
    run: PathBuf,
}

impl Paths {
    /// A store whose run root is its own `run/` directory.
    pub fn new(root: &Path) -> Self {
        let root = std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf());
        let run = root.join("run");
        Paths { root, run }
    }
    /// A store with its runtime state under `run` (as podman's `--runroot`:
    /// meant for a tmpfs such as `/run`, whose contents go with a reboot,
    /// as the containers do).
    pub fn with_runroot(root: &Path, run: &Path) -> Self {
        Paths {
            run: std::path::absolute(run).unwrap_or_else(|_| run.to_path_buf()),
            ..Paths::new(root)
        }
    }
    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn runroot(&self) -> &Path {
        &self.run
    }
    /// The containers' records.
    pub fn containers(&self) -> PathBuf {
        self.run.join("containers")
    }
    /// A container's record: its lock, state and pid file.
    pub fn container(&self, id: &str) -> PathBuf {
        self.containers().join(id)
    }
    /// What of the containers must be on disk (disk uppers, logs).
    pub fn data_dirs(&self) -> PathBuf {
        self.root.join("containers")
    }
    /// A container's data: a disk upper, a kept upper, the log of a
    /// detached container. Made only for containers that have one.
    pub fn data_dir(&self, id: &str) -> PathBuf {
        self.data_dirs().join(id)
    }
    pub fn names(&self) -> PathBuf {
        self.containers().join("names")
    }
    pub fn userns(&self) -> PathBuf {
        self.containers().join("userns")
    }
    pub fn crun_root(&self) -> PathBuf {
        self.run.join("crun")
    }
    /// The container's init pid, as crun writes it (`--pid-file`).
    pub fn pid_file(&self, id: &str) -> PathBuf {
        self.container(id).join("pid")
    }
    /// Where each container's bundle is attached, in crun's own mount
    /// namespace only (an empty directory on the host).
    pub fn bundle_mountpoint(&self) -> PathBuf {
        self.run.join("bundle")
    }
    pub fn userns_conf(&self) -> PathBuf {
        self.root.join("userns.conf")
    }

    /// Makes the run root private (0700): creates it so if missing, narrows
    /// it if it lets other users in. One `stat` when it is private already.
    pub fn make_runroot_private(&self) -> Result<(), RunError> {
        match cairn_store::ensure_private_dir(&self.run) {
            Ok(Some(mode)) => {
                tracing::info!(
                    "{}: mode {mode:04o} let other users in; now {:04o}",
                    self.run.display(),
                    cairn_store::PRIVATE_DIR_MODE
                );
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => Err(io_err("making private", &self.run, e)),
        }
    }

    /// Creates `<root>/containers/<id>/` (and `<root>/containers/`, 0700,
    /// if missing).
    pub(crate) fn create_data_dir(&self, id: &str) -> Result<PathBuf, RunError> {
        let dirs = self.data_dirs();
        cairn_store::create_private_dir(&dirs, false).map_err(|e| io_err("creating", &dirs, e))?;
        let data = self.data_dir(id);
        fs::create_dir_all(&data).map_err(|e| io_err("creating", &data, e))?;
        Ok(data)
    }
}

/// Writes `data` to `path`, created mode 0600 (callers then rename it into
/// place, so it is new each time; one left over by a crash of an older
/// cairn keeps its mode, inside the private run root).
pub(crate) fn write_private(path: &Path, data: &[u8]) -> io::Result<()> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(cairn_store::PRIVATE_FILE_MODE)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?
        .write_all(data)
}

/// Where a container is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Being set up; no container process yet.
    Creating,
    Running,
    /// Finished; resources released, the record (and log, kept upper) left.
    Exited,
}

/// The writable layer a container got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum UpperKind {
    Tmpfs {
        size: u64,
    },
    /// A host directory; with a size, its own loop-mounted filesystem.
    Disk {
        #[serde(default)]
        size: Option<u64>,
    },
}

/// An id range of a user namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsernsRange {
    pub uid: u32,
    pub gid: u32,
    pub count: u32,
    /// The pool slot, for `--userns auto`.
    pub slot: Option<u32>,
}

/// `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub id: String,
    pub name: String,
    /// The image as the user named it.
    pub image: String,
    pub image_digest: String,
    pub command: Vec<String>,
    /// Seconds since the epoch.
    pub created: u64,
    pub status: Status,
    /// The container's init process, as the host sees it.
    pub pid: Option<i32>,
    pub monitor_pid: Option<i32>,
    pub exit_code: Option<i32>,
    pub finished: Option<u64>,
    pub upper: UpperKind,
    /// Keep the upper after exit.
    pub keep: bool,
    /// Where a kept upper is.
    pub kept_upper: Option<PathBuf>,
    /// Remove the record at exit (`--rm`, and every foreground run).
    pub remove: bool,
    pub detached: bool,
    pub tty: bool,
    pub userns: Option<UsernsRange>,
    pub log_path: Option<PathBuf>,
    pub stop_signal: String,
    pub cgroups: Option<Cgroups>,
    pub limits: Limits,
}

/// The container's init pid from crun's pid file, if crun wrote one.
pub fn read_pid(paths: &Paths, st: &State) -> Option<i32> {
    fs::read_to_string(paths.pid_file(&st.id))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A new random container id (64 hex digits).
pub fn new_id() -> String {
    let mut bytes = [0u8; 32];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => {
                // No getrandom: mix time and pid; ids need to be unique, not secret.
                let t = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let seed = t ^ (u128::from(std::process::id()) << 64);
                bytes[..16].copy_from_slice(&seed.to_le_bytes());
                filled = bytes.len();
            }
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `s` is a container id.
pub fn is_id(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Container names: what podman allows, `[a-zA-Z0-9][a-zA-Z0-9_.-]*`.
pub fn validate_name(name: &str) -> Result<(), RunError> {
    let ok = name.len() <= 128
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(RunError::Invalid(format!(
            "invalid container name {name:?}: use letters, digits, '_', '.', '-', starting with a letter or digit"
        )))
    }
}

/// An open container directory whose lock we hold.
#[derive(Debug)]
pub struct Locked {
    pub dir: PathBuf,
    /// Never read: the open file holds the `flock`, which goes when this is
    /// dropped (or with the process).
    _lock: File,
}

fn io_err(what: &str, path: &Path, e: io::Error) -> RunError {
    RunError::Io {
        what: what.to_string(),
        path: path.to_path_buf(),
        source: e,
    }
}

/// Makes `<containers>/<id>/` with its lock held by us (and the run root,
/// private, if missing).
pub fn create_dir(paths: &Paths, id: &str) -> Result<Locked, RunError> {
    paths.make_runroot_private()?;
    let containers = paths.containers();
    for d in [containers.clone(), paths.names(), paths.userns()] {
        fs::create_dir_all(&d).map_err(|e| io_err("creating", &d, e))?;
    }
    let dir = paths.container(id);
    fs::create_dir(&dir).map_err(|e| io_err("creating", &dir, e))?;
    let lock = open_lock(&dir)?;
    flock(&lock, FlockOperation::LockExclusive)
        .map_err(|e| io_err("locking", &dir.join("lock"), e.into()))?;
    Ok(Locked { dir, _lock: lock })
}

/// Opens (creating) the `lock` file of a container or listener directory.
pub(crate) fn open_lock(dir: &Path) -> Result<File, RunError> {
    let path = dir.join("lock");
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| io_err("opening", &path, e))
}

/// Takes the lock of an existing container if nobody holds it.
pub fn try_lock(dir: &Path) -> Result<Option<Locked>, RunError> {
    let path = dir.join("lock");
    let lock = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("opening", &path, e)),
    };
    match flock(&lock, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Some(Locked {
            dir: dir.to_path_buf(),
            _lock: lock,
        })),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
        Err(e) => Err(io_err("locking", &path, e.into())),
    }
}

/// Waits up to `timeout` for the container's lock (its monitor finishing).
pub fn wait_unlocked(dir: &Path, timeout: std::time::Duration) -> Result<bool, RunError> {
    let start = std::time::Instant::now();
    loop {
        if try_lock(dir)?.is_some() || !dir.exists() {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The record's file, and the complete next version while it replaces it.
const STATE: &str = "state.json";
const STATE_NEXT: &str = ".state.json.tmp";

/// Writes `state.json`, so that a reader always finds a complete state.
///
/// The new state is written in full to `.state.json.tmp`; the old
/// `state.json` is unlinked and the new one renamed into its place. Not a
/// rename over the old file: ext4 (`auto_da_alloc`, the default) allocates
/// and writes out the new file's blocks at once on a rename that replaces a
/// file, for ~0.17 ms per state change on this machine's disk against
/// ~0.03 ms this way. In the instant between unlink and rename (and after a
/// crash there) the complete state is the temporary file, which
/// [`read_state`] reads when `state.json` is missing.
pub fn write_state(dir: &Path, state: &State) -> Result<(), RunError> {
    let path = dir.join(STATE);
    let next = dir.join(STATE_NEXT);
    let data = serde_json::to_vec_pretty(state).expect("state serializes");
    let write = || -> io::Result<()> {
        write_private(&next, &data)?;
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        fs::rename(&next, &path)
    };
    write().map_err(|e| io_err("writing", &path, e))
}

/// Reads `state.json`; `None` if there is none (yet).
///
/// Where `state.json` is missing, a complete `.state.json.tmp` is the
/// state (see [`write_state`]); one that does not parse is a first state
/// being written, or the start of the next write after a rename this
/// reader just missed, so `state.json` is read again.
pub fn read_state(dir: &Path) -> Result<Option<State>, RunError> {
    let path = dir.join(STATE);
    let parse = |data: &[u8], at: &Path| {
        serde_json::from_slice(data)
            .map_err(|e| RunError::Invalid(format!("{}: invalid state: {e}", at.display())))
    };
    let next = dir.join(STATE_NEXT);
    for _ in 0..3 {
        match fs::read(&path) {
            Ok(data) => return parse(&data, &path).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("reading", &path, e)),
        }
        match fs::read(&next) {
            Ok(data) => {
                if let Ok(st) = parse(&data, &next) {
                    return Ok(Some(st));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("reading", &next, e)),
        }
    }
    Ok(None)
}

/// Whether the record in `dir` has a state (see [`write_state`]).
pub fn has_state(dir: &Path) -> bool {
    dir.join(STATE).exists() || dir.join(STATE_NEXT).exists()
}

/// Claims `name` for container `id` (fails if another live container has it).
pub fn claim_name(paths: &Paths, name: &str, id: &str) -> Result<(), RunError> {
    let link = paths.names().join(name);
    for _ in 0..2 {
        match std::os::unix::fs::symlink(id, &link) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let owner = fs::read_link(&link).ok();
                let stale = owner
                    .as_ref()
                    .and_then(|o| o.to_str())
                    .is_none_or(|o| !has_state(&paths.container(o)));
                if !stale {
                    return Err(RunError::Invalid(format!(
                        "the name {name:?} is in use by container {}",
                        owner.map(|o| o.display().to_string()).unwrap_or_default()
                    )));
                }
                // The owner is gone: remove its claim and try again.
                let _ = fs::remove_file(&link);
            }
            Err(e) => return Err(io_err("creating", &link, e)),
        }
    }
    Err(RunError::Invalid(format!("the name {name:?} is in use")))
}

/// Releases `name` if it still belongs to `id`.
pub fn release_name(paths: &Paths, name: &str, id: &str) {
    let link = paths.names().join(name);
    if fs::read_link(&link).is_ok_and(|o| o == Path::new(id)) {
        let _ = fs::remove_file(&link);
    }
}

/// Ids of all container directories.
pub fn list_ids(paths: &Paths) -> Result<Vec<String>, RunError> {
    let dir = paths.containers();
    let rd = match fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("listing", &dir, e)),
    };
    let mut ids: Vec<String> = rd
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_id(n))
        .collect();
    ids.sort();
    Ok(ids)
}

/// Finds a container by full id, name, or unique id prefix.
pub fn lookup(paths: &Paths, what: &str) -> Result<String, RunError> {
    if is_id(what) && paths.container(what).is_dir() {
        return Ok(what.to_string());
    }
    if validate_name(what).is_ok() {
        if let Ok(target) = fs::read_link(paths.names().join(what)) {
            if let Some(id) = target.to_str() {
                if paths.container(id).is_dir() {
                    return Ok(id.to_string());
                }
            }
        }
    }
    let matches: Vec<String> = list_ids(paths)?
        .into_iter()
        .filter(|id| !what.is_empty() && id.starts_with(what))
        .collect();
    match matches.len() {
        1 => Ok(matches.into_iter().next().expect("one match")),
        0 => Err(RunError::NoSuchContainer(what.to_string())),
        _ => Err(RunError::Invalid(format!(
            "{what:?} matches {} containers; give more of the id",
            matches.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hex_and_distinct() {
        let a = new_id();
        let b = new_id();
        assert!(is_id(&a) && is_id(&b));
        assert_ne!(a, b);
        assert!(!is_id("xyz"));
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("web-1.a_b").is_ok());
        assert!(validate_name("-x").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name("").is_err());
    }

    #[test]
    fn claims_names_and_reclaims_stale_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Paths::new(tmp.path());
        let a = new_id();
        let b = new_id();
        let _la = create_dir(&paths, &a).unwrap();
        fs::write(paths.container(&a).join("state.json"), "{}").unwrap();
        claim_name(&paths, "web", &a).unwrap();
        assert!(claim_name(&paths, "web", &b).is_err());
        assert_eq!(lookup(&paths, "web").unwrap(), a);
        assert_eq!(lookup(&paths, &a[..8]).unwrap(), a);
        fs::remove_dir_all(paths.container(&a)).unwrap();
        claim_name(&paths, "web", &b).unwrap();
        release_name(&paths, "web", &a);
        assert!(
            paths.names().join("web").exists() || fs::read_link(paths.names().join("web")).is_ok()
        );
        release_name(&paths, "web", &b);
        assert!(fs::read_link(paths.names().join("web")).is_err());
    }

    #[test]
    fn lock_is_exclusive_between_opens() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Paths::new(tmp.path());
        let id = new_id();
        let held = create_dir(&paths, &id).unwrap();
        assert!(try_lock(&held.dir).unwrap().is_none());
        drop(held);
        assert!(try_lock(&paths.container(&id)).unwrap().is_some());
    }

    fn sample(status: Status) -> State {
        State {
            id: new_id(),
            name: "web".into(),
            image: "demo".into(),
            image_digest: "sha256:00".into(),
            command: vec!["true".into()],
            created: 1,
            status,
            pid: None,
            monitor_pid: None,
            exit_code: None,
            finished: None,
            upper: UpperKind::Tmpfs { size: 1 << 20 },
            keep: false,
            kept_upper: None,
            remove: true,
            detached: false,
            tty: false,
            userns: None,
            log_path: None,
            stop_signal: "SIGTERM".into(),
            cgroups: None,
            limits: Default::default(),
        }
    }

    #[test]
    fn state_rewrites_leave_one_file_and_a_crash_between_unlink_and_rename_is_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        assert!(read_state(dir).unwrap().is_none());
        assert!(!has_state(dir));
        write_state(dir, &sample(Status::Creating)).unwrap();
        write_state(dir, &sample(Status::Running)).unwrap();
        let names: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
        assert_eq!(read_state(dir).unwrap().unwrap().status, Status::Running);

        // Killed after unlinking state.json, before the rename: the
        // complete next state is what a reader (the reaper) gets.
        let next = serde_json::to_vec(&sample(Status::Exited)).unwrap();
        fs::write(dir.join(STATE_NEXT), &next).unwrap();
        fs::remove_file(dir.join(STATE)).unwrap();
        assert!(has_state(dir));
        assert_eq!(read_state(dir).unwrap().unwrap().status, Status::Exited);

        // Killed while writing the first state: there is none yet.
        fs::write(dir.join(STATE_NEXT), &next[..next.len() / 2]).unwrap();
        assert!(read_state(dir).unwrap().is_none());
        // The next write replaces the debris.
        write_state(dir, &sample(Status::Creating)).unwrap();
        assert_eq!(read_state(dir).unwrap().unwrap().status, Status::Creating);
        assert!(!dir.join(STATE_NEXT).exists());

        // A corrupt state.json is an error that names it, not "no state".
        fs::write(dir.join(STATE), b"{").unwrap();
        let err = read_state(dir).unwrap_err().to_string();
        assert!(
            err.contains("state.json") && err.contains("invalid state"),
            "{err}"
        );
    }
}
