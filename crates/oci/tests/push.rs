//! Writing to a real registry (Debian's docker-registry 2.8 on 127.0.0.1):
//! blob uploads that skip what is there, manifest and index PUTs, a
//! manifest with a `subject`, the referrers API's absence, and range reads
//! of a blob segment, also watched as it arrives (also with basic auth).

mod common;

use cairn_oci::client::Referrers;
use cairn_oci::{Digest, ImageRef, Registry};
use common::registry::LocalRegistry;
use common::test_client;

fn client(reg: &LocalRegistry) -> Registry {
    let r = ImageRef::parse(&reg.reference("push/x:t")).unwrap();
    let mut opts = test_client();
    if let Some((u, p)) = &reg.basic {
        opts.credentials = Some(cairn_oci::auth::Credentials {
            username: u.clone(),
            password: p.clone(),
            source: None,
        });
    }
    Registry::for_push(&r, &opts)
}

fn round_trip(reg: &LocalRegistry) {
    let c = client(reg);
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let d = Digest::of(&data);
    assert!(!c.blob_exists("push/x", &d).unwrap());
    assert!(c.push_blob("push/x", &d, &data, "test blob").unwrap());
    assert!(c.blob_exists("push/x", &d).unwrap());
    // Already there: not uploaded again.
    assert!(!c.push_blob("push/x", &d, &data, "test blob").unwrap());

    let seg = c
        .fetch_blob_range("push/x", &d, 1000, 5000, "segment")
        .unwrap();
    assert_eq!(seg, &data[1000..6000]);
    let tail = c
        .fetch_blob_range("push/x", &d, 199_990, 10, "tail")
        .unwrap();
    assert_eq!(tail, &data[199_990..]);
    // The same read, watched as it arrives: growing prefixes of the
    // range, the last one the whole range.
    let mut seen: Vec<usize> = Vec::new();
    let long = c
        .fetch_blob_range_progress("push/x", &d, 1000, 190_000, "watched", &mut |p| {
            assert_eq!(p, &data[1000..1000 + p.len()]);
            seen.push(p.len());
        })
        .unwrap();
    assert_eq!(long, &data[1000..191_000]);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert_eq!(seen.last(), Some(&190_000));

    // A manifest with a subject and an artifactType: 2.8 stores it as is.
    let config = b"{}".to_vec();
    let cd = Digest::of(&config);
    c.push_blob("push/x", &cd, &config, "config").unwrap();
    let subject = serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": format!("sha256:{}", "1".repeat(64)), "size": 10
    });
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.cairn.test",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd.to_string(), "size": config.len()},
        "layers": [{"mediaType": "application/octet-stream", "digest": d.to_string(), "size": data.len()}],
        "subject": subject,
    }))
    .unwrap();
    c.put_manifest(
        "push/x",
        "t",
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
        "manifest",
    )
    .unwrap();
    let got = c
        .fetch_manifest(
            "push/x",
            "t",
            &["application/vnd.oci.image.manifest.v1+json"],
            cairn_oci::client::BodySize::AtMost(1 << 20),
            "push/x:t",
        )
        .unwrap();
    assert_eq!(got.bytes, manifest);
    // docker-registry 2.8 has no referrers API.
    let subject_digest = Digest::parse(&format!("sha256:{}", "1".repeat(64))).unwrap();
    assert_eq!(
        c.referrers(
            "push/x",
            &subject_digest,
            Some("application/vnd.cairn.test")
        )
        .unwrap(),
        Referrers::NoApi
    );
    // A missing blob is named.
    let missing = Digest::of(b"nothing");
    let e = c
        .fetch_blob_range("push/x", &missing, 0, 4, "missing")
        .unwrap_err()
        .to_string();
    assert!(e.contains(missing.as_str()), "{e}");
}

#[test]
fn push_then_read_segments() {
    let reg = LocalRegistry::start();
    round_trip(&reg);
}

#[test]
fn push_with_basic_auth() {
    let hash = bcrypt::hash("s3cret", 4).unwrap();
    let line = format!("pusher:{hash}");
    let reg = LocalRegistry::start_with(Some(("pusher", "s3cret", &line)));
    round_trip(&reg);
}
