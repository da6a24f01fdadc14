//! End-to-end import: images built here with umoci (and layers written by
//! GNU tar and by hand where umoci would never write them) go through
//! `cairn import` and `cairn mount`, and the mounted tree must be what
//! `umoci unpack` makes of the same image: every name, content, stat field,
//! xattr and hardlink. Also: a multi-layer Debian image made from real
//! packages, the layer cache, docker archives and `cairn export`.
//!
//! These tests really mount and fail loudly when not run as root.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn umoci(args: &[&OsStr]) {
    run("umoci", args);
}

fn sh(script: &str) {
    let out = Command::new("sh")
        .args(["-euc", script])
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{script}\nfailed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A ustar header for an entry without data (a hardlink, a whiteout).
fn raw_header(name: &str, typeflag: u8, link: &str, mode: u32, mtime: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    let octal = |f: &mut [u8], v: u64| {
        let s = format!("{:0w$o}\0", v, w = f.len() - 1);
        f.copy_from_slice(s.as_bytes());
    };
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], 0);
    octal(&mut h[136..148], mtime);
    h[156] = typeflag;
    h[157..157 + link.len()].copy_from_slice(link.as_bytes());
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    octal(&mut h[148..155], sum);
    h[155] = b' ';
    h
}

/// An OCI layout with one image `tag`, built layer by layer: each step
/// changes the unpacked rootfs and umoci repacks it.
struct Layout {
    dir: PathBuf,
}

impl Layout {
    fn new(dir: &Path, tag: &str) -> Layout {
        umoci(&[os("init"), os("--layout"), dir.as_os_str()]);
        umoci(&[os("new"), os("--image"), image_arg(dir, tag).as_os_str()]);
        Layout {
            dir: dir.to_path_buf(),
        }
    }

    /// Unpacks `tag`, lets `f` change the rootfs, repacks it as `new_tag`.
    fn layer(&self, tag: &str, new_tag: &str, work: &Path, f: impl FnOnce(&Path)) {
        let bundle = work.join(format!("bundle-{new_tag}-{}", rand_suffix()));
        umoci(&[
            os("unpack"),
            os("--image"),
            image_arg(&self.dir, tag).as_os_str(),
            bundle.as_os_str(),
        ]);
        f(&bundle.join("rootfs"));
        umoci(&[
            os("repack"),
            os("--image"),
            image_arg(&self.dir, new_tag).as_os_str(),
            bundle.as_os_str(),
        ]);
        let _ = fs::remove_dir_all(&bundle);
    }

    /// Appends an uncompressed tar as a layer, verbatim.
    fn raw_layer(&self, tag: &str, tar: &Path) {
        umoci(&[
            os("raw"),
            os("add-layer"),
            os("--image"),
            image_arg(&self.dir, tag).as_os_str(),
            tar.as_os_str(),
        ]);
    }

    /// What `umoci unpack` makes of `tag`.
    fn unpack(&self, tag: &str, bundle: &Path) -> PathBuf {
        umoci(&[
            os("unpack"),
            os("--image"),
            image_arg(&self.dir, tag).as_os_str(),
            bundle.as_os_str(),
        ]);
        bundle.join("rootfs")
    }
}

