//! Tests of the dumpfile parser and printer, most of them over the
//! reference's test vectors.
use std::io::{self, Read as _};

use super::parse::{Fields, MAX_XATTR_FIELD_LEN};
use super::*;
use crate::tree::{
    DirEntry, FileType, Inode, InodeData, InodeId, Mtime, RegularFile, Tree, MAX_DEPTH,
    MAX_INLINE_CONTENT, MAX_PATH_LEN, ROOT, S_IFCHR, S_IFDIR, S_IFLNK, S_IFREG,
};

const STRICT: ParseOptions = ParseOptions { strict: true };
const LENIENT: ParseOptions = ParseOptions { strict: false };

/// Vectors the reference test suite parses in lenient mode.
const LENIENT_VECTORS: &[&str] = &[
    "no-newline.dump",
    "longlink.dump",
    "honggfuzz-longlink-unterminated.dump",
];

#[path = "../../tests/common/vectors.rs"]
mod vectors;
use vectors::vectors_dir;

fn read_vector(name: &str) -> Vec<u8> {
    let path = vectors_dir().join(name);
    let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if name.ends_with(".gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .unwrap();
        out
    } else {
        raw
    }
}

/// Every dump vector, sorted, as (name, is_should_fail).
fn vector_names() -> Vec<(String, bool)> {
    let mut names: Vec<(String, bool)> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".dump") || n.ends_with(".dump.gz"))
        .map(|n| {
            let bad = n.starts_with("should-fail-");
            (n, bad)
        })
        .collect();
    names.sort();
    names
}

fn good_vectors() -> Vec<String> {
    let good: Vec<String> = vector_names()
        .into_iter()
        .filter(|(_, bad)| !bad)
        .map(|(n, _)| n)
        .collect();
    assert!(good.len() >= 13, "too few vectors found: {good:?}");
    good
}

fn opts_for(name: &str) -> ParseOptions {
    if LENIENT_VECTORS.contains(&name) {
        LENIENT
    } else {
        STRICT
    }
}

fn parse(text: &str) -> Result<Tree, DumpError> {
    parse_dump(text.as_bytes(), &STRICT)
}

fn parse_ok(text: &str) -> Tree {
    parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn err(text: &str, opts: &ParseOptions) -> String {
    match parse_dump(text.as_bytes(), opts) {
        Ok(_) => panic!("parsed but should not:\n{text}"),
        Err(e) => e.to_string(),
    }
}

fn roundtrip(tree: &Tree) -> String {
    let text = tree_to_dump_string(tree).unwrap();
    let again = parse_dump(text.as_bytes(), &STRICT)
        .unwrap_or_else(|e| panic!("printed dump does not parse: {e}"));
    assert_eq!(&again, tree, "parse → print → parse changed the tree");
    let text2 = tree_to_dump_string(&again).unwrap();
    assert_eq!(text, text2, "printing is not stable");
    text
}

fn id(tree: &Tree, path: &str) -> InodeId {
    tree.lookup(path.as_bytes())
        .unwrap_or_else(|| panic!("{path} missing"))
}

fn regular<'a>(tree: &'a Tree, path: &str) -> &'a RegularFile {
    match &tree.inode(id(tree, path)).data {
        InodeData::Regular(r) => r,
        other => panic!("{path} is not a regular file: {other:?}"),
    }
}

const ROOT_LINE: &str = "/ 4096 40755 2 0 0 0 0.0 - - -\n";

fn with_root(lines: &str) -> String {
    format!("{ROOT_LINE}{lines}")
}

