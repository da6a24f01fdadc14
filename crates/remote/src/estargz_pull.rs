//! `cairn pull --lazy` of an eStargz image: the metadata from the layers'
//! tables of contents, without a cairn artifact.
//!
//! Taken when no cairn artifact refers to the image and every layer's
//! descriptor carries the `containerd.io/snapshot/stargz/toc.digest`
//! annotation. Each layer's TOC is read with two range requests (footer,
//! TOC member), checked against the annotation before it is parsed
//! ([`crate::estargz`]), and turned into the layer record a full pull
//! would have made from the tar (`cairn_image::toc`); the records are
//! applied as a full pull applies its layers and the tree is written as
//! an EROFS image. Regular files are named by the sha256 of their
//! contents (the TOC's `digest`).
//!
//! The layer's TOC member is itself a tar entry of the layer
//! (`stargz.index.json`, the last one before the footer), so a full pull
//! has that file in its tree; it is added here too, with the metadata of
//! its tar header and its contents named by the TOC's sha256.
//!
//! Stored, under the shared store lock, in the order of a cairn artifact's
//! lazy pull: the EROFS image, the TOCs as its lazy index (the file
//! `images/<sha256>.lazy-index`, format below), the record (its `lazy`
//! names the image manifest in place of an artifact, with `estargz` set),
//! the ref.
//!
//! ```text
//! lazy index of an eStargz image
//! magic "CAIRNSGZ" | version u32 = 1 | layer count u32
//! per layer, in the manifest's order:
//!   TOC offset u64 | header mode u32 | uid u32 | gid u32 | mtime i64
//!   | JSON length u64 | the TOC JSON (its sha256 is the layer's annotation)
//! ```
//! all little-endian.

use std::collections::BTreeMap;

use base64::Engine as _;
use cairn_erofs::Mtime;
use cairn_image::toc::{toc_layer_record, tree_from_records, TocEntry, TocKind};
use cairn_oci::{Digest, ImageRef, Registry, Resolved};
use cairn_store::{ImageRecord, LazySource, Store};
use sha2::{Digest as _, Sha256};

use crate::estargz::{self, Entry, Kind, Toc};
use crate::lazy::{incomplete_record, write_incomplete, LazyPullOptions, LazyPullReport};
use crate::RemoteError;

/// The lazy index file's magic.
pub const SGZ_MAGIC: &[u8; 8] = b"CAIRNSGZ";
/// The annotation every layer must carry.
pub use crate::estargz::TOC_DIGEST_ANNOTATION;

/// One layer's TOC as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredToc {
    pub toc_offset: u64,
    /// The TOC tar entry's own header: mode, uid, gid, mtime.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub json: Vec<u8>,
}

/// The layers' TOC annotations, in order, if every layer has one.
pub(crate) fn toc_annotations(manifest: &[u8]) -> Option<Vec<String>> {
    let m: serde_json::Value = serde_json::from_slice(manifest).ok()?;
    let layers = m["layers"].as_array()?;
    if layers.is_empty() {
        return None;
    }
    layers
        .iter()
        .map(|l| {
            l["annotations"][TOC_DIGEST_ANNOTATION]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Encodes the lazy index of an eStargz image.
pub fn encode_tocs(tocs: &[StoredToc]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(SGZ_MAGIC);
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&(tocs.len() as u32).to_le_bytes());
    for t in tocs {
        out.extend_from_slice(&t.toc_offset.to_le_bytes());
        out.extend_from_slice(&t.mode.to_le_bytes());
        out.extend_from_slice(&t.uid.to_le_bytes());
        out.extend_from_slice(&t.gid.to_le_bytes());
        out.extend_from_slice(&t.mtime.to_le_bytes());
        out.extend_from_slice(&(t.json.len() as u64).to_le_bytes());
        out.extend_from_slice(&t.json);
    }
    out
}

/// Decodes the lazy index of an eStargz image (bounded: at most as many
/// layers as the bytes can hold, each JSON at most
/// [`estargz::MAX_TOC_JSON`]).
pub fn decode_tocs(b: &[u8]) -> Result<Vec<StoredToc>, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let s = b
            .get(at..at.checked_add(n).ok_or("length overflow")?)
            .ok_or_else(|| format!("cut short at byte {at}"))?;
        at += n;
        Ok(s)
    };
    if take(8)? != SGZ_MAGIC {
        return Err("not an eStargz TOC bundle (magic)".into());
    }
    let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
    let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
    let version = u32_of(take(4)?);
    if version != 1 {
        return Err(format!("version {version}, not 1"));
    }
    let n = u32_of(take(4)?) as usize;
    let mut out = Vec::with_capacity(n.min(b.len() / 40));
    for _ in 0..n {
        let toc_offset = u64_of(take(8)?);
        let mode = u32_of(take(4)?);
        let uid = u32_of(take(4)?);
        let gid = u32_of(take(4)?);
        let mtime = u64_of(take(8)?) as i64;
        let len = u64_of(take(8)?);
        if len > estargz::MAX_TOC_JSON {
            return Err(format!("a TOC of {len} bytes"));
        }
        let json = take(len as usize)?.to_vec();
        out.push(StoredToc {
            toc_offset,
            mode,
            uid,
            gid,
            mtime,
            json,
        });
    }
    if at != b.len() {
        return Err(format!("{} bytes after the last TOC", b.len() - at));
    }
    Ok(out)
}

