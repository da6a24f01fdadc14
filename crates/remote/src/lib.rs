//! cairn's lazy-image artifact: an image published so that it can start
//! before its file contents are local.
//!
//! ```text
//! cairn push IMAGE REG/REPO:TAG      push::push: EROFS image, index and packs
//!                                    as an OCI artifact whose subject is the
//!                                    image's manifest (referrers API, or the
//!                                    referrers tag schema where there is none)
//! cairn pull --lazy REF              lazy::pull_lazy: metadata only; an
//!                                    *incomplete* image in the store
//! cairn fetch IMAGE                  fetch::fetch_image: the missing objects,
//!                                    range reads coalesced, each verified
//! FUSE data layer                    fetch::RemoteObjects: one object on demand
//! ```
//!
//! The format (artifact, packs, index), the verification rules and the
//! incomplete-image record are described in `docs/lazy-format.md`. Nothing
//! this crate reads from a registry is trusted: the artifact manifest is
//! reached by digest, every blob is checked against its descriptor, the
//! index is parsed with limits ([`index`]), every chunk is checked against
//! its sha256 and every object against its fs-verity digest before any
//! byte of it is written to the store or handed to a reader.

#![forbid(unsafe_code)]

pub mod artifact;
mod error;
pub mod estargz;
pub mod estargz_fetch;
pub mod estargz_pull;
pub mod fetch;
pub mod index;
pub mod lazy;
pub mod prefetch;
pub mod push;

pub use error::RemoteError;

pub use estargz_fetch::EstargzObjects;
pub use fetch::{fetch_image, FetchOptions, FetchReport, RemoteObjects, DEFAULT_COALESCE};
pub use lazy::{pull_lazy, LazyPullOptions, LazyPullReport};
pub use push::{push, PushOptions, PushReport};
