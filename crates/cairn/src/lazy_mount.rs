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
//! of its own, forked before anything is mounted:
//!
//! 1. the server mounts the FUSE layer at `<store>/lazy/<name>/` and says
//!    "ready" (or why not) through a pipe;
//! 2. `cairn mount` stacks and attaches the overlay on it, then tells the
//!    server through a second pipe; if anything fails, it closes that pipe
//!    without a word and the server unmounts the layer and exits;
//! 3. told, the server detaches the FUSE mount (it leaves the mount table;
//!    the overlay keeps it alive), removes its directory and serves until
//!    the kernel ends the connection, which it does when the overlay is
//!    unmounted (`cairn umount`, `umount`, anything): then it exits.
//!
//! Once serving, the server fetches the rest of the image in the
//! background (`--lazy-fetch background`, the default): the artifact's
//! prefetch list first, then every object in pack order, through the
//! layer's own fetcher (so an open of an object being fetched joins that
//! fetch, and opens never queue behind it), `BACKGROUND_JOBS` at a time.
//! A failure is logged and retried with backoff; when every object is
//! local the image is marked complete, as `cairn fetch` does.
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
use cairn_remote::RemoteObjects;
use cairn_store::{ObjectId, Store};

/// What is fetched besides what is opened.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum LazyFetch {
    /// Fetch the rest of the image in the background once serving.
    #[default]
    Background,
    /// Fetch only what is opened (with its neighbours).
    OnDemand,
}

/// The options of `--lazy` (mount and run).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct LazyArgs {
    /// With --lazy: fetch the rest of the image in the background once serving (prefetch list first, then pack order), or only what is opened.
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
}

impl Default for LazyArgs {
    fn default() -> Self {
        LazyArgs {
            lazy_fetch: LazyFetch::Background,
            fetch_timeout: Duration::from_secs(30),
            coalesce: cairn_remote::DEFAULT_COALESCE,
            record_prefetch: None,
        }
    }
}

