//! Helpers shared by the privileged end-to-end tests: run the `cairn`
//! binary, build trees, and snapshot a tree's metadata for comparison.

#![allow(dead_code)]

pub mod containers;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

/// Panics (never skips) when the test is not run as root: these tests mount.
pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test mounts filesystems and must run as root (CI runs it as root)"
    );
}

pub fn cairn_bin() -> &'static str {
    env!("CARGO_BIN_EXE_cairn")
}

/// Runs `cairn --root ROOT ARGS…`, panicking with its output on failure.
pub fn cairn(root: &Path, args: &[&OsStr]) -> Output {
    let out = cairn_raw(root, args);
    assert!(
        out.status.success(),
        "cairn {:?} failed: {}{}",
        args,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn cairn_raw(root: &Path, args: &[&OsStr]) -> Output {
    Command::new(cairn_bin())
        .arg("--root")
        .arg(root)
        .args(args)
        .output()
        .expect("running cairn")
}

pub fn run(cmd: &str, args: &[&OsStr]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {cmd}: {e} (is it installed? run setup.sh)"));
    assert!(
        out.status.success(),
        "{cmd} {:?} failed: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// The mounts whose mount point or source lies under `under` (tests run in
/// parallel, so only a test's own directory tells what it left behind).
pub fn mounts_under(under: &Path) -> BTreeSet<String> {
    let under = under.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&under))
        .map(|l| {
            // Drop the mount id and parent id: they change with every mount.
            l.split(' ').skip(2).collect::<Vec<_>>().join(" ")
        })
        .collect()
}

/// Loop devices whose backing file lies under `under`.
pub fn loop_devices_backed_under(under: &Path) -> usize {
    let under = under.to_string_lossy().into_owned();
    fs::read_dir("/sys/block")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
                .filter_map(|e| fs::read_to_string(e.path().join("loop/backing_file")).ok())
                .filter(|b| b.contains(&under))
                .count()
        })
        .unwrap_or(0)
}

/// Everything `stat`, `readlink`, `getfattr` and reading tell about one entry,
/// except what legitimately differs between filesystems (inode numbers,
/// atime/ctime, block counts, directory sizes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u64,
    pub size: Option<u64>,
    pub mtime: (i64, i64),
    pub rdev: u64,
    pub target: Option<Vec<u8>>,
    pub sha256: Option<String>,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

pub struct Snapshot {
    pub entries: BTreeMap<Vec<u8>, Entry>,
    /// Sets of names that are one inode.
    pub links: BTreeSet<Vec<Vec<u8>>>,
}

pub fn snapshot(root: &Path) -> Snapshot {
    let mut entries = BTreeMap::new();
    let mut by_ino: BTreeMap<(u64, u64), Vec<Vec<u8>>> = BTreeMap::new();
    walk(root, root, &mut entries, &mut by_ino);
    let links = by_ino.into_values().filter(|v| v.len() > 1).collect();
    Snapshot { entries, links }
}

