//! `cairn mount --lazy`: an image pulled with `--lazy` mounted before all
//! of its objects are local.
//!
//! The overlay's data-only layer is then `cairn_fuse`'s FUSE filesystem
//! instead of the store's `objects/`: it passes local objects through to
//! the kernel and fetches missing ones from the image's lazy artifact
//! (`cairn_remote::RemoteObjects`), checks them and publishes them into the
//! store as it goes (docs/lazy-fuse.md, docs/lazy-format.md).
//!
//! The layer must be served for as long as the overlay exists, and `cairn
//! mount` returns once the overlay is attached, so the server is a process
//! of its own, forked before anything is mounted. It is two: a supervisor
//! (one thread) that holds the `/dev/fuse` connection and the journal
//! (`cairn_fuse::Resumable`), and a worker it forks, which serves; when a
//! worker dies by a signal while the connection lives, the supervisor forks
//! a successor that goes on serving the same connection, running the
//! `cairn` binary then on disk (`cairn lazy worker`; docs/lazy-fuse.md,
//! "Surviving the server"). The first worker:
//!
//! 1. the server mounts the FUSE layer at `<store>/lazy/<name>/` and says
//!    "ready" (or why not) through a pipe;
//! 2. `cairn mount` stacks and attaches the overlay on it, then tells the
//!    server through a socket pair; if anything fails, it closes its end
//!    without a word and the server unmounts the layer and exits;
//! 3. told, the server detaches the FUSE mount (it leaves the mount table;
//!    the overlay keeps it alive), removes its directory and serves until
//!    the kernel ends the connection, which it does when the overlay is
//!    unmounted (`cairn umount`, `umount`, anything): then it exits.
//!
//! Once serving, the server fetches in the background, in every mode, what
//! is missing of the image's prefetch list (the artifact's list, which
//! `cairn pull --lazy` fetches first unless `--no-prefetch` and the
//! snapshotter's remote path leaves out; or an eStargz image's files
//! before its prefetch landmarks), while the container starts. With `--lazy-fetch
//! background` (the default) every other object follows in pack order;
//! with `on-demand` nothing beyond the list and what is opened. Both go
//! through the layer's own fetcher (so an open of an object being fetched
//! joins that fetch, and opens never queue behind it), `BACKGROUND_JOBS`
//! at a time. A failure is logged and retried with backoff; when every
//! object is local the image is marked complete, as `cairn fetch` does.
//!
//! The server's log is `<store>/lazy/<name>.log`, removed when it exits
//! after serving without a failed fetch. The server holds no store lock
//! between fetches (each fetch takes it shared, as every writer does), so
//! gc can run meanwhile; the overlay's source names the image, so gc keeps
//! it and whatever it has fetched.

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use cairn_fuse::{FetchError, ObjectSource, ServeOptions};
use cairn_remote::{EstargzObjects, RemoteObjects};
use cairn_store::{ObjectId, StagedObject, Store};

/// What is fetched besides what is opened. The prefetch list is fetched
/// in the background once serving either way.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum LazyFetch {
    /// Fetch the prefetch list, then the rest of the image, in the background once serving.
    #[default]
    Background,
    /// Fetch the prefetch list in the background, otherwise only what is opened (with its neighbours).
    OnDemand,
}

/// The options of `--lazy` (mount and run).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct LazyArgs {
    /// With --lazy: once serving, fetch the image's prefetch list in the background, then the rest of the image in pack order (background), or nothing beyond the list and what is opened (on-demand).
    #[arg(long, value_enum, default_value = "background")]
    pub lazy_fetch: LazyFetch,
    /// With --lazy: an open of a missing file fails with EIO after this long without its data (e.g. 30s, 500ms, 2m; a bare number is seconds).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub fetch_timeout: Duration,
    /// With --lazy: a missing file is fetched together with the missing files after it in its pack, in one request of at most this many bytes (e.g. 1M, 256K; 0: alone).
    #[arg(long, default_value = "1M", value_parser = parse_bytes)]
    pub coalesce: u64,
    /// With --lazy: when the layer goes away (the container exited, the mount is gone), write the paths of the files that were opened, in first-open order, one a line, to FILE (for `cairn push --prefetch FILE`).
    #[arg(long, value_name = "FILE")]
    pub record_prefetch: Option<PathBuf>,
    /// With --lazy: serve every read through the FUSE layer instead of passing local files through to the store's (needed when another overlayfs is stacked on the mount, as containerd's containers are on `cairn snapshotter`'s: the kernel stacks at most two levels).
    #[arg(long)]
    pub no_passthrough: bool,
}

