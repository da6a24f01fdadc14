//! A streaming reader of tar archives as OCI layers use them, with explicit
//! limits.
//!
//! It reads POSIX ustar and pax (`x` extended headers, with `path`,
//! `linkpath`, `size`, `uid`, `gid`, `mtime` with nanoseconds,
//! `SCHILY.xattr.*`), GNU tar (long names `L`, long
//! link names `K`, base-256 numbers, old sparse files `S`), the three GNU pax
//! sparse formats (0.0, 0.1 and 1.0) and old v7 archives. Global pax headers
//! (`g`) are checked and ignored, as containerd does. Entry types other than
//! files, hardlinks, symlinks, devices, directories and fifos are an error
//! (containerd rejects them too).
//!
//! Nothing is held in memory but one entry's metadata: extension headers are
//! capped ([`TarLimits::max_pax_header`]) before they are read, and file
//! data is handed to the caller as it streams ([`TarReader::copy_data`]).
//! Every error says where in the stream it happened and, once known, which
//! entry. This module knows nothing about layers, whiteouts or the store.
//!
//! # Bounded work
//!
//! The input is untrusted, so every field has a limit and the work of
//! reading a stream is linear in its bytes, whatever it declares:
//!
//! - A header is one block; numbers (octal or base-256) are at most 12
//!   bytes and must fit in 64 bits.
//! - Extension headers (`L`, `K`, `x`, `g`): at most
//!   [`TarLimits::max_pax_header`] bytes each, checked before they are
//!   read, and at most 16 in a row. A pax record's length field has at most
//!   20 digits and the record must fit in what is left of the header, so a
//!   record (a "line") is never longer than the header; decimal values
//!   have at most 20 digits.
//! - Paths and link targets: [`TarLimits::max_path`]; xattrs:
//!   [`TarLimits::max_xattr_bytes`] per entry.
//! - A declared size is never trusted for an allocation: data is skipped
//!   or streamed in a fixed buffer, so a size larger than the stream only
//!   reads to its end.
//! - Sparse files (old GNU `S`, pax 0.0, 0.1 and 1.0) are where a few bytes
//!   can declare a huge file. Their segments count against
//!   [`TarLimits::max_sparse_segments`] and their holes (real size minus
//!   stored data) against [`TarLimits::max_hole_bytes`], both summed over
//!   the whole stream (a layer), and both checked as soon as the number is
//!   read: before a map is read on, before any data. A GNU sparse 1.0 map
//!   is parsed as it streams, one block at a time and each byte once; its
//!   lines are numbers of at most 20 digits, so a longer line is an error
//!   at its 21st byte, and the map may not run past the entry's data.
//!
//! Why the sparse limits are what they are: holes cost no bytes in the
//! stream, but they cost work later. The fs-verity digest of a hole is
//! cheap to compute (O(log n), `cairn_store::FsVerityHasher::update_zeros`),
//! yet the kernel, when it enables fs-verity on the published object, reads
//! and hashes every byte of the logical file (about a second per GiB), and
//! anything that reads the file back (an export, a container) sees its full
//! length. So the holes of one layer are capped at a size that costs a few
//! seconds (default 8 GiB: a sparse database file of a few GB imports; a
//! 1 TiB file of a few hundred bytes of tar does not). Each segment, in
//! turn, costs at least one 4 KiB block hash (the block its data lands in)
//! and about one more per level of the tree for the blocks that mix data
//! and zeros, while taking as few as four bytes of a (compressible) map:
//! 65536 segments per layer by default, under a second of hashing.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::sync::Arc;

use cairn_erofs::tree::Mtime;

use crate::pax::{parse_decimal, Pax};
use header::{cstr, parse_octal_or_256, Header};

mod build;
mod header;
mod sparse;

/// Size of a tar block.
pub(crate) const BLOCK: u64 = 512;
/// Most extension headers (`L`, `K`, `x`, `g`) allowed before one entry.
const MAX_EXTENSION_HEADERS: usize = 16;
/// Most decimal digits of a number in a pax record or a GNU sparse 1.0
/// map (`u64::MAX` has 20).
pub(crate) const MAX_DIGITS: usize = 20;

