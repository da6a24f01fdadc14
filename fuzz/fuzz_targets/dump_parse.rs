//! Any bytes given to the dumpfile parser: errors are fine, panics are bugs.
//! What parses must also write and read back.
#![no_main]

use cairn_erofs::dump::{parse_dump, ParseOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for strict in [true, false] {
        if let Ok(tree) = parse_dump(data, &ParseOptions { strict }) {
            if let Ok(image) = cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default()) {
                let back = cairn_erofs::reader::read_image(&image).expect("reading back our own image");
                let again = cairn_erofs::writer::mkfs_erofs_to_vec(&back, &Default::default())
                    .expect("rewriting a read-back image");
                assert!(again == image, "image changed after read + write");
            }
        }
    }
});
