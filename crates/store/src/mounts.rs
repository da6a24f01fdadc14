//! Live mounts: which images of the store are mounted right now, in any
//! mount namespace this process can see.
//!
//! `cairn mount` exits once the mount is attached, so nothing of cairn's
//! runs while an image is in use; the kernel's mount tables are the record.
//! The mount crate mounts an image as overlayfs with
//! `source=<root>/images/<digest>` (the EROFS layer under it is detached and
//! appears nowhere) and reads that back with `cairn_mount::mounted_image`;
//! both sides of this contract are written down in `cairn_mount::stack`
//! ("The source names the image"). An overlay or EROFS mount whose source's
//! file name is an image digest of this store keeps that image, and
//! everything it reaches, alive. No file
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

use cairn_mount::{mount_table_of, mounted_image, MountEntry};

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
        let table = mount_table_of(own)
            .map_err(|e| StoreError::io("reading mount table", own, &self.root, e))?;
        let self_pid = std::process::id();
        let mut found = Vec::new();
        self.collect(&table, self_pid, &mut found);
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
            if let Ok(table) = mount_table_of(Path::new(&format!("/proc/{pid}/mountinfo"))) {
                self.collect(&table, pid, &mut found);
            }
        }
        found.sort();
        found.dedup();
        Ok(found)
    }

    /// Adds the mounts of `table` (the mount namespace of `pid`) that use
    /// one of this store's images.
    fn collect(&self, table: &[MountEntry], pid: u32, out: &mut Vec<LiveMount>) {
        let images_dir = self.images_dir();
        let images_real = fs::canonicalize(&images_dir).ok();
        for m in table {
            let Some(image) = mounted_image(m) else {
                continue;
            };
            let Some(digest) = image.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !is_image_digest(digest) {
                continue;
            }
            let in_store = self.has_image(digest);
            let parent = image.parent();
            let ours = parent == Some(images_dir.as_path()) || parent == images_real.as_deref();
            if in_store || ours {
                out.push(LiveMount {
                    digest: digest.to_owned(),
                    mount_point: m.mount_point.clone(),
                    fs_type: m.fs_type.clone(),
                    pid,
                    in_store,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use cairn_mount::parse_mountinfo;

    use super::*;

    /// An overlay mounted from some `images/<digest>` is live by its digest
    /// even when that path is not this store's (another namespace's view of
    /// it): the contract with `cairn_mount::mounted_image`.
    #[test]
    fn an_overlay_source_ending_in_an_image_digest_is_live() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let d = "a".repeat(64);
        let text = format!(
            "27 1 254:0 / / rw - ext4 /dev/vda rw\n\
             88 27 0:52 / /tmp/my\\040mnt rw,relatime shared:5 - overlay /elsewhere/images/{d} ro\n\
             89 27 0:53 / /tmp/other rw - overlay {}/images/{} ro\n",
            dir.path().display(),
            "b".repeat(64)
        );
        let mut found = Vec::new();
        store.collect(&parse_mountinfo(text.as_bytes()), 7, &mut found);
        // The first is not in the store and not under its images/: not ours.
        // The second is under this store's images/ though the image is gone.
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].digest, "b".repeat(64));
        assert_eq!(found[0].mount_point, Path::new("/tmp/other"));
        assert!(!found[0].in_store);
        assert_eq!(found[0].pid, 7);
    }
}
