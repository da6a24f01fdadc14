//! The fs-verity ioctl, which rustix has no safe wrapper for: with
//! `sha256x2`'s calls into the CPU's SHA instructions, the crate's only
//! `unsafe`.
//!
//! This module owns the kernel ABI structs and opcodes and nothing else: no
//! policy (whether verity is wanted, what an error means), no paths. Every
//! `unsafe` block here carries a `// SAFETY:` line; the rest of the crate
//! denies `unsafe_code`.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::BorrowedFd;

use rustix::ioctl::{ioctl, opcode, Opcode, Setter};

/// `struct fsverity_enable_arg` from `<linux/fsverity.h>`.
#[repr(C)]
#[derive(Debug)]
struct FsverityEnableArg {
    version: u32,
    hash_algorithm: u32,
    block_size: u32,
    salt_size: u32,
    salt_ptr: u64,
    sig_size: u32,
    reserved1: u32,
    sig_ptr: u64,
    reserved2: [u64; 11],
}

const _: () = assert!(std::mem::size_of::<FsverityEnableArg>() == 128);

/// `FS_IOC_ENABLE_VERITY = _IOW('f', 133, struct fsverity_enable_arg)`.
const FS_IOC_ENABLE_VERITY: Opcode = opcode::write::<FsverityEnableArg>(b'f', 133);

/// `FS_VERITY_HASH_ALG_SHA256`.
const FS_VERITY_HASH_ALG_SHA256: u32 = 1;

/// Asks the kernel to build the Merkle tree of the file behind `fd` (SHA-256,
/// 4096-byte blocks, no salt, no signature) and seal it. `fd` must be open
/// read-only and no writable descriptor of the file may be open anywhere
/// (the kernel answers `ETXTBSY` otherwise).
pub(crate) fn enable_verity(fd: BorrowedFd<'_>) -> io::Result<()> {
    let arg = FsverityEnableArg {
        version: 1,
        hash_algorithm: FS_VERITY_HASH_ALG_SHA256,
        block_size: 4096,
        salt_size: 0,
        salt_ptr: 0,
        sig_size: 0,
        reserved1: 0,
        sig_ptr: 0,
        reserved2: [0; 11],
    };
    // SAFETY: FS_IOC_ENABLE_VERITY is a write ioctl whose argument is a
    // pointer to a `struct fsverity_enable_arg`, which `FsverityEnableArg`
    // mirrors field for field (size checked above); salt and signature sizes
    // are 0 with null pointers, so the kernel reads no other memory.
    unsafe {
        let ctl = Setter::<FS_IOC_ENABLE_VERITY, FsverityEnableArg>::new(arg);
        ioctl(fd, ctl)
    }
    .map_err(io::Error::from)
}

/// `struct fsverity_digest` with room for a SHA-256 digest.
#[repr(C)]
#[derive(Debug)]
struct FsverityDigest {
    digest_algorithm: u16,
    digest_size: u16,
    digest: [u8; 32],
}

/// `FS_IOC_MEASURE_VERITY = _IOWR('f', 134, struct fsverity_digest)`; the
/// struct in the opcode is the 4-byte header, as in the kernel's header.
const FS_IOC_MEASURE_VERITY: Opcode = opcode::read_write::<[u16; 2]>(b'f', 134);

/// The fs-verity digest of the file behind `fd` as the kernel measures it:
/// `Ok(None)` when the file has no fs-verity (`ENODATA`); an error where
/// the filesystem or kernel has none (`EOPNOTSUPP`, `ENOTTY`), or for a
/// digest that is not SHA-256 (`EOVERFLOW`, or another algorithm).
pub(crate) fn measure_verity(fd: BorrowedFd<'_>) -> io::Result<Option<[u8; 32]>> {
    let mut arg = FsverityDigest {
        digest_algorithm: 0,
        digest_size: 32,
        digest: [0; 32],
    };
    // SAFETY: FS_IOC_MEASURE_VERITY reads the 4-byte header (digest_size is
    // the room that follows it) and writes back the header and at most
    // digest_size bytes of digest, all within `arg`, which outlives the call.
    let r = unsafe {
        let ctl = rustix::ioctl::Updater::<FS_IOC_MEASURE_VERITY, FsverityDigest>::new(&mut arg);
        ioctl(fd, ctl)
    };
    match r {
        Ok(()) if arg.digest_algorithm == FS_VERITY_HASH_ALG_SHA256 as u16 => Ok(Some(arg.digest)),
        Ok(()) => Err(io::Error::other(format!(
            "fs-verity digest algorithm {} is not SHA-256",
            arg.digest_algorithm
        ))),
        Err(rustix::io::Errno::NODATA) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn opcode_matches_the_kernel_header() {
        assert_eq!(FS_IOC_ENABLE_VERITY as u64, 0x4080_6685);
        assert_eq!(FS_IOC_MEASURE_VERITY as u64, 0xC004_6686);
    }
}
