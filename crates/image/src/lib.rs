//! Filesystem trees from the outside world, turned into [`cairn_erofs::Tree`]s
//! and into images in the store.
//!
//! This crate owns the path from a source of files to the tree model and
//! on into the store:
//!
//! - a directory on the host ([`scan_dir`]);
//! - an OCI layer blob ([`import_layer`]): decompressed (`decompress`),
//!   parsed as it streams (`tar`), its files stored as objects and its
//!   entries as a layer record (`layer`; pax headers in `pax`);
//! - a stack of layers ([`assemble_image`]): applied in order with the
//!   OCI whiteout rules (`apply`) and written as a composefs EROFS image
//!   with its image record (`assemble`);
//! - whole images from an OCI layout, a `docker save` archive or a
//!   directory, and back out to an OCI layout (`archive`, `export`).
//!
//! Regular file contents never stay in memory: small files (up to the
//! inline threshold) are kept inside the image, every other file is named
//! by its fs-verity digest and stored once in the object store.
//!
//! This crate never mounts anything and never writes outside the store
//! (except where `export` is asked to write an OCI layout).

#![forbid(unsafe_code)]

mod apply;
mod archive;
mod assemble;
mod decompress;
mod early;
mod entry;
mod error;
mod export;
mod fuzz;
mod layer;
mod layer_jobs;
mod pax;
mod pipeline;
mod scan;
mod tar;
pub mod toc;

#[doc(hidden)]
pub use archive::fuzz_layout_json;
pub use archive::{import_dir, import_docker_archive, import_oci_layout, ImportOptions};
#[doc(hidden)]
pub use assemble::fuzz_parse_image;
pub use assemble::{
    assemble_image, assemble_image_from, build_image_tree, now_rfc3339, ImportedImage, StagedImage,
};
/// The platform an import picks from an index: `cairn-spec`'s, the one a
/// registry pull uses too.
pub use cairn_spec::PlatformSpec;
pub use decompress::Compression;
pub use early::{
    build_tree_as_imported, reports, taps, BuiltTree, Ends, LayerEnd, LayerFeed, LineTap, Reports,
    TapChunk, TAP_BUDGET,
};
pub use error::LayerError;
pub use export::{export_oci_layout, write_tar, write_tar_from, ExportedImage, TarContents};
pub use fuzz::fuzz_apply;
pub use layer::{
    has_layer, import_layer, import_layer_with, CheckedLayer, LayerInfo, LayerWatch, Limits,
};
pub use layer_jobs::DEFAULT_LAYER_JOBS;
pub use scan::{scan_dir, ScanError, ScanOptions, ScanStats};

/// Fuzzing oracle for the tar reader (the `tar_read` fuzz target): reads
/// every entry of `data`, and all of its data, with the default
/// [`Limits`], checking the reader's invariants. Errors are fine; a panic
/// is a bug. Not part of the API.
#[doc(hidden)]
pub fn fuzz_tar(data: &[u8]) {
    tar::fuzz_read(data)
}
