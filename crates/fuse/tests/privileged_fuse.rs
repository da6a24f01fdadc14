//! Privileged end-to-end tests of the lazy data layer: they really mount
//! the FUSE filesystem (and an overlay stack on it), so they need root.
//! Not root is a failure, never a skip.
//!
//! Each test runs on its own thread in a private mount namespace
//! (`unshare(CLONE_NEWNS)` is per thread), so its mounts are its own and
//! nothing propagates to the host.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use cairn_erofs::dump::{parse_dump, ParseOptions};
use cairn_erofs::writer::{mkfs_erofs_to_vec, WriteOptions};
use cairn_fuse::{serve, take_over, FetchError, FuseMount, NoSource, ObjectSource, ServeOptions};
use cairn_mount::{mount_image, umount, IdMap, MountOptions, UpperSpec, VerityMode};
use cairn_store::{fsverity_digest, ObjectId, StagedObject, Store};
use rustix::io::Errno;

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "privileged FUSE tests must run as root (they really mount); run `cargo test -p cairn-fuse` as root"
    );
}

/// Runs `body` on a fresh thread inside a private mount namespace.
fn in_private_mount_ns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    require_root();
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

/// Deterministic test contents of `len` bytes.
fn content(seed: u8, len: usize) -> Vec<u8> {
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ seed as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn id_of(data: &[u8]) -> ObjectId {
    fsverity_digest(data).unwrap()
}

/// A temp dir on a disk filesystem (EROFS cannot read images on tmpfs),
/// with a store, a FUSE mountpoint and an overlay target.
struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    store: Arc<Store>,
    lazy: PathBuf,
    target: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::Builder::new()
            .prefix("cairn-fuse-test.")
            .tempdir_in("/var/tmp")
            .unwrap();
        let root = dir.path().to_path_buf();
        let store = Arc::new(Store::open(&root.join("store")).unwrap());
        let lazy = root.join("lazy");
        let target = root.join("mnt");
        fs::create_dir(&lazy).unwrap();
        fs::create_dir(&target).unwrap();
        Fixture {
            _dir: dir,
            root,
            store,
            lazy,
            target,
        }
    }

    /// An EROFS metadata image (cairn's writer) whose files `/NAME` are
    /// backed by the objects of the given contents.
    fn image(&self, files: &[(&str, &[u8])]) -> PathBuf {
        let mut dump = String::from("/ 4096 40755 2 0 0 0 0.0 - - -\n");
        let mut files: Vec<_> = files.to_vec();
        files.sort_by_key(|(n, _)| *n);
        for (name, data) in files {
            let id = id_of(data);
            dump.push_str(&format!(
                "/{name} {} 100644 1 0 0 0 0.0 {} - {}\n",
                data.len(),
                id.object_path(),
                id.to_hex()
            ));
        }
        let tree = parse_dump(dump.as_bytes(), &ParseOptions { strict: true }).unwrap();
        let bytes = mkfs_erofs_to_vec(&tree, &WriteOptions::default()).unwrap();
        let path = self.root.join("image.cfs");
        fs::write(&path, bytes).unwrap();
        path
    }

    fn serve(&self, source: Arc<dyn ObjectSource>, timeout: Duration) -> FuseMount {
        self.serve_with(source, timeout, 4)
    }

    fn serve_with(
        &self,
        source: Arc<dyn ObjectSource>,
        timeout: Duration,
        workers: usize,
    ) -> FuseMount {
        serve(
            self.store.clone(),
            source,
            &self.lazy,
            ServeOptions {
                workers,
                fetch_timeout: timeout,
                source_name: "cairn-test".into(),
                ..ServeOptions::default()
            },
        )
        .expect("serving the lazy layer")
    }

    fn mount_overlay(&self, image: &Path) {
        self.mount_overlay_with(image, UpperSpec::None, None);
    }

    fn mount_overlay_with(&self, image: &Path, upper: UpperSpec, idmap: Option<IdMap>) {
        mount_image(&MountOptions {
            image,
            objects: &self.lazy,
            local_objects: None,
            target: &self.target,
            upper,
            idmap,
            verity: VerityMode::Off,
        })
        .expect("mounting the overlay over the lazy layer");
    }
}

/// Unmounts, retrying EBUSY briefly (another test's fork may hold our fds
/// for a moment).
fn umount_retrying(target: &Path) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match umount(target) {
            Ok(()) => return,
            Err(err) if err.errno() == Some(Errno::BUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => panic!("umount {}: {err:?}", target.display()),
        }
    }
}

