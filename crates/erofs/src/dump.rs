//! The composefs dumpfile: a text form of a [`Tree`], one line per path.
//!
//! ```text
//! PATH SIZE MODE NLINK UID GID RDEV MTIME PAYLOAD CONTENT DIGEST [XATTR...]
//! /usr/bin/ls 142024 100755 1 0 0 0 1633950376.0 45/6d3b…28 - 6d3b…28 user.foo=bar
//! /usr/bin/ls-hardlink 142024 @100755 2 0 0 0 1633950376.0 /usr/bin/ls - -
//! ```
//!
//! This module owns reading that format ([`parse_dump`]) and writing it
//! ([`print_dump`]). It reads what the reference `mkcomposefs --from-file`
//! reads and rejects what it rejects (its strict mode is `CFS_PARSE_STRICT`),
//! with one difference in spirit: where the reference would silently truncate
//! a value (a uid above `u32::MAX`, a name cut at an escaped NUL) this parser
//! says so instead. It prints what `composefs-info dump` prints, so a tree
//! survives parse → print → parse unchanged.
//!
//! A dumpfile is untrusted input: every limit is checked, no arithmetic can
//! overflow, nothing indexes out of bounds, and every error names the line
//! and what was wrong with it. This module never touches the filesystem.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, BufWriter, Read, Write};

