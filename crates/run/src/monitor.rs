//! The two ends of a running container: the monitor (parent of crun, the
//! one that waits for the container and tears it down) and the client
//! (`cairn run` in the foreground: forwards signals, proxies a tty, and
//! exits with the container's code).
//!
//! They talk over a socketpair, one line per message:
//! monitor → client `started <crun pid>`, `exit <code>`, `error <text>`;
//! client → monitor `sig <n>`. When the client goes away the container
//! carries on (as with podman); when the monitor goes away the container
//! is left to the reaper.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use cairn_store::StoreLock;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_send_signal, Signal};

use crate::console::{copy_winsize, ConsoleListener, RawMode};
use crate::container::{crun_run_spawn, spawn_crun, teardown, Prepared, RunSpec};
use crate::state::{self, Locked, Paths, State, Status};
use crate::stdio::{StdioPipes, Stream};
use crate::sys::SignalFd;
use crate::sys::Spawned;
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

fn send(sock: &mut Option<UnixStream>, line: &str) {
    if let Some(s) = sock {
        if s.write_all(format!("{line}\n").as_bytes()).is_err() {
            *sock = None;
        }
    }
}

/// The monitor process: never returns.
pub(crate) fn monitor_main(
    paths: &Paths,
    p: Prepared,
    sock: Option<UnixStream>,
    spec: &RunSpec,
) -> ! {
    let mut sock = sock;
    let code = match monitor(paths, p, &mut sock, spec) {
        Ok(()) => 0,
        Err(e) => {
            send(&mut sock, &format!("error {e}"));
            1
        }
    };
    drop(sock);
    crate::sys::exit_now(code)
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(255)
}

