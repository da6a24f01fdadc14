//! Layer application: the layers of an image, bottom first, replayed onto
//! one tree, entry by entry in the order of each layer's tar stream, as
//! umoci unpacks them (and docker and containerd, for everything but
//! umoci's own quirks, which are noted where they matter).
//!
//! For each entry of a layer record (`layer` writes them; see
//! `cairn_store::record`):
//!
//! 1. **Its parent directories are resolved** through the tree as it is
//!    now (the layers below and this layer's earlier entries): a component
//!    that is a symlink is followed, relative to its directory or, for an
//!    absolute target, to the image root; `..` stops at the root; chains are
//!    followed; more than 255 symlinks on one path is a loop, an error that
//!    names the path. So `lib/x86_64-linux-gnu/libfoo.so` on a merged-/usr
//!    image lands in `/usr/lib/x86_64-linux-gnu/` and `lib` stays a symlink.
//!    Components that do not exist are directories to create, 0755
//!    root:root, once the path is resolved (a dangling symlink's target
//!    too), or, below a set-group-ID directory, 2755 with its group, as
//!    mkdir(2) makes them there; a component that is not a directory is an
//!    error.
//! 2. **A whiteout** (`.wh.NAME`) removes NAME from the resolved directory,
//!    an opaque marker (`.wh..wh..opq`) everything in it, but never what
//!    this layer has put there (or below there) itself; a whiteout of
//!    something absent, or below something absent, changes nothing.
//! 3. **Anything else** replaces what is at its name (a directory with all
//!    it holds), except that a directory entry over a directory keeps the
//!    contents and takes the entry's metadata (mode, owner, xattrs). The
//!    entry's own name is never followed: a symlink there is replaced.
//! 4. **A hardlink** links the inode its target path names (parents
//!    resolved as above, the last component not followed: a link to a
//!    symlink links the symlink). A target that does not exist or is a
//!    directory is an error naming the layer, the entry and the target.
//!
//! Nothing here can climb out of the image: paths are cleaned at import and
//! resolution is clamped to the root. The work is bounded: each layer may
//! take at most [`RESOLVE_BUDGET_BASE`] plus [`RESOLVE_BUDGET_PER_ENTRY`] per
//! entry steps of symlink resolution.
//!
//! Then the result is compacted and its hardlinks made consistent: the
//! first name in walk order is an inode's primary entry, `nlink` counts its
//! names. This module works on trees only; it never writes the store.

use std::collections::HashSet;
use std::io::{BufRead, Read};

use cairn_erofs::dump::{parse_line, Line};
use cairn_erofs::tree::{InodeData, InodeId, Tree, MAX_DEPTH, ROOT, S_IFDIR};
use cairn_erofs::{DirEntry, Inode, Mtime};

use cairn_store::{OPAQUE_MARKER, WHITEOUT_PREFIX};

use crate::entry::lossy;
use crate::LayerError;

/// The set-group-ID bit.
const S_ISGID: u32 = 0o2000;
/// Most symlinks followed while resolving one path (as Linux's and umoci's
/// path resolution allow).
const MAX_SYMLINKS: usize = 255;
/// Resolution steps (components looked at) any layer may take…
pub(crate) const RESOLVE_BUDGET_BASE: u64 = 1 << 24;
/// …plus this many per entry.
pub(crate) const RESOLVE_BUDGET_PER_ENTRY: u64 = 1 << 10;
/// Longest line of a layer record (the dump line limit).
const MAX_RECORD_LINE: usize = cairn_erofs::dump::MAX_LINE_LEN;

/// The empty tree layers are applied onto: a root directory 0755
/// root:root.
pub(crate) fn empty_image() -> Tree {
    Tree::new(Inode::new(S_IFDIR | 0o755).expect("directory mode is valid")).expect("a root")
}

/// Where a path's components lead in the tree.
struct Resolved {
    /// The existing directories (and, last, possibly a non-directory)
    /// passed through, the root first.
    nodes: Vec<InodeId>,
    /// The path of the last of `nodes`, from the root, without a leading
    /// `/` (empty for the root).
    path: Vec<u8>,
    /// Offsets in `path` where each of `nodes` after the root starts its
    /// `/name` (so `..` can drop it).
    cuts: Vec<usize>,
    /// Components below the last of `nodes` that do not exist.
    missing: Vec<Vec<u8>>,
}

