//! A listener's record: its directory under `<root>/listeners`, its
//! `listen.json`, its name, and the commands that list, find, stop or
//! reap listeners. The proxy process writes the record; everything here
//! can run in any process.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};

use crate::state::{self, Paths};
use crate::RunError;

/// Where a listener is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ListenStatus {
    /// Listening, no container.
    Waiting,
    /// Starting the container for a connection.
    Starting,
    /// The container runs and connections are forwarded.
    Active,
    /// Stopping the container (idle, or the listener ends).
    Stopping,
}

/// `listen.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListenState {
    pub id: String,
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    /// HOSTADDR:HOSTPORT.
    pub listen: String,
    pub container_port: u16,
    pub idle_stop_ms: Option<u64>,
    pub stop_timeout_ms: u64,
    pub created: u64,
    pub proxy_pid: Option<i32>,
    pub status: ListenStatus,
    /// The running container's id.
    pub container: Option<String>,
    /// How many times a container was started.
    pub starts: u64,
    /// Connections accepted.
    pub connections: u64,
    pub last_error: Option<String>,
}

/// A started listener.
#[derive(Debug, Clone, Serialize)]
pub struct Listening {
    pub id: String,
    pub name: String,
    pub listen: String,
}

/// `<root>/listeners`.
pub fn listeners_dir(paths: &Paths) -> PathBuf {
    paths.root().join("listeners")
}

pub(super) fn names_dir(paths: &Paths) -> PathBuf {
    listeners_dir(paths).join("names")
}

pub(super) fn io_err(what: &str, path: &Path, e: io::Error) -> RunError {
    RunError::io(what, path, e)
}

pub(super) fn write_state(dir: &Path, st: &ListenState) -> Result<(), RunError> {
    let path = dir.join("listen.json");
    let tmp = dir.join(".listen.json.tmp");
    let data = serde_json::to_vec_pretty(st).expect("listen state serializes");
    state::write_private(&tmp, &data)
        .and_then(|()| fs::rename(&tmp, &path))
        .map_err(|e| io_err("writing", &path, e))
}

fn read_state(dir: &Path) -> Option<ListenState> {
    serde_json::from_slice(&fs::read(dir.join("listen.json")).ok()?).ok()
}

/// Takes a listener's lock if its proxy is gone.
fn try_lock(dir: &Path) -> Option<File> {
    let f = File::open(dir.join("lock")).ok()?;
    flock(&f, FlockOperation::NonBlockingLockExclusive)
        .ok()
        .map(|()| f)
}

fn is_id(s: &str) -> bool {
    state::is_id(s)
}

pub(super) fn release_name(paths: &Paths, name: &str, id: &str) {
    let link = names_dir(paths).join(name);
    if fs::read_link(&link).is_ok_and(|o| o == Path::new(id)) {
        let _ = fs::remove_file(&link);
    }
}

/// Tears down an abandoned listener (its lock is held by the caller):
/// stops its container, releases its name, removes its directory.
fn cleanup(paths: &Paths, dir: &Path, st: Option<&ListenState>, timeout: Duration) {
    if let Some(st) = st {
        // The container: by the recorded id, or (started but not yet
        // recorded when the proxy died) by the name it was given.
        let ctr = st
            .container
            .clone()
            .filter(|c| paths.container(c).exists())
            .or_else(|| {
                let owner = fs::read_link(paths.names().join(&st.name)).ok()?;
                let owner = owner.to_str()?.to_string();
                let s = state::read_state(&paths.container(&owner)).ok()??;
                (s.image == st.image && s.detached && s.remove).then_some(owner)
            });
        if let Some(c) = ctr {
            if let Err(e) = crate::lifecycle::stop(paths, &c, timeout) {
                tracing::warn!("stopping container {c} of listener {}: {e}", st.name);
            }
        }
        release_name(paths, &st.name, &st.id);
    }
    let _ = fs::remove_dir_all(dir);
}

/// Removes listeners whose proxy is gone (stopping their containers).
pub fn reap_listeners(paths: &Paths) -> usize {
    let mut n = 0;
    let Ok(rd) = fs::read_dir(listeners_dir(paths)) else {
        return 0;
    };
    for e in rd.flatten() {
        let Some(id) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !is_id(&id) {
            continue;
        }
        let dir = e.path();
        let Some(lock) = try_lock(&dir) else { continue };
        let st = read_state(&dir);
        if st.is_none() {
            // Being created right now, or debris of a launcher that died.
            let old = fs::metadata(&dir)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|a| a > Duration::from_secs(60));
            if !old {
                continue;
            }
        }
        let timeout = st
            .as_ref()
            .map_or(Duration::ZERO, |s| Duration::from_millis(s.stop_timeout_ms));
        cleanup(paths, &dir, st.as_ref(), timeout);
        drop(lock);
        n += 1;
    }
    // Names whose listener is gone.
    for e in fs::read_dir(names_dir(paths))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(target) = fs::read_link(e.path()) {
            if !listeners_dir(paths).join(&target).exists() {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    n
}

/// All live listeners (abandoned ones reaped first).
pub fn list_listeners(paths: &Paths) -> Result<Vec<ListenState>, RunError> {
    reap_listeners(paths);
    let mut out: Vec<ListenState> = match fs::read_dir(listeners_dir(paths)) {
        Ok(rd) => rd
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_id))
            .filter_map(|e| read_state(&e.path()))
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_err("listing", &listeners_dir(paths), e)),
    };
    out.sort_by(|a, b| b.created.cmp(&a.created).then(a.id.cmp(&b.id)));
    Ok(out)
}

/// The id of the listener `what` names (name, id or unique id prefix), if any.
pub fn lookup_listener(paths: &Paths, what: &str) -> Option<String> {
    if state::validate_name(what).is_ok() {
        if let Ok(t) = fs::read_link(names_dir(paths).join(what)) {
            if let Some(id) = t.to_str() {
                if listeners_dir(paths).join(id).is_dir() {
                    return Some(id.to_string());
                }
            }
        }
    }
    if what.len() < 4 {
        return None;
    }
    let mut found = fs::read_dir(listeners_dir(paths))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|id| is_id(id) && id.starts_with(what));
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// Ends listener `id`: the proxy closes its socket and stops its
/// container (SIGKILL after `timeout`). Returns once it is gone.
pub fn stop_listener(paths: &Paths, id: &str, timeout: Duration) -> Result<ListenState, RunError> {
    let dir = listeners_dir(paths).join(id);
    let st = read_state(&dir).ok_or_else(|| RunError::NoSuchContainer(id.to_string()))?;
    if let Some(lock) = try_lock(&dir) {
        // No proxy: clean up here.
        cleanup(paths, &dir, Some(&st), timeout);
        drop(lock);
        return Ok(st);
    }
    let req = dir.join("stop");
    fs::write(&req, timeout.as_millis().to_string()).map_err(|e| io_err("writing", &req, e))?;
    if let Some(pid) = st.proxy_pid.and_then(rustix::process::Pid::from_raw) {
        // The lock is held, so the recorded pid is the live proxy's.
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + timeout + Duration::from_secs(30);
    loop {
        if !dir.exists() {
            return Ok(st);
        }
        if let Some(lock) = try_lock(&dir) {
            cleanup(paths, &dir, read_state(&dir).as_ref(), timeout);
            drop(lock);
            return Ok(st);
        }
        if Instant::now() > deadline {
            return Err(RunError::Crun(format!(
                "the proxy of listener {} did not end",
                st.name
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
