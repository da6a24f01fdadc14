//! The container commands: `run`, `ps`, `stop`, `kill`, `exec`, `logs`,
//! `container rm`. Flags follow podman's; the work is in `cairn_run`.
//!
//! `run` and `exec` exit with the container's code (128+N for a signal
//! N), and with 125 when cairn itself failed, as podman does.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::Serialize;

use cairn_run::{
    ExecSpec, Limits, ListenState, ListenStatus, Network, Paths, RunSpec, State, Status,
    UpperChoice, UsernsChoice, Volume,
};

use crate::{output, Global};

#[derive(Subcommand, Debug)]
#[command(defer = true)]
pub enum RunCommand {
    /// Run a command in a new container: IMAGE [COMMAND [ARG...]].
    Run(Box<RunArgs>),
    /// List containers (running ones; -a for all).
    Ps {
        /// Also show exited containers (with the global -q: only their ids).
        #[arg(short, long)]
        all: bool,
    },
    /// Stop containers: their StopSignal (default SIGTERM), then SIGKILL after the timeout.
    Stop {
        /// Seconds to wait before SIGKILL.
        #[arg(short = 't', long = "time", default_value_t = 10)]
        time: u64,
        /// Names or ids.
        #[arg(required = true)]
        containers: Vec<String>,
    },
    /// Send a signal to containers.
    Kill {
        /// The signal (name or number).
        #[arg(short, long, default_value = "KILL")]
        signal: String,
        #[arg(required = true)]
        containers: Vec<String>,
    },
    /// Run a command in a running container.
    Exec(ExecArgs),
    /// Print a detached container's output.
    Logs {
        /// Keep printing until the container exits.
        #[arg(short, long)]
        follow: bool,
        container: String,
    },
    /// Manage containers (`cairn container rm`).
    #[command(subcommand)]
    Container(ContainerCommand),
}

