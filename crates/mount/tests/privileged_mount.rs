//! Privileged end-to-end tests: they really mount EROFS images, overlays,
//! tmpfs uppers and idmapped layers, so they need root (and `mkfs.erofs` from
//! erofs-utils to build the test images). Not root is a failure, never a skip.
//!
//! Each test runs on its own thread in its own private mount namespace
//! (`unshare(CLONE_NEWNS)` is per thread), so it sees only its own mounts in
//! `/proc/thread-self/mountinfo`, tests can run in parallel, and nothing
//! propagates to the host. Cleanliness is checked three ways: the mount table
//! is exactly as before, no loop device is backed by a test file, and the
//! EROFS superblock has let go of the image file (inotify `IN_CLOSE_NOWRITE`
//! on the image: the kernel closes its file when the superblock dies, so
//! this proves no detached EROFS mount lingers where mountinfo cannot show
//! it).

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cairn_mount::{
    find_mount, is_mountpoint, mount_image, mount_table, prepare_image, probe, umount, umount_with,
    Action, Feature, IdMap, KernelFeatures, MountEntry, MountError, MountOptions, UmountOptions,
    UpperSpec, VerityMode,
};
use rustix::fs::inotify;
use rustix::io::Errno;

const HELLO: &[u8] = b"hello from the object store\n";
const HELLO_OBJECT: &str = "ab/cdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789";
const NOTES: &[u8] = b"user 1000's private notes\n";
const NOTES_OBJECT: &str = "12/3456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0";
const INLINE: &[u8] = b"data stored inside the image\n";

const IDMAP: IdMap = IdMap {
    uid: 100_000,
    gid: 100_000,
    count: 65_536,
};

// ---------------------------------------------------------------- harness --

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "privileged mount tests must run as root (they really mount); run `cargo test -p cairn-mount` as root"
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

/// An image, its objects and an empty mount target in a temp dir under /tmp.
struct Fixture {
    dir: tempfile::TempDir,
    image: PathBuf,
    objects: PathBuf,
    target: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("cairn-mount-test.")
            .tempdir_in("/tmp")
            .expect("tempdir");
        Self::build_in(dir)
    }

    fn build_in(dir: tempfile::TempDir) -> Self {
        let root = dir.path();
        let objects = root.join("objects");
        for (name, data) in [(HELLO_OBJECT, HELLO), (NOTES_OBJECT, NOTES)] {
            let path = objects.join(name);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, data).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o444)).unwrap();
        }

        // The tree the composefs writer would describe: regular files are
        // empty, sized, with a redirect to their object and a metacopy mark.
        let src = root.join("src");
        fs::create_dir_all(src.join("home/user")).unwrap();
        fs::create_dir_all(src.join("etc")).unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o755)).unwrap();
        let stub = |rel: &str, object: &str, len: usize, owner: u32, mode: u32| {
            let path = src.join(rel);
            let f = fs::File::create(&path).unwrap();
            f.set_len(len as u64).unwrap();
            let redirect = format!("/{object}");
            rustix::fs::setxattr(
                &path,
                "trusted.overlay.redirect",
                redirect.as_bytes(),
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap();
            rustix::fs::setxattr(
                &path,
                "trusted.overlay.metacopy",
                b"",
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap();
            std::os::unix::fs::chown(&path, Some(owner), Some(owner)).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
        };
        stub("hello.txt", HELLO_OBJECT, HELLO.len(), 0, 0o644);
        stub("home/user/notes", NOTES_OBJECT, NOTES.len(), 1000, 0o600);
        std::os::unix::fs::chown(src.join("home/user"), Some(1000), Some(1000)).unwrap();
        fs::write(src.join("etc/plain.conf"), INLINE).unwrap();

        let image = root.join("image.erofs");
        let out = Command::new("mkfs.erofs")
            .arg("--quiet")
            .arg("-x1")
            .arg(&image)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("running mkfs.erofs ({e}): install erofs-utils (apt-get install -y erofs-utils)"));
        assert!(
            out.status.success(),
            "mkfs.erofs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        let target = root.join("mnt");
        fs::create_dir(&target).unwrap();
        Fixture {
            dir,
            image,
            objects,
            target,
        }
    }

    fn opts(&self, upper: UpperSpec) -> MountOptions<'_> {
        MountOptions {
            image: &self.image,
            objects: &self.objects,
            local_objects: None,
            target: &self.target,
            upper,
            idmap: None,
            verity: VerityMode::Off,
        }
    }

    fn at(&self, rel: &str) -> PathBuf {
        self.target.join(rel)
    }

    /// Every file under objects/ and the image, with contents and modes.
    fn store_snapshot(&self) -> BTreeMap<PathBuf, (Vec<u8>, u32)> {
        let mut snap = BTreeMap::new();
        let mut stack = vec![self.objects.clone()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                let meta = fs::symlink_metadata(&path).unwrap();
                if meta.is_dir() {
                    stack.push(path.clone());
                    snap.insert(path, (Vec::new(), meta.mode()));
                } else {
                    snap.insert(path.clone(), (fs::read(&path).unwrap(), meta.mode()));
                }
            }
        }
        let meta = fs::metadata(&self.image).unwrap();
        snap.insert(
            self.image.clone(),
            (fs::read(&self.image).unwrap(), meta.mode()),
        );
        snap
    }

    /// Waits up to two seconds for every loop device backed by a file of
    /// this fixture to be detached (autoclear runs as the last opener
    /// closes the device, which can trail the unmount a little).
    fn assert_no_loop_devices(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let found = self.loop_devices_on_fixture();
            if found.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: loop devices still attached: {found:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Loop devices whose backing file is inside this fixture.
    fn loop_devices_on_fixture(&self) -> Vec<String> {
        let root = self.dir.path().to_string_lossy().into_owned();
        let mut found = Vec::new();
        for entry in fs::read_dir("/sys/block").unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                continue;
            }
            if let Ok(backing) = fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            {
                if backing.trim().starts_with(&root) {
                    found.push(format!("/dev/{name} → {}", backing.trim()));
                }
            }
        }
        found
    }
}