impl Resolved {
    fn last(&self) -> InodeId {
        *self.nodes.last().expect("the root is always there")
    }

    /// The resolved path with `name` appended (`a/b/name`, no leading `/`).
    fn child_path(&self, name: &[u8]) -> Vec<u8> {
        let mut p = self.path.clone();
        for m in &self.missing {
            if !p.is_empty() {
                p.push(b'/');
            }
            p.extend_from_slice(m);
        }
        if !p.is_empty() {
            p.push(b'/');
        }
        p.extend_from_slice(name);
        p
    }
}

/// Why an entry could not be applied.
enum Fail {
    /// The entry is wrong for the tree it lands on.
    Entry(String),
    /// The layer's record itself is unreadable.
    Record(String),
}

/// Replays one layer's record onto `image`; `layer` names it in errors.
pub(crate) fn apply_layer(
    image: &mut Tree,
    record: impl BufRead,
    layer: &str,
) -> Result<(), LayerError> {
    let mut a = Applier::new(image);
    let mut line = Vec::new();
    let mut record = record;
    let mut n = 0u64;
    loop {
        line.clear();
        let read = (&mut record)
            .take(MAX_RECORD_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| record_err(layer, n + 1, &format!("reading: {e}")))?;
        if read == 0 {
            return Ok(());
        }
        n += 1;
        let Some(text) = line.strip_suffix(b"\n") else {
            return Err(record_err(layer, n, "line too long or cut short"));
        };
        let (path, what) = parse_line(text).map_err(|r| record_err(layer, n, &r))?;
        a.budget = a.budget.saturating_add(RESOLVE_BUDGET_PER_ENTRY);
        a.apply(&path, what).map_err(|f| match f {
            Fail::Entry(reason) => LayerError::Apply {
                layer: layer.to_owned(),
                path: lossy(&path),
                reason: format!("{reason} (entry {n} of the layer)"),
            },
            Fail::Record(reason) => record_err(layer, n, &reason),
        })?;
    }
}

fn record_err(layer: &str, line: u64, reason: &str) -> LayerError {
    LayerError::Apply {
        layer: layer.to_owned(),
        path: format!("layer record line {line}"),
        reason: format!("corrupt layer record: {reason}"),
    }
}

pub(crate) struct Applier<'t> {
    tree: &'t mut Tree,
    /// Resolved paths (no leading `/`) this layer has put something at, or
    /// below: whiteouts and opaque markers leave them alone.
    upper: HashSet<Vec<u8>>,
    /// Resolution steps left for this layer.
    budget: u64,
}

