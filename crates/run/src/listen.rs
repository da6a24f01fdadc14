//! On-demand containers (the systemd socket-activation idea):
//! `cairn run -d --listen HOSTADDR:HOSTPORT:CTRPORT --idle-stop DURATION`.
//!
//! ```text
//! cairn run -d --listen ──fork,setsid,fork──► proxy (holds the listening socket)
//!                                              │ first connection:
//!                                              ├─fork,setsid,fork─► helper ── start_detached ──► monitor ─► crun ─► ctr
//!                                              │ waits until 127.0.0.1:CTRPORT accepts, then forwards both ways
//!                                              │ idle for --idle-stop with no connection: lifecycle::stop, back to waiting
//! ```
//!
//! # Design
//!
//! - **Networking.** A listen container runs with `--network host`: the
//!   proxy reaches it at `127.0.0.1:CTRPORT`, which is the host's
//!   loopback. So HOSTPORT must differ from CTRPORT (the container's
//!   server would otherwise collide with the proxy's socket). A
//!   veth/netns pair would allow equal ports at the cost of a network
//!   setup per start; not done.
//! - **The proxy** is one single-threaded process with a `poll` loop (as
//!   `systemd-socket-proxyd`'s event loop): every connection is a pair of
//!   non-blocking sockets with a 64 KiB buffer each way; an end of input
//!   on one side becomes a `shutdown(SHUT_WR)` on the other once the
//!   buffer is drained (half-close), and a connection is done when both
//!   ways are. Single-threaded is also what [`fork_monitor`] needs.
//! - **Starting** runs in a helper forked (double fork) from the proxy:
//!   the helper drops the listening socket, the open connections and the
//!   proxy's lock before it calls [`start_detached`], so the container's
//!   monitor (which is forked from whoever starts it and keeps running)
//!   never holds a copy of them: the port is freed and the proxy's lock
//!   dropped when the proxy ends, whatever the container does. While a
//!   container starts or stops, new connections wait in the listen backlog.
//! - **Readiness.** After `start_detached` the proxy connects to
//!   `127.0.0.1:CTRPORT` every millisecond until it accepts (deadline
//!   [`READY_TIMEOUT`]); that first connection is the first client's
//!   upstream.
//! - **Idle stop.** When the container runs, no connection is open and
//!   none came for `--idle-stop`, the proxy calls [`lifecycle::stop`]
//!   (the image's StopSignal, SIGKILL after `--stop-timeout`) and goes back
//!   to waiting. A container that ends by itself is noticed (its record
//!   is gone: listen containers are `--rm`) and started again on demand.
//!
//! # State
//!
//! ```text
//! <root>/listeners/    mode 0700 (the store is private)
//! ├── <id>/            64 hex digits
//! │   ├── lock         flock'ed by the proxy for its whole life
//! │   ├── listen.json  ListenState (tmp + rename), mode 0600
//! │   ├── stop         written by `cairn stop` before it signals the proxy
//! │   └── proxy.log    the proxy's own messages, mode 0600
//! └── names/<name> → <id>
//! ```
//!
//! The containers a listener starts get the listener's name (so `cairn
//! exec NAME`, `cairn logs NAME` reach the running one) and are `--rm`.
//! `cairn stop NAME` / `cairn container rm NAME` find the listener first:
//! [`stop_listener`] asks the proxy to end (SIGTERM); the proxy closes the
//! socket, stops its container and removes its directory. A listener whose
//! lock is free was abandoned (the proxy was killed): [`reap_listeners`]
//! stops its container and removes it.
//!
//! [`fork_monitor`]: crate::sys::fork_monitor
//! [`start_detached`]: crate::start_detached
//! [`lifecycle::stop`]: crate::lifecycle::stop

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};

use crate::container::{start_detached, RunSpec};
use crate::spec::Network;
use crate::state::open_lock;
use crate::state::{self, Paths};
use crate::sys::{fork_monitor, Forked, SignalFd};
use crate::RunError;

