//! Reading a dumpfile: [`parse_dump`] for a whole tree, [`parse_line`] for
//! one line on its own. Every limit of the reference is checked here.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, Read};

use super::print::{bad_tree, escape_into, walk, Escape};
use crate::tree::{
    DirEntry, FileType, Inode, InodeData, InodeId, Mtime, RegularFile, Tree, MAX_DEPTH,
    MAX_INLINE_CONTENT, MAX_NAME_LEN, MAX_PATH_LEN, ROOT,
};

/// How forgiving [`parse_dump`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseOptions {
    /// Reject what the reference rejects only under `CFS_PARSE_STRICT`: a
    /// non-zero RDEV on a non-device, a symlink whose SIZE is not the length
    /// of its target or that has CONTENT, and a last line without newline.
    pub strict: bool,
}

impl Default for ParseOptions {
    fn default() -> Self {
        ParseOptions { strict: true }
    }
}

/// Why a dumpfile could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// The line is malformed or contradicts an earlier one.
    #[error("line {line}: {reason}")]
    Invalid { line: usize, reason: String },
    /// Reading the input failed.
    #[error("line {line}: reading dumpfile: {source}")]
    Io {
        line: usize,
        #[source]
        source: io::Error,
    },
}

impl DumpError {
    /// The 1-based number of the line the error is about.
    pub fn line(&self) -> usize {
        match self {
            DumpError::Invalid { line, .. } | DumpError::Io { line, .. } => *line,
        }
    }
}

/// Longest line read, newline excluded. The longest line the reference can
/// accept within [`MAX_DEPTH`] (a fully escaped 2048-component path, 64 KiB
/// of xattrs, escaped payload and content) is well below this.
pub const MAX_LINE_LEN: usize = 8 << 20;
/// Longest xattr name (`XATTR_NAME_MAX`).
const MAX_XATTR_NAME_LEN: usize = 255;
/// Longest xattr value.
const MAX_XATTR_VALUE_LEN: usize = u16::MAX as usize;
/// Budget for one inode's xattrs from external input
/// (`LCFS_INODE_EXTERNAL_XATTR_MAX`), counted as the reference counts it.
const MAX_XATTRS_SIZE: usize = u16::MAX as usize / 2;
/// Per-xattr overhead in that budget: twice the 4-byte entry header less one,
/// the worst case after alignment.
const XATTR_ENTRY_OVERHEAD: usize = 2 * 4 - 1;
/// Overhead of the first xattr: the 12-byte ibody header.
const XATTR_HEADER_SIZE: usize = 12;
/// Longest xattr part of a line; the reference caps it to bound its
/// quadratic duplicate search.
pub(super) const MAX_XATTR_FIELD_LEN: usize = u16::MAX as usize;
/// Largest regular file stored outside the image: 1024 chunk indexes of
/// 2^43-byte chunks fit in the inode's one block.
const MAX_EXTERNAL_FILE_SIZE: u64 = 1024 << 43;
/// Length of a sha256 digest.
const DIGEST_LEN: usize = 32;

/// Reads a dumpfile into a tree, line by line.
///
/// Hardlink lines (`@` before MODE) may name targets that appear later; they
/// are resolved once the whole input is read. The inodes of the result are
/// numbered in the order [`print_dump`](super::print_dump) prints them (root first, then
/// depth-first in name order), whatever the order of the lines.
pub fn parse_dump(mut input: impl BufRead, opts: &ParseOptions) -> Result<Tree, DumpError> {
    let mut parser = Parser::new(opts.strict);
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    loop {
        buf.clear();
        line_no = line_no.saturating_add(1);
        let limit = MAX_LINE_LEN as u64 + 1;
        let read = (&mut input)
            .take(limit)
            .read_until(b'\n', &mut buf)
            .map_err(|source| DumpError::Io {
                line: line_no,
                source,
            })?;
        if read == 0 {
            break;
        }
        let line = match buf.split_last() {
            Some((b'\n', line)) => line,
            _ if buf.len() > MAX_LINE_LEN => {
                return Err(invalid(
                    line_no,
                    format!("line is longer than {MAX_LINE_LEN} bytes"),
                ))
            }
            _ if opts.strict => {
                return Err(invalid(line_no, "missing newline at the end of the file"))
            }
            _ => &buf[..],
        };
        parser
            .parse_line(line_no, line)
            .map_err(|reason| invalid(line_no, reason))?;
    }
    parser.finish()
}

