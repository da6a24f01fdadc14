//! Assembles and attaches the composefs stack, through the new mount API only.
//!
//! ```text
//!                      target  (the only mount that appears in mountinfo)
//!                        │
//!                   overlayfs   source=<image>, redirect_dir=on, metacopy=on
//!      ┌─────────────────┼──────────────────────┬────────────────────────┐
//!  lowerdir+          datadir+              upperdir/workdir       (none: ro)
//!  EROFS image        objects/               tmpfs (size=…) or
//!  (fsmount fd,       (O_PATH fd, or an      <dir>/upper, <dir>/work
//!   file-backed,       open_tree clone when
//!   or on a loop dev)
//!                      idmapped; data-only)
//!      └── idmapped ──────┘  when an IdMap is given (mount_setattr)
//! ```
//!
//! Every layer is a *detached* mount: it exists only as a file descriptor of
//! this process until overlayfs takes its own private clone. (Kernels before
//! 6.15 refuse detached layers; there the layers are attached, for the
//! moment of the overlay's creation, in a private mount namespace that one
//! short-lived thread holds: see `privns`. The rest is the same.) Once the overlay
//! is attached the descriptors are closed, so the overlay is the only thing
//! holding the layers and `umount(target)` frees them all. For the same
//! reason a failure (or a `kill -9`) at any step leaves nothing behind: no
//! mount, no loop device, no temporary directory (none is ever made); the
//! kernel drops detached mounts with the last fd.
//!
//! # The loop device path
//!
//! EROFS reads the image file itself where the kernel has file-backed
//! mounts (Linux 6.12). Elsewhere (the probe finds `ENOTBLK` for a file
//! source), or when `CAIRN_EROFS_LOOP=1` forces it, the image is opened
//! read-only and attached to a loop device with `LOOP_CONFIGURE` and
//! `LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO` (direct
//! I/O so the image is not cached twice; dropped if the backing file refuses
//! it), and EROFS is mounted from `/dev/loopN`. The fd on the device is
//! closed as soon as the EROFS superblock exists or has failed to, so the
//! superblock is the device's only opener: autoclear detaches the device
//! when the mount goes (the last unmount of the overlay, a failure at any
//! later step, or the mounter's death), and a failure before it detaches
//! the device as the fd closes. The EROFS mount's own source is then the
//! device, but that mount is detached and never in mountinfo; the overlay's
//! source still names the image for gc. [`prepare_image`] stops just before attaching, which the
//! tests use to kill a mounter at its last step.
//!
//! Idmapping: the EROFS and objects layers are idmapped, the upper layer is
//! not. overlayfs does its upper-layer work (work dir, copy-up) with the
//! credentials of whoever mounted it; for root those ids (0) have no mapping
//! through an idmapped upper, so the kernel gets `EOVERFLOW` creating
//! `work/work` and silently mounts the overlay read-only. Instead the upper
//! stores host ids, and its root directory is given the owner that the
//! idmapped image root shows, so the container's root owns `/`. (The overlay
//! mount itself cannot be idmapped: overlayfs refuses `MOUNT_ATTR_IDMAP`.)
//! A writable stack that still comes up read-only is reported as an error.
//!
//! # The source names the image
//!
//! Both the EROFS layer and the overlay are mounted with `source` set to the
//! image file's absolute path, and that is a contract, not a label: nothing
//! of cairn runs while an image stays mounted, so the store's garbage
//! collector (`cairn_store::Store::live_mounts`) learns which images are in
//! use only from the kernel's mount tables. It reads each entry back through
//! [`mounted_image`], takes the file name of the path (an image is named by
//! its digest) and keeps that image and every object it reaches. Mounting
//! with any other source would let gc delete the files of a mounted image.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{
    chmodat, chownat, fstat, fstatvfs, mkdirat, openat, AtFlags, FileType, Gid, Mode, OFlags,
    StatVfsMountFlags, Uid, CWD,
};
use rustix::mount::{move_mount, MountAttrFlags, MoveMountFlags};

