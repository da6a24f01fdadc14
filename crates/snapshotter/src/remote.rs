//! The remote-snapshotter path: a Prepare that carries the labels
//! containerd's CRI image handler puts on each layer
//! (`containerd.io/snapshot/cri.image-ref`, `cri.layer-digest`, …) and the
//! unpacker's target name (`containerd.io/snapshot.ref`) is answered by
//! cairn pulling the image itself, through its own registry client and
//! with the credentials `cairn pull` uses, and committing the layer's
//! snapshot under the target name; containerd then neither fetches nor
//! unpacks that layer (docs/snapshotter.md, "The remote path").

use std::collections::HashMap;

use cairn_oci::{ImageRef, PullOptions};
use cairn_store::Store;

/// The unpacker's label: the name the snapshot will be committed as (the
/// layer's chain ID).
pub const TARGET_REF: &str = "containerd.io/snapshot.ref";
/// The CRI plugin's labels (`pkg/snapshotters` in containerd).
pub const IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
pub const LAYER_DIGEST: &str = "containerd.io/snapshot/cri.layer-digest";
pub const MANIFEST_DIGEST: &str = "containerd.io/snapshot/cri.manifest-digest";

/// What a remote Prepare asks for.
#[derive(Debug, Clone)]
pub struct RemoteRequest {
    pub target: String,
    pub image_ref: String,
    pub layer_digest: String,
    pub manifest_digest: Option<String>,
}

impl RemoteRequest {
    /// The request in `labels`, if they carry one.
    pub fn from_labels(labels: &HashMap<String, String>) -> Option<RemoteRequest> {
        Some(RemoteRequest {
            target: labels.get(TARGET_REF)?.clone(),
            image_ref: labels.get(IMAGE_REF)?.clone(),
            layer_digest: labels.get(LAYER_DIGEST)?.clone(),
            manifest_digest: labels.get(MANIFEST_DIGEST).cloned(),
        })
    }
}

/// A layer pulled for a remote Prepare: its diff_id and the chain from the
/// bottom layer to it.
#[derive(Debug, Clone)]
pub struct Pulled {
    pub diff_id: String,
    pub chain: Vec<String>,
}

/// Pulls the image `req` names into `store` (layers the store has are not
/// fetched again) and returns the chain of the layer `req.layer_digest`,
/// checked against `parent_chain` (the chain of the Prepare's parent).
/// Every error says why the remote path was not taken.
pub fn pull_layer(
    store: &Store,
    req: &RemoteRequest,
    parent_chain: &[String],
) -> Result<Pulled, String> {
    let reference = ImageRef::parse(&req.image_ref)
        .map_err(|e| format!("image ref {:?}: {e}", req.image_ref))?;
    let opts = PullOptions {
        name: None,
        ..PullOptions::default()
    };
    let report = cairn_oci::pull(store, &reference, &opts, &|_: &cairn_oci::PullEvent<'_>| {})
        .map_err(|e| format!("pulling {}: {e}", req.image_ref))?;
    if let Some(m) = &req.manifest_digest {
        if *m != report.manifest_digest {
            return Err(format!(
                "{} resolved to manifest {}, containerd pulls {m}",
                req.image_ref, report.manifest_digest
            ));
        }
    }
    let i = report
        .layers
        .iter()
        .position(|l| l.digest == req.layer_digest)
        .ok_or_else(|| {
            format!(
                "{} (manifest {}) has no layer {}",
                req.image_ref, report.manifest_digest, req.layer_digest
            )
        })?;
    let chain: Vec<String> = report.layers[..=i]
        .iter()
        .map(|l| l.diff_id.clone())
        .collect();
    if chain[..i] != *parent_chain {
        return Err(format!(
            "layer {} of {} does not sit on the parent snapshot's chain",
            req.layer_digest, req.image_ref
        ));
    }
    Ok(Pulled {
        diff_id: chain[i].clone(),
        chain,
    })
}
