//! Records: what the store keeps about imported layers and assembled
//! images besides their files, how it is published, and how image names
//! map to ref names.
//!
//! # On disk
//!
//! ```text
//! layers/
//! └── sha256:<64 hex>/        one directory per layer, named by its diff_id
//!     ├── layer.json          a LayerRecord (JSON): diff_id, blob digest, sizes, counts
//!     └── entries             the layer's tar entries in order, one dumpfile line each
//! images/
//! ├── <sha256>                the EROFS image (image.rs)
//! └── <sha256>.json           its ImageRecord (JSON): manifest, config, layers, …
//! ```
//!
//! ## The layer entries
//!
//! `entries` holds one line per tar entry, in the order of the tar stream,
//! each in the syntax of a composefs dumpfile line
//! (`cairn_erofs::dump::parse_line`): the file's contents replaced by their
//! object (or kept inline up to 64 bytes), so the layer can be applied again
//! without its blob. It is not a dumpfile of a tree: applying a layer
//! resolves each entry's parent directories through the symlinks of the
//! image below and of this layer's earlier entries, so the same path can
//! name different places depending on what comes before it, and only the
//! order of the stream says which.
//!
//! - PATH is the entry's path cleaned as the image root's (`/a/b`; `/` for
//!   the root itself); `..` never climbs above the root.
//! - **Whiteouts** stay what the OCI layer says: an entry `.wh.NAME`
//!   ([`WHITEOUT_PREFIX`]), a character device 0:0, deletes `NAME` of the
//!   layers below; `.wh..wh..opq` ([`OPAQUE_MARKER`]) empties its directory
//!   of what the layers below put in it. Names starting with `.wh.` are
//!   reserved by the image spec, so no real entry has one. These two
//!   markers are defined here, once, for the code that writes records and
//!   the code that applies them (both in `cairn_image`).
//! - **Hardlinks** are hardlink lines (`@` before MODE) whose PAYLOAD is the
//!   target path, resolved when the layer is applied.
//! - Regular files hold inline CONTENT (up to 64 bytes) or name their object
//!   (`PAYLOAD` `ab/cdef…`, `DIGEST`), exactly as in an image dump.
//! - Xattrs are the entry's own; nothing else is stored in them.
//!
//! The image crate (`cairn_image`) writes and applies these records; this
//! module only stores them and lists the objects they name
//! ([`Store::layer_record_objects`]).
//!
//! # Publication
//!
//! Layer directories are built in the staging area and renamed into
//! `layers/` whole (never replacing one that exists: a layer is the same
//! whoever imported it). The objects a layer names are staged with
//! [`Store::stage_object`] and published with [`Store::publish_staged`]
//! *before* the layer directory, and an image record is written only after
//! its image. A crash leaves only `tmp/` debris.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{renameat_with, RenameFlags, CWD};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use crate::image::is_image_digest;
use crate::object::is_lower_hex;
use crate::tmp::{sync_dir, Persisted, Staging, TmpFile};
use crate::verity::{FsVerityHasher, ObjectId};
use crate::{Store, StoreError};

/// The file in a layer directory that holds its [`LayerRecord`].
pub const LAYER_RECORD_FILE: &str = "layer.json";
/// The file in a layer directory that holds its entries, in the order of
/// the tar stream, one dumpfile line each.
pub const LAYER_ENTRIES_FILE: &str = "entries";
/// Version of the layer record format this build writes and reads. Format 1
/// kept a dumpfile of the layer's tree (`dump`), which cannot say in which
/// order entries come or that one is written through a symlink another
/// entry made; a store's format-1 records are replaced when the layer is
/// imported again, and `fsck` reports them.
pub const LAYER_FORMAT: u32 = 2;
/// The name prefix of a whiteout entry in a layer record: `.wh.NAME`
/// deletes `NAME` of the layers below (see "The layer entries" above).
pub const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// The name of an opaque-directory marker in a layer record: it empties its
/// directory of what the layers below put there.
pub const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// Largest record file read back (records are small; a bigger one is corrupt).
const MAX_RECORD_JSON: u64 = 64 << 20;

/// What `layers/<diff_id>/layer.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRecord {
    /// Always [`LAYER_FORMAT`] for records this build writes.
    pub format: u32,
    /// `sha256:<hex>` of the uncompressed tar stream.
    pub diff_id: String,
    /// `sha256:<hex>` of the blob as it was fetched (compressed), when known.
    pub blob_digest: Option<String>,
    /// The media type the blob came with, if any.
    pub media_type: Option<String>,
    /// `gzip`, `zstd` or `none`.
    pub compression: String,
    /// Bytes of the uncompressed tar stream.
    pub size: u64,
    /// Bytes of the blob.
    pub compressed_size: u64,
    /// Tar entries (extension headers not counted).
    pub entries: u64,
    /// Distinct objects the layer's regular files are stored in.
    pub objects: u64,
}

