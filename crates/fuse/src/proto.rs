//! The subset of the FUSE wire protocol that cairn speaks, defined here from
//! the kernel's uapi header (`include/uapi/linux/fuse.h`, protocol 7.40 and
//! later: the first with passthrough). Every structure is native-endian and
//! laid out as the kernel's C struct; sizes are checked by the unit tests.
//!
//! Parsing is total: [`Request::parse`] turns any byte string into a request
//! or a [`ParseError`] naming what was wrong, never a panic, and reads only
//! within the buffer and within the length the header declares.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

/// The protocol major version we speak.
pub const KERNEL_VERSION: u32 = 7;
/// The oldest minor version with passthrough (`FUSE_PASSTHROUGH`,
/// `backing_id` in `fuse_open_out`, `max_stack_depth` in `fuse_init_out`).
pub const PASSTHROUGH_MINOR: u32 = 40;
/// The minor version we announce (the kernel uses the smaller of its own
/// and ours).
pub const KERNEL_MINOR: u32 = 40;
/// The node id of the root directory.
pub const ROOT_ID: u64 = 1;

/// `struct fuse_in_header`.
pub const IN_HEADER_LEN: usize = 40;
/// `struct fuse_out_header`.
pub const OUT_HEADER_LEN: usize = 16;
/// `struct fuse_attr`.
pub const ATTR_LEN: usize = 88;
/// `struct fuse_entry_out`.
pub const ENTRY_OUT_LEN: usize = 40 + ATTR_LEN;
/// `struct fuse_attr_out`.
pub const ATTR_OUT_LEN: usize = 16 + ATTR_LEN;
/// `struct fuse_init_out` (7.23 and later, 64 bytes).
pub const INIT_OUT_LEN: usize = 64;
/// `struct fuse_open_out`.
pub const OPEN_OUT_LEN: usize = 16;
/// `struct fuse_statfs_out` (`struct fuse_kstatfs`).
pub const STATFS_OUT_LEN: usize = 80;
/// `struct fuse_getxattr_out`.
pub const GETXATTR_OUT_LEN: usize = 8;
/// The header of `struct fuse_dirent` (ino, off, namelen, type).
pub const DIRENT_HEADER_LEN: usize = 24;

/// The longest name a LOOKUP may carry (the kernel's `FUSE_NAME_MAX`).
pub const NAME_MAX: usize = 1024;

/// Opcodes (`enum fuse_opcode`).
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
}

/// `fuse_init_in.flags` / `fuse_init_out.flags` bits (the low 32), and
/// `flags2` bits shifted down by 32.
pub mod init_flags {
    pub const ASYNC_READ: u32 = 1 << 0;
    pub const BIG_WRITES: u32 = 1 << 5;
    pub const WRITEBACK_CACHE: u32 = 1 << 16;
    pub const PARALLEL_DIROPS: u32 = 1 << 18;
    pub const MAX_PAGES: u32 = 1 << 22;
    pub const INIT_EXT: u32 = 1 << 30;
    /// `FUSE_PASSTHROUGH` is bit 37: bit 5 of `flags2`.
    pub const PASSTHROUGH2: u32 = 1 << (37 - 32);
    /// `FUSE_ALLOW_IDMAP` is bit 40: bit 8 of `flags2` (Linux 6.12; with
    /// `default_permissions` the mount may then be idmapped).
    pub const ALLOW_IDMAP2: u32 = 1 << (40 - 32);
}

/// `fuse_open_out.open_flags` bits.
pub mod open_flags {
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// A malformed message from the kernel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("message of {got} bytes is shorter than the {need}-byte header")]
    ShortHeader { got: usize, need: usize },
    #[error("header declares {declared} bytes but {got} were read")]
    LengthMismatch { declared: usize, got: usize },
    #[error("opcode {opcode}: body of {got} bytes, {need} needed")]
    ShortBody {
        opcode: u32,
        got: usize,
        need: usize,
    },
    #[error("opcode {opcode}: name is not NUL-terminated within its body")]
    Unterminated { opcode: u32 },
    #[error("opcode {opcode}: name of {len} bytes is longer than {max}")]
    NameTooLong { opcode: u32, len: usize, max: usize },
    #[error("BATCH_FORGET announces {count} entries but carries room for {room}")]
    BatchForgetCount { count: u32, room: usize },
}

/// `struct fuse_in_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
}