/// Seconds since the epoch of an RFC 3339 time as eStargz writes it
/// (`2006-01-02T15:04:05Z`, maybe with a fraction or an offset); `None` if
/// it is not one.
pub(crate) fn parse_rfc3339(s: &str) -> Option<Mtime> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut nsec = 0u32;
    if let Some(f) = rest.strip_prefix('.') {
        let digits = f.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let mut frac: String = f[..digits].chars().take(9).collect();
        while frac.len() < 9 {
            frac.push('0');
        }
        nsec = frac.parse().ok()?;
        rest = &f[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 && (o.starts_with('+') || o.starts_with('-')) && &o[3..4] == ":" => {
            let hh: i64 = o[1..3].parse().ok()?;
            let mm: i64 = o[4..6].parse().ok()?;
            let v = hh * 3600 + mm * 60;
            if o.starts_with('-') {
                -v
            } else {
                v
            }
        }
        _ => return None,
    };
    // Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(Mtime {
        sec: days * 86400 + h * 3600 + mi * 60 + sec - offset,
        nsec,
    })
}

/// The TOC entries of one layer as the tar entries they stand for, the
/// TOC's own tar entry last.
fn toc_entries(toc: &Toc, stored: &StoredToc, what: &str) -> Result<Vec<TocEntry>, RemoteError> {
    let mut out = Vec::with_capacity(toc.entries.len() + 1);
    for e in &toc.entries {
        out.push(toc_entry(e, what)?);
    }
    out.push(TocEntry {
        path: estargz::TOC_NAME.as_bytes().to_vec(),
        kind: TocKind::Regular,
        mode: stored.mode,
        uid: stored.uid,
        gid: stored.gid,
        mtime: Mtime {
            sec: stored.mtime,
            nsec: 0,
        },
        link: Vec::new(),
        devmajor: 0,
        devminor: 0,
        size: stored.json.len() as u64,
        xattrs: BTreeMap::new(),
        sha256: Some(Sha256::digest(&stored.json).into()),
    });
    Ok(out)
}

fn toc_entry(e: &Entry, what: &str) -> Result<TocEntry, RemoteError> {
    let bad = |d: String| RemoteError::invalid(what, format!("TOC entry {:?}: {d}", e.name));
    let mtime = match &e.modtime {
        None => Mtime::default(),
        Some(t) => parse_rfc3339(t).ok_or_else(|| bad(format!("modtime {t:?} is not RFC 3339")))?,
    };
    let mut xattrs = BTreeMap::new();
    for (k, v) in &e.xattrs {
        let value = base64::engine::general_purpose::STANDARD
            .decode(v)
            .map_err(|err| bad(format!("xattr {k}: not base64: {err}")))?;
        xattrs.insert(k.as_bytes().to_vec(), value);
    }
    Ok(TocEntry {
        path: e.name.as_bytes().to_vec(),
        kind: match e.kind {
            Kind::Dir => TocKind::Directory,
            Kind::Reg => TocKind::Regular,
            Kind::Symlink => TocKind::Symlink,
            Kind::Hardlink => TocKind::Hardlink,
            Kind::Char => TocKind::CharDevice,
            Kind::Block => TocKind::BlockDevice,
            Kind::Fifo => TocKind::Fifo,
        },
        mode: e.mode,
        uid: e.uid,
        gid: e.gid,
        mtime,
        link: e.link_name.as_bytes().to_vec(),
        devmajor: e.dev_major,
        devminor: e.dev_minor,
        size: e.size,
        xattrs,
        sha256: e.digest,
    })
}

