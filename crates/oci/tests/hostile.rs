//! A registry that lies, breaks or hangs: one row per misbehaviour, each
//! asserting the error message and that the store is as it was (nothing new
//! under objects/, images/, layers/ or refs/; nothing left in tmp/ once the
//! store is opened again), and that a good image then pulls into it. The
//! registry is an in-test HTTP server on 127.0.0.1 ([`common::fake`]).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_oci::{ImageRef, PullOptions};
use common::fake::{FakeServer, Reply, Request};
use common::{store_snapshot, test_pull_options, tmp_after_reopen, FakeImage};

/// How a row's server misbehaves: given the image, the request and how many
/// requests it has seen, `Some(reply)` overrides the well-behaved answer.
type Hook = Arc<dyn Fn(&FakeImage, &Request, usize) -> Option<Reply> + Send + Sync>;

struct Case {
    name: &'static str,
    image: FakeImage,
    hook: Hook,
    /// The reference pulled; `{addr}` is replaced.
    reference: String,
    /// Substrings of the error; `{addr}`, `{layer0}`, `{layer1}`,
    /// `{config}`, `{manifest}` are replaced.
    expect: Vec<&'static str>,
}

fn case(
    name: &'static str,
    image: FakeImage,
    reference: &str,
    expect: &[&'static str],
    hook: impl Fn(&FakeImage, &Request, usize) -> Option<Reply> + Send + Sync + 'static,
) -> Case {
    Case {
        name,
        image,
        hook: Arc::new(hook),
        reference: reference.to_string(),
        expect: expect.to_vec(),
    }
}

fn is_blob(req: &Request, digest: &str) -> bool {
    req.path.ends_with(&format!("/blobs/{digest}"))
}

fn is_manifest(req: &Request) -> bool {
    req.path.contains("/manifests/")
}

fn cases() -> Vec<Case> {
    let img = FakeImage::new();
    let tag_ref = "{addr}/img:v1";
    let mut rows = vec![
        case(
            "gzip blob with one byte changed",
            img.clone(),
            tag_ref,
            &["layer {layer0}: "],
            |img, req, _| {
                is_blob(req, &img.layers[0].0).then(|| {
                    let mut bad = img.layers[0].1.clone();
                    let at = bad.len() / 2;
                    bad[at] ^= 0xff;
                    Reply::ok("application/octet-stream", bad)
                })
            },
        ),
        case(
            "tar blob with one byte of a file changed",
            FakeImage::with_compression(false),
            tag_ref,
            &["layer {layer0}: blob digest mismatch: expected {layer0}, got sha256:"],
            |img, req, _| {
                is_blob(req, &img.layers[0].0).then(|| {
                    let mut bad = img.layers[0].1.clone();
                    // Inside data.bin's contents: the tar stays valid.
                    bad[4096] ^= 0xff;
                    Reply::ok("application/octet-stream", bad)
                })
            },
        ),
        case(
            "truncated blob, every time",
            img.clone(),
            tag_ref,
            &["blob {layer0}: connection closed", "gave up after 3 attempts"],
            |img, req, _| {
                is_blob(req, &img.layers[0].0).then(|| {
                    let b = &img.layers[0].1;
                    Reply::Short(200, vec![], b[..b.len() / 2].to_vec(), b.len() as u64)
                })
            },
        ),
        case(
            "blob longer than its descriptor",
            img.clone(),
            tag_ref,
            &["blob {layer0}: size mismatch"],
            |img, req, _| {
                is_blob(req, &img.layers[0].0).then(|| {
                    let mut b = img.layers[0].1.clone();
                    b.extend_from_slice(b"trailing junk");
                    Reply::ok("application/octet-stream", b)
                })
            },
        ),
        case("blob unknown", img.clone(), tag_ref, &["blob unknown: {layer0} in {addr}/img"], |img, req, _| {
            is_blob(req, &img.layers[0].0).then(|| Reply::error(404, "BLOB_UNKNOWN", "blob unknown to registry"))
        }),
        case(
            "blob stalls mid-transfer",
            img.clone(),
            tag_ref,
            &["blob {layer0}: no data from registry {addr} for 1 s (gave up after 3 attempts)"],
            |img, req, _| {
                is_blob(req, &img.layers[0].0).then(|| {
                    let b = &img.layers[0].1;
                    Reply::StallAfter(vec![], b[..1000].to_vec(), b.len() as u64, Duration::from_secs(5))
                })
            },
        ),
        case(
            "manifest hangs",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img:v1: no data from registry {addr} for 1 s (gave up after 3 attempts)"],
            |_, req, _| is_manifest(req).then(|| Reply::Hang(Duration::from_secs(5))),
        ),
        case(
            "manifest digest differs from Docker-Content-Digest",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img:v1 (Docker-Content-Digest): digest mismatch: expected sha256:00000000", "got {manifest}"],
            |img, req, _| {
                is_manifest(req).then(|| {
                    Reply::ok(common::OCI_MANIFEST, img.manifest.clone())
                        .with_header("Docker-Content-Digest", &format!("sha256:{}", "0".repeat(64)))
                })
            },
        ),
        case(
            "pinned manifest digest mismatch",
            img.clone(),
            &format!("{{addr}}/img@sha256:{}", "1".repeat(64)),
            &["manifest {addr}/img@sha256:1111", "digest mismatch: expected sha256:1111", "got {manifest}"],
            |img, req, _| is_manifest(req).then(|| Reply::ok(common::OCI_MANIFEST, img.manifest.clone())),
        ),
        case(
            "oversized manifest",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img:v1 is too large: 5242880 bytes (limit 4194304)"],
            |_, req, _| is_manifest(req).then(|| Reply::ok(common::OCI_MANIFEST, vec![b' '; 5 << 20])),
        ),
        case(
            "oversized manifest without Content-Length",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img:v1 is too large: more than 4194304 bytes (limit 4194304)"],
            |_, req, _| {
                // No Content-Length to check first: the body decides.
                is_manifest(req).then(|| {
                    Reply::Unsized(
                        200,
                        vec![("Content-Type".into(), common::OCI_MANIFEST.into())],
                        vec![b' '; 5 << 20],
                    )
                })
            },
        ),
        case(
            "unknown manifest media type",
            {
                let mut i = img.clone();
                i.rebuild_manifest(|m| m["mediaType"] = "application/vnd.example.thing.v1+json".into());
                i
            },
            tag_ref,
            &["manifest {addr}/img:v1: unsupported media type \"application/vnd.example.thing.v1+json\""],
            |img, req, _| is_manifest(req).then(|| Reply::ok("application/vnd.example.thing.v1+json", img.manifest.clone())),
        ),
        case(
            "docker schema 1 manifest",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img:v1: Docker schema 1 manifests are not supported"],
            |_, req, _| {
                is_manifest(req).then(|| {
                    Reply::ok(
                        "application/vnd.docker.distribution.manifest.v1+prettyjws",
                        br#"{"schemaVersion":1,"name":"img","tag":"v1","fsLayers":[]}"#.to_vec(),
                    )
                })
            },
        ),
        case(
            "unknown layer media type",
            {
                let mut i = img.clone();
                i.rebuild_manifest(|m| m["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+bzip2".into());
                i
            },
            tag_ref,
            &["layer {layer0} of {addr}/img:v1: unsupported media type \"application/vnd.oci.image.layer.v1.tar+bzip2\""],
            |_, _, _| None,
        ),
        case(
            "not an image (artifact config)",
            {
                let mut i = img.clone();
                i.rebuild_manifest(|m| m["config"]["mediaType"] = "application/vnd.cncf.helm.config.v1+json".into());
                i
            },
            tag_ref,
            &["config of {addr}/img:v1: unsupported media type \"application/vnd.cncf.helm.config.v1+json\" (not a container image"],
            |_, _, _| None,
        ),
        case(
            "config with wrong bytes",
            img.clone(),
            tag_ref,
            &["config {config} of {addr}/img:v1: digest mismatch: expected {config}"],
            |img, req, _| {
                is_blob(req, &img.config_digest).then(|| {
                    let bad = String::from_utf8(img.config.clone()).unwrap().replace("linux", "linuy");
                    Reply::ok("application/octet-stream", bad.into_bytes())
                })
            },
        ),
        case(
            "config diff_ids disagree with the layers",
            {
                let mut i = img.clone();
                let mut c: serde_json::Value = serde_json::from_slice(&i.config).unwrap();
                c["rootfs"]["diff_ids"].as_array_mut().unwrap().pop();
                i.config = serde_json::to_vec(&c).unwrap();
                i.config_digest = common::registry::sha256(&i.config);
                i.rebuild_manifest(|_| {});
                i
            },
            tag_ref,
            &["rootfs.diff_ids has 1 entries but the manifest has 2 layers"],
            |_, _, _| None,
        ),
        case(
            "config too large (by its descriptor)",
            {
                let mut i = img.clone();
                i.rebuild_manifest(|m| m["config"]["size"] = (100u64 << 20).into());
                i
            },
            tag_ref,
            &["config {config} of {addr}/img:v1 is too large: 104857600 bytes (limit 16777216)"],
            |_, _, _| None,
        ),
        case(
            "401 with basic challenge, no credentials",
            img.clone(),
            tag_ref,
            &["authentication failed for {addr}/img (401: UNAUTHORIZED: authentication required; basic auth required; tried anonymously: no credentials found)"],
            |_, _, _| {
                Some(
                    Reply::error(401, "UNAUTHORIZED", "authentication required")
                        .with_header("WWW-Authenticate", "Basic realm=\"fake\""),
                )
            },
        ),
        case(
            "403 denied",
            img.clone(),
            tag_ref,
            &["authentication failed for {addr}/img (403: DENIED: requested access to the resource is denied"],
            |_, _, _| Some(Reply::error(403, "DENIED", "requested access to the resource is denied")),
        ),
        case("404 tag", img.clone(), "{addr}/img:nosuchtag", &["manifest unknown: {addr}/img:nosuchtag"], |_, _, _| None),
        case(
            "404 repository",
            img.clone(),
            "{addr}/other:v1",
            &["manifest unknown: {addr}/other:v1 (repository {addr}/other is not known to the registry)"],
            |_, _, _| None,
        ),
        case(
            "503 on every attempt",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img:v1: registry {addr} answered 503 (UNAVAILABLE: try later) (gave up after 3 attempts)"],
            |_, _, _| Some(Reply::error(503, "UNAVAILABLE", "try later")),
        ),
        case(
            "blob redirects forever",
            img.clone(),
            tag_ref,
            &["blob {layer0}: registry {addr} answered 307 (more than 5 redirects)"],
            |img, req, _| {
                is_blob(req, &img.layers[0].0)
                    .then(|| Reply::Full(307, vec![("Location".into(), req.path.clone())], vec![]))
            },
        ),
    ];

    // An index whose entries are all for other platforms.
    let index_other = index_of(&img, &[("linux", "s390x"), ("linux", "ppc64le")]);
    rows.push(case(
        "index without the wanted platform",
        img.clone(),
        tag_ref,
        &[
            "no image for platform linux/",
            "in {addr}/img:v1 (available: linux/s390x, linux/ppc64le)",
        ],
        move |_, req, _| {
            (is_manifest(req) && req.path.ends_with("/v1"))
                .then(|| Reply::ok(common::OCI_INDEX, index_other.clone()))
        },
    ));
    // An index entry whose manifest bytes do not have the entry's digest.
    let host = cairn_oci::PlatformSpec::host();
    let index_host = index_of(
        &img,
        &[("linux", Box::leak(host.architecture.into_boxed_str()))],
    );
    rows.push(case(
        "index entry with the wrong manifest bytes",
        img.clone(),
        tag_ref,
        &[
            "manifest {addr}/img:v1 for linux/",
            "digest mismatch: expected {manifest}",
        ],
        move |img, req, _| {
            if !is_manifest(req) {
                return None;
            }
            if req.path.ends_with("/v1") {
                return Some(Reply::ok(common::OCI_INDEX, index_host.clone()));
            }
            // Same length, other bytes: one hex digit of the config digest.
            let text = String::from_utf8(img.manifest.clone()).unwrap();
            let last = img.config_digest.chars().last().unwrap();
            let other = if last == '0' { '1' } else { '0' };
            let changed =
                img.config_digest[..img.config_digest.len() - 1].to_string() + &other.to_string();
            Some(Reply::ok(
                common::OCI_MANIFEST,
                text.replace(&img.config_digest, &changed).into_bytes(),
            ))
        },
    ));
    rows.extend(descriptor_cases(&img));
    rows
}

/// The host's architecture, as index entries spell it.
fn host_arch() -> &'static str {
    Box::leak(
        cairn_oci::PlatformSpec::host()
            .architecture
            .into_boxed_str(),
    )
}

/// An index with one entry for the host naming the image's manifest,
/// `edit`ed.
fn index_with(img: &FakeImage, edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let mut index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": common::OCI_INDEX,
        "manifests": [{
            "mediaType": common::OCI_MANIFEST,
            "digest": img.manifest_digest,
            "size": img.manifest.len(),
            "platform": {"os": "linux", "architecture": host_arch()},
        }],
    });
    edit(&mut index);
    serde_json::to_vec(&index).unwrap()
}

