//! The media types cairn reads and writes, and what a layer's media type
//! says about its compression.
//!
//! OCI types and their Docker schema 2 ancestors are both here: registries
//! and `docker save` still serve the Docker ones, and each Docker type reads
//! exactly as its OCI counterpart. Media type parameters (`; charset=…`)
//! are not part of the type; [`bare`] drops them.

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const OCI_LAYER_NONDIST_TAR: &str = "application/vnd.oci.image.layer.nondistributable.v1.tar";
pub const OCI_LAYER_NONDIST_GZIP: &str =
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip";
pub const OCI_LAYER_NONDIST_ZSTD: &str =
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const DOCKER_LAYER_ZSTD: &str = "application/vnd.docker.image.rootfs.diff.tar.zstd";
pub const DOCKER_LAYER_FOREIGN_GZIP: &str =
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip";
pub const DOCKER_SCHEMA1: &str = "application/vnd.docker.distribution.manifest.v1+json";
pub const DOCKER_SCHEMA1_SIGNED: &str = "application/vnd.docker.distribution.manifest.v1+prettyjws";

/// cairn's lazy-image artifact (`cairn push`, `cairn pull --lazy`): the
/// `artifactType` of its manifest. The format is in `docs/lazy-format.md`.
pub const CAIRN_LAZY_ARTIFACT: &str = "application/vnd.cairn.lazy.v1";
/// Its EROFS metadata image, zstd-compressed.
pub const CAIRN_LAZY_EROFS: &str = "application/vnd.cairn.lazy.v1.erofs+zstd";
/// Its object index (object id -> pack, offset, lengths), zstd-compressed.
pub const CAIRN_LAZY_INDEX: &str = "application/vnd.cairn.lazy.v1.index+zstd";
/// Its prefetch list: object ids, 32 bytes each, in the order to fetch them.
pub const CAIRN_LAZY_PREFETCH: &str = "application/vnd.cairn.lazy.v1.prefetch";
/// Its prefetch list, version 2: objects, and for large objects read in
/// part the chunks that were read (`cairn_remote::prefetch`).
pub const CAIRN_LAZY_PREFETCH_V2: &str = "application/vnd.cairn.lazy.v2.prefetch";
/// One pack of objects, each a zstd frame (or a run of 1 MiB chunk frames).
pub const CAIRN_LAZY_PACK: &str = "application/vnd.cairn.lazy.v1.pack";

/// What a manifest request accepts, most preferred first.
pub const MANIFEST_ACCEPT: [&str; 4] = [
    OCI_INDEX,
    OCI_MANIFEST,
    DOCKER_MANIFEST_LIST,
    DOCKER_MANIFEST,
];

/// `media_type` without its parameters (`; charset=…`).
pub fn bare(media_type: &str) -> &str {
    media_type.split(';').next().unwrap_or("").trim()
}

/// What a manifest-or-index media type names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocKind {
    /// An OCI image index or a Docker manifest list.
    Index,
    /// An OCI image manifest or a Docker schema 2 manifest.
    Manifest,
}

impl DocKind {
    /// The kind of document `media_type` names, or `None` for anything
    /// that is neither an index nor a manifest cairn reads (schema 1
    /// included).
    pub fn of(media_type: &str) -> Option<DocKind> {
        match media_type {
            OCI_INDEX | DOCKER_MANIFEST_LIST => Some(DocKind::Index),
            OCI_MANIFEST | DOCKER_MANIFEST => Some(DocKind::Manifest),
            _ => None,
        }
    }

    /// `index` or `manifest`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            DocKind::Index => "index",
            DocKind::Manifest => "manifest",
        }
    }
}

/// Whether `media_type` is an image config (OCI or Docker); anything else
/// in a manifest's `config` is an artifact, not a container image.
pub fn is_image_config(media_type: &str) -> bool {
    matches!(media_type, OCI_CONFIG | DOCKER_CONFIG)
}

/// Whether `media_type` is a Docker schema 1 manifest, which cairn refuses
/// by name rather than as an unknown type.
pub fn is_schema1(media_type: &str) -> bool {
    matches!(media_type, DOCKER_SCHEMA1 | DOCKER_SCHEMA1_SIGNED)
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression of a tar layer of media type `media_type`
    /// (parameters ignored), or `None` for anything that is not a tar
    /// layer cairn reads.
    pub fn of_layer(media_type: &str) -> Option<Compression> {
        Some(match bare(media_type) {
            OCI_LAYER_TAR | OCI_LAYER_NONDIST_TAR | DOCKER_LAYER_TAR => Compression::None,
            OCI_LAYER_GZIP
            | OCI_LAYER_NONDIST_GZIP
            | DOCKER_LAYER_GZIP
            | DOCKER_LAYER_FOREIGN_GZIP => Compression::Gzip,
            OCI_LAYER_ZSTD | OCI_LAYER_NONDIST_ZSTD | DOCKER_LAYER_ZSTD => Compression::Zstd,
            _ => return None,
        })
    }

    /// The compression the first bytes of a blob show, if any (gzip's and
    /// zstd's magic numbers; a tar has none).
    pub fn from_magic(head: &[u8]) -> Option<Compression> {
        if head.starts_with(&[0x1f, 0x8b]) {
            Some(Compression::Gzip)
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Some(Compression::Zstd)
        } else {
            None
        }
    }

    /// `none`, `gzip` or `zstd`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }

    /// The OCI media type for a layer compressed this way: what the layer
    /// importer is handed, whichever spelling the manifest used.
    pub fn oci_media_type(self) -> &'static str {
        match self {
            Compression::None => OCI_LAYER_TAR,
            Compression::Gzip => OCI_LAYER_GZIP,
            Compression::Zstd => OCI_LAYER_ZSTD,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_types() {
        assert_eq!(
            Compression::of_layer(DOCKER_LAYER_GZIP),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::of_layer(&format!("{OCI_LAYER_ZSTD}; x=y")),
            Some(Compression::Zstd)
        );
        assert_eq!(
            Compression::of_layer(OCI_LAYER_NONDIST_TAR),
            Some(Compression::None)
        );
        assert_eq!(Compression::of_layer(OCI_CONFIG), None);
        for c in [Compression::None, Compression::Gzip, Compression::Zstd] {
            assert_eq!(Compression::of_layer(c.oci_media_type()), Some(c));
        }
        assert_eq!(DocKind::of(DOCKER_MANIFEST_LIST), Some(DocKind::Index));
        assert_eq!(DocKind::of(DOCKER_SCHEMA1), None);
    }
}
