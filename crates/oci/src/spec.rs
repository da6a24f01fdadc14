//! Reading the image spec's documents as a registry serves them: which
//! media type a manifest response is, refusing schema 1 and unknown types,
//! and the checks a pull needs on a config. The types, media types, limits
//! and digest rules are `cairn-spec`'s (re-exported here); this module adds
//! what depends on a registry (Content-Type headers) and says it in
//! [`PullError`]s. Parsing is pure: no I/O.

pub use cairn_spec::image::{Descriptor, ImageConfig, ImageIndex, ImageManifest, Platform};
pub use cairn_spec::limits::{MAX_CONFIG_SIZE, MAX_LAYERS, MAX_MANIFEST_SIZE};
pub use cairn_spec::media_type;
pub use cairn_spec::Compression;

use crate::digest::Digest;
use crate::PullError;

use media_type as mt;

/// The digest of `descriptor`, checked; `what` names whose it is.
pub fn descriptor_digest(descriptor: &Descriptor, what: &str) -> Result<Digest, PullError> {
    descriptor.digest().map_err(|e| PullError::Invalid {
        what: what.to_string(),
        detail: format!("descriptor digest: {e}"),
    })
}

/// A parsed manifest document: what `GET /v2/<name>/manifests/<ref>` serves.
#[derive(Debug, Clone)]
pub enum Manifest {
    Index(ImageIndex),
    Image(ImageManifest),
}

/// The compression of a layer of media type `media_type`, or an error for
/// anything that is not a tar layer.
pub fn layer_compression(media_type: &str, what: &str) -> Result<Compression, PullError> {
    Compression::of_layer(media_type).ok_or_else(|| PullError::UnsupportedMediaType {
        what: what.to_string(),
        media_type: media_type.to_string(),
        hint: "layers must be tar, tar+gzip or tar+zstd".to_string(),
    })
}

fn invalid(what: &str, detail: impl Into<String>) -> PullError {
    PullError::Invalid {
        what: what.to_string(),
        detail: detail.into(),
    }
}

/// Parses a manifest document served with `content_type`. The media type is
/// the document's own `mediaType` when it has one (the OCI spec asks for it),
/// else the Content-Type; with neither, the shape decides. Schema 1 and
/// unknown types are refused.
pub fn parse_manifest(
    bytes: &[u8],
    content_type: Option<&str>,
    what: &str,
) -> Result<(String, Manifest), PullError> {
    parse_manifest_declared(bytes, content_type, what).map(|(_, t, m)| (t, m))
}

/// Parses a manifest or index that `descriptor` (an index entry) names:
/// the descriptor's media type must be a manifest or index type, and a
/// `mediaType` the document declares must be the same (the image spec:
/// content whose type contradicts its descriptor is not to be trusted).
/// Without one, the descriptor's type decides how the bytes are read.
pub fn parse_manifest_for(
    bytes: &[u8],
    descriptor: &Descriptor,
    what: &str,
) -> Result<(String, Manifest), PullError> {
    check_manifest_media_type(&descriptor.media_type, what)?;
    let (declared, media_type, manifest) =
        parse_manifest_declared(bytes, Some(&descriptor.media_type), what)?;
    if let Some(declared) = declared {
        if declared != descriptor.media_type {
            return Err(PullError::MediaTypeMismatch {
                what: what.to_string(),
                descriptor: descriptor.media_type.clone(),
                content: declared,
            });
        }
    }
    Ok((media_type, manifest))
}

/// Checks that an index entry names a manifest or an index.
pub fn check_manifest_media_type(media_type: &str, what: &str) -> Result<(), PullError> {
    match media_type {
        t if mt::DocKind::of(t).is_some() => Ok(()),
        t if mt::is_schema1(t) => Err(PullError::Schema1 {
            what: what.to_string(),
        }),
        other => Err(PullError::UnsupportedMediaType {
            what: what.to_string(),
            media_type: other.to_string(),
            hint: "an index entry must name an OCI image index or manifest, or a Docker \
                   schema 2 manifest or manifest list"
                .to_string(),
        }),
    }
}

