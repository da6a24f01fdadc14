//! Any bytes given to the EROFS reader: errors are fine, panics are bugs.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(tree) = cairn_erofs::reader::read_image(data) {
        // Whatever the reader accepts, the writer and the dump printer handle.
        let _ = cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default());
        let mut out = Vec::new();
        let _ = cairn_erofs::dump::print_dump(&tree, &mut out);
    }
});
