//! EROFS images in the composefs format: the on-disk structures
//! ([`format`]), the in-memory tree they describe ([`tree`]), a writer that
//! turns a tree into an image byte-identical to what composefs'
//! `mkcomposefs` writes ([`writer`]), a reader that turns an untrusted image
//! back into a tree ([`reader`]), and the composefs dumpfile text format
//! that both speak in tests and on the command line ([`dump`]).
//!
//! This crate does no I/O beyond the `Read`/`Write` streams it is handed;
//! it never touches the object store or mounts anything.

#![forbid(unsafe_code)]

pub mod dump;
pub mod format;
pub mod reader;
pub mod tree;
pub mod writer;

pub use tree::{DirEntry, FileType, Inode, InodeData, InodeId, Mtime, RegularFile, Tree, ROOT};

/// Errors in building or writing a tree.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid file mode {0:o}")]
    InvalidMode(u32),
    #[error("the root must be a directory")]
    RootNotDirectory,
    #[error("invalid name: {0}")]
    InvalidName(String),
    #[error("{0}: parent is not a directory")]
    NotADirectory(String),
    #[error("{0}: directories cannot be hardlinked")]
    DirectoryHardlink(String),
    #[error("{0}: entry already exists")]
    DuplicateEntry(String),
    #[error("{path}: {reason}")]
    InvalidInode { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
    #[error("unsupported composefs format version {0} (this writer knows 0 and 1)")]
    UnsupportedVersion(u32),
    #[error("writing image: {0}")]
    Io(#[from] std::io::Error),
}
