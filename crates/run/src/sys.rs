//! The crate's only `unsafe` code.
//!
//! - [`NsSetup`]: what a child does just before it execs crun: join
//!   cgroups, enter a private mount (and cgroup) namespace, mount cgroup2
//!   on `/sys/fs/cgroup`, attach the container's bundle and rootfs. Only system calls
//!   on data prepared by the parent: no allocation, no locks (the parent
//!   may have other threads). As a `pre_exec` hook ([`NsSetup::install`])
//!   or in [`spawn`].
//! - [`spawn`]: a fork by clone3 with a pidfd and `CLONE_INTO_CGROUP`,
//!   signals blocked until the child has reset their handlers, then exec
//!   by path or by fd (`fexecve`); what std's `Command` cannot do.
//! - [`fork_monitor`], [`fork_child_monitor`]: the forks that make a
//!   container's monitor (or a listener's proxy), after checking that the
//!   process has a single thread.
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
/// the child only makes system calls. The mounts to attach are borrowed:
/// they stay open at least as long as the setup, hence until the child
/// has used them.
#[derive(Debug, Default)]
pub struct NsSetup<'fd> {
    /// `cgroup.procs` files to write `0` (this process) into, in order.
    pub join: Vec<CString>,
    /// Unshare the cgroup namespace too and mount cgroup2 on
    /// `/sys/fs/cgroup` (the hybrid-host workaround).
    pub cgroup2_view: bool,
    /// Detached mounts (the container's bundle tmpfs, then its rootfs
    /// inside it) and where to attach them inside the new mount namespace,
    /// in this order.
    pub attach: Vec<(BorrowedFd<'fd>, CString)>,
    /// Whether to make a new mount namespace at all.
    pub new_mount_ns: bool,
}

impl NsSetup<'_> {
    /// Does the setup in the current process: join the cgroups, enter the
    /// namespaces, mount, attach the rootfs. Only system calls on data
    /// prepared earlier: safe between fork and exec.
    fn apply(&self) -> rustix::io::Result<()> {
        for procs in &self.join {
            let fd = rustix::fs::open(
                procs.as_c_str(),
                OFlags::WRONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            rustix::io::write(&fd, b"0")?;
        }
        if !self.new_mount_ns {
            return Ok(());
        }
        let mut flags = UnshareFlags::NEWNS;
        if self.cgroup2_view {
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
        if self.cgroup2_view {
            rustix::mount::mount(
                c"cgroup2",
                c"/sys/fs/cgroup",
                c"cgroup2",
                MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
                None,
            )?;
        }
        for (mount, target) in &self.attach {
            // The child's fd table is a copy of the parent's (no
            // CLONE_FILES), in which the borrow keeps the fd open: the same
            // number names the mount here.
            rustix::mount::move_mount(
                mount,
                c"",
                CWD,
                target.as_c_str(),
                MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
            )?;
        }
        Ok(())
    }
}

impl NsSetup<'static> {
    /// Installs the setup as a `pre_exec` hook on `cmd`. Only a setup
    /// whose borrowed fds live forever can be moved into the hook, which
    /// `Command` keeps for as long as it likes.
    pub fn install(self, cmd: &mut Command) {
        let setup = self;
        let hook = move || -> io::Result<()> { Ok(setup.apply()?) };
        // SAFETY: the hook only makes system calls on data owned by the
        // closure (no allocation, no locking), which is what is allowed
        // between fork and exec in a possibly multi-threaded parent.
        unsafe {
            cmd.pre_exec(hook);
        }
    }
}

/// The program [`spawn`] executes.
#[derive(Debug)]
pub enum Program {
    /// By absolute path.
    Path(CString),
    /// By fd (`fexecve`), e.g. a read-only bind (see `crun::run_program`).
    Fd(OwnedFd),
}

/// A process for [`spawn`]: everything prepared, so that the child only
/// makes system calls.
#[derive(Debug)]
pub struct SpawnSpec<'fd> {
    pub program: Program,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    pub cwd: CString,
    /// Become the child's fds 0, 1 and 2.
    pub stdio: [OwnedFd; 3],
    /// A cgroup2 directory the child starts in (`CLONE_INTO_CGROUP`): no
    /// write to `cgroup.procs`, whose cost (an RCU grace period for the
    /// cgroup threadgroup lock, 10 ms and more after an idle moment) would
    /// land on every container start. With the group's `cgroup.procs`, for
    /// kernels that refuse that.
    pub cgroup: Option<(OwnedFd, CString)>,
    pub setup: NsSetup<'fd>,
}

