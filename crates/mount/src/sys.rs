//! The crate's only `unsafe` code: the few system calls rustix does not wrap.
//!
//! - `mount_setattr(2)` with `MOUNT_ATTR_IDMAP` or `MOUNT_ATTR_RDONLY`
//!   (rustix 1.x lists it as not implemented);
//! - `mount_setattr(2)` with `AT_RECURSIVE` and `MS_PRIVATE` propagation,
//!   and `unshare(CLONE_NEWNS)` on one thread, for the private mount
//!   namespace of kernels without detached overlay layers (see `privns`);
//! - `fork(2)` for the user-namespace holder process (see [`UserNsHolder`]);
//! - the `FS_IOC_MEASURE_VERITY` ioctl, used only to ask whether the kernel
//!   has fs-verity at all;
//! - the loop device ioctls `LOOP_CTL_GET_FREE` and `LOOP_CONFIGURE`, for
//!   size-capped disk upper layers (see `disk`) and EROFS images on
//!   kernels without file-backed mounts (see `loopdev`).
//!
//! Everything here is a thin, checked wrapper returning [`Errno`]; policy
//! (which mount to idmap, what a failure means) lives in the callers. This
//! module must never grow logic that could be written safely elsewhere.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::pipe::{pipe_with, PipeFlags};
use rustix::process::{kill_process, waitpid, Pid, Signal, WaitOptions};

/// `MOUNT_ATTR_RDONLY` and `MOUNT_ATTR_IDMAP` from `<linux/mount.h>`.
const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `FS_IOC_MEASURE_VERITY` = `_IOWR('f', 134, struct fsverity_digest)`, where
/// the struct header is 4 bytes (`u16 digest_algorithm, u16 digest_size`).
// `libc::Ioctl` is a c_ulong with glibc and a c_int with musl: the cast
// keeps the bit pattern either way.
const FS_IOC_MEASURE_VERITY: libc::Ioctl = 0xC004_6686_u32 as libc::Ioctl;

/// `struct mount_attr` from `<linux/mount.h>` (`MOUNT_ATTR_SIZE_VER0`, 32 bytes).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}
const _: () = assert!(std::mem::size_of::<MountAttr>() == 32);

fn last_errno() -> Errno {
    Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO)
}

/// `mount_setattr(mount, "", AT_EMPTY_PATH, {attr_set: MOUNT_ATTR_IDMAP,
/// userns_fd: userns})`: make the detached mount `mount` show ids through the
/// mapping of the user namespace `userns`.
pub(crate) fn mount_setattr_idmap(
    mount: BorrowedFd<'_>,
    userns: BorrowedFd<'_>,
) -> Result<(), Errno> {
    // The kernel reads userns_fd as a file descriptor number; a valid fd is
    // never negative, so the widening is lossless.
    mount_setattr(mount, MOUNT_ATTR_IDMAP, userns.as_raw_fd() as u64)
}

/// `mount_setattr(mount, "", AT_EMPTY_PATH, {attr_set: MOUNT_ATTR_RDONLY})`.
pub(crate) fn mount_setattr_readonly(mount: BorrowedFd<'_>) -> Result<(), Errno> {
    mount_setattr(mount, MOUNT_ATTR_RDONLY, 0)
}

/// `MS_PRIVATE` (as `struct mount_attr.propagation`) and `AT_RECURSIVE`.
const MS_PRIVATE: u64 = 1 << 18;
const AT_RECURSIVE: libc::c_int = 0x8000;

