//! Lazy images end to end against Debian's docker-registry 2.8 on
//! 127.0.0.1 (no referrers API: the referrers tag schema is used):
//! `cairn push` of a pulled image, `cairn pull --lazy` into a fresh store
//! (only metadata crosses the wire, counted by a proxy), `cairn fetch`,
//! and then the same image as a full pull; the clear error for an image
//! without an artifact; a registry that serves wrong bytes; a fetch killed
//! midway and run again.

mod support;

#[path = "../../oci/tests/common/fake.rs"]
mod fake;

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fake::{FakeServer, Reply, Request};
use serde_json::Value;
use support::artifact::{pack_layers, served_manifest};
use support::images::ImageSet;
use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::{assert_fsck_clean, cairn_cmd, cairn_ok, cairn_out};

fn json(root: &Path, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = cairn_ok(root, &all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

/// Every object of a store.
fn objects(root: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for fan in std::fs::read_dir(root.join("objects")).unwrap().flatten() {
        for o in std::fs::read_dir(fan.path()).unwrap().flatten() {
            out.insert(format!(
                "{}{}",
                fan.file_name().to_string_lossy(),
                o.file_name().to_string_lossy()
            ));
        }
    }
    out
}

/// The `cairn images --json` row of `digest`.
fn image_row(root: &Path, digest: &str) -> Value {
    json(root, &["images"])
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["digest"] == digest)
        .unwrap_or_else(|| panic!("no image {digest}"))
        .clone()
}

/// A registry with the test image set in `lazy/set`, the `full` image
/// pulled into `a` and pushed as an artifact tagged `full-lazy` (packs of
/// `pack_size`). Returns the push report.
fn published(reg: &LocalRegistry, a: &Path, pack_size: &str) -> Value {
    ImageSet::get().push(reg, "lazy/set");
    let reference = reg.reference("lazy/set:full");
    cairn_ok(a, &["pull", "-q", &reference]);
    json(
        a,
        &[
            "push",
            &reference,
            &reg.reference("lazy/set:full-lazy"),
            "--pack-size",
            pack_size,
        ],
    )
}

fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

#[test]
fn push_pull_lazy_fetch_equals_a_full_pull() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let push = published(&reg, &a, "256K");
    assert_eq!(push["referrers"], "tag-schema", "{push:#}");
    assert!(push["packs"].as_u64().unwrap() > 1, "{push:#}");
    let full_digest = push["image_digest"].as_str().unwrap().to_string();

    // The artifact as the registry serves it: an image manifest of
    // cairn's artifact type whose subject is the pushed image's manifest
    // (as the registry serves that: digest, size, media type).
    let artifact_digest = push["artifact_digest"].as_str().unwrap();
    let (bytes, _) = served_manifest(&reg, "lazy/set", artifact_digest);
    assert_eq!(sha256_digest(&bytes), artifact_digest);
    let artifact: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(artifact["artifactType"], "application/vnd.cairn.lazy.v1");
    assert_eq!(
        artifact["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    let (source, source_type) = served_manifest(&reg, "lazy/set", "full");
    let source_json: Value = serde_json::from_slice(&source).unwrap();
    let subject = &artifact["subject"];
    assert_eq!(
        subject["digest"],
        sha256_digest(&source).as_str(),
        "{artifact:#}"
    );
    assert_eq!(subject["digest"], push["subject_digest"], "{artifact:#}");
    assert_eq!(subject["size"], source.len() as u64, "{artifact:#}");
    assert_eq!(subject["mediaType"], source_type.as_str(), "{artifact:#}");
    assert_eq!(
        subject["mediaType"], source_json["mediaType"],
        "{artifact:#}"
    );
    // `--pack-size 256K`: a pack is closed once it holds 256 KiB, so it
    // is at most that plus its last frame (one object of at most a
    // chunk, or one chunk: zstd's bound for 1 MiB).
    let pack_size = 256u64 << 10;
    let max_frame = zstd::zstd_safe::compress_bound(1 << 20) as u64;
    let packs = pack_layers(&artifact);
    assert_eq!(packs.len() as u64, push["packs"].as_u64().unwrap());
    assert_eq!(
        packs.iter().map(|p| p.1).sum::<u64>(),
        push["pack_bytes"].as_u64().unwrap()
    );
    for (digest, size) in &packs {
        assert!(
            *size <= pack_size + max_frame,
            "pack {digest} is {size} bytes, over the bound {pack_size} + {max_frame}"
        );
        assert_eq!(
            std::fs::metadata(reg.blob_path(digest)).unwrap().len(),
            *size,
            "pack {digest} as stored in the registry"
        );
    }

    // A fresh store, through a proxy that counts what the registry sends.
    let proxy = SlowProxy::start(&reg.addr, 64 << 10);
    let via = format!("{}/lazy/set:full", proxy.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    assert_eq!(pulled["image_digest"], full_digest.as_str(), "{pulled:#}");
    assert_eq!(pulled["complete"], false);
    let object_bytes = pulled["object_bytes"].as_u64().unwrap();
    let metadata = proxy.bytes_down();
    assert!(
        metadata * 4 < object_bytes,
        "pull --lazy moved {metadata} bytes for an image of {object_bytes} object bytes"
    );
    assert!(objects(&b).is_empty(), "pull --lazy stored objects");
    let row = image_row(&b, &full_digest);
    assert_eq!(row["incomplete"]["objects_local"], 0, "{row:#}");
    assert_eq!(row["incomplete"]["objects"], pulled["objects"], "{row:#}");
    assert_eq!(row["incomplete"]["bytes"], object_bytes, "{row:#}");
    let table = cairn_ok(&b, &["images"]);
    assert!(table.contains("(incomplete)"), "{table}");
    let df = json(&b, &["df"]);
    assert_eq!(
        df["incomplete"][0]["digest"],
        full_digest.as_str(),
        "{df:#}"
    );
    assert_eq!(df["incomplete"][0]["objects_local"], 0, "{df:#}");
    let text = cairn_ok(&b, &["df"]);
    assert!(text.contains("incomplete (pulled with --lazy)"), "{text}");
    // Missing objects are what an incomplete image is, not corruption.
    assert_fsck_clean(&b, "after pull --lazy");
    // The metadata is all there.
    assert_eq!(
        cairn_ok(&b, &["dump", &via]),
        cairn_ok(&a, &["dump", &reg.reference("lazy/set:full")])
    );
    // Not mountable until complete, and said so.
    let out = cairn_out(&b, &["mount", &via, "/nonexistent-mountpoint"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("is incomplete") && err.contains("cairn fetch"),
        "{err}"
    );
    let out = cairn_out(
        &b,
        &[
            "export",
            &via,
            &format!("oci-layout:{}", b.join("out").display()),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is incomplete"),
        "{err}"
    );
    // An incomplete image cannot be pushed.
    let out = cairn_out(&b, &["push", &via, &reg.reference("lazy/set:again-lazy")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("incomplete") && err.contains("cairn fetch"),
        "{err}"
    );
    // gc keeps an incomplete image (named) and its index.
    cairn_ok(&b, &["gc"]);
    assert!(b
        .join("images")
        .join(format!("{full_digest}.lazy-index"))
        .is_file());

    // The library the FUSE data layer uses: one object on demand.
    {
        let store = cairn_store::Store::open(&b).unwrap();
        let client = cairn_oci::ClientOptions {
            auth_files: Vec::new(),
            ..cairn_oci::ClientOptions::default()
        };
        let remote = cairn_remote::RemoteObjects::open(&store, &full_digest, &client).unwrap();
        let entries: Vec<_> = remote.index().entries().collect();
        let single = entries.iter().find(|e| !e.is_chunked()).unwrap();
        let chunked = entries.iter().find(|e| e.is_chunked()).unwrap();
        for e in [single, chunked] {
            let mut out = Vec::new();
            assert_eq!(remote.fetch(&e.id, &mut out).unwrap(), e.size);
            assert_eq!(out.len() as u64, e.size);
            assert_eq!(remote.size(&e.id), Some(e.size));
            assert_eq!(cairn_store::fsverity_digest(&out[..]).unwrap(), e.id);
            if e.is_chunked() {
                let first = remote.fetch_chunk(&e.id, 0).unwrap().unwrap();
                assert_eq!(first, out[..1 << 20]);
                assert!(remote.fetch_chunk(&e.id, 99).unwrap().is_none());
            }
        }
        // Fetching to a writer stores nothing.
        assert!(objects(&b).is_empty());
        // The frames of each pack lie end to end and fill it; its last
        // frame starts before the pack size (else the pack would have
        // been closed before it).
        let mut frames: Vec<_> = entries.iter().flat_map(|e| e.frames.clone()).collect();
        frames.sort_by_key(|f| (f.pack, f.offset));
        for (p, (digest, size)) in packs.iter().enumerate() {
            let mine: Vec<_> = frames.iter().filter(|f| f.pack as usize == p).collect();
            assert!(!mine.is_empty(), "pack {p} ({digest}) holds no frame");
            let mut at = 0;
            for f in &mine {
                assert_eq!(f.offset, at, "pack {p} ({digest}): a gap or overlap");
                assert!(f.compressed <= max_frame, "{f:?}");
                at += f.compressed;
            }
            assert_eq!(at, *size, "pack {p} ({digest}) is not filled by its frames");
            let last = mine.last().unwrap();
            assert!(
                last.offset < pack_size,
                "pack {p} ({digest}) was not closed at {pack_size} bytes: its last frame starts at {}",
                last.offset
            );
        }
        assert!(frames.iter().all(|f| (f.pack as usize) < packs.len()));
    }

    let fetched = json(&b, &["fetch", &via]);
    assert_eq!(fetched["was_complete"], false, "{fetched:#}");
    assert_eq!(fetched["fetched_objects"], pulled["objects"], "{fetched:#}");
    let requests = fetched["requests"].as_u64().unwrap();
    assert!(
        requests < fetched["fetched_objects"].as_u64().unwrap(),
        "neighbours were not coalesced: {fetched:#}"
    );
    // Now it is the image a full pull makes, with the same objects.
    let row = image_row(&b, &full_digest);
    assert!(row.get("incomplete").is_none(), "{row:#}");
    assert_eq!(row["missing_objects"], 0, "{row:#}");
    assert_eq!(json(&b, &["df"])["incomplete"], serde_json::json!([]));
    let (oa, ob) = (objects(&a), objects(&b));
    assert!(
        ob.is_subset(&oa),
        "fetched objects a full pull does not have"
    );
    assert_eq!(ob.len() as u64, pulled["objects"].as_u64().unwrap());
    assert!(!b
        .join("images")
        .join(format!("{full_digest}.lazy-index"))
        .exists());
    assert_fsck_clean(&b, "after fetch");
    let again = json(&b, &["fetch", &via]);
    assert_eq!(again["was_complete"], true);
    cairn_ok(&b, &["gc"]);
    assert_eq!(objects(&b), ob, "gc removed objects of a complete image");

    // `pull --lazy` of the artifact itself works too, and of an image
    // that is complete in the store already changes nothing.
    let c = dir.path().join("c");
    let direct = json(
        &c,
        &["pull", "--lazy", &reg.reference("lazy/set:full-lazy")],
    );
    assert_eq!(direct["image_digest"], full_digest.as_str());
    assert_eq!(direct["manifest_digest"], push["subject_digest"]);
    let again = json(&b, &["pull", "--lazy", &via]);
    assert_eq!(again["complete"], true, "{again:#}");
    // Push never replaces an image's tag with an artifact.
    let reference = reg.reference("lazy/set:full");
    let out = cairn_out(&a, &["push", &reference, &reference]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("names an image") && err.contains("full-lazy"),
        "{err}"
    );
    // A second push of the same image to the artifact's tag is fine.
    let second = json(
        &a,
        &[
            "push",
            &reference,
            &reg.reference("lazy/set:full-lazy"),
            "--pack-size",
            "256K",
        ],
    );
    assert_eq!(second["artifact_digest"], push["artifact_digest"]);
    assert_eq!(second["uploaded_blobs"], 0, "{second:#}");
}

#[test]
fn lazy_pull_of_a_plain_image_says_why() {
    let reg = LocalRegistry::start();
    ImageSet::get().push(&reg, "lazy/plain");
    let dir = tempfile::tempdir().unwrap();
    let reference = reg.reference("lazy/plain:a");
    let out = cairn_out(dir.path(), &["pull", "--lazy", &reference]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    for needle in [
        reference.as_str(),
        "cannot be started lazily",
        "no cairn lazy artifact",
        "no eStargz table of contents",
        "referrers tag schema",
    ] {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
    assert!(
        support::listing(dir.path(), "images").is_empty(),
        "a failed lazy pull stored an image"
    );
    assert!(support::listing(dir.path(), "refs").is_empty());
    // The full pull still works.
    cairn_ok(dir.path(), &["pull", "-q", &reference]);
}

#[test]
fn wrong_bytes_from_the_registry_are_refused_and_named() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let push = published(&reg, &a, "256K");
    let artifact = push["artifact_digest"].as_str().unwrap();
    let (bytes, _) = served_manifest(&reg, "lazy/set", artifact);
    let manifest: Value = serde_json::from_slice(&bytes).unwrap();
    let packs: Vec<String> = pack_layers(&manifest).into_iter().map(|p| p.0).collect();
    let reference = reg.reference("lazy/set:full");
    let pulled = json(&b, &["pull", "--lazy", &reference]);
    let digest = pulled["image_digest"].as_str().unwrap().to_string();

    // The registry now serves the first pack with one byte changed.
    let path = reg.blob_path(&packs[0]);
    let mut data = std::fs::read(&path).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x55;
    std::fs::write(&path, &data).unwrap();

    let out = cairn_out(&b, &["fetch", &reference, "--attempts", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("from blob {}", packs[0]))
            && err.contains("object ")
            && err.contains("nothing of it was stored"),
        "{err}"
    );
    // Still incomplete; what it has is sound.
    let row = image_row(&b, &digest);
    assert!(row.get("incomplete").is_some(), "{row:#}");
    assert_fsck_clean(&b, "after a fetch of wrong bytes");
    for o in objects(&b) {
        assert!(
            objects(&a).contains(&o),
            "object {o} is not one of the image's"
        );
    }
}

#[test]
fn a_fetch_killed_midway_is_finished_by_the_next() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    published(&reg, &a, "256K");
    let proxy = SlowProxy::start(&reg.addr, 16 << 10);
    let via = format!("{}/lazy/set:full", proxy.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    let digest = pulled["image_digest"].as_str().unwrap().to_string();
    let before = proxy.bytes_down();
    proxy.set_delay(Duration::from_millis(15));
    let mut child = cairn_cmd(&b)
        .args(["fetch", &via])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.bytes_down() < before + (1 << 20) {
        assert!(Instant::now() < deadline, "the fetch did not get going");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the fetch ended before it could be killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    proxy.set_delay(Duration::ZERO);
    let row = image_row(&b, &digest);
    assert!(row.get("incomplete").is_some(), "{row:#}");
    assert_fsck_clean(&b, "after a killed fetch");
    let fetched = json(&b, &["fetch", &via]);
    assert_eq!(fetched["was_complete"], false);
    let row = image_row(&b, &digest);
    assert!(row.get("incomplete").is_none(), "{row:#}");
    assert_eq!(row["missing_objects"], 0);
    assert_fsck_clean(&b, "after the second fetch");
}

/// Forwards a GET to the real registry at `upstream` (Accept and Range
/// passed on, or Range dropped when `ignore_range`), answering as it did.
fn forward(upstream: &str, req: &Request, ignore_range: bool) -> Reply {
    let mut r = ureq::AgentBuilder::new()
        .redirects(0)
        .build()
        .request(&req.method, &format!("http://{upstream}{}", req.path));
    for h in ["Accept", "Range"] {
        if h == "Range" && ignore_range {
            continue;
        }
        if let Some(v) = req.header(h) {
            r = r.set(h, v);
        }
    }
    let resp = match r.call() {
        Ok(resp) | Err(ureq::Error::Status(_, resp)) => resp,
        Err(e) => return Reply::status(502, &e.to_string()),
    };
    let status = resp.status();
    let mut headers = Vec::new();
    for h in ["Content-Type", "Content-Range", "Docker-Content-Digest"] {
        if let Some(v) = resp.header(h) {
            headers.push((h.to_string(), v.to_string()));
        }
    }
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut body).unwrap();
    Reply::Full(status, headers, body)
}

/// A registry with the referrers API (a fake in front of docker-registry
/// that answers `/referrers/` itself, and ignores Range): pull --lazy
/// finds the artifact through the API, not the tag schema, and fetch
/// copes with whole-blob answers to range requests.
#[test]
fn referrers_api_and_a_registry_that_ignores_range() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let push = published(&reg, &a, "256K");
    let artifact = push["artifact_digest"].as_str().unwrap().to_string();
    let subject = push["subject_digest"].as_str().unwrap().to_string();
    let size = ureq::get(&format!(
        "http://{}/v2/lazy/set/manifests/{artifact}",
        reg.addr
    ))
    .set("Accept", "application/vnd.oci.image.manifest.v1+json")
    .call()
    .unwrap()
    .header("Content-Length")
    .unwrap()
    .parse::<u64>()
    .unwrap();
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "artifactType": "application/vnd.cairn.lazy.v1",
            "digest": artifact, "size": size,
        }],
    }))
    .unwrap();
    let upstream = reg.addr.clone();
    let referrers_path = format!("/v2/lazy/set/referrers/{subject}");
    let fake = FakeServer::start(move |req| {
        if req.path.starts_with(&referrers_path) {
            Reply::ok("application/vnd.oci.image.index.v1+json", index.clone())
        } else {
            forward(&upstream, req, true)
        }
    });
    let via = format!("{}/lazy/set:full", fake.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    assert_eq!(pulled["artifact_digest"], artifact.as_str(), "{pulled:#}");
    assert!(fake.count(|r| r.path.contains("/referrers/")) >= 1);
    assert_eq!(
        fake.count(|r| r.path.contains("/manifests/sha256-")),
        0,
        "the tag schema was consulted although the registry has the API"
    );
    assert_eq!(
        fake.count(|r| r.path.ends_with("/manifests/full")),
        1,
        "the tag's manifest is asked for once"
    );
    let fetched = json(&b, &["fetch", &via]);
    assert_eq!(fetched["fetched_objects"], pulled["objects"], "{fetched:#}");
    assert_fsck_clean(&b, "after a fetch from a registry that ignores Range");
}

/// A lazy pull pinned to a manifest digest (as the snapshotter pulls, with
/// containerd's `cri.manifest-digest`) looks up the referrers while the
/// manifest is still being read, not after it: here the manifest's answer
/// is held back, and the referrers tag and the artifact are asked for
/// meanwhile. The config comes once: the artifact names the config the
/// resolution fetched.
#[test]
fn a_pinned_lazy_pull_looks_up_referrers_while_the_manifest_comes() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let push = published(&reg, &a, "256K");
    let subject = push["subject_digest"].as_str().unwrap().to_string();
    let artifact = push["artifact_digest"].as_str().unwrap().to_string();
    let (manifest, _) = served_manifest(&reg, "lazy/set", &subject);
    let config = serde_json::from_slice::<Value>(&manifest).unwrap()["config"]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    // (path, when it arrived, when it was answered)
    let seen: Arc<Mutex<Vec<(String, Instant, Instant)>>> = Arc::default();
    let upstream = reg.addr.clone();
    let manifest_path = format!("/v2/lazy/set/manifests/{subject}");
    let log = seen.clone();
    let fake = FakeServer::start(move |req| {
        let arrived = Instant::now();
        if req.path == manifest_path {
            std::thread::sleep(Duration::from_millis(500));
        }
        let reply = forward(&upstream, req, false);
        log.lock()
            .unwrap()
            .push((req.path.clone(), arrived, Instant::now()));
        reply
    });
    let via = format!("{}/lazy/set@{subject}", fake.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    assert_eq!(pulled["artifact_digest"], artifact.as_str(), "{pulled:#}");
    assert_eq!(pulled["manifest_digest"], subject.as_str(), "{pulled:#}");
    let seen = seen.lock().unwrap().clone();
    let find = |want: &str| {
        seen.iter()
            .find(|(p, _, _)| p.as_str() == want)
            .unwrap_or_else(|| panic!("no request for {want}: {seen:#?}"))
            .clone()
    };
    let (_, _, manifest_answered) = find(&format!("/v2/lazy/set/manifests/{subject}"));
    let tag = format!("/v2/lazy/set/manifests/{}", subject.replace(':', "-"));
    let (_, tag_asked, _) = find(&tag);
    let (_, artifact_asked, _) = find(&format!("/v2/lazy/set/manifests/{artifact}"));
    assert!(
        tag_asked < manifest_answered && artifact_asked < manifest_answered,
        "the referrers were looked up after the manifest came: {seen:#?}"
    );
    let config_path = format!("/v2/lazy/set/blobs/{config}");
    assert_eq!(
        seen.iter().filter(|(p, _, _)| *p == config_path).count(),
        1,
        "the config was fetched more than once: {seen:#?}"
    );
    // What was pulled is what an unpinned pull gives.
    let c = dir.path().join("c");
    let plain = json(&c, &["pull", "--lazy", &reg.reference("lazy/set:full")]);
    assert_eq!(pulled["image_digest"], plain["image_digest"]);
    assert_eq!(
        cairn_ok(&b, &["dump", &via]),
        cairn_ok(&c, &["dump", &reg.reference("lazy/set:full")])
    );
}

/// (path, size, object id in hex) of the files of a `cairn dump` that are
/// backed by objects (their payload is `ab/cdef…`), in dump order.
fn object_files(dump: &str) -> Vec<(&str, u64, String)> {
    dump.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 8 && f[8].len() == 65 && f[8].as_bytes()[2] == b'/')
                .then(|| (f[0], f[1].parse().unwrap(), f[8].replace('/', "")))
        })
        .collect()
}

