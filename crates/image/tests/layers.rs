//! Layer semantics: what an image assembled from tar layers holds, rule by
//! rule of the OCI image spec (layer.md), read back from the EROFS image.

mod common;

use cairn_erofs::tree::FileType;
use cairn_erofs::tree::InodeData;
use common::*;
use tar::EntryType;

fn store() -> (tempfile::TempDir, cairn_store::Store) {
    let dir = tempfile::tempdir().unwrap();
    let s = open_store(&dir.path().join("store"));
    (dir, s)
}

#[test]
fn files_dirs_links_devices_and_metadata() {
    let (_d, s) = store();
    let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    let mut l = Layer::new();
    l.dir("./", 0o755)
        .dir("etc/", 0o750)
        .file("etc/small", b"hello\n", 0o640)
        .file("etc/big", &big, 0o4755)
        .file_owned("etc/owned", b"x", 0o600, 1000, 70000)
        .symlink("etc/link", "small")
        .hardlink("etc/big-again", "etc/big")
        .device("dev/null", EntryType::Char, 1, 3)
        .device("dev/loop0", EntryType::Block, 7, 0)
        .device("dev/fifo", EntryType::Fifo, 0, 0)
        .dir("tmp/", 0o1777);
    let img = build(&s, &[l.finish()], Some("example.com/test:1")).unwrap();
    let t = image_tree(&s, &img);
    let e = entries(&t);
    assert_eq!(e["/etc"].mode, 0o040750);
    assert_eq!(e["/etc/small"].mode, 0o100640);
    assert_eq!(content(&s, &e["/etc/small"]), b"hello\n");
    assert_eq!(content(&s, &e["/etc/big"]), big);
    assert_eq!(e["/etc/big"].mode, 0o104755);
    assert_eq!(e["/etc/big"].nlink, 2);
    assert_eq!(e["/etc/owned"].uid, 1000);
    assert_eq!(e["/etc/owned"].gid, 70000);
    assert_eq!(e["/etc/link"].file_type(), FileType::Symlink);
    assert_eq!(e["/dev/null"].rdev, libc::makedev(1, 3));
    assert_eq!(e["/dev/loop0"].file_type(), FileType::BlockDevice);
    assert_eq!(e["/dev/fifo"].file_type(), FileType::Fifo);
    // Implicit parent: 0755 root:root.
    assert_eq!(e["/dev"].mode, 0o040755);
    assert_eq!(e["/tmp"].mode & 0o7777, 0o1777);
    assert_eq!(e["/etc/small"].mtime.sec, 1_600_000_000);
    // The name maps to a ref and the record is there.
    let r = cairn_store::ref_name_for("example.com/test:1");
    assert_eq!(
        s.get_ref(&r).unwrap().as_deref(),
        Some(img.image_digest.as_str())
    );
    let rec = s.image_record(&img.image_digest).unwrap().unwrap();
    assert_eq!(rec.layers.len(), 1);
    assert_eq!(rec.os.as_deref(), Some("linux"));
}

#[test]
fn whiteouts_and_opaque_directories() {
    let (_d, s) = store();
    let mut base = Layer::new();
    base.dir("a/", 0o755)
        .dir("a/b/", 0o755)
        .dir("a/b/c/", 0o755)
        .file("a/b/c/bar", b"bar", 0o644)
        .file("a/keep", b"keep", 0o644)
        .file("gone", b"gone", 0o644)
        .dir("opq/", 0o700)
        .file("opq/old1", b"1", 0o644)
        .dir("opq/sub/", 0o755)
        .file("opq/sub/old2", b"2", 0o644);
    let mut top = Layer::new();
    // Whiteout before and after siblings; opaque after a new entry of the same layer.
    top.whiteout(".wh.gone")
        .dir("a/", 0o755)
        .whiteout("a/.wh.b")
        .dir("a/b/", 0o711)
        .dir("a/b/c/", 0o755)
        .file("a/b/c/foo", b"foo", 0o644)
        .file("opq/new", b"new", 0o644)
        .whiteout("opq/.wh..wh..opq")
        // A whiteout of something that does not exist is harmless.
        .whiteout(".wh.never-existed")
        // A same-layer entry and its whiteout: the entry stays.
        .file("both", b"both", 0o644)
        .whiteout(".wh.both")
        // A directory turned into a file, with whiteouts for what it held
        // (as umoci writes it), and whiteouts below a new symlink: no-ops.
        .file("a/b/c/bar-dir", b"", 0o644)
        .symlink("sym", "/etc")
        .whiteout("sym/.wh.passwd");
    let img = build(&s, &[base.finish(), top.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    let names: Vec<&str> = e.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "/",
            "/a",
            "/a/b",
            "/a/b/c",
            "/a/b/c/bar-dir",
            "/a/b/c/foo",
            "/a/keep",
            "/both",
            "/opq",
            "/opq/new",
            "/sym"
        ],
        "{e:#?}"
    );
    assert_eq!(e["/a/b"].mode & 0o7777, 0o711);
    // Opaque keeps the directory's own metadata from below when the layer does not list it.
    assert_eq!(e["/opq"].mode & 0o7777, 0o700);
}

