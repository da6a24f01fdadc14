//! How large the JSON documents of an image may be, and how many layers
//! and nested indexes it may have: one set of numbers for a registry pull
//! and a local import alike, so an image one accepts the other does too.
//!
//! Manifests, indexes and configs are read whole into memory and parsed;
//! these bounds are what keeps a hostile source from making that cost
//! unbounded. Layer blobs are streamed and bounded elsewhere (the layer
//! importer's `Limits`).

/// The largest manifest or index read, in bytes: 4 MiB, the size the
/// distribution spec lets registries refuse manifests over, so nothing a
/// registry serves is larger, and an index of thousands of platforms fits.
pub const MAX_MANIFEST_SIZE: u64 = 4 << 20;

/// The largest image config read, in bytes: 16 MiB. No spec bounds a
/// config (it is a blob); real ones are a few KiB to a few hundred KiB,
/// the bulk being `history` and labels. The bound is four times the
/// manifest's so that an image built with very long histories or labels
/// still imports, while a config is still small enough to hold in memory
/// and to copy into the image record. (The registry pull refused configs
/// over 8 MiB and the local import over 16 MiB; a config that imports from
/// a `docker save` archive now also pulls.)
pub const MAX_CONFIG_SIZE: u64 = 16 << 20;

/// Most layers an image may have: docker's limit is 127 and OCI has none,
/// so this leaves headroom without allowing absurd counts (each layer is
/// a record to read and a tree to apply).
pub const MAX_LAYERS: usize = 1000;

/// Most image indexes on the way from a reference to its manifest (an
/// index naming an index naming a manifest is two): no tool makes deeper
/// nesting, and bounding it bounds what one reference can make cairn read.
pub const MAX_INDEX_DEPTH: usize = 2;