/// `cairn push --prefetch FILE` packs those files' objects first and
/// names them in the artifact's prefetch list; `pull --lazy` fetches
/// them (and only them); `pull --lazy --no-prefetch` nothing (a lazy
/// mount's server then fetches the list once it serves).
#[test]
fn prefetch_list_objects_come_with_the_lazy_pull() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    ImageSet::get().push(&reg, "lazy/pf");
    let reference = reg.reference("lazy/pf:full");
    cairn_ok(&a, &["pull", "-q", &reference]);
    // Three files backed by objects, from the image's dumpfile.
    let dump = cairn_ok(&a, &["dump", &reference]);
    let files: Vec<&str> = object_files(&dump)
        .into_iter()
        .map(|f| f.0)
        .take(3)
        .collect();
    assert_eq!(files.len(), 3, "{dump}");
    let list = dir.path().join("prefetch");
    std::fs::write(&list, files.join("\n") + "\n").unwrap();
    let target = reg.reference("lazy/pf:full-lazy");
    let push = json(
        &a,
        &[
            "push",
            &reference,
            &target,
            "--prefetch",
            list.to_str().unwrap(),
        ],
    );
    assert_eq!(push["referrers"], "tag-schema");

    let b = dir.path().join("b");
    let plain = dir.path().join("plain");
    let pulled = json(&plain, &["pull", "--lazy", "--no-prefetch", &reference]);
    assert_eq!(pulled["prefetched"], 0, "{pulled:#}");
    assert!(objects(&plain).is_empty(), "the lazy pull fetched objects");
    let pulled = json(&b, &["pull", "--lazy", &reference]);
    let n = pulled["prefetched"].as_u64().unwrap();
    assert!((1..=3).contains(&n), "{pulled:#}");
    assert_eq!(objects(&b).len() as u64, n);
    let row = image_row(&b, pulled["image_digest"].as_str().unwrap());
    assert_eq!(row["incomplete"]["objects_local"], n, "{row:#}");
    assert_fsck_clean(&b, "after a lazy pull with prefetch");

    let c = dir.path().join("c");
    let pulled = json(&c, &["pull", "--lazy", "--no-prefetch", &target]);
    assert_eq!(pulled["prefetched"], 0);
    assert!(objects(&c).is_empty());
    // The listed objects are packed at zstd level 19 (they are on a lazy
    // start's path), the others at 3: each frame is exactly what that
    // level gives.
    {
        let payloads: Vec<String> = dump
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.len() > 8 && f[8].len() == 65 && f[8].as_bytes()[2] == b'/')
                    .then(|| f[8].replace('/', ""))
            })
            .collect();
        let store = cairn_store::Store::open(&c).unwrap();
        let client = cairn_oci::ClientOptions {
            auth_files: Vec::new(),
            ..cairn_oci::ClientOptions::default()
        };
        let digest = pulled["image_digest"].as_str().unwrap();
        let remote = cairn_remote::RemoteObjects::open(&store, digest, &client).unwrap();
        let mut others = 0;
        for (i, hex) in payloads.iter().enumerate() {
            let id = cairn_store::ObjectId::from_hex(hex).unwrap();
            let e = remote.entry(&id).unwrap();
            if e.is_chunked() {
                continue;
            }
            let listed = i < 3;
            if !listed && (payloads[..3].contains(hex) || others >= 5) {
                continue;
            }
            others += usize::from(!listed);
            let data = std::fs::read(a.join("objects").join(&hex[..2]).join(&hex[2..])).unwrap();
            let level = if listed { 19 } else { 3 };
            assert_eq!(
                e.frames[0].compressed,
                zstd::bulk::compress(&data, level).unwrap().len() as u64,
                "object {hex} (listed: {listed}) is not packed at level {level}"
            );
        }
        assert!(others > 0);
    }
    // A path that is not in the image is refused by push.
    std::fs::write(&list, "/no/such/file\n").unwrap();
    let out = cairn_out(
        &a,
        &[
            "push",
            &reference,
            &target,
            "--prefetch",
            list.to_str().unwrap(),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/no/such/file"),
        "{err}"
    );
}

