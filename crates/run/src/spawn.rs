//! The spawn stage: starting `crun run` on a prepared container.
//!
//! [`crun_run_spawn`] turns a [`Prepared`] container into a [`SpawnSpec`]
//! (argv, environment, the namespace and cgroup setup of the child), and
//! [`spawn_crun`] starts it with `sys::spawn`, falling back to a join
//! after the fork where the kernel refuses `CLONE_INTO_CGROUP`.

use std::ffi::{CString, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use rustix::fs::{Mode, OFlags};

use crate::cgroup::Layout;
use crate::prepare::Prepared;
use crate::state::Paths;
use crate::sys::{NsSetup, SpawnError, SpawnSpec, Spawned};
use crate::{crun, RunError};

/// What the monitor runs: `crun run` on the bundle, with `stdio` as its
/// fds 0, 1 and 2. On a hybrid host crun starts in the container's
/// cgroup2 view group (`CLONE_INTO_CGROUP`) and joins the v1 limit groups.
pub(crate) fn crun_run_spawn<'p>(
    paths: &Paths,
    p: &'p Prepared,
    stdio: [OwnedFd; 3],
) -> Result<SpawnSpec<'p>, RunError> {
    let dir = p.dir();
    let mut args = vec![OsString::from("crun")];
    args.extend(crun::global_args(paths, p.state.cgroups.as_ref()));
    args.extend(["run".into(), "--bundle".into(), p.bundle.path().into()]);
    args.extend(["--pid-file".into(), paths.pid_file(&p.state.id).into()]);
    if let Some(c) = &p.console {
        args.extend(["--console-socket".into(), c.crun_path.clone().into()]);
    }
    args.push(p.state.id.clone().into());
    let nul = |what: &str| RunError::Invalid(format!("{what} contains a NUL byte"));
    let argv = args
        .iter()
        .map(|a| CString::new(a.as_bytes()).map_err(|_| nul("a crun argument")))
        .collect::<Result<Vec<_>, _>>()?;
    let (program, program_env) = crun::run_program()?;
    let mut envp = std::env::vars_os()
        .map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).map_err(|_| nul("the environment"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(kv) = program_env {
        envp.push(CString::new(kv).map_err(|_| nul("the environment"))?);
    }
    let mut setup = NsSetup {
        new_mount_ns: true,
        attach: vec![
            (p.bundle.as_fd(), crun::cstring(p.bundle.path())?),
            (
                p.mount.as_fd(),
                crun::cstring(&p.bundle.path().join("rootfs"))?,
            ),
        ],
        ..NsSetup::default()
    };
    let mut cgroup_dir = None;
    if let Some(cg) = p
        .state
        .cgroups
        .as_ref()
        .filter(|c| c.layout == Layout::Hybrid)
    {
        setup.cgroup2_view = true;
        for g in &cg.v1 {
            setup.join.push(crun::cstring(&g.join("cgroup.procs"))?);
        }
        if let Some(view) = &cg.view {
            let fd = rustix::fs::open(
                view,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| RunError::io("opening cgroup", view, e.into()))?;
            cgroup_dir = Some((fd, crun::cstring(&view.join("cgroup.procs"))?));
        }
    }
    Ok(SpawnSpec {
        program,
        argv,
        envp,
        cwd: crun::cstring(dir)?,
        stdio,
        cgroup: cgroup_dir,
        setup,
    })
}

/// Starts `spec`; where the kernel refuses to start it straight in its
/// cgroup, starts it and has it join the group instead.
pub(crate) fn spawn_crun(mut spec: SpawnSpec<'_>) -> Result<Spawned, RunError> {
    let bundle = String::from_utf8_lossy(spec.cwd.as_bytes()).into_owned();
    let failed = |e: SpawnError| {
        RunError::Crun(format!(
            "starting {} for the bundle {bundle}: {e}",
            crate::crun::crun_binary()
        ))
    };
    match crate::sys::spawn(&spec) {
        Err(SpawnError::Clone(e)) if spec.cgroup.is_some() => {
            tracing::debug!("clone3 into the cgroup: {e}; joining it after the fork");
            if let Some((_, procs)) = spec.cgroup.take() {
                spec.setup.join.insert(0, procs);
            }
            crate::sys::spawn(&spec).map_err(failed)
        }
        r => r.map_err(failed),
    }
}
