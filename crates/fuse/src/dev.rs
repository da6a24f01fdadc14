//! The system calls on `/dev/fuse`: opening it, mounting a filesystem
//! served through it, reading requests, writing replies, and the
//! passthrough ioctls. This module holds the crate's only `unsafe` (the
//! ioctls, which rustix does not wrap).

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};

/// `FUSE_DEV_IOC_MAGIC`.
const IOC_MAGIC: u32 = 229;

/// `_IOW(type, nr, size)` as the kernel's asm-generic ioctl.h builds it.
const fn iow(nr: u32, size: u32) -> u32 {
    (1 << 30) | (size << 16) | (IOC_MAGIC << 8) | nr
}

/// `FUSE_DEV_IOC_BACKING_OPEN`: `_IOW(229, 1, struct fuse_backing_map)`.
pub const IOC_BACKING_OPEN: u32 = iow(1, 16);
/// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)`.
pub const IOC_BACKING_CLOSE: u32 = iow(2, 4);

/// `struct fuse_backing_map`.
#[repr(C)]
struct BackingMap {
    fd: i32,
    flags: u32,
    padding: u64,
}

/// Opens `/dev/fuse` for a new connection.
pub fn open_dev() -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        "/dev/fuse",
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Mounts a read-only FUSE filesystem of type `fuse.cairn` at `target`,
/// served through `dev`; `source` is what mountinfo shows as its source.
pub fn mount(dev: BorrowedFd<'_>, target: &Path, source: &str) -> io::Result<()> {
    let data = std::ffi::CString::new(format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions",
        dev.as_raw_fd()
    ))
    .expect("no NUL in mount options");
    rustix::mount::mount(
        source,
        target,
        "fuse.cairn",
        MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
        data.as_c_str(),
    )?;
    Ok(())
}

/// Makes reads of the device return `EAGAIN` when no request is queued,
/// so that workers can wait in `poll` for a request or a stop.
pub fn set_nonblocking(dev: BorrowedFd<'_>) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(dev)?;
    rustix::fs::fcntl_setfl(dev, flags | OFlags::NONBLOCK)?;
    Ok(())
}

/// Unmounts `target` (lazily with `detach`).
pub fn unmount(target: &Path, detach: bool) -> io::Result<()> {
    let mut flags = UnmountFlags::NOFOLLOW;
    if detach {
        flags |= UnmountFlags::DETACH;
    }
    Ok(rustix::mount::unmount(target, flags)?)
}

/// Reads one request; a read returns exactly one message.
pub fn read(dev: BorrowedFd<'_>, buf: &mut [u8]) -> Result<usize, Errno> {
    rustix::io::read(dev, buf)
}

/// Writes one reply with one `write(2)`, as the protocol requires.
pub fn write(dev: BorrowedFd<'_>, msg: &[u8]) -> Result<(), Errno> {
    let n = rustix::io::write(dev, msg)?;
    if n != msg.len() {
        return Err(Errno::IO);
    }
    Ok(())
}

/// Registers `file` as a backing file of the connection; the kernel holds
/// its own reference from here on. Returns the backing id (positive).
pub fn backing_open(dev: BorrowedFd<'_>, file: &File) -> io::Result<i32> {
    let map = BackingMap {
        fd: file.as_fd().as_raw_fd(),
        flags: 0,
        padding: 0,
    };
    // SAFETY: the ioctl reads one `struct fuse_backing_map` from the pointer,
    // which points at a live value of exactly that layout.
    let r = unsafe {
        libc::ioctl(
            dev.as_raw_fd(),
            IOC_BACKING_OPEN as _,
            &map as *const BackingMap,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// Drops the connection's reference to backing id `id`. Files the kernel
/// opened with it keep their own.
pub fn backing_close(dev: BorrowedFd<'_>, id: i32) -> io::Result<()> {
    let id = id as u32;
    // SAFETY: the ioctl reads one u32 from the pointer, which points at one.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), IOC_BACKING_CLOSE as _, &id as *const u32) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_uapi() {
        assert_eq!(std::mem::size_of::<BackingMap>(), 16);
        assert_eq!(IOC_BACKING_OPEN, 0x4010_e501);
        assert_eq!(IOC_BACKING_CLOSE, 0x4004_e502);
    }
}
