//! The crate's only `unsafe` code.
//!
//! - [`NsSetup::install`]: a `pre_exec` hook that runs in the forked child
//!   just before it execs crun: join cgroups, enter a private mount (and
//!   cgroup) namespace, mount cgroup2 on `/sys/fs/cgroup`, attach the
//!   container's rootfs. Only system calls on data prepared by the parent:
//!   no allocation, no locks (the parent may have other threads).
//! - [`fork_monitor`]: the double fork that makes a container's monitor.
//! - [`SignalFd`]: signals blocked and read from a `signalfd`.
//!
//! Everything else in the crate is `#![forbid(unsafe_code)]`-clean; this
//! module must never grow logic that could be written safely elsewhere.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::fs::{Mode, OFlags, CWD};
use rustix::mount::{MountFlags, MountPropagationFlags, MoveMountFlags};
use rustix::thread::UnshareFlags;

/// What the child does before it becomes crun. Built by the parent, so
/// the child only makes system calls.
#[derive(Debug, Default)]
pub struct NsSetup {
    /// `cgroup.procs` files to write `0` (this process) into, in order.
    pub join: Vec<CString>,
    /// Unshare the cgroup namespace too and mount cgroup2 on
    /// `/sys/fs/cgroup` (the hybrid-host workaround).
    pub cgroup2_view: bool,
    /// A detached mount (the container's rootfs) and where to attach it
    /// inside the new mount namespace.
    pub rootfs: Option<(RawFd, CString)>,
    /// Whether to make a new mount namespace at all.
    pub new_mount_ns: bool,
}

impl NsSetup {
    /// Installs the hook on `cmd`. The fd in `rootfs` must stay open until
    /// `cmd` has been spawned.
    pub fn install(self, cmd: &mut Command) {
        let setup = self;
        let hook = move || -> io::Result<()> {
            for procs in &setup.join {
                let fd = rustix::fs::open(
                    procs.as_c_str(),
                    OFlags::WRONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                rustix::io::write(&fd, b"0")?;
            }
            if !setup.new_mount_ns {
                return Ok(());
            }
            let mut flags = UnshareFlags::NEWNS;
            if setup.cgroup2_view {
                flags |= UnshareFlags::NEWCGROUP;
            }
            // SAFETY: unshare(CLONE_NEWNS|CLONE_NEWCGROUP) in a freshly forked,
            // single-threaded child; neither flag affects memory safety (the
            // "unsafe" in rustix is about CLONE_FILES/CLONE_VM-like sharing).
            unsafe { rustix::thread::unshare_unsafe(flags)? };
            rustix::mount::mount_change(
                c"/",
                MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
            )?;
            if setup.cgroup2_view {
                rustix::mount::mount(
                    c"cgroup2",
                    c"/sys/fs/cgroup",
                    c"cgroup2",
                    MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
                    None,
                )?;
            }
            if let Some((fd, target)) = &setup.rootfs {
                // SAFETY: the parent keeps this fd open until spawn returns,
                // and the child is a copy of it, so the fd is valid here.
                let mount = unsafe { BorrowedFd::borrow_raw(*fd) };
                rustix::mount::move_mount(
                    mount,
                    c"",
                    CWD,
                    target.as_c_str(),
                    MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
                )?;
            }
            Ok(())
        };
        // SAFETY: the hook only makes system calls on data owned by the
        // closure (no allocation, no locking), which is what is allowed
        // between fork and exec in a possibly multi-threaded parent.
        unsafe {
            cmd.pre_exec(hook);
        }
    }
}

/// Which side of [`fork_monitor`] we are on.
pub enum Forked {
    /// The caller (the intermediate child has been reaped).
    Parent,
    /// The monitor: a grandchild of the caller in a session of its own,
    /// not a child of anyone who will wait for it.
    Monitor,
}

/// Double fork with `setsid` in between. The caller must be
/// single-threaded (the monitor goes on running Rust code after `fork`).
pub fn fork_monitor() -> io::Result<Forked> {
    // SAFETY: fork in a single-threaded process (documented requirement of
    // this function); both sides continue with ordinary code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid > 0 {
        let pid = rustix::process::Pid::from_raw(pid).expect("fork returned a positive pid");
        loop {
            match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty()) {
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(Some((_, status))) => {
                    if status.exit_status() == Some(0) {
                        return Ok(Forked::Parent);
                    }
                    return Err(io::Error::other("the monitor's first fork failed"));
                }
                Ok(None) => continue,
            }
        }
    }
    // First child: new session, fork again so the monitor is no session
    // leader (it can never acquire a controlling terminal) and is adopted
    // by init (or a subreaper) once we exit.
    let ok = rustix::process::setsid().is_ok();
    // SAFETY: still single-threaded (a fork child has one thread).
    let pid = unsafe { libc::fork() };
    if pid != 0 || !ok {
        // SAFETY: _exit ends this intermediate process without running
        // destructors or atexit handlers that belong to the parent.
        unsafe { libc::_exit(if pid > 0 && ok { 0 } else { 1 }) };
    }
    Ok(Forked::Monitor)
}

/// Signals blocked for this thread and read from a `signalfd` instead.
#[derive(Debug)]
pub struct SignalFd {
    fd: OwnedFd,
}

impl SignalFd {
    /// Blocks `signals` and opens a signalfd for them.
    pub fn new(signals: &[i32]) -> io::Result<Self> {
        // SAFETY: a zeroed sigset_t is a valid argument for sigemptyset,
        // which initializes it; sigaddset/pthread_sigmask/signalfd get valid
        // pointers to it.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for &s in signals {
                libc::sigaddset(&mut set, s);
            }
            let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if r != 0 {
                return Err(io::Error::from_raw_os_error(r));
            }
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(SignalFd {
                fd: OwnedFd::from_raw_fd(fd),
            })
        }
    }

    /// The next pending signal, if any.
    pub fn read(&self) -> io::Result<Option<i32>> {
        let mut buf = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
        match rustix::io::read(&self.fd, &mut buf) {
            Ok(n) if n == buf.len() => {
                // ssi_signo is the first field, a u32 in native byte order.
                let signo = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
                Ok(Some(signo as i32))
            }
            Ok(_) => Ok(None),
            Err(rustix::io::Errno::AGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Unblocks the signals again (the fd stays usable but gets nothing).
    pub fn unblock(signals: &[i32]) {
        // SAFETY: as in `new`.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for &s in signals {
                libc::sigaddset(&mut set, s);
            }
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
    }
}

impl AsFd for SignalFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The raw fd of a borrowed fd, for [`NsSetup::rootfs`].
pub fn raw(fd: BorrowedFd<'_>) -> RawFd {
    fd.as_raw_fd()
}
