//! Fixtures of the containerd snapshotter tests (`privileged_snapshotter.rs`,
//! `privileged_snapshotter_systemd.rs`): the five-layer test image pushed to
//! a local registry, its cairn lazy artifact, and the Go programs built
//! against Debian's containerd sources (the CRI-label pull client).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::images::{ImageSet, Tar};
use super::registry::LocalRegistry;

pub const REPO: &str = "snaptest/img";
pub const TAG: &str = "1";
pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

pub fn sha256_hex(d: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(d)))
}

/// Pushes an image of four layers (files, symlinks, hardlinks, whiteouts,
/// an opaque directory; mostly the test set's) and a fifth with busybox,
/// so that it can run, and the owners, mode bits and xattrs a Debian image
/// has ([`debian_metadata`]); returns its reference.
pub fn push_image(reg: &LocalRegistry) -> String {
    let set = ImageSet::get();
    let layer = |name: &str| {
        let l = set.layers.iter().find(|l| l.name == name).unwrap();
        (l.blob.clone(), l.digest.clone(), l.diff_id.clone())
    };
    let gzip = |tar: Vec<u8>| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        let blob = gz.finish().unwrap();
        let (d, di) = (sha256_hex(&blob), sha256_hex(&tar));
        (blob, d, di)
    };
    // The test set's "edits" layer without its hard link to a file of a
    // lower layer, which containerd's overlayfs applier cannot make.
    let edits = gzip(super::images::edits_tar(("bin/sh-again", "bin/sh")));
    let mut blobs = vec![layer("base"), layer("many"), edits, layer("top")];
    let mut t = Tar::default();
    t.dir("busybox").file_mode(
        "busybox/busybox",
        &std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)"),
        0o755,
    );
    debian_metadata(&mut t);
    blobs.push(gzip(t.finish()));
    for (b, d, _) in &blobs {
        assert_eq!(&reg.push_blob(REPO, b), d);
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/busybox"]},
        "rootfs": {"type": "layers", "diff_ids": blobs.iter().map(|b| b.2.clone()).collect::<Vec<_>>()},
    }))
    .unwrap();
    let cd = reg.push_blob(REPO, &config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cd, "size": config.len()},
        "layers": blobs.iter().map(|(b, d, _)| serde_json::json!({
            "mediaType": LAYER_GZIP, "digest": d, "size": b.len()})).collect::<Vec<_>>(),
    }))
    .unwrap();
    reg.push_manifest(REPO, TAG, OCI_MANIFEST, &manifest);
    reg.reference(&format!("{REPO}:{TAG}"))
}

/// `security.capability` as `setcap cap_net_raw+ep` writes it: a v2
/// `vfs_cap_data` (magic 0x02000000 | VFS_CAP_FLAGS_EFFECTIVE, then
/// permitted and inheritable words for caps 0-31 and 32-63), little endian,
/// CAP_NET_RAW (13) permitted.
pub const CAP_NET_RAW_EP: [u8; 20] = [
    0x01, 0x00, 0x00, 0x02, // magic_etc
    0x00, 0x20, 0x00, 0x00, // permitted, caps 0-31: 1 << 13
    0x00, 0x00, 0x00, 0x00, // inheritable, caps 0-31
    0x00, 0x00, 0x00, 0x00, // permitted, caps 32-63
    0x00, 0x00, 0x00, 0x00, // inheritable, caps 32-63
];

