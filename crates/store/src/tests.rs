//! Unit tests of the store as a whole: imports, images, refs, locking and
//! staging cleanup, each on a fresh store in a temporary directory. None
//! needs root.

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::*;

fn new_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store")).unwrap();
    (dir, store)
}

/// Every file anywhere under `tmp/` (staging directories themselves may
/// stay while their Store lives).
fn tmp_files(store: &Store) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(&e.path(), out);
            } else {
                out.push(e.path());
            }
        }
    }
    let mut out = Vec::new();
    walk(&store.tmp_dir(), &mut out);
    out
}

fn all_objects(store: &Store) -> Vec<ObjectId> {
    let mut v: Vec<_> = store.list_objects().unwrap().map(Result::unwrap).collect();
    v.sort();
    v
}

fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
}

#[test]
fn open_creates_the_layout() {
    let (_dir, store) = new_store();
    let m = fs::metadata(store.root()).unwrap();
    assert_eq!(m.permissions().mode() & 0o7777, 0o700, "the root");
    for d in ["objects", "images", "layers", "refs", "tmp"] {
        let m = fs::metadata(store.root().join(d)).unwrap();
        assert!(m.is_dir(), "{d}");
        assert_eq!(m.permissions().mode() & 0o7777, 0o700, "{d}");
    }
    assert!(store.lock_path().is_file());
    assert_eq!(
        fs::metadata(store.lock_path()).unwrap().mode() & 0o7777,
        0o600
    );
    // Opening again is fine and changes nothing.
    Store::open(store.root()).unwrap();
}

#[test]
fn file_reader_and_bytes_imports_agree() {
    let (dir, store) = new_store();
    let content = data(3 * 4096 + 100);
    let want = fsverity_digest(&content[..]).unwrap();

    let src_path = dir.path().join("src");
    fs::write(&src_path, &content).unwrap();
    let mut src = File::open(&src_path).unwrap();
    // The file position must not matter.
    src.seek(SeekFrom::Start(1000)).unwrap();

    let a = store.import_file(&src).unwrap();
    let (b, size) = store.import_reader(&content[..]).unwrap();
    let c = store.import_bytes(&content).unwrap();
    assert_eq!((a, b, c), (want, want, want));
    assert_eq!(size, content.len() as u64);

    assert_eq!(all_objects(&store), vec![want]);
    let path = store.object_path(&want);
    assert_eq!(path, store.objects_dir().join(want.object_path()));
    assert_eq!(fs::read(&path).unwrap(), content);
    let m = fs::metadata(&path).unwrap();
    assert_eq!(m.permissions().mode() & 0o7777, 0o644);
    assert!(store.has_object(&want));
    assert!(tmp_files(&store).is_empty(), "{:?}", tmp_files(&store));
}

#[test]
fn object_lookup_agrees_with_has_object() {
    let (_dir, store) = new_store();
    let there = store.import_bytes(b"present").unwrap();
    // Same fan-out directory, other name; and a fan-out directory that
    // does not exist.
    let mut sibling = there;
    sibling.0[31] ^= 1;
    let mut elsewhere = there;
    elsewhere.0[0] ^= 0x80;
    // Not a regular file: a directory where an object would be.
    let mut dir_id = there;
    dir_id.0[30] ^= 1;
    fs::create_dir(store.object_path(&dir_id)).unwrap();
    let mut lookup = store.object_lookup();
    for (id, want) in [
        (there, true),
        (sibling, false),
        (elsewhere, false),
        (dir_id, false),
    ] {
        assert_eq!(lookup.has(&id), want, "{id}");
        assert_eq!(store.has_object(&id), want, "{id}");
    }
}