/// Waits until every backing id is closed (RELEASE is asynchronous).
fn wait_backing_closed(fuse: &FuseMount) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while fuse.stats().live_backing_ids != 0 {
        assert!(
            Instant::now() < deadline,
            "backing ids still open: {:?}",
            fuse.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Unmounts the lazy layer, retrying EBUSY briefly, and returns its final
/// counters.
fn unmount_fuse(mut fuse: FuseMount) -> cairn_fuse::Stats {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match fuse.unmount() {
            Ok(stats) => return stats,
            Err(cairn_fuse::FuseError::Unmount { error, .. })
                if error.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn privileged_fuse_passthrough() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let small = content(1, 100);
        let mid = content(2, 200_000);
        let big = content(3, 3 << 20);
        for data in [&small, &mid, &big] {
            fx.store.import_bytes(data).unwrap();
        }
        let image = fx.image(&[("small", &small), ("mid", &mid), ("big", &big)]);
        let fuse = fx.serve(Arc::new(NoSource), Duration::from_secs(5));
        assert!(
            fuse.stats().passthrough,
            "the kernel must offer passthrough"
        );

        // The FUSE tree itself: fan-out directories and object files.
        let id = id_of(&mid);
        let direct = fx.lazy.join(id.object_path());
        let meta = fs::metadata(&direct).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.len(), mid.len() as u64);
        assert!(fs::metadata(fx.lazy.join("00")).unwrap().is_dir());
        let listed = fs::read_dir(&fx.lazy).unwrap().count();
        assert_eq!(listed, 256);
        let missing = id_of(b"not in the store");
        assert_eq!(
            fs::metadata(fx.lazy.join(missing.object_path()))
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
        assert_eq!(fs::read(&direct).unwrap(), mid);
        // Another user can neither read objects through the mount nor
        // make it look anything up (the root is 0500, as the store is
        // private); the overlay still serves them (below).
        use std::os::unix::process::CommandExt;
        let out = std::process::Command::new("cat")
            .arg(&direct)
            .uid(65534)
            .gid(65534)
            .output()
            .expect("running cat as nobody");
        assert!(
            !out.status.success()
                && out.stdout.is_empty()
                && String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
            "nobody read an object through the lazy layer: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        fx.mount_overlay(&image);
        for (name, data) in [("small", &small), ("mid", &mid), ("big", &big)] {
            let got = fs::read(fx.target.join(name)).unwrap();
            assert!(got == *data, "{name}: wrong contents through the overlay");
        }
        // Reads at an offset, through one open file.
        let mut f = fs::File::open(fx.target.join("big")).unwrap();
        let mut buf = vec![0u8; 4096];
        use std::os::unix::fs::FileExt;
        f.read_exact_at(&mut buf, 1 << 20).unwrap();
        assert_eq!(buf, big[1 << 20..(1 << 20) + 4096]);
        let mut rest = Vec::new();
        f.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, big);
        drop(f);

        let stats = fuse.stats();
        assert_eq!(
            stats.reads, 0,
            "passthrough: no READ may reach the server: {stats:?}"
        );
        assert!(stats.passthrough_opens >= 4, "{stats:?}");
        assert_eq!(stats.plain_opens, 0, "{stats:?}");
        // As an unprivileged user, through the overlay (the image's files
        // are 0644).
        let out = std::process::Command::new("cat")
            .arg(fx.target.join("mid"))
            .uid(65534)
            .gid(65534)
            .output()
            .expect("running cat as nobody");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout == mid,
            "nobody read wrong bytes through the overlay"
        );
        assert_eq!(stats.fetches_started, 0, "{stats:?}");

        umount_retrying(&fx.target);
        wait_backing_closed(&fuse);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.backing_opened, stats.backing_closed, "{stats:?}");
        assert_eq!(stats.bad_messages, 0);
    });
}

#[test]
fn privileged_fuse_idmapped_overlay() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let local = content(30, 40_000);
        let lazy = content(31, 70_000);
        fx.store.import_bytes(&local).unwrap();
        let source = Arc::new(TestSource::new(&[(
            &lazy,
            Behaviour::Good {
                delay: Duration::ZERO,
            },
        )]));
        let image = fx.image(&[("local", &local), ("lazy", &lazy)]);
        let fuse = fx.serve(source, Duration::from_secs(5));
        // cairn_mount clones the objects layer and idmaps the clone.
        fx.mount_overlay_with(
            &image,
            UpperSpec::Tmpfs { size: None },
            Some(IdMap {
                uid: 100_000,
                gid: 100_000,
                count: 65_536,
            }),
        );
        use std::os::unix::fs::MetadataExt;
        let m = fs::metadata(fx.target.join("local")).unwrap();
        assert_eq!((m.uid(), m.gid()), (100_000, 100_000));
        assert_eq!(fs::read(fx.target.join("local")).unwrap(), local);
        assert_eq!(fs::read(fx.target.join("lazy")).unwrap(), lazy);
        umount_retrying(&fx.target);
        wait_backing_closed(&fuse);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.reads, 0, "{stats:?}");
        assert_eq!(stats.fetches_published, 1, "{stats:?}");
    });
}

