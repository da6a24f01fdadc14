//! Any bytes given to the parsers of what an image source serves: digests
//! (`cairn_spec::parse_digest`, as the store re-exports it), registry manifests, indexes and configs
//! (`cairn_oci::spec`), the manifest/config pair the image assembler reads
//! and the descriptors of an OCI layout (`cairn_image`'s oracles). Errors
//! are fine, panics are bugs; and a digest that parses never holds a path
//! character, since paths and URLs are made from it.
#![no_main]

use cairn_oci::spec::{self, media_type as mt, Descriptor, Manifest};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest as _, Sha256};

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

fn check_digest(s: &str) {
    if let Ok(hex) = cairn_store::parse_digest(s) {
        assert_eq!(hex.len(), 64, "{s:?}");
        assert!(
            hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{s:?}"
        );
        assert_eq!(s, format!("sha256:{hex}"));
        assert!(cairn_store::is_diff_id(s));
        assert!(cairn_oci::Digest::parse(s).is_ok());
    } else {
        assert!(!cairn_store::is_diff_id(s));
        assert!(cairn_oci::Digest::parse(s).is_err());
    }
}

fn check_descriptor(d: &Descriptor) {
    check_digest(&d.digest);
    if let Ok(digest) = spec::descriptor_digest(d, "fuzz descriptor") {
        assert!(!digest.as_str().contains(['/', '.']));
    }
    let _ = spec::layer_compression(&d.media_type, "fuzz layer");
    let _ = spec::check_config_media_type(&d.media_type, "fuzz config");
    let _ = spec::check_manifest_media_type(&d.media_type, "fuzz manifest");
}

fn check_manifest(m: &Manifest) {
    match m {
        Manifest::Index(i) => {
            i.manifests.iter().for_each(check_descriptor);
            let host = cairn_oci::PlatformSpec::host();
            let _ = cairn_oci::platform::choose(&i.manifests, &host);
        }
        Manifest::Image(m) => {
            check_descriptor(&m.config);
            m.layers.iter().for_each(check_descriptor);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        check_digest(s);
    }

    // As a registry serves it: by tag (any Content-Type) and by descriptor.
    for content_type in [None, Some(mt::OCI_INDEX), Some(mt::DOCKER_MANIFEST), Some("application/json")] {
        if let Ok((_, m)) = spec::parse_manifest(data, content_type, "fuzz") {
            check_manifest(&m);
        }
    }
    for media_type in [mt::OCI_INDEX, mt::OCI_MANIFEST, mt::DOCKER_MANIFEST_LIST] {
        let desc = Descriptor {
            media_type: media_type.to_string(),
            digest: sha256(data),
            size: data.len() as u64,
            urls: Vec::new(),
            platform: None,
            annotations: Default::default(),
        };
        if let Ok((t, m)) = spec::parse_manifest_for(data, &desc, "fuzz") {
            check_manifest(&m);
            // The descriptor's type, whatever the document says of itself.
            assert_eq!(t, media_type);
        }
    }
    for layers in [0, 1, data.len() % 5] {
        if let Ok(c) = spec::parse_config(data, layers, "fuzz") {
            let rootfs = c.rootfs.as_ref().expect("parse_config checks rootfs");
            assert_eq!(rootfs.diff_ids.len(), layers);
            rootfs.diff_ids.iter().for_each(|d| check_digest(d));
        }
    }

    // As the image assembler and an OCI layout read it.
    let config = br#"{"rootfs":{"type":"layers","diff_ids":[]}}"#;
    cairn_image::fuzz_parse_image(data, config);
    let manifest = format!(
        r#"{{"schemaVersion":2,"config":{{"mediaType":"{}","digest":"{}","size":{}}},"layers":[]}}"#,
        mt::OCI_CONFIG,
        sha256(data),
        data.len()
    );
    cairn_image::fuzz_parse_image(manifest.as_bytes(), data);
    cairn_image::fuzz_layout_json(data);
});
