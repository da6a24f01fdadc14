//! EROFS on-disk structures and constants, as the kernel's `erofs_fs.h`
//! defines them, plus the composefs header that precedes the superblock.
//!
//! Field names follow the kernel header. Every struct is `repr(C)` over
//! little-endian zerocopy integers, so byte order lives in the type and
//! there is no padding; the sizes are asserted at compile time. This module
//! holds no logic and does no I/O.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// log2 of the block size cairn writes (4096, as composefs does).
pub const BLKSIZ_BITS: u8 = 12;
pub const BLKSIZ: u64 = 1 << BLKSIZ_BITS;
/// Inodes are addressed in 32-byte slots.
pub const ISLOTBITS: u8 = 5;
pub const SLOTSIZE: u64 = 1 << ISLOTBITS;

/// The superblock lives at byte 1024.
pub const SUPER_OFFSET: u64 = 1024;
pub const SUPER_MAGIC_V1: u32 = 0xE0F5_E1E2;

pub const FEATURE_COMPAT_SB_CHKSUM: u32 = 0x0000_0001;
pub const FEATURE_COMPAT_MTIME: u32 = 0x0000_0002;
pub const FEATURE_COMPAT_XATTR_FILTER: u32 = 0x0000_0004;

/// Incompat features a reader of composefs images may meet; all else is refused.
pub const FEATURE_INCOMPAT_CHUNKED_FILE: u32 = 0x0000_0004;
pub const FEATURE_INCOMPAT_DEVICE_TABLE: u32 = 0x0000_0008;

/// Bit positions inside `i_format`.
pub const I_VERSION_BIT: u16 = 0;
pub const I_VERSION_MASK: u16 = 0x01;
pub const I_DATALAYOUT_BIT: u16 = 1;
pub const I_DATALAYOUT_MASK: u16 = 0x07;

/// Data layouts (`i_format >> I_DATALAYOUT_BIT`).
pub const INODE_FLAT_PLAIN: u16 = 0;
pub const INODE_COMPRESSED_FULL: u16 = 1;
pub const INODE_FLAT_INLINE: u16 = 2;
pub const INODE_COMPRESSED_COMPACT: u16 = 3;
pub const INODE_CHUNK_BASED: u16 = 4;

/// Chunk-based inodes: `i_u.c.format` low bits are log2(chunk size) - BLKSIZ_BITS.
pub const CHUNK_FORMAT_BLKBITS_MASK: u16 = 0x001F;
pub const CHUNK_FORMAT_INDEXES: u16 = 0x0020;
/// A chunk index entry that points nowhere (a hole).
pub const NULL_ADDR: u32 = 0xFFFF_FFFF;

/// Directory entry file types.
pub const FT_UNKNOWN: u8 = 0;
pub const FT_REG_FILE: u8 = 1;
pub const FT_DIR: u8 = 2;
pub const FT_CHRDEV: u8 = 3;
pub const FT_BLKDEV: u8 = 4;
pub const FT_FIFO: u8 = 5;
pub const FT_SOCK: u8 = 6;
pub const FT_SYMLINK: u8 = 7;

/// Xattr name indexes: the prefix each one stands for.
pub const XATTR_INDEX_USER: u8 = 1;
pub const XATTR_INDEX_POSIX_ACL_ACCESS: u8 = 2;
pub const XATTR_INDEX_POSIX_ACL_DEFAULT: u8 = 3;
pub const XATTR_INDEX_TRUSTED: u8 = 4;
pub const XATTR_INDEX_LUSTRE: u8 = 5;
pub const XATTR_INDEX_SECURITY: u8 = 6;
/// An index with this bit refers to a long prefix table entry (not written here).
pub const XATTR_LONG_PREFIX: u8 = 0x80;

