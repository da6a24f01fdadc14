//! Pulls from a real registry (Debian's docker-registry on 127.0.0.1) of
//! images pushed by skopeo or by plain uploads: gzip, zstd and uncompressed
//! layers, OCI and Docker schema 2 manifests, a two-platform index,
//! digest-pinned references, basic auth, and a second image sharing the
//! first one's base layer.

mod common;

use cairn_oci::spec::{media_type, Compression};
use cairn_oci::{ImageRef, PlatformSpec, PullEvent, PullOptions, PullReport, Registry};
use common::registry::{layout_manifest, push_tar_image, tar_of, test_layout, LocalRegistry};
use common::{store_snapshot, test_client, test_pull_options, tmp_after_reopen};

fn pull_into(
    root: &std::path::Path,
    reference: &str,
    opts: &PullOptions,
) -> Result<PullReport, String> {
    let store = cairn_store::Store::open(root).unwrap();
    let r = ImageRef::parse(reference).unwrap();
    let opts = PullOptions {
        name: Some(opts.name.clone().unwrap_or_else(|| r.familiar())),
        ..opts.clone()
    };
    cairn_oci::pull(&store, &r, &opts, &|_: &PullEvent<'_>| {}).map_err(|e| e.to_string())
}

fn resolve(reference: &str, platform: Option<&str>) -> Result<cairn_oci::Resolved, String> {
    let r = ImageRef::parse(reference).unwrap();
    let reg = Registry::new(&r, &test_client());
    let p = platform.map(|p| PlatformSpec::parse(p).unwrap());
    cairn_oci::resolve(&reg, &r, p.as_ref()).map_err(|e| e.to_string())
}

/// The pulled image is in the store under its name, and the store is tidy.
fn assert_pulled(root: &std::path::Path, report: &PullReport, name: &str) {
    let store = cairn_store::Store::open(root).unwrap();
    let found = store
        .resolve_image(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(found.digest.as_deref(), Some(report.image_digest.as_str()));
    drop(store);
    assert!(tmp_after_reopen(root).is_empty());
}

#[test]
fn gzip_image_then_a_second_sharing_its_base() {
    let layout = test_layout();
    let reg = LocalRegistry::start();
    reg.skopeo_push(layout, "base", "test/busybox:base", &[]);
    reg.skopeo_push(layout, "two", "test/busybox:two", &[]);
    let dir = tempfile::tempdir().unwrap();

    let base = pull_into(
        dir.path(),
        &reg.reference("test/busybox:base"),
        &test_pull_options(),
    )
    .unwrap();
    assert_eq!(base.layers.len(), 1);
    assert!(base.layers[0].fetched);
    assert_eq!(base.layers[0].media_type, media_type::OCI_LAYER_GZIP);
    // skopeo copies an OCI image verbatim: same manifest digest as the layout's.
    assert_eq!(base.manifest_digest, layout_manifest(layout, "base").0);
    assert_pulled(dir.path(), &base, &reg.reference("test/busybox:base"));

    let two = pull_into(
        dir.path(),
        &reg.reference("test/busybox:two"),
        &test_pull_options(),
    )
    .unwrap();
    assert_eq!(two.layers.len(), 2);
    assert_eq!(two.layers[0].diff_id, base.layers[0].diff_id);
    assert!(
        !two.layers[0].fetched,
        "the shared base layer is fetched again"
    );
    assert!(two.layers[1].fetched);
    assert_eq!(two.bytes_fetched, two.layers[1].size);
    assert_ne!(two.image_digest, base.image_digest);
    assert_pulled(dir.path(), &two, &reg.reference("test/busybox:two"));

    // Pulling again changes nothing and fetches nothing.
    let before = store_snapshot(dir.path());
    let again = pull_into(
        dir.path(),
        &reg.reference("test/busybox:two"),
        &test_pull_options(),
    )
    .unwrap();
    assert_eq!(again.image_digest, two.image_digest);
    assert_eq!(again.bytes_fetched, 0);
    assert_eq!(store_snapshot(dir.path()), before);

    // Pinned to the manifest digest: the same image.
    let pinned = format!("{}@{}", reg.reference("test/busybox"), two.manifest_digest);
    let by_digest = pull_into(dir.path(), &pinned, &test_pull_options()).unwrap();
    assert_eq!(by_digest.image_digest, two.image_digest);
    assert_pulled(dir.path(), &by_digest, &pinned);
}

#[test]
fn zstd_layers() {
    let layout = test_layout();
    let reg = LocalRegistry::start();
    reg.skopeo_push(
        layout,
        "two",
        "test/zstd:two",
        &["--dest-compress", "--dest-compress-format", "zstd"],
    );
    let reference = reg.reference("test/zstd:two");
    let resolved = resolve(&reference, None).unwrap();
    assert!(
        resolved
            .layers
            .iter()
            .all(|l| l.compression == Compression::Zstd),
        "{:?}",
        resolved.layers
    );
    let dir = tempfile::tempdir().unwrap();
    let report = pull_into(dir.path(), &reference, &test_pull_options()).unwrap();
    assert_eq!(report.layers[0].media_type, media_type::OCI_LAYER_ZSTD);
    assert_pulled(dir.path(), &report, &reference);

    // The same content as gzip layers: the same diff_ids, so nothing new is
    // fetched and the very same image comes out.
    reg.skopeo_push(layout, "two", "test/gzip:two", &[]);
    let gz = pull_into(
        dir.path(),
        &reg.reference("test/gzip:two"),
        &test_pull_options(),
    )
    .unwrap();
    assert_eq!(gz.bytes_fetched, 0);
    assert_eq!(gz.image_digest, report.image_digest);
}

#[test]
fn uncompressed_layers() {
    let reg = LocalRegistry::start();
    let layers = [
        tar_of(&[
            ("bin/", None),
            ("bin/tool", Some(b"#!/bin/sh\necho tool\n")),
        ]),
        tar_of(&[("etc/", None), ("etc/motd", Some(b"plain tar layer\n"))]),
    ];
    let (digest, _) = push_tar_image(
        &reg,
        "test/plain",
        "v1",
        &PlatformSpec::host().architecture,
        &layers,
    );
    let reference = reg.reference("test/plain:v1");
    let resolved = resolve(&reference, None).unwrap();
    assert_eq!(resolved.manifest_digest.as_str(), digest);
    assert!(resolved
        .layers
        .iter()
        .all(|l| l.compression == Compression::None));
    let dir = tempfile::tempdir().unwrap();
    let report = pull_into(dir.path(), &reference, &test_pull_options()).unwrap();
    assert_eq!(report.layers.len(), 2);
    assert_eq!(report.layers[0].unpacked_size, Some(layers[0].len() as u64));
    assert_pulled(dir.path(), &report, &reference);
}

#[test]
fn docker_schema2_manifest() {
    let layout = test_layout();
    let reg = LocalRegistry::start();
    reg.skopeo_push(layout, "two", "test/docker:two", &["--format", "v2s2"]);
    let reference = reg.reference("test/docker:two");
    let resolved = resolve(&reference, None).unwrap();
    assert_eq!(resolved.manifest_media_type, media_type::DOCKER_MANIFEST);
    assert!(resolved
        .layers
        .iter()
        .all(|l| l.media_type == media_type::DOCKER_LAYER_GZIP));
    let dir = tempfile::tempdir().unwrap();
    let report = pull_into(dir.path(), &reference, &test_pull_options()).unwrap();
    assert_pulled(dir.path(), &report, &reference);

    // The OCI original has the same layers and config: same diff_ids.
    reg.skopeo_push(layout, "two", "test/oci:two", &[]);
    let oci = pull_into(
        dir.path(),
        &reg.reference("test/oci:two"),
        &test_pull_options(),
    )
    .unwrap();
    assert_eq!(oci.bytes_fetched, 0);
    assert_eq!(oci.config_digest, report.config_digest);
}

#[test]
fn index_with_two_platforms() {
    let layout = test_layout();
    let reg = LocalRegistry::start();
    reg.skopeo_push(layout, "base", "test/multi:amd64", &[]);
    reg.skopeo_push(layout, "arm64", "test/multi:arm64", &[]);
    let entry = |tag: &str, arch: &str| {
        let (digest, bytes) = layout_manifest(layout, tag);
        serde_json::json!({
            "mediaType": media_type::OCI_MANIFEST, "digest": digest, "size": bytes.len(),
            "platform": {"os": "linux", "architecture": arch}
        })
    };
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media_type::OCI_INDEX,
        "manifests": [entry("base", "amd64"), entry("arm64", "arm64")],
    }))
    .unwrap();
    let index_digest = reg.push_manifest("test/multi", "latest", media_type::OCI_INDEX, &index);
    let reference = reg.reference("test/multi:latest");

    let amd = resolve(&reference, Some("linux/amd64")).unwrap();
    assert_eq!(
        amd.manifest_digest.as_str(),
        layout_manifest(layout, "base").0
    );
    assert_eq!(
        amd.index_digest.as_ref().map(|d| d.as_str()),
        Some(index_digest.as_str())
    );
    assert_eq!(amd.platform.as_deref(), Some("linux/amd64"));
    let arm = resolve(&reference, Some("linux/arm64/v8")).unwrap();
    assert_eq!(
        arm.manifest_digest.as_str(),
        layout_manifest(layout, "arm64").0
    );
    let err = resolve(&reference, Some("linux/s390x")).unwrap_err();
    assert_eq!(
        err,
        format!("no image for platform linux/s390x in {reference} (available: linux/amd64, linux/arm64)")
    );
    // Without --platform: the host's.
    let host = PlatformSpec::host();
    if ["amd64", "arm64"].contains(&host.architecture.as_str()) {
        let r = resolve(&reference, None).unwrap();
        assert_eq!(r.platform, Some(format!("linux/{}", host.architecture)));
    }

    let dir = tempfile::tempdir().unwrap();
    let opts = PullOptions {
        platform: Some(PlatformSpec::parse("linux/arm64").unwrap()),
        ..test_pull_options()
    };
    let report = pull_into(dir.path(), &reference, &opts).unwrap();
    assert_eq!(report.platform.as_deref(), Some("linux/arm64"));
    assert_eq!(report.index_digest.as_deref(), Some(index_digest.as_str()));
    assert_eq!(report.manifest_digest, arm.manifest_digest.as_str());
    assert_pulled(dir.path(), &report, &reference);

    // Pinned to the index digest, the other platform.
    let pinned = format!("{}@{index_digest}", reg.reference("test/multi"));
    let opts = PullOptions {
        platform: Some(PlatformSpec::parse("linux/amd64").unwrap()),
        ..test_pull_options()
    };
    let amd_report = pull_into(dir.path(), &pinned, &opts).unwrap();
    assert_eq!(amd_report.manifest_digest, amd.manifest_digest.as_str());
    // Same layers, another config: no layer fetched.
    assert_eq!(amd_report.bytes_fetched, 0);

    // A single-platform image for another platform than asked is refused.
    let err = resolve(&reg.reference("test/multi:arm64"), Some("linux/amd64")).unwrap_err();
    assert!(err.contains("(available: linux/arm64)"), "{err}");
}