/// Watches the image for the kernel closing it (EROFS superblock teardown).
struct ImageWatch {
    fd: OwnedFd,
}

impl ImageWatch {
    fn new(image: &Path) -> Self {
        let fd =
            inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK).unwrap();
        inotify::add_watch(&fd, image, inotify::WatchFlags::CLOSE_NOWRITE).unwrap();
        ImageWatch { fd }
    }

    fn closes(&self) -> usize {
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(&self.fd, &mut buf);
        let mut n = 0;
        loop {
            match reader.next() {
                Ok(ev) if ev.events().contains(inotify::ReadFlags::CLOSE_NOWRITE) => n += 1,
                Ok(_) => {}
                Err(Errno::AGAIN) => return n,
                Err(e) => panic!("reading inotify: {e}"),
            }
        }
    }

    /// Drops queued events (e.g. from our own reads of the image).
    fn reset(&self) {
        self.closes();
    }

    fn assert_released(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if self.closes() > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: the kernel still holds the EROFS image open (a detached EROFS mount survived)"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn assert_still_held(&self, what: &str) {
        assert_eq!(
            self.closes(),
            0,
            "{what}: the EROFS image was closed while it should be mounted"
        );
    }
}

fn mounts() -> Vec<MountEntry> {
    mount_table().expect("read mountinfo")
}

/// The entries of `now` that were not in `before`.
fn new_mounts(before: &[MountEntry], now: &[MountEntry]) -> Vec<MountEntry> {
    now.iter()
        .filter(|m| !before.contains(m))
        .cloned()
        .collect()
}

/// Asserts the only new mount is our overlay on the target, sourced from the image.
fn assert_only_the_overlay(fx: &Fixture, before: &[MountEntry]) -> MountEntry {
    let added = new_mounts(before, &mounts());
    assert_eq!(
        added.len(),
        1,
        "exactly one new mount expected, got {added:#?}"
    );
    let ovl = added.into_iter().next().unwrap();
    assert_eq!(ovl.fs_type, "overlay");
    assert_eq!(ovl.mount_point, fs::canonicalize(&fx.target).unwrap());
    assert_eq!(ovl.source, fx.image.to_string_lossy());
    assert_eq!(find_mount(&fx.target).unwrap().as_ref(), Some(&ovl));
    assert!(is_mountpoint(&fx.target).unwrap());
    ovl
}

