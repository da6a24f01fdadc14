//! [`StoreError`]: every way a store operation fails, each naming the file
//! and what was being done to it.
//!
//! This module only describes errors. It must never log: the caller decides
//! whether an error is worth a message, and logging here would print it
//! twice.

use std::io;
use std::path::{Path, PathBuf};

/// A failed store operation.
///
/// I/O errors carry the operation, the path (relative to the store root when
/// it lies inside it) and the root, and read like
/// `writing object tmp/s.41.1a2b/o.7 in /var/lib/cairn: No space left on device (os error 28)`.
/// The OS error is part of the message rather than a `source()`, so a chain
/// printed with `{:#}` does not say it twice; [`StoreError::io_error`] gives
/// it back to code that wants to look at it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An operation on a file or directory of the store failed.
    #[error("{op} {} in {}: {error}", path.display(), root.display())]
    Io {
        op: &'static str,
        /// Relative to `root` when it lies inside the store.
        path: PathBuf,
        root: PathBuf,
        error: io::Error,
    },
    /// Reading what is being imported failed (a file outside the store, or a
    /// reader).
    #[error("{op} {what}: {error}")]
    Source {
        op: &'static str,
        what: String,
        error: io::Error,
    },
    /// The file being imported changed between hashing and copying, so its
    /// copy could not be trusted to match its digest.
    #[error("{what} changed while it was being imported into {}", root.display())]
    SourceChanged { what: String, root: PathBuf },
    #[error("invalid object id {0:?}: expected 64 hex digits")]
    InvalidObjectId(String),
    #[error("invalid image digest {0:?}: expected 64 lowercase hex digits (sha256)")]
    InvalidImageDigest(String),
    #[error("invalid ref name {name:?}: {reason}")]
    InvalidRefName { name: String, reason: &'static str },
    /// A ref file holds something other than an image digest.
    #[error("ref {name:?} in {}: {reason}", root.display())]
    CorruptRef {
        name: String,
        root: PathBuf,
        reason: String,
    },
    #[error("image {digest} is not in the store at {}", root.display())]
    ImageNotFound { digest: String, root: PathBuf },
    /// What the user named is neither a ref, nor an image digest or digest
    /// prefix in the store, nor an image file.
    #[error("no image {name:?} in the store at {}: not a name, an image digest (or a prefix of at least 12 digits) or an image file", root.display())]
    NoSuchImage { name: String, root: PathBuf },
    /// A digest prefix that more than one image starts with.
    #[error("image digest prefix {prefix:?} is ambiguous: it matches {}", candidates.join(", "))]
    AmbiguousImagePrefix {
        prefix: String,
        candidates: Vec<String>,
    },
    /// An image in the store that cannot be read as a composefs image.
    #[error("image {digest} in {}: {reason}", root.display())]
    CorruptImage {
        digest: String,
        root: PathBuf,
        reason: String,
    },
    /// A layer record under `layers/` that cannot be read.
    #[error("layer record {diff_id} in {}: {reason}", root.display())]
    CorruptLayer {
        diff_id: String,
        root: PathBuf,
        reason: String,
    },
    /// Garbage collection cannot tell what something still in use needs.
    #[error("not collecting garbage in {}: {reason}", root.display())]
    GcRefused { root: PathBuf, reason: String },
    /// The kernel has fs-verity for this store but refused to enable it on
    /// an object.
    #[error("enabling fs-verity on {} in {}: {error}", path.display(), root.display())]
    Verity {
        path: PathBuf,
        root: PathBuf,
        error: io::Error,
    },
}

impl StoreError {
    /// The OS error behind an I/O failure, if that is what this is.
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            StoreError::Io { error, .. }
            | StoreError::Source { error, .. }
            | StoreError::Verity { error, .. } => Some(error),
            _ => None,
        }
    }

    /// Builds an [`StoreError::Io`], shortening `path` to be relative to
    /// `root` when it lies inside it.
    pub(crate) fn io(op: &'static str, path: &Path, root: &Path, error: io::Error) -> Self {
        let path = match path.strip_prefix(root) {
            Ok(rel) if !rel.as_os_str().is_empty() => rel.to_path_buf(),
            _ => path.to_path_buf(),
        };
        StoreError::Io {
            op,
            path,
            root: root.to_path_buf(),
            error,
        }
    }
}