/// The prefix of each name index, by index (0 = no prefix).
pub const XATTR_PREFIXES: [&[u8]; 7] = [
    b"",
    b"user.",
    b"system.posix_acl_access",
    b"system.posix_acl_default",
    b"trusted.",
    b"lustre.",
    b"security.",
];

/// Xattr bloom filter in the inode's xattr header.
pub const XATTR_FILTER_BITS: u32 = 32;
pub const XATTR_FILTER_DEFAULT: u32 = 0xFFFF_FFFF;
pub const XATTR_FILTER_SEED: u32 = 0x25BB_E08F;

/// composefs header at byte 0 of the image.
pub const COMPOSEFS_MAGIC: u32 = 0xD078_629A;
pub const COMPOSEFS_HEADER_VERSION: u32 = 1;
pub const COMPOSEFS_FLAGS_HAS_ACL: u32 = 1 << 0;

#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ComposefsHeader {
    pub magic: U32,
    pub version: U32,
    pub flags: U32,
    pub composefs_version: U32,
    pub unused: [U32; 4],
}

#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct SuperBlock {
    pub magic: U32,
    pub checksum: U32,
    pub feature_compat: U32,
    pub blkszbits: u8,
    pub sb_extslots: u8,
    pub root_nid: U16,
    pub inos: U64,
    pub build_time: U64,
    pub build_time_nsec: U32,
    pub blocks: U32,
    pub meta_blkaddr: U32,
    pub xattr_blkaddr: U32,
    pub uuid: [u8; 16],
    pub volume_name: [u8; 16],
    pub feature_incompat: U32,
    pub available_compr_algs: U16,
    pub extra_devices: U16,
    pub devt_slotoff: U16,
    pub dirblkbits: u8,
    pub xattr_prefix_count: u8,
    pub xattr_prefix_start: U32,
    pub packed_nid: U64,
    pub xattr_filter_reserved: u8,
    pub reserved2: [u8; 23],
}

/// 32-byte inode: mtime is the superblock's build time.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct InodeCompact {
    pub i_format: U16,
    pub i_xattr_icount: U16,
    pub i_mode: U16,
    pub i_nlink: U16,
    pub i_size: U32,
    pub i_reserved: U32,
    /// raw_blkaddr, rdev, or chunk info (format in the low 16 bits).
    pub i_u: U32,
    pub i_ino: U32,
    pub i_uid: U16,
    pub i_gid: U16,
    pub i_reserved2: U32,
}

/// 64-byte inode with 32-bit ids, 64-bit size and its own mtime.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct InodeExtended {
    pub i_format: U16,
    pub i_xattr_icount: U16,
    pub i_mode: U16,
    pub i_reserved: U16,
    pub i_size: U64,
    pub i_u: U32,
    pub i_ino: U32,
    pub i_uid: U32,
    pub i_gid: U32,
    pub i_mtime: U64,
    pub i_mtime_nsec: U32,
    pub i_nlink: U32,
    pub i_reserved2: [u8; 16],
}

/// Header of an inode's inline xattr area, followed by `h_shared_count`
/// 32-bit shared xattr indexes and then the inline entries.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct XattrIbodyHeader {
    pub h_name_filter: U32,
    pub h_shared_count: u8,
    pub h_reserved2: [u8; 7],
}

/// One xattr: this header, then the name suffix, then the value, padded to 4.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct XattrEntry {
    pub e_name_len: u8,
    pub e_name_index: u8,
    pub e_value_size: U16,
}

/// Directory entry; the names follow all entries of a block.
#[derive(Debug, Default, Clone, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Dirent {
    pub nid: U64,
    pub nameoff: U16,
    pub file_type: u8,
    pub reserved: u8,
}

const _: () = assert!(size_of::<ComposefsHeader>() == 32);
const _: () = assert!(size_of::<SuperBlock>() == 128);
const _: () = assert!(size_of::<InodeCompact>() == 32);
const _: () = assert!(size_of::<InodeExtended>() == 64);
const _: () = assert!(size_of::<XattrIbodyHeader>() == 12);
const _: () = assert!(size_of::<XattrEntry>() == 4);
const _: () = assert!(size_of::<Dirent>() == 12);

