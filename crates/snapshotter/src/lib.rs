//! `cairn snapshotter`: a containerd proxy snapshotter over cairn's store.
//!
//! containerd asks a snapshotter for layer snapshots and container root
//! filesystem mounts over gRPC (`containerd.services.snapshots.v1`); this
//! crate answers on a unix socket. The normal path: containerd unpacks each
//! layer into an active snapshot's directory, and on Commit cairn imports
//! that directory as a layer of its store, exactly as `cairn import` would
//! have, and builds the chain's EROFS image. A container's root filesystem
//! is an overlay over the chain image's composefs mount.
//! docs/snapshotter.md has the design; the modules:
//!
//! - `proto`: the API's messages, hand-written prost structs;
//! - `server`: the tonic service, without generated code;
//! - `snap`: containerd's snapshot semantics;
//! - `meta`: the crash-safe snapshot records;
//! - `commit`: an upper directory into a layer and a chain image.

pub mod commit;
pub mod filter;
pub mod meta;
pub mod proto;
pub mod remote;
mod server;
pub mod snap;

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

pub use snap::{LazyMounter, SnapError, Snapshotter};

/// Set once SIGTERM or SIGINT came: a remote pull that finishes after it is
/// not recorded (containerd was told the call failed).
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the snapshotter is stopping.
pub(crate) fn stopping() -> bool {
    STOPPING.load(std::sync::atomic::Ordering::SeqCst)
}

/// Told when the snapshotter stops: calls waiting for a remote pull give up.
pub(crate) fn stop_signal() -> tokio::sync::watch::Receiver<bool> {
    STOP.get_or_init(|| tokio::sync::watch::channel(false).0)
        .subscribe()
}

static STOP: std::sync::OnceLock<tokio::sync::watch::Sender<bool>> = std::sync::OnceLock::new();

/// How long calls in flight (a Commit's import) may take to finish once
/// the snapshotter is told to stop.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// What `serve_with` serves besides the store.
#[derive(Default, Clone)]
pub struct Options {
    /// The lazy remote path (see [`LazyMounter`]); `None`: images are
    /// always pulled in full.
    pub lazy: Option<std::sync::Arc<dyn LazyMounter>>,
}

/// Serves the snapshotter of the store at `root` on the unix socket
/// `address` until SIGINT or SIGTERM. The socket's directory is created
/// 0700 if missing; the socket is 0600. A stale socket file is replaced.
pub fn serve(root: &Path, address: &Path) -> Result<(), SnapError> {
    serve_with(root, address, Options::default())
}

/// [`serve`] with [`Options`]. SIGTERM or SIGINT stops it promptly: a
/// Prepare waiting for a remote pull is answered `Unavailable` at once
/// (the pull is abandoned and nothing of it recorded; what it staged is
/// `tmp/` debris of the store), other calls get [`STOP_GRACE`] to finish.
pub fn serve_with(root: &Path, address: &Path, options: Options) -> Result<(), SnapError> {
    let mut snap = Snapshotter::open(root)?;
    if let Some(m) = options.lazy {
        snap.set_lazy_mounter(m);
    }
    let internal = |what: String| move |e: io::Error| SnapError::Internal(format!("{what}: {e}"));
    if let Some(dir) = address.parent() {
        if !dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(internal(dir.display().to_string()))?;
        }
    }
    match fs::remove_file(address) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(internal(address.display().to_string())(e)),
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(internal("starting the runtime".into()))?;
    let shared = Arc::new(Mutex::new(snap));
    let served = rt.block_on(async move {
        // Bound (and listening) under a temporary name, made 0600, then
        // renamed into place: a client that sees the socket can connect
        // (binding and listening are two system calls, and a connect in
        // between is refused), and it is never open to others for a moment.
        let mut staged = address.as_os_str().to_owned();
        staged.push(format!(".{}.tmp", std::process::id()));
        let staged = std::path::PathBuf::from(staged);
        let _ = fs::remove_file(&staged);
        let listener = tokio::net::UnixListener::bind(&staged)
            .map_err(internal(format!("binding {}", staged.display())))?;
        let placed = fs::set_permissions(&staged, fs::Permissions::from_mode(0o600))
            .and_then(|()| fs::rename(&staged, address));
        if let Err(e) = placed {
            let _ = fs::remove_file(&staged);
            return Err(internal(address.display().to_string())(e));
        }
        tracing::info!("cairn snapshotter listening on {}", address.display());
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let stop = STOP.get_or_init(|| tokio::sync::watch::channel(false).0);
        let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(internal("installing a SIGTERM handler".into()))?;
        let shutdown = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("cairn snapshotter stopping");
            STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
            stop.send_replace(true);
            let _ = stopped_tx.send(());
        };
        let serving = tonic::transport::Server::builder()
            .add_service(server::SnapshotsServer::new(shared))
            .serve_with_incoming_shutdown(incoming, shutdown);
        let grace = async move {
            let _ = stopped_rx.await;
            tokio::time::sleep(STOP_GRACE).await;
        };
        tokio::select! {
            r = serving => r.map_err(|e| SnapError::Internal(format!("serving: {e}"))),
            () = grace => {
                tracing::warn!("calls still in flight {STOP_GRACE:?} after the stop: left unanswered");
                Ok(())
            }
        }
    });
    // Blocking threads still running (an abandoned remote pull) are not
    // waited for: they end with the process.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    served?;
    let _ = fs::remove_file(address);
    Ok(())
}
