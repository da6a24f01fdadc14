//! [`PullError`]: every way resolving or pulling an image fails.
//!
//! Each variant names what was being fetched or checked (the reference, the
//! blob digest, the registry) so the message alone tells a user where it went
//! wrong. Messages of underlying errors are part of the message rather than a
//! `source()`, as in `cairn-store`, so `{:#}` chains do not say them twice.
//! This module only describes errors; it never logs.

use std::path::PathBuf;

/// A failed resolve or pull.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("invalid image reference {input:?}: {reason}")]
    InvalidReference { input: String, reason: String },

    #[error("invalid platform {input:?}: {reason}")]
    InvalidPlatform { input: String, reason: String },

    /// No connection could be made (refused, no such host, connect timeout).
    #[error("cannot reach registry {registry}: {detail}")]
    Unreachable { registry: String, detail: String },

    /// The registry answered 401 or 403 to us, with or without credentials.
    #[error("authentication failed for {target} ({status}: {detail})")]
    AuthFailed {
        /// `registry/repository`.
        target: String,
        status: u16,
        detail: String,
    },

    /// The tag or digest is not in the repository (or the repository is not).
    #[error("manifest unknown: {reference}{detail}")]
    ManifestUnknown { reference: String, detail: String },

    #[error("blob unknown: {digest} in {repository}")]
    BlobUnknown { digest: String, repository: String },

    /// Any other HTTP status we cannot do anything with.
    #[error("{what}: registry {registry} answered {status}{detail}")]
    Http {
        what: String,
        registry: String,
        status: u16,
        detail: String,
    },

    /// The registry stopped sending (read timeout) and retries ran out.
    #[error(
        "{what}: no data from registry {registry} for {secs} s (gave up after {attempts} attempts)"
    )]
    Timeout {
        what: String,
        registry: String,
        secs: u64,
        attempts: u32,
    },

    /// A transient failure (reset connection, 5xx, 429, short body) that
    /// went on past the last retry.
    #[error("{what}: {detail} (gave up after {attempts} attempts)")]
    Network {
        what: String,
        detail: String,
        attempts: u32,
    },

    /// `size` is what the descriptor or Content-Length said, or `None` when
    /// the body itself ran past the limit.
    #[error("{what} is too large: {} (limit {limit})", size.map_or_else(|| format!("more than {limit} bytes"), |s| format!("{s} bytes")))]
    TooLarge {
        what: String,
        size: Option<u64>,
        limit: u64,
    },

    #[error("{what}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },

    #[error("{what}: size mismatch: the descriptor says {expected} bytes, got {actual}")]
    SizeMismatch {
        what: String,
        expected: u64,
        actual: u64,
    },

    /// The blob went on past the size its descriptor states (the reader
    /// stops one byte past it).
    #[error("{what}: size mismatch: the descriptor says {expected} bytes, the blob is longer")]
    TooLong { what: String, expected: u64 },

    /// A manifest or index whose own `mediaType` contradicts the descriptor
    /// that named it.
    #[error(
        "{what}: media type mismatch: the descriptor says {descriptor:?}, the content says {content:?}"
    )]
    MediaTypeMismatch {
        what: String,
        descriptor: String,
        content: String,
    },

    #[error("{what}: unsupported media type {media_type:?} ({hint})")]
    UnsupportedMediaType {
        what: String,
        media_type: String,
        hint: String,
    },

    #[error(
        "{what}: Docker schema 1 manifests are not supported (deprecated since 2017; \
         push the image again with a current client)"
    )]
    Schema1 { what: String },

    /// Well-formed bytes that do not make a valid manifest, index or config.
    #[error("invalid {what}: {detail}")]
    Invalid { what: String, detail: String },

    #[error(
        "no image for platform {wanted} in {reference} (available: {})",
        list_or_none(available)
    )]
    NoMatchingPlatform {
        reference: String,
        wanted: String,
        available: Vec<String>,
    },

    #[error("reading registry credentials from {}: {detail}", path.display())]
    Credentials { path: PathBuf, detail: String },

    /// Importing a layer failed (its digest or diff_id did not match, its
    /// tar stream was bad, or the store could not take it). The importer's
    /// message names the layer already.
    #[error("{error}")]
    Layer {
        digest: String,
        error: Box<cairn_image::LayerError>,
    },

    #[error("assembling image {reference}: {error}")]
    Assemble {
        reference: String,
        error: Box<cairn_image::LayerError>,
    },

    #[error("{0}")]
    Store(Box<cairn_store::StoreError>),

    /// Another layer failed first; this one was stopped.
    #[error("cancelled")]
    Cancelled,
}

impl From<cairn_spec::InvalidPlatform> for PullError {
    fn from(e: cairn_spec::InvalidPlatform) -> Self {
        PullError::InvalidPlatform {
            input: e.input,
            reason: e.reason,
        }
    }
}

impl From<cairn_store::StoreError> for PullError {
    fn from(e: cairn_store::StoreError) -> Self {
        PullError::Store(Box::new(e))
    }
}

fn list_or_none(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}
