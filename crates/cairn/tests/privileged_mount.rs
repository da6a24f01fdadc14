//! End-to-end: a tree with every kind of entry goes through `cairn mkfs
//! --store` and `cairn mount`, and comes back identical; idmapped mounts
//! shift owners; writable uppers behave like a normal filesystem and never
//! change the store; `umount` leaves nothing behind. These tests really
//! mount and fail loudly when not run as root.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;

struct Fixture {
    _dir: tempfile::TempDir,
    store: std::path::PathBuf,
    tree: std::path::PathBuf,
    image: std::path::PathBuf,
    base: std::path::PathBuf,
}

fn fixture() -> Fixture {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-e2e")
        .tempdir()
        .unwrap();
    let base = dir.path().to_path_buf();
    let store = base.join("store");
    let tree = base.join("tree");
    let image = base.join("tree.img");
    build_full_tree(&tree);
    cairn(
        &store,
        &[
            os("mkfs"),
            os("--store"),
            tree.as_os_str(),
            image.as_os_str(),
        ],
    );
    Fixture {
        _dir: dir,
        store,
        tree,
        image,
        base,
    }
}

#[test]
fn privileged_mount_shows_the_tree_exactly() {
    let f = fixture();
    let before = mounts_under(&f.base);
    let target = f.base.join("mnt");
    {
        let _m = mount(&f.store, &f.image, &target, &[]);
        assert_eq!(
            loop_devices_backed_under(&f.base),
            0,
            "the EROFS image must be mounted without a loop device"
        );
        let differences = diff(&snapshot(&f.tree), &snapshot(&target));
        assert!(
            differences.is_empty(),
            "mounted tree differs from the source:\n{}",
            differences.join("\n")
        );
        // overlayfs' own xattrs (redirect, metacopy, the root's opaque) never show through.
        let root_x = xattrs(&target);
        assert!(
            !root_x.keys().any(|k| k.starts_with(b"trusted.overlay.")),
            "{root_x:?}"
        );
        assert!(!xattrs(&target.join("large"))
            .keys()
            .any(|k| k.starts_with(b"trusted.overlay.")));
        // Read-only by default.
        let err = fs::write(target.join("new-file"), b"x").unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(libc_erofs()),
            "write to a read-only mount: {err}"
        );
    }
    assert_eq!(
        mounts_under(&f.base),
        before,
        "umount must leave the mount table as it was"
    );
}

fn libc_erofs() -> i32 {
    30 // EROFS
}

