//! Layer import: one layer blob (as fetched) → objects in the store and a
//! layer record under `layers/<diff_id>`.
//!
//! The blob streams through the reader stack of `decompress` into the tar
//! parser of `tar`; each entry becomes a line of the layer record as it
//! comes (metadata only), each regular file's content a staged object.
//! Objects are published while the stream is read, each once a sync has
//! made it durable (`cairn_store::Publisher`); only when the stream has
//! ended, and its blob digest and diff_id match what the caller expects, is
//! the record published. An error at any point drops everything not yet
//! published; what was (whole objects, named by their content) is garbage
//! that no record names, for gc.
//!
//! # What the record keeps
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
//!   many a layer may have is [`Limits::max_hole_bytes`] and
//!   [`Limits::max_sparse_segments`]).

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read};

use cairn_erofs::tree::{
    check_name, InodeData, RegularFile, DEFAULT_INLINE_THRESHOLD, MAX_NAME_LEN, MAX_PATH_LEN,
    S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFREG,
};
use cairn_erofs::Inode;
use cairn_store::{
    is_diff_id, LayerRecord, LayerRecordWriter, ObjectId, PublishShard, StagedObject, Store,
    StoreError, OPAQUE_MARKER, WHITEOUT_PREFIX,
};

use crate::decompress::{
    open_blob, Compression, DecompressError, LimitError, OpenError, SourceError,
};
use crate::tar::{Chunk, EntryKind, TarEntry, TarError, TarErrorKind, TarLimits, TarReader};
use crate::{pipeline, LayerError};

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
/// stream, both before the layer record becomes visible (objects, which
/// are named by their content, may be published before). If `expected_diff_id` is
/// given and the store has that layer already, `blob` is not read at all.
pub fn import_layer(
    store: &Store,
    blob: impl Read + Send,
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
            Compression::of_layer(mt).ok_or_else(|| LayerError::MediaType {
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

    let open_err = |e: OpenError| match e {
        OpenError::Read(source) => classify_io(&layer, source, None),
        OpenError::Mismatch(reason) => LayerError::Invalid {
            layer: layer.clone(),
            reason,
        },
    };
    let threads = pipeline::parallelism();
    let workers = threads.clamp(1, pipeline::MAX_WORKERS);
    // Objects are named by the threads that stage them, as each becomes
    // durable (see `cairn_store::Publisher`), not in one pass at the end.
    let publisher = store
        .publisher(workers)
        .map_err(|e| store_err(&layer, "starting the object publisher", e))?;
    let (mut b, compression, totals) = if threads <= 1 {
        // One CPU: every stage in this thread, one after the other.
        let (stream, compression, meter) = open_blob(
            blob,
            declared,
            limits.max_layer_bytes,
            limits.max_ratio,
            true,
        )
        .map_err(open_err)?;
        let mut tar = TarReader::new(
            BufReader::with_capacity(64 * 1024, stream),
            TarLimits::from(limits),
        );
        // Named staging files, renamed at the end: with one thread, a sync
        // each time the open-file budget is reached stops all the work
        // while the disk writes (taskset -c 0: 47.3 s against 27.7 s for
        // the Linux-tree layer), where the kernel's own writeback overlaps.
        let mut b = LayerBuilder::new(store, None, None)
            .map_err(|e| store_err(&layer, "starting the layer record", e))?;
        parse_layer(&mut tar, compression, &mut b, limits, &layer)?;
        drop(tar);
        (b, compression, pipeline::Totals::of(&meter))
    } else {
        std::thread::scope(|s| {
            let q = pipeline::stream_queues();
            let (max_bytes, max_ratio) = (limits.max_layer_bytes, limits.max_ratio);
            // Named, for `perf`, `top -H` and `ps -L`.
            let decompressor = spawn_named(s, "cairn-decompress", move || {
                pipeline::decompress(
                    blob,
                    declared,
                    max_bytes,
                    max_ratio,
                    q.opened_tx,
                    q.tx,
                    q.free_rx,
                )
            })
            .map_err(|e| LayerError::Invalid {
                layer: layer.clone(),
                reason: format!("starting the decompression thread: {e}"),
            })?;
            let compression = match q.opened_rx.recv() {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(open_err(e)),
                Err(_) => {
                    return Err(LayerError::Invalid {
                        layer: layer.clone(),
                        reason: "the decompression thread stopped".into(),
                    })
                }
            };
            let (objects, ends) = pipeline::Objects::new(workers);
            let (flush_tx, flush_rx) = std::sync::mpsc::sync_channel(1);
            let publisher = &publisher;
            let thread_err = |what: &str, e: std::io::Error| LayerError::Invalid {
                layer: layer.clone(),
                reason: format!("starting {what}: {e}"),
            };
            for (jobs, done, free) in ends {
                let flush = flush_tx.clone();
                spawn_named(s, "cairn-objects", move || {
                    pipeline::object_worker(publisher, jobs, done, free, flush)
                })
                .map_err(|e| thread_err("an object worker", e))?;
            }
            drop(flush_tx);
            spawn_named(s, "cairn-flush", move || {
                pipeline::flusher(publisher, flush_rx)
            })
            .map_err(|e| thread_err("the flusher thread", e))?;
            let mut b = LayerBuilder::new(store, Some(objects), None)
                .map_err(|e| store_err(&layer, "starting the layer record", e))?;
            // The chunks are the buffer: no BufReader (and no copy) between.
            let mut tar = TarReader::new(q.reader, TarLimits::from(limits));
            parse_layer(&mut tar, compression, &mut b, limits, &layer)?;
            let diff_id = tar.into_inner().diff_id();
            b.settle_all().map_err(|e| add_err(&layer, b"", 0, e))?;
            let mut totals = decompressor
                .join()
                .map_err(|_| LayerError::Invalid {
                    layer: layer.clone(),
                    reason: "the decompression thread panicked".into(),
                })?
                .ok_or_else(|| LayerError::Invalid {
                    layer: layer.clone(),
                    reason: "the decompression thread ended without totals".into(),
                })?;
            totals.diff_id = diff_id;
            check_digests(&layer, expected_blob_digest, expected_diff_id, &totals)?;
            // Every object is staged, and the layer is the one expected:
            // the workers name their last objects as they end, which they
            // do when their queues close.
            publisher.staging_done();
            b.objects = None;
            Ok((b, compression, totals))
        })?
    };
    tracing::debug!(
        "layer {layer}: {} entries, {} bytes read in {:?}",
        b.entries,
        totals.uncompressed,
        started.elapsed()
    );

    check_digests(&layer, expected_blob_digest, expected_diff_id, &totals)?;
    let pipeline::Totals {
        blob_digest,
        diff_id,
        compressed,
        uncompressed,
    } = totals;
    let record = LayerRecord {
        format: cairn_store::LAYER_FORMAT,
        diff_id: diff_id.clone(),
        blob_digest: Some(blob_digest),
        media_type: media_type.map(str::to_owned),
        compression: compression.name().to_owned(),
        size: uncompressed,
        compressed_size: compressed,
        entries: b.entries,
        objects: b.staged.len() as u64,
    };
    // Someone else (another pull) may have finished it meanwhile.
    if let Some(rec) = cached_record(store, &diff_id)? {
        return Ok(LayerInfo::from_record(&rec, false));
    }
    b.flush().map_err(|e| match e {
        AddError::Reason(reason) => LayerError::Invalid {
            layer: diff_id.clone(),
            reason,
        },
        AddError::Tar(e) => tar_err(&diff_id, e),
        AddError::Store(e) => store_err(&diff_id, "writing the layer record", e),
    })?;
    let LayerBuilder {
        staged,
        writer,
        shard,
        ..
    } = b;
    // Every shard gone (the workers' with their threads): what they hold
    // goes to finish, which names it and makes every new name durable.
    drop(shard);
    publisher
        .finish()
        .map_err(|e| store_err(&diff_id, "publishing objects", e))?;
    // Objects staged with names (where fs-verity seals them): renamed here.
    store
        .publish_staged(staged.into_values())
        .map_err(|e| store_err(&diff_id, "publishing objects", e))?;
    tracing::debug!(
        "layer {diff_id}: objects published at {:?}",
        started.elapsed()
    );
    writer
        .commit(store, &record)
        .map_err(|e| store_err(&diff_id, "publishing the layer record", e))?;
    tracing::debug!(
        "layer {diff_id}: record published at {:?}",
        started.elapsed()
    );
    Ok(LayerInfo::from_record(&record, false))
}

/// Checks the digests of what was read against those expected.
fn check_digests(
    layer: &str,
    expected_blob_digest: Option<&str>,
    expected_diff_id: Option<&str>,
    totals: &pipeline::Totals,
) -> Result<(), LayerError> {
    for (what, expected, actual) in [
        ("blob digest", expected_blob_digest, &totals.blob_digest),
        ("diff_id", expected_diff_id, &totals.diff_id),
    ] {
        if let Some(expected) = expected {
            if expected != actual {
                return Err(LayerError::Digest {
                    layer: layer.to_owned(),
                    what,
                    expected: expected.to_owned(),
                    actual: actual.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Reads every entry of the tar stream into `b`.
fn parse_layer<R: crate::tar::TarSource>(
    tar: &mut TarReader<R>,
    compression: Compression,
    b: &mut LayerBuilder<'_>,
    limits: &Limits,
    layer: &str,
) -> Result<(), LayerError> {
    loop {
        let entry = match tar.next_entry() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            // A limit is about what parsed fine: no reason to read on.
            Err(e) if matches!(e.kind, TarErrorKind::Limit(_)) => return Err(tar_err(layer, e)),
            Err(e) => return Err(explain(tar, compression, tar_err(layer, e), layer)),
        };
        b.entries += 1;
        if b.entries > limits.max_entries {
            return Err(LayerError::Limit {
                layer: layer.to_owned(),
                reason: format!("more than {} tar entries", limits.max_entries),
            });
        }
        let (path, offset) = (entry.path.clone(), entry.offset);
        if let Err(e) = b.add(tar, entry) {
            let e = add_err(layer, &path, offset, e);
            return Err(explain(tar, compression, e, layer));
        }
    }
    tar.drain().map_err(|e| tar_err(layer, e))?;
    Ok(())
}

fn add_err(layer: &str, path: &[u8], offset: u64, e: AddError) -> LayerError {
    match e {
        AddError::Reason(reason) => LayerError::Entry {
            layer: layer.to_owned(),
            entry: lossy(path),
            offset,
            reason,
        },
        AddError::Tar(e) => tar_err(layer, e),
        AddError::Store(e) => store_err(layer, &format!("storing {}", lossy(path)), e),
    }
}

/// A compressed stream that does not parse as tar is more often corrupt
/// than a bad archive: if reading on to its end shows the compression is
/// broken (a checksum, a bad block), that is the error to report.
fn explain<R: crate::tar::TarSource>(
    tar: &mut TarReader<R>,
    compression: Compression,
    err: LayerError,
    layer: &str,
) -> LayerError {
    let parse_error = matches!(err, LayerError::Invalid { .. } | LayerError::Entry { .. });
    if !parse_error || compression == Compression::None {
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
    // What the reader stack said, also when another thread ran it.
    let inner = pipeline::original(&e).get_ref();
    if inner.is_some_and(|i| i.is::<SourceError>()) {
        return LayerError::Read { layer, source: e };
    }
    if let Some(d) = inner.and_then(|i| i.downcast_ref::<DecompressError>()) {
        return LayerError::Invalid {
            layer,
            reason: format!("{d}{at}"),
        };
    }
    if let Some(l) = inner.and_then(|i| i.downcast_ref::<LimitError>()) {
        return LayerError::Limit {
            layer,
            reason: format!("{l}{at}"),
        };
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

/// The layer's record, written entry by entry as the stream is read.
struct LayerBuilder<'s> {
    store: &'s Store,
    writer: LayerRecordWriter,
    /// Lines not yet written to the record file.
    pending: Vec<u8>,
    /// Objects staged so far, by id (each content once).
    staged: HashMap<ObjectId, StagedObject>,
    entries: u64,
    /// The object workers, if objects are staged in other threads.
    objects: Option<pipeline::Objects>,
    /// Where objects are staged and published, if in this thread.
    shard: Option<PublishShard<'s>>,
    /// Entries whose line waits for an object a worker is writing (the
    /// first one does), in stream order.
    waiting: VecDeque<Waiting>,
}

fn worker_gone(_: pipeline::WorkerGone) -> AddError {
    AddError::Reason("the object worker stopped".into())
}

/// A file's data, read by the tar parser straight into the object
/// workers' batch.
struct ToWorkers<'o>(&'o mut pipeline::Objects);

impl crate::tar::DataSink<AddError> for ToWorkers<'_> {
    fn room(&mut self, want: usize) -> Result<&mut [u8], AddError> {
        self.0.room(want).map_err(worker_gone)
    }

    fn filled(&mut self, n: usize) -> Result<(), AddError> {
        self.0.filled(n);
        Ok(())
    }

    fn hole(&mut self, n: u64) -> Result<(), AddError> {
        self.0.hole(n);
        Ok(())
    }
}

/// A record line that waits for its object.
struct Waiting {
    path: Vec<u8>,
    inode: Inode,
    hardlink: Option<Vec<u8>>,
    /// The object's number, for a regular file staged by a worker.
    object: Option<u64>,
}

/// Lines that may wait for objects before the parser waits for them too.
const MAX_WAITING: usize = 1 << 16;

/// Flush the record's pending lines once they reach this size.
const RECORD_BUFFER: usize = 1 << 20;

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

impl<'s> LayerBuilder<'s> {
    fn new(
        store: &'s Store,
        objects: Option<pipeline::Objects>,
        shard: Option<PublishShard<'s>>,
    ) -> Result<Self, StoreError> {
        Ok(LayerBuilder {
            shard,
            store,
            writer: store.layer_writer()?,
            pending: Vec::with_capacity(RECORD_BUFFER + 64 * 1024),
            staged: HashMap::new(),
            entries: 0,
            objects,
            waiting: VecDeque::new(),
        })
    }

    fn write_line(
        &mut self,
        path: &[u8],
        inode: &Inode,
        hardlink: Option<&[u8]>,
    ) -> Result<(), AddError> {
        if !self.waiting.is_empty() {
            self.waiting.push_back(Waiting {
                path: path.to_vec(),
                inode: inode.clone(),
                hardlink: hardlink.map(<[u8]>::to_vec),
                object: None,
            });
            return self.settle(false);
        }
        self.format_line(path, inode, hardlink)
    }

    fn format_line(
        &mut self,
        path: &[u8],
        inode: &Inode,
        hardlink: Option<&[u8]>,
    ) -> Result<(), AddError> {
        cairn_erofs::dump::format_entry_line(&mut self.pending, path, inode, hardlink);
        if self.pending.len() >= RECORD_BUFFER {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the waiting lines whose objects are done, from the first on;
    /// with `wait` (or too many waiting), waits for the first one's.
    fn settle(&mut self, wait: bool) -> Result<(), AddError> {
        while let Some(front) = self.waiting.front() {
            let mut w = if let Some(seq) = front.object {
                let must = wait || self.waiting.len() > MAX_WAITING;
                let objects = self.objects.as_mut().expect("objects while lines wait");
                let gone = |_| {
                    AddError::Reason(format!(
                        "storing {}: the object worker stopped",
                        lossy(&front.path)
                    ))
                };
                let Some(done) = objects.take(seq, must).map_err(gone)? else {
                    if must {
                        return Err(AddError::Reason(format!(
                            "storing {}: the object worker stopped",
                            lossy(&front.path)
                        )));
                    }
                    return Ok(());
                };
                let staged = done.map_err(|e| {
                    AddError::Reason(format!("storing {}: {e}", lossy(&front.path)))
                })?;
                let mut w = self.waiting.pop_front().expect("the front");
                let id = staged.id();
                w.inode.data = InodeData::Regular(RegularFile {
                    content: None,
                    payload: Some(id.object_path().into_bytes()),
                    digest: Some(id.0),
                });
                self.staged.entry(id).or_insert(staged);
                w
            } else {
                self.waiting.pop_front().expect("the front")
            };
            let hardlink = w.hardlink.take();
            self.format_line(&w.path, &w.inode, hardlink.as_deref())?;
        }
        Ok(())
    }

    /// Waits for every object and writes every waiting line.
    fn settle_all(&mut self) -> Result<(), AddError> {
        self.settle(true)
    }

    fn flush(&mut self) -> Result<(), AddError> {
        use std::io::Write;
        self.writer
            .entries()
            .write_all(&self.pending)
            .map_err(|e| AddError::Reason(format!("writing the layer record: {e}")))?;
        self.pending.clear();
        Ok(())
    }

    fn add<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: TarEntry,
    ) -> Result<(), AddError> {
        let (path, mut inode) = match prepare(&e)? {
            Prepared::Skip => return Ok(()),
            Prepared::Line(path, inode, hardlink) => {
                return self.write_line(&path, &inode, hardlink.as_deref())
            }
            Prepared::Regular(path, inode) => (path, inode),
        };
        if self.objects.is_some() && e.size > DEFAULT_INLINE_THRESHOLD {
            let seq = self.send_content(tar, &e)?;
            self.waiting.push_back(Waiting {
                path,
                inode,
                hardlink: None,
                object: Some(seq),
            });
            return self.settle(false);
        }
        inode.data = InodeData::Regular(self.read_content(tar, &e)?);
        self.write_line(&path, &inode, None)
    }

    /// Hands a regular file's content to an object worker; the object's
    /// number.
    fn send_content<R: crate::tar::TarSource>(
        &mut self,
        tar: &mut TarReader<R>,
        e: &TarEntry,
    ) -> Result<u64, AddError> {
        let objects = self.objects.as_mut().expect("object workers");
        let seq = objects.begin(e.size).map_err(worker_gone)?;
        tar.copy_data_into(e, &mut ToWorkers(objects))?;
        objects.end();
        Ok(seq)
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
        let mut stager = match &self.shard {
            Some(shard) => shard.stage_object(),
            None => self.store.stage_object(),
        }
        .map_err(AddError::Store)?;
        tar.copy_data::<AddError>(e, |c| {
            match c {
                Chunk::Data(d) => stager.write(d),
                Chunk::Hole(n) => stager.hole(n),
            }
            .map_err(AddError::Store)
        })?;
        let staged = match &mut self.shard {
            Some(shard) => {
                let staged = shard.finish(stager).map_err(AddError::Store)?;
                shard.publish_ready();
                staged
            }
            None => stager.finish(self.store).map_err(AddError::Store)?,
        };
        let id = staged.id();
        self.staged.entry(id).or_insert(staged);
        Ok(RegularFile {
            content: None,
            payload: Some(id.object_path().into_bytes()),
            digest: Some(id.0),
        })
    }
}

/// A scoped thread with a name (what `ps -L` and `perf` show).
fn spawn_named<'scope, 'env, T: Send + 'scope>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, T>> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn_scoped(s, f)
}
