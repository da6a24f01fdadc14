//! A set of test images that share layers, built in memory (tar → gzip),
//! written as an OCI layout and pushed to a registry.
//!
//! Four layers, each a few hundred KB to 2 MB compressed:
//! - `base`: a 1.5 MB incompressible file, a symlink and a hardlink to it,
//!   150 small text files;
//! - `many`: 800 small files in 10 directories, some with the same content
//!   as files of `base`, and a 1 MB incompressible file;
//! - `edits`: deletes a file of `base` (whiteout), makes `/usr/lib` opaque
//!   and refills it, turns the `/bin/sh` symlink into a file, hardlinks a
//!   file of `base` (across layers), and an 800 KB file;
//! - `top`: whiteouts of a directory and a file, a 300 KB file, small files.
//!
//! Images (tags): `full` = base+many+edits+top (the crash image, about
//! 5 MB compressed), `a` = base+many, `b` = base+edits, `c` =
//! base+many+top, `d` = base+edits+top, `base` = base.

use std::io::Write;
use std::path::Path;
use std::sync::OnceLock;

use super::registry::{sha256, LocalRegistry};

const MTIME: u64 = 1_700_000_000;

/// A ustar stream built entry by entry.
#[derive(Default)]
pub struct Tar {
    buf: Vec<u8>,
}

impl Tar {
    fn header(&mut self, name: &str, kind: u8, mode: u32, size: usize, link: &str) {
        self.header_owned(name, kind, mode, (0, 0), size, link);
    }

    fn header_owned(
        &mut self,
        name: &str,
        kind: u8,
        mode: u32,
        (uid, gid): (u32, u32),
        size: usize,
        link: &str,
    ) {
        let mut h = [0u8; 512];
        assert!(name.len() <= 100, "name too long: {name}");
        assert!(link.len() <= 100, "link too long: {link}");
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..107].copy_from_slice(format!("{mode:07o}").as_bytes());
        h[108..115].copy_from_slice(format!("{uid:07o}").as_bytes());
        h[116..123].copy_from_slice(format!("{gid:07o}").as_bytes());
        h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        h[136..147].copy_from_slice(format!("{MTIME:011o}").as_bytes());
        h[156] = kind;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        self.buf.extend_from_slice(&h);
    }

    pub fn dir(&mut self, name: &str) -> &mut Self {
        self.header(&format!("{name}/"), b'5', 0o755, 0, "");
        self
    }

    pub fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.file_mode(name, data, 0o644)
    }

    pub fn file_mode(&mut self, name: &str, data: &[u8], mode: u32) -> &mut Self {
        self.header(name, b'0', mode, data.len(), "");
        self.buf.extend_from_slice(data);
        self.buf.resize(self.buf.len().div_ceil(512) * 512, 0);
        self
    }

    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.header(name, b'2', 0o777, 0, target);
        self
    }

    pub fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.header(name, b'1', 0o644, 0, target);
        self
    }

    /// A pax extended header (`x`) of `SCHILY.xattr.*` records: the xattrs
    /// of the entry that follows it (as docker, buildkit and Go's
    /// archive/tar write them; values are binary).
    fn pax_xattrs(&mut self, name: &str, xattrs: &[(&str, &[u8])]) {
        if xattrs.is_empty() {
            return;
        }
        let mut body = Vec::new();
        for (key, value) in xattrs {
            // "LEN SCHILY.xattr.KEY=VALUE\n", LEN counting its own digits.
            let rest = format!(" SCHILY.xattr.{key}=").len() + value.len() + 1;
            let mut len = rest + 1;
            while len != rest + len.to_string().len() {
                len = rest + len.to_string().len();
            }
            body.extend_from_slice(format!("{len} SCHILY.xattr.{key}=").as_bytes());
            body.extend_from_slice(value);
            body.push(b'\n');
        }
        let short: String = name.chars().take(80).collect();
        self.header(&format!("PaxHeaders/{short}"), b'x', 0o644, body.len(), "");
        self.buf.extend_from_slice(&body);
        self.buf.resize(self.buf.len().div_ceil(512) * 512, 0);
    }

    /// A directory with its mode (with setuid, setgid and sticky bits),
    /// owner (`uid`, `gid`) and xattrs.
    pub fn dir_owned(
        &mut self,
        name: &str,
        mode: u32,
        owner: (u32, u32),
        xattrs: &[(&str, &[u8])],
    ) -> &mut Self {
        let name = format!("{name}/");
        self.pax_xattrs(&name, xattrs);
        self.header_owned(&name, b'5', mode, owner, 0, "");
        self
    }

    /// A regular file with its mode (with setuid, setgid and sticky bits),
    /// owner (`uid`, `gid`) and xattrs.
    pub fn file_owned(
        &mut self,
        name: &str,
        data: &[u8],
        mode: u32,
        owner: (u32, u32),
        xattrs: &[(&str, &[u8])],
    ) -> &mut Self {
        self.pax_xattrs(name, xattrs);
        self.header_owned(name, b'0', mode, owner, data.len(), "");
        self.buf.extend_from_slice(data);
        self.buf.resize(self.buf.len().div_ceil(512) * 512, 0);
        self
    }

    /// A symlink owned by `owner` (`uid`, `gid`).
    pub fn symlink_owned(&mut self, name: &str, target: &str, owner: (u32, u32)) -> &mut Self {
        self.header_owned(name, b'2', 0o777, owner, 0, target);
        self
    }

    /// Deletes `dir/name` of the layers below.
    pub fn whiteout(&mut self, dir: &str, name: &str) -> &mut Self {
        self.file(&format!("{dir}/.wh.{name}"), b"")
    }

    /// Hides what the layers below have in `dir`.
    pub fn opaque(&mut self, dir: &str) -> &mut Self {
        self.file(&format!("{dir}/.wh..wh..opq"), b"")
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.buf.resize(self.buf.len() + 1024, 0);
        self.buf
    }
}