/// [`parse_dump`] over a byte slice: the entry point for fuzzing. Any input
/// gives a tree or an error, never a panic.
pub fn parse_dump_bytes(data: &[u8], opts: &ParseOptions) -> Result<Tree, DumpError> {
    parse_dump(data, opts)
}

/// What one dumpfile line says when it is read on its own ([`parse_line`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// A full line: the inode at its PATH.
    Inode(Inode),
    /// A hardlink line (`@` before MODE): PATH is another name of the
    /// inode at this path (its PAYLOAD, unescaped, as written).
    Hardlink(Vec<u8>),
}

/// Reads one line (without its newline) on its own, as strictly as
/// [`parse_dump`] reads its fields, but without placing it in a tree: PATH is
/// unescaped and returned as written (no parent or root-first rule, no
/// duplicate check). For formats that reuse the line syntax for something
/// that is not a tree, such as cairn's layer records (the entries of a tar
/// stream, in order).
pub fn parse_line(line: &[u8]) -> Result<(Vec<u8>, Line), String> {
    let Head {
        f,
        path,
        hardlink,
        mode,
        ftype,
    } = Head::read(line)?;
    if hardlink {
        if ftype == FileType::Directory {
            return Err(format!("{}: directories cannot be hardlinked", show(&path)));
        }
        let target = unescape_optional(f.payload, "PAYLOAD")?
            .filter(|t| !t.is_empty())
            .ok_or_else(|| format!("{}: hardlink without a target", show(&path)))?;
        check_payload(&target, "hardlink target")?;
        return Ok((path, Line::Hardlink(target)));
    }
    Ok((path, Line::Inode(parse_inode(&f, mode, ftype, true)?)))
}

fn invalid(line: usize, reason: impl Into<String>) -> DumpError {
    DumpError::Invalid {
        line,
        reason: reason.into(),
    }
}

/// Shows bytes from the input in an error message, escaped as in a dumpfile
/// and cut short if long.
fn show(bytes: &[u8]) -> String {
    const MAX_SHOWN: usize = 64;
    let mut out = Vec::new();
    let shown = bytes.get(..MAX_SHOWN).unwrap_or(bytes);
    escape_into(&mut out, shown, Escape::default());
    let mut s = String::from_utf8_lossy(&out).into_owned();
    if shown.len() < bytes.len() {
        s.push_str(&format!("… ({} bytes)", bytes.len()));
    }
    s
}

/// A hardlink line waiting for its target.
struct PendingLink {
    line: usize,
    /// The placeholder inode its directory entry points at until resolved.
    placeholder: InodeId,
    parent: InodeId,
    name: Vec<u8>,
    /// Unescaped PAYLOAD, or `None` for `-`.
    target: Option<Vec<u8>>,
}

/// Where a line's path goes.
enum Place {
    Root,
    Child { parent: InodeId, name: Vec<u8> },
}

struct Parser {
    strict: bool,
    tree: Option<Tree>,
    /// Number of the line being parsed (the last one, in `finish`).
    line: usize,
    pending: Vec<PendingLink>,
    /// Placeholder inode → index in `pending`.
    placeholders: HashMap<InodeId, usize>,
}

/// The fixed fields of a line and the xattr part after them.
pub(super) struct Fields<'a> {
    path: &'a [u8],
    size: &'a [u8],
    mode: &'a [u8],
    nlink: &'a [u8],
    uid: &'a [u8],
    gid: &'a [u8],
    rdev: &'a [u8],
    mtime: &'a [u8],
    payload: &'a [u8],
    content: &'a [u8],
    digest: &'a [u8],
    pub(super) xattrs: &'a [u8],
}