/// Unmounts the test's stack. The tests run on threads of one process, and
/// any of them may fork (mkfs.erofs, the user-namespace holder, the kill
/// helper): until the child execs or closes its descriptors it holds copies
/// of every fd this thread has open, files in our overlay included, and the
/// kernel answers `EBUSY`. Such a hold lasts microseconds, so `EBUSY` is
/// retried for up to two seconds; a file this test itself forgot to close
/// keeps the mount busy for longer and still fails.
fn umount_own_stack(target: &Path) {
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

fn unmount_and_check_clean(fx: &Fixture, before: &[MountEntry], watch: &ImageWatch) {
    umount_own_stack(&fx.target);
    watch.assert_released("after umount");
    assert_eq!(mounts(), before, "mount table must be exactly as before");
    assert!(!is_mountpoint(&fx.target).unwrap());
    fx.assert_no_loop_devices("after umount");
}

fn errno_of(err: &std::io::Error) -> Option<Errno> {
    Errno::from_io_error(err)
}

// ------------------------------------------------------------------ tests --

#[test]
fn privileged_probe_finds_the_stack_features_and_leaves_nothing() {
    in_private_mount_ns(|| {
        let before = mounts();
        let features = KernelFeatures::detect();
        println!("{features}");
        assert_eq!(mounts(), before, "probing must not leave mounts");
        let fx = Fixture::new();
        let needed = fx
            .opts(UpperSpec::Tmpfs { size: None })
            .required_features()
            .into_iter()
            .chain([
                Feature::IdmappedMounts,
                Feature::UserNamespaces,
                Feature::Fuse,
            ])
            .collect::<Vec<_>>();
        features
            .require(&needed)
            .expect("this machine has the whole stack (see docs/machines.md)");
        assert_eq!(
            features.has(Feature::OverlayLayerAppend),
            probe().has(Feature::OverlayLayerAppend)
        );
        if !features.has(Feature::FsVerity) {
            let err = features
                .require(&[Feature::Erofs, Feature::FsVerity])
                .unwrap_err();
            let text = err.to_string();
            assert_eq!(err.feature, Feature::FsVerity);
            assert!(
                text.contains("lacks fs-verity (CONFIG_FS_VERITY, Linux ≥ 5.4"),
                "{text}"
            );
            assert!(text.contains("mount with verity off"), "{text}");
        }
    });
}

#[test]
fn privileged_readonly_stack_serves_object_data() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        mount_image(&fx.opts(UpperSpec::None)).expect("mount read-only stack");
        watch.reset();

        let ovl = assert_only_the_overlay(&fx, &before);
        assert!(ovl.mount_options.split(',').any(|o| o == "ro"), "{ovl:?}");
        println!("overlay: {ovl:?}");
        if cairn_mount::erofs_loop_forced() {
            assert_eq!(fx.loop_devices_on_fixture().len(), 1, "CAIRN_EROFS_LOOP=1");
        } else {
            assert_eq!(
                fx.loop_devices_on_fixture(),
                Vec::<String>::new(),
                "EROFS must not use a loop device"
            );
        }

        // Data of redirect+metacopy files comes from objects/.
        assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
        assert_eq!(fs::read(fx.at("home/user/notes")).unwrap(), NOTES);
        assert_eq!(fs::read(fx.at("etc/plain.conf")).unwrap(), INLINE);
        // Metadata comes from the image.
        let hello = fs::metadata(fx.at("hello.txt")).unwrap();
        assert_eq!(
            (hello.uid(), hello.len(), hello.mode() & 0o7777),
            (0, HELLO.len() as u64, 0o644)
        );
        let notes = fs::metadata(fx.at("home/user/notes")).unwrap();
        assert_eq!(
            (notes.uid(), notes.gid(), notes.mode() & 0o7777),
            (1000, 1000, 0o600)
        );

        let write = fs::File::create(fx.at("new.txt")).unwrap_err();
        assert_eq!(errno_of(&write), Some(Errno::ROFS));
        watch.assert_still_held("while mounted");

        unmount_and_check_clean(&fx, &before, &watch);
        let again = umount(&fx.target).unwrap_err();
        assert!(matches!(again, MountError::NotMounted(_)), "{again}");
        assert!(
            again.to_string().contains(&*fx.target.to_string_lossy()),
            "{again}"
        );
    });
}

#[test]
fn privileged_tmpfs_upper_takes_writes_and_leaves_the_store_untouched() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let store = fx.store_snapshot();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        mount_image(&fx.opts(UpperSpec::Tmpfs { size: None })).expect("mount with tmpfs upper");
        watch.reset();
        let ovl = assert_only_the_overlay(&fx, &before);
        assert!(!ovl.mount_options.split(',').any(|o| o == "ro"), "{ovl:?}");

        fs::write(fx.at("new.txt"), b"fresh").unwrap();
        // Appending to a metacopy file copies its data up from the object.
        fs::OpenOptions::new()
            .append(true)
            .open(fx.at("hello.txt"))
            .unwrap()
            .write_all(b"appended\n")
            .unwrap();
        fs::remove_file(fx.at("home/user/notes")).unwrap();
        fs::create_dir(fx.at("etc/new.d")).unwrap();

        assert_eq!(fs::read(fx.at("new.txt")).unwrap(), b"fresh");
        assert_eq!(
            fs::read(fx.at("hello.txt")).unwrap(),
            [HELLO, b"appended\n"].concat()
        );
        assert!(!fx.at("home/user/notes").exists());
        // The merged root takes its attributes from the image root.
        let root = fs::metadata(&fx.target).unwrap();
        assert_eq!((root.uid(), root.mode() & 0o7777), (0, 0o755));

        assert_eq!(
            fx.store_snapshot(),
            store,
            "objects/ and the image must be unchanged"
        );
        unmount_and_check_clean(&fx, &before, &watch);
        assert_eq!(fx.store_snapshot(), store);

        // The tmpfs upper died with the mount: a new one starts clean.
        mount_image(&fx.opts(UpperSpec::Tmpfs { size: None })).expect("remount");
        watch.reset();
        assert!(!fx.at("new.txt").exists());
        assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
        assert_eq!(fs::read(fx.at("home/user/notes")).unwrap(), NOTES);
        unmount_and_check_clean(&fx, &before, &watch);
    });
}

