//! The snapshotter's own metadata: one record per snapshot, and an index
//! from snapshot keys to records.
//!
//! # On disk
//!
//! ```text
//! $CAIRN_ROOT/snapshots/          0700
//! ├── lock                        flock'ed exclusively by the running snapshotter
//! ├── meta/<id>.json              one Record per snapshot (the truth)
//! ├── names/<sha256 of key>       "<id>\n": the name index
//! ├── tmp/                        staging for the two above, and removals
//! ├── chains/<image digest>/      mount points of chain images (snap/chain.rs)
//! └── <id>/fs, <id>/work          an active snapshot's directories
//! ```
//!
//! # Crash safety
//!
//! Every file is written under `tmp/` and renamed into place, so a reader
//! sees a record whole or not at all. A record is fsynced before its
//! rename and the directory after it (a removal: the directory after the
//! unlink), so a call that returned has its record on disk. The record is
//! the truth: a name index entry is believed only if the record it names
//! exists and carries the same key, so the order of the two writes (record
//! first, then index; index removed after the record) never makes a
//! half-done operation visible. At start the records are read and the
//! index is made to agree with them, so the index need not be durable:
//! its entries are renamed into place without an fsync of the file or of
//! `names/` (a crash may lose or keep an entry; the start repairs either).
//! That halves the syncs of a call: a container's Prepare is 2 (the
//! record and `meta/`), not 4 (docs/snapshotter.md, "Where the time goes").

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Version of the record format.
pub const RECORD_FORMAT: u32 = 1;
/// Largest record read back (labels are bounded by containerd: 4 KiB each).
const MAX_RECORD: u64 = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Active,
    View,
    Committed,
}

/// Nanoseconds since the epoch (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Time {
    pub sec: i64,
    pub nsec: u32,
}

impl Time {
    pub fn now() -> Time {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Time {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        }
    }
}

/// What a committed snapshot is in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    /// `sha256:<hex>` of the layer's tar stream: its name under `layers/`.
    pub diff_id: String,
    /// The diff_ids of the chain, bottom first, ending with `diff_id`.
    pub chain: Vec<String>,
    /// The chain's EROFS image (hex sha256): its name under `images/`.
    pub image: String,
    /// The ref that keeps `image` alive for gc.
    pub ref_name: String,
    /// Bytes of the layer's tar stream (the layer record's `size`).
    pub size: u64,
    /// Entries of the layer (the layer record's `entries`).
    pub entries: u64,
    /// Set for a layer the remote path placed in a whole image it pulled
    /// (docs/snapshotter.md, "The remote path"): `image` is the whole
    /// image's EROFS image. Pulled lazily (an incomplete image), the store
    /// has no layer records for its chain; pulled in full, it has, and the
    /// field is set for the intermediate layers only (`partial`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy: Option<LazyChain>,
}

/// Where a layer placed in a whole image came from, so that its chain can
/// be pulled in full, and its chain's own image assembled, when the whole
/// image is not enough.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LazyChain {
    /// The image reference the layer was pulled from (CRI label).
    pub image_ref: String,
    /// The manifest digest the pull resolved to.
    pub manifest_digest: String,
    /// `image` is the whole image's tree, not this chain's: an
    /// intermediate layer. Mounting on it first pulls the image in full
    /// (if the store lacks the chain's layer records) and assembles the
    /// chain's own image.
    pub partial: bool,
}

/// `meta/<id>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub format: u32,
    pub id: u64,
    pub key: String,
    pub kind: Kind,
    /// The key of the committed parent, if any.
    pub parent: Option<String>,
    /// For an active or view snapshot with a parent: the parent's chain
    /// image, mounted under `chains/` while such snapshots exist.
    pub parent_image: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub created: Time,
    pub updated: Time,
    /// Set for committed snapshots.
    pub layer: Option<Layer>,
}

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a snapshot record: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> MetaError + '_ {
    move |source| MetaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The records of one snapshotter root, loaded in memory.
#[derive(Debug)]
pub struct Meta {
    dir: PathBuf,
    by_key: HashMap<String, Record>,
    next_id: u64,
}

fn mkdir_private(p: &Path) -> Result<(), MetaError> {
    match fs::DirBuilder::new().mode(0o700).create(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err(p)(e)),
    }
}

fn sync_dir(p: &Path) -> Result<(), MetaError> {
    count_sync();
    File::open(p).and_then(|f| f.sync_all()).map_err(io_err(p))
}

/// Whether a write or removal must be on disk when the call returns (a
/// record), or may be lost in a crash (an index entry, which the start
/// rebuilds from the records).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durable {
    Yes,
    No,
}