/// One layer of an image, as its [`ImageRecord`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecordLayer {
    /// `sha256:<hex>`: the name of the layer under `layers/`.
    pub diff_id: String,
    /// The digest the manifest gives the layer blob.
    pub blob_digest: Option<String>,
    /// Uncompressed size of the layer's tar stream.
    pub size: u64,
}

/// What `images/<digest>.json` holds: where an image came from and how it
/// was made. Names are not in it: they are refs (`refs/`), several of which
/// may point at one image.
///
/// One record per EROFS image: two imports whose filesystems are byte for
/// byte the same (e.g. images that differ only in their config) share the
/// image, and the record is the one imported last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// SHA-256 (hex, no prefix) of the EROFS image: its name under `images/`.
    pub image_digest: String,
    /// `sha256:<hex>` of the manifest JSON (as given; synthesised for images
    /// that had none, e.g. from a directory or a docker archive).
    pub manifest_digest: String,
    /// `sha256:<hex>` of the config JSON.
    pub config_digest: String,
    /// The manifest, exactly as imported.
    pub manifest: String,
    /// The image config, exactly as imported.
    pub config: String,
    /// The layers in the order they were applied (bottom first).
    pub layers: Vec<ImageRecordLayer>,
    /// `created` from the config (RFC 3339), if it has one.
    pub created: Option<String>,
    pub architecture: Option<String>,
    pub os: Option<String>,
    /// When this store assembled the image (RFC 3339, UTC).
    pub imported: String,
    /// Size of the EROFS image file.
    pub image_size: u64,
    /// Sum of the sizes of the image's regular files (each inode once).
    pub content_size: u64,
    /// Where it came from (`oci-layout:/path:tag`, a registry reference, …),
    /// when the importer says.
    #[serde(default)]
    pub source: Option<String>,
    /// Set while the image is *incomplete*: pulled with `--lazy`, its
    /// metadata is here and its objects are still (partly) in a registry.
    /// Cleared once every object is in the store (`cairn fetch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy: Option<LazySource>,
}

/// Where the objects of an incomplete image come from: a cairn lazy-image
/// artifact in a registry (`docs/lazy-format.md`). Its object index is kept
/// beside the image as `images/<digest>.lazy-index`
/// ([`Store::lazy_index_path`]), exactly as the artifact's index blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LazySource {
    /// The registry as references name it (`127.0.0.1:5000`, `docker.io`).
    pub registry: String,
    pub repository: String,
    /// `sha256:<hex>` of the artifact manifest.
    pub artifact_digest: String,
    /// The artifact manifest, exactly as fetched (its digest is
    /// `artifact_digest`): it names the index and the packs.
    pub artifact_manifest: String,
    /// `sha256:<hex>` of the index blob, which is the file
    /// `images/<digest>.lazy-index`.
    pub index_digest: String,
    /// Distinct objects the image uses, and the sum of their sizes.
    pub objects: u64,
    pub object_bytes: u64,
    /// An eStargz image pulled through its layers' TOCs: `artifact_digest`
    /// and `artifact_manifest` are then the image manifest's (it names
    /// the layer blobs), the lazy index holds the TOCs, and files are
    /// named by the sha256 of their contents (docs/lazy-format.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estargz: bool,
}

/// Whether `s` is a diff_id as layers are named: `sha256:` and 64 lowercase
/// hex digits ([`crate::parse_digest`] accepts it).
pub fn is_diff_id(s: &str) -> bool {
    cairn_spec::parse_digest(s).is_ok()
}

/// The ref name an image name is stored under. Image names hold `/`
/// (`registry:5000/library/debian:bookworm`), which ref names cannot: `%`
/// becomes `%25`, `/` becomes `%2F`, a leading `.` and the second `.` of
/// `..` become `%2E`, control characters `%XX`. Names that need none of
/// that are their own ref name. [`image_name_for`] reverses it.
pub fn ref_name_for(image_name: &str) -> String {
    let mut out = String::with_capacity(image_name.len());
    let mut prev_dot = false;
    for (i, c) in image_name.chars().enumerate() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '.' if i == 0 || prev_dot => out.push_str("%2E"),
            c if c.is_control() && (c as u32) < 0x100 => {
                out.push_str(&format!("%{:02X}", c as u32))
            }
            c => out.push(c),
        }
        prev_dot = c == '.';
    }
    out
}