/// [`parse_manifest`], also returning the `mediaType` the document
/// declares itself, if any.
fn parse_manifest_declared(
    bytes: &[u8],
    content_type: Option<&str>,
    what: &str,
) -> Result<(Option<String>, String, Manifest), PullError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| invalid(what, format!("not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| invalid(what, "not a JSON object"))?;
    let schema = obj.get("schemaVersion").and_then(|v| v.as_u64());
    let declared = match obj.get("mediaType") {
        Some(serde_json::Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(invalid(what, "mediaType is not a string")),
        None => None,
    };
    let header = content_type.map(mt::bare).filter(|s| !s.is_empty());
    if schema == Some(1)
        || [declared, header]
            .iter()
            .flatten()
            .any(|t| mt::is_schema1(t))
    {
        return Err(PullError::Schema1 {
            what: what.to_string(),
        });
    }
    if schema != Some(2) {
        return Err(invalid(
            what,
            format!(
                "schemaVersion is {:?}, expected 2",
                obj.get("schemaVersion")
            ),
        ));
    }
    let media_type = match (declared, header) {
        (Some(d), _) => d.to_string(),
        // Registries that know no better say application/json or octet-stream.
        (None, Some(h)) if h.starts_with("application/vnd.") => h.to_string(),
        _ if obj.contains_key("manifests") => mt::OCI_INDEX.to_string(),
        _ if obj.contains_key("config") && obj.contains_key("layers") => {
            mt::OCI_MANIFEST.to_string()
        }
        _ => {
            return Err(invalid(
                what,
                "no mediaType, and neither an index nor a manifest by its fields",
            ))
        }
    };
    let declared = declared.map(str::to_string);
    let manifest = match media_type.as_str() {
        mt::OCI_INDEX | mt::DOCKER_MANIFEST_LIST => Manifest::Index(
            serde_json::from_value(value).map_err(|e| invalid(what, e.to_string()))?,
        ),
        mt::OCI_MANIFEST | mt::DOCKER_MANIFEST => {
            let m: ImageManifest = serde_json::from_value(value).map_err(|e| invalid(what, e.to_string()))?;
            if m.layers.len() > MAX_LAYERS {
                return Err(invalid(what, format!("{} layers (at most {MAX_LAYERS})", m.layers.len())));
            }
            Manifest::Image(m)
        }
        other => {
            return Err(PullError::UnsupportedMediaType {
                what: what.to_string(),
                media_type: other.to_string(),
                hint: "expected an OCI image index or manifest, or a Docker schema 2 manifest or manifest list"
                    .to_string(),
            })
        }
    };
    Ok((declared, media_type, manifest))
}

/// Checks that a config descriptor names an image config.
pub fn check_config_media_type(media_type: &str, what: &str) -> Result<(), PullError> {
    match media_type {
        t if mt::is_image_config(t) => Ok(()),
        other => Err(PullError::UnsupportedMediaType {
            what: what.to_string(),
            media_type: other.to_string(),
            hint:
                "not a container image (an OCI artifact?): expected an OCI or Docker image config"
                    .to_string(),
        }),
    }
}

/// Parses an image config and checks its `rootfs` against the manifest's
/// layer count.
pub fn parse_config(bytes: &[u8], layers: usize, what: &str) -> Result<ImageConfig, PullError> {
    let config: ImageConfig =
        serde_json::from_slice(bytes).map_err(|e| invalid(what, e.to_string()))?;
    config
        .check_rootfs(layers)
        .map_err(|e| invalid(what, e.to_string()))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn manifest(media_type: &str) -> String {
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{media_type}",
               "config":{{"mediaType":"{}","digest":"{D}","size":2}},
               "layers":[{{"mediaType":"{}","digest":"{D}","size":3}}]}}"#,
            mt::OCI_CONFIG,
            mt::OCI_LAYER_GZIP
        )
    }

    #[test]
    fn manifests_by_media_type() {
        let (t, m) = parse_manifest(manifest(mt::OCI_MANIFEST).as_bytes(), None, "m").unwrap();
        assert_eq!(t, mt::OCI_MANIFEST);
        assert!(matches!(m, Manifest::Image(ref i) if i.layers.len() == 1));
        let (t, _) = parse_manifest(
            manifest(mt::DOCKER_MANIFEST).as_bytes(),
            Some("text/plain"),
            "m",
        )
        .unwrap();
        assert_eq!(t, mt::DOCKER_MANIFEST);
        // No mediaType in the body: the header decides, then the shape.
        let body = manifest(mt::OCI_MANIFEST)
            .replace(&format!(r#""mediaType":"{}","#, mt::OCI_MANIFEST), "");
        let (t, _) = parse_manifest(
            body.as_bytes(),
            Some(&format!("{}; charset=utf-8", mt::DOCKER_MANIFEST)),
            "m",
        )
        .unwrap();
        assert_eq!(t, mt::DOCKER_MANIFEST);
        let (t, _) = parse_manifest(body.as_bytes(), Some("application/json"), "m").unwrap();
        assert_eq!(t, mt::OCI_MANIFEST);
        let idx = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"{}","digest":"{D}","size":1}}]}}"#,
            mt::OCI_MANIFEST
        );
        let (t, m) = parse_manifest(idx.as_bytes(), None, "m").unwrap();
        assert_eq!(t, mt::OCI_INDEX);
        assert!(matches!(m, Manifest::Index(ref i) if i.manifests.len() == 1));
    }

    #[test]
    fn refuses_schema1_unknown_and_malformed() {
        let e =
            parse_manifest(br#"{"schemaVersion":1,"name":"x"}"#, None, "manifest x").unwrap_err();
        assert!(e.to_string().contains("schema 1"), "{e}");
        let e = parse_manifest(
            manifest("application/vnd.example+json").as_bytes(),
            None,
            "manifest x",
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("unsupported media type \"application/vnd.example+json\""),
            "{e}"
        );
        for bad in [
            &b"not json"[..],
            b"[]",
            br#"{"schemaVersion":3}"#,
            br#"{"schemaVersion":2,"mediaType":7}"#,
            br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","layers":[]}"#,
            br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"x","digest":"d","size":-1},"layers":[]}"#,
        ] {
            assert!(parse_manifest(bad, None, "m").is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn manifests_named_by_a_descriptor() {
        let desc = |media_type: &str| Descriptor {
            media_type: media_type.into(),
            digest: D.into(),
            size: 1,
            urls: vec![],
            platform: None,
            annotations: Default::default(),
        };
        let oci = manifest(mt::OCI_MANIFEST);
        let (t, _) = parse_manifest_for(oci.as_bytes(), &desc(mt::OCI_MANIFEST), "m").unwrap();
        assert_eq!(t, mt::OCI_MANIFEST);
        let e = parse_manifest_for(oci.as_bytes(), &desc(mt::DOCKER_MANIFEST), "m").unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "m: media type mismatch: the descriptor says {:?}, the content says {:?}",
                mt::DOCKER_MANIFEST,
                mt::OCI_MANIFEST
            )
        );
        // Without a mediaType of its own, the descriptor's decides.
        let bare = oci.replace(&format!(r#""mediaType":"{}","#, mt::OCI_MANIFEST), "");
        let (t, _) = parse_manifest_for(bare.as_bytes(), &desc(mt::DOCKER_MANIFEST), "m").unwrap();
        assert_eq!(t, mt::DOCKER_MANIFEST);
        assert!(parse_manifest_for(bare.as_bytes(), &desc(mt::OCI_INDEX), "m").is_err());
        let e = parse_manifest_for(oci.as_bytes(), &desc(mt::OCI_LAYER_GZIP), "m").unwrap_err();
        assert!(e.to_string().contains("unsupported media type"), "{e}");
    }

    #[test]
    fn layer_types() {
        assert_eq!(
            layer_compression(mt::DOCKER_LAYER_GZIP, "l").unwrap(),
            Compression::Gzip
        );
        assert_eq!(
            layer_compression(mt::OCI_LAYER_ZSTD, "l").unwrap(),
            Compression::Zstd
        );
        assert_eq!(
            layer_compression(mt::OCI_LAYER_TAR, "l").unwrap(),
            Compression::None
        );
        assert!(layer_compression("application/vnd.oci.image.layer.v1.tar+bzip2", "l").is_err());
    }

    #[test]
    fn config_rootfs_checked() {
        let c = format!(
            r#"{{"architecture":"amd64","os":"linux","rootfs":{{"type":"layers","diff_ids":["{D}"]}}}}"#
        );
        assert!(parse_config(c.as_bytes(), 1, "c").is_ok());
        let e = parse_config(c.as_bytes(), 2, "c").unwrap_err();
        assert!(
            e.to_string()
                .contains("rootfs.diff_ids has 1 entries but the manifest has 2 layers"),
            "{e}"
        );
        assert!(parse_config(br#"{"rootfs":{"type":"layers","diff_ids":["x"]}}"#, 1, "c").is_err());
        assert!(parse_config(br#"{"rootfs":{"type":"other","diff_ids":[]}}"#, 0, "c").is_err());
    }
}
