//! Run-time probe of what the running kernel can do for cairn's mount stack.
//!
//! Every answer comes from trying the real thing on scratch objects that
//! exist only as file descriptors (detached tmpfs/ramfs mounts, a forked
//! child), never from version numbers or cargo features: distribution
//! kernels backport and configure features freely. The probe leaves nothing
//! behind, costs a few milliseconds and is cached per process by [`probe`].
//!
//! A probe that is refused for lack of privilege (`EPERM`) says so instead of
//! claiming the kernel lacks the feature.

use std::fmt;
use std::os::fd::AsFd;
use std::os::unix::fs::FileTypeExt;
use std::sync::OnceLock;

use rustix::fs::{mkdirat, openat, Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::MountAttrFlags;

use crate::error::{errno_text, StepFailure};
use crate::fscontext::{fd_subpath, FsContext};
use crate::sys;
use crate::userns::{IdMap, UserNamespace};

/// A kernel capability the mount stack may need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Feature {
    /// `fsopen`/`fsconfig`/`fsmount`/`move_mount`/`open_tree`.
    NewMountApi,
    /// The EROFS filesystem.
    Erofs,
    /// EROFS mounted straight from a regular file, without a loop device.
    ErofsFileBacked,
    /// overlayfs.
    Overlay,
    /// overlayfs data-only lower layers (`datadir+`, or `lowerdir=A::B`).
    OverlayDataOnlyLayers,
    /// overlayfs `lowerdir+`/`datadir+` options (one layer per fsconfig call).
    /// Optional: without it the older `lowerdir=META::OBJECTS` string is used.
    OverlayLayerAppend,
    /// overlayfs layers given as detached mounts (fsmount/open_tree fds).
    OverlayDetachedLayers,
    /// Idmapped mounts (`mount_setattr` with `MOUNT_ATTR_IDMAP`).
    IdmappedMounts,
    /// User namespaces (to carry the id mapping of an idmapped mount).
    UserNamespaces,
    /// fs-verity in the kernel (overlay `verity=require`).
    FsVerity,
    /// FUSE (`/dev/fuse`).
    Fuse,
    /// Loop devices configured with `LOOP_CONFIGURE` (`/dev/loop-control`):
    /// how EROFS reads an image where it cannot read the file itself.
    LoopDevices,
}

impl Feature {
    /// Every feature, in probe order.
    pub const ALL: [Feature; 12] = [
        Feature::NewMountApi,
        Feature::Erofs,
        Feature::ErofsFileBacked,
        Feature::Overlay,
        Feature::OverlayDataOnlyLayers,
        Feature::OverlayLayerAppend,
        Feature::OverlayDetachedLayers,
        Feature::IdmappedMounts,
        Feature::UserNamespaces,
        Feature::FsVerity,
        Feature::Fuse,
        Feature::LoopDevices,
    ];

    fn index(self) -> usize {
        Feature::ALL.iter().position(|f| *f == self).unwrap_or(0)
    }

