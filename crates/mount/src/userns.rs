//! User namespaces that exist only to carry an id mapping for idmapped
//! mounts (`mount_setattr(MOUNT_ATTR_IDMAP)`).
//!
//! Creating one needs a process to enter it: a forked child (see
//! `UserNsHolder` in the private `sys` module) unshares `CLONE_NEWUSER` and waits; we write
//! its `uid_map`/`gid_map` from outside (as root in the parent namespace no
//! `setgroups` dance is needed), open `/proc/PID/ns/user`, then kill and reap
//! the child. The namespace lives on as long as the returned fd. The calling
//! process itself never changes namespace, so this works from a
//! multi-threaded program.

use std::fmt;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;

use crate::error::MountError;
use crate::sys::UserNsHolder;

/// One contiguous id mapping: container ids `0..count` are host uids
/// `uid..uid+count` and host gids `gid..gid+count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IdMap {
    /// Host uid that container uid 0 maps to.
    pub uid: u32,
    /// Host gid that container gid 0 maps to.
    pub gid: u32,
    /// How many ids are mapped.
    pub count: u32,
}

impl IdMap {
    /// The host uid a container uid maps to, if it is mapped.
    pub fn host_uid(&self, container_uid: u32) -> Option<u32> {
        if container_uid < self.count {
            self.uid.checked_add(container_uid)
        } else {
            None
        }
    }

    /// The host gid a container gid maps to, if it is mapped.
    pub fn host_gid(&self, container_gid: u32) -> Option<u32> {
        if container_gid < self.count {
            self.gid.checked_add(container_gid)
        } else {
            None
        }
    }

    /// Checks the mapping can be written to `uid_map`: non-empty, and the
    /// host range must stay below id 2^32-1 (which means "no id").
    pub fn validate(&self) -> Result<(), String> {
        if self.count == 0 {
            return Err(format!("id map {self} maps no ids (count is 0)"));
        }
        let fits = |base: u32| u64::from(base) + u64::from(self.count) <= u64::from(u32::MAX);
        if !fits(self.uid) || !fits(self.gid) {
            return Err(format!("id map {self} runs past the largest id 4294967294"));
        }
        Ok(())
    }
}

impl fmt::Display for IdMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "0..{} → uid {}.., gid {}..",
            u64::from(self.count),
            self.uid,
            self.gid
        )
    }
}

/// A user namespace holding one [`IdMap`], kept alive by its fd.
#[derive(Debug)]
pub struct UserNamespace {
    fd: OwnedFd,
    map: IdMap,
}

impl UserNamespace {
    /// Creates a user namespace whose `uid_map` is `0 UID COUNT` and whose
    /// `gid_map` is `0 GID COUNT`. Needs root (CAP_SETUID/CAP_SETGID in the
    /// caller's namespace) for mappings other than the caller's own id.
    pub fn new(map: IdMap) -> Result<Self, MountError> {
        let fail = |step: &str, errno: Errno| MountError::UserNamespace {
            idmap: map,
            step: step.to_string(),
            errno,
        };
        let io_fail = |step: &str, err: std::io::Error| {
            fail(step, Errno::from_io_error(&err).unwrap_or(Errno::IO))
        };
        if let Err(reason) = map.validate() {
            return Err(fail(&format!("invalid map: {reason}"), Errno::INVAL));
        }

        let holder = UserNsHolder::spawn()
            .map_err(|errno| fail("fork and unshare(CLONE_NEWUSER)", errno))?;
        let proc_dir = format!("/proc/{}", holder.pid().as_raw_nonzero());
        // Each map must be written with a single write(2); std::fs::write
        // does that for a buffer this small.
        std::fs::write(
            format!("{proc_dir}/uid_map"),
            format!("0 {} {}\n", map.uid, map.count),
        )
        .map_err(|e| io_fail("writing uid_map", e))?;
        std::fs::write(
            format!("{proc_dir}/gid_map"),
            format!("0 {} {}\n", map.gid, map.count),
        )
        .map_err(|e| io_fail("writing gid_map", e))?;
        let ns =
            File::open(format!("{proc_dir}/ns/user")).map_err(|e| io_fail("opening ns/user", e))?;
        drop(holder);
        Ok(UserNamespace { fd: ns.into(), map })
    }

    /// The mapping this namespace carries.
    pub fn map(&self) -> IdMap {
        self.map
    }
}

impl AsFd for UserNamespace {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idmap_translates_only_mapped_ids() {
        let map = IdMap {
            uid: 100_000,
            gid: 200_000,
            count: 65_536,
        };
        assert_eq!(map.host_uid(0), Some(100_000));
        assert_eq!(map.host_uid(1000), Some(101_000));
        assert_eq!(map.host_uid(65_536), None);
        assert_eq!(map.host_gid(1000), Some(201_000));
        assert!(map.validate().is_ok());
    }

    #[test]
    fn idmap_rejects_empty_and_overflowing_maps() {
        let empty = IdMap {
            uid: 1,
            gid: 1,
            count: 0,
        };
        assert!(empty.validate().unwrap_err().contains("maps no ids"));
        let too_far = IdMap {
            uid: u32::MAX - 10,
            gid: 0,
            count: 11,
        };
        assert!(too_far.validate().unwrap_err().contains("runs past"));
        let edge = IdMap {
            uid: u32::MAX - 10,
            gid: 0,
            count: 10,
        };
        assert!(edge.validate().is_ok());
    }
}