impl<'t> Applier<'t> {
    /// Starts applying one layer onto `tree`.
    pub(crate) fn new(tree: &'t mut Tree) -> Applier<'t> {
        Applier {
            tree,
            upper: HashSet::new(),
            budget: RESOLVE_BUDGET_BASE,
        }
    }

    /// Applies one entry (as its record line says it) and says why not.
    pub(crate) fn apply_entry(&mut self, path: &[u8], what: Line) -> Result<(), String> {
        self.budget = self.budget.saturating_add(RESOLVE_BUDGET_PER_ENTRY);
        self.apply(path, what).map_err(|f| match f {
            Fail::Entry(r) | Fail::Record(r) => r,
        })
    }

    /// The tree being built.
    pub(crate) fn tree(&self) -> &Tree {
        self.tree
    }

    fn apply(&mut self, path: &[u8], what: Line) -> Result<(), Fail> {
        let Some(rel) = path.strip_prefix(b"/") else {
            return Err(Fail::Record(format!(
                "path {} is not absolute",
                lossy(path)
            )));
        };
        if rel.is_empty() {
            // The root itself.
            let Line::Inode(inode) = what else {
                return Err(Fail::Record("the root cannot be a hardlink".into()));
            };
            if !inode.is_dir() {
                return Err(Fail::Record("the root entry is not a directory".into()));
            }
            copy_attrs(self.tree.inode_mut(ROOT), &inode);
            return Ok(());
        }
        let comps: Vec<&[u8]> = rel.split(|&b| b == b'/').collect();
        let (name, parents) = comps.split_last().expect("split yields one item at least");
        if name.is_empty() || comps.iter().any(|c| matches!(*c, b"" | b"." | b"..")) {
            return Err(Fail::Record(format!("path {} is not clean", lossy(path))));
        }
        let dir = self.resolve(parents, path)?;

        if let Some(target) = name.strip_prefix(WHITEOUT_PREFIX) {
            let opaque = *name == OPAQUE_MARKER;
            self.whiteout(&dir, if opaque { None } else { Some(target) });
            return Ok(());
        }

        let dir_path = dir.child_path(b"");
        let dir_id = self.make_dirs(dir, path)?;
        let existing = self.entries(dir_id).get(*name).map(|e| e.inode);
        let resolved = [&dir_path[..], name].concat();
        match what {
            Line::Inode(inode) => match existing {
                Some(old) if inode.is_dir() && self.tree.inode(old).is_dir() => {
                    copy_attrs(self.tree.inode_mut(old), &inode);
                }
                _ => {
                    let mut inode = inode;
                    if let InodeData::Directory(entries) = &mut inode.data {
                        entries.clear();
                    }
                    inode.nlink = 1;
                    let id = self.tree.push(inode);
                    link(self.tree, dir_id, name, id);
                }
            },
            Line::Hardlink(target) => {
                // The old name goes first (as unpackers unlink before they
                // link), so a link to itself finds nothing.
                if existing.is_some() {
                    if let InodeData::Directory(entries) = &mut self.tree.inode_mut(dir_id).data {
                        entries.remove(*name);
                    }
                }
                let id = self.hardlink_target(&target)?;
                link(self.tree, dir_id, name, id);
            }
        }
        self.mark_upper(&resolved);
        Ok(())
    }

    fn entries(&self, dir: InodeId) -> &std::collections::BTreeMap<Vec<u8>, DirEntry> {
        self.tree
            .inode(dir)
            .entries()
            .expect("resolved parents are directories")
    }

    /// Follows `comps` from the root through the tree; see the module docs.
    /// `whole` is the entry's path, for errors.
    fn resolve(&mut self, comps: &[&[u8]], whole: &[u8]) -> Result<Resolved, Fail> {
        let tree: &Tree = self.tree;
        let mut r = Resolved {
            nodes: vec![ROOT],
            path: Vec::new(),
            cuts: Vec::new(),
            missing: Vec::new(),
        };
        // Components still to look at, the next one last.
        let mut todo: Vec<&[u8]> = comps.iter().rev().copied().collect();
        let mut followed = 0usize;
        while let Some(c) = todo.pop() {
            if self.budget == 0 {
                return Err(Fail::Entry(format!(
                    "resolving {} exceeds the layer's budget of symlink resolution \
                     ({RESOLVE_BUDGET_BASE} steps and {RESOLVE_BUDGET_PER_ENTRY} per entry)",
                    lossy(whole)
                )));
            }
            self.budget -= 1;
            match c {
                b"" | b"." => continue,
                b".." => {
                    if r.missing.pop().is_none() && r.nodes.len() > 1 {
                        r.nodes.pop();
                        let cut = r.cuts.pop().expect("a cut per node past the root");
                        r.path.truncate(cut);
                    }
                    continue;
                }
                _ => {}
            }
            if !r.missing.is_empty() {
                r.missing.push(c.to_vec());
                continue;
            }
            let found = tree.inode(r.last()).entries().and_then(|es| es.get(c));
            let Some(e) = found else {
                r.missing.push(c.to_vec());
                continue;
            };
            if let InodeData::Symlink(target) = &tree.inode(e.inode).data {
                followed += 1;
                if followed > MAX_SYMLINKS {
                    return Err(Fail::Entry(format!(
                        "too many levels of symbolic links (more than {MAX_SYMLINKS}) in {}",
                        lossy(whole)
                    )));
                }
                if target.starts_with(b"/") {
                    r.nodes.truncate(1);
                    r.cuts.clear();
                    r.path.clear();
                }
                todo.extend(target.split(|&b| b == b'/').rev());
                continue;
            }
            r.cuts.push(r.path.len());
            if !r.path.is_empty() {
                r.path.push(b'/');
            }
            r.path.extend_from_slice(c);
            r.nodes.push(e.inode);
            if r.nodes.len() + r.missing.len() > MAX_DEPTH {
                return Err(Fail::Entry(format!(
                    "{} resolves to a path nested deeper than {MAX_DEPTH} directories",
                    lossy(whole)
                )));
            }
        }
        if r.nodes.len() + r.missing.len() > MAX_DEPTH {
            return Err(Fail::Entry(format!(
                "{} resolves to a path nested deeper than {MAX_DEPTH} directories",
                lossy(whole)
            )));
        }
        Ok(r)
    }

    /// Creates the missing directories of `r`; the directory the entry
    /// goes in.
    fn make_dirs(&mut self, r: Resolved, whole: &[u8]) -> Result<InodeId, Fail> {
        let mut dir = r.last();
        if !self.tree.inode(dir).is_dir() {
            return Err(Fail::Entry(format!(
                "parent /{} of {} is not a directory",
                lossy(&r.path),
                lossy(whole)
            )));
        }
        for name in r.missing {
            let mut d = Inode::new(S_IFDIR | 0o755).expect("directory mode is valid");
            d.mtime = Mtime::default();
            // As mkdir(2) makes it below a set-group-ID directory: the
            // parent's group and the set-group-ID bit are inherited.
            let parent = self.tree.inode(dir);
            if parent.mode & S_ISGID != 0 {
                d.mode |= S_ISGID;
                d.gid = parent.gid;
            }
            let id = self.tree.push(d);
            link(self.tree, dir, &name, id);
            dir = id;
        }
        Ok(dir)
    }

    /// Removes `name` (or, for `None`, everything) from the resolved
    /// directory, sparing what this layer put there.
    fn whiteout(&mut self, dir: &Resolved, name: Option<&[u8]>) {
        if !dir.missing.is_empty() || !self.tree.inode(dir.last()).is_dir() {
            return;
        }
        let dir_id = dir.last();
        let names: Vec<Vec<u8>> = match name {
            Some(n) => {
                if !self.entries(dir_id).contains_key(n) {
                    return;
                }
                vec![n.to_vec()]
            }
            None => self.entries(dir_id).keys().cloned().collect(),
        };
        let base = dir.child_path(b"");
        // Depth-first with an explicit stack: (directory, name, its path).
        let mut stack: Vec<(InodeId, Vec<u8>, Vec<u8>)> = names
            .into_iter()
            .map(|n| {
                let p = [&base[..], &n].concat();
                (dir_id, n, p)
            })
            .collect();
        while let Some((d, n, p)) = stack.pop() {
            if !self.upper.contains(&p) {
                if let InodeData::Directory(entries) = &mut self.tree.inode_mut(d).data {
                    entries.remove(&n);
                }
                continue;
            }
            let Some(child) = self.entries(d).get(&n).map(|e| e.inode) else {
                continue;
            };
            if let Some(es) = self.tree.inode(child).entries() {
                for k in es.keys() {
                    let cp = [&p[..], b"/", k].concat();
                    stack.push((child, k.clone(), cp));
                }
            }
        }
    }

    /// The inode a hardlink's target path names.
    fn hardlink_target(&mut self, target: &[u8]) -> Result<InodeId, Fail> {
        let rel = target.strip_prefix(b"/").unwrap_or(target);
        let comps: Vec<&[u8]> = rel
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty())
            .collect();
        let Some((name, parents)) = comps.split_last() else {
            return Err(Fail::Entry("hardlink to the root directory".into()));
        };
        let dir = self.resolve(parents, target)?;
        let missing = || {
            Fail::Entry(format!(
                "hardlink target {} does not exist in this layer or the layers below",
                lossy(target)
            ))
        };
        if !dir.missing.is_empty() {
            return Err(missing());
        }
        let id = self
            .tree
            .inode(dir.last())
            .entries()
            .and_then(|es| es.get(*name))
            .map(|e| e.inode)
            .ok_or_else(missing)?;
        if self.tree.inode(id).is_dir() {
            return Err(Fail::Entry(format!(
                "hardlink target {} is a directory",
                lossy(target)
            )));
        }
        Ok(id)
    }