    /// What the feature is, with the kernel version or option that brings it.
    pub fn description(self) -> &'static str {
        match self {
            Feature::NewMountApi => "the new mount API (fsopen/fsconfig/fsmount, Linux ≥ 5.2)",
            Feature::Erofs => "the EROFS filesystem (CONFIG_EROFS_FS, Linux ≥ 5.4)",
            Feature::ErofsFileBacked => {
                "EROFS mounts from an image file without a loop device \
                 (CONFIG_EROFS_FS_BACKED_BY_FILE, Linux ≥ 6.12)"
            }
            Feature::Overlay => "overlayfs (CONFIG_OVERLAY_FS, Linux ≥ 3.18)",
            Feature::OverlayDataOnlyLayers => {
                "overlayfs data-only lower layers (datadir+ or lowerdir=A::B, Linux ≥ 6.5)"
            }
            Feature::OverlayLayerAppend => "overlayfs lowerdir+/datadir+ options (Linux ≥ 6.7)",
            Feature::OverlayDetachedLayers => "overlayfs layers on detached mounts (Linux ≥ 6.15)",
            Feature::IdmappedMounts => {
                "idmapped mounts (mount_setattr MOUNT_ATTR_IDMAP, Linux ≥ 5.12; tmpfs ≥ 6.3)"
            }
            Feature::UserNamespaces => "user namespaces (CONFIG_USER_NS, Linux ≥ 3.8)",
            Feature::FsVerity => {
                "fs-verity (CONFIG_FS_VERITY, Linux ≥ 5.4; overlayfs verity=require ≥ 6.6)"
            }
            Feature::Fuse => "FUSE (/dev/fuse, CONFIG_FUSE_FS; passthrough Linux ≥ 6.9)",
            Feature::LoopDevices => {
                "loop devices (/dev/loop-control, CONFIG_BLK_DEV_LOOP; LOOP_CONFIGURE, Linux ≥ 5.8)"
            }
        }
    }

    /// What to do about it.
    pub fn remedy(self) -> &'static str {
        match self {
            Feature::NewMountApi => "use Linux 5.2 or later",
            Feature::Erofs => {
                "load it with `modprobe erofs`, or use a kernel built with CONFIG_EROFS_FS"
            }
            Feature::ErofsFileBacked => {
                "nothing needed where loop devices work: cairn attaches the image to a \
                 read-only loop device instead; or use Linux 6.12 or later with \
                 CONFIG_EROFS_FS_BACKED_BY_FILE=y"
            }
            Feature::Overlay => {
                "load it with `modprobe overlay`, or use a kernel built with CONFIG_OVERLAY_FS"
            }
            Feature::OverlayDataOnlyLayers => "use Linux 6.5 or later",
            Feature::OverlayLayerAppend => {
                "nothing needed: the older lowerdir=META::OBJECTS syntax is used instead"
            }
            Feature::OverlayDetachedLayers => {
                "nothing needed: cairn attaches the layers in a private mount namespace \
                 of its own while it creates the overlay"
            }
            Feature::IdmappedMounts => "use a newer kernel, or run the container without an id map",
            Feature::UserNamespaces => {
                "use a kernel with CONFIG_USER_NS and a non-zero sysctl user.max_user_namespaces"
            }
            Feature::FsVerity => {
                "use a kernel with CONFIG_FS_VERITY=y, or mount with verity off \
                 (cairn then checks object digests in userspace)"
            }
            Feature::Fuse => "load it with `modprobe fuse`",
            Feature::LoopDevices => {
                "load it with `modprobe loop`, or use Linux 6.12 or later with \
                 CONFIG_EROFS_FS_BACKED_BY_FILE=y (file-backed EROFS needs no loop device)"
            }
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// What the probe found for one feature.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Support {
    Present,
    /// The kernel lacks it; the text says what the probe saw.
    Absent(String),
    /// The probe was refused for lack of privilege; the kernel may have it.
    NotPermitted(String),
}

/// How the EROFS layer reads its image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErofsPath {
    /// Straight from the image file (file-backed mount, Linux ≥ 6.12).
    File,
    /// From a read-only loop device attached to the image (autoclear,
    /// direct I/O), which goes away with the mount.
    Loop,
}

impl fmt::Display for ErofsPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErofsPath::File => "straight from the image file (file-backed)",
            ErofsPath::Loop => "through a read-only loop device (autoclear, direct I/O)",
        })
    }
}

/// How overlayfs is handed its layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerPath {
    /// As detached mounts (`/proc/self/fd/N` of `fsmount`/`open_tree`
    /// fds), Linux ≥ 6.15.
    Detached,
    /// Attached for the moment of the overlay's creation in a private mount
    /// namespace of one short-lived thread (see `privns`): older kernels.
    PrivateNamespace,
}

