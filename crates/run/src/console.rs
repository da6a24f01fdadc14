//! Terminals: the console socket crun hands a container's pty master to
//! (`--console-socket`, the fd arrives as `SCM_RIGHTS`), raw mode for the
//! caller's terminal, and window sizes.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use rustix::termios::{tcgetattr, tcgetwinsize, tcsetattr, tcsetwinsize, OptionalActions, Termios};

/// The longest path a unix socket address holds (with its NUL).
const SUN_PATH_MAX: usize = 107;

/// A listening console socket.
#[derive(Debug)]
pub struct ConsoleListener {
    listener: UnixListener,
    /// What to give crun as `--console-socket`.
    pub crun_path: PathBuf,
    /// Where it is (removed by whoever owns the directory).
    pub path: PathBuf,
}

impl ConsoleListener {
    /// Listens at `<dir>/<name>`. A path too long for a socket address is
    /// bound through `/proc/self/fd/<dir>/…` and given to crun relative to
    /// `dir` (crun runs with `dir` as its working directory).
    pub fn bind(dir: &Path, name: &str) -> io::Result<Self> {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let (listener, crun_path) = if path.as_os_str().len() <= SUN_PATH_MAX {
            (UnixListener::bind(&path)?, path.clone())
        } else {
            let d = File::open(dir)?;
            let short = format!("/proc/self/fd/{}/{name}", d.as_raw_fd());
            (UnixListener::bind(short)?, PathBuf::from(name))
        };
        listener.set_nonblocking(true)?;
        Ok(ConsoleListener {
            listener,
            crun_path,
            path,
        })
    }

    /// Listens at `name` in the directory `dirfd` (bound through
    /// `/proc/self/fd/<dirfd>/name`, short whatever the directory's path),
    /// for a crun whose working directory that directory is; `shown` is its
    /// path as crun sees it (the bundle: crun runs in it).
    pub fn bind_in(dirfd: BorrowedFd<'_>, shown: &Path, name: &str) -> io::Result<Self> {
        let short = format!("/proc/self/fd/{}/{name}", dirfd.as_raw_fd());
        let listener = UnixListener::bind(short)?;
        listener.set_nonblocking(true)?;
        Ok(ConsoleListener {
            listener,
            crun_path: PathBuf::from(name),
            path: shown.join(name),
        })
    }

    /// Accepts crun's connection and receives the pty master; `None` if
    /// no connection is pending.
    pub fn accept_master(&self) -> io::Result<Option<OwnedFd>> {
        let stream = match self.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        stream.set_nonblocking(false)?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut data = [0u8; 4096];
        let mut iov = [IoSliceMut::new(&mut data)];
        recvmsg(&stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(mut fds) = msg {
                if let Some(fd) = fds.next() {
                    return Ok(Some(fd));
                }
            }
        }
        Err(io::Error::other(
            "crun connected to the console socket but sent no terminal",
        ))
    }
}

impl AsFd for ConsoleListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

/// The caller's terminal in raw mode; restored by [`RawMode::restore`] or
/// on drop.
pub struct RawMode {
    saved: Option<(OwnedFd, Termios)>,
}

impl RawMode {
    /// Puts stdin in raw mode if it is a terminal.
    pub fn enter() -> RawMode {
        let stdin = io::stdin();
        let fd = stdin.as_fd();
        if !rustix::termios::isatty(fd) {
            return RawMode { saved: None };
        }
        let Ok(saved) = tcgetattr(fd) else {
            return RawMode { saved: None };
        };
        let mut raw = saved.clone();
        raw.make_raw();
        if tcsetattr(fd, OptionalActions::Now, &raw).is_err() {
            return RawMode { saved: None };
        }
        let owned = fd.try_clone_to_owned().ok();
        RawMode {
            saved: owned.map(|o| (o, saved)),
        }
    }

    pub fn restore(&mut self) {
        if let Some((fd, t)) = self.saved.take() {
            let _ = tcsetattr(&fd, OptionalActions::Now, &t);
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Copies the caller's window size (from stdout, else stdin) to `master`.
pub fn copy_winsize(master: BorrowedFd<'_>) {
    let size = tcgetwinsize(io::stdout()).or_else(|_| tcgetwinsize(io::stdin()));
    if let Ok(ws) = size {
        let _ = tcsetwinsize(master, ws);
    }
}