/// How long the proxy waits for CTRPORT to accept after a start.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes buffered per direction of a connection.
const BUF: usize = 64 << 10;

const SIGNALS: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// What `cairn run -d --listen` was asked for.
#[derive(Debug, Clone)]
pub struct ListenSpec {
    /// The container; its network must be host.
    pub run: RunSpec,
    /// Where the proxy listens.
    pub host: SocketAddr,
    /// Where the container serves (on 127.0.0.1, the host's loopback).
    pub container_port: u16,
    /// Stop the container after this long without connections (`None`:
    /// keep it running until the listener is stopped).
    pub idle_stop: Option<Duration>,
    /// How long a stop waits after the StopSignal before SIGKILL.
    pub stop_timeout: Duration,
}

/// Where a listener is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ListenStatus {
    /// Listening, no container.
    Waiting,
    /// Starting the container for a connection.
    Starting,
    /// The container runs and connections are forwarded.
    Active,
    /// Stopping the container (idle, or the listener ends).
    Stopping,
}

/// `listen.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListenState {
    pub id: String,
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    /// HOSTADDR:HOSTPORT.
    pub listen: String,
    pub container_port: u16,
    pub idle_stop_ms: Option<u64>,
    pub stop_timeout_ms: u64,
    pub created: u64,
    pub proxy_pid: Option<i32>,
    pub status: ListenStatus,
    /// The running container's id.
    pub container: Option<String>,
    /// How many times a container was started.
    pub starts: u64,
    /// Connections accepted.
    pub connections: u64,
    pub last_error: Option<String>,
}

/// A started listener.
#[derive(Debug, Clone, Serialize)]
pub struct Listening {
    pub id: String,
    pub name: String,
    pub listen: String,
}

/// `<root>/listeners`.
pub fn listeners_dir(paths: &Paths) -> PathBuf {
    paths.root().join("listeners")
}

fn names_dir(paths: &Paths) -> PathBuf {
    listeners_dir(paths).join("names")
}

/// Parses `[HOSTADDR:]HOSTPORT:CTRPORT` (HOSTADDR defaults to 127.0.0.1;
/// an IPv6 address goes in brackets).
pub fn parse_listen(s: &str) -> Result<(SocketAddr, u16), String> {
    let bad = || format!("invalid --listen {s:?}: expected [HOSTADDR:]HOSTPORT:CTRPORT");
    let mut parts = s.rsplitn(3, ':');
    let ctr = parts.next().ok_or_else(bad)?;
    let host_port = parts.next().ok_or_else(bad)?;
    let addr = parts.next().unwrap_or("127.0.0.1");
    let port = |p: &str| p.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(bad);
    let (host_port, ctr) = (port(host_port)?, port(ctr)?);
    let ip: IpAddr = addr
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .map_err(|_| bad())?;
    if host_port == ctr {
        return Err(format!(
            "--listen {s}: HOSTPORT and CTRPORT must differ: a listen container shares the \
             host's network, so its server on port {ctr} would collide with cairn's socket"
        ));
    }
    Ok((SocketAddr::new(ip, host_port), ctr))
}

/// Parses `500ms`, `30s`, `5m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: use e.g. 500ms, 30s, 5m"))?;
    let ms = match unit {
        "ms" => Some(n),
        "" | "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => None,
    }
    .ok_or_else(|| format!("invalid duration {s:?}: use e.g. 500ms, 30s, 5m"))?;
    Ok(Duration::from_millis(ms))
}

fn io_err(what: &str, path: &Path, e: io::Error) -> RunError {
    RunError::io(what, path, e)
}

fn write_state(dir: &Path, st: &ListenState) -> Result<(), RunError> {
    let path = dir.join("listen.json");
    let tmp = dir.join(".listen.json.tmp");
    let data = serde_json::to_vec_pretty(st).expect("listen state serializes");
    state::write_private(&tmp, &data)
        .and_then(|()| fs::rename(&tmp, &path))
        .map_err(|e| io_err("writing", &path, e))
}

