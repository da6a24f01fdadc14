//! Commit: an active snapshot's directory becomes a layer in the store,
//! and its chain (the parent's layers and this one) an EROFS image.
//!
//! The directory's metadata is scanned as `cairn mkfs` scans a tree (no
//! file content is read at this step), the scanned tree is turned from
//! overlayfs's upper-directory form into the OCI layer form
//! (a whiteout character device 0:0 `NAME` becomes an entry `.wh.NAME`, a
//! directory with `trusted.overlay.opaque=y` gains a `.wh..wh..opq` entry,
//! overlayfs's own `trusted.overlay.*` attributes are dropped), and the
//! tree is streamed as a tar, each file read from the directory as it is
//! written, through the same layer importer `cairn import` and `cairn
//! pull` use, which digests and stores each file once. The layer record,
//! its diff_id and its objects are therefore exactly those an import of
//! that tar gives. The
//! chain image is then assembled as an import assembles an image, and a
//! ref keeps it (and so its layers and objects) alive for gc.

use std::fs::File;
use std::io;
use std::path::Path;

use cairn_erofs::tree::{InodeId, Tree, ROOT};
use cairn_erofs::Inode;
use cairn_image::{
    import_layer_with, scan_dir, write_tar_from, CheckedLayer, LayerInfo, Limits, ScanOptions,
    StagedImage, TarContents,
};
use cairn_spec::media_type as mt;
use cairn_spec::{sha256_digest, PlatformSpec};
use cairn_store::{Store, OPAQUE_MARKER, WHITEOUT_PREFIX};
use serde_json::json;

/// The xattr overlayfs marks an opaque directory of an upper layer with.
const OPAQUE_XATTR: &[u8] = b"trusted.overlay.opaque";
/// overlayfs's private xattrs, never part of a layer.
const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";

/// What a commit made.
#[derive(Debug, Clone)]
pub struct Committed {
    pub layer: LayerInfo,
    pub image: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("scanning {path}: {source}")]
    Scan {
        path: String,
        source: Box<cairn_image::ScanError>,
    },
    #[error("{0}")]
    Tree(String),
    #[error("importing the layer: {0}")]
    Layer(Box<cairn_image::LayerError>),
    #[error("{what}: {source}")]
    Store {
        what: &'static str,
        source: cairn_store::StoreError,
    },
}