impl fmt::Display for LayerPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayerPath::Detached => "as detached mounts",
            LayerPath::PrivateNamespace => {
                "attached in a private mount namespace while the overlay is made \
                 (no detached overlay layers before Linux 6.15)"
            }
        })
    }
}

/// The environment variable that forces the loop device path where the
/// kernel could read image files itself: `CAIRN_EROFS_LOOP=1`. For tests,
/// and for kernels whose file-backed EROFS misbehaves.
pub const EROFS_LOOP_ENV: &str = "CAIRN_EROFS_LOOP";

/// Whether [`EROFS_LOOP_ENV`] asks for loop devices (`1`, `yes` or `true`).
pub fn erofs_loop_forced() -> bool {
    std::env::var(EROFS_LOOP_ENV)
        .map(|v| matches!(v.trim(), "1" | "yes" | "true"))
        .unwrap_or(false)
}

/// The result of [`probe`]: one [`Support`] per [`Feature`].
#[derive(Clone, Debug)]
pub struct KernelFeatures {
    release: String,
    support: Vec<Support>,
}

static CACHE: OnceLock<KernelFeatures> = OnceLock::new();

/// The kernel's features, probed once per process and cached.
pub fn probe() -> KernelFeatures {
    CACHE.get_or_init(KernelFeatures::detect).clone()
}

/// Whether [`probe`] has run in this process already (its answer is then
/// free).
pub(crate) fn probed() -> bool {
    CACHE.get().is_some()
}

impl KernelFeatures {
    /// Probes now, without the cache of [`probe`].
    pub fn detect() -> Self {
        let release = rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned();
        let mut found = KernelFeatures {
            release,
            support: vec![Support::Absent("not probed".into()); Feature::ALL.len()],
        };
        found.detect_all();
        found
    }

    /// `uname -r` of the probed kernel.
    pub fn release(&self) -> &str {
        &self.release
    }

    pub fn has(&self, feature: Feature) -> bool {
        self.support(feature) == &Support::Present
    }

    pub fn support(&self, feature: Feature) -> &Support {
        &self.support[feature.index()]
    }

    /// Features that are not [`Support::Present`].
    pub fn missing(&self) -> Vec<Feature> {
        Feature::ALL.into_iter().filter(|f| !self.has(*f)).collect()
    }

    /// `Ok` if every feature in `needed` is present; otherwise an error that
    /// names the first missing one and what to do about it.
    pub fn require(&self, needed: &[Feature]) -> Result<(), MissingFeature> {
        match needed.iter().find(|f| !self.has(**f)) {
            None => Ok(()),
            Some(&feature) => Err(MissingFeature {
                feature,
                support: self.support(feature).clone(),
                release: self.release.clone(),
            }),
        }
    }

    /// How EROFS will read images on this kernel: from the file where it
    /// can (unless [`EROFS_LOOP_ENV`] forces loop devices), else from a
    /// loop device; an error naming file-backed EROFS (and why loop
    /// devices cannot stand in) where neither works.
    pub fn erofs_path(&self) -> Result<ErofsPath, MissingFeature> {
        self.require(&[Feature::Erofs])?;
        let file = self.has(Feature::ErofsFileBacked);
        if file && !erofs_loop_forced() {
            return Ok(ErofsPath::File);
        }
        match self.require(&[Feature::LoopDevices]) {
            Ok(()) => Ok(ErofsPath::Loop),
            Err(e) if file => Err(e),
            Err(loop_missing) => Err(MissingFeature {
                feature: Feature::ErofsFileBacked,
                support: match self.support(Feature::ErofsFileBacked) {
                    Support::Absent(why) => Support::Absent(format!(
                        "{why}; and no loop device to stand in: {loop_missing}"
                    )),
                    other => other.clone(),
                },
                release: self.release.clone(),
            }),
        }
    }

