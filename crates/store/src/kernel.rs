//! Kernel fs-verity: whether the store's filesystem has it, and sealing
//! objects with it when it does.
//!
//! This module owns the run-time probe and the policy around
//! `FS_IOC_ENABLE_VERITY` (the raw ioctl is in `sys.rs`). It must never make
//! the store depend on kernel verity: without it, objects are named and
//! checked by their userspace digest (`verity.rs`) and everything works.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::sys;
use crate::tmp::Staging;

/// Whether the kernel can seal store objects with fs-verity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VeritySupport {
    /// `FS_IOC_ENABLE_VERITY` works on the store's filesystem: every object
    /// imported from now on is sealed before it is published.
    Supported,
    /// It does not; the reason says what the kernel answered and where.
    Unsupported(String),
}

impl VeritySupport {
    pub fn is_supported(&self) -> bool {
        matches!(self, VeritySupport::Supported)
    }
}

/// The warning is about the host, not about one store: say it once.
static WARNED: AtomicBool = AtomicBool::new(false);

/// Tries to enable fs-verity on a scratch file in the staging directory.
pub(crate) fn probe(staging: &Arc<Staging>) -> VeritySupport {
    let fs = fs_name(staging.path());
    let result = (|| -> io::Result<()> {
        let mut tmp = staging.tmp_file("verity-probe").map_err(into_io)?;
        tmp.file().write_all(b"cairn")?;
        tmp.close();
        enable_on_path(tmp.path())
    })();
    match result {
        Ok(()) => VeritySupport::Supported,
        Err(e) => {
            let reason = format!("{}: {e}", staging.root().display());
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "kernel fs-verity not available on {fs} ({reason}): \
                     store objects are checked in userspace only"
                );
            }
            VeritySupport::Unsupported(format!("{fs}: {reason}"))
        }
    }
}

fn into_io(e: crate::StoreError) -> io::Error {
    io::Error::other(e.to_string())
}

/// Enables fs-verity on the file at `path` through a fresh read-only
/// descriptor. The caller must have closed every writable one. A file that
/// has verity already counts as success.
pub(crate) fn enable_on_path(path: &Path) -> io::Result<()> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)?;
    match sys::enable_verity(f.as_fd()) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        r => r,
    }
}

/// A readable name for the filesystem holding `path`, for messages.
fn fs_name(path: &Path) -> String {
    let Ok(dir) = File::open(path) else {
        return "the store's filesystem".into();
    };
    let Ok(st) = rustix::fs::fstatfs(&dir) else {
        return "the store's filesystem".into();
    };
    // Magic numbers from <linux/magic.h>; they all fit in 32 bits, whatever
    // width the platform gives f_type.
    let magic = st.f_type as u32;
    let name = match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0xF2F5_2010 => "f2fs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        0xE0F5_E1E2 => "erofs",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        0x0102_1997 => "9p",
        0xCA45_1A4E => "bcachefs",
        _ => return format!("filesystem type {magic:#x}"),
    };
    name.into()
}

/// Enables fs-verity on the file at `path` (no writable descriptor of it
/// may be open); one that has it already counts as success. For tools and
/// tests: the store seals its own objects and images.
pub fn seal_with_verity(path: &Path) -> io::Result<()> {
    enable_on_path(path)
}

/// The fs-verity digest of the file at `path` as the kernel measures it
/// (`FS_IOC_MEASURE_VERITY`): `Ok(None)` when the file has no fs-verity,
/// an error where its filesystem or the kernel has none.
pub fn measure_verity(path: &Path) -> io::Result<Option<crate::ObjectId>> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?;
    Ok(sys::measure_verity(f.as_fd())?.map(crate::ObjectId))
}

/// Whether the file at `path` has fs-verity enabled (`statx`'s
/// `STATX_ATTR_VERITY`: no open, no ioctl). `false` also where the
/// filesystem does not report the attribute.
pub fn has_verity(path: &Path) -> io::Result<bool> {
    /// `STATX_ATTR_VERITY` from `<linux/stat.h>`.
    const STATX_ATTR_VERITY: u64 = 0x0010_0000;
    let st = rustix::fs::statx(
        rustix::fs::CWD,
        path,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::BASIC_STATS,
    )?;
    Ok(st.stx_attributes_mask.bits() & STATX_ATTR_VERITY != 0
        && st.stx_attributes.bits() & STATX_ATTR_VERITY != 0)
}

