//! Overlay layers for kernels that refuse detached mounts as layers.
//!
//! Before Linux 6.15, overlayfs takes a private clone of each layer with
//! `clone_private_mount`, which refuses (`EINVAL`) a mount that is not in
//! the caller's mount namespace, and a detached mount (an `fsmount` or
//! `open_tree(OPEN_TREE_CLONE)` fd) is in none. Debian 13's and Ubuntu
//! 24.10/25.04's 6.12 kernels have everything else composefs needs, so
//! there cairn attaches its layers for the moment the overlay is created,
//! somewhere nobody else can see:
//!
//! 1. a short-lived thread (std's scoped thread) calls
//!    `unshare(CLONE_NEWNS)`: from then on that thread alone lives in a copy
//!    of the mount namespace, while it still shares the process's file
//!    descriptor table;
//! 2. it makes the whole copy private (`mount_setattr(/, AT_RECURSIVE,
//!    MS_PRIVATE)`), so nothing attached there propagates to a peer in the
//!    host's namespace;
//! 3. it `move_mount`s each detached layer (EROFS, the idmapped objects
//!    clone, the tmpfs upper) onto the thread's `/`, stacked there. The
//!    layers are still named by `/proc/self/fd/N`, which now resolves to a
//!    mount of the thread's namespace, so `clone_private_mount` accepts it;
//!    directories named by path (a plain objects directory, a host upper
//!    directory, the lazy layer's FUSE mountpoint) resolve to the thread's
//!    copies, which it accepts too. Path lookups start at the thread's root
//!    *under* the stacked mounts, so stacking on `/` hides nothing;
//! 4. it builds the overlay (`fsopen`/`fsconfig`/`fsmount`): a detached
//!    overlay fd in the shared fd table, holding private clones of every
//!    layer;
//! 5. it exits. Its namespace has no other member, so the kernel tears it
//!    down with every mount attached in it; the overlay keeps its clones.
//!
//! The attachments exist only in a namespace that one thread of this
//! process holds: they never appear in any other namespace's mount table,
//! and if the process is killed at any moment (`kill -9`) the namespace and
//! its mounts go with the thread. Nothing is created on disk. On kernels
//! with detached layers (≥ 6.15) none of this runs (see [`crate::stack`]).
//!
//! A thread rather than a forked child: the fd table is shared, so the
//! overlay fd needs no `SCM_RIGHTS` passing, and the code that runs there
//! is ordinary Rust (a child forked from a multi-threaded process could
//! only make async-signal-safe calls).

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{openat, Mode, OFlags, CWD};
use rustix::mount::{move_mount, MoveMountFlags};

use crate::error::StepFailure;
use crate::sys;

/// The environment variable that forces the private-namespace path where
/// the kernel would take detached layers: `CAIRN_OVERLAY_PRIVATE_NS=1`. For
/// tests on new kernels (the path the 6.12 guest takes) and for kernels
/// whose detached layers misbehave.
pub const PRIVATE_NS_ENV: &str = "CAIRN_OVERLAY_PRIVATE_NS";

/// Whether [`PRIVATE_NS_ENV`] asks for the private-namespace path.
pub fn private_ns_forced() -> bool {
    std::env::var(PRIVATE_NS_ENV)
        .map(|v| matches!(v.trim(), "1" | "yes" | "true"))
        .unwrap_or(false)
}

/// The thread's view: lets the body attach detached mounts there.
pub(crate) struct PrivateNamespace {
    _private: (),
}

impl PrivateNamespace {
    /// Attaches the detached mount `fd` on this namespace's `/` (stacked on
    /// whatever is there); `/proc/self/fd/N` of it then names a mount of
    /// this namespace.
    pub(crate) fn attach(&self, fd: &impl AsFd) -> Result<(), StepFailure> {
        move_mount(fd, "", CWD, "/", MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
            .map_err(|errno| StepFailure::new("move_mount (into a private namespace)", errno))
    }

    /// Opens `dir` as this namespace sees it (`O_PATH`): the fd to hand to
    /// overlayfs for a layer that is a directory of the host's tree.
    pub(crate) fn open_dir(&self, dir: &Path) -> Result<OwnedFd, StepFailure> {
        openat(
            CWD,
            dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| StepFailure::new("open (in a private namespace)", errno))
    }
}

/// Runs `body` on a short-lived thread in a private copy of the mount
/// namespace (module docs), and returns its result once the thread is gone.
pub(crate) fn in_private_namespace<T: Send>(
    body: impl FnOnce(&PrivateNamespace) -> Result<T, StepFailure> + Send,
) -> Result<T, StepFailure> {
    let (tid, result) = std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("cairn-privns".into())
            .spawn_scoped(scope, move || {
                let tid = rustix::thread::gettid();
                let run = || {
                    sys::unshare_mount_namespace()
                        .map_err(|errno| StepFailure::new("unshare(CLONE_NEWNS)", errno))?;
                    sys::make_mount_tree_private().map_err(|errno| {
                        StepFailure::new("mount_setattr (/, recursive, MS_PRIVATE)", errno)
                    })?;
                    body(&PrivateNamespace { _private: () })
                };
                (tid, run())
            })
            .map_err(|e| StepFailure::io("spawning the private-namespace thread", &e))?;
        Ok(thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    })?;
    wait_until_gone(tid);
    result
}

/// `join` returns as soon as the thread's user-space part is done; the
/// kernel task (and with it the private namespace and its mounts) goes a
/// moment later. Wait for that, so that callers see a single-threaded
/// process again (`cairn run` forks its monitor next, which needs one) and
/// the attachments are gone when the overlay is returned. Bounded: after
/// two seconds it stops waiting (the task then ends on its own).
fn wait_until_gone(tid: rustix::thread::Pid) {
    let task = format!("/proc/self/task/{}", tid.as_raw_nonzero());
    let start = std::time::Instant::now();
    while std::path::Path::new(&task).exists()
        && start.elapsed() < std::time::Duration::from_secs(2)
    {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}
