//! A container's OCI bundle: `config.json` and the files bind-mounted into
//! `/etc`, on a small detached tmpfs (see [`Bundle`]).

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use crate::spec::Network;
use crate::state::Paths;
use crate::RunError;

/// A new detached tmpfs of at most `size` bytes, root directory mode 0755.
pub(crate) fn new_tmpfs(size: u64) -> rustix::io::Result<OwnedFd> {
    use rustix::mount::{
        fsconfig_create, fsconfig_set_string, fsmount, fsopen, FsMountFlags, FsOpenFlags,
        MountAttrFlags,
    };
    let fs = fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
    fsconfig_set_string(&fs, "size", size.to_string().as_str())?;
    fsconfig_set_string(&fs, "mode", "0755")?;
    fsconfig_create(&fs)?;
    fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::empty())
}

/// The cap of a bundle tmpfs: config.json, /etc/hosts and the like.
const BUNDLE_TMPFS_SIZE: u64 = 4 << 20;

/// The OCI bundle: `config.json`, the files bind-mounted into `/etc` and
/// the `rootfs/` mount point, on a small detached tmpfs that the monitor
/// attaches only in crun's private mount namespace (as it does the rootfs).
/// Creating and removing these files on the store's filesystem cost more
/// than the rest of the bundle work together (ext4 is slow to reuse inodes
/// freed a moment ago, which every container start after another does); on
/// tmpfs they cost microseconds, and the kernel frees them with the
/// namespace.
///
/// Every container's bundle is attached at the same place,
/// [`Paths::bundle_mountpoint`], each in its own namespace: no directory of
/// a container's record is a mount point anywhere. Removing one that is
/// (in any namespace) makes the kernel detach the mounts on it there and
/// then, the rootfs stack included (~0.3 ms here, on the way to `cairn
/// run` returning); this way they go when the monitor lets go of crun's
/// namespace.
pub(crate) struct Bundle {
    fd: OwnedFd,
    /// Where crun sees it.
    path: PathBuf,
}

impl Bundle {
    pub(crate) fn new(paths: &Paths) -> Result<Self, RunError> {
        let path = paths.bundle_mountpoint();
        fs::create_dir_all(&path).map_err(|e| RunError::io("creating", &path, e))?;
        let fd = new_tmpfs(BUNDLE_TMPFS_SIZE)
            .map_err(|e| RunError::io("mounting the bundle tmpfs for", &path, e.into()))?;
        rustix::fs::mkdirat(&fd, "rootfs", Mode::from_raw_mode(0o755))
            .map_err(|e| RunError::io("creating", path.join("rootfs"), e.into()))?;
        Ok(Bundle { fd, path })
    }

    /// Writes `name` into the bundle; returns its path as crun sees it.
    pub(crate) fn write(&self, name: &str, data: &[u8]) -> Result<PathBuf, RunError> {
        let path = self.path.join(name);
        let run = || -> io::Result<()> {
            let fd = rustix::fs::openat(
                &self.fd,
                name,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )?;
            fs::File::from(fd).write_all(data)
        };
        run().map_err(|e| RunError::io("writing", &path, e))?;
        Ok(path)
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// Writes the container's `/etc/hosts`, `/etc/resolv.conf` and
/// `/etc/hostname` into the bundle; returns them as (container path, bundle
/// path) pairs for the runtime config's bind mounts.
pub(crate) fn etc_files(
    bundle: &Bundle,
    network: Network,
    hostname: &str,
) -> Result<Vec<(String, String)>, RunError> {
    let write = |name: &str, text: String| -> Result<String, RunError> {
        Ok(bundle.write(name, text.as_bytes())?.display().to_string())
    };
    let (hosts, resolv) = match network {
        Network::Host => {
            let mut hosts = fs::read_to_string("/etc/hosts").unwrap_or_default();
            if !hosts.ends_with('\n') && !hosts.is_empty() {
                hosts.push('\n');
            }
            hosts.push_str(&format!("127.0.1.1\t{hostname}\n"));
            let resolv = fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
            (hosts, resolv)
        }
        Network::None => (
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
            ),
            // Nothing to resolve with: loopback only.
            "# cairn: --network none, no name servers\noptions ndots:0\n".to_string(),
        ),
    };
    Ok(vec![
        ("/etc/hosts".into(), write("hosts", hosts)?),
        ("/etc/resolv.conf".into(), write("resolv.conf", resolv)?),
        (
            "/etc/hostname".into(),
            write("hostname", format!("{hostname}\n"))?,
        ),
    ])
}