#[test]
fn basic_auth() {
    let hash = bcrypt::hash_with_result("s3cret", 4)
        .unwrap()
        .format_for_version(bcrypt::Version::TwoA);
    let reg = LocalRegistry::start_with(Some(("alice", "s3cret", &format!("alice:{hash}"))));
    reg.skopeo_push(test_layout(), "base", "private/busybox:base", &[]);
    let reference = reg.reference("private/busybox:base");
    let dir = tempfile::tempdir().unwrap();
    let before = store_snapshot(dir.path());

    let err = pull_into(dir.path(), &reference, &test_pull_options()).unwrap_err();
    assert_eq!(
        err,
        format!(
            "authentication failed for {}/private/busybox (401: UNAUTHORIZED: authentication required; \
             basic auth required; tried anonymously: no credentials found)",
            reg.addr
        )
    );
    assert_eq!(store_snapshot(dir.path()), before);

    // Credentials from a Docker config.json, keyed by URL as `docker login` writes it.
    use base64::Engine as _;
    let auth_dir = tempfile::tempdir().unwrap();
    let config = auth_dir.path().join("config.json");
    let write = |pass: &str| {
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("alice:{pass}"));
        std::fs::write(
            &config,
            format!(
                r#"{{"auths":{{"http://{}":{{"auth":"{b64}"}}}}}}"#,
                reg.addr
            ),
        )
        .unwrap();
    };
    let opts = PullOptions {
        client: cairn_oci::ClientOptions {
            auth_files: vec![config.clone()],
            ..test_client()
        },
        ..test_pull_options()
    };
    write("wrong");
    let err = pull_into(dir.path(), &reference, &opts).unwrap_err();
    assert!(
        err.starts_with(&format!(
            "authentication failed for {}/private/busybox (401: ",
            reg.addr
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "tried as \"alice\" with credentials from {}",
            config.display()
        )),
        "{err}"
    );
    assert_eq!(store_snapshot(dir.path()), before);

    write("s3cret");
    let report = pull_into(dir.path(), &reference, &opts).unwrap();
    assert_pulled(dir.path(), &report, &reference);
}

