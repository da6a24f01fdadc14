//! eStargz images made by stargz-snapshotter's own converter, started
//! lazily by cairn. A two-layer image (busybox, symlinks, a hard link,
//! whiteouts, an opaque directory, a 5 MiB file) is imported into Debian's
//! containerd 1.6 (`support::containerd`), converted with `ctr-remote
//! image convert --estargz --oci --estargz-record-in` (so each layer has a
//! prefetch landmark), pushed with `ctr image push` to docker-registry on
//! 127.0.0.1. Then:
//!
//! - `cairn pull --lazy` builds the metadata from the TOCs alone: the tree
//!   of a full `cairn pull` (contents named by sha256), only manifests,
//!   config and TOCs fetched (a counting proxy); a lazy mount's background
//!   fetch asks for the landmark's files first and stores every file;
//!   `cairn fetch` completes it into the full pull's image; the plain gzip
//!   original is refused with its reason;
//! - `cairn run --lazy` prints what `cairn run` prints, fetching only
//!   what was read; a second run fetches nothing;
//! - a registry that flips bytes gives EIO, stores nothing, and the log
//!   names the file, the chunk and the blob; after `cairn lazy restart` the
//!   successor serves what its predecessor stored.
//!
//! Runs as root (containerd, mounts).

mod support;

use support::containerd::Containerd;
use support::estargz::publish_estargz;
use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::{assert_fsck_clean, cairn_ok, cairn_out};

/// `cairn dump` with what differs by design between a lazy eStargz pull
/// and a full pull taken out: a regular file's payload, inline contents
/// and verity digest (the lazy image names contents by sha256 and
/// inlines nothing).
fn shape(dump: &str) -> String {
    dump.lines()
        .map(|l| {
            let mut f: Vec<&str> = l.split(' ').collect();
            if f.len() > 10 && f[2].trim_start_matches('@').starts_with("10") {
                f[8] = "-";
                f[9] = "-";
                f[10] = "-";
            }
            f.join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// (layer, name) → the offset of the first chunk's gzip member, from the
/// TOCs a lazy pull kept (`images/*.lazy-index`, docs/lazy-format.md).
fn toc_offsets(root: &std::path::Path) -> std::collections::BTreeMap<(usize, String), u64> {
    let path = std::fs::read_dir(root.join("images"))
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".lazy-index"))
        .expect("a .lazy-index file")
        .path();
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"CAIRNSGZ");
    let n = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
    let mut at = 16;
    let mut out = std::collections::BTreeMap::new();
    for layer in 0..n {
        let len = u64::from_le_bytes(b[at + 28..at + 36].try_into().unwrap()) as usize;
        let json: serde_json::Value = serde_json::from_slice(&b[at + 36..at + 36 + len]).unwrap();
        for e in json["entries"].as_array().unwrap() {
            if e["type"] == "reg" && e["offset"].as_u64().is_some() {
                let name = e["name"].as_str().unwrap().to_string();
                out.insert((layer, name), e["offset"].as_u64().unwrap());
            }
        }
        at += 36 + len;
    }
    out
}

/// The sha256 (hex) of `data`.
fn sha_hex(data: &[u8]) -> String {
    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(data))
}

