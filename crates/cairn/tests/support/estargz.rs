//! The eStargz test image: a two-layer image (busybox, symlinks, a hard
//! link, whiteouts, an opaque directory, a 5 MiB file of random bytes)
//! imported into Debian's containerd 1.6 (`super::containerd`), converted
//! by stargz-snapshotter's own converter (`ctr-remote image convert
//! --estargz --oci --estargz-record-in`, so that each layer has a prefetch
//! landmark) and pushed to a local registry. Used by
//! `privileged_lazy_estargz.rs` and `privileged_snapshotter.rs`.

use super::containerd::Containerd;
use super::images::{random_bytes, text, Tar};
use super::registry::{sha256, LocalRegistry};

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

pub fn gzip(tar: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, tar).unwrap();
    gz.finish().unwrap()
}

/// An OCI archive (what `ctr image import` reads) of a two-layer image
/// named `name`, and its manifest's digest.
pub fn archive(name: &str) -> (Vec<u8>, String) {
    let mut l1 = Tar::default();
    l1.dir("bin")
        .file_mode(
            "bin/busybox",
            &std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)"),
            0o755,
        )
        .symlink("bin/sh", "busybox")
        .hardlink("bin/ls", "bin/busybox")
        .dir("etc")
        .file("etc/msg", b"hello from an eStargz image\n")
        .file("etc/gone", b"deleted by the upper layer\n")
        .dir("usr")
        .dir("usr/lib")
        .file("usr/lib/old", &text(3000, 1))
        .dir("data")
        .file("data/big", &random_bytes(5 << 20, 7));
    let mut l2 = Tar::default();
    l2.dir("etc")
        .whiteout("etc", "gone")
        .file("etc/msg", b"hello again, from the upper layer\n")
        .dir("usr/lib")
        .opaque("usr/lib")
        .file("usr/lib/new", &text(5000, 2));
    let tars = [l1.finish(), l2.finish()];
    let blobs: Vec<Vec<u8>> = tars.iter().map(|t| gzip(t)).collect();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh", "-c", "cat /etc/msg; ls /usr/lib"]},
        "rootfs": {"type": "layers", "diff_ids": tars.iter().map(|t| sha256(t)).collect::<Vec<_>>()},
    }))
    .unwrap();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha256(&config), "size": config.len()},
        "layers": blobs.iter().map(|b| serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": sha256(b), "size": b.len()})).collect::<Vec<_>>(),
    }))
    .unwrap();
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": OCI_MANIFEST, "digest": sha256(&manifest),
                       "size": manifest.len(),
                       "annotations": {"io.containerd.image.name": name}}],
    }))
    .unwrap();
    let mut a = Tar::default();
    a.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)
        .file("index.json", &index);
    for b in blobs.iter().chain([&config, &manifest]) {
        let hex = sha256(b);
        a.file(
            &format!("blobs/sha256/{}", hex.strip_prefix("sha256:").unwrap()),
            b,
        );
    }
    (a.finish(), sha256(&manifest))
}

/// Imports the test image into `ctd`, converts it with ctr-remote (with a
/// record of what it "reads" first: `/bin/busybox` of the lower layer and
/// `/etc/msg` of the upper one, which `ctr-remote` puts before each
/// layer's prefetch landmark) and pushes both to `reg`; returns (plain,
/// estargz) references.
pub fn publish_estargz(ctd: &Containerd, reg: &LocalRegistry) -> (String, String) {
    let plain = reg.reference("stargz/img:plain");
    let esgz = reg.reference("stargz/img:esgz");
    let path = ctd.dir().join("image.tar");
    let (bytes, manifest) = archive(&plain);
    std::fs::write(&path, bytes).unwrap();
    let record = ctd.dir().join("record.json");
    std::fs::write(
        &record,
        format!(
            "{{\"path\":\"bin/busybox\",\"manifestDigest\":\"{manifest}\",\"layerIndex\":0}}\n\
             {{\"path\":\"etc/msg\",\"manifestDigest\":\"{manifest}\",\"layerIndex\":1}}\n"
        ),
    )
    .unwrap();
    ctd.ok("ctr", &["image", "import", path.to_str().unwrap()]);
    ctd.ok(
        "ctr-remote",
        &[
            "image",
            "convert",
            "--estargz",
            "--oci",
            "--estargz-record-in",
            record.to_str().unwrap(),
            &plain,
            &esgz,
        ],
    );
    ctd.ok("ctr", &["image", "push", "--plain-http", &plain]);
    ctd.ok("ctr", &["image", "push", "--plain-http", &esgz]);
    (plain, esgz)
}