use crate::bind::clone_tree;
use crate::error::{Action, MountError, StepFailure};
use crate::fscontext::{fd_path, fd_subpath, FsContext};
use crate::loopdev::{LoopDevice, LoopFlags};
use crate::mountinfo::MountEntry;
use crate::privns::{in_private_namespace, private_ns_forced};
use crate::probe::{
    erofs_loop_forced, probe, verity_support_of, ErofsPath, Feature, LayerPath, MissingFeature,
    Support,
};
use crate::sys;
use crate::userns::{IdMap, UserNamespace};

/// Where a container's writes go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum UpperSpec {
    /// Read-only stack.
    #[default]
    None,
    /// A fresh tmpfs, optionally capped at `size` bytes (writes past it fail
    /// with `ENOSPC`); gone at unmount.
    Tmpfs { size: Option<u64> },
    /// `DIR/upper` and `DIR/work` (created if missing; they must be on one
    /// filesystem); kept after unmount and visible to `du`.
    Dir(PathBuf),
}

/// Whether overlayfs must check object digests with fs-verity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerityMode {
    #[default]
    Off,
    /// overlay `verity=require`. An error where the kernel (or the objects'
    /// filesystem) lacks fs-verity.
    Require,
}

/// What every image stack needs of the kernel (besides a way for EROFS
/// to read the image, [`crate::KernelFeatures::erofs_path`]), in the order
/// a refusal names them. Detached layers (Linux 6.15) are not among them:
/// without them the layers are attached in a private namespace for the
/// moment of the overlay's creation (`privns`, [`crate::LayerPath`]).
pub const STACK_FEATURES: [Feature; 4] = [
    Feature::NewMountApi,
    Feature::Erofs,
    Feature::Overlay,
    Feature::OverlayDataOnlyLayers,
];

/// What to mount where.
#[derive(Clone, Debug)]
pub struct MountOptions<'a> {
    /// The EROFS metadata image file.
    pub image: &'a Path,
    /// The store's `objects/` directory (the data-only layer), or for a
    /// lazy mount the lazy server's FUSE layer that stands for it.
    pub objects: &'a Path,
    /// A data-only layer searched before `objects`: for a lazy mount, the
    /// store's own `objects/`. overlayfs looks a file's data up in the
    /// data-only layers in order and takes the first that has it, so a
    /// file already in the store is read from it by the kernel alone (no
    /// FUSE request, not even an open), and only a missing one goes to the
    /// lazy layer, which fetches it. The lookup happens at the file's first
    /// open and overlayfs keeps its answer for the inode's life: a file
    /// first opened while missing stays served by the lazy layer
    /// (passthrough once fetched). `None`: `objects` alone.
    pub local_objects: Option<&'a Path>,
    /// An existing directory to mount on.
    pub target: &'a Path,
    pub upper: UpperSpec,
    /// Show the image's ids shifted by this mapping.
    pub idmap: Option<IdMap>,
    pub verity: VerityMode,
}

impl MountOptions<'_> {
    /// The kernel features this stack needs, besides a way for EROFS to
    /// read the image ([`crate::KernelFeatures::erofs_path`]: file-backed, or a
    /// loop device).
    pub fn required_features(&self) -> Vec<Feature> {
        let mut needed = STACK_FEATURES.to_vec();
        if self.idmap.is_some() {
            needed.extend([Feature::UserNamespaces, Feature::IdmappedMounts]);
        }
        // fs-verity for verity=require is checked where it matters, on the
        // objects' filesystem (the probe's answer is about the filesystem of
        // cairn's own binary, which may differ).
        needed
    }
}

/// A finished overlay that is not attached anywhere yet: it exists only as
/// this file descriptor, and dropping it unmounts everything.
#[derive(Debug)]
pub struct PreparedMount {
    overlay: OwnedFd,
    layers: DetachedLayers,
}

/// The detached layer mounts (EROFS, objects clone, tmpfs upper) that an
/// overlay was built from. The overlay holds clones of its own, so these
/// only need closing; but closing the last fd of a detached mount makes
/// the kernel dissolve its tree, and each dissolution waits for an
/// expedited RCU grace period (tens of microseconds, an interrupt on every
/// CPU). A caller in a hurry takes them with [`PreparedMount::take_layers`]
/// and drops them later, off its critical path.
#[derive(Debug, Default)]
pub struct DetachedLayers {
    /// Held only to be closed on drop.
    _fds: Vec<OwnedFd>,
}

