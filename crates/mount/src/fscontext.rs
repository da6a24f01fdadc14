//! A thin wrapper over one filesystem context of the new mount API
//! (`fsopen` → `fsconfig`… → `fsmount`), which turns each failing call into a
//! [`StepFailure`] carrying the kernel's own fs-context log.
//!
//! The kernel queues messages (`e …` errors, `w …` warnings, `i …` info) on
//! the context fd; `read(2)` returns one per call and `ENODATA` when none is
//! left. They often say more than the errno ("overlay: Unknown parameter
//! 'lowerdir+'"), so every failure drains them into the error.
//!
//! Mounts made here are detached: they exist only as file descriptors and
//! vanish, superblock and all, when the last descriptor (or the overlay that
//! took a private clone of them) goes away. Nothing here attaches a mount.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::mount::{
    fsconfig_create, fsconfig_set_flag, fsconfig_set_string, fsmount, fsopen, FsMountFlags,
    FsOpenFlags, MountAttrFlags,
};

use crate::error::StepFailure;

/// An open filesystem context (`fsopen` fd).
pub(crate) struct FsContext {
    fd: OwnedFd,
}

impl FsContext {
    pub(crate) fn open(fstype: &str) -> Result<Self, StepFailure> {
        let fd = fsopen(fstype, FsOpenFlags::FSOPEN_CLOEXEC)
            .map_err(|errno| StepFailure::new(format!("fsopen {fstype}"), errno))?;
        Ok(FsContext { fd })
    }

    /// `fsconfig(FSCONFIG_SET_STRING, key, value)`.
    pub(crate) fn set_string(
        &self,
        key: &str,
        value: impl rustix::path::Arg,
    ) -> Result<(), StepFailure> {
        fsconfig_set_string(&self.fd, key, value)
            .map_err(|errno| self.failure(format!("fsconfig {key}"), errno))
    }

    /// `fsconfig(FSCONFIG_SET_FLAG, key)`.
    pub(crate) fn set_flag(&self, key: &str) -> Result<(), StepFailure> {
        fsconfig_set_flag(&self.fd, key)
            .map_err(|errno| self.failure(format!("fsconfig {key}"), errno))
    }

    /// `fsconfig(FSCONFIG_CMD_CREATE)`: build the superblock.
    pub(crate) fn create(&self) -> Result<(), StepFailure> {
        fsconfig_create(&self.fd).map_err(|errno| self.failure("fsconfig create", errno))
    }

    /// `fsmount`: a detached mount of the superblock built by [`Self::create`].
    pub(crate) fn mount(&self, attrs: MountAttrFlags) -> Result<OwnedFd, StepFailure> {
        let fd = fsmount(&self.fd, FsMountFlags::FSMOUNT_CLOEXEC, attrs)
            .map_err(|errno| self.failure("fsmount", errno))?;
        for message in self.drain_log() {
            tracing::debug!(%message, "kernel fs-context message");
        }
        Ok(fd)
    }

    /// `create` then `mount`.
    pub(crate) fn create_and_mount(&self, attrs: MountAttrFlags) -> Result<OwnedFd, StepFailure> {
        self.create()?;
        self.mount(attrs)
    }

    fn failure(&self, step: impl Into<String>, errno: Errno) -> StepFailure {
        StepFailure {
            step: step.into(),
            errno,
            kernel_log: self.drain_log(),
        }
    }

    /// All queued messages, severity prefix kept only for warnings and info.
    fn drain_log(&self) -> Vec<String> {
        let mut messages = Vec::new();
        let mut buf = [0u8; 1024];
        // The kernel keeps at most 8 messages per context; the bound is a
        // guard against a kernel that would keep answering.
        for _ in 0..32 {
            match rustix::io::read(&self.fd, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let text = text.trim_end();
                    let text = text.strip_prefix("e ").unwrap_or(text);
                    messages.push(text.to_string());
                }
            }
        }
        messages
    }
}

/// The path through which the kernel resolves a directory fd (a detached
/// mount, typically) when an option wants a path string.
pub(crate) fn fd_path(fd: BorrowedFd<'_>) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// Like [`fd_path`] for something inside the tree of `fd`.
pub(crate) fn fd_subpath(fd: &impl AsFd, name: &str) -> String {
    format!("{}/{name}", fd_path(fd.as_fd()))
}
