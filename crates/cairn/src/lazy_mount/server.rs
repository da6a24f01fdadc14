//! The lazy layer's server process: the supervisor that `cairn mount
//! --lazy` forks, which holds the `/dev/fuse` connection and the journal,
//! and the workers it forks (or, after an upgrade, execs as `cairn lazy
//! worker`) to serve; a worker that dies by a signal gets a successor that
//! goes on serving the same connection (docs/lazy-fuse.md, "Surviving the
//! server").

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cairn_fuse::{ObjectSource, ServeOptions};
use cairn_store::{ObjectId, Store};

use super::background::{background, write_prefetch};
use super::{LazyArgs, LazyFetch, Remote, RemoteSource, BACKGROUND_JOBS, START_FILES};
use crate::log::logline;

/// The server child's standard streams: /dev/null, and its log.
pub(super) struct Detached {
    pub(super) devnull: fs::File,
    pub(super) log: fs::File,
}

/// What the server was asked to do.
pub(super) struct Settings {
    pub(super) lazy: LazyArgs,
    pub(super) client: cairn_oci::ClientOptions,
}

/// What a worker serves, kept by the supervisor for each successor.
pub(super) struct Served {
    /// Taken by each worker (a fork: the supervisor's copy stays).
    pub(super) store: Option<Store>,
    pub(super) remote: Option<Remote>,
    /// The FUSE mountpoint (detached once the overlay stands on it).
    pub(super) dir: PathBuf,
    pub(super) log_path: PathBuf,
    /// `<store>/lazy/<name>.pid`: who serves (`cairn lazy list`).
    pub(super) pid_path: PathBuf,
    pub(super) digest: String,
    pub(super) settings: Settings,
    /// The image's objects (node ids) and the state that survives a
    /// worker (a memfd).
    pub(super) journal: cairn_fuse::Resumable,
    /// The objects the background fetch takes first, ahead of the prefetch
    /// list: those of [`START_FILES`] in the image.
    pub(super) first: Vec<ObjectId>,
    /// The connection: the supervisor's descriptor keeps it alive while
    /// no worker runs.
    pub(super) device: OwnedFd,
    /// The socket on which `cairn mount` tells that the overlay is attached
    /// (one byte) or that it failed (closed without a word).
    pub(super) attached: Option<fs::File>,
    /// The `cairn` binary the mount was started from: successors run
    /// what is at this path then (an upgrade), if it starts.
    pub(super) exe: Option<PathBuf>,
}

/// How a worker starts.
pub(super) enum Start {
    /// The first: it mounts the layer and says "ready" on this pipe.
    First { ready: fs::File },
    /// A successor of a worker that died: it goes on serving the
    /// connection with the journal.
    Successor,
}

/// The journal's marks (`Resumable::set_mark`): what the workers so far
/// have done, for a successor to know where to go on.
mod mark {
    /// The layer is mounted and "ready" was said: a worker that dies from
    /// now on gets a successor.
    pub const READY: u8 = 0;
    /// `cairn mount` told that the overlay is attached.
    pub const TOLD: u8 = 1;
    /// The FUSE mount is detached (the overlay alone holds it).
    pub const DETACHED: u8 = 2;
}

/// The exit status of `cairn lazy worker` when it could not take over
/// (its binary cannot read what it was given): the supervisor then starts
/// a fork of itself instead.
pub(super) const EXIT_CANNOT_RESUME: i32 = 3;

/// A worker that lives at least this long resets the back-off.
const STABLE: Duration = Duration::from_secs(10);
/// Quick deaths in a row after which the supervisor gives up (and the
/// connection ends: opens of the overlay then fail with ENOTCONN).
const MAX_QUICK_DEATHS: u32 = 8;