impl PreparedMount {
    /// Takes the layer mounts out, to be dropped when convenient (see
    /// [`DetachedLayers`]); the overlay stays complete without them.
    pub fn take_layers(&mut self) -> DetachedLayers {
        std::mem::take(&mut self.layers)
    }

    /// `move_mount` the overlay onto `target`.
    pub fn attach(self, target: &Path) -> Result<(), MountError> {
        move_mount(
            &self.overlay,
            "",
            CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|errno| {
            MountError::step(
                Action::AttachOverlay,
                target,
                StepFailure::new("move_mount", errno),
            )
        })?;
        tracing::debug!(target = %target.display(), "attached overlay");
        Ok(())
    }
}

impl AsFd for PreparedMount {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.overlay.as_fd()
    }
}

/// The image file a mount of cairn's was made from, as its mount table
/// entry names it: the `source` of an overlay or EROFS mount (see "The
/// source names the image" in the module docs). `None` for other
/// filesystems. The path is the one the mounter gave, as it resolved in the
/// mounter's mount namespace, so callers match on its file name.
pub fn mounted_image(entry: &MountEntry) -> Option<&Path> {
    matches!(entry.fs_type.as_str(), "overlay" | "erofs").then(|| Path::new(&entry.source))
}

/// Mounts the image stack described by `opts` on `opts.target`.
pub fn mount_image(opts: &MountOptions<'_>) -> Result<(), MountError> {
    prepare_image(opts)?.attach(opts.target)
}

/// Builds the whole stack as a detached overlay, without attaching it.
/// `opts.target` is used only to name the mount in errors.
pub fn prepare_image(opts: &MountOptions<'_>) -> Result<PreparedMount, MountError> {
    prepare(opts, false, erofs_loop_forced(), private_ns_forced())
}

/// Test hook, not part of the API: [`prepare_image`] with the older
/// `lowerdir=META::OBJECTS` syntax, which `prepare_image` uses only on
/// kernels without `lowerdir+`, so that the fallback is tested on new ones.
#[doc(hidden)]
pub fn prepare_image_with_legacy_lowerdir(
    opts: &MountOptions<'_>,
) -> Result<PreparedMount, MountError> {
    prepare(opts, true, erofs_loop_forced(), private_ns_forced())
}

/// Test hook, not part of the API: [`prepare_image`] with the image on a
/// loop device, as if `CAIRN_EROFS_LOOP=1` were set (which tests running as
/// threads of one process cannot set for one test alone).
#[doc(hidden)]
pub fn prepare_image_on_loop_device(opts: &MountOptions<'_>) -> Result<PreparedMount, MountError> {
    prepare(opts, false, true, private_ns_forced())
}

/// Test hook, not part of the API: [`prepare_image`] with the layers
/// attached in a private namespace (`privns`), as on kernels before 6.15,
/// as if `CAIRN_OVERLAY_PRIVATE_NS=1` were set.
#[doc(hidden)]
pub fn prepare_image_in_private_namespace(
    opts: &MountOptions<'_>,
) -> Result<PreparedMount, MountError> {
    prepare(opts, false, erofs_loop_forced(), true)
}

fn prepare(
    opts: &MountOptions<'_>,
    force_legacy: bool,
    force_loop: bool,
    force_private: bool,
) -> Result<PreparedMount, MountError> {
    if !force_legacy
        && opts.verity == VerityMode::Off
        && !force_loop
        && !force_private
        && !crate::probe::probed()
    {
        // Fast path: assume the kernel has everything (probing costs more
        // than the mount itself); probe only to explain a failure, to
        // choose the older overlay syntax, a loop device for the image or
        // the private namespace for the layers. Once this process has
        // probed, its answer is free and a doomed first attempt is not.
        match prepare_with(opts, true, ErofsPath::File, LayerPath::Detached) {
            Ok(m) => return Ok(m),
            Err(first) => {
                let features = probe();
                features.require(&opts.required_features())?;
                let path = features.erofs_path()?;
                let append = features.has(Feature::OverlayLayerAppend);
                let layers = features.layer_path();
                if append && path == ErofsPath::File && layers == LayerPath::Detached {
                    return Err(first);
                }
                tracing::debug!(%path, %layers, "retrying the stack as the probe says");
                return prepare_with(opts, append, path, layers);
            }
        }
    }
    let features = probe();
    features.require(&opts.required_features())?;
    let path = if force_loop {
        features.require(&[Feature::LoopDevices])?;
        ErofsPath::Loop
    } else {
        features.erofs_path()?
    };
    let layers = if force_private {
        LayerPath::PrivateNamespace
    } else {
        features.layer_path()
    };
    prepare_with(
        opts,
        features.has(Feature::OverlayLayerAppend) && !force_legacy,
        path,
        layers,
    )
}

