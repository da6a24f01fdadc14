//! The artifact manifest: an OCI image manifest with `artifactType`
//! [`CAIRN_LAZY_ARTIFACT`], the source image's config as its `config`, the
//! source image's manifest as its `subject`, and as layers the EROFS
//! metadata image, the object index, an optional prefetch list and the
//! packs, in that order. Writing it, reading it back (untrusted: every
//! role checked, every digest parsed), the referrers index of the tag
//! schema, and bounded zstd decoding.

use std::io::Read;

use cairn_oci::Digest;
use cairn_spec::media_type::{
    CAIRN_LAZY_ARTIFACT, CAIRN_LAZY_EROFS, CAIRN_LAZY_INDEX, CAIRN_LAZY_PACK, CAIRN_LAZY_PREFETCH,
    CAIRN_LAZY_PREFETCH_V2, OCI_INDEX, OCI_MANIFEST,
};
use cairn_spec::Descriptor;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::RemoteError;

/// Annotation: sha256 (hex) of the decompressed EROFS image.
pub const ANNOTATION_EROFS_SHA256: &str = "org.cairn.lazy.erofs.sha256";
/// Annotation: how many objects the packs hold.
pub const ANNOTATION_OBJECTS: &str = "org.cairn.lazy.objects";
/// Annotation on the EROFS layer: its decompressed size.
pub const ANNOTATION_UNCOMPRESSED: &str = "org.cairn.lazy.uncompressed-size";
/// The largest artifact manifest read: an artifact is an image manifest,
/// and has the spec's limit for one.
pub const MAX_ARTIFACT_MANIFEST: u64 = cairn_spec::limits::MAX_MANIFEST_SIZE;
/// The largest EROFS image accepted (the EROFS reader's own limit).
pub const MAX_EROFS: u64 = 4 << 30;

/// A blob as a descriptor names it: a [`cairn_spec::Descriptor`] whose
/// digest is checked, and that is also written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
}

impl Blob {
    pub fn json(&self) -> Value {
        json!({"mediaType": self.media_type, "digest": self.digest.to_string(), "size": self.size})
    }
}

/// An artifact, parsed and checked.
#[derive(Debug, Clone)]
pub struct Artifact {
    pub config: Blob,
    pub subject: Option<Blob>,
    pub erofs: Blob,
    /// sha256 hex of the decompressed EROFS image, from the annotation.
    pub erofs_sha256: Option<String>,
    /// The decompressed EROFS image's size, from its layer's annotation.
    pub erofs_size: Option<u64>,
    pub index: Blob,
    pub prefetch: Option<Blob>,
    pub packs: Vec<Blob>,
}

/// What an artifact manifest names.
#[derive(Debug, Clone)]
pub struct Parts<'a> {
    pub config: &'a Blob,
    pub subject: &'a Blob,
    pub erofs: &'a Blob,
    /// sha256 hex of the decompressed EROFS image, and its size.
    pub erofs_sha256: &'a str,
    pub erofs_size: u64,
    pub index: &'a Blob,
    pub prefetch: Option<&'a Blob>,
    pub packs: &'a [Blob],
    pub objects: u64,
}

/// Writes the artifact manifest.
pub fn manifest_bytes(p: &Parts<'_>) -> Vec<u8> {
    let Parts {
        config,
        subject,
        erofs,
        erofs_sha256,
        erofs_size,
        index,
        prefetch,
        packs,
        objects,
    } = *p;
    let mut layers = vec![
        json!({"mediaType": erofs.media_type, "digest": erofs.digest.to_string(), "size": erofs.size,
               "annotations": {ANNOTATION_UNCOMPRESSED: erofs_size.to_string()}}),
        index.json(),
    ];
    if let Some(p) = prefetch {
        layers.push(p.json());
    }
    layers.extend(packs.iter().map(Blob::json));
    let m = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": CAIRN_LAZY_ARTIFACT,
        "config": config.json(),
        "layers": layers,
        "subject": subject.json(),
        "annotations": {
            ANNOTATION_EROFS_SHA256: erofs_sha256,
            ANNOTATION_OBJECTS: objects.to_string(),
        },
    });
    serde_json::to_vec(&m).expect("a manifest serialises")
}

/// A descriptor read as the spec crate reads every other one
/// ([`cairn_spec::Descriptor`]: `mediaType`, `digest` and `size` required),
/// its digest checked.
fn blob_of(v: &Value, what: &str) -> Result<Blob, RemoteError> {
    let d = Descriptor::deserialize(v)
        .map_err(|e| RemoteError::invalid(what, format!("descriptor: {e}")))?;
    let digest = d
        .digest()
        .map_err(|e| RemoteError::invalid(what, format!("descriptor digest: {e}")))?;
    Ok(Blob {
        media_type: d.media_type,
        digest,
        size: d.size,
    })
}