impl Default for LazyArgs {
    fn default() -> Self {
        LazyArgs {
            lazy_fetch: LazyFetch::Background,
            fetch_timeout: Duration::from_secs(30),
            coalesce: cairn_remote::DEFAULT_COALESCE,
            record_prefetch: None,
            no_passthrough: false,
        }
    }
}

/// A byte count: a plain number, or one with K, M or G.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(n) => Ok(n),
        Err(_) => crate::parse_size(s),
    }
}

/// `30s`, `500ms`, `2m`, `1h`, or a number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(at) => s.split_at(at),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (like 30s, 500ms, 2m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (ms, s, m, h)")),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 86_400.0 {
        return Err(format!("{s:?}: a duration from 1ms to 24h"));
    }
    Ok(Duration::from_secs_f64(secs.max(0.001)))
}

/// Background fetches in flight at once (each one range request, or a
/// chunked object's requests one after another).
const BACKGROUND_JOBS: usize = 2;

/// Where an incomplete image's objects come from: its cairn artifact, or
/// (an eStargz image pulled through its TOCs) its layer blobs.
enum Remote {
    Artifact(RemoteObjects),
    Estargz(EstargzObjects),
}

impl Remote {
    /// Opens the lazy source of the store's incomplete image `digest`.
    fn open(
        store: &Store,
        digest: &str,
        client: &cairn_oci::ClientOptions,
    ) -> Result<Remote, cairn_remote::RemoteError> {
        if EstargzObjects::is_estargz(store, digest) {
            EstargzObjects::open(store, digest, client).map(Remote::Estargz)
        } else {
            RemoteObjects::open(store, digest, client).map(Remote::Artifact)
        }
    }
}

/// The image's lazy source as the FUSE layer's source of objects: for a
/// cairn artifact, one object streamed whole, or a run of neighbours of
/// one pack in one range request of at most `coalesce` bytes; for an
/// eStargz image, a file chunk by chunk (each chunk checked against its
/// TOC digest), named by its sha256 and stored under its fs-verity digest.
struct RemoteSource {
    remote: Remote,
    coalesce: u64,
    /// The prefetch list's objects, once the background thread has it: a
    /// fetch of one of them takes along only listed neighbours, so that
    /// the list phase fetches the list and nothing else.
    listed: std::sync::OnceLock<std::collections::HashSet<ObjectId>>,
}

impl ObjectSource for RemoteSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        match &self.remote {
            Remote::Artifact(r) => r.size(id),
            Remote::Estargz(e) => e.size(id),
        }
    }

    fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), FetchError> {
        match &self.remote {
            Remote::Artifact(r) => r.fetch(id, out).map(|_| ()),
            Remote::Estargz(e) => e.fetch(id, out),
        }
        .map_err(|e| FetchError::Other(e.to_string()))
    }

    fn group(&self, store: &Store, id: &ObjectId) -> Vec<ObjectId> {
        match &self.remote {
            Remote::Artifact(r) if self.coalesce > 0 => {
                let mut group = r
                    .neighbours(store, id, self.coalesce)
                    .unwrap_or_else(|_| vec![*id]);
                if let Some(listed) = self.listed.get().filter(|l| l.contains(id)) {
                    // A run of the list (`cairn push` packs it first, in
                    // its order): up to the first object not on it.
                    let keep = group[1..]
                        .iter()
                        .position(|n| !listed.contains(n))
                        .map_or(group.len(), |p| p + 1);
                    group.truncate(keep);
                }
                group
            }
            _ => vec![*id],
        }
    }

    fn stage_group(
        &self,
        store: &Store,
        group: &[ObjectId],
    ) -> Option<Result<Vec<StagedObject>, FetchError>> {
        match &self.remote {
            Remote::Artifact(r) => Some(
                r.stage_run(store, group)
                    .map_err(|e| FetchError::Other(e.to_string())),
            ),
            Remote::Estargz(_) => None,
        }
    }

    fn chunks(&self, id: &ObjectId) -> Option<Vec<u64>> {
        match &self.remote {
            Remote::Artifact(r) => r.chunk_starts(id),
            Remote::Estargz(e) => e.chunk_starts(id),
        }
    }

    fn fetch_chunk(&self, id: &ObjectId, k: usize) -> Result<Vec<u8>, FetchError> {
        match &self.remote {
            Remote::Artifact(r) => match r.fetch_chunk(id, k) {
                Ok(Some(data)) => Ok(data),
                Ok(None) => Err(FetchError::Other(format!("object {id} has no chunk {k}"))),
                Err(e) => Err(FetchError::Other(e.to_string())),
            },
            Remote::Estargz(e) => e
                .fetch_chunk(id, k)
                .map_err(|e| FetchError::Other(e.to_string())),
        }
    }

    fn foreign_names(&self) -> bool {
        matches!(self.remote, Remote::Estargz(_))
    }

    fn local_id(&self, id: &ObjectId) -> Option<ObjectId> {
        match &self.remote {
            Remote::Artifact(_) => Some(*id),
            Remote::Estargz(e) => e.local_id(id),
        }
    }

    fn accept(&self, id: &ObjectId, sha256: &[u8; 32], stored: &ObjectId) -> Result<(), String> {
        match &self.remote {
            Remote::Artifact(_) => Err(format!("object {id}: named by its fs-verity digest")),
            Remote::Estargz(e) => e.accept(id, sha256, stored),
        }
    }
}