    /// Marks `path` and every directory above it as this layer's.
    fn mark_upper(&mut self, path: &[u8]) {
        let mut end = path.len();
        loop {
            let p = &path[..end];
            if self.upper.contains(p) {
                // Its ancestors were marked with it.
                return;
            }
            self.upper.insert(p.to_vec());
            match p.iter().rposition(|&b| b == b'/') {
                Some(i) => end = i,
                None => return,
            }
        }
    }
}

/// Gives `to` the metadata of `from`: mode, owner, mtime, xattrs (replacing
/// all of `to`'s).
fn copy_attrs(to: &mut Inode, from: &Inode) {
    to.mode = from.mode;
    to.uid = from.uid;
    to.gid = from.gid;
    to.mtime = from.mtime;
    to.xattrs = from.xattrs.clone();
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
    for_each_reachable(tree, |dir, name, id| out.push((dir, name.to_vec(), id)));
    out
}

/// Calls `f(dir, name, inode)` for each entry reachable from the root, in
/// depth-first name order (directories nested deeper than `MAX_DEPTH` are
/// not entered).
fn for_each_reachable(tree: &Tree, mut f: impl FnMut(InodeId, &[u8], InodeId)) {
    let mut stack: Vec<(InodeId, usize)> = vec![(ROOT, 0)];
    // Iterative depth-first: push children in reverse so they pop in order.
    while let Some((dir, depth)) = stack.pop() {
        let Some(entries) = tree.inode(dir).entries() else {
            continue;
        };
        let mut subdirs = Vec::new();
        for (name, e) in entries {
            f(dir, name, e.inode);
            if tree.inode(e.inode).is_dir() && depth < cairn_erofs::tree::MAX_DEPTH {
                subdirs.push((e.inode, depth + 1));
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
}

/// Makes hardlink flags and link counts consistent: for every inode with
/// several names, the first name in depth-first name order is the primary
/// one; `nlink` of non-directories is the number of names.
pub(crate) fn normalize_links(tree: &mut Tree) {
    let all = reachable(tree);
    // Indexed by inode id (ids are dense): no hashing of 80k keys.
    let mut count = vec![0u32; tree.inodes.len()];
    let mut flags: Vec<(InodeId, Vec<u8>, bool)> = Vec::with_capacity(all.len());
    for (dir, name, id) in all {
        count[id] += 1;
        flags.push((dir, name, count[id] > 1));
    }
    for (dir, name, hardlink) in flags {
        if let InodeData::Directory(entries) = &mut tree.inode_mut(dir).data {
            if let Some(e) = entries.get_mut(&name) {
                e.hardlink = hardlink;
            }
        }
    }
    for (id, n) in count.into_iter().enumerate() {
        let inode = tree.inode_mut(id);
        if n > 0 && !inode.is_dir() {
            inode.nlink = n;
        }
    }
}

/// `tree` with only what is reachable from the root, renumbered in
/// depth-first order, with consistent hardlinks. The inodes are moved, not
/// copied.
pub(crate) fn compact(tree: Tree) -> Tree {
    const UNSEEN: InodeId = InodeId::MAX;
    // Indexed by old inode id (ids are dense): the new id, or UNSEEN.
    let mut new_id = vec![UNSEEN; tree.inodes.len()];
    new_id[ROOT] = ROOT;
    let mut order = vec![ROOT];
    for_each_reachable(&tree, |_, _, id| {
        if new_id[id] == UNSEEN {
            new_id[id] = order.len();
            order.push(id);
        }
    });
    let mut old: Vec<Option<Inode>> = tree.inodes.into_iter().map(Some).collect();
    let mut inodes: Vec<Inode> = order
        .into_iter()
        .map(|id| old[id].take().expect("each inode is numbered once"))
        .collect();
    drop(old);
    for inode in &mut inodes {
        if let InodeData::Directory(entries) = &mut inode.data {
            entries.retain(|_, e| new_id[e.inode] != UNSEEN);
            for e in entries.values_mut() {
                e.inode = new_id[e.inode];
            }
        }
    }
    let mut out = Tree { inodes };
    normalize_links(&mut out);
    out
}
