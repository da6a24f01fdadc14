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

/// Pulls the image `req` names into `store` in full (layers the store has
/// are not fetched again), unnamed, and places `req.layer_digest` in it,
/// checked against `parent_chain` (the chain of the Prepare's parent): the
/// pulled image is the whole image's tree, which is the top layer's chain.
/// Every error says why the remote path was not taken.
pub fn pull_layer(
    store: &Store,
    req: &RemoteRequest,
    parent_chain: &[String],
) -> Result<LazyPulled, String> {
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
    Ok(LazyPulled {
        diff_id: chain[i].clone(),
        chain,
        image: report.image_digest,
        manifest_digest: report.manifest_digest,
        top: i + 1 == report.layers.len(),
        objects: 0,
        object_bytes: 0,
    })
}

/// A layer placed in a whole image pulled for it: the whole image's EROFS
/// image (incomplete if pulled lazily), and the layer's place in it.
#[derive(Debug, Clone)]
pub struct LazyPulled {
    pub diff_id: String,
    pub chain: Vec<String>,
    /// The whole image's EROFS image (hex sha256).
    pub image: String,
    pub manifest_digest: String,
    /// The layer is the image's top layer: `image` is its chain's tree.
    pub top: bool,
    pub objects: u64,
    pub object_bytes: u64,
}

/// Pulls the metadata of the image `req` names lazily, as `cairn pull
/// --lazy` does (its cairn artifact, found through the referrers API or the
/// referrers tag schema), and places `req.layer_digest` in it, checked
/// against `parent_chain`. An error says why not (no artifact, a manifest
/// other than containerd's, …): the caller then pulls in full.
pub fn pull_layer_lazy(
    store: &Store,
    req: &RemoteRequest,
    parent_chain: &[String],
) -> Result<LazyPulled, String> {
    let mut reference = ImageRef::parse(&req.image_ref)
        .map_err(|e| format!("image ref {:?}: {e}", req.image_ref))?;
    // Pinned to the manifest containerd unpacks: fetched by digest, and
    // its referrers asked for at once, while it is read (see
    // `cairn_remote::pull_lazy`). A reference with a digest of its own
    // keeps it (a mismatch is refused below, as for any other).
    if reference.digest.is_none() {
        if let Some(d) = req
            .manifest_digest
            .as_deref()
            .and_then(|m| cairn_oci::Digest::parse(m).ok())
        {
            reference.digest = Some(d);
        }
    }
    // Metadata only: Prepare answers once the image is in; the chain
    // mount's lazy server fetches the prefetch list in the background
    // (docs/snapshotter.md, "The lazy remote path").
    let opts = cairn_remote::LazyPullOptions {
        name: None,
        prefetch: false,
        ..cairn_remote::LazyPullOptions::default()
    };
    let report = cairn_remote::pull_lazy(store, &reference, &opts)
        .map_err(|e| format!("lazy pull of {}: {e}", req.image_ref))?;
    place_layer(
        store,
        &report.image_digest,
        &report.manifest_digest,
        req,
        parent_chain,
    )
}

/// Places `req.layer_digest` in the image `image` of the store, pulled
/// (lazily or in full) from the manifest `manifest_digest` (no network):
/// by the image record's manifest and config, checked against
/// `parent_chain`. The layers above the first of an image use it with the
/// image their parent snapshot names, so that only the first layer's
/// Prepare pulls.
pub fn place_layer(
    store: &Store,
    image: &str,
    manifest_digest: &str,
    req: &RemoteRequest,
    parent_chain: &[String],
) -> Result<LazyPulled, String> {
    if let Some(m) = &req.manifest_digest {
        if m != manifest_digest {
            return Err(format!(
                "{} resolved to manifest {manifest_digest}, containerd pulls {m}",
                req.image_ref
            ));
        }
    }
    let rec = store
        .image_record(image)
        .map_err(|e| format!("reading image {image}: {e}"))?
        .filter(|_| store.has_image(image))
        .ok_or_else(|| format!("image {image} is not in the store"))?;
    if rec.manifest_digest != manifest_digest {
        // The store had the same tree from another image: its record names
        // that image's manifest, not this one's layers.
        return Err(format!(
            "image {image} is recorded for manifest {}, not {manifest_digest}",
            rec.manifest_digest
        ));
    }
    let (objects, object_bytes) = rec
        .lazy
        .as_ref()
        .map_or((0, rec.content_size), |l| (l.objects, l.object_bytes));
    let (layers, diff_ids) = layers_of(&rec.manifest, &rec.config)
        .map_err(|e| format!("manifest {} of {}: {e}", rec.manifest_digest, req.image_ref))?;
    let i = layers
        .iter()
        .position(|l| *l == req.layer_digest)
        .ok_or_else(|| {
            format!(
                "{} (manifest {manifest_digest}) has no layer {}",
                req.image_ref, req.layer_digest
            )
        })?;
    let chain = diff_ids[..=i].to_vec();
    if chain[..i] != *parent_chain {
        return Err(format!(
            "layer {} of {} does not sit on the parent snapshot's chain",
            req.layer_digest, req.image_ref
        ));
    }
    Ok(LazyPulled {
        diff_id: chain[i].clone(),
        chain,
        image: image.to_owned(),
        manifest_digest: manifest_digest.to_owned(),
        top: i + 1 == layers.len(),
        objects,
        object_bytes,
    })
}

