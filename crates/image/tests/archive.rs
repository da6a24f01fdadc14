//! Local image sources: OCI layouts (tags, image indexes and platforms,
//! blobs that do not match their descriptors' sizes, digests or media
//! types, digests cairn refuses), docker archives (the digests their names
//! and configs state, skopeo's layout of them) and exports read back.

mod common;

use std::fs;
use std::path::Path;

use cairn_image::{import_oci_layout, ImportOptions, PlatformSpec};
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
        platform: Some(PlatformSpec::parse(p).unwrap()),
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
    // uname's and Rust's names are the OCI ones, as for a registry pull
    // (the same parser): `--platform linux/x86_64` is amd64, aarch64 arm64.
    let x86_64 = import_oci_layout(&s, &dir, Some("multi"), &opts("linux/x86_64")).unwrap();
    assert_eq!(x86_64.image_digest, amd.image_digest);
    assert_eq!(x86_64.manifest_digest, amd.manifest_digest);
    let aarch64 = import_oci_layout(&s, &dir, Some("multi"), &opts("linux/aarch64/v8")).unwrap();
    assert_eq!(aarch64.manifest_digest, arm.manifest_digest);
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

// ---- Descriptors: every blob's size, digest and media type is checked ----

use serde_json::Value;

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// Which blob of a [`Bad`] layout a change applies to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Blob {
    Index,
    Manifest,
    Config,
    Layer,
}

/// One way to spoil a one-image layout (tag `t`, one uncompressed layer
/// with `/f`, optionally behind an image index); `None` leaves it good.
#[derive(Clone, Copy, Default)]
struct Bad {
    /// The manifest sits behind an image index for the host's platform.
    nested: bool,
    /// The layer's bytes as stored (its descriptor follows them).
    layer_bytes: Option<fn(&mut Vec<u8>)>,
    layer_desc: Option<fn(&mut Value)>,
    config_desc: Option<fn(&mut Value)>,
    manifest: Option<fn(&mut Value)>,
    /// The manifest's descriptor (in the index, or in index.json).
    manifest_desc: Option<fn(&mut Value)>,
    index: Option<fn(&mut Value)>,
    /// The index's descriptor in index.json.
    index_desc: Option<fn(&mut Value)>,
    /// Replaces this blob's file with other bytes of the same length.
    swap: Option<Blob>,
}

fn desc_of(dir: &Path, media_type: &str, data: &[u8], edit: Option<fn(&mut Value)>) -> Value {
    let mut d = blob(dir, media_type, data);
    if let Some(f) = edit {
        f(&mut d);
    }
    d
}

/// Writes the layout `bad` describes at `dir`.
fn bad_layout(dir: &Path, bad: Bad) {
    let _ = fs::remove_dir_all(dir);
    let mut l = Layer::new();
    l.file("f", b"descriptors are checked\n", 0o644);
    let tar = l.finish();
    let mut layer = tar.clone();
    if let Some(f) = bad.layer_bytes {
        f(&mut layer);
    }
    let layer_desc = desc_of(dir, LAYER_TAR, &layer, bad.layer_desc);
    let host = cairn_image::PlatformSpec::host();
    let config = serde_json::to_vec(&json!({
        "architecture": host.architecture, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [sha256(&tar)]},
    }))
    .unwrap();
    let config_desc = desc_of(dir, OCI_CONFIG, &config, bad.config_desc);
    let mut manifest = json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": config_desc, "layers": [layer_desc],
    });
    if let Some(f) = bad.manifest {
        f(&mut manifest);
    }
    let manifest = serde_json::to_vec(&manifest).unwrap();
    let mut manifest_desc = desc_of(dir, OCI_MANIFEST, &manifest, bad.manifest_desc);
    let mut top = if bad.nested {
        manifest_desc["platform"] = json!({"architecture": host.architecture, "os": "linux"});
        let mut index = json!({
            "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [manifest_desc],
        });
        if let Some(f) = bad.index {
            f(&mut index);
        }
        let index = serde_json::to_vec(&index).unwrap();
        desc_of(dir, OCI_INDEX, &index, bad.index_desc)
    } else {
        manifest_desc
    };
    top["annotations"] = json!({"org.opencontainers.image.ref.name": "t"});
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [top.clone()]})).unwrap(),
    )
    .unwrap();
    if let Some(which) = bad.swap {
        // The descriptor chain down to `which`, read back from what was written.
        let read = |d: &Value| -> Value {
            let hex = &d["digest"].as_str().unwrap()[7..];
            serde_json::from_slice(&fs::read(dir.join("blobs/sha256").join(hex)).unwrap()).unwrap()
        };
        let m_desc = if bad.nested {
            read(&top)["manifests"][0].clone()
        } else {
            top.clone()
        };
        let target = match which {
            Blob::Index => top.clone(),
            Blob::Manifest => m_desc,
            Blob::Config => read(&m_desc)["config"].clone(),
            Blob::Layer => read(&m_desc)["layers"][0].clone(),
        };
        let path = dir
            .join("blobs/sha256")
            .join(&target["digest"].as_str().unwrap()[7..]);
        let mut data = fs::read(&path).unwrap();
        if which == Blob::Layer {
            // A byte of /f's contents (after the 512-byte header): still a tar.
            data[514] ^= 1;
        } else {
            // Same length, other bytes (no longer JSON, but the digest is
            // checked first).
            data.rotate_right(1);
            data[0] = b' ';
        }
        fs::write(&path, data).unwrap();
    }
}