/// What a server's death does to the stack: the kernel aborts the
/// connection (here through fusectl's `abort`, which is what closing the
/// last `/dev/fuse` descriptor does): files already open keep reading from
/// their backing files; new opens fail with `ENOTCONN`.
#[test]
fn privileged_fuse_server_death_keeps_open_files() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let one = content(40, 300_000);
        let two = content(41, 300_000);
        fx.store.import_bytes(&one).unwrap();
        fx.store.import_bytes(&two).unwrap();
        let image = fx.image(&[("one", &one), ("two", &two)]);
        let fuse = fx.serve(Arc::new(NoSource), Duration::from_secs(5));
        fx.mount_overlay(&image);
        let mut f = fs::File::open(fx.target.join("one")).unwrap();
        let mut head = vec![0u8; 1000];
        f.read_exact(&mut head).unwrap();

        // fusectl, in this test's own mount namespace.
        let ctl = Path::new("/sys/fs/fuse/connections");
        let mount_ctl = fs::read_dir(ctl)
            .map(|mut d| d.next().is_none())
            .unwrap_or(true);
        if mount_ctl {
            rustix::mount::mount(
                "fusectl",
                ctl,
                "fusectl",
                rustix::mount::MountFlags::empty(),
                None,
            )
            .expect("mounting fusectl");
        }
        use std::os::unix::fs::MetadataExt;
        let dev = fs::metadata(&fx.lazy).unwrap().dev();
        let conn = ctl.join(format!("{}", rustix::fs::minor(dev)));
        fs::write(conn.join("abort"), b"1").expect("aborting the connection");

        let mut rest = Vec::new();
        f.read_to_end(&mut rest)
            .expect("an open file reads on after the server is gone");
        assert!([head, rest].concat() == one, "wrong bytes after the abort");
        drop(f);
        let err = fs::File::open(fx.target.join("two")).expect_err("a new open must fail");
        assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");

        umount_retrying(&fx.target);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.reads, 0, "{stats:?}");
        if mount_ctl {
            rustix::mount::unmount(ctl, rustix::mount::UnmountFlags::empty()).unwrap();
        }
    });
}

/// With passthrough off, reads are served by READ, from the store's file
/// (or a fetched one): contents right at every offset and size, counted.
#[test]
fn privileged_fuse_reads_without_passthrough() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let local = content(70, (1 << 20) + 12345);
        let lazy = content(71, 99_999);
        fx.store.import_bytes(&local).unwrap();
        let source = Arc::new(TestSource::new(&[(
            &lazy,
            Behaviour::Good {
                delay: Duration::ZERO,
            },
        )]));
        let image = fx.image(&[("local", &local), ("lazy", &lazy)]);
        let fuse = serve(
            fx.store.clone(),
            source,
            &fx.lazy,
            ServeOptions {
                passthrough: false,
                ..ServeOptions::default()
            },
        )
        .unwrap();
        assert!(!fuse.stats().passthrough);
        fx.mount_overlay(&image);
        assert!(fs::read(fx.target.join("local")).unwrap() == local);
        assert!(fs::read(fx.target.join("lazy")).unwrap() == lazy);
        use std::os::unix::fs::FileExt;
        let f = fs::File::open(fx.target.join("local")).unwrap();
        for (off, len) in [
            (0usize, 1usize),
            (4095, 2),
            (500_000, 200_000),
            (local.len() - 3, 3),
        ] {
            let mut buf = vec![0u8; len];
            f.read_exact_at(&mut buf, off as u64).unwrap();
            assert!(buf == local[off..off + len], "bytes {off}+{len}");
        }
        // Past the end: nothing.
        let mut buf = [0u8; 10];
        assert_eq!(f.read_at(&mut buf, local.len() as u64).unwrap(), 0);
        drop(f);
        let stats = fuse.stats();
        assert!(stats.reads > 0, "{stats:?}");
        assert_eq!(stats.passthrough_opens, 0, "{stats:?}");
        assert_eq!(stats.backing_opened, 0, "{stats:?}");
        umount_retrying(&fx.target);
        unmount_fuse(fuse);
    });
}

