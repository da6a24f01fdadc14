//! The crate's only `unsafe`: the fs-verity ioctl, which rustix has no safe
//! wrapper for.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn opcode_matches_the_kernel_header() {
        assert_eq!(FS_IOC_ENABLE_VERITY as u64, 0x4080_6685);
    }
}