#[test]
fn every_good_vector_parses_and_roundtrips() {
    for name in good_vectors() {
        let data = read_vector(&name);
        let tree =
            parse_dump(&data[..], &opts_for(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(tree.root().is_dir(), "{name}");
        roundtrip(&tree);
        // Strict and lenient agree wherever strict accepts.
        if !LENIENT_VECTORS.contains(&name.as_str()) {
            assert_eq!(parse_dump(&data[..], &LENIENT).unwrap(), tree, "{name}");
        }
    }
}

#[test]
fn every_path_line_becomes_one_entry() {
    // Each line but the root is exactly one directory entry.
    for name in good_vectors() {
        let data = read_vector(&name);
        let lines = data
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .count();
        let tree = parse_dump(&data[..], &opts_for(&name)).unwrap();
        let entries: usize = tree
            .inodes
            .iter()
            .filter_map(Inode::entries)
            .map(|e| e.len())
            .sum();
        assert_eq!(entries + 1, lines, "{name}");
        let hardlinks = data.windows(2).filter(|w| w == b" @").count();
        assert_eq!(tree.inodes.len() + hardlinks, lines, "{name}");
    }
}

#[test]
fn lenient_vectors_fail_strict() {
    let table: &[(&str, usize, &str)] = &[
        (
            "no-newline.dump",
            1,
            "RDEV 10 on a file that is not a device",
        ),
        (
            "longlink.dump",
            2,
            "symlink SIZE 5 is not the length of its target (4070)",
        ),
        (
            "honggfuzz-longlink-unterminated.dump",
            2,
            "symlink SIZE 0 is not the length of its target (4095)",
        ),
    ];
    assert_eq!(table.len(), LENIENT_VECTORS.len());
    for &(name, line, msg) in table {
        let e = parse_dump(&read_vector(name)[..], &STRICT).unwrap_err();
        assert_eq!(e.line(), line, "{name}: {e}");
        assert!(e.to_string().contains(msg), "{name}: {e}");
    }
}

#[test]
fn every_should_fail_vector_fails_strict() {
    // (file, line, message in strict mode, message in lenient mode when
    // the strict one is about strictness)
    let table: &[(&str, usize, &str, Option<&str>)] = &[
        (
            "should-fail-big-inline.dump",
            2,
            "missing newline at the end of the file",
            Some("inline CONTENT of 5004 bytes is larger than 5000"),
        ),
        (
            "should-fail-dir-hardlink.dump",
            2,
            "/rootlink: directories cannot be hardlinked",
            None,
        ),
        (
            "should-fail-dot-name.dump",
            2,
            "'.' and '..' are not valid names",
            None,
        ),
        (
            "should-fail-dotdot-name.dump",
            2,
            "'.' and '..' are not valid names",
            None,
        ),
        (
            "should-fail-empty-link-name.dump",
            2,
            "symlink without a target",
            None,
        ),
        (
            "should-fail-empty-name.dump",
            2,
            "//: empty file name",
            None,
        ),
        (
            "should-fail-empty-xattr-key.dump",
            2,
            "empty xattr name",
            None,
        ),
        (
            "should-fail-honggfuzz-long-xattr.dump",
            1,
            "missing newline at the end of the file",
            Some("xattrs too large"),
        ),
        (
            "should-fail-long-link.dump",
            2,
            "symlink target of 7248 bytes is longer than 4095",
            None,
        ),
        (
            "should-fail-long-xattr-key.dump",
            2,
            "too many xattrs: 123219 bytes of xattrs, at most 65535",
            None,
        ),
        (
            "should-fail-long-xattr-value.dump",
            2,
            // Its MODE (644) has no file type; the reference stops there too.
            "invalid MODE 644: no known file type",
            None,
        ),
        (
            "should-fail-no-ftype.dump",
            2,
            "invalid MODE 0: no known file type",
            None,
        ),
        (
            "should-fail-self-hardlink.dump",
            2,
            "missing newline at the end of the file",
            Some("hardlink /037blockdev points at itself"),
        ),
        (
            "should-fail-too-big.dump",
            2,
            "file of 9500000000000000 bytes is larger than the 9007199254740992 bytes",
            None,
        ),
    ];
    let on_disk: Vec<String> = vector_names()
        .into_iter()
        .filter(|(_, bad)| *bad)
        .map(|(n, _)| n)
        .collect();
    let in_table: Vec<String> = table.iter().map(|r| r.0.to_string()).collect();
    assert_eq!(on_disk, in_table, "every should-fail vector needs a row");

    for &(name, line, strict_msg, lenient_msg) in table {
        let data = read_vector(name);
        let e = parse_dump(&data[..], &STRICT).unwrap_err();
        assert_eq!(e.line(), line, "{name}: {e}");
        assert!(e.to_string().contains(strict_msg), "{name}: {e}");
        let e = parse_dump(&data[..], &LENIENT).unwrap_err();
        assert_eq!(e.line(), line, "{name} (lenient): {e}");
        let msg = lenient_msg.unwrap_or(strict_msg);
        assert!(e.to_string().contains(msg), "{name} (lenient): {e}");
    }
}

#[test]
fn special_vector_contents() {
    let tree = parse_dump(&read_vector("special.dump")[..], &STRICT).unwrap();
    let root = tree.root();
    assert_eq!(root.mode, S_IFDIR | 0o555);
    assert_eq!(
        root.mtime,
        Mtime {
            sec: 1633950376,
            nsec: 0
        }
    );
    assert_eq!(root.xattrs.get(&b"trusted.foo1"[..]).unwrap(), b"bar-1");

    let blk = tree.inode(id(&tree, "/blockdev"));
    assert_eq!(blk.file_type(), FileType::BlockDevice);
    assert_eq!(blk.rdev, 107690);
    assert!(tree.inode(id(&tree, "/whiteout")).is_whiteout());
    assert!(!tree.inode(id(&tree, "/chardev")).is_whiteout());

    let esc = tree.inode(id(&tree, "/escaped-xattr"));
    assert_eq!(
        esc.xattrs.get(&b"trusted.overlay.redirect"[..]).unwrap(),
        b"/foo\n"
    );
    let inline = regular(&tree, "/inline");
    assert_eq!(inline.content.as_deref(), Some(&b"FOOBAR\nINAFILE\n"[..]));
    assert_eq!(inline.payload, None);
    for (name, len) in [
        ("/inline-large1", 4095),
        ("/inline-large2", 4096),
        ("/inline-large3", 4097),
    ] {
        let r = regular(&tree, name);
        assert_eq!(r.content.as_ref().map(Vec::len), Some(len), "{name}");
        assert_eq!(tree.inode(id(&tree, name)).size, len as u64, "{name}");
    }
}

#[test]
fn hardlink_vector_shares_one_inode() {
    let tree = parse_dump(&read_vector("config-with-hard-link.dump.gz")[..], &STRICT).unwrap();
    let ls = id(&tree, "/usr/bin/ls");
    assert_eq!(id(&tree, "/usr/bin/ls-hardlink"), ls);
    let bin = tree.inode(id(&tree, "/usr/bin")).entries().unwrap();
    assert!(!bin[&b"ls"[..]].hardlink);
    assert!(bin[&b"ls-hardlink"[..]].hardlink);
    // The target keeps the nlink it declared.
    assert_eq!(tree.inode(ls).nlink, 2);
    let r = regular(&tree, "/usr/bin/ls");
    assert_eq!(
        r.payload.as_deref(),
        Some(&b"45/6d3b24fc32f6867e5ef79e6b428576cb14f22e0627e66945efcb3becc98a28"[..])
    );
    let text = roundtrip(&tree);
    assert!(text
        .contains("\n/usr/bin/ls-hardlink 142024 @100145 2 0 0 0 1633950376.0 /usr/bin/ls - - "));
}

#[test]
fn symlinks_take_their_size_from_the_target() {
    let tree = parse_dump(&read_vector("longlink.dump")[..], &LENIENT).unwrap();
    let link = tree.inode(id(&tree, "/max-link"));
    assert_eq!(link.size, 4095);
    assert!(matches!(&link.data, InodeData::Symlink(t) if t.len() == 4095));

    let tree = parse_ok(&with_root("/l 1 120777 1 0 0 0 0.0 x - -\n"));
    assert_eq!(
        tree.inode(id(&tree, "/l")).data,
        InodeData::Symlink(b"x".to_vec())
    );
    // Lenient: any SIZE, and CONTENT of that size is ignored.
    let tree = parse_dump(
        with_root("/l 3 120777 1 0 0 0 0.0 x abc -\n").as_bytes(),
        &LENIENT,
    )
    .unwrap();
    assert_eq!(tree.inode(id(&tree, "/l")).size, 1);
    assert!(
        err(&with_root("/l 3 120777 1 0 0 0 0.0 x abc -\n"), &STRICT)
            .contains("symlink SIZE 3 is not the length of its target (1)")
    );
    assert!(err(&with_root("/l 1 120777 1 0 0 0 0.0 x y -\n"), &STRICT)
        .contains("a symlink cannot have CONTENT"));
}

#[test]
fn hand_written_hardlinks() {
    // Forward reference, a chain through another hardlink, a hardlink
    // to a symlink; printed with the primary path.
    let text = with_root(
        "/a 0 @100644 0 0 0 0 0.0 /d/f - -\n\
             /b 0 @100644 0 0 0 0 0.0 /a - -\n\
             /d 4096 40755 2 0 0 0 0.0 - - -\n\
             /d/f 3 100644 3 7 8 0 5.6 - abc - user.x=1\n\
             /d/s 1 120777 1 0 0 0 0.0 t - -\n\
             /z 0 @120777 0 0 0 0 0.0 //d//s/ - -\n",
    );
    let tree = parse_ok(&text);
    let f = id(&tree, "/d/f");
    assert_eq!(id(&tree, "/a"), f);
    assert_eq!(id(&tree, "/b"), f);
    assert_eq!(id(&tree, "/z"), id(&tree, "/d/s"));
    assert_eq!(tree.inode(f).nlink, 3);
    assert_eq!(tree.inodes.len(), 4, "placeholders are gone");
    let root = tree.root().entries().unwrap();
    assert!(root[&b"a"[..]].hardlink && root[&b"b"[..]].hardlink && root[&b"z"[..]].hardlink);
    assert!(!root[&b"d"[..]].hardlink);
    let printed = roundtrip(&tree);
    assert_eq!(
        printed,
        "/ 4096 40755 2 0 0 0 0.0 - - -\n\
             /a 3 @100644 3 7 8 0 5.6 /d/f abc - user.x=1\n\
             /b 3 @100644 3 7 8 0 5.6 /d/f abc - user.x=1\n\
             /d 4096 40755 2 0 0 0 0.0 - - -\n\
             /d/f 3 100644 3 7 8 0 5.6 - abc - user.x=1\n\
             /d/s 1 120777 1 0 0 0 0.0 t - -\n\
             /z 1 @120777 1 0 0 0 0.0 /d/s - -\n"
    );
}

#[test]
fn bad_input_table() {
    // (input, message); the offending line is always the last one.
    let table: &[(&str, &str)] = &[
        ("", "line 1: no root directory: the dumpfile is empty"),
        ("\n", "empty PATH"),
        (
            "/a 0 100644 1 0 0 0 0.0 - - -\n",
            "/a: the first line must be the root directory /",
        ),
        (
            "/ 0 100644 1 0 0 0 0.0 - - -\n",
            "the root / must be a directory",
        ),
        (
            "/ 0 @40755 1 0 0 0 0.0 - - -\n",
            "/: directories cannot be hardlinked",
        ),
        (
            &with_root("/ 4096 40755 2 0 0 0 0.0 - - -\n"),
            "the root / appears twice",
        ),
        (&with_root("\n"), "empty PATH"),
        (
            &with_root("/a\0 0 100644 1 0 0 0 0.0 - - -\n"),
            "NUL byte at offset 2",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - -\n/a 0 100644 1 0 0 0 0.0 - - -\n"),
            "/a already exists",
        ),
        (
            &with_root("/x/a 0 100644 1 0 0 0 0.0 - - -\n"),
            "/x/a: parent directory does not exist",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - -\n/a/b 0 100644 1 0 0 0 0.0 - - -\n"),
            "/a/b: parent is not a directory",
        ),
        (
            &with_root("/a/ 0 100644 1 0 0 0 0.0 - - -\n"),
            "/a/: parent directory does not exist",
        ),
        (
            &with_root("/d 0 40755 1 0 0 0 0.0 - - -\n/d/ 0 100644 1 0 0 0 0.0 - - -\n"),
            "/d/: empty file name",
        ),
        (
            &with_root(&format!(
                "/{} 0 100644 1 0 0 0 0.0 - - -\n",
                "n".repeat(256)
            )),
            "name of 256 bytes is longer than 255",
        ),
        (
            &with_root("/a\\x00b 0 100644 1 0 0 0 0.0 - - -\n"),
            "PATH /a\\x00b contains a NUL byte",
        ),
        // Integers.
        (
            &with_root("/a  100644 1 0 0 0 0.0 - - -\n"),
            "invalid SIZE ''",
        ),
        (
            &with_root("/a 1x 100644 1 0 0 0 0.0 - - -\n"),
            "invalid SIZE '1x'",
        ),
        (
            &with_root("/a 0 100648 1 0 0 0 0.0 - - -\n"),
            "invalid MODE '100648'",
        ),
        (
            &with_root("/a 0 170644 1 0 0 0 0.0 - - -\n"),
            "invalid MODE 170644: no known file type",
        ),
        (
            &with_root("/a 0 100644 1 0 4294967296 0 0.0 - - -\n"),
            "GID 4294967296 is out of range",
        ),
        (
            &with_root("/a 0 100644 1 -1 0 0 0.0 - - -\n"),
            "UID -1 is out of range",
        ),
        (
            &with_root("/a 0 100644 1 0 0 x 0.0 - - -\n"),
            "invalid RDEV 'x'",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 99999999999999999999.0 - - -\n"),
            "MTIME seconds 99999999999999999999 is out of range",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 5 - - -\n"),
            "invalid MTIME nanoseconds ''",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 5.1.2 - - -\n"),
            "invalid MTIME nanoseconds '1.2'",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.4294967296 - - -\n"),
            "MTIME nanoseconds 4294967296 is out of range",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0\n"),
            "invalid MTIME seconds ''",
        ),
        // Escapes.
        (
            &with_root("/a\\q 0 100644 1 0 0 0 0.0 - - -\n"),
            "PATH: unsupported escape \\q",
        ),
        (
            &with_root("/a\\ 0 100644 1 0 0 0 0.0 - - -\n"),
            "PATH: backslash at the end",
        ),
        (
            &with_root("/a\\x4 0 100644 1 0 0 0 0.0 - - -\n"),
            "PATH: \\x needs two hex digits",
        ),
        (
            &with_root("/a\\xg0 0 100644 1 0 0 0 0.0 - - -\n"),
            "PATH: invalid hex escape \\xg0",
        ),
        // Regular files.
        (
            &with_root("/a 4 100644 1 0 0 0 0.0 - abc -\n"),
            "CONTENT has 3 bytes but SIZE is 4",
        ),
        (
            &with_root("/a 4 100644 1 0 0 0 0.0 - \\x -\n"),
            "CONTENT: \\x needs two hex digits",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - abc\n"),
            "invalid DIGEST abc: expected 64 hex digits",
        ),
        (
            &with_root(&format!(
                "/a 0 100644 1 0 0 0 0.0 - - {}g\n",
                "0".repeat(63)
            )),
            "invalid DIGEST",
        ),
        (
            &with_root(&format!(
                "/a 0 100644 1 0 0 0 0.0 {} - -\n",
                "p".repeat(4096)
            )),
            "PAYLOAD of 4096 bytes is longer than 4095",
        ),
        (
            &with_root("/a 9007199254740993 100644 1 0 0 0 0.0 - - -\n"),
            "file of 9007199254740993 bytes is larger",
        ),
        // Symlinks.
        (
            &with_root("/l 0 120777 1 0 0 0 0.0 - - -\n"),
            "symlink without a target (PAYLOAD is -)",
        ),
        (
            &with_root("/l 0 120777 1 0 0 0 0.0  - -\n"),
            "symlink with an empty target",
        ),
        (
            &with_root("/l 1 120777 1 0 0 0 0.0 \\x00 - -\n"),
            "symlink target \\x00 contains a NUL byte",
        ),
        // Xattrs.
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a\n"),
            "xattr user.a has no '='",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a=1  user.b=2\n"),
            "xattr  has no '='",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - - =v\n"),
            "empty xattr name",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.\\x00=v\n"),
            "contains a NUL byte",
        ),
        (
            &with_root(&format!(
                "/a 0 100644 1 0 0 0 0.0 - - - {}=v\n",
                "k".repeat(256)
            )),
            "xattr name of 256 bytes is longer than 255",
        ),
        (
            &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a=\\z\n"),
            "xattr value: unsupported escape \\z",
        ),
        // Hardlinks.
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 - - -\n"),
            "hardlink without a target (PAYLOAD is -)",
        ),
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 /nope - -\n"),
            "hardlink target /nope does not exist",
        ),
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 /a - -\n"),
            "hardlink /a points at itself",
        ),
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 / - -\n"),
            "hardlink target / is a directory",
        ),
        (
            &with_root("/d 0 40755 0 0 0 0 0.0 - - -\n/a 0 @100644 0 0 0 0 0.0 /d - -\n"),
            "hardlink target /d is a directory",
        ),
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 /b - -\n/b 0 @100644 0 0 0 0 0.0 /a - -\n"),
            "hardlink cycle",
        ),
        (
            &with_root("/a 0 @40755 0 0 0 0 0.0 /b - -\n"),
            "/a: directories cannot be hardlinked",
        ),
        (&with_root("/a 0 @0 0 0 0 0 0.0 /b - -\n"), "invalid MODE 0"),
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 /b - -\n/a/x 0 100644 0 0 0 0 0.0 - - -\n"),
            "/a/x: parent is not a directory",
        ),
        (
            &with_root("/a 0 @100644 0 0 0 0 0.0 /b - -\n/a/x/y 0 100644 0 0 0 0 0.0 - - -\n"),
            "/a/x/y: parent directory does not exist",
        ),
    ];
    for (input, msg) in table {
        let e = match parse_dump(input.as_bytes(), &LENIENT) {
            Ok(_) => panic!("parsed but should not:\n{input}"),
            Err(e) => e,
        };
        let last = input.matches('\n').count().max(1);
        let cycle = msg.contains("cycle");
        assert!(
            e.line() == last || cycle && e.line() >= 2,
            "{input:?}: error on line {}, expected {last}: {e}",
            e.line()
        );
        assert!(
            e.to_string().contains(msg),
            "{input:?}: got {e}, expected {msg}"
        );
        // Strict mode rejects everything lenient mode does.
        assert!(parse_dump(input.as_bytes(), &STRICT).is_err(), "{input:?}");
    }
}

