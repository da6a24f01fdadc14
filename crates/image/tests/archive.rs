//! Local image sources: OCI layouts (tags, image indexes and platforms,
//! blobs that do not match their digests) and exports read back.

mod common;

use std::fs;
use std::path::Path;

use cairn_image::{import_oci_layout, ImportOptions, Platform};
use common::*;
use serde_json::json;

/// Writes a blob into the layout and returns its descriptor.
fn blob(dir: &Path, media_type: &str, data: &[u8]) -> serde_json::Value {
    let digest = sha256(data);
    fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
    fs::write(dir.join("blobs/sha256").join(&digest[7..]), data).unwrap();
    json!({"mediaType": media_type, "digest": digest, "size": data.len()})
}

/// One image (one gzip layer holding `/arch` = `text`) in the layout.
fn image(dir: &Path, arch: &str, text: &str) -> serde_json::Value {
    let mut l = Layer::new();
    l.file("arch", text.as_bytes(), 0o644);
    let tar = l.finish();
    let layer = blob(
        dir,
        "application/vnd.oci.image.layer.v1.tar+gzip",
        &gzip(&tar),
    );
    let config = serde_json::to_vec(&json!({
        "architecture": arch, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [sha256(&tar)]},
    }))
    .unwrap();
    let config = blob(dir, "application/vnd.oci.image.config.v1+json", &config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config, "layers": [layer],
    }))
    .unwrap();
    let mut d = blob(dir, "application/vnd.oci.image.manifest.v1+json", &manifest);
    d["platform"] = json!({"architecture": arch, "os": "linux"});
    d
}

fn layout(dir: &Path) {
    let amd = image(dir, "amd64", "amd64");
    let arm = image(dir, "arm64", "arm64");
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [amd.clone(), arm],
    }))
    .unwrap();
    let mut index = blob(dir, "application/vnd.oci.image.index.v1+json", &index);
    index["annotations"] = json!({"org.opencontainers.image.ref.name": "multi"});
    let mut single = amd;
    single["annotations"] = json!({"org.opencontainers.image.ref.name": "single"});
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [index, single]})).unwrap(),
    )
    .unwrap();
}

#[test]
fn oci_layout_tags_indexes_and_platforms() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    layout(&dir);
    let s = open_store(&d.path().join("store"));
    let opts = |p: &str| ImportOptions {
        platform: Some(Platform::parse(p).unwrap()),
        ..Default::default()
    };
    let arm = import_oci_layout(&s, &dir, Some("multi"), &opts("linux/arm64")).unwrap();
    assert_eq!(arm.name.as_deref(), Some("multi"));
    let e = entries(&image_tree(&s, &arm));
    assert_eq!(content(&s, &e["/arch"]), b"arm64");
    let amd = import_oci_layout(&s, &dir, Some("multi"), &opts("linux/amd64")).unwrap();
    assert_eq!(
        content(&s, &entries(&image_tree(&s, &amd))["/arch"]),
        b"amd64"
    );
    // The amd64 layer is cached the second time round.
    let single = import_oci_layout(&s, &dir, Some("single"), &ImportOptions::default()).unwrap();
    assert!(single.layers[0].cached);
    assert_eq!(single.image_digest, amd.image_digest);

    let err = import_oci_layout(&s, &dir, Some("nope"), &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no image tagged \"nope\" (tags: multi, single)"),
        "{err}"
    );
    let err = import_oci_layout(&s, &dir, None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 images in the layout"), "{err}");
    let err = import_oci_layout(&s, &dir, Some("multi"), &opts("linux/s390x"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no image for platform linux/s390x"), "{err}");
    assert!(err.contains("linux/amd64, linux/arm64"), "{err}");
}

#[test]
fn oci_layout_blobs_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    layout(&dir);
    // Corrupt every layer blob (the only gzip files in the layout).
    for e in fs::read_dir(dir.join("blobs/sha256")).unwrap() {
        let p = e.unwrap().path();
        let mut data = fs::read(&p).unwrap();
        if data.starts_with(&[0x1f, 0x8b]) {
            let n = data.len();
            data[n - 5] ^= 1;
            fs::write(&p, data).unwrap();
        }
    }
    let root = d.path().join("store");
    let s = open_store(&root);
    let err = import_oci_layout(&s, &dir, Some("single"), &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blob digest mismatch") || err.contains("gzip stream is corrupt"),
        "{err}"
    );
    drop(s);
    drop(open_store(&root));
    let (seen, tmp) = visible(&root);
    assert!(seen.is_empty(), "{seen:?}");
    assert!(tmp.is_empty(), "{tmp:?}");
}

#[test]
fn export_reads_back_identically() {
    let d = tempfile::tempdir().unwrap();
    let s = open_store(&d.path().join("store"));
    let mut l1 = Layer::new();
    l1.dir("./", 0o755)
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644)
        .file("bin/big", &vec![9u8; 100_000], 0o755)
        .hardlink("bin/big2", "bin/big")
        .pax(&[("SCHILY.xattr.user.k", b"v"), ("mtime", b"1700000000.5")])
        .file("x", b"x", 0o600)
        .symlink(&format!("l/{}", "n".repeat(150)), &"t".repeat(300));
    let mut l2 = Layer::new();
    l2.whiteout("etc/.wh.passwd").file("etc/new", b"new", 0o644);
    let img = build(&s, &[l1.finish(), l2.finish()], Some("ex:1")).unwrap();
    let out = d.path().join("out");
    let exported = cairn_image::export_oci_layout(&s, &img.image_digest, &out, "1").unwrap();
    // Import the export into a fresh store: the same filesystem image.
    let s2 = open_store(&d.path().join("store2"));
    let back = import_oci_layout(&s2, &out, Some("1"), &ImportOptions::default()).unwrap();
    assert_eq!(back.layers.len(), 1);
    assert_eq!(back.layers[0].diff_id, exported.diff_id);
    assert_eq!(
        back.image_digest, img.image_digest,
        "export → import must give the same image"
    );
    let rec = s2.image_record(&back.image_digest).unwrap().unwrap();
    assert!(
        rec.config.contains("PATH=/bin"),
        "the config is kept: {}",
        rec.config
    );
}
