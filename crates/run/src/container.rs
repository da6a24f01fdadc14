//! Setting a container up (bundle, rootfs, cgroups, user namespace) and
//! tearing it down again.
//!
//! [`prepare`] does everything up to the point where crun can start; every
//! resource it takes is recorded in `state.json` *before* it is taken, so
//! that [`teardown`], run from the monitor or from a reaper after a crash,
//! frees exactly what exists. Teardown is idempotent.

use std::ffi::{CString, OsString};
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use cairn_mount::{IdMap, MountOptions, PreparedMount, UpperSpec, VerityMode};
use cairn_store::{Store, StoreLock};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use crate::cgroup::{self, Layout};
use crate::console::ConsoleListener;
use crate::image_config::{resolve_user, ImageConfig};
use crate::monitor;
use crate::spec::{self, build_spec, merge_env, Limits, Network, SpecInput, Volume, DEFAULT_PATH};
use crate::state::{self, Locked, Paths, State, Status, UpperKind, UsernsRange};
use crate::sys::{
    fork_child_monitor, fork_monitor, Forked, NsSetup, SpawnError, SpawnSpec, Spawned,
};
use crate::userns::{self, Pool};
use crate::{crun, RunError};

/// The default cap of a tmpfs upper: 1 GiB. tmpfs pages are only used
/// when written, so the cap costs nothing until a container writes; it
/// keeps a runaway container from eating the host's memory.
pub const DEFAULT_TMPFS_SIZE: u64 = 1 << 30;

/// The file behind a size-capped disk upper, in the container's directory.
const DISK_IMAGE: &str = "upper.img";
/// In the data directory of a container run with `--keep`: its upper stays
/// even when the record is gone (a reboot emptied the run root).
pub(crate) const KEEP_MARKER: &str = "keep";

/// `--upper`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpperChoice {
    /// A tmpfs of at most `size` bytes (default [`DEFAULT_TMPFS_SIZE`]).
    Tmpfs { size: Option<u64> },
    /// A host directory under `<root>/containers/<id>/`.
    Disk { size: Option<u64> },
}

impl Default for UpperChoice {
    fn default() -> Self {
        UpperChoice::Tmpfs { size: None }
    }
}

/// `--userns`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UsernsChoice {
    /// No user namespace: container root is host root.
    #[default]
    Host,
    /// A range from the pool.
    Auto,
    /// This range.
    Map(IdMap),
}

/// Everything `cairn run` was asked for.
#[derive(Debug, Clone, Default)]
pub struct RunSpec {
    pub image: String,
    /// Replaces the image's Cmd when not empty.
    pub command: Vec<String>,
    /// `--entrypoint`: replaces the image's Entrypoint (and drops its Cmd).
    pub entrypoint: Option<Vec<String>>,
    pub name: Option<String>,
    /// `KEY=VALUE` entries, already resolved (`-e KEY` from the host env,
    /// `--env-file`), applied after the image's.
    pub env: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub hostname: Option<String>,
    pub volumes: Vec<Volume>,
    pub read_only: bool,
    pub network: Network,
    pub limits: Limits,
    pub upper: UpperChoice,
    pub keep: bool,
    pub userns: UsernsChoice,
    pub interactive: bool,
    pub tty: bool,
    pub detach: bool,
    /// `--rm`: also remove a detached container's record when it exits
    /// (a foreground container's record always goes).
    pub remove: bool,
}

/// A started detached container.
#[derive(Debug, Clone, Serialize)]
pub struct Started {
    pub id: String,
    pub name: String,
    /// Where a kept upper will be.
    pub upper: Option<PathBuf>,
}

/// A container ready for crun: what the monitor needs.
pub(crate) struct Prepared {
    pub locked: Locked,
    pub state: State,
    pub mount: PreparedMount,
    pub bundle: Bundle,
    pub store_lock: Option<StoreLock>,
    pub console: Option<ConsoleListener>,
}

impl Prepared {
    pub fn dir(&self) -> &Path {
        &self.locked.dir
    }
}

fn has_cap_sys_resource() -> bool {
    use rustix::thread::{capabilities, CapabilitySet};
    capabilities(None).is_ok_and(|c| c.effective.contains(CapabilitySet::SYS_RESOURCE))
}

