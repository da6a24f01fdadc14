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
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use cairn_fuse::{FetchError, ObjectSource, ServeOptions};
use cairn_remote::RemoteObjects;
use cairn_store::{ObjectId, Store};

/// The image's lazy artifact as the FUSE layer's source of objects.
struct RemoteSource(RemoteObjects);

impl ObjectSource for RemoteSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        self.0.size(id)
    }

    fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), FetchError> {
        self.0
            .fetch(id, out)
            .map(|_| ())
            .map_err(|e| FetchError::Other(e.to_string()))
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
    ) -> Result<LazyLayer> {
        let store = Store::open(root)
            .with_context(|| format!("opening the store at {}", root.display()))?;
        // Opened (and its index checked) here, so that a broken source is
        // this command's error, not a line in the server's log.
        let remote = RemoteObjects::open(&store, digest, client)
            .with_context(|| format!("opening the lazy source of image {digest}"))?;
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
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let log_path = lazy.join(format!("{name}.log"));
        let log = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let devnull = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .context("opening /dev/null")?;
        let threads = threads().context("counting this process's threads")?;
        if threads != 1 {
            let _ = fs::remove_dir(&dir);
            bail!("cannot fork the lazy layer's server: this process has {threads} threads");
        }
        let (ready_r, ready_w) = pipe()?;
        let (attached_r, attached_w) = pipe()?;
        // SAFETY: this process has one thread (checked above), so the
        // child is a whole copy of it and may do anything the parent could;
        // it never returns into the caller (it ends in `exit`).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let _ = fs::remove_dir(&dir);
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

/// The server process: returns its exit status.
#[allow(clippy::too_many_arguments)]
fn server(
    store: Store,
    remote: RemoteObjects,
    dir: &Path,
    log_path: &Path,
    digest: &str,
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
        ..ServeOptions::default()
    };
    let mount = match cairn_fuse::serve(
        Arc::new(store),
        Arc::new(RemoteSource(remote)),
        dir,
        options,
    ) {
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
    let result = if told {
        let r = mount.detach_and_serve();
        let _ = fs::remove_dir(dir);
        r
    } else {
        let mut mount = mount;
        let r = mount.unmount();
        let _ = fs::remove_dir(dir);
        r
    };
    match result {
        Ok(stats) => {
            eprintln!("cairn lazy layer for image {digest}: done: {stats:?}");
            if stats.fetches_failed == 0 && stats.fetches_timed_out == 0 {
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