/// A prefetch file whose line names chunks of a large file
/// (`/bin/tool<TAB>chunks=1`) gives a v2 list: `push` packs that chunk
/// right after the whole file listed before it, ahead of the object's
/// other chunk; the list reads back with its chunk; `pull --lazy` fetches
/// the whole entries only (the chunk entry is the lazy server's) and the
/// store checks clean.
#[test]
fn a_prefetch_list_of_chunks_packs_them_first() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    ImageSet::get().push(&reg, "lazy/pfc");
    let reference = reg.reference("lazy/pfc:full");
    cairn_ok(&a, &["pull", "-q", &reference]);
    let dump = cairn_ok(&a, &["dump", &reference]);
    let files = object_files(&dump);
    let small = files.iter().find(|f| f.1 > 0 && f.1 < 1 << 20).unwrap();
    let tool = files.iter().find(|f| f.0 == "/bin/tool").unwrap();
    assert!(tool.1 > 1 << 20 && tool.1 <= 2 << 20, "{tool:?}");
    let list = dir.path().join("prefetch");
    std::fs::write(&list, format!("{}\n{}\tchunks=1\n", small.0, tool.0)).unwrap();
    let target = reg.reference("lazy/pfc:full-lazy");
    let pushed = |list: &Path| {
        cairn_out(
            &a,
            &[
                "push",
                &reference,
                &target,
                "--prefetch",
                list.to_str().unwrap(),
            ],
        )
    };
    let out = pushed(&list);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let c = dir.path().join("c");
    let pulled = json(&c, &["pull", "--lazy", "--no-prefetch", &target]);
    let store = cairn_store::Store::open(&c).unwrap();
    let client = cairn_oci::ClientOptions {
        auth_files: Vec::new(),
        ..cairn_oci::ClientOptions::default()
    };
    let digest = pulled["image_digest"].as_str().unwrap();
    let remote = cairn_remote::RemoteObjects::open(&store, digest, &client).unwrap();
    let id = |hex: &str| cairn_store::ObjectId::from_hex(hex).unwrap();
    assert_eq!(
        remote.prefetch_entries().unwrap(),
        vec![
            cairn_remote::prefetch::Entry::whole(id(&small.2)),
            cairn_remote::prefetch::Entry {
                id: id(&tool.2),
                chunks: Some(vec![1]),
            },
        ]
    );
    let s = remote.entry(&id(&small.2)).unwrap();
    let t = remote.entry(&id(&tool.2)).unwrap();
    assert_eq!((s.frames[0].pack, s.frames[0].offset), (0, 0));
    assert_eq!(
        (t.frames[1].pack, t.frames[1].offset),
        (0, s.frames[0].compressed),
        "chunk 1 of /bin/tool follows the listed file"
    );
    assert!(t.frames[0].pack > 0 || t.frames[0].offset > t.frames[1].offset);
    // The old reader's view: the objects, the chunked one whole.
    assert_eq!(
        remote.prefetch_list().unwrap(),
        vec![id(&small.2), id(&tool.2)]
    );

    // The pull fetches the whole entries; the chunk entry is left to the
    // lazy layer's server (a partial object is never stored).
    let b = dir.path().join("b");
    let pulled = json(&b, &["pull", "--lazy", &target]);
    assert_eq!(pulled["prefetched"], 1, "{pulled:#}");
    assert_eq!(objects(&b), BTreeSet::from([small.2.clone()]));
    assert_fsck_clean(&b, "after a lazy pull of a list with chunks");
    let fetched = json(&b, &["fetch", &target]);
    assert_eq!(
        fetched["fetched_objects"].as_u64().unwrap() + 1,
        pulled["objects"].as_u64().unwrap()
    );
    assert_fsck_clean(&b, "after fetching an image whose list named chunks");

    // Chunks past the file's, or not increasing, are refused by push.
    for bad in ["chunks=2", "chunks=1,0"] {
        std::fs::write(&list, format!("{}\t{bad}\n", tool.0)).unwrap();
        let out = pushed(&list);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("/bin/tool"),
            "{bad}: {err}"
        );
    }
}

