//! Pipes between crun and the caller's stdin, stdout and stderr.
//!
//! crun `fchown`s the stdio descriptors it is given to the container's
//! user (so that a process in a user namespace can reopen them): handed
//! the caller's terminal, its output file or the host's `/dev/null`, it
//! would give those to uid 100000 or whoever the container runs as. So
//! crun only ever gets pipes of ours, and we copy (as conmon does): the
//! caller's stdin into the container's (a thread, since a terminal read
//! blocks), the container's stdout and stderr to our fds 1 and 2 (the
//! caller's, or a detached container's log).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::process::Stdio;
use std::time::{Duration, Instant};

use rustix::pipe::{pipe_with, PipeFlags};

/// The two outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Out,
    Err,
}

/// Our ends of the three pipes.
#[derive(Debug)]
pub(crate) struct StdioPipes {
    child: Option<(OwnedFd, OwnedFd, OwnedFd)>,
    stdin_w: Option<OwnedFd>,
    out_r: Option<OwnedFd>,
    err_r: Option<OwnedFd>,
    /// Whether our fd 1 / fd 2 still take data.
    out_ok: bool,
    err_ok: bool,
}

impl StdioPipes {
    pub fn new() -> io::Result<Self> {
        let (in_r, in_w) = pipe_with(PipeFlags::CLOEXEC)?;
        let (out_r, out_w) = pipe_with(PipeFlags::CLOEXEC)?;
        let (err_r, err_w) = pipe_with(PipeFlags::CLOEXEC)?;
        Ok(StdioPipes {
            child: Some((in_r, out_w, err_w)),
            stdin_w: Some(in_w),
            out_r: Some(out_r),
            err_r: Some(err_r),
            out_ok: true,
            err_ok: true,
        })
    }

    /// The child's ends, for `Command::stdin/stdout/stderr`. Drop the
    /// `Command` after spawning it, or the pipes never see end-of-file.
    pub fn child_stdio(&mut self) -> (Stdio, Stdio, Stdio) {
        let (i, o, e) = self.child.take().expect("child ends taken once");
        (Stdio::from(i), Stdio::from(o), Stdio::from(e))
    }

    /// The child's ends as fds (for `sys::spawn`): stdin, stdout, stderr.
    pub fn child_fds(&mut self) -> [OwnedFd; 3] {
        let (i, o, e) = self.child.take().expect("child ends taken once");
        [i, o, e]
    }

    /// Starts copying our stdin into the child's (`live`), or closes the
    /// child's stdin right away.
    pub fn start_stdin(&mut self, live: bool) {
        let Some(w) = self.stdin_w.take() else { return };
        if !live {
            return;
        }
        std::thread::spawn(move || {
            let mut w = std::fs::File::from(w);
            let mut buf = [0u8; 8192];
            let stdin = io::stdin();
            let mut input = stdin.lock();
            loop {
                match input.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if w.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            // Dropping w closes the container's stdin.
        });
    }

    /// The read ends still open.
    pub fn readers(&self) -> Vec<(Stream, BorrowedFd<'_>)> {
        let mut v = Vec::new();
        if let Some(fd) = &self.out_r {
            v.push((Stream::Out, fd.as_fd()));
        }
        if let Some(fd) = &self.err_r {
            v.push((Stream::Err, fd.as_fd()));
        }
        v
    }

    /// Copies what `which` has to our fd 1 or 2; closes it at end-of-file.
    pub fn pump(&mut self, which: Stream) {
        let mut buf = [0u8; 16384];
        let (slot, ok) = match which {
            Stream::Out => (&mut self.out_r, &mut self.out_ok),
            Stream::Err => (&mut self.err_r, &mut self.err_ok),
        };
        let Some(fd) = slot.as_ref() else { return };
        match rustix::io::read(fd, &mut buf) {
            Ok(0) => *slot = None,
            Ok(n) => {
                if *ok {
                    let written = match which {
                        Stream::Out => {
                            let mut out = io::stdout().lock();
                            out.write_all(&buf[..n]).and_then(|()| out.flush())
                        }
                        Stream::Err => io::stderr().lock().write_all(&buf[..n]),
                    };
                    // A reader that went away: keep draining, stop writing.
                    *ok = written.is_ok();
                }
            }
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => {}
            Err(_) => *slot = None,
        }
    }

    /// After the child exited: copies what is left, until end-of-file (or
    /// a second of silence from a writer that outlived the container).
    pub fn drain(&mut self) {
        for fd in [&self.out_r, &self.err_r].into_iter().flatten() {
            let _ = rustix::fs::fcntl_setfl(fd, rustix::fs::OFlags::NONBLOCK);
        }
        let mut quiet_since = Instant::now();
        while self.out_r.is_some() || self.err_r.is_some() {
            let mut fds: Vec<rustix::event::PollFd<'_>> = Vec::new();
            let readers: Vec<(Stream, BorrowedFd<'_>)> = self.readers();
            for (_, fd) in &readers {
                fds.push(rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN));
            }
            let timeout = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            let _ = rustix::event::poll(&mut fds, Some(&timeout));
            let ready: Vec<Stream> = readers
                .iter()
                .zip(fds.iter())
                .filter(|(_, p)| !p.revents().is_empty())
                .map(|((s, _), _)| *s)
                .collect();
            drop(fds);
            if ready.is_empty() {
                if quiet_since.elapsed() > Duration::from_secs(1) {
                    break;
                }
                continue;
            }
            for s in ready {
                self.pump(s);
            }
            quiet_since = Instant::now();
        }
    }
}