    /// How overlay layers are handed over on this kernel (unless
    /// [`crate::PRIVATE_NS_ENV`] forces the private namespace).
    pub fn layer_path(&self) -> LayerPath {
        if self.has(Feature::OverlayDetachedLayers) && !crate::privns::private_ns_forced() {
            LayerPath::Detached
        } else {
            LayerPath::PrivateNamespace
        }
    }

    fn set(&mut self, feature: Feature, support: Support) {
        self.support[feature.index()] = support;
    }

    fn detect_all(&mut self) {
        use Feature::*;
        let api = open_support("tmpfs");
        if api == Support::Present {
            let erofs = open_support("erofs");
            let file_backed = match &erofs {
                Support::Present => probe_erofs_file_backed(),
                other => needs(other, "EROFS"),
            };
            self.set(Erofs, erofs);
            self.set(ErofsFileBacked, file_backed);

            let overlay = open_support("overlay");
            let layers = match &overlay {
                Support::Present => probe_overlay_layers(),
                other => LayerSupport::all(needs(other, "overlayfs")),
            };
            self.set(Overlay, overlay);
            self.set(OverlayDataOnlyLayers, layers.data_only);
            self.set(OverlayLayerAppend, layers.append);
            self.set(OverlayDetachedLayers, layers.detached);
        } else {
            let missing = needs(&api, "the new mount API");
            for f in [
                Erofs,
                ErofsFileBacked,
                Overlay,
                OverlayDataOnlyLayers,
                OverlayLayerAppend,
                OverlayDetachedLayers,
            ] {
                self.set(f, missing.clone());
            }
        }

        let userns = match sys::UserNsHolder::spawn() {
            Ok(_) => Support::Present,
            Err(errno) => classify(&StepFailure::new("fork and unshare(CLONE_NEWUSER)", errno)),
        };
        let idmapped = match (&api, &userns) {
            (Support::Present, Support::Present) => probe_idmapped_mounts(),
            (Support::Present, other) => needs(other, "user namespaces"),
            (other, _) => needs(other, "the new mount API"),
        };
        self.set(NewMountApi, api);
        self.set(UserNamespaces, userns);
        self.set(IdmappedMounts, idmapped);
        self.set(FsVerity, probe_fs_verity());
        self.set(Fuse, probe_fuse());
        self.set(LoopDevices, probe_loop_devices());
    }
}

/// The support of a feature that could not be probed because `base` (named
/// `what`) is not there: absent, or not permitted if that was the reason.
fn needs(base: &Support, what: &str) -> Support {
    match base {
        Support::NotPermitted(why) => {
            Support::NotPermitted(format!("probing needs {what}, which was refused: {why}"))
        }
        _ => Support::Absent(format!("needs {what}")),
    }
}

impl fmt::Display for KernelFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "kernel {}", self.release)?;
        for feature in Feature::ALL {
            match self.support(feature) {
                Support::Present => writeln!(f, "  yes  {feature}")?,
                Support::Absent(why) => writeln!(f, "  no   {feature}: {why}")?,
                Support::NotPermitted(why) => writeln!(f, "  ?    {feature}: {why}")?,
            }
        }
        match self.erofs_path() {
            Ok(path) => writeln!(f, "EROFS images are read {path}")?,
            Err(e) => writeln!(f, "EROFS images cannot be mounted: {e}")?,
        }
        match self
            .require(&crate::stack::STACK_FEATURES)
            .and_then(|()| self.erofs_path())
        {
            Ok(_) => writeln!(
                f,
                "cairn mount and cairn run: supported; overlay layers are handed over {}",
                self.layer_path()
            ),
            Err(e) => writeln!(f, "cairn mount and cairn run: not supported: {e}"),
        }
    }
}

/// A required kernel feature is missing (or could not be probed).
#[derive(Clone, Debug, thiserror::Error)]
pub struct MissingFeature {
    pub feature: Feature,
    pub support: Support,
    /// `uname -r` of the kernel that lacks it.
    pub release: String,
}