/// The supervisor: the process `cairn mount` forks. It holds the
/// `/dev/fuse` descriptor and the journal, forks the worker that serves,
/// and forks a successor when a worker dies by a signal (killed, or
/// restarted with `cairn lazy restart`) while the connection lives, after
/// a back-off if it died quickly. It has one thread, reads nothing from
/// anyone, and ends when a worker ends by itself (the connection ended, or
/// the start was refused). Returns its exit status.
pub(super) fn supervise(
    mut served: Served,
    streams: Detached,
    ready: fs::File,
    attached: fs::File,
) -> i32 {
    // Kept for successors: a worker that dies before it is told that the
    // overlay is attached leaves the telling to its successor.
    served.attached = Some(attached);
    // Out of `cairn mount`'s session and away from its terminal and pipes
    // (whoever reads its output must not wait for this process).
    // SAFETY: plain system calls on descriptors this process owns.
    unsafe {
        libc::setsid();
        libc::dup2(streams.devnull.as_raw_fd(), 0);
        libc::dup2(streams.devnull.as_raw_fd(), 1);
        libc::dup2(streams.log.as_raw_fd(), 2);
    }
    drop(streams);
    crate::log::as_daemon();
    let digest = served.digest.clone();
    let mut start = Some(Start::First { ready });
    let mut restarts = 0u32;
    let mut quick = 0u32;
    let mut delay = Duration::from_millis(100);
    // Successors exec `served.exe` until one of them cannot start there.
    let mut exec_allowed = true;
    let code = loop {
        let began = std::time::Instant::now();
        // SAFETY: this process has one thread (it was forked from one that
        // had, and starts none), so the child is a whole copy of it; the
        // child never returns into this loop (it ends in `exit`).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            logline!(
                "cairn lazy layer for image {digest}: forking a worker: {}",
                io::Error::last_os_error()
            );
            break 1;
        }
        if pid == 0 {
            let start = start.take().unwrap_or(Start::Successor);
            if matches!(start, Start::Successor) && exec_allowed {
                if let Some(exe) = served.exe.clone() {
                    let e = exec_worker(&served, &exe);
                    // Descriptors 3 to 6 may have been replaced: this
                    // process cannot serve; the supervisor starts a fork
                    // of itself instead.
                    logline!(
                        "cairn lazy layer for image {digest}: running {} as the successor: {e}",
                        exe.display()
                    );
                    std::process::exit(EXIT_CANNOT_RESUME);
                }
            }
            let code = worker(&mut served, start);
            std::process::exit(code);
        }
        // The first worker's pipes are its own: `cairn mount` reads until
        // every write end is closed.
        start = None;
        write_status(&served.pid_path, pid, &digest, restarts);
        let status = loop {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            if r == pid {
                break status;
            }
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break 0;
            }
        };
        if libc::WIFEXITED(status) {
            if libc::WEXITSTATUS(status) == EXIT_CANNOT_RESUME && exec_allowed && restarts > 0 {
                logline!(
                    "cairn lazy layer for image {digest}: the successor could not start from \
                     the binary; successors are forks of this process from now on"
                );
                exec_allowed = false;
                continue;
            }
            break libc::WEXITSTATUS(status);
        }
        let signal = if libc::WIFSIGNALED(status) {
            libc::WTERMSIG(status)
        } else {
            0
        };
        if !served.journal.marked(mark::READY) {
            logline!(
                "cairn lazy layer for image {digest}: the worker died (signal {signal}) before \
                 the overlay was attached"
            );
            break 1;
        }
        if connection_ended(&served.device, Duration::ZERO) {
            break 0;
        }
        if began.elapsed() < STABLE {
            quick += 1;
            if quick > MAX_QUICK_DEATHS {
                logline!(
                    "cairn lazy layer for image {digest}: {quick} workers died within \
                     {STABLE:?} of their start; giving up (the layer's connection ends)"
                );
                break 1;
            }
        } else {
            quick = 0;
            delay = Duration::from_millis(100);
        }
        let wait = if quick > 1 { delay } else { Duration::ZERO };
        logline!(
            "cairn lazy layer for image {digest}: worker {pid} died (signal {signal}); \
             starting a successor in {wait:?}"
        );
        if quick > 1 {
            delay = (delay * 2).min(Duration::from_secs(30));
        }
        if connection_ended(&served.device, wait) {
            break 0;
        }
        restarts += 1;
    };
    let _ = fs::remove_file(&served.pid_path);
    if code == 0 {
        let _ = fs::remove_file(&served.log_path);
    }
    let _ = fs::remove_dir(&served.dir);
    code
}