/// The layer digests of a manifest and the diff_ids of its config, as many
/// of each, every one a digest.
fn layers_of(manifest: &str, config: &str) -> Result<(Vec<String>, Vec<String>), String> {
    let m: serde_json::Value =
        serde_json::from_str(manifest).map_err(|e| format!("the manifest: {e}"))?;
    let c: serde_json::Value =
        serde_json::from_str(config).map_err(|e| format!("the config: {e}"))?;
    let strings = |v: Option<&Vec<serde_json::Value>>,
                   what: &str,
                   f: &dyn Fn(&serde_json::Value) -> Option<String>| {
        v.ok_or_else(|| format!("no {what}"))?
            .iter()
            .map(|x| {
                f(x).filter(|s| cairn_spec::parse_digest(s).is_ok())
                    .ok_or_else(|| format!("a {what} entry that is not a digest"))
            })
            .collect::<Result<Vec<String>, String>>()
    };
    let layers = strings(m["layers"].as_array(), "layers", &|x| {
        x["digest"].as_str().map(str::to_owned)
    })?;
    let diff_ids = strings(
        c["rootfs"]["diff_ids"].as_array(),
        "rootfs.diff_ids",
        &|x| x.as_str().map(str::to_owned),
    )?;
    if layers.len() != diff_ids.len() || layers.is_empty() {
        return Err(format!(
            "{} layers and {} diff_ids",
            layers.len(),
            diff_ids.len()
        ));
    }
    Ok((layers, diff_ids))
}

/// Pulls the image `image_ref` in full (layers the store has are not
/// fetched again), unnamed, and checks that it is still the manifest
/// `manifest_digest`: the layer records of a lazily pulled chain.
pub fn pull_full(store: &Store, image_ref: &str, manifest_digest: &str) -> Result<(), String> {
    let reference =
        ImageRef::parse(image_ref).map_err(|e| format!("image ref {image_ref:?}: {e}"))?;
    let opts = PullOptions {
        name: None,
        ..PullOptions::default()
    };
    let report = cairn_oci::pull(store, &reference, &opts, &|_: &cairn_oci::PullEvent<'_>| {})
        .map_err(|e| format!("pulling {image_ref}: {e}"))?;
    if report.manifest_digest != manifest_digest {
        return Err(format!(
            "{image_ref} resolves to manifest {} now, the snapshot was pulled from {manifest_digest}",
            report.manifest_digest
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::layers_of;

    #[test]
    fn layers_of_checks_what_it_reads() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let m = serde_json::json!({"layers": [{"digest": d('a')}, {"digest": d('b')}]}).to_string();
        let c = serde_json::json!({"rootfs": {"diff_ids": [d('1'), d('2')]}}).to_string();
        let (l, i) = layers_of(&m, &c).unwrap();
        assert_eq!(l, vec![d('a'), d('b')]);
        assert_eq!(i, vec![d('1'), d('2')]);
        let short = serde_json::json!({"rootfs": {"diff_ids": [d('1')]}}).to_string();
        assert!(layers_of(&m, &short)
            .unwrap_err()
            .contains("2 layers and 1 diff_ids"));
        let bad = serde_json::json!({"layers": [{"digest": "sha256:x"}]}).to_string();
        assert!(layers_of(&bad, &short)
            .unwrap_err()
            .contains("not a digest"));
        assert!(layers_of("{", &c).unwrap_err().contains("the manifest"));
        assert!(layers_of(&m, "{}")
            .unwrap_err()
            .contains("no rootfs.diff_ids"));
    }
}