#[test]
fn strict_only_rejections() {
    let table: &[(&str, &str)] = &[
        (
            "/f 0 10644 1 0 0 5 0.0 - - -\n",
            "line 2: RDEV 5 on a file that is not a device",
        ),
        (
            "/d 0 40755 1 0 0 1 0.0 - - -\n",
            "line 2: RDEV 1 on a file that is not a device",
        ),
        (
            "/l 2 120777 1 0 0 0 0.0 t - -\n",
            "line 2: symlink SIZE 2 is not the length of its target (1)",
        ),
        (
            "/l 1 120777 1 0 0 0 0.0 t x -\n",
            "line 2: a symlink cannot have CONTENT",
        ),
        (
            "/a 0 100644 1 0 0 0 0.0 - - -",
            "line 2: missing newline at the end of the file",
        ),
    ];
    for (lines, msg) in table {
        let text = with_root(lines);
        assert_eq!(err(&text, &STRICT), *msg, "{text:?}");
        let tree = parse_dump(text.as_bytes(), &LENIENT).unwrap();
        // What lenient mode keeps is canonical: no RDEV on non-devices,
        // symlink SIZE from the target.
        let inode = &tree.inodes[1];
        assert_eq!(inode.rdev, 0);
        if let InodeData::Symlink(t) = &inode.data {
            assert_eq!(inode.size, t.len() as u64);
        }
        roundtrip(&tree);
    }
}