/// `mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {propagation: MS_PRIVATE})`:
/// no mount of the calling thread's mount namespace propagates to or from
/// any other namespace any more.
pub(crate) fn make_mount_tree_private() -> Result<(), Errno> {
    let attr = MountAttr {
        attr_set: 0,
        attr_clr: 0,
        propagation: MS_PRIVATE,
        userns_fd: 0,
    };
    // SAFETY: the path is a NUL-terminated static string; `attr` is a live,
    // properly laid out `struct mount_attr` and we pass its exact size; the
    // kernel only reads from both pointers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c"/".as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// `unshare(CLONE_NEWNS)`: the calling *thread* gets a copy of the mount
/// namespace (and, implied by it, its own root and working directory). The
/// file descriptor table stays shared with the other threads, which is what
/// `privns` relies on.
pub(crate) fn unshare_mount_namespace() -> Result<(), Errno> {
    // SAFETY: CLONE_NEWNS does not unshare the file descriptor table (the
    // hazard that makes rustix's `unshare` unsafe); it changes only which
    // mounts this thread's path lookups see.
    let ret = unsafe { libc::unshare(libc::CLONE_NEWNS) };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

fn mount_setattr(mount: BorrowedFd<'_>, attr_set: u64, userns_fd: u64) -> Result<(), Errno> {
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd,
    };
    // SAFETY: the mount fd is borrowed, hence open for the whole call (and
    // the caller's userns fd, if any, likewise); the path is a
    // NUL-terminated static string; `attr` is a live, properly laid out
    // `struct mount_attr` and we pass its exact size; the kernel only reads
    // from both pointers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// Ask the filesystem of `fd` to measure its fs-verity digest with a buffer
/// too small for any digest. The answer tells whether the kernel has
/// fs-verity: `ENODATA` (no verity on this file), `EOVERFLOW` (verity on,
/// buffer too small) or success mean yes; `EOPNOTSUPP` means the kernel (or
/// this filesystem) lacks it; `ENOTTY` means the filesystem has no verity
/// ioctls at all.
pub(crate) fn measure_verity(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    // struct fsverity_digest { u16 digest_algorithm; u16 digest_size; u8 digest[]; }
    // with digest_size = 0: the kernel writes back at most the 4-byte header.
    let mut header = [0u16; 2];
    // SAFETY: the fd is borrowed and open; `header` is a writable 4-byte
    // buffer that outlives the call and matches the size encoded in the
    // ioctl number; with digest_size 0 the kernel writes nothing beyond it.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_MEASURE_VERITY, header.as_mut_ptr()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// `LOOP_CTL_GET_FREE` and `LOOP_CONFIGURE` from `<linux/loop.h>`.
const LOOP_CTL_GET_FREE: libc::Ioctl = 0x4C82;
const LOOP_CONFIGURE: libc::Ioctl = 0x4C0A;
/// `LO_FLAGS_READ_ONLY`: the device refuses writes.
pub(crate) const LO_FLAGS_READ_ONLY: u32 = 1;
/// `LO_FLAGS_AUTOCLEAR`: the device detaches itself when its last user
/// (our fd, then the mounted filesystem) goes away.
pub(crate) const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// `LO_FLAGS_DIRECT_IO`: reads go to the backing file with `O_DIRECT`, so
/// its pages are not cached twice (once for the file, once for the device).
pub(crate) const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// `ioctl(/dev/loop-control, LOOP_CTL_GET_FREE)`: the number of a free
/// loop device (made if need be).
pub(crate) fn loop_get_free(control: BorrowedFd<'_>) -> Result<u32, Errno> {
    // SAFETY: the fd is borrowed and open; this ioctl takes no argument.
    let ret = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
    if ret >= 0 {
        Ok(ret as u32)
    } else {
        Err(last_errno())
    }
}

/// `ioctl(loop, LOOP_CONFIGURE)`: back the loop device with `backing`,
/// with `LO_FLAGS_*` `flags`.
pub(crate) fn loop_configure(
    loop_dev: BorrowedFd<'_>,
    backing: BorrowedFd<'_>,
    flags: u32,
) -> Result<(), Errno> {
    let config = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size: 0,
        info: LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: [0; 64],
            lo_crypt_name: [0; 64],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        },
        reserved: [0; 8],
    };
    // SAFETY: both fds are borrowed and open; `config` is a live, properly
    // laid out `struct loop_config` that the kernel only reads.
    let ret = unsafe {
        libc::ioctl(
            loop_dev.as_raw_fd(),
            LOOP_CONFIGURE,
            &config as *const LoopConfig,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// A child process that has entered a fresh user namespace and waits there,
/// so that the parent can write its `uid_map`/`gid_map` and open
/// `/proc/PID/ns/user`. The child is killed and reaped on drop.
///
/// The child dies on its own when this process dies (it is blocked reading a
/// pipe whose only write end the parent holds, and it has
/// `PR_SET_PDEATHSIG(SIGKILL)`), so a killed mounter leaves no holder behind.
pub(crate) struct UserNsHolder {
    pid: Pid,
    /// Closing this lets the child's blocking read return, ending it.
    _release: OwnedFd,
}

impl UserNsHolder {
    /// Fork a child that unshares `CLONE_NEWUSER`, closes every other file
    /// descriptor and waits.
    ///
    /// Forking a multi-threaded process is sound only if the child sticks to
    /// async-signal-safe calls; it does: it runs raw system calls on values
    /// prepared before the fork and never returns into Rust code.
    pub(crate) fn spawn() -> Result<Self, Errno> {
        let (ready_r, ready_w) = pipe_with(PipeFlags::CLOEXEC)?;
        let (hold_r, hold_w) = pipe_with(PipeFlags::CLOEXEC)?;
        let parent = rustix::process::getpid().as_raw_pid();
        let ready_w_raw = ready_w.as_raw_fd();
        let hold_r_raw = hold_r.as_raw_fd();

        // SAFETY: after fork the child runs only `holder_child`, which makes
        // async-signal-safe system calls on integers computed before the fork,
        // takes no locks, does not allocate and ends in `_exit`; it never
        // returns into Rust code or runs destructors. The parent continues
        // normally.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(last_errno());
        }
        if pid == 0 {
            holder_child(parent, ready_w_raw, hold_r_raw);
        }
        drop(ready_w);
        drop(hold_r);
        let pid = Pid::from_raw(pid).ok_or(Errno::CHILD)?;
        // From here on the holder is reaped by Drop, whatever happens below.
        let holder = UserNsHolder {
            pid,
            _release: hold_w,
        };

        let mut status = [0u8; 4];
        let mut got = 0;
        while got < status.len() {
            match rustix::io::read(&ready_r, &mut status[got..]) {
                Ok(0) => return Err(Errno::CHILD),
                Ok(n) => got += n,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e),
            }
        }
        match i32::from_ne_bytes(status) {
            0 => Ok(holder),
            raw => Err(Errno::from_raw_os_error(raw)),
        }
    }

    pub(crate) fn pid(&self) -> Pid {
        self.pid
    }
}

impl Drop for UserNsHolder {
    fn drop(&mut self) {
        // Errors are ignored: the child may already be gone, and a caller
        // that set SIGCHLD to SIG_IGN has its children reaped for it.
        let _ = kill_process(self.pid, Signal::KILL);
        while let Err(Errno::INTR) = waitpid(Some(self.pid), WaitOptions::empty()) {}
    }
}

/// The body of the forked holder. Only async-signal-safe system calls.
fn holder_child(parent: libc::pid_t, ready: libc::c_int, hold: libc::c_int) -> ! {
    // SAFETY: every call below is a plain system call wrapper that is
    // async-signal-safe; all pointers point into this stack frame and are
    // valid for the sizes passed.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        if libc::getppid() != parent {
            libc::_exit(1);
        }
        let err: libc::c_int = if libc::unshare(libc::CLONE_NEWUSER) == 0 {
            0
        } else {
            *libc::__errno_location()
        };
        // Keep nothing of the parent alive (its detached mounts above all):
        // close every descriptor except the two pipe ends. close_range is
        // Linux ≥ 5.9; where it is missing the fds close when we are killed.
        let (lo, hi) = if ready < hold {
            (ready, hold)
        } else {
            (hold, ready)
        };
        let close = |first: libc::c_int, last: libc::c_uint| {
            libc::syscall(
                libc::SYS_close_range,
                first as libc::c_uint,
                last,
                0 as libc::c_uint,
            );
        };
        if lo > 0 {
            close(0, (lo - 1) as libc::c_uint);
        }
        if hi > lo + 1 {
            close(lo + 1, (hi - 1) as libc::c_uint);
        }
        close(hi + 1, libc::c_uint::MAX);

        let bytes = err.to_ne_bytes();
        libc::write(ready, bytes.as_ptr().cast(), bytes.len());
        libc::close(ready);
        if err != 0 {
            libc::_exit(1);
        }
        let mut byte = 0u8;
        loop {
            let n = libc::read(hold, (&mut byte as *mut u8).cast(), 1);
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            break;
        }
        libc::_exit(0);
    }
}