impl fmt::Display for MissingFeature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.support {
            Support::NotPermitted(why) => write!(
                f,
                "cannot use {}: {why} (mounting needs CAP_SYS_ADMIN: run as root)",
                self.feature
            ),
            Support::Absent(why) => write!(
                f,
                "kernel {} lacks {}: {} (probe: {why})",
                self.release,
                self.feature,
                self.feature.remedy()
            ),
            Support::Present => write!(f, "{} is present", self.feature),
        }
    }
}

fn classify(failure: &StepFailure) -> Support {
    let mut text = format!("{}: {}", failure.step, errno_text(failure.errno));
    if !failure.kernel_log.is_empty() {
        text.push_str(&format!(" ({})", failure.kernel_log.join("; ")));
    }
    match failure.errno {
        Errno::PERM | Errno::ACCESS => Support::NotPermitted(text),
        _ => Support::Absent(text),
    }
}

fn open_support(fstype: &str) -> Support {
    match FsContext::open(fstype) {
        Ok(_) => Support::Present,
        Err(f) => classify(&f),
    }
}

/// Hands a zero-filled file to EROFS as its source. With file-backed mounts
/// the kernel opens it and rejects the superblock (`EINVAL`); without, it
/// looks for a block device and says `ENOTBLK`. The file must live on a
/// filesystem whose page cache EROFS can read (`read_folio`): tmpfs and memfd
/// files are refused with `ENOTBLK` even where the feature exists, ramfs is
/// accepted, so the scratch file sits on a detached ramfs mount. Side effect:
/// one "cannot find valid erofs superblock" line in the kernel log per probe.
fn probe_erofs_file_backed() -> Support {
    let unknown = |f: StepFailure| {
        let mut s = classify(&f);
        if let Support::Absent(text) = &mut s {
            *text = format!("could not tell: scratch ramfs: {text}");
        }
        s
    };
    let ramfs =
        match FsContext::open("ramfs").and_then(|c| c.create_and_mount(MountAttrFlags::empty())) {
            Ok(fd) => fd,
            Err(f) => return unknown(f),
        };
    let file = match openat(
        &ramfs,
        "probe.img",
        OFlags::CREATE | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    ) {
        Ok(fd) => fd,
        Err(errno) => return unknown(StepFailure::new("create probe.img", errno)),
    };
    let zeros = [0u8; 8192];
    if let Err(errno) = rustix::io::write(&file, &zeros) {
        return unknown(StepFailure::new("write probe.img", errno));
    }
    drop(file);
    let attempt = FsContext::open("erofs").and_then(|c| {
        c.set_string("source", fd_subpath(&ramfs, "probe.img"))?;
        c.create()
    });
    match attempt {
        Ok(()) => Support::Present,
        Err(f) if f.errno == Errno::INVAL => Support::Present,
        Err(f) if f.errno == Errno::NOTBLK => Support::Absent(
            "an image file was refused as source (ENOTBLK): only block devices are accepted".into(),
        ),
        Err(f) => classify(&f),
    }
}

struct LayerSupport {
    data_only: Support,
    append: Support,
    detached: Support,
}

impl LayerSupport {
    fn all(support: Support) -> Self {
        LayerSupport {
            data_only: support.clone(),
            append: support.clone(),
            detached: support,
        }
    }
}

