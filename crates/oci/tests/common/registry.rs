//! A real registry on 127.0.0.1 for tests: Debian's `docker-registry`
//! (distribution 2.8) in a temp directory, killed on drop; test images
//! built with umoci from busybox-static's `/bin/busybox`, pushed with
//! skopeo or with a plain HTTP upload (skopeo 1.9 recompresses uncompressed
//! layers on push, so uncompressed images and hand-made indexes go up
//! through [`push_blob`]/[`push_manifest`]).
//!
//! Shared by the cairn-oci and cairn CLI tests (`#[path]`-included), so it
//! uses nothing but std, ureq, serde_json, sha2/hex and tempfile.
#![allow(dead_code)]

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// Fails with the tool's output when it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("running {cmd:?}: {e} (apt-get install skopeo umoci docker-registry busybox-static)")
    });
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_ready(child: &mut Child, addr: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if std::net::TcpStream::connect(addr).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A docker-registry process serving `127.0.0.1:<port>`.
pub struct LocalRegistry {
    child: Child,
    pub addr: String,
    /// `user:password` it requires, if any.
    pub basic: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl LocalRegistry {
    pub fn start() -> LocalRegistry {
        Self::start_with(None)
    }

    /// With basic auth: `(user, password, htpasswd line "user:<bcrypt hash>")`.
    pub fn start_with(auth: Option<(&str, &str, &str)>) -> LocalRegistry {
        let dir = tempfile::tempdir().unwrap();
        let mut basic = None;
        let mut auth_config = String::new();
        if let Some((user, pass, line)) = auth {
            let htpasswd = dir.path().join("htpasswd");
            std::fs::write(&htpasswd, format!("{line}\n")).unwrap();
            auth_config = format!(
                "auth:\n  htpasswd:\n    realm: cairn-test\n    path: {}\n",
                htpasswd.display()
            );
            basic = Some((user.to_string(), pass.to_string()));
        }
        // The port may be taken between choosing and binding it: try again.
        for attempt in 0..5 {
            let addr = format!("127.0.0.1:{}", free_port());
            let config = format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n{auth_config}",
                dir.path().join("data").display()
            );
            let cfg = dir.path().join(format!("config-{attempt}.yml"));
            std::fs::write(&cfg, config).unwrap();
            let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
            let mut child = Command::new("/usr/bin/docker-registry")
                .arg("serve")
                .arg(&cfg)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("starting /usr/bin/docker-registry (apt-get install docker-registry)");
            if wait_ready(&mut child, &addr) {
                return LocalRegistry {
                    child,
                    addr,
                    basic,
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("docker-registry did not come up");
    }

    /// Where the registry keeps blob `digest` (`sha256:<hex>`) on disk:
    /// a test that must make it serve wrong bytes changes this file.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self._dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// `127.0.0.1:<port>/<repo>:<tag>`.
    pub fn reference(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.addr)
    }

    fn auth_header(&self) -> Option<String> {
        use base64::Engine as _;
        self.basic.as_ref().map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        })
    }

    /// `skopeo copy oci:<layout>:<tag> docker://<addr>/<dest>` with `extra` flags.
    pub fn skopeo_push(&self, layout: &Path, tag: &str, dest: &str, extra: &[&str]) {
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "-q", "--dest-tls-verify=false"]);
        if let Some((u, p)) = &self.basic {
            cmd.arg(format!("--dest-creds={u}:{p}"));
        }
        cmd.args(extra)
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{dest}", self.addr))
            // No blob-info cache shared between tests: it makes skopeo reuse
            // blobs another test pushed in another encoding.
            .env("HOME", layout.parent().unwrap_or(layout));
        run(&mut cmd);
    }

    /// Uploads a blob (monolithic POST + PUT) and returns its digest.
    pub fn push_blob(&self, repo: &str, data: &[u8]) -> String {
        let digest = sha256(data);
        let agent = ureq::agent();
        let mut post = agent.post(&format!("http://{}/v2/{repo}/blobs/uploads/", self.addr));
        if let Some(h) = self.auth_header() {
            post = post.set("Authorization", &h);
        }
        let resp = post.call().expect("starting a blob upload");
        assert_eq!(resp.status(), 202);
        let loc = resp
            .header("Location")
            .expect("upload location")
            .to_string();
        let url = if loc.starts_with("http") {
            loc
        } else {
            format!("http://{}{loc}", self.addr)
        };
        let sep = if url.contains('?') { '&' } else { '?' };
        let mut put = agent
            .put(&format!("{url}{sep}digest={digest}"))
            .set("Content-Type", "application/octet-stream");
        if let Some(h) = self.auth_header() {
            put = put.set("Authorization", &h);
        }
        let resp = put.send_bytes(data).expect("finishing a blob upload");
        assert_eq!(resp.status(), 201);
        digest
    }

    /// Puts a manifest under `reference` (tag or digest).
    pub fn push_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        data: &[u8],
    ) -> String {
        let mut put = ureq::agent()
            .put(&format!(
                "http://{}/v2/{repo}/manifests/{reference}",
                self.addr
            ))
            .set("Content-Type", media_type);
        if let Some(h) = self.auth_header() {
            put = put.set("Authorization", &h);
        }
        let resp = put.send_bytes(data).unwrap_or_else(|e| {
            let body = match e {
                ureq::Error::Status(_, r) => {
                    let mut s = String::new();
                    let _ = r.into_reader().read_to_string(&mut s);
                    s
                }
                other => other.to_string(),
            };
            panic!("pushing manifest {repo}:{reference}: {body}")
        });
        assert_eq!(resp.status(), 201);
        sha256(data)
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The OCI layout with the test images, built once per test binary under
/// the target's temp directory:
/// - `base`: one gzip layer, `/bin/busybox`;
/// - `two`: `base` + a layer with `/hello` and `/etc/two` (shares the base);
/// - `arm64`: `base` with an arm64 config (for the index test).
pub fn test_layout() -> &'static Path {
    static LAYOUT: OnceLock<PathBuf> = OnceLock::new();
    LAYOUT.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "cairn-oci-layout-{}",
            std::env::current_exe()
                .unwrap()
                .file_name()
                .unwrap()
                .to_string_lossy()
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let layout = root.join("layout");
        let l = layout.display().to_string();
        let bundle = root.join("bundle");
        run(Command::new("umoci").args(["init", "--layout", &l]));
        run(Command::new("umoci").args(["new", "--image", &format!("{l}:base")]));
        run(Command::new("umoci")
            .args(["unpack", "--image", &format!("{l}:base")])
            .arg(&bundle));
        std::fs::create_dir_all(bundle.join("rootfs/bin")).unwrap();
        std::fs::copy("/bin/busybox", bundle.join("rootfs/bin/busybox"))
            .expect("copying /bin/busybox (apt-get install busybox-static)");
        run(Command::new("umoci")
            .args(["repack", "--image", &format!("{l}:base")])
            .arg(&bundle));
        run(Command::new("umoci").args([
            "config",
            "--image",
            &format!("{l}:base"),
            "--tag",
            "two",
            "--config.cmd",
            "/bin/sh",
        ]));
        std::fs::remove_dir_all(&bundle).unwrap();
        run(Command::new("umoci")
            .args(["unpack", "--image", &format!("{l}:two")])
            .arg(&bundle));
        std::fs::write(bundle.join("rootfs/hello"), "hello from layer two\n").unwrap();
        std::fs::create_dir_all(bundle.join("rootfs/etc")).unwrap();
        std::fs::write(bundle.join("rootfs/etc/two"), "2\n").unwrap();
        run(Command::new("umoci")
            .args(["repack", "--image", &format!("{l}:two")])
            .arg(&bundle));
        std::fs::remove_dir_all(&bundle).unwrap();
        run(Command::new("umoci").args([
            "config",
            "--image",
            &format!("{l}:base"),
            "--tag",
            "arm64",
            "--architecture",
            "arm64",
        ]));
        layout
    })
}

