//! The crate's error type. Every failure names what was being done, to which
//! path, at which system call, the errno, and (for `fsconfig`/`fsmount`) the
//! kernel's own fs-context log message, e.g.
//! `mounting EROFS image /var/lib/cairn/images/ab…: fsconfig create: Invalid argument`.
//!
//! Errors are values: nothing here logs.

use std::fmt;
use std::path::PathBuf;

use rustix::io::Errno;

use crate::probe::MissingFeature;
use crate::userns::IdMap;

/// What the crate was doing when a step failed; printed before the path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// fsopen/fsconfig/fsmount of the EROFS metadata image (path: the image).
    MountErofs,
    /// open_tree of the object store's `objects/` directory (path: it).
    OpenObjects,
    /// The tmpfs upper layer (path: the target).
    MountTmpfsUpper,
    /// Creating `upper/` and `work/` in a host directory (path: that directory).
    PrepareUpperDir,
    /// A size-capped disk upper: sparse file, ext4, loop device, mount
    /// (path: the mount point).
    MountDiskUpper,
    /// fsopen/fsconfig/fsmount of the overlay (path: the target).
    MountOverlay,
    /// move_mount of the finished overlay onto the target (path: the target).
    AttachOverlay,
    /// umount2 (path: the target).
    Unmount,
    /// open_tree + mount_setattr of a read-only bind (path: the source).
    ReadOnlyBind,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::MountErofs => "mounting EROFS image",
            Action::OpenObjects => "opening objects directory",
            Action::MountTmpfsUpper => "mounting tmpfs upper layer for",
            Action::PrepareUpperDir => "preparing upper directory",
            Action::MountDiskUpper => "mounting a size-capped disk upper at",
            Action::MountOverlay => "mounting overlay for",
            Action::AttachOverlay => "attaching overlay at",
            Action::Unmount => "unmounting",
            Action::ReadOnlyBind => "making a read-only bind of",
        })
    }
}

/// Why mounting or unmounting failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MountError {
    /// The kernel lacks something the requested stack needs (found by
    /// [`crate::probe()`] before anything was mounted).
    #[error(transparent)]
    Unsupported(#[from] MissingFeature),

    /// A system call failed.
    #[error(
        "{action} {}: {step}: {}{}",
        path.display(),
        errno_text(*errno),
        KernelLog(kernel_log)
    )]
    Step {
        action: Action,
        path: PathBuf,
        /// The system call, e.g. `fsconfig source`, `fsmount`, `move_mount`.
        step: String,
        errno: Errno,
        /// Messages the kernel left in the fs context (`e …`, `w …`), if any.
        kernel_log: Vec<String>,
    },

    /// A request that cannot work, found without a failing system call.
    #[error("{action} {}: {reason}", path.display())]
    Invalid {
        action: Action,
        path: PathBuf,
        reason: String,
    },

    /// Creating the user namespace that carries an id mapping failed.
    #[error("creating user namespace for id map {idmap}: {step}: {}", errno_text(*errno))]
    UserNamespace {
        idmap: IdMap,
        step: String,
        errno: Errno,
    },

    /// `umount` of a path that is not a mount point.
    #[error("unmounting {}: not a mount point", .0.display())]
    NotMounted(PathBuf),

    /// Reading the mount table failed.
    #[error("reading {}: {source}", path.display())]
    MountTable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl MountError {
    /// The errno behind the failure, where there is one (e.g. `EBUSY` from
    /// unmounting a target that is still in use).
    pub fn errno(&self) -> Option<Errno> {
        match self {
            MountError::Step { errno, .. } | MountError::UserNamespace { errno, .. } => {
                Some(*errno)
            }
            MountError::MountTable { source, .. } => Errno::from_io_error(source),
            _ => None,
        }
    }

    pub(crate) fn step(action: Action, path: impl Into<PathBuf>, failure: StepFailure) -> Self {
        MountError::Step {
            action,
            path: path.into(),
            step: failure.step,
            errno: failure.errno,
            kernel_log: failure.kernel_log,
        }
    }
}

/// A failed system call before it is given its action and path.
#[derive(Debug)]
pub(crate) struct StepFailure {
    pub(crate) step: String,
    pub(crate) errno: Errno,
    pub(crate) kernel_log: Vec<String>,
}

impl StepFailure {
    pub(crate) fn new(step: impl Into<String>, errno: Errno) -> Self {
        StepFailure {
            step: step.into(),
            errno,
            kernel_log: Vec::new(),
        }
    }

    pub(crate) fn io(step: impl Into<String>, err: &std::io::Error) -> Self {
        StepFailure::new(step, Errno::from_io_error(err).unwrap_or(Errno::IO))
    }
}

/// `Invalid argument`, without std's ` (os error 22)` suffix.
pub(crate) fn errno_text(errno: Errno) -> String {
    let text = std::io::Error::from(errno).to_string();
    match text.rfind(" (os error ") {
        Some(cut) => text[..cut].to_string(),
        None => text,
    }
}

/// Renders the kernel's fs-context messages as ` (kernel: …; …)`.
struct KernelLog<'a>(&'a [String]);

impl fmt::Display for KernelLog<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return Ok(());
        }
        write!(f, " (kernel: {})", self.0.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_error_names_action_path_step_errno_and_kernel_log() {
        let err = MountError::step(
            Action::MountErofs,
            "/var/lib/cairn/images/ab12",
            StepFailure {
                step: "fsconfig source".into(),
                errno: Errno::INVAL,
                kernel_log: vec!["overlay: Unknown parameter 'x'".into()],
            },
        );
        assert_eq!(
            err.to_string(),
            "mounting EROFS image /var/lib/cairn/images/ab12: fsconfig source: Invalid argument \
             (kernel: overlay: Unknown parameter 'x')"
        );
        assert_eq!(err.errno(), Some(Errno::INVAL));
    }

    #[test]
    fn step_error_without_kernel_log_has_no_suffix() {
        let err = MountError::step(
            Action::Unmount,
            "/mnt/x",
            StepFailure::new("umount2", Errno::BUSY),
        );
        // The C library's text: "Device or resource busy" (glibc),
        // "Resource busy" (musl).
        assert_eq!(
            err.to_string(),
            format!("unmounting /mnt/x: umount2: {}", errno_text(Errno::BUSY))
        );
        assert!(!err.to_string().contains("os error"), "{err}");
    }
}