/// Whether the kernel ended the connection (the overlay is gone), waiting
/// up to `wait` for it.
fn connection_ended(device: &OwnedFd, wait: Duration) -> bool {
    let mut fds = [libc::pollfd {
        fd: device.as_raw_fd(),
        events: 0,
        revents: 0,
    }];
    let ms = wait.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one pollfd, of a descriptor this process owns.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
    r > 0 && fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
}

/// Writes `<name>.pid`: the supervisor, its worker, the image, how many
/// times the worker was restarted (atomically: a file renamed over it).
fn write_status(path: &Path, worker: i32, digest: &str, restarts: u32) {
    let text = format!(
        "supervisor {}\nworker {worker}\nimage {digest}\nrestarts {restarts}\n",
        std::process::id()
    );
    let tmp = path.with_extension("pid-tmp");
    if let Err(e) = fs::write(&tmp, text).and_then(|()| fs::rename(&tmp, path)) {
        logline!("cairn lazy layer: writing {}: {e}", path.display());
    }
}

/// A worker process: serves the layer until the kernel ends the
/// connection. Returns its exit status: 0 (done, no fetch failed), 2
/// (done, some fetch failed: the log stays), 1 (could not serve).
fn worker(served: &mut Served, start: Start) -> i32 {
    let Some(store) = served.store.take() else {
        return 1;
    };
    let remote = served.remote.take();
    let digest = served.digest.as_str();
    let dir = served.dir.as_path();
    let settings = &served.settings;
    let options = ServeOptions {
        source_name: format!("cairn-lazy:{digest}"),
        fetch_timeout: settings.lazy.fetch_timeout,
        max_background_fetches: BACKGROUND_JOBS,
        record_opens: settings.lazy.record_prefetch.is_some(),
        // The pieces `cairn push` cuts large objects into: the recorded
        // list names which of them a large file's reads touched.
        record_chunk_size: u64::from(cairn_remote::index::CHUNK_SIZE),
        resumable: Some(served.journal.clone()),
        passthrough: !settings.lazy.no_passthrough,
        ..ServeOptions::default()
    };
    let device = match served.device.try_clone() {
        Ok(d) => d,
        Err(e) => {
            logline!(
                "cairn lazy layer {}: duplicating /dev/fuse: {e}",
                dir.display()
            );
            return 1;
        }
    };
    let store = Arc::new(store);
    // No lazy source (a successor that found the image complete): every
    // object is local.
    let remote = remote.map(|remote| {
        Arc::new(RemoteSource {
            remote,
            coalesce: settings.lazy.coalesce,
            listed: std::sync::OnceLock::new(),
            start: served.first.iter().copied().collect(),
        })
    });
    let source: Arc<dyn ObjectSource> = match &remote {
        Some(r) => r.clone(),
        None => Arc::new(cairn_fuse::NoSource),
    };
    let journal = served.journal.clone();
    let mut mount = match start {
        Start::First { mut ready } => {
            match cairn_fuse::serve_on(device, store.clone(), source.clone(), dir, options) {
                Ok(m) => {
                    journal.set_mark(mark::READY);
                    let _ = ready.write_all(b"ready");
                    m
                }
                Err(e) => {
                    let _ = write!(ready, "error: {e}");
                    logline!("cairn lazy layer {}: {e}", dir.display());
                    return 1;
                }
            }
        }
        Start::Successor => {
            // A predecessor killed between detaching the layer and marking
            // it leaves the mark unset: the mount table says. (Not a stat
            // of `dir`: it would ask this very server, not serving yet.)
            let mounted = !journal.marked(mark::DETACHED)
                && cairn_mount::mount_table()
                    .map(|t| t.iter().any(|m| m.mount_point == dir))
                    .unwrap_or(true);
            match cairn_fuse::resume(device, store.clone(), source.clone(), dir, mounted, options) {
                Ok(m) => {
                    logline!(
                        "cairn lazy layer for image {digest}: worker {} serves on",
                        std::process::id()
                    );
                    m
                }
                Err(e) => {
                    logline!("cairn lazy layer for image {digest}: resuming: {e}");
                    return 1;
                }
            }
        }
    };
    // The start files (`/etc/passwd`, `/etc/group`: containerd reads them
    // through the rootfs before it creates the task) from the moment the
    // layer serves, before the overlay on it is attached and long before
    // the background fetch has the prefetch list: one small request.
    if let Some(source) = &remote {
        let bg = mount.background();
        for id in &served.first {
            if !source.local_id(id).is_some_and(|l| store.has_object(&l)) {
                bg.start(id);
            }
        }
    }
    // A v2 list's chunk entries, at once: a foreground `cairn run` tells
    // the server that the overlay is attached only when its container has
    // exited, and the start's opens must find these partials (else an
    // open starts an ordinary one, which fetches the whole object). The
    // list phase below finds them started. (Only a v2 list has any: no
    // second fetch of a v1 list.)
    let v2 = matches!(remote.as_ref().map(|s| &s.remote), Some(Remote::Artifact(r)) if r.prefetch_names_chunks());
    if v2 {
        let (source, bg) = (remote.clone().expect("checked"), mount.background());
        let all = settings.lazy.fetch() == LazyFetch::Background;
        let spawned = std::thread::Builder::new()
            .name("cairn-list-chunks".into())
            .spawn(move || {
                if let Remote::Artifact(r) = &source.remote {
                    for e in r.prefetch_entries().unwrap_or_default() {
                        if let Some(c) = e.chunks {
                            bg.prefetch_chunks(&e.id, &c, all);
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            logline!("cairn lazy layer for image {digest}: no early chunk fetch: {e}");
        }
    }
    let told = journal.marked(mark::TOLD) || {
        let mut byte = [0u8; 1];
        // Peeked, not read: the byte stays for a successor (see `start`).
        let told = match served.attached.as_ref() {
            Some(a) => loop {
                match rustix::net::recv(a, &mut byte, rustix::net::RecvFlags::PEEK) {
                    Err(rustix::io::Errno::INTR) => continue,
                    r => break matches!(r, Ok((1, _))),
                }
            },
            None => false,
        };
        if told {
            journal.set_mark(mark::TOLD);
        }
        told
    };
    served.attached = None;
    let open_log = mount.open_log();
    let record = settings.lazy.record_prefetch.clone();
    let result = if told {
        if let Some(source) = &remote {
            let bg = mount.background();
            let owned = digest.to_owned();
            let client = settings.client.clone();
            let all = settings.lazy.fetch() == LazyFetch::Background;
            let (store, source) = (store.clone(), source.clone());
            let first = served.first.clone();
            let spawned = std::thread::Builder::new()
                .name("cairn-background".into())
                .spawn(move || background(&store, &source, &bg, &owned, &client, &first, all));
            if let Err(e) = spawned {
                logline!("cairn lazy layer for image {digest}: no background fetch: {e}");
            }
        }
        let r = mount.detach().and_then(|()| {
            journal.set_mark(mark::DETACHED);
            mount.detach_and_serve()
        });
        let _ = fs::remove_dir(dir);
        r
    } else {
        let r = mount.unmount();
        let _ = fs::remove_dir(dir);
        r
    };
    if let (Some(file), true) = (&record, told) {
        match write_prefetch(&store, digest, &open_log.entries(), file) {
            Ok(n) => logline!(
                "cairn lazy layer for image {digest}: {n} opened paths written to {}",
                file.display()
            ),
            Err(e) => logline!("cairn lazy layer for image {digest}: {e:#}"),
        }
    }
    match result {
        Ok(stats) => {
            logline!("cairn lazy layer for image {digest}: done: {stats:?}");
            if stats.fetches_failed == 0 && stats.fetches_timed_out == 0 && stats.chunks_failed == 0
            {
                0
            } else {
                2
            }
        }
        Err(e) => {
            logline!("cairn lazy layer for image {digest}: {e}");
            1
        }
    }
}

/// What a successor that runs a new binary (`cairn lazy worker`) is told,
/// as JSON on descriptor 6; descriptors 3, 4 and 5 are the connection, the
/// journal and (if `attached`) the "attached" socket, and stderr is the log.
/// The format is between one cairn and the next: fields may be added.
#[derive(serde::Serialize, serde::Deserialize)]
struct WorkerSpec {
    root: PathBuf,
    digest: String,
    dir: PathBuf,
    attached: bool,
    on_demand: bool,
    fetch_timeout_ms: u64,
    coalesce: u64,
    record_prefetch: Option<PathBuf>,
    #[serde(default)]
    no_passthrough: bool,
    insecure: bool,
    connect_timeout_ms: u64,
    read_timeout_ms: u64,
    max_attempts: u32,
    backoff_ms: u64,
    max_backoff_ms: u64,
    auth_files: Vec<PathBuf>,
    credentials: Option<(String, String)>,
    user_agent: String,
}

/// Where `cairn lazy worker` finds what it is given.
const FD_DEVICE: i32 = 3;
const FD_JOURNAL: i32 = 4;
const FD_ATTACHED: i32 = 5;
const FD_SPEC: i32 = 6;

/// In a forked child of the supervisor: runs `exe lazy worker` with the
/// connection, the journal, the socket and the settings. Returns only if
/// that could not be done.
fn exec_worker(served: &Served, exe: &Path) -> io::Error {
    let Some(store) = served.store.as_ref() else {
        return io::Error::other("no store");
    };
    let s = &served.settings;
    let c = &s.client;
    let spec = WorkerSpec {
        root: store.root().to_path_buf(),
        digest: served.digest.clone(),
        dir: served.dir.clone(),
        attached: served.attached.is_some(),
        on_demand: s.lazy.fetch() == LazyFetch::OnDemand,
        fetch_timeout_ms: s.lazy.fetch_timeout.as_millis() as u64,
        coalesce: s.lazy.coalesce,
        record_prefetch: s.lazy.record_prefetch.clone(),
        no_passthrough: s.lazy.no_passthrough,
        insecure: c.insecure,
        connect_timeout_ms: c.connect_timeout.as_millis() as u64,
        read_timeout_ms: c.read_timeout.as_millis() as u64,
        max_attempts: c.max_attempts,
        backoff_ms: c.backoff.as_millis() as u64,
        max_backoff_ms: c.max_backoff.as_millis() as u64,
        auth_files: c.auth_files.clone(),
        credentials: c
            .credentials
            .as_ref()
            .map(|k| (k.username.clone(), k.password.clone())),
        user_agent: c.user_agent.clone(),
    };
    let spec_fd = match rustix::fs::memfd_create("cairn-lazy-spec", rustix::fs::MemfdFlags::CLOEXEC)
    {
        Ok(fd) => fd,
        Err(e) => return e.into(),
    };
    let mut spec_file = fs::File::from(spec_fd);
    let json = serde_json::to_vec(&spec).expect("a spec serializes");
    if let Err(e) = spec_file
        .write_all(&json)
        .and_then(|()| io::Seek::seek(&mut spec_file, io::SeekFrom::Start(0)).map(|_| ()))
    {
        return e;
    }
    let journal = served.journal.as_fd().as_raw_fd();
    let sources = [
        (served.device.as_raw_fd(), FD_DEVICE),
        (journal, FD_JOURNAL),
        (
            served.attached.as_ref().map_or(-1, |a| a.as_raw_fd()),
            FD_ATTACHED,
        ),
        (spec_file.as_raw_fd(), FD_SPEC),
    ];
    // First out of the way (above the targets), then into place: dup2
    // clears close-on-exec.
    let mut high = Vec::new();
    for (fd, _) in sources {
        if fd < 0 {
            high.push(-1);
            continue;
        }
        // SAFETY: a plain system call on a descriptor of this process.
        let h = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100) };
        if h < 0 {
            return io::Error::last_os_error();
        }
        high.push(h);
    }
    for (h, (_, target)) in high.iter().zip(sources) {
        // SAFETY: plain system calls on descriptors of this process.
        unsafe {
            if *h < 0 {
                libc::close(target);
            } else if libc::dup2(*h, target) < 0 {
                return io::Error::last_os_error();
            }
        }
    }
    use std::os::unix::process::CommandExt;
    // exec only returns on failure (and then this process exits).
    std::process::Command::new(exe)
        .arg0("cairn")
        .arg("--root")
        .arg(&spec.root)
        .args(["lazy", "worker"])
        .exec()
}

/// `cairn lazy worker`: a successor started by a supervisor, running
/// this binary (which may be newer than the supervisor's).
pub(super) fn lazy_worker() -> Result<i32> {
    use std::os::fd::FromRawFd;
    // SAFETY: the supervisor placed these descriptors before exec; nothing
    // else in this process owns them.
    let (device, journal_fd, spec_file) = unsafe {
        (
            OwnedFd::from_raw_fd(FD_DEVICE),
            OwnedFd::from_raw_fd(FD_JOURNAL),
            fs::File::from_raw_fd(FD_SPEC),
        )
    };
    let st = rustix::fs::fstat(&device).context("descriptor 3")?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::CharacterDevice {
        bail!("descriptor 3 is not /dev/fuse: `cairn lazy worker` is started by a lazy server");
    }
    let mut json = Vec::new();
    spec_file
        .take(1 << 20)
        .read_to_end(&mut json)
        .context("reading the worker's settings")?;
    let spec: WorkerSpec = serde_json::from_slice(&json).context("the worker's settings")?;
    // SAFETY: as above.
    let attached = spec
        .attached
        .then(|| unsafe { fs::File::from_raw_fd(FD_ATTACHED) });
    let store = Store::open(&spec.root)
        .with_context(|| format!("opening the store at {}", spec.root.display()))?;
    let (contents, first) = store
        .image_contents_at(&spec.digest, &START_FILES)
        .with_context(|| format!("reading image {}", spec.digest))?;
    let objects: Vec<ObjectId> = contents.objects.into_keys().collect();
    let journal =
        cairn_fuse::Resumable::open(journal_fd, objects).context("the lazy layer's journal")?;
    let fetch_timeout = Duration::from_millis(spec.fetch_timeout_ms.max(1));
    let client = cairn_oci::ClientOptions {
        insecure: spec.insecure,
        connect_timeout: Duration::from_millis(spec.connect_timeout_ms),
        read_timeout: Duration::from_millis(spec.read_timeout_ms),
        max_attempts: spec.max_attempts,
        backoff: Duration::from_millis(spec.backoff_ms),
        max_backoff: Duration::from_millis(spec.max_backoff_ms),
        auth_files: spec.auth_files.clone(),
        credentials: spec.credentials.clone().map(|(username, password)| {
            cairn_oci::auth::Credentials {
                username,
                password,
                source: None,
            }
        }),
        user_agent: spec.user_agent.clone(),
    };
    let mut server_client = client.clone();
    server_client.read_timeout = server_client.read_timeout.min(fetch_timeout);
    let remote = match Remote::open(&store, &spec.digest, &server_client) {
        Ok(r) => Some(r),
        Err(e) => {
            logline!(
                "cairn lazy layer for image {}: no lazy source ({e}); serving what is local",
                spec.digest
            );
            None
        }
    };
    let mut served = Served {
        store: Some(store),
        remote,
        dir: spec.dir,
        log_path: PathBuf::new(),
        pid_path: PathBuf::new(),
        digest: spec.digest,
        settings: Settings {
            lazy: LazyArgs {
                lazy_fetch: Some(if spec.on_demand {
                    LazyFetch::OnDemand
                } else {
                    LazyFetch::Background
                }),
                fetch_timeout,
                coalesce: spec.coalesce,
                record_prefetch: spec.record_prefetch,
                no_passthrough: spec.no_passthrough,
            },
            client,
        },
        journal,
        first: first.into_iter().flatten().collect(),
        device,
        attached,
        exe: None,
    };
    Ok(worker(&mut served, Start::Successor))
}