/// What every line starts with: its fields split, PATH unescaped, MODE
/// read (`hardlink` for a `@` before it).
struct Head<'a> {
    f: Fields<'a>,
    path: Vec<u8>,
    hardlink: bool,
    mode: u32,
    ftype: FileType,
}

impl<'a> Head<'a> {
    fn read(line: &'a [u8]) -> Result<Head<'a>, String> {
        if let Some(pos) = line.iter().position(|&b| b == 0) {
            return Err(format!("NUL byte at offset {pos}"));
        }
        let f = Fields::split(line);
        let path = unescape(f.path, "PATH")?;
        if path.is_empty() {
            return Err("empty PATH".into());
        }
        if path.contains(&0) {
            return Err(format!("PATH {} contains a NUL byte", show(&path)));
        }
        let (hardlink, mode_field) = match f.mode.split_first() {
            Some((b'@', rest)) => (true, rest),
            _ => (false, f.mode),
        };
        let mode = parse_u32(mode_field, 8, "MODE")?;
        let ftype = FileType::from_mode(mode)
            .ok_or_else(|| format!("invalid MODE {mode:o}: no known file type"))?;
        Ok(Head {
            f,
            path,
            hardlink,
            mode,
            ftype,
        })
    }
}

impl<'a> Fields<'a> {
    /// Splits at single spaces; missing trailing fields are empty.
    pub(super) fn split(line: &'a [u8]) -> Fields<'a> {
        let mut rest = line;
        let mut next = || {
            let mut it = rest.splitn(2, |&b| b == b' ');
            let field = it.next().unwrap_or_default();
            rest = it.next().unwrap_or_default();
            field
        };
        let path = next();
        let size = next();
        let mode = next();
        let nlink = next();
        let uid = next();
        let gid = next();
        let rdev = next();
        let mtime = next();
        let payload = next();
        let content = next();
        let digest = next();
        Fields {
            path,
            size,
            mode,
            nlink,
            uid,
            gid,
            rdev,
            mtime,
            payload,
            content,
            digest,
            xattrs: rest,
        }
    }
}

impl Parser {
    fn new(strict: bool) -> Parser {
        Parser {
            strict,
            tree: None,
            line: 0,
            pending: Vec::new(),
            placeholders: HashMap::new(),
        }
    }

    fn parse_line(&mut self, line_no: usize, line: &[u8]) -> Result<(), String> {
        self.line = line_no;
        let Head {
            f,
            path,
            hardlink,
            mode,
            ftype,
        } = Head::read(line)?;

        let place = self.place(&path, ftype)?;

        if hardlink {
            if ftype == FileType::Directory {
                return Err(format!("{}: directories cannot be hardlinked", show(&path)));
            }
            let Place::Child { parent, name } = place else {
                // `place` only accepts a directory for the root.
                return Err("the root cannot be a hardlink".into());
            };
            let target = unescape_optional(f.payload, "PAYLOAD")?;
            return self.add_hardlink(parent, name, mode, target);
        }

        let inode = parse_inode(&f, mode, ftype, self.strict)?;
        match place {
            Place::Root => {
                self.tree = Some(Tree {
                    inodes: vec![inode],
                })
            }
            Place::Child { parent, name } => {
                let tree = self.tree_mut()?;
                tree.inodes.push(inode);
                let id = tree.inodes.len() - 1;
                link(tree, parent, name, id, false)?;
            }
        }
        Ok(())
    }

    fn tree_mut(&mut self) -> Result<&mut Tree, String> {
        self.tree
            .as_mut()
            .ok_or_else(|| "the first line must be the root directory /".to_string())
    }