fn upper_hex(d: &mut Value) {
    let s = d["digest"].as_str().unwrap();
    d["digest"] = json!(format!("sha256:{}", s[7..].to_uppercase()));
}

/// Imports the bad layout, expects an error with every one of `expect`,
/// then checks that the store holds nothing new and that fsck is content,
/// and that a good image imports into the same store afterwards.
fn refused(name: &str, bad: Bad, expect: &[&str]) -> Result<String, String> {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    bad_layout(&dir, bad);
    let root = d.path().join("store");
    let s = open_store(&root);
    let err = match import_oci_layout(&s, &dir, Some("t"), &ImportOptions::default()) {
        Ok(img) => return Err(format!("{name}: imported: {img:?}")),
        Err(e) => e.to_string(),
    };
    for want in expect {
        if !err.contains(want) {
            return Err(format!("{name}: error {err:?} lacks {want:?}"));
        }
    }
    let fsck = s.fsck(&cairn_store::FsckOptions::default()).unwrap();
    if !fsck.problems.is_empty() {
        return Err(format!("{name}: fsck: {:?}", fsck.problems));
    }
    drop(s);
    drop(open_store(&root));
    let (seen, tmp) = visible(&root);
    if !seen.is_empty() || !tmp.is_empty() {
        return Err(format!("{name}: left {seen:?}, tmp {tmp:?}"));
    }
    // A good image after the bad one.
    bad_layout(&dir, Bad::default());
    let s = open_store(&root);
    let img = import_oci_layout(&s, &dir, Some("t"), &ImportOptions::default())
        .map_err(|e| format!("{name}: the good image after it: {e}"))?;
    assert_eq!(
        content(&s, &entries(&image_tree(&s, &img))["/f"]),
        b"descriptors are checked\n"
    );
    Ok(err)
}

