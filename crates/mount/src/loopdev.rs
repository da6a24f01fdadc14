//! Loop devices, attached with `LOOP_CONFIGURE` through `/dev/loop-control`
//! and always with `LO_FLAGS_AUTOCLEAR`.
//!
//! Autoclear makes the kernel detach the device when its last opener goes
//! away. The only opener cairn holds is the [`LoopDevice`] fd, so the device
//! lives exactly as long as that fd or whatever filesystem was mounted from
//! it: dropping a [`LoopDevice`] whose mount failed (or a process killed
//! before it mounted anything) detaches it; a mounted filesystem keeps it
//! until its superblock goes away with the last unmount.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

use crate::error::StepFailure;
use crate::sys;

/// An attached loop device and the one fd this process holds on it.
#[derive(Debug)]
pub(crate) struct LoopDevice {
    /// `/dev/loopN`.
    pub(crate) path: String,
    fd: OwnedFd,
}

impl AsFd for LoopDevice {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// How to attach.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoopFlags {
    pub(crate) read_only: bool,
    /// Ask for direct I/O; where the backing file refuses it (`EINVAL`:
    /// a filesystem without `O_DIRECT`, or misaligned), attach without.
    pub(crate) direct_io: bool,
}

impl LoopDevice {
    /// Attaches `backing` (opened read-only for a read-only device) to a
    /// free loop device, with autoclear.
    pub(crate) fn attach(backing: &File, how: LoopFlags) -> Result<Self, StepFailure> {
        let control = rustix::fs::open(
            "/dev/loop-control",
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| StepFailure::new("open /dev/loop-control", errno))?;
        let mut flags = sys::LO_FLAGS_AUTOCLEAR;
        if how.read_only {
            flags |= sys::LO_FLAGS_READ_ONLY;
        }
        let access = if how.read_only {
            OFlags::RDONLY
        } else {
            OFlags::RDWR
        };
        let mut direct_io = how.direct_io;
        // Another process may take the device between GET_FREE and
        // CONFIGURE; then ask again.
        let mut last = Errno::BUSY;
        for _ in 0..16 {
            let n = sys::loop_get_free(control.as_fd())
                .map_err(|errno| StepFailure::new("LOOP_CTL_GET_FREE", errno))?;
            let path = format!("/dev/loop{n}");
            let fd = rustix::fs::open(path.as_str(), access | OFlags::CLOEXEC, Mode::empty())
                .map_err(|errno| StepFailure::new(format!("open {path}"), errno))?;
            let with = |dio: bool| flags | if dio { sys::LO_FLAGS_DIRECT_IO } else { 0 };
            let mut result = sys::loop_configure(fd.as_fd(), backing.as_fd(), with(direct_io));
            if direct_io && result == Err(Errno::INVAL) {
                tracing::debug!(device = %path, "loop device refused direct I/O; attaching without");
                direct_io = false;
                result = sys::loop_configure(fd.as_fd(), backing.as_fd(), with(false));
            }
            match result {
                Ok(()) => return Ok(LoopDevice { path, fd }),
                Err(Errno::BUSY) => last = Errno::BUSY,
                Err(errno) => {
                    return Err(StepFailure::new(format!("LOOP_CONFIGURE {path}"), errno))
                }
            }
        }
        Err(StepFailure::new(
            "LOOP_CONFIGURE (every free device was taken)",
            last,
        ))
    }
}

/// The loop devices now attached to `backing_file` (an absolute path, as
/// `/sys/block/loopN/loop/backing_file` shows it), by device name.
pub fn loop_devices_backed_by(backing_file: &std::path::Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            let backing = backing.trim_end_matches('\n');
            let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
            (std::path::Path::new(backing) == backing_file).then_some(name)
        })
        .collect();
    found.sort();
    found
}