    /// Finds the directory a new path goes in, checking everything the
    /// reference checks before it adds the node.
    fn place(&self, path: &[u8], ftype: FileType) -> Result<Place, String> {
        if path == b"/" {
            if ftype != FileType::Directory {
                return Err("the root / must be a directory".into());
            }
            if self.tree.is_some() {
                return Err("the root / appears twice".into());
            }
            return Ok(Place::Root);
        }
        let Some(tree) = &self.tree else {
            return Err(format!(
                "{}: the first line must be the root directory /",
                show(path)
            ));
        };
        let trimmed = trim_leading_slashes(path);
        let mut comps = trimmed.split(|&b| b == b'/');
        // `split` always yields at least one item; the last one is the name.
        let name = comps.next_back().unwrap_or_default();
        let mut parent = ROOT;
        let mut depth = 1usize;
        for comp in comps.filter(|c| !c.is_empty()) {
            depth = depth.saturating_add(1);
            if depth > MAX_DEPTH {
                return Err(format!(
                    "{}: nested deeper than {MAX_DEPTH} directories",
                    show(path)
                ));
            }
            parent = tree
                .inodes
                .get(parent)
                .and_then(Inode::entries)
                .and_then(|e| e.get(comp))
                .map(|e| e.inode)
                .ok_or_else(|| format!("{}: parent directory does not exist", show(path)))?;
        }
        let entries = tree
            .inodes
            .get(parent)
            .and_then(Inode::entries)
            .ok_or_else(|| format!("{}: parent is not a directory", show(path)))?;
        if name == b"." || name == b".." {
            return Err(format!("{}: '.' and '..' are not valid names", show(path)));
        }
        if name.is_empty() {
            return Err(format!("{}: empty file name", show(path)));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(format!(
                "{}: name of {} bytes is longer than {MAX_NAME_LEN}",
                show(path),
                name.len()
            ));
        }
        if entries.contains_key(name) {
            return Err(format!("{} already exists", show(path)));
        }
        Ok(Place::Child {
            parent,
            name: name.to_vec(),
        })
    }

    /// Links a placeholder for a hardlink line; [`Parser::finish`] points
    /// the entry at the real inode.
    fn add_hardlink(
        &mut self,
        parent: InodeId,
        name: Vec<u8>,
        mode: u32,
        target: Option<Vec<u8>>,
    ) -> Result<(), String> {
        let line = self.line;
        let tree = self.tree_mut()?;
        tree.inodes.push(Inode {
            mode,
            uid: 0,
            gid: 0,
            nlink: 1,
            rdev: 0,
            size: 0,
            mtime: Mtime::default(),
            xattrs: BTreeMap::new(),
            data: InodeData::Special,
        });
        let placeholder = tree.inodes.len() - 1;
        link(tree, parent, name.clone(), placeholder, true)?;
        self.placeholders.insert(placeholder, self.pending.len());
        self.pending.push(PendingLink {
            line,
            placeholder,
            parent,
            name,
            target,
        });
        Ok(())
    }