#[test]
fn first_missing_agrees_with_has_by_listing_and_by_lookup() {
    let (_dir, store) = new_store();
    let present: Vec<ObjectId> = (0..300u32)
        .map(|i| {
            store
                .import_bytes(format!("object {i}").as_bytes())
                .unwrap()
        })
        .collect();
    let mut twice = present.clone();
    twice.extend_from_slice(&present);
    let mut sibling = present[7];
    sibling.0[31] ^= 1;
    let mut dir_id = present[9];
    dir_id.0[30] ^= 1;
    fs::create_dir(store.object_path(&dir_id)).unwrap();
    // A name in a fan-out directory that is not an object's is ignored.
    let stray = store.objects_dir().join(format!("{:02x}", present[3].0[0]));
    fs::write(stray.join("not-an-object"), b"x").unwrap();
    // A fan-out directory that does not exist.
    let mut nowhere = present[0];
    nowhere.0[0] = 0;
    for id in present.iter().filter(|p| p.0[0] == 0) {
        fs::remove_file(store.object_path(id)).unwrap();
    }
    let there: Vec<ObjectId> = present.iter().filter(|p| p.0[0] != 0).copied().collect();
    for listing in [Some(true), Some(false), None] {
        let mut lookup = store.object_lookup();
        assert_eq!(
            lookup.first_missing_by(&there, listing),
            None,
            "{listing:?}"
        );
        let mut with_twice = there.clone();
        with_twice.extend_from_slice(&there);
        assert_eq!(lookup.first_missing_by(&with_twice, listing), None);
        for absent in [sibling, dir_id, nowhere] {
            assert!(!store.has_object(&absent), "{absent}");
            let mut ids = there.clone();
            ids.insert(ids.len() / 2, absent);
            assert_eq!(
                lookup.first_missing_by(&ids, listing),
                Some(absent),
                "{listing:?}"
            );
            assert_eq!(lookup.first_missing_by(&[absent], listing), Some(absent));
        }
    }
    // The objects removed from fan-out 00 are missing, the smallest first.
    let removed = present
        .iter()
        .filter(|p| p.0[0] == 0)
        .min_by_key(|p| p.0)
        .copied();
    assert_eq!(store.object_lookup().first_missing(&twice), removed);
}

#[test]
fn importing_existing_content_writes_nothing() {
    let (dir, store) = new_store();
    let id = store.import_bytes(b"same").unwrap();
    let ino = fs::metadata(store.object_path(&id)).unwrap().ino();
    let src_path = dir.path().join("src");
    fs::write(&src_path, b"same").unwrap();
    assert_eq!(
        store.import_file(&File::open(&src_path).unwrap()).unwrap(),
        id
    );
    assert_eq!(store.import_reader(&b"same"[..]).unwrap().0, id);
    assert_eq!(store.import_bytes(b"same").unwrap(), id);
    assert_eq!(fs::metadata(store.object_path(&id)).unwrap().ino(), ino);
    assert!(tmp_files(&store).is_empty());
}

#[test]
fn empty_and_small_objects() {
    let (_dir, store) = new_store();
    let empty = store.import_bytes(b"").unwrap();
    assert_eq!(
        empty.to_hex(),
        "3d248ca542a24fc62d1c43b916eae5016878e2533c88238480b26128a1f1af95"
    );
    assert_eq!(fs::metadata(store.object_path(&empty)).unwrap().len(), 0);
    let hello = store.import_bytes(b"hello world\n").unwrap();
    assert_eq!(
        store.object_path(&hello),
        store
            .root()
            .join("objects/37/061ef2ac4c21bec68489b56138c5780306a4ad7fe6676236ecdf2c9027cd92")
    );
}

#[test]
fn import_file_from_a_pipe_streams() {
    let (_dir, store) = new_store();
    let (r, w) = rustix::pipe::pipe().unwrap();
    let content = data(200_000);
    let writer = {
        let content = content.clone();
        std::thread::spawn(move || File::from(w).write_all(&content).unwrap())
    };
    let id = store.import_file(&File::from(r)).unwrap();
    writer.join().unwrap();
    assert_eq!(id, fsverity_digest(&content[..]).unwrap());
    assert_eq!(fs::read(store.object_path(&id)).unwrap(), content);
}