fn read_state(dir: &Path) -> Option<ListenState> {
    serde_json::from_slice(&fs::read(dir.join("listen.json")).ok()?).ok()
}

/// Takes a listener's lock if its proxy is gone.
fn try_lock(dir: &Path) -> Option<File> {
    let f = File::open(dir.join("lock")).ok()?;
    flock(&f, FlockOperation::NonBlockingLockExclusive)
        .ok()
        .map(|()| f)
}

fn is_id(s: &str) -> bool {
    state::is_id(s)
}

fn release_name(paths: &Paths, name: &str, id: &str) {
    let link = names_dir(paths).join(name);
    if fs::read_link(&link).is_ok_and(|o| o == Path::new(id)) {
        let _ = fs::remove_file(&link);
    }
}

/// Tears down an abandoned listener (its lock is held by the caller):
/// stops its container, releases its name, removes its directory.
fn cleanup(paths: &Paths, dir: &Path, st: Option<&ListenState>, timeout: Duration) {
    if let Some(st) = st {
        // The container: by the recorded id, or (started but not yet
        // recorded when the proxy died) by the name it was given.
        let ctr = st
            .container
            .clone()
            .filter(|c| paths.container(c).exists())
            .or_else(|| {
                let owner = fs::read_link(paths.names().join(&st.name)).ok()?;
                let owner = owner.to_str()?.to_string();
                let s = state::read_state(&paths.container(&owner)).ok()??;
                (s.image == st.image && s.detached && s.remove).then_some(owner)
            });
        if let Some(c) = ctr {
            if let Err(e) = crate::lifecycle::stop(paths, &c, timeout) {
                tracing::warn!("stopping container {c} of listener {}: {e}", st.name);
            }
        }
        release_name(paths, &st.name, &st.id);
    }
    let _ = fs::remove_dir_all(dir);
}

/// Removes listeners whose proxy is gone (stopping their containers).
pub fn reap_listeners(paths: &Paths) -> usize {
    let mut n = 0;
    let Ok(rd) = fs::read_dir(listeners_dir(paths)) else {
        return 0;
    };
    for e in rd.flatten() {
        let Some(id) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !is_id(&id) {
            continue;
        }
        let dir = e.path();
        let Some(lock) = try_lock(&dir) else { continue };
        let st = read_state(&dir);
        if st.is_none() {
            // Being created right now, or debris of a launcher that died.
            let old = fs::metadata(&dir)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|a| a > Duration::from_secs(60));
            if !old {
                continue;
            }
        }
        let timeout = st
            .as_ref()
            .map_or(Duration::ZERO, |s| Duration::from_millis(s.stop_timeout_ms));
        cleanup(paths, &dir, st.as_ref(), timeout);
        drop(lock);
        n += 1;
    }
    // Names whose listener is gone.
    for e in fs::read_dir(names_dir(paths))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(target) = fs::read_link(e.path()) {
            if !listeners_dir(paths).join(&target).exists() {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    n
}

/// All live listeners (abandoned ones reaped first).
pub fn list_listeners(paths: &Paths) -> Result<Vec<ListenState>, RunError> {
    reap_listeners(paths);
    let mut out: Vec<ListenState> = match fs::read_dir(listeners_dir(paths)) {
        Ok(rd) => rd
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_id))
            .filter_map(|e| read_state(&e.path()))
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_err("listing", &listeners_dir(paths), e)),
    };
    out.sort_by(|a, b| b.created.cmp(&a.created).then(a.id.cmp(&b.id)));
    Ok(out)
}

