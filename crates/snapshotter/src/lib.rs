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

pub use snap::{SnapError, Snapshotter};

/// Serves the snapshotter of the store at `root` on the unix socket
/// `address` until SIGINT or SIGTERM. The socket's directory is created
/// 0700 if missing; the socket is 0600. A stale socket file is replaced.
pub fn serve(root: &Path, address: &Path) -> Result<(), SnapError> {
    let snap = Snapshotter::open(root)?;
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
    rt.block_on(async move {
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
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("a SIGTERM handler can be installed");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("cairn snapshotter stopping");
        };
        tonic::transport::Server::builder()
            .add_service(server::SnapshotsServer::new(shared))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
            .map_err(|e| SnapError::Internal(format!("serving: {e}")))
    })?;
    let _ = fs::remove_file(address);
    Ok(())
}
