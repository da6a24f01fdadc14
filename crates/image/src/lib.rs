//! Filesystem trees from the outside world, turned into [`cairn_erofs::Tree`]s.
//!
//! This crate owns the path from a source of files to the tree model: today
//! a directory on the host ([`scan_dir`]); the OCI layer importer (tar
//! streams, whiteouts, layer application) will live here too. Regular file
//! contents never stay in memory: small files (up to the inline threshold)
//! are kept inside the image, every other file is named by its fs-verity
//! digest and, when a [`cairn_store::Store`] is given, copied (reflinked
//! where the filesystem can) into the object store.
//!
//! This crate never mounts anything and never writes outside the store.

#![forbid(unsafe_code)]

mod scan;

pub use scan::{scan_dir, ScanError, ScanOptions, ScanStats};