#[test]
fn concurrent_imports_of_the_same_content() {
    let (_dir, store) = new_store();
    let content = Arc::new(data(64 * 1024 + 17));
    let want = fsverity_digest(&content[..]).unwrap();
    std::thread::scope(|s| {
        for i in 0..8 {
            let (store, content) = (&store, Arc::clone(&content));
            s.spawn(move || {
                let id = if i % 2 == 0 {
                    store.import_reader(&content[..]).unwrap().0
                } else {
                    store.import_bytes(&content).unwrap()
                };
                assert_eq!(id, want);
            });
        }
    });
    // And from separate Stores (separate staging directories), as separate
    // processes would.
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (root, content) = (store.root().to_path_buf(), Arc::clone(&content));
            s.spawn(move || {
                let other = Store::open(&root).unwrap();
                assert_eq!(other.import_reader(&content[..]).unwrap().0, want);
            });
        }
    });
    assert_eq!(all_objects(&store), vec![want]);
    assert_eq!(fs::read(store.object_path(&want)).unwrap(), *content);
    assert!(tmp_files(&store).is_empty(), "{:?}", tmp_files(&store));
}

/// Yields `good` bytes, then fails.
struct FailingReader {
    left: usize,
}

impl Read for FailingReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "peer went away",
            ));
        }
        let n = buf.len().min(self.left).min(10_000);
        buf[..n].fill(b'x');
        self.left -= n;
        Ok(n)
    }
}

#[test]
fn reader_failing_half_way_leaves_nothing() {
    let (_dir, store) = new_store();
    let err = store
        .import_reader(FailingReader { left: 300_000 })
        .unwrap_err();
    assert!(matches!(err, StoreError::Source { .. }), "{err:?}");
    assert_eq!(
        err.io_error().unwrap().kind(),
        io::ErrorKind::ConnectionReset
    );
    assert!(err.to_string().contains("peer went away"), "{err}");
    assert!(all_objects(&store).is_empty());
    assert!(tmp_files(&store).is_empty(), "{:?}", tmp_files(&store));
}

#[test]
fn io_errors_name_the_file_and_the_store() {
    let e = StoreError::io(
        "writing object",
        Path::new("/var/lib/cairn/tmp/s.1.2.0/o.7"),
        Path::new("/var/lib/cairn"),
        io::Error::from_raw_os_error(libc::ENOSPC),
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with(
            "writing object tmp/s.1.2.0/o.7 in /var/lib/cairn: No space left on device"
        ),
        "{msg}"
    );
}

#[test]
fn unwritable_store_is_an_error_that_names_it() {
    let (dir, _store) = new_store();
    // A store whose root is a file cannot be opened.
    let not_a_dir = dir.path().join("file");
    fs::write(&not_a_dir, b"").unwrap();
    let err = Store::open(&not_a_dir.join("store")).unwrap_err();
    assert!(err.to_string().contains("file"), "{err}");
}

#[test]
fn image_writer_commit_and_drop() {
    let (_dir, store) = new_store();
    let image = data(10_000);
    let want = hex::encode(Sha256::digest(&image));

    // Dropped uncommitted: nothing anywhere.
    {
        let mut w = store.image_writer().unwrap();
        w.write_all(&image).unwrap();
        assert!(w.path().exists());
    }
    assert!(tmp_files(&store).is_empty());
    assert_eq!(store.list_images().unwrap().count(), 0);

    // Written out of order, committed.
    let mut w = store.image_writer().unwrap();
    w.seek(SeekFrom::Start(5000)).unwrap();
    w.write_all(&image[5000..]).unwrap();
    w.seek(SeekFrom::Start(0)).unwrap();
    w.write_all(&image[..5000]).unwrap();
    let digest = w.commit().unwrap();
    assert_eq!(digest, want);
    assert!(store.has_image(&digest));
    let path = store.image_path(&digest);
    assert_eq!(fs::read(&path).unwrap(), image);
    assert_eq!(
        fs::metadata(&path).unwrap().permissions().mode() & 0o7777,
        0o600,
        "images inline small files: private"
    );
    let ino = fs::metadata(&path).unwrap().ino();

    // The same image again: the first copy stays.
    let mut w = store.image_writer().unwrap();
    w.write_all(&image).unwrap();
    assert_eq!(w.commit().unwrap(), want);
    assert_eq!(fs::metadata(&path).unwrap().ino(), ino);

    let images: Vec<_> = store.list_images().unwrap().map(Result::unwrap).collect();
    assert_eq!(images, vec![want]);
    assert!(tmp_files(&store).is_empty());
}