    /// Resolves hardlinks, drops their placeholders and hands out the tree
    /// in canonical order.
    fn finish(self) -> Result<Tree, DumpError> {
        let Parser {
            tree,
            line,
            pending,
            placeholders,
            ..
        } = self;
        let Some(mut tree) = tree else {
            return Err(invalid(
                line.max(1),
                "no root directory: the dumpfile is empty",
            ));
        };
        let finals = resolve_links(&tree, &pending, &placeholders)?;
        for (p, &target) in pending.iter().zip(&finals) {
            let entry = match tree.inodes.get_mut(p.parent).map(|i| &mut i.data) {
                Some(InodeData::Directory(e)) => e.get_mut(&p.name),
                _ => None,
            };
            let entry = entry.ok_or_else(|| invalid(p.line, "internal error: entry vanished"))?;
            entry.inode = target;
            entry.hardlink = true;
        }

        canonical_order(tree).map_err(|e| invalid(line, format!("internal error: {e}")))
    }
}

/// Builds the inode of a full (non-hardlink) line, in the order the
/// reference checks its fields.
fn parse_inode(f: &Fields<'_>, mode: u32, ftype: FileType, strict: bool) -> Result<Inode, String> {
    let size = parse_uint(f.size, 10, "SIZE")?;
    let nlink = parse_u32(f.nlink, 10, "NLINK")?;
    let uid = parse_u32(f.uid, 10, "UID")?;
    let gid = parse_u32(f.gid, 10, "GID")?;
    let rdev = parse_uint(f.rdev, 10, "RDEV")?;
    let mtime = parse_mtime(f.mtime)?;
    let payload = unescape_optional(f.payload, "PAYLOAD")?;
    let content = unescape_optional(f.content, "CONTENT")?;
    if let Some(c) = &content {
        if c.len() as u64 != size {
            return Err(format!("CONTENT has {} bytes but SIZE is {size}", c.len()));
        }
    }
    let digest = unescape_optional(f.digest, "DIGEST")?;

    let is_device = matches!(ftype, FileType::CharDevice | FileType::BlockDevice);
    if !is_device && rdev != 0 && strict {
        return Err(format!("RDEV {rdev} on a file that is not a device"));
    }

    let mut inode = Inode {
        mode,
        uid,
        gid,
        nlink,
        rdev: if is_device { rdev } else { 0 },
        size,
        mtime,
        xattrs: BTreeMap::new(),
        data: InodeData::Special,
    };

    if ftype == FileType::Symlink {
        let target = payload.ok_or("symlink without a target (PAYLOAD is -)")?;
        check_payload(&target, "symlink target")?;
        if target.is_empty() {
            return Err("symlink with an empty target".into());
        }
        if strict {
            if size != target.len() as u64 {
                return Err(format!(
                    "symlink SIZE {size} is not the length of its target ({})",
                    target.len()
                ));
            }
            if content.as_ref().is_some_and(|c| !c.is_empty()) {
                return Err("a symlink cannot have CONTENT".into());
            }
        }
        inode.size = target.len() as u64;
        inode.data = InodeData::Symlink(target);
    } else {
        if let Some(p) = &payload {
            check_payload(p, "PAYLOAD")?;
        }
        if let Some(c) = &content {
            if c.len() > MAX_INLINE_CONTENT {
                return Err(format!(
                    "inline CONTENT of {} bytes is larger than {MAX_INLINE_CONTENT}",
                    c.len()
                ));
            }
        }
        // Empty content is no content, as in the reference.
        let content = content.filter(|c| !c.is_empty());
        inode.data = match ftype {
            FileType::Directory => InodeData::Directory(BTreeMap::new()),
            FileType::Regular => {
                if content.is_none() && size > MAX_EXTERNAL_FILE_SIZE {
                    return Err(format!(
                        "file of {size} bytes is larger than the {MAX_EXTERNAL_FILE_SIZE} \
                         bytes an image can describe"
                    ));
                }
                InodeData::Regular(RegularFile {
                    content,
                    payload,
                    digest: None,
                })
            }
            // PAYLOAD, CONTENT and DIGEST mean nothing for these; the
            // reference accepts and ignores them, and so do we.
            _ => InodeData::Special,
        };
    }

    // The reference ignores a DIGEST it cannot decode and then uses
    // whatever was in its buffer; here an empty DIGEST is none and a
    // malformed one on a regular file is an error. Other file types have
    // no use for a digest, so theirs is not looked at.
    if let InodeData::Regular(r) = &mut inode.data {
        if let Some(d) = digest.filter(|d| !d.is_empty()) {
            r.digest = Some(parse_digest(&d)?);
        }
    }

    if f.xattrs.len() > MAX_XATTR_FIELD_LEN {
        return Err(format!(
            "too many xattrs: {} bytes of xattrs, at most {MAX_XATTR_FIELD_LEN}",
            f.xattrs.len()
        ));
    }
    let mut budget = XattrBudget::default();
    let mut rest = f.xattrs;
    while !rest.is_empty() {
        let mut it = rest.splitn(2, |&b| b == b' ');
        let field = it.next().unwrap_or_default();
        rest = it.next().unwrap_or_default();
        parse_xattr(field, &mut inode.xattrs, &mut budget)?;
    }
    Ok(inode)
}

/// Renumbers the inodes in the order [`print_dump`](super::print_dump) prints them (the root,
/// then depth-first in name order), dropping any not reached by a primary
/// entry (the hardlink placeholders). The tree then does not depend on the
/// order of the input lines, so parse → print → parse gives an equal tree.
fn canonical_order(tree: Tree) -> io::Result<Tree> {
    let mut order = Vec::with_capacity(tree.inodes.len());
    walk(&tree, |_, id, hardlink| {
        if !hardlink {
            order.push(id);
        }
        Ok(())
    })?;
    let mut remap: Vec<Option<InodeId>> = vec![None; tree.inodes.len()];
    for (new, &old) in order.iter().enumerate() {
        if let Some(slot) = remap.get_mut(old) {
            *slot = Some(new);
        }
    }
    let mut slots: Vec<Option<Inode>> = tree.inodes.into_iter().map(Some).collect();
    let mut inodes = Vec::with_capacity(order.len());
    for &old in &order {
        let inode = slots.get_mut(old).and_then(Option::take);
        inodes.push(inode.ok_or_else(|| bad_tree("inode reached twice"))?);
    }
    for inode in &mut inodes {
        if let InodeData::Directory(entries) = &mut inode.data {
            for e in entries.values_mut() {
                e.inode = remap
                    .get(e.inode)
                    .copied()
                    .flatten()
                    .ok_or_else(|| bad_tree("entry points at an unreachable inode"))?;
            }
        }
    }
    Ok(Tree { inodes })
}

/// Follows every hardlink line to the inode it finally names (a hardlink may
/// name another hardlink), rejecting missing targets, directories and cycles.
/// Returns the target inode of each entry of `pending`.
fn resolve_links(
    tree: &Tree,
    pending: &[PendingLink],
    placeholders: &HashMap<InodeId, usize>,
) -> Result<Vec<InodeId>, DumpError> {
    let mut finals: Vec<Option<InodeId>> = vec![None; pending.len()];
    let mut on_chain = vec![false; pending.len()];
    let mut chain = Vec::new();
    for start in 0..pending.len() {
        if finals.get(start).copied().flatten().is_some() {
            continue;
        }
        chain.clear();
        let mut cur = start;
        let target = loop {
            let p = pending
                .get(cur)
                .ok_or_else(|| invalid(0, "internal error: bad hardlink index"))?;
            chain.push(cur);
            if let Some(flag) = on_chain.get_mut(cur) {
                *flag = true;
            }
            let path = p
                .target
                .as_deref()
                .ok_or_else(|| invalid(p.line, "hardlink without a target (PAYLOAD is -)"))?;
            let id = lookup(tree, path).ok_or_else(|| {
                invalid(
                    p.line,
                    format!("hardlink target {} does not exist", show(path)),
                )
            })?;
            if id == p.placeholder {
                return Err(invalid(
                    p.line,
                    format!("hardlink {} points at itself", show(path)),
                ));
            }
            let Some(&next) = placeholders.get(&id) else {
                break id;
            };
            if let Some(done) = finals.get(next).copied().flatten() {
                break done;
            }
            if on_chain.get(next).copied().unwrap_or(false) {
                return Err(invalid(
                    p.line,
                    format!("hardlink cycle through {}", show(path)),
                ));
            }
            cur = next;
        };
        let first = pending
            .get(start)
            .ok_or_else(|| invalid(0, "internal error: bad hardlink index"))?;
        if tree.inodes.get(target).is_some_and(Inode::is_dir) {
            let path = first.target.as_deref().unwrap_or_default();
            return Err(invalid(
                first.line,
                format!("hardlink target {} is a directory", show(path)),
            ));
        }
        for &i in &chain {
            if let Some(slot) = finals.get_mut(i) {
                *slot = Some(target);
            }
            if let Some(flag) = on_chain.get_mut(i) {
                *flag = false;
            }
        }
    }
    finals
        .into_iter()
        .map(|f| f.ok_or_else(|| invalid(0, "internal error: unresolved hardlink")))
        .collect()
}

/// Adds a directory entry; `place` already checked name and parent.
fn link(
    tree: &mut Tree,
    parent: InodeId,
    name: Vec<u8>,
    child: InodeId,
    hardlink: bool,
) -> Result<(), String> {
    match tree.inodes.get_mut(parent).map(|i| &mut i.data) {
        Some(InodeData::Directory(entries)) => {
            entries.insert(
                name,
                DirEntry {
                    inode: child,
                    hardlink,
                },
            );
            Ok(())
        }
        _ => Err("internal error: parent is not a directory".into()),
    }
}

fn trim_leading_slashes(path: &[u8]) -> &[u8] {
    let start = path.iter().position(|&b| b != b'/').unwrap_or(path.len());
    path.get(start..).unwrap_or_default()
}

/// Looks a hardlink target up as the reference does: leading, repeated and
/// trailing slashes are ignored, and an empty path is the root.
fn lookup(tree: &Tree, path: &[u8]) -> Option<InodeId> {
    let mut cur = ROOT;
    for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
        cur = tree.inodes.get(cur)?.entries()?.get(comp)?.inode;
    }
    Some(cur)
}

/// The reference's running xattr size, kept exactly as it keeps it so the
/// same inputs pass.
#[derive(Default)]
struct XattrBudget {
    used: usize,
}

fn parse_xattr(
    field: &[u8],
    xattrs: &mut BTreeMap<Vec<u8>, Vec<u8>>,
    budget: &mut XattrBudget,
) -> Result<(), String> {
    let mut it = field.splitn(2, |&b| b == b'=');
    let raw_key = it.next().unwrap_or_default();
    let Some(raw_value) = it.next() else {
        return Err(format!("xattr {} has no '='", show(field)));
    };
    let key = unescape(raw_key, "xattr name")?;
    let value = unescape(raw_value, "xattr value")?;
    if key.contains(&0) {
        return Err(format!("xattr name {} contains a NUL byte", show(&key)));
    }
    if key.is_empty() {
        return Err("empty xattr name".into());
    }
    if key.len() > MAX_XATTR_NAME_LEN {
        return Err(format!(
            "xattr name of {} bytes is longer than {MAX_XATTR_NAME_LEN}",
            key.len()
        ));
    }
    if value.len() > MAX_XATTR_VALUE_LEN {
        return Err(format!(
            "xattr {} value of {} bytes is longer than {MAX_XATTR_VALUE_LEN}",
            show(&key),
            value.len()
        ));
    }
    // Setting a name again replaces the value (and its share of the budget).
    if let Some(old) = xattrs.remove(&key) {
        budget.used = if xattrs.is_empty() {
            0
        } else {
            budget
                .used
                .saturating_sub(XATTR_ENTRY_OVERHEAD + key.len() + old.len())
        };
    }
    let mut entry = XATTR_ENTRY_OVERHEAD + key.len() + value.len();
    if xattrs.is_empty() {
        entry += XATTR_HEADER_SIZE;
    }
    let used = budget.used.saturating_add(entry);
    if used > MAX_XATTRS_SIZE {
        return Err(format!(
            "xattrs too large: adding {} brings them to {used} bytes, at most {MAX_XATTRS_SIZE}",
            show(&key)
        ));
    }
    budget.used = used;
    xattrs.insert(key, value);
    Ok(())
}

/// A backing-object path or symlink target: no NUL, shorter than PATH_MAX.
fn check_payload(p: &[u8], what: &str) -> Result<(), String> {
    if p.contains(&0) {
        return Err(format!("{what} {} contains a NUL byte", show(p)));
    }
    if p.len() > MAX_PATH_LEN {
        return Err(format!(
            "{what} of {} bytes is longer than {MAX_PATH_LEN}",
            p.len()
        ));
    }
    Ok(())
}

/// An unsigned integer as `strtoull` reads it: leading white space, an
/// optional sign (`-` negates modulo 2^64), then at least one digit and
/// nothing else. Unlike `strtoull`, overflow is an error, not `u64::MAX`.
fn parse_uint(field: &[u8], radix: u32, what: &str) -> Result<u64, String> {
    let bad = || format!("invalid {what} '{}'", show(field));
    let start = field
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r'))
        .unwrap_or(field.len());
    let s = field.get(start..).unwrap_or_default();
    let (negative, digits) = match s.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, s),
    };
    if digits.is_empty() {
        return Err(bad());
    }
    let mut value: u64 = 0;
    for &b in digits {
        let d = char::from(b).to_digit(radix).ok_or_else(bad)?;
        value = value
            .checked_mul(u64::from(radix))
            .and_then(|v| v.checked_add(u64::from(d)))
            .ok_or_else(|| format!("{what} {} is out of range", show(field)))?;
    }
    Ok(if negative {
        value.wrapping_neg()
    } else {
        value
    })
}