/// The image name a ref name stands for (the inverse of [`ref_name_for`]);
/// `%XX` sequences that are not escapes are kept as they are.
pub fn image_name_for(ref_name: &str) -> String {
    let bytes = ref_name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| ref_name.to_owned())
}

/// A file content being staged as an object: write it (and skip holes),
/// then [`finish`](Self::finish). Dropped unfinished, it leaves nothing.
#[derive(Debug)]
pub struct ObjectStager {
    tmp: TmpFile,
    hasher: FsVerityHasher,
    /// Bytes of the file so far (data and holes).
    len: u64,
    /// Whether the file position is behind `len` (a hole at the end).
    hole_at_end: bool,
    /// Whether the file was created with the object's mode already (the
    /// umask took none of its bits), so `finish` need not `fchmod` it.
    mode_set: bool,
}

/// A staged object, complete and hashed, not yet visible in `objects/`.
#[derive(Debug)]
pub struct StagedObject {
    pub(crate) id: ObjectId,
    pub(crate) size: u64,
    /// `None` when the store had the object already, or when a
    /// [`Publisher`](crate::Publisher) holds it (to link it itself).
    pub(crate) tmp: Option<TmpFile>,
}

impl StagedObject {
    pub fn id(&self) -> ObjectId {
        self.id
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Opens the staged file read-only: its bytes, which hashed to
    /// [`id`](Self::id), readable before the object is published (before
    /// the syncs that make its name durable). The descriptor stays valid
    /// after publication (the rename keeps the inode) and after a failed
    /// one. `None` when the store had the object already: open it there.
    pub fn open_staged(&self) -> Option<Result<File, StoreError>> {
        let tmp = self.tmp.as_ref()?;
        Some(
            fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(tmp.path())
                .map_err(|e| tmp.err("opening staged object", e)),
        )
    }
}

/// A staging directory for one thread's objects: see
/// [`Store::object_shard`].
#[derive(Debug)]
pub struct ObjectShard(Arc<Staging>);

impl ObjectShard {
    /// [`Store::stage_object`], in this shard.
    pub fn stage_object(&self) -> Result<ObjectStager, StoreError> {
        ObjectStager::new(&self.0)
    }
}

impl ObjectStager {
    /// Starts staging an object in `staging`: see [`Store::stage_object`].
    fn new(staging: &Arc<Staging>) -> Result<ObjectStager, StoreError> {
        Self::new_in(staging, false)
    }

    /// Starts staging an object in `staging`, as an unnamed (`O_TMPFILE`)
    /// file if `anonymous` (see [`Publisher`](crate::Publisher)).
    pub(crate) fn new_in(
        staging: &Arc<Staging>,
        anonymous: bool,
    ) -> Result<ObjectStager, StoreError> {
        let mode_set = process_umask().is_some_and(|m| m & OBJECT_MODE == 0);
        let mode = if mode_set { OBJECT_MODE } else { 0o600 };
        let tmp = if anonymous {
            staging.anon_file(mode)?
        } else {
            staging.tmp_file_mode("o", mode)?
        };
        Ok(ObjectStager {
            tmp,
            hasher: FsVerityHasher::new(),
            len: 0,
            hole_at_end: false,
            mode_set,
        })
    }

    /// Appends `data`.
    pub fn write(&mut self, data: &[u8]) -> Result<(), StoreError> {
        if self.hole_at_end {
            self.tmp
                .file()
                .seek(SeekFrom::Start(self.len))
                .map_err(|e| self.tmp.err("seeking in object", e))?;
            self.hole_at_end = false;
        }
        self.hasher.update(data);
        self.tmp
            .file()
            .write_all(data)
            .map_err(|e| self.tmp.err("writing object", e))?;
        self.len += data.len() as u64;
        Ok(())
    }

    /// Appends `len` zero bytes as a hole (no disk space where the
    /// filesystem can). Hashing a hole takes O(log len) time
    /// ([`FsVerityHasher::update_zeros`]), so a hole costs nothing like
    /// its length; what the largest hole may be is the caller's limit.
    pub fn hole(&mut self, len: u64) -> Result<(), StoreError> {
        self.len = self.len.checked_add(len).ok_or_else(|| {
            self.tmp.err(
                "extending object",
                io::Error::new(io::ErrorKind::InvalidInput, "object size overflows 64 bits"),
            )
        })?;
        self.hasher.update_zeros(len);
        self.hole_at_end = true;
        Ok(())
    }

    /// Bytes so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Completes the file. If the store has the object already, the staged
    /// copy is dropped at once.
    pub fn finish(self, store: &Store) -> Result<StagedObject, StoreError> {
        self.finish_with(|id| store.may_have_object(id))
    }

