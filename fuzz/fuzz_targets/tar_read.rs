//! Any bytes given to the tar reader as a layer's tar stream: every entry
//! and all its data read with the default limits, the reader's invariants
//! checked (`cairn_image::fuzz_tar`). Errors are fine; panics, hangs and
//! unbounded memory are bugs.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_image::fuzz_tar(data);
});
