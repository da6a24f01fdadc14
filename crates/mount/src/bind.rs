//! Read-only detached binds of single files.
//!
//! `cairn run` executes crun from one of these: crun (like runc) takes an
//! executable on a read-only mount, flagged by `_LIBCONTAINER_CLONED_BINARY=1`,
//! as already protected against a container overwriting it through
//! `/proc/<pid>/exe` (CVE-2019-5736), and skips the copy of itself it
//! otherwise makes on every start. A detached mount is in no mount table:
//! nothing to unmount, and it goes away with its last reference.

use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::CWD;
use rustix::mount::{open_tree, OpenTreeFlags};

use crate::error::{Action, MountError, StepFailure};

/// A detached bind mount of `path` (`open_tree(OPEN_TREE_CLONE)`: an
/// `O_PATH` fd of it, close on exec). The objects layer of a stack is one.
pub(crate) fn clone_tree(path: &Path) -> Result<OwnedFd, StepFailure> {
    open_tree(
        CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(|errno| StepFailure::new("open_tree (clone)", errno))
}

/// A detached, read-only bind mount of `path` (an `O_PATH` fd of it, close
/// on exec), e.g. to `execveat` from.
pub fn readonly_bind(path: &Path) -> Result<OwnedFd, MountError> {
    let run = || {
        let fd = clone_tree(path)?;
        crate::sys::mount_setattr_readonly(rustix::fd::AsFd::as_fd(&fd))
            .map_err(|errno| StepFailure::new("mount_setattr (read-only)", errno))?;
        Ok(fd)
    };
    run().map_err(|f| MountError::step(Action::ReadOnlyBind, path, f))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs root (open_tree with OPEN_TREE_CLONE needs CAP_SYS_ADMIN).
    #[test]
    fn privileged_readonly_bind_is_read_only_and_detached() {
        assert!(
            rustix::process::geteuid().is_root(),
            "privileged_readonly_bind_is_read_only_and_detached must run as root"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"data").unwrap();
        let fd = readonly_bind(&file).unwrap();
        let st = rustix::fs::fstatvfs(&fd).unwrap();
        assert!(
            st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY),
            "the bind is not read-only: {:?}",
            st.f_flag
        );
        // Writing through the bind fails; the file itself stays writable.
        let through = format!("/proc/self/fd/{}", rustix::fd::AsRawFd::as_raw_fd(&fd));
        let err = std::fs::OpenOptions::new()
            .write(true)
            .open(&through)
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        std::fs::write(&file, b"more").unwrap();
        // Detached: not in this namespace's mount table.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mountinfo.contains(dir.path().to_str().unwrap()));

        let err = readonly_bind(&dir.path().join("missing")).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("read-only bind") && text.contains("missing"),
            "{text}"
        );
    }
}
