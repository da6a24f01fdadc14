//! Layer import: one layer blob (as fetched) → objects in the store and a
//! layer record under `layers/<diff_id>`.
//!
//! The blob streams through the reader stack of `decompress` into the tar
//! parser of `tar`; each entry goes into a [`Tree`] of the layer as it
//! comes (metadata only), each regular file's content into a staged object.
//! Only when the stream has ended, and its blob digest and diff_id match
//! what the caller expects, are the objects published and then the record;
//! an error at any point drops everything staged, so the store is as it was.
//!
//! # What an entry means (OCI image-spec `layer.md`, as containerd does it)
//!
//! - Paths are cleaned lexically: `./`, `//` and `a/../` go away; a leading
//!   `/` means the image root (containerd joins every path to the root the
//!   same way). A path that climbs above the root with `..` is an error,
//!   not clamped: no legitimate layer has one.
//! - `./` (or `/`) is the root directory itself and sets its metadata.
//! - A missing parent directory is created *implicitly*: 0755 root:root if
//!   no layer below has it, and an existing one is left as it is.
//! - A parent that is a symlink (in this layer) is an error: cairn never
//!   writes through a symlink, so no entry can land outside the image or
//!   somewhere a link redirects it.
//! - An entry whose path exists already replaces it (the later one wins, as
//!   extraction does); two directories merge, the later's metadata winning.
//! - `.wh.NAME` deletes NAME from the layers below, `.wh..wh..opq` hides
//!   everything below in its directory; neither touches entries of the same
//!   layer, and neither appears in the image. `.wh.` names naming `.`, `..`
//!   or nothing are errors; `.wh..wh.X` (a whiteout of a name that can never
//!   exist) is ignored, and so is a whiteout below a path this layer makes a
//!   file or symlink (that replacement drops the lower subtree already;
//!   umoci writes such whiteouts when a directory becomes a file).
//! - A hardlink's target must be an earlier entry of this layer that is not
//!   a directory, or a file of the layers below (resolved when the image is
//!   assembled; a missing target is an error there).
//! - Regular files of 1 to 64 bytes are kept in the record; larger ones are
//!   stored as objects, sparse files with their holes (which cost neither
//!   disk space nor, for the digest, time in proportion to their size; how
//!   many a layer may have is [`Limits::max_hole_bytes`] and
//!   [`Limits::max_sparse_segments`]).

use std::collections::HashMap;
use std::io::{BufReader, Read};

use cairn_erofs::tree::{
    check_name, InodeData, InodeId, RegularFile, Tree, DEFAULT_INLINE_THRESHOLD, MAX_NAME_LEN,
    MAX_PATH_LEN, ROOT, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFREG,
};
use cairn_erofs::{DirEntry, Inode, Mtime};
use cairn_store::{is_diff_id, LayerRecord, ObjectId, StagedObject, Store, StoreError};

use crate::apply::{
    normalize_links, XATTR_ESCAPED_PREFIX, XATTR_HARDLINK, XATTR_IMPLICIT, XATTR_RESERVED_PREFIX,
};
use crate::decompress::{
    compression_for_media_type, open_blob, DecompressError, LimitError, OpenError, SourceError,
};
use crate::tar::{Chunk, EntryKind, TarEntry, TarError, TarErrorKind, TarLimits, TarReader};
use crate::LayerError;

/// The name of an opaque-directory marker.
pub(crate) const OPAQUE: &[u8] = b".wh..wh..opq";
/// The prefix of whiteouts.
pub(crate) const WHITEOUT_PREFIX: &[u8] = b".wh.";

/// What a layer may hold before its import is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest uncompressed tar stream (default 64 GiB).
    pub max_layer_bytes: u64,
    /// Largest uncompressed/compressed ratio once past 64 MiB (default 200).
    pub max_ratio: u64,
    /// Most tar entries (default 10 million).
    pub max_entries: u64,
    /// Longest path or link target in the tar stream (default 4096).
    pub max_path: usize,
    /// Largest total of one entry's xattr names and values (default 32767,
    /// what composefs can store).
    pub max_xattr_bytes: usize,
    /// Largest pax extended header or GNU long name (default 1 MiB).
    pub max_pax_header: usize,
    /// Most segments the sparse files of a layer may list together
    /// (default 65536). Each costs at least one block hash, whatever its
    /// size; see the `tar` module's docs.
    pub max_sparse_segments: u64,
    /// Most bytes of holes (real size minus stored data) the sparse files
    /// of a layer may declare together (default 8 GiB). Holes are free in
    /// the tar stream but the kernel reads every byte of them when it
    /// enables fs-verity, and so does anything that reads the file.
    pub max_hole_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_layer_bytes: 64 << 30,
            max_ratio: 200,
            max_entries: 10_000_000,
            max_path: 4096,
            max_xattr_bytes: u16::MAX as usize / 2,
            max_pax_header: 1 << 20,
            max_sparse_segments: 1 << 16,
            max_hole_bytes: 8 << 30,
        }
    }
}