/// A chunked object wanted whole (`cairn fetch`, a prefetch list) comes in
/// one request a run of chunks that lie end to end in a pack (up to
/// `CHUNK_RUN`), not one a chunk; each chunk is still checked.
#[test]
fn a_chunked_object_comes_in_one_request_a_run() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    // Packs of 3 MB: /bin/tool (1.5 MB, two chunks) sits whole in pack 0.
    published(&reg, &a, "3M");
    let upstream = reg.addr.clone();
    let fake = FakeServer::start(move |req| forward(&upstream, req, false));
    let via = format!("{}/lazy/set:full", fake.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    let digest = pulled["image_digest"].as_str().unwrap();
    let store = cairn_store::Store::open(&b).unwrap();
    let client = cairn_oci::ClientOptions {
        auth_files: Vec::new(),
        ..cairn_oci::ClientOptions::default()
    };
    let remote = cairn_remote::RemoteObjects::open(&store, digest, &client).unwrap();
    let chunked: Vec<_> = remote
        .index()
        .entries()
        .filter(|e| e.is_chunked())
        .collect();
    assert!(!chunked.is_empty());
    let mut runs = 0;
    for e in &chunked {
        let before = fake.count(|r| r.header("Range").is_some());
        let mut out = Vec::new();
        assert_eq!(remote.fetch(&e.id, &mut out).unwrap(), e.size);
        assert_eq!(cairn_store::fsverity_digest(&out[..]).unwrap(), e.id);
        let n = cairn_remote::fetch::chunk_runs(&e.frames).len();
        assert_eq!(fake.count(|r| r.header("Range").is_some()) - before, n);
        // The lazy server's way (it hashes the whole itself): the same
        // bytes, the same requests.
        let mut again = Vec::new();
        assert_eq!(remote.fetch_for_stager(&e.id, &mut again).unwrap(), e.size);
        assert!(again == out);
        assert_eq!(fake.count(|r| r.header("Range").is_some()) - before, 2 * n);
        if e.frames.iter().all(|f| f.pack == e.frames[0].pack) {
            assert_eq!(n, 1, "{:?}", e.frames);
        }
        runs += n;
    }
    assert!(
        runs < chunked.iter().map(|e| e.frames.len()).sum(),
        "no run"
    );
    // `cairn fetch` counts (and makes) the same requests for them.
    let fetched = json(&b, &["fetch", &via]);
    assert_eq!(fetched["fetched_objects"], pulled["objects"], "{fetched:#}");
    assert_fsck_clean(&b, "after a fetch with runs of chunks");
}