/// A successor takes the live connection over a unix socket: files open
/// across the hand-over read on, their release reaches the successor
/// (which closes their backing ids), and new lookups, opens and fetches are
/// the successor's; the old server has stopped.
#[test]
fn privileged_fuse_hand_over() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let kept = content(50, 500_000);
        let later = content(51, 20_000);
        let fetched = content(52, 30_000);
        fx.store.import_bytes(&kept).unwrap();
        fx.store.import_bytes(&later).unwrap();
        let source = Arc::new(TestSource::new(&[(
            &fetched,
            Behaviour::Good {
                delay: Duration::ZERO,
            },
        )]));
        let image = fx.image(&[("kept", &kept), ("later", &later), ("fetched", &fetched)]);
        let old = fx.serve(source.clone(), Duration::from_secs(5));
        fx.mount_overlay(&image);
        let mut f = fs::File::open(fx.target.join("kept")).unwrap();
        let mut head = vec![0u8; 4096];
        f.read_exact(&mut head).unwrap();
        // Looked up, not open: the successor must know it too.
        let later_meta = fs::metadata(fx.target.join("later")).unwrap();
        assert_eq!(later_meta.len(), later.len() as u64);
        assert_eq!(old.stats().live_backing_ids, 1);

        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let store = fx.store.clone();
        let src: Arc<dyn ObjectSource> = source.clone();
        let successor = std::thread::spawn(move || {
            take_over(store, src, &b, ServeOptions::default()).expect("taking over")
        });
        old.hand_over(&a).map_err(|(_, e)| e).expect("handing over");
        let new = successor.join().unwrap();
        assert_eq!(new.path(), fx.lazy);
        assert_eq!(new.stats().live_backing_ids, 1, "the backing id moved over");

        let mut rest = Vec::new();
        f.read_to_end(&mut rest).unwrap();
        assert!(
            [head, rest].concat() == kept,
            "wrong bytes across the hand-over"
        );
        drop(f);
        assert_eq!(fs::read(fx.target.join("later")).unwrap(), later);
        assert_eq!(fs::read(fx.target.join("fetched")).unwrap(), fetched);
        assert!(new.settle(Duration::from_secs(10)));
        assert!(fx.store.has_object(&id_of(&fetched)));
        let stats = new.stats();
        assert_eq!(stats.fetches_published, 1, "{stats:?}");
        assert_eq!(stats.reads, 0, "{stats:?}");

        umount_retrying(&fx.target);
        wait_backing_closed(&new);
        let stats = unmount_fuse(new);
        // The release of the file opened before the hand-over closed the
        // old server's backing id in the successor.
        assert!(stats.backing_closed >= 1, "{stats:?}");
    });
}

/// A successor that refuses the state (here: more nodes than its limit)
/// closes the socket; the old server serves on.
#[test]
fn privileged_fuse_failed_hand_over_serves_on() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let data = content(60, 50_000);
        fx.store.import_bytes(&data).unwrap();
        let image = fx.image(&[("data", &data)]);
        let old = fx.serve(Arc::new(NoSource), Duration::from_secs(5));
        fx.mount_overlay(&image);
        assert_eq!(fs::read(fx.target.join("data")).unwrap(), data);

        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let store = fx.store.clone();
        let successor = std::thread::spawn(move || {
            let options = ServeOptions {
                max_nodes: 0,
                ..ServeOptions::default()
            };
            take_over(store, Arc::new(NoSource), &b, options)
        });
        let (old, err) = old.hand_over(&a).expect_err("the successor must refuse");
        let refused = successor
            .join()
            .unwrap()
            .expect_err("more nodes than its limit");
        assert!(refused.to_string().contains("limit"), "{refused}");
        // Refused after the header ("did not take over") or while the
        // rest was still being sent (a broken pipe): either way a failed
        // hand-over.
        assert!(
            matches!(err, cairn_fuse::FuseError::HandOver { .. }),
            "{err}"
        );

        // Still served, by the old server, without a restart of anything.
        assert_eq!(fs::read(fx.target.join("data")).unwrap(), data);
        umount_retrying(&fx.target);
        wait_backing_closed(&old);
        let stats = unmount_fuse(old);
        assert_eq!(stats.reads, 0, "{stats:?}");
    });
}

/// How the test source behaves for one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Behaviour {
    /// The right bytes, after `delay`.
    Good { delay: Duration },
    /// Bytes of the right length that hash to something else.
    Wrong,
    /// Blocks for `delay` the first time, then behaves.
    SlowOnce { delay: Duration },
}

/// An in-memory source that counts its fetches.
struct TestSource {
    objects: HashMap<ObjectId, (Vec<u8>, Behaviour)>,
    fetches: Mutex<HashMap<ObjectId, usize>>,
    in_fetch: AtomicUsize,
}

impl TestSource {
    fn new(objects: &[(&[u8], Behaviour)]) -> TestSource {
        TestSource {
            objects: objects
                .iter()
                .map(|(d, b)| (id_of(d), (d.to_vec(), *b)))
                .collect(),
            fetches: Mutex::new(HashMap::new()),
            in_fetch: AtomicUsize::new(0),
        }
    }

    fn fetches(&self, id: &ObjectId) -> usize {
        self.fetches.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

impl ObjectSource for TestSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        self.objects.get(id).map(|(d, _)| d.len() as u64)
    }

    fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), FetchError> {
        let (data, behaviour) = self.objects.get(id).ok_or(FetchError::NotFound(*id))?;
        let n = {
            let mut f = self.fetches.lock().unwrap();
            let n = f.entry(*id).or_default();
            *n += 1;
            *n
        };
        self.in_fetch.fetch_add(1, Ordering::SeqCst);
        let result = (|| {
            match *behaviour {
                Behaviour::Good { delay } => std::thread::sleep(delay),
                Behaviour::SlowOnce { delay } if n == 1 => std::thread::sleep(delay),
                Behaviour::SlowOnce { .. } => {}
                Behaviour::Wrong => {
                    let mut bad = data.clone();
                    bad[0] ^= 0xff;
                    out.write_all(&bad)?;
                    return Ok(());
                }
            }
            // In pieces, as a network source would.
            for chunk in data.chunks(64 * 1024) {
                out.write_all(chunk)?;
            }
            Ok(())
        })();
        self.in_fetch.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

fn open_err(path: &Path) -> io::Error {
    fs::File::open(path).expect_err("open must fail")
}

#[test]
fn privileged_fuse_fetch() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let lazy_a = content(10, 300_000);
        let lazy_b = content(11, 5000);
        let wrong = content(12, 70_000);
        let slow = content(13, 4096);
        let shared = content(14, 1 << 20);
        let local = content(15, 1234);
        fx.store.import_bytes(&local).unwrap();
        let fast = Behaviour::Good {
            delay: Duration::ZERO,
        };
        let source = Arc::new(TestSource::new(&[
            (&lazy_a, fast),
            (&lazy_b, fast),
            (&wrong, Behaviour::Wrong),
            (
                &slow,
                Behaviour::SlowOnce {
                    delay: Duration::from_secs(4),
                },
            ),
            (
                &shared,
                Behaviour::Good {
                    delay: Duration::from_millis(400),
                },
            ),
        ]));
        let timeout = Duration::from_millis(800);
        let fuse = fx.serve(source.clone(), timeout);

        // 1. Through the overlay: the first read fetches, verifies and
        // publishes; the object appears in objects/; reads are passed
        // through even so.
        let image = fx.image(&[("a", &lazy_a), ("b", &lazy_b), ("local", &local)]);
        fx.mount_overlay(&image);
        let a = id_of(&lazy_a);
        assert!(!fx.store.has_object(&a));
        assert_eq!(fs::read(fx.target.join("a")).unwrap(), lazy_a);
        // The open was answered from the checked staged file; the
        // publication follows it.
        assert!(fuse.settle(Duration::from_secs(10)));
        assert!(
            fx.store.has_object(&a),
            "the fetched object must be published"
        );
        assert_eq!(fs::read(fx.store.object_path(&a)).unwrap(), lazy_a);
        assert_eq!(fs::read(fx.target.join("b")).unwrap(), lazy_b);
        assert_eq!(fs::read(fx.target.join("local")).unwrap(), local);
        // Again: from the store now, no second fetch.
        assert_eq!(fs::read(fx.target.join("a")).unwrap(), lazy_a);
        assert_eq!(source.fetches(&a), 1);
        assert!(fuse.settle(Duration::from_secs(10)));
        let stats = fuse.stats();
        assert_eq!(stats.reads, 0, "{stats:?}");
        assert_eq!(stats.fetches_published, 2, "{stats:?}");
        umount_retrying(&fx.target);

        // 2. Wrong bytes: EIO, nothing stored (and no staged debris).
        let w = id_of(&wrong);
        let err = open_err(&fx.lazy.join(w.object_path()));
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        assert!(!fx.store.has_object(&w));
        // A later open tries again (and fails again).
        let err = open_err(&fx.lazy.join(w.object_path()));
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        assert_eq!(source.fetches(&w), 2);
        assert!(!fx.store.has_object(&w));
        assert_eq!(
            staged_files(&fx.store),
            0,
            "a refused fetch leaves no staged file"
        );

        // 3. A source slower than the timeout: EIO within the bound, then
        // a later open fetches afresh and succeeds.
        let s = id_of(&slow);
        let t0 = Instant::now();
        let err = open_err(&fx.lazy.join(s.object_path()));
        let took = t0.elapsed();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        assert!(
            took >= timeout && took < timeout + Duration::from_secs(2),
            "EIO after {took:?}, the timeout is {timeout:?}"
        );
        assert!(!fx.store.has_object(&s));
        assert_eq!(
            fs::read(fx.lazy.join(s.object_path())).unwrap(),
            slow,
            "a later open must try again"
        );
        assert_eq!(source.fetches(&s), 2);
        assert!(fuse.settle(Duration::from_secs(10)));
        assert!(fx.store.has_object(&s));

        // 4. Concurrent readers of one missing object: one fetch.
        let sh = id_of(&shared);
        let path = fx.lazy.join(sh.object_path());
        let readers = 8;
        let barrier = Arc::new(Barrier::new(readers));
        let threads: Vec<_> = (0..readers)
            .map(|_| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    fs::read(path).unwrap()
                })
            })
            .collect();
        for t in threads {
            assert!(
                t.join().unwrap() == shared,
                "a concurrent reader got wrong bytes"
            );
        }
        assert_eq!(
            source.fetches(&sh),
            1,
            "concurrent opens must share one fetch"
        );
        assert!(fuse.settle(Duration::from_secs(10)));
        assert!(fx.store.has_object(&sh));

        let stats = fuse.stats();
        assert_eq!(stats.reads, 0, "{stats:?}");
        assert_eq!(stats.fetches_failed, 2, "{stats:?}");
        assert!(stats.fetches_timed_out >= 1, "{stats:?}");

        // The abandoned slow fetch is still asleep in the source; its end
        // must not publish anything or disturb the server.
        let deadline = Instant::now() + Duration::from_secs(10);
        while source.in_fetch.load(Ordering::SeqCst) != 0 {
            assert!(Instant::now() < deadline, "the slow fetch never returned");
            std::thread::sleep(Duration::from_millis(20));
        }
        wait_backing_closed(&fuse);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.backing_opened, stats.backing_closed, "{stats:?}");
        assert_eq!(staged_files(&fx.store), 0);
    });
}