impl From<&Limits> for TarLimits {
    fn from(l: &Limits) -> Self {
        TarLimits {
            max_path: l.max_path,
            max_pax_header: l.max_pax_header,
            max_xattr_bytes: l.max_xattr_bytes,
            max_sparse_segments: l.max_sparse_segments,
            max_hole_bytes: l.max_hole_bytes,
        }
    }
}

/// What an imported layer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// `sha256:<hex>` of the uncompressed tar stream.
    pub diff_id: String,
    /// `sha256:<hex>` of the blob as read (or as recorded, for a cached
    /// layer).
    pub blob_digest: Option<String>,
    /// Tar entries.
    pub entries: u64,
    /// Uncompressed bytes.
    pub size: u64,
    /// Bytes of the blob.
    pub compressed_size: u64,
    /// True when the layer was in the store already and the blob was not
    /// read at all.
    pub cached: bool,
}

impl LayerInfo {
    fn from_record(r: &LayerRecord, cached: bool) -> LayerInfo {
        LayerInfo {
            diff_id: r.diff_id.clone(),
            blob_digest: r.blob_digest.clone(),
            entries: r.entries,
            size: r.size,
            compressed_size: r.compressed_size,
            cached,
        }
    }
}

/// Whether the store has the layer (a complete record of it).
pub fn has_layer(store: &Store, diff_id: &str) -> bool {
    store.has_layer_record(diff_id)
}