#[cfg(test)]
thread_local! {
    /// fsyncs issued by this thread (the tests count a call's).
    static SYNCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count_sync() {
    #[cfg(test)]
    SYNCS.with(|c| c.set(c.get() + 1));
}

/// The name of a key's index file.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

impl Meta {
    /// Opens (creating) the metadata under `dir` and loads every record.
    pub fn open(dir: &Path) -> Result<Meta, MetaError> {
        mkdir_private(dir)?;
        for sub in ["meta", "names", "tmp"] {
            mkdir_private(&dir.join(sub))?;
        }
        let mut m = Meta {
            dir: dir.to_path_buf(),
            by_key: HashMap::new(),
            next_id: 1,
        };
        // Leftovers of writes a crash interrupted.
        let tmp = dir.join("tmp");
        for e in fs::read_dir(&tmp).map_err(io_err(&tmp))? {
            let e = e.map_err(io_err(&tmp))?;
            let p = e.path();
            let r = if e.file_type().map_err(io_err(&p))?.is_dir() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
            if let Err(err) = r {
                tracing::warn!("cannot remove {}: {err}", p.display());
            }
        }
        let meta = dir.join("meta");
        for e in fs::read_dir(&meta).map_err(io_err(&meta))? {
            let e = e.map_err(io_err(&meta))?;
            let p = e.path();
            let name = e.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                tracing::warn!("ignoring {} (not a record name)", p.display());
                continue;
            };
            let rec = read_record(&p)?;
            if rec.id != id {
                return Err(MetaError::Corrupt {
                    path: p,
                    reason: format!("holds id {}", rec.id),
                });
            }
            m.next_id = m.next_id.max(id + 1);
            if let Some(old) = m.by_key.insert(rec.key.clone(), rec) {
                return Err(MetaError::Corrupt {
                    path: p,
                    reason: format!("key {:?} also in record {}", old.key, old.id),
                });
            }
        }
        m.repair_index()?;
        Ok(m)
    }

    /// Makes `names/` hold exactly one entry per record.
    fn repair_index(&mut self) -> Result<(), MetaError> {
        let names = self.dir.join("names");
        let want: HashMap<String, u64> = self
            .by_key
            .values()
            .map(|r| (key_hash(&r.key), r.id))
            .collect();
        for e in fs::read_dir(&names).map_err(io_err(&names))? {
            let e = e.map_err(io_err(&names))?;
            let n = e.file_name().to_string_lossy().into_owned();
            let good = want
                .get(&n)
                .is_some_and(|id| read_index(&e.path()).ok() == Some(*id));
            if !good {
                fs::remove_file(e.path()).map_err(io_err(&e.path()))?;
            }
        }
        for r in self.by_key.values() {
            let p = names.join(key_hash(&r.key));
            if read_index(&p).ok() != Some(r.id) {
                write_atomic(&self.dir, &p, format!("{}\n", r.id).as_bytes(), Durable::No)?;
            }
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn get(&self, key: &str) -> Option<&Record> {
        self.by_key.get(key)
    }

    pub fn records(&self) -> impl Iterator<Item = &Record> {
        self.by_key.values()
    }

    /// A fresh id (never used by a record of this root).
    pub fn allocate_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn record_path(&self, id: u64) -> PathBuf {
        self.dir.join("meta").join(format!("{id}.json"))
    }

    /// Looks `key` up through the name index, as a reader without the
    /// in-memory map would (used by tests to check the index).
    pub fn lookup_on_disk(&self, key: &str) -> Option<Record> {
        let id = read_index(&self.dir.join("names").join(key_hash(key))).ok()?;
        let rec = read_record(&self.record_path(id)).ok()?;
        (rec.key == key).then_some(rec)
    }

    /// Writes `rec` (new or replacing the record with its id) and its index
    /// entry. If `old_key` is given and differs, that key's index entry is
    /// removed after (a commit renames a snapshot).
    pub fn put(&mut self, rec: Record, old_key: Option<&str>) -> Result<(), MetaError> {
        let data = serde_json::to_vec_pretty(&rec).expect("records serialise");
        write_atomic(&self.dir, &self.record_path(rec.id), &data, Durable::Yes)?;
        let idx = self.dir.join("names").join(key_hash(&rec.key));
        write_atomic(
            &self.dir,
            &idx,
            format!("{}\n", rec.id).as_bytes(),
            Durable::No,
        )?;
        if let Some(old) = old_key.filter(|o| *o != rec.key) {
            let p = self.dir.join("names").join(key_hash(old));
            remove_file(&p, Durable::No)?;
            self.by_key.remove(old);
        }
        self.by_key.insert(rec.key.clone(), rec);
        Ok(())
    }

    /// Removes the record of `key` and then its index entry.
    pub fn remove(&mut self, key: &str) -> Result<Option<Record>, MetaError> {
        let Some(rec) = self.by_key.get(key) else {
            return Ok(None);
        };
        remove_file(&self.record_path(rec.id), Durable::Yes)?;
        remove_file(&self.dir.join("names").join(key_hash(key)), Durable::No)?;
        Ok(self.by_key.remove(key))
    }
}

fn remove_file(p: &Path, durable: Durable) -> Result<(), MetaError> {
    match fs::remove_file(p) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(p)(e)),
    }
    if durable == Durable::No {
        return Ok(());
    }
    sync_dir(p.parent().expect("metadata files have a parent"))
}

