//! The proxy process of a listener: one single-threaded `poll` loop that
//! accepts connections, starts the container on the first one (through a
//! forked helper), forwards bytes both ways and stops the container when
//! it is idle.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};

use super::record::{io_err, release_name, write_state, ListenState, ListenStatus};
use super::{ListenSpec, READY_TIMEOUT};
use crate::container::start_detached;
use crate::state::{self, Paths};
use crate::sys::{fork_monitor, Forked, SignalFd};
use crate::RunError;

/// Bytes buffered per direction of a connection.
const BUF: usize = 64 << 10;

const SIGNALS: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// One direction of a connection.
struct Pipe {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The reading side reached its end.
    eof: bool,
    /// The end was passed on (`shutdown(SHUT_WR)` on the writing side).
    shut: bool,
}

impl Pipe {
    fn new() -> Self {
        Pipe {
            buf: vec![0; BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            eof: false,
            shut: false,
        }
    }

    fn pending(&self) -> bool {
        self.start < self.end
    }

    fn wants_read(&self) -> bool {
        !self.eof && self.end < self.buf.len()
    }

    /// Moves bytes from `from` to `to` until either would block. An error
    /// (reset, broken pipe) ends the connection.
    fn pump(&mut self, from: &mut TcpStream, to: &mut TcpStream) -> io::Result<()> {
        for _ in 0..64 {
            while self.pending() {
                match to.write(&self.buf[self.start..self.end]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => self.start += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            self.start = 0;
            self.end = 0;
            if self.eof {
                if !self.shut {
                    self.shut = true;
                    match to.shutdown(Shutdown::Write) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotConnected => {}
                        Err(e) => return Err(e),
                    }
                }
                return Ok(());
            }
            match from.read(&mut self.buf) {
                Ok(0) => self.eof = true,
                Ok(n) => self.end = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

struct Conn {
    client: TcpStream,
    upstream: TcpStream,
    up: Pipe,
    down: Pipe,
}

impl Conn {
    fn new(client: TcpStream, upstream: TcpStream) -> io::Result<Self> {
        client.set_nonblocking(true)?;
        upstream.set_nonblocking(true)?;
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        Ok(Conn {
            client,
            upstream,
            up: Pipe::new(),
            down: Pipe::new(),
        })
    }

    fn flags(&self) -> (PollFlags, PollFlags) {
        let mut c = PollFlags::empty();
        let mut u = PollFlags::empty();
        if self.up.wants_read() {
            c |= PollFlags::IN;
        }
        if self.down.pending() {
            c |= PollFlags::OUT;
        }
        if self.down.wants_read() {
            u |= PollFlags::IN;
        }
        if self.up.pending() {
            u |= PollFlags::OUT;
        }
        (c, u)
    }

    /// Moves what can be moved; `false` once the connection is over.
    fn pump(&mut self) -> bool {
        let ok = self.up.pump(&mut self.client, &mut self.upstream).is_ok()
            && self.down.pump(&mut self.upstream, &mut self.client).is_ok();
        ok && !(self.up.shut && self.down.shut)
    }

    fn close(self) {
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

/// The proxy process's state.
pub(super) struct Proxy {
    paths: Paths,
    dir: PathBuf,
    spec: ListenSpec,
    st: ListenState,
    lock: Option<File>,
    listener: Option<TcpListener>,
    signals: Option<SignalFd>,
    conns: Vec<Conn>,
    /// When the last connection closed (or the container started).
    idle_since: Instant,
}

fn log(msg: &str) {
    eprintln!("cairn-proxy[{}]: {msg}", std::process::id());
}

impl Proxy {
    /// The proxy of listener `st` in `dir`, holding its lock and listening
    /// socket; for the forked proxy process, which then runs [`Proxy::main`].
    pub(super) fn new(
        paths: Paths,
        dir: PathBuf,
        spec: ListenSpec,
        st: ListenState,
        lock: File,
        listener: TcpListener,
    ) -> Self {
        Proxy {
            paths,
            dir,
            spec,
            st,
            lock: Some(lock),
            listener: Some(listener),
            signals: None,
            conns: Vec::new(),
            idle_since: Instant::now(),
        }
    }

    fn save(&self) {
        if let Err(e) = write_state(&self.dir, &self.st) {
            log(&e.to_string());
        }
    }

    pub(super) fn main(mut self, sock: UnixStream) -> ! {
        let mut sock = Some(sock);
        let setup = (|| -> Result<(), RunError> {
            let log_path = self.dir.join("proxy.log");
            let logf = OpenOptions::new()
                .create(true)
                .append(true)
                .mode(cairn_store::PRIVATE_FILE_MODE)
                .open(&log_path)
                .map_err(|e| io_err("opening", &log_path, e))?;
            let null = File::open("/dev/null")
                .map_err(|e| io_err("opening", Path::new("/dev/null"), e))?;
            let redirect = || -> rustix::io::Result<()> {
                rustix::stdio::dup2_stdin(&null)?;
                rustix::stdio::dup2_stdout(&logf)?;
                rustix::stdio::dup2_stderr(&logf)
            };
            redirect().map_err(|e| io_err("redirecting output to", &log_path, e.into()))?;
            self.signals = Some(
                SignalFd::new(&SIGNALS).map_err(|e| io_err("blocking signals in", &self.dir, e))?,
            );
            self.st.proxy_pid = Some(std::process::id() as i32);
            write_state(&self.dir, &self.st)
        })();
        if let Err(e) = setup {
            if let Some(s) = sock.as_mut() {
                let _ = writeln!(s, "error {e}");
            }
            self.shutdown();
            std::process::exit(1);
        }
        if let Some(mut s) = sock.take() {
            let _ = s.write_all(b"ready\n");
        }
        log(&format!(
            "listening on {} for {} (container port {})",
            self.st.listen, self.st.name, self.spec.container_port
        ));
        let code = match self.run() {
            Ok(()) => 0,
            Err(e) => {
                log(&e.to_string());
                1
            }
        };
        self.shutdown();
        std::process::exit(code)
    }

    /// Ends the listener: socket closed, container stopped, state removed.
    fn shutdown(&mut self) {
        self.listener.take();
        for c in self.conns.drain(..) {
            c.close();
        }
        let timeout = fs::read_to_string(self.dir.join("stop"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map_or(self.spec.stop_timeout, Duration::from_millis);
        self.stop_container(timeout);
        release_name(&self.paths, &self.st.name, &self.st.id);
        let _ = fs::remove_dir_all(&self.dir);
        self.lock.take();
    }

    fn container_alive(&self) -> bool {
        self.st
            .container
            .as_ref()
            .is_some_and(|c| state::has_state(&self.paths.container(c)))
    }

    fn stop_container(&mut self, timeout: Duration) {
        let Some(c) = self.st.container.clone() else {
            return;
        };
        self.st.status = ListenStatus::Stopping;
        self.save();
        let t = Instant::now();
        match crate::lifecycle::stop(&self.paths, &c, timeout) {
            Ok(_) | Err(RunError::NoSuchContainer(_)) => log(&format!(
                "stopped container {} in {:?}",
                &c[..12],
                t.elapsed()
            )),
            Err(e) => {
                log(&format!("stopping container {}: {e}", &c[..12]));
                self.st.last_error = Some(e.to_string());
            }
        }
        self.st.container = None;
        self.st.status = ListenStatus::Waiting;
        self.save();
    }

    /// Starts the container (in a helper process that holds none of the
    /// proxy's descriptors) and returns its id.
    fn start_container(&mut self, pending: &mut Vec<TcpStream>) -> Result<String, RunError> {
        let (mut ours, theirs) =
            UnixStream::pair().map_err(|e| io_err("creating socketpair in", &self.dir, e))?;
        match fork_monitor().map_err(|e| io_err("forking a starter in", &self.dir, e))? {
            Forked::Monitor => {
                drop(ours);
                // Nothing of the proxy may live on in the container's monitor.
                self.listener.take();
                self.lock.take();
                self.conns.clear();
                pending.clear();
                self.signals.take();
                SignalFd::unblock(&SIGNALS);
                let mut theirs = theirs;
                let line = match start_detached(&self.paths, &self.spec.run) {
                    Ok(s) => format!("ok {}\n", s.id),
                    Err(e) => format!("error {}\n", e.to_string().replace('\n', " ")),
                };
                let _ = theirs.write_all(line.as_bytes());
                std::process::exit(0)
            }
            Forked::Parent => {
                drop(theirs);
                // The helper's copy lives on in the container's monitor:
                // read a line, not to the end.
                let mut line = String::new();
                BufReader::new(&mut ours)
                    .read_line(&mut line)
                    .map_err(|e| io_err("reading from the starter in", &self.dir, e))?;
                let line = line.trim();
                if let Some(id) = line.strip_prefix("ok ") {
                    Ok(id.to_string())
                } else {
                    Err(RunError::Crun(
                        line.strip_prefix("error ")
                            .unwrap_or("the starter exited without an answer")
                            .to_string(),
                    ))
                }
            }
        }
    }

    /// A connection to the container's port, starting the container first
    /// if none runs.
    fn upstream(&mut self, pending: &mut Vec<TcpStream>) -> Result<TcpStream, RunError> {
        let target = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.spec.container_port);
        if self.st.container.is_some() && !self.container_alive() {
            log("the container ended on its own");
            self.st.container = None;
            self.st.status = ListenStatus::Waiting;
            self.save();
        }
        if self.st.container.is_some() {
            match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
                Ok(s) => return Ok(s),
                Err(e) => {
                    return Err(RunError::Crun(format!(
                        "connecting to the container at {target}: {e}"
                    )))
                }
            }
        }
        let t0 = Instant::now();
        self.st.status = ListenStatus::Starting;
        self.save();
        let id = match self.start_container(pending) {
            Ok(id) => id,
            Err(e) => {
                self.st.status = ListenStatus::Waiting;
                self.st.last_error = Some(e.to_string());
                self.save();
                return Err(e);
            }
        };
        let started = t0.elapsed();
        self.st.container = Some(id.clone());
        self.st.starts += 1;
        self.save();
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut tries = 0u32;
        loop {
            match TcpStream::connect(target) {
                Ok(s) => {
                    log(&format!(
                        "started container {} in {started:?}, port {} ready after {:?}",
                        &id[..12],
                        self.spec.container_port,
                        t0.elapsed()
                    ));
                    self.st.status = ListenStatus::Active;
                    self.save();
                    self.idle_since = Instant::now();
                    return Ok(s);
                }
                Err(e) => {
                    tries += 1;
                    let dead = tries.is_multiple_of(16) && !self.container_alive();
                    if dead || Instant::now() > deadline {
                        let why = if dead {
                            "the container exited before its port accepted connections".to_string()
                        } else {
                            format!(
                                "port {} did not accept within {READY_TIMEOUT:?}: {e}",
                                self.spec.container_port
                            )
                        };
                        self.stop_container(Duration::ZERO);
                        self.st.last_error = Some(why.clone());
                        self.save();
                        return Err(RunError::Crun(why));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    fn accept(&mut self) {
        let mut pending = Vec::new();
        if let Some(l) = &self.listener {
            loop {
                match l.accept() {
                    Ok((s, _)) => pending.push(s),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        while !pending.is_empty() {
            self.st.connections += 1;
            // The client stays in `pending` while a start may fork, so the
            // starter drops its copy too.
            let up = self.upstream(&mut pending);
            let client = pending.remove(0);
            match up {
                Ok(up) => match Conn::new(client, up) {
                    Ok(c) => self.conns.push(c),
                    Err(e) => log(&format!("setting up a connection: {e}")),
                },
                Err(e) => {
                    log(&format!("connection dropped: {e}"));
                    let _ = client.shutdown(Shutdown::Both);
                }
            }
            self.save();
        }
    }

    fn stop_requested(&self) -> bool {
        let mut stop = false;
        if let Some(s) = &self.signals {
            while let Ok(Some(sig)) = s.read() {
                log(&format!("signal {sig}: ending"));
                stop = true;
            }
        }
        stop
    }

    fn run(&mut self) -> Result<(), RunError> {
        loop {
            if self.st.container.is_some() && !self.container_alive() && self.conns.is_empty() {
                log("the container ended on its own");
                self.st.container = None;
                self.st.status = ListenStatus::Waiting;
                self.save();
            }
            // Idle stop.
            let mut timeout = None;
            if self.st.container.is_some() {
                let mut t = Duration::from_secs(1);
                if let (true, Some(idle)) = (self.conns.is_empty(), self.spec.idle_stop) {
                    let left = idle.saturating_sub(self.idle_since.elapsed());
                    if left.is_zero() {
                        log(&format!("idle for {idle:?}: stopping the container"));
                        self.stop_container(self.spec.stop_timeout);
                        continue;
                    }
                    t = t.min(left);
                }
                timeout = Some(t);
            }
            let ts = timeout.map(|t| rustix::event::Timespec {
                tv_sec: t.as_secs() as i64,
                tv_nsec: i64::from(t.subsec_nanos()),
            });
            let mut fds = Vec::with_capacity(2 + 2 * self.conns.len());
            let Some(signals) = &self.signals else {
                return Ok(());
            };
            fds.push(PollFd::new(signals, PollFlags::IN));
            let Some(listener) = &self.listener else {
                return Ok(());
            };
            fds.push(PollFd::new(listener, PollFlags::IN));
            let mut owners = Vec::with_capacity(2 * self.conns.len());
            for (i, c) in self.conns.iter().enumerate() {
                let (cf, uf) = c.flags();
                if !cf.is_empty() {
                    fds.push(PollFd::new(&c.client, cf));
                    owners.push(i);
                }
                if !uf.is_empty() {
                    fds.push(PollFd::new(&c.upstream, uf));
                    owners.push(i);
                }
            }
            match poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(io_err("polling in", &self.dir, e.into())),
            }
            let sig = !fds[0].revents().is_empty();
            let new = !fds[1].revents().is_empty();
            let mut ready: Vec<usize> = fds[2..]
                .iter()
                .zip(&owners)
                .filter(|(f, _)| !f.revents().is_empty())
                .map(|(_, &i)| i)
                .collect();
            drop(fds);
            ready.dedup();
            if sig && self.stop_requested() {
                return Ok(());
            }
            let before = self.conns.len();
            for &i in ready.iter().rev() {
                if !self.conns[i].pump() {
                    self.conns.swap_remove(i).close();
                }
            }
            if new {
                self.accept();
            }
            if before > 0 && self.conns.is_empty() {
                self.idle_since = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipes_forward_and_half_close() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let l2 = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l2.local_addr().unwrap()).unwrap();
        let (mut d, _) = l2.accept().unwrap();
        // a ⇄ [b proxy c] ⇄ d
        let mut conn = Conn::new(b, c).unwrap();
        a.write_all(b"ping").unwrap();
        a.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        d.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        while got.len() < 4 || !conn.up.shut {
            assert!(conn.pump());
            let mut chunk = [0u8; 16];
            d.set_nonblocking(true).unwrap();
            match d.read(&mut chunk) {
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            assert!(t.elapsed() < Duration::from_secs(5));
        }
        assert_eq!(got, b"ping");
        d.set_nonblocking(false).unwrap();
        // The half-close reached d: it reads the end, and can still answer.
        let mut rest = Vec::new();
        d.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        d.write_all(b"pong").unwrap();
        drop(d);
        let mut back = Vec::new();
        while conn.pump() {
            assert!(t.elapsed() < Duration::from_secs(5));
        }
        conn.close();
        a.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"pong");
    }
}