/// `len` incompressible bytes (xorshift), different per `seed`.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// About `len` bytes of text (compresses like source code, ~4:1).
pub fn text(len: usize, seed: u64) -> Vec<u8> {
    const WORDS: [&str; 16] = [
        "layer", "object", "store", "image", "digest", "mount", "erofs", "overlay", "fn", "let",
        "match", "return", "0x1f", "=>", "{", "}\n",
    ];
    let mut x = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(WORDS[(x % 16) as usize].as_bytes());
        out.push(b' ');
    }
    out.truncate(len);
    out
}

fn base_layer() -> Vec<u8> {
    let mut t = Tar::default();
    t.dir("bin").dir("etc").dir("usr").dir("usr/lib");
    t.file_mode("bin/tool", &random_bytes(1_500_000, 1), 0o755)
        .symlink("bin/sh", "tool")
        .hardlink("bin/tool-link", "bin/tool")
        .file("etc/os-release", b"ID=cairn-test\nVERSION_ID=1\n")
        .file("etc/hostname", b"base\n")
        .file("etc/gone-later", &text(3000, 2));
    for i in 0..150u64 {
        t.file(
            &format!("usr/lib/lib{i:03}.txt"),
            &text(1000 + (i as usize * 37) % 8000, 100 + i),
        );
    }
    t.finish()
}

fn many_layer() -> Vec<u8> {
    let mut t = Tar::default();
    t.dir("usr/share").dir("usr/share/many");
    for d in 0..10u64 {
        t.dir(&format!("usr/share/many/d{d:02}"));
        for f in 0..80u64 {
            let i = d * 80 + f;
            // Every 10th file has the content of a base file: stored once.
            let data = if i % 10 == 0 {
                let j = (i / 10) % 150;
                text(1000 + (j as usize * 37) % 8000, 100 + j)
            } else {
                text(100 + (i as usize * 131) % 3000, 10_000 + i)
            };
            t.file(&format!("usr/share/many/d{d:02}/f{f:03}"), &data);
        }
    }
    t.file("usr/share/blob", &random_bytes(1_000_000, 3));
    t.finish()
}

fn edits_layer() -> Vec<u8> {
    edits_tar(("bin/tool-again", "bin/tool"))
}

/// The "edits" layer's tar, its one hard link `link` (name, target): the
/// test set links to a file of a lower layer; the snapshotter tests link
/// within the layer, which containerd's overlayfs applier can make.
pub fn edits_tar(link: (&str, &str)) -> Vec<u8> {
    let mut t = Tar::default();
    t.dir("etc")
        .whiteout("etc", "gone-later")
        .file("etc/hostname", b"edited\n")
        .dir("usr/lib")
        .opaque("usr/lib");
    for i in 0..100u64 {
        t.file(
            &format!("usr/lib/new{i:03}.txt"),
            &text(500 + i as usize, 20_000 + i),
        );
    }
    t.dir("bin")
        .file_mode("bin/sh", b"#!/bin/tool\n", 0o755)
        .hardlink(link.0, link.1)
        .dir("opt")
        .file("opt/data", &random_bytes(800_000, 4));
    t.finish()
}

fn top_layer() -> Vec<u8> {
    let mut t = Tar::default();
    t.dir("usr/share")
        .whiteout("usr/share", "old")
        .dir("etc")
        .whiteout("etc", "hostname")
        .file("etc/motd", b"top layer\n")
        .dir("srv")
        .file("srv/top", &random_bytes(300_000, 5));
    for i in 0..50u64 {
        t.file(&format!("srv/s{i:02}"), &text(2000, 30_000 + i));
    }
    t.finish()
}

/// Builds one layer's tar stream.
type MakeTar = fn() -> Vec<u8>;

