//! SHA-256 of two 4096-byte blocks at once, with the x86 SHA extensions:
//! the leaf level of an fs-verity tree, which is most of its cost.
//!
//! Why our own: one SHA-256 stream on a CPU with SHA-NI is bound by the
//! latency of `sha256rnds2` (each pair of rounds waits for the one
//! before), not by the CPU's throughput, so two independent messages
//! whose rounds are issued side by side take little longer than one. The
//! leaves of a Merkle tree are independent messages of one fixed size;
//! the `sha2` crate hashes one message at a time. Linux hashes fs-verity
//! and dm-verity leaves two at a time for the same reason
//! (`sha256_ni_finup2x`). Measured on this project's machines (Intel, SHA-NI,
//! one core): `sha2` 1.24-1.37 GB/s of 4096-byte blocks, this 1.89-1.96
//! GB/s (`docs/store.md`, "fs-verity").
//!
//! What it owns: the compression function for two messages, and the
//! fixed padding of a 4096-byte message. It must never be the only check
//! of itself: the tests compare every output with `sha2`, and
//! [`hash_pair`] returns `None` where the CPU lacks the extensions, so the
//! caller hashes with `sha2` there. The module's `unsafe` is the call into
//! the `#[target_feature]` functions once the features are detected (each
//! with a `// SAFETY:` line); the intrinsics themselves are safe to call
//! inside those functions.
#![allow(unsafe_code)]

/// Size of the messages [`hash_pair`] hashes: fs-verity's block size.
pub(crate) const BLOCK: usize = 4096;

/// The SHA-256 digests of `a` and of `b`, or `None` if this CPU has no SHA
/// extensions (the caller then hashes each with `sha2`).
#[inline]
pub(crate) fn hash_pair(a: &[u8; BLOCK], b: &[u8; BLOCK]) -> Option<([u8; 32], [u8; 32])> {
    #[cfg(target_arch = "x86_64")]
    {
        if x86::available() {
            // SAFETY: `available` has checked that the CPU has every
            // feature `hash_pair` is compiled for (sha, sse2, ssse3,
            // sse4.1); the function reads only its two array arguments.
            return Some(unsafe { x86::hash_pair(a, b) });
        }
    }
    let _ = (a, b);
    None
}