#[test]
fn accepted_oddities() {
    // What the reference reads that may be surprising.
    let tree = parse_ok(&with_root(
        "a 4096 40755 2 0 0 0 0.0 - - -\n\
             a//b 4096 40755 2 0 0 0 0.0 - - -\n\
             /a/b/c +5 0100644 1 \t7 0 0 -1.5 - hello -\n\
             a/b/d 0 10644 1 0 0 0 0.0 payload - -\n\
             ///a///b///e 0 100644 1 0 0 0 0.0  - -\n",
    ));
    let c = tree.inode(id(&tree, "/a/b/c"));
    assert_eq!(c.size, 5);
    assert_eq!(c.uid, 7);
    assert_eq!(c.mtime, Mtime { sec: -1, nsec: 5 });
    // PAYLOAD on a fifo is accepted and dropped.
    assert_eq!(tree.inode(id(&tree, "/a/b/d")).data, InodeData::Special);
    // An empty PAYLOAD is not "-".
    assert_eq!(regular(&tree, "/a/b/e").payload.as_deref(), Some(&b""[..]));
    roundtrip(&tree);

    // An empty DIGEST is none; a bad one on a non-regular file is ignored.
    let tree = parse_ok(&with_root(
        "/a 0 100644 1 0 0 0 0.0 - - \n/l 1 120777 1 0 0 0 0.0 t - xyz\n",
    ));
    assert_eq!(regular(&tree, "/a").digest, None);
    let digest = format!("{}{}", "AB".repeat(16), "cd".repeat(16));
    let tree = parse_ok(&with_root(&format!(
        "/a 0 100644 1 0 0 0 0.0 - - {digest}\n"
    )));
    let mut want = [0xab; 32];
    want[16..].fill(0xcd);
    assert_eq!(regular(&tree, "/a").digest, Some(want));

    // Empty CONTENT is no content.
    let tree = parse_ok(&with_root("/a 0 100644 1 0 0 0 0.0 -  -\n"));
    assert_eq!(regular(&tree, "/a").content, None);
    // Hardlink lines ignore every field but PATH, MODE and PAYLOAD.
    let tree = parse_ok(&with_root(
        "/f 0 100644 1 0 0 0 0.0 - - -\n/h junk @100644 junk junk junk junk junk /f junk junk =\n",
    ));
    assert_eq!(id(&tree, "/h"), id(&tree, "/f"));
    // A trailing space after the fixed fields is not an empty xattr.
    parse_ok("/ 4096 40755 2 0 0 0 0.0 - - - \n");
    parse_ok("/ 4096 40755 2 0 0 0 0.0 - - - user.a=b \n");
}