/// Whether a manifest document declares itself a cairn lazy artifact.
pub fn is_artifact(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Value>(bytes)
        .ok()
        .is_some_and(|v| v["artifactType"] == CAIRN_LAZY_ARTIFACT)
}

/// Parses an artifact manifest (`what` names it for errors).
pub fn parse(bytes: &[u8], what: &str) -> Result<Artifact, RemoteError> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| RemoteError::invalid(what, e.to_string()))?;
    if v["artifactType"] != CAIRN_LAZY_ARTIFACT {
        return Err(RemoteError::invalid(
            what,
            format!(
                "artifactType is {}, not {CAIRN_LAZY_ARTIFACT}",
                v["artifactType"]
            ),
        ));
    }
    if v["schemaVersion"] != 2 {
        return Err(RemoteError::invalid(what, "schemaVersion is not 2"));
    }
    let config = blob_of(&v["config"], &format!("{what}: config"))?;
    let subject = match &v["subject"] {
        Value::Null => None,
        s => Some(blob_of(s, &format!("{what}: subject"))?),
    };
    let layers = v["layers"]
        .as_array()
        .ok_or_else(|| RemoteError::invalid(what, "no layers"))?;
    let mut erofs = None;
    let mut erofs_size = None;
    let mut index = None;
    let mut prefetch = None;
    let mut packs = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let lwhat = format!("{what}: layer {i}");
        let b = blob_of(l, &lwhat)?;
        let slot = match b.media_type.as_str() {
            CAIRN_LAZY_EROFS => {
                erofs_size = l["annotations"][ANNOTATION_UNCOMPRESSED]
                    .as_str()
                    .and_then(|s| s.parse::<u64>().ok());
                &mut erofs
            }
            CAIRN_LAZY_INDEX => &mut index,
            CAIRN_LAZY_PREFETCH | CAIRN_LAZY_PREFETCH_V2 => &mut prefetch,
            CAIRN_LAZY_PACK => {
                packs.push(b);
                continue;
            }
            other => {
                return Err(RemoteError::invalid(
                    lwhat,
                    format!("unknown media type {other:?}"),
                ))
            }
        };
        if slot.is_some() {
            return Err(RemoteError::invalid(
                lwhat,
                format!("a second {} layer", b.media_type),
            ));
        }
        *slot = Some(b);
    }
    let erofs_sha256 = v["annotations"][ANNOTATION_EROFS_SHA256]
        .as_str()
        .map(str::to_string);
    if let Some(h) = &erofs_sha256 {
        if h.len() != 64 || !h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(RemoteError::invalid(
                what,
                format!("{ANNOTATION_EROFS_SHA256} is not a sha256: {h:?}"),
            ));
        }
    }
    Ok(Artifact {
        config,
        subject,
        erofs: erofs.ok_or_else(|| RemoteError::invalid(what, "no EROFS metadata layer"))?,
        erofs_sha256,
        erofs_size,
        index: index.ok_or_else(|| RemoteError::invalid(what, "no index layer"))?,
        prefetch,
        packs,
    })
}

/// The tag the referrers tag schema keeps `subject`'s referrers under:
/// `sha256-<hex>`.
pub fn referrers_tag(subject: &Digest) -> String {
    format!("sha256-{}", subject.hex())
}

/// The cairn artifacts an image index of referrers lists (by
/// `artifactType`), in its order.
pub fn artifacts_in(index: &[u8], what: &str) -> Result<Vec<Blob>, RemoteError> {
    let v: Value =
        serde_json::from_slice(index).map_err(|e| RemoteError::invalid(what, e.to_string()))?;
    let Some(list) = v["manifests"].as_array() else {
        return Err(RemoteError::invalid(what, "no manifests list"));
    };
    let mut out = Vec::new();
    for m in list {
        if m["artifactType"] == CAIRN_LAZY_ARTIFACT {
            out.push(blob_of(m, what)?);
        }
    }
    Ok(out)
}

/// The referrers index with `artifact` added (or a new one); `None` when
/// it lists the artifact already.
pub fn add_referrer(
    existing: Option<&[u8]>,
    artifact: &Blob,
    what: &str,
) -> Result<Option<Vec<u8>>, RemoteError> {
    let mut v = match existing {
        Some(b) => {
            serde_json::from_slice(b).map_err(|e| RemoteError::invalid(what, e.to_string()))?
        }
        None => json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}),
    };
    let Some(list) = v["manifests"].as_array_mut() else {
        return Err(RemoteError::invalid(what, "no manifests list"));
    };
    let digest = artifact.digest.to_string();
    if list.iter().any(|m| m["digest"] == digest.as_str()) {
        return Ok(None);
    }
    let mut d = artifact.json();
    d["artifactType"] = json!(CAIRN_LAZY_ARTIFACT);
    list.push(d);
    Ok(Some(serde_json::to_vec(&v).expect("an index serialises")))
}

