//! The remote path against a registry that requires basic auth (issue 14,
//! point 3): cairn reads its credentials from the same auth files as
//! `cairn pull` (`$REGISTRY_AUTH_FILE` here), and when it has none, it
//! answers so that containerd falls back to its normal path, and logs why.
//! containerd itself is given the credentials (the CRI-label client with
//! `RPULL_USER`/`RPULL_PASSWORD`), as the CRI would from its own config.

use std::path::Path;

use super::support::registry::LocalRegistry;
use super::support::snapshotter::{build_rpull, push_image, Ctd, OCI_MANIFEST, REPO, TAG};
use super::{cairn_ok_at, layer_digests, require_root, snapshot_rows, CountingProxy, Daemons};

const USER: &str = "puller";
const PASSWORD: &str = "s3cret";
/// `htpasswd` line of [`USER`] with [`PASSWORD`] (bcrypt, cost 4).
const HTPASSWD: &str = "puller:$2b$04$3v3YGEsxfoSud9uh4i.TeeUShnDCY67tpQW0gz1KChchE4VhciYye";

/// The client's credentials: containerd authenticates whatever cairn has.
const RPULL_CREDS: &[(&str, &str)] = &[("RPULL_USER", USER), ("RPULL_PASSWORD", PASSWORD)];

fn basic(user: &str, password: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
}

/// A registry on 127.0.0.1 that answers 401 without [`USER`]'s password.
fn auth_registry() -> LocalRegistry {
    LocalRegistry::start_with(Some((USER, PASSWORD, HTPASSWD)))
}

/// The snapshotter's environment: `REGISTRY_AUTH_FILE` holding `auth_json`,
/// and a `HOME` and XDG directories of its own (empty), so that no auth
/// file of the machine is read.
fn isolated_env(dir: &Path, auth_json: &str) -> Vec<(String, String)> {
    let file = dir.join("auth.json");
    std::fs::write(&file, auth_json).unwrap();
    let mut env = vec![("REGISTRY_AUTH_FILE".to_string(), file.display().to_string())];
    for (var, sub) in [
        ("HOME", "home"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_RUNTIME_DIR", "run"),
    ] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).unwrap();
        env.push((var.to_string(), d.display().to_string()));
    }
    env
}

/// The test image in [`auth_registry`], behind a counting proxy, pulled by
/// the CRI-label client with the credentials into containerd `v` and a
/// snapshotter whose auth file is `auth_json(the proxy's address)`.
struct Pulled {
    _registry: LocalRegistry,
    _auth: tempfile::TempDir,
    proxy: CountingProxy,
    upstream: String,
    reference: String,
    ds: Daemons,
}

fn pull_with_auth_file(v: Ctd, auth_json: impl Fn(&str) -> String) -> Pulled {
    require_root();
    let rpull = build_rpull(v);
    let registry = auth_registry();
    let direct = push_image(&registry);
    let upstream = direct.split('/').next().unwrap().to_owned();
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    let auth = tempfile::tempdir().unwrap();
    let env = isolated_env(auth.path(), &auth_json(&proxy.addr));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let ds = Daemons::start_with_env(v, &[], &env);
    ds.rpull(&rpull, &reference, RPULL_CREDS);
    Pulled {
        _registry: registry,
        _auth: auth,
        proxy,
        upstream,
        reference,
        ds,
    }
}

/// The test image's manifest, read from `upstream` with the credentials.
fn manifest(upstream: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(upstream).unwrap();
    write!(
        c,
        "GET /v2/{REPO}/manifests/{TAG} HTTP/1.0\r\nHost: {upstream}\r\nAccept: {OCI_MANIFEST}\r\nAuthorization: Basic {}\r\n\r\n",
        basic(USER, PASSWORD)
    )
    .unwrap();
    let mut resp = Vec::new();
    c.read_to_end(&mut resp).unwrap();
    let body = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    serde_json::from_slice(&resp[body..]).unwrap_or_else(|e| {
        panic!(
            "the manifest ({e}): {}",
            String::from_utf8_lossy(&resp[..body])
        )
    })
}

