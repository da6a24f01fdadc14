//! Helpers for the layer tests: build tar layers (with the `tar` crate,
//! raw headers where a case needs bytes no well-behaved writer makes),
//! import them, assemble images and look at the result.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use cairn_erofs::tree::{InodeData, Tree};
use cairn_erofs::Inode;
use cairn_image::{assemble_image, import_layer, ImportedImage, LayerError, LayerInfo, Limits};
use cairn_store::Store;
use sha2::{Digest, Sha256};
use tar::{EntryType, Header};

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// A layer under construction.
pub struct Layer {
    b: tar::Builder<Vec<u8>>,
    pub mtime: u64,
}

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    pub fn new() -> Layer {
        Layer {
            b: tar::Builder::new(Vec::new()),
            mtime: 1_600_000_000,
        }
    }

    /// Appends an entry whose name is put into the header as raw bytes
    /// (no checks, no long-name handling); `f` may adjust the header.
    pub fn raw(
        &mut self,
        name: &[u8],
        kind: EntryType,
        mode: u32,
        data: &[u8],
        f: impl FnOnce(&mut Header),
    ) -> &mut Self {
        let mut h = Header::new_ustar();
        h.as_mut_bytes()[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_mtime(self.mtime);
        h.set_uid(0);
        h.set_gid(0);
        f(&mut h);
        h.set_cksum();
        self.b.append(&h, data).unwrap();
        self
    }

    fn header(&self, kind: EntryType, mode: u32) -> Header {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_mtime(self.mtime);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(0);
        h
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> &mut Self {
        let h = self.header(EntryType::Directory, mode);
        self.b.append_data(&mut h.clone(), path, &[][..]).unwrap();
        self
    }

    pub fn file(&mut self, path: &str, data: &[u8], mode: u32) -> &mut Self {
        let mut h = self.header(EntryType::Regular, mode);
        h.set_size(data.len() as u64);
        self.b.append_data(&mut h, path, data).unwrap();
        self
    }

    pub fn file_owned(
        &mut self,
        path: &str,
        data: &[u8],
        mode: u32,
        uid: u64,
        gid: u64,
    ) -> &mut Self {
        let mut h = self.header(EntryType::Regular, mode);
        h.set_size(data.len() as u64);
        h.set_uid(uid);
        h.set_gid(gid);
        self.b.append_data(&mut h, path, data).unwrap();
        self
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        let mut h = self.header(EntryType::Symlink, 0o777);
        self.b.append_link(&mut h, path, target).unwrap();
        self
    }

    pub fn hardlink(&mut self, path: &str, target: &str) -> &mut Self {
        let mut h = self.header(EntryType::Link, 0o644);
        self.b.append_link(&mut h, path, target).unwrap();
        self
    }

    pub fn device(&mut self, path: &str, kind: EntryType, major: u32, minor: u32) -> &mut Self {
        let mut h = self.header(kind, 0o600);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.b.append_data(&mut h, path, &[][..]).unwrap();
        self
    }

    pub fn whiteout(&mut self, path: &str) -> &mut Self {
        self.file(path, b"", 0o644)
    }

    /// A pax extended header for the next entry.
    pub fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Self {
        self.b
            .append_pax_extensions(records.iter().map(|(k, v)| (*k, *v)))
            .unwrap();
        self
    }

    /// Raw bytes appended to the stream as they are.
    pub fn bytes(&mut self, data: &[u8]) -> &mut Self {
        self.b.get_mut().extend_from_slice(data);
        self
    }

    pub fn finish(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }

    /// The stream without the end-of-archive marker.
    pub fn unterminated(self) -> Vec<u8> {
        self.b.get_ref().clone()
    }
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::encode_all(data, 3).unwrap()
}

pub fn open_store(dir: &Path) -> Store {
    Store::open(dir).unwrap()
}

pub fn import(store: &Store, tar: &[u8]) -> Result<LayerInfo, LayerError> {
    import_layer(store, tar, None, None, None, &Limits::default())
}

/// Manifest and config for layers with these diff_ids (uncompressed blobs).
pub fn manifest_and_config(layers: &[(String, u64)]) -> (Vec<u8>, Vec<u8>) {
    let diff_ids: Vec<&String> = layers.iter().map(|(d, _)| d).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "created": "2024-01-02T03:04:05Z",
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256(&config), "size": config.len()},
        "layers": layers.iter().map(|(d, s)| serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s})).collect::<Vec<_>>(),
    }))
    .unwrap();
    (manifest, config)
}

/// Imports the layers and assembles them into an image.
pub fn build(
    store: &Store,
    layers: &[Vec<u8>],
    name: Option<&str>,
) -> Result<ImportedImage, LayerError> {
    let mut ids = Vec::new();
    for l in layers {
        let info = import(store, l)?;
        ids.push((info.diff_id, l.len() as u64));
    }
    let (m, c) = manifest_and_config(&ids);
    assemble_image(store, &m, &c, name)
}

/// The image's tree, read back from the EROFS file.
pub fn image_tree(store: &Store, image: &ImportedImage) -> Tree {
    let data = std::fs::read(store.image_path(&image.image_digest)).unwrap();
    cairn_erofs::reader::read_image(&data).unwrap()
}

/// Path → inode, for every name in the tree (the root is "/").
pub fn entries(tree: &Tree) -> BTreeMap<String, Inode> {
    let mut out = BTreeMap::new();
    fn walk(tree: &Tree, dir: usize, prefix: &str, out: &mut BTreeMap<String, Inode>) {
        for (name, e) in tree.inode(dir).entries().unwrap() {
            let p = format!("{prefix}/{}", String::from_utf8_lossy(name));
            out.insert(p.clone(), tree.inode(e.inode).clone());
            if tree.inode(e.inode).is_dir() {
                walk(tree, e.inode, &p, out);
            }
        }
    }
    out.insert("/".into(), tree.root().clone());
    walk(tree, 0, "", &mut out);
    out
}

/// The content of a regular file in the image.
pub fn content(store: &Store, inode: &Inode) -> Vec<u8> {
    let InodeData::Regular(r) = &inode.data else {
        panic!("not a regular file: {inode:?}")
    };
    if let Some(c) = &r.content {
        return c.clone();
    }
    match &r.payload {
        Some(p) => std::fs::read(
            store
                .objects_dir()
                .join(String::from_utf8_lossy(p).trim_start_matches('/')),
        )
        .unwrap(),
        None => Vec::new(),
    }
}

/// Everything visible in a store (objects, layers, images, refs), to prove
/// a failed import changed nothing, and what is in tmp/.
pub fn visible(root: &Path) -> (Vec<String>, Vec<String>) {
    let mut seen = Vec::new();
    for dir in ["objects", "layers", "images", "refs"] {
        let base = root.join(dir);
        let mut stack = vec![base.clone()];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p.clone());
                }
                seen.push(p.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    seen.sort();
    let mut tmp: Vec<String> = std::fs::read_dir(root.join("tmp"))
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    tmp.sort();
    (seen, tmp)
}
