//! One tar entry → one line of a layer record, checked on its own.
//!
//! The record (`layers/<diff_id>/entries`, see `cairn_store::record`) is
//! the tar stream's entries in their order, one dumpfile line each, with
//! file contents replaced by their objects: what an entry *does* to an
//! image depends on the layers below it (a parent may be a symlink there),
//! so it is decided when the layer is applied (`apply`), not here. Here
//! each entry is checked on its own:
//!
//! - Paths are cleaned as umoci cleans them: `./`, `//` and `a/../` go
//!   away, a leading `/` means the image root and `..` stops at the root, so
//!   no path can name anything outside the image.
//! - `./` (or `/`) is the root directory itself and must be a directory.
//! - `.wh.NAME` (a whiteout) and `.wh..wh..opq` (an opaque marker) are kept
//!   as such; `.wh.` names naming `.`, `..` or nothing are errors, a parent
//!   named `.wh.*` is an error, and `.wh..wh.X` (a whiteout of a name no
//!   entry can have) is dropped.
//! - A hardlink keeps its cleaned target path.
//! - Symlink targets are kept as written (resolved, clamped to the root,
//!   only when a later entry's path goes through them).
//! - Xattrs umoci never sets (`security.selinux`, `system.nfs4_acl`, the
//!   `trusted.overlay.*` bookkeeping) are dropped; a `user.*` xattr on
//!   anything but a regular file or directory is an error, as it is for
//!   the kernel.
//! - Regular files of 1 to 64 bytes are kept in the record; larger ones are
//!   stored as objects, sparse files with their holes (which cost neither
//!   disk space nor, for the digest, time in proportion to their size; how
//!   many a layer may have is [`crate::Limits::max_hole_bytes`] and
//!   [`crate::Limits::max_sparse_segments`]).

use cairn_erofs::tree::{
    check_name, InodeData, MAX_NAME_LEN, MAX_PATH_LEN, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK,
    S_IFREG,
};
use cairn_erofs::Inode;
use cairn_store::{StoreError, OPAQUE_MARKER, WHITEOUT_PREFIX};

use crate::tar::{EntryKind, TarEntry, TarError};

/// Why one entry could not be added.
pub(crate) enum AddError {
    Reason(String),
    Tar(TarError),
    Store(StoreError),
}

impl From<TarError> for AddError {
    fn from(e: TarError) -> Self {
        AddError::Tar(e)
    }
}

impl From<String> for AddError {
    fn from(s: String) -> Self {
        AddError::Reason(s)
    }
}

/// What one entry becomes in a layer record, before any content is read.
pub(crate) enum Prepared {
    /// Nothing (a whiteout of a reserved name).
    Skip,
    /// A finished line: path, inode, hardlink target.
    Line(Vec<u8>, Inode, Option<Vec<u8>>),
    /// A regular file whose contents are still to be named: path, inode
    /// (its size set, no data yet).
    Regular(Vec<u8>, Inode),
}

/// Checks one entry on its own (path, whiteouts, hardlink targets, mode,
/// xattrs; see the module docs) and says what line it becomes. The tar
/// path and the eStargz TOC path (`crate::toc`) both go through here, so
/// an entry means the same whichever way it was read.
pub(crate) fn prepare(e: &TarEntry) -> Result<Prepared, AddError> {
    let comps = clean_path(&e.path)?;
    let path = absolute(&comps);
    if path.len() > MAX_PATH_LEN {
        return Err(AddError::Reason(format!(
            "path of {} bytes is longer than {MAX_PATH_LEN}",
            path.len()
        )));
    }
    let Some((name, parents)) = comps.split_last() else {
        // The root itself.
        if e.kind != EntryKind::Directory {
            return Err(AddError::Reason(
                "the root entry ('./') must be a directory".into(),
            ));
        }
        let inode = inode_for(e)?;
        return Ok(Prepared::Line(path, inode, None));
    };
    if let Some(p) = parents.iter().find(|c| c.starts_with(WHITEOUT_PREFIX)) {
        return Err(AddError::Reason(format!(
            "parent {} is a whiteout name, not a directory",
            lossy(p)
        )));
    }

    if let Some(target) = name.strip_prefix(WHITEOUT_PREFIX) {
        if *name != OPAQUE_MARKER {
            if target.starts_with(WHITEOUT_PREFIX) {
                // `.wh..wh.X` would delete a name no entry can have.
                tracing::debug!("ignoring whiteout of reserved name {}", lossy(name));
                return Ok(Prepared::Skip);
            }
            match target {
                b"" => return Err(AddError::Reason("whiteout names nothing ('.wh.')".into())),
                b"." | b".." => {
                    return Err(AddError::Reason(format!(
                        "whiteout of '{}' would delete outside its directory",
                        lossy(target)
                    )))
                }
                _ => {}
            }
            check_name(target).map_err(|e| e.to_string())?;
        }
        let marker = Inode::new(S_IFCHR).expect("char device mode is valid");
        return Ok(Prepared::Line(path, marker, None));
    }

    if e.kind == EntryKind::Hardlink {
        let target = clean_path(&e.link).map_err(|r| format!("hardlink target: {r}"))?;
        if target
            .last()
            .is_some_and(|n| n.starts_with(WHITEOUT_PREFIX))
        {
            return Err(AddError::Reason(format!(
                "hardlink to whiteout {}",
                lossy(&e.link)
            )));
        }
        let target = absolute(&target);
        if target.len() > MAX_PATH_LEN {
            return Err(AddError::Reason(format!(
                "hardlink target of {} bytes is longer than {MAX_PATH_LEN}",
                target.len()
            )));
        }
        let placeholder = Inode::new(S_IFREG).expect("regular mode is valid");
        return Ok(Prepared::Line(path, placeholder, Some(target)));
    }

    let inode = inode_for(e)?;
    if e.kind == EntryKind::Regular {
        return Ok(Prepared::Regular(path, inode));
    }
    Ok(Prepared::Line(path, inode, None))
}

