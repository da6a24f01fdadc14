//! Layer application: the trees of a layer stack, bottom first, merged
//! into the tree of the image, as the OCI image spec (`layer.md`,
//! "Applying Changesets") defines it.
//!
//! Each layer is applied in three passes, so the result does not depend on
//! the order of entries within a layer:
//!
//! 1. **Deletions.** Opaque markers empty their directory and whiteouts
//!    remove their name, both only in what the layers below left.
//! 2. **Hardlinks to lower layers** are resolved against what is left
//!    (literally: a link never follows a symlink); a missing target or a
//!    directory is an error naming the layer and the path.
//! 3. **Additions.** Entries replace what is there; two directories merge
//!    (an implicit directory of the layer leaves the existing metadata
//!    alone; an explicit one replaces it); other entries take the path,
//!    dropping whatever was there (a directory with all it held).
//!
//! Then the result is compacted and its hardlinks made consistent: the
//! first name in walk order is an inode's primary entry, `nlink` counts its
//! names.
//!
//! This module works on trees only; it never reads or writes the store.

use std::collections::{BTreeMap, HashMap};

use cairn_erofs::tree::{InodeData, InodeId, Tree, ROOT, S_IFDIR};
use cairn_erofs::{DirEntry, Inode};

use crate::layer::{lossy, OPAQUE, WHITEOUT_PREFIX};
use crate::LayerError;

/// Marks an implicit directory in a layer record.
pub(crate) const XATTR_IMPLICIT: &[u8] = b"trusted.cairn.layer.implicit";
/// Marks a hardlink to a lower layer; the value is the target path.
pub(crate) const XATTR_HARDLINK: &[u8] = b"trusted.cairn.layer.hardlink";
/// Real xattrs with this prefix are escaped in layer records…
pub(crate) const XATTR_RESERVED_PREFIX: &[u8] = b"trusted.cairn.";
/// …to this one.
pub(crate) const XATTR_ESCAPED_PREFIX: &[u8] = b"trusted.cairn.x.";
/// The prefix of record markers.
const XATTR_MARKER_PREFIX: &[u8] = b"trusted.cairn.layer.";

/// The real xattrs of a record inode: markers dropped, escapes undone.
fn real_xattrs(x: &BTreeMap<Vec<u8>, Vec<u8>>) -> BTreeMap<Vec<u8>, Vec<u8>> {
    x.iter()
        .filter(|(k, _)| !k.starts_with(XATTR_MARKER_PREFIX))
        .map(|(k, v)| match k.strip_prefix(XATTR_ESCAPED_PREFIX) {
            Some(rest) => ([XATTR_RESERVED_PREFIX, rest].concat(), v.clone()),
            None => (k.clone(), v.clone()),
        })
        .collect()
}

fn is_implicit(inode: &Inode) -> bool {
    inode.is_dir() && inode.xattrs.contains_key(XATTR_IMPLICIT)
}

/// The empty tree layers are applied onto: a root directory 0755
/// root:root.
pub(crate) fn empty_image() -> Tree {
    Tree::new(Inode::new(S_IFDIR | 0o755).expect("directory mode is valid")).expect("a root")
}

/// Applies one layer's record tree onto `image`.
pub(crate) fn apply_layer(image: &mut Tree, layer: &Tree, name: &str) -> Result<(), LayerError> {
    delete_pass(image, Some(ROOT), layer, ROOT, 0);
    let mut map: HashMap<InodeId, InodeId> = HashMap::new();
    resolve_links(image, layer, name, &mut map)?;
    merge_dir(image, ROOT, layer, ROOT, &mut map, 0);
    Ok(())
}

fn delete_pass(image: &mut Tree, dir: Option<InodeId>, layer: &Tree, ldir: InodeId, depth: usize) {
    let Some(lentries) = layer.inode(ldir).entries() else {
        return;
    };
    if let Some(dir) = dir {
        if let InodeData::Directory(entries) = &mut image.inode_mut(dir).data {
            if lentries.contains_key(OPAQUE) {
                entries.clear();
            }
            for name in lentries.keys() {
                if let Some(target) = name.strip_prefix(WHITEOUT_PREFIX) {
                    entries.remove(target);
                }
            }
        }
    }
    if depth >= cairn_erofs::tree::MAX_DEPTH {
        return;
    }
    for (name, e) in lentries {
        if name.starts_with(WHITEOUT_PREFIX) || !layer.inode(e.inode).is_dir() {
            continue;
        }
        let below = dir.and_then(|d| {
            image
                .inode(d)
                .entries()
                .and_then(|es| es.get(name))
                .map(|c| c.inode)
                .filter(|&c| image.inode(c).is_dir())
        });
        delete_pass(image, below, layer, e.inode, depth + 1);
    }
}

/// Finds each hardlink placeholder's target in the image as it is after
/// the deletions.
fn resolve_links(
    image: &Tree,
    layer: &Tree,
    name: &str,
    map: &mut HashMap<InodeId, InodeId>,
) -> Result<(), LayerError> {
    for (id, inode) in layer.inodes.iter().enumerate() {
        let Some(target) = inode.xattrs.get(XATTR_HARDLINK) else {
            continue;
        };
        if inode.is_dir() {
            continue;
        }
        let err = |reason: String| LayerError::Apply {
            layer: name.to_owned(),
            path: lossy(target),
            reason,
        };
        let mut cur = ROOT;
        let comps: Vec<&[u8]> = target
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty())
            .collect();
        for (i, comp) in comps.iter().enumerate() {
            let Some(e) = image.inode(cur).entries().and_then(|es| es.get(*comp)) else {
                return Err(err(
                    "hardlink target does not exist in this layer or the layers below".into(),
                ));
            };
            let node = image.inode(e.inode);
            if i + 1 < comps.len() && !node.is_dir() {
                return Err(err(format!(
                    "hardlink target's parent {} is not a directory",
                    lossy(&comps[..=i].join(&b'/'))
                )));
            }
            cur = e.inode;
        }
        if image.inode(cur).is_dir() {
            return Err(err("hardlink target is a directory".into()));
        }
        map.insert(id, cur);
    }
    Ok(())
}