/// Turns an overlayfs upper directory's tree into a layer's tree, in place.
pub fn upper_to_layer(tree: &mut Tree) -> Result<(), CommitError> {
    let mut dirs: Vec<InodeId> = vec![ROOT];
    while let Some(dir) = dirs.pop() {
        let opaque = tree
            .inode(dir)
            .xattrs
            .get(OPAQUE_XATTR)
            .is_some_and(|v| v == b"y");
        let entries: Vec<(Vec<u8>, InodeId, bool)> = tree
            .inode(dir)
            .entries()
            .map(|e| {
                e.iter()
                    .map(|(n, d)| (n.clone(), d.inode, d.hardlink))
                    .collect()
            })
            .unwrap_or_default();
        let mut whiteouts = Vec::new();
        for (name, ino, hardlink) in &entries {
            let inode = tree.inode(*ino);
            if inode.is_dir() && !*hardlink {
                dirs.push(*ino);
            } else if inode.is_whiteout() {
                whiteouts.push(name.clone());
            }
        }
        // overlayfs makes its whiteouts hard links of one shared inode:
        // each becomes a marker of its own.
        for name in whiteouts {
            if let cairn_erofs::InodeData::Directory(e) = &mut tree.inode_mut(dir).data {
                e.remove(&name);
            }
            let mut wh = WHITEOUT_PREFIX.to_vec();
            wh.extend_from_slice(&name);
            let ino = tree.push(Inode::new(libc::S_IFCHR).expect("a valid mode"));
            tree.add_child(dir, &wh, ino, false)
                .map_err(|e| CommitError::Tree(format!("whiteout of {:?}: {e}", lossy(&name))))?;
        }
        if opaque {
            let marker = tree.push(Inode::new(libc::S_IFREG | 0o644).expect("a valid mode"));
            tree.add_child(dir, OPAQUE_MARKER, marker, false)
                .map_err(|e| CommitError::Tree(format!("opaque marker: {e}")))?;
        }
    }
    for inode in &mut tree.inodes {
        inode
            .xattrs
            .retain(|k, _| !k.starts_with(OVERLAY_XATTR_PREFIX));
    }
    Ok(())
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Imports `dir` (a whole tree if `parent_chain` is empty, else an
/// overlayfs upper directory over that chain) as a layer, and assembles
/// the chain image. The caller holds the store's shared lock and sets the
/// ref.
pub fn commit_dir(
    store: &Store,
    dir: &Path,
    parent_chain: &[String],
) -> Result<Committed, CommitError> {
    // Metadata only: the tar writer reads each file from the directory
    // and the importer digests and stores it, once.
    let scan = ScanOptions {
        metadata_only: true,
        ..ScanOptions::default()
    };
    let (mut tree, _) = scan_dir(dir, &scan).map_err(|source| CommitError::Scan {
        path: dir.display().to_string(),
        source: Box::new(source),
    })?;
    upper_to_layer(&mut tree)?;
    let (reader, mut writer) = io::pipe().map_err(|e| CommitError::Tree(format!("pipe: {e}")))?;
    let (checked_tx, checked_rx) = std::sync::mpsc::channel::<CheckedLayer>();
    let (layer, staged) = std::thread::scope(|s| {
        let tree = &tree;
        let w = s.spawn(move || {
            let r = write_tar_from(tree, TarContents::Dir(dir), &mut writer);
            drop(writer);
            r
        });
        // The chain's image is written on its own thread while the layer's
        // last objects and its record are published, as a pull writes it.
        let stager = s.spawn(move || {
            checked_rx
                .recv()
                .ok()
                .map(|layer| stage_chain(store, parent_chain, Some(layer)))
        });
        let info = import_layer_with(
            store,
            reader,
            Some(mt::OCI_LAYER_TAR),
            None,
            None,
            &Limits::default(),
            &mut |layer: CheckedLayer| {
                // The receiver is there until this send or the end.
                let _ = checked_tx.send(layer);
            },
        );
        drop(checked_tx);
        let staged = stager.join().expect("staging the image does not panic");
        let written = w.join().expect("the tar writer does not panic");
        let layer = match (info, written) {
            (Ok(i), Ok(_)) => Ok(i),
            (Err(e), _) => Err(CommitError::Layer(Box::new(e))),
            (Ok(_), Err(e)) => Err(CommitError::Tree(format!("writing the layer's tar: {e}"))),
        };
        (layer, staged)
    });
    let layer = layer?;
    let staged = match staged {
        Some(staged) => staged?,
        None => {
            let mut chain = parent_chain.to_vec();
            chain.push(layer.diff_id.clone());
            stage_chain(store, &chain, None)?
        }
    };
    let image = staged
        .publish()
        .map_err(|e| CommitError::Layer(Box::new(e)))?
        .image_digest;
    Ok(Committed { layer, image })
}

/// Assembles the image of a chain of layers (all in the store), without a
/// name; returns its digest.
pub fn assemble_chain(store: &Store, chain: &[String]) -> Result<String, CommitError> {
    let img = stage_chain(store, chain, None)?
        .publish()
        .map_err(|e| CommitError::Layer(Box::new(e)))?;
    Ok(img.image_digest)
}

/// Writes the image of `chain` (in the store) and, if `top` is given, of
/// that layer above it (checked, not yet published: see
/// [`import_layer_with`]) into the store's staging area.
fn stage_chain<'s>(
    store: &'s Store,
    chain: &[String],
    top: Option<CheckedLayer>,
) -> Result<StagedImage<'s>, CommitError> {
    let mut chain = chain.to_vec();
    let mut entries: Vec<Option<File>> = chain.iter().map(|_| None).collect();
    let top_size = top.map(|l| {
        chain.push(l.diff_id);
        entries.push(Some(l.entries));
        l.size
    });
    let platform = PlatformSpec::host();
    let mut config = json!({
        "architecture": platform.architecture,
        "os": platform.os,
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": chain},
    });
    if let Some(v) = platform.variant {
        config["variant"] = json!(v);
    }
    let config = serde_json::to_vec(&config).expect("JSON values serialise");
    let mut layers = Vec::new();
    for (i, d) in chain.iter().enumerate() {
        if let (Some(size), true) = (top_size, i + 1 == chain.len()) {
            layers.push(json!({"mediaType": mt::OCI_LAYER_TAR, "digest": d, "size": size}));
            continue;
        }
        let rec = store
            .layer_record(d)
            .map_err(|source| CommitError::Store {
                what: "reading a layer record",
                source,
            })?
            .ok_or_else(|| CommitError::Tree(format!("layer {d} is not in the store")))?;
        layers.push(json!({"mediaType": mt::OCI_LAYER_TAR, "digest": d, "size": rec.size}));
    }
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": mt::OCI_MANIFEST,
        "config": {"mediaType": mt::OCI_CONFIG, "digest": sha256_digest(&config), "size": config.len()},
        "layers": layers,
    }))
    .expect("JSON values serialise");
    StagedImage::stage(
        store,
        &manifest,
        &config,
        None,
        Some("cairn snapshotter"),
        entries,
    )
    .map_err(|e| CommitError::Layer(Box::new(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn whiteouts_and_opaque_dirs_become_oci_markers() {
        let mut t = Tree::new(Inode::new(libc::S_IFDIR | 0o755).unwrap()).unwrap();
        let d = t.push(Inode::new(libc::S_IFDIR | 0o755).unwrap());
        t.inode_mut(d).xattrs = BTreeMap::from([
            (OPAQUE_XATTR.to_vec(), b"y".to_vec()),
            (b"user.keep".to_vec(), b"1".to_vec()),
        ]);
        t.add_child(ROOT, b"d", d, false).unwrap();
        let w = t.push(Inode::new(libc::S_IFCHR).unwrap());
        t.add_child(ROOT, b"gone", w, false).unwrap();
        t.inode_mut(w).nlink = 2;
        t.add_child(d, b"gone2", w, true).unwrap();
        let f = t.push(Inode::new(libc::S_IFREG | 0o644).unwrap());
        t.inode_mut(f)
            .xattrs
            .insert(b"trusted.overlay.origin".to_vec(), b"x".to_vec());
        t.add_child(d, b"f", f, false).unwrap();
        upper_to_layer(&mut t).unwrap();
        assert!(t.lookup(b"gone").is_none());
        assert!(t.inode(t.lookup(b".wh.gone").unwrap()).is_whiteout());
        assert!(t.lookup(b"d/.wh..wh..opq").is_some());
        let w2 = t.lookup(b"d/.wh.gone2").unwrap();
        assert!(t.inode(w2).is_whiteout());
        assert_eq!(t.inode(w2).nlink, 1);
        assert!(t.lookup(b"d/gone2").is_none());
        assert!(t.lookup(b"d/f").is_some());
        let keys: Vec<_> = t.inode(d).xattrs.keys().cloned().collect();
        assert_eq!(keys, vec![b"user.keep".to_vec()]);
        assert!(t.inode(f).xattrs.is_empty());
    }
}
