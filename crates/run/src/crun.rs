//! Invoking crun for a container: every call gets `--root <runroot>/crun`,
//! `--cgroup-manager cgroupfs` (`disabled` on a hybrid host, see
//! [`global_args`]), and on a hybrid host the cgroup view of the container
//! (see `cgroup`), entered by the pre-exec hook in `sys`.
//! `crun run` itself is started by `sys::spawn` (clone3 straight into the
//! container's cgroup) from a read-only bind of crun ([`run_program`]).

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cgroup::{self, Cgroups, Layout};
use crate::state::Paths;
use crate::sys::{NsSetup, Program};
use crate::RunError;

/// The crun binary (`CAIRN_CRUN` overrides, for tests and odd installs).
pub fn crun_binary() -> String {
    std::env::var("CAIRN_CRUN").unwrap_or_else(|_| "crun".into())
}

/// [`crun_binary`] as a path: a name without a slash is looked up on
/// `PATH`, as `execvp` would, but once, in the parent.
pub fn crun_path() -> Result<PathBuf, RunError> {
    let name = crun_binary();
    if name.contains('/') {
        return Ok(PathBuf::from(name));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(&name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            RunError::Crun(format!(
                "{name} not found on PATH (install crun, or set CAIRN_CRUN to its path)"
            ))
        })
}

/// What crun (like runc) reads to learn that it runs from a protected
/// copy of itself: with it set and `/proc/self/exe` on a read-only mount,
/// crun skips the copy it otherwise makes on every start (a bind mount, a
/// remount, an unmount and a second exec: about 1.2 ms here) so that a
/// container cannot overwrite the runtime binary through `/proc/<pid>/exe`
/// (CVE-2019-5736). A read-only bind gives that protection; crun's own
/// fallback is the same bind.
pub const CLONED_BINARY_ENV: &str = "_LIBCONTAINER_CLONED_BINARY=1";

/// How to exec crun for `crun run`: from a detached read-only bind of the
/// binary (with [`CLONED_BINARY_ENV`] in its environment), else by path
/// (crun then protects itself by copying itself). The bind costs two
/// system calls; the copy crun would make costs a mount, a remount, an
/// unmount and a second exec.
pub fn run_program() -> Result<(Program, Option<&'static str>), RunError> {
    let path = crun_path()?;
    match cairn_mount::readonly_bind(&path) {
        Ok(fd) => Ok((Program::Fd(fd), Some(CLONED_BINARY_ENV))),
        Err(e) => {
            tracing::debug!("running {} by path: {e}", path.display());
            Ok((Program::Path(cstring(&path)?), None))
        }
    }
}

/// The arguments every crun call for a container with cgroups `cg`
/// starts with.
///
/// On a hybrid host crun runs in a cgroup2 view whose root is the
/// container's own group (see [`cgroup`]): the container can live in that
/// group itself, so crun's cgroup manager is off there. It would otherwise
/// make (and remove) one more group below, enable controllers in the view's
/// `subtree_control` (there are none to enable on a hybrid host's cgroup2)
/// and start the container into it: a dozen cgroupfs operations on every
/// start, each a walk through `/sys`. The container's processes are in the
/// view group and cairn's v1 limit groups all the same, and killing its
/// init ends them all (it is PID 1 of its own PID namespace).
pub fn global_args(paths: &Paths, cg: Option<&Cgroups>) -> Vec<OsString> {
    let manager = match cg {
        Some(cg) if cg.layout == Layout::Hybrid => "disabled",
        _ => "cgroupfs",
    };
    vec![
        "--root".into(),
        paths.crun_root().into(),
        "--cgroup-manager".into(),
        manager.into(),
    ]
}

pub(crate) fn cstring(p: &Path) -> Result<CString, RunError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| RunError::Invalid(format!("path {} contains a NUL byte", p.display())))
}

