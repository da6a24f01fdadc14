//! Running containers from cairn images with crun.
//!
//! `cairn run` builds an OCI bundle in `<root>/containers/<id>/` (see
//! [`state`] for the layout): the runtime config from the image config and
//! the flags ([`spec`], [`image_config`]), and a rootfs that is the image's
//! composefs stack with a throwaway upper layer, optionally idmapped into a
//! user namespace from the `--userns auto` pool ([`userns`]).
//!
//! # Processes
//!
//! ```text
//! cairn run (client) ──fork,setsid,fork──► monitor ──spawn──► crun run ──► container init
//!   │  signals, exit code over a socketpair   │  holds containers/<id>/lock
//!   │  tty: console socket, pty proxy         │  waits, records the exit, tears down
//! ```
//!
//! The monitor (cairn's conmon) is the parent of crun for foreground and
//! detached containers alike, so a container is torn down when it ends
//! even if the `cairn run` that started it was killed. crun runs in a
//! private mount namespace made just before it execs (`sys::NsSetup`): the
//! rootfs overlay is attached only there, so the host's mount table never
//! holds it and no kill of anything can leak it: the kernel drops the mount
//! with the last process in that namespace. On a hybrid cgroup host the same
//! hook gives crun the cgroup2 view it needs ([`cgroup`]).
//!
//! crun gets pipes for stdin, stdout and stderr, never the caller's
//! descriptors (it `fchown`s them to the container's user: the caller's
//! terminal, output file or the host's `/dev/null` would change owner); the
//! monitor copies between the pipes and the caller (or the log), see
//! `stdio`.
//!
//! Teardown ([`teardown::teardown`]) is idempotent and runs from the
//! monitor, or from any later command that finds an abandoned container
//! (its lock free while its state says it runs: [`teardown::reap`]).
//!
//! For other front ends (the on-demand `--listen` proxy): [`start_detached`]
//! starts a container from a [`RunSpec`] and returns at once;
//! [`lifecycle::stop`] stops it. [`listen`] is that front end: a proxy
//! process that holds a listening socket and starts the container on the
//! first connection, stops it when idle.
//!
//! # Modules
//!
//! The run path is cut into stages, one module each, and the imports
//! between modules form a DAG: a module may import only modules on a
//! lower line of this picture (never one on its own line or above); the
//! building blocks at the bottom import no stage, and each other only
//! from left to right.
//!
//! ```text
//! listen                      on-demand proxy (record: listen::record)
//!   │
//! container   lifecycle       entry points: run / start; ps, stop, exec, rm, logs
//!   │      ╲      │
//! monitor   ╲     │           crun's parent: waits, records the exit, tears down
//!   │  ╲     ╲    │
//! spawn  ╲  session           start `crun run` │ the client's end (signals, tty)
//!   │     ╲
//! prepare  ╲                  record, rootfs, bundle, cgroups, config.json
//!   │       ╲
//! teardown                    release what a record holds; the reaper
//!   │
//! bundle crun userns state cgroup image_config spec   console stdio sys
//! ```
//!
//! - `prepare` takes a `RunSpec` to a `Prepared` container; on failure
//!   it calls `teardown`.
//! - `spawn` turns a `Prepared` container into crun's `sys::SpawnSpec`
//!   and starts it.
//! - `session` is the client's side (foreground `cairn run`, `cairn
//!   exec`); it knows nothing of preparing or spawning.
//! - `monitor` uses prepare's output, spawn, session's exit code and
//!   teardown; [`container`] forks it and then runs the client's session.
//! - [`lifecycle`] uses teardown (the reaper) and session (for exec).
//! - [`listen`] uses [`container::start_detached`] and
//!   [`lifecycle::stop`].
#![deny(unsafe_code)]

// Building blocks, no stage among them (see the picture above).
mod bundle;
pub mod cgroup;
mod console;
pub mod crun;
pub mod image_config;
pub mod spec;
pub mod state;
mod stdio;
mod sys;
pub mod userns;

// The stages.
mod prepare;
mod session;
mod spawn;
pub mod teardown;

// On top of the stages.
pub mod container;
pub mod lifecycle;
pub mod listen;
mod monitor;

use std::path::PathBuf;

pub use container::{run_foreground, start_detached, RunSpec, Started, UpperChoice, UsernsChoice};
pub use lifecycle::{exec, kill, list, logs, remove, stop, ExecSpec};
pub use listen::{ListenSpec, ListenState, ListenStatus, Listening};
pub use spec::{Limits, Network, Volume};
pub use state::{Paths, State, Status};
pub use sys::exit_now;
pub use teardown::reap;

/// Why a container operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    #[error("{0}")]
    Invalid(String),
    #[error("no such container: {0}")]
    NoSuchContainer(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] cairn_store::StoreError),
    #[error(transparent)]
    Mount(#[from] cairn_mount::MountError),
    #[error(transparent)]
    Verity(#[from] cairn_store::VerityRefusal),
    #[error("{0}")]
    Crun(String),
}

impl RunError {
    pub(crate) fn io(what: &str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RunError::Io {
            what: what.to_string(),
            path: path.into(),
            source,
        }
    }
}