use crate::tree::{
    lossy, DirEntry, FileType, Inode, InodeData, InodeId, Mtime, RegularFile, Tree, MAX_DEPTH,
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
const MAX_XATTR_FIELD_LEN: usize = u16::MAX as usize;
/// Largest regular file stored outside the image: 1024 chunk indexes of
/// 2^43-byte chunks fit in the inode's one block.
const MAX_EXTERNAL_FILE_SIZE: u64 = 1024 << 43;
/// Length of a sha256 digest.
const DIGEST_LEN: usize = 32;

/// Reads a dumpfile into a tree, line by line.
///
/// Hardlink lines (`@` before MODE) may name targets that appear later; they
/// are resolved once the whole input is read. The inodes of the result are
/// numbered in the order [`print_dump`] prints them (root first, then
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

/// Writes `inode` at `path` as one line, newline included, in the layout
/// [`print_dump`] uses; with `hardlink`, a hardlink line naming that path
/// (only the type bits of `inode.mode` matter then). [`parse_line`] reads
/// it back.
pub fn format_entry_line(out: &mut Vec<u8>, path: &[u8], inode: &Inode, hardlink: Option<&[u8]>) {
    format_line(out, path, inode, hardlink);
}

/// The fuzzing oracle: parses `data` strictly and leniently and, whenever
/// that succeeds, checks that printing the tree and parsing it back strictly
/// gives the same tree.
///
/// # Panics
///
/// Only on a bug in this module: a parsed tree that does not print, or
/// prints to something that reads back differently (other than the xattr
/// limit [`print_dump`] documents).
pub fn fuzz_dump(data: &[u8]) {
    for strict in [true, false] {
        let Ok(tree) = parse_dump_bytes(data, &ParseOptions { strict }) else {
            continue;
        };
        let mut text = Vec::new();
        if let Err(e) = print_dump(&tree, &mut text) {
            panic!("a parsed tree failed to print: {e}");
        }
        match parse_dump_bytes(&text, &ParseOptions { strict: true }) {
            Ok(again) => assert!(again == tree, "parse → print → parse changed the tree"),
            Err(e) => {
                // The one documented exception: xattrs that escape to more
                // than a line may hold.
                let too_long = text
                    .split(|&b| b == b'\n')
                    .any(|l| Fields::split(l).xattrs.len() > MAX_XATTR_FIELD_LEN);
                assert!(too_long, "printed dump does not parse: {e}");
            }
        }
    }
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
struct Fields<'a> {
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
    xattrs: &'a [u8],
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
    fn split(line: &'a [u8]) -> Fields<'a> {
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

/// Renumbers the inodes in the order [`print_dump`] prints them (the root,
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

fn bad_tree(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed tree: {what}"),
    )
}

/// Visits the root (as `/`) and then every entry depth-first in name order,
/// calling `f(path, inode, is_hardlink)`. Iterative, so depth costs heap, not
/// stack; a directory reached twice is an error, so it always terminates.
fn walk(tree: &Tree, mut f: impl FnMut(&[u8], InodeId, bool) -> io::Result<()>) -> io::Result<()> {
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
struct Escape {
    /// `=`, which separates an xattr's name from its value.
    equal: bool,
    /// A field that is exactly `-`, which would read back as "none".
    lone_dash: bool,
}

/// Escapes as `composefs-info dump` does: `\\ \n \r \t`, and every byte that
/// is not a printable, non-space ASCII character as `\xHH`.
fn escape_into(out: &mut Vec<u8>, s: &[u8], how: Escape) {
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

#[cfg(test)]
mod tests {
    use std::io::Read as _;
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::tree::{S_IFCHR, S_IFDIR, S_IFLNK, S_IFREG};

    const STRICT: ParseOptions = ParseOptions { strict: true };
    const LENIENT: ParseOptions = ParseOptions { strict: false };

    /// Vectors the reference test suite parses in lenient mode.
    const LENIENT_VECTORS: &[&str] = &[
        "no-newline.dump",
        "longlink.dump",
        "honggfuzz-longlink-unterminated.dump",
    ];

    fn vectors_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/testdata/composefs")
    }

    fn read_vector(name: &str) -> Vec<u8> {
        let path = vectors_dir().join(name);
        let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if name.ends_with(".gz") {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&raw[..])
                .read_to_end(&mut out)
                .unwrap();
            out
        } else {
            raw
        }
    }

    /// Every dump vector, sorted, as (name, is_should_fail).
    fn vector_names() -> Vec<(String, bool)> {
        let mut names: Vec<(String, bool)> = std::fs::read_dir(vectors_dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".dump") || n.ends_with(".dump.gz"))
            .map(|n| {
                let bad = n.starts_with("should-fail-");
                (n, bad)
            })
            .collect();
        names.sort();
        names
    }

    fn good_vectors() -> Vec<String> {
        let good: Vec<String> = vector_names()
            .into_iter()
            .filter(|(_, bad)| !bad)
            .map(|(n, _)| n)
            .collect();
        assert!(good.len() >= 13, "too few vectors found: {good:?}");
        good
    }

    fn opts_for(name: &str) -> ParseOptions {
        if LENIENT_VECTORS.contains(&name) {
            LENIENT
        } else {
            STRICT
        }
    }

    fn parse(text: &str) -> Result<Tree, DumpError> {
        parse_dump(text.as_bytes(), &STRICT)
    }

    fn parse_ok(text: &str) -> Tree {
        parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    fn err(text: &str, opts: &ParseOptions) -> String {
        match parse_dump(text.as_bytes(), opts) {
            Ok(_) => panic!("parsed but should not:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    fn roundtrip(tree: &Tree) -> String {
        let text = tree_to_dump_string(tree).unwrap();
        let again = parse_dump(text.as_bytes(), &STRICT)
            .unwrap_or_else(|e| panic!("printed dump does not parse: {e}"));
        assert_eq!(&again, tree, "parse → print → parse changed the tree");
        let text2 = tree_to_dump_string(&again).unwrap();
        assert_eq!(text, text2, "printing is not stable");
        text
    }

    fn id(tree: &Tree, path: &str) -> InodeId {
        tree.lookup(path.as_bytes())
            .unwrap_or_else(|| panic!("{path} missing"))
    }

    fn regular<'a>(tree: &'a Tree, path: &str) -> &'a RegularFile {
        match &tree.inode(id(tree, path)).data {
            InodeData::Regular(r) => r,
            other => panic!("{path} is not a regular file: {other:?}"),
        }
    }

    const ROOT_LINE: &str = "/ 4096 40755 2 0 0 0 0.0 - - -\n";

    fn with_root(lines: &str) -> String {
        format!("{ROOT_LINE}{lines}")
    }

    #[test]
    fn every_good_vector_parses_and_roundtrips() {
        for name in good_vectors() {
            let data = read_vector(&name);
            let tree =
                parse_dump(&data[..], &opts_for(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(tree.root().is_dir(), "{name}");
            roundtrip(&tree);
            // Strict and lenient agree wherever strict accepts.
            if !LENIENT_VECTORS.contains(&name.as_str()) {
                assert_eq!(parse_dump(&data[..], &LENIENT).unwrap(), tree, "{name}");
            }
        }
    }

    #[test]
    fn every_path_line_becomes_one_entry() {
        // Each line but the root is exactly one directory entry.
        for name in good_vectors() {
            let data = read_vector(&name);
            let lines = data
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .count();
            let tree = parse_dump(&data[..], &opts_for(&name)).unwrap();
            let entries: usize = tree
                .inodes
                .iter()
                .filter_map(Inode::entries)
                .map(|e| e.len())
                .sum();
            assert_eq!(entries + 1, lines, "{name}");
            let hardlinks = data.windows(2).filter(|w| w == b" @").count();
            assert_eq!(tree.inodes.len() + hardlinks, lines, "{name}");
        }
    }

    #[test]
    fn lenient_vectors_fail_strict() {
        let table: &[(&str, usize, &str)] = &[
            (
                "no-newline.dump",
                1,
                "RDEV 10 on a file that is not a device",
            ),
            (
                "longlink.dump",
                2,
                "symlink SIZE 5 is not the length of its target (4070)",
            ),
            (
                "honggfuzz-longlink-unterminated.dump",
                2,
                "symlink SIZE 0 is not the length of its target (4095)",
            ),
        ];
        assert_eq!(table.len(), LENIENT_VECTORS.len());
        for &(name, line, msg) in table {
            let e = parse_dump(&read_vector(name)[..], &STRICT).unwrap_err();
            assert_eq!(e.line(), line, "{name}: {e}");
            assert!(e.to_string().contains(msg), "{name}: {e}");
        }
    }

    #[test]
    fn every_should_fail_vector_fails_strict() {
        // (file, line, message in strict mode, message in lenient mode when
        // the strict one is about strictness)
        let table: &[(&str, usize, &str, Option<&str>)] = &[
            (
                "should-fail-big-inline.dump",
                2,
                "missing newline at the end of the file",
                Some("inline CONTENT of 5004 bytes is larger than 5000"),
            ),
            (
                "should-fail-dir-hardlink.dump",
                2,
                "/rootlink: directories cannot be hardlinked",
                None,
            ),
            (
                "should-fail-dot-name.dump",
                2,
                "'.' and '..' are not valid names",
                None,
            ),
            (
                "should-fail-dotdot-name.dump",
                2,
                "'.' and '..' are not valid names",
                None,
            ),
            (
                "should-fail-empty-link-name.dump",
                2,
                "symlink without a target",
                None,
            ),
            (
                "should-fail-empty-name.dump",
                2,
                "//: empty file name",
                None,
            ),
            (
                "should-fail-empty-xattr-key.dump",
                2,
                "empty xattr name",
                None,
            ),
            (
                "should-fail-honggfuzz-long-xattr.dump",
                1,
                "missing newline at the end of the file",
                Some("xattrs too large"),
            ),
            (
                "should-fail-long-link.dump",
                2,
                "symlink target of 7248 bytes is longer than 4095",
                None,
            ),
            (
                "should-fail-long-xattr-key.dump",
                2,
                "too many xattrs: 123219 bytes of xattrs, at most 65535",
                None,
            ),
            (
                "should-fail-long-xattr-value.dump",
                2,
                // Its MODE (644) has no file type; the reference stops there too.
                "invalid MODE 644: no known file type",
                None,
            ),
            (
                "should-fail-no-ftype.dump",
                2,
                "invalid MODE 0: no known file type",
                None,
            ),
            (
                "should-fail-self-hardlink.dump",
                2,
                "missing newline at the end of the file",
                Some("hardlink /037blockdev points at itself"),
            ),
            (
                "should-fail-too-big.dump",
                2,
                "file of 9500000000000000 bytes is larger than the 9007199254740992 bytes",
                None,
            ),
        ];
        let on_disk: Vec<String> = vector_names()
            .into_iter()
            .filter(|(_, bad)| *bad)
            .map(|(n, _)| n)
            .collect();
        let in_table: Vec<String> = table.iter().map(|r| r.0.to_string()).collect();
        assert_eq!(on_disk, in_table, "every should-fail vector needs a row");

        for &(name, line, strict_msg, lenient_msg) in table {
            let data = read_vector(name);
            let e = parse_dump(&data[..], &STRICT).unwrap_err();
            assert_eq!(e.line(), line, "{name}: {e}");
            assert!(e.to_string().contains(strict_msg), "{name}: {e}");
            let e = parse_dump(&data[..], &LENIENT).unwrap_err();
            assert_eq!(e.line(), line, "{name} (lenient): {e}");
            let msg = lenient_msg.unwrap_or(strict_msg);
            assert!(e.to_string().contains(msg), "{name} (lenient): {e}");
        }
    }

    #[test]
    fn special_vector_contents() {
        let tree = parse_dump(&read_vector("special.dump")[..], &STRICT).unwrap();
        let root = tree.root();
        assert_eq!(root.mode, S_IFDIR | 0o555);
        assert_eq!(
            root.mtime,
            Mtime {
                sec: 1633950376,
                nsec: 0
            }
        );
        assert_eq!(root.xattrs.get(&b"trusted.foo1"[..]).unwrap(), b"bar-1");

        let blk = tree.inode(id(&tree, "/blockdev"));
        assert_eq!(blk.file_type(), FileType::BlockDevice);
        assert_eq!(blk.rdev, 107690);
        assert!(tree.inode(id(&tree, "/whiteout")).is_whiteout());
        assert!(!tree.inode(id(&tree, "/chardev")).is_whiteout());

        let esc = tree.inode(id(&tree, "/escaped-xattr"));
        assert_eq!(
            esc.xattrs.get(&b"trusted.overlay.redirect"[..]).unwrap(),
            b"/foo\n"
        );
        let inline = regular(&tree, "/inline");
        assert_eq!(inline.content.as_deref(), Some(&b"FOOBAR\nINAFILE\n"[..]));
        assert_eq!(inline.payload, None);
        for (name, len) in [
            ("/inline-large1", 4095),
            ("/inline-large2", 4096),
            ("/inline-large3", 4097),
        ] {
            let r = regular(&tree, name);
            assert_eq!(r.content.as_ref().map(Vec::len), Some(len), "{name}");
            assert_eq!(tree.inode(id(&tree, name)).size, len as u64, "{name}");
        }
    }

    #[test]
    fn hardlink_vector_shares_one_inode() {
        let tree = parse_dump(&read_vector("config-with-hard-link.dump.gz")[..], &STRICT).unwrap();
        let ls = id(&tree, "/usr/bin/ls");
        assert_eq!(id(&tree, "/usr/bin/ls-hardlink"), ls);
        let bin = tree.inode(id(&tree, "/usr/bin")).entries().unwrap();
        assert!(!bin[&b"ls"[..]].hardlink);
        assert!(bin[&b"ls-hardlink"[..]].hardlink);
        // The target keeps the nlink it declared.
        assert_eq!(tree.inode(ls).nlink, 2);
        let r = regular(&tree, "/usr/bin/ls");
        assert_eq!(
            r.payload.as_deref(),
            Some(&b"45/6d3b24fc32f6867e5ef79e6b428576cb14f22e0627e66945efcb3becc98a28"[..])
        );
        let text = roundtrip(&tree);
        assert!(text.contains(
            "\n/usr/bin/ls-hardlink 142024 @100145 2 0 0 0 1633950376.0 /usr/bin/ls - - "
        ));
    }

    #[test]
    fn symlinks_take_their_size_from_the_target() {
        let tree = parse_dump(&read_vector("longlink.dump")[..], &LENIENT).unwrap();
        let link = tree.inode(id(&tree, "/max-link"));
        assert_eq!(link.size, 4095);
        assert!(matches!(&link.data, InodeData::Symlink(t) if t.len() == 4095));

        let tree = parse_ok(&with_root("/l 1 120777 1 0 0 0 0.0 x - -\n"));
        assert_eq!(
            tree.inode(id(&tree, "/l")).data,
            InodeData::Symlink(b"x".to_vec())
        );
        // Lenient: any SIZE, and CONTENT of that size is ignored.
        let tree = parse_dump(
            with_root("/l 3 120777 1 0 0 0 0.0 x abc -\n").as_bytes(),
            &LENIENT,
        )
        .unwrap();
        assert_eq!(tree.inode(id(&tree, "/l")).size, 1);
        assert!(
            err(&with_root("/l 3 120777 1 0 0 0 0.0 x abc -\n"), &STRICT)
                .contains("symlink SIZE 3 is not the length of its target (1)")
        );
        assert!(err(&with_root("/l 1 120777 1 0 0 0 0.0 x y -\n"), &STRICT)
            .contains("a symlink cannot have CONTENT"));
    }

    #[test]
    fn hand_written_hardlinks() {
        // Forward reference, a chain through another hardlink, a hardlink
        // to a symlink; printed with the primary path.
        let text = with_root(
            "/a 0 @100644 0 0 0 0 0.0 /d/f - -\n\
             /b 0 @100644 0 0 0 0 0.0 /a - -\n\
             /d 4096 40755 2 0 0 0 0.0 - - -\n\
             /d/f 3 100644 3 7 8 0 5.6 - abc - user.x=1\n\
             /d/s 1 120777 1 0 0 0 0.0 t - -\n\
             /z 0 @120777 0 0 0 0 0.0 //d//s/ - -\n",
        );
        let tree = parse_ok(&text);
        let f = id(&tree, "/d/f");
        assert_eq!(id(&tree, "/a"), f);
        assert_eq!(id(&tree, "/b"), f);
        assert_eq!(id(&tree, "/z"), id(&tree, "/d/s"));
        assert_eq!(tree.inode(f).nlink, 3);
        assert_eq!(tree.inodes.len(), 4, "placeholders are gone");
        let root = tree.root().entries().unwrap();
        assert!(root[&b"a"[..]].hardlink && root[&b"b"[..]].hardlink && root[&b"z"[..]].hardlink);
        assert!(!root[&b"d"[..]].hardlink);
        let printed = roundtrip(&tree);
        assert_eq!(
            printed,
            "/ 4096 40755 2 0 0 0 0.0 - - -\n\
             /a 3 @100644 3 7 8 0 5.6 /d/f abc - user.x=1\n\
             /b 3 @100644 3 7 8 0 5.6 /d/f abc - user.x=1\n\
             /d 4096 40755 2 0 0 0 0.0 - - -\n\
             /d/f 3 100644 3 7 8 0 5.6 - abc - user.x=1\n\
             /d/s 1 120777 1 0 0 0 0.0 t - -\n\
             /z 1 @120777 1 0 0 0 0.0 /d/s - -\n"
        );
    }

    #[test]
    fn bad_input_table() {
        // (input, message); the offending line is always the last one.
        let table: &[(&str, &str)] = &[
            ("", "line 1: no root directory: the dumpfile is empty"),
            ("\n", "empty PATH"),
            (
                "/a 0 100644 1 0 0 0 0.0 - - -\n",
                "/a: the first line must be the root directory /",
            ),
            (
                "/ 0 100644 1 0 0 0 0.0 - - -\n",
                "the root / must be a directory",
            ),
            (
                "/ 0 @40755 1 0 0 0 0.0 - - -\n",
                "/: directories cannot be hardlinked",
            ),
            (
                &with_root("/ 4096 40755 2 0 0 0 0.0 - - -\n"),
                "the root / appears twice",
            ),
            (&with_root("\n"), "empty PATH"),
            (
                &with_root("/a\0 0 100644 1 0 0 0 0.0 - - -\n"),
                "NUL byte at offset 2",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - -\n/a 0 100644 1 0 0 0 0.0 - - -\n"),
                "/a already exists",
            ),
            (
                &with_root("/x/a 0 100644 1 0 0 0 0.0 - - -\n"),
                "/x/a: parent directory does not exist",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - -\n/a/b 0 100644 1 0 0 0 0.0 - - -\n"),
                "/a/b: parent is not a directory",
            ),
            (
                &with_root("/a/ 0 100644 1 0 0 0 0.0 - - -\n"),
                "/a/: parent directory does not exist",
            ),
            (
                &with_root("/d 0 40755 1 0 0 0 0.0 - - -\n/d/ 0 100644 1 0 0 0 0.0 - - -\n"),
                "/d/: empty file name",
            ),
            (
                &with_root(&format!(
                    "/{} 0 100644 1 0 0 0 0.0 - - -\n",
                    "n".repeat(256)
                )),
                "name of 256 bytes is longer than 255",
            ),
            (
                &with_root("/a\\x00b 0 100644 1 0 0 0 0.0 - - -\n"),
                "PATH /a\\x00b contains a NUL byte",
            ),
            // Integers.
            (
                &with_root("/a  100644 1 0 0 0 0.0 - - -\n"),
                "invalid SIZE ''",
            ),
            (
                &with_root("/a 1x 100644 1 0 0 0 0.0 - - -\n"),
                "invalid SIZE '1x'",
            ),
            (
                &with_root("/a 0 100648 1 0 0 0 0.0 - - -\n"),
                "invalid MODE '100648'",
            ),
            (
                &with_root("/a 0 170644 1 0 0 0 0.0 - - -\n"),
                "invalid MODE 170644: no known file type",
            ),
            (
                &with_root("/a 0 100644 1 0 4294967296 0 0.0 - - -\n"),
                "GID 4294967296 is out of range",
            ),
            (
                &with_root("/a 0 100644 1 -1 0 0 0.0 - - -\n"),
                "UID -1 is out of range",
            ),
            (
                &with_root("/a 0 100644 1 0 0 x 0.0 - - -\n"),
                "invalid RDEV 'x'",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 99999999999999999999.0 - - -\n"),
                "MTIME seconds 99999999999999999999 is out of range",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 5 - - -\n"),
                "invalid MTIME nanoseconds ''",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 5.1.2 - - -\n"),
                "invalid MTIME nanoseconds '1.2'",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.4294967296 - - -\n"),
                "MTIME nanoseconds 4294967296 is out of range",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0\n"),
                "invalid MTIME seconds ''",
            ),
            // Escapes.
            (
                &with_root("/a\\q 0 100644 1 0 0 0 0.0 - - -\n"),
                "PATH: unsupported escape \\q",
            ),
            (
                &with_root("/a\\ 0 100644 1 0 0 0 0.0 - - -\n"),
                "PATH: backslash at the end",
            ),
            (
                &with_root("/a\\x4 0 100644 1 0 0 0 0.0 - - -\n"),
                "PATH: \\x needs two hex digits",
            ),
            (
                &with_root("/a\\xg0 0 100644 1 0 0 0 0.0 - - -\n"),
                "PATH: invalid hex escape \\xg0",
            ),
            // Regular files.
            (
                &with_root("/a 4 100644 1 0 0 0 0.0 - abc -\n"),
                "CONTENT has 3 bytes but SIZE is 4",
            ),
            (
                &with_root("/a 4 100644 1 0 0 0 0.0 - \\x -\n"),
                "CONTENT: \\x needs two hex digits",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - abc\n"),
                "invalid DIGEST abc: expected 64 hex digits",
            ),
            (
                &with_root(&format!(
                    "/a 0 100644 1 0 0 0 0.0 - - {}g\n",
                    "0".repeat(63)
                )),
                "invalid DIGEST",
            ),
            (
                &with_root(&format!(
                    "/a 0 100644 1 0 0 0 0.0 {} - -\n",
                    "p".repeat(4096)
                )),
                "PAYLOAD of 4096 bytes is longer than 4095",
            ),
            (
                &with_root("/a 9007199254740993 100644 1 0 0 0 0.0 - - -\n"),
                "file of 9007199254740993 bytes is larger",
            ),
            // Symlinks.
            (
                &with_root("/l 0 120777 1 0 0 0 0.0 - - -\n"),
                "symlink without a target (PAYLOAD is -)",
            ),
            (
                &with_root("/l 0 120777 1 0 0 0 0.0  - -\n"),
                "symlink with an empty target",
            ),
            (
                &with_root("/l 1 120777 1 0 0 0 0.0 \\x00 - -\n"),
                "symlink target \\x00 contains a NUL byte",
            ),
            // Xattrs.
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a\n"),
                "xattr user.a has no '='",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a=1  user.b=2\n"),
                "xattr  has no '='",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - - =v\n"),
                "empty xattr name",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.\\x00=v\n"),
                "contains a NUL byte",
            ),
            (
                &with_root(&format!(
                    "/a 0 100644 1 0 0 0 0.0 - - - {}=v\n",
                    "k".repeat(256)
                )),
                "xattr name of 256 bytes is longer than 255",
            ),
            (
                &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a=\\z\n"),
                "xattr value: unsupported escape \\z",
            ),
            // Hardlinks.
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 - - -\n"),
                "hardlink without a target (PAYLOAD is -)",
            ),
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 /nope - -\n"),
                "hardlink target /nope does not exist",
            ),
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 /a - -\n"),
                "hardlink /a points at itself",
            ),
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 / - -\n"),
                "hardlink target / is a directory",
            ),
            (
                &with_root("/d 0 40755 0 0 0 0 0.0 - - -\n/a 0 @100644 0 0 0 0 0.0 /d - -\n"),
                "hardlink target /d is a directory",
            ),
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 /b - -\n/b 0 @100644 0 0 0 0 0.0 /a - -\n"),
                "hardlink cycle",
            ),
            (
                &with_root("/a 0 @40755 0 0 0 0 0.0 /b - -\n"),
                "/a: directories cannot be hardlinked",
            ),
            (&with_root("/a 0 @0 0 0 0 0 0.0 /b - -\n"), "invalid MODE 0"),
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 /b - -\n/a/x 0 100644 0 0 0 0 0.0 - - -\n"),
                "/a/x: parent is not a directory",
            ),
            (
                &with_root("/a 0 @100644 0 0 0 0 0.0 /b - -\n/a/x/y 0 100644 0 0 0 0 0.0 - - -\n"),
                "/a/x/y: parent directory does not exist",
            ),
        ];
        for (input, msg) in table {
            let e = match parse_dump(input.as_bytes(), &LENIENT) {
                Ok(_) => panic!("parsed but should not:\n{input}"),
                Err(e) => e,
            };
            let last = input.matches('\n').count().max(1);
            let cycle = msg.contains("cycle");
            assert!(
                e.line() == last || cycle && e.line() >= 2,
                "{input:?}: error on line {}, expected {last}: {e}",
                e.line()
            );
            assert!(
                e.to_string().contains(msg),
                "{input:?}: got {e}, expected {msg}"
            );
            // Strict mode rejects everything lenient mode does.
            assert!(parse_dump(input.as_bytes(), &STRICT).is_err(), "{input:?}");
        }
    }

    #[test]
    fn strict_only_rejections() {
        let table: &[(&str, &str)] = &[
            (
                "/f 0 10644 1 0 0 5 0.0 - - -\n",
                "line 2: RDEV 5 on a file that is not a device",
            ),
            (
                "/d 0 40755 1 0 0 1 0.0 - - -\n",
                "line 2: RDEV 1 on a file that is not a device",
            ),
            (
                "/l 2 120777 1 0 0 0 0.0 t - -\n",
                "line 2: symlink SIZE 2 is not the length of its target (1)",
            ),
            (
                "/l 1 120777 1 0 0 0 0.0 t x -\n",
                "line 2: a symlink cannot have CONTENT",
            ),
            (
                "/a 0 100644 1 0 0 0 0.0 - - -",
                "line 2: missing newline at the end of the file",
            ),
        ];
        for (lines, msg) in table {
            let text = with_root(lines);
            assert_eq!(err(&text, &STRICT), *msg, "{text:?}");
            let tree = parse_dump(text.as_bytes(), &LENIENT).unwrap();
            // What lenient mode keeps is canonical: no RDEV on non-devices,
            // symlink SIZE from the target.
            let inode = &tree.inodes[1];
            assert_eq!(inode.rdev, 0);
            if let InodeData::Symlink(t) = &inode.data {
                assert_eq!(inode.size, t.len() as u64);
            }
            roundtrip(&tree);
        }
    }

    #[test]
    fn accepted_oddities() {
        // What the reference reads that may be surprising.
        let tree = parse_ok(&with_root(
            "a 4096 40755 2 0 0 0 0.0 - - -\n\
             a//b 4096 40755 2 0 0 0 0.0 - - -\n\
             /a/b/c +5 0100644 1 \t7 0 0 -1.5 - hello -\n\
             a/b/d 0 10644 1 0 0 0 0.0 payload - -\n\
             ///a///b///e 0 100644 1 0 0 0 0.0  - -\n",
        ));
        let c = tree.inode(id(&tree, "/a/b/c"));
        assert_eq!(c.size, 5);
        assert_eq!(c.uid, 7);
        assert_eq!(c.mtime, Mtime { sec: -1, nsec: 5 });
        // PAYLOAD on a fifo is accepted and dropped.
        assert_eq!(tree.inode(id(&tree, "/a/b/d")).data, InodeData::Special);
        // An empty PAYLOAD is not "-".
        assert_eq!(regular(&tree, "/a/b/e").payload.as_deref(), Some(&b""[..]));
        roundtrip(&tree);

        // An empty DIGEST is none; a bad one on a non-regular file is ignored.
        let tree = parse_ok(&with_root(
            "/a 0 100644 1 0 0 0 0.0 - - \n/l 1 120777 1 0 0 0 0.0 t - xyz\n",
        ));
        assert_eq!(regular(&tree, "/a").digest, None);
        let digest = format!("{}{}", "AB".repeat(16), "cd".repeat(16));
        let tree = parse_ok(&with_root(&format!(
            "/a 0 100644 1 0 0 0 0.0 - - {digest}\n"
        )));
        let mut want = [0xab; 32];
        want[16..].fill(0xcd);
        assert_eq!(regular(&tree, "/a").digest, Some(want));

        // Empty CONTENT is no content.
        let tree = parse_ok(&with_root("/a 0 100644 1 0 0 0 0.0 -  -\n"));
        assert_eq!(regular(&tree, "/a").content, None);
        // Hardlink lines ignore every field but PATH, MODE and PAYLOAD.
        let tree = parse_ok(&with_root(
            "/f 0 100644 1 0 0 0 0.0 - - -\n/h junk @100644 junk junk junk junk junk /f junk junk =\n",
        ));
        assert_eq!(id(&tree, "/h"), id(&tree, "/f"));
        // A trailing space after the fixed fields is not an empty xattr.
        parse_ok("/ 4096 40755 2 0 0 0 0.0 - - - \n");
        parse_ok("/ 4096 40755 2 0 0 0 0.0 - - - user.a=b \n");
    }

    #[test]
    fn newline_handling() {
        let text = "/ 4096 40755 2 0 0 0 0.0 - - -\n/a 0 100644 1 0 0 0 0.0 - - -";
        let e = parse_dump(text.as_bytes(), &STRICT).unwrap_err();
        assert_eq!(e.line(), 2);
        assert!(e.to_string().contains("missing newline"));
        let tree = parse_dump(text.as_bytes(), &LENIENT).unwrap();
        assert_eq!(tree.inodes.len(), 2);
        // An empty line is an empty path, even at the end.
        assert!(err(&format!("{text}\n\n"), &LENIENT).contains("line 3: empty PATH"));
    }

    #[test]
    fn escapes_roundtrip() {
        let text = with_root(
            "/sp\\x20ace\\x3d\\\\\\t\\xff 5 100644 1 0 0 0 0.0 \\x2d \\x00\\r\\n=\\x2d - \
             user.k\\x3d\\x20=v\\x3d\\n\\x00 user.dash=\\x2d\n\
             /dash 1 100644 1 0 0 0 0.0 - \\x2d -\n",
        );
        let tree = parse_ok(&text);
        let name = b"sp ace=\\\t\xff";
        let root = tree.root().entries().unwrap();
        let f = root[&name[..]].inode;
        let InodeData::Regular(r) = &tree.inode(f).data else {
            panic!("not regular");
        };
        assert_eq!(r.payload.as_deref(), Some(&b"-"[..]));
        assert_eq!(r.content.as_deref(), Some(&b"\0\r\n=-"[..]));
        let x = &tree.inode(f).xattrs;
        assert_eq!(x[&b"user.k= "[..]], b"v=\n\0");
        assert_eq!(x[&b"user.dash"[..]], b"-");
        assert_eq!(regular(&tree, "/dash").content.as_deref(), Some(&b"-"[..]));

        let printed = roundtrip(&tree);
        assert_eq!(
            printed,
            "/ 4096 40755 2 0 0 0 0.0 - - -\n\
             /dash 1 100644 1 0 0 0 0.0 - \\x2d -\n\
             /sp\\x20ace=\\\\\\t\\xff 5 100644 1 0 0 0 0.0 \\x2d \\x00\\r\\n=- - \
             user.dash=- user.k\\x3d\\x20=v\\x3d\\n\\x00\n"
        );
    }

    #[test]
    fn xattr_replacement_and_budget() {
        // Setting a name twice keeps the last value.
        let tree = parse_ok(&with_root(
            "/a 0 100644 1 0 0 0 0.0 - - - user.a=1 user.b=2 user.a=3\n",
        ));
        let x = &tree.inode(id(&tree, "/a")).xattrs;
        assert_eq!(x.len(), 2);
        assert_eq!(x[&b"user.a"[..]], b"3");

        // One xattr costs 12 + 7 + name + value; the budget is 32767.
        let fits = 32767 - 12 - 7 - "user.v".len();
        let line = |n: usize| {
            with_root(&format!(
                "/a 0 100644 1 0 0 0 0.0 - - - user.v={}\n",
                "v".repeat(n)
            ))
        };
        parse_ok(&line(fits));
        assert!(err(&line(fits + 1), &STRICT).contains("xattrs too large"));

        // Replacing the only xattr frees its share, header included...
        let twice = |n: usize| {
            with_root(&format!(
                "/a 0 100644 1 0 0 0 0.0 - - - user.v={} user.v={}\n",
                "v".repeat(n),
                "v".repeat(n)
            ))
        };
        parse_ok(&twice(fits));
        // ...but with another xattr present the header stays counted, as in
        // the reference.
        let second = fits - 7 - "user.w".len() - 1;
        let text = with_root(&format!(
            "/a 0 100644 1 0 0 0 0.0 - - - user.w=x user.v={} user.v={}\n",
            "v".repeat(second),
            "v".repeat(second)
        ));
        parse_ok(&text);
        let text = with_root(&format!(
            "/a 0 100644 1 0 0 0 0.0 - - - user.w=x user.v={}\n",
            "v".repeat(second + 1)
        ));
        assert!(err(&text, &STRICT).contains("xattrs too large"));
    }

    #[test]
    fn limits() {
        // Largest inline content and payload are fine.
        let content = "c".repeat(MAX_INLINE_CONTENT);
        parse_ok(&with_root(&format!(
            "/a 5000 100644 1 0 0 0 0.0 - {content} -\n"
        )));
        let payload = "p".repeat(MAX_PATH_LEN);
        parse_ok(&with_root(&format!(
            "/a 0 100644 1 0 0 0 0.0 {payload} - -\n"
        )));
        parse_ok(&with_root(&format!(
            "/l 4095 120777 1 0 0 0 0.0 {payload} - -\n"
        )));
        // The largest external file.
        parse_ok(&with_root("/a 9007199254740992 100644 1 0 0 0 0.0 - - -\n"));

        // Nesting up to MAX_DEPTH components.
        let mut text = String::from(ROOT_LINE);
        let mut path = String::new();
        for _ in 0..MAX_DEPTH {
            path.push_str("/d");
            text.push_str(&format!("{path} 0 40755 2 0 0 0 0.0 - - -\n"));
        }
        let tree = parse_ok(&text);
        roundtrip(&tree);
        text.push_str(&format!("{path}/d 0 40755 2 0 0 0 0.0 - - -\n"));
        assert!(err(&text, &STRICT).contains(&format!("nested deeper than {MAX_DEPTH}")));

        // Overlong lines are refused before they are buffered whole.
        let mut long = String::from(ROOT_LINE);
        long.push_str(&"x".repeat(MAX_LINE_LEN + 10));
        let e = parse_dump(long.as_bytes(), &LENIENT).unwrap_err();
        assert_eq!(e.line(), 2);
        assert!(e.to_string().contains("longer than"), "{e}");
    }

    #[test]
    fn io_errors_name_the_line() {
        struct Failing(usize);
        impl io::Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let data = ROOT_LINE.as_bytes();
                if self.0 >= data.len() {
                    return Err(io::Error::other("disk on fire"));
                }
                let n = (data.len() - self.0).min(buf.len());
                buf[..n].copy_from_slice(&data[self.0..self.0 + n]);
                self.0 += n;
                Ok(n)
            }
        }
        let e = parse_dump(io::BufReader::new(Failing(0)), &STRICT).unwrap_err();
        assert!(matches!(e, DumpError::Io { line: 2, .. }), "{e}");
        assert!(e.to_string().contains("disk on fire"));
    }

    #[test]
    fn printer_rejects_malformed_trees() {
        let mut root = Inode::new(S_IFDIR | 0o755).unwrap();
        let InodeData::Directory(e) = &mut root.data else {
            unreachable!()
        };
        e.insert(
            b"x".to_vec(),
            DirEntry {
                inode: 7,
                hardlink: false,
            },
        );
        let tree = Tree { inodes: vec![root] };
        let e = tree_to_dump_string(&tree).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);

        // A directory containing itself.
        let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
        let d = tree.push(Inode::new(S_IFDIR | 0o755).unwrap());
        tree.add_child(ROOT, b"d", d, false).unwrap();
        if let InodeData::Directory(e) = &mut tree.inode_mut(d).data {
            e.insert(
                b"loop".to_vec(),
                DirEntry {
                    inode: d,
                    hardlink: false,
                },
            );
        }
        assert!(tree_to_dump_string(&tree)
            .unwrap_err()
            .to_string()
            .contains("reached twice"));

        // A hardlink to an inode that has no primary entry.
        let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
        let f = tree.push(Inode::new(S_IFREG | 0o644).unwrap());
        tree.add_child(ROOT, b"h", f, true).unwrap();
        assert!(tree_to_dump_string(&tree)
            .unwrap_err()
            .to_string()
            .contains("primary"));
    }

    #[test]
    fn built_trees_roundtrip() {
        // A tree made in code (not parsed) prints to what parses back to it.
        let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
        let mut f = Inode::new(S_IFREG | 0o600).unwrap();
        f.size = 1 << 40;
        f.nlink = 2;
        f.uid = u32::MAX;
        f.mtime = Mtime {
            sec: i64::MIN,
            nsec: 999_999_999,
        };
        f.data = InodeData::Regular(RegularFile {
            content: None,
            payload: Some(b"ab/cdef".to_vec()),
            digest: Some([0xab; 32]),
        });
        f.xattrs.insert(
            b"security.selinux".to_vec(),
            b"system_u:object_r:bin_t:s0\0".to_vec(),
        );
        let f = tree.push(f);
        tree.add_child(ROOT, b"big", f, false).unwrap();
        tree.add_child(ROOT, b"another name", f, true).unwrap();
        let mut dev = Inode::new(S_IFCHR | 0o666).unwrap();
        dev.rdev = u64::MAX;
        let dev = tree.push(dev);
        tree.add_child(ROOT, b"dev", dev, false).unwrap();
        let mut l = Inode::new(S_IFLNK | 0o777).unwrap();
        l.data = InodeData::Symlink(b"-".to_vec());
        l.size = 1;
        let l = tree.push(l);
        tree.add_child(ROOT, b"l", l, false).unwrap();
        let text = roundtrip(&tree);
        assert!(text.contains(&format!(
            "/another\\x20name {} @100600 2 4294967295 0 0 -9223372036854775808.999999999 /big - {}",
            1u64 << 40,
            "ab".repeat(32)
        )));
        assert!(text.contains("/l 1 120777 1 0 0 0 0.0 \\x2d - -\n"));
    }

    /// `cargo test --release -p cairn-erofs dump::tests::speed -- --ignored --nocapture`
    #[test]
    #[ignore = "timing; run in release"]
    fn speed() {
        let data = read_vector("cs9-x86_64-minimal.dump.gz");
        // Five copies of the tree under different top-level names: ~110k lines.
        let mut big = Vec::from(ROOT_LINE);
        for copy in 0..5 {
            for line in data
                .split(|&b| b == b'\n')
                .skip(1)
                .filter(|l| !l.is_empty())
            {
                big.extend_from_slice(format!("/c{copy}").as_bytes());
                big.extend_from_slice(line);
                big.push(b'\n');
            }
            big.extend_from_slice(format!("/c{copy} 4096 40755 2 0 0 0 0.0 - - -\n").as_bytes());
        }
        // Directories must precede their children: sort by path bytes puts
        // "/c0" before "/c0/...".
        let mut lines: Vec<&[u8]> = big
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        lines.sort_by_key(|l| l.split(|&b| b == b' ').next().map(<[u8]>::to_vec));
        let big: Vec<u8> = lines.join(&b'\n').into_iter().chain([b'\n']).collect();
        let start = std::time::Instant::now();
        let tree = parse_dump(&big[..], &STRICT).unwrap();
        let parsed = start.elapsed();
        let start = std::time::Instant::now();
        let text = tree_to_dump_string(&tree).unwrap();
        let printed = start.elapsed();
        eprintln!(
            "{} lines, {} inodes: parse {parsed:?}, print {printed:?} ({} bytes)",
            lines.len(),
            tree.inodes.len(),
            text.len()
        );
    }

    /// Cheap deterministic fuzzing over the vectors: truncations and byte
    /// mutations must give an error or a tree that round-trips, never a
    /// panic.
    #[test]
    fn mutated_vectors_never_panic() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rand = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let interesting = b" \n\\@-=/.0x9\0";
        for (name, _) in vector_names() {
            let data = read_vector(&name);
            if data.len() > 200_000 {
                continue;
            }
            fuzz_dump(&data);
            for i in 0..40 {
                let cut = (rand() as usize) % (data.len() + 1);
                fuzz_dump(&data[..cut]);
                let mut m = data.clone();
                for _ in 0..=(i % 4) {
                    if m.is_empty() {
                        break;
                    }
                    let pos = (rand() as usize) % m.len();
                    let r = rand() as usize;
                    m[pos] = if r.is_multiple_of(2) {
                        interesting[r / 2 % interesting.len()]
                    } else {
                        (r >> 8) as u8
                    };
                }
                fuzz_dump(&m);
            }
        }
    }
}