/// What a Debian image's tree carries beyond root-owned 0644/0755 files,
/// added to the busybox layer (in directories of the lower layers and new
/// ones): files and directories of other owners (`/etc/shadow` 0:42
/// shadow, www-data 33:33, a user 1000:1000, a symlink of that user),
/// setuid, setgid and sticky bits, and xattrs in pax `SCHILY.xattr.*`
/// records: `security.capability` (ping's cap_net_raw+ep) and `user.*`
/// on a file and a directory.
fn debian_metadata(t: &mut Tar) {
    t.dir_owned("tmp", 0o1777, (0, 0), &[])
        .file_owned(
            "etc/shadow",
            b"root:*:20000:0:99999:7:::\nwww-data:*:20000:0:99999:7:::\n",
            0o640,
            (0, 42),
            &[],
        )
        .file_owned("bin/su", b"#!/bin/tool su\n", 0o4755, (0, 0), &[])
        .file_owned("bin/wall", b"#!/bin/tool wall\n", 0o2755, (0, 5), &[])
        .file_owned(
            "bin/ping",
            b"#!/bin/tool ping\n",
            0o755,
            (0, 0),
            &[
                ("security.capability", &CAP_NET_RAW_EP),
                ("user.cairn.origin", b"iputils-ping"),
            ],
        )
        .dir_owned("srv/shared", 0o1777, (0, 0), &[])
        .dir_owned("srv/www", 0o2775, (33, 33), &[("user.cairn.site", b"www")])
        .file_owned(
            "srv/www/index.html",
            b"<p>www-data</p>\n",
            0o644,
            (33, 33),
            &[("user.mime_type", b"text/html")],
        )
        .dir_owned("srv/home", 0o755, (0, 0), &[])
        .dir_owned("srv/home/user", 0o750, (1000, 1000), &[])
        .file_owned(
            "srv/home/user/.profile",
            b"PATH=/busybox\n",
            0o644,
            (1000, 1000),
            &[],
        )
        .file_owned(
            "srv/home/user/secret",
            b"s3cret\n",
            0o600,
            (1000, 1000),
            &[],
        )
        .symlink_owned("srv/home/user/profile-link", ".profile", (1000, 1000));
}

/// The manifest `tag` of the test repository, read from the registry at
/// `upstream` directly (not through a counting proxy).
pub fn manifest_at(upstream: &str, tag: &str) -> serde_json::Value {
    manifest_of(upstream, REPO, tag)
}

/// The manifest `repo:tag`, read from the registry at `upstream` directly.
pub fn manifest_of(upstream: &str, repo: &str, tag: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(upstream).unwrap();
    write!(
        c,
        "GET /v2/{repo}/manifests/{tag} HTTP/1.0\r\nHost: {upstream}\r\nAccept: {OCI_MANIFEST}\r\n\r\n"
    )
    .unwrap();
    let mut resp = Vec::new();
    c.read_to_end(&mut resp).unwrap();
    let body = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    serde_json::from_slice(&resp[body..]).expect("a manifest")
}