#[test]
fn privileged_dir_upper_keeps_writes_on_the_host() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let store = fx.store_snapshot();
        let state = fx.dir.path().join("state/container-1");
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        mount_image(&fx.opts(UpperSpec::Dir(state.clone()))).expect("mount with dir upper");
        watch.reset();
        assert_only_the_overlay(&fx, &before);

        fs::write(fx.at("kept.txt"), b"kept").unwrap();
        fs::OpenOptions::new()
            .append(true)
            .open(fx.at("hello.txt"))
            .unwrap()
            .write_all(b"more\n")
            .unwrap();
        unmount_and_check_clean(&fx, &before, &watch);

        // The writes are plain files on the host, usage visible to du.
        assert_eq!(fs::read(state.join("upper/kept.txt")).unwrap(), b"kept");
        assert_eq!(
            fs::read(state.join("upper/hello.txt")).unwrap(),
            [HELLO, b"more\n"].concat()
        );
        assert!(state.join("work").is_dir());
        let upper_root = fs::metadata(state.join("upper")).unwrap();
        assert_eq!(upper_root.mode() & 0o7777, 0o755);

        // Mounting again with the same directory brings them back.
        mount_image(&fx.opts(UpperSpec::Dir(state.clone()))).expect("remount with dir upper");
        watch.reset();
        assert_eq!(fs::read(fx.at("kept.txt")).unwrap(), b"kept");
        assert_eq!(fs::read(fx.at("home/user/notes")).unwrap(), NOTES);
        unmount_and_check_clean(&fx, &before, &watch);
        assert_eq!(fx.store_snapshot(), store);
    });
}

#[test]
fn privileged_size_capped_tmpfs_gives_enospc() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        let cap = 1 << 20;
        mount_image(&fx.opts(UpperSpec::Tmpfs { size: Some(cap) }))
            .expect("mount with capped tmpfs");
        watch.reset();

        let mut f = fs::File::create(fx.at("big")).unwrap();
        let chunk = vec![0x5a_u8; 64 * 1024];
        let mut written = 0u64;
        let err = loop {
            match f.write_all(&chunk) {
                Ok(()) => written += chunk.len() as u64,
                Err(e) => break e,
            }
            assert!(
                written <= 4 * cap,
                "wrote {written} bytes into a {cap}-byte tmpfs"
            );
        };
        assert_eq!(errno_of(&err), Some(Errno::NOSPC), "{err}");
        assert!(written < cap + chunk.len() as u64, "{written}");
        drop(f);
        // Reads of the lower layers still work on a full upper.
        assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
        unmount_and_check_clean(&fx, &before, &watch);
    });
}

#[test]
fn privileged_idmap_shifts_owners_of_image_and_upper_root() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        let mut opts = fx.opts(UpperSpec::Tmpfs { size: None });
        opts.idmap = Some(IDMAP);
        mount_image(&opts).expect("mount idmapped stack");
        watch.reset();
        assert_only_the_overlay(&fx, &before);

        let owner = |rel: &str| {
            let m = fs::metadata(fx.at(rel)).unwrap();
            (m.uid(), m.gid())
        };
        assert_eq!(owner("hello.txt"), (100_000, 100_000), "root-owned file");
        assert_eq!(owner("home/user"), (101_000, 101_000), "dir owned by 1000");
        assert_eq!(
            owner("home/user/notes"),
            (101_000, 101_000),
            "file owned by 1000"
        );
        assert_eq!(
            owner(""),
            (100_000, 100_000),
            "merged root (upper root) belongs to container root"
        );
        // Data still comes from the (idmapped) objects layer.
        assert_eq!(fs::read(fx.at("home/user/notes")).unwrap(), NOTES);

        // Writable (not the silent read-only fallback), and copy-up keeps
        // the shifted owner.
        fs::OpenOptions::new()
            .append(true)
            .open(fx.at("home/user/notes"))
            .unwrap()
            .write_all(b"+")
            .unwrap();
        assert_eq!(owner("home/user/notes"), (101_000, 101_000));
        assert_eq!(
            fs::read(fx.at("home/user/notes")).unwrap(),
            [NOTES, b"+"].concat()
        );
        fs::write(fx.at("by-host-root"), b"x").unwrap();

        unmount_and_check_clean(&fx, &before, &watch);

        // Without the map the same image shows its own ids.
        mount_image(&fx.opts(UpperSpec::None)).unwrap();
        watch.reset();
        assert_eq!(owner("home/user/notes"), (1000, 1000));
        unmount_and_check_clean(&fx, &before, &watch);
    });
}