/// Whether [`hash_pair`] hashes on this CPU.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::BLOCK;

    /// Cached by `std`'s feature detection (one `cpuid` per process).
    #[inline]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("sha")
            && std::arch::is_x86_feature_detected!("sse2")
            && std::arch::is_x86_feature_detected!("ssse3")
            && std::arch::is_x86_feature_detected!("sse4.1")
    }

    /// The round constants, four to a group of rounds.
    const K: [[u32; 4]; 16] = [
        [0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5],
        [0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5],
        [0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3],
        [0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174],
        [0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc],
        [0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da],
        [0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7],
        [0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967],
        [0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13],
        [0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85],
        [0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3],
        [0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070],
        [0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5],
        [0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3],
        [0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208],
        [0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2],
    ];

    /// The initial hash value H(0), A to H.
    const H0: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];

    /// The last block of every 4096-byte message: the `0x80` byte, zeros,
    /// and the message's length in bits (32768), big-endian.
    const PAD: [u8; 64] = {
        let mut p = [0u8; 64];
        p[0] = 0x80;
        let bits = ((BLOCK as u64) * 8).to_be_bytes();
        let mut i = 0;
        while i < 8 {
            p[56 + i] = bits[i];
            i += 1;
        }
        p
    };

    /// The eight state words as `sha256rnds2` takes them: A, B, E, F in one
    /// register and C, D, G, H in the other (highest lane first).
    #[derive(Clone, Copy)]
    struct State {
        abef: __m128i,
        cdgh: __m128i,
    }

    #[inline]
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn initial() -> State {
        let h = H0.map(|w| w as i32);
        State {
            abef: _mm_set_epi32(h[0], h[1], h[4], h[5]),
            cdgh: _mm_set_epi32(h[2], h[3], h[6], h[7]),
        }
    }

    #[inline]
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn digest(s: State) -> [u8; 32] {
        let words = [
            _mm_extract_epi32::<3>(s.abef),
            _mm_extract_epi32::<2>(s.abef),
            _mm_extract_epi32::<3>(s.cdgh),
            _mm_extract_epi32::<2>(s.cdgh),
            _mm_extract_epi32::<1>(s.abef),
            _mm_extract_epi32::<0>(s.abef),
            _mm_extract_epi32::<1>(s.cdgh),
            _mm_extract_epi32::<0>(s.cdgh),
        ];
        let mut out = [0u8; 32];
        for (o, w) in out.chunks_exact_mut(4).zip(words) {
            o.copy_from_slice(&(w as u32).to_be_bytes());
        }
        out
    }

    /// Message words `4i..4i+4` of a block, in lanes 0..3, as big-endian
    /// 32-bit words.
    #[inline]
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn words(block: &[u8; 64], i: usize) -> __m128i {
        let w = |j: usize| {
            let at = 16 * i + 4 * j;
            i32::from_be_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
        };
        _mm_set_epi32(w(3), w(2), w(1), w(0))
    }

    /// Rounds `4i..4i+4` of both messages, and the message schedule that
    /// goes with them: the standard SHA-NI sequence, each step issued for
    /// `a` and then for `b` so that the two dependency chains overlap.
    macro_rules! rounds {
        ($a:ident, $wa:ident, $b:ident, $wb:ident, $i:literal) => {{
            let k = _mm_set_epi32(
                K[$i][3] as i32,
                K[$i][2] as i32,
                K[$i][1] as i32,
                K[$i][0] as i32,
            );
            let ma = _mm_add_epi32($wa[$i % 4], k);
            let mb = _mm_add_epi32($wb[$i % 4], k);
            $a.cdgh = _mm_sha256rnds2_epu32($a.cdgh, $a.abef, ma);
            $b.cdgh = _mm_sha256rnds2_epu32($b.cdgh, $b.abef, mb);
            if $i >= 3 && $i <= 14 {
                // W[4(i+1)..] from W[4(i-3)..] (already through msg1),
                // W[4i-3..4i+1] and W[4i..4i+4].
                let ta = _mm_alignr_epi8::<4>($wa[$i % 4], $wa[($i + 3) % 4]);
                let tb = _mm_alignr_epi8::<4>($wb[$i % 4], $wb[($i + 3) % 4]);
                $wa[($i + 1) % 4] =
                    _mm_sha256msg2_epu32(_mm_add_epi32($wa[($i + 1) % 4], ta), $wa[$i % 4]);
                $wb[($i + 1) % 4] =
                    _mm_sha256msg2_epu32(_mm_add_epi32($wb[($i + 1) % 4], tb), $wb[$i % 4]);
            }
            let ma = _mm_shuffle_epi32::<0x0e>(ma);
            let mb = _mm_shuffle_epi32::<0x0e>(mb);
            $a.abef = _mm_sha256rnds2_epu32($a.abef, $a.cdgh, ma);
            $b.abef = _mm_sha256rnds2_epu32($b.abef, $b.cdgh, mb);
            if $i >= 1 && $i <= 12 {
                $wa[($i + 3) % 4] = _mm_sha256msg1_epu32($wa[($i + 3) % 4], $wa[$i % 4]);
                $wb[($i + 3) % 4] = _mm_sha256msg1_epu32($wb[($i + 3) % 4], $wb[$i % 4]);
            }
        }};
    }

    /// One 64-byte block of each message.
    // The lint reads the schedule's updates in the last groups, whose
    // conditions are false, as assignments never read.
    #[allow(unused_assignments)]
    #[inline]
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn compress(a: &mut State, b: &mut State, ba: &[u8; 64], bb: &[u8; 64]) {
        let (a0, b0) = (*a, *b);
        let mut wa = [words(ba, 0), words(ba, 1), words(ba, 2), words(ba, 3)];
        let mut wb = [words(bb, 0), words(bb, 1), words(bb, 2), words(bb, 3)];
        rounds!(a, wa, b, wb, 0);
        rounds!(a, wa, b, wb, 1);
        rounds!(a, wa, b, wb, 2);
        rounds!(a, wa, b, wb, 3);
        rounds!(a, wa, b, wb, 4);
        rounds!(a, wa, b, wb, 5);
        rounds!(a, wa, b, wb, 6);
        rounds!(a, wa, b, wb, 7);
        rounds!(a, wa, b, wb, 8);
        rounds!(a, wa, b, wb, 9);
        rounds!(a, wa, b, wb, 10);
        rounds!(a, wa, b, wb, 11);
        rounds!(a, wa, b, wb, 12);
        rounds!(a, wa, b, wb, 13);
        rounds!(a, wa, b, wb, 14);
        rounds!(a, wa, b, wb, 15);
        a.abef = _mm_add_epi32(a.abef, a0.abef);
        a.cdgh = _mm_add_epi32(a.cdgh, a0.cdgh);
        b.abef = _mm_add_epi32(b.abef, b0.abef);
        b.cdgh = _mm_add_epi32(b.cdgh, b0.cdgh);
    }

    /// # Safety
    /// The CPU must have the features named in `target_feature`
    /// ([`available`]).
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub(super) fn hash_pair(x: &[u8; BLOCK], y: &[u8; BLOCK]) -> ([u8; 32], [u8; 32]) {
        let mut a = initial();
        let mut b = initial();
        for (ca, cb) in x.as_chunks::<64>().0.iter().zip(y.as_chunks::<64>().0) {
            compress(&mut a, &mut b, ca, cb);
        }
        compress(&mut a, &mut b, &PAD, &PAD);
        (digest(a), digest(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn sha2(block: &[u8]) -> [u8; 32] {
        Sha256::digest(block).into()
    }

    /// Every pair of a few thousand pseudo-random blocks, and the blocks
    /// that stress the schedule's carries (all ones, all zeros, one bit),
    /// against `sha2`.
    #[test]
    fn pairs_hash_as_sha2_does() {
        #[cfg(target_arch = "x86_64")]
        assert!(
            available() || !std::arch::is_x86_feature_detected!("sha"),
            "the CPU has SHA extensions but hash_pair does not use them"
        );
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut blocks: Vec<[u8; BLOCK]> = (0..2000)
            .map(|_| {
                let mut b = [0u8; BLOCK];
                for byte in b.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *byte = x as u8;
                }
                b
            })
            .collect();
        blocks.push([0u8; BLOCK]);
        blocks.push([0xffu8; BLOCK]);
        let mut one = [0u8; BLOCK];
        one[BLOCK - 1] = 1;
        blocks.push(one);
        let Some(_) = hash_pair(&blocks[0], &blocks[1]) else {
            // No SHA extensions here: the callers' sha2 path is all there is.
            return;
        };
        for pair in blocks.windows(2) {
            let (ha, hb) = hash_pair(&pair[0], &pair[1]).unwrap();
            assert_eq!(ha, sha2(&pair[0]));
            assert_eq!(hb, sha2(&pair[1]));
        }
        let (ha, hb) = hash_pair(&blocks[5], &blocks[5]).unwrap();
        assert_eq!(ha, hb);
        // The known digest of 4096 zero bytes.
        assert_eq!(
            hex::encode(hash_pair(&[0u8; BLOCK], &[0u8; BLOCK]).unwrap().0),
            "ad7facb2586fc6e966c004d7d1d16b024f5805ff7cb47c7a85dabd8b48892ca7"
        );
    }
}