/// A 32-bit field; the reference would silently truncate larger values.
fn parse_u32(field: &[u8], radix: u32, what: &str) -> Result<u32, String> {
    let v = parse_uint(field, radix, what)?;
    u32::try_from(v).map_err(|_| format!("{what} {} is out of range", show(field)))
}

/// `SEC.NSEC`; SEC may be negative (it wraps through `u64` as in the
/// reference), NSEC must fit in 32 bits.
fn parse_mtime(field: &[u8]) -> Result<Mtime, String> {
    let mut it = field.splitn(2, |&b| b == b'.');
    let sec = it.next().unwrap_or_default();
    let nsec = it.next().unwrap_or_default();
    let sec = parse_uint(sec, 10, "MTIME seconds")?;
    let nsec = parse_u32(nsec, 10, "MTIME nanoseconds")?;
    Ok(Mtime {
        sec: sec as i64,
        nsec,
    })
}

fn parse_digest(hex: &[u8]) -> Result<[u8; DIGEST_LEN], String> {
    let bad = || {
        format!(
            "invalid DIGEST {}: expected {} hex digits",
            show(hex),
            DIGEST_LEN * 2
        )
    };
    if hex.len() != DIGEST_LEN * 2 {
        return Err(bad());
    }
    let mut raw = [0u8; DIGEST_LEN];
    for (byte, pair) in raw.iter_mut().zip(hex.chunks_exact(2)) {
        let [hi, lo] = pair else {
            return Err(bad());
        };
        *byte = (hex_value(*hi).ok_or_else(bad)? << 4) | hex_value(*lo).ok_or_else(bad)?;
    }
    Ok(raw)
}

