//! Writing a dumpfile: [`print_dump`] for a whole tree, [`format_entry_line`]
//! for one line, in the layout `composefs-info dump` prints.

use std::collections::HashMap;
use std::io::{self, BufWriter, Write};

use crate::tree::{lossy, Inode, InodeData, InodeId, Tree, ROOT};

/// Writes `inode` at `path` as one line, newline included, in the layout
/// [`print_dump`] uses; with `hardlink`, a hardlink line naming that path
/// (only the type bits of `inode.mode` matter then). [`parse_line`](super::parse_line) reads
/// it back.
pub fn format_entry_line(out: &mut Vec<u8>, path: &[u8], inode: &Inode, hardlink: Option<&[u8]>) {
    format_line(out, path, inode, hardlink);
}

/// Writes `tree` as a dumpfile: depth-first in name order, root first,
/// second and later names of a hardlinked inode as `@` lines whose PAYLOAD
/// is the path of its primary entry.
///
/// A line whose escaped xattrs exceed 65535 bytes (possible for large
/// binary values, which escape to four times their size) is printed, as
/// `composefs-info dump` prints it, but neither this parser nor the
/// reference reads it back.
///
/// Fails with [`io::ErrorKind::InvalidData`] for a tree that is not well
/// formed (an entry pointing outside the arena, a directory reached twice,
/// a hardlink to an inode without a primary entry).
pub fn print_dump(tree: &Tree, out: &mut impl Write) -> io::Result<()> {
    // A hardlink may come before its primary entry in name order, so find
    // the primary paths of hardlinked inodes first.
    let mut linked: HashMap<InodeId, Option<Vec<u8>>> = HashMap::new();
    for inode in &tree.inodes {
        if let Some(entries) = inode.entries() {
            for e in entries.values().filter(|e| e.hardlink) {
                linked.insert(e.inode, None);
            }
        }
    }
    if !linked.is_empty() {
        walk(tree, |path, id, hardlink| {
            if !hardlink {
                if let Some(slot) = linked.get_mut(&id) {
                    *slot = Some(path.to_vec());
                }
            }
            Ok(())
        })?;
    }

    let mut w = BufWriter::new(out);
    let mut line = Vec::new();
    walk(tree, |path, id, hardlink| {
        let inode = tree
            .inodes
            .get(id)
            .ok_or_else(|| bad_tree("dangling inode"))?;
        let primary = if hardlink {
            let p = linked.get(&id).and_then(Option::as_deref).ok_or_else(|| {
                bad_tree(&format!(
                    "{}: hardlink to an inode without a primary entry",
                    lossy(path)
                ))
            })?;
            Some(p)
        } else {
            None
        };
        line.clear();
        format_line(&mut line, path, inode, primary);
        w.write_all(&line)
    })?;
    w.flush()
}

/// [`print_dump`] into a string (a dumpfile is ASCII: everything else is
/// escaped).
pub fn tree_to_dump_string(tree: &Tree) -> io::Result<String> {
    let mut out = Vec::new();
    print_dump(tree, &mut out)?;
    String::from_utf8(out).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

pub(super) fn bad_tree(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed tree: {what}"),
    )
}

/// Visits the root (as `/`) and then every entry depth-first in name order,
/// calling `f(path, inode, is_hardlink)`. Iterative, so depth costs heap, not
/// stack; a directory reached twice is an error, so it always terminates.
pub(super) fn walk(
    tree: &Tree,
    mut f: impl FnMut(&[u8], InodeId, bool) -> io::Result<()>,
) -> io::Result<()> {
    let root = tree
        .inodes
        .get(ROOT)
        .and_then(Inode::entries)
        .ok_or_else(|| bad_tree("the root is not a directory"))?;
    f(b"/", ROOT, false)?;
    let mut seen_dirs = vec![false; tree.inodes.len()];
    if let Some(s) = seen_dirs.get_mut(ROOT) {
        *s = true;
    }
    let mut path: Vec<u8> = Vec::new();
    let mut stack = vec![(root.iter(), 0usize)];
    while let Some((iter, base)) = stack.last_mut() {
        let base = *base;
        let Some((name, entry)) = iter.next() else {
            stack.pop();
            continue;
        };
        path.truncate(base);
        path.push(b'/');
        path.extend_from_slice(name);
        f(&path, entry.inode, entry.hardlink)?;
        if entry.hardlink {
            continue;
        }
        let child = tree
            .inodes
            .get(entry.inode)
            .ok_or_else(|| bad_tree(&format!("{}: dangling inode", lossy(&path))))?;
        if let Some(entries) = child.entries() {
            match seen_dirs.get_mut(entry.inode) {
                Some(seen) if !*seen => *seen = true,
                _ => {
                    return Err(bad_tree(&format!(
                        "{}: directory reached twice",
                        lossy(&path)
                    )))
                }
            }
            stack.push((entries.iter(), path.len()));
        }
    }
    Ok(())
}

/// One dumpfile line, newline included, in the layout of
/// `composefs-info dump`.
fn format_line(out: &mut Vec<u8>, path: &[u8], inode: &Inode, primary: Option<&[u8]>) {
    let std_escape = Escape::default();
    let field = Escape {
        lone_dash: true,
        ..Escape::default()
    };
    let xattr = Escape {
        equal: true,
        ..Escape::default()
    };

    escape_into(out, path, std_escape);
    let at = if primary.is_some() { "@" } else { "" };
    // Writing to a Vec cannot fail.
    let _ = write!(
        out,
        " {} {at}{:o} {} {} {} {} {}.{} ",
        inode.size,
        inode.mode,
        inode.nlink,
        inode.uid,
        inode.gid,
        inode.rdev,
        inode.mtime.sec,
        inode.mtime.nsec
    );

    let (payload, content, digest) = match &inode.data {
        InodeData::Regular(r) => (
            r.payload.as_deref(),
            r.content.as_deref().filter(|c| !c.is_empty()),
            r.digest.as_ref(),
        ),
        InodeData::Symlink(target) => (Some(target.as_slice()), None, None),
        InodeData::Directory(_) | InodeData::Special => (None, None, None),
    };
    match primary.or(payload) {
        Some(p) => escape_into(out, p, field),
        None => out.push(b'-'),
    }
    out.push(b' ');
    match content {
        Some(c) => escape_into(out, c, field),
        None => out.push(b'-'),
    }
    out.push(b' ');
    match digest {
        Some(d) => {
            let _ = write!(out, "{}", hex::encode(d));
        }
        None => out.push(b'-'),
    }
    for (k, v) in &inode.xattrs {
        out.push(b' ');
        escape_into(out, k, xattr);
        out.push(b'=');
        escape_into(out, v, xattr);
    }
    out.push(b'\n');
}

/// Which characters besides the usual ones to escape.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Escape {
    /// `=`, which separates an xattr's name from its value.
    pub(super) equal: bool,
    /// A field that is exactly `-`, which would read back as "none".
    pub(super) lone_dash: bool,
}

/// Escapes as `composefs-info dump` does: `\\ \n \r \t`, and every byte that
/// is not a printable, non-space ASCII character as `\xHH`.
pub(super) fn escape_into(out: &mut Vec<u8>, s: &[u8], how: Escape) {
    if how.lone_dash && s == b"-" {
        out.extend_from_slice(b"\\x2d");
        return;
    }
    for &c in s {
        match c {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b'=' if how.equal => out.extend_from_slice(b"\\x3d"),
            0x21..=0x7e => out.push(c),
            _ => {
                let _ = write!(out, "\\x{c:02x}");
            }
        }
    }
}