/// One layer: tar stream, gzip blob, digests.
pub struct Layer {
    pub name: &'static str,
    pub tar_size: usize,
    pub blob: Vec<u8>,
    pub digest: String,
    pub diff_id: String,
}

/// One image: its tag, its layers (indexes into [`ImageSet::layers`]),
/// config and manifest.
pub struct TestImage {
    pub tag: &'static str,
    pub layers: Vec<usize>,
    pub config: Vec<u8>,
    pub config_digest: String,
    pub manifest: Vec<u8>,
    pub manifest_digest: String,
}

pub struct ImageSet {
    pub layers: Vec<Layer>,
    pub images: Vec<TestImage>,
}

const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

impl ImageSet {
    /// The standard set (built once per test binary).
    pub fn get() -> &'static ImageSet {
        static SET: OnceLock<ImageSet> = OnceLock::new();
        SET.get_or_init(ImageSet::build)
    }

    fn build() -> ImageSet {
        let tars: [(&'static str, MakeTar); 4] = [
            ("base", base_layer),
            ("many", many_layer),
            ("edits", edits_layer),
            ("top", top_layer),
        ];
        let layers: Vec<Layer> = std::thread::scope(|s| {
            let handles: Vec<_> = tars
                .iter()
                .map(|&(name, make)| {
                    s.spawn(move || {
                        let tar = make();
                        let blob = gzip(&tar);
                        Layer {
                            name,
                            tar_size: tar.len(),
                            digest: sha256(&blob),
                            diff_id: sha256(&tar),
                            blob,
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let arch = cairn_oci::PlatformSpec::host().architecture;
        let images = [
            ("full", vec![0, 1, 2, 3]),
            ("a", vec![0, 1]),
            ("b", vec![0, 2]),
            ("c", vec![0, 1, 3]),
            ("d", vec![0, 2, 3]),
            ("base", vec![0]),
        ]
        .into_iter()
        .map(|(tag, idx)| {
            let config = serde_json::to_vec(&serde_json::json!({
                "architecture": arch,
                "os": "linux",
                "created": "2024-01-01T00:00:00Z",
                "config": {"Cmd": ["/bin/sh"], "Labels": {"tag": tag}},
                "rootfs": {
                    "type": "layers",
                    "diff_ids": idx.iter().map(|&i| layers[i].diff_id.clone()).collect::<Vec<_>>(),
                },
            }))
            .unwrap();
            let config_digest = sha256(&config);
            let manifest = serde_json::to_vec(&serde_json::json!({
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config.len()},
                "layers": idx.iter().map(|&i| serde_json::json!({
                    "mediaType": LAYER_GZIP, "digest": layers[i].digest, "size": layers[i].blob.len(),
                })).collect::<Vec<_>>(),
            }))
            .unwrap();
            TestImage {
                tag,
                layers: idx,
                config,
                config_digest,
                manifest_digest: sha256(&manifest),
                manifest,
            }
        })
        .collect();
        ImageSet { layers, images }
    }

    pub fn image(&self, tag: &str) -> &TestImage {
        self.images
            .iter()
            .find(|i| i.tag == tag)
            .unwrap_or_else(|| panic!("no test image {tag}"))
    }

    /// Compressed bytes of an image's layers.
    pub fn blob_bytes(&self, tag: &str) -> usize {
        self.image(tag)
            .layers
            .iter()
            .map(|&i| self.layers[i].blob.len())
            .sum()
    }

    /// Writes every image as an OCI layout at `dir` (tags as
    /// `org.opencontainers.image.ref.name`).
    pub fn write_layout(&self, dir: &Path) {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap();
        let put = |digest: &str, data: &[u8]| {
            std::fs::write(blobs.join(digest.strip_prefix("sha256:").unwrap()), data).unwrap();
        };
        for l in &self.layers {
            put(&l.digest, &l.blob);
        }
        let mut entries = Vec::new();
        for i in &self.images {
            put(&i.config_digest, &i.config);
            put(&i.manifest_digest, &i.manifest);
            entries.push(serde_json::json!({
                "mediaType": OCI_MANIFEST,
                "digest": i.manifest_digest,
                "size": i.manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": i.tag},
            }));
        }
        std::fs::write(
            dir.join("index.json"),
            serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": entries}))
                .unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    }

    /// Pushes every image to `repo` on `reg`, tagged.
    pub fn push(&self, reg: &LocalRegistry, repo: &str) {
        for l in &self.layers {
            assert_eq!(reg.push_blob(repo, &l.blob), l.digest);
        }
        for i in &self.images {
            assert_eq!(reg.push_blob(repo, &i.config), i.config_digest);
            assert_eq!(
                reg.push_manifest(repo, i.tag, OCI_MANIFEST, &i.manifest),
                i.manifest_digest
            );
        }
    }
}