#[test]
fn newline_handling() {
    let text = "/ 4096 40755 2 0 0 0 0.0 - - -\n/a 0 100644 1 0 0 0 0.0 - - -";
    let e = parse_dump(text.as_bytes(), &STRICT).unwrap_err();
    assert_eq!(e.line(), 2);
    assert!(e.to_string().contains("missing newline"));
    let tree = parse_dump(text.as_bytes(), &LENIENT).unwrap();
    assert_eq!(tree.inodes.len(), 2);
    // An empty line is an empty path, even at the end.
    assert!(err(&format!("{text}\n\n"), &LENIENT).contains("line 3: empty PATH"));
}

#[test]
fn escapes_roundtrip() {
    let text = with_root(
        "/sp\\x20ace\\x3d\\\\\\t\\xff 5 100644 1 0 0 0 0.0 \\x2d \\x00\\r\\n=\\x2d - \
             user.k\\x3d\\x20=v\\x3d\\n\\x00 user.dash=\\x2d\n\
             /dash 1 100644 1 0 0 0 0.0 - \\x2d -\n",
    );
    let tree = parse_ok(&text);
    let name = b"sp ace=\\\t\xff";
    let root = tree.root().entries().unwrap();
    let f = root[&name[..]].inode;
    let InodeData::Regular(r) = &tree.inode(f).data else {
        panic!("not regular");
    };
    assert_eq!(r.payload.as_deref(), Some(&b"-"[..]));
    assert_eq!(r.content.as_deref(), Some(&b"\0\r\n=-"[..]));
    let x = &tree.inode(f).xattrs;
    assert_eq!(x[&b"user.k= "[..]], b"v=\n\0");
    assert_eq!(x[&b"user.dash"[..]], b"-");
    assert_eq!(regular(&tree, "/dash").content.as_deref(), Some(&b"-"[..]));

    let printed = roundtrip(&tree);
    assert_eq!(
        printed,
        "/ 4096 40755 2 0 0 0 0.0 - - -\n\
             /dash 1 100644 1 0 0 0 0.0 - \\x2d -\n\
             /sp\\x20ace=\\\\\\t\\xff 5 100644 1 0 0 0 0.0 \\x2d \\x00\\r\\n=- - \
             user.dash=- user.k\\x3d\\x20=v\\x3d\\n\\x00\n"
    );
}