#[test]
fn oci_layout_descriptors_are_enforced() {
    let nested = Bad {
        nested: true,
        ..Bad::default()
    };
    let rows: Vec<(&str, Bad, Vec<&str>)> = vec![
        (
            "index's manifest descriptor +100",
            Bad {
                manifest_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() + 100)),
                ..nested
            },
            vec!["oci-layout:", ":t: manifest sha256:", "size mismatch: the descriptor says", "bytes, the blob has"],
        ),
        (
            "index descriptor +100",
            Bad {
                index_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() + 100)),
                ..nested
            },
            vec![": index sha256:", "size mismatch"],
        ),
        (
            "manifest descriptor -1",
            Bad {
                manifest_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() - 1)),
                ..Bad::default()
            },
            vec![": manifest sha256:", "size mismatch"],
        ),
        (
            "layer size +1",
            Bad {
                layer_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() + 1)),
                ..Bad::default()
            },
            vec![": layer sha256:", "size mismatch: the descriptor says 2049 bytes, the blob has 2048"],
        ),
        (
            "layer size -1",
            Bad {
                layer_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() - 1)),
                ..Bad::default()
            },
            vec![": layer sha256:", "size mismatch: the descriptor says 2047 bytes, the blob has 2048"],
        ),
        (
            "config size +1",
            Bad {
                config_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() + 1)),
                ..Bad::default()
            },
            vec![": config sha256:", "size mismatch"],
        ),
        (
            "config size -1",
            Bad {
                config_desc: Some(|d| d["size"] = json!(d["size"].as_u64().unwrap() - 1)),
                ..Bad::default()
            },
            vec![": config sha256:", "size mismatch"],
        ),
        (
            "index bytes differ from its digest",
            Bad {
                swap: Some(Blob::Index),
                ..nested
            },
            vec![": index sha256:", "digest mismatch: expected sha256:"],
        ),
        (
            "manifest bytes differ from its digest",
            Bad {
                swap: Some(Blob::Manifest),
                ..nested
            },
            vec![": manifest sha256:", "digest mismatch"],
        ),
        (
            "config bytes differ from its digest",
            Bad {
                swap: Some(Blob::Config),
                ..Bad::default()
            },
            vec![": config sha256:", "digest mismatch"],
        ),
        (
            "layer bytes differ from its digest",
            Bad {
                swap: Some(Blob::Layer),
                ..Bad::default()
            },
            vec!["layer sha256:", "blob digest mismatch: expected sha256:"],
        ),
        (
            "upper-case hex (layer)",
            Bad {
                layer_desc: Some(upper_hex),
                ..Bad::default()
            },
            vec!["layer 1: descriptor digest: \"sha256:", "a sha256 digest is 64 lower-case hex digits"],
        ),
        (
            "upper-case hex (manifest)",
            Bad {
                manifest_desc: Some(upper_hex),
                ..Bad::default()
            },
            vec!["index.json: descriptor digest:", "64 lower-case hex digits"],
        ),
        (
            "unknown algorithm (config)",
            Bad {
                config_desc: Some(|d| d["digest"] = json!("md5:d41d8cd98f00b204e9800998ecf8427e")),
                ..Bad::default()
            },
            vec!["config: descriptor digest:", "unregistered digest algorithm \"md5\""],
        ),
        (
            "sha512 digest (layer)",
            Bad {
                layer_desc: Some(|d| d["digest"] = json!(format!("sha512:{}", "ab".repeat(64)))),
                ..Bad::default()
            },
            vec!["sha512 digests are not supported (cairn verifies sha256 only)"],
        ),
        (
            "path characters (manifest)",
            Bad {
                manifest_desc: Some(|d| d["digest"] = json!("sha256:../../x")),
                ..nested
            },
            vec!["\"sha256:../../x\" is not a digest"],
        ),
        (
            "path characters (layer)",
            Bad {
                layer_desc: Some(|d| d["digest"] = json!("sha256:../../../etc/passwd")),
                ..Bad::default()
            },
            vec!["\"sha256:../../../etc/passwd\" is not a digest"],
        ),
        (
            "manifest mediaType contradicts its descriptor",
            Bad {
                manifest: Some(|m| {
                    m["mediaType"] = json!("application/vnd.docker.distribution.manifest.v2+json")
                }),
                ..Bad::default()
            },
            vec![
                ": manifest sha256:",
                "media type mismatch: the descriptor says \"application/vnd.oci.image.manifest.v1+json\", the content says \"application/vnd.docker.distribution.manifest.v2+json\"",
            ],
        ),
        (
            "index mediaType contradicts its descriptor",
            Bad {
                index: Some(|m| m["mediaType"] = json!(OCI_MANIFEST)),
                ..nested
            },
            vec![": index sha256:", "media type mismatch"],
        ),
        (
            "descriptor says manifest, content is an index",
            Bad {
                index_desc: Some(|d| d["mediaType"] = json!(OCI_MANIFEST)),
                ..nested
            },
            vec![": manifest sha256:", "media type mismatch"],
        ),
        (
            "layer media type gzip, bytes a plain tar",
            Bad {
                layer_desc: Some(|d| d["mediaType"] = json!(LAYER_GZIP)),
                ..Bad::default()
            },
            vec!["layer sha256:", "the media type says gzip but the blob does not start with gzip magic bytes"],
        ),
        (
            "layer media type tar, bytes gzip",
            Bad {
                layer_bytes: Some(|b| *b = gzip(b)),
                ..Bad::default()
            },
            vec!["layer sha256:", "the media type says an uncompressed tar but the blob starts with gzip magic bytes"],
        ),
        (
            "config of another media type",
            Bad {
                config_desc: Some(|d| d["mediaType"] = json!("application/vnd.cncf.helm.config.v1+json")),
                ..Bad::default()
            },
            vec!["unsupported media type \"application/vnd.cncf.helm.config.v1+json\""],
        ),
        (
            "negative size",
            Bad {
                layer_desc: Some(|d| d["size"] = json!(-1)),
                ..Bad::default()
            },
            vec!["layer 1: the descriptor's size is not a non-negative integer"],
        ),
    ];
    let mut failures = Vec::new();
    for (name, bad, expect) in rows {
        match refused(name, bad, &expect) {
            Ok(err) => eprintln!("ok: {name}: {err}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn oci_layout_good_nested_index_imports() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    bad_layout(
        &dir,
        Bad {
            nested: true,
            ..Bad::default()
        },
    );
    let s = open_store(&d.path().join("store"));
    let img = import_oci_layout(&s, &dir, Some("t"), &ImportOptions::default()).unwrap();
    assert_eq!(img.layers.len(), 1);
}

// ---- docker-archive: no descriptors; the digests it does state are checked ----

/// A `docker save`-style archive of one image with one uncompressed layer
/// holding `/f`; `edit` may change the member names and contents and the
/// config before the archive is written: (config name, config, layer
/// name, layer).
fn docker_archive(
    path: &Path,
    edit: impl FnOnce(&mut String, &mut Value, &mut String, &mut Vec<u8>),
) {
    let mut l = Layer::new();
    l.file("f", b"from a docker archive\n", 0o644);
    let mut layer = l.finish();
    let host = cairn_image::PlatformSpec::host();
    let mut config = json!({
        "architecture": host.architecture, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [sha256(&layer)]},
    });
    let config_bytes = serde_json::to_vec(&config).unwrap();
    let mut config_name = format!("{}.json", &sha256(&config_bytes)[7..]);
    let mut layer_name = format!("{}.tar", &sha256(&layer)[7..]);
    let original = config.clone();
    edit(&mut config_name, &mut config, &mut layer_name, &mut layer);
    // An edited config keeps its name (the name then lies).
    let config_bytes = if config == original {
        config_bytes
    } else {
        serde_json::to_vec(&config).unwrap()
    };
    let manifest = serde_json::to_vec(&json!([{
        "Config": config_name, "RepoTags": ["docker.test/x:y"], "Layers": [layer_name],
    }]))
    .unwrap();
    let mut b = tar::Builder::new(fs::File::create(path).unwrap());
    for (name, data) in [
        (layer_name.as_str(), &layer),
        (config_name.as_str(), &config_bytes),
        ("manifest.json", &manifest),
    ] {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        if name.contains("..") {
            // A raw name: the tar crate refuses `..`, which one row needs.
            h.as_mut_bytes()[..name.len()].copy_from_slice(name.as_bytes());
            h.set_cksum();
            b.append(&h, data.as_slice()).unwrap();
        } else {
            b.append_data(&mut h, name, data.as_slice()).unwrap();
        }
    }
    b.into_inner().unwrap();
}

