//! The session stage: the client's side of a running container, that is
//! `cairn run` in the foreground (talking to the monitor over a
//! socketpair) and `cairn exec` (the parent of `crun exec`). It forwards
//! signals, proxies a tty and returns the container's exit code.
//!
//! The protocol, one line per message: monitor → client `started <crun
//! pid>`, `exit <code>`, `error <text>`; client → monitor `sig <n>`.
//! When the client goes away the container carries on (as with podman);
//! when the monitor goes away the container is left to the reaper.
//!
//! This module knows nothing of how a container is prepared or started:
//! it imports only the shared building blocks (console, stdio, state).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use cairn_store::StoreLock;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_send_signal, Signal};

use crate::console::{copy_winsize, ConsoleListener, RawMode};
use crate::state::{Locked, State};
use crate::stdio::{StdioPipes, Stream};
use crate::sys::SignalFd;
use crate::RunError;

/// Signals `cairn run` passes on to the container (as podman's sig-proxy).
pub(crate) const FORWARDED: [i32; 7] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
];

/// Sends one line of the protocol; a failed write means the other end
/// is gone, and the socket is dropped.
pub(crate) fn send(sock: &mut Option<UnixStream>, line: &str) {
    if let Some(s) = sock {
        if s.write_all(format!("{line}\n").as_bytes()).is_err() {
            *sock = None;
        }
    }
}

/// The exit code a shell would report for `status` (128+N for signal N).
pub(crate) fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(255)
}