/// A started child.
#[derive(Debug)]
pub struct Spawned {
    pub pid: rustix::process::Pid,
    pub pidfd: OwnedFd,
}

/// Why [`spawn`] failed.
#[derive(Debug)]
pub enum SpawnError {
    /// clone3 itself failed (nothing was started): an old kernel, or one
    /// that refuses `CLONE_INTO_CGROUP` for that group.
    Clone(io::Error),
    /// The child failed in `stage` before it could exec.
    Child {
        stage: &'static str,
        error: io::Error,
    },
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpawnError::Clone(e) => write!(f, "clone3: {e}"),
            SpawnError::Child { stage, error } => write!(f, "{stage}: {error}"),
        }
    }
}

/// `struct clone_args` of clone3(2), up to `CLONE_ARGS_SIZE_VER2`.
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}
const _: () = assert!(std::mem::size_of::<CloneArgs>() == 88);
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// The stages a child reports failure in (an index, over the error pipe).
const STAGES: [&str; 4] = [
    "setting up stdio",
    "entering the container's namespaces and cgroups",
    "changing directory",
    "executing",
];

/// Starts `spec` with clone3 (a pidfd, optionally straight into a cgroup)
/// and returns once the child has exec'd, or with why it could not.
pub fn spawn(spec: &SpawnSpec<'_>) -> Result<Spawned, SpawnError> {
    let argv = null_terminated(&spec.argv);
    let envp = null_terminated(&spec.envp);
    let (err_r, err_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| SpawnError::Clone(e.into()))?;
    let mut pidfd: libc::c_int = -1;
    let mut args = CloneArgs {
        flags: libc::CLONE_PIDFD as u64,
        pidfd: std::ptr::addr_of_mut!(pidfd) as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..CloneArgs::default()
    };
    if let Some((cg, _)) = &spec.cgroup {
        args.flags |= CLONE_INTO_CGROUP;
        args.cgroup = cg.as_raw_fd() as u64;
    }
    let ret = clone_child(&mut args, spec, &argv, &envp, err_w.as_raw_fd());
    if ret < 0 {
        return Err(SpawnError::Clone(io::Error::from_raw_os_error(
            (-ret) as i32,
        )));
    }
    drop(err_w);
    // SAFETY: the kernel stored a new pidfd there (CLONE_PIDFD), owned by us.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let pid = rustix::process::Pid::from_raw(ret as i32).expect("clone3 returned a positive pid");
    let mut report = [0u8; 8];
    let mut got = 0;
    while got < report.len() {
        match rustix::io::read(&err_r, &mut report[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => break,
        }
    }
    if got == 0 {
        return Ok(Spawned { pid, pidfd });
    }
    // The child failed and exits: reap it.
    let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
    let stage = u32::from_ne_bytes([report[0], report[1], report[2], report[3]]) as usize;
    let errno = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
    Err(SpawnError::Child {
        stage: STAGES.get(stage).copied().unwrap_or("starting"),
        error: io::Error::from_raw_os_error(errno),
    })
}

/// clone3 with `args` but neither `CLONE_VM` nor `CLONE_VFORK`, that is
/// a fork (with a pidfd, and maybe straight into a cgroup), whose child
/// runs [`child`] until it execs or exits. Returns the child's pid, or
/// `-errno`.
///
/// Every signal is blocked in this thread across the clone, so that the
/// child starts with all of them blocked and no handler of ours can run
/// in it before [`child`] has reset the handled ones to their default
/// action ([`reset_signals`], as `posix_spawn` does). The caller's mask
/// is restored right after the clone.
///
/// The child shares nothing with us but the open file descriptions: it
/// has its own copy of memory and of the fd table, and one thread, so
/// whatever it does cannot touch our state. It is still a child of a
/// possibly multi-threaded process that the C library knows nothing of,
/// so [`child`] must keep to system calls on data prepared beforehand (a
/// lock that another of our threads held at the moment of the copy stays
/// held in the child forever; the C library's cached thread id there is
/// ours).
///
/// A `CLONE_VM|CLONE_VFORK` child on a stack of its own (what
/// `posix_spawn` does, and what this was until it was replaced) copies no
/// page tables, but needs a hand-written assembly trampoline to start on
/// that stack, and a child that shares our memory. Timed with `crun`'s
/// `spawn_latency` test (on a loaded 2-core VM), the fork cost about
/// 0.15 ms more per spawn with 0.1 MB of anonymous memory resident and
/// 0.2 ms with 1.1 MB (a container's monitor has about 0.8 MB), growing by
/// some 65 µs per further MB: not enough to keep the harder argument.
fn clone_child(
    args: &mut CloneArgs,
    spec: &SpawnSpec<'_>,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    err_w: RawFd,
) -> isize {
    // SAFETY: sigfillset initializes the set it is given; pthread_sigmask
    // gets valid pointers to initialized sets.
    let saved = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        saved
    };
    // SAFETY: clone3 without CLONE_VM, CLONE_VFORK, CLONE_FILES or
    // CLONE_THREAD is a fork: the child continues here with a copy of this
    // address space and fd table, on a copy of this stack, with one thread.
    // It runs `child`, which never returns (it execs or exits) and keeps
    // to what is sound in a fork child of a multi-threaded process (see
    // above). `args` and the pidfd it points to outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            std::ptr::from_mut(args),
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if ret == 0 {
        child(spec, argv, envp, err_w);
    }
    let ret = if ret < 0 {
        -(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL) as isize)
    } else {
        ret as isize
    };
    // SAFETY: restores the mask saved above, a valid initialized set.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut()) };
    ret
}