/// A crun command for `cg`'s container. `join_limits`: also join the v1
/// limit groups (for processes that will run in the container).
pub fn command(
    paths: &Paths,
    cg: Option<&Cgroups>,
    join_limits: bool,
) -> Result<(Command, NsSetup<'static>), RunError> {
    let mut cmd = Command::new(crun_binary());
    cmd.args(global_args(paths, cg));
    let mut setup = NsSetup::default();
    if let Some(cg) = cg {
        if cg.layout == Layout::Hybrid {
            setup.cgroup2_view = true;
            setup.new_mount_ns = true;
            let files = if join_limits {
                cgroup::procs_files(cg)
            } else {
                cg.view.iter().map(|v| v.join("cgroup.procs")).collect()
            };
            for f in files {
                setup.join.push(cstring(&f)?);
            }
        }
    }
    Ok((cmd, setup))
}

/// Runs a crun subcommand to completion, quietly; returns its stderr on failure.
pub fn run_quiet(paths: &Paths, cg: Option<&Cgroups>, args: &[&OsStr]) -> Result<(), String> {
    let (mut cmd, setup) = command(paths, cg, false).map_err(|e| e.to_string())?;
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    setup.install(&mut cmd);
    let out = cmd
        .output()
        .map_err(|e| format!("running {}: {e}", crun_binary()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// `crun kill ID SIGNAL`.
pub fn kill(paths: &Paths, cg: Option<&Cgroups>, id: &str, signal: &str) -> Result<(), RunError> {
    run_quiet(
        paths,
        cg,
        &[OsStr::new("kill"), OsStr::new(id), OsStr::new(signal)],
    )
    .map_err(|e| RunError::Crun(format!("crun kill {signal}: {e}")))
}

/// `crun delete --force ID`, if crun still knows the container.
pub fn delete(paths: &Paths, cg: Option<&Cgroups>, id: &str) -> Result<(), String> {
    if !paths.crun_root().join(id).exists() {
        return Ok(());
    }
    run_quiet(
        paths,
        cg,
        &[OsStr::new("delete"), OsStr::new("--force"), OsStr::new(id)],
    )
}

/// Signal names as crun and podman take them: `TERM`, `SIGTERM`, `15`.
pub fn parse_signal(s: &str) -> Result<i32, RunError> {
    let name = s.trim().to_ascii_uppercase();
    if let Ok(n) = name.parse::<i32>() {
        if (1..=64).contains(&n) {
            return Ok(n);
        }
    }
    let bare = name.strip_prefix("SIG").unwrap_or(&name);
    let n = match bare {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "ILL" => libc::SIGILL,
        "TRAP" => libc::SIGTRAP,
        "ABRT" | "IOT" => libc::SIGABRT,
        "BUS" => libc::SIGBUS,
        "FPE" => libc::SIGFPE,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "SEGV" => libc::SIGSEGV,
        "USR2" => libc::SIGUSR2,
        "PIPE" => libc::SIGPIPE,
        "ALRM" => libc::SIGALRM,
        "TERM" => libc::SIGTERM,
        "STKFLT" => libc::SIGSTKFLT,
        "CHLD" => libc::SIGCHLD,
        "CONT" => libc::SIGCONT,
        "STOP" => libc::SIGSTOP,
        "TSTP" => libc::SIGTSTP,
        "TTIN" => libc::SIGTTIN,
        "TTOU" => libc::SIGTTOU,
        "URG" => libc::SIGURG,
        "XCPU" => libc::SIGXCPU,
        "XFSZ" => libc::SIGXFSZ,
        "VTALRM" => libc::SIGVTALRM,
        "PROF" => libc::SIGPROF,
        "WINCH" => libc::SIGWINCH,
        "IO" | "POLL" => libc::SIGIO,
        "PWR" => libc::SIGPWR,
        "SYS" => libc::SIGSYS,
        _ => return Err(RunError::Invalid(format!("unknown signal {s:?}"))),
    };
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::{spawn, SpawnError, SpawnSpec, Spawned};
    use std::fs::File;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::fd::OwnedFd;

    #[test]
    fn parses_signals_like_podman() {
        assert_eq!(parse_signal("TERM").unwrap(), 15);
        assert_eq!(parse_signal("sigkill").unwrap(), 9);
        assert_eq!(parse_signal("2").unwrap(), 2);
        assert!(parse_signal("FOO").is_err());
        assert!(parse_signal("0").is_err());
    }

    fn c(s: &str) -> CString {
        CString::new(s).unwrap()
    }

    /// Spawns `program` with `args`, in `cwd` and optionally `cgroup`;
    /// returns its stdout and exit status.
    fn run_spawned(
        program: Program,
        args: &[&str],
        cwd: &str,
        cgroup: Option<&Path>,
    ) -> Result<(String, i32), SpawnError> {
        let (out_r, out_w) = rustix::pipe::pipe().unwrap();
        let null = OwnedFd::from(File::open("/dev/null").unwrap());
        let err = rustix::io::dup(rustix::stdio::stderr()).unwrap();
        let cgroup = cgroup.map(|g| {
            let fd = rustix::fs::open(
                g,
                rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
                rustix::fs::Mode::empty(),
            )
            .unwrap();
            (fd, cstring(&g.join("cgroup.procs")).unwrap())
        });
        let spec = SpawnSpec {
            program,
            argv: args.iter().map(|a| c(a)).collect(),
            envp: vec![c("PATH=/usr/bin:/bin")],
            cwd: c(cwd),
            stdio: [null, out_w, err],
            cgroup,
            setup: NsSetup::default(),
        };
        let Spawned { pid, pidfd: _ } = spawn(&spec)?;
        drop(spec);
        let mut out = String::new();
        File::from(out_r).read_to_string(&mut out).unwrap();
        let (_, status) =
            rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
                .unwrap()
                .unwrap();
        Ok((out, status.exit_status().unwrap_or(-1)))
    }

    /// What crun checks before it skips copying itself: `/proc/self/exe`
    /// on a read-only mount and [`CLONED_BINARY_ENV`] set.
    #[test]
    fn privileged_run_program_is_a_read_only_bind_that_crun_accepts() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test makes a read-only bind and must run as root (CI runs it as root)"
        );
        let (program, env) = run_program().unwrap();
        assert_eq!(env, Some(CLONED_BINARY_ENV));
        let Program::Fd(fd) = program else {
            panic!("expected crun from a read-only bind, got {program:?}")
        };
        let st = rustix::fs::fstatvfs(&fd).unwrap();
        assert!(st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY));
        assert_eq!(
            std::fs::read(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap(),
            std::fs::read(crun_path().unwrap()).unwrap()
        );
        // A program run from such a bind sees its own executable read-only.
        let python = cairn_mount::readonly_bind(Path::new("/usr/bin/python3")).unwrap();
        let check = "import os, sys; sys.exit(0 if os.statvfs('/proc/self/exe').f_flag & os.ST_RDONLY else 3)";
        let (_, code) =
            run_spawned(Program::Fd(python), &["python3", "-c", check], "/", None).unwrap();
        assert_eq!(code, 0, "/proc/self/exe is not on a read-only mount");
    }

    /// The cost of `spawn` up to the child's exec, for comparing ways of
    /// making the child: `cargo test -p cairn-run --lib spawn_latency --
    /// --ignored --nocapture` (add `--release` for optimized code; the
    /// time is nearly all the kernel's either way). Prints the median and the
    /// 10th and 90th percentiles of 200 spawns of `/bin/true`, with this
    /// process as it is and with 1, 4 and 64 MiB more of it resident (the cost
    /// of a fork grows with the page tables it copies).
    #[test]
    #[ignore = "a timing, not a check"]
    fn spawn_latency() {
        let time_spawns = |label: &str| {
            let mut times = Vec::with_capacity(200);
            for _ in 0..200 {
                let null = || OwnedFd::from(File::open("/dev/null").unwrap());
                let spec = SpawnSpec {
                    program: Program::Path(c("/bin/true")),
                    argv: vec![c("true")],
                    envp: vec![],
                    cwd: c("/"),
                    stdio: [null(), null(), null()],
                    cgroup: None,
                    setup: NsSetup::default(),
                };
                let t = std::time::Instant::now();
                let Spawned { pid, pidfd: _ } = spawn(&spec).unwrap();
                times.push(t.elapsed());
                rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty()).unwrap();
            }
            times.sort();
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let mem: Vec<String> = status
                .lines()
                .filter(|l| {
                    ["VmRSS:", "RssAnon:", "VmPTE:"]
                        .iter()
                        .any(|k| l.starts_with(k))
                })
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect();
            eprintln!(
                "{label}: median {:?}, p10 {:?}, p90 {:?} ({})",
                times[100],
                times[20],
                times[180],
                mem.join(", ")
            );
        };
        time_spawns("spawn");
        // A container's monitor has about 0.8 MB of anonymous memory
        // resident (RssAnon), 5 MB in all.
        for mib in [1, 4, 64] {
            let ballast = vec![1u8; mib << 20];
            time_spawns(&format!("spawn, {mib} MiB more resident"));
            drop(std::hint::black_box(ballast));
        }
    }

    /// The child starts with no signal blocked and SIGPIPE at its default
    /// action, whatever this thread blocks and Rust ignores.
    #[test]
    fn spawn_resets_the_signal_mask_and_sigpipe() {
        let blocked = crate::sys::SignalFd::new(&[libc::SIGUSR2]).unwrap();
        let result = run_spawned(
            Program::Path(c("/bin/cat")),
            &["cat", "/proc/self/status"],
            "/",
            None,
        );
        crate::sys::SignalFd::unblock(&[libc::SIGUSR2]);
        drop(blocked);
        let (out, code) = result.unwrap();
        assert_eq!(code, 0);
        let mask = |key: &str| {
            let line = out.lines().find(|l| l.starts_with(key)).unwrap();
            u64::from_str_radix(line[key.len()..].trim(), 16).unwrap()
        };
        assert_eq!(mask("SigBlk:"), 0, "{out}");
        assert_eq!(mask("SigIgn:") & (1 << (libc::SIGPIPE - 1)), 0, "{out}");
    }

    #[test]
    fn spawn_reports_failures_by_stage() {
        let by_path = Program::Path(c("/bin/pwd"));
        let (out, code) = run_spawned(by_path, &["pwd"], "/usr", None).unwrap();
        assert_eq!((out.trim(), code), ("/usr", 0));

        let missing = run_spawned(Program::Path(c("/bin/true")), &["true"], "/no/such", None);
        match missing {
            Err(SpawnError::Child { stage, error }) => {
                assert_eq!(stage, "changing directory");
                assert_eq!(error.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("expected a child failure, got {other:?}"),
        }
        let noexec = run_spawned(Program::Path(c("/no/such/crun")), &["crun"], "/", None);
        assert!(
            matches!(
                noexec,
                Err(SpawnError::Child {
                    stage: "executing",
                    ..
                })
            ),
            "{noexec:?}"
        );
    }

    #[test]
    fn privileged_spawn_starts_the_child_in_its_cgroup() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test makes a cgroup and must run as root (CI runs it as root)"
        );
        let base = match cgroup::detect() {
            Layout::Unified => PathBuf::from("/sys/fs/cgroup"),
            Layout::Hybrid => PathBuf::from("/sys/fs/cgroup/unified"),
            Layout::Legacy => {
                panic!("no cgroup2 hierarchy on this host: CLONE_INTO_CGROUP needs one")
            }
        };
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let own = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap_or("/")
            .to_string();
        let name = format!("cairn-spawn-test-{}", std::process::id());
        let group = base.join(own.trim_start_matches('/')).join(&name);
        std::fs::create_dir(&group).unwrap();
        let result = run_spawned(
            Program::Path(c("/bin/cat")),
            &["cat", "/proc/self/cgroup"],
            "/",
            Some(&group),
        );
        let removed = std::fs::remove_dir(&group);
        let (out, code) = result.unwrap();
        removed.unwrap();
        assert_eq!(code, 0);
        let line = out
            .lines()
            .find(|l| l.starts_with("0::"))
            .unwrap_or_default();
        assert!(
            line.ends_with(&format!("/{name}")),
            "the child should start in {}, its cgroup2 line is {line:?}",
            group.display()
        );
    }
}
