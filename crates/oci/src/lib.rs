//! OCI images from registries: references, the distribution API client, and
//! `pull`, which streams layers from a registry into the store.
//!
//! ```text
//! ImageRef::parse("127.0.0.1:5000/debian:bookworm")
//!   │  reference   registry / repository / tag / digest, docker's defaults
//!   ▼
//! Registry         /v2/ API: auth (basic, bearer tokens), redirects, retries
//!   │  resolve     manifest (index → platform), config; every digest checked
//!   ▼
//! pull             layers the store lacks, a few at a time:
//!                  BlobReader ──stream──► cairn_image::import_layer (digest + diff_id)
//!                  then cairn_image::assemble_image, named
//! ```
//!
//! Supported: OCI image indexes and manifests, Docker schema 2 manifests and
//! manifest lists; tar, tar+gzip and tar+zstd layers. Refused with a clear
//! error: Docker schema 1, unknown media types, non-image artifacts.
//! Credentials: see [`auth`] (no credential helpers). The image spec's
//! types, media types, digests, platforms and limits are `cairn-spec`'s
//! ([`spec`] re-exports what a pull uses).
//!
//! This crate never parses tar and never writes to the store itself: the
//! layer importer in `cairn-image` does both, and publishes nothing it has
//! not verified.

#![forbid(unsafe_code)]

pub mod auth;
pub mod client;
mod error;
pub mod pull;
pub mod reference;
pub mod spec;

/// Digests and platforms are `cairn-spec`'s, shared with the local image
/// sources so that a pull and an import read them alike.
pub use cairn_spec::{digest, platform};
pub use cairn_spec::{Digest, PlatformSpec};
pub use client::{ClientOptions, FetchedManifest, Registry};
pub use error::PullError;
pub use pull::{
    pull, resolve, resolve_fetched, LayerReport, PullEvent, PullObserver, PullOptions, PullReport,
    Resolved,
};
pub use reference::ImageRef;