#[test]
fn add_image_copies_a_file() {
    let (dir, store) = new_store();
    let src = dir.path().join("image.erofs");
    fs::write(&src, b"not really erofs").unwrap();
    let digest = store.add_image(&src).unwrap();
    assert_eq!(digest, hex::encode(Sha256::digest(b"not really erofs")));
    assert_eq!(
        fs::read(store.image_path(&digest)).unwrap(),
        b"not really erofs"
    );
    let err = store.add_image(&dir.path().join("missing")).unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    assert!(tmp_files(&store).is_empty());
}

#[test]
fn ref_names_are_validated() {
    let long = "a".repeat(256);
    let bad = [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/abs",
        ".hidden",
        "a..b",
        "tab\there",
        "nl\n",
        "nul\0",
        "del\x7f",
        &long,
    ];
    for name in bad {
        let err = validate_ref_name(name).unwrap_err();
        assert!(matches!(err, StoreError::InvalidRefName { .. }), "{name:?}");
    }
    for name in [
        "debian",
        "debian:bookworm",
        "a.b",
        "x@sha256:ab",
        "ünïcode",
        &"a".repeat(255),
    ] {
        validate_ref_name(name).unwrap_or_else(|e| panic!("{name:?}: {e}"));
    }
}

#[test]
fn refs_set_get_list_remove() {
    let (_dir, store) = new_store();
    let mut w = store.image_writer().unwrap();
    w.write_all(b"image one").unwrap();
    let one = w.commit().unwrap();
    let mut w = store.image_writer().unwrap();
    w.write_all(b"image two").unwrap();
    let two = w.commit().unwrap();

    assert_eq!(store.get_ref("web").unwrap(), None);
    store.set_ref("web", &one).unwrap();
    store.set_ref("db", &two).unwrap();
    assert_eq!(store.get_ref("web").unwrap(), Some(one.clone()));
    // Replaced atomically.
    store.set_ref("web", &two).unwrap();
    assert_eq!(store.get_ref("web").unwrap(), Some(two.clone()));
    assert_eq!(
        store.list_refs().unwrap(),
        vec![
            ("db".to_string(), two.clone()),
            ("web".to_string(), two.clone())
        ]
    );
    assert!(store.remove_ref("web").unwrap());
    assert!(!store.remove_ref("web").unwrap());
    assert_eq!(
        store.list_refs().unwrap(),
        vec![("db".to_string(), two.clone())]
    );

    // Bad names and values change nothing.
    for name in ["", "../escape", "a/b", "x\u{1}"] {
        assert!(store.set_ref(name, &one).is_err(), "{name:?}");
        assert!(store.get_ref(name).is_err(), "{name:?}");
        assert!(store.remove_ref(name).is_err(), "{name:?}");
    }
    let upper = one.to_uppercase();
    for digest in ["", "abc", upper.as_str(), &format!("{one}0")] {
        let err = store.set_ref("x", digest).unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidImageDigest(_)),
            "{digest:?}"
        );
    }
    let absent = "0".repeat(64);
    let err = store.set_ref("x", &absent).unwrap_err();
    assert!(matches!(err, StoreError::ImageNotFound { .. }), "{err:?}");
    assert_eq!(store.list_refs().unwrap(), vec![("db".to_string(), two)]);

    // A ref file that does not hold a digest is reported, not trusted.
    fs::write(store.refs_dir().join("broken"), b"garbage\n").unwrap();
    let err = store.get_ref("broken").unwrap_err();
    assert!(matches!(err, StoreError::CorruptRef { .. }), "{err:?}");
    assert!(tmp_files(&store).is_empty());
}