#[test]
fn privileged_failure_halfway_leaves_nothing() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let store = fx.store_snapshot();
        let before = mounts();
        let missing = fx.dir.path().join("no-such-objects");
        let garbage = fx.dir.path().join("garbage.img");
        fs::write(&garbage, vec![0u8; 16384]).unwrap();
        let nowhere = fx.dir.path().join("no-such-target");
        let shm = tempfile::Builder::new()
            .prefix("cairn-mount-test.")
            .tempdir_in("/dev/shm")
            .expect("tempdir on tmpfs");
        let on_tmpfs = shm.path().join("image.erofs");
        fs::copy(&fx.image, &on_tmpfs).unwrap();

        struct Case<'a> {
            name: &'a str,
            opts: MountOptions<'a>,
            /// Whether the EROFS mount existed when the failure hit.
            erofs_was_mounted: bool,
            expect: &'a dyn Fn(&MountError),
        }
        let base = fx.opts(UpperSpec::Tmpfs { size: None });
        let cases = [
            Case {
                name: "objects directory missing (after the EROFS fsmount)",
                opts: MountOptions {
                    objects: &missing,
                    ..base.clone()
                },
                erofs_was_mounted: true,
                expect: &|e| {
                    assert!(
                        matches!(
                            e,
                            MountError::Step {
                                action: Action::OpenObjects,
                                errno: Errno::NOENT,
                                ..
                            }
                        ),
                        "{e:?}"
                    );
                    assert_eq!(
                        e.to_string(),
                        format!(
                            "opening objects directory {}: open: No such file or directory",
                            missing.display()
                        )
                    );
                },
            },
            Case {
                name: "objects directory missing, idmapped (user namespace made, EROFS idmapped)",
                opts: MountOptions {
                    objects: &missing,
                    idmap: Some(IDMAP),
                    ..base.clone()
                },
                erofs_was_mounted: true,
                expect: &|e| {
                    assert!(
                        matches!(
                            e,
                            MountError::Step {
                                action: Action::OpenObjects,
                                ..
                            }
                        ),
                        "{e:?}"
                    )
                },
            },
            Case {
                name: "image is not EROFS",
                opts: MountOptions {
                    image: &garbage,
                    ..base.clone()
                },
                erofs_was_mounted: false,
                expect: &|e| {
                    assert!(
                        matches!(
                            e,
                            MountError::Step {
                                action: Action::MountErofs,
                                errno: Errno::INVAL,
                                ..
                            }
                        ),
                        "{e:?}"
                    );
                    let text = e.to_string();
                    assert!(
                        text.starts_with(&format!(
                            "mounting EROFS image {}: fsconfig create",
                            garbage.display()
                        )),
                        "{text}"
                    );
                },
            },
            Case {
                name: "image on tmpfs (EROFS cannot read it without a loop device)",
                opts: MountOptions {
                    image: &on_tmpfs,
                    ..base.clone()
                },
                erofs_was_mounted: false,
                expect: &|e| {
                    assert!(
                        matches!(
                            e,
                            MountError::Step {
                                action: Action::MountErofs,
                                errno: Errno::NOTBLK,
                                ..
                            }
                        ),
                        "{e:?}"
                    );
                    assert!(e.to_string().contains("e.g. tmpfs"), "{e}");
                },
            },
            Case {
                name: "target missing (fails at the last step, move_mount)",
                opts: MountOptions {
                    target: &nowhere,
                    ..base.clone()
                },
                erofs_was_mounted: true,
                expect: &|e| {
                    assert!(
                        matches!(
                            e,
                            MountError::Step {
                                action: Action::AttachOverlay,
                                errno: Errno::NOENT,
                                ..
                            }
                        ),
                        "{e:?}"
                    );
                    assert!(e.to_string().contains("move_mount"), "{e}");
                },
            },
            Case {
                name: "zero-size tmpfs",
                opts: MountOptions {
                    upper: UpperSpec::Tmpfs { size: Some(0) },
                    ..base.clone()
                },
                erofs_was_mounted: false,
                expect: &|e| assert!(matches!(e, MountError::Invalid { .. }), "{e:?}"),
            },
        ];
        // On the loop path (CAIRN_EROFS_LOOP=1) an image on tmpfs mounts.
        let loop_forced = cairn_mount::erofs_loop_forced();
        for case in cases
            .into_iter()
            .filter(|c| !(loop_forced && c.name.starts_with("image on tmpfs")))
        {
            let watch = ImageWatch::new(case.opts.image);
            let err = mount_image(&case.opts).expect_err(case.name);
            (case.expect)(&err);
            if case.erofs_was_mounted {
                watch.assert_released(case.name);
            }
            assert_eq!(mounts(), before, "{}: mount table changed", case.name);
            fx.assert_no_loop_devices(case.name);
            assert!(
                !nowhere.exists(),
                "{}: no directory may be created",
                case.name
            );
        }
        assert_eq!(fx.store_snapshot(), store);
        let leftovers: Vec<_> = fs::read_dir(fx.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        assert_eq!(
            leftovers,
            ["garbage.img", "image.erofs", "mnt", "objects", "src"],
            "no temporary files"
        );
    });
}

