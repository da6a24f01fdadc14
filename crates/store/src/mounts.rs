//! Live mounts: which images of the store are mounted right now, in any
//! mount namespace this process can see.
//!
//! `cairn mount` exits once the mount is attached, so nothing of cairn's
//! runs while an image is in use; the kernel's mount tables are the record.
//! cairn mounts an image as overlayfs with `source=<root>/images/<digest>`
//! (the EROFS layer under it is detached and appears nowhere), so an
//! overlay or EROFS mount whose source's file name is an image digest of
//! this store keeps that image, and everything it reaches, alive. No file
//! under the store records mounts: a file would go stale on `umount(8)`, a
//! crash or a dying namespace, the mount table cannot.
//!
//! The match is on the digest alone, not on the whole path: the source is
//! the path as the mounter saw it (another mount namespace, a symlinked
//! root), and keeping an image another store's mount happens to share is
//! harmless where deleting one in use is not.
//!
//! Every mount namespace is read once, through the first process found in
//! it (`/proc/<pid>/mountinfo`), so containers in their own namespaces are
//! seen too. Not seen: namespaces no process is in (kept alive only by a
//! bind-mounted `/proc/<pid>/ns/mnt`), processes this user may not inspect
//! (run gc as root), and lazily detached mounts (`umount -l`) still busy.
//!
//! This module only reads `/proc`; it never changes a mount.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use crate::image::is_image_digest;
use crate::{Store, StoreError};

/// A mount of one of the store's images.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LiveMount {
    pub digest: String,
    /// Where it is mounted, in the namespace of `pid`.
    pub mount_point: PathBuf,
    pub fs_type: String,
    /// A process in the mount namespace the mount is in.
    pub pid: u32,
    /// Whether `images/<digest>` exists. A mount whose source is this
    /// store's `images/` directory but whose image is gone (removed while
    /// mounted) uses objects no one can list any more.
    pub in_store: bool,
}

impl Store {
    /// Every mount, in every mount namespace visible to this process, whose
    /// source is one of this store's images. Fails only if this process's
    /// own mount table cannot be read (a gc that cannot see mounts must not
    /// run).
    pub fn live_mounts(&self) -> Result<Vec<LiveMount>, StoreError> {
        let own = Path::new("/proc/thread-self/mountinfo");
        let text =
            fs::read(own).map_err(|e| StoreError::io("reading mount table", own, &self.root, e))?;
        let self_pid = std::process::id();
        let mut found = Vec::new();
        self.collect(&text, self_pid, &mut found);
        let mut seen = HashSet::new();
        if let Ok(ns) = fs::read_link("/proc/thread-self/ns/mnt") {
            seen.insert(ns);
        }
        let procs = fs::read_dir("/proc")
            .map_err(|e| StoreError::io("listing", Path::new("/proc"), &self.root, e))?;
        for entry in procs.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            // Gone, or not ours to look at: skip (see the module docs).
            let Ok(ns) = fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
                continue;
            };
            if !seen.insert(ns) {
                continue;
            }
            if let Ok(text) = fs::read(format!("/proc/{pid}/mountinfo")) {
                self.collect(&text, pid, &mut found);
            }
        }
        found.sort();
        found.dedup();
        Ok(found)
    }

    fn collect(&self, mountinfo: &[u8], pid: u32, out: &mut Vec<LiveMount>) {
        let images_dir = self.images_dir();
        let images_real = fs::canonicalize(&images_dir).ok();
        for m in parse_mountinfo(mountinfo) {
            if m.fs_type != "overlay" && m.fs_type != "erofs" {
                continue;
            }
            let Some(digest) = Path::new(&m.source).file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !is_image_digest(digest) {
                continue;
            }
            let in_store = self.has_image(digest);
            let parent = Path::new(&m.source).parent();
            let ours = parent == Some(images_dir.as_path()) || parent == images_real.as_deref();
            if in_store || ours {
                out.push(LiveMount {
                    digest: digest.to_owned(),
                    mount_point: m.mount_point,
                    fs_type: m.fs_type,
                    pid,
                    in_store,
                });
            }
        }
    }
}

/// The fields of a mountinfo line this module needs.
#[derive(Debug, PartialEq, Eq)]
struct MountLine {
    mount_point: PathBuf,
    fs_type: String,
    source: String,
}

/// Parses `/proc/<pid>/mountinfo` (proc(5)); malformed lines are skipped.
fn parse_mountinfo(text: &[u8]) -> Vec<MountLine> {
    use std::os::unix::ffi::OsStringExt;
    let mut out = Vec::new();
    for line in text.split(|b| *b == b'\n') {
        let fields: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == b"-") else {
            continue;
        };
        if sep < 6 || fields.len() < sep + 3 {
            continue;
        }
        out.push(MountLine {
            mount_point: PathBuf::from(std::ffi::OsString::from_vec(unescape(fields[4]))),
            fs_type: String::from_utf8_lossy(&unescape(fields[sep + 1])).into_owned(),
            source: String::from_utf8_lossy(&unescape(fields[sep + 2])).into_owned(),
        });
    }
    out
}

/// Undoes the kernel's `\ooo` escapes of space, tab, newline and backslash.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while let Some(&b) = field.get(i) {
        if b == b'\\' {
            if let Some(d) = field.get(i + 1..i + 4) {
                if d.iter().all(|c| (b'0'..=b'7').contains(c)) {
                    let v = u32::from(d[0] - b'0') * 64
                        + u32::from(d[1] - b'0') * 8
                        + u32::from(d[2] - b'0');
                    if let Ok(byte) = u8::try_from(v) {
                        out.push(byte);
                        i += 4;
                        continue;
                    }
                }
            }
        }
        out.push(b);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_overlay_sources_with_escapes() {
        let d = "a".repeat(64);
        let text = format!(
            "27 1 254:0 / / rw - ext4 /dev/vda rw\n\
             88 27 0:52 / /tmp/my\\040mnt rw,relatime shared:5 - overlay /var/lib/cairn/images/{d} ro,lowerdir+=/proc/self/fd/7\n\
             junk\n"
        );
        let lines = parse_mountinfo(text.as_bytes());
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1].mount_point, Path::new("/tmp/my mnt"));
        assert_eq!(lines[1].fs_type, "overlay");
        assert_eq!(lines[1].source, format!("/var/lib/cairn/images/{d}"));
    }
}