#[test]
fn privileged_fuse_fetch_leaves_workers_free() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let slow = content(20, 10_000);
        let local = content(21, 5000);
        fx.store.import_bytes(&local).unwrap();
        let source = Arc::new(TestSource::new(&[(
            &slow,
            Behaviour::Good {
                delay: Duration::from_secs(3),
            },
        )]));
        // One worker: if it waited for the fetch, nothing else would be
        // served meanwhile.
        let fuse = fx.serve_with(source.clone(), Duration::from_secs(10), 1);
        let slow_path = fx.lazy.join(id_of(&slow).object_path());
        let reader = std::thread::spawn(move || fs::read(slow_path).unwrap());
        let deadline = Instant::now() + Duration::from_secs(5);
        while source.in_fetch.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the fetch never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        let t0 = Instant::now();
        let got = fs::read(fx.lazy.join(id_of(&local).object_path())).unwrap();
        let took = t0.elapsed();
        assert_eq!(got, local);
        assert_eq!(
            source.in_fetch.load(Ordering::SeqCst),
            1,
            "the local object must be served while the fetch is still running (took {took:?})"
        );
        assert_eq!(reader.join().unwrap(), slow);
        wait_backing_closed(&fuse);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.reads, 0, "{stats:?}");
    });
}

/// Files under the store's staging area (`tmp/`), at any depth.
fn staged_files(store: &Store) -> usize {
    fn count(dir: &Path) -> usize {
        let Ok(entries) = fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| {
                let p = e.path();
                if p.is_dir() {
                    count(&p)
                } else {
                    1
                }
            })
            .sum()
    }
    count(&store.tmp_dir())
}

/// The size of `id` in `order` (the test sources' objects, in pack order).
fn size_in(order: &[(ObjectId, Vec<u8>)], id: &ObjectId) -> Option<u64> {
    order
        .iter()
        .find(|(o, _)| o == id)
        .map(|(_, d)| d.len() as u64)
}

/// `id` and the objects after it in `order` that are not in the store.
fn run_in(order: &[(ObjectId, Vec<u8>)], store: &Store, id: &ObjectId) -> Vec<ObjectId> {
    let at = order.iter().position(|(o, _)| o == id).unwrap();
    let mut g = vec![*id];
    g.extend(
        order[at + 1..]
            .iter()
            .map(|(o, _)| *o)
            .take_while(|o| !store.has_object(o)),
    );
    g
}

/// `id` of `order`, staged in `store`.
fn stage_in(order: &[(ObjectId, Vec<u8>)], store: &Store, id: &ObjectId) -> StagedObject {
    let (_, data) = order.iter().find(|(o, _)| o == id).unwrap();
    let mut s = store.stage_object().unwrap();
    s.write(data).unwrap();
    s.finish(store).unwrap()
}

/// A source that fetches a run of objects at once: `group(id)` is `id`
/// and the objects after it in `order` that are not in the store;
/// `stage_group` waits `delay`, then stages each (the server publishes). `fetch`
/// (one object alone) waits `delay` too. Every call is counted.
struct GroupSource {
    order: Vec<(ObjectId, Vec<u8>)>,
    delay: Duration,
    groups: Mutex<Vec<Vec<ObjectId>>>,
    fetches: Mutex<Vec<ObjectId>>,
    /// The nice value of the thread of each `stage_group`, as it began and
    /// as it ended.
    nices: Mutex<Vec<(i32, i32)>>,
}

/// The calling thread's nice value.
fn thread_nice() -> i32 {
    rustix::process::getpriority_process(None).unwrap()
}