/// A FUSE data layer served by a process of its own, not yet told that
/// the overlay on it is attached. Dropped untold, the server unmounts the
/// layer and exits, and is waited for.
pub(crate) struct LazyLayer {
    dir: PathBuf,
    pid: libc::pid_t,
    attached: Option<fs::File>,
}

impl LazyLayer {
    /// Forks the server for the incomplete image `digest` of the store at
    /// `root` and waits until its layer is mounted (or it failed, with its
    /// reason). Must be called while this process has one thread.
    pub(crate) fn start(
        root: &Path,
        digest: &str,
        client: &cairn_oci::ClientOptions,
        lazy: &LazyArgs,
    ) -> Result<LazyLayer> {
        let store = Store::open(root)
            .with_context(|| format!("opening the store at {}", root.display()))?;
        // Opened (and its index checked) here, so that a broken source is
        // this command's error, not a line in the server's log.
        // A read that waits longer than an open may is of no use to the
        // open, and would keep its fetch slot: the server's requests give
        // up on an idle connection after `--fetch-timeout` at most.
        let mut server_client = client.clone();
        server_client.read_timeout = server_client.read_timeout.min(lazy.fetch_timeout);
        let remote = Remote::open(&store, digest, &server_client)
            .with_context(|| format!("opening the lazy source of image {digest}"))?;
        let mut lazy_args = lazy.clone();
        if let Some(f) = &lazy_args.record_prefetch {
            // The server may run anywhere: an absolute path.
            lazy_args.record_prefetch = Some(
                std::path::absolute(f)
                    .with_context(|| format!("the prefetch list path {}", f.display()))?,
            );
        }
        // The layer serves the image's objects and nothing else; their
        // sorted list gives each its node id, so that a successor of a
        // killed server answers for the same nodes (docs/lazy-fuse.md).
        let objects: Vec<ObjectId> = store
            .image_contents(digest)
            .with_context(|| format!("reading image {digest}"))?
            .objects
            .into_keys()
            .collect();
        let journal = cairn_fuse::Resumable::create(objects)
            .context("making the lazy layer's journal (memfd)")?;
        let device = cairn_fuse::open_device().context("the lazy data layer")?;
        // Everything that can refuse comes before anything is created, so a
        // refusal leaves nothing under lazy/.
        let devnull = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .context("opening /dev/null")?;
        let threads = threads().context("counting this process's threads")?;
        if threads != 1 {
            bail!("cannot fork the lazy layer's server: this process has {threads} threads");
        }
        let (ready_r, ready_w) = pipe()?;
        // A socket, not a pipe: a worker reads the byte with MSG_PEEK,
        // leaving it for a successor if it is killed before it marks the
        // journal (a pipe's byte, once read, would be gone, and the
        // successor would take the closed, empty pipe for a failure).
        let (attached_r, attached_w) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(io::Error::from)
        .context("making a socket pair for the lazy layer's server")?;
        let lazy = store.root().join("lazy");
        fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(&lazy)
            .with_context(|| format!("creating {}", lazy.display()))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("{}.{}.{nanos}", &digest[..12], std::process::id());
        let dir = lazy.join(&name);
        let log_path = lazy.join(format!("{name}.log"));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let log = match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&log_path)
        {
            Ok(l) => l,
            Err(e) => {
                let _ = fs::remove_dir(&dir);
                return Err(e).with_context(|| format!("creating {}", log_path.display()));
            }
        };
        // SAFETY: this process has one thread (checked above), so the
        // child is a whole copy of it and may do anything the parent could;
        // it never returns into the caller (it ends in `exit`).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let _ = fs::remove_dir(&dir);
            let _ = fs::remove_file(&log_path);
            return Err(io::Error::last_os_error()).context("forking the lazy layer's server");
        }
        if pid == 0 {
            drop(ready_r);
            drop(attached_w);
            let code = supervise(
                Served {
                    store: Some(store),
                    remote: Some(remote),
                    dir,
                    log_path,
                    pid_path: lazy.join(format!("{name}.pid")),
                    digest: digest.to_owned(),
                    settings: Settings {
                        lazy: lazy_args,
                        client: client.clone(),
                    },
                    journal,
                    device,
                    attached: None,
                    exe: fs::read_link("/proc/self/exe")
                        .ok()
                        .filter(|p| !p.to_string_lossy().ends_with(" (deleted)")),
                },
                Detached { devnull, log },
                fs::File::from(ready_w),
                fs::File::from(attached_r),
            );
            std::process::exit(code);
        }
        drop(ready_w);
        drop(attached_r);
        let mut said = String::new();
        let _ = fs::File::from(ready_r)
            .take(64 * 1024)
            .read_to_string(&mut said);
        let layer = LazyLayer {
            dir,
            pid,
            attached: Some(fs::File::from(attached_w)),
        };
        if said != "ready" {
            let why = said.strip_prefix("error: ").unwrap_or(&said).to_owned();
            drop(layer);
            bail!(
                "serving the lazy data layer: {}",
                if why.is_empty() {
                    format!("the server exited (see {})", log_path.display())
                } else {
                    why
                }
            );
        }
        Ok(layer)
    }

    /// The FUSE mountpoint: the overlay's data-only layer.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// The server's process id.
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Tells the server that the overlay is attached: from now on it serves
    /// until the overlay is gone.
    pub(crate) fn attached(mut self) -> Result<()> {
        let mut w = self.attached.take().expect("told once");
        w.write_all(b"1")
            .context("telling the lazy layer's server that the overlay is attached")
    }
}

