//! Random layered trees applied as image assembly applies layers: errors
//! are fine; a panic, a path outside the root, a malformed tree or a
//! symlink replaced by an entry written through it are bugs (the checks
//! are in `cairn_image::fuzz_apply`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cairn_image::fuzz_apply(data);
});