#[test]
fn docker_archive_digests_are_checked() {
    type Edit = fn(&mut String, &mut Value, &mut String, &mut Vec<u8>);
    let rows: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "config content differs from its name",
            |_, c, _, _| c["os"] = json!("linux "),
            vec![
                "docker-archive:",
                ".json\": digest mismatch: its name says sha256:",
                "its content is sha256:",
            ],
        ),
        (
            "layer content differs from its digest name",
            |_, _, _, l| l[514] ^= 1,
            vec![
                "docker-archive:",
                ": layer \"",
                ".tar\": layer sha256:",
                "blob digest mismatch: expected sha256:",
            ],
        ),
        (
            "layer differs from its diff_id (name not a digest)",
            |_, _, n, l| {
                *n = "0123/layer.tar".into();
                l[514] ^= 1;
            },
            vec!["diff_id mismatch: expected sha256:"],
        ),
        (
            "layer in blobs/ with a changed byte",
            |_, _, n, l| {
                *n = format!("blobs/sha256/{}", &sha256(l)[7..]);
                l[514] ^= 1;
            },
            vec!["blob digest mismatch"],
        ),
        (
            "upper-case hex diff_id",
            |cn, c, _, _| {
                *cn = "config.json".into();
                let d = c["rootfs"]["diff_ids"][0].as_str().unwrap().to_uppercase();
                c["rootfs"]["diff_ids"][0] = json!(d.replace("SHA256", "sha256"));
            },
            vec![
                "rootfs.diff_ids[0]: \"sha256:",
                "a sha256 digest is 64 lower-case hex digits",
            ],
        ),
        (
            "upper-case hex blob name",
            |_, _, n, l| *n = format!("blobs/sha256/{}", sha256(l)[7..].to_uppercase()),
            vec![
                "manifest.json: layer \"blobs/sha256/",
                "64 lower-case hex digits",
            ],
        ),
        (
            "unknown algorithm diff_id",
            |cn, c, _, _| {
                *cn = "config.json".into();
                c["rootfs"]["diff_ids"][0] = json!("md5:d41d8cd98f00b204e9800998ecf8427e");
            },
            vec!["unregistered digest algorithm \"md5\""],
        ),
        (
            "sha512 diff_id",
            |cn, c, _, _| {
                *cn = "config.json".into();
                c["rootfs"]["diff_ids"][0] = json!(format!("sha512:{}", "cd".repeat(64)));
            },
            vec!["sha512 digests are not supported"],
        ),
        (
            "path characters in a diff_id",
            |cn, c, _, _| {
                *cn = "config.json".into();
                c["rootfs"]["diff_ids"][0] = json!("sha256:../../x");
            },
            vec!["\"sha256:../../x\" is not a digest"],
        ),
        (
            "path characters in a blob name",
            |_, _, n, _| *n = "blobs/sha256/../../x".into(),
            vec!["\"sha256:../../x\" is not a digest"],
        ),
        (
            "sha512 config name",
            |cn, _, _, _| *cn = format!("blobs/sha512/{}", "ef".repeat(64)),
            vec!["config \"blobs/sha512/", "sha512 digests are not supported"],
        ),
    ];
    let d = tempfile::tempdir().unwrap();
    let good = d.path().join("good.tar");
    docker_archive(&good, |_, _, _, _| {});
    let mut failures = Vec::new();
    for (i, (name, edit, expect)) in rows.into_iter().enumerate() {
        let path = d.path().join(format!("bad{i}.tar"));
        docker_archive(&path, edit);
        let root = d.path().join(format!("store{i}"));
        let s = open_store(&root);
        let err = match cairn_image::import_docker_archive(&s, &path, &ImportOptions::default()) {
            Ok(img) => {
                failures.push(format!("{name}: imported: {img:?}"));
                continue;
            }
            Err(e) => e.to_string(),
        };
        eprintln!("ok: {name}: {err}");
        for want in &expect {
            if !err.contains(want) {
                failures.push(format!("{name}: error {err:?} lacks {want:?}"));
            }
        }
        let fsck = s.fsck(&cairn_store::FsckOptions::default()).unwrap();
        assert!(fsck.problems.is_empty(), "{name}: {:?}", fsck.problems);
        drop(s);
        drop(open_store(&root));
        let (seen, tmp) = visible(&root);
        if !seen.is_empty() || !tmp.is_empty() {
            failures.push(format!("{name}: left {seen:?}, tmp {tmp:?}"));
        }
        let s = open_store(&root);
        match cairn_image::import_docker_archive(&s, &good, &ImportOptions::default()) {
            Ok(img) => assert_eq!(
                content(&s, &entries(&image_tree(&s, &img))["/f"]),
                b"from a docker archive\n"
            ),
            Err(e) => failures.push(format!("{name}: the good archive after it: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// skopeo's docker-archive (`<hex>.json`, `<hex>.tar`, a legacy
/// `<id>/layer.tar` symlink) imports, its names checked as digests.
#[test]
fn docker_archive_from_skopeo() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    bad_layout(&dir, Bad::default());
    let archive = d.path().join("a.tar");
    let out = std::process::Command::new("skopeo")
        .args(["copy", "-q"])
        .arg(format!("oci:{}:t", dir.display()))
        .arg(format!("docker-archive:{}:x:y", archive.display()))
        .env("HOME", d.path())
        .output()
        .expect("running skopeo (apt-get install skopeo)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = open_store(&d.path().join("store"));
    let img = cairn_image::import_docker_archive(&s, &archive, &ImportOptions::default()).unwrap();
    assert_eq!(
        content(&s, &entries(&image_tree(&s, &img))["/f"]),
        b"descriptors are checked\n"
    );
}

// ---- Several layers at once: the same result as one at a time ----

/// Four layers (gzip, zstd, plain, and the first again), with whiteouts
/// and files over the inline size: their tars and blobs.
fn four_layers() -> Vec<(Vec<u8>, Vec<u8>, &'static str)> {
    let mut a = Layer::new();
    a.dir("etc", 0o755)
        .file("etc/os", b"a\n", 0o644)
        .file("bin/big", &vec![1u8; 300_000], 0o755)
        .hardlink("bin/big2", "bin/big");
    for i in 0..200 {
        a.file(&format!("usr/share/f{i}"), &vec![i as u8; 5000 + i], 0o644);
    }
    let a = a.finish();
    let mut b = Layer::new();
    b.whiteout("etc/.wh.os")
        .file("etc/b", &vec![2u8; 70_000], 0o600);
    for i in 0..100 {
        b.file(&format!("usr/share/f{i}"), &vec![i as u8 + 1; 6000], 0o644);
    }
    let b = b.finish();
    let mut c = Layer::new();
    c.whiteout("usr/.wh..wh..opq").file("usr/c", b"c", 0o644);
    let c = c.finish();
    vec![
        (gzip(&a), a.clone(), LAYER_GZIP),
        (zstd(&b), b, "application/vnd.oci.image.layer.v1.tar+zstd"),
        (c.clone(), c, LAYER_TAR),
        (gzip(&a), a, LAYER_GZIP),
    ]
}

/// A layout of one image (tag `t`) from these layers.
fn layout_of(dir: &Path, layers: &[(Vec<u8>, Vec<u8>, &str)]) {
    let host = PlatformSpec::host();
    let diff_ids: Vec<String> = layers.iter().map(|(_, tar, _)| sha256(tar)).collect();
    let config = serde_json::to_vec(&json!({
        "architecture": host.architecture, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let descs: Vec<Value> = layers
        .iter()
        .map(|(blob_bytes, _, mt)| blob(dir, mt, blob_bytes))
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": blob(dir, OCI_CONFIG, &config), "layers": descs,
    }))
    .unwrap();
    let mut m = blob(dir, OCI_MANIFEST, &manifest);
    m["annotations"] = json!({"org.opencontainers.image.ref.name": "t"});
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [m]})).unwrap(),
    )
    .unwrap();
}