/// `RemoteObjects::publish_with_neighbours`: the object asked for and the
/// ones after it in its pack come in one range request, each verified.
#[test]
fn neighbours_come_in_one_request() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    published(&reg, &a, "256K");
    let upstream = reg.addr.clone();
    let fake = FakeServer::start(move |req| forward(&upstream, req, false));
    let via = format!("{}/lazy/set:full", fake.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    let digest = pulled["image_digest"].as_str().unwrap();
    let store = cairn_store::Store::open(&b).unwrap();
    let client = cairn_oci::ClientOptions {
        auth_files: Vec::new(),
        ..cairn_oci::ClientOptions::default()
    };
    let remote = cairn_remote::RemoteObjects::open(&store, digest, &client).unwrap();
    let small = remote
        .index()
        .entries()
        .find(|e| !e.is_chunked() && e.size < 4096)
        .unwrap();
    let ranges_before = fake.count(|r| r.header("Range").is_some());
    let got = remote
        .publish_with_neighbours(&store, &small.id, 256 << 10)
        .unwrap();
    assert_eq!(got[0], small.id);
    assert!(got.len() > 1, "no neighbour came along");
    assert_eq!(
        fake.count(|r| r.header("Range").is_some()) - ranges_before,
        1,
        "neighbours took more than one request"
    );
    let have = objects(&b);
    for id in &got {
        assert!(have.contains(&id.to_hex()), "{id} not published");
    }
    assert_eq!(have.len(), got.len());
    drop(store);
    assert_fsck_clean(&b, "after publishing neighbours");
}

