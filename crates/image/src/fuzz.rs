//! Fuzzing oracles: entry points for `cargo fuzz` targets (see `fuzz/`)
//! that drive this crate's untrusted-input paths with arbitrary bytes and
//! panic only on a broken invariant.

use std::collections::BTreeMap;

use cairn_erofs::dump::{format_entry_line, parse_line, print_dump};
use cairn_erofs::tree::{InodeId, Tree, MAX_DEPTH, ROOT, S_IFCHR, S_IFDIR, S_IFLNK, S_IFREG};
use cairn_erofs::{Inode, InodeData};

use cairn_store::OPAQUE_MARKER;

use crate::apply::{compact, empty_image, Applier};
use crate::entry::clean_path;

/// Names the generated paths are made of: few, so entries collide.
const NAMES: &[&[u8]] = &[b"a", b"b", b"lib", b"usr", b"..", b".", b"x"];
/// Symlink targets: relative, absolute, climbing, looping, dangling.
const TARGETS: &[&[u8]] = &[
    b"a",
    b"b",
    b"usr/lib",
    b"/usr/lib",
    b"../..",
    b".",
    b"/",
    b"..",
    b"a/b",
    b"/a/../b",
    b"../../../x",
    b"lib",
    b"nowhere/deep",
];

/// Reads bytes as a small program of layers, each a list of entries
/// (files, directories, symlinks, hardlinks, whiteouts, opaque markers on
/// a few colliding names), applies them as image assembly does, and checks
/// after every entry that:
///
/// - nothing panics, and an entry that fails fails with a reason;
/// - the tree stays well formed (prints as a dumpfile that reads back the
///   same; no path deeper than the format allows), so nothing can be
///   outside the root;
/// - an entry other than a whiteout removes at most what was at its own
///   resolved name: every name that disappears lies at or below one path,
///   and that path exists afterwards (so a symlink the entry's parents go
///   through is kept, never replaced by a directory).
#[doc(hidden)]
pub fn fuzz_apply(data: &[u8]) {
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next();
    let mut image = empty_image();
    let mut layers = 0;
    while layers < 8 {
        layers += 1;
        let mut a = Applier::new(&mut image);
        let mut entries = 0;
        while entries < 48 {
            entries += 1;
            let Some(op) = next() else { return };
            if op == 0xff {
                break; // next layer
            }
            let depth = 1 + (next().unwrap_or(0) % 3) as usize;
            let mut raw = Vec::new();
            for i in 0..depth {
                if i > 0 {
                    raw.push(b'/');
                }
                raw.extend_from_slice(NAMES[next().unwrap_or(0) as usize % NAMES.len()]);
            }
            let kind = op % 7;
            if kind == 4 || kind == 5 {
                // A whiteout of the last name, or an opaque marker.
                let name: &[u8] = if kind == 5 { OPAQUE_MARKER } else { b".wh.a" };
                raw.push(b'/');
                raw.extend_from_slice(name);
            }
            let Ok(comps) = clean_path(&raw) else {
                continue;
            };
            if comps.is_empty() {
                continue;
            }
            let path: Vec<u8> = comps.iter().flat_map(|c| [&b"/"[..], c].concat()).collect();
            let target = TARGETS[next().unwrap_or(0) as usize % TARGETS.len()];
            let (inode, hardlink) = match kind {
                0 => (Inode::new(S_IFREG | 0o644).expect("mode"), None),
                1 => (Inode::new(S_IFDIR | 0o755).expect("mode"), None),
                2 | 6 => {
                    let mut l = Inode::new(S_IFLNK | 0o777).expect("mode");
                    l.size = target.len() as u64;
                    l.data = InodeData::Symlink(target.to_vec());
                    (l, None)
                }
                3 => {
                    let t = clean_path(target).unwrap_or_default();
                    let t: Vec<u8> = t.iter().flat_map(|c| [&b"/"[..], c].concat()).collect();
                    let t = if t.is_empty() { b"/".to_vec() } else { t };
                    (Inode::new(S_IFREG).expect("mode"), Some(t))
                }
                _ => (Inode::new(S_IFCHR).expect("mode"), None),
            };
            // Through the record's line syntax, as assembly reads it.
            let mut line = Vec::new();
            format_entry_line(&mut line, &path, &inode, hardlink.as_deref());
            let (path, what) = match parse_line(line.strip_suffix(b"\n").unwrap_or(&line)) {
                Ok(parsed) => parsed,
                Err(e) => panic!("a generated line does not read back: {e}"),
            };
            let whiteout = kind == 4 || kind == 5;
            let before = names(a.tree());
            match a.apply_entry(&path, what) {
                Ok(()) => {}
                Err(reason) => {
                    assert!(!reason.is_empty(), "an error without a reason");
                    continue;
                }
            }
            let after = names(a.tree());
            check_well_formed(a.tree());
            if !whiteout {
                check_removed_one_place(&before, &after, &path);
            }
        }
    }
    let image = compact(image);
    check_well_formed(&image);
}