impl ObjectSource for GroupSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        size_in(&self.order, id)
    }

    fn fetch(&self, id: &ObjectId, out: &mut dyn Write) -> Result<(), FetchError> {
        self.fetches.lock().unwrap().push(*id);
        std::thread::sleep(self.delay);
        let (_, data) = self.order.iter().find(|(o, _)| o == id).unwrap();
        out.write_all(data)?;
        Ok(())
    }

    fn group(&self, store: &Store, id: &ObjectId) -> Vec<ObjectId> {
        run_in(&self.order, store, id)
    }

    fn stage_group(
        &self,
        store: &Store,
        group: &[ObjectId],
        staged: &mut dyn FnMut(StagedObject),
    ) -> Option<Result<(), FetchError>> {
        self.groups.lock().unwrap().push(group.to_vec());
        let began = thread_nice();
        std::thread::sleep(self.delay);
        self.nices.lock().unwrap().push((began, thread_nice()));
        for id in group {
            staged(stage_in(&self.order, store, id));
        }
        Some(Ok(()))
    }
}

/// An open brings its neighbours in one `stage_group`; an open of a
/// neighbour while that runs joins it (no second fetch); a background
/// fetch is joined by an open of its object the same way, and its thread,
/// at the background priority until then, gets the normal one back.
#[test]
fn privileged_fuse_neighbours_and_background_share_one_fetch() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let files: Vec<Vec<u8>> = (0..5)
            .map(|i| content(60 + i, 10_000 + i as usize))
            .collect();
        let source = Arc::new(GroupSource {
            order: files.iter().map(|d| (id_of(d), d.clone())).collect(),
            delay: Duration::from_millis(600),
            groups: Mutex::new(Vec::new()),
            fetches: Mutex::new(Vec::new()),
            nices: Mutex::new(Vec::new()),
        });
        let names = ["f0", "f1", "f2", "f3", "f4"];
        let image = fx.image(
            &names
                .iter()
                .zip(&files)
                .map(|(n, d)| (*n, d.as_slice()))
                .collect::<Vec<_>>(),
        );
        // f3 and f4 are not neighbours of f0: make f3 local.
        fx.store.import_bytes(&files[3]).unwrap();
        let fuse = fx.serve(source.clone(), Duration::from_secs(10));
        fx.mount_overlay(&image);

        // f0's open fetches f0, f1, f2; f2's open, while that runs, joins.
        let t0 = {
            let p = fx.target.join("f0");
            std::thread::spawn(move || fs::read(p).unwrap())
        };
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(fs::read(fx.target.join("f2")).unwrap(), files[2]);
        assert_eq!(t0.join().unwrap(), files[0]);
        assert_eq!(fs::read(fx.target.join("f1")).unwrap(), files[1]);
        assert_eq!(
            *source.groups.lock().unwrap(),
            vec![files[..3].iter().map(|d| id_of(d)).collect::<Vec<_>>()]
        );
        assert!(source.fetches.lock().unwrap().is_empty());
        // The opens were answered from the checked staged files, before
        // the publication's syncs; the publication follows.
        assert!(fuse.stats().staged_opens >= 2, "{:?}", fuse.stats());
        assert!(fuse.settle(Duration::from_secs(10)));
        assert_eq!(fuse.stats().neighbours_published, 2, "{:?}", fuse.stats());
        for d in &files[..3] {
            assert!(fx.store.has_object(&id_of(d)), "published after the opens");
        }

        // A background fetch of f4, joined by an open of f4.
        let bg = fuse.background();
        let id4 = id_of(&files[4]);
        let t4 = std::thread::spawn(move || bg.fetch(&id4));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(fs::read(fx.target.join("f4")).unwrap(), files[4]);
        t4.join().unwrap().unwrap();
        // f4 is the last in order: a group of one, staged alone, once
        // (through `stage_group`, which this source has).
        assert!(source.fetches.lock().unwrap().is_empty());
        assert_eq!(
            *source.groups.lock().unwrap(),
            vec![
                files[..3].iter().map(|d| id_of(d)).collect::<Vec<_>>(),
                vec![id4]
            ]
        );
        let stats = fuse.stats();
        assert_eq!(stats.fetches_background, 1, "{stats:?}");
        assert_eq!(stats.fetches_started, 2, "{stats:?}");
        // The open's fetch ran at the normal priority throughout; the
        // background one began at the background priority and had the
        // normal one back once the open came to wait for it.
        assert_eq!(
            *source.nices.lock().unwrap(),
            vec![(0, 0), (cairn_fuse::BACKGROUND_NICE, 0)]
        );
        // A background fetch of a local object does nothing.
        fuse.background().fetch(&id_of(&files[3])).unwrap();
        assert_eq!(fuse.stats().fetches_started, 2);

        umount_retrying(&fx.target);
        wait_backing_closed(&fuse);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.fetches_failed, 0, "{stats:?}");
    });
}

/// A source that stages a group as a streaming registry source does: the
/// first object at once, the rest only once the test opens `gate`; it
/// fails, once, on the object `fail_once` (after the ones before it were
/// handed over).
struct StreamingSource {
    order: Vec<(ObjectId, Vec<u8>)>,
    gate: (Mutex<bool>, std::sync::Condvar),
    fail_once: Mutex<Option<ObjectId>>,
    groups: Mutex<Vec<Vec<ObjectId>>>,
}