/// An image without a record (made by `cairn mkfs --store`) has no
/// manifest to be the artifact's subject: push says so, before any
/// network.
#[test]
fn push_needs_a_pulled_or_imported_image() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let tree = dir.path().join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("f"), vec![7u8; 5000]).unwrap();
    let image = dir.path().join("t.img");
    cairn_ok(
        &root,
        &[
            "mkfs",
            "--store",
            tree.to_str().unwrap(),
            image.to_str().unwrap(),
        ],
    );
    cairn_ok(&root, &["tag", image.to_str().unwrap(), "local"]);
    let out = cairn_out(&root, &["push", "local", "127.0.0.1:1/x/y:lazy"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has no image record") && err.contains("subject"),
        "{err}"
    );
}

/// The (path, Range) of each range request for one of `packs` that a
/// fake server saw, in order.
fn pack_ranges(fake: &FakeServer, packs: &[String]) -> Vec<(String, String)> {
    fake.requests()
        .into_iter()
        .filter(|r| {
            packs
                .iter()
                .any(|p| r.path.ends_with(&format!("/blobs/{p}")))
        })
        .filter_map(|r| Some((r.path.clone(), r.header("Range")?.to_string())))
        .collect()
}

/// The test set published from store `a` with 256 KiB packs (as
/// [`published`]): the digests of its packs, as the artifact the
/// registry serves lists them.
fn published_packs(reg: &LocalRegistry, a: &Path) -> Vec<String> {
    let push = published(reg, a, "256K");
    let artifact_digest = push["artifact_digest"].as_str().unwrap();
    let (bytes, _) = served_manifest(reg, "lazy/set", artifact_digest);
    pack_layers(&serde_json::from_slice(&bytes).unwrap())
        .into_iter()
        .map(|p| p.0)
        .collect()
}