fn read_index(p: &Path) -> io::Result<u64> {
    let s = fs::read_to_string(p)?;
    s.trim_end()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not an id"))
}

fn read_record(p: &Path) -> Result<Record, MetaError> {
    let mut data = Vec::new();
    File::open(p)
        .and_then(|f| f.take(MAX_RECORD + 1).read_to_end(&mut data))
        .map_err(io_err(p))?;
    if data.len() as u64 > MAX_RECORD {
        return Err(MetaError::Corrupt {
            path: p.to_path_buf(),
            reason: format!("larger than {MAX_RECORD} bytes"),
        });
    }
    let rec: Record = serde_json::from_slice(&data).map_err(|e| MetaError::Corrupt {
        path: p.to_path_buf(),
        reason: e.to_string(),
    })?;
    if rec.format != RECORD_FORMAT {
        return Err(MetaError::Corrupt {
            path: p.to_path_buf(),
            reason: format!("format {} (this build reads {RECORD_FORMAT})", rec.format),
        });
    }
    Ok(rec)
}

/// Writes `data` to `dest` by a file staged in `<root>/tmp` and renamed
/// over `dest`; if `durable`, the file is fsynced before the rename and
/// the directory after it.
fn write_atomic(root: &Path, dest: &Path, data: &[u8], durable: Durable) -> Result<(), MetaError> {
    let tmp = root.join("tmp").join(format!(
        "w.{}.{}",
        std::process::id(),
        dest.file_name().unwrap_or_default().to_string_lossy()
    ));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all(data).map_err(io_err(&tmp))?;
    if durable == Durable::Yes {
        count_sync();
        f.sync_all().map_err(io_err(&tmp))?;
    }
    drop(f);
    fs::rename(&tmp, dest).map_err(io_err(dest))?;
    if durable == Durable::No {
        return Ok(());
    }
    sync_dir(dest.parent().expect("metadata files have a parent"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: u64, key: &str) -> Record {
        Record {
            format: RECORD_FORMAT,
            id,
            key: key.into(),
            kind: Kind::Active,
            parent: None,
            parent_image: None,
            labels: BTreeMap::from([("a".into(), "b".into())]),
            created: Time::now(),
            updated: Time::now(),
            layer: None,
        }
    }

    #[test]
    fn records_survive_reopen() {
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let id = m.allocate_id();
        m.put(rec(id, "ns/1/a"), None).unwrap();
        let id2 = m.allocate_id();
        m.put(rec(id2, "ns/2/b"), None).unwrap();
        drop(m);
        let m = Meta::open(d.path()).unwrap();
        assert_eq!(m.get("ns/1/a").unwrap().id, id);
        assert_eq!(m.lookup_on_disk("ns/2/b").unwrap().id, id2);
        let mut m = m;
        assert!(m.allocate_id() > id2);
    }

    #[test]
    fn rename_moves_the_index() {
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let id = m.allocate_id();
        m.put(rec(id, "active"), None).unwrap();
        let mut r = m.get("active").unwrap().clone();
        r.key = "committed".into();
        r.kind = Kind::Committed;
        m.put(r, Some("active")).unwrap();
        assert!(m.get("active").is_none());
        assert!(m.lookup_on_disk("active").is_none());
        assert_eq!(m.lookup_on_disk("committed").unwrap().kind, Kind::Committed);
        let m = Meta::open(d.path()).unwrap();
        assert_eq!(m.records().count(), 1);
    }

    /// A crash between the writes of a record leaves either the old state
    /// or the new, never a half-written record.
    #[test]
    fn half_written_records_are_never_seen() {
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let id = m.allocate_id();
        m.put(rec(id, "k"), None).unwrap();
        drop(m);
        // A crash while staging the next record: a partial file in tmp/.
        fs::write(
            d.path().join("tmp/w.1.2.json"),
            b"{\"format\":1,\"id\":2,\"ke",
        )
        .unwrap();
        // A crash between the record and its index: an index entry whose
        // record is gone, and a stale one naming a record of another key.
        fs::write(d.path().join("names").join(key_hash("gone")), b"9\n").unwrap();
        fs::write(
            d.path().join("names").join(key_hash("other")),
            format!("{id}\n"),
        )
        .unwrap();
        let m = Meta::open(d.path()).unwrap();
        assert_eq!(m.records().count(), 1);
        assert!(m.lookup_on_disk("gone").is_none());
        assert!(m.lookup_on_disk("other").is_none());
        assert_eq!(m.lookup_on_disk("k").unwrap().id, id);
        assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
        assert_eq!(fs::read_dir(d.path().join("names")).unwrap().count(), 1);
    }

    /// A record whose index entry was never written (crash after the
    /// record) is found again, and its index entry rewritten.
    #[test]
    fn missing_index_is_rebuilt() {
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let id = m.allocate_id();
        m.put(rec(id, "k"), None).unwrap();
        drop(m);
        fs::remove_file(d.path().join("names").join(key_hash("k"))).unwrap();
        let m = Meta::open(d.path()).unwrap();
        assert_eq!(m.lookup_on_disk("k").unwrap().id, id);
    }

    /// Only records are synced (the file and `meta/`: 2 syncs a write, 1 a
    /// removal); index entries are not, and a crash that lost a commit's
    /// index changes (the old key's entry still there, the new one
    /// missing) is repaired at the next start.
    #[test]
    fn only_records_are_synced() {
        let syncs = || SYNCS.with(|c| c.get());
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let id = m.allocate_id();
        let n = syncs();
        m.put(rec(id, "active"), None).unwrap();
        assert_eq!(syncs() - n, 2, "a new record");
        let mut r = m.get("active").unwrap().clone();
        r.key = "committed".into();
        r.kind = Kind::Committed;
        let n = syncs();
        m.put(r, Some("active")).unwrap();
        assert_eq!(syncs() - n, 2, "a commit's rename");
        drop(m);
        let names = d.path().join("names");
        fs::remove_file(names.join(key_hash("committed"))).unwrap();
        fs::write(names.join(key_hash("active")), format!("{id}\n")).unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        assert!(m.lookup_on_disk("active").is_none());
        assert_eq!(m.lookup_on_disk("committed").unwrap().id, id);
        let n = syncs();
        m.remove("committed").unwrap();
        assert_eq!(syncs() - n, 1, "a removal");
        assert_eq!(fs::read_dir(&names).unwrap().count(), 0);
    }

    #[test]
    fn corrupt_records_are_errors() {
        let d = tempfile::tempdir().unwrap();
        Meta::open(d.path()).unwrap();
        fs::write(d.path().join("meta/3.json"), b"{").unwrap();
        let e = Meta::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("3.json"), "{e}");
    }

    #[test]
    fn remove_drops_record_and_index() {
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let id = m.allocate_id();
        m.put(rec(id, "k"), None).unwrap();
        assert!(m.remove("k").unwrap().is_some());
        assert!(m.remove("k").unwrap().is_none());
        let m = Meta::open(d.path()).unwrap();
        assert_eq!(m.records().count(), 0);
    }

    /// A committed layer's record with and without `lazy`: a record
    /// written before the field existed reads as a full layer, and a
    /// lazily pulled one round-trips (and is written only when set).
    #[test]
    fn lazy_layers_round_trip_and_old_records_read() {
        let d = tempfile::tempdir().unwrap();
        let mut m = Meta::open(d.path()).unwrap();
        let layer = |lazy| Layer {
            diff_id: format!("sha256:{}", "1".repeat(64)),
            chain: vec![format!("sha256:{}", "1".repeat(64))],
            image: "2".repeat(64),
            ref_name: "containerd-snapshot-1".into(),
            size: 0,
            entries: 0,
            lazy,
        };
        let mut r = rec(m.allocate_id(), "full");
        r.kind = Kind::Committed;
        r.layer = Some(layer(None));
        m.put(r, None).unwrap();
        let text = fs::read_to_string(d.path().join("meta/1.json")).unwrap();
        assert!(!text.contains("lazy"), "{text}");
        let mut r = rec(m.allocate_id(), "lazy");
        r.kind = Kind::Committed;
        let lz = LazyChain {
            image_ref: "127.0.0.1:5000/a/b:1".into(),
            manifest_digest: format!("sha256:{}", "3".repeat(64)),
            partial: true,
        };
        r.layer = Some(layer(Some(lz.clone())));
        m.put(r, None).unwrap();
        let m = Meta::open(d.path()).unwrap();
        assert_eq!(m.get("full").unwrap().layer.as_ref().unwrap().lazy, None);
        assert_eq!(
            m.get("lazy").unwrap().layer.as_ref().unwrap().lazy,
            Some(lz)
        );
    }
}