#[test]
fn directory_replaced_by_file_and_back() {
    let (_d, s) = store();
    let mut l1 = Layer::new();
    l1.dir("x/", 0o755)
        .file("x/inner", b"inner", 0o644)
        .file("y", b"y-file", 0o644);
    let mut l2 = Layer::new();
    // umoci also writes whiteouts for what the replaced directory held.
    l2.file("x", b"now a file", 0o600)
        .whiteout("x/.wh.inner")
        .dir("y/", 0o750)
        .file("y/child", b"c", 0o644);
    let mut l3 = Layer::new();
    l3.dir("x/", 0o755).file("x/again", b"again", 0o644);
    let img = build(&s, &[l1.finish(), l2.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    assert_eq!(e["/x"].file_type(), FileType::Regular);
    assert_eq!(e["/y"].file_type(), FileType::Directory);
    assert!(e.contains_key("/y/child"));
    let mut l1 = Layer::new();
    l1.dir("x/", 0o755).file("x/inner", b"inner", 0o644);
    let mut l2 = Layer::new();
    l2.file("x", b"now a file", 0o600);
    let img = build(&s, &[l1.finish(), l2.finish(), l3.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    assert_eq!(e["/x"].file_type(), FileType::Directory);
    assert!(e.contains_key("/x/again"));
    assert!(
        !e.contains_key("/x/inner"),
        "the old directory's content must not come back"
    );
}

#[test]
fn hardlinks_within_and_across_layers() {
    let (_d, s) = store();
    let data = vec![42u8; 5000];
    let mut l1 = Layer::new();
    l1.file("bin/tool", &data, 0o755)
        .hardlink("bin/tool2", "bin/tool")
        .file("lib/base", b"base content here", 0o644);
    let mut l2 = Layer::new();
    // A link to a lower layer's file, and a link to that link's target through a new name.
    l2.hardlink("usr/base-link", "lib/base")
        .hardlink("usr/tool3", "bin/tool");
    let img = build(&s, &[l1.finish(), l2.finish()], None).unwrap();
    let t = image_tree(&s, &img);
    let e = entries(&t);
    assert_eq!(e["/bin/tool"].nlink, 3);
    assert_eq!(e["/lib/base"].nlink, 2);
    assert_eq!(content(&s, &e["/usr/base-link"]), b"base content here");
    assert_eq!(content(&s, &e["/usr/tool3"]), data);
    // Replacing one name of a hardlinked pair leaves the other alone.
    let mut l3 = Layer::new();
    l3.file("bin/tool", b"replaced", 0o755);
    let mut l1 = Layer::new();
    l1.file("bin/tool", &data, 0o755)
        .hardlink("bin/tool2", "bin/tool");
    let img = build(&s, &[l1.finish(), l3.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    assert_eq!(content(&s, &e["/bin/tool"]), b"replaced");
    assert_eq!(content(&s, &e["/bin/tool2"]), data);
    assert_eq!(e["/bin/tool2"].nlink, 1);
    assert_eq!(e["/bin/tool"].nlink, 1);
}

#[test]
fn pax_xattrs_long_names_and_times() {
    let (_d, s) = store();
    let long_dir = "d".repeat(120);
    let long_name = format!("{long_dir}/{}", "f".repeat(200));
    let long_target = "t/".repeat(300);
    let mut l = Layer::new();
    l.pax(&[
        ("SCHILY.xattr.user.greeting", b"hello"),
        ("SCHILY.xattr.security.capability", b"\x01\x00\x00\x02"),
        ("LIBARCHIVE.xattr.user.b64%3Dname", b"aGk="),
        ("SCHILY.xattr.trusted.cairn.layer.implicit", b"spoof"),
        ("mtime", b"1633950376.123456789"),
        ("uid", b"4000000000"),
    ])
    .file("x", b"xattrs", 0o644)
    // GNU long name (the tar crate writes these for long paths).
    .file(&long_name, b"long", 0o644)
    .symlink("longlink", &long_target)
    // pax path and linkpath.
    .pax(&[("path", format!("pax/{}", "p".repeat(150)).as_bytes())])
    .file("ignored-name", b"pax path", 0o644);
    let img = build(&s, &[l.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    let x = &e["/x"];
    assert_eq!(x.xattrs[&b"user.greeting"[..]], b"hello");
    // bsdtar's own xattr records are read past, as the Go-based
    // unpackers (docker, containerd, umoci) read past them.
    assert!(!x.xattrs.contains_key(&b"user.b64=name"[..]));
    assert_eq!(
        x.xattrs[&b"trusted.cairn.layer.implicit"[..]],
        b"spoof",
        "a real xattr that looks like a marker survives"
    );
    assert_eq!(x.mtime.sec, 1633950376);
    assert_eq!(x.mtime.nsec, 123456789);
    assert_eq!(x.uid, 4_000_000_000);
    assert!(e.contains_key(&format!("/{long_name}")));
    let InodeData::Symlink(t) = &e["/longlink"].data else {
        panic!()
    };
    assert_eq!(t, long_target.as_bytes());
    assert_eq!(
        content(&s, &e[&format!("/pax/{}", "p".repeat(150))]),
        b"pax path"
    );
}

#[test]
fn duplicates_absolute_paths_and_dot_slash() {
    let (_d, s) = store();
    let mut l = Layer::new();
    l.file("dup", b"first", 0o644)
        .file("./dup", b"second", 0o600)
        .raw(b"/abs/file", EntryType::Regular, 0o644, b"abs", |_| {})
        .raw(b"a/./b/../c", EntryType::Regular, 0o644, b"c", |_| {})
        .dir("dd/", 0o700)
        .file("dd/f", b"f", 0o644)
        .dir("dd/", 0o755);
    let img = build(&s, &[l.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    assert_eq!(content(&s, &e["/dup"]), b"second");
    assert_eq!(e["/dup"].mode & 0o777, 0o600);
    assert_eq!(content(&s, &e["/abs/file"]), b"abs");
    assert_eq!(content(&s, &e["/a/c"]), b"c");
    assert_eq!(
        e["/dd"].mode & 0o777,
        0o755,
        "the later directory entry's metadata wins"
    );
    assert!(e.contains_key("/dd/f"), "two directory entries merge");
}

#[test]
fn compressed_layers_and_media_types() {
    let (_d, s) = store();
    let mut l = Layer::new();
    l.file("gz", &vec![1u8; 10_000], 0o644);
    let tar = l.finish();
    let diff_id = sha256(&tar);
    for (blob, mt) in [
        (
            gzip(&tar),
            Some("application/vnd.oci.image.layer.v1.tar+gzip"),
        ),
        (
            zstd(&tar),
            Some("application/vnd.oci.image.layer.v1.tar+zstd"),
        ),
        (
            gzip(&tar),
            Some("application/vnd.docker.image.rootfs.diff.tar.gzip"),
        ),
        (zstd(&tar), None),
        (tar.clone(), Some("application/vnd.oci.image.layer.v1.tar")),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let s2 = open_store(dir.path());
        let info = cairn_image::import_layer(
            &s2,
            &blob[..],
            mt,
            Some(&sha256(&blob)),
            Some(&diff_id),
            &cairn_image::Limits::default(),
        )
        .unwrap();
        assert_eq!(info.diff_id, diff_id);
        assert_eq!(info.size, tar.len() as u64);
        assert!(!info.cached);
    }
    let _ = s;
}

/// An uncompressed blob is hashed once (its digest is the diff_id), and
/// still checked against the digest the manifest gives: a blob larger than
/// the first read, with bytes after the tar's end marker.
#[test]
fn an_uncompressed_blobs_digest_is_its_diff_id_and_checked() {
    let mut l = Layer::new();
    for i in 0..40 {
        l.file(&format!("f{i}"), &vec![i as u8; 20_000], 0o644);
    }
    let mut tar = l.finish();
    tar.extend_from_slice(&[0u8; 10_240]);
    assert!(tar.len() > 256 * 1024);
    let digest = sha256(&tar);
    let dir = tempfile::tempdir().unwrap();
    let s = open_store(dir.path());
    let mt = Some("application/vnd.oci.image.layer.v1.tar");
    let wrong = format!("sha256:{}", "0".repeat(64));
    let e = cairn_image::import_layer(
        &s,
        &tar[..],
        mt,
        Some(&wrong),
        None,
        &cairn_image::Limits::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&format!(
            "blob digest mismatch: expected {wrong}, got {digest}"
        )),
        "{e}"
    );
    let info = cairn_image::import_layer(
        &s,
        &tar[..],
        mt,
        Some(&digest),
        Some(&digest),
        &cairn_image::Limits::default(),
    )
    .unwrap();
    assert_eq!(info.diff_id, digest);
    assert_eq!(info.blob_digest.as_deref(), Some(digest.as_str()));
    assert_eq!(info.size, tar.len() as u64);
}

/// A reader that fails the test if anyone reads it.
struct Untouchable;
impl std::io::Read for Untouchable {
    fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
        panic!("the layer cache must not read the blob")
    }
}

#[test]
fn layer_cache_never_reads_the_blob() {
    let (_d, s) = store();
    let mut l = Layer::new();
    l.file("f", &vec![3u8; 3000], 0o644);
    let tar = l.finish();
    let first = import(&s, &tar).unwrap();
    assert!(!first.cached);
    assert!(cairn_image::has_layer(&s, &first.diff_id));
    let again = cairn_image::import_layer(
        &s,
        Untouchable,
        Some("application/vnd.oci.image.layer.v1.tar+gzip"),
        Some(&format!("sha256:{}", "0".repeat(64))),
        Some(&first.diff_id),
        &cairn_image::Limits::default(),
    )
    .unwrap();
    assert!(again.cached);
    assert_eq!(again.diff_id, first.diff_id);
    assert_eq!(again.entries, first.entries);
}

/// An image is written only over objects that are all there: one missing
/// from the store fails the assembly, naming it, and nothing is published
/// (the check runs beside the image's writing; the image waits for it).
#[test]
fn a_missing_object_fails_the_image_and_publishes_nothing() {
    let (_d, s) = store();
    let gone = vec![5u8; 3000];
    let mut l = Layer::new();
    l.file("kept", &vec![4u8; 3000], 0o644)
        .file("gone", &gone, 0o644);
    let tar = l.finish();
    let info = import(&s, &tar).unwrap();
    let id = s.import_bytes(&gone).unwrap();
    std::fs::remove_file(s.object_path(&id)).unwrap();
    let (m, c) = manifest_and_config(&[(info.diff_id, tar.len() as u64)]);
    let err = cairn_image::assemble_image(&s, &m, &c, Some("img"))
        .unwrap_err()
        .to_string();
    assert!(err.contains(&id.to_string()), "{err}");
    let images: Vec<_> = std::fs::read_dir(s.root().join("images"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(images.is_empty(), "published: {images:?}");
    assert_eq!(s.get_ref(&cairn_store::ref_name_for("img")).unwrap(), None);
}

#[test]
fn gnu_tar_sparse_formats() {
    let (d, s) = store();
    // A sparse file made by the filesystem, archived by GNU tar in each of its sparse formats.
    let src = d.path().join("src");
    std::fs::create_dir(&src).unwrap();
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::create(src.join("sparse")).unwrap();
        f.write_all(b"start").unwrap();
        f.seek(SeekFrom::Start(3 << 20)).unwrap();
        f.write_all(b"middle").unwrap();
        f.seek(SeekFrom::Start(7 << 20)).unwrap();
        f.write_all(&[9u8; 10000]).unwrap();
        f.set_len(12 << 20).unwrap();
    }
    let expected = std::fs::read(src.join("sparse")).unwrap();
    for args in [
        &["--format=gnu"][..],
        &["--format=posix", "--sparse-version=0.0"],
        &["--format=posix", "--sparse-version=0.1"],
        &["--format=posix", "--sparse-version=1.0"],
    ] {
        let out = std::process::Command::new("tar")
            .args(["-c", "--sparse", "-C"])
            .arg(&src)
            .args(args)
            .arg("sparse")
            .output()
            .expect("GNU tar");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let img = build(&s, std::slice::from_ref(&out.stdout), None)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let e = entries(&image_tree(&s, &img));
        assert_eq!(e.keys().collect::<Vec<_>>(), ["/", "/sparse"], "{args:?}");
        assert_eq!(e["/sparse"].size, 12 << 20, "{args:?}");
        assert!(
            content(&s, &e["/sparse"]) == expected,
            "{args:?}: content differs"
        );
        assert!(
            out.stdout.len() < 1 << 20,
            "{args:?}: GNU tar did not write a sparse entry"
        );
    }
}

/// The names in the image, with a letter for the type and, for symlinks,
/// the target: `/lib -> usr/lib`, `/usr/lib/x` (files), `/usr/` (dirs).
fn listing(s: &cairn_store::Store, layers: &[Vec<u8>]) -> Vec<String> {
    let img = build(s, layers, None).unwrap();
    entries(&image_tree(s, &img))
        .into_iter()
        .map(|(p, i)| match &i.data {
            InodeData::Symlink(t) => format!("{p} -> {}", String::from_utf8_lossy(t)),
            InodeData::Directory(_) if p != "/" => format!("{p}/"),
            _ => p,
        })
        .collect()
}

fn merged_usr() -> Layer {
    let mut l = Layer::new();
    l.dir("usr/", 0o755)
        .dir("usr/lib/", 0o755)
        .file("usr/lib/old.so", b"old", 0o644)
        .dir("usr/bin/", 0o755)
        .symlink("lib", "usr/lib")
        .symlink("bin", "/usr/bin")
        .dir("run/", 0o755)
        .dir("var/", 0o755)
        .symlink("var/run", "/run");
    l
}

#[test]
fn parents_resolve_through_lower_symlinks() {
    let (_d, s) = store();
    let mut top = Layer::new();
    top.file("lib/x86_64-linux-gnu/libfoo.so", b"foo", 0o644)
        .file("bin/tool", b"tool", 0o755)
        .file("var/run/app.pid", b"1", 0o644)
        .whiteout("lib/.wh.old.so");
    let got = listing(&s, &[merged_usr().finish(), top.finish()]);
    assert_eq!(
        got,
        [
            "/",
            "/bin -> /usr/bin",
            "/lib -> usr/lib",
            "/run/",
            "/run/app.pid",
            "/usr/",
            "/usr/bin/",
            "/usr/bin/tool",
            "/usr/lib/",
            "/usr/lib/x86_64-linux-gnu/",
            "/usr/lib/x86_64-linux-gnu/libfoo.so",
            "/var/",
            "/var/run -> /run",
        ]
    );
}

#[test]
fn parents_resolve_through_chains_and_this_layers_symlinks() {
    let (_d, s) = store();
    let mut base = Layer::new();
    base.dir("usr/lib/", 0o755)
        .symlink("a", "b")
        .symlink("b", "usr/lib");
    let mut top = Layer::new();
    // Through a chain of the layer below; through a symlink this very
    // layer made (relative to its directory, and climbing with `..`).
    top.file("a/chained", b"c", 0o644)
        .dir("opt/", 0o755)
        .symlink("opt/up", "../usr/lib")
        .file("opt/up/via-up", b"u", 0o644)
        .symlink("abs", "/opt")
        .file("abs/via-abs", b"v", 0o644);
    let got = listing(&s, &[base.finish(), top.finish()]);
    assert_eq!(
        got,
        [
            "/",
            "/a -> b",
            "/abs -> /opt",
            "/b -> usr/lib",
            "/opt/",
            "/opt/up -> ../usr/lib",
            "/opt/via-abs",
            "/usr/",
            "/usr/lib/",
            "/usr/lib/chained",
            "/usr/lib/via-up",
        ]
    );
}

#[test]
fn resolution_never_leaves_the_root() {
    let (_d, s) = store();
    let mut base = Layer::new();
    base.dir("etc/", 0o755).file("etc/shadow", b"lower", 0o600);
    let mut top = Layer::new();
    top.raw(b"../evil", EntryType::Regular, 0o644, b"1", |_| {})
        .raw(b"a/../../evil2", EntryType::Regular, 0o644, b"2", |_| {})
        .raw(b"/../etc/passwd", EntryType::Regular, 0o644, b"3", |_| {})
        .symlink("up", "../../..")
        .file("up/x/y", b"4", 0o644)
        .symlink("s", "/.")
        .file("s/etc/hosts", b"5", 0o644)
        .symlink("evil", "/../../etc")
        .file("evil/group", b"6", 0o644)
        .raw(
            b"../.wh.shadow-not-here",
            EntryType::Regular,
            0o644,
            b"",
            |_| {},
        )
        .raw(b"../etc/.wh.shadow", EntryType::Regular, 0o644, b"", |_| {});
    let got = listing(&s, &[base.finish(), top.finish()]);
    assert_eq!(
        got,
        [
            "/",
            "/etc/",
            "/etc/group",
            "/etc/hosts",
            "/etc/passwd",
            "/evil -> /../../etc",
            "/evil2",
            "/s -> /",
            "/up -> ../../..",
            "/x/",
            "/x/y",
        ]
    );
}

#[test]
fn whiteouts_of_absent_paths_change_nothing() {
    let (_d, s) = store();
    let mut base = Layer::new();
    base.dir("tmp/", 0o1777).file("f", b"f", 0o644);
    let mut top = Layer::new();
    top.whiteout("tmp/x/.wh.y")
        .whiteout("nowhere/.wh..wh..opq")
        .whiteout("f/.wh.z")
        .whiteout(".wh.absent");
    let got = listing(&s, &[base.finish(), top.finish()]);
    assert_eq!(got, ["/", "/f", "/tmp/"]);
}

#[test]
fn order_within_a_layer_is_kept() {
    let (_d, s) = store();
    let base = merged_usr().finish();
    // Written through the lower symlink, then the symlink whited out: the
    // file stays where it landed, the symlink goes.
    let mut one = Layer::new();
    one.file("lib/x.so", b"x", 0o644).whiteout(".wh.lib");
    let got = listing(&s, &[base.clone(), one.finish()]);
    assert!(got.contains(&"/usr/lib/x.so".to_string()), "{got:#?}");
    assert!(!got.iter().any(|p| p.starts_with("/lib")), "{got:#?}");
    // The other way round: the symlink goes first, and the file makes a
    // directory /lib of its own.
    let mut two = Layer::new();
    two.whiteout(".wh.lib").file("lib/x.so", b"x", 0o644);
    let got = listing(&s, &[base.clone(), two.finish()]);
    assert!(got.contains(&"/lib/".to_string()), "{got:#?}");
    assert!(got.contains(&"/lib/x.so".to_string()), "{got:#?}");
    assert!(got.contains(&"/usr/lib/old.so".to_string()), "{got:#?}");
    // A directory entry replaces a lower symlink (its name is never
    // followed), and what comes after lands in the new directory.
    let mut three = Layer::new();
    three.dir("lib/", 0o700).file("lib/y.so", b"y", 0o644);
    let got = listing(&s, &[base, three.finish()]);
    assert!(got.contains(&"/lib/".to_string()), "{got:#?}");
    assert!(got.contains(&"/lib/y.so".to_string()), "{got:#?}");
    assert!(got.contains(&"/usr/lib/old.so".to_string()), "{got:#?}");
}

#[test]
fn hardlinks_resolve_parents_but_not_the_last_name() {
    let (_d, s) = store();
    let mut top = Layer::new();
    top.file("usr/lib/real.so", b"real", 0o644)
        .symlink("usr/lib/link.so", "real.so")
        // Parent through the lower symlink `lib`.
        .hardlink("hard.so", "lib/real.so")
        // To the symlink itself, not what it points at.
        .hardlink("hard-link.so", "usr/lib/link.so");
    let img = build(&s, &[merged_usr().finish(), top.finish()], None).unwrap();
    let e = entries(&image_tree(&s, &img));
    assert_eq!(e["/hard.so"].nlink, 2);
    assert_eq!(e["/usr/lib/real.so"].nlink, 2);
    assert_eq!(e["/hard-link.so"].file_type(), FileType::Symlink);
    assert_eq!(e["/usr/lib/link.so"].nlink, 2);
}

// ---- The tree built from a layer's lines as its import writes them ----

/// The record's lines in chunks of `lines` lines each, as a tap sends them.
fn chunks_of(record: &[u8], lines: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    for (i, line) in record.split_inclusive(|&b| b == b'\n').enumerate() {
        cur.extend_from_slice(line);
        if (i + 1) % lines == 0 {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// A layer's feed whose tap has sent the first `sent` of `chunks`, and closed.
fn fed(chunks: &[Vec<u8>], sent: usize) -> cairn_image::LayerFeed {
    let (mut feeds, mut taps) = cairn_image::taps(&[true]);
    let mut tap = taps.pop().flatten().expect("a tap");
    for c in chunks.iter().take(sent) {
        assert!(tap.send(c), "room for the test's chunks");
    }
    feeds.pop().expect("a feed")
}

#[test]
fn a_tree_built_from_tapped_lines_is_the_one_the_records_make() {
    use cairn_image::{build_tree_as_imported, LayerEnd, LayerFeed, StagedImage};

    let (_d, s) = store();
    let mut a = Layer::new();
    a.dir("etc", 0o755).file("etc/a", b"a", 0o644);
    for i in 0..400 {
        a.file(&format!("usr/f{i}"), format!("{i}").as_bytes(), 0o644);
    }
    a.symlink("lib", "usr");
    let mut b = Layer::new();
    b.whiteout("etc/.wh.a").hardlink("lib/h", "usr/f1");
    for i in 0..300 {
        b.file(&format!("usr/g{i}"), &vec![i as u8; 5000], 0o600);
    }
    let (a, b) = (a.finish(), b.finish());
    let infos = [import(&s, &a).unwrap(), import(&s, &b).unwrap()];
    let diff_ids: Vec<String> = infos.iter().map(|i| i.diff_id.clone()).collect();
    let (manifest, config) = manifest_and_config(
        &infos
            .iter()
            .map(|i| (i.diff_id.clone(), i.size))
            .collect::<Vec<_>>(),
    );
    let expected = cairn_image::assemble_image(&s, &manifest, &config, None)
        .unwrap()
        .image_digest;
    let record = |i: usize| std::fs::read(s.layer_entries_path(&diff_ids[i])).unwrap();
    let entries = |i: usize| std::fs::File::open(s.layer_entries_path(&diff_ids[i])).unwrap();

    // How each layer is fed: the chunks its tap sends before it closes
    // (None: a layer from the store), and how its import ends.
    type Feed = Option<(usize, &'static str)>;
    let cases: [(&str, [Feed; 2]); 5] = [
        (
            "every line through the taps",
            [Some((usize::MAX, "checked")); 2],
        ),
        (
            "the taps give up after a chunk (full): the rest from the entries",
            [Some((1, "checked")); 2],
        ),
        ("no line through the taps", [Some((0, "checked")); 2]),
        (
            "the bottom layer from the store",
            [None, Some((2, "checked"))],
        ),
        (
            "the top layer's import found it in the store",
            [Some((usize::MAX, "checked")), Some((0, "in store"))],
        ),
    ];
    for (case, feeds) in cases {
        let mut ends = Vec::new();
        let feeds: Vec<LayerFeed> = feeds
            .iter()
            .enumerate()
            .map(|(i, f)| match f {
                None => {
                    ends.push(None);
                    LayerFeed::Store
                }
                Some((chunks, end)) => {
                    ends.push(Some(*end));
                    fed(&chunks_of(&record(i), 50), *chunks)
                }
            })
            .collect();
        let tree = build_tree_as_imported(&s, &diff_ids, feeds, &mut |i| match ends[i] {
            Some("checked") => LayerEnd::Checked(entries(i)),
            Some("in store") => LayerEnd::InStore,
            other => panic!("layer {i} asked for its end: {other:?}"),
        })
        .unwrap();
        let img = StagedImage::from_tree(&s, &manifest, &config, None, None, Some(tree))
            .unwrap()
            .publish()
            .unwrap();
        assert_eq!(img.image_digest, expected, "{case}");
    }

    // An import that fails after its lines were sent fails the tree; one
    // that sent lines and then says the store has the layer is refused.
    for (failed, want) in [
        (true, "its import ended before the layer was checked"),
        (false, "found its record in the store"),
    ] {
        let end = || {
            if failed {
                LayerEnd::Failed
            } else {
                LayerEnd::InStore
            }
        };
        let feed = fed(&chunks_of(&record(0), 50), 1);
        let e = build_tree_as_imported(&s, &diff_ids[..1], vec![feed], &mut |_| end())
            .err()
            .expect("the tree fails")
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    // A tree for other layers than the config's is refused.
    let tree = build_tree_as_imported(&s, &diff_ids[..1], vec![fed(&[], 0)], &mut |_| {
        LayerEnd::Checked(entries(0))
    })
    .unwrap();
    let e = StagedImage::from_tree(&s, &manifest, &config, None, None, Some(tree))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("other layers"), "{e}");
}