#[test]
fn lock_shared_and_exclusive() {
    let (_dir, store) = new_store();
    let s1 = store.lock_shared().unwrap();
    let s2 = store
        .try_lock_shared()
        .unwrap()
        .expect("shared locks coexist");
    assert_eq!(s2.kind(), LockKind::Shared);
    assert!(store.try_lock_exclusive().unwrap().is_none());
    drop(s1);
    assert!(store.try_lock_exclusive().unwrap().is_none());
    drop(s2);

    let x = store.try_lock_exclusive().unwrap().expect("free now");
    assert_eq!(x.kind(), LockKind::Exclusive);
    assert!(store.try_lock_shared().unwrap().is_none());
    assert!(store.try_lock_exclusive().unwrap().is_none());
    // Another Store on the same root (as another process) sees it too.
    let other = Store::open(store.root()).unwrap();
    assert!(other.try_lock_shared().unwrap().is_none());

    // A blocking exclusive lock waits for the holder: the waiter shows in
    // /proc/locks as blocked before the holder lets go, and gets the lock
    // only after. Had it not blocked, it would have sent first.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _l = other.lock_exclusive().unwrap();
            tx.send(()).unwrap();
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while flock_waiters(&store.lock_path()).is_empty() {
            assert!(rx.try_recv().is_err(), "got the lock while it was held");
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter never blocked on the lock"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(rx.try_recv().is_err(), "got the lock while it was held");
        drop(x);
        rx.recv().unwrap();
    });
    assert!(store.try_lock_exclusive().unwrap().is_some());
}

#[test]
fn stale_staging_is_cleaned_and_live_staging_is_not() {
    let (_dir, store) = new_store();
    let tmp = store.tmp_dir();

    // A live writer: another Store with an image being written.
    let live = Store::open(store.root()).unwrap();
    let writing = live.image_writer().unwrap();
    let live_file = writing.path().to_path_buf();

    // Debris a crashed writer would leave: an unlocked staging directory
    // with a half-written file, and a stray file.
    let stale = tmp.join("s.999999.1.0");
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join("o.0"), b"half").unwrap();
    fs::write(tmp.join("stray"), b"x").unwrap();

    let removed = store.clean_tmp().unwrap();
    assert_eq!(removed, 2);
    assert!(!stale.exists());
    assert!(!tmp.join("stray").exists());
    assert!(live_file.exists(), "removed a live writer's file");

    // A live writer's own cleaning does not remove its own staging either.
    assert_eq!(live.clean_tmp().unwrap(), 0);
    assert!(live_file.exists());

    drop(writing);
    assert!(!live_file.exists());
    // Once the writer's Store is gone, its directory goes too.
    let live_dir = live_file.parent().unwrap().to_path_buf();
    drop(live);
    assert!(!live_dir.exists());
    // Opening cleans as well.
    let stale2 = tmp.join("s.999999.2.0");
    fs::create_dir(&stale2).unwrap();
    Store::open(store.root()).unwrap();
    assert!(!stale2.exists());
}

#[test]
fn list_objects_skips_foreign_names() {
    let (_dir, store) = new_store();
    let a = store.import_bytes(b"a").unwrap();
    let b = store.import_bytes(b"b").unwrap();
    fs::create_dir_all(store.objects_dir().join("zz")).unwrap();
    fs::write(store.objects_dir().join("zz/not-an-object"), b"").unwrap();
    fs::write(store.objects_dir().join("README"), b"").unwrap();
    let fanout = store.object_path(&a).parent().unwrap().to_path_buf();
    fs::write(fanout.join("short"), b"").unwrap();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(all_objects(&store), want);
}

#[test]
fn verity_support_is_probed_and_imports_work_either_way() {
    let (_dir, store) = new_store();
    let support = store.verity_support();
    // Probed once: the same answer again, and no probe file left behind.
    assert_eq!(store.verity_support(), support);
    if let VeritySupport::Unsupported(reason) = &support {
        assert!(!reason.is_empty());
    }
    let id = store.import_bytes(b"sealed or not").unwrap();
    assert_eq!(fs::read(store.object_path(&id)).unwrap(), b"sealed or not");
    assert!(tmp_files(&store).is_empty(), "{:?}", tmp_files(&store));
}