/// Streams one layer blob into the store; see the module docs.
///
/// `expected_blob_digest` is checked against the SHA-256 of the bytes read
/// from `blob`, `expected_diff_id` against that of the uncompressed tar
/// stream, both before anything becomes visible. If `expected_diff_id` is
/// given and the store has that layer already, `blob` is not read at all.
pub fn import_layer(
    store: &Store,
    blob: impl Read,
    media_type: Option<&str>,
    expected_blob_digest: Option<&str>,
    expected_diff_id: Option<&str>,
    limits: &Limits,
) -> Result<LayerInfo, LayerError> {
    let layer = expected_blob_digest
        .or(expected_diff_id)
        .unwrap_or("(unnamed)")
        .to_owned();
    for (what, d) in [
        ("blob digest", expected_blob_digest),
        ("diff_id", expected_diff_id),
    ] {
        if let Some(d) = d {
            if !is_diff_id(d) {
                return Err(LayerError::Invalid {
                    layer,
                    reason: format!(
                        "expected {what} {d:?} is not sha256:<64 lowercase hex digits> (the only digest cairn checks)"
                    ),
                });
            }
        }
    }
    if let Some(diff_id) = expected_diff_id {
        if let Some(rec) = cached_record(store, diff_id)? {
            return Ok(LayerInfo::from_record(&rec, true));
        }
    }
    let declared = match media_type {
        Some(mt) => Some(
            compression_for_media_type(mt).ok_or_else(|| LayerError::MediaType {
                layer: layer.clone(),
                media_type: mt.to_owned(),
            })?,
        ),
        None => None,
    };
    let _lock = store.lock_shared().map_err(LayerError::store(format!(
        "layer {layer}: locking the store"
    )))?;
    let started = std::time::Instant::now();

    let (stream, compression, meter) =
        open_blob(blob, declared, limits.max_layer_bytes, limits.max_ratio).map_err(
            |e| match e {
                OpenError::Read(source) => classify_io(&layer, source, None),
                OpenError::Mismatch(reason) => LayerError::Invalid {
                    layer: layer.clone(),
                    reason,
                },
            },
        )?;
    let mut tar = TarReader::new(
        BufReader::with_capacity(64 * 1024, stream),
        TarLimits::from(limits),
    );
    let mut b =
        LayerBuilder::new(store).map_err(|e| store_err(&layer, "building the layer tree", e))?;
    loop {
        let entry = match tar.next_entry() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            // A limit is about what parsed fine: no reason to read on.
            Err(e) if matches!(e.kind, TarErrorKind::Limit(_)) => return Err(tar_err(&layer, e)),
            Err(e) => return Err(explain(&mut tar, compression, tar_err(&layer, e), &layer)),
        };
        b.entries += 1;
        if b.entries > limits.max_entries {
            return Err(LayerError::Limit {
                layer,
                reason: format!("more than {} tar entries", limits.max_entries),
            });
        }
        let (path, offset) = (entry.path.clone(), entry.offset);
        let added = b.add(&mut tar, entry).map_err(|e| match e {
            AddError::Reason(reason) => LayerError::Entry {
                layer: layer.clone(),
                entry: lossy(&path),
                offset,
                reason,
            },
            AddError::Tar(e) => tar_err(&layer, e),
            AddError::Store(e) => store_err(&layer, &format!("storing {}", lossy(&path)), e),
        });
        if let Err(e) = added {
            return Err(explain(&mut tar, compression, e, &layer));
        }
    }
    tar.drain().map_err(|e| tar_err(&layer, e))?;
    drop(tar);
    tracing::debug!(
        "layer {layer}: {} entries, {} bytes read in {:?}",
        b.entries,
        meter.uncompressed.get(),
        started.elapsed()
    );

    let blob_digest = meter.blob_digest();
    let diff_id = meter.diff_id();
    if let Some(expected) = expected_blob_digest {
        if expected != blob_digest {
            return Err(LayerError::Digest {
                layer,
                what: "blob digest",
                expected: expected.to_owned(),
                actual: blob_digest,
            });
        }
    }
    if let Some(expected) = expected_diff_id {
        if expected != diff_id {
            return Err(LayerError::Digest {
                layer,
                what: "diff_id",
                expected: expected.to_owned(),
                actual: diff_id,
            });
        }
    }
    let record = LayerRecord {
        format: cairn_store::LAYER_FORMAT,
        diff_id: diff_id.clone(),
        blob_digest: Some(blob_digest),
        media_type: media_type.map(str::to_owned),
        compression: compression.name().to_owned(),
        size: meter.uncompressed.get(),
        compressed_size: meter.compressed.get(),
        entries: b.entries,
        objects: b.staged.len() as u64,
    };
    // Someone else (another pull) may have finished it meanwhile.
    if let Some(rec) = cached_record(store, &diff_id)? {
        return Ok(LayerInfo::from_record(&rec, false));
    }
    let LayerBuilder {
        mut tree, staged, ..
    } = b;
    store
        .publish_staged(staged.into_values())
        .map_err(|e| store_err(&diff_id, "publishing objects", e))?;
    tracing::debug!(
        "layer {diff_id}: objects published at {:?}",
        started.elapsed()
    );
    normalize_links(&mut tree);
    let mut writer = store
        .layer_writer()
        .map_err(|e| store_err(&diff_id, "writing the layer record", e))?;
    cairn_erofs::dump::print_dump(&tree, writer.dump()).map_err(|e| LayerError::Invalid {
        layer: diff_id.clone(),
        reason: format!("writing the layer record: {e}"),
    })?;
    writer
        .commit(store, &record)
        .map_err(|e| store_err(&diff_id, "publishing the layer record", e))?;
    tracing::debug!(
        "layer {diff_id}: record published at {:?}",
        started.elapsed()
    );
    Ok(LayerInfo::from_record(&record, false))
}

/// A compressed stream that does not parse as tar is more often corrupt
/// than a bad archive: if reading on to its end shows the compression is
/// broken (a checksum, a bad block), that is the error to report.
fn explain<R: crate::tar::TarSource>(
    tar: &mut TarReader<R>,
    compression: crate::decompress::Compression,
    err: LayerError,
    layer: &str,
) -> LayerError {
    let parse_error = matches!(err, LayerError::Invalid { .. } | LayerError::Entry { .. });
    if !parse_error || compression == crate::decompress::Compression::None {
        return err;
    }
    match tar.drain() {
        Err(e) => match tar_err(layer, e) {
            decompress @ LayerError::Invalid { .. } => decompress,
            _ => err,
        },
        Ok(_) => err,
    }
}