#[test]
fn xattr_replacement_and_budget() {
    // Setting a name twice keeps the last value.
    let tree = parse_ok(&with_root(
        "/a 0 100644 1 0 0 0 0.0 - - - user.a=1 user.b=2 user.a=3\n",
    ));
    let x = &tree.inode(id(&tree, "/a")).xattrs;
    assert_eq!(x.len(), 2);
    assert_eq!(x[&b"user.a"[..]], b"3");

    // One xattr costs 12 + 7 + name + value; the budget is 32767.
    let fits = 32767 - 12 - 7 - "user.v".len();
    let line = |n: usize| {
        with_root(&format!(
            "/a 0 100644 1 0 0 0 0.0 - - - user.v={}\n",
            "v".repeat(n)
        ))
    };
    parse_ok(&line(fits));
    assert!(err(&line(fits + 1), &STRICT).contains("xattrs too large"));

    // Replacing the only xattr frees its share, header included...
    let twice = |n: usize| {
        with_root(&format!(
            "/a 0 100644 1 0 0 0 0.0 - - - user.v={} user.v={}\n",
            "v".repeat(n),
            "v".repeat(n)
        ))
    };
    parse_ok(&twice(fits));
    // ...but with another xattr present the header stays counted, as in
    // the reference.
    let second = fits - 7 - "user.w".len() - 1;
    let text = with_root(&format!(
        "/a 0 100644 1 0 0 0 0.0 - - - user.w=x user.v={} user.v={}\n",
        "v".repeat(second),
        "v".repeat(second)
    ));
    parse_ok(&text);
    let text = with_root(&format!(
        "/a 0 100644 1 0 0 0 0.0 - - - user.w=x user.v={}\n",
        "v".repeat(second + 1)
    ));
    assert!(err(&text, &STRICT).contains("xattrs too large"));
}