fn monitor(
    paths: &Paths,
    p: Prepared,
    sock: &mut Option<UnixStream>,
    spec: &RunSpec,
) -> Result<(), RunError> {
    let dir = p.dir().to_path_buf();
    let mut st = p.state.clone();
    if let Some(log_path) = st.log_path.clone().filter(|_| st.detached) {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(cairn_store::PRIVATE_FILE_MODE)
            .open(&log_path)
            .map_err(|e| RunError::io("opening", &log_path, e))?;
        let null = File::open("/dev/null").map_err(|e| RunError::io("opening", "/dev/null", e))?;
        let redirect = || -> rustix::io::Result<()> {
            rustix::stdio::dup2_stdin(&null)?;
            rustix::stdio::dup2_stdout(&log)?;
            rustix::stdio::dup2_stderr(&log)
        };
        redirect().map_err(|e| {
            RunError::io("redirecting the monitor's output to", &log_path, e.into())
        })?;
    }
    let stdin_live = spec.interactive && !spec.tty && !st.detached;
    let mut pipes = StdioPipes::new().map_err(|e| RunError::io("creating pipes in", &dir, e))?;
    let spawn_spec = crun_run_spawn(paths, &p, pipes.child_fds());
    let spawned = spawn_spec.and_then(spawn_crun);
    pipes.start_stdin(stdin_live);
    let Prepared {
        locked,
        mut mount,
        bundle,
        store_lock,
        console,
        ..
    } = p;
    // The overlay's detached layers: closing them waits for RCU grace
    // periods, which is done after the client has its exit code.
    let layers = mount.take_layers();
    // crun's private namespace holds the bundle and rootfs now (or
    // spawning failed).
    drop((mount, bundle));
    drop(store_lock);
    // The foreground client accepts the console itself.
    let console = if st.detached { console } else { None };
    let Spawned {
        pid: crun_pid,
        pidfd,
    } = match spawned {
        Ok(s) => s,
        Err(e) => {
            st.remove = true;
            teardown(paths, &mut st);
            return Err(e);
        }
    };
    // crun is the only process in its private mount namespace (the rootfs
    // stack, the bundle): when it exits, the kernel unmounts all of it, an
    // RCU grace period included, before crun counts as exited. Holding the
    // namespace moves that work to the drop of this fd, after the client
    // has the exit code. Best effort: a crun that failed at once is gone.
    let crun_mnt_ns = rustix::fs::open(
        format!("/proc/{}/ns/mnt", crun_pid.as_raw_nonzero()).as_str(),
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok();
    st.status = Status::Running;
    st.monitor_pid = Some(std::process::id() as i32);
    state::write_state(&dir, &st)?;
    if !st.detached {
        send(sock, &format!("started {}", crun_pid.as_raw_nonzero()));
    }
    let mut started_sent = !st.detached;
    let started_at = Instant::now();
    let mut master: Option<OwnedFd> = None;
    let mut buf = Vec::new();
    let log = st.log_path.clone();
    let pid_file = paths.pid_file(&st.id);
    loop {
        if !started_sent && pid_file.exists() {
            send(sock, &format!("started {}", crun_pid.as_raw_nonzero()));
            started_sent = true;
        }
        let mut fds = vec![PollFd::new(&pidfd, PollFlags::IN)];
        let sock_idx = sock.as_ref().map(|s| {
            fds.push(PollFd::new(s, PollFlags::IN));
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
        let readers = pipes.readers();
        let first_reader = fds.len();
        for (_, fd) in &readers {
            fds.push(PollFd::new(fd, PollFlags::IN));
        }
        let timeout = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 5_000_000,
        };
        match poll(&mut fds, (!started_sent).then_some(&timeout)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(RunError::io("polling in", &dir, e.into())),
        }
        let ready = |i: Option<usize>| i.is_some_and(|i| !fds[i].revents().is_empty());
        let (crun_done, sock_ready, listen_ready, master_ready) = (
            ready(Some(0)),
            ready(sock_idx),
            ready(listen_idx),
            ready(master_idx),
        );
        let pumps: Vec<Stream> = readers
            .iter()
            .enumerate()
            .filter(|(i, _)| ready(Some(first_reader + i)))
            .map(|(_, (s, _))| *s)
            .collect();
        drop(fds);
        drop(readers);
        for s in pumps {
            pipes.pump(s);
        }
        if sock_ready {
            let mut chunk = [0u8; 256];
            let n = sock.as_mut().map_or(Ok(0), |s| s.read(&mut chunk));
            match n {
                Ok(0) | Err(_) => *sock = None,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=pos).collect();
                        let line = String::from_utf8_lossy(&line);
                        if let Some(n) = line.trim().strip_prefix("sig ") {
                            if let Some(sig) = n.parse().ok().and_then(Signal::from_named_raw) {
                                let _ = pidfd_send_signal(&pidfd, sig);
                            }
                        }
                    }
                }
            }
        }
        if listen_ready {
            if let Some(c) = &console {
                if let Ok(Some(m)) = c.accept_master() {
                    master = Some(m);
                }
            }
        }
        if master_ready {
            if let (Some(m), Some(log)) = (&master, &log) {
                let mut chunk = [0u8; 8192];
                match rustix::io::read(m, &mut chunk) {
                    Ok(0) | Err(_) => master = None,
                    Ok(n) => {
                        if let Ok(mut f) = OpenOptions::new().append(true).open(log) {
                            let _ = f.write_all(&chunk[..n]);
                        }
                    }
                }
            }
        }
        if crun_done {
            break;
        }
        if !started_sent && started_at.elapsed() > Duration::from_secs(60) {
            // crun never wrote the pid file; let the client go on waiting no more.
            send(sock, "started 0");
            started_sent = true;
        }
    }
    let status = loop {
        match rustix::process::waitpid(Some(crun_pid), rustix::process::WaitOptions::empty()) {
            Err(rustix::io::Errno::INTR) | Ok(None) => continue,
            Err(e) => return Err(RunError::io("waiting for crun in", &dir, e.into())),
            Ok(Some((_, status))) => break status,
        }
    };
    let code = exit_code(std::process::ExitStatus::from_raw(status.as_raw() as i32));
    pipes.drain();
    if !started_sent && !pid_file.exists() {
        let tail = log
            .as_ref()
            .and_then(|l| fs::read_to_string(l).ok())
            .map(|t| t.lines().rev().take(3).collect::<Vec<_>>().join("; "))
            .unwrap_or_default();
        st.remove = true;
        st.exit_code = Some(code);
        teardown(paths, &mut st);
        return Err(RunError::Crun(format!(
            "the container did not start (crun exited with {code}): {tail}"
        )));
    }
    st.pid = state::read_pid(paths, &st);
    st.exit_code = Some(code);
    st.finished = Some(state::now());
    st.status = Status::Exited;
    for problem in teardown(paths, &mut st) {
        eprintln!("cairn: teardown of {}: {problem}", st.id);
    }
    if !started_sent {
        send(sock, &format!("started {}", crun_pid.as_raw_nonzero()));
    }
    send(sock, &format!("exit {code}"));
    // Unmounting the stack (crun's namespace goes with this fd) waits for
    // an expedited RCU grace period, which interrupts every CPU: let a
    // foreground client exit first (it closes the socket), for 50 ms at most.
    if let Some(s) = sock.as_mut() {
        if s.set_read_timeout(Some(Duration::from_millis(50))).is_ok() {
            let mut rest = [0u8; 64];
            while let Ok(n) = s.read(&mut rest) {
                if n == 0 {
                    break;
                }
            }
        }
    }
    drop(crun_mnt_ns);
    drop(layers);
    drop(locked);
    Ok(())
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