fn nofile_limit() -> u64 {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .maximum
        .unwrap_or(1 << 20);
    if has_cap_sys_resource() {
        let nr_open = fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20);
        (1u64 << 20).min(nr_open).max(hard.min(nr_open))
    } else {
        // Raising it needs CAP_SYS_RESOURCE, which this host's bounding
        // set may lack: stay within what we have.
        hard
    }
}

fn mount_fd_path(fd: BorrowedFd<'_>, rel: &str) -> Option<OwnedFd> {
    rustix::fs::openat2(
        fd,
        rel.trim_start_matches('/'),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT,
    )
    .ok()
}

/// Reads a small file of the rootfs, symlinks resolved inside it.
fn read_in_root(root: BorrowedFd<'_>, rel: &str) -> Option<String> {
    let fd = mount_fd_path(root, rel)?;
    let mut s = String::new();
    fs::File::from(fd)
        .take(4 << 20)
        .read_to_string(&mut s)
        .ok()?;
    Some(s)
}

/// Creates `path` (absolute, in the container) in the rootfs if missing.
fn ensure_dir_in_root(root: BorrowedFd<'_>, path: &str) -> Result<(), RunError> {
    let mut prefix = String::new();
    for part in path.split('/').filter(|p| !p.is_empty() && *p != ".") {
        if part == ".." {
            return Err(RunError::Invalid(format!(
                "working directory {path:?} has '..'"
            )));
        }
        let parent = if prefix.is_empty() {
            ".".to_string()
        } else {
            prefix.clone()
        };
        prefix = if prefix.is_empty() {
            part.to_string()
        } else {
            format!("{prefix}/{part}")
        };
        if mount_fd_path(root, &prefix).is_some() {
            continue;
        }
        let dirfd = rustix::fs::openat2(
            root,
            parent.as_str(),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT,
        )
        .map_err(|e| RunError::Invalid(format!("working directory {path:?}: {e}")))?;
        match rustix::fs::mkdirat(&dirfd, part, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => {
                return Err(RunError::Invalid(format!(
                    "creating working directory {path:?}: {e}"
                )))
            }
        }
    }
    Ok(())
}

/// A new detached tmpfs of at most `size` bytes, root directory mode 0755.
fn new_tmpfs(size: u64) -> rustix::io::Result<OwnedFd> {
    use rustix::mount::{
        fsconfig_create, fsconfig_set_string, fsmount, fsopen, FsMountFlags, FsOpenFlags,
        MountAttrFlags,
    };
    let fs = fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
    fsconfig_set_string(&fs, "size", size.to_string().as_str())?;
    fsconfig_set_string(&fs, "mode", "0755")?;
    fsconfig_create(&fs)?;
    fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::empty())
}

