//! The README's containerd 2.x configuration, as a user copies it: with
//! it, `ctr image pull --snapshotter cairn` goes through containerd's
//! transfer service, which passes the layer labels to cairn (the
//! snapshotter exports `enable_remote_snapshot_annotations`), so cairn
//! pulls the image itself (the remote path), lazily when the image has a
//! cairn lazy artifact; the container prints what containerd's overlayfs
//! snapshotter's prints.

use std::collections::BTreeSet;
use std::path::Path;

use super::support::registry::LocalRegistry;
use super::support::snapshotter::{manifest_at, push_image, push_lazy_artifact, Ctd, REPO, TAG};
use super::{
    assert_same_as_overlayfs, cairn_ok_at, layer_digests, require_root, CountingProxy, Daemons,
};

/// The README's `version = 3` block, verbatim but for the snapshotter's
/// socket, plus what every containerd of these tests has: its own root,
/// state and sockets, the CRI and NRI off (they would listen on fixed
/// paths shared with the machine), and an overlayfs entry for the
/// transfer service as the README's comment says, to compare with.
fn readme_config(d: &Path, sock: &Path) -> String {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let readme = std::fs::read_to_string(&readme).unwrap();
    let start = readme
        .find("```toml\nversion = 3")
        .expect("the README's containerd 2.x configuration (```toml, version = 3)")
        + "```toml\n".len();
    let block = &readme[start..];
    let block = &block[..block.find("```").expect("the end of the README's block")];
    assert!(
        block.contains("/run/cairn/snapshotter.sock")
            && block.contains("enable_remote_snapshot_annotations = \"true\""),
        "{block}"
    );
    let block = block.replace("/run/cairn/snapshotter.sock", &sock.display().to_string());
    let (version, tables) = block.split_once('\n').unwrap();
    let d = d.display();
    format!(
        r#"{version}
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.nri.v1.nri"]
{tables}
[grpc]
  address = "{d}/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"

[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "overlayfs"
  differ = "walking"
"#
    )
}

#[test]
fn privileged_snapshotter_containerd2_readme_config_pull_and_run() {
    readme_config_pull_and_run(false);
}

/// The same with an image published with `cairn push`: the lazy remote
/// path (the snapshotter's defaults).
#[test]
fn privileged_snapshotter_containerd2_readme_config_lazy_pull_and_run() {
    readme_config_pull_and_run(true);
}

fn readme_config_pull_and_run(lazy: bool) {
    require_root();
    assert_eq!(
        std::env::consts::ARCH,
        "x86_64",
        "the README's block names linux/amd64"
    );
    let reg = LocalRegistry::start();
    let direct = push_image(&reg);
    let upstream = direct.split('/').next().unwrap().to_owned();
    let packs = if lazy {
        push_lazy_artifact(&direct, &upstream).0
    } else {
        BTreeSet::new()
    };
    let proxy = CountingProxy::start(&upstream);
    let reference = format!("{}/{REPO}:{TAG}", proxy.addr);
    let ds = Daemons::start_with_config(Ctd::V24, readme_config);

    // `ctr image pull`, nothing else: the transfer service.
    ds.pull("cairn", &reference);
    let pulled = if lazy {
        "pulled lazily by cairn"
    } else {
        "pulled by cairn"
    };
    assert_eq!(
        ds.log().matches(pulled).count(),
        5,
        "layers {pulled} (the remote path), snapshotter log:\n{}",
        ds.log()
    );
    // Each layer blob was fetched once, by cairn, or (lazily) not at all,
    // nor any pack; containerd fetched only the manifest and the config.
    let layers = layer_digests(&manifest_at(&upstream, TAG));
    assert_eq!(layers.len(), 5);
    if lazy {
        for d in &layers {
            assert_eq!(proxy.fetchers(d), Vec::<String>::new(), "layer {d}");
        }
    } else {
        proxy.assert_fetched_once_by_cairn(&layers);
    }
    // No pack by the Prepares; the lazy server of the top layer's chain,
    // mounted as its Prepare answers, fetches from then on (see
    // `last_logged`).
    let gets = if lazy {
        proxy.blob_gets_before(super::last_logged(&ds.log(), pulled))
    } else {
        proxy.blob_gets()
    };
    assert!(
        !gets.iter().any(|(_, d)| packs.contains(d)),
        "packs fetched by the pull: {gets:#?}"
    );

    // The container prints what it prints on containerd's overlayfs
    // snapshotter (pulled through the same transfer service).
    let id = if lazy { "readme-lazy" } else { "readme-cairn" };
    let remote = ds.run_test_script("cairn", &reference, id);
    ds.pull("overlayfs", &direct);
    let normal = ds.run_test_script("overlayfs", &direct, "readme-overlayfs");
    assert_same_as_overlayfs(&remote, &normal, "the README configuration's container");
    cairn_ok_at(&ds.dir.path().join("store"), &["fsck"]);
}