fn hex_value(b: u8) -> Option<u8> {
    char::from(b)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

/// Undoes the dumpfile escapes `\\ \n \r \t \xHH`; any other backslash
/// sequence is an error.
fn unescape(s: &[u8], what: &str) -> Result<Vec<u8>, String> {
    if !s.contains(&b'\\') {
        return Ok(s.to_vec());
    }
    let mut out = Vec::with_capacity(s.len());
    let mut it = s.iter().copied();
    while let Some(c) = it.next() {
        if c != b'\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some(b'\\') => out.push(b'\\'),
            Some(b'n') => out.push(b'\n'),
            Some(b'r') => out.push(b'\r'),
            Some(b't') => out.push(b'\t'),
            Some(b'x') => {
                let (Some(hi), Some(lo)) = (it.next(), it.next()) else {
                    return Err(format!("{what}: \\x needs two hex digits"));
                };
                match (hex_value(hi), hex_value(lo)) {
                    (Some(hi), Some(lo)) => out.push((hi << 4) | lo),
                    _ => {
                        return Err(format!(
                            "{what}: invalid hex escape \\x{}",
                            [hi, lo].escape_ascii()
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(format!(
                    "{what}: unsupported escape \\{}",
                    [other].escape_ascii()
                ))
            }
            None => return Err(format!("{what}: backslash at the end")),
        }
    }
    Ok(out)
}

/// Like [`unescape`], but a lone `-` means "none".
fn unescape_optional(s: &[u8], what: &str) -> Result<Option<Vec<u8>>, String> {
    if s == b"-" {
        return Ok(None);
    }
    unescape(s, what).map(Some)
}
