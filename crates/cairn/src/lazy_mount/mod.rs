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
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use cairn_fuse::{FetchError, ObjectSource};
use cairn_remote::{EstargzObjects, RemoteObjects};
use cairn_store::{ObjectId, StagedObject, Store};

mod background;
mod server;

use server::{lazy_worker, supervise, Detached, Served, Settings, EXIT_CANNOT_RESUME};

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

impl LazyFetch {
    /// The name the command line gives it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            LazyFetch::Background => "background",
            LazyFetch::OnDemand => "on-demand",
        }
    }
}

/// The options of `--lazy` (mount and run).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct LazyArgs {
    /// With --lazy: once serving, fetch the image's prefetch list in the background, then the rest of the image in pack order (background, the default), or nothing beyond the list and what is opened (on-demand). `--lazy=on-demand` says the same.
    #[arg(long, value_enum)]
    pub lazy_fetch: Option<LazyFetch>,
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
            lazy_fetch: None,
            fetch_timeout: Duration::from_secs(30),
            coalesce: cairn_remote::DEFAULT_COALESCE,
            record_prefetch: None,
            no_passthrough: false,
        }
    }
}

impl LazyArgs {
    /// What is fetched besides what is opened.
    pub(crate) fn fetch(&self) -> LazyFetch {
        self.lazy_fetch.unwrap_or_default()
    }

    /// These options with the mode `--lazy=MODE` names, if it names one
    /// (`--lazy=on-demand` is `--lazy --lazy-fetch on-demand`); the two
    /// naming different modes is an error.
    pub(crate) fn with_mode(&self, lazy: Option<LazyFetch>) -> anyhow::Result<LazyArgs> {
        let mut out = self.clone();
        match (lazy, self.lazy_fetch) {
            (Some(a), Some(b)) if a != b => anyhow::bail!(
                "--lazy={} and --lazy-fetch {} name different modes: give one",
                a.name(),
                b.name()
            ),
            (Some(a), _) => out.lazy_fetch = Some(a),
            (None, _) => {}
        }
        Ok(out)
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

/// Files that every container start reads, whatever its command: the
/// user database. containerd reads `/etc/group` for the process's
/// supplementary groups as it builds a container's spec, and runc reads
/// `/etc/passwd` and `/etc/group` as it sets up the process's user (so
/// does a `cairn run`: a list it records starts with them). The
/// background fetch takes them first, ahead of the prefetch list, also
/// where the list lacks them (recorded otherwise, an eStargz image's
/// landmark files, no list at all): a few hundred bytes each.
const START_FILES: [&str; 2] = ["/etc/passwd", "/etc/group"];

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
    /// The objects of [`START_FILES`]: fetched the moment the layer
    /// serves, on their own (a fetch of one takes along only the others),
    /// so that the small request that brings them waits neither for the
    /// prefetch list nor behind its first run of neighbours.
    start: std::collections::HashSet<ObjectId>,
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
            // The server stages what it gets and checks its fs-verity
            // digest (`ObjectSource::fetch`): not hashed twice.
            Remote::Artifact(r) => r.fetch_for_stager(id, out).map(|_| ()),
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
                if self.start.contains(id) {
                    // A start file: with the start files next to it only.
                    let keep = group[1..]
                        .iter()
                        .position(|n| !self.start.contains(n))
                        .map_or(group.len(), |p| p + 1);
                    group.truncate(keep);
                } else if let Some(listed) = self.listed.get().filter(|l| l.contains(id)) {
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
        staged: &mut dyn FnMut(StagedObject),
    ) -> Option<Result<(), FetchError>> {
        match &self.remote {
            Remote::Artifact(r) => Some(
                r.stage_run(store, group, staged)
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
        let (contents, first) = store
            .image_contents_at(digest, &START_FILES)
            .with_context(|| format!("reading image {digest}"))?;
        let objects: Vec<ObjectId> = contents.objects.into_keys().collect();
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
        // The image's parse is freed by now, but mimalloc keeps freed
        // pages for reuse, and both forks (supervisor and worker) would
        // carry them for their whole life: about 0.9 KiB an entry, 91 MiB
        // for 100,000 files. Give them back first (8 ms for that image).
        // SAFETY: mi_collect frees only pages the allocator holds unused;
        // it touches no live allocation and may be called at any time.
        unsafe { libmimalloc_sys::mi_collect(true) };
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
                    first: first.into_iter().flatten().collect(),
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
            .arg(self.lazy_fetch.name())
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
            // Its stderr is the server's log file.
            crate::log::as_daemon();
            let code = lazy_worker().unwrap_or_else(|e| {
                crate::log::logline!("cairn lazy worker: {e:#}");
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