/// The tag serves `index`; everything else is as the image has it.
fn serving_index(
    index: Vec<u8>,
) -> impl Fn(&FakeImage, &Request, usize) -> Option<Reply> + Send + Sync + 'static {
    move |_, req, _| {
        (is_manifest(req) && req.path.ends_with("/v1"))
            .then(|| Reply::ok(common::OCI_INDEX, index.clone()))
    }
}

fn with_manifest(img: &FakeImage, edit: impl FnOnce(&mut serde_json::Value)) -> FakeImage {
    let mut i = img.clone();
    i.rebuild_manifest(edit);
    i
}

fn add_to_size(d: &mut serde_json::Value, n: i64) {
    d["size"] = (d["size"].as_i64().unwrap() + n).into();
}

/// Descriptors enforced (issue 11): size and digest of every blob, digests
/// parsed by the spec's grammar before a URL is made from them, media
/// types that contradict the content.
fn descriptor_cases(img: &FakeImage) -> Vec<Case> {
    let tag_ref = "{addr}/img:v1";
    let upper = |d: &str| format!("sha256:{}", d[7..].to_uppercase());
    let mut rows = vec![
        case(
            "index entry says 100 bytes more than the manifest",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img@{manifest} (linux/", " in the index of {addr}/img:v1): size mismatch: the descriptor says"],
            serving_index(index_with(img, |i| add_to_size(&mut i["manifests"][0], 100))),
        ),
        case(
            "index entry says 1 byte less, no Content-Length",
            img.clone(),
            tag_ref,
            &["manifest {addr}/img@{manifest} (linux/", "size mismatch", "the blob is longer"],
            {
                let index = index_with(img, |i| add_to_size(&mut i["manifests"][0], -1));
                move |img, req, _| {
                    if !is_manifest(req) {
                        return None;
                    }
                    Some(if req.path.ends_with("/v1") {
                        Reply::ok(common::OCI_INDEX, index.clone())
                    } else {
                        Reply::Unsized(200, vec![], img.manifest.clone())
                    })
                }
            },
        ),
        case(
            "layer size +1",
            with_manifest(img, |m| add_to_size(&mut m["layers"][0], 1)),
            tag_ref,
            &["blob {layer0}: size mismatch: the descriptor says"],
            |_, _, _| None,
        ),
        case(
            "layer size -1",
            with_manifest(img, |m| add_to_size(&mut m["layers"][0], -1)),
            tag_ref,
            &["blob {layer0}: size mismatch: the descriptor says"],
            |_, _, _| None,
        ),
        case(
            "layer longer than its descriptor, no Content-Length",
            img.clone(),
            tag_ref,
            &["blob {layer0}: size mismatch: the descriptor says", "bytes, the blob is longer"],
            |img, req, _| {
                is_blob(req, &img.layers[0].0).then(|| {
                    let mut b = img.layers[0].1.clone();
                    b.push(0);
                    Reply::Unsized(200, vec![], b)
                })
            },
        ),
        case(
            "config size +1",
            with_manifest(img, |m| add_to_size(&mut m["config"], 1)),
            tag_ref,
            &["config {config} of {addr}/img:v1: size mismatch: the descriptor says"],
            |_, _, _| None,
        ),
        case(
            "config size -1",
            with_manifest(img, |m| add_to_size(&mut m["config"], -1)),
            tag_ref,
            &["config {config} of {addr}/img:v1: size mismatch: the descriptor says"],
            |_, _, _| None,
        ),
        case(
            "config longer than its descriptor, no Content-Length",
            img.clone(),
            tag_ref,
            &["config {config} of {addr}/img:v1: size mismatch", "the blob is longer"],
            |img, req, _| {
                is_blob(req, &img.config_digest).then(|| {
                    let mut c = img.config.clone();
                    c.push(b' ');
                    Reply::Unsized(200, vec![], c)
                })
            },
        ),
        case(
            "index bytes differ from the pinned digest",
            img.clone(),
            "{addr}/img@{manifest}",
            &["manifest {addr}/img@{manifest}: digest mismatch: expected {manifest}"],
            {
                let index = index_with(img, |_| {});
                move |_, req, _| is_manifest(req).then(|| Reply::ok(common::OCI_INDEX, index.clone()))
            },
        ),
        case(
            "upper-case hex layer digest",
            with_manifest(img, |m| m["layers"][0]["digest"] = upper(m["layers"][0]["digest"].as_str().unwrap()).into()),
            tag_ref,
            &["invalid layer 1 of {addr}/img:v1: descriptor digest: \"sha256:", "a sha256 digest is 64 lower-case hex digits"],
            |_, _, _| None,
        ),
        case(
            "upper-case hex index entry",
            img.clone(),
            tag_ref,
            &["descriptor digest:", "64 lower-case hex digits"],
            serving_index(index_with(img, |i| {
                i["manifests"][0]["digest"] = upper(i["manifests"][0]["digest"].as_str().unwrap()).into()
            })),
        ),
        case(
            "unknown digest algorithm (config)",
            with_manifest(img, |m| m["config"]["digest"] = "md5:d41d8cd98f00b204e9800998ecf8427e".into()),
            tag_ref,
            &["config of {addr}/img:v1: descriptor digest:", "unregistered digest algorithm \"md5\""],
            |_, _, _| None,
        ),
        case(
            "sha512 layer digest",
            with_manifest(img, |m| m["layers"][0]["digest"] = format!("sha512:{}", "ab".repeat(64)).into()),
            tag_ref,
            &["layer 1 of {addr}/img:v1", "sha512 digests are not supported (cairn verifies sha256 only)"],
            |_, _, _| None,
        ),
        case(
            "path characters in a layer digest",
            with_manifest(img, |m| m["layers"][0]["digest"] = "sha256:../../x".into()),
            tag_ref,
            &["\"sha256:../../x\" is not a digest"],
            // Never asked for: no URL is made from it.
            |_, req, _| req.path.contains("..").then(|| Reply::error(500, "PATH", "a path was made from an unparsed digest")),
        ),
        case(
            "path characters in an index entry",
            img.clone(),
            tag_ref,
            &["\"sha256:../../x\" is not a digest"],
            serving_index(index_with(img, |i| i["manifests"][0]["digest"] = "sha256:../../x".into())),
        ),
        case(
            "manifest mediaType contradicts the index entry",
            with_manifest(img, |m| m["mediaType"] = "application/vnd.docker.distribution.manifest.v2+json".into()),
            tag_ref,
            &[
                "manifest {addr}/img:v1 for linux/",
                "media type mismatch: the descriptor says \"application/vnd.oci.image.manifest.v1+json\", the content says \"application/vnd.docker.distribution.manifest.v2+json\"",
            ],
            // The index is made from the changed manifest below.
            |_, _, _| None,
        ),
        case(
            "index entry names a layer type",
            img.clone(),
            tag_ref,
            &["unsupported media type \"application/vnd.oci.image.layer.v1.tar+gzip\""],
            serving_index(index_with(img, |i| {
                i["manifests"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip".into()
            })),
        ),
        case(
            "layer media type gzip, bytes a plain tar",
            {
                let mut i = FakeImage::with_compression(false);
                i.layer_media_type = "application/vnd.oci.image.layer.v1.tar+gzip";
                i.rebuild_manifest(|_| {});
                i
            },
            tag_ref,
            &["layer {layer0}: the media type says gzip but the blob does not start with gzip magic bytes"],
            |_, _, _| None,
        ),
        case(
            "layer media type tar, bytes gzip",
            {
                let mut i = FakeImage::new();
                i.layer_media_type = "application/vnd.oci.image.layer.v1.tar";
                i.rebuild_manifest(|_| {});
                i
            },
            tag_ref,
            &["layer {layer0}: the media type says an uncompressed tar but the blob starts with gzip magic bytes"],
            |_, _, _| None,
        ),
    ];
    // The index naming the manifest whose mediaType contradicts it.
    let row = rows
        .iter_mut()
        .find(|r| r.name == "manifest mediaType contradicts the index entry")
        .unwrap();
    row.hook = Arc::new(serving_index(index_with(&row.image, |_| {})));
    rows
}

/// An index naming the image's manifest once per `(os, arch)`.
fn index_of(img: &FakeImage, platforms: &[(&str, &str)]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": common::OCI_INDEX,
        "manifests": platforms.iter().map(|(os, arch)| serde_json::json!({
            "mediaType": common::OCI_MANIFEST,
            "digest": img.manifest_digest,
            "size": img.manifest.len(),
            "platform": {"os": os, "architecture": arch},
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn serve_with(img: FakeImage, hook: Hook) -> FakeServer {
    let n = Arc::new(AtomicUsize::new(0));
    FakeServer::start(move |req| {
        let i = n.fetch_add(1, Ordering::Relaxed);
        hook(&img, req, i).unwrap_or_else(|| img.serve(req))
    })
}

#[test]
fn hostile_registry_table() {
    let rows = cases();
    assert!(rows.len() >= 20);
    let mut failures = Vec::new();
    for row in rows {
        let server = serve_with(row.image.clone(), Arc::clone(&row.hook));
        let fill = |s: &str| {
            s.replace("{addr}", &server.addr)
                .replace("{layer0}", &row.image.layers[0].0)
                .replace("{layer1}", &row.image.layers[1].0)
                .replace("{config}", &row.image.config_digest)
                .replace("{manifest}", &row.image.manifest_digest)
        };
        let dir = tempfile::tempdir().unwrap();
        let store = cairn_store::Store::open(dir.path()).unwrap();
        let before = store_snapshot(dir.path());
        let reference = ImageRef::parse(&fill(&row.reference)).unwrap();
        // One layer at a time and every bad blob is the first layer, so a
        // failure stops the pull before anything else is imported (that a
        // good layer fetched alongside a bad one stays is tested below).
        let opts = PullOptions {
            name: Some("hostile".into()),
            jobs: 1,
            ..test_pull_options()
        };
        let started = Instant::now();
        let result = cairn_oci::pull(&store, &reference, &opts, &|_: &cairn_oci::PullEvent<
            '_,
        >| {});
        drop(store);
        let elapsed = started.elapsed();
        let err = match result {
            Ok(r) => {
                failures.push(format!("{}: pull succeeded: {r:?}", row.name));
                continue;
            }
            Err(e) => e.to_string(),
        };
        for want in &row.expect {
            let want = fill(want);
            if !err.contains(&want) {
                failures.push(format!("{}: error {err:?} lacks {want:?}", row.name));
            }
        }
        let after = store_snapshot(dir.path());
        if after != before {
            failures.push(format!(
                "{}: store changed: {before:?} -> {after:?}",
                row.name
            ));
        }
        let tmp = tmp_after_reopen(dir.path());
        if !tmp.is_empty() {
            failures.push(format!(
                "{}: tmp/ not clean after reopening: {tmp:?}",
                row.name
            ));
        }
        // Bounded: the slowest rows wait out 3 read timeouts of 1 s.
        if elapsed > Duration::from_secs(10) {
            failures.push(format!("{}: took {elapsed:?}", row.name));
        }
        // A good image pulls into the same store afterwards.
        let good = FakeImage::new();
        let good_server = serve_with(good.clone(), Arc::new(|_, _, _| None));
        let store = cairn_store::Store::open(dir.path()).unwrap();
        let good_ref = ImageRef::parse(&good.reference(&good_server.addr)).unwrap();
        if let Err(e) =
            cairn_oci::pull(&store, &good_ref, &opts, &|_: &cairn_oci::PullEvent<'_>| {})
        {
            failures.push(format!("{}: the good image after it: {e}", row.name));
        }
        eprintln!("ok: {}: {err}", row.name);
    }
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn unreachable_registry_fails_fast() {
    let port = common::registry::free_port();
    let r = ImageRef::parse(&format!("127.0.0.1:{port}/foo:bar")).unwrap();
    let reg = cairn_oci::Registry::new(&r, &common::test_client());
    let started = Instant::now();
    let err = cairn_oci::resolve(&reg, &r, None).unwrap_err().to_string();
    assert_eq!(
        err,
        format!("cannot reach registry 127.0.0.1:{port}: connection refused")
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "no retries before the registry ever answered"
    );
}

#[test]
fn transient_errors_are_retried_then_succeed() {
    let img = FakeImage::new();
    // 500 on the first manifest request, 429 (Retry-After: 0) on the first
    // config request; then all is well.
    let seen_manifest = Arc::new(AtomicUsize::new(0));
    let seen_config = Arc::new(AtomicUsize::new(0));
    let (m, c) = (Arc::clone(&seen_manifest), Arc::clone(&seen_config));
    let server = serve_with(
        img.clone(),
        Arc::new(move |img, req, _| {
            if is_manifest(req) && m.fetch_add(1, Ordering::Relaxed) == 0 {
                return Some(Reply::error(500, "INTERNAL", "boom"));
            }
            if is_blob(req, &img.config_digest) && c.fetch_add(1, Ordering::Relaxed) == 0 {
                return Some(
                    Reply::error(429, "TOOMANYREQUESTS", "slow down")
                        .with_header("Retry-After", "0"),
                );
            }
            None
        }),
    );
    let r = ImageRef::parse(&img.reference(&server.addr)).unwrap();
    let reg = cairn_oci::Registry::new(&r, &common::test_client());
    let resolved = cairn_oci::resolve(&reg, &r, None).unwrap();
    assert_eq!(resolved.manifest_digest.as_str(), img.manifest_digest);
    assert_eq!(seen_manifest.load(Ordering::Relaxed), 2);
    assert_eq!(seen_config.load(Ordering::Relaxed), 2);
}

/// Reads a blob through a [`cairn_oci::client::BlobReader`] and returns it
/// with the requests the server saw.
fn read_blob(img: &FakeImage, hook: Hook, which: usize) -> (Result<Vec<u8>, String>, Vec<Request>) {
    let server = serve_with(img.clone(), hook);
    let r = ImageRef::parse(&img.reference(&server.addr)).unwrap();
    let reg = cairn_oci::Registry::new(&r, &common::test_client());
    let d = cairn_oci::Digest::parse(&img.layers[which].0).unwrap();
    let mut reader = reg.blob_reader(
        "img",
        &d,
        img.layers[which].1.len() as u64,
        None,
        Box::new(|_| {}),
    );
    let mut out = Vec::new();
    let res = std::io::Read::read_to_end(&mut reader, &mut out)
        .map(|_| out)
        .map_err(|e| e.to_string());
    (res, server.requests())
}

#[test]
fn broken_blob_transfer_resumes_with_range() {
    let img = FakeImage::new();
    let blob = img.layers[0].1.clone();
    let half = blob.len() / 2;
    let first = Arc::new(AtomicUsize::new(0));
    let f = Arc::clone(&first);
    let (got, reqs) = read_blob(
        &img,
        Arc::new(move |img, req, _| {
            (is_blob(req, &img.layers[0].0) && f.fetch_add(1, Ordering::Relaxed) == 0).then(|| {
                let b = &img.layers[0].1;
                Reply::Short(200, vec![], b[..half].to_vec(), b.len() as u64)
            })
        }),
        0,
    );
    assert_eq!(got.unwrap(), blob);
    let ranges: Vec<_> = reqs
        .iter()
        .filter_map(|r| r.header("Range").map(str::to_string))
        .collect();
    assert_eq!(ranges, vec![format!("bytes={half}-")]);
}

#[test]
fn broken_blob_transfer_restarts_without_range_support() {
    let img = FakeImage::new();
    let blob = img.layers[0].1.clone();
    let first = Arc::new(AtomicUsize::new(0));
    let f = Arc::clone(&first);
    let (got, reqs) = read_blob(
        &img,
        Arc::new(move |img, req, _| {
            if !is_blob(req, &img.layers[0].0) {
                return None;
            }
            let b = &img.layers[0].1;
            Some(if f.fetch_add(1, Ordering::Relaxed) == 0 {
                Reply::Short(200, vec![], b[..b.len() / 3].to_vec(), b.len() as u64)
            } else {
                // Ignores Range: the whole blob again.
                Reply::ok("application/octet-stream", b.clone())
            })
        }),
        0,
    );
    assert_eq!(got.unwrap(), blob);
    assert_eq!(
        reqs.iter().filter(|r| is_blob(r, &img.layers[0].0)).count(),
        2
    );
}

#[test]
fn blob_redirect_to_another_origin_drops_authorization() {
    let img = FakeImage::new();
    // The "CDN": serves the blob, records what it was sent.
    let cdn_img = img.clone();
    let cdn = FakeServer::start(move |req| {
        let d = req.path.trim_start_matches("/cdn/");
        match cdn_img.blob(d) {
            Some(b) => Reply::ok("application/octet-stream", b.to_vec()),
            None => Reply::status(404, ""),
        }
    });
    let cdn_addr = cdn.addr.clone();
    // The registry wants basic auth and redirects blobs to the CDN.
    let registry = serve_with(
        img.clone(),
        Arc::new(move |img, req, _| {
            if req.header("Authorization").is_none() {
                return Some(
                    Reply::error(401, "UNAUTHORIZED", "auth")
                        .with_header("WWW-Authenticate", "Basic realm=x"),
                );
            }
            is_blob(req, &img.layers[1].0).then(|| {
                Reply::Full(
                    307,
                    vec![(
                        "Location".into(),
                        format!("http://{cdn_addr}/cdn/{}", img.layers[1].0),
                    )],
                    vec![],
                )
            })
        }),
    );
    let r = ImageRef::parse(&img.reference(&registry.addr)).unwrap();
    let opts = cairn_oci::ClientOptions {
        credentials: Some(cairn_oci::auth::Credentials {
            username: "u".into(),
            password: "p".into(),
            source: None,
        }),
        ..common::test_client()
    };
    let reg = cairn_oci::Registry::new(&r, &opts);
    cairn_oci::resolve(&reg, &r, None).unwrap();
    let d = cairn_oci::Digest::parse(&img.layers[1].0).unwrap();
    let mut reader = reg.blob_reader(
        "img",
        &d,
        img.layers[1].1.len() as u64,
        None,
        Box::new(|_| {}),
    );
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut reader, &mut out).unwrap();
    assert_eq!(out, img.layers[1].1);
    let cdn_reqs = cdn.requests();
    assert_eq!(cdn_reqs.len(), 1);
    assert!(
        cdn_reqs[0].header("Authorization").is_none(),
        "credentials leaked to another origin"
    );
}

/// A registry that wants bearer tokens from its own `/token` endpoint,
/// optionally only for `user:pass`.
fn bearer_server(
    img: FakeImage,
    creds: Option<(&'static str, &'static str)>,
) -> (FakeServer, Arc<AtomicUsize>) {
    let tokens = Arc::new(AtomicUsize::new(0));
    let t = Arc::clone(&tokens);
    let addr_slot: Arc<std::sync::OnceLock<String>> = Arc::new(std::sync::OnceLock::new());
    let a = Arc::clone(&addr_slot);
    let server = FakeServer::start(move |req| {
        use base64::Engine as _;
        if req.path.starts_with("/token?") {
            t.fetch_add(1, Ordering::Relaxed);
            assert!(
                req.path.contains("scope=repository%3Aimg%3Apull"),
                "{}",
                req.path
            );
            assert!(req.path.contains("service=fake-registry"), "{}", req.path);
            if let Some((u, p)) = creds {
                let want = format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
                );
                if req.header("Authorization") != Some(want.as_str()) {
                    return Reply::status(401, r#"{"details":"incorrect username or password"}"#);
                }
            }
            return Reply::ok(
                "application/json",
                br#"{"token":"tok-123","expires_in":300}"#.to_vec(),
            );
        }
        if req.header("Authorization") != Some("Bearer tok-123") {
            let realm = format!("http://{}/token", a.get().unwrap());
            return Reply::error(401, "UNAUTHORIZED", "authentication required").with_header(
                "WWW-Authenticate",
                &format!(
                    r#"Bearer realm="{realm}",service="fake-registry",scope="repository:img:pull""#
                ),
            );
        }
        img.serve(req)
    });
    addr_slot.set(server.addr.clone()).unwrap();
    (server, tokens)
}

#[test]
fn bearer_token_handshake_anonymous() {
    let img = FakeImage::new();
    let (server, tokens) = bearer_server(img.clone(), None);
    let r = ImageRef::parse(&img.reference(&server.addr)).unwrap();
    let reg = cairn_oci::Registry::new(&r, &common::test_client());
    let resolved = cairn_oci::resolve(&reg, &r, None).unwrap();
    assert_eq!(resolved.config_digest.as_str(), img.config_digest);
    // One token, reused for the config fetch.
    assert_eq!(tokens.load(Ordering::Relaxed), 1);
}

#[test]
fn bearer_token_with_credentials_from_auth_file() {
    use base64::Engine as _;
    let img = FakeImage::new();
    let (server, tokens) = bearer_server(img.clone(), Some(("alice", "s3cret")));
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.json");
    let write = |pass: &str| {
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("alice:{pass}"));
        std::fs::write(
            &auth,
            format!(r#"{{"auths":{{"{}":{{"auth":"{b64}"}}}}}}"#, server.addr),
        )
        .unwrap();
    };
    let r = ImageRef::parse(&img.reference(&server.addr)).unwrap();
    let opts = cairn_oci::ClientOptions {
        auth_files: vec![dir.path().join("missing.json"), auth.clone()],
        ..common::test_client()
    };

    write("s3cret");
    let reg = cairn_oci::Registry::new(&r, &opts);
    cairn_oci::resolve(&reg, &r, None).unwrap();
    assert_eq!(tokens.load(Ordering::Relaxed), 1);

    write("wrong");
    let reg = cairn_oci::Registry::new(&r, &opts);
    let err = cairn_oci::resolve(&reg, &r, None).unwrap_err().to_string();
    let want = [
        format!("authentication failed for {}/img (401: ", server.addr),
        format!(
            "token endpoint http://{}/token refused; tried as \"alice\" with credentials from {})",
            server.addr,
            auth.display()
        ),
    ];
    for w in want {
        assert!(err.contains(&w), "{err}\nwanted: {w}");
    }
}

/// A pull of `img` from `server`, named `name`, two layers at a time, into
/// a new store: its directory, the reference and options used, and the
/// result (the store is closed again).
fn pull_into_new_store(
    img: &FakeImage,
    server: &FakeServer,
    name: &str,
) -> (
    tempfile::TempDir,
    ImageRef,
    PullOptions,
    Result<cairn_oci::PullReport, cairn_oci::PullError>,
) {
    let dir = tempfile::tempdir().unwrap();
    let r = ImageRef::parse(&img.reference(&server.addr)).unwrap();
    let opts = PullOptions {
        name: Some(name.into()),
        jobs: 2,
        ..test_pull_options()
    };
    let store = cairn_store::Store::open(dir.path()).unwrap();
    let pulled = cairn_oci::pull(&store, &r, &opts, &|_: &cairn_oci::PullEvent<'_>| {});
    (dir, r, opts, pulled)
}

#[test]
fn failed_pull_keeps_only_verified_layers_and_retry_reuses_them() {
    let img = FakeImage::new();
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let b = Arc::clone(&broken);
    let server = serve_with(
        img.clone(),
        Arc::new(move |img, req, _| {
            (b.load(Ordering::Relaxed) && is_blob(req, &img.layers[0].0)).then(|| {
                let blob = &img.layers[0].1;
                Reply::Short(
                    200,
                    vec![],
                    blob[..blob.len() / 2].to_vec(),
                    blob.len() as u64,
                )
            })
        }),
    );
    let (dir, r, opts, pulled) = pull_into_new_store(&img, &server, "partial");
    let err = pulled.unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("blob {}", img.layers[0].0)),
        "{err}"
    );
    // Nothing but (possibly) the good layer, verified, became visible.
    for p in store_snapshot(dir.path()) {
        let top = p
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .into_owned();
        assert!(
            top != "images" && top != "refs",
            "{p:?} appeared after a failed pull"
        );
        if top == "layers" {
            assert!(
                p.to_string_lossy().contains(&img.layers[1].2),
                "{p:?} is not the good layer"
            );
        }
    }
    assert!(tmp_after_reopen(dir.path()).is_empty());
    let good_layer_kept = cairn_image::has_layer(
        &cairn_store::Store::open(dir.path()).unwrap(),
        &img.layers[1].2,
    );

    // The registry is well again: the retry succeeds and fetches only what
    // the first attempt did not finish.
    broken.store(false, Ordering::Relaxed);
    let before = server.count(|q| is_blob(q, &img.layers[1].0));
    let store = cairn_store::Store::open(dir.path()).unwrap();
    let report = cairn_oci::pull(&store, &r, &opts, &|_: &cairn_oci::PullEvent<'_>| {}).unwrap();
    assert!(report.layers[0].fetched);
    assert_eq!(report.layers[1].fetched, !good_layer_kept);
    let refetched = server.count(|q| is_blob(q, &img.layers[1].0)) - before;
    assert_eq!(refetched, usize::from(!good_layer_kept));
    let found = store.resolve_image("partial").unwrap();
    assert_eq!(found.digest.as_deref(), Some(report.image_digest.as_str()));
}

#[test]
fn full_pull_with_bearer_auth_then_all_cached() {
    let img = FakeImage::new();
    let (server, tokens) = bearer_server(img.clone(), None);
    let dir = tempfile::tempdir().unwrap();
    let store = cairn_store::Store::open(dir.path()).unwrap();
    let r = ImageRef::parse(&img.reference(&server.addr)).unwrap();
    let events = std::sync::Mutex::new(Vec::new());
    let observer = |e: &cairn_oci::PullEvent<'_>| {
        let tag = match e {
            cairn_oci::PullEvent::Resolved(_) => "resolved".to_string(),
            cairn_oci::PullEvent::LayerStart { index, .. } => format!("start {index}"),
            cairn_oci::PullEvent::LayerDone { index, .. } => format!("done {index}"),
            cairn_oci::PullEvent::LayerCached { index, .. } => format!("cached {index}"),
            cairn_oci::PullEvent::Assembling => "assembling".to_string(),
            _ => return,
        };
        events.lock().unwrap().push(tag);
    };
    let report = cairn_oci::pull(&store, &r, &test_pull_options(), &observer).unwrap();
    assert_eq!(report.manifest_digest, img.manifest_digest);
    assert_eq!(report.config_digest, img.config_digest);
    assert_eq!(
        report.bytes_fetched,
        img.layers.iter().map(|l| l.1.len() as u64).sum::<u64>()
    );
    assert!(store.has_image(&report.image_digest));
    // One token for the whole pull, layers fetched concurrently included.
    assert_eq!(tokens.load(Ordering::Relaxed), 1);
    let mut ev = events.lock().unwrap().clone();
    ev.sort();
    assert_eq!(
        ev,
        [
            "assembling",
            "done 0",
            "done 1",
            "resolved",
            "start 0",
            "start 1"
        ]
    );

    // Again: every layer cached, nothing fetched, the same image.
    events.lock().unwrap().clear();
    let again = cairn_oci::pull(&store, &r, &test_pull_options(), &observer).unwrap();
    assert_eq!(again.image_digest, report.image_digest);
    assert_eq!(again.bytes_fetched, 0);
    let mut ev = events.lock().unwrap().clone();
    ev.sort();
    assert_eq!(ev, ["assembling", "cached 0", "cached 1", "resolved"]);
}

/// Serves `img` and opens an empty store: what the two tests below pull
/// with (`pull` pulls `img` quietly).
struct Served {
    server: FakeServer,
    dir: tempfile::TempDir,
    store: cairn_store::Store,
    reference: ImageRef,
}

impl Served {
    fn new(img: &FakeImage) -> Served {
        let served = img.clone();
        let server = FakeServer::start(move |req| served.serve(req));
        let dir = tempfile::tempdir().unwrap();
        let store = cairn_store::Store::open(dir.path()).unwrap();
        let reference = ImageRef::parse(&img.reference(&server.addr)).unwrap();
        Served {
            server,
            dir,
            store,
            reference,
        }
    }

    fn pull(&self) -> Result<cairn_oci::PullReport, cairn_oci::PullError> {
        cairn_oci::pull(
            &self.store,
            &self.reference,
            &test_pull_options(),
            &|_: &cairn_oci::PullEvent<'_>| {},
        )
    }
}

/// A manifest may list one layer twice (a layer that undoes a change and
/// one that redoes it, say). The pull fetches it once; the image, written
/// while layers are still being published, is the one a pull of the same
/// image from layers already in the store writes.
#[test]
fn a_layer_listed_twice_is_fetched_once_and_the_image_is_the_cached_one() {
    let mut img = FakeImage::new();
    let first = img.layers[0].clone();
    img.layers.push(first);
    img.rebuild_config();
    let s = Served::new(&img);
    let report = s.pull().unwrap();
    let blob = format!("/v2/img/blobs/{}", img.layers[0].0);
    assert_eq!(
        s.server.count(|q| q.path == blob),
        1,
        "{:?}",
        s.server.requests()
    );
    assert_eq!(report.layers.len(), 3);
    assert!(report.layers[0].fetched && !report.layers[2].fetched);

    // Every layer from the store now: the same image.
    let again = s.pull().unwrap();
    assert_eq!(again.bytes_fetched, 0);
    assert_eq!(again.image_digest, report.image_digest);
}

/// A layer already in the store is read from its record, and the objects
/// it names are looked up before the image is published: one that has gone
/// missing fails the pull and publishes no image.
#[test]
fn a_cached_layer_whose_object_is_gone_fails_the_pull() {
    let img = FakeImage::new();
    let s = Served::new(&img);
    let report = s.pull().unwrap();
    // Remove the image (so the next pull writes it again) and one object of
    // the bottom layer.
    std::fs::remove_file(s.dir.path().join("images").join(&report.image_digest)).unwrap();
    let objects = s.store.layer_record_objects(&img.layers[0].2).unwrap();
    let gone = objects.first().expect("the bottom layer has an object");
    std::fs::remove_file(s.store.object_path(gone)).unwrap();

    let err = s.pull().unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&format!("object {gone} is missing")), "{msg}");
    assert!(!s.store.has_image(&report.image_digest));
}

/// A layer that cannot be applied on the one below it (a file under a
/// path that is a regular file there) fails the pull's tree while the
/// layer still streams: the tree stops the fetch, and its error is the one
/// the pull returns, not the stalled transfer's (which, without the stop,
/// would give up after its attempts and be reported instead).
#[test]
fn a_layer_that_does_not_apply_stops_the_pull_and_is_named() {
    let mut img = FakeImage::new();
    let bottom = common::registry::tar_of(&[("f", Some(b"a file"))]);
    // Some 3 MiB of record lines, most before the stall, so that the tap
    // sends the first MiB of them (the bad entry first) while the stream
    // goes on.
    let names: Vec<String> = (0..30_000)
        .map(|i| format!("d/{i:05}-{}", "x".repeat(80)))
        .collect();
    let mut entries: Vec<(&str, Option<&[u8]>)> =
        vec![("f/x", Some(b"under a file")), ("d/", None)];
    entries.extend(names.iter().map(|n| (n.as_str(), Some(&b"1"[..]))));
    let top = common::registry::tar_of(&entries);
    img.layers = [bottom, top]
        .iter()
        .map(|t| {
            let blob = common::gzip(t);
            (
                common::registry::sha256(&blob),
                blob,
                common::registry::sha256(t),
            )
        })
        .collect();
    img.rebuild_config();
    let server = serve_with(
        img.clone(),
        Arc::new(|img, req, _| {
            is_blob(req, &img.layers[1].0).then(|| {
                let b = &img.layers[1].1;
                let part = b.len() * 9 / 10;
                Reply::StallAfter(
                    vec![],
                    b[..part].to_vec(),
                    b.len() as u64,
                    Duration::from_secs(5),
                )
            })
        }),
    );
    let (dir, _, _, pulled) = pull_into_new_store(&img, &server, "conflict");
    let err = pulled.unwrap_err().to_string();
    assert!(
        err.contains("parent /f of /f/x is not a directory"),
        "{err}"
    );
    for p in store_snapshot(dir.path()) {
        let top = p.components().next().unwrap().as_os_str().to_owned();
        assert!(
            top != "images" && top != "refs",
            "{p:?} appeared after a failed pull"
        );
    }
    assert!(tmp_after_reopen(dir.path()).is_empty());
}