/// Builds (but never mounts) overlay superblocks over two directories of a
/// detached tmpfs: with `lowerdir+`/`datadir+`, then with `lowerdir=A::B`,
/// then with plain `lowerdir=A:B`, which tells the three layer features
/// apart.
fn probe_overlay_layers() -> LayerSupport {
    let scratch =
        FsContext::open("tmpfs").and_then(|c| c.create_and_mount(MountAttrFlags::empty()));
    let scratch = match scratch.and_then(|fd| {
        for dir in ["l", "d"] {
            mkdirat(&fd, dir, Mode::from_raw_mode(0o755))
                .map_err(|e| StepFailure::new("mkdirat", e))?;
        }
        Ok(fd)
    }) {
        Ok(fd) => fd,
        Err(f) => return LayerSupport::all(classify(&f)),
    };
    let lower = fd_subpath(&scratch, "l");
    let data = fd_subpath(&scratch, "d");
    let attempt = |options: &[(&str, &str)]| {
        let ctx = FsContext::open("overlay")?;
        for (key, value) in options {
            ctx.set_string(key, *value)?;
        }
        ctx.create()
    };
    let data_only_opts = [("redirect_dir", "on"), ("metacopy", "on")];
    let append = [("lowerdir+", lower.as_str()), ("datadir+", data.as_str())];
    let legacy = format!("{lower}::{data}");
    let plain = format!("{lower}:{data}");
    // The three attempts, in order: lowerdir+/datadir+, lowerdir=A::B,
    // lowerdir=A:B.
    let attempts = || -> [Result<(), StepFailure>; 3] {
        [
            attempt(&[&append[..], &data_only_opts[..]].concat()),
            attempt(&[&[("lowerdir", legacy.as_str())][..], &data_only_opts[..]].concat()),
            attempt(&[("lowerdir", plain.as_str())]),
        ]
    };
    let [append_r, legacy_r, plain_r] = attempts();
    let detached = match &plain_r {
        Ok(()) => Support::Present,
        Err(f) => classify(f),
    };
    let (append_r, legacy_r, plain_r) = if plain_r.is_ok() {
        (append_r, legacy_r, plain_r)
    } else {
        // No detached layers: try again with the scratch tmpfs attached in
        // a private namespace, as the stack would be built here.
        let private = crate::privns::in_private_namespace(|ns| {
            ns.attach(&scratch)?;
            Ok(attempts())
        });
        match private {
            Ok([a, l, p]) => (a, l, p),
            Err(f) => {
                let why = |s: Support| match s {
                    Support::Absent(t) => Support::Absent(format!(
                        "could not tell without detached layers or a private namespace: {t}"
                    )),
                    other => other,
                };
                return LayerSupport {
                    data_only: why(classify(&f)),
                    append: why(classify(&f)),
                    detached,
                };
            }
        }
    };
    let support = |r: &Result<(), StepFailure>| match r {
        Ok(()) => Support::Present,
        Err(f) => classify(f),
    };
    let data_only = match (&append_r, &legacy_r, &plain_r) {
        (Ok(()), _, _) | (_, Ok(()), _) => Support::Present,
        (_, Err(f), Ok(())) => classify(f),
        (_, _, Err(f)) => {
            let t = classify(f);
            match t {
                Support::Absent(t) => {
                    Support::Absent(format!("could not tell: even lowerdir=A:B failed: {t}"))
                }
                other => other,
            }
        }
    };
    LayerSupport {
        data_only,
        append: support(&append_r),
        detached,
    }
}

/// Idmaps a detached tmpfs through a fresh user namespace.
fn probe_idmapped_mounts() -> Support {
    let tmpfs =
        match FsContext::open("tmpfs").and_then(|c| c.create_and_mount(MountAttrFlags::empty())) {
            Ok(fd) => fd,
            Err(f) => return classify(&f),
        };
    let ns = match UserNamespace::new(IdMap {
        uid: 0,
        gid: 0,
        count: 1,
    }) {
        Ok(ns) => ns,
        Err(e) => return Support::Absent(format!("could not tell: {e}")),
    };
    match sys::mount_setattr_idmap(tmpfs.as_fd(), ns.as_fd()) {
        Ok(()) => Support::Present,
        Err(errno) => classify(&StepFailure::new("mount_setattr (idmap) on tmpfs", errno)),
    }
}