/// The id of the listener `what` names (name, id or unique id prefix), if any.
pub fn lookup_listener(paths: &Paths, what: &str) -> Option<String> {
    if state::validate_name(what).is_ok() {
        if let Ok(t) = fs::read_link(names_dir(paths).join(what)) {
            if let Some(id) = t.to_str() {
                if listeners_dir(paths).join(id).is_dir() {
                    return Some(id.to_string());
                }
            }
        }
    }
    if what.len() < 4 {
        return None;
    }
    let mut found = fs::read_dir(listeners_dir(paths))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|id| is_id(id) && id.starts_with(what));
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// Ends listener `id`: the proxy closes its socket and stops its
/// container (SIGKILL after `timeout`). Returns once it is gone.
pub fn stop_listener(paths: &Paths, id: &str, timeout: Duration) -> Result<ListenState, RunError> {
    let dir = listeners_dir(paths).join(id);
    let st = read_state(&dir).ok_or_else(|| RunError::NoSuchContainer(id.to_string()))?;
    if let Some(lock) = try_lock(&dir) {
        // No proxy: clean up here.
        cleanup(paths, &dir, Some(&st), timeout);
        drop(lock);
        return Ok(st);
    }
    let req = dir.join("stop");
    fs::write(&req, timeout.as_millis().to_string()).map_err(|e| io_err("writing", &req, e))?;
    if let Some(pid) = st.proxy_pid.and_then(rustix::process::Pid::from_raw) {
        // The lock is held, so the recorded pid is the live proxy's.
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + timeout + Duration::from_secs(30);
    loop {
        if !dir.exists() {
            return Ok(st);
        }
        if let Some(lock) = try_lock(&dir) {
            cleanup(paths, &dir, read_state(&dir).as_ref(), timeout);
            drop(lock);
            return Ok(st);
        }
        if Instant::now() > deadline {
            return Err(RunError::Crun(format!(
                "the proxy of listener {} did not end",
                st.name
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Starts a listener: binds the socket here (so a busy port is an error
/// of this call), then forks the proxy and returns once it runs.
/// The caller must be single-threaded.
pub fn start_listener(paths: &Paths, spec: &ListenSpec) -> Result<Listening, RunError> {
    if spec.run.network != Network::Host {
        return Err(RunError::Invalid(
            "--listen needs --network host: cairn reaches the container on the host's loopback"
                .into(),
        ));
    }
    if spec.run.tty || spec.run.interactive {
        return Err(RunError::Invalid(
            "--listen containers have no terminal or stdin (-t, -i)".into(),
        ));
    }
    if spec.host.port() == spec.container_port {
        return Err(RunError::Invalid(
            "--listen: HOSTPORT and CTRPORT must differ".into(),
        ));
    }
    if spec.run.keep {
        return Err(RunError::Invalid(
            "--listen containers are removed when idle; --keep is not supported".into(),
        ));
    }
    reap_listeners(paths);
    let id = state::new_id();
    let name = spec
        .run
        .name
        .clone()
        .unwrap_or_else(|| id[..12].to_string());
    state::validate_name(&name)?;
    if let Ok(owner) = fs::read_link(paths.names().join(&name)) {
        if paths.container(&owner.to_string_lossy()).exists() {
            return Err(RunError::Invalid(format!(
                "the name {name:?} is in use by container {}",
                owner.display()
            )));
        }
    }
    // Check the image before forking anything (errors show here, not in
    // the proxy's log at the first connection).
    let store = cairn_store::Store::open(paths.root())?;
    store.make_private_or_warn();
    let resolved = store.resolve_image(&spec.run.image)?;
    if resolved.digest.is_none() {
        return Err(RunError::Invalid(format!(
            "{} is an image file, not an image in the store",
            spec.run.image
        )));
    }
    drop(store);

    let base = listeners_dir(paths);
    cairn_store::create_private_dir(&base, false).map_err(|e| io_err("creating", &base, e))?;
    let names = names_dir(paths);
    fs::create_dir_all(&names).map_err(|e| io_err("creating", &names, e))?;
    let dir = base.join(&id);
    fs::create_dir(&dir).map_err(|e| io_err("creating", &dir, e))?;
    let lock = open_lock(&dir)?;
    flock(&lock, FlockOperation::LockExclusive)
        .map_err(|e| io_err("locking", &dir.join("lock"), e.into()))?;
    let fail = |e: RunError| -> RunError {
        let _ = fs::remove_dir_all(&dir);
        e
    };
    let link = names.join(&name);
    if let Err(e) = std::os::unix::fs::symlink(&id, &link) {
        let msg = if e.kind() == io::ErrorKind::AlreadyExists {
            RunError::Invalid(format!("the name {name:?} is in use by a listener"))
        } else {
            io_err("creating", &link, e)
        };
        return Err(fail(msg));
    }
    let fail = |e: RunError| -> RunError {
        release_name(paths, &name, &id);
        let _ = fs::remove_dir_all(&dir);
        e
    };
    let listener = TcpListener::bind(spec.host).map_err(|e| {
        fail(RunError::Invalid(format!(
            "--listen: binding {}: {e}",
            spec.host
        )))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(io_err("setting up the socket of", &dir, e)))?;
    let st = ListenState {
        id: id.clone(),
        name: name.clone(),
        image: spec.run.image.clone(),
        command: spec.run.command.clone(),
        listen: spec.host.to_string(),
        container_port: spec.container_port,
        idle_stop_ms: spec.idle_stop.map(|d| d.as_millis() as u64),
        stop_timeout_ms: spec.stop_timeout.as_millis() as u64,
        created: state::now(),
        proxy_pid: None,
        status: ListenStatus::Waiting,
        container: None,
        starts: 0,
        connections: 0,
        last_error: None,
    };
    write_state(&dir, &st).map_err(fail)?;
    let (mut client, proxy_end) =
        UnixStream::pair().map_err(|e| fail(io_err("creating socketpair in", &dir, e)))?;
    match fork_monitor() {
        Err(e) => Err(fail(io_err("forking the proxy for", &dir, e))),
        Ok(Forked::Monitor) => {
            drop(client);
            let mut spec = spec.clone();
            spec.run.name = Some(name);
            spec.run.detach = true;
            spec.run.remove = true;
            let proxy = Proxy {
                paths: paths.clone(),
                dir,
                spec,
                st,
                lock: Some(lock),
                listener: Some(listener),
                signals: None,
                conns: Vec::new(),
                idle_since: Instant::now(),
            };
            proxy.main(proxy_end)
        }
        Ok(Forked::Parent) => {
            drop(proxy_end);
            drop(listener);
            drop(lock);
            let mut line = String::new();
            let _ = BufReader::new(&mut client).read_line(&mut line);
            if line.trim() == "ready" {
                Ok(Listening {
                    id,
                    name,
                    listen: spec.host.to_string(),
                })
            } else {
                Err(RunError::Crun(format!(
                    "the proxy did not start: {}",
                    line.trim().trim_start_matches("error ")
                )))
            }
        }
    }
}

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

/// The proxy process.
struct Proxy {
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
    fn save(&self) {
        if let Err(e) = write_state(&self.dir, &self.st) {
            log(&e.to_string());
        }
    }

    fn main(mut self, sock: UnixStream) -> ! {
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
    fn parses_listen_addresses() {
        let (a, p) = parse_listen("127.0.0.1:8080:80").unwrap();
        assert_eq!((a.to_string().as_str(), p), ("127.0.0.1:8080", 80));
        let (a, p) = parse_listen("9000:90").unwrap();
        assert_eq!((a.to_string().as_str(), p), ("127.0.0.1:9000", 90));
        let (a, _) = parse_listen("[::1]:9000:90").unwrap();
        assert_eq!(a.to_string(), "[::1]:9000");
        assert!(parse_listen("127.0.0.1:80:80").is_err());
        assert!(parse_listen("80").is_err());
        assert!(parse_listen("x:1:2").is_err());
        assert!(parse_listen("1:0").is_err());
    }

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("ms").is_err());
    }

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