/// A `docker save` archive at `path` of one image (tag `tag`) with these
/// layers, their members as they are (docker archives name no
/// compression).
fn docker_save(path: &Path, layers: &[(Vec<u8>, Vec<u8>, &str)], tag: &str) {
    let names: Vec<String> = (0..layers.len())
        .map(|i| format!("l{i}/layer.tar"))
        .collect();
    let diff_ids: Vec<String> = layers.iter().map(|(_, tar, _)| sha256(tar)).collect();
    let host = PlatformSpec::host();
    let config = serde_json::to_vec(&json!({
        "architecture": host.architecture, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let manifest = serde_json::to_vec(&json!([{
        "Config": "config.json", "RepoTags": [tag], "Layers": names,
    }]))
    .unwrap();
    let mut b = tar::Builder::new(fs::File::create(path).unwrap());
    let members = layers
        .iter()
        .zip(&names)
        .map(|((blob, _, _), n)| (n.as_str(), blob))
        .chain([("config.json", &config), ("manifest.json", &manifest)]);
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, name, data.as_slice()).unwrap();
    }
    b.into_inner().unwrap();
}

/// Every file under the store's `layers/` and `objects/`, with its bytes.
fn layers_and_objects(store: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![store.join("layers"), store.join("objects")];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                todo.push(e.path());
            } else {
                let rel = e.path().strip_prefix(store).unwrap().display().to_string();
                out.insert(rel, fs::read(e.path()).unwrap());
            }
        }
    }
    out
}

