//! The documents of the image spec cairn reads: descriptors, image indexes
//! (and Docker manifest lists), image manifests (OCI and Docker schema 2)
//! and image configs.
//!
//! These are cairn's own structs rather than the `oci-spec` crate's image
//! types, for three reasons:
//!
//! - `oci-spec`'s `ImageConfiguration` requires `architecture` and `os`, and
//!   its manifest and index types hold media types as an enum that reads
//!   Docker schema 2 types as "other"; images in the wild (`docker save`
//!   archives, configs written by hand or by old tools) lack the former and
//!   registries serve the latter, and cairn reads both.
//! - Every check names what was wrong in cairn's terms: a digest is checked
//!   by [`crate::parse_digest`] (sha256 only, lower-case hex, the message
//!   quoting at most a bounded piece of a hostile string), not by a second
//!   parser with other rules and other messages.
//! - Only the fields cairn reads are here; a document's other fields are
//!   kept as the raw bytes it came in (the image record stores those), so
//!   nothing is lost by not modelling them.
//!
//! The structs are strict where cairn relies on a field: a descriptor
//! must have a `mediaType`, a `digest` and a non-negative `size`. A
//! digest is kept as the string the document holds and checked with
//! [`Descriptor::digest`] before anything is named by it. Parsing is pure:
//! no I/O. The size of a document is bounded before it is parsed (see
//! [`crate::limits`]).

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::digest::{Digest, DigestError};

/// The annotation an OCI layout's `index.json` names an image by.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// A content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    /// As the document has it; [`Descriptor::digest`] checks it.
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub urls: Vec<String>,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

impl Descriptor {
    /// The digest, checked by [`crate::parse_digest`].
    pub fn digest(&self) -> Result<Digest, DigestError> {
        Digest::parse(&self.digest)
    }

    /// The `org.opencontainers.image.ref.name` annotation, if any.
    pub fn ref_name(&self) -> Option<&str> {
        self.annotations
            .get(ANNOTATION_REF_NAME)
            .map(String::as_str)
    }
}

/// The platform an index entry states (the image spec's `platform`
/// object). Architectures are as the document spells them; matching
/// normalises them ([`crate::platform`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(rename = "os.version", default)]
    pub os_version: Option<String>,
    #[serde(default)]
    pub variant: Option<String>,
}

/// An image index (OCI) or manifest list (Docker).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ImageIndex {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default)]
    pub media_type: Option<String>,
    pub manifests: Vec<Descriptor>,
}

/// An image manifest (OCI or Docker schema 2).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ImageManifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default)]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// An image config: the parts cairn reads. `rootfs` is optional here
/// because `cairn run` reads the `config` of an image whose layers were
/// checked long ago; importing an image requires it
/// ([`ImageConfig::check_rootfs`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub created: Option<String>,
    #[serde(default)]
    pub architecture: Option<String>,
    #[serde(default)]
    pub os: Option<String>,
    #[serde(default)]
    pub variant: Option<String>,
    /// How to run the image (`null` reads as absent).
    #[serde(default)]
    pub config: Option<ExecConfig>,
    #[serde(default)]
    pub rootfs: Option<RootFs>,
}

/// The image config's `config` object: what a container of the image
/// runs, and as whom. Each field may be absent or `null`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExecConfig {
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub stop_signal: Option<String>,
}

/// The image config's `rootfs`: the layers' diff_ids, bottom first.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<String>,
}

/// Why an image config's `rootfs` does not fit its manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RootFsError {
    #[error("the config has no rootfs")]
    Missing,
    #[error("rootfs.type is {0:?}, expected \"layers\"")]
    Kind(String),
    #[error("rootfs.diff_ids has {diff_ids} entries but the manifest has {layers} layers")]
    Count { diff_ids: usize, layers: usize },
    #[error("rootfs.diff_ids[{index}]: {error}")]
    Digest { index: usize, error: DigestError },
}

impl ImageConfig {
    /// The `rootfs`, checked against a manifest of `layers` layers: of type
    /// `layers`, one diff_id per layer, each a digest cairn verifies.
    pub fn check_rootfs(&self, layers: usize) -> Result<&RootFs, RootFsError> {
        let rootfs = self.rootfs.as_ref().ok_or(RootFsError::Missing)?;
        if rootfs.kind != "layers" {
            return Err(RootFsError::Kind(rootfs.kind.clone()));
        }
        if rootfs.diff_ids.len() != layers {
            return Err(RootFsError::Count {
                diff_ids: rootfs.diff_ids.len(),
                layers,
            });
        }
        for (index, d) in rootfs.diff_ids.iter().enumerate() {
            crate::parse_digest(d).map_err(|error| RootFsError::Digest { index, error })?;
        }
        Ok(rootfs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn descriptors_need_type_digest_and_size() {
        let ok = format!(r#"{{"mediaType":"a","digest":"{D}","size":3}}"#);
        let d: Descriptor = serde_json::from_str(&ok).unwrap();
        assert_eq!(d.digest().unwrap().as_str(), D);
        for bad in [
            format!(r#"{{"digest":"{D}","size":3}}"#),
            r#"{"mediaType":"a","size":3}"#.to_string(),
            format!(r#"{{"mediaType":"a","digest":"{D}","size":-1}}"#),
        ] {
            assert!(serde_json::from_str::<Descriptor>(&bad).is_err(), "{bad}");
        }
        let upper: Descriptor = serde_json::from_str(&ok.replace("abcdef", "ABCDEF")).unwrap();
        assert!(upper.digest().is_err());
    }

    #[test]
    fn config_rootfs_and_exec() {
        let c: ImageConfig = serde_json::from_str(&format!(
            r#"{{"architecture":"amd64","config":{{"Cmd":["sh"],"User":null}},
               "rootfs":{{"type":"layers","diff_ids":["{D}"]}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.config.as_ref().unwrap().cmd.as_deref(),
            Some(&["sh".to_string()][..])
        );
        assert_eq!(c.check_rootfs(1).unwrap().diff_ids, [D]);
        assert_eq!(
            c.check_rootfs(2).unwrap_err().to_string(),
            "rootfs.diff_ids has 1 entries but the manifest has 2 layers"
        );
        let none: ImageConfig = serde_json::from_str(r#"{"config":null}"#).unwrap();
        assert_eq!(none.check_rootfs(0), Err(RootFsError::Missing));
    }
}
