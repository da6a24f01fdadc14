//! Invoking crun for a container: every call gets `--root <root>/run/crun`,
//! `--cgroup-manager cgroupfs`, and on a hybrid host the cgroup view of
//! the container (see `cgroup`), entered by the pre-exec hook in `sys`.

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::cgroup::{self, Cgroups, Layout};
use crate::state::Paths;
use crate::sys::NsSetup;
use crate::RunError;

/// The crun binary (`CAIRN_CRUN` overrides, for tests and odd installs).
pub fn crun_binary() -> String {
    std::env::var("CAIRN_CRUN").unwrap_or_else(|_| "crun".into())
}

fn cstring(p: &Path) -> Result<CString, RunError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| RunError::Invalid(format!("path {} contains a NUL byte", p.display())))
}

/// A crun command for `cg`'s container. `join_limits`: also join the v1
/// limit groups (for processes that will run in the container).
pub fn command(
    paths: &Paths,
    cg: Option<&Cgroups>,
    join_limits: bool,
) -> Result<(Command, NsSetup), RunError> {
    let mut cmd = Command::new(crun_binary());
    cmd.arg("--root")
        .arg(paths.crun_root())
        .arg("--cgroup-manager")
        .arg("cgroupfs");
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

    #[test]
    fn parses_signals_like_podman() {
        assert_eq!(parse_signal("TERM").unwrap(), 15);
        assert_eq!(parse_signal("sigkill").unwrap(), 9);
        assert_eq!(parse_signal("2").unwrap(), 2);
        assert!(parse_signal("FOO").is_err());
        assert!(parse_signal("0").is_err());
    }
}
