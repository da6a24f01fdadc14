//! The first pass: every inode's place in the image (breadth-first over the
//! primary directory entries, names sorted bytewise), its size, inline tail,
//! padding and block address, and the xattrs composefs adds or escapes.

use std::borrow::Cow;
use std::collections::HashMap;

use super::*;
use crate::tree::{
    FileType, InodeData, MAX_INLINE_CONTENT, MAX_PATH_LEN, ROOT, S_IFCHR, S_IFMT, S_IFREG,
};

/// Non-inline files are described by at most this many chunk pointers.
const MAX_NONINLINE_CHUNKS: u64 = 1024;
/// Largest total of xattr key and value bytes one inode may carry (as composefs).
const MAX_INODE_XATTR_BYTES: usize = u16::MAX as usize / 2;

const OVERLAY_PREFIX: &[u8] = b"trusted.overlay.";
const OVERLAY_ESCAPED_PREFIX: &[u8] = b"trusted.overlay.overlay.";
const XATTR_METACOPY: &[u8] = b"trusted.overlay.metacopy";
const XATTR_REDIRECT: &[u8] = b"trusted.overlay.redirect";
const XATTR_OPAQUE: &[u8] = b"trusted.overlay.opaque";
const XATTR_ESCAPED_WHITEOUT: &[u8] = b"trusted.overlay.overlay.whiteout";
const XATTR_ESCAPED_WHITEOUTS: &[u8] = b"trusted.overlay.overlay.whiteouts";
const XATTR_ESCAPED_OPAQUE: &[u8] = b"trusted.overlay.overlay.opaque";
const XATTR_USER_WHITEOUT: &[u8] = b"user.overlay.whiteout";
const XATTR_USER_WHITEOUTS: &[u8] = b"user.overlay.whiteouts";
const XATTR_USER_OPAQUE: &[u8] = b"user.overlay.opaque";

impl<'t> Layout<'t> {
    pub(super) fn build(tree: &'t Tree, version: u32) -> Result<Layout<'t>, Error> {
        let mut layout = Layout {
            tree,
            version,
            nodes: Vec::new(),
            min_mtime: tree.root().mtime,
            has_acl: false,
            shared_xattrs: Vec::new(),
            shared_size: 0,
            inodes_end: 0,
            n_data_blocks: 0,
        };
        layout.collect()?;
        layout.rewrite_for_overlay()?;
        layout.finish_tree();
        layout.share_xattrs();
        Ok(layout)
    }

    pub(super) fn path_of(&self, idx: usize) -> String {
        // Names are found by scanning the parent's children: only used on errors.
        let mut parts = Vec::new();
        let mut cur = idx;
        while cur != 0 && parts.len() < crate::tree::MAX_DEPTH {
            let parent = self.nodes[cur].parent;
            if let Body::Dir(children) = &self.nodes[parent].body {
                if let Some(c) = children.iter().find(|c| {
                    matches!(c.target, Target::Node(n) if n == cur)
                        && &*c.name != b"."
                        && &*c.name != b".."
                }) {
                    parts.push(String::from_utf8_lossy(&c.name).into_owned());
                }
            }
            cur = parent;
        }
        parts.reverse();
        format!("/{}", parts.join("/"))
    }

    fn node_from_inode(&self, id: InodeId, parent: usize) -> Result<Node<'t>, Error> {
        let ino = self.tree.inode(id);
        let (body, size) = match &ino.data {
            InodeData::Directory(_) => (Body::Dir(Vec::new()), 0),
            InodeData::Regular(r) => match &r.content {
                Some(c) if !c.is_empty() => (Body::Regular { content: Some(c) }, c.len() as u64),
                _ => (Body::Regular { content: None }, ino.size),
            },
            InodeData::Symlink(t) => (Body::Symlink(t), t.len() as u64),
            InodeData::Special => (Body::Special, ino.size),
        };
        Ok(Node {
            parent,
            source: Some(id),
            mode: ino.mode,
            uid: ino.uid,
            gid: ino.gid,
            nlink: ino.nlink,
            rdev: ino.rdev,
            size,
            mtime: ino.mtime,
            xattrs: ino
                .xattrs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            body,
            compact: false,
            n_blocks: 0,
            tail: 0,
            ipad: 0,
            xattr_size: 0,
            nid: 0,
            shared: Vec::new(),
        })
    }