#[test]
fn oci_layout_layers_import_at_once_with_the_same_result() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    layout_of(&dir, &four_layers());
    let mut seen = Vec::new();
    for jobs in [1, 4] {
        let root = d.path().join(format!("store-{jobs}"));
        let s = open_store(&root);
        let opts = ImportOptions {
            jobs,
            ..Default::default()
        };
        let img = import_oci_layout(&s, &dir, Some("t"), &opts).unwrap();
        assert_eq!(img.layers.len(), 4);
        // The repeat of the first layer is imported once.
        assert!(
            !img.layers[0].cached && img.layers[3].cached,
            "{:?}",
            img.layers
        );
        seen.push((img.image_digest.clone(), layers_and_objects(&root)));
    }
    // The same layers in a `docker save` archive (gzip and zstd members
    // as they are; docker archives name no compression).
    let archive = d.path().join("image.tar");
    docker_save(&archive, &four_layers(), "docker.test/four:1");
    let mut from_archive = Vec::new();
    for jobs in [1, 4] {
        let root = d.path().join(format!("docker-{jobs}"));
        let s = open_store(&root);
        let opts = ImportOptions {
            jobs,
            ..Default::default()
        };
        let img = cairn_image::import_docker_archive(&s, &archive, &opts).unwrap();
        assert!(
            !img.layers[0].cached && img.layers[3].cached,
            "{:?}",
            img.layers
        );
        from_archive.push((img.image_digest.clone(), layers_and_objects(&root)));
    }
    assert_eq!(
        from_archive[0].0, from_archive[1].0,
        "docker archive: the same image"
    );
    assert!(
        from_archive[0].1 == from_archive[1].1,
        "docker archive: the same store"
    );

    assert_eq!(seen[0].0, seen[1].0, "the same image digest");
    assert!(seen[0].1.keys().any(|k| k.starts_with("objects/")));
    assert!(seen[0].1.keys().any(|k| k.starts_with("layers/")));
    assert_eq!(
        seen[0].1.keys().collect::<Vec<_>>(),
        seen[1].1.keys().collect::<Vec<_>>(),
        "the same layer records and objects"
    );
    assert!(seen[0].1 == seen[1].1, "the same bytes in each");
}