/// Builds the stack; `append` chooses `lowerdir+`/`datadir+` over the older
/// `lowerdir=META::OBJECTS` syntax, `erofs_path` how EROFS reads the image,
/// `layers` how overlayfs is handed its layers.
fn prepare_with(
    opts: &MountOptions<'_>,
    append: bool,
    erofs_path: ErofsPath,
    layers: LayerPath,
) -> Result<PreparedMount, MountError> {
    let invalid = |action, path: &Path, reason: String| MountError::Invalid {
        action,
        path: path.to_path_buf(),
        reason,
    };
    if opts.upper == (UpperSpec::Tmpfs { size: Some(0) }) {
        return Err(invalid(
            Action::MountTmpfsUpper,
            opts.target,
            "a tmpfs size of 0 would mean no limit; leave it unset for that".into(),
        ));
    }
    // Absolute, so that the overlay's source names the image wherever the
    // caller's working directory was.
    let image = std::path::absolute(opts.image).map_err(|e| {
        MountError::step(
            Action::MountErofs,
            opts.image,
            StepFailure::io("resolving path", &e),
        )
    })?;

    let userns = opts.idmap.map(UserNamespace::new).transpose()?;
    let erofs = mount_erofs(&image, erofs_path, userns.as_ref())?;
    let objects = open_objects(opts.objects, userns.as_ref())?;
    let local = opts
        .local_objects
        .map(|p| open_objects(p, userns.as_ref()))
        .transpose()?;
    if opts.verity == VerityMode::Require {
        // The open_tree fd is O_PATH, which ioctls refuse: open the directory.
        // (Checked on `objects`; a local layer before it is the store's
        // objects/, on the filesystem `objects` would be checked for
        // without a lazy layer.)
        let dir = openat(
            &objects,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| {
            MountError::step(
                Action::OpenObjects,
                opts.objects,
                StepFailure::new("openat", errno),
            )
        })?;
        let support = verity_support_of(dir.as_fd(), &opts.objects.display().to_string());
        if support != Support::Present {
            return Err(MissingFeature {
                feature: Feature::FsVerity,
                support,
                release: probe().release().to_string(),
            }
            .into());
        }
    }
    let upper = prepare_upper(opts, &erofs)?;
    let overlay = match layers {
        LayerPath::Detached => {
            let data: Vec<BorrowedFd<'_>> = local
                .iter()
                .map(AsFd::as_fd)
                .chain([objects.as_fd()])
                .collect();
            mount_overlay(opts, &image, erofs.as_fd(), &data, &upper, append)?
        }
        LayerPath::PrivateNamespace => {
            // The overlay's errors are already MountErrors; setup failures
            // (unshare, move_mount) are StepFailures named after the overlay.
            let result = in_private_namespace(|ns| {
                ns.attach(&erofs)?;
                // Each data layer: its idmapped clone attached, or the
                // directory opened again inside the namespace (in order).
                let mut reopened = Vec::new();
                for (layer, path) in local
                    .iter()
                    .zip(opts.local_objects)
                    .chain([(&objects, opts.objects)])
                {
                    match layer {
                        Objects::Clone(fd) => ns.attach(fd)?,
                        Objects::Dir(_) => reopened.push(ns.open_dir(path)?),
                    }
                }
                let mut reopened = reopened.iter();
                let data: Vec<BorrowedFd<'_>> = local
                    .iter()
                    .chain([&objects])
                    .map(|layer| match layer {
                        Objects::Clone(fd) => fd.as_fd(),
                        Objects::Dir(_) => reopened
                            .next()
                            .expect("one fd reopened per directory layer")
                            .as_fd(),
                    })
                    .collect();
                if let Upper::Tmpfs(fd) = &upper {
                    ns.attach(fd)?;
                }
                Ok(mount_overlay(
                    opts,
                    &image,
                    erofs.as_fd(),
                    &data,
                    &upper,
                    append,
                ))
            });
            match result {
                Ok(overlay) => overlay?,
                Err(f) => return Err(MountError::step(Action::MountOverlay, opts.target, f)),
            }
        }
    };
    tracing::debug!(image = %image.display(), %layers, "prepared overlay stack");
    let mut layers = vec![erofs];
    for data in local.into_iter().chain([objects]) {
        if let Objects::Clone(fd) = data {
            layers.push(fd);
        }
    }
    if let Upper::Tmpfs(fd) = upper {
        layers.push(fd);
    }
    Ok(PreparedMount {
        overlay,
        layers: DetachedLayers { _fds: layers },
    })
}

