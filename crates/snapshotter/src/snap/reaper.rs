//! Removing snapshot directories off the caller's path.
//!
//! A snapshot directory goes when its snapshot is removed, and on the
//! normal path when its layer is committed: by then its files are in the
//! store, and the directory containerd unpacked the layer into is left
//! over. Freeing its files takes time in proportion to the layer (for the
//! python image of the containerd benchmark, 0.39 s for its 121 MB bottom
//! layer and 0.22 s for the 101 MB one above it, on ext4), and a Commit
//! that waited for it made containerd wait too: it unpacks the next layer
//! only once this one is committed. So the directory is renamed out of the
//! way under `tmp/` (a crash halfway leaves only `tmp/` debris, which the
//! next start removes, `Meta::open`) and emptied by one thread of its own,
//! one directory after another, while the caller answers.
//!
//! Nothing reads the directory once it is renamed, and its name (`rm.` and
//! the snapshot's id) is not given twice while it is there: a process
//! gives each id once, and a new one empties `tmp/` before it gives any (a
//! removal still queued when the process ended is finished then).
//! `Cleanup` waits for the queue ([`Reaper::wait`]): containerd calls it to
//! get space back, and it should have it when the call returns.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};

/// The thread that empties directories moved aside, started at the first.
#[derive(Default)]
pub(super) struct Reaper {
    tx: Option<Sender<PathBuf>>,
    /// Directories queued and not yet removed.
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Reaper {
    /// Moves `dir` to `junk` (in the same filesystem) and has it removed
    /// in the background; a directory that cannot be moved is removed in
    /// place, now. A directory that does not exist is left alone.
    pub(super) fn remove(&mut self, dir: &Path, junk: PathBuf) {
        if !dir.exists() {
            return;
        }
        if let Err(e) = fs::rename(dir, &junk) {
            tracing::warn!("moving {} aside: {e}", dir.display());
            remove_now(dir);
            return;
        }
        let Some(junk) = self.queue(junk) else {
            return;
        };
        // No thread: remove it here.
        remove_now(&junk);
    }

    /// Waits until every directory queued so far is removed.
    pub(super) fn wait(&self) {
        let (count, done) = &*self.pending;
        let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = done.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Queues `junk` for the thread (starting it); gives `junk` back when
    /// there is no thread to take it.
    fn queue(&mut self, junk: PathBuf) -> Option<PathBuf> {
        if self.tx.is_none() {
            let (tx, rx) = mpsc::channel::<PathBuf>();
            let pending = Arc::clone(&self.pending);
            let started = std::thread::Builder::new()
                .name("cairn-snap-rm".into())
                .spawn(move || {
                    background_priority();
                    for dir in rx {
                        remove_now(&dir);
                        let (count, done) = &*pending;
                        let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
                        *n = n.saturating_sub(1);
                        done.notify_all();
                    }
                });
            match started {
                Ok(_) => self.tx = Some(tx),
                Err(e) => {
                    tracing::warn!("starting the thread that removes snapshot directories: {e}");
                    return Some(junk);
                }
            }
        }
        let tx = self.tx.as_ref()?;
        let (count, _) = &*self.pending;
        *count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        match tx.send(junk) {
            Ok(()) => None,
            Err(mpsc::SendError(junk)) => {
                *count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
                self.tx = None;
                Some(junk)
            }
        }
    }
}

/// Lowers the calling thread's CPU priority (nice 19) and I/O priority
/// (best effort, its lowest level): emptying a directory of tens of
/// thousands of files takes a core for seconds, and a container starting
/// meanwhile (often the one whose layers were just committed) should not
/// wait behind it. Still scheduled, not idle-only: `Cleanup` waits for the
/// queue and must end on a busy node too. A failure leaves the priority as
/// it was.
fn background_priority() {
    // SAFETY: plain system calls that change only this thread's
    // priorities (`who` 0: the calling thread, as Linux keeps both per
    // thread); no memory is passed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
        const IOPRIO_WHO_PROCESS: libc::c_long = 1;
        const IOPRIO_CLASS_BE: libc::c_long = 2;
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0 as libc::c_long,
            (IOPRIO_CLASS_BE << 13) | 7,
        );
    }
}

fn remove_now(dir: &Path) {
    if let Err(e) = fs::remove_dir_all(dir) {
        tracing::warn!("removing {}: {e}", dir.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_gone_at_once_and_emptied_in_the_background() {
        let d = tempfile::tempdir().unwrap();
        let tmp = d.path().join("tmp");
        fs::create_dir(&tmp).unwrap();
        let mut r = Reaper::default();
        for id in 0..3 {
            let dir = d.path().join(id.to_string());
            fs::create_dir_all(dir.join("fs/a/b")).unwrap();
            fs::write(dir.join("fs/a/b/file"), vec![1u8; 100_000]).unwrap();
            r.remove(&dir, tmp.join(format!("rm.{id}")));
            assert!(!dir.exists(), "{id}: moved aside at once");
        }
        // Not there: nothing happens.
        r.remove(&d.path().join("9"), tmp.join("rm.9"));
        r.wait();
        assert_eq!(
            fs::read_dir(&tmp).unwrap().count(),
            0,
            "the thread emptied tmp/"
        );
        assert_eq!(
            fs::read_dir(d.path()).unwrap().count(),
            1,
            "only tmp/ is left"
        );
        // Nothing queued: no wait.
        r.wait();
        // The thread runs at the lowest CPU priority: its nice value
        // (field 19 of its stat) is 19.
        let mut found = 0;
        for t in fs::read_dir("/proc/self/task").unwrap() {
            let t = t.unwrap().path();
            let comm = fs::read_to_string(t.join("comm")).unwrap_or_default();
            if comm.trim() != "cairn-snap-rm" {
                continue;
            }
            // After the command's closing parenthesis: state is field 3.
            // (Another test's reaper may be starting right now, its name
            // set and its priority not yet: give each a moment.)
            let nice = || {
                let stat = fs::read_to_string(t.join("stat")).ok()?;
                let rest = stat.get(stat.rfind(')')? + 2..)?;
                rest.split(' ').nth(19 - 3).map(str::to_owned)
            };
            let mut seen = nice();
            for _ in 0..100 {
                if seen.is_none() || seen.as_deref() == Some("19") {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
                seen = nice();
            }
            if let Some(n) = seen {
                assert_eq!(n, "19", "nice of {}", t.display());
                found += 1;
            }
        }
        assert!(found >= 1, "no cairn-snap-rm thread in /proc/self/task");
    }
}