/// Asks for the fs-verity digest of this program's own file. The question
/// reaches fs-verity only on filesystems that route the ioctl (ext4, btrfs,
/// f2fs); elsewhere the answer is "could not tell", which counts as absent.
fn probe_fs_verity() -> Support {
    let exe = match std::fs::File::open("/proc/self/exe") {
        Ok(f) => f,
        Err(e) => return Support::Absent(format!("could not tell: opening /proc/self/exe: {e}")),
    };
    verity_support_of(exe.as_fd(), "/proc/self/exe")
}

/// fs-verity support as seen through the filesystem of the directory or
/// file at `path` (for "does the store's filesystem have it").
pub fn verity_support_at(path: &std::path::Path) -> Support {
    match std::fs::File::open(path) {
        Ok(f) => verity_support_of(f.as_fd(), &path.display().to_string()),
        Err(e) => Support::Absent(format!("could not tell: opening {}: {e}", path.display())),
    }
}

/// fs-verity support as seen through the filesystem of `fd`.
pub(crate) fn verity_support_of(fd: std::os::fd::BorrowedFd<'_>, what: &str) -> Support {
    match sys::measure_verity(fd) {
        Ok(()) => Support::Present,
        Err(Errno::NODATA | Errno::OVERFLOW) => Support::Present,
        Err(Errno::OPNOTSUPP) => Support::Absent(format!(
            "FS_IOC_MEASURE_VERITY on {what}: Operation not supported"
        )),
        Err(Errno::NOTTY) => Support::Absent(format!(
            "could not tell: the filesystem of {what} has no fs-verity ioctls"
        )),
        Err(errno) => Support::Absent(format!(
            "FS_IOC_MEASURE_VERITY on {what}: {}",
            errno_text(errno)
        )),
    }
}

/// `/dev/loop-control` opened as cairn opens it to attach a device; nothing
/// is attached. (`LOOP_CONFIGURE` itself, Linux 5.8, is older than the
/// other features cairn needs, so it is not tried.)
fn probe_loop_devices() -> Support {
    match rustix::fs::open(
        "/dev/loop-control",
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(_) => Support::Present,
        Err(errno) => classify(&StepFailure::new("open /dev/loop-control", errno)),
    }
}