impl StreamingSource {
    fn open_gate(&self) {
        *self.gate.0.lock().unwrap() = true;
        self.gate.1.notify_all();
    }
}

impl ObjectSource for StreamingSource {
    fn size(&self, id: &ObjectId) -> Option<u64> {
        size_in(&self.order, id)
    }

    fn fetch(&self, _id: &ObjectId, _out: &mut dyn Write) -> Result<(), FetchError> {
        Err(FetchError::Other("this source stages groups only".into()))
    }

    fn group(&self, store: &Store, id: &ObjectId) -> Vec<ObjectId> {
        run_in(&self.order, store, id)
    }

    fn stage_group(
        &self,
        store: &Store,
        group: &[ObjectId],
        staged: &mut dyn FnMut(StagedObject),
    ) -> Option<Result<(), FetchError>> {
        self.groups.lock().unwrap().push(group.to_vec());
        for (k, id) in group.iter().enumerate() {
            if k == 1 {
                // The rest of the range "arrives" when the test says so
                // (bounded, so that a failing test ends).
                let open = self.gate.0.lock().unwrap();
                let _ = self
                    .gate
                    .1
                    .wait_timeout_while(open, Duration::from_secs(30), |o| !*o)
                    .unwrap();
            }
            if self
                .fail_once
                .lock()
                .unwrap()
                .take_if(|f| f == id)
                .is_some()
            {
                return Some(Err(FetchError::Other(format!("object {id}: a bad frame"))));
            }
            staged(stage_in(&self.order, store, id));
        }
        Some(Ok(()))
    }
}

/// An open is answered as soon as the source has staged its object, while
/// the rest of its group is still on its way; a neighbour that fails after
/// it costs the objects before it nothing (they are published), and is
/// fetched again by its own open.
#[test]
fn privileged_fuse_open_is_answered_before_the_rest_of_its_group() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let files: Vec<Vec<u8>> = (0..4)
            .map(|i| content(80 + i, 20_000 + i as usize))
            .collect();
        let ids: Vec<ObjectId> = files.iter().map(|d| id_of(d)).collect();
        let source = Arc::new(StreamingSource {
            order: ids.iter().copied().zip(files.iter().cloned()).collect(),
            gate: (Mutex::new(false), std::sync::Condvar::new()),
            fail_once: Mutex::new(Some(ids[2])),
            groups: Mutex::new(Vec::new()),
        });
        let names = ["g0", "g1", "g2", "g3"];
        let image = fx.image(
            &names
                .iter()
                .zip(&files)
                .map(|(n, d)| (*n, d.as_slice()))
                .collect::<Vec<_>>(),
        );
        let fuse = fx.serve(source.clone(), Duration::from_secs(60));
        fx.mount_overlay(&image);

        // g0's open: its group is all four; the source stages g0 and then
        // waits for the gate. The open does not.
        let (tx, rx) = std::sync::mpsc::channel();
        let p = fx.target.join("g0");
        std::thread::spawn(move || tx.send(fs::read(p).unwrap()).unwrap());
        let got = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("g0's open waited for the rest of its group");
        assert_eq!(got, files[0]);
        assert_eq!(*source.groups.lock().unwrap(), vec![ids.clone()]);
        assert!(!fx.store.has_object(&ids[1]), "the rest is not staged yet");

        // The rest arrives; g2 fails its check: g0 and g1 are kept and
        // published, g2 and g3 are not.
        source.open_gate();
        assert!(fuse.settle(Duration::from_secs(20)));
        assert!(fx.store.has_object(&ids[0]));
        assert!(fx.store.has_object(&ids[1]), "g1 came before the bad frame");
        assert!(!fx.store.has_object(&ids[2]));
        assert!(!fx.store.has_object(&ids[3]));
        assert_eq!(staged_files(&fx.store), 0, "nothing staged is left behind");

        // g1 is read from the store; g2's open fetches g2 and g3 again.
        assert_eq!(fs::read(fx.target.join("g1")).unwrap(), files[1]);
        assert_eq!(fs::read(fx.target.join("g2")).unwrap(), files[2]);
        assert_eq!(fs::read(fx.target.join("g3")).unwrap(), files[3]);
        assert_eq!(
            *source.groups.lock().unwrap(),
            vec![ids.clone(), ids[2..].to_vec()]
        );
        assert!(fuse.settle(Duration::from_secs(20)));
        for id in &ids {
            assert!(fx.store.has_object(id));
        }

        umount_retrying(&fx.target);
        wait_backing_closed(&fuse);
        let stats = unmount_fuse(fuse);
        assert_eq!(stats.fetches_started, 2, "{stats:?}");
    });
}