fn idmap(fd: &OwnedFd, userns: Option<&UserNamespace>) -> Result<(), StepFailure> {
    match userns {
        Some(ns) => sys::mount_setattr_idmap(fd.as_fd(), ns.as_fd())
            .map_err(|errno| StepFailure::new("mount_setattr (idmap)", errno)),
        None => Ok(()),
    }
}

/// The EROFS image as a detached, read-only mount: file-backed, or from a
/// read-only loop device (autoclear, direct I/O) that goes with the mount.
fn mount_erofs(
    image: &Path,
    path: ErofsPath,
    userns: Option<&UserNamespace>,
) -> Result<OwnedFd, MountError> {
    let run = || {
        let ctx = FsContext::open("erofs")?;
        // On the loop path, our fd on the device is its only opener until
        // the superblock opens it; dropped at the end of this closure (also
        // on every error), which leaves the mount (if any) as the device's
        // last user, so autoclear detaches it with the last unmount.
        let device = match path {
            ErofsPath::File => {
                // The image path as the source: gc's liveness check reads
                // it back (module docs, "The source names the image").
                ctx.set_string("source", image)?;
                None
            }
            ErofsPath::Loop => {
                let backing = std::fs::File::open(image)
                    .map_err(|e| StepFailure::io("open (for the loop device)", &e))?;
                let device = LoopDevice::attach(
                    &backing,
                    LoopFlags {
                        read_only: true,
                        direct_io: true,
                    },
                )?;
                // This EROFS mount stays detached (never in mountinfo); the
                // overlay's source still names the image for gc.
                ctx.set_string("source", device.path.as_str())?;
                Some(device)
            }
        };
        // Default options otherwise: user_xattr and acl must stay (the image
        // carries user xattrs and POSIX ACLs; noacl would hide them, and was
        // no faster for `ls -lR` anyway); cache_strategy is for compressed
        // images only; directio (file-backed data reads) made no difference:
        // a composefs image holds metadata only (ls-lR-analysis.md in
        // bench/results).
        ctx.set_flag("ro")?;
        let fd = ctx.create_and_mount(MountAttrFlags::MOUNT_ATTR_RDONLY)?;
        drop(device);
        idmap(&fd, userns)?;
        Ok(fd)
    };
    run().map_err(|mut f: StepFailure| {
        // The probe found file-backed mounts, so ENOTBLK here is about where
        // the image lives: EROFS needs a page cache it can read (read_folio),
        // which tmpfs files lack.
        if f.errno == rustix::io::Errno::NOTBLK && path == ErofsPath::File {
            f.step = format!(
                "{} (EROFS cannot read image files on this filesystem, e.g. tmpfs; \
                 keep images on a disk filesystem)",
                f.step
            );
        }
        MountError::step(Action::MountErofs, image, f)
    })
}

/// The objects directory as the data-only layer.
enum Objects {
    /// An `O_PATH` fd of the directory itself: all overlayfs needs when
    /// nothing is idmapped, and no mount to make and dissolve again.
    Dir(OwnedFd),
    /// A detached clone of it, idmapped.
    Clone(OwnedFd),
}

impl AsFd for Objects {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Objects::Dir(fd) | Objects::Clone(fd) => fd.as_fd(),
        }
    }
}

