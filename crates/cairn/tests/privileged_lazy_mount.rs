//! A lazily pulled image, once `cairn fetch` has completed it, mounts and
//! reads exactly like the same image pulled whole: same entries, modes,
//! owners, symlinks and file contents. Mounts for real; fails loudly when
//! not run as root.

mod support;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use support::images::ImageSet;
use support::registry::LocalRegistry;
use support::{cairn_ok, cairn_out};

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test mounts and must run as root (it is not skipped)"
    );
}

/// Unmounts on drop, so a failed assertion leaves nothing mounted.
struct Mounted {
    root: PathBuf,
    target: PathBuf,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let out = cairn_out(&self.root, &[Path::new("umount"), &self.target]);
        assert!(
            out.status.success() || std::thread::panicking(),
            "umount {}: {}",
            self.target.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn mount(root: &Path, image: &str, target: &Path) -> Mounted {
    fs::create_dir_all(target).unwrap();
    cairn_ok(root, &[Path::new("mount"), Path::new(image), target]);
    Mounted {
        root: root.to_path_buf(),
        target: target.to_path_buf(),
    }
}

/// Every entry below `dir`: type, mode, owner, size, and the contents of
/// files and targets of symlinks.
fn tree(dir: &Path) -> BTreeMap<PathBuf, (u32, u32, u32, u64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let m = fs::symlink_metadata(&p).unwrap();
            let data = if m.file_type().is_symlink() {
                fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if m.is_file() {
                fs::read(&p).unwrap()
            } else {
                Vec::new()
            };
            if m.is_dir() {
                stack.push(p.clone());
            }
            let size = if m.is_dir() { 0 } else { m.len() };
            out.insert(
                p.strip_prefix(dir).unwrap().to_path_buf(),
                (m.mode(), m.uid(), m.gid(), size, data),
            );
        }
    }
    out
}

#[test]
fn privileged_fetched_lazy_image_mounts_like_a_full_pull() {
    require_root();
    let reg = LocalRegistry::start();
    ImageSet::get().push(&reg, "lazy/set");
    let dir = tempfile::Builder::new()
        .prefix("cairn-lazy")
        .tempdir()
        .unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let reference = reg.reference("lazy/set:full");
    cairn_ok(&a, &["pull", "-q", &reference]);
    cairn_ok(
        &a,
        &[
            "push",
            "-q",
            &reference,
            &reg.reference("lazy/set:full-lazy"),
            "--pack-size",
            "1M",
        ],
    );
    cairn_ok(&b, &["pull", "-q", "--lazy", &reference]);
    cairn_ok(&b, &["fetch", "-q", &reference]);

    let full = mount(&a, &reference, &dir.path().join("mnt-a"));
    let lazy = mount(&b, &reference, &dir.path().join("mnt-b"));
    let (ta, tb) = (tree(&full.target), tree(&lazy.target));
    assert!(ta.len() > 900, "{} entries", ta.len());
    assert_eq!(ta.len(), tb.len());
    for (path, want) in &ta {
        let got = tb
            .get(path)
            .unwrap_or_else(|| panic!("{} missing", path.display()));
        assert!(got == want, "{} differs", path.display());
    }
    drop(lazy);
    drop(full);
}