fn cached_record(store: &Store, diff_id: &str) -> Result<Option<LayerRecord>, LayerError> {
    if !store.has_layer_record(diff_id) {
        return Ok(None);
    }
    store
        .layer_record(diff_id)
        .map_err(|e| store_err(diff_id, "reading the cached layer record", e))
}

fn store_err(layer: &str, what: &str, e: StoreError) -> LayerError {
    LayerError::store(format!("layer {layer}: {what}"))(e)
}

pub(crate) fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Sorts an I/O error from the reader stack by where it came from.
fn classify_io(layer: &str, e: std::io::Error, at: Option<u64>) -> LayerError {
    let layer = layer.to_owned();
    let at = at
        .map(|o| format!(" at byte {o} of the tar stream"))
        .unwrap_or_default();
    if let Some(inner) = e.get_ref() {
        if inner.is::<SourceError>() {
            return LayerError::Read { layer, source: e };
        }
        if let Some(d) = inner.downcast_ref::<DecompressError>() {
            return LayerError::Invalid {
                layer,
                reason: format!("{d}{at}"),
            };
        }
        if let Some(l) = inner.downcast_ref::<LimitError>() {
            return LayerError::Limit {
                layer,
                reason: format!("{l}{at}"),
            };
        }
    }
    LayerError::Invalid {
        layer,
        reason: format!("reading the tar stream{at}: {e}"),
    }
}

fn tar_err(layer: &str, e: TarError) -> LayerError {
    match e.kind {
        TarErrorKind::Read(io) => classify_io(layer, io, Some(e.offset)),
        kind => {
            let reason = TarError {
                offset: e.offset,
                entry: None,
                kind,
            }
            .reason();
            match e.entry {
                Some(entry) => LayerError::Entry {
                    layer: layer.to_owned(),
                    entry: lossy(&entry),
                    offset: e.offset,
                    reason,
                },
                None => LayerError::Invalid {
                    layer: layer.to_owned(),
                    reason: format!("tar stream at byte {}: {reason}", e.offset),
                },
            }
        }
    }
}

/// Why one entry could not be added.
enum AddError {
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

/// The layer's tree, built entry by entry.
struct LayerBuilder<'s> {
    store: &'s Store,
    tree: Tree,
    /// Objects staged so far, by id (each content once).
    staged: HashMap<ObjectId, StagedObject>,
    /// Placeholders of hardlinks to lower layers, by target path.
    external: HashMap<Vec<u8>, InodeId>,
    entries: u64,
}

