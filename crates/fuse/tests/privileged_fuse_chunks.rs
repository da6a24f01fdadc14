//! Chunked reads of a large missing object through the lazy data layer
//! (and an overlay on it): a read near the end of a 40 MiB object is
//! answered after the chunks it needs, not the whole object; a chunk the
//! source refuses gives `EIO` to the reads that need it and nothing is
//! stored; the object is then completed, verified, published, and later
//! opens pass through. Mounts for real: root only, never skipped.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cairn_erofs::dump::{parse_dump, ParseOptions};
use cairn_erofs::writer::{mkfs_erofs_to_vec, WriteOptions};
use cairn_fuse::{serve, FetchError, ObjectSource, ServeOptions};
use cairn_mount::{mount_image, umount, MountOptions, UpperSpec, VerityMode};
use cairn_store::{fsverity_digest, ObjectId, Store};

const MIB: usize = 1 << 20;

fn in_private_mount_ns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    assert!(
        rustix::process::geteuid().is_root(),
        "privileged FUSE tests must run as root (they really mount); not skipped"
    );
    std::thread::spawn(move || {
        // SAFETY: only CLONE_NEWNS (which implies CLONE_FS) is unshared; file
        // descriptor tables stay shared, so no fd is invalidated.
        unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }
            .expect("unshare(CLONE_NEWNS)");
        rustix::mount::mount_change(
            "/",
            rustix::mount::MountPropagationFlags::PRIVATE
                | rustix::mount::MountPropagationFlags::REC,
        )
        .expect("make / recursively private");
        body()
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

fn content(seed: u8, len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Objects cut in 1 MiB chunks; each chunk fetch takes `delay` and is
/// counted; `bad` names a chunk (of `bad_object`) the source refuses, as
/// a source that checked it against its digest would.
struct ChunkSource {
    objects: HashMap<ObjectId, Vec<u8>>,
    delay: Duration,
    chunk_fetches: Mutex<HashMap<ObjectId, Vec<usize>>>,
    whole_fetches: AtomicUsize,
    bad: Mutex<Option<(ObjectId, usize)>>,
}

impl ChunkSource {
    fn fetched(&self, id: &ObjectId) -> Vec<usize> {
        self.chunk_fetches
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .unwrap_or_default()
    }
}

impl ObjectSource for ChunkSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        self.objects.get(id).map(|d| d.len() as u64)
    }

    fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), FetchError> {
        self.whole_fetches.fetch_add(1, Ordering::SeqCst);
        let d = self.objects.get(id).ok_or(FetchError::NotFound(*id))?;
        out.write_all(d)?;
        Ok(())
    }

    fn chunks(&self, id: &ObjectId) -> Option<Vec<u64>> {
        let d = self.objects.get(id)?;
        Some((0..d.len()).step_by(MIB).map(|s| s as u64).collect())
    }

    fn fetch_chunk(&self, id: &ObjectId, k: usize) -> Result<Vec<u8>, FetchError> {
        let d = self.objects.get(id).ok_or(FetchError::NotFound(*id))?;
        std::thread::sleep(self.delay);
        self.chunk_fetches
            .lock()
            .unwrap()
            .entry(*id)
            .or_default()
            .push(k);
        if *self.bad.lock().unwrap() == Some((*id, k)) {
            return Err(FetchError::Other(format!(
                "object {id}: chunk {k} from blob sha256:test does not hash to its digest"
            )));
        }
        let start = k * MIB;
        Ok(d[start..(start + MIB).min(d.len())].to_vec())
    }
}

fn staged_files(store: &Store) -> usize {
    fn count(dir: &Path) -> usize {
        let Ok(entries) = fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| {
                if e.path().is_dir() {
                    count(&e.path())
                } else {
                    1
                }
            })
            .sum()
    }
    count(&store.tmp_dir())
}

fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn privileged_fuse_chunked_reads() {
    in_private_mount_ns(|| {
        let dir = tempfile::Builder::new()
            .prefix("cairn-fuse-chunks.")
            .tempdir_in("/var/tmp")
            .unwrap();
        let root: PathBuf = dir.path().to_path_buf();
        let store = Arc::new(Store::open(&root.join("store")).unwrap());
        let (lazy, target) = (root.join("lazy"), root.join("mnt"));
        fs::create_dir(&lazy).unwrap();
        fs::create_dir(&target).unwrap();

        let big = content(1, 40 * MIB + 12_345);
        let other = content(2, 8 * MIB);
        let (big_id, other_id) = (
            fsverity_digest(&big[..]).unwrap(),
            fsverity_digest(&other[..]).unwrap(),
        );
        let source = Arc::new(ChunkSource {
            objects: [(big_id, big.clone()), (other_id, other.clone())].into(),
            delay: Duration::from_millis(100),
            chunk_fetches: Mutex::new(HashMap::new()),
            whole_fetches: AtomicUsize::new(0),
            bad: Mutex::new(Some((other_id, 5))),
        });

        let mut dump = String::from("/ 4096 40755 2 0 0 0 0.0 - - -\n");
        for (name, d, id) in [("big", &big, big_id), ("other", &other, other_id)] {
            dump.push_str(&format!(
                "/{name} {} 100644 1 0 0 0 0.0 {} - {}\n",
                d.len(),
                id.object_path(),
                id.to_hex()
            ));
        }
        let tree = parse_dump(dump.as_bytes(), &ParseOptions { strict: true }).unwrap();
        let image = root.join("image.cfs");
        fs::write(
            &image,
            mkfs_erofs_to_vec(&tree, &WriteOptions::default()).unwrap(),
        )
        .unwrap();

        let mut fuse = serve(
            store.clone(),
            source.clone(),
            &lazy,
            ServeOptions {
                fetch_timeout: Duration::from_secs(20),
                source_name: "cairn-test".into(),
                ..ServeOptions::default()
            },
        )
        .unwrap();
        mount_image(&MountOptions {
            image: &image,
            objects: &lazy,
            local_objects: None,
            target: &target,
            upper: UpperSpec::None,
            idmap: None,
            verity: VerityMode::Off,
        })
        .unwrap();

        // 1. A read near the end of the 40 MiB object: answered after the
        // chunks it covers, long before the 41 chunks could all be in.
        let f = fs::File::open(target.join("big")).unwrap();
        let at = big.len() - 200_000;
        let mut buf = vec![0u8; 64 * 1024];
        let t0 = Instant::now();
        f.read_exact_at(&mut buf, at as u64).unwrap();
        let took = t0.elapsed();
        let fetched = source.fetched(&big_id);
        assert!(buf == big[at..at + buf.len()], "wrong bytes near the end");
        assert!(
            fetched.len() <= 3 && fetched.contains(&(at / MIB)),
            "the read returned after chunks {fetched:?} were fetched"
        );
        assert!(took < Duration::from_secs(2), "the read took {took:?}");
        assert!(!store.has_object(&big_id), "published before all chunks");

        // A background fetch of it waits for the chunked fetch instead of
        // fetching it whole.
        let bg = fuse.background();
        let waiting = std::thread::spawn(move || bg.fetch(&big_id));

        // 2. A chunk the source refuses: EIO for the reads that need it,
        // other chunks of the object read fine, nothing stored.
        let g = fs::File::open(target.join("other")).unwrap();
        let mut small = vec![0u8; 4096];
        let err = g
            .read_exact_at(&mut small, (5 * MIB + 100) as u64)
            .expect_err("a refused chunk must not be read");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        g.read_exact_at(&mut small, 100).unwrap();
        assert!(small[..] == other[100..4196]);
        assert!(!store.has_object(&other_id));
        // The source serves it right again: a read gets it.
        *source.bad.lock().unwrap() = None;
        g.read_exact_at(&mut small, (5 * MIB + 100) as u64).unwrap();
        assert!(small[..] == other[5 * MIB + 100..5 * MIB + 4196]);

        // 3. The rest follows the first reads; both objects are verified
        // and published, each chunk fetched once (the refused one twice).
        wait_for("both objects published", 60, || {
            store.has_object(&big_id) && store.has_object(&other_id)
        });
        let mut b = source.fetched(&big_id);
        b.sort();
        assert_eq!(b, (0..41).collect::<Vec<_>>(), "chunks fetched of big");
        let mut o = source.fetched(&other_id);
        assert!(
            o.iter().filter(|&&k| k == 5).count() >= 2,
            "the refused chunk is fetched again: {o:?}"
        );
        o.sort();
        o.dedup();
        assert_eq!(o, (0..8).collect::<Vec<_>>(), "chunks fetched of other");
        assert_eq!(fs::read(store.object_path(&big_id)).unwrap(), big);
        assert_eq!(waiting.join().unwrap(), Ok(()));
        assert_eq!(source.whole_fetches.load(Ordering::SeqCst), 0);
        // The whole file through the open handle, from the staging file.
        let mut all = vec![0u8; big.len()];
        f.read_exact_at(&mut all, 0).unwrap();
        assert!(all == big, "the handle opened early reads the whole object");
        drop(f);
        drop(g);
        let stats = fuse.stats();
        assert_eq!(stats.chunked_opens, 2, "{stats:?}");
        assert_eq!(stats.chunked_published, 2, "{stats:?}");
        assert!(stats.chunks_failed >= 1, "{stats:?}");

        // 4. Later opens are served from the store, passed through when
        // the kernel can.
        let reads = fuse.stats().reads;
        // RELEASE is asynchronous: an open while a chunked handle is still
        // open would be served by READ too.
        std::thread::sleep(Duration::from_millis(300));
        assert!(fs::read(target.join("big")).unwrap() == big);
        let stats = fuse.stats();
        if stats.passthrough {
            assert_eq!(stats.reads, reads, "read again, not passed through");
            assert!(stats.passthrough_opens >= 1, "{stats:?}");
        }
        assert_eq!(staged_files(&store), 0, "staging debris");

        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match umount(&target) {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("umount: {e:?}"),
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match fuse.unmount() {
                Ok(_) => break,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("{e}"),
            }
        }
    });
}