#[test]
fn privileged_verity_require_is_refused_without_kernel_fs_verity() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let mut opts = fx.opts(UpperSpec::None);
        opts.verity = VerityMode::Require;
        let support = cairn_mount::probe::verity_support_at(opts.objects);
        if support == cairn_mount::Support::Present {
            // A kernel with fs-verity: the stack mounts (reads of objects
            // without verity would then fail, which is the point).
            mount_image(&opts).expect("verity=require mounts where the kernel has fs-verity");
            umount_own_stack(&fx.target);
        } else {
            let err = mount_image(&opts).expect_err("verity=require without kernel fs-verity");
            match &err {
                MountError::Unsupported(missing) => assert_eq!(missing.feature, Feature::FsVerity),
                other => panic!("expected Unsupported(FsVerity), got {other:?}"),
            }
            assert!(err.to_string().contains("fs-verity"), "{err}");
        }
        assert_eq!(mounts(), before);
    });
}

#[test]
fn privileged_busy_umount_names_the_target_and_lazy_umount_detaches() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        mount_image(&fx.opts(UpperSpec::None)).unwrap();
        watch.reset();

        let mut held = fs::File::open(fx.at("hello.txt")).unwrap();
        let err = umount(&fx.target).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::BUSY), "{err}");
        // The C library's text for EBUSY ("Device or resource busy" with
        // glibc, "Resource busy" with musl).
        let busy = std::io::Error::from(Errno::BUSY).to_string();
        let busy = busy.split(" (os error").next().unwrap_or_default();
        assert_eq!(
            err.to_string(),
            format!("unmounting {}: umount2: {busy}", fx.target.display())
        );

        umount_with(&fx.target, UmountOptions { lazy: true }).expect("lazy umount");
        assert_eq!(mounts(), before, "a lazy umount detaches at once");
        // The open file keeps the detached stack alive until it is closed.
        let mut data = Vec::new();
        held.read_to_end(&mut data).unwrap();
        assert_eq!(data, HELLO);
        watch.assert_still_held("while a file of the lazily unmounted stack is open");
        drop(held);
        watch.assert_released("after the last open file closed");
    });
}

#[test]
fn privileged_legacy_lowerdir_syntax_builds_the_same_stack() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        cairn_mount::stack::prepare_image_with_legacy_lowerdir(
            &fx.opts(UpperSpec::Tmpfs { size: None }),
        )
        .expect("prepare with lowerdir=META::OBJECTS")
        .attach(&fx.target)
        .expect("attach");
        watch.reset();
        let ovl = assert_only_the_overlay(&fx, &before);
        assert!(
            ovl.super_options.contains("::"),
            "data-only layer in the lowerdir string: {ovl:?}"
        );
        assert!(!ovl.super_options.contains("lowerdir+"), "{ovl:?}");
        assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
        fs::write(fx.at("new.txt"), b"w").unwrap();
        unmount_and_check_clean(&fx, &before, &watch);
    });
}

/// The path of kernels before 6.15 (layers attached in a private namespace
/// of one thread while the overlay is made), taken here on purpose: the
/// same stack, idmapped or not, with nothing but the overlay in the mount
/// table, and the overlay still serving once that namespace is gone.
#[test]
fn privileged_private_namespace_path_builds_the_same_stack() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        for idmap in [None, Some(IDMAP)] {
            let before = mounts();
            let watch = ImageWatch::new(&fx.image);
            let mut opts = fx.opts(UpperSpec::Tmpfs { size: None });
            opts.idmap = idmap;
            cairn_mount::stack::prepare_image_in_private_namespace(&opts)
                .expect("prepare with the layers in a private namespace")
                .attach(&fx.target)
                .expect("attach");
            watch.reset();
            assert_only_the_overlay(&fx, &before);
            assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
            assert_eq!(fs::read(fx.at("home/user/notes")).unwrap(), NOTES);
            if idmap.is_some() {
                let m = fs::metadata(fx.at("home/user/notes")).unwrap();
                assert_eq!((m.uid(), m.gid()), (101_000, 101_000), "idmapped");
            }
            fs::write(fx.at("new.txt"), b"w").unwrap();
            unmount_and_check_clean(&fx, &before, &watch);
        }
    });
}