/// Splits a tar path into its components, cleaned lexically.
pub(crate) fn clean_path(path: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut comps: Vec<&[u8]> = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                if comps.pop().is_none() {
                    return Err("path climbs out of the image root with '..'".into());
                }
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

fn join(comps: &[&[u8]]) -> Vec<u8> {
    comps.join(&b'/')
}

fn implicit_dir(mtime: Mtime) -> Inode {
    let mut d = Inode::new(S_IFDIR | 0o755).expect("directory mode is valid");
    d.mtime = mtime;
    d.xattrs.insert(XATTR_IMPLICIT.to_vec(), Vec::new());
    d
}

fn whiteout() -> Inode {
    Inode::new(S_IFCHR).expect("char device mode is valid")
}

impl<'s> LayerBuilder<'s> {
    fn new(store: &'s Store) -> Result<Self, StoreError> {
        Ok(LayerBuilder {
            store,
            tree: Tree::new(implicit_dir(Mtime::default())).expect("a directory root"),
            staged: HashMap::new(),
            external: HashMap::new(),
            entries: 0,
        })
    }

    fn entries_of(&self, dir: InodeId) -> &std::collections::BTreeMap<Vec<u8>, DirEntry> {
        self.tree
            .inode(dir)
            .entries()
            .expect("parents are directories")
    }

    /// The directory that holds `comps`' last component, creating missing
    /// parents implicitly.
    fn parent_of(&mut self, comps: &[&[u8]], mtime: Mtime) -> Result<InodeId, String> {
        let mut cur = ROOT;
        for (i, comp) in comps.iter().enumerate() {
            if comp.starts_with(WHITEOUT_PREFIX) {
                return Err(format!(
                    "parent {} is a whiteout name, not a directory",
                    lossy(&join(&comps[..=i]))
                ));
            }
            match self.entries_of(cur).get(*comp) {
                Some(e) => {
                    let child = self.tree.inode(e.inode);
                    if child.is_dir() {
                        cur = e.inode;
                    } else if matches!(child.data, InodeData::Symlink(_)) {
                        return Err(format!(
                            "parent {} is a symlink; cairn never writes through symlinks",
                            lossy(&join(&comps[..=i]))
                        ));
                    } else {
                        return Err(format!(
                            "parent {} is not a directory",
                            lossy(&join(&comps[..=i]))
                        ));
                    }
                }
                None => {
                    let id = self.tree.push(implicit_dir(mtime));
                    self.tree
                        .add_child(cur, comp, id, false)
                        .map_err(|e| e.to_string())?;
                    cur = id;
                }
            }
        }
        Ok(cur)
    }

    /// The first of `comps` that this layer has as something other than a
    /// directory, if any.
    fn non_dir_parent(&self, comps: &[&[u8]]) -> Option<Vec<u8>> {
        let mut cur = ROOT;
        for (i, comp) in comps.iter().enumerate() {
            let e = self.entries_of(cur).get(*comp)?;
            if !self.tree.inode(e.inode).is_dir() {
                return Some(join(&comps[..=i]));
            }
            cur = e.inode;
        }
        None
    }

    /// Links `id` as `name` in `dir`, replacing what is there (two
    /// directories merge: the old one takes the new one's metadata).
    fn put(&mut self, dir: InodeId, name: &[u8], id: InodeId, hardlink: bool) {
        let existing = self.entries_of(dir).get(name).map(|e| e.inode);
        if let Some(old) = existing {
            if self.tree.inode(old).is_dir() && self.tree.inode(id).is_dir() {
                let new = self.tree.inode(id).clone();
                let o = self.tree.inode_mut(old);
                o.mode = new.mode;
                o.uid = new.uid;
                o.gid = new.gid;
                o.mtime = new.mtime;
                o.xattrs = new.xattrs;
                return;
            }
        }
        if let InodeData::Directory(entries) = &mut self.tree.inode_mut(dir).data {
            entries.insert(
                name.to_vec(),
                DirEntry {
                    inode: id,
                    hardlink,
                },
            );
        }
    }

    fn add<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: TarEntry,
    ) -> Result<(), AddError> {
        let comps = clean_path(&e.path)?;
        let Some((name, parents)) = comps.split_last() else {
            // The root itself.
            if e.kind != EntryKind::Directory {
                return Err(AddError::Reason(
                    "the root entry ('./') must be a directory".into(),
                ));
            }
            let new = self.inode_for(&e)?;
            let root = self.tree.inode_mut(ROOT);
            root.mode = new.mode;
            root.uid = new.uid;
            root.gid = new.gid;
            root.mtime = new.mtime;
            root.xattrs = new.xattrs;
            return Ok(());
        };
        let name: &[u8] = name;

        if let Some(target) = name.strip_prefix(WHITEOUT_PREFIX) {
            if let Some(blocker) = self.non_dir_parent(parents) {
                // This layer replaces a parent with a file or symlink, which
                // drops everything below it from the lower layers anyway
                // (umoci writes such whiteouts when a directory becomes a
                // file); there is nothing left for the whiteout to delete.
                tracing::debug!(
                    "ignoring whiteout {} below non-directory {}",
                    lossy(&e.path),
                    lossy(&blocker)
                );
                return Ok(());
            }
            let dir = self.parent_of(parents, e.mtime)?;
            if name == OPAQUE {
                let id = self.tree.push(whiteout());
                self.put(dir, OPAQUE, id, false);
                return Ok(());
            }
            if target.starts_with(WHITEOUT_PREFIX) {
                tracing::debug!("ignoring whiteout of reserved name {}", lossy(name));
                return Ok(());
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
            let id = self.tree.push(whiteout());
            self.put(dir, name, id, false);
            return Ok(());
        }

        if e.kind == EntryKind::Hardlink {
            return self.add_hardlink(&comps, &e);
        }

        let dir = self.parent_of(parents, e.mtime)?;
        let mut inode = self.inode_for(&e)?;
        if e.kind == EntryKind::Regular {
            inode.data = InodeData::Regular(self.read_content(tar, &e)?);
        }
        let id = self.tree.push(inode);
        self.put(dir, name, id, false);
        Ok(())
    }

    fn add_hardlink(&mut self, comps: &[&[u8]], e: &TarEntry) -> Result<(), AddError> {
        let target = clean_path(&e.link).map_err(|r| format!("hardlink target: {r}"))?;
        let Some(target_name) = target.last() else {
            return Err(AddError::Reason("hardlink to the root directory".into()));
        };
        if target_name.starts_with(WHITEOUT_PREFIX) {
            return Err(AddError::Reason(format!(
                "hardlink to whiteout {}",
                lossy(&e.link)
            )));
        }
        // A link to itself (GNU tar writes one for a file named twice) finds
        // the entry that is there and changes nothing.
        // Literally, without following symlinks: a link names a file.
        let mut cur = ROOT;
        let mut found = None;
        for (i, comp) in target.iter().enumerate() {
            let Some(entry) = self.entries_of(cur).get(*comp) else {
                break;
            };
            let node = self.tree.inode(entry.inode);
            if i + 1 == target.len() {
                if node.is_dir() {
                    return Err(AddError::Reason(format!(
                        "hardlink to directory {}",
                        lossy(&e.link)
                    )));
                }
                found = Some(entry.inode);
            } else if node.is_dir() {
                cur = entry.inode;
            } else {
                return Err(AddError::Reason(format!(
                    "hardlink target {}: {} is not a directory",
                    lossy(&e.link),
                    lossy(&join(&target[..=i]))
                )));
            }
        }
        let id = match found {
            Some(id) => id,
            None => {
                // Not in this layer: a file of the layers below, found when
                // the image is assembled.
                let key = join(&target);
                match self.external.get(&key) {
                    Some(&id) => id,
                    None => {
                        let mut p = Inode::new(S_IFREG).expect("regular mode is valid");
                        p.xattrs.insert(XATTR_HARDLINK.to_vec(), key.clone());
                        let id = self.tree.push(p);
                        self.external.insert(key, id);
                        id
                    }
                }
            }
        };
        let (name, parents) = comps.split_last().expect("not the root");
        let dir = self.parent_of(parents, e.mtime)?;
        self.put(dir, name, id, true);
        Ok(())
    }

    /// The inode an entry describes (regular files without content yet).
    fn inode_for(&self, e: &TarEntry) -> Result<Inode, String> {
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
            if k.len() > 255 || k.contains(&0) {
                return Err(format!(
                    "invalid xattr name {:?} (at most 255 bytes, no NUL)",
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
            let key = match k.strip_prefix(XATTR_RESERVED_PREFIX) {
                Some(rest) => [XATTR_ESCAPED_PREFIX, rest].concat(),
                None => k.clone(),
            };
            inode.xattrs.insert(key, v.clone());
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
                inode.size = e.link.len() as u64;
                inode.data = InodeData::Symlink(e.link.clone());
            }
            EntryKind::Regular => inode.size = e.size,
            _ => {}
        }
        Ok(inode)
    }

    /// Reads a regular file's content: inline if small, else into a staged
    /// object.
    fn read_content<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: &TarEntry,
    ) -> Result<RegularFile, AddError> {
        if e.size == 0 {
            return Ok(RegularFile::default());
        }
        if e.size <= DEFAULT_INLINE_THRESHOLD {
            let mut content = Vec::with_capacity(e.size as usize);
            tar.copy_data::<AddError>(e, |c| {
                match c {
                    Chunk::Data(d) => content.extend_from_slice(d),
                    Chunk::Hole(n) => content.resize(content.len() + n as usize, 0),
                }
                Ok(())
            })?;
            return Ok(RegularFile {
                content: Some(content),
                ..Default::default()
            });
        }
        let mut stager = self.store.stage_object().map_err(AddError::Store)?;
        tar.copy_data::<AddError>(e, |c| {
            match c {
                Chunk::Data(d) => stager.write(d),
                Chunk::Hole(n) => stager.hole(n),
            }
            .map_err(AddError::Store)
        })?;
        let staged = stager.finish(self.store).map_err(AddError::Store)?;
        let id = staged.id();
        self.staged.entry(id).or_insert(staged);
        Ok(RegularFile {
            content: None,
            payload: Some(id.object_path().into_bytes()),
            digest: Some(id.0),
        })
    }
}
