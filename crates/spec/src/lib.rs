//! The OCI image spec as cairn reads it, in one place: digests
//! ([`digest`]), media types ([`media_type`]), descriptors, indexes,
//! manifests and configs ([`image`]), platforms ([`platform`]) and the
//! limits on what is read ([`limits`]).
//!
//! Every crate that handles an image uses these: the store (digests), the
//! layer importer and local image sources (`cairn-image`), the registry
//! client (`cairn-oci`) and the runtime (`cairn-run`, the image config's
//! `config`). Before this crate each had its own copy, and they disagreed
//! (on the config size limit, on which architecture names a platform may
//! use); one definition keeps a pull and an import of the same image
//! alike. The crate is at the bottom of the graph: pure parsing and
//! checking, no I/O, no network client.

#![forbid(unsafe_code)]

pub mod digest;
pub mod image;
pub mod limits;
pub mod media_type;
pub mod platform;

pub use digest::{parse_digest, sha256_digest, Digest, DigestError};
pub use image::{Descriptor, ExecConfig, ImageConfig, ImageIndex, ImageManifest, Platform, RootFs};
pub use media_type::{Compression, DocKind};
pub use platform::{InvalidPlatform, NoMatchingPlatform, PlatformSpec};
