//! Two images that hold the same file store it once, and reading it through
//! both mounts keeps one copy in the page cache.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;

fn meminfo_cached_kib() -> u64 {
    let s = fs::read_to_string("/proc/meminfo").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Cached:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("Cached in /proc/meminfo")
}

/// Bytes of `path` resident in the page cache (util-linux fincore).
fn resident_bytes(path: &Path) -> u64 {
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .expect("fincore (util-linux)");
    assert!(
        out.status.success(),
        "fincore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn drop_caches() {
    rustix::fs::sync();
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

fn read_all(p: &Path) -> usize {
    fs::read(p).unwrap().len()
}

#[test]
fn privileged_shared_file_is_stored_once_and_cached_once() {
    require_root();
    let dir = tempfile::Builder::new()
        .prefix("cairn-share")
        .tempdir()
        .unwrap();
    let base = dir.path();
    let store = base.join("store");
    const SIZE: usize = 48 << 20;
    for (name, seed) in [("a", 11), ("b", 22)] {
        let t = base.join(name);
        fs::create_dir_all(t.join("usr/lib")).unwrap();
        write_pattern(&t.join("usr/lib/shared.bin"), SIZE, 7);
        write_pattern(&t.join("own.bin"), 100_000, seed);
        cairn(
            &store,
            &[
                os("mkfs"),
                os("--store"),
                t.as_os_str(),
                base.join(format!("{name}.img")).as_os_str(),
            ],
        );
    }
    // Stored once: three objects (shared + two own files).
    let objects = objects_fingerprint(&store);
    assert_eq!(objects.len(), 3, "objects: {objects:?}");
    let dump_a =
        String::from_utf8(cairn(&store, &[os("dump"), base.join("a.img").as_os_str()]).stdout)
            .unwrap();
    let dump_b =
        String::from_utf8(cairn(&store, &[os("dump"), base.join("b.img").as_os_str()]).stdout)
            .unwrap();
    let payload = |d: &str| {
        d.lines()
            .find(|l| l.starts_with("/usr/lib/shared.bin "))
            .and_then(|l| l.split(' ').nth(8))
            .map(str::to_owned)
            .unwrap()
    };
    assert_eq!(
        payload(&dump_a),
        payload(&dump_b),
        "both images must name the same object"
    );
    let object = store.join("objects").join(payload(&dump_a));
    assert_eq!(fs::metadata(&object).unwrap().len(), SIZE as u64);

    let ma = mount(&store, &base.join("a.img"), &base.join("mnt-a"), &[]);
    let mb = mount(&store, &base.join("b.img"), &base.join("mnt-b"), &[]);
    // The page cache is counted machine-wide (`Cached` in /proc/meminfo),
    // so another process's reads can add to one measurement; a second copy
    // of the file would add its 48 MiB to every one. Up to three tries.
    let mut growth = Vec::new();
    for _ in 0..3 {
        drop_caches();
        assert!(
            resident_bytes(&object) < (SIZE as u64) / 8,
            "object should start cold"
        );
        assert_eq!(read_all(&ma.target.join("usr/lib/shared.bin")), SIZE);
        let after_a = resident_bytes(&object);
        assert!(
            after_a >= SIZE as u64 * 9 / 10,
            "reading through mount A fills the object's page cache: {after_a}"
        );
        let cached_a = meminfo_cached_kib();
        assert_eq!(read_all(&mb.target.join("usr/lib/shared.bin")), SIZE);
        let cached_b = meminfo_cached_kib();
        let grew_kib = cached_b.saturating_sub(cached_a);
        eprintln!(
            "object resident after mount A: {} MiB; page cache growth when reading the same file through mount B: {} KiB (file is {} MiB)",
            after_a >> 20,
            grew_kib,
            SIZE >> 20
        );
        growth.push(grew_kib);
        if grew_kib < (SIZE as u64 / 1024) / 8 {
            break;
        }
    }
    assert!(
        growth.iter().any(|&g| g < (SIZE as u64 / 1024) / 8),
        "reading the shared file through the second mount must not cache it again (grew {growth:?} KiB)"
    );
    drop(mb);
    drop(ma);
}
