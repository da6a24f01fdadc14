//! The lazy-image artifact's untrusted inputs: the object index (binary),
//! the artifact manifest and a referrers index (JSON), the prefetch list
//! (v1 and v2, and a prefetch file's line). None may panic or
//! take unbounded time or memory; a parsed index keeps every frame inside
//! its pack.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = cairn_remote::index::Index::parse(data.to_vec()) {
        for e in index.entries() {
            for f in &e.frames {
                assert!(f.offset + f.compressed <= index.packs()[f.pack as usize]);
            }
            assert_eq!(index.size(&e.id), Some(e.size));
        }
    }
    let _ = cairn_remote::artifact::parse(data, "fuzz");
    let _ = cairn_remote::artifact::artifacts_in(data, "fuzz");
    let _ = cairn_remote::artifact::unzstd(data, 1 << 20, "fuzz");
    let _ = cairn_remote::artifact::unzstd_exact(data, 4096);
    for mt in [
        "application/vnd.cairn.lazy.v1.prefetch",
        "application/vnd.cairn.lazy.v2.prefetch",
    ] {
        if let Ok(entries) = cairn_remote::prefetch::parse(mt, data, "fuzz") {
            for e in &entries {
                if let Some(c) = &e.chunks {
                    assert!(c.windows(2).all(|w| w[0] < w[1]));
                }
            }
        }
    }
    let _ = cairn_remote::push::parse_prefetch_line(data);
});