/// What `--verity` asks of a mount: overlayfs `verity=require` always,
/// where every object has fs-verity, or never.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerityChoice {
    Require,
    #[default]
    Auto,
    Off,
}

impl std::str::FromStr for VerityChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "require" => Ok(VerityChoice::Require),
            "auto" => Ok(VerityChoice::Auto),
            "off" => Ok(VerityChoice::Off),
            _ => Err(format!(
                "invalid verity mode '{s}' (expected require, auto or off)"
            )),
        }
    }
}

/// What [`crate::Store::decide_verity`] chose, and why (for the user).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerityDecision {
    pub mode: cairn_mount::VerityMode,
    pub reason: String,
}

impl std::fmt::Display for VerityDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.mode {
            cairn_mount::VerityMode::Require => "require",
            cairn_mount::VerityMode::Off => "off",
        };
        write!(f, "verity {mode}: {}", self.reason)
    }
}

impl crate::Store {
    /// The first object of image `digest` (in the image's walk order, with
    /// a path that uses it) whose file lacks fs-verity, or `None` when every
    /// one has it. Objects missing from the store count as lacking it.
    pub fn object_without_verity(
        &self,
        digest: &str,
    ) -> Result<Option<(crate::ObjectId, String)>, crate::StoreError> {
        let contents = self.image_contents(digest)?;
        for (id, usage) in &contents.objects {
            let path = self.object_path(id);
            let sealed = has_verity(&path)
                .map_err(|e| crate::StoreError::io("statx", &path, &self.root, e))?;
            if !sealed {
                let used_by = String::from_utf8_lossy(&usage.path).into_owned();
                return Ok(Some((*id, used_by)));
            }
        }
        Ok(None)
    }

    /// Turns `--verity` into the overlay's mode for image `digest` (its
    /// objects in this store's `objects/`): `Require` refuses, naming the
    /// object, where one lacks fs-verity; `Auto` requires verity where every
    /// object has it and the kernel can check it, else is off; the reason
    /// says which and why. `lazy` is for a FUSE data layer, whose files have
    /// no fs-verity.
    pub fn decide_verity(
        &self,
        digest: &str,
        choice: VerityChoice,
        lazy: bool,
    ) -> Result<VerityDecision, VerityRefusal> {
        use cairn_mount::VerityMode;
        let off = |reason: String| {
            Ok(VerityDecision {
                mode: VerityMode::Off,
                reason,
            })
        };
        if choice == VerityChoice::Off {
            return off("asked for (--verity off)".into());
        }
        if lazy {
            let why = "the lazy layer's files (served through FUSE) have no fs-verity";
            if choice == VerityChoice::Require {
                return Err(VerityRefusal(format!("--verity require: {why}")));
            }
            return off(why.into());
        }
        if choice == VerityChoice::Auto {
            // Cheap first: whether the objects' filesystem has fs-verity at
            // all (no need to read the image on a machine without it).
            if let cairn_mount::Support::Absent(why) | cairn_mount::Support::NotPermitted(why) =
                cairn_mount::probe::verity_support_at(&self.objects_dir())
            {
                return off(format!("no fs-verity where the objects are ({why})"));
            }
        }
        let lacking = self
            .object_without_verity(digest)
            .map_err(|e| VerityRefusal(format!("checking the objects' fs-verity: {e}")))?;
        match (lacking, choice) {
            (Some((id, path)), VerityChoice::Require) => Err(VerityRefusal(format!(
                "--verity require: object {} (the content of {path} in image {digest}) has no \
                 fs-verity; objects get it when they are imported into a store on a filesystem \
                 with fs-verity (ext4 -O verity, btrfs, f2fs)",
                id.object_path()
            ))),
            (Some((id, path)), _) => off(format!(
                "object {} (the content of {path}) has no fs-verity",
                id.object_path()
            )),
            (None, _) => Ok(VerityDecision {
                mode: VerityMode::Require,
                reason: if choice == VerityChoice::Require {
                    "asked for (--verity require); every object has fs-verity".into()
                } else {
                    "every object of the image has fs-verity".into()
                },
            }),
        }
    }
}

/// `--verity require` cannot be honoured; the text names why (an object).
#[derive(Clone, Debug, thiserror::Error)]
#[error("{0}")]
pub struct VerityRefusal(pub String);