    /// [`finish`](Self::finish), asking `in_store` whether the store has
    /// the object already.
    pub(crate) fn finish_with(
        mut self,
        in_store: impl FnOnce(&ObjectId) -> bool,
    ) -> Result<StagedObject, StoreError> {
        if self.hole_at_end {
            self.tmp
                .file()
                .set_len(self.len)
                .map_err(|e| self.tmp.err("extending object", e))?;
        }
        let id = self.hasher.finalize();
        if in_store(&id) {
            return Ok(StagedObject {
                id,
                size: self.len,
                tmp: None,
            });
        }
        if !self.mode_set {
            self.tmp
                .file()
                .set_permissions(fs::Permissions::from_mode(OBJECT_MODE))
                .map_err(|e| self.tmp.err("setting mode of object", e))?;
        }
        // Closed now (a layer may stage more files than a process may hold
        // open), except an unnamed file, which closing would free.
        if !self.tmp.is_anonymous() {
            self.tmp.close();
        }
        Ok(StagedObject {
            id,
            size: self.len,
            tmp: Some(self.tmp),
        })
    }
}

/// The mode of an object file.
const OBJECT_MODE: u32 = 0o644;

/// More changed fan-out directories than this are made durable by one
/// `syncfs` rather than an fsync each.
pub const SYNCFS_DIRS: usize = 8;

/// The process's umask, as `/proc/self/status` says (read once; cairn
/// never changes it), or `None` if it cannot be read. `umask(2)` cannot
/// read it without setting it, which races with other threads.
fn process_umask() -> Option<u32> {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(line.trim(), 8).ok()
    })
}

/// A layer directory being built in the staging area; see
/// [`Store::layer_writer`].
#[derive(Debug)]
pub struct LayerRecordWriter {
    staging: Arc<Staging>,
    dir: PathBuf,
    entries: File,
    done: bool,
}

impl LayerRecordWriter {
    /// The entries file, to write the layer's entry lines into.
    pub fn entries(&mut self) -> &mut File {
        &mut self.entries
    }

    /// The entries file opened again, read-only and at its start: what was
    /// written to it so far, for a reader beside the writer.
    pub fn open_entries(&self) -> Result<File, StoreError> {
        let path = self.dir.join(LAYER_ENTRIES_FILE);
        File::open(&path).map_err(|e| self.err("opening layer entries", &path, e))
    }

    fn err(&self, op: &'static str, path: &Path, e: io::Error) -> StoreError {
        StoreError::io(op, path, self.staging.root(), e)
    }

    /// Writes `record`, syncs both files and renames the directory to
    /// `layers/<diff_id>`. Every object the entries name must be published
    /// already. Returns false if the layer was there already (ours is
    /// dropped).
    pub fn commit(mut self, store: &Store, record: &LayerRecord) -> Result<bool, StoreError> {
        if !is_diff_id(&record.diff_id) {
            return Err(bad_diff_id(self.staging.root(), &record.diff_id));
        }
        let entries_path = self.dir.join(LAYER_ENTRIES_FILE);
        self.entries
            .sync_all()
            .map_err(|e| self.err("syncing layer entries", &entries_path, e))?;
        let json_path = self.dir.join(LAYER_RECORD_FILE);
        let json = serde_json::to_vec_pretty(record).expect("layer records serialise");
        write_new_file(&json_path, &json).map_err(|e| self.err("writing", &json_path, e))?;
        sync_dir(&self.dir, self.staging.root())?;
        let dest = store.layer_dir(&record.diff_id);
        // Twice at most: a record of an older format (or an unreadable one)
        // in the way is set aside once and ours takes its place.
        for attempt in 0..2 {
            match renameat_with(CWD, &self.dir, CWD, &dest, RenameFlags::NOREPLACE) {
                Ok(()) => {
                    self.done = true;
                    sync_dir(&store.layers_dir(), &store.root)?;
                    return Ok(true);
                }
                Err(Errno::EXIST | Errno::NOTEMPTY) => {
                    if attempt > 0 || matches!(store.layer_record(&record.diff_id), Ok(Some(_))) {
                        return Ok(false);
                    }
                    self.set_aside(&dest)?;
                }
                Err(e) => {
                    return Err(StoreError::io(
                        "renaming into",
                        &dest,
                        &store.root,
                        e.into(),
                    ))
                }
            }
        }
        Ok(false)
    }

    /// Moves a stale layer directory out of `layers/` into the staging
    /// area and removes it there (someone else may have done so already).
    fn set_aside(&self, dest: &Path) -> Result<(), StoreError> {
        let tmp = self.staging.tmp_file("stale-layer")?;
        let mut aside = tmp.path().as_os_str().to_owned();
        aside.push(".d");
        let aside = PathBuf::from(aside);
        drop(tmp);
        match renameat_with(CWD, dest, CWD, &aside, RenameFlags::NOREPLACE) {
            Ok(()) => {
                fs::remove_dir_all(&aside)
                    .map_err(|e| self.err("removing stale layer record", &aside, e))?;
                Ok(())
            }
            Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(self.err("setting aside stale layer record", dest, e.into())),
        }
    }
}

