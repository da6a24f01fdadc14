//! Reading back what `cairn push` published: the artifact manifest as the
//! registry serves it, and its pack layers.

use serde_json::Value;

use super::registry::LocalRegistry;

/// The manifest `reference` (tag or digest) of `repo` as the registry
/// serves it: its bytes and Content-Type.
pub fn served_manifest(reg: &LocalRegistry, repo: &str, reference: &str) -> (Vec<u8>, String) {
    let resp = ureq::get(&format!(
        "http://{}/v2/{repo}/manifests/{reference}",
        reg.addr
    ))
    .set("Accept", "application/vnd.oci.image.manifest.v1+json")
    .call()
    .unwrap();
    let content_type = resp.header("Content-Type").unwrap_or_default().to_string();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut bytes).unwrap();
    (bytes, content_type)
}

/// (digest, size) of each pack layer of an artifact manifest, in order.
pub fn pack_layers(manifest: &Value) -> Vec<(String, u64)> {
    manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["mediaType"] == "application/vnd.cairn.lazy.v1.pack")
        .map(|l| {
            (
                l["digest"].as_str().unwrap().to_string(),
                l["size"].as_u64().unwrap(),
            )
        })
        .collect()
}