/// Cleaners running all the time never break writers that are starting up
/// or writing (the mkdir/flock window in `tmp.rs`).
#[test]
fn cleaning_races_with_writers() {
    let (_dir, store) = new_store();
    let root = store.root().to_path_buf();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                store.clean_tmp().unwrap();
            }
        });
        let writers: Vec<_> = (0..3u8)
            .map(|t| {
                let root = &root;
                s.spawn(move || {
                    for i in 0..30u8 {
                        // A new Store each time: a new staging directory.
                        let w = Store::open(root).unwrap();
                        let content = [t, i, 1, 2, 3];
                        let id = w.import_reader(&content[..]).unwrap().0;
                        assert_eq!(fs::read(w.object_path(&id)).unwrap(), content);
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(all_objects(&store).len(), 90);
    assert!(tmp_files(&store).is_empty());
}

#[test]
fn batch_publishes_only_at_commit_and_dedups() {
    let (dir, store) = new_store();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let c = dir.path().join("c");
    fs::write(&a, data(100_000)).unwrap();
    fs::write(&b, data(100_000)).unwrap(); // same content as a
    fs::write(&c, data(5000)).unwrap();
    let batch = store.object_batch();
    let ia = batch.import_file(&File::open(&a).unwrap()).unwrap();
    let ib = batch.import_file(&File::open(&b).unwrap()).unwrap();
    let ic = batch.import_file(&File::open(&c).unwrap()).unwrap();
    assert_eq!(ia, ib);
    assert_eq!(batch.len(), 2, "identical content is staged once");
    assert!(
        all_objects(&store).is_empty(),
        "nothing is visible before commit"
    );
    assert_eq!(batch.commit().unwrap(), 2);
    assert_eq!(all_objects(&store).len(), 2);
    assert_eq!(fs::read(store.object_path(&ic)).unwrap(), data(5000));
    assert_eq!(
        fs::metadata(store.object_path(&ia)).unwrap().mode() & 0o777,
        0o644
    );
    assert!(tmp_files(&store).is_empty(), "{:?}", tmp_files(&store));
}

#[test]
fn dropped_batch_leaves_nothing() {
    let (dir, store) = new_store();
    let a = dir.path().join("a");
    fs::write(&a, data(70_000)).unwrap();
    {
        let batch = store.object_batch();
        batch.import_file(&File::open(&a).unwrap()).unwrap();
        assert_eq!(tmp_files(&store).len(), 1);
    }
    assert!(all_objects(&store).is_empty());
    assert!(tmp_files(&store).is_empty(), "{:?}", tmp_files(&store));
}

/// A store made wider (by hand, or by a cairn that made 0755 directories):
/// reading it changes nothing, its first write narrows the root and the
/// directories below it, and fsck reports and repairs what is left.
#[test]
fn a_wider_store_is_narrowed_by_its_next_write_and_reported_by_fsck() {
    let (dir, store) = new_store();
    let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
    let containers = store.root().join("containers");
    fs::create_dir(&containers).unwrap();
    let widen = |store: &Store| {
        for d in store.private_dirs() {
            if d.exists() {
                fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
    };
    widen(&store);

    // Opening and reading write nothing.
    let reader = Store::open(store.root()).unwrap();
    reader.list_objects().unwrap().for_each(drop);
    assert_eq!(mode(store.root()), 0o755);

    // fsck reports each wide directory (and only those: the others are
    // missing), and the extra directory it is given.
    let extra = dir.path().join("runroot");
    fs::create_dir(&extra).unwrap();
    fs::set_permissions(&extra, fs::Permissions::from_mode(0o711)).unwrap();
    let extras = [extra.as_path()];
    let opts = FsckOptions {
        private_dirs: &extras,
        ..FsckOptions::default()
    };
    let report = reader.fsck(&opts).unwrap();
    let wide: Vec<(PathBuf, u32)> = report
        .problems
        .iter()
        .filter_map(|p| match p {
            Problem::WideDirectory { path, mode } => Some((path.clone(), *mode)),
            _ => None,
        })
        .collect();
    let mut want: Vec<(PathBuf, u32)> = store
        .private_dirs()
        .into_iter()
        .filter(|d| d.exists())
        .map(|d| (d, 0o755))
        .collect();
    want.push((extra.clone(), 0o711));
    assert_eq!(wide, want);
    assert_eq!(report.problems.len(), want.len(), "{:?}", report.problems);
    assert!(report.problems[0].to_string().contains("0755"));
    assert_eq!(report.problems[0].kind(), "wide-directory");
    assert_eq!(mode(store.root()), 0o755, "a check changes nothing");

    // The first write narrows the store (not the extra directory: that is
    // the run root's owner's business).
    let writer = Store::open(store.root()).unwrap();
    writer.import_bytes(b"private").unwrap();
    for d in writer.private_dirs().iter().filter(|d| d.exists()) {
        assert_eq!(mode(d), 0o700, "{}", d.display());
    }
    assert_eq!(mode(&extra), 0o711);
    // The object inside keeps 0644: the directories are the barrier.
    let id = fsverity_digest(&b"private"[..]).unwrap();
    assert_eq!(mode(&writer.object_path(&id)), 0o644);

    // A repair narrows what is still wide, and leaves the store clean.
    widen(&writer);
    let report = writer
        .fsck(&FsckOptions {
            repair: true,
            ..opts
        })
        .unwrap();
    assert_eq!(report.repairs.len(), want.len(), "{:?}", report.repairs);
    assert!(matches!(report.repairs[0], Repair::MadePrivate(_, 0o755)));
    assert!(report.repairs[0].to_string().contains("was 0755"));
    for d in writer.private_dirs().iter().filter(|d| d.exists()) {
        assert_eq!(mode(d), 0o700, "{}", d.display());
    }
    assert_eq!(mode(&extra), 0o700);
    assert!(writer.fsck(&opts).unwrap().is_clean());
}

/// Records and refs are written 0600.
#[test]
fn records_and_refs_are_private() {
    let (_dir, store) = new_store();
    let image = {
        let mut w = store.image_writer().unwrap();
        w.write_all(b"not really an image").unwrap();
        w.commit().unwrap()
    };
    store.set_ref("r", &image).unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
    assert_eq!(mode(&store.refs_dir().join("r")), 0o600);
    assert_eq!(mode(&store.image_path(&image)), 0o600);

    let mut w = store.layer_writer().unwrap();
    w.entries()
        .write_all(b"/ 0 40755 2 0 0 0 0.0 - - -\n")
        .unwrap();
    let diff_id = format!("sha256:{}", "a".repeat(64));
    let record = LayerRecord {
        format: LAYER_FORMAT,
        diff_id: diff_id.clone(),
        blob_digest: None,
        media_type: None,
        compression: "none".into(),
        size: 0,
        compressed_size: 0,
        entries: 1,
        objects: 0,
    };
    assert!(w.commit(&store, &record).unwrap());
    let layer = store.layer_dir(&diff_id);
    assert_eq!(mode(&layer), 0o700);
    assert_eq!(mode(&layer.join(LAYER_RECORD_FILE)), 0o600);
    assert_eq!(mode(&layer.join(LAYER_ENTRIES_FILE)), 0o600);
}

#[test]
fn ensure_private_dir_creates_and_narrows() {
    let dir = tempfile::tempdir().unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
    let run = dir.path().join("a/b/run");
    assert_eq!(ensure_private_dir(&run).unwrap(), None);
    assert_eq!(mode(&run), 0o700);
    // Only the directory itself is private, not the parents made for it.
    assert_eq!(mode(&dir.path().join("a/b")) & 0o700, 0o700);
    fs::set_permissions(&run, fs::Permissions::from_mode(0o1777)).unwrap();
    assert_eq!(ensure_private_dir(&run).unwrap(), Some(0o1777));
    assert_eq!(mode(&run), 0o700);
    assert_eq!(ensure_private_dir(&run).unwrap(), None);
}