impl Drop for LayerRecordWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

fn write_new_file(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    f.write_all(data)?;
    f.set_permissions(fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE))?;
    f.sync_all()
}

impl Store {
    /// `layers/<diff_id>` (a directory). `diff_id` should pass
    /// [`is_diff_id`].
    pub fn layer_dir(&self, diff_id: &str) -> PathBuf {
        debug_assert!(is_diff_id(diff_id), "bad diff_id {diff_id:?}");
        self.layers_dir().join(diff_id)
    }

    /// Whether a complete record of the layer, in the format this build
    /// reads, is in the store.
    pub fn has_layer_record(&self, diff_id: &str) -> bool {
        is_diff_id(diff_id) && matches!(self.layer_record(diff_id), Ok(Some(_)))
    }

    /// The layer's record, or `None` if the store does not have the layer.
    pub fn layer_record(&self, diff_id: &str) -> Result<Option<LayerRecord>, StoreError> {
        if !is_diff_id(diff_id) {
            return Err(bad_diff_id(&self.root, diff_id));
        }
        let path = self.layer_dir(diff_id).join(LAYER_RECORD_FILE);
        let Some(data) = self.read_record_file(&path)? else {
            return Ok(None);
        };
        let rec: LayerRecord =
            serde_json::from_slice(&data).map_err(|e| StoreError::CorruptLayer {
                diff_id: diff_id.to_owned(),
                root: self.root.clone(),
                reason: format!("{LAYER_RECORD_FILE}: {e}"),
            })?;
        if rec.diff_id != diff_id || rec.format != LAYER_FORMAT {
            return Err(StoreError::CorruptLayer {
                diff_id: diff_id.to_owned(),
                root: self.root.clone(),
                reason: format!(
                    "{LAYER_RECORD_FILE} describes {} in format {} (this build reads format \
                     {LAYER_FORMAT}; importing the layer again replaces it)",
                    rec.diff_id, rec.format
                ),
            });
        }
        Ok(Some(rec))
    }

    /// `layers/<diff_id>/entries`.
    pub fn layer_entries_path(&self, diff_id: &str) -> PathBuf {
        self.layer_dir(diff_id).join(LAYER_ENTRIES_FILE)
    }

