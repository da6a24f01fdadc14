//! Starting containers: [`run_foreground`] and [`start_detached`] prepare
//! a container, fork its monitor and then act as the client.
//!
//! This is the top of the run path: it uses the prepare stage, the
//! monitor and the session; of the other modules only the listen front
//! end imports it.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use serde::Serialize;

use crate::prepare::{prepare, Prepared};
pub use crate::prepare::{RunSpec, UpperChoice, UsernsChoice, DEFAULT_TMPFS_SIZE};
use crate::state::Paths;
use crate::sys::{fork_child_monitor, fork_monitor, Forked};
use crate::teardown::teardown;
use crate::{monitor, session, RunError};

/// A started detached container.
#[derive(Debug, Clone, Serialize)]
pub struct Started {
    pub id: String,
    pub name: String,
    /// Where a kept upper will be.
    pub upper: Option<PathBuf>,
}

/// Runs a container in the foreground; returns its exit code (128+N when
/// a signal N ended it).
pub fn run_foreground(paths: &Paths, spec: &RunSpec) -> Result<i32, RunError> {
    let mut spec = spec.clone();
    spec.detach = false;
    let prepared = prepare(paths, &spec)?;
    let (client, monitor_end) = UnixStream::pair()
        .map_err(|e| RunError::io("creating socketpair for", prepared.dir(), e))?;
    match fork_child_monitor() {
        Err(e) => Err(monitor_fork_failed(paths, prepared, e)),
        Ok(Forked::Monitor) => {
            drop(client);
            monitor::monitor_main(paths, prepared, Some(monitor_end), &spec)
        }
        Ok(Forked::Parent) => {
            drop(monitor_end);
            let Prepared {
                locked,
                mount,
                bundle,
                store_lock,
                console,
                state,
            } = prepared;
            drop((mount, bundle));
            session::client_session(
                client,
                console,
                spec.interactive,
                store_lock,
                locked,
                &state,
            )
        }
    }
}

/// Undoes a prepared container whose monitor could not be forked.
fn monitor_fork_failed(paths: &Paths, prepared: Prepared, e: std::io::Error) -> RunError {
    let mut st = prepared.state.clone();
    st.remove = true;
    drop(prepared);
    teardown(paths, &mut st);
    RunError::io("forking the monitor for", paths.container(&st.id), e)
}

/// Starts a detached container and returns once crun is running it.
pub fn start_detached(paths: &Paths, spec: &RunSpec) -> Result<Started, RunError> {
    let mut spec = spec.clone();
    spec.detach = true;
    let prepared = prepare(paths, &spec)?;
    let (mut client, monitor_end) = UnixStream::pair()
        .map_err(|e| RunError::io("creating socketpair for", prepared.dir(), e))?;
    match fork_monitor() {
        Err(e) => Err(monitor_fork_failed(paths, prepared, e)),
        Ok(Forked::Monitor) => {
            drop(client);
            monitor::monitor_main(paths, prepared, Some(monitor_end), &spec)
        }
        Ok(Forked::Parent) => {
            drop(monitor_end);
            let started = Started {
                id: prepared.state.id.clone(),
                name: prepared.state.name.clone(),
                upper: prepared.state.kept_upper.clone(),
            };
            drop(prepared);
            match session::wait_started(&mut client) {
                Ok(()) => Ok(started),
                Err(e) => Err(e),
            }
        }
    }
}