/// The kernel's `struct sigaction`, as `rt_sigaction(2)` reads and writes
/// it on x86-64, aarch64 and riscv64 (where it has no `sa_restorer`, the
/// kernel reads `handler`, `flags` and then `restorer` as the mask: all
/// zero below, so the same). Not the C library's: its `sigaction` may
/// take a lock (musl's does for `SIGABRT`), which a fork child must not.
#[repr(C)]
#[derive(Default)]
struct KernelSigaction {
    handler: usize,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "riscv64"
)))]
compile_error!("sys::KernelSigaction: check struct sigaction of this architecture");

/// The kernel's signal set size (64 signals), rt_sigaction's last argument,
/// as the `long` that `syscall(2)` reads its arguments as.
const SIGSET_SIZE: libc::c_long = 8;

/// In a fork child with every signal blocked: gives each signal that has
/// a handler (code of the parent's, which must not run here) its default
/// action, as `posix_spawn` does, and SIGPIPE too (Rust ignores it, and
/// an ignored disposition survives exec); then unblocks every signal, as
/// std's `Command` does. Ignored signals other than SIGPIPE stay ignored.
/// Raw system calls on our own stack only.
fn reset_signals() {
    let default = KernelSigaction::default();
    for sig in 1..=64i32 {
        let mut old = KernelSigaction::default();
        // SAFETY: rt_sigaction(sig, NULL, &old, 8) only writes `old`, a
        // struct at least as large as the kernel's.
        let got = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                libc::c_long::from(sig),
                std::ptr::null::<KernelSigaction>(),
                std::ptr::from_mut(&mut old),
                SIGSET_SIZE,
            )
        };
        let handled = got == 0 && old.handler != libc::SIG_DFL && old.handler != libc::SIG_IGN;
        if handled || sig == libc::SIGPIPE {
            // SAFETY: rt_sigaction(sig, &default, NULL, 8) reads `default`:
            // SIG_DFL, no flags, an empty mask.
            unsafe {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    libc::c_long::from(sig),
                    std::ptr::from_ref(&default),
                    std::ptr::null_mut::<KernelSigaction>(),
                    SIGSET_SIZE,
                );
            }
        }
    }
    // SAFETY: a zeroed sigset_t is an empty set; rt_sigprocmask only reads it.
    unsafe {
        let empty: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
}