/// A data-only layer before the objects (`local_objects`, what a lazy
/// mount puts the store in front of its FUSE layer with): a file's data
/// comes from the first layer that has it, and the second fills in what
/// the first lacks. On every path: detached layers, the legacy lowerdir
/// string, and the private namespace, idmapped or not.
#[test]
fn privileged_local_objects_layer_comes_first_and_the_other_fills_in() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        // The first layer holds only hello's object, with other bytes of
        // the same length (nothing checks contents with verity off), so
        // the test sees which layer answered.
        let first = fx.dir.path().join("first");
        let local_hello: Vec<u8> = HELLO.iter().map(|b| b.to_ascii_uppercase()).collect();
        fs::create_dir_all(first.join(HELLO_OBJECT).parent().unwrap()).unwrap();
        fs::write(first.join(HELLO_OBJECT), &local_hello).unwrap();
        type Prepare = fn(&MountOptions<'_>) -> Result<cairn_mount::PreparedMount, MountError>;
        let paths: [(&str, Prepare, Option<IdMap>); 4] = [
            ("detached", prepare_image, None),
            (
                "legacy lowerdir",
                cairn_mount::stack::prepare_image_with_legacy_lowerdir,
                None,
            ),
            (
                "private namespace",
                cairn_mount::stack::prepare_image_in_private_namespace,
                None,
            ),
            (
                "private namespace, idmapped",
                cairn_mount::stack::prepare_image_in_private_namespace,
                Some(IDMAP),
            ),
        ];
        for (what, prepare, idmap) in paths {
            let before = mounts();
            let watch = ImageWatch::new(&fx.image);
            let mut opts = fx.opts(UpperSpec::None);
            opts.local_objects = Some(&first);
            opts.idmap = idmap;
            prepare(&opts)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .attach(&fx.target)
                .unwrap_or_else(|e| panic!("{what}: attach: {e}"));
            watch.reset();
            let ovl = assert_only_the_overlay(&fx, &before);
            assert_eq!(
                fs::read(fx.at("hello.txt")).unwrap(),
                local_hello,
                "{what}: hello.txt's data from the first layer ({ovl:?})"
            );
            assert_eq!(
                fs::read(fx.at("home/user/notes")).unwrap(),
                NOTES,
                "{what}: notes' data from the second layer"
            );
            unmount_and_check_clean(&fx, &before, &watch);
        }
    });
}

/// The mounter is killed with SIGKILL after building the whole stack
/// (userns, idmapped EROFS and objects, tmpfs upper, overlay) but before
/// attaching it: everything must vanish with the process.
#[test]
fn privileged_killed_mounter_leaves_nothing() {
    killed_mounter_leaves_nothing(false);
}

/// The same with the image on a loop device (`CAIRN_EROFS_LOOP=1` in the
/// mounter): the device must be detached with the process.
#[test]
fn privileged_killed_mounter_on_loop_path_leaves_nothing() {
    killed_mounter_leaves_nothing(true);
}

fn killed_mounter_leaves_nothing(on_loop: bool) {
    in_private_mount_ns(move || {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        let mut helper = Command::new(std::env::current_exe().unwrap());
        if on_loop {
            helper.env(cairn_mount::EROFS_LOOP_ENV, "1");
        }
        let mut child = helper
            .args([
                "--exact",
                "kill_helper_prepares_a_stack_and_waits",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HELPER_ENV, fx.dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn helper");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains(HELPER_READY));
        assert!(ready, "helper did not get its stack ready");
        if on_loop {
            assert_eq!(
                fx.loop_devices_on_fixture().len(),
                1,
                "the helper's image is on a loop device"
            );
        } else {
            watch.assert_still_held("while the helper holds the prepared stack");
        }

        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        watch.assert_released("after the mounter was killed");
        assert_eq!(mounts(), before);
        fx.assert_no_loop_devices("after the mounter was killed");
    });
}

const HELPER_ENV: &str = "CAIRN_MOUNT_KILL_HELPER_DIR";
const HELPER_READY: &str = "CAIRN-HELPER-READY";

/// Not a test on its own: the process that `privileged_killed_mounter_leaves_nothing`
/// starts and kills. Does nothing unless that test set its environment.
#[test]
#[ignore = "helper process for privileged_killed_mounter_leaves_nothing"]
fn kill_helper_prepares_a_stack_and_waits() {
    let Some(dir) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let (image, objects, target) = (
        dir.join("image.erofs"),
        dir.join("objects"),
        dir.join("mnt"),
    );
    let opts = MountOptions {
        image: &image,
        objects: &objects,
        local_objects: None,
        target: &target,
        upper: UpperSpec::Tmpfs {
            size: Some(1 << 20),
        },
        idmap: Some(IDMAP),
        verity: VerityMode::Off,
    };
    // Probed first, so that a kernel without detached layers (< 6.15) does
    // not make (and close) a first EROFS mount before the stack the parent
    // watches.
    let _ = cairn_mount::probe();
    let prepared = prepare_image(&opts).expect("helper: prepare stack");
    println!("{HELPER_READY}");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
    drop(prepared);
    panic!("helper was not killed");
}

// ------------------------------------------------- the loop device path --

/// The image on a read-only loop device: the stack serves the same data,
/// the device is attached (read-only, autoclear) while mounted and detached
/// by the unmount alone.
#[test]
fn privileged_loop_path_mounts_reads_and_detaches_with_the_mount() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let watch = ImageWatch::new(&fx.image);
        cairn_mount::stack::prepare_image_on_loop_device(&fx.opts(UpperSpec::Tmpfs { size: None }))
            .expect("prepare the stack on a loop device")
            .attach(&fx.target)
            .expect("attach");
        watch.reset();
        let ovl = assert_only_the_overlay(&fx, &before);
        println!("overlay: {ovl:?}");

        let devices = fx.loop_devices_on_fixture();
        assert_eq!(
            devices.len(),
            1,
            "one loop device for the image: {devices:?}"
        );
        assert_eq!(
            cairn_mount::loopdev::loop_devices_backed_by(&fx.image).len(),
            1
        );
        let name = cairn_mount::loopdev::loop_devices_backed_by(&fx.image).remove(0);
        let attr = |a: &str| {
            fs::read_to_string(format!("/sys/block/{name}/{a}"))
                .unwrap()
                .trim()
                .to_string()
        };
        assert_eq!(attr("ro"), "1", "read-only device");
        assert_eq!(attr("loop/autoclear"), "1", "autoclear device");
        println!("{name}: dio={}", attr("loop/dio"));

        assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
        assert_eq!(fs::read(fx.at("home/user/notes")).unwrap(), NOTES);
        assert_eq!(fs::read(fx.at("etc/plain.conf")).unwrap(), INLINE);
        fs::write(fx.at("new.txt"), b"written").unwrap();
        assert_eq!(fs::read(fx.at("new.txt")).unwrap(), b"written");

        unmount_and_check_clean(&fx, &before, &watch);
    });
}