/// Every path in the tree (no leading `/`) → the inode there.
fn names(tree: &Tree) -> BTreeMap<Vec<u8>, InodeId> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<(InodeId, Vec<u8>, usize)> = vec![(ROOT, Vec::new(), 0)];
    while let Some((dir, prefix, depth)) = stack.pop() {
        let Some(entries) = tree.inode(dir).entries() else {
            continue;
        };
        assert!(depth <= MAX_DEPTH, "a path deeper than {MAX_DEPTH}");
        for (name, e) in entries {
            assert!(
                !name.is_empty() && name != b"." && name != b".." && !name.contains(&b'/'),
                "an invalid name {name:?}"
            );
            let p = if prefix.is_empty() {
                name.clone()
            } else {
                [&prefix[..], b"/", name].concat()
            };
            out.insert(p.clone(), e.inode);
            if tree.inode(e.inode).is_dir() {
                stack.push((e.inode, p, depth + 1));
            }
        }
    }
    out
}

fn check_well_formed(tree: &Tree) {
    let tree = compact(tree.clone());
    let mut text = Vec::new();
    if let Err(e) = print_dump(&tree, &mut text) {
        panic!("the applied tree does not print: {e}");
    }
    let back = match cairn_erofs::dump::parse_dump_bytes(&text, &Default::default()) {
        Ok(t) => t,
        Err(e) => panic!("the applied tree's dump does not read back: {e}"),
    };
    let mut again = Vec::new();
    print_dump(&back, &mut again).expect("a parsed tree prints");
    assert_eq!(text, again, "the applied tree changes through its dump");
}

fn check_removed_one_place(
    before: &BTreeMap<Vec<u8>, InodeId>,
    after: &BTreeMap<Vec<u8>, InodeId>,
    entry: &[u8],
) {
    let gone: Vec<&Vec<u8>> = before
        .iter()
        .filter(|(p, id)| after.get(*p) != Some(id))
        .map(|(p, _)| p)
        .collect();
    // Paths sort before their descendants, so the first one is the top.
    let Some(top) = gone.first() else { return };
    for p in &gone {
        let below = p.len() > top.len() && p.starts_with(top) && p[top.len()] == b'/';
        assert!(
            *p == *top || below,
            "entry {} removed {} and {}, two places",
            String::from_utf8_lossy(entry),
            String::from_utf8_lossy(top),
            String::from_utf8_lossy(p)
        );
    }
    assert!(
        after.contains_key(*top),
        "entry {} removed {} without putting anything there",
        String::from_utf8_lossy(entry),
        String::from_utf8_lossy(top)
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn fuzz_apply_runs_on_simple_inputs() {
        for seed in 0u32..150 {
            let data: Vec<u8> = (0..200u32)
                .map(|i| {
                    (i.wrapping_mul(2654435761)
                        .wrapping_add(seed.wrapping_mul(40503))
                        >> 11) as u8
                })
                .collect();
            super::fuzz_apply(&data);
        }
    }
}