/// Runs the image from the cairn snapshotter: every layer's files, and a
/// write.
fn run(ds: &Daemons, reference: &str, id: &str) -> String {
    let out = ds.run_test_script("cairn", reference, id);
    assert!(
        out.contains("ID=cairn-test") && out.contains("hello\n"),
        "the container printed:\n{out}"
    );
    out
}

fn committed(ds: &Daemons) -> usize {
    let listed = ds.ctr(&["snapshots", "--snapshotter", "cairn", "ls"]);
    snapshot_rows(&listed)
        .iter()
        .filter(|r| r.last() == Some(&"Committed"))
        .count()
}

#[test]
fn privileged_snapshotter_remote_pull_falls_back_without_credentials() {
    falls_back_without_credentials(Ctd::V16);
}

/// The same with containerd 2.4.2 and its client.
#[test]
fn privileged_snapshotter_containerd2_remote_pull_falls_back_without_credentials() {
    falls_back_without_credentials(Ctd::V24);
}

/// cairn's auth files hold nothing for the registry: each layer's remote
/// Prepare fails on the registry's 401, says so, and containerd fetches
/// and unpacks the layer itself (it has the credentials).
fn falls_back_without_credentials(v: Ctd) {
    let pulled = pull_with_auth_file(v, |_| r#"{"auths":{}}"#.to_owned());
    let Pulled {
        proxy,
        upstream,
        reference,
        ds,
        ..
    } = &pulled;
    let log = ds.log();
    let fallbacks: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("containerd fetches and unpacks it"))
        .collect();
    println!("fallback lines:\n{}", fallbacks.join("\n"));
    let why = format!(
        "authentication failed for {}/{REPO} (401: UNAUTHORIZED",
        proxy.addr
    );
    assert_eq!(
        fallbacks.iter().filter(|l| l.contains(&why)).count(),
        5,
        "a fallback naming the 401 for each layer, snapshotter log:\n{log}"
    );
    assert!(
        fallbacks.iter().all(|l| l.contains("no credentials found")),
        "{log}"
    );
    assert!(!log.contains("pulled by cairn"), "{log}");
    // containerd fetched each layer blob, cairn none.
    for d in layer_digests(&manifest(upstream)) {
        let by = proxy.fetchers(&d);
        assert!(
            !by.is_empty() && by.iter().all(|ua| !ua.starts_with("cairn/")),
            "layer {d} fetched by {by:?}"
        );
    }
    // containerd's normal path committed every layer into cairn.
    assert_eq!(committed(ds), 5, "{log}");
    run(ds, reference, "fallback-no-creds");
    cairn_ok_at(&ds.dir.path().join("store"), &["fsck"]);
}

#[test]
fn privileged_snapshotter_remote_pull_with_credentials() {
    with_credentials(Ctd::V16);
}

/// The same with containerd 2.4.2 and its client.
#[test]
fn privileged_snapshotter_containerd2_remote_pull_with_credentials() {
    with_credentials(Ctd::V24);
}

/// cairn's `$REGISTRY_AUTH_FILE` holds the registry's credentials: every
/// layer goes through the remote path, each blob fetched once, by cairn.
fn with_credentials(v: Ctd) {
    let pulled = pull_with_auth_file(v, |proxy| {
        serde_json::json!({"auths": {proxy: {"auth": basic(USER, PASSWORD)}}}).to_string()
    });
    let Pulled {
        proxy,
        upstream,
        reference,
        ds,
        ..
    } = &pulled;
    let log = ds.log();
    assert_eq!(
        log.matches("pulled by cairn").count(),
        5,
        "layers pulled by cairn, snapshotter log:\n{log}"
    );
    assert!(!log.contains("containerd fetches and unpacks it"), "{log}");
    proxy.assert_fetched_once_by_cairn(&layer_digests(&manifest(upstream)));
    assert_eq!(committed(ds), 5, "{log}");
    run(ds, reference, "fallback-with-creds");
    cairn_ok_at(&ds.dir.path().join("store"), &["fsck"]);
}