/// Decompresses a whole zstd blob, refusing more than `limit` bytes.
pub fn unzstd(data: &[u8], limit: u64, what: &str) -> Result<Vec<u8>, RemoteError> {
    // One frame that says its size (as `cairn push` writes them), within
    // the limit: in one call into a buffer of that size, which is all the
    // call may write (no window buffer, no growing copies). The size is the
    // sender's word: the buffer is asked for with `try_reserve_exact`, so a
    // header claiming gigabytes the machine will not give is a fallback,
    // not an abort, and only what really decompresses is touched. Anything
    // else, or any error, goes the streaming way, which also words the
    // error.
    if let Ok(Some(size)) = zstd::zstd_safe::get_frame_content_size(data) {
        let mut out = Vec::new();
        if size <= limit && out.try_reserve_exact(size as usize).is_ok() {
            let done = zstd::bulk::Decompressor::new()
                .and_then(|mut d| d.decompress_to_buffer(data, &mut out));
            if matches!(done, Ok(n) if n as u64 == size) {
                return Ok(out);
            }
        }
    }
    let dec = zstd::stream::read::Decoder::new(data)
        .map_err(|e| RemoteError::invalid(what, format!("zstd: {e}")))?;
    let mut out = Vec::new();
    dec.take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| RemoteError::invalid(what, format!("zstd: {e}")))?;
    if out.len() as u64 > limit {
        return Err(RemoteError::invalid(
            what,
            format!("decompresses to more than {limit} bytes"),
        ));
    }
    Ok(out)
}

/// Decompresses one frame that must give exactly `size` bytes.
///
/// A pack frame holds one object or one chunk of one, so `size` is at most
/// the index's chunk size (1 MiB: `Index::parse` refuses more) and the
/// frame is decompressed in one call straight into a buffer of exactly
/// `size` bytes: nothing else is allocated, and a frame that would give
/// more is refused when the buffer is full, whatever window it asks for.
/// The decompression context is kept per thread: a fresh one per frame
/// (as a streaming decoder makes, with its window buffer) was a quarter of
/// a prefetch list's fetch, in `mmap`, page faults and zeroing.
pub fn unzstd_exact(data: &[u8], size: u64) -> Result<Vec<u8>, String> {
    use std::cell::RefCell;
    thread_local! {
        static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { RefCell::new(None) };
    }
    if size > MAX_EXACT {
        return Err(format!(
            "a frame of {size} bytes, more than the {MAX_EXACT} a frame may hold"
        ));
    }
    let mut out = Vec::with_capacity(size as usize);
    let r = DCTX.with(|cell| {
        let mut cell = cell.borrow_mut();
        let dec = match &mut *cell {
            Some(d) => d,
            None => cell.insert(zstd::bulk::Decompressor::new()?),
        };
        dec.decompress_to_buffer(data, &mut out)
    });
    match r {
        Ok(n) if n as u64 == size => Ok(out),
        Ok(n) => Err(format!(
            "frame decompresses to {n} bytes, the index says {size}"
        )),
        Err(e) => match zstd::zstd_safe::get_frame_content_size(data) {
            Ok(Some(n)) if n > size => Err(format!(
                "frame decompresses to {n} bytes, the index says {size}"
            )),
            _ => Err(format!("zstd: {e}")),
        },
    }
}