/// Reads one layer's TOC: footer, TOC member (JSON checked against the
/// annotation, then parsed), and the TOC entry's tar header.
fn read_layer_toc(
    reg: &Registry,
    repo: &str,
    blob: &Digest,
    size: u64,
    annotation: &str,
    what: &str,
    fetched: &mut u64,
) -> Result<(Toc, StoredToc), RemoteError> {
    let inv = |e: estargz::EstargzError| RemoteError::invalid(what, e.0);
    if size < estargz::FOOTER_LEN {
        return Err(RemoteError::invalid(what, "shorter than an eStargz footer"));
    }
    let footer_at = size - estargz::FOOTER_LEN;
    let footer = reg.fetch_blob_range(repo, blob, footer_at, estargz::FOOTER_LEN, what)?;
    *fetched += footer.len() as u64;
    let toc_offset = estargz::parse_footer(&footer).map_err(inv)?;
    if toc_offset >= footer_at || footer_at - toc_offset > estargz::MAX_TOC_COMPRESSED {
        return Err(RemoteError::invalid(
            what,
            format!("footer: the TOC at {toc_offset}, the footer at {footer_at}"),
        ));
    }
    let member = reg.fetch_blob_range(repo, blob, toc_offset, footer_at - toc_offset, what)?;
    *fetched += member.len() as u64;
    let (json, header) = estargz::toc_json_and_header(&member).map_err(inv)?;
    let toc = estargz::parse_toc(&json, toc_offset, Some(annotation)).map_err(inv)?;
    let stored = StoredToc {
        toc_offset,
        mode: header.mode,
        uid: header.uid,
        gid: header.gid,
        mtime: header.mtime,
        json,
    };
    Ok((toc, stored))
}

/// The EROFS image of an eStargz image's TOCs (the layers in order, each
/// with the name its errors give it).
pub fn image_from_tocs(layers: &[(String, Toc, StoredToc)]) -> Result<Vec<u8>, RemoteError> {
    let mut records = Vec::with_capacity(layers.len());
    for (name, toc, stored) in layers {
        let what = format!("eStargz layer {name}");
        let entries = toc_entries(toc, stored, &what)?;
        let record = toc_layer_record(entries, name)
            .map_err(|e| RemoteError::invalid(&what, e.to_string()))?;
        records.push((name.clone(), record));
    }
    let tree = tree_from_records(&records)
        .map_err(|e| RemoteError::invalid("eStargz layers", e.to_string()))?;
    cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default()).map_err(|e| {
        RemoteError::invalid("eStargz layers", format!("writing the EROFS image: {e}"))
    })
}