impl Drop for LazyLayer {
    fn drop(&mut self) {
        if self.attached.take().is_some() {
            // Closed untold: the server unmounts its layer and exits.
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(self.pid, &mut status, 0) };
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

/// `cairn snapshotter`'s chain mounter for incomplete images: the
/// snapshotter is a multi-threaded process and cannot fork a lazy server
/// ([`LazyLayer::start`] needs one thread), so it runs `cairn mount --lazy`
/// of this very binary, which forks the server, mounts the image
/// read-only at the chain's directory and exits. The server belongs to no
/// snapshotter: it outlives a restart of it and goes when the chain mount
/// goes (docs/snapshotter.md, "The lazy remote path"). Reads are not passed
/// through: containerd stacks the container's overlay on the chain mount,
/// and the kernel stacks at most two levels.
pub(crate) struct ChainMounter {
    pub lazy_fetch: LazyFetch,
    pub fetch_timeout: Duration,
    pub coalesce: u64,
}

impl cairn_snapshotter::LazyMounter for ChainMounter {
    fn mount(&self, root: &Path, image: &str, target: &Path) -> Result<(), String> {
        let exe = fs::read_link("/proc/self/exe")
            .map_err(|e| format!("finding the cairn binary (/proc/self/exe): {e}"))?;
        let o = std::process::Command::new(&exe)
            .arg("--root")
            .arg(root)
            .args(["mount", "--lazy", "--no-passthrough", "--verity", "off"])
            .arg("--lazy-fetch")
            .arg(match self.lazy_fetch {
                LazyFetch::Background => "background",
                LazyFetch::OnDemand => "on-demand",
            })
            .arg("--fetch-timeout")
            .arg(format!("{}ms", self.fetch_timeout.as_millis()))
            .arg("--coalesce")
            .arg(self.coalesce.to_string())
            .arg(image)
            .arg(target)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| format!("running {} mount --lazy: {e}", exe.display()))?;
        if !o.status.success() {
            return Err(format!(
                "cairn mount --lazy ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Ok(())
    }
}

/// The server child's standard streams: /dev/null, and its log.
struct Detached {
    devnull: fs::File,
    log: fs::File,
}

/// What the server was asked to do.
struct Settings {
    lazy: LazyArgs,
    client: cairn_oci::ClientOptions,
}

/// What a worker serves, kept by the supervisor for each successor.
struct Served {
    /// Taken by each worker (a fork: the supervisor's copy stays).
    store: Option<Store>,
    remote: Option<Remote>,
    /// The FUSE mountpoint (detached once the overlay stands on it).
    dir: PathBuf,
    log_path: PathBuf,
    /// `<store>/lazy/<name>.pid`: who serves (`cairn lazy list`).
    pid_path: PathBuf,
    digest: String,
    settings: Settings,
    /// The image's objects (node ids) and the state that survives a
    /// worker (a memfd).
    journal: cairn_fuse::Resumable,
    /// The connection: the supervisor's descriptor keeps it alive while
    /// no worker runs.
    device: OwnedFd,
    /// The socket on which `cairn mount` tells that the overlay is attached
    /// (one byte) or that it failed (closed without a word).
    attached: Option<fs::File>,
    /// The `cairn` binary the mount was started from: successors run
    /// what is at this path then (an upgrade), if it starts.
    exe: Option<PathBuf>,
}

/// How a worker starts.
enum Start {
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
const EXIT_CANNOT_RESUME: i32 = 3;

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
fn supervise(mut served: Served, streams: Detached, ready: fs::File, attached: fs::File) -> i32 {
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
            eprintln!(
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
                    eprintln!(
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
                eprintln!(
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
            eprintln!(
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
                eprintln!(
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
        eprintln!(
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
        eprintln!("cairn lazy layer: writing {}: {e}", path.display());
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
            eprintln!(
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
                    eprintln!("cairn lazy layer {}: {e}", dir.display());
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
                    eprintln!(
                        "cairn lazy layer for image {digest}: worker {} serves on",
                        std::process::id()
                    );
                    m
                }
                Err(e) => {
                    eprintln!("cairn lazy layer for image {digest}: resuming: {e}");
                    return 1;
                }
            }
        }
    };
    // A v2 list's chunk entries, at once: a foreground `cairn run` tells
    // the server that the overlay is attached only when its container has
    // exited, and the start's opens must find these partials (else an
    // open starts an ordinary one, which fetches the whole object). The
    // list phase below finds them started. (Only a v2 list has any: no
    // second fetch of a v1 list.)
    let v2 = matches!(remote.as_ref().map(|s| &s.remote), Some(Remote::Artifact(r)) if r.prefetch_names_chunks());
    if v2 {
        let (source, bg) = (remote.clone().expect("checked"), mount.background());
        let all = settings.lazy.lazy_fetch == LazyFetch::Background;
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
            eprintln!("cairn lazy layer for image {digest}: no early chunk fetch: {e}");
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
            let all = settings.lazy.lazy_fetch == LazyFetch::Background;
            let (store, source) = (store.clone(), source.clone());
            let spawned = std::thread::Builder::new()
                .name("cairn-background".into())
                .spawn(move || background(&store, &source, &bg, &owned, &client, all));
            if let Err(e) = spawned {
                eprintln!("cairn lazy layer for image {digest}: no background fetch: {e}");
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
            Ok(n) => eprintln!(
                "cairn lazy layer for image {digest}: {n} opened paths written to {}",
                file.display()
            ),
            Err(e) => eprintln!("cairn lazy layer for image {digest}: {e:#}"),
        }
    }
    match result {
        Ok(stats) => {
            eprintln!("cairn lazy layer for image {digest}: done: {stats:?}");
            if stats.fetches_failed == 0 && stats.fetches_timed_out == 0 && stats.chunks_failed == 0
            {
                0
            } else {
                2
            }
        }
        Err(e) => {
            eprintln!("cairn lazy layer for image {digest}: {e}");
            1
        }
    }
}

/// Writes the paths of `opened` (objects, in first-open order) to `file`,
/// one a line, each the first path in the image backed by that object,
/// followed for a large file read in part by the chunks read
/// (`<TAB>chunks=0-1,6`, `cairn_remote::push::parse_prefetch_line`);
/// atomically (a temporary file renamed over it). Returns how many.
fn write_prefetch(
    store: &Store,
    digest: &str,
    opened: &[(ObjectId, Option<Vec<u32>>)],
    file: &Path,
) -> Result<usize> {
    let contents = store
        .image_contents(digest)
        .with_context(|| format!("reading image {digest} to name the opened files"))?;
    let mut out = Vec::new();
    let mut n = 0;
    for (id, chunks) in opened {
        // A path with a newline cannot be a line of the list, nor one
        // that holds what starts a line's chunks.
        let Some(u) = contents.objects.get(id).filter(|u| {
            !u.path.contains(&b'\n')
                && !u
                    .path
                    .windows(cairn_remote::push::CHUNKS_TAG.len())
                    .any(|w| w == cairn_remote::push::CHUNKS_TAG)
        }) else {
            continue;
        };
        if !u.path.starts_with(b"/") {
            out.push(b'/');
        }
        out.extend_from_slice(&u.path);
        // A large file read in part: the chunks that were read.
        // (Opened but not read at all: its first chunk, where a reader
        // starts.)
        if let Some(c) = chunks {
            let c = if c.is_empty() { &[0][..] } else { &c[..] };
            out.extend_from_slice(cairn_remote::push::CHUNKS_TAG);
            out.extend_from_slice(cairn_remote::push::format_chunks(c).as_bytes());
        }
        out.push(b'\n');
        n += 1;
    }
    let tmp = file.with_extension("cairn-tmp");
    fs::write(&tmp, &out).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, file)
        .with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
    Ok(n)
}

/// The background fetch, started once serving, in every mode: first the
/// image's prefetch list (the files a recorded start opened), a run of
/// listed neighbours a request (and no unlisted one); then, if `all`
/// (`--lazy-fetch background`), every other object in pack order, and the
/// image is marked complete. `BACKGROUND_JOBS` at a time through the
/// layer's fetcher: opens have their own slots and never wait behind
/// these, and an open of an object fetched here joins that fetch. An
/// object that fails is retried with backoff (1 s doubling to 60 s), up
/// to `ATTEMPTS` times; the image then stays incomplete. Stops when the
/// layer goes away. Logs one line for the list, nothing per object that
/// succeeds.
fn background(
    store: &Arc<Store>,
    source: &Arc<RemoteSource>,
    bg: &cairn_fuse::Background,
    digest: &str,
    client: &cairn_oci::ClientOptions,
    all: bool,
) {
    let began = std::time::Instant::now();
    // A v2 list's entries for large objects read in part: their chunks.
    let mut chunk_entries: Vec<(ObjectId, Vec<u32>)> = Vec::new();
    let (mut list, mut rest) = match &source.remote {
        Remote::Artifact(r) => {
            let rest = if all { r.pack_order() } else { Vec::new() };
            match r.prefetch_entries() {
                Ok(entries) => (
                    entries
                        .into_iter()
                        .map(|e| {
                            if let Some(c) = e.chunks {
                                chunk_entries.push((e.id, c));
                            }
                            e.id
                        })
                        .collect(),
                    rest,
                ),
                Err(e) => {
                    eprintln!(
                        "cairn lazy layer for image {digest}: the prefetch list: {e}; going on \
                         without it"
                    );
                    (Vec::new(), rest)
                }
            }
        }
        // The files before each layer's prefetch landmark.
        Remote::Estargz(e) => (
            e.prefetch_order().to_vec(),
            if all {
                e.all_files().to_vec()
            } else {
                Vec::new()
            },
        ),
    };
    if let Remote::Estargz(_) = &source.remote {
        // The TOCs list files that upper layers delete: only what the
        // image uses.
        match store.image_contents(digest) {
            Ok(c) => {
                list.retain(|id| c.objects.contains_key(id));
                rest.retain(|id| c.objects.contains_key(id));
            }
            Err(e) => {
                eprintln!("cairn lazy layer for image {digest}: no background fetch: {e}");
                return;
            }
        }
    }
    let local = |id: &ObjectId| source.local_id(id).is_some_and(|l| store.has_object(&l));
    // Only the listed chunks of a large object read in part, into a
    // partial that its opens will read (pinned while the layer is
    // served); the rest of it only when read (on-demand) or by the walk
    // below (background). Where no partial can be started, the object is
    // fetched whole with the list.
    for (id, chunks) in &chunk_entries {
        if !local(id) && bg.prefetch_chunks(id, chunks, all) {
            list.retain(|l| l != id);
        }
    }
    let mut seen: std::collections::HashSet<ObjectId> = list.iter().copied().collect();
    let _ = source.listed.set(seen.clone());
    // The list phase fetches each run of listed neighbours once, by its
    // first object: two jobs never start on the same run.
    let mut heads = Vec::new();
    let mut covered = std::collections::HashSet::new();
    let mut listed_missing = 0usize;
    for id in &list {
        if covered.contains(id) || local(id) {
            continue;
        }
        listed_missing += 1;
        covered.extend(source.group(store, id));
        covered.insert(*id);
        heads.push(*id);
    }
    drop(covered);
    // Large (chunked) objects last: one the start opens before the list
    // reaches it is then read chunk by chunk (answered as soon as the
    // chunks it reads are in, the rest following), instead of waiting for
    // the list's fetch of the whole object, which it would join.
    let (mut heads, chunked): (Vec<ObjectId>, Vec<ObjectId>) = heads
        .into_iter()
        .partition(|id| source.chunks(id).is_none());
    heads.extend(chunked);
    let mut given_up = fetch_all(bg, &heads, &local, digest);
    if bg.stopped() {
        return;
    }
    if !list.is_empty() {
        let still = list.iter().filter(|id| !local(id)).count();
        eprintln!(
            "cairn lazy layer for image {digest}: prefetch list: {} of {} objects local after \
             {:.2} s ({listed_missing} were missing{})",
            list.len() - still,
            list.len(),
            began.elapsed().as_secs_f64(),
            if still > 0 {
                format!("; {still} still missing")
            } else {
                String::new()
            }
        );
    }
    if !all {
        return;
    }
    rest.retain(|id| seen.insert(*id));
    drop(seen);
    given_up += fetch_all(bg, &rest, &local, digest);
    if bg.stopped() {
        return;
    }
    let order: Vec<ObjectId> = list.into_iter().chain(rest).collect();
    let missing = order.iter().filter(|id| !local(id)).count();
    if missing > 0 {
        eprintln!(
            "cairn lazy layer for image {digest}: background fetch done; {missing} objects still \
             missing ({given_up} given up on); the image stays incomplete"
        );
        return;
    }
    if let Remote::Estargz(_) = source.remote {
        // Its image names files by sha256: written again with the stored
        // objects' names, as another image that the names move to.
        let done = store
            .lock_shared()
            .map_err(cairn_remote::RemoteError::from)
            .and_then(|_lock| cairn_remote::estargz_fetch::complete_from_local(store, digest));
        match done {
            Ok(Some(complete)) => eprintln!(
                "cairn lazy layer for image {digest}: every file is local; the image is complete \
                 as {complete}"
            ),
            Ok(None) => eprintln!(
                "cairn lazy layer for image {digest}: a file is not local after all; the image \
                 stays incomplete"
            ),
            Err(e) => {
                eprintln!("cairn lazy layer for image {digest}: marking the image complete: {e}")
            }
        }
        return;
    }
    // Every object is local: `cairn fetch` finds nothing to fetch, checks
    // that under the store's rules, and marks the image complete.
    let opts = cairn_remote::FetchOptions {
        client: client.clone(),
        ..cairn_remote::FetchOptions::default()
    };
    match cairn_remote::fetch_image(store, digest, &opts) {
        Ok(r) => eprintln!(
            "cairn lazy layer for image {digest}: every object is local; the image is complete \
             ({} fetched at the end)",
            r.fetched_objects
        ),
        Err(e) => eprintln!("cairn lazy layer for image {digest}: marking the image complete: {e}"),
    }
}

/// Fetches `ids` in order through the layer's fetcher, `BACKGROUND_JOBS`
/// at a time, each retried with backoff (1 s doubling to 60 s) up to
/// `ATTEMPTS` times; stops when the layer goes away. Returns how many
/// were given up on. Logs failures only.
fn fetch_all(
    bg: &cairn_fuse::Background,
    ids: &[ObjectId],
    local: &(dyn Fn(&ObjectId) -> bool + Sync),
    digest: &str,
) -> usize {
    const ATTEMPTS: u32 = 8;
    let next = AtomicUsize::new(0);
    let given_up = AtomicUsize::new(0);
    let job = || loop {
        if bg.stopped() {
            return;
        }
        let Some(id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) else {
            return;
        };
        let mut wait = Duration::from_secs(1);
        for attempt in 1..=ATTEMPTS {
            if local(id) || bg.stopped() {
                break;
            }
            match bg.fetch(id) {
                Ok(()) => break,
                Err(_) if bg.stopped() => return,
                Err(e) => {
                    eprintln!(
                        "cairn lazy layer for image {digest}: background fetch of object {id} \
                         (attempt {attempt} of {ATTEMPTS}): {e}"
                    );
                    if attempt == ATTEMPTS {
                        given_up.fetch_add(1, Ordering::Relaxed);
                    } else {
                        std::thread::sleep(wait);
                        wait = (wait * 2).min(Duration::from_secs(60));
                    }
                }
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..BACKGROUND_JOBS.min(ids.len().max(1)) {
            s.spawn(job);
        }
        job();
    });
    given_up.into_inner()
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(io::Error::from)
        .context("making a pipe for the lazy layer's server")
}

/// This process's thread count, from `/proc/self/status`.
fn threads() -> io::Result<usize> {
    let status = fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| io::Error::other("no Threads: line in /proc/self/status"))
}

/// `cairn lazy …`.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum LazyCommand {
    /// List the running lazy servers of this store: name, image, supervisor and worker pids, restarts (--json: as JSON).
    List {
        #[arg(long)]
        json: bool,
    },
    /// A successor started by a lazy server's supervisor (not for use by hand).
    #[command(hide = true)]
    Worker,
    /// Restart the worker of a lazy server (by its name, its image's digest or a prefix of it, or `all`): the supervisor starts a successor, which goes on serving the same connection; the container notices nothing.
    Restart {
        /// A name from `cairn lazy list`, an image digest (or prefix), or `all`.
        server: String,
    },
}

/// One running lazy server, from its `<name>.pid`.
#[derive(Debug, serde::Serialize)]
struct ServerInfo {
    name: String,
    image: String,
    supervisor: i32,
    worker: i32,
    restarts: u32,
}

/// The lazy servers of the store at `root` whose supervisor is alive.
fn servers(root: &Path) -> Result<Vec<ServerInfo>> {
    let dir = root.join("lazy");
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(name) = file.strip_suffix(".pid") else {
            continue;
        };
        // Small files of our own, in a directory only root may write.
        let Ok(text) = fs::read_to_string(e.path()) else {
            continue;
        };
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(' '))
                .map(str::to_owned)
        };
        let num = |k: &str| field(k).and_then(|v| v.parse::<i32>().ok());
        let (Some(supervisor), Some(worker), Some(image)) =
            (num("supervisor"), num("worker"), field("image"))
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{supervisor}")).exists() {
            continue;
        }
        out.push(ServerInfo {
            name: name.to_owned(),
            image,
            supervisor,
            worker,
            restarts: num("restarts").unwrap_or(0) as u32,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

pub(crate) fn command(root: &Path, cmd: LazyCommand) -> Result<()> {
    match cmd {
        LazyCommand::Worker => {
            let code = lazy_worker().unwrap_or_else(|e| {
                eprintln!("cairn lazy worker: {e:#}");
                EXIT_CANNOT_RESUME
            });
            std::process::exit(code);
        }
        LazyCommand::List { json } => {
            let list = servers(root)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!(
                    "{:<40} {:<20} {:>10} {:>10} {:>8}",
                    "NAME", "IMAGE", "SUPERVISOR", "WORKER", "RESTARTS"
                );
                for s in &list {
                    let short = s.image.strip_prefix("sha256:").unwrap_or(&s.image);
                    println!(
                        "{:<40} {:<20} {:>10} {:>10} {:>8}",
                        s.name,
                        &short[..short.len().min(12)],
                        s.supervisor,
                        s.worker,
                        s.restarts
                    );
                }
            }
            Ok(())
        }
        LazyCommand::Restart { server } => {
            let list = servers(root)?;
            let want = server.strip_prefix("sha256:").unwrap_or(&server);
            let chosen: Vec<&ServerInfo> = list
                .iter()
                .filter(|s| {
                    let image = s.image.strip_prefix("sha256:").unwrap_or(&s.image);
                    server == "all"
                        || s.name == server
                        || (want.len() >= 12 && image.starts_with(want))
                })
                .collect();
            if chosen.is_empty() {
                bail!(
                    "no running lazy server is named {server:?} or serves an image {server:?} \
                     (`cairn lazy list` shows them; an image needs at least 12 digits)"
                );
            }
            for s in chosen {
                // The pid file may lag behind a restart: the worker must
                // still be the supervisor's child.
                let parent = fs::read_to_string(format!("/proc/{}/status", s.worker))
                    .ok()
                    .and_then(|st| {
                        st.lines()
                            .find_map(|l| l.strip_prefix("PPid:"))
                            .and_then(|p| p.trim().parse::<i32>().ok())
                    });
                if parent != Some(s.supervisor) {
                    bail!(
                        "worker {} of {} is not running (restarting already?)",
                        s.worker,
                        s.name
                    );
                }
                // The worker is a child of the supervisor; SIGTERM ends it
                // (it handles no signal), and the supervisor forks a
                // successor that goes on serving the connection.
                // SAFETY: a plain system call.
                let r = unsafe { libc::kill(s.worker, libc::SIGTERM) };
                if r != 0 {
                    return Err(io::Error::last_os_error())
                        .with_context(|| format!("signalling worker {} of {}", s.worker, s.name));
                }
                println!("{}: worker {} restarted", s.name, s.worker);
            }
            Ok(())
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
        on_demand: s.lazy.lazy_fetch == LazyFetch::OnDemand,
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
fn lazy_worker() -> Result<i32> {
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
    let objects: Vec<ObjectId> = store
        .image_contents(&spec.digest)
        .with_context(|| format!("reading image {}", spec.digest))?
        .objects
        .into_keys()
        .collect();
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
            eprintln!(
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
                lazy_fetch: if spec.on_demand {
                    LazyFetch::OnDemand
                } else {
                    LazyFetch::Background
                },
                fetch_timeout,
                coalesce: spec.coalesce,
                record_prefetch: spec.record_prefetch,
                no_passthrough: spec.no_passthrough,
            },
            client,
        },
        journal,
        device,
        attached,
        exe: None,
    };
    Ok(worker(&mut served, Start::Successor))
}