/// The most a frame may decompress to: one chunk (`Index::parse` refuses
/// a single-frame object or a chunk larger than that).
const MAX_EXACT: u64 = crate::index::CHUNK_SIZE as u64;

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(t: &str, n: u8) -> Blob {
        Blob {
            media_type: t.to_string(),
            digest: Digest::of(&[n]),
            size: u64::from(n) + 10,
        }
    }

    #[test]
    fn manifest_round_trip() {
        let packs = vec![blob(CAIRN_LAZY_PACK, 5), blob(CAIRN_LAZY_PACK, 6)];
        let bytes = manifest_bytes(&Parts {
            config: &blob(cairn_spec::media_type::OCI_CONFIG, 1),
            subject: &blob(OCI_MANIFEST, 2),
            erofs: &blob(CAIRN_LAZY_EROFS, 3),
            erofs_sha256: &"a".repeat(64),
            erofs_size: 1234,
            index: &blob(CAIRN_LAZY_INDEX, 4),
            prefetch: None,
            packs: &packs,
            objects: 7,
        });
        assert!(is_artifact(&bytes));
        let a = parse(&bytes, "t").unwrap();
        assert_eq!(a.packs, packs);
        assert_eq!(a.erofs_size, Some(1234));
        assert_eq!(a.subject, Some(blob(OCI_MANIFEST, 2)));
        assert_eq!(a.erofs_sha256.as_deref(), Some(&*"a".repeat(64)));
        // Referrers tag schema: added once.
        let d = Blob {
            media_type: OCI_MANIFEST.into(),
            digest: Digest::of(&bytes),
            size: bytes.len() as u64,
        };
        let idx = add_referrer(None, &d, "r").unwrap().unwrap();
        assert_eq!(add_referrer(Some(&idx), &d, "r").unwrap(), None);
        assert_eq!(artifacts_in(&idx, "r").unwrap(), vec![d]);
    }

    #[test]
    fn hostile_manifests_are_named() {
        for (doc, needle) in [
            (r#"{"artifactType":"x"}"#, "artifactType"),
            (
                r#"{"artifactType":"application/vnd.cairn.lazy.v1","schemaVersion":2,"config":{"mediaType":"a","digest":"sha256:zz","size":1},"layers":[]}"#,
                "digest",
            ),
            (
                r#"{"artifactType":"application/vnd.cairn.lazy.v1","schemaVersion":2,"config":{"mediaType":"a","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":1},"layers":[]}"#,
                "no EROFS",
            ),
            ("not json", "expected"),
            // Descriptors are read as the spec crate reads them.
            (
                r#"{"artifactType":"application/vnd.cairn.lazy.v1","schemaVersion":2,"config":{"mediaType":"a","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000"},"layers":[]}"#,
                "m: config: descriptor: missing field `size`",
            ),
            (
                r#"{"artifactType":"application/vnd.cairn.lazy.v1","schemaVersion":2,"config":{"mediaType":"a","digest":"sha256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA","size":1},"layers":[]}"#,
                "64 lower-case hex digits",
            ),
        ] {
            let e = parse(doc.as_bytes(), "m").unwrap_err().to_string();
            assert!(e.contains(needle), "{doc}: {e}");
        }
    }

    #[test]
    fn zstd_limits() {
        let data = zstd::bulk::compress(&[7u8; 10_000], 3).unwrap();
        assert_eq!(unzstd(&data, 10_000, "x").unwrap().len(), 10_000);
        assert!(unzstd(&data, 9_999, "x").is_err());
        assert!(unzstd_exact(&data, 10_000).is_ok());
        assert!(unzstd_exact(&data, 9_000).is_err());
        assert!(unzstd_exact(&data, 11_000).is_err());
        assert!(unzstd_exact(b"garbage", 5).is_err());
        // Two frames: the first's declared size is not the whole; the
        // one-call way gives up and the streaming way reads both.
        let mut two = data.clone();
        two.extend_from_slice(&zstd::bulk::compress(&[8u8; 5_000], 3).unwrap());
        let both = unzstd(&two, 20_000, "x").unwrap();
        assert_eq!(both.len(), 15_000);
        assert!(both[..10_000].iter().all(|&b| b == 7) && both[10_000..].iter().all(|&b| b == 8));
        assert!(unzstd(&two, 14_999, "x").is_err());
        // A frame with trailing garbage is refused either way.
        let mut bad = data.clone();
        bad.extend_from_slice(b"garbage");
        assert!(unzstd(&bad, 20_000, "x").is_err());
    }

    /// One frame exactly, whatever its header says or leaves out, with
    /// the context reused from frame to frame.
    #[test]
    fn exact_frames() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let z = zstd::bulk::compress(&data, 3).unwrap();
        for _ in 0..3 {
            assert_eq!(unzstd_exact(&z, data.len() as u64).unwrap(), data);
        }
        let more = unzstd_exact(&z, 1000).unwrap_err();
        assert!(more.contains("300000 bytes, the index says 1000"), "{more}");
        let less = unzstd_exact(&z, 400_000).unwrap_err();
        assert!(
            less.contains("300000 bytes, the index says 400000"),
            "{less}"
        );
        // A streamed frame has no content size in its header.
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        enc.include_contentsize(false).unwrap();
        std::io::Write::write_all(&mut enc, &data).unwrap();
        let streamed = enc.finish().unwrap();
        assert_eq!(unzstd_exact(&streamed, data.len() as u64).unwrap(), data);
        assert!(unzstd_exact(&streamed, 1000).is_err());
        // Two frames back to back are more than the one the index names.
        let two = [z.clone(), z.clone()].concat();
        assert!(unzstd_exact(&two, data.len() as u64).is_err());
        // Truncated, and more than a chunk: refused.
        assert!(unzstd_exact(&z[..z.len() / 2], data.len() as u64).is_err());
        assert!(unzstd_exact(&z, (1 << 20) + 1).is_err());
    }
}
