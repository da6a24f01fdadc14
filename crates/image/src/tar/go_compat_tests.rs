//! Where tar readers disagree, cairn reads a layer as Go's archive/tar
//! does (docker, containerd and umoci use it), or refuses it: a layer must
//! never show cairn other entries than it shows them. Each expectation
//! below was checked against Go 1.26's archive/tar (`tar.NewReader`,
//! `Next` until `io.EOF` or an error) on the same bytes.

use std::io;

use super::*;

fn octal(field: &mut [u8], v: u64) {
    let w = field.len() - 1;
    field[..w].copy_from_slice(format!("{v:0w$o}").as_bytes());
    field[w] = 0;
}

fn checksum(b: &mut [u8; 512]) {
    b[148..156].copy_from_slice(b"        ");
    let sum: u64 = b.iter().map(|&x| u64::from(x)).sum();
    b[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

/// A ustar header; `edit` may change any byte before the checksum.
fn header(name: &[u8], typeflag: u8, size: u64, edit: impl FnOnce(&mut [u8; 512])) -> Vec<u8> {
    let mut b = [0u8; 512];
    b[..name.len()].copy_from_slice(name);
    octal(&mut b[100..108], 0o644);
    octal(&mut b[108..116], 0);
    octal(&mut b[116..124], 0);
    octal(&mut b[124..136], size);
    octal(&mut b[136..148], 0);
    b[156] = typeflag;
    b[257..265].copy_from_slice(b"ustar\x0000");
    edit(&mut b);
    checksum(&mut b);
    b.to_vec()
}

/// A GNU header (magic `ustar  \0`, no prefix field).
fn gnu_header(name: &[u8], edit: impl FnOnce(&mut [u8; 512])) -> Vec<u8> {
    header(name, b'0', 0, |b| {
        b[257..265].copy_from_slice(b"ustar  \x00");
        edit(b);
    })
}

fn padded(data: &[u8]) -> Vec<u8> {
    let mut v = data.to_vec();
    v.resize(data.len().div_ceil(512) * 512, 0);
    v
}

/// A pax extended header with `records`.
fn pax(records: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in records {
        let rest = k.len() + v.len() + 3;
        let mut len = rest + 1;
        while rest + len.to_string().len() != len {
            len = rest + len.to_string().len();
        }
        body.extend_from_slice(format!("{len} {k}=").as_bytes());
        body.extend_from_slice(v);
        body.push(b'\n');
    }
    let mut out = header(b"PaxHeader", b'x', body.len() as u64, |_| {});
    out.extend(padded(&body));
    out
}

/// One entry named `name` with `data`, after a pax header of `records`,
/// and the end of the archive.
fn with_pax(records: &[(&str, &[u8])], name: &[u8], typeflag: u8, data: &[u8]) -> Vec<u8> {
    [
        pax(records),
        header(name, typeflag, data.len() as u64, |_| {}),
        padded(data),
        end(),
    ]
    .concat()
}

fn end() -> Vec<u8> {
    vec![0u8; 1024]
}

/// The paths in `tar`, or the paths before the error and the error.
fn list(tar: &[u8]) -> Result<Vec<String>, (Vec<String>, String)> {
    let limits = TarLimits::from(&crate::Limits::default());
    let mut r = TarReader::new(io::BufReader::new(tar), limits);
    let mut paths = Vec::new();
    loop {
        match r.next_entry() {
            Ok(Some(e)) => paths.push(String::from_utf8_lossy(&e.path).into_owned()),
            Ok(None) => return Ok(paths),
            Err(e) => return Err((paths, e.reason())),
        }
    }
}

#[test]
fn links_devices_fifos_and_directories_have_no_data_whatever_their_size() {
    // A directory that declares 1024 bytes, which are two headers: Go
    // reads them as entries (a whiteout among them); a reader that
    // skipped them would not see them.
    let mut t = header(b"etc/", b'5', 1024, |_| {});
    t.extend(header(b"etc/.wh.secret", b'0', 0, |_| {}));
    t.extend(header(b"etc/hidden", b'0', 0, |_| {}));
    t.extend(header(b"etc/visible", b'0', 0, |_| {}));
    t.extend(end());
    assert_eq!(
        list(&t).unwrap(),
        ["etc/", "etc/.wh.secret", "etc/hidden", "etc/visible"]
    );

    // The other way: a directory whose declared 512 bytes would have
    // swallowed a header, so that the "data" of the next file became an
    // entry of its own for a reader that skipped them.
    let inner = header(b"etc/ld.so.preload", b'0', 0, |_| {});
    let mut t = header(b"etc/", b'5', 512, |_| {});
    t.extend(header(b"etc/harmless", b'0', 512, |_| {}));
    t.extend(&inner);
    t.extend(end());
    assert_eq!(list(&t).unwrap(), ["etc/", "etc/harmless"]);

    // Every type without data, the old directory (type NUL with a
    // trailing slash) too.
    for (name, typeflag) in [
        (&b"hard"[..], b'1'),
        (b"sym", b'2'),
        (b"chr", b'3'),
        (b"blk", b'4'),
        (b"dir/", b'5'),
        (b"fifo", b'6'),
        (b"olddir/", 0),
    ] {
        let mut t = header(name, typeflag, 512, |b| {
            if typeflag == b'1' || typeflag == b'2' {
                b[157..163].copy_from_slice(b"target");
            }
        });
        t.extend(header(b"next", b'0', 0, |_| {}));
        t.extend(end());
        let want = [String::from_utf8_lossy(name).into_owned(), "next".into()];
        assert_eq!(list(&t).unwrap(), want, "type {typeflag:?}");
    }

    // A GNU dumpdir ('D') keeps its data, as in Go.
    let mut t = header(b"dumped/", b'D', 512, |_| {});
    t.extend(header(b"listing-not-an-entry", b'0', 0, |_| {}));
    t.extend(header(b"next", b'0', 0, |_| {}));
    t.extend(end());
    assert_eq!(list(&t).unwrap(), ["dumped/", "next"]);
}

#[test]
fn a_sparse_name_renames_only_sparse_files() {
    let mut t = pax(&[
        ("path", b"usr/share/doc/readme"),
        ("GNU.sparse.name", b"etc/ld.so.preload"),
    ]);
    t.extend(header(b"usr/share/doc/readme", b'0', 4, |_| {}));
    t.extend(padded(b"text"));
    t.extend(end());
    assert_eq!(list(&t).unwrap(), ["usr/share/doc/readme"]);

    // On a sparse file (format 0.1) it is the file's name; an empty one
    // is ignored.
    let sparse = |name: &[u8]| {
        with_pax(
            &[
                ("GNU.sparse.name", name),
                ("GNU.sparse.realsize", b"8192"),
                ("GNU.sparse.numblocks", b"1"),
                ("GNU.sparse.map", b"4096,4"),
            ],
            b"GNUSparseFile.0/name",
            b'0',
            b"data",
        )
    };
    assert_eq!(list(&sparse(b"real/name")).unwrap(), ["real/name"]);
    assert_eq!(list(&sparse(b"")).unwrap(), ["GNUSparseFile.0/name"]);
}

/// Go reads such an entry as a plain file, its map's text and all.
#[test]
fn an_unknown_sparse_version_is_refused() {
    let mut t = pax(&[
        ("GNU.sparse.major", b"2"),
        ("GNU.sparse.minor", b"0"),
        ("GNU.sparse.map", b"0,4"),
        ("GNU.sparse.realsize", b"4"),
    ]);
    t.extend(header(b"file", b'0', 4, |_| {}));
    t.extend(padded(b"data"));
    t.extend(end());
    let (_, e) = list(&t).unwrap_err();
    assert!(e.contains("unsupported GNU sparse format 2.0"), "{e}");
}

#[test]
fn a_header_after_a_single_zero_block_is_refused() {
    let mut t = header(b"a", b'0', 0, |_| {});
    t.extend([0u8; 512]);
    t.extend(header(b"b", b'0', 0, |_| {}));
    t.extend(end());
    let (seen, e) = list(&t).unwrap_err();
    assert_eq!(seen, ["a"]);
    assert!(e.contains("a header after a single zero block"), "{e}");

    // One zero block at the end of the stream, or two and then anything:
    // the end, as in Go.
    let mut t = header(b"a", b'0', 0, |_| {});
    t.extend([0u8; 512]);
    assert_eq!(list(&t).unwrap(), ["a"]);
    let mut t = header(b"a", b'0', 0, |_| {});
    t.extend(end());
    t.extend(header(b"after-the-end", b'0', 0, |_| {}));
    assert_eq!(list(&t).unwrap(), ["a"]);
}

#[test]
fn prefixes_are_read_as_go_reads_them() {
    // ustar: the 155-byte prefix.
    let t = [
        header(b"name", b'0', 0, |b| b[345..349].copy_from_slice(b"some")),
        end(),
    ]
    .concat();
    assert_eq!(list(&t).unwrap(), ["some/name"]);

    // star: ustar magic and "tar\0" at the end; the prefix is 131 bytes,
    // and its atime and ctime follow.
    let t = [
        header(b".wh.file", b'0', 0, |b| {
            b[345..476].fill(b'x');
            b[476..488].copy_from_slice(b"00000000000\0");
            b[488..500].copy_from_slice(b"00000000000\0");
            b[508..512].copy_from_slice(b"tar\0");
        }),
        end(),
    ]
    .concat();
    assert_eq!(list(&t).unwrap(), [format!("{}/.wh.file", "x".repeat(131))]);

    // GNU: no prefix; its atime and ctime are there.
    let t = [
        gnu_header(b"etc/ld.so.preload", |b| {
            b[345..357].copy_from_slice(b"14701400000\0");
        }),
        end(),
    ]
    .concat();
    assert_eq!(list(&t).unwrap(), ["etc/ld.so.preload"]);

    // GNU written by Go before 1.8, with a ustar prefix where the times
    // go: a time that is not a number makes Go read the prefix.
    let t = [
        gnu_header(b"etc/ld.so.preload", |b| {
            b[345..358].copy_from_slice(b"harmless/docs");
        }),
        end(),
    ]
    .concat();
    assert_eq!(list(&t).unwrap(), ["harmless/docs/etc/ld.so.preload"]);

    // Numbers as Go reads them: spaces and NULs around the digits, a
    // base-256 time; a prefix that is not ASCII stays unread.
    for (atime, want) in [
        (&b" 1470140000 "[..], "a"),
        (b"\x001470140000\0", "a"),
        (b"12\x00345", "a"),
        (b"\x80\0\0\0\0\0\0\0\x57\xa1\x2b\x60", "a"),
        (b"9", "9/a"),
        (b"\xffprefix", "a"),
    ] {
        let t = [
            gnu_header(b"a", |b| b[345..345 + atime.len()].copy_from_slice(atime)),
            end(),
        ]
        .concat();
        assert_eq!(list(&t).unwrap(), [want], "atime {atime:?}");
    }
}

#[test]
fn a_cut_off_sparse_file_says_how_much_is_missing() {
    let mut t = pax(&[
        ("GNU.sparse.realsize", b"4000"),
        ("GNU.sparse.numblocks", b"2"),
        ("GNU.sparse.map", b"0,1000,3000,1000"),
    ]);
    t.extend(header(b"GNUSparseFile.0/f", b'0', 2000, |_| {}));
    t.extend(vec![7u8; 100]);
    let limits = TarLimits::from(&crate::Limits::default());
    let mut r = TarReader::new(io::BufReader::new(&t[..]), limits);
    let e = r.next_entry().unwrap().unwrap();
    let err = r
        .copy_data(&e, |_| Ok::<(), TarError>(()))
        .unwrap_err()
        .reason();
    assert!(err.contains("1900 of 2000 bytes missing"), "{err}");
}

/// A GNU long name or long link header (`L` or `K`).
fn gnu_long(typeflag: u8, name: &[u8]) -> Vec<u8> {
    let mut data = name.to_vec();
    data.push(0);
    let mut out = header(b"././@LongLink", typeflag, data.len() as u64, |_| {});
    out.extend(padded(&data));
    out
}

/// The entries of `tar` with their link targets and sizes.
fn entries(tar: &[u8]) -> Vec<(String, String, u64)> {
    let limits = TarLimits::from(&crate::Limits::default());
    let mut r = TarReader::new(io::BufReader::new(tar), limits);
    let mut out = Vec::new();
    while let Some(e) = r.next_entry().unwrap() {
        let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        out.push((lossy(&e.path), lossy(&e.link), e.size));
    }
    out
}

#[test]
fn gnu_long_names_win_over_pax_paths() {
    let t = [
        pax(&[("path", b"from-pax")]),
        gnu_long(b'L', b"from-gnu-L"),
        header(b"short", b'0', 0, |_| {}),
        end(),
    ]
    .concat();
    assert_eq!(list(&t).unwrap(), ["from-gnu-L"]);

    let t = [
        pax(&[("linkpath", b"/etc/shadow")]),
        gnu_long(b'K', b"harmless"),
        header(b"link", b'2', 0, |_| {}),
        end(),
    ]
    .concat();
    assert_eq!(entries(&t)[0].1, "harmless");

    // Which name decides an old directory: the long name. Here a file
    // whose 512 bytes are a whiteout's header, not an entry.
    let t = [
        pax(&[("path", b"a/")]),
        gnu_long(b'L', b"b"),
        header(b"x", 0, 512, |_| {}),
        header(b"etc/.wh.hidden", b'0', 0, |_| {}),
        end(),
    ]
    .concat();
    assert_eq!(list(&t).unwrap(), ["b"]);
}

#[test]
fn a_global_header_ends_the_extension_headers_before_it() {
    for pending in [
        pax(&[("path", b"etc/.wh.passwd")]),
        gnu_long(b'L', b"etc/.wh.passwd"),
    ] {
        let t = [
            pending,
            {
                let body = b"13 comment=x\n";
                let mut g = header(b"GlobalHead", b'g', body.len() as u64, |_| {});
                g.extend(padded(body));
                g
            },
            header(b"harmless", b'0', 0, |_| {}),
            end(),
        ]
        .concat();
        assert_eq!(list(&t).unwrap(), ["harmless"]);
    }
}

#[test]
fn sparse_versions_and_maps_are_read_as_go_reads_them() {
    // "01" is no version Go knows: refused, not read as 1.0.
    let t = with_pax(
        &[
            ("GNU.sparse.major", b"01"),
            ("GNU.sparse.minor", b"0"),
            ("GNU.sparse.name", b"etc/ld.so.preload"),
            ("GNU.sparse.realsize", b"4"),
        ],
        b"usr/doc",
        b'0',
        &[b'1'; 516],
    );
    let (_, e) = list(&t).unwrap_err();
    assert!(e.contains("unsupported GNU sparse format 01.0"), "{e}");

    // An empty map and no version: a plain file, its sparse name ignored.
    let t = with_pax(
        &[
            ("GNU.sparse.map", b""),
            ("GNU.sparse.name", b"etc/ld.so.preload"),
            ("GNU.sparse.realsize", b"4"),
        ],
        b"usr/doc",
        b'0',
        b"",
    );
    assert_eq!(entries(&t), [("usr/doc".into(), "".into(), 0)]);

    // GNU.sparse.size wins over GNU.sparse.realsize, in either order.
    for records in [
        [
            ("GNU.sparse.size", &b"8"[..]),
            ("GNU.sparse.realsize", b"4"),
        ],
        [("GNU.sparse.realsize", b"4"), ("GNU.sparse.size", b"8")],
    ] {
        let mut r = records.to_vec();
        r.extend([
            ("GNU.sparse.numblocks", &b"1"[..]),
            ("GNU.sparse.map", b"0,4"),
        ]);
        let t = with_pax(&r, b"f", b'0', b"data");
        assert_eq!(entries(&t), [("f".into(), "".into(), 8)]);
    }

    // Formats 0.x need numblocks, and it must count the map.
    for numblocks in [None, Some(&b"2"[..])] {
        let mut r = vec![
            ("GNU.sparse.realsize", &b"8"[..]),
            ("GNU.sparse.map", b"0,4"),
        ];
        if let Some(n) = numblocks {
            r.push(("GNU.sparse.numblocks", n));
        }
        let t = with_pax(&r, b"f", b'0', b"data");
        let (_, e) = list(&t).unwrap_err();
        assert!(e.contains("GNU sparse 0.x entry of 1 segments with"), "{e}");
    }

    // An old directory is one by its name before a sparse name renames
    // it; with a sparse map it is refused, as Go refuses it.
    let t = with_pax(
        &[
            ("path", b"dir/"),
            ("GNU.sparse.name", b"file"),
            ("GNU.sparse.realsize", b"8"),
            ("GNU.sparse.numblocks", b"1"),
            ("GNU.sparse.map", b"0,4"),
        ],
        b"dir/",
        0,
        b"data",
    );
    let (_, e) = list(&t).unwrap_err();
    assert!(e.contains("sparse map on a non-regular entry"), "{e}");
}

#[test]
fn a_star_header_with_times_that_are_not_numbers_is_refused() {
    let t = [
        header(b"name", b'0', 0, |b| {
            b[345..349].copy_from_slice(b"pre/");
            b[476..480].copy_from_slice(b"junk");
            b[508..512].copy_from_slice(b"tar\0");
        }),
        end(),
    ]
    .concat();
    let (_, e) = list(&t).unwrap_err();
    assert!(e.contains("star header whose atime or ctime"), "{e}");
}

#[test]
fn what_go_refuses_is_refused() {
    // Device numbers that are not numbers, on any header but v7's.
    let t = [
        header(b"file", b'0', 0, |b| b[329..333].copy_from_slice(b"junk")),
        end(),
    ]
    .concat();
    let (_, e) = list(&t).unwrap_err();
    assert!(
        e.contains("devmajor or devminor field is not a number"),
        "{e}"
    );

    // GNU sparse 0.0 records out of order.
    let t = with_pax(
        &[
            ("GNU.sparse.numblocks", b"2"),
            ("GNU.sparse.offset", b"0"),
            ("GNU.sparse.offset", b"4"),
            ("GNU.sparse.numbytes", b"2"),
            ("GNU.sparse.numbytes", b"2"),
            ("GNU.sparse.realsize", b"8"),
        ],
        b"f",
        b'0',
        b"data",
    );
    let (_, e) = list(&t).unwrap_err();
    assert!(e.contains("offsets and lengths out of order"), "{e}");
}
