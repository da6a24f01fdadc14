//! fs-verity end to end: `cairn mount --verity require|auto|off`,
//! `--digest`, and `cairn fsck` on objects that are not what their name
//! says. Where the store's filesystem has fs-verity (the 6.12 guest of the
//! kernel matrix: ext4 with `-O verity`) the kernel's checks are exercised;
//! elsewhere (the development machine has no CONFIG_FS_VERITY) the refusal
//! paths are. Which branch runs is reported; `CAIRN_TEST_EXPECT_VERITY=1`
//! (set in the guest) makes a store without fs-verity a failure, so the
//! kernel branch cannot silently not run. These tests mount and fail
//! loudly when not run as root.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use common::*;
use sha2::{Digest, Sha256};

/// Larger than the inline threshold (64 bytes), so it is an object.
const HELLO: &[u8] = b"hello, verity: this file is long enough to live in the store as an object, not in the image\n";

struct Fixture {
    _dir: tempfile::TempDir,
    base: PathBuf,
    store: PathBuf,
    tree: PathBuf,
    /// The image as the store holds it (`images/<sha256>`).
    image: PathBuf,
    /// Its name in the store (what the tests mount).
    digest: String,
    /// Whether the store's objects have kernel fs-verity.
    verity: bool,
}

fn fixture() -> Fixture {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-verity")
        .tempdir()
        .unwrap();
    let base = dir.path().to_path_buf();
    let store = base.join("store");
    let tree = base.join("tree");
    fs::create_dir_all(tree.join("sub")).unwrap();
    fs::write(tree.join("hello.txt"), HELLO).unwrap();
    write_pattern(&tree.join("sub/big.bin"), 300_000, 7);
    let file = base.join("tree.img");
    cairn(
        &store,
        &[
            os("mkfs"),
            os("--store"),
            tree.as_os_str(),
            file.as_os_str(),
        ],
    );
    // `cairn mount FILE` copies the image into images/; do it once here.
    let digest = hex::encode(Sha256::digest(fs::read(&file).unwrap()));
    let image = store.join("images").join(&digest);
    let out = cairn_raw(&store, &[os("fsck")]);
    assert!(out.status.success(), "fresh store is clean");
    let verity = cairn_store::has_verity(&object_of(&store, HELLO)).unwrap();
    println!("store objects have kernel fs-verity: {verity}");
    if std::env::var("CAIRN_TEST_EXPECT_VERITY").as_deref() == Ok("1") {
        assert!(
            verity,
            "CAIRN_TEST_EXPECT_VERITY=1 but the store's objects have no fs-verity"
        );
    }
    // Copy the image into the store the way `cairn mount FILE` does, with
    // a mount that is dropped at once.
    {
        let _m = mount(&store, &file, &base.join("first"), &["--verity", "off"]);
    }
    assert!(image.is_file(), "{} in the store", image.display());
    Fixture {
        _dir: dir,
        base,
        store,
        tree,
        image,
        digest,
        verity,
    }
}

/// The object file holding `content`.
fn object_of(store: &Path, content: &[u8]) -> PathBuf {
    let id = cairn_store::fsverity_digest(content).unwrap();
    store.join("objects").join(id.object_path())
}

fn object_name(content: &[u8]) -> String {
    cairn_store::fsverity_digest(content).unwrap().object_path()
}