/// The objects directory: a detached, idmapped clone with `userns`, else
/// the directory.
fn open_objects(objects: &Path, userns: Option<&UserNamespace>) -> Result<Objects, MountError> {
    let run = || {
        let Some(ns) = userns else {
            return openat(
                CWD,
                objects,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map(Objects::Dir)
            .map_err(|errno| StepFailure::new("open", errno));
        };
        let fd = clone_tree(objects)?;
        let st = fstat(&fd).map_err(|errno| StepFailure::new("fstat", errno))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
            return Err(StepFailure::new(
                "open_tree (clone)",
                rustix::io::Errno::NOTDIR,
            ));
        }
        idmap(&fd, Some(ns))?;
        Ok(Objects::Clone(fd))
    };
    run().map_err(|f| MountError::step(Action::OpenObjects, objects, f))
}

/// The upper layer, ready for `upperdir=`/`workdir=`.
enum Upper {
    None,
    Tmpfs(OwnedFd),
    Dir(PathBuf),
}

impl Upper {
    fn dirs(&self) -> Option<(String, String)> {
        match self {
            Upper::None => None,
            Upper::Tmpfs(fd) => Some((fd_subpath(fd, "upper"), fd_subpath(fd, "work"))),
            Upper::Dir(dir) => Some((
                dir.join("upper").display().to_string(),
                dir.join("work").display().to_string(),
            )),
        }
    }
}

/// Owner and permissions for a freshly made `upper/`: those the (idmapped)
/// image root shows, since overlayfs takes the merged root's from the upper.
struct RootAttrs {
    mode: Mode,
    uid: Uid,
    gid: Gid,
}

fn root_attrs(erofs: &OwnedFd) -> Result<RootAttrs, StepFailure> {
    let st = fstat(erofs).map_err(|errno| StepFailure::new("fstat image root", errno))?;
    Ok(RootAttrs {
        mode: Mode::from_raw_mode(st.st_mode & 0o7777),
        uid: Uid::from_raw(st.st_uid),
        gid: Gid::from_raw(st.st_gid),
    })
}

fn prepare_upper(opts: &MountOptions<'_>, erofs: &OwnedFd) -> Result<Upper, MountError> {
    match &opts.upper {
        UpperSpec::None => Ok(Upper::None),
        UpperSpec::Tmpfs { size } => {
            let run = || {
                let attrs = root_attrs(erofs)?;
                let ctx = FsContext::open("tmpfs")?;
                if let Some(size) = size {
                    ctx.set_string("size", size.to_string())?;
                }
                let fd = ctx.create_and_mount(MountAttrFlags::empty())?;
                let step = |what: &'static str| move |errno| StepFailure::new(what, errno);
                mkdirat(&fd, "upper", attrs.mode).map_err(step("mkdirat upper"))?;
                // mkdirat is subject to the umask; set the exact bits.
                chmodat(&fd, "upper", attrs.mode, AtFlags::empty())
                    .map_err(step("chmodat upper"))?;
                chownat(
                    &fd,
                    "upper",
                    Some(attrs.uid),
                    Some(attrs.gid),
                    AtFlags::empty(),
                )
                .map_err(step("chownat upper"))?;
                mkdirat(&fd, "work", Mode::from_raw_mode(0o700)).map_err(step("mkdirat work"))?;
                Ok(Upper::Tmpfs(fd))
            };
            run().map_err(|f| MountError::step(Action::MountTmpfsUpper, opts.target, f))
        }
        UpperSpec::Dir(dir) => {
            let fail = |step: &str, e: &io::Error| {
                MountError::step(Action::PrepareUpperDir, dir, StepFailure::io(step, e))
            };
            let dir = std::path::absolute(dir).map_err(|e| fail("resolving path", &e))?;
            std::fs::create_dir_all(&dir).map_err(|e| fail("creating directory", &e))?;
            let upper = dir.join("upper");
            match std::fs::create_dir(&upper) {
                Ok(()) => {
                    let attrs = root_attrs(erofs)
                        .map_err(|f| MountError::step(Action::PrepareUpperDir, &dir, f))?;
                    let set = || {
                        chmodat(CWD, &upper, attrs.mode, AtFlags::empty())?;
                        chownat(
                            CWD,
                            &upper,
                            Some(attrs.uid),
                            Some(attrs.gid),
                            AtFlags::empty(),
                        )
                    };
                    set().map_err(|errno| {
                        MountError::step(
                            Action::PrepareUpperDir,
                            &dir,
                            StepFailure::new("chmod/chown upper", errno),
                        )
                    })?;
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(fail("creating upper", &e)),
            }
            let work = dir.join("work");
            match std::fs::create_dir(&work) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(fail("creating work", &e)),
            }
            let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev());
            let upper_dev = dev(&upper).map_err(|e| fail("stat upper", &e))?;
            let work_dev = dev(&work).map_err(|e| fail("stat work", &e))?;
            if upper_dev != work_dev {
                return Err(MountError::Invalid {
                    action: Action::PrepareUpperDir,
                    path: dir,
                    reason: "upper/ and work/ are on different filesystems".into(),
                });
            }
            Ok(Upper::Dir(dir))
        }
    }
}

