//! Any bytes given to the dumpfile parser: errors are fine, panics are bugs.
//! What parses must also write and read back.
#![no_main]

use cairn_erofs::dump::{parse_dump, ParseOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for strict in [true, false] {
        if let Ok(tree) = parse_dump(data, &ParseOptions { strict }) {
            if let Ok(image) = cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default()) {
                // The first read-back may lose what the format does not keep
                // (a fifo's declared size, which still decides the inode
                // format, as in mkcomposefs); from then on it is a fixed point.
                let back = cairn_erofs::reader::read_image(&image).expect("reading back our own image");
                let again = cairn_erofs::writer::mkfs_erofs_to_vec(&back, &Default::default())
                    .expect("rewriting a read-back image");
                let back2 = cairn_erofs::reader::read_image(&again).expect("reading back again");
                let third = cairn_erofs::writer::mkfs_erofs_to_vec(&back2, &Default::default())
                    .expect("rewriting again");
                assert!(third == again, "image changed after read + write");
            }
        }
    }
});
