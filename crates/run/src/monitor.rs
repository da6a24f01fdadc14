//! The monitor (cairn's conmon): the parent of crun, the one process that
//! waits for the container, records its exit and tears it down.
//!
//! It sits on top of the stages: it takes a [`Prepared`] container, starts
//! crun ([`spawn`](crate::spawn)), copies crun's stdio, answers the client's
//! session ([`session`](crate::session), the other end of the socketpair)
//! and finally runs [`teardown`].

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_send_signal, Signal};

use crate::prepare::{Prepared, RunSpec};
use crate::session::{exit_code, send};
use crate::spawn::{crun_run_spawn, spawn_crun};
use crate::state::{self, Paths, Status};
use crate::stdio::{StdioPipes, Stream};
use crate::sys::Spawned;
use crate::teardown::teardown;
use crate::RunError;

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