fn mount_overlay(
    opts: &MountOptions<'_>,
    image: &Path,
    erofs: BorrowedFd<'_>,
    data: &[BorrowedFd<'_>],
    upper: &Upper,
    append: bool,
) -> Result<OwnedFd, MountError> {
    let fail = |f| MountError::step(Action::MountOverlay, opts.target, f);
    let run = || {
        let ctx = FsContext::open("overlay")?;
        // As for the EROFS layer: gc finds the image in use by this source.
        ctx.set_string("source", image)?;
        let meta = fd_path(erofs);
        let data: Vec<String> = data.iter().map(|fd| fd_path(*fd)).collect();
        if append {
            ctx.set_string("lowerdir+", &meta)?;
            for d in &data {
                ctx.set_string("datadir+", d)?;
            }
        } else {
            ctx.set_string("lowerdir", format!("{meta}::{}", data.join("::")))?;
        }
        // Both required by the composefs format: every regular file in the
        // image is a metadata-only copy (trusted.overlay.metacopy) whose data
        // overlayfs finds by following trusted.overlay.redirect=/ab/cdef…
        // into the data-only layer. Without an upper layer the kernel turns
        // redirect_dir=follow into =on (mountinfo shows =on for both; the
        // same ls -lR time), so =on serves the read-only and writable stacks.
        //
        // Nothing else is set on purpose. Measured on an 84k-entry tree
        // (bench/results/ls-lR-analysis.md), none of these changed `ls -lR`
        // cold or warm beyond ±1.5%: xino=on/auto (the kernel counts the
        // layers as one filesystem and ignores it; mountinfo shows no xino),
        // uuid=null (uuid=off falls back to it with a warning), index=off
        // (the default without an upper). Leaving out `ro` gives the same
        // mount (no upper: read-only anyway). userxattr is refused with
        // metacopy/redirect_dir (composefs uses trusted.overlay.*). The cost
        // over plain EROFS is overlayfs' own per-entry work (lookup, getattr,
        // getxattr through a second inode/dentry), which no option changes.
        ctx.set_string("redirect_dir", "on")?;
        ctx.set_string("metacopy", "on")?;
        if opts.verity == VerityMode::Require {
            ctx.set_string("verity", "require")?;
        }
        let attrs = match upper.dirs() {
            Some((upperdir, workdir)) => {
                ctx.set_string("upperdir", upperdir)?;
                ctx.set_string("workdir", workdir)?;
                // index=on makes overlayfs track hardlinks of lower files
                // across copy-up and unlink, so link counts behave as on a
                // normal filesystem; it also ties a host-directory upper to
                // the image it was first used with.
                ctx.set_string("index", "on")?;
                MountAttrFlags::empty()
            }
            None => {
                ctx.set_flag("ro")?;
                MountAttrFlags::MOUNT_ATTR_RDONLY
            }
        };
        ctx.create_and_mount(attrs)
    };
    let fd = run().map_err(fail)?;
    if !matches!(upper, Upper::None) {
        let st = fstatvfs(&fd).map_err(|errno| fail(StepFailure::new("fstatvfs", errno)))?;
        if st.f_flag.contains(StatVfsMountFlags::RDONLY) {
            return Err(MountError::Invalid {
                action: Action::MountOverlay,
                path: opts.target.to_path_buf(),
                reason: "overlayfs fell back to read-only: it could not use the upper layer \
                         (the kernel log, dmesg, says why)"
                    .into(),
            });
        }
    }
    Ok(fd)
}