#[test]
fn limits() {
    // Largest inline content and payload are fine.
    let content = "c".repeat(MAX_INLINE_CONTENT);
    parse_ok(&with_root(&format!(
        "/a 5000 100644 1 0 0 0 0.0 - {content} -\n"
    )));
    let payload = "p".repeat(MAX_PATH_LEN);
    parse_ok(&with_root(&format!(
        "/a 0 100644 1 0 0 0 0.0 {payload} - -\n"
    )));
    parse_ok(&with_root(&format!(
        "/l 4095 120777 1 0 0 0 0.0 {payload} - -\n"
    )));
    // The largest external file.
    parse_ok(&with_root("/a 9007199254740992 100644 1 0 0 0 0.0 - - -\n"));

    // Nesting up to MAX_DEPTH components.
    let mut text = String::from(ROOT_LINE);
    let mut path = String::new();
    for _ in 0..MAX_DEPTH {
        path.push_str("/d");
        text.push_str(&format!("{path} 0 40755 2 0 0 0 0.0 - - -\n"));
    }
    let tree = parse_ok(&text);
    roundtrip(&tree);
    text.push_str(&format!("{path}/d 0 40755 2 0 0 0 0.0 - - -\n"));
    assert!(err(&text, &STRICT).contains(&format!("nested deeper than {MAX_DEPTH}")));

    // Overlong lines are refused before they are buffered whole.
    let mut long = String::from(ROOT_LINE);
    long.push_str(&"x".repeat(MAX_LINE_LEN + 10));
    let e = parse_dump(long.as_bytes(), &LENIENT).unwrap_err();
    assert_eq!(e.line(), 2);
    assert!(e.to_string().contains("longer than"), "{e}");
}

#[test]
fn io_errors_name_the_line() {
    struct Failing(usize);
    impl io::Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let data = ROOT_LINE.as_bytes();
            if self.0 >= data.len() {
                return Err(io::Error::other("disk on fire"));
            }
            let n = (data.len() - self.0).min(buf.len());
            buf[..n].copy_from_slice(&data[self.0..self.0 + n]);
            self.0 += n;
            Ok(n)
        }
    }
    let e = parse_dump(io::BufReader::new(Failing(0)), &STRICT).unwrap_err();
    assert!(matches!(e, DumpError::Io { line: 2, .. }), "{e}");
    assert!(e.to_string().contains("disk on fire"));
}

#[test]
fn printer_rejects_malformed_trees() {
    let mut root = Inode::new(S_IFDIR | 0o755).unwrap();
    let InodeData::Directory(e) = &mut root.data else {
        unreachable!()
    };
    e.insert(
        b"x".to_vec(),
        DirEntry {
            inode: 7,
            hardlink: false,
        },
    );
    let tree = Tree { inodes: vec![root] };
    let e = tree_to_dump_string(&tree).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);

    // A directory containing itself.
    let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
    let d = tree.push(Inode::new(S_IFDIR | 0o755).unwrap());
    tree.add_child(ROOT, b"d", d, false).unwrap();
    if let InodeData::Directory(e) = &mut tree.inode_mut(d).data {
        e.insert(
            b"loop".to_vec(),
            DirEntry {
                inode: d,
                hardlink: false,
            },
        );
    }
    assert!(tree_to_dump_string(&tree)
        .unwrap_err()
        .to_string()
        .contains("reached twice"));

    // A hardlink to an inode that has no primary entry.
    let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
    let f = tree.push(Inode::new(S_IFREG | 0o644).unwrap());
    tree.add_child(ROOT, b"h", f, true).unwrap();
    assert!(tree_to_dump_string(&tree)
        .unwrap_err()
        .to_string()
        .contains("primary"));
}

