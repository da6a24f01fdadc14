//! A directory as a tar stream, its files read straight from the directory
//! (`ScanOptions::metadata_only` + `TarContents::Dir`, the snapshotter's
//! commit) against the same directory scanned into the store and written
//! from its objects (`write_tar`): the same bytes. And what the directory
//! source refuses: a file that changed since the scan, a symlink put in
//! the place of a file or of a directory on its path.

mod common;

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use cairn_image::{scan_dir, write_tar, write_tar_from, ScanOptions, TarContents};
use common::*;

fn tree_at(root: &Path) {
    fs::create_dir_all(root.join("etc/deep/er")).unwrap();
    fs::create_dir_all(root.join("usr/bin")).unwrap();
    fs::write(root.join("etc/hostname"), b"h\n").unwrap();
    fs::write(root.join("etc/empty"), b"").unwrap();
    fs::write(root.join("etc/deep/er/big"), vec![7u8; 300_000]).unwrap();
    for i in 0..50 {
        fs::write(root.join(format!("usr/bin/f{i}")), vec![i as u8; 1000 * i]).unwrap();
    }
    fs::hard_link(root.join("usr/bin/f10"), root.join("usr/bin/f10-link")).unwrap();
    symlink("../etc/hostname", root.join("usr/host")).unwrap();
    fs::set_permissions(root.join("usr/bin/f3"), fs::Permissions::from_mode(0o4755)).unwrap();
    rustix::fs::setxattr(
        root.join("etc/hostname"),
        "user.cairn",
        b"v",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
}

/// `root` as a tar twice: scanned into `store` and written from its
/// objects, then scanned for metadata only and written from the directory
/// (after `between` runs). Each with its entry count.
fn tars_of(root: &Path, store: &cairn_store::Store, between: impl FnOnce()) -> [(Vec<u8>, u64); 2] {
    let (stored, _) = scan_dir(
        root,
        &ScanOptions {
            store: Some(store),
            ..Default::default()
        },
    )
    .unwrap();
    let mut from_objects = Vec::new();
    let n1 = write_tar(&stored, store, &mut from_objects).unwrap();
    let (meta, _) = scan_dir(
        root,
        &ScanOptions {
            metadata_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    between();
    let mut from_dir = Vec::new();
    let n2 = write_tar_from(&meta, TarContents::Dir(root), &mut from_dir).unwrap();
    [(from_objects, n1), (from_dir, n2)]
}

#[test]
fn a_directory_source_writes_the_tar_its_objects_write() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("tree");
    tree_at(&root);
    let store = open_store(&d.path().join("store"));
    let [(from_objects, n1), (from_dir, n2)] = tars_of(&root, &store, || ());
    assert_eq!(n1, n2);
    assert!(from_objects.len() > 300_000);
    assert!(from_objects == from_dir, "the same tar bytes");
    // And the importer makes the same layer of either.
    let a = import(&store, &from_dir).unwrap();
    let b = import(&store, &from_objects).unwrap();
    assert_eq!(a.diff_id, b.diff_id);
}

#[test]
fn a_directory_source_refuses_what_changed_since_the_scan() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("tree");
    let outside = d.path().join("secret");
    fs::write(&outside, vec![1u8; 1000]).unwrap();
    let meta_only = ScanOptions {
        metadata_only: true,
        ..Default::default()
    };
    let tar_of = |root: &Path| {
        let (t, _) = scan_dir(root, &meta_only).unwrap();
        t
    };
    let write = |t: &cairn_erofs::Tree| {
        let mut out = Vec::new();
        write_tar_from(t, TarContents::Dir(&root), &mut out).map(|_| ())
    };

    // A file that grew.
    tree_at(&root);
    let t = tar_of(&root);
    fs::write(root.join("etc/deep/er/big"), vec![7u8; 300_001]).unwrap();
    let e = write(&t).unwrap_err().to_string();
    assert!(
        e.contains("etc/deep/er/big") && e.contains("changed since it was scanned"),
        "{e}"
    );

    // A file replaced by a symlink of the same length's target.
    fs::remove_dir_all(&root).unwrap();
    tree_at(&root);
    fs::write(root.join("usr/bin/f1"), vec![1u8; 1000]).unwrap();
    let t = tar_of(&root);
    fs::remove_file(root.join("usr/bin/f1")).unwrap();
    symlink(&outside, root.join("usr/bin/f1")).unwrap();
    let e = write(&t).unwrap_err().to_string();
    assert!(e.contains("usr/bin/f1"), "{e}");

    // A file replaced by a FIFO: refused, not waited on.
    fs::remove_dir_all(&root).unwrap();
    tree_at(&root);
    let t = tar_of(&root);
    fs::remove_file(root.join("usr/bin/f7")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("usr/bin/f7"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let e = write(&t).unwrap_err().to_string();
    assert!(
        e.contains("usr/bin/f7") && e.contains("not a regular file"),
        "{e}"
    );

    // A directory on the path replaced by a symlink to another tree.
    fs::remove_dir_all(&root).unwrap();
    tree_at(&root);
    let t = tar_of(&root);
    let elsewhere = d.path().join("elsewhere");
    fs::rename(root.join("etc/deep"), &elsewhere).unwrap();
    symlink(&elsewhere, root.join("etc/deep")).unwrap();
    let e = write(&t).unwrap_err().to_string();
    assert!(e.contains("etc/deep/er/big"), "{e}");
}

/// Drops `root`'s regular files from the page cache (written back first),
/// and says whether the kernel now holds the first page of none of them
/// (`mincore`, which starts no read).
fn evict(root: &Path) -> bool {
    let mut files = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() && e.metadata().unwrap().len() > 0 {
                let f = fs::File::open(e.path()).unwrap();
                f.sync_all().unwrap();
                rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
                files.push(f);
            }
        }
    }
    files.iter().all(|f| {
        use std::os::fd::AsRawFd;
        let mut v = 0u8;
        // SAFETY: a shared read-only mapping of one page of a file this
        // test holds open, unmapped before the closure returns; mincore
        // writes one byte for one page into `v`.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::mincore(p, 4096, &mut v), 0);
            libc::munmap(p, 4096);
        }
        v & 1 == 0
    })
}

/// A tree that is not in the page cache is read ahead of the writer by
/// other threads (`write_tar_from`'s read-ahead): the bytes are the same.
#[test]
fn a_directory_read_from_the_disk_writes_the_same_tar() {
    // Not tmpfs: its pages cannot be dropped.
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let root = d.path().join("tree");
    tree_at(&root);
    // Enough files for the read-ahead to run ahead of the writer, in
    // several directories, some larger than one read.
    for dir in 0..8 {
        let p = root.join(format!("many/d{dir}"));
        fs::create_dir_all(&p).unwrap();
        for i in 0..300usize {
            let len = (i * 997 + dir * 131) % 20_000 + if i % 97 == 0 { 600_000 } else { 0 };
            let body: Vec<u8> = (0..len).map(|b| (b * 7 + i + dir) as u8).collect();
            fs::write(p.join(format!("f{i}")), body).unwrap();
        }
    }
    let store = open_store(&d.path().join("store"));
    let [(from_objects, n1), (from_dir, n2)] = tars_of(&root, &store, || {
        assert!(
            evict(&root),
            "files of {} stayed in the page cache: this test needs a filesystem that drops pages",
            root.display()
        )
    });
    assert_eq!(n1, n2);
    assert!(from_objects.len() > 30_000_000, "{}", from_objects.len());
    assert!(from_objects == from_dir, "the same tar bytes");
}
