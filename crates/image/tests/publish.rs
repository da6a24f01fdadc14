//! Objects published by the object workers while a layer streams
//! (`cairn_store::Publisher`): a `kill -9` in the middle of a layer leaves
//! only complete objects under names and no layer record, a retry then
//! succeeds, and a low `RLIMIT_NOFILE` is respected (the unnamed files a
//! layer holds open stay within its budget, where holding them all would
//! fail with `EMFILE`).
//!
//! Each case runs the import in a child process (this test binary again,
//! running [`child_import`] with `CAIRN_PUBLISH_CHILD` set), so that its
//! open-file limit and its death touch nothing else.

mod common;

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cairn_store::{fsverity_digest, ObjectId, Store};
use common::*;

const CHILD_ENV: &str = "CAIRN_PUBLISH_CHILD";

/// Bytes that differ from file to file.
fn data(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// An uncompressed layer of `n` distinct files of 2-6 KiB.
fn layer(n: u32) -> Vec<u8> {
    let mut l = Layer::new();
    l.dir("./", 0o755).dir("d/", 0o755);
    for i in 0..n {
        l.file(
            &format!("d/f{i}"),
            &data(i, 2048 + (i as usize * 37) % 4096),
            0o644,
        );
    }
    l.finish()
}

/// The child's side: sets the open-file limit (soft and hard) to what
/// the parent says, then imports the layer read from the given path (a
/// FIFO or a file) into the given store with two object workers, and
/// prints the number of objects. A no-op when run as a test of its own.
#[test]
fn child_import() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '\n');
    let (limit, root, blob) = (
        parts.next().unwrap().parse::<u64>().unwrap(),
        PathBuf::from(parts.next().unwrap()),
        PathBuf::from(parts.next().unwrap()),
    );
    let lim = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: setrlimit reads the struct it is given.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    let store = Store::open(&root).unwrap();
    let blob = std::fs::File::open(&blob).unwrap();
    let info = cairn_image::import_layer(
        &store,
        blob,
        None,
        None,
        None,
        &cairn_image::Limits::default(),
    )
    .unwrap();
    println!("entries {}", info.entries);
}

/// Starts [`child_import`] in a child process.
fn spawn_child(limit: u64, root: &Path, blob: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_import", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!("{limit}\n{}\n{}", root.display(), blob.display()),
        )
        .env("CAIRN_IMPORT_THREADS", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Every object under `objects/`, each checked against its name.
fn checked_objects(root: &Path) -> usize {
    let mut n = 0;
    for fanout in std::fs::read_dir(root.join("objects")).unwrap() {
        let fanout = fanout.unwrap();
        for obj in std::fs::read_dir(fanout.path()).unwrap() {
            let obj = obj.unwrap();
            let name = format!(
                "{}{}",
                fanout.file_name().to_str().unwrap(),
                obj.file_name().to_str().unwrap()
            );
            let id = ObjectId::from_hex(&name).unwrap();
            let content = std::fs::read(obj.path()).unwrap();
            assert_eq!(
                fsverity_digest(&content[..]).unwrap(),
                id,
                "object {name} is not whole"
            );
            n += 1;
        }
    }
    n
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path it is given.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo: {}", std::io::Error::last_os_error());
    assert!(std::fs::metadata(path).unwrap().file_type().is_fifo());
}

#[test]
fn kill_mid_layer_leaves_only_whole_objects_and_a_retry_succeeds() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    drop(open_store(&root));
    let tar = layer(1500);
    let fifo = d.path().join("blob");
    mkfifo(&fifo);
    // A low limit: a budget of 64 unnamed files, so that objects are
    // synced and named while the layer streams.
    let mut child = spawn_child(256, &root, &fifo);
    let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    // Two thirds of the layer, then wait until objects have names.
    w.write_all(&tar[..tar.len() * 2 / 3]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let named = std::fs::read_dir(root.join("objects"))
            .unwrap()
            .flatten()
            .map(|f| std::fs::read_dir(f.path()).map_or(0, |d| d.count()))
            .sum::<usize>();
        if named >= 100 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no objects named mid-layer ({named})"
        );
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "the child ended early ({status}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    drop(w);

    let named = checked_objects(&root);
    assert!((100..1500).contains(&named), "{named} objects named");
    assert_eq!(
        std::fs::read_dir(root.join("layers")).unwrap().count(),
        0,
        "a layer record after the kill"
    );
    // The next writer clears the dead one's staging; the retry (the whole
    // layer, with the same low limit) publishes everything.
    let blob = d.path().join("blob.tar");
    std::fs::write(&blob, &tar).unwrap();
    let out = spawn_child(256, &root, &blob).wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "retry failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("entries 1502"));
    assert_eq!(checked_objects(&root), 1500);
    let store = open_store(&root);
    let fsck = store.fsck(&cairn_store::FsckOptions::default()).unwrap();
    assert!(fsck.problems.is_empty(), "fsck: {:?}", fsck.problems);
    assert_eq!(fsck.layers, 1);
    drop(store);
    let (_, tmp) = visible(&root);
    assert!(tmp.is_empty(), "staging left: {tmp:?}");
}

#[test]
fn a_low_open_file_limit_is_respected() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    drop(open_store(&root));
    let blob = d.path().join("blob.tar");
    std::fs::write(&blob, layer(2000)).unwrap();
    // 96 descriptors in all: the test harness, the store, and 24
    // unnamed files at most. Holding all 2000 would fail.
    let out = spawn_child(96, &root, &blob).wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "import failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("entries 2002"));
    assert_eq!(checked_objects(&root), 2000);
}