#[derive(Subcommand, Debug)]
#[command(defer = true)]
pub enum ContainerCommand {
    /// Remove exited containers: record, log and kept upper.
    Rm {
        /// Stop running ones first.
        #[arg(short, long)]
        force: bool,
        #[arg(required = true)]
        containers: Vec<String>,
    },
    /// List containers (as `cairn ps -a`).
    Ls,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Keep stdin open.
    #[arg(short, long)]
    interactive: bool,
    /// Give the container a terminal.
    #[arg(short, long)]
    tty: bool,
    /// Run in the background and print the container id.
    #[arg(short, long)]
    detach: bool,
    /// Remove the container's record when it exits (foreground containers always go).
    #[arg(long)]
    rm: bool,
    /// For an image pulled with --lazy: start it now, fetching each missing file from the registry when it is first opened (a server process serves the files until the container's rootfs is gone). A complete image runs as usual. `--lazy=on-demand` fetches only what is opened (and the prefetch list); see --lazy-fetch.
    #[arg(long, value_enum, value_name = "FETCH", num_args = 0..=1, require_equals = true)]
    lazy: Option<Option<crate::lazy_mount::LazyFetch>>,
    #[command(flatten)]
    lazy_args: crate::lazy_mount::LazyArgs,
    #[command(flatten)]
    client: crate::remote_cmds::ClientArgs,
    /// Kernel fs-verity checks of every object the container reads (overlayfs verity=require): require (refuse to start, naming the object, where one lacks fs-verity), auto (require where every object has it, else off; logged at debug) or off.
    #[arg(long, default_value = "auto", value_name = "require|auto|off")]
    verity: cairn_store::VerityChoice,
    /// A name for the container.
    #[arg(long)]
    name: Option<String>,
    /// Set KEY=VALUE in the container, or KEY to pass the host's value.
    #[arg(short, long = "env", value_name = "KEY[=VALUE]")]
    env: Vec<String>,
    /// Read KEY=VALUE lines from a file.
    #[arg(long, value_name = "FILE")]
    env_file: Vec<PathBuf>,
    /// Working directory in the container.
    #[arg(short, long)]
    workdir: Option<String>,
    /// USER[:GROUP], names or numbers (names from the image's /etc/passwd and /etc/group).
    #[arg(short, long)]
    user: Option<String>,
    /// Replace the image's entrypoint (a command, or a JSON array).
    #[arg(long)]
    entrypoint: Option<String>,
    /// Bind mount HOST:CONTAINER[:ro] (`-v HOST:CTR` works too: a `-v` whose value has a ':').
    #[arg(long = "volume", value_name = "HOST:CTR[:ro]")]
    volume: Vec<String>,
    /// Make the root filesystem read-only.
    #[arg(long)]
    read_only: bool,
    /// The container's host name (default: the short id).
    #[arg(long)]
    hostname: Option<String>,
    /// none (a private loopback; the default) or host (the default with --listen).
    #[arg(long, alias = "net", value_parser = parse_network)]
    network: Option<Network>,
    /// Memory limit, e.g. 256m.
    #[arg(short, long, value_parser = crate::parse_size)]
    memory: Option<u64>,
    /// CPU limit in CPUs, e.g. 1.5.
    #[arg(long)]
    cpus: Option<f64>,
    /// Most processes the container may have.
    #[arg(long)]
    pids_limit: Option<i64>,
    /// Writable layer: tmpfs[:SIZE] (default, capped at 1G) or disk[:SIZE] (a directory under the store, visible to du; with SIZE its own loop-mounted filesystem of that size).
    #[arg(long, default_value = "tmpfs", value_parser = parse_upper_choice)]
    upper: UpperChoice,
    /// Keep the writable layer after the container exits (`cairn container rm` removes it).
    #[arg(long)]
    keep: bool,
    /// host (none), auto (a range from the pool in <root>/userns.conf), or UID:GID:COUNT.
    #[arg(long, default_value = "host", value_parser = parse_userns)]
    userns: UsernsChoice,
    /// Start on demand: cairn listens on [HOSTADDR:]HOSTPORT, starts the container
    /// at the first connection and forwards to its CTRPORT on 127.0.0.1 (host
    /// network, so HOSTPORT must differ from CTRPORT). Needs -d.
    #[arg(long, value_name = "[HOSTADDR:]HOSTPORT:CTRPORT", value_parser = cairn_run::listen::parse_listen)]
    listen: Option<(std::net::SocketAddr, u16)>,
    /// With --listen: stop the container after this long without connections (500ms, 30s, 5m).
    #[arg(long, value_name = "DURATION", value_parser = cairn_run::listen::parse_duration)]
    idle_stop: Option<Duration>,
    /// Seconds a stop waits after the StopSignal before SIGKILL (--listen's idle stops).
    #[arg(long, default_value_t = 10)]
    stop_timeout: u64,
    /// The image: a name or a digest (prefix) of an image in the store.
    image: String,
    /// The command and its arguments (default: the image's).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ExecArgs {
    #[arg(short, long)]
    interactive: bool,
    #[arg(short, long)]
    tty: bool,
    #[arg(short, long = "env", value_name = "KEY[=VALUE]")]
    env: Vec<String>,
    #[arg(short, long)]
    workdir: Option<String>,
    #[arg(short, long)]
    user: Option<String>,
    container: String,
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

fn parse_network(s: &str) -> Result<Network, String> {
    match s {
        "none" => Ok(Network::None),
        "host" => Ok(Network::Host),
        _ => Err(format!("unsupported network {s:?}: use none or host")),
    }
}

fn parse_upper_choice(s: &str) -> Result<UpperChoice, String> {
    let (kind, size) = match s.split_once(':') {
        Some((k, size)) => (k, Some(crate::parse_size(size)?)),
        None => (s, None),
    };
    match kind {
        "tmpfs" => Ok(UpperChoice::Tmpfs { size }),
        "disk" => Ok(UpperChoice::Disk { size }),
        _ => Err(format!(
            "unknown upper {s:?}: use tmpfs[:SIZE] or disk[:SIZE]"
        )),
    }
}

fn parse_userns(s: &str) -> Result<UsernsChoice, String> {
    match s {
        "host" | "" => Ok(UsernsChoice::Host),
        "auto" => Ok(UsernsChoice::Auto),
        _ => crate::parse_idmap(s).map(UsernsChoice::Map),
    }
}

/// `-v` is cairn's global `--verbose`; among `run`'s options (before the
/// image), a `-v` whose value looks like a volume (`HOST:CTR`) means
/// `--volume`, as in podman. Arguments after the image are the
/// container's and are left alone.
pub fn rewrite_volume_flags(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    // Options of `run` (and global ones) that take a value.
    const LONG_VALUE: [&str; 18] = [
        "--name",
        "--env",
        "--env-file",
        "--workdir",
        "--user",
        "--entrypoint",
        "--volume",
        "--hostname",
        "--network",
        "--net",
        "--memory",
        "--cpus",
        "--pids-limit",
        "--upper",
        "--userns",
        "--listen",
        "--idle-stop",
        "--stop-timeout",
    ];
    const SHORT_VALUE: [char; 4] = ['e', 'w', 'u', 'm'];
    let args: Vec<OsString> = args.into_iter().collect();
    let Some(run_at) = args.iter().position(|a| a == "run") else {
        return args;
    };
    let mut out: Vec<OsString> = args[..=run_at].to_vec();
    let mut i = run_at + 1;
    while i < args.len() {
        let s = args[i].to_string_lossy().into_owned();
        if s == "--" || !s.starts_with('-') {
            // The image (or the end of options): the rest is the container's.
            break;
        }
        let next_is_volume = args
            .get(i + 1)
            .is_some_and(|n| n.to_string_lossy().contains(':'));
        if s == "-v" && next_is_volume {
            out.push(OsString::from("--volume"));
            out.push(args[i + 1].clone());
            i += 2;
            continue;
        }
        if let Some(v) = s.strip_prefix("-v").filter(|v| v.contains(':')) {
            out.push(OsString::from(format!(
                "--volume={}",
                v.trim_start_matches('=')
            )));
            i += 1;
            continue;
        }
        out.push(args[i].clone());
        let takes_value = if let Some(long) = s.strip_prefix("--") {
            !long.contains('=')
                && (LONG_VALUE.contains(&s.as_str()) || s == "--root" || s == "--runroot")
        } else {
            // -it, -e VALUE, -eVALUE, -ie VALUE: a short value option takes
            // the next token only when it ends the cluster.
            let chars: Vec<char> = s.chars().skip(1).collect();
            chars
                .iter()
                .position(|c| SHORT_VALUE.contains(c))
                .is_some_and(|p| p + 1 == chars.len())
        };
        if takes_value {
            if let Some(v) = args.get(i + 1) {
                out.push(v.clone());
                i += 1;
            }
        }
        i += 1;
    }
    out.extend(args[i..].iter().cloned());
    out
}

/// Where the containers of the store at `--root` keep their state.
pub(crate) fn paths(g: &Global) -> Paths {
    match &g.runroot {
        Some(run) => Paths::with_runroot(&g.root, run),
        None if g.root == Path::new(crate::DEFAULT_ROOT) => {
            Paths::with_runroot(&g.root, Path::new("/run/cairn"))
        }
        None => Paths::new(&g.root),
    }
}

/// Runs a container command; `run` and `exec` exit the process themselves.
pub fn run(g: &Global, cmd: RunCommand) -> Result<()> {
    match cmd {
        RunCommand::Run(args) => run_container(g, &args),
        RunCommand::Ps { all } => ps(g, all),
        RunCommand::Stop { time, containers } => {
            let p = paths(g);
            for c in &containers {
                if let Some(id) = cairn_run::listen::lookup_listener(&p, c) {
                    let l = cairn_run::listen::stop_listener(&p, &id, Duration::from_secs(time))
                        .with_context(|| format!("stopping {c}"))?;
                    output(g, &Row::from(&l), |_| c.clone())?;
                    continue;
                }
                let st = cairn_run::stop(&p, c, Duration::from_secs(time))
                    .with_context(|| format!("stopping {c}"))?;
                output(g, &Row::from(&st), |_| c.clone())?;
            }
            Ok(())
        }
        RunCommand::Kill { signal, containers } => {
            let p = paths(g);
            for c in &containers {
                let st = cairn_run::kill(&p, c, &signal).with_context(|| format!("killing {c}"))?;
                output(g, &Row::from(&st), |_| c.clone())?;
            }
            Ok(())
        }
        RunCommand::Exec(args) => exec(g, &args),
        RunCommand::Logs { follow, container } => {
            let mut out = std::io::stdout().lock();
            cairn_run::logs(&paths(g), &container, follow, &mut out)
                .with_context(|| format!("logs of {container}"))
        }
        RunCommand::Container(ContainerCommand::Rm { force, containers }) => {
            let p = paths(g);
            for c in &containers {
                if let Some(id) = cairn_run::listen::lookup_listener(&p, c) {
                    let l = cairn_run::listen::stop_listener(&p, &id, Duration::ZERO)
                        .with_context(|| format!("removing {c}"))?;
                    output(g, &Row::from(&l), |_| c.clone())?;
                    continue;
                }
                let st =
                    cairn_run::remove(&p, c, force).with_context(|| format!("removing {c}"))?;
                output(g, &Row::from(&st), |_| c.clone())?;
            }
            Ok(())
        }
        RunCommand::Container(ContainerCommand::Ls) => ps(g, true),
    }
}

fn env_from(entries: &[String], files: &[PathBuf]) -> Result<Vec<String>> {
    let mut env = Vec::new();
    let mut add = |e: &str| {
        if e.contains('=') {
            env.push(e.to_string());
        } else if let Ok(v) = std::env::var(e) {
            env.push(format!("{e}={v}"));
        }
    };
    for f in files {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading env file {}", f.display()))?;
        for line in text.lines() {
            let line = line.trim();
            if !line.is_empty() && !line.starts_with('#') {
                add(line);
            }
        }
    }
    for e in entries {
        add(e);
    }
    Ok(env)
}

fn parse_volume(v: &str) -> Result<Volume> {
    let parts: Vec<&str> = v.split(':').collect();
    let (host, ctr, opts) = match parts[..] {
        [h, c] => (h, c, ""),
        [h, c, o] => (h, c, o),
        _ => bail!("invalid volume {v:?}: expected HOST:CONTAINER[:ro]"),
    };
    let mut readonly = false;
    for o in opts.split(',').filter(|o| !o.is_empty()) {
        match o {
            "ro" => readonly = true,
            "rw" => readonly = false,
            _ => bail!("invalid volume option {o:?} in {v:?}: use ro or rw"),
        }
    }
    if !ctr.starts_with('/') {
        bail!("invalid volume {v:?}: the container path must be absolute");
    }
    let host = std::path::absolute(Path::new(host))
        .with_context(|| format!("volume {v:?}"))?
        .display()
        .to_string();
    Ok(Volume {
        host,
        container: ctr.to_string(),
        readonly,
    })
}

fn spec_of(args: &RunArgs) -> Result<RunSpec> {
    let entrypoint = match &args.entrypoint {
        None => None,
        Some(e) if e.trim_start().starts_with('[') => Some(
            serde_json::from_str::<Vec<String>>(e)
                .with_context(|| format!("--entrypoint {e:?} is not a JSON array of strings"))?,
        ),
        Some(e) => Some(vec![e.clone()]),
    };
    Ok(RunSpec {
        image: args.image.clone(),
        command: args.command.clone(),
        entrypoint,
        name: args.name.clone(),
        env: env_from(&args.env, &args.env_file)?,
        workdir: args.workdir.clone(),
        user: args.user.clone(),
        hostname: args.hostname.clone(),
        volumes: args
            .volume
            .iter()
            .map(|v| parse_volume(v))
            .collect::<Result<_>>()?,
        read_only: args.read_only,
        network: args.network.unwrap_or(if args.listen.is_some() {
            Network::Host
        } else {
            Network::None
        }),
        limits: Limits {
            memory: args.memory,
            cpus: args.cpus,
            pids: args.pids_limit,
        },
        upper: args.upper,
        keep: args.keep,
        userns: args.userns,
        interactive: args.interactive,
        tty: args.tty,
        detach: args.detach,
        remove: args.rm,
        data_layer: None,
        local_first: false,
        verity: args.verity,
    })
}

/// For `--lazy` and an incomplete image: its FUSE data layer, served by a
/// process of its own (started now, while this process has one thread).
fn lazy_layer(
    g: &Global,
    args: &RunArgs,
    spec: &mut RunSpec,
) -> Result<Option<crate::lazy_mount::LazyLayer>> {
    let Some(mode) = args.lazy else {
        return Ok(None);
    };
    let lazy_args = args.lazy_args.with_mode(mode)?;
    if args.listen.is_some() {
        bail!("--lazy and --listen together are not supported yet");
    }
    let store = cairn_store::Store::open(&g.root)
        .with_context(|| format!("opening the store at {}", g.root.display()))?;
    let digest = {
        let _lock = store.lock_shared().context("locking the store")?;
        store
            .resolve_image(&args.image)
            .with_context(|| format!("resolving image {}", args.image))?
            .digest
    };
    let Some(digest) = digest else {
        return Ok(None);
    };
    let incomplete = store
        .image_record(&digest)
        .ok()
        .flatten()
        .is_some_and(|r| r.lazy.is_some());
    if !incomplete {
        tracing::info!("image {} is complete: run from the store", args.image);
        return Ok(None);
    }
    let layer = crate::lazy_mount::LazyLayer::start(
        store.root(),
        &digest,
        &args.client.options(),
        &lazy_args,
    )?;
    spec.data_layer = Some(layer.path().to_path_buf());
    // The store's objects before the lazy layer, except while recording a
    // prefetch list: the list must name every file opened, and the lazy
    // server sees only the opens of files the store lacks.
    spec.local_first = args.lazy_args.record_prefetch.is_none();
    Ok(Some(layer))
}

fn run_container(g: &Global, args: &RunArgs) -> Result<()> {
    let result = spec_of(args).and_then(|mut spec| {
        let p = paths(g);
        let lazy = lazy_layer(g, args, &mut spec)?;
        if let Some((host, container_port)) = args.listen {
            if !spec.detach {
                bail!("--listen needs -d: the proxy runs in the background");
            }
            let listening = cairn_run::listen::start_listener(
                &p,
                &cairn_run::ListenSpec {
                    run: spec,
                    host,
                    container_port,
                    idle_stop: args.idle_stop,
                    stop_timeout: Duration::from_secs(args.stop_timeout),
                },
            )?;
            if g.json {
                output(g, &listening, |_| String::new())?;
            } else {
                println!("{}", listening.id);
            }
            return Ok(0);
        }
        if args.idle_stop.is_some() {
            bail!("--idle-stop needs --listen");
        }
        if spec.detach {
            let started = cairn_run::start_detached(&p, &spec)?;
            // The rootfs stands on the layer now: its server serves until
            // the rootfs is gone.
            if let Some(layer) = lazy {
                layer.attached()?;
            }
            if g.json {
                output(g, &started, |_| String::new())?;
            } else {
                // Always, as podman: scripts capture it.
                println!("{}", started.id);
            }
            if let Some(u) = &started.upper {
                eprintln!("cairn: the upper layer will be kept at {}", u.display());
            }
            Ok(0)
        } else {
            let keep = spec.keep;
            let code = cairn_run::run_foreground(&p, &spec)?;
            if let Some(layer) = lazy {
                layer.attached()?;
            }
            if keep {
                eprintln!(
                    "cairn: kept the upper layer under {} (remove it with `cairn container rm`)",
                    p.data_dirs().display()
                );
            }
            Ok(code)
        }
    });
    match result {
        Ok(code) => cairn_run::exit_now(code),
        Err(e) => {
            eprintln!("cairn: {e:#}");
            cairn_run::exit_now(125)
        }
    }
}

fn exec(g: &Global, args: &ExecArgs) -> Result<()> {
    let spec = ExecSpec {
        args: args.command.clone(),
        interactive: args.interactive,
        tty: args.tty,
        env: env_from(&args.env, &[]).unwrap_or_default(),
        workdir: args.workdir.clone(),
        user: args.user.clone(),
    };
    match cairn_run::exec(&paths(g), &args.container, &spec) {
        Ok(code) => cairn_run::exit_now(code),
        Err(e) => {
            eprintln!("cairn: exec in {}: {e:#}", args.container);
            cairn_run::exit_now(125)
        }
    }
}

/// One container as `ps` shows it.
#[derive(Serialize)]
struct Row {
    id: String,
    name: String,
    image: String,
    image_digest: String,
    command: Vec<String>,
    created: String,
    /// creating, running, exited; for a listener waiting, starting, active, stopping.
    status: String,
    exit_code: Option<i32>,
    pid: Option<i32>,
    upper: String,
    kept_upper: Option<PathBuf>,
    userns: Option<String>,
    detached: bool,
    /// Set for an on-demand listener (`run --listen`).
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<ListenRow>,
}

/// What `ps` shows of a listener.
#[derive(Serialize)]
struct ListenRow {
    address: String,
    container_port: u16,
    idle_stop_ms: Option<u64>,
    proxy_pid: Option<i32>,
    container: Option<String>,
    starts: u64,
    connections: u64,
    last_error: Option<String>,
}

impl From<&ListenState> for Row {
    fn from(l: &ListenState) -> Self {
        Row {
            id: l.id.clone(),
            name: l.name.clone(),
            image: l.image.clone(),
            image_digest: String::new(),
            command: l.command.clone(),
            created: crate::store_cmds::rfc3339(
                SystemTime::UNIX_EPOCH + Duration::from_secs(l.created),
            ),
            status: status_word(&l.status),
            exit_code: None,
            pid: None,
            upper: String::new(),
            kept_upper: None,
            userns: None,
            detached: true,
            listen: Some(ListenRow {
                address: l.listen.clone(),
                container_port: l.container_port,
                idle_stop_ms: l.idle_stop_ms,
                proxy_pid: l.proxy_pid,
                container: l.container.clone(),
                starts: l.starts,
                connections: l.connections,
                last_error: l.last_error.clone(),
            }),
        }
    }
}

fn status_word<T: Serialize>(s: &T) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

impl From<&State> for Row {
    fn from(s: &State) -> Self {
        Row {
            id: s.id.clone(),
            name: s.name.clone(),
            image: s.image.clone(),
            image_digest: s.image_digest.clone(),
            command: s.command.clone(),
            created: crate::store_cmds::rfc3339(
                SystemTime::UNIX_EPOCH + Duration::from_secs(s.created),
            ),
            status: status_word(&s.status),
            exit_code: s.exit_code,
            pid: s.pid,
            upper: match &s.upper {
                cairn_run::state::UpperKind::Tmpfs { size } => {
                    format!("tmpfs:{}", crate::store_cmds::human_bytes(*size))
                }
                cairn_run::state::UpperKind::Disk { size: None } => "disk".into(),
                cairn_run::state::UpperKind::Disk { size: Some(size) } => {
                    format!("disk:{}", crate::store_cmds::human_bytes(*size))
                }
            },
            kept_upper: s.kept_upper.clone(),
            userns: s.userns.map(|u| format!("{}:{}:{}", u.uid, u.gid, u.count)),
            detached: s.detached,
            listen: None,
        }
    }
}

fn ago(secs: u64) -> String {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(secs);
    let d = now.saturating_sub(secs);
    match d {
        0..=59 => format!("{d} seconds"),
        60..=3599 => format!("{} minutes", d / 60),
        3600..=86_399 => format!("{} hours", d / 3600),
        _ => format!("{} days", d / 86_400),
    }
}

fn ps(g: &Global, all: bool) -> Result<()> {
    let states = cairn_run::list(&paths(g), all).context("listing containers")?;
    let listeners = cairn_run::listen::list_listeners(&paths(g)).context("listing listeners")?;
    if g.quiet && !g.json {
        // podman's `ps -q`: ids only.
        for id in listeners
            .iter()
            .map(|l| &l.id)
            .chain(states.iter().map(|s| &s.id))
        {
            println!("{}", &id[..12]);
        }
        return Ok(());
    }
    let rows: Vec<Row> = listeners
        .iter()
        .map(Row::from)
        .chain(states.iter().map(Row::from))
        .collect();
    output(g, &rows, |_| {
        let mut lines = vec![format!(
            "{:<14}{:<24}{:<24}{:<16}{:<30}{}",
            "CONTAINER ID", "IMAGE", "COMMAND", "CREATED", "STATUS", "NAMES"
        )];
        for l in &listeners {
            let what = match l.status {
                ListenStatus::Waiting => "Waiting",
                ListenStatus::Starting => "Starting",
                ListenStatus::Active => "Active",
                ListenStatus::Stopping => "Stopping",
            };
            let mut image = l.image.clone();
            if image.chars().count() > 22 {
                image = image.chars().take(20).collect::<String>() + "…";
            }
            lines.push(format!(
                "{:<14}{:<24}{:<24}{:<16}{:<30}{}",
                &l.id[..12],
                image,
                format!("listen →:{}", l.container_port),
                format!("{} ago", ago(l.created)),
                format!("{what} on {}", l.listen),
                l.name
            ));
        }
        for s in &states {
            let status = match s.status {
                Status::Creating => "Created".to_string(),
                Status::Running => format!("Up {}", ago(s.created)),
                Status::Exited => format!(
                    "Exited ({}) {} ago",
                    s.exit_code.unwrap_or(-1),
                    ago(s.finished.unwrap_or(s.created))
                ),
            };
            let mut command = s.command.join(" ");
            if command.chars().count() > 22 {
                command = command.chars().take(20).collect::<String>() + "…";
            }
            let mut image = s.image.clone();
            if image.chars().count() > 22 {
                image = image.chars().take(20).collect::<String>() + "…";
            }
            lines.push(format!(
                "{:<14}{:<24}{:<24}{:<16}{:<30}{}",
                &s.id[..12],
                image,
                command,
                format!("{} ago", ago(s.created)),
                status,
                s.name
            ));
        }
        lines.join("\n")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn volume_flags_before_the_image_become_volumes() {
        assert_eq!(
            rewrite_volume_flags(os(&[
                "cairn", "-v", "run", "-v", "/a:/b", "img", "grep", "-v", "x:y"
            ])),
            os(&["cairn", "-v", "run", "--volume", "/a:/b", "img", "grep", "-v", "x:y"])
        );
        assert_eq!(
            rewrite_volume_flags(os(&[
                "cairn",
                "run",
                "-v/a:/b:ro",
                "-e",
                "A=1",
                "-v",
                "img"
            ])),
            os(&[
                "cairn",
                "run",
                "--volume=/a:/b:ro",
                "-e",
                "A=1",
                "-v",
                "img"
            ])
        );
        assert_eq!(
            rewrite_volume_flags(os(&[
                "cairn", "run", "--name", "x:y", "-it", "-v", "/c:/d", "img"
            ])),
            os(&["cairn", "run", "--name", "x:y", "-it", "--volume", "/c:/d", "img"])
        );
        assert_eq!(
            rewrite_volume_flags(os(&["cairn", "run", "--", "-v", "/a:/b"])),
            os(&["cairn", "run", "--", "-v", "/a:/b"])
        );
        assert_eq!(
            rewrite_volume_flags(os(&["cairn", "-v", "ps"])),
            os(&["cairn", "-v", "ps"])
        );
    }

    #[test]
    fn parses_volumes_uppers_and_userns() {
        let v = parse_volume("/data:/mnt:ro").unwrap();
        assert_eq!(
            (v.host.as_str(), v.container.as_str(), v.readonly),
            ("/data", "/mnt", true)
        );
        assert!(parse_volume("/data").is_err());
        assert!(parse_volume("/a:rel").is_err());
        assert_eq!(
            parse_upper_choice("tmpfs:64M").unwrap(),
            UpperChoice::Tmpfs {
                size: Some(64 << 20)
            }
        );
        assert_eq!(
            parse_upper_choice("disk").unwrap(),
            UpperChoice::Disk { size: None }
        );
        assert!(parse_upper_choice("zfs").is_err());
        assert_eq!(parse_userns("auto").unwrap(), UsernsChoice::Auto);
        assert!(matches!(
            parse_userns("1:2:3").unwrap(),
            UsernsChoice::Map(_)
        ));
    }
}