/// The inode an entry describes (regular files without content yet).
pub(crate) fn inode_for(e: &TarEntry) -> Result<Inode, String> {
    let fmt = match e.kind {
        EntryKind::Regular => S_IFREG,
        EntryKind::Directory => S_IFDIR,
        EntryKind::Symlink => S_IFLNK,
        EntryKind::CharDevice => S_IFCHR,
        EntryKind::BlockDevice => S_IFBLK,
        EntryKind::Fifo => S_IFIFO,
        EntryKind::Hardlink => unreachable!("hardlinks have no inode of their own"),
    };
    let mut inode = Inode::new(fmt | (e.mode & 0o7777)).map_err(|e| e.to_string())?;
    inode.uid = e.uid;
    inode.gid = e.gid;
    inode.mtime = e.mtime;
    for (k, v) in &e.xattrs {
        if k.is_empty() || k.len() > 255 || k.contains(&0) {
            return Err(format!(
                "invalid xattr name {:?} (1 to 255 bytes, no NUL)",
                lossy(k)
            ));
        }
        if v.len() > u16::MAX as usize {
            return Err(format!(
                "xattr {} value of {} bytes is too large",
                lossy(k),
                v.len()
            ));
        }
        if IGNORED_XATTRS.contains(&k.as_slice()) {
            continue;
        }
        // The kernel refuses user.* xattrs on anything but regular files
        // and directories (so does every unpacker writing to a disk).
        if k.starts_with(b"user.") && !matches!(e.kind, EntryKind::Regular | EntryKind::Directory) {
            return Err(format!(
                "xattr {} on a {}: user.* xattrs exist only on regular files and directories",
                lossy(k),
                kind_name(e.kind)
            ));
        }
        inode.xattrs.insert(k.clone(), v.clone());
    }
    match e.kind {
        EntryKind::CharDevice | EntryKind::BlockDevice => {
            inode.rdev = libc::makedev(e.devmajor, e.devminor);
        }
        EntryKind::Symlink => {
            if e.link.is_empty() {
                return Err("symlink with an empty target".into());
            }
            if e.link.len() > MAX_PATH_LEN {
                return Err(format!(
                    "symlink target of {} bytes is longer than {MAX_PATH_LEN}",
                    e.link.len()
                ));
            }
            if e.link.contains(&0) {
                return Err("symlink target contains a NUL byte".into());
            }
            // A symlink's mode is 0777 on Linux whatever the header
            // says (what any unpacker's symlink(2) gives).
            inode.mode = S_IFLNK | 0o777;
            inode.size = e.link.len() as u64;
            inode.data = InodeData::Symlink(e.link.clone());
        }
        EntryKind::Regular => inode.size = e.size,
        _ => {}
    }
    Ok(inode)
}

/// Xattrs umoci never sets when it unpacks a layer (host-specific, or
/// overlayfs bookkeeping of the machine that built the layer); cairn drops
/// them too, so that both give the same tree.
const IGNORED_XATTRS: &[&[u8]] = &[
    b"security.selinux",
    b"system.nfs4_acl",
    b"trusted.overlay.opaque",
    b"trusted.overlay.redirect",
    b"trusted.overlay.origin",
    b"trusted.overlay.impure",
    b"trusted.overlay.nlink",
    b"trusted.overlay.upper",
    b"trusted.overlay.metacopy",
];

fn kind_name(k: EntryKind) -> &'static str {
    match k {
        EntryKind::Regular => "regular file",
        EntryKind::Hardlink => "hardlink",
        EntryKind::Symlink => "symlink",
        EntryKind::CharDevice => "character device",
        EntryKind::BlockDevice => "block device",
        EntryKind::Directory => "directory",
        EntryKind::Fifo => "fifo",
    }
}

/// Splits a tar path into its components, cleaned as umoci cleans them
/// (Go's `filepath.Clean` of the path below `/`): `.` and empty components
/// go, `..` removes the component before it and is dropped at the root, so
/// a path never leaves the image root.
pub(crate) fn clean_path(path: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut comps: Vec<&[u8]> = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                comps.pop();
            }
            c => {
                if c.len() > MAX_NAME_LEN {
                    return Err(format!(
                        "path component of {} bytes is longer than {MAX_NAME_LEN}",
                        c.len()
                    ));
                }
                if c.contains(&0) {
                    return Err("path contains a NUL byte".into());
                }
                comps.push(c)
            }
        }
    }
    Ok(comps)
}

/// `comps` as an absolute path (`/` for none).
fn absolute(comps: &[&[u8]]) -> Vec<u8> {
    if comps.is_empty() {
        return b"/".to_vec();
    }
    let mut out = Vec::with_capacity(comps.iter().map(|c| c.len() + 1).sum());
    for c in comps {
        out.push(b'/');
        out.extend_from_slice(c);
    }
    out
}

/// A path or name for a message (not UTF-8: replaced characters).
pub(crate) fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
