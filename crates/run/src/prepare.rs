//! The prepare stage: everything up to the point where crun can start a
//! container (its record, name, user namespace, upper layer, rootfs,
//! bundle, cgroups and runtime config).
//!
//! Every resource [`prepare`] takes is recorded in `state.json` *before*
//! it is taken, so that [`teardown`], run from the monitor, from a failed
//! step here or from a reaper after a crash, frees exactly what exists.

use std::fs;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use cairn_mount::{IdMap, MountOptions, PreparedMount, UpperSpec};
use cairn_store::{Store, StoreLock};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use crate::bundle::{etc_files, new_tmpfs, Bundle};
use crate::cgroup::{self, Layout};
use crate::console::ConsoleListener;
use crate::image_config::{resolve_user, ImageConfig};
use crate::spec::{self, build_spec, merge_env, Limits, Network, SpecInput, Volume, DEFAULT_PATH};
use crate::state::{self, Locked, Paths, State, Status, UpperKind, UsernsRange};
use crate::teardown::{reap_one, teardown, DISK_IMAGE, KEEP_MARKER};
use crate::userns::{self, Pool};
use crate::RunError;

/// The default cap of a tmpfs upper: 1 GiB. tmpfs pages are only used
/// when written, so the cap costs nothing until a container writes; it
/// keeps a runaway container from eating the host's memory.
pub const DEFAULT_TMPFS_SIZE: u64 = 1 << 30;

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
    /// The overlay's data-only layer instead of the store's `objects/`: an
    /// incomplete image's FUSE layer (`cairn run --lazy`), served by a
    /// process the caller started.
    pub data_layer: Option<PathBuf>,
    /// With `data_layer`: the store's `objects/` goes before it, so that
    /// files already local are read from the store by the kernel alone
    /// (`cairn_mount::MountOptions::local_objects`). Off while the lazy
    /// layer records every open for a prefetch list.
    pub local_first: bool,
    /// `--verity`: overlayfs `verity=require` always, where every object
    /// has fs-verity (the default), or never.
    pub verity: cairn_store::VerityChoice,
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

/// Sets the container up to the point where crun can run it. On error,
/// everything taken so far is released.
///
/// The steps, in order: check the request, resolve the image, create the
/// record, give it its data directory and name, a user namespace range,
/// an upper layer, the rootfs and bundle, the process (user, working
/// directory, environment), the `/etc` files, cgroups, `config.json` and
/// a console socket. From the record on, each step records what it takes
/// before it takes it, and a failed step tears down what is recorded.
pub(crate) fn prepare(paths: &Paths, spec: &RunSpec) -> Result<Prepared, RunError> {
    check_request(spec)?;
    let image = open_image(paths, spec)?;
    let (locked, mut c) = create_record(paths, spec, &image)?;
    c.write().map_err(|e| c.fail(e))?;
    c.data_and_name(spec).map_err(|e| c.fail(e))?;
    let idmap = c.userns(spec).map_err(|e| c.fail(e))?;
    let upper = c.upper(spec).map_err(|e| c.fail(e))?;
    let (bundle, mount) = mount_rootfs(
        paths,
        &image,
        upper,
        idmap,
        spec.data_layer.as_deref(),
        spec.local_first,
        spec.verity,
    )
    .map_err(|e| c.fail(e))?;
    let process =
        resolve_process(spec, &image.config, mount.as_fd(), &c.st.id).map_err(|e| c.fail(e))?;
    let etc = etc_files(&bundle, spec.network, &process.hostname).map_err(|e| c.fail(e))?;
    check_volumes(&spec.volumes).map_err(|e| c.fail(e))?;
    let resources = make_cgroups(&c, spec).map_err(|e| c.fail(e))?;
    write_config(
        &bundle, spec, &c.st, image.args, process, etc, idmap, resources,
    )
    .map_err(|e| c.fail(e))?;
    let console = spec
        .tty
        .then(|| listen_console(&bundle))
        .transpose()
        .map_err(|e| c.fail(e))?;
    Ok(Prepared {
        locked,
        state: c.st,
        mount,
        bundle,
        store_lock: Some(image.store_lock),
        console,
    })
}

