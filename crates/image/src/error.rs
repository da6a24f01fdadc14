//! [`LayerError`]: every way importing a layer or assembling an image fails.
//! Each names the layer (its digest, or what the caller called it) and,
//! for a bad tar entry, the entry's path and where it is in the stream.
//!
//! This module only describes errors; it never logs.

use std::io;

use cairn_store::StoreError;

/// A failed layer import or image assembly. Nothing it was doing became
/// visible in the store.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Reading the blob failed (the network, a file): worth a retry.
    #[error("layer {layer}: reading the blob: {source}")]
    Read {
        layer: String,
        #[source]
        source: io::Error,
    },
    /// The blob is not a valid layer (corrupt compression, not a tar, …).
    #[error("layer {layer}: {reason}")]
    Invalid { layer: String, reason: String },
    /// One tar entry is malformed or unsafe.
    #[error("layer {layer}: tar entry {entry:?} at byte {offset} of the tar stream: {reason}")]
    Entry {
        layer: String,
        entry: String,
        offset: u64,
        reason: String,
    },
    /// The blob or the tar stream is not what the caller said it is.
    #[error("layer {layer}: {what} mismatch: expected {expected}, got {actual}")]
    Digest {
        layer: String,
        what: &'static str,
        expected: String,
        actual: String,
    },
    /// A size, count or ratio limit was exceeded.
    #[error("layer {layer}: {reason}")]
    Limit { layer: String, reason: String },
    /// The media type is not a layer type cairn reads.
    #[error("layer {layer}: unknown layer media type {media_type:?}")]
    MediaType { layer: String, media_type: String },
    /// Applying a layer on the layers below it failed.
    #[error("layer {layer}: applying {path:?}: {reason}")]
    Apply {
        layer: String,
        path: String,
        reason: String,
    },
    /// The manifest or config is unusable.
    #[error("image {what}: {reason}")]
    Image { what: &'static str, reason: String },
    /// An image archive or layout (oci-layout, docker-archive, dir) is
    /// unusable.
    #[error("{archive}: {reason}")]
    Archive { archive: String, reason: String },
    /// A layer the image needs is not in the store.
    #[error("layer {diff_id} is not in the store (import it first)")]
    MissingLayer { diff_id: String },
    /// The import stopped before it checked the layer: it failed, or
    /// something else of the image failed first and stopped it. The
    /// failure that stopped it is the one to report; this only says that
    /// what waited for the layer (an image's tree) has nothing to use.
    #[error("layer {layer}: {reason}")]
    Stopped { layer: String, reason: &'static str },
    /// The store failed.
    #[error("{context}: {source}")]
    Store {
        context: String,
        #[source]
        source: StoreError,
    },
}

impl LayerError {
    pub(crate) fn store(context: impl Into<String>) -> impl FnOnce(StoreError) -> LayerError {
        let context = context.into();
        move |source| LayerError::Store { context, source }
    }
}