    /// The objects the layer's entries name (each once, sorted), read from
    /// the PAYLOAD field of its lines without parsing the rest.
    pub fn layer_record_objects(&self, diff_id: &str) -> Result<Vec<ObjectId>, StoreError> {
        if !is_diff_id(diff_id) {
            return Err(bad_diff_id(&self.root, diff_id));
        }
        let path = self.layer_entries_path(diff_id);
        let file =
            File::open(&path).map_err(|e| StoreError::io("opening", &path, &self.root, e))?;
        let mut out = BTreeSet::new();
        let mut line = Vec::new();
        let mut r = BufReader::with_capacity(1 << 20, file);
        loop {
            line.clear();
            let n = r
                .read_until(b'\n', &mut line)
                .map_err(|e| StoreError::io("reading", &path, &self.root, e))?;
            if n == 0 {
                break;
            }
            // PATH SIZE MODE NLINK UID GID RDEV MTIME PAYLOAD …: hardlink
            // lines (MODE starting with '@') name a path, not an object.
            let mut fields = line.split(|&b| b == b' ');
            let mode = fields.nth(2);
            if mode.is_some_and(|m| m.starts_with(b"@")) {
                continue;
            }
            if let Some(payload) = fields.nth(5) {
                if let Some(id) = object_id_of_payload(payload) {
                    out.insert(id);
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Starts a new layer directory in the staging area.
    pub fn layer_writer(&self) -> Result<LayerRecordWriter, StoreError> {
        let staging = self.staging()?;
        let tmp = staging.tmp_file("layer")?;
        // A directory named like the (unique) file, which we then drop.
        // `layer.<n>.d`: with_extension would drop the unique `<n>` and
        // make concurrent layer writers of one Store collide.
        let mut dir = tmp.path().as_os_str().to_owned();
        dir.push(".d");
        let dir = PathBuf::from(dir);
        fs::DirBuilder::new()
            .mode(crate::PRIVATE_DIR_MODE)
            .create(&dir)
            .map_err(|e| StoreError::io("creating", &dir, &self.root, e))?;
        drop(tmp);
        fs::set_permissions(&dir, fs::Permissions::from_mode(crate::PRIVATE_DIR_MODE))
            .map_err(|e| StoreError::io("setting mode of", &dir, &self.root, e))?;
        let entries_path = dir.join(LAYER_ENTRIES_FILE);
        let entries = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&entries_path)
            .map_err(|e| StoreError::io("creating", &entries_path, &self.root, e))?;
        fs::set_permissions(
            &entries_path,
            fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE),
        )
        .map_err(|e| StoreError::io("setting mode of", &entries_path, &self.root, e))?;
        Ok(LayerRecordWriter {
            staging,
            dir,
            entries,
            done: false,
        })
    }

    /// Starts staging an object's content.
    ///
    /// The file is created with the object's mode (0644) when the umask
    /// leaves it whole, else private and set at [`ObjectStager::finish`]:
    /// either way its mode is 0644 before it is published. (The staging
    /// directory is 0700: nobody else can open it meanwhile.)
    pub fn stage_object(&self) -> Result<ObjectStager, StoreError> {
        ObjectStager::new(&self.staging()?)
    }

    /// A staging directory of its own for one thread that stages many
    /// objects ([`ObjectShard::stage_object`]); see [`Staging::shard`].
    pub fn object_shard(&self) -> Result<ObjectShard, StoreError> {
        Ok(ObjectShard(self.staging()?.shard()?))
    }

    /// Starts writing every staged file to disk and waits for it, as the
    /// sync before publishing will (`syncfs(2)`): called now and then while
    /// a long import stages files, it makes the disk work while the CPUs
    /// do, and leaves that last sync little to wait for.
    pub fn sync_staged(&self) -> Result<(), StoreError> {
        let staging = self.staging()?;
        rustix::fs::syncfs(staging.dir())
            .map_err(|e| StoreError::io("syncing", staging.path(), &self.root, e.into()))
    }

    /// Publishes staged objects: one `syncfs` for all of them (rather than
    /// an fsync each), fs-verity where the kernel has it, then a rename
    /// each (never replacing) and a sync of the fan-out directories that
    /// changed (an fsync each, or one more `syncfs` when more than
    /// [`SYNCFS_DIRS`] changed).
    pub fn publish_staged(
        &self,
        objects: impl IntoIterator<Item = StagedObject>,
    ) -> Result<(), StoreError> {
        let objects: Vec<(ObjectId, TmpFile)> = objects
            .into_iter()
            .filter_map(|o| o.tmp.map(|t| (o.id, t)))
            .collect();
        self.publish_files(objects).map(|_| ())
    }

    /// Publishes closed staged files as the objects they hash to, as
    /// [`publish_staged`](Self::publish_staged) says; how many were new
    /// (the others were in the store already, and are dropped).
    pub(crate) fn publish_files(
        &self,
        objects: Vec<(ObjectId, TmpFile)>,
    ) -> Result<usize, StoreError> {
        if objects.is_empty() {
            return Ok(0);
        }
        self.sync_staged()?;
        let verity = self.verity_supported();
        // Each fan-out directory once (not once per object): at most 256
        // `mkdir`s, whatever the number of objects.
        let mut fanouts = [false; 256];
        let mut new_fanout = false;
        for (id, _) in &objects {
            let b = id.0[0];
            if std::mem::replace(&mut fanouts[b as usize], true) {
                continue;
            }
            let fanout = self.objects_dir().join(format!("{b:02x}"));
            match fs::DirBuilder::new().mode(0o755).create(&fanout) {
                Ok(()) => {
                    fs::set_permissions(&fanout, fs::Permissions::from_mode(0o755))
                        .map_err(|e| StoreError::io("setting mode of", &fanout, &self.root, e))?;
                    new_fanout = true;
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(StoreError::io("creating", &fanout, &self.root, e)),
            }
            self.fanouts().set(b);
        }
        if new_fanout {
            sync_dir(&self.objects_dir(), &self.root)?;
        }
        // Grouped by fan-out directory, each opened once: the renames go
        // from one directory descriptor to another, with no path walked
        // from `/`. (Renames between two directories take a lock of the
        // whole filesystem, so more threads would only wait for each
        // other.)
        let mut by_fanout: Vec<Vec<(ObjectId, TmpFile)>> = (0..256).map(|_| Vec::new()).collect();
        for (id, tmp) in objects {
            by_fanout[id.0[0] as usize].push((id, tmp));
        }
        let mut created = 0;
        // The fan-out directories that got new entries and still need a
        // sync: few are synced one by one; past SYNCFS_DIRS, one `syncfs`
        // after the last rename does for all of them (a Linux-tree layer
        // touches all 256: 256 directory fsyncs took ~1 s, each a
        // synchronous write and cache flush of its own).
        let mut changed: Vec<(File, PathBuf)> = Vec::new();
        for (b, objs) in by_fanout.into_iter().enumerate() {
            if objs.is_empty() {
                continue;
            }
            let fanout = self.objects_dir().join(format!("{b:02x}"));
            let dir = File::open(&fanout)
                .map_err(|e| StoreError::io("opening", &fanout, &self.root, e))?;
            let before = created;
            for (id, tmp) in objs {
                if verity {
                    self.enable_verity(&tmp)?;
                }
                let hex = id.to_hex();
                let name = Path::new(&hex[2..]);
                if tmp.persist_at(&dir, name, &fanout.join(name), false)? == Persisted::Created {
                    created += 1;
                }
            }
            if created > before {
                changed.push((dir, fanout));
            }
        }
        if changed.len() > SYNCFS_DIRS {
            let objects = self.objects_dir();
            rustix::fs::syncfs(&changed[0].0)
                .map_err(|e| StoreError::io("syncing", &objects, &self.root, e.into()))?;
        } else {
            for (dir, fanout) in changed {
                dir.sync_all()
                    .map_err(|e| StoreError::io("syncing directory", &fanout, &self.root, e))?;
            }
        }
        Ok(created)
    }

    /// `images/<digest>.json`.
    pub fn image_record_path(&self, digest: &str) -> PathBuf {
        debug_assert!(is_image_digest(digest), "bad image digest {digest:?}");
        self.images_dir().join(format!("{digest}.json"))
    }

    /// `images/<digest>.lazy-index`: the object index of an incomplete
    /// image ([`LazySource`]).
    pub fn lazy_index_path(&self, digest: &str) -> PathBuf {
        debug_assert!(is_image_digest(digest), "bad image digest {digest:?}");
        self.images_dir().join(format!("{digest}.lazy-index"))
    }

    /// `images/<digest>.lazy-names`: for an incomplete eStargz image, the
    /// files its lazy layer stored, one `<sha256 hex> <object id>` line
    /// each (docs/lazy-format.md). Goes with the image.
    pub fn lazy_names_path(&self, digest: &str) -> PathBuf {
        debug_assert!(is_image_digest(digest), "bad image digest {digest:?}");
        self.images_dir().join(format!("{digest}.lazy-names"))
    }

    /// The objects an image's lazy-names file names (none without one;
    /// lines that are not two ids are skipped). gc keeps them with the
    /// image.
    pub(crate) fn lazy_named_objects(&self, digest: &str) -> Vec<crate::ObjectId> {
        self.lazy_names(digest).into_values().collect()
    }

    /// An image's lazy-names map: the name its EROFS image uses for a file
    /// (an eStargz file's sha256) → the object the lazy layer stored it
    /// as. Empty without a lazy-names file; lines that are not two ids are
    /// skipped. The objects need not be present (a crash between a line
    /// and the publication leaves a line naming nothing).
    pub fn lazy_names(
        &self,
        digest: &str,
    ) -> std::collections::HashMap<crate::ObjectId, crate::ObjectId> {
        let Ok(text) = fs::read_to_string(self.lazy_names_path(digest)) else {
            return Default::default();
        };
        let id = |hex: &str| {
            let mut raw = [0u8; 32];
            hex::decode_to_slice(hex, &mut raw).ok()?;
            Some(crate::ObjectId(raw))
        };
        text.lines()
            .filter_map(|l| {
                let (name, stored) = l.split_once(' ')?;
                Some((id(name)?, id(stored)?))
            })
            .collect()
    }

    /// Writes (or replaces) the lazy index of an image that is in the
    /// store: staged, synced, renamed. Written before the record that
    /// names it.
    pub fn write_lazy_index(&self, digest: &str, data: &[u8]) -> Result<(), StoreError> {
        if !is_image_digest(digest) {
            return Err(StoreError::InvalidImageDigest(digest.to_owned()));
        }
        if !self.has_image(digest) {
            return Err(StoreError::ImageNotFound {
                digest: digest.to_owned(),
                root: self.root.clone(),
            });
        }
        let tmp = self.staging()?.tmp_file("lazy-index")?;
        let mut f = tmp.file();
        f.write_all(data)
            .map_err(|e| tmp.err("writing lazy index", e))?;
        f.set_permissions(fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE))
            .map_err(|e| tmp.err("setting mode of lazy index", e))?;
        f.sync_all().map_err(|e| tmp.err("syncing lazy index", e))?;
        tmp.persist(&self.lazy_index_path(digest), true)?;
        sync_dir(&self.images_dir(), &self.root)
    }

    /// Removes the lazy index of an image that is complete now (after its
    /// record says so); gone already is fine.
    pub fn remove_lazy_index(&self, digest: &str) -> Result<(), StoreError> {
        if !is_image_digest(digest) {
            return Err(StoreError::InvalidImageDigest(digest.to_owned()));
        }
        let path = self.lazy_index_path(digest);
        match fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.images_dir(), &self.root),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("removing", &path, &self.root, e)),
        }
    }

    /// Writes (or replaces) the record of an image that is in the store.
    pub fn write_image_record(&self, record: &ImageRecord) -> Result<(), StoreError> {
        let digest = &record.image_digest;
        if !is_image_digest(digest) {
            return Err(StoreError::InvalidImageDigest(digest.clone()));
        }
        if !self.has_image(digest) {
            return Err(StoreError::ImageNotFound {
                digest: digest.clone(),
                root: self.root.clone(),
            });
        }
        let json = serde_json::to_vec_pretty(record).expect("image records serialise");
        let tmp = self.staging()?.tmp_file("record")?;
        let mut f = tmp.file();
        f.write_all(&json)
            .and_then(|()| f.write_all(b"\n"))
            .map_err(|e| tmp.err("writing image record", e))?;
        f.set_permissions(fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE))
            .map_err(|e| tmp.err("setting mode of image record", e))?;
        f.sync_all()
            .map_err(|e| tmp.err("syncing image record", e))?;
        tmp.persist(&self.image_record_path(digest), true)?;
        sync_dir(&self.images_dir(), &self.root)
    }

    /// The record of an image, `None` if it has none (made by `mkfs`, or
    /// missing).
    pub fn image_record(&self, digest: &str) -> Result<Option<ImageRecord>, StoreError> {
        if !is_image_digest(digest) {
            return Err(StoreError::InvalidImageDigest(digest.to_owned()));
        }
        let path = self.image_record_path(digest);
        let Some(data) = self.read_record_file(&path)? else {
            return Ok(None);
        };
        serde_json::from_slice(&data)
            .map(Some)
            .map_err(|e| StoreError::CorruptImage {
                digest: digest.to_owned(),
                root: self.root.clone(),
                reason: format!("image record {digest}.json: {e}"),
            })
    }

    fn read_record_file(&self, path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io("opening", path, &self.root, e)),
        };
        let mut data = Vec::new();
        io::Read::read_to_end(&mut io::Read::take(file, MAX_RECORD_JSON + 1), &mut data)
            .map_err(|e| StoreError::io("reading", path, &self.root, e))?;
        if data.len() as u64 > MAX_RECORD_JSON {
            return Err(StoreError::io(
                "reading",
                path,
                &self.root,
                io::Error::new(io::ErrorKind::InvalidData, "record larger than 64 MiB"),
            ));
        }
        Ok(Some(data))
    }
}