/// Size in bytes of an inode's xattr area for a given `i_xattr_icount`.
pub fn xattr_ibody_size(icount: u16) -> usize {
    if icount == 0 {
        0
    } else {
        size_of::<XattrIbodyHeader>() + (usize::from(icount) - 1) * 4
    }
}

/// The kernel's xxh32, used for the xattr name bloom filter.
pub fn xxh32(input: &[u8], seed: u32) -> u32 {
    const P1: u32 = 2_654_435_761;
    const P2: u32 = 2_246_822_519;
    const P3: u32 = 3_266_489_917;
    const P4: u32 = 668_265_263;
    const P5: u32 = 374_761_393;
    fn round(acc: u32, lane: u32) -> u32 {
        acc.wrapping_add(lane.wrapping_mul(P2))
            .rotate_left(13)
            .wrapping_mul(P1)
    }
    fn le32(b: &[u8]) -> u32 {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    let len = input.len();
    let mut rest = input;
    let mut h = if len >= 16 {
        let mut v = [
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        ];
        while rest.len() >= 16 {
            for (i, lane) in v.iter_mut().enumerate() {
                *lane = round(*lane, le32(&rest[i * 4..]));
            }
            rest = &rest[16..];
        }
        v[0].rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18))
    } else {
        seed.wrapping_add(P5)
    };
    h = h.wrapping_add(len as u32);
    while rest.len() >= 4 {
        h = h
            .wrapping_add(le32(rest).wrapping_mul(P3))
            .rotate_left(17)
            .wrapping_mul(P4);
        rest = &rest[4..];
    }
    for &b in rest {
        h = h
            .wrapping_add(u32::from(b).wrapping_mul(P5))
            .rotate_left(11)
            .wrapping_mul(P1);
    }
    h ^= h >> 15;
    h = h.wrapping_mul(P2);
    h ^= h >> 13;
    h = h.wrapping_mul(P3);
    h ^= h >> 16;
    h
}

/// Splits an xattr name into its EROFS name index and the remaining suffix.
pub fn xattr_name_index(name: &[u8]) -> (u8, &[u8]) {
    const ORDER: [u8; 5] = [
        XATTR_INDEX_USER,
        XATTR_INDEX_POSIX_ACL_ACCESS,
        XATTR_INDEX_POSIX_ACL_DEFAULT,
        XATTR_INDEX_TRUSTED,
        XATTR_INDEX_SECURITY,
    ];
    for idx in ORDER {
        let prefix = XATTR_PREFIXES[usize::from(idx)];
        if let Some(rest) = name.strip_prefix(prefix) {
            return (idx, rest);
        }
    }
    (0, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh32_known_values() {
        // Reference values of xxHash32 (seed 0) from the xxHash project.
        assert_eq!(xxh32(b"", 0), 0x02CC_5D05);
        assert_eq!(xxh32(b"a", 0), 0x550D_7456);
        assert_eq!(xxh32(b"abc", 0), 0x32D1_53FF);
        assert_eq!(
            xxh32(b"Nobody inspects the spammish repetition", 0),
            0xE229_3B2F
        );
    }

    #[test]
    fn xattr_prefixes_split() {
        assert_eq!(xattr_name_index(b"user.foo"), (1, &b"foo"[..]));
        assert_eq!(xattr_name_index(b"system.posix_acl_access"), (2, &b""[..]));
        assert_eq!(
            xattr_name_index(b"trusted.overlay.x"),
            (4, &b"overlay.x"[..])
        );
        assert_eq!(xattr_name_index(b"security.selinux"), (6, &b"selinux"[..]));
        assert_eq!(xattr_name_index(b"system.other"), (0, &b"system.other"[..]));
    }
}