/// Every failure on the loop path, before and after the EROFS mount took
/// the device, leaves no device attached and nothing mounted.
#[test]
fn privileged_loop_path_failures_leave_no_loop_device() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let garbage = fx.dir.path().join("garbage.img");
        fs::write(&garbage, vec![0u8; 16384]).unwrap();
        let missing = fx.dir.path().join("no-such-objects");
        let nowhere = fx.dir.path().join("no-such-target");
        let absent_image = fx.dir.path().join("no-such-image");
        let base = fx.opts(UpperSpec::Tmpfs { size: None });
        let cases: [(&str, MountOptions<'_>, Action); 4] = [
            (
                "not an EROFS image (the mount refuses the device)",
                MountOptions {
                    image: &garbage,
                    ..base.clone()
                },
                Action::MountErofs,
            ),
            (
                "no image file (nothing to attach)",
                MountOptions {
                    image: &absent_image,
                    ..base.clone()
                },
                Action::MountErofs,
            ),
            (
                "objects directory missing (after the EROFS mount took the device)",
                MountOptions {
                    objects: &missing,
                    ..base.clone()
                },
                Action::OpenObjects,
            ),
            (
                "target missing (fails at the last step)",
                MountOptions {
                    target: &nowhere,
                    ..base.clone()
                },
                Action::AttachOverlay,
            ),
        ];
        for (name, opts, action) in cases {
            let err = cairn_mount::stack::prepare_image_on_loop_device(&opts)
                .and_then(|m| m.attach(opts.target))
                .expect_err(name);
            assert!(
                matches!(&err, MountError::Step { action: a, .. } if *a == action),
                "{name}: {err:?}"
            );
            println!("{name}: {err}");
            assert_eq!(mounts(), before, "{name}: mount table changed");
            fx.assert_no_loop_devices(name);
        }
    });
}

// ------------------------------------------------------ any kernel at all --

/// What the probe says decides what a mount does, on any kernel: where it
/// finds the whole stack, the image mounts on the path it names (a loop
/// device exactly when it says so); where it does not, the mount stops with
/// one line naming the first missing feature and the kernel version that
/// brings it, and nothing is mounted or attached. The kernel matrix
/// (scripts/vm-test.sh) runs this on kernels of both kinds.
#[test]
fn privileged_mount_follows_the_probe() {
    in_private_mount_ns(|| {
        let fx = Fixture::new();
        let before = mounts();
        let features = probe();
        println!("{features}");
        let opts = fx.opts(UpperSpec::Tmpfs { size: None });
        let supported = features
            .require(&opts.required_features())
            .and_then(|()| features.erofs_path());
        match supported {
            Ok(path) => {
                mount_image(&opts).expect("the probe found the whole stack");
                assert_only_the_overlay(&fx, &before);
                assert_eq!(fs::read(fx.at("hello.txt")).unwrap(), HELLO);
                let devices = fx.loop_devices_on_fixture();
                assert_eq!(
                    devices.len(),
                    usize::from(path == cairn_mount::ErofsPath::Loop),
                    "EROFS path {path:?}, loop devices {devices:?}"
                );
                umount_own_stack(&fx.target);
                assert_eq!(mounts(), before);
                fx.assert_no_loop_devices("after umount");
            }
            Err(missing) => {
                let err = mount_image(&opts).expect_err("the probe found a feature missing");
                let text = err.to_string();
                println!("refused: {text}");
                assert!(
                    matches!(&err, MountError::Unsupported(m) if m.feature == missing.feature),
                    "{err:?}"
                );
                assert!(!text.contains('\n'), "one line: {text}");
                assert!(text.contains("Linux ≥ "), "names the version: {text}");
                assert_eq!(mounts(), before, "nothing mounted");
                fx.assert_no_loop_devices("after the refusal");
            }
        }
    });
}