#[test]
fn built_trees_roundtrip() {
    // A tree made in code (not parsed) prints to what parses back to it.
    let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
    let mut f = Inode::new(S_IFREG | 0o600).unwrap();
    f.size = 1 << 40;
    f.nlink = 2;
    f.uid = u32::MAX;
    f.mtime = Mtime {
        sec: i64::MIN,
        nsec: 999_999_999,
    };
    f.data = InodeData::Regular(RegularFile {
        content: None,
        payload: Some(b"ab/cdef".to_vec()),
        digest: Some([0xab; 32]),
    });
    f.xattrs.insert(
        b"security.selinux".to_vec(),
        b"system_u:object_r:bin_t:s0\0".to_vec(),
    );
    let f = tree.push(f);
    tree.add_child(ROOT, b"big", f, false).unwrap();
    tree.add_child(ROOT, b"another name", f, true).unwrap();
    let mut dev = Inode::new(S_IFCHR | 0o666).unwrap();
    dev.rdev = u64::MAX;
    let dev = tree.push(dev);
    tree.add_child(ROOT, b"dev", dev, false).unwrap();
    let mut l = Inode::new(S_IFLNK | 0o777).unwrap();
    l.data = InodeData::Symlink(b"-".to_vec());
    l.size = 1;
    let l = tree.push(l);
    tree.add_child(ROOT, b"l", l, false).unwrap();
    let text = roundtrip(&tree);
    assert!(text.contains(&format!(
        "/another\\x20name {} @100600 2 4294967295 0 0 -9223372036854775808.999999999 /big - {}",
        1u64 << 40,
        "ab".repeat(32)
    )));
    assert!(text.contains("/l 1 120777 1 0 0 0 0.0 \\x2d - -\n"));
}

/// `cargo test --release -p cairn-erofs dump::tests::speed -- --ignored --nocapture`
#[test]
#[ignore = "timing; run in release"]
fn speed() {
    let data = read_vector("cs9-x86_64-minimal.dump.gz");
    // Five copies of the tree under different top-level names: ~110k lines.
    let mut big = Vec::from(ROOT_LINE);
    for copy in 0..5 {
        for line in data
            .split(|&b| b == b'\n')
            .skip(1)
            .filter(|l| !l.is_empty())
        {
            big.extend_from_slice(format!("/c{copy}").as_bytes());
            big.extend_from_slice(line);
            big.push(b'\n');
        }
        big.extend_from_slice(format!("/c{copy} 4096 40755 2 0 0 0 0.0 - - -\n").as_bytes());
    }
    // Directories must precede their children: sort by path bytes puts
    // "/c0" before "/c0/...".
    let mut lines: Vec<&[u8]> = big
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    lines.sort_by_key(|l| l.split(|&b| b == b' ').next().map(<[u8]>::to_vec));
    let big: Vec<u8> = lines.join(&b'\n').into_iter().chain([b'\n']).collect();
    let start = std::time::Instant::now();
    let tree = parse_dump(&big[..], &STRICT).unwrap();
    let parsed = start.elapsed();
    let start = std::time::Instant::now();
    let text = tree_to_dump_string(&tree).unwrap();
    let printed = start.elapsed();
    eprintln!(
        "{} lines, {} inodes: parse {parsed:?}, print {printed:?} ({} bytes)",
        lines.len(),
        tree.inodes.len(),
        text.len()
    );
}

/// Cheap deterministic fuzzing over the vectors: truncations and byte
/// mutations must give an error or a tree that round-trips, never a
/// panic.
#[test]
fn mutated_vectors_never_panic() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let interesting = b" \n\\@-=/.0x9\0";
    for (name, _) in vector_names() {
        let data = read_vector(&name);
        if data.len() > 200_000 {
            continue;
        }
        check_round_trip(&data);
        for i in 0..40 {
            let cut = (rand() as usize) % (data.len() + 1);
            check_round_trip(&data[..cut]);
            let mut m = data.clone();
            for _ in 0..=(i % 4) {
                if m.is_empty() {
                    break;
                }
                let pos = (rand() as usize) % m.len();
                let r = rand() as usize;
                m[pos] = if r.is_multiple_of(2) {
                    interesting[r / 2 % interesting.len()]
                } else {
                    (r >> 8) as u8
                };
            }
            check_round_trip(&m);
        }
    }
}

/// The oracle of `mutated_vectors_never_panic`: parses `data` strictly and
/// leniently and, whenever that succeeds, checks that printing the tree and
/// parsing it back strictly gives the same tree.
///
/// # Panics
///
/// Only on a bug in this module: a parsed tree that does not print, or
/// prints to something that reads back differently (other than the xattr
/// limit [`print_dump`] documents).
fn check_round_trip(data: &[u8]) {
    for strict in [true, false] {
        let Ok(tree) = parse_dump_bytes(data, &ParseOptions { strict }) else {
            continue;
        };
        let mut text = Vec::new();
        if let Err(e) = print_dump(&tree, &mut text) {
            panic!("a parsed tree failed to print: {e}");
        }
        match parse_dump_bytes(&text, &ParseOptions { strict: true }) {
            Ok(again) => assert!(again == tree, "parse → print → parse changed the tree"),
            Err(e) => {
                // The one documented exception: xattrs that escape to more
                // than a line may hold.
                let too_long = text
                    .split(|&b| b == b'\n')
                    .any(|l| Fields::split(l).xattrs.len() > MAX_XATTR_FIELD_LEN);
                assert!(too_long, "printed dump does not parse: {e}");
            }
        }
    }
}
