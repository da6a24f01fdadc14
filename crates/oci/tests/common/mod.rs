//! Test helpers for cairn-oci: a real registry fixture, a scriptable fake
//! registry, a small image to serve from it, and store snapshots.
#![allow(dead_code)]

pub mod fake;
pub mod registry;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cairn_oci::{ClientOptions, PullOptions};
use fake::{Reply, Request};
use registry::{sha256, tar_of};

/// Client options for tests: short timeouts and backoff, no auth files
/// from the environment.
pub fn test_client() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(1),
        max_attempts: 3,
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        auth_files: Vec::new(),
        ..ClientOptions::default()
    }
}

pub fn test_pull_options() -> PullOptions {
    PullOptions {
        client: test_client(),
        ..PullOptions::default()
    }
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// A two-layer image (gzip layers) to serve from a [`fake::FakeServer`].
#[derive(Clone)]
pub struct FakeImage {
    pub repo: String,
    pub tag: String,
    /// (blob digest, blob, diff_id)
    pub layers: Vec<(String, Vec<u8>, String)>,
    pub config: Vec<u8>,
    pub config_digest: String,
    pub manifest: Vec<u8>,
    pub manifest_digest: String,
    pub layer_media_type: &'static str,
}

impl FakeImage {
    /// Two gzip layers.
    pub fn new() -> FakeImage {
        Self::with_compression(true)
    }

    /// Two layers, gzip-compressed or plain tar.
    pub fn with_compression(gzipped: bool) -> FakeImage {
        let big: Vec<u8> = (0..300_000u32)
            .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
            .collect();
        let tars = [
            tar_of(&[
                ("etc/", None),
                ("etc/hostname", Some(b"fake\n")),
                ("data.bin", Some(&big)),
            ]),
            tar_of(&[("hello", Some(b"hello from the fake registry\n"))]),
        ];
        let layers: Vec<_> = tars
            .iter()
            .map(|t| {
                let blob = if gzipped { gzip(t) } else { t.clone() };
                (sha256(&blob), blob, sha256(t))
            })
            .collect();
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": cairn_oci::PlatformSpec::host().architecture,
            "os": "linux",
            "config": {"Cmd": ["/hello"]},
            "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.2.clone()).collect::<Vec<_>>()},
        }))
        .unwrap();
        let mut img = FakeImage {
            repo: "img".into(),
            tag: "v1".into(),
            layers,
            config_digest: sha256(&config),
            config,
            manifest: Vec::new(),
            manifest_digest: String::new(),
            layer_media_type: if gzipped {
                "application/vnd.oci.image.layer.v1.tar+gzip"
            } else {
                "application/vnd.oci.image.layer.v1.tar"
            },
        };
        img.rebuild_manifest(|_| {});
        img
    }

    /// Rewrites the config's diff_ids from the layers, then the config's
    /// digest and the manifest: after the layers were changed.
    pub fn rebuild_config(&mut self) {
        let diff_ids: Vec<String> = self.layers.iter().map(|l| l.2.clone()).collect();
        let mut config: serde_json::Value = serde_json::from_slice(&self.config).unwrap();
        config["rootfs"]["diff_ids"] = serde_json::json!(diff_ids);
        self.config = serde_json::to_vec(&config).unwrap();
        self.config_digest = sha256(&self.config);
        self.rebuild_manifest(|_| {});
    }

    /// Rewrites the manifest (after `edit` of its JSON) and its digest.
    pub fn rebuild_manifest(&mut self, edit: impl FnOnce(&mut serde_json::Value)) {
        let mut m = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": self.config_digest, "size": self.config.len()},
            "layers": self.layers.iter().map(|(d, b, _)| serde_json::json!({
                "mediaType": self.layer_media_type, "digest": d, "size": b.len()
            })).collect::<Vec<_>>(),
        });
        edit(&mut m);
        self.manifest = serde_json::to_vec(&m).unwrap();
        self.manifest_digest = sha256(&self.manifest);
    }

    pub fn blob(&self, digest: &str) -> Option<&[u8]> {
        if digest == self.config_digest {
            return Some(&self.config);
        }
        self.layers
            .iter()
            .find(|l| l.0 == digest)
            .map(|l| l.1.as_slice())
    }

    pub fn reference(&self, addr: &str) -> String {
        format!("{addr}/{}:{}", self.repo, self.tag)
    }

    /// The well-behaved answer to `req`.
    pub fn serve(&self, req: &Request) -> Reply {
        let p = req.path.as_str();
        if p == "/v2/" {
            return Reply::status(200, "{}");
        }
        let Some(rest) = p.strip_prefix(&format!("/v2/{}/", self.repo)) else {
            return Reply::error(404, "NAME_UNKNOWN", "repository name not known to registry");
        };
        if let Some(r) = rest.strip_prefix("manifests/") {
            if r == self.tag || r == self.manifest_digest {
                return Reply::ok(OCI_MANIFEST, self.manifest.clone())
                    .with_header("Docker-Content-Digest", &self.manifest_digest);
            }
            return Reply::error(404, "MANIFEST_UNKNOWN", "manifest unknown");
        }
        if let Some(d) = rest.strip_prefix("blobs/") {
            let Some(blob) = self.blob(d) else {
                return Reply::error(404, "BLOB_UNKNOWN", "blob unknown to registry");
            };
            return serve_range(req, blob);
        }
        Reply::error(404, "NOT_FOUND", "no such route")
    }
}

/// Serves `blob`, honouring `Range: bytes=N-`.
pub fn serve_range(req: &Request, blob: &[u8]) -> Reply {
    if let Some(from) = req
        .header("Range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok())
    {
        if from < blob.len() {
            return Reply::Full(
                206,
                vec![(
                    "Content-Range".into(),
                    format!("bytes {from}-{}/{}", blob.len() - 1, blob.len()),
                )],
                blob[from..].to_vec(),
            );
        }
    }
    Reply::ok("application/octet-stream", blob.to_vec())
}

/// Every path under the store's published directories (objects, images,
/// layers, refs), sorted.
pub fn store_snapshot(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in ["objects", "images", "layers", "refs"] {
        walk(&root.join(dir), root, &mut out);
    }
    out.sort();
    out
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        out.push(p.strip_prefix(root).unwrap().to_path_buf());
        if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            walk(&p, root, out);
        }
    }
}

/// What is left under `tmp/` once a new Store has opened (and cleaned) it.
pub fn tmp_after_reopen(root: &Path) -> Vec<String> {
    let store = cairn_store::Store::open(root).unwrap();
    let left = std::fs::read_dir(store.tmp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    drop(store);
    left
}