fn merge_dir(
    image: &mut Tree,
    dir: InodeId,
    layer: &Tree,
    ldir: InodeId,
    map: &mut HashMap<InodeId, InodeId>,
    depth: usize,
) {
    let lroot = layer.inode(ldir);
    if ldir == ROOT && !is_implicit(lroot) {
        copy_attrs(image.inode_mut(dir), lroot);
    }
    let Some(lentries) = lroot.entries() else {
        return;
    };
    for (name, e) in lentries {
        if name.starts_with(WHITEOUT_PREFIX) {
            continue;
        }
        let linode = layer.inode(e.inode);
        let existing = image
            .inode(dir)
            .entries()
            .and_then(|es| es.get(name))
            .map(|c| c.inode);
        if linode.is_dir() {
            let target = match existing {
                Some(old) if image.inode(old).is_dir() => {
                    if !is_implicit(linode) {
                        copy_attrs(image.inode_mut(old), linode);
                    }
                    old
                }
                _ => {
                    let mut d = Inode::new(linode.mode).expect("a directory mode");
                    copy_attrs(&mut d, linode);
                    let id = image.push(d);
                    link(image, dir, name, id);
                    id
                }
            };
            if depth < cairn_erofs::tree::MAX_DEPTH {
                merge_dir(image, target, layer, e.inode, map, depth + 1);
            }
        } else {
            let id = match map.get(&e.inode) {
                Some(&id) => id,
                None => {
                    let mut copy = linode.clone();
                    copy.xattrs = real_xattrs(&linode.xattrs);
                    copy.nlink = 1;
                    let id = image.push(copy);
                    map.insert(e.inode, id);
                    id
                }
            };
            link(image, dir, name, id);
        }
    }
}

fn copy_attrs(to: &mut Inode, from: &Inode) {
    to.mode = from.mode;
    to.uid = from.uid;
    to.gid = from.gid;
    to.mtime = from.mtime;
    to.xattrs = real_xattrs(&from.xattrs);
}

fn link(image: &mut Tree, dir: InodeId, name: &[u8], id: InodeId) {
    if let InodeData::Directory(entries) = &mut image.inode_mut(dir).data {
        entries.insert(
            name.to_vec(),
            DirEntry {
                inode: id,
                hardlink: false,
            },
        );
    }
}

/// Every (directory, name, inode) reachable from the root, depth-first in
/// name order (the order the dump printer and walkers use).
fn reachable(tree: &Tree) -> Vec<(InodeId, Vec<u8>, InodeId)> {
    let mut out = Vec::new();
    let mut stack: Vec<(InodeId, usize)> = vec![(ROOT, 0)];
    // Iterative depth-first: push children in reverse so they pop in order.
    while let Some((dir, depth)) = stack.pop() {
        let Some(entries) = tree.inode(dir).entries() else {
            continue;
        };
        let mut subdirs = Vec::new();
        for (name, e) in entries {
            out.push((dir, name.clone(), e.inode));
            if tree.inode(e.inode).is_dir() && depth < cairn_erofs::tree::MAX_DEPTH {
                subdirs.push((e.inode, depth + 1));
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
    out
}

/// Makes hardlink flags and link counts consistent: for every inode with
/// several names, the first name in depth-first name order is the primary
/// one; `nlink` of non-directories is the number of names.
pub(crate) fn normalize_links(tree: &mut Tree) {
    let all = reachable(tree);
    let mut count: HashMap<InodeId, u32> = HashMap::new();
    let mut flags: Vec<(InodeId, Vec<u8>, bool)> = Vec::with_capacity(all.len());
    for (dir, name, id) in all {
        let n = count.entry(id).or_insert(0);
        *n += 1;
        flags.push((dir, name, *n > 1));
    }
    for (dir, name, hardlink) in flags {
        if let InodeData::Directory(entries) = &mut tree.inode_mut(dir).data {
            if let Some(e) = entries.get_mut(&name) {
                e.hardlink = hardlink;
            }
        }
    }
    for (id, n) in count {
        let inode = tree.inode_mut(id);
        if !inode.is_dir() {
            inode.nlink = n;
        }
    }
}

/// A copy of `tree` holding only what is reachable from the root, with
/// consistent hardlinks.
pub(crate) fn compact(tree: &Tree) -> Tree {
    let mut new_id: HashMap<InodeId, InodeId> = HashMap::new();
    new_id.insert(ROOT, ROOT);
    let mut inodes: Vec<Inode> = vec![tree.inode(ROOT).clone()];
    let all = reachable(tree);
    for (_, _, id) in &all {
        if !new_id.contains_key(id) {
            new_id.insert(*id, inodes.len());
            inodes.push(tree.inode(*id).clone());
        }
    }
    for inode in &mut inodes {
        if let InodeData::Directory(entries) = &mut inode.data {
            entries.retain(|_, e| new_id.contains_key(&e.inode));
            for e in entries.values_mut() {
                e.inode = new_id[&e.inode];
            }
        }
    }
    let mut out = Tree { inodes };
    normalize_links(&mut out);
    out
}
