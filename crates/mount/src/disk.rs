//! Size-capped disk upper layers (`cairn run --upper disk:SIZE`).
//!
//! A host directory shows its usage to `du` and to the kubelet, but caps
//! it only through project quotas, which need kernel quota support and a
//! filesystem mounted with them. Where those are missing (this project's
//! machines: no `CONFIG_QUOTA`), the cap comes from a filesystem of its
//! own: a sparse file on the store's filesystem, formatted ext4 and
//! mounted through a loop device at a directory on the host, mounted with
//! `discard` so that deleted data is given back to the host. A container
//! that fills it gets `ENOSPC`; the host and the store do not; `du` on
//! the directory (it crosses into the mount) shows what the container
//! wrote, and the file's allocated blocks grow and shrink with it.
//!
//! The loop device is attached with `LO_FLAGS_AUTOCLEAR`: it detaches
//! itself when the filesystem is unmounted, so unmounting the directory
//! (even lazily) and deleting the file is the whole teardown.

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;

use rustix::mount::{move_mount, MountAttrFlags, MoveMountFlags};

use crate::error::{Action, MountError, StepFailure};
use crate::fscontext::FsContext;
use crate::loopdev::{LoopDevice, LoopFlags};

/// The smallest cap accepted: ext4 needs room for its own metadata.
pub const MIN_DISK_UPPER: u64 = 8 << 20;

/// Makes a sparse `size`-byte file `image` (which must not exist), formats
/// it ext4 and mounts it at `target` (created if missing). On error,
/// nothing stays mounted or attached; the caller removes `image`.
pub fn mount_sized_upper(image: &Path, size: u64, target: &Path) -> Result<(), MountError> {
    let invalid = |reason: String| MountError::Invalid {
        action: Action::MountDiskUpper,
        path: target.to_path_buf(),
        reason,
    };
    if size < MIN_DISK_UPPER {
        return Err(invalid(format!(
            "a disk upper needs at least {} MiB (asked for {size} bytes)",
            MIN_DISK_UPPER >> 20
        )));
    }
    let io_fail =
        |what: &str, e: std::io::Error| invalid(format!("{what} {}: {e}", image.display()));
    let file = File::create_new(image).map_err(|e| io_fail("creating", e))?;
    file.set_len(size).map_err(|e| io_fail("sizing", e))?;
    drop(file);
    format_ext4(image).map_err(invalid)?;
    std::fs::create_dir_all(target)
        .map_err(|e| invalid(format!("creating the mount point: {e}")))?;

    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .map_err(|e| io_fail("opening", e))?;
    let device = LoopDevice::attach(
        &backing,
        LoopFlags {
            read_only: false,
            direct_io: false,
        },
    )
    .map_err(|f| MountError::step(Action::MountDiskUpper, target, f))?;
    let mount = || -> Result<(), StepFailure> {
        let ctx = FsContext::open("ext4")?;
        ctx.set_string("source", device.path.as_str())?;
        ctx.set_flag("discard")?;
        let fd = ctx.create_and_mount(MountAttrFlags::MOUNT_ATTR_NODEV)?;
        move_mount(
            fd.as_fd(),
            "",
            rustix::fs::CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|errno| StepFailure::new("move_mount", errno))
    };
    let mounted = mount();
    // The mount (if any) holds the device now; closing ours lets
    // autoclear detach it with the last unmount, or right away on error.
    drop(device);
    drop(backing);
    mounted.map_err(|f| MountError::step(Action::MountDiskUpper, target, f))
}

/// `mkfs.ext4` on `image`: no reserved blocks (the cap is the container's),
/// no journal (the layer is thrown away with the container), lazy init
/// (a sparse file stays sparse).
fn format_ext4(image: &Path) -> Result<(), String> {
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-O", "^has_journal"])
        .args(["-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"])
        .args(["-L", "cairn-upper"])
        .arg(image)
        .output()
        .map_err(|e| {
            format!("running mkfs.ext4 (e2fsprogs; a disk upper with a size needs it): {e}")
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "mkfs.ext4 {} failed: {}",
            image.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
