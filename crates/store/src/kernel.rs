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