fn probe_fuse() -> Support {
    match std::fs::metadata("/dev/fuse") {
        Ok(m) if m.file_type().is_char_device() => Support::Present,
        Ok(_) => Support::Absent("/dev/fuse is not a character device".into()),
        Err(e) => Support::Absent(format!("/dev/fuse: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_present() -> KernelFeatures {
        KernelFeatures {
            release: "6.18.0".into(),
            support: vec![Support::Present; Feature::ALL.len()],
        }
    }

    #[test]
    fn require_names_the_missing_feature_and_the_remedy() {
        let mut k = all_present();
        k.set(
            Feature::OverlayDataOnlyLayers,
            Support::Absent("fsconfig lowerdir+: Invalid argument".into()),
        );
        assert!(k.require(&[Feature::Erofs, Feature::Overlay]).is_ok());
        let err = k
            .require(&[Feature::Erofs, Feature::OverlayDataOnlyLayers])
            .unwrap_err();
        assert_eq!(err.feature, Feature::OverlayDataOnlyLayers);
        assert_eq!(
            err.to_string(),
            "kernel 6.18.0 lacks overlayfs data-only lower layers (datadir+ or lowerdir=A::B, \
             Linux ≥ 6.5): use Linux 6.5 or later (probe: fsconfig lowerdir+: Invalid argument)"
        );
        assert_eq!(k.missing(), vec![Feature::OverlayDataOnlyLayers]);
    }

    /// What Debian bookworm's 6.1 kernel shows (EROFS and loop devices, no
    /// file-backed EROFS, no detached layers; in the private namespace plain
    /// lowerdir works but data-only layers and lowerdir+ do not).
    fn linux_6_1() -> KernelFeatures {
        let mut k = all_present();
        k.release = "6.1.0-56-cloud-amd64".into();
        for f in [
            Feature::ErofsFileBacked,
            Feature::OverlayDataOnlyLayers,
            Feature::OverlayLayerAppend,
            Feature::OverlayDetachedLayers,
        ] {
            k.set(
                f,
                Support::Absent("fsconfig create: Invalid argument".into()),
            );
        }
        k
    }

    /// 6.12 has file-backed EROFS and data-only layers but not detached
    /// layers: it mounts, with the layers in a private namespace.
    #[test]
    fn linux_6_12_mounts_through_a_private_namespace() {
        let mut k = linux_6_1();
        k.release = "6.12.117+deb12-cloud-amd64".into();
        k.set(Feature::ErofsFileBacked, Support::Present);
        k.set(Feature::OverlayDataOnlyLayers, Support::Present);
        k.set(Feature::OverlayLayerAppend, Support::Present);
        assert_eq!(k.erofs_path().unwrap(), ErofsPath::File);
        k.require(&crate::stack::STACK_FEATURES).unwrap();
        assert_eq!(k.layer_path(), LayerPath::PrivateNamespace);
        let shown = k.to_string();
        assert!(
            shown.contains(
                "cairn mount and cairn run: supported; overlay layers are handed over \
                 attached in a private mount namespace"
            ),
            "{shown}"
        );
        if !crate::privns::private_ns_forced() {
            assert_eq!(all_present().layer_path(), LayerPath::Detached);
        }
    }

    #[test]
    fn old_kernel_is_refused_in_one_line_naming_the_feature_and_its_version() {
        let k = linux_6_1();
        assert_eq!(k.erofs_path().unwrap(), ErofsPath::Loop);
        let err = k.require(&crate::stack::STACK_FEATURES).unwrap_err();
        assert_eq!(err.feature, Feature::OverlayDataOnlyLayers);
        let text = err.to_string();
        assert!(!text.contains('\n'), "{text}");
        assert!(
            text.starts_with("kernel 6.1.0-56-cloud-amd64 lacks overlayfs data-only lower layers"),
            "{text}"
        );
        assert!(text.contains("Linux ≥ 6.5"), "{text}");
        let shown = k.to_string();
        assert!(
            shown.contains("EROFS images are read through a read-only loop device"),
            "{shown}"
        );
        assert!(
            shown.contains(
                "cairn mount and cairn run: not supported: \
                 kernel 6.1.0-56-cloud-amd64 lacks overlayfs data-only lower layers"
            ),
            "{shown}"
        );
    }

    #[test]
    fn every_feature_names_the_kernel_version_it_needs() {
        for f in Feature::ALL {
            assert!(
                f.description().contains("Linux ≥ "),
                "{f:?}: {}",
                f.description()
            );
        }
    }

    #[test]
    fn erofs_path_without_file_backed_mounts_or_loop_devices_names_both() {
        let mut k = linux_6_1();
        k.set(
            Feature::LoopDevices,
            Support::Absent("open /dev/loop-control: No such file or directory".into()),
        );
        let err = k.erofs_path().unwrap_err();
        assert_eq!(err.feature, Feature::ErofsFileBacked);
        let text = err.to_string();
        assert!(text.contains("Linux 6.12"), "{text}");
        assert!(text.contains("/dev/loop-control"), "{text}");
        assert!(!text.contains('\n'), "{text}");
        if !erofs_loop_forced() {
            assert_eq!(all_present().erofs_path().unwrap(), ErofsPath::File);
        }
    }

    #[test]
    fn refused_probe_says_run_as_root() {
        let mut k = all_present();
        k.set(
            Feature::NewMountApi,
            Support::NotPermitted("fsopen tmpfs: Operation not permitted".into()),
        );
        let err = k.require(&[Feature::NewMountApi]).unwrap_err();
        assert!(err.to_string().contains("run as root"), "{err}");
    }
}