/// Mounts a host tmpfs (for a kept tmpfs upper) at `target`.
fn mount_host_tmpfs(target: &Path, size: u64) -> Result<(), RunError> {
    use rustix::mount::{move_mount, MoveMountFlags};
    let run = || -> rustix::io::Result<()> {
        let m = new_tmpfs(size)?;
        move_mount(
            &m,
            "",
            rustix::fs::CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    fs::create_dir_all(target).map_err(|e| RunError::io("creating", target, e))?;
    run().map_err(|e| RunError::io("mounting a tmpfs upper at", target, e.into()))
}

/// The cap of a bundle tmpfs: config.json, /etc/hosts and the like.
const BUNDLE_TMPFS_SIZE: u64 = 4 << 20;

/// The OCI bundle: `config.json`, the files bind-mounted into `/etc` and
/// the `rootfs/` mount point, on a small detached tmpfs that the monitor
/// attaches only in crun's private mount namespace (as it does the rootfs).
/// Creating and removing these files on the store's filesystem cost more
/// than the rest of the bundle work together (ext4 is slow to reuse inodes
/// freed a moment ago, which every container start after another does); on
/// tmpfs they cost microseconds, and the kernel frees them with the
/// namespace.
///
/// Every container's bundle is attached at the same place,
/// [`Paths::bundle_mountpoint`], each in its own namespace: no directory of
/// a container's record is a mount point anywhere. Removing one that is
/// (in any namespace) makes the kernel detach the mounts on it there and
/// then, the rootfs stack included (~0.3 ms here, on the way to `cairn
/// run` returning); this way they go when the monitor lets go of crun's
/// namespace.
pub(crate) struct Bundle {
    fd: OwnedFd,
    /// Where crun sees it.
    path: PathBuf,
}

impl Bundle {
    fn new(paths: &Paths) -> Result<Self, RunError> {
        let path = paths.bundle_mountpoint();
        fs::create_dir_all(&path).map_err(|e| RunError::io("creating", &path, e))?;
        let fd = new_tmpfs(BUNDLE_TMPFS_SIZE)
            .map_err(|e| RunError::io("mounting the bundle tmpfs for", &path, e.into()))?;
        rustix::fs::mkdirat(&fd, "rootfs", Mode::from_raw_mode(0o755))
            .map_err(|e| RunError::io("creating", path.join("rootfs"), e.into()))?;
        Ok(Bundle { fd, path })
    }

    /// Writes `name` into the bundle; returns its path as crun sees it.
    fn write(&self, name: &str, data: &[u8]) -> Result<PathBuf, RunError> {
        let path = self.path.join(name);
        let run = || -> io::Result<()> {
            let fd = rustix::fs::openat(
                &self.fd,
                name,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )?;
            fs::File::from(fd).write_all(data)
        };
        run().map_err(|e| RunError::io("writing", &path, e))?;
        Ok(path)
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

fn etc_files(
    bundle: &Bundle,
    spec: &RunSpec,
    hostname: &str,
) -> Result<Vec<(String, String)>, RunError> {
    let write = |name: &str, text: String| -> Result<String, RunError> {
        Ok(bundle.write(name, text.as_bytes())?.display().to_string())
    };
    let (hosts, resolv) = match spec.network {
        Network::Host => {
            let mut hosts = fs::read_to_string("/etc/hosts").unwrap_or_default();
            if !hosts.ends_with('\n') && !hosts.is_empty() {
                hosts.push('\n');
            }
            hosts.push_str(&format!("127.0.1.1\t{hostname}\n"));
            let resolv = fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
            (hosts, resolv)
        }
        Network::None => (
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
            ),
            // Nothing to resolve with: loopback only.
            "# cairn: --network none, no name servers\noptions ndots:0\n".to_string(),
        ),
    };
    Ok(vec![
        ("/etc/hosts".into(), write("hosts", hosts)?),
        ("/etc/resolv.conf".into(), write("resolv.conf", resolv)?),
        (
            "/etc/hostname".into(),
            write("hostname", format!("{hostname}\n"))?,
        ),
    ])
}

/// Sets the container up to the point where crun can run it. On error,
/// everything taken so far is released.
pub(crate) fn prepare(paths: &Paths, spec: &RunSpec) -> Result<Prepared, RunError> {
    if let UpperChoice::Disk { size: Some(size) } = spec.upper {
        if size < cairn_mount::MIN_DISK_UPPER {
            return Err(RunError::Invalid(format!(
                "--upper disk:SIZE: at least {} MiB",
                cairn_mount::MIN_DISK_UPPER >> 20
            )));
        }
    }
    if let Some(name) = &spec.name {
        state::validate_name(name)?;
    }
    let store = Store::open(paths.root())?;
    // A store made wider (or by an older cairn) is private again from its
    // first container on; the run root is made private with the record.
    store.make_private_or_warn();
    // Held until crun has attached the rootfs (and so shows it in a mount
    // table, where gc looks): gc cannot remove the image in between.
    let store_lock = store.lock_shared()?;
    let resolved = store.resolve_image(&spec.image)?;
    let Some(digest) = resolved.digest.clone() else {
        return Err(RunError::Invalid(format!(
            "{} is an image file, not an image in the store at {} (add it with `cairn mkfs --store` or `cairn import`)",
            spec.image,
            paths.root().display()
        )));
    };
    let config = match store.image_record(&digest)? {
        Some(rec) => ImageConfig::parse(&rec.config).map_err(RunError::Invalid)?,
        None => ImageConfig::fallback(),
    };
    let args = config.args(spec.entrypoint.as_deref(), &spec.command);
    if args.is_empty() {
        return Err(RunError::Invalid(format!(
            "no command given and image {} has neither Entrypoint nor Cmd",
            spec.image
        )));
    }

    let id = state::new_id();
    let name = spec.name.clone().unwrap_or_else(|| id[..12].to_string());
    let layout = cgroup::detect();
    // Planned (not made) now, so that the first state write records them.
    let cgroups = cgroup::plan(&id, layout, &spec.limits)
        .map_err(|e| RunError::io("setting up cgroups for", paths.container(&id), e))?;
    let locked = state::create_dir(paths, &id)?;
    let dir = locked.dir.clone();
    let data = paths.data_dir(&id);
    let mut st = State {
        id: id.clone(),
        name: name.clone(),
        image: spec.image.clone(),
        image_digest: digest.clone(),
        command: args.clone(),
        created: state::now(),
        status: Status::Creating,
        pid: None,
        monitor_pid: None,
        exit_code: None,
        finished: None,
        upper: match spec.upper {
            UpperChoice::Tmpfs { size } => UpperKind::Tmpfs {
                size: size.unwrap_or(DEFAULT_TMPFS_SIZE),
            },
            UpperChoice::Disk { size } => UpperKind::Disk { size },
        },
        keep: spec.keep,
        kept_upper: None,
        remove: !spec.keep && (!spec.detach || spec.remove),
        detached: spec.detach,
        tty: spec.tty,
        userns: None,
        log_path: spec.detach.then(|| data.join("ctr.log")),
        stop_signal: config
            .stop_signal
            .clone()
            .unwrap_or_else(|| "SIGTERM".into()),
        cgroups: Some(cgroups.clone()),
        limits: spec.limits,
    };
    // A failure from here on tears down what the state records; a crash
    // leaves it for the reaper.
    let fail = |st: &State, e: RunError| -> RunError {
        let mut st = st.clone();
        st.remove = true;
        for p in teardown(paths, &mut st) {
            tracing::warn!("{p}");
        }
        e
    };
    state::write_state(&dir, &st).map_err(|e| fail(&st, e))?;
    // On disk, after the record that makes the reaper remove it: what a
    // container keeps or writes for later (only some have any).
    if spec.detach || spec.keep || matches!(spec.upper, UpperChoice::Disk { .. }) {
        paths.create_data_dir(&id).map_err(|e| fail(&st, e))?;
        if spec.keep {
            let marker = data.join(KEEP_MARKER);
            state::write_private(&marker, format!("{}\n", st.name).as_bytes())
                .map_err(|e| fail(&st, RunError::io("writing", &marker, e)))?;
        }
    }
    // A default name is the id's first 12 digits, which `lookup` finds as
    // an id prefix: only a chosen name needs a claim (on this store's disk
    // a claim is a block allocated and discarded per container).
    if spec.name.is_some() {
        if let Err(e) = claim_name_reaping(paths, &name, &id) {
            // Not ours: don't release the name at teardown.
            st.name = String::new();
            return Err(fail(&st, e));
        }
    }

    let idmap = match spec.userns {
        UsernsChoice::Host => None,
        UsernsChoice::Map(m) => {
            m.validate().map_err(|e| fail(&st, RunError::Invalid(e)))?;
            st.userns = Some(UsernsRange {
                uid: m.uid,
                gid: m.gid,
                count: m.count,
                slot: None,
            });
            Some(m)
        }
        UsernsChoice::Auto => {
            let pool = Pool::load(paths).map_err(|e| fail(&st, e))?;
            let r = userns::allocate(paths, &pool, &id).map_err(|e| fail(&st, e))?;
            st.userns = Some(r);
            state::write_state(&dir, &st).map_err(|e| fail(&st, e))?;
            Some(IdMap {
                uid: r.uid,
                gid: r.gid,
                count: r.count,
            })
        }
    };

    let upper = match (spec.upper, spec.keep) {
        (UpperChoice::Tmpfs { size }, false) => UpperSpec::Tmpfs {
            size: Some(size.unwrap_or(DEFAULT_TMPFS_SIZE)),
        },
        (UpperChoice::Tmpfs { size }, true) => {
            let at = data.join("upperfs");
            st.kept_upper = Some(at.join("upper"));
            state::write_state(&dir, &st).map_err(|e| fail(&st, e))?;
            mount_host_tmpfs(&at, size.unwrap_or(DEFAULT_TMPFS_SIZE)).map_err(|e| fail(&st, e))?;
            UpperSpec::Dir(at)
        }
        (UpperChoice::Disk { size: None }, keep) => {
            if keep {
                st.kept_upper = Some(data.join("upper"));
            }
            UpperSpec::Dir(data.clone())
        }
        (UpperChoice::Disk { size: Some(size) }, keep) => {
            // Its own filesystem of that size (see cairn_mount::disk),
            // mounted on the host like a kept tmpfs upper.
            let at = data.join("upperfs");
            if keep {
                st.kept_upper = Some(at.join("upper"));
            }
            state::write_state(&dir, &st).map_err(|e| fail(&st, e))?;
            cairn_mount::mount_sized_upper(&data.join(DISK_IMAGE), size, &at)
                .map_err(|e| fail(&st, e.into()))?;
            UpperSpec::Dir(at)
        }
    };
    let bundle = Bundle::new(paths).map_err(|e| fail(&st, e))?;
    let rootfs = bundle.path().join("rootfs");
    let image = store.image_path(&digest);
    let objects = store.objects_dir();
    let mount = cairn_mount::prepare_image(&MountOptions {
        image: &image,
        objects: &objects,
        target: &rootfs,
        upper,
        idmap,
        verity: VerityMode::Off,
    })
    .map_err(|e| fail(&st, e.into()))?;

    let root_fd = mount.as_fd();
    let user_spec = spec
        .user
        .clone()
        .or_else(|| config.user.clone())
        .unwrap_or_else(|| "0:0".into());
    let passwd = read_in_root(root_fd, "etc/passwd");
    let group = read_in_root(root_fd, "etc/group");
    let user = resolve_user(&user_spec, passwd.as_deref(), group.as_deref())
        .map_err(|e| fail(&st, RunError::Invalid(format!("--user {user_spec}: {e}"))))?;
    let cwd = spec
        .workdir
        .clone()
        .or_else(|| config.working_dir.clone())
        .unwrap_or_else(|| "/".into());
    if !cwd.starts_with('/') {
        return Err(fail(
            &st,
            RunError::Invalid(format!("the working directory {cwd:?} must be absolute")),
        ));
    }
    ensure_dir_in_root(root_fd, &cwd).map_err(|e| fail(&st, e))?;

    let hostname = spec
        .hostname
        .clone()
        .unwrap_or_else(|| id[..12].to_string());
    let mut env_layers: Vec<String> = Vec::new();
    if !config.env.iter().any(|e| e.starts_with("PATH=")) {
        env_layers.push(format!("PATH={DEFAULT_PATH}"));
    }
    env_layers.extend(config.env.iter().cloned());
    env_layers.push(format!("HOSTNAME={hostname}"));
    env_layers.push("container=cairn".into());
    if spec.tty {
        env_layers.push("TERM=xterm".into());
    }
    if !config.env.iter().any(|e| e.starts_with("HOME=")) {
        env_layers.push(format!(
            "HOME={}",
            user.home.clone().unwrap_or_else(|| "/".into())
        ));
    }
    env_layers.extend(spec.env.iter().cloned());
    let env = merge_env(env_layers.iter().map(String::as_str));

    let etc = etc_files(&bundle, spec, &hostname).map_err(|e| fail(&st, e))?;
    for v in &spec.volumes {
        if !Path::new(&v.host).exists() {
            return Err(fail(
                &st,
                RunError::Invalid(format!(
                    "-v {}: no such file or directory on the host",
                    v.host
                )),
            ));
        }
    }

    // The groups were recorded in the first state write, before this, so
    // a crash in between leaves them to the reaper.
    let cg = cgroups;
    cgroup::make(&cg, &spec.limits)
        .map_err(|e| fail(&st, RunError::io("setting up cgroups for", &dir, e)))?;
    let resources = match layout {
        Layout::Hybrid => None,
        Layout::Legacy => spec::resources_for(&spec.limits, true),
        Layout::Unified => spec::resources_for(&spec.limits, has_cap_sys_resource()),
    };

    let oci = build_spec(&SpecInput {
        args,
        env,
        cwd,
        user: spec::User {
            uid: user.uid,
            gid: user.gid,
            additional_gids: user.additional_gids,
        },
        terminal: spec.tty,
        hostname,
        readonly_root: spec.read_only,
        network: spec.network,
        volumes: spec.volumes.clone(),
        etc_files: etc,
        idmap,
        cgroups_path: cg.crun_path.clone(),
        resources,
        nofile: nofile_limit(),
    });
    let json = spec::config_json(&oci);
    bundle
        .write("config.json", &json)
        .map_err(|e| fail(&st, e))?;

    let console = if spec.tty {
        // In the bundle, where crun runs: crun gets a relative path.
        Some(
            ConsoleListener::bind_in(bundle.as_fd(), bundle.path(), "console.sock").map_err(
                |e| {
                    fail(
                        &st,
                        RunError::io("listening on", bundle.path().join("console.sock"), e),
                    )
                },
            )?,
        )
    } else {
        None
    };
    Ok(Prepared {
        locked,
        state: st,
        mount,
        bundle,
        store_lock: Some(store_lock),
        console,
    })
}

/// Claims `name`; if another container holds it, reaps that one first
/// (it may be an abandoned one) and tries once more.
fn claim_name_reaping(paths: &Paths, name: &str, id: &str) -> Result<(), RunError> {
    match state::claim_name(paths, name, id) {
        Ok(()) => Ok(()),
        Err(first) => {
            if let Ok(owner) = fs::read_link(paths.names().join(name)) {
                if let Some(owner) = owner.to_str() {
                    crate::lifecycle::reap_one(paths, owner);
                }
            }
            state::claim_name(paths, name, id).map_err(|_| first)
        }
    }
}

/// Releases everything `st` records, and the record itself when
/// `st.remove`; otherwise marks it exited. Returns the problems met (each
/// is also left for the next reaper to retry).
pub fn teardown(paths: &Paths, st: &mut State) -> Vec<String> {
    let mut problems = Vec::new();
    let dir = paths.container(&st.id);
    let data = paths.data_dir(&st.id);
    if let Err(e) = crun::delete(paths, st.cgroups.as_ref(), &st.id) {
        problems.push(format!("crun delete {}: {e}", st.id));
    }
    if let Some(cg) = &st.cgroups {
        problems.extend(cgroup::remove(cg));
    }
    if let Some(UsernsRange {
        slot: Some(slot), ..
    }) = st.userns
    {
        userns::free(paths, slot, &st.id);
    }
    if !st.keep || st.remove {
        let upperfs = data.join("upperfs");
        if cairn_mount::is_mountpoint(&upperfs).unwrap_or(false) {
            let _ = cairn_mount::umount_with(&upperfs, cairn_mount::UmountOptions { lazy: true });
        }
        if let Err(e) = fs::remove_file(data.join(DISK_IMAGE)) {
            if e.kind() != std::io::ErrorKind::NotFound {
                problems.push(format!("removing {}: {e}", data.join(DISK_IMAGE).display()));
            }
        }
        for d in ["upper", "work", "upperfs"] {
            let p = data.join(d);
            if let Err(e) = fs::remove_dir_all(&p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    problems.push(format!("removing {}: {e}", p.display()));
                }
            }
        }
    }
    if st.remove {
        if !st.name.is_empty() {
            state::release_name(paths, &st.name, &st.id);
        }
        // The data first: a record left by a crash here is retried.
        for d in [&data, &dir] {
            if let Err(e) = fs::remove_dir_all(d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    problems.push(format!("removing {}: {e}", d.display()));
                }
            }
        }
    } else {
        let _ = fs::remove_file(paths.pid_file(&st.id));
        if st.status != Status::Exited {
            st.status = Status::Exited;
            st.finished.get_or_insert_with(state::now);
        }
        if let Err(e) = state::write_state(&dir, st) {
            problems.push(e.to_string());
        }
    }
    problems
}

/// What the monitor runs: `crun run` on the bundle, with `stdio` as its
/// fds 0, 1 and 2. On a hybrid host crun starts in the container's
/// cgroup2 view group (`CLONE_INTO_CGROUP`) and joins the v1 limit groups.
pub(crate) fn crun_run_spawn(
    paths: &Paths,
    p: &Prepared,
    stdio: [OwnedFd; 3],
) -> Result<SpawnSpec, RunError> {
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
            (
                crate::sys::raw(p.bundle.as_fd()),
                crun::cstring(p.bundle.path())?,
            ),
            (
                crate::sys::raw(p.mount.as_fd()),
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
pub(crate) fn spawn_crun(mut spec: SpawnSpec) -> Result<Spawned, RunError> {
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
            monitor::client_session(
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
            match monitor::wait_started(&mut client) {
                Ok(()) => Ok(started),
                Err(e) => Err(e),
            }
        }
    }
}