#[test]
fn privileged_dump_of_the_image_round_trips() {
    let f = fixture();
    let dump = cairn(&f.store, &[os("dump"), f.image.as_os_str()]).stdout;
    let dumpfile = f.base.join("tree.dump");
    fs::write(&dumpfile, &dump).unwrap();
    let again = f.base.join("again.img");
    cairn(
        &f.store,
        &[
            os("mkfs"),
            os("--from-dump"),
            dumpfile.as_os_str(),
            again.as_os_str(),
        ],
    );
    assert!(
        fs::read(&f.image).unwrap() == fs::read(&again).unwrap(),
        "dump -> mkfs must give the same bytes"
    );
    let out = std::process::Command::new("fsck.erofs")
        .arg(&f.image)
        .output()
        .expect("fsck.erofs (run setup.sh)");
    assert!(
        out.status.success(),
        "fsck.erofs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn privileged_idmapped_mount_shifts_owners() {
    let f = fixture();
    let target = f.base.join("mnt-idmap");
    let _m = mount(
        &f.store,
        &f.image,
        &target,
        &["--idmap", "100000:200000:65536"],
    );
    let src = snapshot(&f.tree);
    let mnt = snapshot(&target);
    for (name, e) in &src.entries {
        let m = &mnt.entries[name];
        let (uid, gid) = if e.uid < 65536 && e.gid < 65536 {
            (e.uid + 100000, e.gid + 200000)
        } else {
            (65534, 65534) // outside the map: the overflow ids
        };
        assert_eq!(
            (m.uid, m.gid),
            (uid, gid),
            "{}",
            String::from_utf8_lossy(name)
        );
        assert_eq!(m.mode, e.mode);
    }
    // Nothing in the store was chowned.
    for (_, (mode, _)) in objects_fingerprint(&f.store) {
        assert_eq!(mode & 0o7777, 0o644);
    }
    let any_object = fs::read_dir(f.store.join("objects"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let obj = fs::read_dir(any_object)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert_eq!(fs::metadata(obj).unwrap().uid(), 0);
}

fn exercise_writes(target: &Path) {
    // Create, overwrite, append, rename, delete image files, hardlink, chmod, xattrs.
    fs::write(target.join("created"), b"new").unwrap();
    fs::write(target.join("small"), b"overwritten").unwrap();
    assert_eq!(fs::read(target.join("small")).unwrap(), b"overwritten");
    {
        use std::io::Write;
        let mut a = fs::OpenOptions::new()
            .append(true)
            .open(target.join("large"))
            .unwrap();
        a.write_all(b"appended").unwrap();
    }
    assert_eq!(
        fs::metadata(target.join("large")).unwrap().len(),
        (3 << 20) + 8
    );
    fs::rename(target.join("four-k"), target.join("renamed")).unwrap();
    assert!(!target.join("four-k").exists());
    assert_eq!(fs::metadata(target.join("renamed")).unwrap().len(), 4096);
    fs::remove_file(target.join("links/second")).unwrap();
    assert_eq!(
        fs::metadata(target.join("links/original")).unwrap().nlink(),
        2
    );
    fs::remove_dir_all(target.join("many")).unwrap();
    assert!(!target.join("many").exists());
    fs::hard_link(target.join("created"), target.join("created-link")).unwrap();
    assert_eq!(fs::metadata(target.join("created")).unwrap().nlink(), 2);
    fs::set_permissions(target.join("setuid"), fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(
        fs::metadata(target.join("setuid")).unwrap().mode() & 0o7777,
        0o700
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("user.added"),
            os("-v"),
            os("1"),
            target.join("small").as_os_str(),
        ],
    );
    assert_eq!(
        xattrs(&target.join("small"))
            .get(&b"user.added"[..])
            .map(|v| v.as_slice()),
        Some(&b"1"[..])
    );
    fs::create_dir(target.join("newdir")).unwrap();
    fs::rename(target.join("links"), target.join("newdir/links-moved")).unwrap();
    assert_eq!(
        fs::read(target.join("newdir/links-moved/small-link")).unwrap(),
        b"tiny"
    );
}

#[test]
fn privileged_tmpfs_upper_takes_writes_and_spares_the_store() {
    let f = fixture();
    let before = objects_fingerprint(&f.store);
    let image_before = fs::read(&f.image).unwrap();
    let target = f.base.join("mnt-tmpfs");
    let table = mounts_under(&f.base);
    {
        let _m = mount(&f.store, &f.image, &target, &["--upper", "tmpfs:256M"]);
        exercise_writes(&target);
    }
    assert_eq!(mounts_under(&f.base), table);
    assert_eq!(
        objects_fingerprint(&f.store),
        before,
        "the store must not change"
    );
    assert!(fs::read(&f.image).unwrap() == image_before);
    // Ephemeral: a new mount shows the image as it was.
    let _m = mount(&f.store, &f.image, &target, &["--upper", "tmpfs"]);
    assert_eq!(fs::read(target.join("small")).unwrap(), b"hello, cairn\n");
    assert!(!target.join("created").exists());
}

#[test]
fn privileged_tmpfs_upper_size_cap_gives_enospc() {
    let f = fixture();
    let target = f.base.join("mnt-cap");
    let _m = mount(&f.store, &f.image, &target, &["--upper", "tmpfs:1M"]);
    let err = fs::write(target.join("big"), vec![0u8; 4 << 20]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(28), "expected ENOSPC, got {err}");
}

#[test]
fn privileged_dir_upper_keeps_writes_on_the_host() {
    let f = fixture();
    let before = objects_fingerprint(&f.store);
    let target = f.base.join("mnt-dir");
    let upper = f.base.join("upper");
    {
        let _m = mount(
            &f.store,
            &f.image,
            &target,
            &["--upper", upper.to_str().unwrap()],
        );
        exercise_writes(&target);
    }
    assert_eq!(
        objects_fingerprint(&f.store),
        before,
        "the store must not change"
    );
    assert_eq!(fs::read(upper.join("upper/created")).unwrap(), b"new");
    // Mounting again with the same upper shows the writes.
    let _m = mount(
        &f.store,
        &f.image,
        &target,
        &["--upper", upper.to_str().unwrap()],
    );
    assert_eq!(fs::read(target.join("small")).unwrap(), b"overwritten");
    assert!(!target.join("four-k").exists());
}

#[test]
fn privileged_bad_image_fails_cleanly() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let bad = dir.path().join("bad.img");
    fs::write(&bad, vec![0x5a; 8192]).unwrap();
    let target = dir.path().join("mnt");
    fs::create_dir(&target).unwrap();
    let before = mounts_under(dir.path());
    let out = cairn_raw(&store, &[os("mount"), bad.as_os_str(), target.as_os_str()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.img") && err.contains("not an EROFS image"),
        "{err}"
    );
    assert_eq!(mounts_under(dir.path()), before);
}

#[test]
fn privileged_mount_of_a_small_image_file_by_path() {
    // A one-file tree gives an image of a few blocks; mounting it by path
    // reads only its first block before handing it to the kernel.
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-small")
        .tempdir()
        .unwrap();
    let (store, tree, image) = (
        dir.path().join("store"),
        dir.path().join("t"),
        dir.path().join("t.img"),
    );
    fs::create_dir(&tree).unwrap();
    write_pattern(&tree.join("data"), 1 << 20, 9);
    cairn(
        &store,
        &[
            os("mkfs"),
            os("--store"),
            tree.as_os_str(),
            image.as_os_str(),
        ],
    );
    assert!(fs::metadata(&image).unwrap().len() > 4096);
    let target = dir.path().join("mnt");
    let _m = mount(&store, &image, &target, &[]);
    assert!(fs::read(target.join("data")).unwrap() == fs::read(tree.join("data")).unwrap());
}