/// What the reader refuses to read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TarLimits {
    /// Longest path or link target, in bytes.
    pub max_path: usize,
    /// Largest pax extended header (or GNU long name) data.
    pub max_pax_header: usize,
    /// Largest total of xattr names and values on one entry.
    pub max_xattr_bytes: usize,
    /// Most segments all the sparse files of the stream may list together.
    pub max_sparse_segments: u64,
    /// Most bytes of holes (real size minus stored data) all the sparse
    /// files of the stream may declare together.
    pub max_hole_bytes: u64,
}

/// Why the archive could not be read.
#[derive(Debug)]
pub(crate) struct TarError {
    /// Byte offset in the tar stream of the header the error is about (or
    /// where reading stopped).
    pub offset: u64,
    /// The entry's path, once known.
    pub entry: Option<Vec<u8>>,
    pub kind: TarErrorKind,
}

#[derive(Debug)]
pub(crate) enum TarErrorKind {
    /// Reading the underlying stream failed (decompression, the source).
    Read(io::Error),
    /// The stream ended too early.
    Truncated(String),
    /// The bytes are not a valid archive.
    Invalid(String),
    /// A limit was exceeded.
    Limit(String),
}

impl TarError {
    fn new(offset: u64, kind: TarErrorKind) -> Self {
        TarError {
            offset,
            entry: None,
            kind,
        }
    }

    fn with_entry(mut self, path: &[u8]) -> Self {
        if self.entry.is_none() {
            self.entry = Some(path.to_vec());
        }
        self
    }

    pub(crate) fn reason(&self) -> String {
        match &self.kind {
            TarErrorKind::Read(e) => e.to_string(),
            TarErrorKind::Truncated(s) | TarErrorKind::Invalid(s) | TarErrorKind::Limit(s) => {
                s.clone()
            }
        }
    }
}

/// The type of an entry (also what an eStargz TOC entry is: `toc::TocKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Regular,
    Hardlink,
    Symlink,
    CharDevice,
    BlockDevice,
    Directory,
    Fifo,
}