/// For `start_detached`: waits for the monitor's `started` (or `error`).
pub(crate) fn wait_started(sock: &mut UnixStream) -> Result<(), RunError> {
    let mut text = String::new();
    let mut chunk = [0u8; 4096];
    loop {
        match sock.read(&mut chunk) {
            Ok(0) => {
                return Err(RunError::Crun(
                    "the container's monitor exited before the container started".into(),
                ))
            }
            Ok(n) => text.push_str(&String::from_utf8_lossy(&chunk[..n])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(RunError::io("reading from the monitor of", "container", e)),
        }
        for line in text.lines() {
            if line.starts_with("started") {
                return Ok(());
            }
            if let Some(msg) = line.strip_prefix("error ") {
                return Err(RunError::Crun(msg.to_string()));
            }
        }
    }
}

/// The foreground client: waits for the container's exit code while
/// forwarding signals and, with a tty, proxying the terminal.
pub(crate) fn client_session(
    sock: UnixStream,
    console: Option<ConsoleListener>,
    interactive: bool,
    store_lock: Option<StoreLock>,
    locked: Locked,
    st: &State,
) -> Result<i32, RunError> {
    let signals = SignalFd::new(&FORWARDED)
        .map_err(|e| RunError::io("blocking signals for", &locked.dir, e))?;
    let io = SessionIo {
        sock: Some(sock),
        child: None,
        pipes: None,
        console,
    };
    let result = session_loop(&signals, io, interactive, store_lock, st);
    SignalFd::unblock(&FORWARDED);
    drop(locked);
    result
}

/// What a session talks to: the monitor (its socket), or a crun child
/// whose stdio are `pipes`; and a console socket for a tty.
pub(crate) struct SessionIo<'a> {
    pub sock: Option<UnixStream>,
    pub child: Option<(&'a mut std::process::Child, OwnedFd)>,
    pub pipes: Option<&'a mut StdioPipes>,
    pub console: Option<ConsoleListener>,
}

/// Waits for the monitor's `exit` line, or the child's exit, while
/// forwarding signals and proxying a tty.
pub(crate) fn session_loop(
    signals: &SignalFd,
    io: SessionIo<'_>,
    interactive: bool,
    store_lock: Option<StoreLock>,
    st: &State,
) -> Result<i32, RunError> {
    let SessionIo {
        mut sock,
        mut child,
        mut pipes,
        console,
    } = io;
    let mut store_lock = store_lock;
    let mut raw: Option<RawMode> = None;
    let mut master: Option<OwnedFd> = None;
    let mut stdin_open = interactive;
    let mut buf = Vec::new();
    let stdin = io::stdin();
    let stdin_fd = stdin.as_fd();
    let finish = |raw: &mut Option<RawMode>, master: &mut Option<OwnedFd>| {
        if let Some(m) = master.take() {
            drain(&m);
        }
        if let Some(r) = raw.as_mut() {
            r.restore();
        }
    };
    loop {
        let mut fds = vec![PollFd::new(signals, PollFlags::IN)];
        let sock_idx = sock.as_ref().map(|s| {
            fds.push(PollFd::new(s, PollFlags::IN));
            fds.len() - 1
        });
        let child_idx = child.as_ref().map(|(_, pfd)| {
            fds.push(PollFd::new(pfd, PollFlags::IN));
            fds.len() - 1
        });
        let listen_idx = match (&console, &master) {
            (Some(c), None) => {
                fds.push(PollFd::new(c, PollFlags::IN));
                Some(fds.len() - 1)
            }
            _ => None,
        };
        let master_idx = master.as_ref().map(|m| {
            fds.push(PollFd::new(m, PollFlags::IN));
            fds.len() - 1
        });
        let stdin_idx = (master.is_some() && stdin_open).then(|| {
            fds.push(PollFd::new(&stdin_fd, PollFlags::IN));
            fds.len() - 1
        });
        let readers = pipes.as_ref().map(|p| p.readers()).unwrap_or_default();
        let first_reader = fds.len();
        for (_, fd) in &readers {
            fds.push(PollFd::new(fd, PollFlags::IN));
        }
        match poll(&mut fds, None) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(RunError::io("polling for container", &st.id, e.into())),
        }
        let ready = |i: Option<usize>| i.is_some_and(|i| !fds[i].revents().is_empty());
        let (sig_ready, sock_ready, child_ready, listen_ready, master_ready, stdin_ready) = (
            ready(Some(0)),
            ready(sock_idx),
            ready(child_idx),
            ready(listen_idx),
            ready(master_idx),
            ready(stdin_idx),
        );
        let pumps: Vec<Stream> = readers
            .iter()
            .enumerate()
            .filter(|(i, _)| ready(Some(first_reader + i)))
            .map(|(_, (s, _))| *s)
            .collect();
        drop(fds);
        drop(readers);
        if let Some(p) = pipes.as_mut() {
            for s in pumps {
                p.pump(s);
            }
        }
        if sig_ready {
            while let Ok(Some(sig)) = signals.read() {
                if sig == libc::SIGWINCH {
                    if let Some(m) = &master {
                        copy_winsize(m.as_fd());
                    }
                    continue;
                }
                if let Some((c, pfd)) = child.as_mut() {
                    let _ = c;
                    if let Some(s) = Signal::from_named_raw(sig) {
                        let _ = pidfd_send_signal(&*pfd, s);
                    }
                }
                send(&mut sock, &format!("sig {sig}"));
            }
        }
        if listen_ready {
            if let Some(c) = &console {
                match c.accept_master() {
                    Ok(Some(m)) => {
                        let _ = rustix::fs::fcntl_setfl(&m, rustix::fs::OFlags::NONBLOCK);
                        copy_winsize(m.as_fd());
                        raw = Some(RawMode::enter());
                        master = Some(m);
                    }
                    Ok(None) => {}
                    Err(e) => return Err(RunError::io("receiving the terminal of", &st.id, e)),
                }
            }
        }
        if master_ready {
            if let Some(m) = &master {
                let mut chunk = [0u8; 8192];
                match rustix::io::read(m, &mut chunk) {
                    Ok(0) => master = None,
                    Ok(n) => {
                        let mut out = io::stdout().lock();
                        let _ = out.write_all(&chunk[..n]);
                        let _ = out.flush();
                    }
                    Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
                    Err(_) => master = None,
                }
            }
        }
        if stdin_ready {
            let mut chunk = [0u8; 4096];
            match rustix::io::read(stdin_fd, &mut chunk) {
                Ok(0) | Err(_) => {
                    stdin_open = false;
                    if let Some(m) = &master {
                        // End of input: the terminal's EOF character.
                        let _ = rustix::io::write(m, &[4]);
                    }
                }
                Ok(n) => {
                    if let Some(m) = &master {
                        write_all_fd(m, &chunk[..n]);
                    }
                }
            }
        }
        if sock_ready {
            let mut chunk = [0u8; 4096];
            let n = sock.as_mut().map_or(Ok(0), |s| s.read(&mut chunk));
            match n {
                Ok(0) | Err(_) => {
                    sock = None;
                    if child.is_none() {
                        finish(&mut raw, &mut master);
                        return Err(RunError::Crun(format!(
                            "the monitor of container {} went away; see `cairn ps -a`",
                            &st.id[..12]
                        )));
                    }
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let line = String::from_utf8_lossy(&line).trim().to_string();
                if line.starts_with("started") {
                    store_lock.take();
                } else if let Some(code) = line.strip_prefix("exit ") {
                    finish(&mut raw, &mut master);
                    return Ok(code.parse().unwrap_or(255));
                } else if let Some(msg) = line.strip_prefix("error ") {
                    finish(&mut raw, &mut master);
                    return Err(RunError::Crun(msg.to_string()));
                }
            }
        }
        if child_ready {
            if let Some((c, _)) = child.take() {
                let status = c
                    .wait()
                    .map_err(|e| RunError::io("waiting for crun exec in", &st.id, e))?;
                if let Some(p) = pipes.as_mut() {
                    p.drain();
                }
                finish(&mut raw, &mut master);
                return Ok(exit_code(status));
            }
        }
    }
}

fn write_all_fd(fd: &OwnedFd, mut data: &[u8]) {
    while !data.is_empty() {
        match rustix::io::write(fd, data) {
            Ok(n) => data = &data[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => return,
        }
    }
}

/// Copies what is left in a pty master to stdout.
fn drain(master: &OwnedFd) {
    let _ = rustix::fs::fcntl_setfl(master, rustix::fs::OFlags::NONBLOCK);
    let mut out = io::stdout().lock();
    let mut chunk = [0u8; 8192];
    while let Ok(n) = rustix::io::read(master, &mut chunk) {
        if n == 0 {
            break;
        }
        let _ = out.write_all(&chunk[..n]);
    }
    let _ = out.flush();
}