/// The registry's answer to `req` cut off after half its body (the
/// connection closed with the Content-Length not reached); an upstream
/// answer that is not a 206 with a body to cut is noted in `bad`.
fn dropped_mid_body(upstream: &str, req: &Request, bad: &Mutex<Vec<String>>) -> Reply {
    match forward(upstream, req, false) {
        Reply::Full(206, headers, body) if body.len() > 1 => {
            let half = body[..body.len() / 2].to_vec();
            Reply::Short(206, headers, half, body.len() as u64)
        }
        Reply::Full(status, _, body) => {
            bad.lock().unwrap().push(format!(
                "{} {:?}: upstream answered {status} with {} bytes",
                req.path,
                req.header("Range"),
                body.len()
            ));
            Reply::status(500, "unexpected upstream answer")
        }
        _ => unreachable!("forward answers Full"),
    }
}

/// Runs `cairn fetch ARGS` in `root` and waits at most `limit` for it
/// (killed and a failure past that): its output.
fn fetch_bounded(root: &Path, args: &[&str], limit: Duration) -> std::process::Output {
    let child = cairn_cmd(root)
        .arg("fetch")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) on the child this function spawned, which
            // has not been waited for (the waiting thread still waits).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("cairn fetch {args:?} did not end within {limit:?}");
        }
    }
}