/// The checks of `spec` that need nothing but the request itself.
fn check_request(spec: &RunSpec) -> Result<(), RunError> {
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
    Ok(())
}

/// The image a container runs, resolved in the store, with the shared
/// store lock that keeps gc away from it.
struct Image {
    store: Store,
    store_lock: StoreLock,
    digest: String,
    config: ImageConfig,
    /// The process's arguments: the image's Entrypoint and Cmd as
    /// overridden by the request.
    args: Vec<String>,
}

fn open_image(paths: &Paths, spec: &RunSpec) -> Result<Image, RunError> {
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
    let record = store.image_record(&digest)?;
    // Pulled with `--lazy` and not yet fetched: overlayfs would fail the
    // reads of every file whose object is missing, in the middle of the
    // container's work.
    if let Some(lazy) = record
        .as_ref()
        .and_then(|r| r.lazy.as_ref())
        .filter(|_| spec.data_layer.is_none())
    {
        return Err(RunError::Invalid(format!(
            "image {} is incomplete (pulled with --lazy, {} objects in all): `cairn fetch {}` \
             fetches the rest, or `cairn run --lazy` fetches each file when it is first read",
            spec.image, lazy.objects, spec.image
        )));
    }
    let config = match record {
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
    Ok(Image {
        store,
        store_lock,
        digest,
        config,
        args,
    })
}

/// A container being set up: its record so far, and how to undo it.
struct InProgress<'a> {
    paths: &'a Paths,
    /// `containers/<id>/`, locked by the caller.
    dir: PathBuf,
    /// `data/<id>/` (made only for a container that needs it).
    data: PathBuf,
    st: State,
}

impl InProgress<'_> {
    /// Tears down what the record holds (the record included) and returns
    /// `e`: what a failed step does. A crash instead leaves it all to the
    /// reaper.
    fn fail(&self, e: RunError) -> RunError {
        let mut st = self.st.clone();
        st.remove = true;
        for p in teardown(self.paths, &mut st) {
            tracing::warn!("{p}");
        }
        e
    }

    /// Writes the record as it is now.
    fn write(&self) -> Result<(), RunError> {
        state::write_state(&self.dir, &self.st)
    }

    /// On disk, after the record that makes the reaper remove it: what a
    /// container keeps or writes for later (only some have any); then the
    /// claim of a chosen name.
    fn data_and_name(&mut self, spec: &RunSpec) -> Result<(), RunError> {
        if spec.detach || spec.keep || matches!(spec.upper, UpperChoice::Disk { .. }) {
            self.paths.create_data_dir(&self.st.id)?;
            if spec.keep {
                let marker = self.data.join(KEEP_MARKER);
                state::write_private(&marker, format!("{}\n", self.st.name).as_bytes())
                    .map_err(|e| RunError::io("writing", &marker, e))?;
            }
        }
        // A default name is the id's first 12 digits, which `lookup` finds
        // as an id prefix: only a chosen name needs a claim (on this
        // store's disk a claim is a block allocated and discarded per
        // container).
        if spec.name.is_some() {
            if let Err(e) = claim_name_reaping(self.paths, &self.st.name, &self.st.id) {
                // Not ours: don't release the name at teardown.
                self.st.name = String::new();
                return Err(e);
            }
        }
        Ok(())
    }

    /// The user namespace's id range, if any: a pool range is recorded
    /// before the container uses it.
    fn userns(&mut self, spec: &RunSpec) -> Result<Option<IdMap>, RunError> {
        Ok(match spec.userns {
            UsernsChoice::Host => None,
            UsernsChoice::Map(m) => {
                m.validate().map_err(RunError::Invalid)?;
                self.st.userns = Some(UsernsRange {
                    uid: m.uid,
                    gid: m.gid,
                    count: m.count,
                    slot: None,
                });
                Some(m)
            }
            UsernsChoice::Auto => {
                let pool = Pool::load(self.paths)?;
                let r = userns::allocate(self.paths, &pool, &self.st.id)?;
                self.st.userns = Some(r);
                self.write()?;
                Some(IdMap {
                    uid: r.uid,
                    gid: r.gid,
                    count: r.count,
                })
            }
        })
    }

    /// The overlay's upper layer: a tmpfs of the rootfs stack's own, or a
    /// directory (on the host, or on a filesystem mounted for it, which
    /// is recorded first).
    fn upper(&mut self, spec: &RunSpec) -> Result<UpperSpec, RunError> {
        let data = &self.data;
        Ok(match (spec.upper, spec.keep) {
            (UpperChoice::Tmpfs { size }, false) => UpperSpec::Tmpfs {
                size: Some(size.unwrap_or(DEFAULT_TMPFS_SIZE)),
            },
            (UpperChoice::Tmpfs { size }, true) => {
                let at = data.join("upperfs");
                self.st.kept_upper = Some(at.join("upper"));
                self.write()?;
                mount_host_tmpfs(&at, size.unwrap_or(DEFAULT_TMPFS_SIZE))?;
                UpperSpec::Dir(at)
            }
            (UpperChoice::Disk { size: None }, keep) => {
                if keep {
                    self.st.kept_upper = Some(data.join("upper"));
                }
                UpperSpec::Dir(data.clone())
            }
            (UpperChoice::Disk { size: Some(size) }, keep) => {
                // Its own filesystem of that size (see cairn_mount::disk),
                // mounted on the host like a kept tmpfs upper.
                let at = data.join("upperfs");
                if keep {
                    self.st.kept_upper = Some(at.join("upper"));
                }
                self.write()?;
                cairn_mount::mount_sized_upper(&data.join(DISK_IMAGE), size, &at)?;
                UpperSpec::Dir(at)
            }
        })
    }
}