fn bad_diff_id(root: &Path, diff_id: &str) -> StoreError {
    StoreError::CorruptLayer {
        diff_id: diff_id.chars().take(100).collect(),
        root: root.to_path_buf(),
        reason: "not a layer name: expected a diff_id, sha256:<64 lowercase hex digits>".into(),
    }
}

/// The object a dumpfile line's PAYLOAD (`ab/cdef…`, or with a leading `/`) names.
fn object_id_of_payload(payload: &[u8]) -> Option<ObjectId> {
    let p = payload.strip_prefix(b"/").unwrap_or(payload);
    if p.len() != 65 || p[2] != b'/' {
        return None;
    }
    let hex: Vec<u8> = p[..2].iter().chain(&p[3..]).copied().collect();
    let hex = std::str::from_utf8(&hex).ok()?;
    if !is_lower_hex(hex) {
        return None;
    }
    ObjectId::from_hex(hex).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ref_names_round_trip() {
        for name in [
            "debian",
            "debian:bookworm",
            "127.0.0.1:5000/library/debian:bookworm",
            "docker.io/library/alpine@sha256:abcd",
            "100%/x",
            ".hidden",
            "a..b",
            "tab\there",
        ] {
            let r = ref_name_for(name);
            crate::validate_ref_name(&r).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(image_name_for(&r), name);
        }
        assert_eq!(ref_name_for("debian:12"), "debian:12");
        assert_eq!(ref_name_for("a/b:c"), "a%2Fb:c");
    }

    #[test]
    fn diff_ids() {
        assert!(is_diff_id(&format!("sha256:{}", "a".repeat(64))));
        assert!(!is_diff_id(&format!("sha256:{}", "A".repeat(64))));
        assert!(!is_diff_id(&"a".repeat(64)));
        assert!(!is_diff_id("sha256:../x"));
    }
}
