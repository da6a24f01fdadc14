//! Layer records from a table of contents instead of a tar stream.
//!
//! An eStargz layer carries a TOC that lists every tar entry of the layer,
//! in tar order, with its metadata and, for a regular file, the sha256 of
//! its contents. A lazy pull builds the image's metadata from the TOCs
//! without reading any file: each TOC entry is turned into the tar entry
//! it describes and checked and recorded by the same code a tar entry
//! goes through (`entry::prepare`), so whiteouts, opaque directories, hard
//! links, modes, owners, xattrs, symlinks and devices mean exactly what
//! they mean in a full pull. The one difference: a regular file's payload
//! is named by the sha256 of its contents (`ab/cdef…`, the same 32-byte
//! namespace as fs-verity object names), not by its fs-verity digest,
//! which cannot be known before the contents are read; no file is inlined
//! in the image and no verity digest is recorded. The records are then
//! applied by `apply`, as the layers of a full pull are.

use std::collections::BTreeMap;

use cairn_erofs::tree::{InodeData, RegularFile, Tree};
use cairn_erofs::Mtime;

use crate::apply::{apply_layer, compact, empty_image};
use crate::entry::{prepare, AddError, Prepared};
use crate::tar::TarEntry;
use crate::LayerError;

/// What a TOC entry is: the tar entry types, the same enum the tar
/// reader uses.
pub use crate::tar::EntryKind as TocKind;

/// One entry of a table of contents, as the tar entry it stands for.
#[derive(Debug, Clone)]
pub struct TocEntry {
    /// The path as the tar had it (cleaned again here).
    pub path: Vec<u8>,
    pub kind: TocKind,
    /// Permission bits (`0o7777` are used).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: Mtime,
    /// Symlink target or hardlink target path.
    pub link: Vec<u8>,
    pub devmajor: u32,
    pub devminor: u32,
    /// Regular files: the size.
    pub size: u64,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Regular files with contents: the sha256 of the contents, which
    /// becomes the payload's name.
    pub sha256: Option<[u8; 32]>,
}

/// The layer record (dumpfile lines, as `cairn_store::record` describes)
/// of one layer's TOC entries; `layer` names it in errors.
pub fn toc_layer_record(
    entries: impl IntoIterator<Item = TocEntry>,
    layer: &str,
) -> Result<Vec<u8>, LayerError> {
    let mut out = Vec::new();
    for t in entries {
        let e = TarEntry {
            offset: 0,
            data_offset: 0,
            path: t.path.clone(),
            link: t.link,
            kind: t.kind,
            mode: t.mode & 0o7777,
            uid: t.uid,
            gid: t.gid,
            mtime: t.mtime,
            devmajor: t.devmajor,
            devminor: t.devminor,
            size: t.size,
            stored: t.size,
            sparse: None,
            xattrs: t.xattrs,
        };
        let fail = |reason: String| LayerError::Apply {
            layer: layer.to_owned(),
            path: String::from_utf8_lossy(&t.path).into_owned(),
            reason,
        };
        let prepared = prepare(&e).map_err(|e| match e {
            AddError::Reason(r) => fail(r),
            AddError::Tar(t) => fail(format!("{t:?}")),
            AddError::Store(s) => fail(s.to_string()),
        })?;
        match prepared {
            Prepared::Skip => {}
            Prepared::Line(path, inode, hardlink) => {
                cairn_erofs::dump::format_entry_line(&mut out, &path, &inode, hardlink.as_deref())
            }
            Prepared::Regular(path, mut inode) => {
                if t.size > 0 {
                    let sha = t
                        .sha256
                        .ok_or_else(|| fail("a regular file with contents but no digest".into()))?;
                    let id = cairn_store::ObjectId(sha);
                    inode.data = InodeData::Regular(RegularFile {
                        content: None,
                        payload: Some(id.object_path().into_bytes()),
                        digest: None,
                    });
                }
                cairn_erofs::dump::format_entry_line(&mut out, &path, &inode, None)
            }
        }
    }
    Ok(out)
}

/// Applies layer records (bottom first; each with the name errors give
/// it) onto an empty tree, as a full pull applies its layers.
pub fn tree_from_records(records: &[(String, Vec<u8>)]) -> Result<Tree, LayerError> {
    let mut image = empty_image();
    for (name, record) in records {
        apply_layer(&mut image, record.as_slice(), name)?;
    }
    Ok(compact(image))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, kind: TocKind) -> TocEntry {
        TocEntry {
            path: path.as_bytes().to_vec(),
            kind,
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: Mtime::default(),
            link: Vec::new(),
            devmajor: 0,
            devminor: 0,
            size: 0,
            xattrs: BTreeMap::new(),
            sha256: None,
        }
    }

    #[test]
    fn whiteouts_and_links_apply_as_in_a_full_pull() {
        let mut f = entry("a/f", TocKind::Regular);
        f.size = 100;
        f.sha256 = Some([7; 32]);
        f.mode = 0o100644;
        let mut l = entry("a/l", TocKind::Hardlink);
        l.link = b"a/f".to_vec();
        let mut s = entry("a/s", TocKind::Symlink);
        s.link = b"f".to_vec();
        let lower = toc_layer_record(
            vec![
                entry("a", TocKind::Directory),
                f,
                l,
                s,
                entry("b", TocKind::Directory),
                entry("b/x", TocKind::Fifo),
            ],
            "lower",
        )
        .unwrap();
        let upper = toc_layer_record(
            vec![
                entry("a/.wh.s", TocKind::Regular),
                entry("b/.wh..wh..opq", TocKind::Regular),
            ],
            "upper",
        )
        .unwrap();
        let tree = tree_from_records(&[("lower".into(), lower), ("upper".into(), upper)]).unwrap();
        let dump = cairn_erofs::dump::tree_to_dump_string(&tree).unwrap();
        assert!(
            dump.contains("/a/f 100 100644 2 0 0 0 0.0 07/0707"),
            "{dump}"
        );
        assert!(dump.contains("/a/l "), "{dump}");
        assert!(!dump.contains("/a/s "), "{dump}");
        assert!(!dump.contains("/b/x "), "{dump}");
    }

    #[test]
    fn a_bad_entry_is_named() {
        let mut f = entry("x", TocKind::Regular);
        f.size = 10;
        let e = toc_layer_record(vec![f], "sha256:l")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no digest") && e.contains("sha256:l"), "{e}");
        let e = toc_layer_record(vec![entry(".wh.", TocKind::Regular)], "l")
            .unwrap_err()
            .to_string();
        assert!(e.contains("whiteout names nothing"), "{e}");
    }
}