/// Picks the id and name, plans the cgroups and creates the record's
/// directory (locked); the first state is not written yet.
fn create_record<'a>(
    paths: &'a Paths,
    spec: &RunSpec,
    image: &Image,
) -> Result<(Locked, InProgress<'a>), RunError> {
    let id = state::new_id();
    let name = spec.name.clone().unwrap_or_else(|| id[..12].to_string());
    let layout = cgroup::detect();
    // Planned (not made) now, so that the first state write records them.
    let cgroups = cgroup::plan(&id, layout, &spec.limits)
        .map_err(|e| RunError::io("setting up cgroups for", paths.container(&id), e))?;
    let locked = state::create_dir(paths, &id)?;
    let dir = locked.dir.clone();
    let data = paths.data_dir(&id);
    let st = State {
        id: id.clone(),
        name,
        image: spec.image.clone(),
        image_digest: image.digest.clone(),
        command: image.args.clone(),
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
        stop_signal: image
            .config
            .stop_signal
            .clone()
            .unwrap_or_else(|| "SIGTERM".into()),
        cgroups: Some(cgroups),
        limits: spec.limits,
    };
    Ok((
        locked,
        InProgress {
            paths,
            dir,
            data,
            st,
        },
    ))
}

/// Makes the bundle and the image's rootfs stack with `upper` on top, both
/// detached (the monitor attaches them in crun's namespace).
fn mount_rootfs(
    paths: &Paths,
    image: &Image,
    upper: UpperSpec,
    idmap: Option<IdMap>,
    data_layer: Option<&Path>,
    local_first: bool,
    verity: cairn_store::VerityChoice,
) -> Result<(Bundle, PreparedMount), RunError> {
    let verity = image
        .store
        .decide_verity(&image.digest, verity, data_layer.is_some())?;
    tracing::debug!(%verity, "rootfs fs-verity");
    let bundle = Bundle::new(paths)?;
    let rootfs = bundle.path().join("rootfs");
    let image_path = image.store.image_path(&image.digest);
    let objects = data_layer.map_or_else(|| image.store.objects_dir(), Path::to_path_buf);
    let store_objects = image.store.objects_dir();
    let local_objects = (data_layer.is_some() && local_first).then_some(store_objects.as_path());
    let mount = cairn_mount::prepare_image(&MountOptions {
        image: &image_path,
        objects: &objects,
        local_objects,
        target: &rootfs,
        upper,
        idmap,
        verity: verity.mode,
    })?;
    Ok((bundle, mount))
}

/// The container's process as the rootfs and the request make it.
struct Process {
    user: crate::image_config::ResolvedUser,
    cwd: String,
    env: Vec<String>,
    hostname: String,
}