/// One entry's metadata, extension headers applied.
#[derive(Debug, Clone)]
pub(crate) struct TarEntry {
    /// Offset of the entry's first header (extension headers included).
    pub offset: u64,
    /// Offset of the entry's data (after a pax 1.0 sparse map).
    pub data_offset: u64,
    pub path: Vec<u8>,
    /// Hardlink or symlink target.
    pub link: Vec<u8>,
    pub kind: EntryKind,
    /// Permission bits (`0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: Mtime,
    pub devmajor: u32,
    pub devminor: u32,
    /// Size of the file the entry describes (sparse files: with holes).
    pub size: u64,
    /// Bytes of data stored in the archive for it.
    pub stored: u64,
    /// For sparse files: `(offset, length)` of each data segment, in order.
    pub sparse: Option<Vec<(u64, u64)>>,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// A source of archive bytes that may skip cheaply, and may lend the next
/// bytes from a shared buffer instead of copying them.
pub(crate) trait TarSource: Read {
    /// Skips `n` bytes; an early end is `UnexpectedEof`.
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let got = io::copy(&mut self.take(n), &mut io::sink())?;
        if got < n {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    /// Up to `max` (at least 1) of the next bytes, consumed, in the buffer
    /// they arrived in (the parallel import's chunks); by default the
    /// source only copies.
    fn lend(&mut self, _max: usize) -> io::Result<Lend> {
        Ok(Lend::Unsupported)
    }
}

impl<R: Read> TarSource for io::BufReader<R> {}

/// Stream bytes lent in the buffer they arrived in, instead of copied out
/// of it: `buf[start..start + len]`. Holding it keeps the buffer from
/// being reused.
#[derive(Debug, Clone)]
pub(crate) struct Lent {
    pub buf: Arc<Vec<u8>>,
    pub start: usize,
    pub len: usize,
}

impl Lent {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// What [`TarSource::lend`] gave.
pub(crate) enum Lend {
    /// The next bytes (at least one).
    Bytes(Lent),
    /// The stream has ended.
    End,
    /// This source only copies: use `read`.
    Unsupported,
}

/// Where [`TarReader::copy_data_into`] puts an entry's data.
pub(crate) trait DataSink<E> {
    /// A buffer (not empty) to read the next at most `want` bytes into.
    fn room(&mut self, want: usize) -> Result<&mut [u8], E>;
    /// The first `n` bytes of the buffer [`room`](Self::room) gave last
    /// are the entry's next data.
    fn filled(&mut self, n: usize) -> Result<(), E>;
    /// `n` zero bytes (a hole of a sparse file).
    fn hole(&mut self, n: u64) -> Result<(), E>;
    /// Whether the sink takes pieces of at least `n` bytes as they are
    /// lent ([`lent`](Self::lent)) rather than copied into its room.
    fn takes_lent(&self, _n: usize) -> bool {
        false
    }
    /// The entry's next data, lent. By default it is copied into the
    /// sink's room, as if read.
    fn lent(&mut self, piece: Lent) -> Result<(), E> {
        let mut bytes = piece.bytes();
        while !bytes.is_empty() {
            let room = self.room(bytes.len())?;
            let n = room.len().min(bytes.len());
            room[..n].copy_from_slice(&bytes[..n]);
            self.filled(n)?;
            bytes = &bytes[n..];
        }
        Ok(())
    }
}

/// [`TarReader::copy_data`]'s sink: one buffer, each piece handed on.
struct BufSink<'b, F> {
    buf: &'b mut [u8],
    sink: F,
}

impl<E, F: FnMut(Chunk<'_>) -> Result<(), E>> DataSink<E> for BufSink<'_, F> {
    fn room(&mut self, want: usize) -> Result<&mut [u8], E> {
        let n = want.min(self.buf.len());
        Ok(&mut self.buf[..n])
    }

    fn filled(&mut self, n: usize) -> Result<(), E> {
        (self.sink)(Chunk::Data(&self.buf[..n]))
    }

    fn hole(&mut self, n: u64) -> Result<(), E> {
        (self.sink)(Chunk::Hole(n))
    }
}

/// Reads entries one after the other.
pub(crate) struct TarReader<R> {
    r: R,
    limits: TarLimits,
    /// Bytes consumed from the stream.
    pos: u64,
    /// Data (and padding) of the current entry not yet consumed.
    pending: u64,
    done: bool,
    /// Sparse segments and hole bytes of the entries so far (against
    /// `max_sparse_segments` and `max_hole_bytes`).
    sparse_segments: u64,
    hole_bytes: u64,
    /// The buffer `copy_data` reads into, allocated once.
    buf: Vec<u8>,
}

/// Size of the buffer [`TarReader::copy_data`] streams data through.
const COPY_BUFFER: usize = 256 * 1024;

/// A piece of an entry's data.
pub(crate) enum Chunk<'a> {
    Data(&'a [u8]),
    Hole(u64),
}

impl<R: TarSource> TarReader<R> {
    pub(crate) fn new(r: R, limits: TarLimits) -> Self {
        TarReader {
            r,
            limits,
            pos: 0,
            pending: 0,
            done: false,
            sparse_segments: 0,
            hole_bytes: 0,
            buf: Vec::new(),
        }
    }

    /// The stream, once the archive is read.
    pub(crate) fn into_inner(self) -> R {
        self.r
    }

    /// Segments a sparse entry may still list.
    fn segments_left(&self) -> u64 {
        self.limits
            .max_sparse_segments
            .saturating_sub(self.sparse_segments)
    }

    /// Checks that `holes` more bytes of holes fit the limit.
    fn check_holes(&self, real: u64, holes: u64) -> Result<(), String> {
        let left = self.limits.max_hole_bytes.saturating_sub(self.hole_bytes);
        if holes > left {
            return Err(format!(
                "sparse file of {real} bytes has at least {holes} bytes of holes; with the {} bytes of \
                 holes before it that is more than the limit of {} bytes of holes per layer",
                self.hole_bytes, self.limits.max_hole_bytes
            ));
        }
        Ok(())
    }

    fn read_error(&self, e: io::Error, what: &str) -> TarError {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            TarError::new(
                self.pos,
                TarErrorKind::Truncated(format!("the archive ends in the middle of {what}")),
            )
        } else {
            TarError::new(self.pos, TarErrorKind::Read(e))
        }
    }

    fn read_exact(&mut self, buf: &mut [u8], what: &str) -> Result<(), TarError> {
        self.r
            .read_exact(buf)
            .map_err(|e| self.read_error(e, what))?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), TarError> {
        self.r.skip(n).map_err(|e| self.read_error(e, what))?;
        self.pos += n;
        Ok(())
    }

    /// Reads a header block; `None` at a clean end of stream.
    fn read_block(&mut self, block: &mut [u8; 512]) -> Result<bool, TarError> {
        let mut got = 0;
        while got < block.len() {
            match self.r.read(&mut block[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(TarError::new(self.pos, TarErrorKind::Read(e))),
            }
        }
        self.pos += got as u64;
        match got {
            0 => Ok(false),
            512 => Ok(true),
            _ => Err(TarError::new(
                self.pos,
                TarErrorKind::Truncated(format!(
                    "the archive ends in the middle of a header ({got} of 512 bytes)"
                )),
            )),
        }
    }

    /// Reads the data of an extension header, capped.
    fn read_extension(&mut self, size: u64, what: &str, at: u64) -> Result<Vec<u8>, TarError> {
        if size > self.limits.max_pax_header as u64 {
            return Err(TarError::new(
                at,
                TarErrorKind::Limit(format!(
                    "{what} of {size} bytes is larger than the limit of {} bytes",
                    self.limits.max_pax_header
                )),
            ));
        }
        let mut data = vec![0u8; size as usize];
        self.read_exact(&mut data, what)?;
        self.skip(padding(size), what)?;
        Ok(data)
    }

    /// The next entry, or `None` after the end-of-archive marker (or a clean
    /// end of the stream). The previous entry's unread data is skipped.
    pub(crate) fn next_entry(&mut self) -> Result<Option<TarEntry>, TarError> {
        if self.done {
            return Ok(None);
        }
        if self.pending > 0 {
            let n = self.pending;
            self.pending = 0;
            self.skip(n, "an entry's data")?;
        }
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link: Option<Vec<u8>> = None;
        let mut pax: Option<Pax> = None;
        let mut first_offset: Option<u64> = None;
        let mut extensions = 0usize;
        let mut block = [0u8; 512];
        loop {
            let offset = self.pos;
            if !self.read_block(&mut block)? {
                if first_offset.is_some() {
                    return Err(TarError::new(
                        offset,
                        TarErrorKind::Truncated(
                            "the archive ends after extension headers, before their entry".into(),
                        ),
                    ));
                }
                self.done = true;
                return Ok(None);
            }
            if block.iter().all(|&b| b == 0) {
                if first_offset.is_some() {
                    return Err(TarError::new(
                        offset,
                        TarErrorKind::Invalid(
                            "end-of-archive marker right after extension headers".into(),
                        ),
                    ));
                }
                // The end is two zero blocks, or one at the end of the
                // stream. A header after a single zero block is refused,
                // as Go's archive/tar (docker, containerd, umoci) refuses
                // it, rather than ending the archive there and hiding
                // what follows from cairn but not from other readers.
                let next = self.pos;
                if self.read_block(&mut block)? && block.iter().any(|&b| b != 0) {
                    return Err(TarError::new(
                        next,
                        TarErrorKind::Invalid(
                            "a header after a single zero block (the end of an archive is two)"
                                .into(),
                        ),
                    ));
                }
                self.done = true;
                return Ok(None);
            }
            let first = *first_offset.get_or_insert(offset);
            let h = Header(&block);
            h.check_checksum().map_err(|reason| {
                let reason = if offset == 0 {
                    format!("not a tar archive ({reason})")
                } else {
                    reason
                };
                TarError::new(offset, TarErrorKind::Invalid(reason))
            })?;
            let size = h
                .number(124, 12, "size")
                .map_err(|r| TarError::new(offset, TarErrorKind::Invalid(r)))?;
            let typeflag = block[156];
            match typeflag {
                b'L' | b'K' | b'x' | b'g' => {
                    extensions += 1;
                    if extensions > MAX_EXTENSION_HEADERS {
                        return Err(TarError::new(
                            offset,
                            TarErrorKind::Invalid(format!(
                                "more than {MAX_EXTENSION_HEADERS} extension headers in a row"
                            )),
                        ));
                    }
                    let what = match typeflag {
                        b'L' => "GNU long name",
                        b'K' => "GNU long link name",
                        b'x' => "pax extended header",
                        _ => "pax global header",
                    };
                    let data = self.read_extension(size, what, offset)?;
                    match typeflag {
                        b'L' | b'K' => {
                            let name = cstr(&data).to_vec();
                            if name.len() > self.limits.max_path {
                                return Err(TarError::new(
                                    offset,
                                    TarErrorKind::Limit(format!(
                                        "{what} of {} bytes is longer than the limit of {}",
                                        name.len(),
                                        self.limits.max_path
                                    )),
                                ));
                            }
                            let slot = if typeflag == b'L' {
                                &mut long_name
                            } else {
                                &mut long_link
                            };
                            if slot.is_some() {
                                return Err(TarError::new(
                                    offset,
                                    TarErrorKind::Invalid(format!(
                                        "two {what} headers for one entry"
                                    )),
                                ));
                            }
                            *slot = Some(name);
                        }
                        b'x' => {
                            if pax.is_some() {
                                return Err(TarError::new(
                                    offset,
                                    TarErrorKind::Invalid(
                                        "two pax extended headers for one entry".into(),
                                    ),
                                ));
                            }
                            pax = Some(Pax::parse(&data, self.segments_left()).map_err(|r| {
                                TarError::new(
                                    offset,
                                    TarErrorKind::Invalid(format!("malformed pax header: {r}")),
                                )
                            })?);
                        }
                        _ => {
                            // Checked, then ignored (containerd and Go do the same).
                            Pax::parse(&data, self.segments_left()).map_err(|r| {
                                TarError::new(
                                    offset,
                                    TarErrorKind::Invalid(format!(
                                        "malformed pax global header: {r}"
                                    )),
                                )
                            })?;
                            // Go returns a global header as an entry of its
                            // own (docker and containerd then skip it): the
                            // extension headers before it apply to nothing.
                            long_name = None;
                            long_link = None;
                            pax = None;
                            first_offset = None;
                        }
                    }
                    continue;
                }
                _ => {}
            }
            let entry = self.build_entry(&h, size, first, long_name, long_link, pax)?;
            return Ok(Some(entry));
        }
    }

    /// Streams the current entry's data to `sink` (holes of sparse files as
    /// [`Chunk::Hole`]). Call at most once per entry, before `next_entry`.
    pub(crate) fn copy_data<E: From<TarError>>(
        &mut self,
        entry: &TarEntry,
        sink: impl FnMut(Chunk<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.buf.is_empty() {
            self.buf = vec![0u8; COPY_BUFFER];
        }
        let mut buf = std::mem::take(&mut self.buf);
        let r = self.copy_data_into(
            entry,
            &mut BufSink {
                buf: &mut buf,
                sink,
            },
        );
        self.buf = buf;
        r
    }

    /// Reads the current entry's data straight into the buffers `sink`
    /// gives (no copy in between); holes go to [`DataSink::hole`]. Call at
    /// most once per entry, before `next_entry`.
    pub(crate) fn copy_data_into<E: From<TarError>>(
        &mut self,
        entry: &TarEntry,
        sink: &mut impl DataSink<E>,
    ) -> Result<(), E> {
        let mut cur = 0u64;
        let single = [(0u64, entry.stored)];
        let segments: &[(u64, u64)] = entry.sparse.as_deref().unwrap_or(&single);
        for &(off, len) in segments {
            if off > cur {
                sink.hole(off - cur)?;
            }
            let mut left = len;
            while left > 0 {
                let want = usize::try_from(left).unwrap_or(usize::MAX);
                if sink.takes_lent(want) {
                    match self.r.lend(want) {
                        Ok(Lend::Bytes(piece)) => {
                            let got = piece.len;
                            self.pos += got as u64;
                            self.pending -= got as u64;
                            left -= got as u64;
                            sink.lent(piece)?;
                            continue;
                        }
                        Ok(Lend::End) => return Err(self.cut_short(entry).into()),
                        Ok(Lend::Unsupported) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            return Err(TarError::new(self.pos, TarErrorKind::Read(e))
                                .with_entry(&entry.path)
                                .into())
                        }
                    }
                }
                let room = sink.room(want)?;
                debug_assert!(!room.is_empty(), "DataSink::room gave no room");
                let n = left.min(room.len() as u64) as usize;
                let got = match self.r.read(&mut room[..n]) {
                    Ok(0) => return Err(self.cut_short(entry).into()),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        return Err(TarError::new(self.pos, TarErrorKind::Read(e))
                            .with_entry(&entry.path)
                            .into())
                    }
                };
                self.pos += got as u64;
                self.pending -= got as u64;
                left -= got as u64;
                sink.filled(got)?;
            }
            cur = off + len;
        }
        if entry.size > cur {
            sink.hole(entry.size - cur)?;
        }
        Ok(())
    }

    /// The error of a stream that ends before the end of `entry`'s data:
    /// what is missing is what is still pending of its stored bytes (all
    /// segments of a sparse file, not only the one being read).
    fn cut_short(&self, entry: &TarEntry) -> TarError {
        let left = self.pending.saturating_sub(padding(entry.stored));
        TarError::new(
            self.pos,
            TarErrorKind::Truncated(format!(
                "the archive ends inside the entry's data ({} of {} bytes missing)",
                left, entry.stored
            )),
        )
        .with_entry(&entry.path)
    }

    /// Reads everything left in the stream (after the end-of-archive
    /// marker), returning how many bytes that was.
    pub(crate) fn drain(&mut self) -> Result<u64, TarError> {
        let n = io::copy(&mut self.r, &mut io::sink())
            .map_err(|e| TarError::new(self.pos, TarErrorKind::Read(e)))?;
        self.pos += n;
        Ok(n)
    }
}

/// The fuzzing oracle behind [`crate::fuzz_tar`]: reads every entry of
/// `data` and all of its data with the default limits and checks what the
/// reader promises. Any input may be rejected; none may panic here or
/// inside the reader.
pub(crate) fn fuzz_read(data: &[u8]) {
    let limits = TarLimits::from(&crate::Limits::default());
    let mut tar = TarReader::new(io::BufReader::new(data), limits);
    let len = data.len() as u64;
    let (mut prev_end, mut holes, mut segments) = (0u64, 0u64, 0u64);
    while let Ok(Some(e)) = tar.next_entry() {
        assert!(prev_end <= e.offset && e.offset < e.data_offset && e.data_offset <= len);
        assert!(!e.path.is_empty() && e.path.len() <= limits.max_path);
        assert!(e.link.len() <= limits.max_path);
        match &e.sparse {
            None => assert_eq!(e.size, e.stored),
            Some(s) => {
                assert_eq!(e.kind, EntryKind::Regular);
                assert!(e.stored <= e.size);
                holes += e.size - e.stored;
                segments += s.len() as u64;
                assert!(holes <= limits.max_hole_bytes);
                assert!(segments <= limits.max_sparse_segments);
            }
        }
        let (mut stored, mut size) = (0u64, 0u64);
        let copied = tar.copy_data::<TarError>(&e, |c| {
            match c {
                Chunk::Data(d) => {
                    stored += d.len() as u64;
                    size += d.len() as u64;
                }
                Chunk::Hole(n) => size = size.checked_add(n).expect("holes fit the size"),
            }
            Ok(())
        });
        if copied.is_err() {
            break;
        }
        assert_eq!((stored, size), (e.stored, e.size));
        prev_end = e.data_offset + e.stored;
        assert!(tar.pos == prev_end && prev_end <= len);
    }
    assert!(tar.pos <= len);
}

fn padding(size: u64) -> u64 {
    (BLOCK - size % BLOCK) % BLOCK
}

fn show_type(t: u8) -> String {
    if t.is_ascii_graphic() {
        format!("'{}'", t as char)
    } else {
        format!("{t:#04x}")
    }
}

pub(crate) fn id32(v: u64, what: &str) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("{what} {v} does not fit in 32 bits"))
}

#[cfg(test)]
mod go_compat_tests;

#[cfg(test)]
mod lent_tests {
    use super::*;

    /// A sink with a small room and no lending of its own.
    struct Small(Vec<u8>, [u8; 3]);

    impl DataSink<()> for Small {
        fn room(&mut self, want: usize) -> Result<&mut [u8], ()> {
            let n = want.min(self.1.len());
            Ok(&mut self.1[..n])
        }
        fn filled(&mut self, n: usize) -> Result<(), ()> {
            self.0.extend_from_slice(&self.1[..n]);
            Ok(())
        }
        fn hole(&mut self, _n: u64) -> Result<(), ()> {
            Ok(())
        }
    }

    #[test]
    fn a_sink_that_takes_no_lent_pieces_gets_them_copied() {
        let mut sink = Small(Vec::new(), [0; 3]);
        let piece = Lent {
            buf: Arc::new(b"0123456789".to_vec()),
            start: 2,
            len: 7,
        };
        sink.lent(piece).unwrap();
        assert_eq!(sink.0, b"2345678");
    }
}
