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

//!
//! The module is cut in three: this one (the request and the start),
//! [`record`] (a listener's directory, its state file and name, and the
//! commands that read or end them) and `proxy` (the proxy process's loop).

mod proxy;
pub mod record;

use std::fs;
use std::io::{self, BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::fs::{flock, FlockOperation};

use crate::container::RunSpec;
use crate::spec::Network;
use crate::state::{self, open_lock, Paths};
use crate::sys::{fork_monitor, Forked};
use crate::RunError;

use proxy::Proxy;
use record::{io_err, names_dir, release_name, write_state};
pub use record::{
    list_listeners, listeners_dir, lookup_listener, reap_listeners, stop_listener, ListenState,
    ListenStatus, Listening,
};

/// How long the proxy waits for CTRPORT to accept after a start.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

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

/// Starts a listener: binds the socket here (so a busy port is an error
/// of this call), then forks the proxy and returns once it runs.
/// Fails if the caller has more than one thread (see `sys::fork_monitor`).
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
            let proxy = Proxy::new(paths.clone(), dir, spec, st, lock, listener);
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
}
