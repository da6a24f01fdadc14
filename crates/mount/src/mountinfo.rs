//! The mount table as the calling thread sees it, and unmounting.
//!
//! The table is read from `/proc/thread-self/mountinfo`, not
//! `/proc/self/mountinfo`: a thread may have its own mount namespace
//! (`unshare(CLONE_NEWNS)` applies per thread), and `/proc/self` shows the
//! main thread's. Paths in the table escape space, tab, newline and
//! backslash as octal (`\040`, `\011`, `\012`, `\134`); entries are returned
//! unescaped.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use rustix::io::Errno;
use rustix::mount::{unmount, UnmountFlags};

use crate::error::{Action, MountError, StepFailure};

const MOUNTINFO: &str = "/proc/thread-self/mountinfo";

/// One line of `mountinfo` (see proc(5)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    /// `major:minor` of the superblock's device (anonymous for erofs-on-file,
    /// overlay, tmpfs).
    pub device: (u32, u32),
    /// The directory of the filesystem that is mounted here.
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub mount_options: String,
    pub fs_type: String,
    /// The `source` the filesystem was mounted with (for cairn's overlays:
    /// the EROFS image path).
    pub source: String,
    pub super_options: String,
}

/// The calling thread's mount table, in mount order.
pub fn mount_table() -> Result<Vec<MountEntry>, MountError> {
    let text = std::fs::read(MOUNTINFO).map_err(|source| MountError::MountTable {
        path: MOUNTINFO.into(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// The mount table of another process's mount namespace, from a
/// `/proc/<pid>/mountinfo` file (or any file in that format).
pub fn mount_table_of(mountinfo: &Path) -> std::io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read(mountinfo)?))
}

/// The topmost mount whose mount point is `path` (after resolving symlinks
/// and `..` in `path`), if any.
pub fn find_mount(path: &Path) -> Result<Option<MountEntry>, MountError> {
    let path = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(MountError::MountTable {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    Ok(mount_table()?
        .into_iter()
        .rev()
        .find(|m| m.mount_point == path))
}

/// Whether something is mounted on `path`.
pub fn is_mountpoint(path: &Path) -> Result<bool, MountError> {
    Ok(find_mount(path)?.is_some())
}

/// How [`umount_with`] unmounts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UmountOptions {
    /// `MNT_DETACH`: detach now, free when the last user goes. Off by
    /// default, so that a busy mount is an `EBUSY` error the caller sees.
    pub lazy: bool,
}

/// Unmounts `target` (not lazily). For a cairn stack this frees the overlay
/// and with it the EROFS, objects and tmpfs mounts it holds.
pub fn umount(target: &Path) -> Result<(), MountError> {
    umount_with(target, UmountOptions::default())
}

/// Unmounts `target`. Symlinks in the last component are not followed.
pub fn umount_with(target: &Path, options: UmountOptions) -> Result<(), MountError> {
    let mut flags = UnmountFlags::NOFOLLOW;
    if options.lazy {
        flags |= UnmountFlags::DETACH;
    }
    match unmount(target, flags) {
        Ok(()) => Ok(()),
        Err(Errno::INVAL) if !is_mountpoint(target).unwrap_or(true) => {
            Err(MountError::NotMounted(target.to_path_buf()))
        }
        Err(errno) => Err(MountError::step(
            Action::Unmount,
            target,
            StepFailure::new("umount2", errno),
        )),
    }
}

/// Parses `mountinfo` text (proc(5)), in the order of its lines;
/// malformed lines are skipped. This is cairn's one reader of the format:
/// the store's gc and the cgroup setup use it too.
pub fn parse_mountinfo(text: &[u8]) -> Vec<MountEntry> {
    text.split(|b| *b == b'\n').filter_map(parse_line).collect()
}

fn parse_line(line: &[u8]) -> Option<MountEntry> {
    let fields: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
    let sep = fields.iter().position(|f| *f == b"-")?;
    if sep < 6 || fields.len() < sep + 4 {
        return None;
    }
    let text = |b: &[u8]| String::from_utf8_lossy(&unescape(b)).into_owned();
    let num = |b: &[u8]| std::str::from_utf8(b).ok()?.parse::<u32>().ok();
    let (major, minor) = std::str::from_utf8(fields[2]).ok()?.split_once(':')?;
    Some(MountEntry {
        mount_id: num(fields[0])?,
        parent_id: num(fields[1])?,
        device: (major.parse().ok()?, minor.parse().ok()?),
        root: PathBuf::from(OsString::from_vec(unescape(fields[3]))),
        mount_point: PathBuf::from(OsString::from_vec(unescape(fields[4]))),
        mount_options: text(fields[5]),
        fs_type: text(fields[sep + 1]),
        source: text(fields[sep + 2]),
        super_options: text(fields[sep + 3]),
    })
}

/// Undoes the kernel's `\ooo` octal escapes (`mangle()` in fs/proc_namespace.c).
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        if field[i] == b'\\' {
            let octal = field
                .get(i + 1..i + 4)
                .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
            if let Some(d) = octal {
                let value = u32::from(d[0] - b'0') * 64
                    + u32::from(d[1] - b'0') * 8
                    + u32::from(d[2] - b'0');
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(field[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_an_overlay_line_with_escaped_paths_and_optional_fields() {
        let text = b"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n\
            88 27 0:52 / /tmp/my\\040dir/with\\011tab\\134back rw,relatime shared:5 master:2 - overlay \
            /var/lib/cairn/images/ab\\040cd ro,lowerdir+=/proc/self/fd/7,redirect_dir=on\n\
            garbage line\n";
        let entries = parse_mountinfo(text);
        assert_eq!(entries.len(), 2);
        let ovl = &entries[1];
        assert_eq!(ovl.mount_id, 88);
        assert_eq!(ovl.parent_id, 27);
        assert_eq!(ovl.device, (0, 52));
        assert_eq!(ovl.mount_point, Path::new("/tmp/my dir/with\ttab\\back"));
        assert_eq!(ovl.fs_type, "overlay");
        assert_eq!(ovl.source, "/var/lib/cairn/images/ab cd");
        assert_eq!(
            ovl.super_options,
            "ro,lowerdir+=/proc/self/fd/7,redirect_dir=on"
        );
        assert_eq!(ovl.mount_options, "rw,relatime");
    }

    #[test]
    fn unescape_leaves_non_octal_backslashes_alone() {
        assert_eq!(unescape(b"a\\040b"), b"a b");
        assert_eq!(unescape(b"a\\x40"), b"a\\x40");
        assert_eq!(unescape(b"end\\04"), b"end\\04");
        assert_eq!(unescape(b"\\"), b"\\");
    }

    #[test]
    fn reads_this_threads_table() {
        let table = mount_table().expect("mountinfo is readable without privileges");
        assert!(table.iter().any(|m| m.mount_point == Path::new("/")));
    }
}