/// `struct fuse_init_in` (the part we use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `flags | flags2 << 32` (flags2 only when the kernel set INIT_EXT).
    pub flags: u64,
}

/// One request from the kernel, its body parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op<'a> {
    Init(InitIn),
    Lookup {
        name: &'a OsStr,
    },
    Forget {
        nlookup: u64,
    },
    BatchForget(Vec<(u64, u64)>),
    Getattr,
    Open {
        flags: u32,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Release {
        fh: u64,
    },
    Opendir,
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Releasedir {
        fh: u64,
    },
    Getxattr {
        size: u32,
    },
    Listxattr {
        size: u32,
    },
    Statfs,
    Access {
        mask: u32,
    },
    Flush,
    Interrupt {
        unique: u64,
    },
    Destroy,
    /// Anything else: answered ENOSYS.
    Other,
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    pub header: InHeader,
    pub op: Op<'a>,
}

/// A bounds-checked reader over a body.
struct Body<'a> {
    opcode: u32,
    buf: &'a [u8],
}

impl<'a> Body<'a> {
    fn need(&self, n: usize) -> Result<(), ParseError> {
        if self.buf.len() < n {
            Err(ParseError::ShortBody {
                opcode: self.opcode,
                got: self.buf.len(),
                need: n,
            })
        } else {
            Ok(())
        }
    }

    fn u32_at(&self, off: usize) -> Result<u32, ParseError> {
        self.need(off + 4)?;
        Ok(u32::from_ne_bytes(
            self.buf[off..off + 4].try_into().expect("4 bytes"),
        ))
    }

    fn u64_at(&self, off: usize) -> Result<u64, ParseError> {
        self.need(off + 8)?;
        Ok(u64::from_ne_bytes(
            self.buf[off..off + 8].try_into().expect("8 bytes"),
        ))
    }

    /// A NUL-terminated name starting at `off`.
    fn name_at(&self, off: usize) -> Result<&'a OsStr, ParseError> {
        self.need(off + 1)?;
        let rest = &self.buf[off..];
        let end = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(ParseError::Unterminated {
                opcode: self.opcode,
            })?;
        if end > NAME_MAX {
            return Err(ParseError::NameTooLong {
                opcode: self.opcode,
                len: end,
                max: NAME_MAX,
            });
        }
        Ok(OsStr::from_bytes(&rest[..end]))
    }
}