/// Pulls the metadata of an eStargz image lazily; `resolved` is what
/// `r` resolved to (no cairn artifact refers to it), `annotations` the
/// layers' TOC digests.
pub(crate) fn pull_estargz(
    store: &Store,
    r: &ImageRef,
    opts: &LazyPullOptions,
    reg: &Registry,
    resolved: Resolved,
    annotations: Vec<String>,
    mut fetched: u64,
) -> Result<LazyPullReport, RemoteError> {
    let display = r.to_string();
    let repo = &r.repository;
    fetched += resolved.config_bytes.len() as u64;
    if annotations.len() != resolved.layers.len() {
        return Err(RemoteError::invalid(
            format!("manifest {} of {display}", resolved.manifest_digest),
            "its layers and their TOC annotations do not match up",
        ));
    }
    let mut layers = Vec::with_capacity(resolved.layers.len());
    for (i, (l, annotation)) in resolved.layers.iter().zip(&annotations).enumerate() {
        let what = format!("eStargz layer {i} ({}) of {display}", l.digest);
        let (toc, stored) = read_layer_toc(
            reg,
            repo,
            &l.digest,
            l.size,
            annotation,
            &what,
            &mut fetched,
        )?;
        layers.push((l.digest.to_string(), toc, stored));
    }
    let image = image_from_tocs(&layers)?;
    let image_sha = hex::encode(Sha256::digest(&image));
    let ewhat = format!("EROFS image built from the TOCs of {display}");
    let objects = crate::lazy::image_objects(&image, &ewhat)?;
    let object_bytes: u64 = objects.values().sum();
    let tocs: Vec<StoredToc> = layers.into_iter().map(|(_, _, s)| s).collect();
    let index = encode_tocs(&tocs);
    let parsed_config: cairn_spec::ImageConfig = serde_json::from_slice(&resolved.config_bytes)
        .map_err(|e| RemoteError::invalid(format!("config of {display}"), e.to_string()))?;

    // Into the store: image, lazy index (the TOCs), record, name.
    let _lock = store.lock_shared()?;
    let complete = crate::lazy::complete_in_store(store, &image_sha);
    if !complete {
        let manifest = String::from_utf8_lossy(&resolved.manifest_bytes).into_owned();
        let record = ImageRecord {
            manifest_digest: resolved.manifest_digest.to_string(),
            config_digest: resolved.config_digest.to_string(),
            manifest: manifest.clone(),
            ..incomplete_record(
                &image_sha,
                &resolved.config_bytes,
                &parsed_config,
                &display,
                LazySource {
                    registry: r.registry.clone(),
                    repository: repo.clone(),
                    artifact_digest: resolved.manifest_digest.to_string(),
                    artifact_manifest: manifest,
                    index_digest: Digest::of(&index).to_string(),
                    objects: objects.len() as u64,
                    object_bytes,
                    estargz: true,
                },
            )
        };
        write_incomplete(store, &image, &index, record)?;
    }
    if let Some(name) = &opts.name {
        store.set_ref(&cairn_store::ref_name_for(name), &image_sha)?;
    }
    Ok(LazyPullReport {
        reference: display,
        name: opts.name.clone(),
        image_digest: image_sha,
        artifact_digest: resolved.manifest_digest.to_string(),
        manifest_digest: resolved.manifest_digest.to_string(),
        objects: objects.len() as u64,
        object_bytes,
        objects_local: 0,
        bytes_fetched: fetched,
        complete,
        prefetched: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times() {
        let t = |s| parse_rfc3339(s).map(|m| (m.sec, m.nsec));
        assert_eq!(t("1970-01-01T00:00:00Z"), Some((0, 0)));
        assert_eq!(t("2023-11-14T22:13:20Z"), Some((1_700_000_000, 0)));
        assert_eq!(t("2000-02-29T00:00:00Z"), Some((951_782_400, 0)));
        assert_eq!(
            t("2023-11-14T23:13:20.5+01:00"),
            Some((1_700_000_000, 500_000_000))
        );
        assert_eq!(t("1969-12-31T23:59:59Z"), Some((-1, 0)));
        for bad in [
            "",
            "2023-11-14",
            "2023-13-01T00:00:00Z",
            "2023-11-14T22:13:20",
            "x023-11-14T22:13:20Z",
        ] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }

    #[test]
    fn toc_bundles_round_trip_and_refuse_damage() {
        let tocs = vec![
            StoredToc {
                toc_offset: 7,
                mode: 0o644,
                uid: 1,
                gid: 2,
                mtime: -3,
                json: b"{}".to_vec(),
            },
            StoredToc {
                toc_offset: 9,
                mode: 0,
                uid: 0,
                gid: 0,
                mtime: 0,
                json: Vec::new(),
            },
        ];
        let b = encode_tocs(&tocs);
        assert_eq!(decode_tocs(&b).unwrap(), tocs);
        for n in 0..b.len() {
            assert!(decode_tocs(&b[..n]).is_err(), "{n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_tocs(&long).is_err());
    }

    #[test]
    fn an_estargz_layer_becomes_the_tree_a_tar_would_give() {
        let (blob, digest) = crate::estargz::build::layer(
            &[("a/one", &[1u8; 3000][..]), ("a/two", b"hello")],
            1024,
            true,
        );
        let toc = crate::estargz::read_toc(blob.len() as u64, Some(&digest), |o, l| {
            Ok(blob[o as usize..(o + l) as usize].to_vec())
        })
        .unwrap();
        let stored = StoredToc {
            toc_offset: toc.toc_offset,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 0,
            json: b"{}".to_vec(),
        };
        let image = image_from_tocs(&[("l0".into(), toc, stored)]).unwrap();
        let objects = crate::lazy::image_objects(&image, "t").unwrap();
        let one: [u8; 32] = Sha256::digest([1u8; 3000]).into();
        assert_eq!(objects.get(&cairn_store::ObjectId(one)), Some(&3000));
        let toc_sha: [u8; 32] = Sha256::digest(b"{}").into();
        assert_eq!(objects.get(&cairn_store::ObjectId(toc_sha)), Some(&2));
    }
}