#[test]
fn oci_layout_a_bad_layer_among_several_fails_with_its_own_error() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("layout");
    let mut layers = four_layers();
    layers.truncate(3);
    layout_of(&dir, &layers);
    // The second layer's file changes after its descriptor was written:
    // a digest mismatch found only once it streams.
    let digest = sha256(&layers[1].0);
    let path = dir.join("blobs/sha256").join(&digest[7..]);
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    let root = d.path().join("store");
    let s = open_store(&root);
    let opts = ImportOptions {
        jobs: 3,
        ..Default::default()
    };
    let e = import_oci_layout(&s, &dir, Some("t"), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&digest), "{e}");
    assert!(!e.contains("stopped"), "the failing layer's error: {e}");
    assert_eq!(s.list_images().unwrap().count(), 0, "no image");
    // Put right, the import goes through in the same store.
    bytes[last] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    let img = import_oci_layout(&s, &dir, Some("t"), &opts).unwrap();
    assert_eq!(img.layers.len(), 3);
}

/// The image that the store's layer records make, from the image record
/// of `digest`: what an import made before it wrote the image from the
/// entries its layers handed over.
fn assembled_from_records(s: &cairn_store::Store, digest: &str) -> String {
    let rec = s.image_record(digest).unwrap().expect("an image record");
    cairn_image::assemble_image(s, rec.manifest.as_bytes(), rec.config.as_bytes(), None)
        .unwrap()
        .image_digest
}

