//! A large file of a lazily pulled image is read chunk by chunk: a read
//! near the end of a 40 MiB file returns once the chunks it needs are
//! fetched (the registry, behind a counting proxy, has served only those
//! ranges), a chunk the registry corrupts gives `EIO` and a log line
//! naming the object and the blob, and the object is later complete,
//! verified, stored and passed through. A small file whose one frame the
//! registry corrupts gives `EIO` too (the fs-verity digest its staged copy
//! hashes to is not its name), and nothing of it is stored. Mounts for
//! real: root only, never skipped.

mod support;

use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::artifact::{pack_layers, served_manifest};
use support::images::{random_bytes, text, Tar};
use support::range_proxy::RangeProxy;
use support::registry::LocalRegistry;
use support::{cairn_ok, cairn_out};

const MIB: usize = 1 << 20;

fn sha256_hex(d: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(d)))
}

/// One gzip layer: a 40 MiB file, an 8 MiB file, two small ones (the
/// last, `tiny.bin`, random: its zstd frame holds its bytes as they are,
/// so a byte flipped in it still decodes, to bytes of another digest).
fn push_image(reg: &LocalRegistry, repo: &str, big: &[u8], other: &[u8], tiny: &[u8]) -> String {
    let mut t = Tar::default();
    t.dir("data")
        .file("data/big.bin", big)
        .file("data/other.bin", other)
        .file("data/small.txt", &text(3000, 7))
        .file("data/tiny.bin", tiny);
    let tar = t.finish();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::none());
    gz.write_all(&tar).unwrap();
    let blob = gz.finish().unwrap();
    assert_eq!(reg.push_blob(repo, &blob), sha256_hex(&blob));
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [sha256_hex(&tar)]},
    }))
    .unwrap();
    let cd = reg.push_blob(repo, &config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": sha256_hex(&blob), "size": blob.len()}],
    }))
    .unwrap();
    reg.push_manifest(
        repo,
        "1",
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    );
    reg.reference(&format!("{repo}:1"))
}

/// The store's objects of exactly `len` bytes.
fn objects_of_len(root: &Path, len: u64) -> usize {
    let mut n = 0;
    for fanout in fs::read_dir(root.join("objects")).unwrap() {
        for e in fs::read_dir(fanout.unwrap().path()).unwrap() {
            if e.unwrap().metadata().unwrap().len() == len {
                n += 1;
            }
        }
    }
    n
}

fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn privileged_lazy_large_file_is_read_chunk_by_chunk() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test mounts and must run as root (it is not skipped)"
    );
    let reg = LocalRegistry::start();
    let big = random_bytes(40 * MIB + 4321, 11);
    let other = random_bytes(8 * MIB, 12);
    let tiny = random_bytes(5000, 13);
    let reference = push_image(&reg, "lazy/chunks", &big, &other, &tiny);
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy-chunks")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    cairn_ok(&a, &["pull", "-q", &reference]);
    let push = cairn_ok(
        &a,
        &[
            "--json",
            "push",
            &reference,
            &reg.reference("lazy/chunks:1-lazy"),
        ],
    );
    let push: serde_json::Value = serde_json::from_str(&push).unwrap();
    let proxy = RangeProxy::start(&reg.addr, Duration::from_millis(150));
    let via = format!("{}/lazy/chunks:1", proxy.addr);
    let pulled = cairn_ok(&b, &["--json", "pull", "--lazy", "--no-prefetch", &via]);
    let pulled: serde_json::Value = serde_json::from_str(&pulled).unwrap();
    // The pack blobs that hold chunk 6 of other.bin and tiny.bin's one
    // frame (read below with the registry corrupting them): from the
    // artifact's manifest and index.
    let (other_id, tiny_id) = (
        cairn_store::fsverity_digest(&other[..]).unwrap(),
        cairn_store::fsverity_digest(&tiny[..]).unwrap(),
    );
    let (other_pack, tiny_pack) = {
        let (bytes, _) = served_manifest(
            &reg,
            "lazy/chunks",
            push["artifact_digest"].as_str().unwrap(),
        );
        let packs: Vec<String> = pack_layers(&serde_json::from_slice(&bytes).unwrap())
            .into_iter()
            .map(|p| p.0)
            .collect();
        let store = cairn_store::Store::open(&b).unwrap();
        let client = cairn_oci::ClientOptions {
            auth_files: Vec::new(),
            ..cairn_oci::ClientOptions::default()
        };
        let digest = pulled["image_digest"].as_str().unwrap();
        let remote = cairn_remote::RemoteObjects::open(&store, digest, &client).unwrap();
        let pack_of =
            |id, k: usize| packs[remote.entry(id).unwrap().frames[k].pack as usize].clone();
        (pack_of(&other_id, 6), pack_of(&tiny_id, 0))
    };
    let repository = format!("{}/lazy/chunks", proxy.addr);
    let target = dir.path().join("mnt");
    fs::create_dir_all(&target).unwrap();
    let report = cairn_ok(
        &b,
        &[
            Path::new("mount"),
            Path::new("--json"),
            Path::new("--lazy"),
            Path::new("--lazy-fetch"),
            Path::new("on-demand"),
            Path::new(&via),
            &target,
        ],
    );
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    let pid = report["lazy_server"].as_i64().expect("a lazy server pid") as i32;

    // 1. Near the end of the 40 MiB file: answered after its chunks only.
    let before = proxy.blob_ranges().len();
    let f = fs::File::open(target.join("data/big.bin")).unwrap();
    let at = big.len() - 300_000;
    let mut buf = vec![0u8; 64 * 1024];
    let t0 = Instant::now();
    f.read_exact_at(&mut buf, at as u64).unwrap();
    let took = t0.elapsed();
    let served = proxy.blob_ranges()[before..].to_vec();
    assert!(buf[..] == big[at..at + buf.len()], "wrong bytes");
    assert!(
        (1..=3).contains(&served.len()),
        "the read returned after {} ranges ({took:?}): {served:?}",
        served.len()
    );
    assert!(took < Duration::from_secs(3), "the read took {took:?}");
    assert_eq!(objects_of_len(&b, big.len() as u64), 0, "stored early");

    // 2. The registry corrupts what it sends: EIO for a read of a chunk
    // not fetched yet; nothing stored. Then it serves right, and the read
    // works.
    let g = fs::File::open(target.join("data/other.bin")).unwrap();
    let mut small = vec![0u8; 4096];
    proxy.corrupt.store(true, Ordering::SeqCst);
    let err = g
        .read_exact_at(&mut small, (6 * MIB + 10) as u64)
        .expect_err("a corrupt chunk must not be read");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    proxy.corrupt.store(false, Ordering::SeqCst);
    assert_eq!(objects_of_len(&b, other.len() as u64), 0);
    g.read_exact_at(&mut small, (6 * MIB + 10) as u64).unwrap();
    assert!(small[..] == other[6 * MIB + 10..6 * MIB + 4106]);

    // 2b. A small object, the last of its pack (no neighbours: fetched
    // alone), corrupted in flight: EIO, nothing stored; then it is read.
    proxy.corrupt.store(true, Ordering::SeqCst);
    let err =
        fs::read(target.join("data/tiny.bin")).expect_err("a corrupt object must not be read");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    proxy.corrupt.store(false, Ordering::SeqCst);
    assert_eq!(
        objects_of_len(&b, tiny.len() as u64),
        0,
        "a corrupt object was stored"
    );
    assert!(fs::read(target.join("data/tiny.bin")).unwrap() == tiny);
    // Answered from the checked staged file; published right after.
    wait_for("tiny.bin stored", 20, || {
        objects_of_len(&b, tiny.len() as u64) == 1
    });

    // 3. The rest follows: both verified and stored, and the early
    // handle reads the whole file.
    wait_for("both large objects stored", 120, || {
        objects_of_len(&b, big.len() as u64) == 1 && objects_of_len(&b, other.len() as u64) == 1
    });
    let mut all = vec![0u8; big.len()];
    f.read_exact_at(&mut all, 0).unwrap();
    assert!(all == big, "the early handle reads the whole file");
    drop(f);
    drop(g);
    std::thread::sleep(Duration::from_millis(300));
    // A later open is served from the store (passed through).
    let ranges = proxy.blob_ranges().len();
    assert!(fs::read(target.join("data/big.bin")).unwrap() == big);
    assert!(fs::read(target.join("data/other.bin")).unwrap() == other);
    assert_eq!(proxy.blob_ranges().len(), ranges, "fetched again");

    let out = cairn_out(&b, &[Path::new("umount"), &target]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("the lazy server exits", 20, || {
        !Path::new(&format!("/proc/{pid}")).exists()
    });
    // Its log (kept: a chunk failed) names the object and the blob, and
    // its counters say the later opens passed through.
    let mut log = String::new();
    for e in fs::read_dir(b.join("lazy")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "log") {
            log.push_str(&fs::read_to_string(&p).unwrap());
        }
    }
    // The corrupt chunk's line: the object, the chunk, the pack blob it
    // came from, and that its reads fail with EIO.
    let chunk_line = format!("object {other_id} from blob {other_pack} in {repository}: chunk 6 ");
    assert!(
        log.lines().any(|l| l.contains(&chunk_line)
            && l.contains(&format!("object {other_id}: chunk 6 (bytes "))
            && l.contains("EIO")
            && l.contains("nothing of it was stored")),
        "no line with {chunk_line:?}: {log}"
    );
    // The small object's line: its name, the pack blob, what it hashed
    // to (another object).
    let tiny_line = format!(
        "object {tiny_id} from blob {tiny_pack} in {repository}: its bytes hash to object "
    );
    let hashed_to: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split_once(&tiny_line))
        .map(|(_, rest)| rest.get(..64).unwrap_or(rest))
        .collect();
    assert!(!hashed_to.is_empty(), "no line with {tiny_line:?}: {log}");
    for h in hashed_to {
        assert!(
            h.len() == 64 && h.bytes().all(|c| c.is_ascii_hexdigit()) && h != tiny_id.to_string(),
            "{tiny_line:?} then {h:?}: {log}"
        );
    }
    assert!(log.contains("chunked_published: 2"), "{log}");
    if log.contains("passthrough: true") {
        assert!(!log.contains("passthrough_opens: 0,"), "{log}");
    }
    support::assert_fsck_clean(&b, "after chunked reads");
}
