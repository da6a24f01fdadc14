//! Containers after they started: list, stop, kill, exec, logs, remove.
//!
//! These commands sit on top of the stages: they use [`teardown`] (and
//! its reaper, re-exported here) and, for `exec`, the session loop.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::console::ConsoleListener;
use crate::crun::{self, parse_signal};
use crate::image_config::resolve_user;
use crate::session::{session_loop, SessionIo, FORWARDED};
use crate::state::{self, Paths, State, Status};
use crate::stdio::StdioPipes;
use crate::sys::SignalFd;
use crate::teardown::teardown;
pub use crate::teardown::{reap, reap_one};
use crate::RunError;

/// All containers (reaped first); `all = false` keeps only running ones.
pub fn list(paths: &Paths, all: bool) -> Result<Vec<State>, RunError> {
    reap(paths)?;
    let mut out = Vec::new();
    for id in state::list_ids(paths)? {
        let dir = paths.container(&id);
        if let Ok(Some(mut st)) = state::read_state(&dir) {
            if st.pid.is_none() {
                st.pid = state::read_pid(paths, &st);
            }
            if all || st.status != Status::Exited {
                out.push(st);
            }
        }
    }
    out.sort_by(|a, b| b.created.cmp(&a.created).then(a.id.cmp(&b.id)));
    Ok(out)
}

fn running(paths: &Paths, what: &str) -> Result<State, RunError> {
    let id = state::lookup(paths, what)?;
    reap_one(paths, &id);
    let st = state::read_state(&paths.container(&id))?
        .ok_or_else(|| RunError::NoSuchContainer(what.to_string()))?;
    if st.status != Status::Running {
        return Err(RunError::Invalid(format!(
            "container {} is not running ({})",
            st.name,
            match st.status {
                Status::Creating => "still being created",
                _ => "it exited",
            }
        )));
    }
    Ok(st)
}

/// `cairn kill`: sends `signal` to the container's init.
pub fn kill(paths: &Paths, what: &str, signal: &str) -> Result<State, RunError> {
    parse_signal(signal)?;
    let st = running(paths, what)?;
    crun::kill(paths, st.cgroups.as_ref(), &st.id, signal)?;
    Ok(st)
}

/// `cairn stop`: the image's StopSignal (SIGTERM by default), SIGKILL
/// after `timeout`; returns once the container is torn down.
pub fn stop(paths: &Paths, what: &str, timeout: Duration) -> Result<State, RunError> {
    let id = state::lookup(paths, what)?;
    reap_one(paths, &id);
    let dir = paths.container(&id);
    let st = state::read_state(&dir)?.ok_or_else(|| RunError::NoSuchContainer(what.into()))?;
    if st.status == Status::Exited {
        return Ok(st);
    }
    let cg = st.cgroups.clone();
    let _ = crun::kill(paths, cg.as_ref(), &id, &st.stop_signal);
    if !state::wait_unlocked(&dir, timeout)? {
        let _ = crun::kill(paths, cg.as_ref(), &id, "KILL");
        if !state::wait_unlocked(&dir, Duration::from_secs(10))? {
            return Err(RunError::Crun(format!(
                "container {} did not stop after SIGKILL",
                st.name
            )));
        }
    }
    // No monitor (it was killed): tear down here.
    reap_one(paths, &id);
    Ok(state::read_state(&dir)?.unwrap_or(st))
}

/// `cairn exec` options.
#[derive(Debug, Clone, Default)]
pub struct ExecSpec {
    pub args: Vec<String>,
    pub interactive: bool,
    pub tty: bool,
    pub env: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
}

