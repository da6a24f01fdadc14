//! The teardown stage: releasing what `prepare` took for a container,
//! and the reaper that does so for containers whose monitor is gone.
//!
//! Everything a container holds is recorded in its `state.json` before it
//! is taken, so [`teardown`] works from the record alone and is
//! idempotent: the monitor runs it when crun exits, `prepare` when a later
//! step fails, and [`reap_one`] for a container found abandoned (its lock
//! free while its state says it runs). This module imports no other stage.

use std::fs;
use std::path::Path;
use std::time::Duration;

use crate::state::{self, Paths, State, Status, UsernsRange};
use crate::{cgroup, crun, userns, RunError};

/// The file behind a size-capped disk upper, in the container's directory.
pub(crate) const DISK_IMAGE: &str = "upper.img";
/// In the data directory of a container run with `--keep`: its upper stays
/// even when the record is gone (a reboot emptied the run root).
pub(crate) const KEEP_MARKER: &str = "keep";

/// Releases everything `st` records, and the record itself when
/// `st.remove`; otherwise marks it exited. Returns the problems met (each
/// is also left for the next reaper to retry).
pub fn teardown(paths: &Paths, st: &mut State) -> Vec<String> {
    let mut problems = Vec::new();
    let dir = paths.container(&st.id);
    let data = paths.data_dir(&st.id);
    if let Err(e) = crun::delete(paths, st.cgroups.as_ref(), &st.id) {
        problems.push(format!("crun delete {}: {e}", st.id));
    }
    if let Some(cg) = &st.cgroups {
        problems.extend(cgroup::remove(cg));
    }
    if let Some(UsernsRange {
        slot: Some(slot), ..
    }) = st.userns
    {
        userns::free(paths, slot, &st.id);
    }
    if !st.keep || st.remove {
        let upperfs = data.join("upperfs");
        if cairn_mount::is_mountpoint(&upperfs).unwrap_or(false) {
            let _ = cairn_mount::umount_with(&upperfs, cairn_mount::UmountOptions { lazy: true });
        }
        if let Err(e) = fs::remove_file(data.join(DISK_IMAGE)) {
            if e.kind() != std::io::ErrorKind::NotFound {
                problems.push(format!("removing {}: {e}", data.join(DISK_IMAGE).display()));
            }
        }
        for d in ["upper", "work", "upperfs"] {
            let p = data.join(d);
            if let Err(e) = fs::remove_dir_all(&p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    problems.push(format!("removing {}: {e}", p.display()));
                }
            }
        }
    }
    if st.remove {
        if !st.name.is_empty() {
            state::release_name(paths, &st.name, &st.id);
        }
        // The data first: a record left by a crash here is retried.
        for d in [&data, &dir] {
            if let Err(e) = fs::remove_dir_all(d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    problems.push(format!("removing {}: {e}", d.display()));
                }
            }
        }
    } else {
        let _ = fs::remove_file(paths.pid_file(&st.id));
        if st.status != Status::Exited {
            st.status = Status::Exited;
            st.finished.get_or_insert_with(state::now);
        }
        if let Err(e) = state::write_state(&dir, st) {
            problems.push(e.to_string());
        }
    }
    problems
}

/// Whether the container's init process (per its pid file) is alive.
fn init_alive(paths: &Paths, st: &State) -> bool {
    let pid = st.pid.or_else(|| state::read_pid(paths, st));
    let Some(pid) = pid else { return false };
    // The pid is only the container's if crun still has it on record.
    let status = paths.crun_root().join(&st.id).join("status");
    let Ok(text) = fs::read_to_string(status) else {
        return false;
    };
    text.contains(&format!("\"pid\": {pid}")) && Path::new(&format!("/proc/{pid}")).exists()
}

/// Tears down container `id` if it was abandoned (lock free, state not
/// exited), or removes its record if it exited with `remove` set. Returns
/// whether it did anything.
pub fn reap_one(paths: &Paths, id: &str) -> bool {
    let dir = paths.container(id);
    let Ok(Some(lock)) = state::try_lock(&dir) else {
        return false;
    };
    let st = match state::read_state(&dir) {
        Ok(Some(st)) => st,
        Ok(None) => {
            // A directory whose state was never written: debris of a
            // launcher killed right after mkdir, once it is old enough
            // not to be one being set up right now.
            let old = fs::metadata(&dir)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|a| a > Duration::from_secs(60));
            if old {
                let _ = fs::remove_dir_all(&dir);
            }
            return old;
        }
        Err(_) => return false,
    };
    if st.status == Status::Exited {
        return false;
    }
    if init_alive(paths, &st) {
        // Running without a monitor: leave it; stop/kill still work and a
        // later reap tears it down once it has exited.
        return false;
    }
    let mut st = st;
    if st.status == Status::Creating {
        st.remove = true;
    }
    st.exit_code = st.exit_code.or(Some(-1));
    for p in teardown(paths, &mut st) {
        tracing::warn!("{p}");
    }
    drop(lock);
    true
}

/// Reaps every abandoned container and orphaned pool slot. Returns how
/// many containers it tore down.
pub fn reap(paths: &Paths) -> Result<usize, RunError> {
    let mut n = 0;
    for id in state::list_ids(paths)? {
        if reap_one(paths, &id) {
            n += 1;
        }
    }
    userns::free_orphans(paths);
    remove_orphan_data(paths);
    Ok(n)
}

/// Removes the data directories whose record is gone: the run root is a
/// tmpfs that a reboot empties (or was changed). A container's data is
/// made after its record and removed before it, so no live container has
/// one. Kept uppers (the `keep` marker) stay for their owner to take.
fn remove_orphan_data(paths: &Paths) {
    let Ok(rd) = fs::read_dir(paths.data_dirs()) else {
        return;
    };
    for e in rd.flatten() {
        let Some(id) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !state::is_id(&id) || paths.container(&id).exists() {
            continue;
        }
        let data = paths.data_dir(&id);
        // A state.json here is a record of the layout before the run root
        // (an older cairn): not data of a gone record; leave it alone.
        if data.join(KEEP_MARKER).exists() || data.join("state.json").exists() {
            continue;
        }
        let upperfs = data.join("upperfs");
        if cairn_mount::is_mountpoint(&upperfs).unwrap_or(false) {
            let _ = cairn_mount::umount_with(&upperfs, cairn_mount::UmountOptions { lazy: true });
        }
        if let Err(e) = fs::remove_dir_all(&data) {
            tracing::warn!("removing {}: {e}", data.display());
        }
    }
}