/// A byte count: a plain number, or one with K, M or G.
fn parse_bytes(s: &str) -> Result<u64, String> {
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

/// The image's lazy artifact as the FUSE layer's source of objects: one
/// object streamed whole, or a run of neighbours of one pack in one range
/// request of at most `coalesce` bytes.
struct RemoteSource {
    remote: RemoteObjects,
    coalesce: u64,
}

impl ObjectSource for RemoteSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        self.remote.size(id)
    }

    fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), FetchError> {
        self.remote
            .fetch(id, out)
            .map(|_| ())
            .map_err(|e| FetchError::Other(e.to_string()))
    }

    fn group(&self, store: &Store, id: &ObjectId) -> Vec<ObjectId> {
        if self.coalesce == 0 {
            return vec![*id];
        }
        self.remote
            .neighbours(store, id, self.coalesce)
            .unwrap_or_else(|_| vec![*id])
    }

    fn publish_group(&self, store: &Store, group: &[ObjectId]) -> Option<Result<(), FetchError>> {
        Some(
            self.remote
                .publish_group(store, group)
                .map_err(|e| FetchError::Other(e.to_string())),
        )
    }

    fn chunks(&self, id: &ObjectId) -> Option<Vec<u64>> {
        self.remote.chunk_starts(id)
    }

    fn fetch_chunk(&self, id: &ObjectId, k: usize) -> Result<Vec<u8>, FetchError> {
        match self.remote.fetch_chunk(id, k) {
            Ok(Some(data)) => Ok(data),
            Ok(None) => Err(FetchError::Other(format!("object {id} has no chunk {k}"))),
            Err(e) => Err(FetchError::Other(e.to_string())),
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
        let remote = RemoteObjects::open(&store, digest, &server_client)
            .with_context(|| format!("opening the lazy source of image {digest}"))?;
        let mut lazy_args = lazy.clone();
        if let Some(f) = &lazy_args.record_prefetch {
            // The server may run anywhere: an absolute path.
            lazy_args.record_prefetch = Some(
                std::path::absolute(f)
                    .with_context(|| format!("the prefetch list path {}", f.display()))?,
            );
        }
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
        let (attached_r, attached_w) = pipe()?;
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
            let code = server(
                store,
                remote,
                &dir,
                &log_path,
                digest,
                Settings {
                    lazy: lazy_args,
                    client: client.clone(),
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

/// The server process: returns its exit status.
#[allow(clippy::too_many_arguments)]
fn server(
    store: Store,
    remote: RemoteObjects,
    dir: &Path,
    log_path: &Path,
    digest: &str,
    settings: Settings,
    streams: Detached,
    mut ready: fs::File,
    mut attached: fs::File,
) -> i32 {
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
    let options = ServeOptions {
        source_name: format!("cairn-lazy:{digest}"),
        fetch_timeout: settings.lazy.fetch_timeout,
        max_background_fetches: BACKGROUND_JOBS,
        record_opens: settings.lazy.record_prefetch.is_some(),
        ..ServeOptions::default()
    };
    let store = Arc::new(store);
    let store_for_record = store.clone();
    let source = Arc::new(RemoteSource {
        remote,
        coalesce: settings.lazy.coalesce,
    });
    let mount = match cairn_fuse::serve(store.clone(), source.clone(), dir, options) {
        Ok(m) => m,
        Err(e) => {
            let _ = write!(ready, "error: {e}");
            eprintln!("cairn lazy layer {}: {e}", dir.display());
            return 1;
        }
    };
    let _ = ready.write_all(b"ready");
    drop(ready);
    let mut told = [0u8; 1];
    let told = matches!(attached.read(&mut told), Ok(1));
    drop(attached);
    let open_log = mount.open_log();
    let record = settings.lazy.record_prefetch.clone();
    let result = if told {
        if settings.lazy.lazy_fetch == LazyFetch::Background {
            let bg = mount.background();
            let owned = digest.to_owned();
            let spawned = std::thread::Builder::new()
                .name("cairn-background".into())
                .spawn(move || background(&store, &source, &bg, &owned, &settings.client));
            if let Err(e) = spawned {
                eprintln!("cairn lazy layer for image {digest}: no background fetch: {e}");
            }
        }
        let r = mount.detach_and_serve();
        let _ = fs::remove_dir(dir);
        r
    } else {
        let mut mount = mount;
        let r = mount.unmount();
        let _ = fs::remove_dir(dir);
        r
    };
    if let (Some(file), true) = (&record, told) {
        match write_prefetch(&store_for_record, digest, &open_log.objects(), file) {
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
                let _ = fs::remove_file(log_path);
            }
            0
        }
        Err(e) => {
            eprintln!("cairn lazy layer for image {digest}: {e}");
            1
        }
    }
}

/// Writes the paths of `opened` (objects, in first-open order) to `file`,
/// one a line, each the first path in the image backed by that object;
/// atomically (a temporary file renamed over it). Returns how many.
fn write_prefetch(store: &Store, digest: &str, opened: &[ObjectId], file: &Path) -> Result<usize> {
    let contents = store
        .image_contents(digest)
        .with_context(|| format!("reading image {digest} to name the opened files"))?;
    let mut out = Vec::new();
    let mut n = 0;
    for id in opened {
        // A path with a newline cannot be a line of the list.
        let Some(u) = contents
            .objects
            .get(id)
            .filter(|u| !u.path.contains(&b'\n'))
        else {
            continue;
        };
        if !u.path.starts_with(b"/") {
            out.push(b'/');
        }
        out.extend_from_slice(&u.path);
        out.push(b'\n');
        n += 1;
    }
    let tmp = file.with_extension("cairn-tmp");
    fs::write(&tmp, &out).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, file)
        .with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
    Ok(n)
}

/// The background fetch: every object of the image into the store, the
/// prefetch list first, then pack order, `BACKGROUND_JOBS` at a time
/// through the layer's fetcher; then the image is marked complete. An
/// object that fails is retried with backoff (1 s doubling to 60 s), up
/// to `ATTEMPTS` times; the image then stays incomplete. Stops when the
/// layer goes away.
fn background(
    store: &Arc<Store>,
    source: &Arc<RemoteSource>,
    bg: &cairn_fuse::Background,
    digest: &str,
    client: &cairn_oci::ClientOptions,
) {
    const ATTEMPTS: u32 = 8;
    let mut order = match source.remote.prefetch_list() {
        Ok(list) => list,
        Err(e) => {
            eprintln!(
                "cairn lazy layer for image {digest}: the prefetch list: {e}; going on without it"
            );
            Vec::new()
        }
    };
    let mut seen: std::collections::HashSet<ObjectId> = order.iter().copied().collect();
    for id in source.remote.pack_order() {
        if seen.insert(id) {
            order.push(id);
        }
    }
    drop(seen);
    let next = AtomicUsize::new(0);
    let given_up = AtomicUsize::new(0);
    let job = || loop {
        if bg.stopped() {
            return;
        }
        let Some(id) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
            return;
        };
        let mut wait = Duration::from_secs(1);
        for attempt in 1..=ATTEMPTS {
            if store.has_object(id) || bg.stopped() {
                break;
            }
            match bg.fetch(id) {
                Ok(()) => break,
                Err(e) if bg.stopped() => {
                    let _ = e;
                    return;
                }
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
        for _ in 1..BACKGROUND_JOBS {
            s.spawn(job);
        }
        job();
    });
    if bg.stopped() {
        return;
    }
    let missing = order.iter().filter(|id| !store.has_object(id)).count();
    if missing > 0 {
        eprintln!(
            "cairn lazy layer for image {digest}: background fetch done; {missing} objects still \
             missing ({} given up on); the image stays incomplete",
            given_up.load(Ordering::Relaxed)
        );
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