/// `cairn fetch` through a registry front that breaks two range requests
/// for pack blobs: the first for a run of single-frame objects is cut off
/// mid-body (connection closed after half of it), the first for a chunk
/// of a chunked object is answered 503. The client retries each (the
/// policy of `cairn_oci::client`: transient failures, `--attempts`
/// attempts in all, default 4, with backoff), from the range's first
/// byte, and the fetch completes with exactly the image's objects: the
/// front saw two range requests more than the fetch reports making, each
/// broken range twice and every other range once.
#[test]
fn broken_range_requests_are_retried_and_the_fetch_completes() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let packs = published_packs(&reg, &a);
    // Where the requests for single-frame objects and for chunks start,
    // from the artifact's index (a lazy pull straight from the registry).
    let (singles, chunks) = {
        let c = dir.path().join("c");
        let pulled = json(&c, &["pull", "--lazy", &reg.reference("lazy/set:full")]);
        let store = cairn_store::Store::open(&c).unwrap();
        let client = cairn_oci::ClientOptions {
            auth_files: Vec::new(),
            ..cairn_oci::ClientOptions::default()
        };
        let digest = pulled["image_digest"].as_str().unwrap();
        let remote = cairn_remote::RemoteObjects::open(&store, digest, &client).unwrap();
        let (mut singles, mut chunks) = (HashSet::new(), HashSet::new());
        for e in remote.index().entries() {
            let set = if e.is_chunked() {
                &mut chunks
            } else {
                &mut singles
            };
            for f in &e.frames {
                set.insert((f.pack as usize, f.offset));
            }
        }
        (singles, chunks)
    };
    assert!(!singles.is_empty() && !chunks.is_empty());

    let dropped: Arc<Mutex<Option<(String, String)>>> = Arc::default();
    let refused: Arc<Mutex<Option<(String, String)>>> = Arc::default();
    let bad: Arc<Mutex<Vec<String>>> = Arc::default();
    let fake = {
        let (upstream, packs) = (reg.addr.clone(), packs.clone());
        let (dropped, refused, bad) = (dropped.clone(), refused.clone(), bad.clone());
        FakeServer::start(move |req| {
            let (Some(range), Some(pack)) = (
                req.header("Range"),
                packs
                    .iter()
                    .position(|p| req.path.ends_with(&format!("/blobs/{p}"))),
            ) else {
                return forward(&upstream, req, false);
            };
            let start: u64 = range
                .strip_prefix("bytes=")
                .and_then(|r| r.split('-').next())
                .and_then(|s| s.parse().ok())
                .unwrap_or(u64::MAX);
            let key = Some((req.path.clone(), range.to_string()));
            if singles.contains(&(pack, start)) {
                let mut d = dropped.lock().unwrap();
                if d.is_none() {
                    *d = key;
                    return dropped_mid_body(&upstream, req, &bad);
                }
            } else if chunks.contains(&(pack, start)) {
                let mut r = refused.lock().unwrap();
                if r.is_none() {
                    *r = key;
                    return Reply::error(503, "UNAVAILABLE", "try again later");
                }
            } else {
                bad.lock()
                    .unwrap()
                    .push(format!("range {range} of pack {pack} starts at no frame"));
            }
            forward(&upstream, req, false)
        })
    };
    let via = format!("{}/lazy/set:full", fake.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    assert!(pack_ranges(&fake, &packs).is_empty(), "the pull read packs");

    let fetched = json(&b, &["fetch", &via]);
    assert_eq!(fetched["was_complete"], false, "{fetched:#}");
    assert_eq!(fetched["fetched_objects"], pulled["objects"], "{fetched:#}");
    let bad = bad.lock().unwrap().clone();
    assert!(bad.is_empty(), "{bad:#?}");
    let dropped = dropped.lock().unwrap().clone().expect("no group request");
    let refused = refused.lock().unwrap().clone().expect("no chunk request");
    let ranges = pack_ranges(&fake, &packs);
    let requests = fetched["requests"].as_u64().unwrap();
    assert_eq!(ranges.len() as u64, requests + 2, "{ranges:#?}");
    let times = |k: &(String, String)| ranges.iter().filter(|r| *r == k).count();
    assert_eq!(times(&dropped), 2, "{dropped:?} in {ranges:#?}");
    assert_eq!(times(&refused), 2, "{refused:?} in {ranges:#?}");
    let distinct: BTreeSet<_> = ranges.iter().collect();
    assert_eq!(distinct.len() as u64, requests, "{ranges:#?}");

    // Complete, with exactly the image's objects, each checked.
    let digest = pulled["image_digest"].as_str().unwrap();
    let row = image_row(&b, digest);
    assert!(row.get("incomplete").is_none(), "{row:#}");
    assert_eq!(row["missing_objects"], 0, "{row:#}");
    let (oa, ob) = (objects(&a), objects(&b));
    assert!(
        ob.is_subset(&oa),
        "fetched objects a full pull does not have"
    );
    assert_eq!(ob.len() as u64, pulled["objects"].as_u64().unwrap());
    assert_fsck_clean(&b, "after a fetch with retried range requests");
}

/// A range request for a pack that fails every time (cut off mid-body,
/// 503, alternately) is tried `--attempts` times (default 4), not more,
/// and then the fetch fails, promptly, with an error naming the pack blob
/// and the attempts; nothing is stored and the image stays incomplete.
#[test]
fn a_range_request_that_always_fails_gives_up_naming_the_blob() {
    let reg = LocalRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let packs = published_packs(&reg, &a);
    let bad: Arc<Mutex<Vec<String>>> = Arc::default();
    let fake = {
        let (upstream, packs, bad) = (reg.addr.clone(), packs.clone(), bad.clone());
        let n = AtomicUsize::new(0);
        FakeServer::start(move |req| {
            let pack = packs
                .iter()
                .any(|p| req.path.ends_with(&format!("/blobs/{p}")));
            if !pack || req.header("Range").is_none() {
                return forward(&upstream, req, false);
            }
            if n.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
                dropped_mid_body(&upstream, req, &bad)
            } else {
                Reply::error(503, "UNAVAILABLE", "try again later")
            }
        })
    };
    let via = format!("{}/lazy/set:full", fake.addr);
    let pulled = json(&b, &["pull", "--lazy", &via]);
    assert!(pack_ranges(&fake, &packs).is_empty(), "the pull read packs");

    // One request in flight: the first range's attempts are all there is.
    let out = fetch_bounded(&b, &[&via, "--jobs", "1"], Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let bad = bad.lock().unwrap().clone();
    assert!(bad.is_empty(), "{bad:#?}");
    let ranges = pack_ranges(&fake, &packs);
    assert_eq!(ranges.len(), 4, "{ranges:#?}");
    assert!(ranges.iter().all(|r| *r == ranges[0]), "{ranges:#?}");
    let blob = ranges[0].0.rsplit('/').next().unwrap();
    assert!(packs.iter().any(|p| p == blob));
    for needle in [
        format!("pack {blob} bytes "),
        "gave up after 4 attempts".to_string(),
    ] {
        // Said once: the error chain does not repeat the registry's error.
        assert_eq!(err.matches(&needle).count(), 1, "{needle:?} in: {err}");
    }
    let row = image_row(&b, pulled["image_digest"].as_str().unwrap());
    assert!(row.get("incomplete").is_some(), "{row:#}");
    assert!(objects(&b).is_empty(), "a failed fetch stored objects");
    assert_fsck_clean(&b, "after a fetch that gave up");
}