fn walk(
    root: &Path,
    p: &Path,
    out: &mut BTreeMap<Vec<u8>, Entry>,
    by_ino: &mut BTreeMap<(u64, u64), Vec<Vec<u8>>>,
) {
    let meta = fs::symlink_metadata(p).unwrap();
    let rel = p
        .strip_prefix(root)
        .unwrap()
        .as_os_str()
        .as_bytes()
        .to_vec();
    let ft = meta.file_type();
    let kind = if ft.is_dir() {
        "dir"
    } else if ft.is_file() {
        "file"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_char_device() {
        "chr"
    } else if ft.is_block_device() {
        "blk"
    } else if ft.is_fifo() {
        "fifo"
    } else {
        "socket"
    };
    if !ft.is_dir() {
        by_ino
            .entry((meta.dev(), meta.ino()))
            .or_default()
            .push(rel.clone());
    }
    let sha256 = ft.is_file().then(|| {
        let mut f = fs::File::open(p).unwrap();
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        hex::encode(h.finalize())
    });
    out.insert(
        rel,
        Entry {
            kind,
            mode: meta.mode(),
            uid: meta.uid(),
            gid: meta.gid(),
            nlink: meta.nlink(),
            size: (!ft.is_dir()).then_some(meta.len()),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            rdev: if ft.is_char_device() || ft.is_block_device() {
                meta.rdev()
            } else {
                0
            },
            target: ft
                .is_symlink()
                .then(|| fs::read_link(p).unwrap().as_os_str().as_bytes().to_vec()),
            sha256,
            xattrs: xattrs(p),
        },
    );
    if ft.is_dir() {
        let mut names: Vec<PathBuf> = fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for n in names {
            walk(root, &n, out, by_ino);
        }
    }
}

pub fn xattrs(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut out = BTreeMap::new();
    let size = rustix::fs::llistxattr_query(p).unwrap_or(0);
    if size == 0 {
        return out;
    }
    let mut list = vec![0u8; size];
    let n = rustix::fs::llistxattr(p, &mut list[..]).unwrap();
    for name in list[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let vs = rustix::fs::lgetxattr_query(p, name).unwrap();
        let mut v = vec![0u8; vs];
        let got = rustix::fs::lgetxattr(p, name, &mut v[..]).unwrap();
        v.truncate(got);
        out.insert(name.to_vec(), v);
    }
    out
}

/// Compares two snapshots and returns one line per difference.
pub fn diff(a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let mut d = Vec::new();
    for (k, ea) in &a.entries {
        let name = String::from_utf8_lossy(k);
        match b.entries.get(k) {
            None => d.push(format!("{name}: missing")),
            Some(eb) if ea != eb => d.push(format!("{name}:\n  source {ea:?}\n  mount  {eb:?}")),
            _ => {}
        }
    }
    for k in b.entries.keys() {
        if !a.entries.contains_key(k) {
            d.push(format!("{}: unexpected", String::from_utf8_lossy(k)));
        }
    }
    if a.links != b.links {
        d.push(format!(
            "hardlink sets differ: {:?} vs {:?}",
            a.links, b.links
        ));
    }
    d
}

/// Writes `len` bytes of deterministic pseudo-random data.
pub fn write_pattern(p: &Path, len: usize, seed: u64) {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    fs::write(p, data).unwrap();
}

/// A tree holding every kind of entry cairn must carry.
pub fn build_full_tree(t: &Path) {
    use std::os::unix::fs::{symlink, PermissionsExt};
    fs::create_dir_all(t).unwrap();
    fs::write(t.join("empty"), b"").unwrap();
    fs::write(t.join("small"), b"hello, cairn\n").unwrap();
    write_pattern(&t.join("inline-max"), 64, 1);
    write_pattern(&t.join("just-over-inline"), 65, 2);
    write_pattern(&t.join("four-k"), 4096, 3);
    write_pattern(&t.join("large"), 3 << 20, 4);
    // Sparse: 64 MiB with data at both ends and holes between.
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = fs::File::create(t.join("sparse")).unwrap();
        f.write_all(b"start").unwrap();
        f.seek(SeekFrom::Start(32 << 20)).unwrap();
        f.write_all(b"middle").unwrap();
        f.set_len(64 << 20).unwrap();
    }
    // Hardlinks, within a directory and across directories.
    fs::create_dir(t.join("links")).unwrap();
    write_pattern(&t.join("links/original"), 10000, 5);
    fs::hard_link(t.join("links/original"), t.join("links/second")).unwrap();
    fs::hard_link(t.join("links/original"), t.join("third-name")).unwrap();
    fs::write(t.join("links/small-original"), b"tiny").unwrap();
    fs::hard_link(t.join("links/small-original"), t.join("links/small-link")).unwrap();
    // Symlinks, short and long.
    symlink("small", t.join("symlink")).unwrap();
    symlink("/absolute/target/that/does/not/exist", t.join("dangling")).unwrap();
    let long: String = "x/".repeat(2000) + "end";
    symlink(&long, t.join("long-symlink")).unwrap();
    // Special files.
    run("mkfifo", &[t.join("fifo").as_os_str()]);
    run(
        "mknod",
        &[t.join("chardev").as_os_str(), os("c"), os("1"), os("3")],
    );
    run(
        "mknod",
        &[t.join("blockdev").as_os_str(), os("b"), os("7"), os("200")],
    );
    let _sock = std::os::unix::net::UnixListener::bind(t.join("socket")).unwrap();
    // A directory with thousands of entries (several dirent blocks).
    fs::create_dir(t.join("many")).unwrap();
    for i in 0..3000 {
        fs::write(
            t.join(format!("many/entry-{i:05}-with-a-longer-name")),
            i.to_string(),
        )
        .unwrap();
    }
    // Names with spaces, newlines and bytes that are not UTF-8.
    fs::write(t.join("name with spaces"), b"s").unwrap();
    fs::write(t.join("new\nline"), b"n").unwrap();
    fs::write(t.join(OsStr::from_bytes(b"latin1-\xe9t\xe9")), b"l").unwrap();
    fs::write(t.join(OsStr::from_bytes(b"-")), b"dash").unwrap();
    fs::create_dir(t.join("deep")).unwrap();
    let mut d = t.join("deep");
    for i in 0..40 {
        d = d.join(format!("level{i}"));
        fs::create_dir(&d).unwrap();
    }
    fs::write(d.join("bottom"), b"bottom").unwrap();
    // Modes: setuid, setgid, sticky, odd permissions.
    fs::write(t.join("setuid"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(t.join("setuid"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::write(t.join("setgid"), b"g").unwrap();
    fs::set_permissions(t.join("setgid"), fs::Permissions::from_mode(0o2711)).unwrap();
    fs::create_dir(t.join("sticky")).unwrap();
    fs::set_permissions(t.join("sticky"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::write(t.join("no-perms"), b"0").unwrap();
    fs::set_permissions(t.join("no-perms"), fs::Permissions::from_mode(0o000)).unwrap();
    // Ownership.
    fs::write(t.join("owned"), b"o").unwrap();
    rustix::fs::chown(
        t.join("owned"),
        Some(rustix::fs::Uid::from_raw(1000)),
        Some(rustix::fs::Gid::from_raw(1001)),
    )
    .unwrap();
    fs::write(t.join("owned-high"), b"h").unwrap();
    rustix::fs::chown(
        t.join("owned-high"),
        Some(rustix::fs::Uid::from_raw(70000)),
        Some(rustix::fs::Gid::from_raw(80000)),
    )
    .unwrap();
    // xattrs: user, trusted (including one overlayfs would interpret), security, ACLs.
    run(
        "setfattr",
        &[
            os("-n"),
            os("user.note"),
            os("-v"),
            os("hello"),
            t.join("small").as_os_str(),
        ],
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("user.shared"),
            os("-v"),
            os("same"),
            t.join("small").as_os_str(),
        ],
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("user.shared"),
            os("-v"),
            os("same"),
            t.join("large").as_os_str(),
        ],
    );
    run(
        "setfattr",
        &[os("-n"), os("user.empty"), t.join("large").as_os_str()],
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("trusted.cairn"),
            os("-v"),
            os("t"),
            t.join("four-k").as_os_str(),
        ],
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("trusted.overlay.opaque"),
            os("-v"),
            os("y"),
            t.join("sticky").as_os_str(),
        ],
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("security.cairn"),
            os("-v"),
            os("s"),
            t.join("links/original").as_os_str(),
        ],
    );
    run(
        "setfattr",
        &[
            os("-n"),
            os("user.on-symlink-dir"),
            os("-v"),
            os("d"),
            t.join("links").as_os_str(),
        ],
    );
    run(
        "setfacl",
        &[os("-m"), os("u:1234:r-x"), t.join("setgid").as_os_str()],
    );
    run(
        "setfacl",
        &[
            os("-d"),
            os("-m"),
            os("g:555:rwx"),
            t.join("many").as_os_str(),
        ],
    );
    // Nanosecond mtimes, old and new; set last so nothing above touches them.
    let times = [
        ("small", 1_633_950_376, 123_456_789),
        ("large", 1_000_000_000, 1),
        ("sparse", 2_000_000_000, 999_999_999),
        ("fifo", 1_700_000_000, 500),
    ];
    for (name, sec, nsec) in times {
        let ts = rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec {
                tv_sec: sec,
                tv_nsec: nsec,
            },
            last_modification: rustix::fs::Timespec {
                tv_sec: sec,
                tv_nsec: nsec,
            },
        };
        rustix::fs::utimensat(
            rustix::fs::CWD,
            t.join(name),
            &ts,
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )
        .unwrap();
    }
}

/// sha256 of every file under the store's objects/ (to prove nothing changed).
pub fn objects_fingerprint(store: &Path) -> BTreeMap<PathBuf, (u32, String)> {
    let mut out = BTreeMap::new();
    let objects = store.join("objects");
    let mut stack = vec![objects.clone()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p);
            } else {
                let data = fs::read(&p).unwrap();
                out.insert(
                    p.strip_prefix(&objects).unwrap().to_path_buf(),
                    (m.mode(), hex::encode(Sha256::digest(&data))),
                );
            }
        }
    }
    out
}

/// A mount that is unmounted when dropped (so a failing test leaves nothing behind).
pub struct Mounted {
    pub root: PathBuf,
    pub target: PathBuf,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = cairn_raw(&self.root, &[os("umount"), self.target.as_os_str()]);
    }
}

pub fn mount(root: &Path, image: &Path, target: &Path, extra: &[&str]) -> Mounted {
    fs::create_dir_all(target).unwrap();
    let mut args: Vec<&OsStr> = vec![os("mount"), image.as_os_str(), target.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    cairn(root, &args);
    Mounted {
        root: root.to_path_buf(),
        target: target.to_path_buf(),
    }
}