#[test]
fn an_image_written_while_its_layers_are_published_is_the_one_their_records_make() {
    // Three different layers: each import hands its entries over and the
    // image is written from them (a repeated layer would be read from its
    // record instead; the four-layer test above covers that).
    let d = tempfile::tempdir().unwrap();
    let mut layers = four_layers();
    layers.truncate(3);
    let dir = d.path().join("layout");
    layout_of(&dir, &layers);
    let mut digests = Vec::new();
    for (case, cached_first) in [("fresh", false), ("first layer cached", true)] {
        let root = d.path().join(format!("store-{}", digests.len()));
        let s = open_store(&root);
        if cached_first {
            let (blob_bytes, tar, mt) = &layers[0];
            cairn_image::import_layer(
                &s,
                blob_bytes.as_slice(),
                Some(mt),
                None,
                Some(&sha256(tar)),
                &Default::default(),
            )
            .unwrap();
        }
        for jobs in [1, 3] {
            let opts = ImportOptions {
                jobs,
                ..Default::default()
            };
            let img = import_oci_layout(&s, &dir, Some("t"), &opts).unwrap();
            // The second import (jobs 3) finds every layer in the store.
            let cached: Vec<bool> = (0..3)
                .map(|i| jobs == 3 || (i == 0 && cached_first))
                .collect();
            assert_eq!(
                img.layers.iter().map(|l| l.cached).collect::<Vec<_>>(),
                cached,
                "{case}, jobs {jobs}"
            );
            assert_eq!(
                img.image_digest,
                assembled_from_records(&s, &img.image_digest),
                "{case}, jobs {jobs}"
            );
            digests.push(img.image_digest);
        }
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");

    // The same layers from a `docker save` archive (its manifest is made
    // from the layers' sizes, known once each is checked) and one layer
    // from a directory: the images their records make.
    let archive = d.path().join("image.tar");
    docker_save(&archive, &layers, "docker.test/three:1");
    let s = open_store(&d.path().join("docker"));
    let img = cairn_image::import_docker_archive(&s, &archive, &Default::default()).unwrap();
    assert_eq!(img.image_digest, digests[0], "docker archive");
    assert_eq!(
        img.image_digest,
        assembled_from_records(&s, &img.image_digest)
    );
    let rec = s.image_record(&img.image_digest).unwrap().unwrap();
    let m: serde_json::Value = serde_json::from_str(&rec.manifest).unwrap();
    let sizes: Vec<u64> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .collect();
    assert_eq!(
        sizes,
        layers
            .iter()
            .map(|(_, tar, _)| tar.len() as u64)
            .collect::<Vec<_>>(),
        "the archive's manifest names each layer's size"
    );

    let tree = d.path().join("tree");
    fs::create_dir_all(tree.join("etc")).unwrap();
    fs::write(tree.join("etc/hello"), vec![7u8; 10_000]).unwrap();
    let img = cairn_image::import_dir(&s, &tree, &Default::default()).unwrap();
    assert_eq!(
        img.image_digest,
        assembled_from_records(&s, &img.image_digest)
    );
}

#[test]
fn docker_archive_with_too_many_layers_is_refused_before_any_import() {
    let d = tempfile::tempdir().unwrap();
    let n = cairn_spec::limits::MAX_LAYERS + 1;
    let layers: Vec<(Vec<u8>, Vec<u8>, &str)> = (0..n)
        .map(|i| {
            let mut l = Layer::new();
            l.file(&format!("f{i}"), b"", 0o644);
            let t = l.finish();
            (t.clone(), t, "application/vnd.oci.image.layer.v1.tar")
        })
        .collect();
    let path = d.path().join("many.tar");
    docker_save(&path, &layers, "many:layers");
    let root = d.path().join("store");
    let s = open_store(&root);
    let err = cairn_image::import_docker_archive(&s, &path, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("{n} layers (at most")), "{err}");
    drop(s);
    assert!(layers_and_objects(&root).is_empty(), "layers were imported");
}

#[test]
fn docker_archive_cut_off_inside_a_member_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let mut l = Layer::new();
    l.file("f", b"x", 0o644);
    let layer = l.finish();
    let path = d.path().join("cut.tar");
    docker_save(
        &path,
        &[(
            layer.clone(),
            layer,
            "application/vnd.oci.image.layer.v1.tar",
        )],
        "cut:off",
    );
    // A member after the others, then the archive cut inside its data
    // (the end-of-archive blocks go too): the first pass skips members by
    // seeking, and a seek past the end of a file succeeds.
    let mut bytes = fs::read(&path).unwrap();
    bytes.truncate(bytes.len() - 1024);
    let mut tail = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(1 << 20);
    h.set_mode(0o644);
    tail.append_data(&mut h, "junk", &vec![1u8; 1 << 20][..])
        .unwrap();
    let tail = tail.into_inner().unwrap();
    bytes.extend_from_slice(&tail[..512 + (1 << 19)]);
    fs::write(&path, &bytes).unwrap();
    let s = open_store(&d.path().join("store"));
    let err = cairn_image::import_docker_archive(&s, &path, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cut.tar: byte 5120: the archive ends in the middle of an entry's data"),
        "{err}"
    );
}