/// Pushes the test image's cairn lazy artifact (pulled into a scratch
/// store, then `cairn push`ed next to it); returns the artifact's pack
/// digests and its EROFS blob's.
pub fn push_lazy_artifact(direct: &str, upstream: &str) -> (BTreeSet<String>, String) {
    let scratch = tempfile::Builder::new()
        .prefix("cairn-lazy-src-")
        .tempdir_in("/var/tmp")
        .unwrap();
    cairn_ok_at(scratch.path(), &["pull", "-q", direct]);
    cairn_ok_at(
        scratch.path(),
        &[
            "push",
            "-q",
            direct,
            &format!("{upstream}/{REPO}:{TAG}-lazy"),
            "--pack-size",
            "1M",
        ],
    );
    let artifact = manifest_at(upstream, &format!("{TAG}-lazy"));
    let packs: BTreeSet<String> = artifact["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["mediaType"] == "application/vnd.cairn.lazy.v1.pack")
        .map(|l| l["digest"].as_str().unwrap().to_owned())
        .collect();
    assert!(!packs.is_empty(), "{artifact}");
    let erofs = artifact["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["mediaType"] == "application/vnd.cairn.lazy.v1.erofs+zstd")
        .map(|l| l["digest"].as_str().unwrap().to_owned())
        .unwrap_or_else(|| panic!("no EROFS blob in {artifact}"));
    (packs, erofs)
}

pub fn cairn_ok_at(store: &Path, args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--root")
        .arg(store)
        .args(args)
        .env_remove("CAIRN_ROOT")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "cairn {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn go_bin() -> PathBuf {
    for p in ["/usr/local/go/bin/go", "/usr/lib/go/bin/go", "/usr/bin/go"] {
        if Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    panic!(
        "no Go toolchain (/usr/local/go/bin/go or Debian's golang-go): setup.sh installs golang-go"
    );
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// Builds `tests/<dir>` (a test binary if `test`) in GOPATH mode against
/// Debian's containerd sources; returns the binary's path.
pub fn build_go(dir: &str, name: &str, test: bool) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(dir);
    std::fs::create_dir_all(&out).unwrap();
    let bin = out.join(name);
    let src = workspace_root().join("tests").join(dir);
    let gopath = "/usr/share/gocode";
    assert!(
        Path::new(gopath)
            .join("src/github.com/containerd/containerd/snapshots/testsuite")
            .exists(),
        "{gopath} has no containerd testsuite: setup.sh installs golang-github-containerd-containerd-dev"
    );
    let o = Command::new(go_bin())
        .args(
            if test {
                ["test", "-c", "-o"]
            } else {
                ["build", "-o", ""]
            }
            .into_iter()
            .filter(|a| !a.is_empty()),
        )
        .arg(&bin)
        .arg(".")
        .current_dir(&src)
        .env("GO111MODULE", "off")
        .env("GOPATH", gopath)
        .env("GOCACHE", out.join("cache"))
        .env("GOFLAGS", "")
        .output()
        .expect("running go");
    assert!(
        o.status.success(),
        "building {}: {}{}",
        src.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    bin
}

/// Where `setup.sh` (and bench/pull-containerd.sh) install containerd
/// 2.4.2's `containerd`, `ctr` and `containerd-shim-runc-v2` (`go install`).
pub const CONTAINERD2_BIN: &str = "/usr/local/lib/cairn-bench/bin";
pub const CONTAINERD2_VERSION: &str = "2.4.2";

/// The containerd a test runs against: Debian's 1.6 or containerd 2.4.2.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ctd {
    V16,
    V24,
}

impl Ctd {
    pub fn bin(self, name: &str) -> PathBuf {
        match self {
            Ctd::V16 => Path::new("/usr/bin").join(name),
            Ctd::V24 => Path::new(CONTAINERD2_BIN).join(name),
        }
    }

    /// The containerd namespace of the tests. runc keeps its state under
    /// /run/containerd/runc/<namespace> whichever containerd started it, so
    /// two containerds' containers of the same name in the same namespace
    /// would collide: the two versions' tests run at the same time.
    pub fn namespace(self) -> &'static str {
        match self {
            Ctd::V16 => "cairn-test",
            Ctd::V24 => "cairn-test-2",
        }
    }

    /// Panics unless containerd 2.4.2's binaries are installed.
    pub fn check_installed(self) {
        if self == Ctd::V16 {
            return;
        }
        for name in ["containerd", "ctr", "containerd-shim-runc-v2"] {
            let p = self.bin(name);
            let v = Command::new(&p).arg("--version").output();
            assert!(
                v.as_ref().is_ok_and(
                    |o| String::from_utf8_lossy(&o.stdout).contains(CONTAINERD2_VERSION)
                ),
                "{} is not containerd {CONTAINERD2_VERSION} ({v:?}): setup.sh installs it",
                p.display()
            );
        }
    }
}

/// Builds the package `tests/containerd2/<pkg>` (a test binary if `test`)
/// with Go modules against containerd v2.4.2 (tests/containerd2/go.mod;
/// setup.sh downloads the modules); returns the binary's path.
pub fn build_go_module(pkg: &str, name: &str, test: bool) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("containerd2");
    std::fs::create_dir_all(&out).unwrap();
    let bin = out.join(name);
    let src = workspace_root().join("tests/containerd2");
    let mut cmd = Command::new(go_bin());
    if test {
        cmd.args(["test", "-c"]);
    } else {
        cmd.arg("build");
    }
    let o = cmd
        .arg("-o")
        .arg(&bin)
        .arg(format!("./{pkg}"))
        .current_dir(&src)
        .env("GO111MODULE", "on")
        .env("GOFLAGS", "-buildvcs=false -mod=readonly")
        .output()
        .expect("running go");
    assert!(
        o.status.success(),
        "building {}/{pkg} (setup.sh downloads its modules): {}{}",
        src.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    bin
}

/// Builds the Go client that pulls with the CRI's labels for that containerd.
pub fn build_rpull(v: Ctd) -> PathBuf {
    match v {
        Ctd::V16 => build_go("containerd-rpull", "rpull", false),
        Ctd::V24 => build_go_module("rpull", "rpull", false),
    }
}