/// The tests of this file one at a time. They use the same image, and gc
/// keeps a store's image while an image of the same digest is mounted from
/// any store (`store::mounts`, on purpose), so one test's lazy mount kept
/// the lazy image that another's gc was checking it removed (1 run in 7).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn privileged_lazy_estargz_pull_builds_the_tree_of_a_full_pull_from_the_tocs() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    assert!(
        rustix::process::geteuid().is_root(),
        "this test starts containerd and must run as root"
    );
    let reg = LocalRegistry::start();
    let ctd = Containerd::start();
    let (plain, esgz) = publish_estargz(&ctd, &reg);
    let dir = tempfile::tempdir().unwrap();
    let (lazy, full) = (dir.path().join("lazy"), dir.path().join("full"));

    // Lazily, through a proxy that counts what the registry sends.
    let proxy = SlowProxy::start(&reg.addr, 64 << 10);
    let via = esgz.replacen(&reg.addr, &proxy.addr, 1);
    let out = cairn_ok(&lazy, &["--json", "pull", "--lazy", &via]);
    let pulled: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(pulled["complete"], false, "{pulled:#}");
    let object_bytes = pulled["object_bytes"].as_u64().unwrap();
    assert!(object_bytes > 6 << 20, "{pulled:#}");
    let moved = proxy.bytes_down();
    assert!(
        moved < 64 << 10,
        "pull --lazy of an eStargz image moved {moved} bytes (manifests, config and TOCs \
         should be a few KB)"
    );
    let objects = std::fs::read_dir(lazy.join("objects"))
        .unwrap()
        .flatten()
        .flat_map(|f| std::fs::read_dir(f.path()).unwrap().flatten())
        .count();
    assert_eq!(objects, 0, "pull --lazy stored objects");
    assert_fsck_clean(&lazy, "after an eStargz pull --lazy");
    let table = cairn_ok(&lazy, &["images"]);
    assert!(table.contains("(incomplete)"), "{table}");

    // The same tree as a full pull of the converted image.
    cairn_ok(&full, &["pull", "-q", &esgz]);
    let lazy_dump = cairn_ok(&lazy, &["dump", &via]);
    let full_dump = cairn_ok(&full, &["dump", &esgz]);
    assert_eq!(shape(&lazy_dump), shape(&full_dump));
    for expected in [
        "/etc/msg 34 100644",
        "/bin/sh 7 120777",
        "/usr/lib/new ",
        "/stargz.index.json ",
    ] {
        assert!(lazy_dump.contains(expected), "{expected}:\n{lazy_dump}");
    }
    for gone in ["/etc/gone", "/usr/lib/old"] {
        assert!(!lazy_dump.contains(gone), "{gone}:\n{lazy_dump}");
    }

    // A lazy mount with the background fetch (another store, pulled
    // through a proxy that records ranges): every file of the image (not
    // the ones an upper layer deletes) ends up stored, the files before
    // the layers' prefetch landmarks first.
    let bg = dir.path().join("bg");
    let ranges = support::range_proxy::RangeProxy::start(&reg.addr, std::time::Duration::ZERO);
    let via_ranges = esgz.replacen(&reg.addr, &ranges.addr, 1);
    cairn_ok(&bg, &["pull", "-q", "--lazy", &via_ranges]);
    let before = ranges.blob_ranges().len();
    // (Read now: the lazy image and its TOCs go once it is complete.)
    let offsets = toc_offsets(&bg);
    let lazy_digest = serde_json::from_str::<serde_json::Value>(&cairn_ok(
        &bg,
        &["--json", "inspect", &via_ranges],
    ))
    .unwrap()["digest"]
        .clone();
    let target = dir.path().join("mnt");
    std::fs::create_dir_all(&target).unwrap();
    cairn_ok(
        &bg,
        &["mount", "--lazy", &via_ranges, target.to_str().unwrap()],
    );
    let files = lazy_dump
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            f.len() > 8 && f[2].starts_with("10") && f[8] != "-"
        })
        .count();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while objects_in(&bg) < files {
        assert!(
            std::time::Instant::now() < deadline,
            "the background fetch stored {} of {files} files",
            objects_in(&bg)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Then the layer completes the image (below): the name moves.
    while serde_json::from_str::<serde_json::Value>(&cairn_ok(
        &bg,
        &["--json", "inspect", &via_ranges],
    ))
    .unwrap()["digest"]
        == lazy_digest
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the image is still incomplete with every file stored"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = cairn_out(&bg, &["umount", target.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for_servers_gone(&bg);
    assert_fsck_clean(&bg, "after the background fetch");
    // With every file stored the layer completed the image from them, as
    // another image (files backed by fs-verity names) that the name moved
    // to: the tree of a full pull, mounted without --lazy.
    let inspect: serde_json::Value =
        serde_json::from_str(&cairn_ok(&bg, &["--json", "inspect", &via_ranges])).unwrap();
    assert!(inspect["record"]["lazy"].is_null(), "{inspect:#}");
    assert_eq!(inspect["missing_objects"], 0, "{inspect:#}");
    assert_eq!(
        shape(&cairn_ok(&bg, &["dump", &via_ranges])),
        shape(&full_dump)
    );
    cairn_ok(&bg, &["mount", &via_ranges, target.to_str().unwrap()]);
    let msg = std::fs::read(target.join("etc/msg"));
    cairn_ok(&bg, &["umount", target.to_str().unwrap()]);
    assert_eq!(msg.unwrap().len(), 34);
    // gc keeps what the lazy layer stored (now the complete image's) and
    // removes the lazy image, nameless and no longer mounted.
    cairn_ok(&bg, &["gc"]);
    assert_eq!(objects_in(&bg), files, "gc removed stored files");
    let table = cairn_ok(&bg, &["images"]);
    assert!(!table.contains("(incomplete)"), "{table}");
    // Two fetches at a time: the first two requests are busybox's and
    // /etc/msg's chunks (the TOCs say where their members start).
    let first: std::collections::BTreeSet<u64> = ranges.blob_ranges()[before..]
        .iter()
        .take(2)
        .map(|(_, r)| {
            r.trim_start_matches("bytes=")
                .split('-')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    let want: std::collections::BTreeSet<u64> = [
        offsets[&(0, "bin/busybox".to_string())],
        offsets[&(1, "etc/msg".to_string())],
    ]
    .into_iter()
    .collect();
    assert_eq!(first, want, "{:?}", ranges.blob_ranges());

    // `cairn fetch` completes it: its layers pulled whole, the image a
    // full pull makes, named as the lazy one was.
    let out = cairn_ok(&lazy, &["--json", "fetch", &via]);
    let fetched: serde_json::Value = serde_json::from_str(&out).unwrap();
    let full_digest =
        serde_json::from_str::<serde_json::Value>(&cairn_ok(&full, &["--json", "inspect", &esgz]))
            .unwrap()["digest"]
            .clone();
    assert_eq!(fetched["completed_as"], full_digest, "{fetched:#}");
    assert_eq!(cairn_ok(&lazy, &["dump", &via]), full_dump);
    cairn_ok(&lazy, &["gc"]);
    assert_fsck_clean(&lazy, "after cairn fetch of an eStargz image");
    // (gc removes the nameless lazy image unless a mount of it, in any
    // store, is live.)
    let table = cairn_ok(&lazy, &["images"]);
    let row = table
        .lines()
        .find(|l| l.starts_with(&via))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(!row.contains("(incomplete)"), "{table}");

    // The gzip original has neither an artifact nor TOCs: refused, and why.
    let o = cairn_out(&lazy, &["pull", "--lazy", &plain]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("no eStargz table of contents"), "{err}");
}

/// The objects in a store.
fn objects_in(root: &std::path::Path) -> usize {
    std::fs::read_dir(root.join("objects"))
        .map(|d| {
            d.flatten()
                .flat_map(|f| std::fs::read_dir(f.path()).unwrap().flatten())
                .count()
        })
        .unwrap_or(0)
}

/// Waits (20 s at most) until the store's lazy servers are gone.
fn wait_for_servers_gone(root: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let left: Vec<_> = std::fs::read_dir(root.join("lazy"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        if left.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "left in lazy/: {left:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn privileged_lazy_estargz_run_prints_what_a_full_run_prints() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    assert!(
        rustix::process::geteuid().is_root(),
        "this test starts containerd and mounts: it must run as root"
    );
    let reg = LocalRegistry::start();
    let ctd = Containerd::start();
    let (_, esgz) = publish_estargz(&ctd, &reg);
    let dir = tempfile::Builder::new()
        .prefix("cairn-esgz-run")
        .tempdir()
        .unwrap();
    let (lazy, full) = (dir.path().join("lazy"), dir.path().join("full"));
    cairn_ok(&full, &["pull", "-q", &esgz]);
    let command = [
        "/bin/sh",
        "-c",
        "cat /etc/msg; ls /usr/lib; sha256sum /data/big",
    ];
    let mut args = vec!["run", esgz.as_str()];
    args.extend(command);
    let expected = cairn_ok(&full, &args);
    assert!(
        expected.contains("upper layer") && expected.contains("new"),
        "{expected}"
    );

    let proxy = SlowProxy::start(&reg.addr, 64 << 10);
    let via = esgz.replacen(&reg.addr, &proxy.addr, 1);
    cairn_ok(&lazy, &["pull", "-q", "--lazy", &via]);
    let mut args = vec!["run", "--lazy", "--lazy-fetch", "on-demand", via.as_str()];
    args.extend(command);
    let got = cairn_ok(&lazy, &args);
    assert_eq!(got, expected);
    wait_for_servers_gone(&lazy);
    // busybox, /etc/msg and /data/big were read, stored under their
    // fs-verity digests; nothing else.
    assert_eq!(objects_in(&lazy), 3, "objects fetched");
    let names = std::fs::read_dir(lazy.join("images"))
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".lazy-names"))
        .expect("a .lazy-names file");
    let names = std::fs::read_to_string(names.path()).unwrap();
    assert_eq!(names.lines().count(), 3, "{names}");
    assert_fsck_clean(&lazy, "after a lazy run of an eStargz image");
    // `cairn images` and `cairn df` count them as local, through the
    // lazy-names map (the image names them by sha256).
    let rows: serde_json::Value =
        serde_json::from_str(&cairn_ok(&lazy, &["--json", "images"])).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| !r["incomplete"].is_null())
        .unwrap_or_else(|| panic!("no incomplete image: {rows:#}"));
    let local = &row["incomplete"];
    assert_eq!(local["objects_local"], 3, "{row:#}");
    let stored: u64 = std::fs::read_dir(lazy.join("objects"))
        .unwrap()
        .flatten()
        .flat_map(|f| std::fs::read_dir(f.path()).unwrap().flatten())
        .map(|o| o.metadata().unwrap().len())
        .sum();
    assert_eq!(local["bytes_local"], stored, "{row:#}");
    let df: serde_json::Value = serde_json::from_str(&cairn_ok(&lazy, &["--json", "df"])).unwrap();
    assert_eq!(df["incomplete"][0]["objects_local"], 3, "{df:#}");
    assert_eq!(df["incomplete"][0]["bytes_local"], stored, "{df:#}");
    let table = cairn_ok(&lazy, &["images"]);
    assert!(
        table.contains(&format!("3/{} objects", local["objects"])),
        "{table}"
    );
    // Only the TOCs and what was read came over the wire (the layers
    // hold 5 MiB of incompressible data, busybox about 1 MiB more).
    let moved = proxy.bytes_down();
    let blobs: u64 = (5 << 20) + 2_000_000;
    assert!(moved < blobs + (256 << 10), "{moved} bytes moved");

    // Again, with the files stored now: no fetch at all.
    let before = proxy.bytes_down();
    let mut args = vec!["run", "--lazy", "--lazy-fetch", "on-demand", via.as_str()];
    args.extend(command);
    assert_eq!(cairn_ok(&lazy, &args), expected);
    wait_for_servers_gone(&lazy);
    assert_eq!(proxy.bytes_down(), before, "a second run fetched again");
}

#[test]
fn privileged_lazy_estargz_wrong_bytes_give_eio_and_a_successor_finds_stored_files() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    use std::sync::atomic::Ordering;
    assert!(
        rustix::process::geteuid().is_root(),
        "this test starts containerd and mounts: it must run as root"
    );
    let reg = LocalRegistry::start();
    let ctd = Containerd::start();
    let (_, esgz) = publish_estargz(&ctd, &reg);
    let dir = tempfile::Builder::new()
        .prefix("cairn-esgz-bad")
        .tempdir()
        .unwrap();
    let root = dir.path().join("store");
    let proxy = support::range_proxy::RangeProxy::start(&reg.addr, std::time::Duration::ZERO);
    let via = esgz.replacen(&reg.addr, &proxy.addr, 1);
    cairn_ok(&root, &["pull", "-q", "--lazy", &via]);
    let target = dir.path().join("mnt");
    std::fs::create_dir_all(&target).unwrap();
    proxy.corrupt.store(true, Ordering::SeqCst);
    cairn_ok(
        &root,
        &[
            "mount",
            "--lazy",
            "--lazy-fetch",
            "on-demand",
            &via,
            target.to_str().unwrap(),
        ],
    );
    // A file of one chunk and one of two: EIO, nothing stored. (The proxy
    // flips a byte in the middle of each range; for a tiny file that is
    // past its contents, in the tar padding and next header that share
    // its gzip member, which are never read.)
    for f in ["bin/busybox", "data/big"] {
        let err = std::fs::read(target.join(f)).expect_err("wrong bytes were served");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{f}: {err}");
    }
    // Nothing wrong was stored. (The mount's background fetch of the
    // prefetch landmarks' files may have stored /etc/msg: the flipped
    // byte of its range lies past its contents.)
    let msg = cairn_store::fsverity_digest(&b"hello again, from the upper layer\n"[..])
        .unwrap()
        .to_hex();
    let stored: Vec<String> = std::fs::read_dir(root.join("objects"))
        .map(|d| {
            d.flatten()
                .flat_map(|f| std::fs::read_dir(f.path()).unwrap().flatten())
                .map(|o| {
                    let fan = o.path().parent().unwrap().file_name().unwrap().to_owned();
                    format!(
                        "{}{}",
                        fan.to_string_lossy(),
                        o.file_name().to_string_lossy()
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    assert!(
        stored.iter().all(|h| *h == msg),
        "wrong bytes were stored: {stored:?} (/etc/msg is {msg})"
    );
    // The server's log names the file, the chunk
    // and the blob.
    let mut log = String::new();
    for e in std::fs::read_dir(root.join("lazy")).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            log.push_str(&std::fs::read_to_string(e.path()).unwrap());
        }
    }
    let big = sha_hex(&support::images::random_bytes(5 << 20, 7));
    assert!(
        log.contains(&format!("sha256:{big} (chunk ")) && log.contains("from blob sha256:"),
        "{log}"
    );
    assert!(log.contains("EIO"), "{log}");
    // The registry serves right again: the same files read.
    proxy.corrupt.store(false, Ordering::SeqCst);
    assert_eq!(
        std::fs::read(target.join("bin/busybox")).unwrap(),
        std::fs::read("/bin/busybox").unwrap()
    );
    assert_eq!(
        std::fs::read(target.join("data/big")).unwrap().len(),
        5 << 20
    );

    // A successor server (docs/lazy-fuse.md) finds what its predecessor
    // stored under fs-verity names (through images/<digest>.lazy-names):
    // a handle opened before the restart reads on, stored files are
    // served without a fetch, a new file is fetched.
    use std::os::unix::fs::FileExt;
    let held = std::fs::File::open(target.join("bin/busybox")).unwrap();
    let out = cairn_ok(&root, &["lazy", "restart", "all"]);
    assert!(out.contains("restarted"), "{out}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let list: serde_json::Value =
            serde_json::from_str(&cairn_ok(&root, &["--json", "lazy", "list"])).unwrap();
        if list[0]["restarts"] == 1 && list[0]["worker"].as_u64().is_some() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no successor: {list}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let ranges = proxy.blob_ranges().len();
    let mut head = [0u8; 4];
    held.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(&head, b"\x7fELF");
    assert_eq!(
        std::fs::read(target.join("data/big")).unwrap().len(),
        5 << 20
    );
    assert_eq!(
        proxy.blob_ranges().len(),
        ranges,
        "stored files fetched again"
    );
    assert_eq!(
        std::fs::read(target.join("etc/msg")).unwrap(),
        b"hello again, from the upper layer\n"
    );
    drop(held);
    let out = cairn_out(&root, &["umount", target.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for_servers_gone_or_log(&root);
    assert_fsck_clean(&root, "after wrong bytes");
}

/// Waits (20 s at most) until no lazy server of the store runs (its log
/// may stay).
fn wait_for_servers_gone_or_log(root: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let left: Vec<_> = std::fs::read_dir(root.join("lazy"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.ends_with(".log"))
                    .collect()
            })
            .unwrap_or_default();
        if left.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "left in lazy/: {left:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