#[test]
fn missing_tags_and_repositories() {
    let reg = LocalRegistry::start();
    reg.skopeo_push(test_layout(), "base", "test/here:base", &[]);
    let err = resolve(&reg.reference("test/here:nosuchtag"), None).unwrap_err();
    assert_eq!(
        err,
        format!("manifest unknown: {}/test/here:nosuchtag", reg.addr)
    );
    // distribution 2.8 says MANIFEST_UNKNOWN for a repository it never
    // saw, too (others say NAME_UNKNOWN, which the message then names).
    let err = resolve(&reg.reference("test/nothere:base"), None).unwrap_err();
    assert!(
        err.starts_with(&format!("manifest unknown: {}/test/nothere:base", reg.addr)),
        "{err}"
    );
}

/// Descriptors a real registry serves as they were pushed but that do not
/// match their blobs (distribution does not check sizes, nor an index
/// entry's media type against the manifest's): each pull is refused with
/// the blob, the expected and the actual size named, the store is as it
/// was, and a good image pulls into it afterwards.
#[test]
fn descriptor_sizes_and_media_types_are_enforced() {
    use serde_json::json;
    let reg = LocalRegistry::start();
    let repo = "test/desc";
    let layer = tar_of(&[("etc/", None), ("etc/desc", Some(b"sizes are checked\n"))]);
    let layer_digest = reg.push_blob(repo, &layer);
    let arch = PlatformSpec::host().architecture;
    let config = serde_json::to_vec(&json!({
        "architecture": arch, "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }))
    .unwrap();
    let config_digest = reg.push_blob(repo, &config);
    let manifest = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut m = json!({
            "schemaVersion": 2,
            "mediaType": media_type::OCI_MANIFEST,
            "config": {"mediaType": media_type::OCI_CONFIG, "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": media_type::OCI_LAYER_TAR, "digest": layer_digest, "size": layer.len()}],
        });
        edit(&mut m);
        serde_json::to_vec(&m).unwrap()
    };
    let good = manifest(&|_| {});
    let good_digest = reg.push_manifest(repo, "good", media_type::OCI_MANIFEST, &good);
    let index = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut i = json!({
            "schemaVersion": 2,
            "mediaType": media_type::OCI_INDEX,
            "manifests": [{
                "mediaType": media_type::OCI_MANIFEST, "digest": good_digest, "size": good.len(),
                "platform": {"os": "linux", "architecture": arch},
            }],
        });
        edit(&mut i);
        serde_json::to_vec(&i).unwrap()
    };
    let push = |tag: &str, mt: &str, bytes: Vec<u8>| {
        reg.push_manifest(repo, tag, mt, &bytes);
        reg.reference(&format!("{repo}:{tag}"))
    };
    let plus = |n: i64| {
        move |d: &mut serde_json::Value| d["size"] = json!(d["size"].as_i64().unwrap() + n)
    };
    let rows: Vec<(String, Vec<String>)> = vec![
        (
            push(
                "layer-plus-1",
                media_type::OCI_MANIFEST,
                manifest(&|m| plus(1)(&mut m["layers"][0])),
            ),
            vec![format!(
                "blob {layer_digest}: size mismatch: the descriptor says {} bytes, got {}",
                layer.len() + 1,
                layer.len()
            )],
        ),
        (
            push(
                "layer-minus-1",
                media_type::OCI_MANIFEST,
                manifest(&|m| plus(-1)(&mut m["layers"][0])),
            ),
            vec![format!(
                "blob {layer_digest}: size mismatch: the descriptor says {} bytes, got {}",
                layer.len() - 1,
                layer.len()
            )],
        ),
        (
            push(
                "config-plus-1",
                media_type::OCI_MANIFEST,
                manifest(&|m| plus(1)(&mut m["config"])),
            ),
            vec![format!(
                "config {config_digest} of {}: size mismatch: the descriptor says {} bytes, got {}",
                reg.reference(&format!("{repo}:config-plus-1")),
                config.len() + 1,
                config.len()
            )],
        ),
        (
            push(
                "config-minus-1",
                media_type::OCI_MANIFEST,
                manifest(&|m| plus(-1)(&mut m["config"])),
            ),
            vec![format!("config {config_digest} of"), "size mismatch".into()],
        ),
        (
            push(
                "index-plus-100",
                media_type::OCI_INDEX,
                index(&|i| plus(100)(&mut i["manifests"][0])),
            ),
            vec![
                format!(
                    "manifest {}@{good_digest} (linux/{arch} in the index of",
                    reg.reference(repo)
                ),
                format!(
                    "size mismatch: the descriptor says {} bytes, got {}",
                    good.len() + 100,
                    good.len()
                ),
            ],
        ),
        (
            push(
                "index-media-type",
                media_type::OCI_INDEX,
                index(&|i| i["manifests"][0]["mediaType"] = json!(media_type::DOCKER_MANIFEST)),
            ),
            vec![format!(
                "media type mismatch: the descriptor says {:?}, the content says {:?}",
                media_type::DOCKER_MANIFEST,
                media_type::OCI_MANIFEST
            )],
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let before = store_snapshot(dir.path());
    for (reference, expect) in rows {
        let err = pull_into(dir.path(), &reference, &test_pull_options()).expect_err(&reference);
        for want in &expect {
            assert!(
                err.contains(want.as_str()),
                "{reference}: {err:?} lacks {want:?}"
            );
        }
        eprintln!("ok: {reference}: {err}");
        assert_eq!(store_snapshot(dir.path()), before, "{reference}");
        assert!(tmp_after_reopen(dir.path()).is_empty(), "{reference}");
    }
    let good_ref = reg.reference(&format!("{repo}:good"));
    let report = pull_into(dir.path(), &good_ref, &test_pull_options()).unwrap();
    assert_pulled(dir.path(), &report, &good_ref);
    let fsck = cairn_store::Store::open(dir.path())
        .unwrap()
        .fsck(&cairn_store::FsckOptions::default())
        .unwrap();
    assert!(fsck.problems.is_empty(), "{:?}", fsck.problems);
}