fn image_arg(dir: &Path, tag: &str) -> std::ffi::OsString {
    let mut s = dir.as_os_str().to_os_string();
    s.push(":");
    s.push(tag);
    s
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Runs `cairn --json import SOURCE` and returns its report.
fn import(store: &Path, source: &OsStr, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![os("--json"), os("import"), source];
    args.extend(extra.iter().map(|s| os(s)));
    let out = cairn(store, &args);
    serde_json::from_slice(&out.stdout).expect("import --json prints JSON")
}

fn oci_source(layout: &Path, tag: &str) -> std::ffi::OsString {
    let mut s = std::ffi::OsString::from("oci-layout:");
    s.push(image_arg(layout, tag));
    s
}

/// Mounts the imported image and compares it with the reference tree.
fn assert_mount_matches(store: &Path, report: &serde_json::Value, reference: &Path, target: &Path) {
    let digest = report["image"].as_str().unwrap();
    let image = store.join("images").join(digest);
    let _m = mount(store, &image, target, &[]);
    let differences = diff(&snapshot(reference), &snapshot(target));
    assert!(
        differences.is_empty(),
        "mounted image differs from umoci unpack ({} differences):\n{}",
        differences.len(),
        differences
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

fn layer_cached(report: &serde_json::Value) -> Vec<bool> {
    report["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["cached"].as_bool().unwrap())
        .collect()
}

/// The synthetic image: every layer rule, built with umoci, GNU tar and by hand.
fn synthetic_layout(work: &Path) -> Layout {
    let l = Layout::new(&work.join("layout"), "base");
    // Layer 1: everything build_full_tree makes (sockets cannot be in a
    // tar), plus what the later layers change.
    l.layer("base", "t", work, |r| {
        build_full_tree(&r.join("full"));
        fs::remove_file(r.join("full/socket")).unwrap();
        for d in [
            "wh-dir/sub",
            "dir-to-file/inner",
            "opaque/keep-not/deep",
            "meta",
        ] {
            fs::create_dir_all(r.join(d)).unwrap();
        }
        fs::write(r.join("wh-file"), b"deleted in layer 2").unwrap();
        fs::write(r.join("wh-dir/sub/f"), b"deleted with its directory").unwrap();
        fs::write(r.join("dir-to-file/inner/x"), b"x").unwrap();
        fs::write(r.join("file-to-dir"), b"a file first").unwrap();
        fs::write(r.join("opaque/old"), b"hidden by the opaque marker").unwrap();
        fs::write(r.join("opaque/keep-not/deep/f"), b"hidden too").unwrap();
        write_pattern(&r.join("meta/changes"), 5000, 9);
        write_pattern(&r.join("meta/link-me"), 7000, 10);
        fs::write(
            r.join("meta/lower-target"),
            b"a file a later layer links to",
        )
        .unwrap();
        // Long names: a 255-byte name in a path well over 255 bytes.
        let deep = r.join("long").join("d".repeat(200)).join("e".repeat(200));
        fs::create_dir_all(&deep).unwrap();
        fs::write(deep.join("n".repeat(255)), b"long").unwrap();
        std::os::unix::fs::symlink("t".repeat(1000), r.join("long/target")).unwrap();
    });
    // Layer 2 (umoci): deletions, type changes, a hardlink to a lower file,
    // metadata-only changes.
    l.layer("t", "t", work, |r| {
        fs::remove_file(r.join("wh-file")).unwrap();
        fs::remove_dir_all(r.join("wh-dir")).unwrap();
        fs::remove_dir_all(r.join("dir-to-file")).unwrap();
        fs::write(r.join("dir-to-file"), b"now a file").unwrap();
        fs::remove_file(r.join("file-to-dir")).unwrap();
        fs::create_dir(r.join("file-to-dir")).unwrap();
        fs::write(r.join("file-to-dir/x"), b"now a directory").unwrap();
        fs::hard_link(r.join("meta/link-me"), r.join("meta/linked-in-layer-2")).unwrap();
        fs::set_permissions(r.join("meta/changes"), fs::Permissions::from_mode(0o4711)).unwrap();
        rustix::fs::chown(
            r.join("meta/changes"),
            Some(rustix::fs::Uid::from_raw(4242)),
            Some(rustix::fs::Gid::from_raw(4343)),
        )
        .unwrap();
        run(
            "setfattr",
            &[
                os("-n"),
                os("user.added"),
                os("-v"),
                os("later"),
                r.join("meta/changes").as_os_str(),
            ],
        );
        run(
            "mknod",
            &[r.join("meta/tty").as_os_str(), os("c"), os("5"), os("0")],
        );
    });
    // Layer 3, by GNU tar and by hand: an opaque directory, a sparse file,
    // nanosecond mtimes and xattrs in pax headers, a hardlink whose target
    // is only in a lower layer, and a directory turned back from a file.
    let stage = work.join("stage3");
    fs::create_dir_all(stage.join("opaque")).unwrap();
    fs::create_dir_all(stage.join("sparse")).unwrap();
    fs::write(stage.join("opaque/.wh..wh..opq"), b"").unwrap();
    fs::write(
        stage.join("opaque/new"),
        b"the opaque directory's only file",
    )
    .unwrap();
    sh(&format!(
        "cd {s} && truncate -s 20M sparse/holes && printf start | dd of=sparse/holes conv=notrunc 2>/dev/null && \
         printf middle | dd of=sparse/holes bs=1 seek=10485760 conv=notrunc 2>/dev/null && \
         echo nano > sparse/nano && touch -d '2021-02-03 04:05:06.123456789' sparse/nano && \
         setfattr -n user.pax -v from-gnu-tar sparse/nano && touch -d '2020-01-01' opaque opaque/new sparse sparse/holes",
        s = stage.display()
    ));
    let tar3 = work.join("layer3.tar");
    sh(&format!(
        "cd {s} && tar --no-recursion --format=posix --xattrs --xattrs-include='*' --sparse --numeric-owner --owner=0 --group=0 \
         -cf {t} opaque/.wh..wh..opq opaque opaque/new sparse sparse/holes sparse/nano",
        s = stage.display(),
        t = tar3.display()
    ));
    // The hand-made hardlink entry, appended with tar --concatenate.
    let link_tar = work.join("link.tar");
    let mut bytes = raw_header(
        "meta/link-to-lower",
        b'1',
        "meta/lower-target",
        0o644,
        1_600_000_000,
    )
    .to_vec();
    bytes.extend_from_slice(&[0u8; 1024]);
    fs::write(&link_tar, bytes).unwrap();
    sh(&format!(
        "tar -A -f {} {}",
        tar3.display(),
        link_tar.display()
    ));
    l.raw_layer("t", &tar3);
    l
}

#[test]
fn privileged_import_synthetic_image_matches_umoci() {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-import")
        .tempdir()
        .unwrap();
    let work = dir.path();
    let layout = synthetic_layout(work);
    let store = work.join("store");
    let report = import(&store, &oci_source(&layout.dir, "t"), &[]);
    assert_eq!(report["name"], "t");
    assert_eq!(layer_cached(&report), [false, false, false], "{report}");
    let reference = layout.unpack("t", &work.join("umoci"));
    // Sanity: the reference shows the rules at work.
    assert!(!reference.join("wh-file").exists());
    assert!(!reference.join("opaque/old").exists());
    assert!(reference.join("opaque/new").exists());
    assert!(reference.join("file-to-dir/x").exists());
    let snap = snapshot(&reference);
    assert!(snap.entries.len() > 3000, "{} entries", snap.entries.len());
    for pair in [
        ["meta/link-to-lower", "meta/lower-target"],
        ["meta/link-me", "meta/linked-in-layer-2"],
    ] {
        assert!(
            snap.links
                .iter()
                .any(|set| pair.iter().all(|p| set.contains(&p.as_bytes().to_vec()))),
            "{pair:?} should be one inode"
        );
    }
    assert_mount_matches(&store, &report, &reference, &work.join("mnt"));

    // The same image again costs nothing: every layer comes from the cache.
    let again = import(&store, &oci_source(&layout.dir, "t"), &["--name", "again"]);
    assert_eq!(layer_cached(&again), [true, true, true]);
    assert_eq!(again["image"], report["image"]);

    // Export → an OCI layout umoci reads back to the same tree.
    let exported = work.join("exported");
    cairn(
        &store,
        &[
            os("export"),
            os("t"),
            os(&format!("oci-layout:{}:out", exported.display())),
        ],
    );
    let out = Command::new("skopeo")
        .arg("inspect")
        .arg(format!("oci:{}:out", exported.display()))
        .output()
        .expect("skopeo");
    assert!(
        out.status.success(),
        "skopeo inspect: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back = Layout { dir: exported }.unpack("out", &work.join("umoci-exported"));
    let differences = diff(&snapshot(&reference), &snapshot(&back));
    assert!(
        differences.is_empty(),
        "export → umoci unpack differs:\n{}",
        differences.join("\n")
    );
}

/// Debian packages, downloaded once per machine with apt-get into a cache.
fn debs(names: &[&str]) -> Vec<PathBuf> {
    let cache = Path::new("/var/tmp/cairn-test-debs");
    fs::create_dir_all(cache).unwrap();
    let mut out = Vec::new();
    for name in names {
        let find = || {
            fs::read_dir(cache)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with(&format!("{name}_"))
                })
        };
        if find().is_none() {
            let download = || {
                Command::new("apt-get")
                    .args(["download", name])
                    .current_dir(cache)
                    .status()
                    .expect("apt-get")
                    .success()
            };
            if !download() {
                // A machine whose package lists are not fetched yet.
                let _ = Command::new("apt-get").args(["update", "-qq"]).status();
                assert!(download(), "apt-get download {name} failed");
            }
        }
        out.push(find().unwrap());
    }
    out
}

#[test]
fn privileged_import_debian_layers_match_umoci_and_share_the_base() {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-debian")
        .tempdir()
        .unwrap();
    let work = dir.path();
    let pkgs = debs(&["base-files", "busybox-static", "libc6", "tzdata", "bash"]);
    let l = Layout::new(&work.join("layout"), "empty");
    let extract = |r: &Path, deb: &Path| {
        run("dpkg-deb", &[os("-x"), deb.as_os_str(), r.as_os_str()]);
    };
    // base: base-files + busybox; then one package per layer; then a layer
    // that deletes documentation (whiteouts) and rewrites a file.
    l.layer("empty", "deb", work, |r| {
        extract(r, &pkgs[0]);
        extract(r, &pkgs[1]);
    });
    l.layer("deb", "deb", work, |r| extract(r, &pkgs[2]));
    l.layer("deb", "deb", work, |r| extract(r, &pkgs[3]));
    l.layer("deb", "deb", work, |r| {
        fs::remove_dir_all(r.join("usr/share/doc")).unwrap();
        fs::write(r.join("etc/debian_version"), b"cairn\n").unwrap();
    });
    let store = work.join("store");
    let start = std::time::Instant::now();
    let report = import(&store, &oci_source(&l.dir, "deb"), &[]);
    println!("imported 4 Debian layers in {:?}", start.elapsed());
    assert_eq!(layer_cached(&report), [false; 4]);
    let reference = l.unpack("deb", &work.join("umoci"));
    assert!(reference.join("usr/share/zoneinfo").is_dir());
    assert!(!reference.join("usr/share/doc").exists());
    assert_mount_matches(&store, &report, &reference, &work.join("mnt"));

    // A second image on the same base: only its own layer is read. The
    // base layers' blobs are removed from the layout first, so reading
    // them would fail.
    l.layer("deb", "deb2", work, |r| extract(r, &pkgs[4]));
    let manifest_layers = |tag: &str| -> Vec<String> {
        let index: serde_json::Value =
            serde_json::from_slice(&fs::read(l.dir.join("index.json")).unwrap()).unwrap();
        let desc = index["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
            .unwrap()
            .clone();
        let hex = desc["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:")
            .to_string();
        let m: serde_json::Value =
            serde_json::from_slice(&fs::read(l.dir.join("blobs/sha256").join(hex)).unwrap())
                .unwrap();
        m["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                d["digest"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches("sha256:")
                    .to_string()
            })
            .collect()
    };
    let reference2 = l.unpack("deb2", &work.join("umoci2"));
    let base = manifest_layers("deb");
    let layers2 = manifest_layers("deb2");
    assert_eq!(&layers2[..4], &base[..]);
    for hex in &base {
        fs::remove_file(l.dir.join("blobs/sha256").join(hex)).unwrap();
    }
    let report2 = import(&store, &oci_source(&l.dir, "deb2"), &[]);
    assert_eq!(layer_cached(&report2), [true, true, true, true, false]);
    assert_mount_matches(&store, &report2, &reference2, &work.join("mnt2"));
    assert_ne!(report["image"], report2["image"]);
}

/// A merged-/usr Debian base (`bin`, `sbin`, `lib`, `lib64` symlinks into
/// `usr/`, `var/run -> /run`), then a layer written as a raw tar (GNU tar,
/// not umoci's repack, which never writes through a symlink) whose entries
/// go through `lib/`, `bin/` and `var/run/`: a file, a hardlink, a whiteout.
/// umoci resolves those parents through the symlinks; cairn must too.
#[test]
fn privileged_import_debian_merged_usr_writes_through_symlinks_match_umoci() {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-debian-usrmerge")
        .tempdir()
        .unwrap();
    let work = dir.path();
    let pkgs = debs(&["base-files", "busybox-static", "libc6", "tzdata"]);
    let l = Layout::new(&work.join("layout"), "empty");
    l.layer("empty", "deb", work, |r| {
        for p in &pkgs[..3] {
            run("dpkg-deb", &[os("-x"), p.as_os_str(), r.as_os_str()]);
        }
        // usrmerge by hand: each top-level directory's contents into usr/.
        sh(&format!(
            "cd {} && for d in bin sbin lib lib64; do \
               mkdir -p usr/$d; if [ -d $d ] && [ ! -L $d ]; then cp -a $d/. usr/$d/; rm -rf $d; fi; \
               ln -s usr/$d $d; done && \
             rm -rf var/run && mkdir -p run && ln -s /run var/run",
            r.display()
        ));
    });
    l.layer("deb", "deb", work, |r| {
        run("dpkg-deb", &[os("-x"), pkgs[3].as_os_str(), r.as_os_str()])
    });
    l.layer("deb", "deb", work, |r| {
        fs::remove_dir_all(r.join("usr/share/doc")).unwrap();
    });
    // The raw layer, from a staging tree where lib/ and var/run/ are real
    // directories, listed entry by entry (no parent directory entries).
    let stage = work.join("stage");
    let so = stage.join("lib/x86_64-linux-gnu");
    fs::create_dir_all(&so).unwrap();
    fs::create_dir_all(stage.join("var/run")).unwrap();
    fs::create_dir_all(stage.join("bin")).unwrap();
    write_pattern(&so.join("libcairn-test.so"), 5000, 11);
    fs::hard_link(so.join("libcairn-test.so"), so.join("libcairn-test.so.1")).unwrap();
    fs::write(so.join(".wh.libanl.so.1"), b"").unwrap();
    fs::write(stage.join("var/run/cairn.pid"), b"4242\n").unwrap();
    fs::write(stage.join("bin/cairn-tool"), b"#!/bin/sh\necho cairn\n").unwrap();
    fs::set_permissions(
        stage.join("bin/cairn-tool"),
        fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let tar = work.join("through.tar");
    sh(&format!(
        "cd {} && tar --no-recursion --format=posix --numeric-owner --owner=0 --group=0 -cf {} \
         lib/x86_64-linux-gnu/libcairn-test.so lib/x86_64-linux-gnu/libcairn-test.so.1 \
         lib/x86_64-linux-gnu/.wh.libanl.so.1 var/run/cairn.pid bin/cairn-tool",
        stage.display(),
        tar.display()
    ));
    l.raw_layer("deb", &tar);

    let store = work.join("store");
    let report = import(&store, &oci_source(&l.dir, "deb"), &[]);
    assert_eq!(layer_cached(&report), [false; 4]);
    let reference = l.unpack("deb", &work.join("umoci"));
    // Sanity: umoci wrote through the symlinks and kept them.
    for link in ["bin", "sbin", "lib", "lib64", "var/run"] {
        assert!(
            fs::symlink_metadata(reference.join(link))
                .unwrap()
                .file_type()
                .is_symlink(),
            "{link} should still be a symlink"
        );
    }
    let libs = reference.join("usr/lib/x86_64-linux-gnu");
    assert!(libs.join("libcairn-test.so").is_file());
    assert!(libs.join("libc.so.6").is_file());
    assert!(!libs.join("libanl.so.1").exists());
    assert!(reference.join("run/cairn.pid").is_file());
    assert!(reference.join("usr/bin/cairn-tool").is_file());
    assert_mount_matches(&store, &report, &reference, &work.join("mnt"));
}

#[test]
fn privileged_import_docker_archive_and_dir() {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-archive")
        .tempdir()
        .unwrap();
    let work = dir.path();
    // A docker-save style archive, made from a umoci image: manifest.json,
    // the config, one tar per layer (the second one gzipped).
    let l = Layout::new(&work.join("layout"), "base");
    l.layer("base", "t", work, |r| {
        fs::create_dir_all(r.join("etc")).unwrap();
        fs::write(r.join("etc/one"), b"layer one").unwrap();
        write_pattern(&r.join("etc/big"), 200_000, 3);
    });
    l.layer("t", "t", work, |r| {
        fs::remove_file(r.join("etc/one")).unwrap();
        fs::write(r.join("etc/two"), b"layer two").unwrap();
    });
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(l.dir.join("index.json")).unwrap()).unwrap();
    let mdigest = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == "t")
        .unwrap()["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let blobs = l.dir.join("blobs/sha256");
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(blobs.join(&mdigest)).unwrap()).unwrap();
    let cfg_hex = manifest["config"]["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let arch = work.join("archive");
    fs::create_dir_all(&arch).unwrap();
    fs::copy(blobs.join(&cfg_hex), arch.join(format!("{cfg_hex}.json"))).unwrap();
    let mut layer_names = Vec::new();
    for (i, d) in manifest["layers"].as_array().unwrap().iter().enumerate() {
        let hex = d["digest"].as_str().unwrap().trim_start_matches("sha256:");
        let name = format!("layer{i}/layer.tar");
        fs::create_dir_all(arch.join(format!("layer{i}"))).unwrap();
        if i == 0 {
            sh(&format!(
                "zcat {} > {}",
                blobs.join(hex).display(),
                arch.join(&name).display()
            ));
        } else {
            fs::copy(blobs.join(hex), arch.join(&name)).unwrap();
        }
        layer_names.push(name);
    }
    fs::write(
        arch.join("manifest.json"),
        serde_json::to_vec(&serde_json::json!([{
            "Config": format!("{cfg_hex}.json"),
            "RepoTags": ["example.com/archived:v1"],
            "Layers": layer_names,
        }]))
        .unwrap(),
    )
    .unwrap();
    let tarball = work.join("image.tar");
    sh(&format!(
        "cd {} && tar -cf {} manifest.json {cfg_hex}.json layer0 layer1",
        arch.display(),
        tarball.display()
    ));
    let store = work.join("store");
    let mut src = std::ffi::OsString::from("docker-archive:");
    src.push(&tarball);
    let report = import(&store, &src, &[]);
    assert_eq!(report["name"], "example.com/archived:v1");
    let reference = l.unpack("t", &work.join("umoci"));
    assert_mount_matches(&store, &report, &reference, &work.join("mnt"));
    // The same layers from the OCI layout are already in the store.
    let from_layout = import(&store, &oci_source(&l.dir, "t"), &[]);
    assert_eq!(layer_cached(&from_layout), [true, true]);
    assert_eq!(from_layout["image"], report["image"]);

    // dir: a directory as a one-layer image, mounted back identical.
    let tree = work.join("tree");
    build_full_tree(&tree);
    fs::remove_file(tree.join("socket")).unwrap();
    let mut src = std::ffi::OsString::from("dir:");
    src.push(&tree);
    let report = import(&store, &src, &["--name", "local/tree:1"]);
    assert_eq!(report["name"], "local/tree:1");
    // The tree goes in as a layer, and a layer carries neither overlayfs's
    // own bookkeeping xattrs (umoci drops them) nor an xattr with an empty
    // value (a pax record with an empty value is no record to Go's
    // archive/tar, so to docker, containerd and umoci): the mount has
    // neither.
    for (xattr, file) in [
        ("trusted.overlay.opaque", "sticky"),
        ("user.empty", "large"),
    ] {
        let out = Command::new("setfattr")
            .args([os("-x"), os(xattr), tree.join(file).as_os_str()])
            .output()
            .expect("setfattr");
        assert!(
            out.status.success(),
            "setfattr -x {xattr}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_mount_matches(&store, &report, &tree, &work.join("mnt-dir"));
    let inspect = cairn(&store, &[os("--json"), os("inspect"), os("local/tree:1")]);
    assert!(inspect.status.success());
}