/// Replaces `path` by a new file holding `content` (by rename, as an
/// attacker with write access to the store could), optionally sealed.
fn replace_file(path: &Path, content: &[u8], seal: bool) {
    let tmp = path.with_extension("impostor");
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .unwrap();
        f.write_all(content).unwrap();
        f.sync_all().unwrap();
    }
    if seal {
        cairn_store::seal_with_verity(&tmp).expect("enable fs-verity on the replacement");
    }
    fs::rename(&tmp, path).unwrap();
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn try_mount(f: &Fixture, target: &Path, extra: &[&str]) -> std::process::Output {
    fs::create_dir_all(target).unwrap();
    let mut args = vec![os("mount"), os(&f.digest), target.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    cairn_raw(&f.store, &args)
}

#[test]
fn privileged_verity_require_reads_back_identical_or_refuses_naming_an_object() {
    let f = fixture();
    let target = f.base.join("mnt");
    let before = mounts_under(&f.base);
    if f.verity {
        let _m = mount(
            &f.store,
            Path::new(&f.digest),
            &target,
            &["--verity", "require"],
        );
        let entry = cairn_mount::find_mount(&target).unwrap().expect("mounted");
        assert!(entry.super_options.contains("verity=require"), "{entry:?}");
        assert_eq!(fs::read(target.join("hello.txt")).unwrap(), HELLO);
        assert_eq!(
            fs::read(target.join("sub/big.bin")).unwrap(),
            fs::read(f.tree.join("sub/big.bin")).unwrap()
        );
    } else {
        let out = try_mount(&f, &target, &["--verity", "require"]);
        let err = stderr(&out);
        assert!(!out.status.success(), "mounted without fs-verity: {err}");
        assert!(
            err.contains("--verity require: object ") && err.contains("has no fs-verity"),
            "{err}"
        );
        assert_eq!(mounts_under(&f.base), before, "nothing mounted");
    }
}

#[test]
fn privileged_verity_auto_says_which_mode_and_why() {
    let f = fixture();
    let target = f.base.join("mnt");
    let out = try_mount(&f, &target, &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let entry = cairn_mount::find_mount(&target).unwrap().expect("mounted");
    if f.verity {
        assert!(
            err.contains("cairn: verity require: every object of the image has fs-verity"),
            "{err}"
        );
        assert!(entry.super_options.contains("verity=require"), "{entry:?}");
    } else {
        assert!(err.contains("cairn: verity off: "), "{err}");
        assert!(!entry.super_options.contains("verity="), "{entry:?}");
    }
    assert_eq!(fs::read(target.join("hello.txt")).unwrap(), HELLO);
    cairn(&f.store, &[os("umount"), target.as_os_str()]);
    // off says nothing and mounts without verity.
    let out = try_mount(&f, &target, &["--verity", "off"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("verity"), "{}", stderr(&out));
    let entry = cairn_mount::find_mount(&target).unwrap().expect("mounted");
    assert!(!entry.super_options.contains("verity="), "{entry:?}");
    cairn(&f.store, &[os("umount"), target.as_os_str()]);
}

/// An object replaced by other bytes under the same name: with fs-verity
/// enabled on the impostor, a read through a `verity=require` mount fails
/// with EIO; in any case `cairn fsck` names the object.
#[test]
fn privileged_verity_impostor_object_gives_eio_and_fsck_names_it() {
    let f = fixture();
    let object = object_of(&f.store, HELLO);
    let name = object_name(HELLO);
    let mut impostor = HELLO.to_vec();
    impostor[..6].copy_from_slice(b"HELLO!");
    replace_file(&object, &impostor, f.verity);
    if f.verity {
        let target = f.base.join("mnt");
        let _m = mount(
            &f.store,
            Path::new(&f.digest),
            &target,
            &["--verity", "require"],
        );
        let err = fs::read(target.join("hello.txt")).expect_err("read of the impostor");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        // The other object still reads.
        assert_eq!(
            fs::read(target.join("sub/big.bin")).unwrap(),
            fs::read(f.tree.join("sub/big.bin")).unwrap()
        );
    }
    let out = cairn_raw(&f.store, &[os("fsck")]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(!out.status.success(), "fsck passed a forged object: {text}");
    let hex = name.replace('/', "");
    assert!(
        text.contains(&name) || text.contains(&hex),
        "fsck names object {name}: {text}"
    );
}

/// An object without fs-verity: `--verity require` refuses, naming it;
/// `auto` mounts with verity off and says which object made it so.
#[test]
fn privileged_verity_object_without_verity_is_refused_by_require() {
    let f = fixture();
    let object = object_of(&f.store, HELLO);
    let name = object_name(HELLO);
    // Same bytes, no fs-verity.
    replace_file(&object, HELLO, false);
    let target = f.base.join("mnt");
    let before = mounts_under(&f.base);
    let out = try_mount(&f, &target, &["--verity", "require"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "mounted: {err}");
    assert!(err.contains("--verity require: object "), "{err}");
    assert!(!err.trim_end().contains('\n'), "one line: {err}");
    if f.verity {
        assert!(
            err.contains(&format!("object {name} (the content of /hello.txt")),
            "names the object: {err}"
        );
    }
    assert_eq!(mounts_under(&f.base), before, "nothing mounted");
    let out = try_mount(&f, &target, &["--verity", "auto"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    if f.verity {
        assert!(
            err.contains(&format!("cairn: verity off: object {name} ")),
            "{err}"
        );
    } else {
        assert!(err.contains("cairn: verity off: "), "{err}");
    }
    assert_eq!(fs::read(target.join("hello.txt")).unwrap(), HELLO);
    cairn(&f.store, &[os("umount"), target.as_os_str()]);
}

/// `--digest`: the image's fs-verity digest must match; refused (nothing
/// mounted) on a mismatch, and where the image has no fs-verity.
#[test]
fn privileged_mount_digest_checks_the_images_verity_digest() {
    let f = fixture();
    let target = f.base.join("mnt");
    let before = mounts_under(&f.base);
    let good = cairn_store::fsverity_digest(fs::File::open(&f.image).unwrap())
        .unwrap()
        .to_hex();
    let bad = format!(
        "{}{}",
        if good.starts_with('0') { "1" } else { "0" },
        &good[1..]
    );
    let out = try_mount(&f, &target, &["--digest", &bad]);
    let err = stderr(&out);
    assert!(!out.status.success(), "mounted with a wrong digest: {err}");
    assert!(err.contains("refusing to mount"), "{err}");
    assert_eq!(mounts_under(&f.base), before, "nothing mounted");
    let out = try_mount(&f, &target, &["--digest", &good]);
    let err = stderr(&out);
    if f.verity {
        assert!(out.status.success(), "right digest refused: {err}");
        assert_eq!(fs::read(target.join("hello.txt")).unwrap(), HELLO);
        cairn(&f.store, &[os("umount"), target.as_os_str()]);
        assert!(
            stderr(&try_mount(&f, &target, &["--digest", &bad]))
                .contains(&format!("has fs-verity digest {good}, not {bad}")),
            "names both digests"
        );
    } else {
        assert!(!out.status.success(), "mounted unchecked: {err}");
        assert!(err.contains("refusing to mount"), "{err}");
        assert!(
            err.contains("has no fs-verity") || err.contains("measuring the fs-verity digest"),
            "{err}"
        );
    }
    assert_eq!(mounts_under(&f.base), before, "nothing mounted");
}