/// Reads blob `digest` of an OCI layout.
pub fn layout_blob(layout: &Path, digest: &str) -> Vec<u8> {
    let hex = digest.strip_prefix("sha256:").unwrap();
    std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap()
}

/// The manifest digest tagged `tag` in an OCI layout.
pub fn layout_manifest(layout: &Path, tag: &str) -> (String, Vec<u8>) {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let entry = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .unwrap_or_else(|| panic!("no tag {tag} in the layout"));
    let digest = entry["digest"].as_str().unwrap().to_string();
    let bytes = layout_blob(layout, &digest);
    (digest, bytes)
}

/// A tar stream (ustar, regular files and directories only) of `entries`:
/// `(path, Some(contents))` for a file, `(path, None)` for a directory.
pub fn tar_of(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (path, data) in entries {
        let mut h = [0u8; 512];
        let name = path.as_bytes();
        assert!(name.len() < 100);
        h[..name.len()].copy_from_slice(name);
        let (mode, size, kind) = match data {
            Some(d) => (0o644, d.len(), b'0'),
            None => (0o755, 0, b'5'),
        };
        h[100..107].copy_from_slice(format!("{mode:07o}").as_bytes());
        h[108..115].copy_from_slice(b"0000000");
        h[116..123].copy_from_slice(b"0000000");
        h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        h[136..147].copy_from_slice(b"00000000000");
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        out.extend_from_slice(&h);
        if let Some(d) = data {
            out.extend_from_slice(d);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
    }
    out.resize(out.len() + 1024, 0);
    out
}

/// Pushes an image whose layers are uncompressed tar streams `layers` to
/// `repo:tag`, for `os/arch`; returns (manifest digest, manifest bytes).
pub fn push_tar_image(
    reg: &LocalRegistry,
    repo: &str,
    tag: &str,
    arch: &str,
    layers: &[Vec<u8>],
) -> (String, Vec<u8>) {
    let mut descs = Vec::new();
    let mut diff_ids = Vec::new();
    for l in layers {
        let d = reg.push_blob(repo, l);
        descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": l.len()
        }));
        diff_ids.push(d);
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": arch, "os": "linux",
        "config": {"Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let cd = reg.push_blob(repo, &config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
        "layers": descs,
    }))
    .unwrap();
    let md = reg.push_manifest(
        repo,
        tag,
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    );
    (md, manifest)
}