fn null_terminated(v: &[CString]) -> Vec<*const libc::c_char> {
    v.iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// Reports `stage` and `errno` to the parent of a [`spawn`] and exits.
fn child_fail(err_w: RawFd, stage: u32, errno: i32) -> ! {
    let mut report = [0u8; 8];
    report[..4].copy_from_slice(&stage.to_ne_bytes());
    report[4..].copy_from_slice(&errno.to_ne_bytes());
    // SAFETY: write(2) and _exit(2) on our own fd; nothing else runs.
    unsafe {
        libc::write(err_w, report.as_ptr().cast(), report.len());
        libc::_exit(127)
    }
}

/// The child side of [`spawn`], in a fork child (see [`clone_child`]):
/// system calls only, on data prepared by the parent, then exec or
/// `_exit`.
fn child(
    spec: &SpawnSpec<'_>,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    err_w: RawFd,
) -> ! {
    let fail = |stage: u32, errno: i32| child_fail(err_w, stage, errno);
    reset_signals();
    // Move sources out of 0..=2 first, so that no dup2 overwrites a
    // source still to be used.
    let mut src = [-1; 3];
    for (i, fd) in spec.stdio.iter().enumerate() {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd we own.
        let d = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
        if d < 0 {
            fail(0, io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        src[i] = d;
    }
    for (target, fd) in src.iter().enumerate() {
        // SAFETY: dup2 onto 0, 1, 2 (clears close-on-exec there).
        if unsafe { libc::dup2(*fd, target as i32) } < 0 {
            fail(0, io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
    }
    if let Err(e) = spec.setup.apply() {
        fail(1, e.raw_os_error());
    }
    if let Err(e) = rustix::process::chdir(spec.cwd.as_c_str()) {
        fail(2, e.raw_os_error());
    }
    // SAFETY: argv and envp are null-terminated arrays of pointers to
    // NUL-terminated strings that live in `spec`, which outlives this call.
    unsafe {
        match &spec.program {
            Program::Path(p) => libc::execve(p.as_ptr(), argv.as_ptr(), envp.as_ptr()),
            Program::Fd(fd) => libc::fexecve(fd.as_raw_fd(), argv.as_ptr(), envp.as_ptr()),
        };
    }
    fail(3, io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// Which side of [`fork_monitor`] we are on.
pub enum Forked {
    /// The caller (the intermediate child has been reaped).
    Parent,
    /// The monitor: a grandchild of the caller in a session of its own,
    /// not a child of anyone who will wait for it.
    Monitor,
}

/// Fails unless this process has exactly one thread, which a fork whose
/// child goes on running ordinary Rust code needs: a lock that another
/// thread held at the moment of the fork (the allocator's, stdout's) would
/// stay held forever in the child. Only this thread could start another,
/// so the answer holds until it does.
fn ensure_single_threaded() -> io::Result<()> {
    let stat = std::fs::read("/proc/self/stat")?;
    // num_threads is field 20; fields are counted after the command name,
    // which is in parentheses and may itself hold spaces or parentheses.
    let after_comm = stat
        .iter()
        .rposition(|&b| b == b')')
        .map_or(&[][..], |i| &stat[i + 1..]);
    let threads = std::str::from_utf8(after_comm)
        .ok()
        .and_then(|s| s.split_ascii_whitespace().nth(17))
        .and_then(|n| n.parse::<u64>().ok());
    match threads {
        Some(1) => Ok(()),
        Some(n) => Err(io::Error::other(format!(
            "forking a monitor needs a single-threaded process; this one has {n} threads"
        ))),
        None => Err(io::Error::other(
            "unreadable thread count in /proc/self/stat",
        )),
    }
}

/// Double fork with `setsid` in between. Fails if the caller has more
/// than one thread (the monitor goes on running Rust code after `fork`).
pub fn fork_monitor() -> io::Result<Forked> {
    ensure_single_threaded()?;
    // SAFETY: fork in a process just found single-threaded; both sides
    // continue with ordinary code, which is sound in the child as no lock
    // can be held by a thread that the child lacks.
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

/// One fork with `setsid` in the child, which becomes the monitor while
/// staying the caller's child: for a caller that exits soon after the
/// monitor (a foreground `cairn run`), so nobody is left with a zombie,
/// and one fork less on the way to the container's start. The monitor is
/// a session leader and so must never open a terminal device (it receives
/// a console's fd over a socket, which gives no controlling terminal).
/// Fails if the caller has more than one thread, as [`fork_monitor`].
pub fn fork_child_monitor() -> io::Result<Forked> {
    ensure_single_threaded()?;
    // SAFETY: fork in a process just found single-threaded (see
    // `fork_monitor`); both sides continue with ordinary code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid > 0 {
        return Ok(Forked::Parent);
    }
    if rustix::process::setsid().is_err() {
        // SAFETY: _exit ends this child without running the parent's
        // destructors or atexit handlers.
        unsafe { libc::_exit(1) };
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

/// Ends the process with `code` once stdout and stderr are flushed, without
/// the C library's exit handlers: the only one registered is the
/// allocator's, which would hand every heap page back to the kernel page
/// by page (a dozen `madvise` calls) just before the kernel frees them all.
/// For a process whose owned resources are already dropped.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit(2) only ends the process; everything Rust owns here was
    // dropped by the caller, and the buffered streams were flushed above.
    unsafe { libc::_exit(code) }
}