/// Resolves the user (in the rootfs's `/etc/passwd` and `/etc/group`),
/// the working directory (made if missing) and the environment.
fn resolve_process(
    spec: &RunSpec,
    config: &ImageConfig,
    root_fd: BorrowedFd<'_>,
    id: &str,
) -> Result<Process, RunError> {
    let user_spec = spec
        .user
        .clone()
        .or_else(|| config.user.clone())
        .unwrap_or_else(|| "0:0".into());
    let passwd = read_in_root(root_fd, "etc/passwd");
    let group = read_in_root(root_fd, "etc/group");
    let user = resolve_user(&user_spec, passwd.as_deref(), group.as_deref())
        .map_err(|e| RunError::Invalid(format!("--user {user_spec}: {e}")))?;
    let cwd = spec
        .workdir
        .clone()
        .or_else(|| config.working_dir.clone())
        .unwrap_or_else(|| "/".into());
    if !cwd.starts_with('/') {
        return Err(RunError::Invalid(format!(
            "the working directory {cwd:?} must be absolute"
        )));
    }
    ensure_dir_in_root(root_fd, &cwd)?;

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
    Ok(Process {
        user,
        cwd,
        env,
        hostname,
    })
}

/// Every `-v` source must exist on the host (crun's error would not say
/// which one is missing).
fn check_volumes(volumes: &[Volume]) -> Result<(), RunError> {
    for v in volumes {
        if !Path::new(&v.host).exists() {
            return Err(RunError::Invalid(format!(
                "-v {}: no such file or directory on the host",
                v.host
            )));
        }
    }
    Ok(())
}

/// Makes the container's cgroups; returns the limits crun must set itself
/// (none on a hybrid host, where cairn's own groups hold them). The groups
/// were recorded in the first state write, before this, so a crash in
/// between leaves them to the reaper.
fn make_cgroups(
    c: &InProgress<'_>,
    spec: &RunSpec,
) -> Result<Option<oci_spec::runtime::LinuxResources>, RunError> {
    let cg = c.st.cgroups.as_ref().expect("planned in create_record");
    cgroup::make(cg, &spec.limits)
        .map_err(|e| RunError::io("setting up cgroups for", &c.dir, e))?;
    Ok(match cg.layout {
        Layout::Hybrid => None,
        Layout::Legacy => spec::resources_for(&spec.limits, true),
        Layout::Unified => spec::resources_for(&spec.limits, has_cap_sys_resource()),
    })
}

/// Builds the OCI runtime config and writes it into the bundle.
#[allow(clippy::too_many_arguments)]
fn write_config(
    bundle: &Bundle,
    spec: &RunSpec,
    st: &State,
    args: Vec<String>,
    process: Process,
    etc: Vec<(String, String)>,
    idmap: Option<IdMap>,
    resources: Option<oci_spec::runtime::LinuxResources>,
) -> Result<(), RunError> {
    let Process {
        user,
        cwd,
        env,
        hostname,
    } = process;
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
        cgroups_path: st.cgroups.as_ref().and_then(|c| c.crun_path.clone()),
        resources,
        nofile: nofile_limit(),
    });
    let json = spec::config_json(&oci);
    bundle.write("config.json", &json)?;
    Ok(())
}

/// The console socket crun hands the pty master to, in the bundle where
/// crun runs (crun gets a relative path).
fn listen_console(bundle: &Bundle) -> Result<ConsoleListener, RunError> {
    ConsoleListener::bind_in(bundle.as_fd(), bundle.path(), "console.sock")
        .map_err(|e| RunError::io("listening on", bundle.path().join("console.sock"), e))
}

/// Claims `name`; if another container holds it, reaps that one first
/// (it may be an abandoned one) and tries once more.
fn claim_name_reaping(paths: &Paths, name: &str, id: &str) -> Result<(), RunError> {
    match state::claim_name(paths, name, id) {
        Ok(()) => Ok(()),
        Err(first) => {
            if let Ok(owner) = fs::read_link(paths.names().join(name)) {
                if let Some(owner) = owner.to_str() {
                    reap_one(paths, owner);
                }
            }
            state::claim_name(paths, name, id).map_err(|_| first)
        }
    }
}