/// `cairn exec`: runs a process in a running container; returns its exit code.
pub fn exec(paths: &Paths, what: &str, spec: &ExecSpec) -> Result<i32, RunError> {
    if spec.args.is_empty() {
        return Err(RunError::Invalid("exec needs a command".into()));
    }
    let st = running(paths, what)?;
    let dir = paths.container(&st.id);
    let (mut cmd, setup) = crun::command(paths, st.cgroups.as_ref(), true)?;
    cmd.arg("exec");
    let console = if spec.tty {
        let name = format!("exec-{}.sock", std::process::id());
        let c = ConsoleListener::bind(&dir, &name)
            .map_err(|e| RunError::io("listening on", dir.join(&name), e))?;
        cmd.arg("--tty").arg("--console-socket").arg(&c.crun_path);
        cmd.current_dir(&dir);
        Some(c)
    } else {
        None
    };
    let socket_path = console.as_ref().map(|c| c.path.clone());
    for e in &spec.env {
        cmd.arg("--env").arg(e);
    }
    if let Some(w) = &spec.workdir {
        cmd.arg("--cwd").arg(w);
    }
    if let Some(u) = &spec.user {
        let pid = st.pid.or_else(|| state::read_pid(paths, &st));
        let read =
            |f: &str| pid.and_then(|p| fs::read_to_string(format!("/proc/{p}/root/etc/{f}")).ok());
        let r = resolve_user(u, read("passwd").as_deref(), read("group").as_deref())
            .map_err(|e| RunError::Invalid(format!("--user {u}: {e}")))?;
        cmd.arg("--user").arg(format!("{}:{}", r.uid, r.gid));
    }
    cmd.arg(&st.id);
    cmd.args(spec.args.iter().map(OsString::from));
    // Pipes, never our own descriptors: crun chowns what it is given.
    let mut pipes = StdioPipes::new().map_err(|e| RunError::io("creating pipes in", &dir, e))?;
    let (stdin, stdout, stderr) = pipes.child_stdio();
    cmd.stdin(stdin).stdout(stdout).stderr(stderr);
    setup.install(&mut cmd);
    let signals =
        SignalFd::new(&FORWARDED).map_err(|e| RunError::io("blocking signals for", &dir, e))?;
    let result = (|| {
        let spawned = cmd.spawn();
        drop(cmd);
        let mut child =
            spawned.map_err(|e| RunError::Crun(format!("running {}: {e}", crun::crun_binary())))?;
        pipes.start_stdin(spec.interactive && !spec.tty);
        let pid = Pid::from_raw(child.id() as i32).expect("child pid is positive");
        let pidfd = pidfd_open(pid, PidfdFlags::empty())
            .map_err(|e| RunError::io("pidfd_open for crun exec in", &dir, e.into()))?;
        let io = SessionIo {
            sock: None,
            child: Some((&mut child, pidfd)),
            pipes: Some(&mut pipes),
            console,
        };
        session_loop(&signals, io, spec.interactive, None, &st)
    })();
    SignalFd::unblock(&FORWARDED);
    if let Some(p) = socket_path {
        let _ = fs::remove_file(p);
    }
    result
}

/// `cairn container rm`: removes an exited container's record, log and
/// kept upper; `force` stops a running one first.
pub fn remove(paths: &Paths, what: &str, force: bool) -> Result<State, RunError> {
    let id = state::lookup(paths, what)?;
    reap_one(paths, &id);
    let dir = paths.container(&id);
    let mut st = state::read_state(&dir)?.ok_or_else(|| RunError::NoSuchContainer(what.into()))?;
    if st.status != Status::Exited {
        if !force {
            return Err(RunError::Invalid(format!(
                "container {} is running; stop it first or use --force",
                st.name
            )));
        }
        st = stop(paths, &id, Duration::from_secs(0))?;
    }
    let Some(lock) = state::try_lock(&dir)? else {
        return Err(RunError::Invalid(format!("container {} is busy", st.name)));
    };
    st.keep = false;
    st.remove = true;
    let problems = teardown(paths, &mut st);
    drop(lock);
    if let Some(p) = problems.into_iter().next() {
        return Err(RunError::Crun(p));
    }
    Ok(st)
}

/// `cairn logs`: copies a detached container's output to `out`; with
/// `follow`, keeps copying until the container has exited.
pub fn logs(paths: &Paths, what: &str, follow: bool, out: &mut dyn Write) -> Result<(), RunError> {
    let id = state::lookup(paths, what)?;
    let dir = paths.container(&id);
    let st = state::read_state(&dir)?.ok_or_else(|| RunError::NoSuchContainer(what.into()))?;
    let Some(path) = st.log_path.clone() else {
        return Err(RunError::Invalid(format!(
            "container {} ran in the foreground: its output went to the terminal, there is no log",
            st.name
        )));
    };
    let mut file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(RunError::io("opening", &path, e)),
    };
    let mut pos = 0u64;
    let mut copy = |file: &mut fs::File, pos: &mut u64| -> Result<(), RunError> {
        file.seek(SeekFrom::Start(*pos))
            .map_err(|e| RunError::io("reading", &path, e))?;
        let mut data = Vec::new();
        file.read_to_end(&mut data)
            .map_err(|e| RunError::io("reading", &path, e))?;
        *pos += data.len() as u64;
        out.write_all(&data)
            .and_then(|()| out.flush())
            .map_err(|e| RunError::io("writing", "stdout", e))
    };
    copy(&mut file, &mut pos)?;
    if !follow {
        return Ok(());
    }
    let start = Instant::now();
    loop {
        let done = state::try_lock(&dir)?.is_some() || !dir.exists();
        copy(&mut file, &mut pos)?;
        if done {
            return Ok(());
        }
        let _ = start;
        std::thread::sleep(Duration::from_millis(50));
    }
}