fn ne_u32(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn ne_u64(b: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

impl InHeader {
    /// Parses the header and checks that the message is exactly as long as
    /// it declares.
    pub fn parse(msg: &[u8]) -> Result<InHeader, ParseError> {
        if msg.len() < IN_HEADER_LEN {
            return Err(ParseError::ShortHeader {
                got: msg.len(),
                need: IN_HEADER_LEN,
            });
        }
        let h = InHeader {
            len: ne_u32(msg, 0),
            opcode: ne_u32(msg, 4),
            unique: ne_u64(msg, 8),
            nodeid: ne_u64(msg, 16),
            uid: ne_u32(msg, 24),
            gid: ne_u32(msg, 28),
            pid: ne_u32(msg, 32),
            total_extlen: u16::from_ne_bytes([msg[36], msg[37]]),
        };
        if h.len as usize != msg.len() {
            return Err(ParseError::LengthMismatch {
                declared: h.len as usize,
                got: msg.len(),
            });
        }
        Ok(h)
    }
}

impl<'a> Request<'a> {
    /// Parses one message as read from `/dev/fuse` (one `read(2)` returns
    /// exactly one message).
    pub fn parse(msg: &'a [u8]) -> Result<Request<'a>, ParseError> {
        use opcode::*;
        let header = InHeader::parse(msg)?;
        // Extensions (security context, supplementary groups) follow the
        // body; their length is in 8-byte units. We ask for none, but cut
        // them off if the kernel sends any.
        let ext = header.total_extlen as usize * 8;
        let body_len = (msg.len() - IN_HEADER_LEN).saturating_sub(ext);
        let b = Body {
            opcode: header.opcode,
            buf: &msg[IN_HEADER_LEN..IN_HEADER_LEN + body_len],
        };
        let op = match header.opcode {
            INIT => {
                // major, minor, max_readahead, flags; flags2 after them
                // from 7.36 (only meaningful with INIT_EXT).
                let major = b.u32_at(0)?;
                let minor = b.u32_at(4)?;
                let max_readahead = b.u32_at(8)?;
                let flags = b.u32_at(12)?;
                let mut all = flags as u64;
                if flags & init_flags::INIT_EXT != 0 {
                    all |= (b.u32_at(16)? as u64) << 32;
                }
                Op::Init(InitIn {
                    major,
                    minor,
                    max_readahead,
                    flags: all,
                })
            }
            LOOKUP => Op::Lookup {
                name: b.name_at(0)?,
            },
            FORGET => Op::Forget {
                nlookup: b.u64_at(0)?,
            },
            BATCH_FORGET => {
                b.need(8)?;
                let count = b.u32_at(0)?;
                let room = (b.buf.len() - 8) / 16;
                if count as usize > room {
                    return Err(ParseError::BatchForgetCount { count, room });
                }
                let mut v = Vec::with_capacity(count as usize);
                for i in 0..count as usize {
                    let off = 8 + i * 16;
                    v.push((b.u64_at(off)?, b.u64_at(off + 8)?));
                }
                Op::BatchForget(v)
            }
            GETATTR => {
                // fuse_getattr_in: getattr_flags, dummy, fh (checked, unused).
                b.need(16)?;
                Op::Getattr
            }
            OPEN => Op::Open {
                flags: b.u32_at(0)?,
            },
            OPENDIR => {
                b.need(8)?;
                Op::Opendir
            }
            READ | READDIR => {
                // fuse_read_in: fh, offset, size, read_flags, lock_owner,
                // flags, padding (40 bytes).
                b.need(40)?;
                let (fh, offset, size) = (b.u64_at(0)?, b.u64_at(8)?, b.u32_at(16)?);
                if header.opcode == READ {
                    Op::Read { fh, offset, size }
                } else {
                    Op::Readdir { fh, offset, size }
                }
            }
            RELEASE | RELEASEDIR => {
                // fuse_release_in: fh, flags, release_flags, lock_owner.
                b.need(24)?;
                let fh = b.u64_at(0)?;
                if header.opcode == RELEASE {
                    Op::Release { fh }
                } else {
                    Op::Releasedir { fh }
                }
            }
            GETXATTR => {
                // fuse_getxattr_in: size, padding; then the name.
                let size = b.u32_at(0)?;
                b.name_at(8)?;
                Op::Getxattr { size }
            }
            LISTXATTR => Op::Listxattr { size: b.u32_at(0)? },
            STATFS => Op::Statfs,
            ACCESS => Op::Access { mask: b.u32_at(0)? },
            FLUSH => {
                b.need(24)?;
                Op::Flush
            }
            INTERRUPT => Op::Interrupt {
                unique: b.u64_at(0)?,
            },
            DESTROY => Op::Destroy,
            _ => Op::Other,
        };
        Ok(Request { header, op })
    }
}

/// `struct fuse_attr`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub mtime: u64,
    pub mode: u32,
    pub nlink: u32,
    pub blksize: u32,
}

impl Attr {
    fn write(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&self.ino.to_ne_bytes());
        out.extend_from_slice(&self.size.to_ne_bytes());
        out.extend_from_slice(&self.blocks.to_ne_bytes());
        // atime, mtime, ctime (seconds), then their nanoseconds.
        for _ in 0..3 {
            out.extend_from_slice(&self.mtime.to_ne_bytes());
        }
        for _ in 0..3 {
            out.extend_from_slice(&0u32.to_ne_bytes());
        }
        out.extend_from_slice(&self.mode.to_ne_bytes());
        out.extend_from_slice(&self.nlink.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes()); // uid
        out.extend_from_slice(&0u32.to_ne_bytes()); // gid
        out.extend_from_slice(&0u32.to_ne_bytes()); // rdev
        out.extend_from_slice(&self.blksize.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes()); // flags
        debug_assert_eq!(out.len() - start, ATTR_LEN);
    }
}

/// Builds replies: a header followed by a body, written with one `write(2)`.
#[derive(Debug)]
pub struct Reply {
    buf: Vec<u8>,
}

impl Reply {
    /// A successful reply to `unique`, body to follow.
    pub fn ok(unique: u64) -> Reply {
        let mut buf = Vec::with_capacity(OUT_HEADER_LEN + ENTRY_OUT_LEN);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&0i32.to_ne_bytes());
        buf.extend_from_slice(&unique.to_ne_bytes());
        Reply { buf }
    }

    /// An error reply (`errno` positive, as in `libc::ENOENT`).
    pub fn error(unique: u64, errno: i32) -> Reply {
        let mut r = Reply::ok(unique);
        r.buf[4..8].copy_from_slice(&(-errno).to_ne_bytes());
        r
    }

    /// The finished message, its length filled in.
    pub fn finish(mut self) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }

    pub fn bytes(mut self, data: &[u8]) -> Reply {
        self.buf.extend_from_slice(data);
        self
    }

    /// `struct fuse_entry_out`.
    pub fn entry(mut self, nodeid: u64, valid_secs: u64, attr: &Attr) -> Reply {
        let b = &mut self.buf;
        b.extend_from_slice(&nodeid.to_ne_bytes());
        b.extend_from_slice(&0u64.to_ne_bytes()); // generation
        b.extend_from_slice(&valid_secs.to_ne_bytes()); // entry_valid
        b.extend_from_slice(&valid_secs.to_ne_bytes()); // attr_valid
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        attr.write(b);
        self
    }

    /// `struct fuse_attr_out`.
    pub fn attr(mut self, valid_secs: u64, attr: &Attr) -> Reply {
        let b = &mut self.buf;
        b.extend_from_slice(&valid_secs.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        attr.write(b);
        self
    }

    /// `struct fuse_open_out`.
    pub fn open(mut self, fh: u64, flags: u32, backing_id: i32) -> Reply {
        let b = &mut self.buf;
        b.extend_from_slice(&fh.to_ne_bytes());
        b.extend_from_slice(&flags.to_ne_bytes());
        b.extend_from_slice(&backing_id.to_ne_bytes());
        self
    }

    /// `struct fuse_init_out`.
    pub fn init(mut self, init: &InitOut) -> Reply {
        let b = &mut self.buf;
        let start = b.len();
        b.extend_from_slice(&init.major.to_ne_bytes());
        b.extend_from_slice(&init.minor.to_ne_bytes());
        b.extend_from_slice(&init.max_readahead.to_ne_bytes());
        b.extend_from_slice(&(init.flags as u32).to_ne_bytes());
        b.extend_from_slice(&init.max_background.to_ne_bytes());
        b.extend_from_slice(&init.congestion_threshold.to_ne_bytes());
        b.extend_from_slice(&init.max_write.to_ne_bytes());
        b.extend_from_slice(&1u32.to_ne_bytes()); // time_gran: 1 ns
        b.extend_from_slice(&init.max_pages.to_ne_bytes());
        b.extend_from_slice(&0u16.to_ne_bytes()); // map_alignment
        b.extend_from_slice(&((init.flags >> 32) as u32).to_ne_bytes());
        b.extend_from_slice(&init.max_stack_depth.to_ne_bytes());
        b.resize(start + INIT_OUT_LEN, 0);
        self
    }

    /// `struct fuse_kstatfs`.
    pub fn statfs(mut self, blocks: u64, files: u64, bsize: u32, namelen: u32) -> Reply {
        let b = &mut self.buf;
        let start = b.len();
        b.extend_from_slice(&blocks.to_ne_bytes());
        b.extend_from_slice(&0u64.to_ne_bytes()); // bfree
        b.extend_from_slice(&0u64.to_ne_bytes()); // bavail
        b.extend_from_slice(&files.to_ne_bytes());
        b.extend_from_slice(&0u64.to_ne_bytes()); // ffree
        b.extend_from_slice(&bsize.to_ne_bytes());
        b.extend_from_slice(&namelen.to_ne_bytes());
        b.extend_from_slice(&bsize.to_ne_bytes()); // frsize
        b.resize(start + STATFS_OUT_LEN, 0);
        self
    }

    /// `struct fuse_getxattr_out` (the size an xattr value or list needs).
    pub fn xattr_size(mut self, size: u32) -> Reply {
        self.buf.extend_from_slice(&size.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self
    }

    /// Appends one `struct fuse_dirent` if it fits in `max` bytes of body;
    /// returns false (and appends nothing) if not.
    pub fn dirent(&mut self, max: usize, ino: u64, off: u64, typ: u32, name: &[u8]) -> bool {
        let len = (DIRENT_HEADER_LEN + name.len()).next_multiple_of(8);
        if self.buf.len() - OUT_HEADER_LEN + len > max {
            return false;
        }
        let b = &mut self.buf;
        let start = b.len();
        b.extend_from_slice(&ino.to_ne_bytes());
        b.extend_from_slice(&off.to_ne_bytes());
        b.extend_from_slice(&(name.len() as u32).to_ne_bytes());
        b.extend_from_slice(&typ.to_ne_bytes());
        b.extend_from_slice(name);
        b.resize(start + len, 0);
        true
    }
}

/// What we answer to INIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `flags | flags2 << 32`.
    pub flags: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub max_pages: u16,
    pub max_stack_depth: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((IN_HEADER_LEN + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&opcode.to_ne_bytes());
        m.extend_from_slice(&unique.to_ne_bytes());
        m.extend_from_slice(&nodeid.to_ne_bytes());
        m.extend_from_slice(&[0u8; 16]); // uid gid pid extlen padding
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn lookup_parses() {
        let m = msg(opcode::LOOKUP, 7, 3, b"ab\0");
        let r = Request::parse(&m).unwrap();
        assert_eq!(r.header.unique, 7);
        assert_eq!(r.header.nodeid, 3);
        assert_eq!(
            r.op,
            Op::Lookup {
                name: OsStr::new("ab")
            }
        );
    }

    #[test]
    fn short_header_is_an_error() {
        for n in 0..IN_HEADER_LEN {
            let m = vec![0u8; n];
            assert!(matches!(
                Request::parse(&m),
                Err(ParseError::ShortHeader { .. })
            ));
        }
    }

    #[test]
    fn declared_length_must_match() {
        let mut m = msg(opcode::GETATTR, 1, 1, &[0u8; 16]);
        m[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(matches!(
            Request::parse(&m),
            Err(ParseError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn unterminated_and_long_names_are_errors() {
        let m = msg(opcode::LOOKUP, 1, 1, b"abc");
        assert_eq!(
            Request::parse(&m),
            Err(ParseError::Unterminated {
                opcode: opcode::LOOKUP
            })
        );
        let mut long = vec![b'a'; NAME_MAX + 1];
        long.push(0);
        let m = msg(opcode::LOOKUP, 1, 1, &long);
        assert!(matches!(
            Request::parse(&m),
            Err(ParseError::NameTooLong { .. })
        ));
        let m = msg(opcode::LOOKUP, 1, 1, b"");
        assert!(matches!(
            Request::parse(&m),
            Err(ParseError::ShortBody { .. })
        ));
    }

    #[test]
    fn short_bodies_are_errors() {
        use opcode::*;
        let needs = [
            (INIT, 16),
            (FORGET, 8),
            (BATCH_FORGET, 8),
            (GETATTR, 16),
            (OPEN, 4),
            (OPENDIR, 8),
            (READ, 40),
            (READDIR, 40),
            (RELEASE, 24),
            (RELEASEDIR, 24),
            (GETXATTR, 9),
            (LISTXATTR, 4),
            (ACCESS, 4),
            (FLUSH, 24),
            (INTERRUPT, 8),
        ];
        for (op, need) in needs {
            for n in 0..need {
                let m = msg(op, 1, 1, &vec![1u8; n]);
                assert!(
                    Request::parse(&m).is_err(),
                    "opcode {op} with a {n}-byte body parsed"
                );
            }
        }
    }

    #[test]
    fn batch_forget_count_is_bounded_by_the_body() {
        let mut body = Vec::new();
        body.extend_from_slice(&3u32.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        for i in 0..2u64 {
            body.extend_from_slice(&(10 + i).to_ne_bytes());
            body.extend_from_slice(&1u64.to_ne_bytes());
        }
        let m = msg(opcode::BATCH_FORGET, 1, 0, &body);
        assert_eq!(
            Request::parse(&m),
            Err(ParseError::BatchForgetCount { count: 3, room: 2 })
        );
        body[0..4].copy_from_slice(&2u32.to_ne_bytes());
        let m = msg(opcode::BATCH_FORGET, 1, 0, &body);
        assert_eq!(
            Request::parse(&m).unwrap().op,
            Op::BatchForget(vec![(10, 1), (11, 1)])
        );
    }

    #[test]
    fn init_reads_flags2_only_with_init_ext() {
        let mut body = vec![0u8; 64];
        body[0..4].copy_from_slice(&7u32.to_ne_bytes());
        body[4..8].copy_from_slice(&41u32.to_ne_bytes());
        body[12..16].copy_from_slice(&init_flags::INIT_EXT.to_ne_bytes());
        body[16..20].copy_from_slice(&init_flags::PASSTHROUGH2.to_ne_bytes());
        let m = msg(opcode::INIT, 1, 0, &body);
        let Op::Init(init) = Request::parse(&m).unwrap().op else {
            panic!("not INIT")
        };
        assert_eq!(init.minor, 41);
        assert_ne!(init.flags & (1 << 37), 0);
        body[12..16].copy_from_slice(&0u32.to_ne_bytes());
        let m = msg(opcode::INIT, 1, 0, &body);
        let Op::Init(init) = Request::parse(&m).unwrap().op else {
            panic!("not INIT")
        };
        assert_eq!(init.flags, 0);
    }

    #[test]
    fn unknown_opcodes_parse_as_other() {
        let m = msg(9999, 1, 1, &[]);
        assert_eq!(Request::parse(&m).unwrap().op, Op::Other);
    }

    #[test]
    fn garbage_never_panics() {
        // A cheap deterministic generator: every opcode we know, with
        // random lengths and contents, and random headers.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let op = (next() % 60) as u32;
            let n = (next() % 96) as usize;
            let body: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            let mut m = msg(op, 1, 1, &body);
            if next() % 8 == 0 {
                m[36..38].copy_from_slice(&((next() % 64) as u16).to_ne_bytes());
            }
            if next() % 4 == 0 {
                let cut = (next() as usize) % (m.len() + 1);
                m.truncate(cut);
                // Mostly keep the declared length honest, so that the body
                // parsers (not only the header check) see short bodies.
                if cut >= 4 && next() % 2 == 0 {
                    m[0..4].copy_from_slice(&(cut as u32).to_ne_bytes());
                }
            }
            let _ = Request::parse(&m);
        }
    }

    #[test]
    fn reply_sizes_match_the_kernel_structs() {
        let a = Attr::default();
        let r = Reply::ok(1).entry(2, 1, &a).finish();
        assert_eq!(r.len(), OUT_HEADER_LEN + ENTRY_OUT_LEN);
        assert_eq!(ENTRY_OUT_LEN, 128);
        let r = Reply::ok(1).attr(1, &a).finish();
        assert_eq!(r.len(), OUT_HEADER_LEN + ATTR_OUT_LEN);
        assert_eq!(ATTR_OUT_LEN, 104);
        let r = Reply::ok(1).open(1, 0, 5).finish();
        assert_eq!(r.len(), OUT_HEADER_LEN + OPEN_OUT_LEN);
        let init = InitOut {
            major: 7,
            minor: 40,
            max_readahead: 0,
            flags: 1 << 37,
            max_background: 16,
            congestion_threshold: 12,
            max_write: 4096,
            max_pages: 32,
            max_stack_depth: 1,
        };
        let r = Reply::ok(1).init(&init).finish();
        assert_eq!(r.len(), OUT_HEADER_LEN + INIT_OUT_LEN);
        // flags2 at offset 32 of the body, max_stack_depth at 36.
        assert_eq!(ne_u32(&r, OUT_HEADER_LEN + 32), 1 << 5);
        assert_eq!(ne_u32(&r, OUT_HEADER_LEN + 36), 1);
        let r = Reply::ok(1).statfs(1, 1, 4096, 255).finish();
        assert_eq!(r.len(), OUT_HEADER_LEN + STATFS_OUT_LEN);
        let r = Reply::error(9, libc::ENOENT).finish();
        assert_eq!(r.len(), OUT_HEADER_LEN);
        assert_eq!(
            i32::from_ne_bytes(r[4..8].try_into().unwrap()),
            -libc::ENOENT
        );
        assert_eq!(ne_u32(&r, 0), OUT_HEADER_LEN as u32);
    }

    #[test]
    fn dirents_are_padded_and_bounded() {
        let mut r = Reply::ok(1);
        assert!(r.dirent(64, 1, 1, 4, b"."));
        assert!(r.dirent(64, 1, 2, 4, b".."));
        // 2 × 32 bytes fill 64.
        assert!(!r.dirent(64, 2, 3, 4, b"00"));
        assert_eq!(r.finish().len(), OUT_HEADER_LEN + 64);
    }
}