    /// Breadth-first over primary entries: the node order is the inode order.
    fn collect(&mut self) -> Result<(), Error> {
        let tree = self.tree;
        let mut index_of: Vec<Option<usize>> = vec![None; tree.inodes.len()];
        index_of[ROOT] = Some(0);
        let root = self.node_from_inode(ROOT, 0)?;
        self.nodes.push(root);
        let mut cur = 0;
        while cur < self.nodes.len() {
            let Some(src) = self.nodes[cur].source else {
                cur += 1;
                continue;
            };
            let Some(entries) = tree.inode(src).entries() else {
                cur += 1;
                continue;
            };
            // (name, kind): kinds are sorted together by name, as composefs
            // keeps one sorted child list holding `.`, `..` and the whiteouts.
            enum Kind {
                Primary(InodeId),
                Link(InodeId),
                Dot,
                DotDot,
                RootWhiteout,
            }
            let mut kids: Vec<(Cow<'t, [u8]>, Kind)> = Vec::with_capacity(entries.len() + 2);
            for (name, e) in entries {
                let kind = if e.hardlink {
                    Kind::Link(e.inode)
                } else {
                    Kind::Primary(e.inode)
                };
                kids.push((Cow::Borrowed(name.as_slice()), kind));
            }
            kids.push((Cow::Borrowed(b"."), Kind::Dot));
            kids.push((Cow::Borrowed(b".."), Kind::DotDot));
            if cur == 0 && self.version < 2 {
                for i in 0..=255u8 {
                    let name = format!("{i:02x}").into_bytes();
                    if !entries.contains_key(&name) {
                        kids.push((Cow::Owned(name), Kind::RootWhiteout));
                    }
                }
            }
            kids.sort_by(|a, b| a.0.cmp(&b.0));

            let mut children = Vec::with_capacity(kids.len());
            for (name, kind) in kids {
                let target = match kind {
                    Kind::Dot => Target::Node(cur),
                    Kind::DotDot => Target::Node(self.nodes[cur].parent),
                    Kind::Link(id) => {
                        if tree.inodes.get(id).is_some_and(|i| i.is_dir()) {
                            return Err(Error::DirectoryHardlink(format!(
                                "{}/{}",
                                self.path_of(cur),
                                String::from_utf8_lossy(&name)
                            )));
                        }
                        Target::Link(id)
                    }
                    Kind::Primary(id) => {
                        if id >= index_of.len() {
                            return Err(Error::Invalid(format!(
                                "entry points at missing inode {id}"
                            )));
                        }
                        if index_of[id].is_some() {
                            return Err(Error::InvalidInode {
                                path: format!("{}/{}", self.path_of(cur), String::from_utf8_lossy(&name)),
                                reason: "inode has more than one primary entry (a directory loop or an unmarked hardlink)".into(),
                            });
                        }
                        let node = self.node_from_inode(id, cur)?;
                        let idx = self.nodes.len();
                        self.nodes.push(node);
                        index_of[id] = Some(idx);
                        Target::Node(idx)
                    }
                    Kind::RootWhiteout => {
                        let idx = self.nodes.len();
                        let root = &self.nodes[0];
                        let selinux = root
                            .xattrs
                            .iter()
                            .find(|(k, _)| k.as_slice() == b"security.selinux")
                            .cloned();
                        let node = Node {
                            parent: 0,
                            source: None,
                            mode: S_IFCHR | 0o644,
                            uid: root.uid,
                            gid: root.gid,
                            nlink: 1,
                            rdev: 0,
                            size: 0,
                            mtime: root.mtime,
                            xattrs: selinux.into_iter().collect(),
                            body: Body::Special,
                            compact: false,
                            n_blocks: 0,
                            tail: 0,
                            ipad: 0,
                            xattr_size: 0,
                            nid: 0,
                            shared: Vec::new(),
                        };
                        self.nodes.push(node);
                        Target::Node(idx)
                    }
                };
                children.push(Child { name, target });
            }
            self.nodes[cur].body = Body::Dir(children);
            cur += 1;
        }

        // Resolve secondary names now that every primary has its node.
        for n in 0..self.nodes.len() {
            let Body::Dir(children) = &mut self.nodes[n].body else {
                continue;
            };
            for c in children.iter_mut() {
                if let Target::Link(id) = c.target {
                    match index_of.get(id).copied().flatten() {
                        Some(idx) => c.target = Target::Node(idx),
                        None => {
                            return Err(Error::InvalidInode {
                                path: String::from_utf8_lossy(&c.name).into_owned(),
                                reason:
                                    "hardlink to an inode that has no primary entry in the tree"
                                        .into(),
                            })
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn validate(&self, idx: usize) -> Result<(), Error> {
        let n = &self.nodes[idx];
        let bad = |reason: String| Error::InvalidInode {
            path: self.path_of(idx),
            reason,
        };
        if FileType::from_mode(n.mode).is_none() {
            return Err(bad(format!("invalid file mode {:o}", n.mode)));
        }
        match &n.body {
            Body::Regular { content } => {
                if let Some(c) = content {
                    if c.len() > MAX_INLINE_CONTENT {
                        return Err(bad(format!(
                            "inline content of {} bytes exceeds the maximum of {MAX_INLINE_CONTENT}",
                            c.len()
                        )));
                    }
                } else if n.size > 0 && chunking(n.size).1 > MAX_NONINLINE_CHUNKS {
                    return Err(bad(format!("file size {} is too large", n.size)));
                }
            }
            Body::Symlink(t) if t.is_empty() || t.len() > MAX_PATH_LEN => {
                return Err(bad(format!(
                    "symlink target of {} bytes (must be 1 to {MAX_PATH_LEN})",
                    t.len()
                )));
            }
            _ => {}
        }
        Ok(())
    }

    /// The overlayfs xattrs composefs adds, and whiteout escaping.
    fn rewrite_for_overlay(&mut self) -> Result<(), Error> {
        let n_real = self.nodes.len();
        for idx in 0..n_real {
            if self.nodes[idx].source.is_none() {
                continue;
            }
            self.validate(idx)?;
            let node = &mut self.nodes[idx];
            // Escape the tree's own overlay xattrs.
            for (k, _) in node.xattrs.iter_mut() {
                if k.starts_with(OVERLAY_PREFIX) {
                    let mut esc = OVERLAY_ESCAPED_PREFIX.to_vec();
                    esc.extend_from_slice(&k[OVERLAY_PREFIX.len()..]);
                    *k = esc;
                }
            }
            if let Body::Regular { content: None } = node.body {
                if node.size > 0 {
                    let (digest, payload) = match node.source.map(|s| &self.tree.inode(s).data) {
                        Some(InodeData::Regular(r)) => (r.digest, r.payload.clone()),
                        _ => (None, None),
                    };
                    let mut meta = Vec::new();
                    if let Some(d) = digest {
                        meta.extend_from_slice(&[0, 36, 0, 1]);
                        meta.extend_from_slice(&d);
                    }
                    set_xattr(&mut node.xattrs, XATTR_METACOPY, &meta);
                    if let Some(p) = payload.filter(|p| !p.is_empty()) {
                        let mut redirect = b"/".to_vec();
                        redirect.extend_from_slice(&p);
                        set_xattr(&mut node.xattrs, XATTR_REDIRECT, &redirect);
                    }
                }
            }
            if node.mode & S_IFMT == S_IFCHR && node.rdev == 0 {
                node.size = 0;
                node.mode = S_IFREG | (node.mode & !S_IFMT);
                node.body = Body::Regular { content: None };
                set_xattr(&mut node.xattrs, XATTR_ESCAPED_WHITEOUT, b"");
                set_xattr(&mut node.xattrs, XATTR_USER_WHITEOUT, b"");
                let parent = node.parent;
                let p = &mut self.nodes[parent].xattrs;
                set_xattr(p, XATTR_ESCAPED_WHITEOUTS, b"");
                set_xattr(p, XATTR_USER_WHITEOUTS, b"");
                if self.version >= 1 {
                    set_xattr(p, XATTR_ESCAPED_OPAQUE, b"x");
                    set_xattr(p, XATTR_USER_OPAQUE, b"x");
                }
            }
        }
        if self.version < 2 {
            set_xattr(&mut self.nodes[0].xattrs, XATTR_OPAQUE, b"y");
        }
        for idx in 0..self.nodes.len() {
            let total: usize = self.nodes[idx]
                .xattrs
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum();
            if total > MAX_INODE_XATTR_BYTES * 2 {
                return Err(Error::InvalidInode {
                    path: self.path_of(idx),
                    reason: format!("{total} bytes of xattrs do not fit in an inode"),
                });
            }
        }
        Ok(())
    }

    /// Directory link counts, minimum mtime, ACL flag: what `lcfs_compute_tree` does.
    fn finish_tree(&mut self) {
        let mut min = self.nodes[0].mtime;
        let mut has_acl = false;
        for idx in 0..self.nodes.len() {
            if let Body::Dir(children) = &self.nodes[idx].body {
                let subdirs = children
                    .iter()
                    .filter(|c| &*c.name != b"." && &*c.name != b"..")
                    .filter(|c| matches!(self.nodes[c.node()].body, Body::Dir(_)))
                    .count();
                self.nodes[idx].nlink = 2 + subdirs as u32;
            }
            let n = &mut self.nodes[idx];
            n.xattrs.sort_by(|a, b| a.0.cmp(&b.0));
            if n.mtime < min {
                min = n.mtime;
            }
            if n.xattrs.iter().any(|(k, _)| {
                k.as_slice() == b"system.posix_acl_access"
                    || k.as_slice() == b"system.posix_acl_default"
            }) {
                has_acl = true;
            }
        }
        self.min_mtime = min;
        self.has_acl = has_acl;
    }

    /// xattrs used by more than one inode go to the shared area, in the
    /// reference's canonical order (descending by key, then value).
    fn share_xattrs(&mut self) {
        // Sized once: growing it re-hashes every key, and an image of 80k
        // files has about as many distinct xattrs (overlay redirects).
        let total: usize = self.nodes.iter().map(|n| n.xattrs.len()).sum();
        let mut counts: HashMap<(&[u8], &[u8]), u32> = HashMap::with_capacity(total);
        for n in &self.nodes {
            for (k, v) in &n.xattrs {
                *counts.entry((k, v)).or_default() += 1;
            }
        }
        let mut multi: Vec<(&[u8], &[u8])> = counts
            .iter()
            .filter(|(_, &c)| c > 1)
            .map(|(&kv, _)| kv)
            .collect();
        multi.sort_by(|a, b| {
            b.0.cmp(a.0)
                .then_with(|| b.1.len().cmp(&a.1.len()))
                .then_with(|| b.1.cmp(a.1))
        });
        let mut offsets: HashMap<(&[u8], &[u8]), u64> = HashMap::with_capacity(multi.len());
        let mut off = 0u64;
        let mut shared = Vec::with_capacity(multi.len());
        for kv in multi {
            offsets.insert(kv, off);
            off += xattr_entry_size(kv.0, kv.1);
            shared.push((kv.0.to_vec(), kv.1.to_vec()));
        }
        let per_node: Vec<Vec<Option<u64>>> = self
            .nodes
            .iter()
            .map(|n| {
                let mut n_shared = 0u32;
                n.xattrs
                    .iter()
                    .map(|(k, v)| match offsets.get(&(k.as_slice(), v.as_slice())) {
                        Some(&o) if n_shared < u32::from(XATTR_LONG_PREFIX) => {
                            n_shared += 1;
                            Some(o)
                        }
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        for (n, s) in self.nodes.iter_mut().zip(per_node) {
            n.shared = s;
        }
        self.shared_xattrs = shared;
        self.shared_size = off;
    }

    /// First pass: sizes, tails, padding and node ids.
    pub(super) fn place(&mut self) -> Result<(), Error> {
        let mut pos = SUPER_OFFSET + size_of::<SuperBlock>() as u64;
        let meta_start = round_down(pos, BLKSIZ);
        for idx in 0..self.nodes.len() {
            self.size_body(idx);
            let fits = self.fits_compact(idx);
            let n = &mut self.nodes[idx];
            n.compact = fits;
            let inode_size = if fits {
                size_of::<InodeCompact>()
            } else {
                size_of::<InodeExtended>()
            } as u64;
            let (n_shared, inline_size) = xattr_counts(n);
            n.xattr_size = xattr_ibody_size_for(n_shared, inline_size);

            let aligned = round_up(pos, SLOTSIZE);
            n.ipad = aligned - pos;
            pos = aligned;
            let extra = pad_for_tail(n, pos, inode_size, n.xattr_size);
            n.ipad += extra;
            pos += extra;
            let isize = inode_size + n.xattr_size + n.tail;
            self.n_data_blocks += n.n_blocks;
            n.nid = (pos - meta_start) / SLOTSIZE;
            pos += isize;
        }
        if self.nodes[0].nid > u64::from(u16::MAX) {
            return Err(Error::Invalid(
                "root inode does not fit in the first 64k slots".into(),
            ));
        }
        self.inodes_end = round_up(pos, SLOTSIZE);
        Ok(())
    }

    fn size_body(&mut self, idx: usize) {
        let n = &mut self.nodes[idx];
        let (blocks, tail) = match &n.body {
            Body::Dir(children) => dir_size(children),
            Body::Symlink(t) => (0, t.len() as u64),
            Body::Regular { content: Some(_) } if n.size > 0 => {
                let (mut b, mut t) = (n.size / BLKSIZ, n.size % BLKSIZ);
                if t > BLKSIZ / 2 {
                    b += 1;
                    t = 0;
                }
                (b, t)
            }
            Body::Regular { content: None } if n.size > 0 => (0, chunking(n.size).1 * 4),
            _ => (0, 0),
        };
        n.n_blocks = blocks;
        n.tail = tail;
    }

    fn fits_compact(&self, idx: usize) -> bool {
        let n = &self.nodes[idx];
        if n.mtime != self.min_mtime {
            return false;
        }
        if n.nlink > u32::from(u16::MAX)
            || n.uid > u32::from(u16::MAX)
            || n.gid > u32::from(u16::MAX)
        {
            return false;
        }
        let size = match n.body {
            Body::Dir(_) => n.n_blocks * BLKSIZ + n.tail,
            _ => n.size,
        };
        size <= u64::from(u32::MAX)
    }
}

/// Sets (or replaces) an xattr in an unsorted list.
fn set_xattr(xattrs: &mut Vec<(Vec<u8>, Vec<u8>)>, key: &[u8], value: &[u8]) {
    match xattrs.iter_mut().find(|(k, _)| k.as_slice() == key) {
        Some((_, v)) => *v = value.to_vec(),
        None => xattrs.push((key.to_vec(), value.to_vec())),
    }
}

fn xattr_entry_size(key: &[u8], value: &[u8]) -> u64 {
    let (_, suffix) = xattr_name_index(key);
    round_up(
        (size_of::<XattrEntry>() + suffix.len() + value.len()) as u64,
        4,
    )
}

fn xattr_counts(n: &Node<'_>) -> (u64, u64) {
    let mut shared = 0;
    let mut inline = 0;
    for ((k, v), s) in n.xattrs.iter().zip(&n.shared) {
        if s.is_some() {
            shared += 1;
        } else {
            inline += xattr_entry_size(k, v);
        }
    }
    (shared, inline)
}

fn xattr_ibody_size_for(n_shared: u64, inline: u64) -> u64 {
    if n_shared == 0 && inline == 0 {
        0
    } else {
        round_up(
            size_of::<XattrIbodyHeader>() as u64
                + n_shared * size_of::<XattrEntry>() as u64
                + inline,
            4,
        )
    }
}

/// Full dirent blocks and the size of the tail.
fn dir_size(children: &[Child<'_>]) -> (u64, u64) {
    let mut blocks = 0;
    let mut used = 0;
    for c in children {
        let len = dirent_len(c);
        if used + len > BLKSIZ {
            blocks += 1;
            used = 0;
        }
        used += len;
    }
    // As the reference does: never inline more than half a block.
    if used > BLKSIZ / 2 {
        blocks += 1;
        used = 0;
    }
    (blocks, used)
}

/// Padding before an inode so that its inline tail does not cross a block
/// boundary; may instead move the tail out to a block of its own.
fn pad_for_tail(n: &mut Node<'_>, pos: u64, inode_size: u64, xattr_size: u64) -> u64 {
    let non_tail = inode_size + xattr_size;
    let total = non_tail + n.tail;
    if matches!(n.body, Body::Symlink(_)) {
        // A symlink keeps inode and target in one block, or the target
        // moves to a block of its own.
        let pos_block = pos / BLKSIZ;
        let end_block = (pos + total - 1) / BLKSIZ;
        if total / BLKSIZ > 0 {
            n.n_blocks += 1;
            n.tail = 0;
        }
        return if pos_block != end_block {
            round_up(pos, BLKSIZ) - pos
        } else {
            0
        };
    }
    let remainder = BLKSIZ - (pos + non_tail) % BLKSIZ;
    if remainder < n.tail {
        let extra = round_up(remainder, SLOTSIZE);
        let remainder = BLKSIZ - (pos + non_tail + extra) % BLKSIZ;
        if n.tail <= remainder {
            return extra;
        }
        n.n_blocks += 1;
        n.tail = 0;
        return round_up(pos, BLKSIZ) - pos;
    }
    0
}
