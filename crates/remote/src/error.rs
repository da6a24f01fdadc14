//! [`RemoteError`]: every way pushing, lazily pulling or fetching fails.
//! Each names what it was doing and on what (image, object, blob), so the
//! message alone says where it went wrong.

/// A failed push, lazy pull or fetch.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// Talking to the registry failed (the message names the registry,
    /// the blob or manifest, and why). Transparent: the message and the
    /// source are the inner error's, so that an error chain (`{:#}`) does
    /// not say it twice.
    #[error(transparent)]
    Registry(#[from] cairn_oci::PullError),

    #[error(transparent)]
    Store(#[from] cairn_store::StoreError),

    /// The image cannot be started lazily; `why` says what was looked for.
    #[error("image {reference} cannot be started lazily: {why}")]
    NotLazy { reference: String, why: String },

    /// What the registry served for an object is not the object: nothing
    /// of it was stored or served.
    #[error(
        "object {object} from blob {blob} in {repository}: {detail}; nothing of it was stored"
    )]
    CorruptObject {
        object: String,
        blob: String,
        repository: String,
        detail: String,
    },

    /// An artifact, index or metadata blob that is not what cairn writes.
    #[error("invalid {what}: {detail}")]
    Invalid { what: String, detail: String },

    /// The image cannot be pushed (no record, incomplete, corrupt object).
    #[error("cannot push image {image}: {why}")]
    CannotPush { image: String, why: String },

    /// The image has no lazy source (it is complete, or not from `pull --lazy`).
    #[error("image {image} is not an incomplete (lazily pulled) image: {why}")]
    NotIncomplete { image: String, why: String },

    /// Writing the fetched bytes to the caller failed.
    #[error("writing object {object}: {error}")]
    Write {
        object: String,
        error: std::io::Error,
    },
}

impl RemoteError {
    pub(crate) fn invalid(what: impl Into<String>, detail: impl Into<String>) -> RemoteError {
        RemoteError::Invalid {
            what: what.into(),
            detail: detail.into(),
        }
    }
}
