//! The reader stack under the tar parser: the blob as fetched (hashed for
//! its digest, counted), a decompressor (gzip, zstd or none, chosen by media
//! type and magic bytes), and a limiter over the uncompressed stream that
//! hashes it for the diff_id and stops decompression bombs.
//!
//! Errors keep their origin: a failure of the blob reader itself comes out
//! wrapped in [`SourceError`], a decompressor's complaint in
//! [`DecompressError`], a limit in [`LimitError`], so the importer can say
//! which it was (and a caller can retry a network error but not a corrupt
//! blob).

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::{self, BufRead, BufReader, Read};
use std::rc::Rc;

use sha2::{Digest, Sha256};

/// Uncompressed bytes past which the ratio limit applies.
pub const RATIO_FLOOR: u64 = 64 << 20;

/// How a layer is compressed: the image spec's notion, shared with the
/// registry client (the media type table is `cairn_spec`'s).
pub use cairn_spec::Compression;

/// The blob reader failed (not the data in it).
#[derive(Debug)]
pub struct SourceError(pub io::Error);

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SourceError {}

/// The decompressor rejected the data.
#[derive(Debug)]
pub struct DecompressError {
    pub compression: Compression,
    pub error: io::Error,
}

impl fmt::Display for DecompressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.error.kind() {
            io::ErrorKind::UnexpectedEof => "truncated".to_string(),
            _ => format!("corrupt ({})", self.error),
        };
        write!(f, "{} stream is {what}", self.compression.name())
    }
}

impl std::error::Error for DecompressError {}

/// A size or ratio limit stopped the stream.
#[derive(Debug)]
pub struct LimitError(pub String);

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LimitError {}

/// What the stack counts and hashes, shared with whoever built it.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    pub compressed: Cell<u64>,
    pub blob_hash: RefCell<Sha256>,
    pub uncompressed: Cell<u64>,
    pub tar_hash: RefCell<Sha256>,
    /// Whether any byte was read from the blob (the layer cache test).
    pub touched: Cell<bool>,
    /// The blob is not compressed: it is the uncompressed stream, so its
    /// digest is the diff_id ([`Meter::blob_digest`]), and the blob is
    /// not hashed a second time once that is known (past the first read,
    /// which shows the magic bytes). A sha256 of the whole layer saved:
    /// 13% of the CPU of a `cairn import dir:` of a Debian tree, whose tar
    /// (as every directory import's and every Commit's) is uncompressed.
    pub blob_is_stream: Cell<bool>,
}

impl Meter {
    /// The blob's digest; `None` for an uncompressed blob, whose digest is
    /// the stream's (the diff_id, once the stream is read to its end).
    pub fn blob_digest(&self) -> Option<String> {
        if self.blob_is_stream.get() {
            return None;
        }
        Some(format!(
            "sha256:{}",
            hex::encode(self.blob_hash.borrow().clone().finalize())
        ))
    }

    pub fn diff_id(&self) -> String {
        format!(
            "sha256:{}",
            hex::encode(self.tar_hash.borrow().clone().finalize())
        )
    }
}

/// The blob as fetched: hashed and counted.
struct SourceReader<R> {
    inner: R,
    meter: Rc<Meter>,
}

impl<R: Read> Read for SourceReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.meter.touched.set(true);
        loop {
            match self.inner.read(buf) {
                Ok(n) => {
                    if !self.meter.blob_is_stream.get() {
                        self.meter.blob_hash.borrow_mut().update(&buf[..n]);
                    }
                    self.meter
                        .compressed
                        .set(self.meter.compressed.get() + n as u64);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io::Error::new(e.kind(), SourceError(e))),
            }
        }
    }
}

/// The uncompressed stream: hashed, counted and limited.
struct LimitReader<R> {
    inner: R,
    compression: Compression,
    meter: Rc<Meter>,
    max_bytes: u64,
    max_ratio: u64,
    /// Whether this reader hashes the stream for the diff_id (the
    /// threaded import hashes it where the chunks are parsed instead).
    hash: bool,
}

impl<R: Read> Read for LimitReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = loop {
            match self.inner.read(buf) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let from_source = e.get_ref().is_some_and(|inner| inner.is::<SourceError>());
                    if from_source || self.compression == Compression::None {
                        return Err(e);
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        DecompressError {
                            compression: self.compression,
                            error: e,
                        },
                    ));
                }
            }
        };
        let total = self.meter.uncompressed.get() + n as u64;
        self.meter.uncompressed.set(total);
        if total > self.max_bytes {
            return Err(io::Error::other(LimitError(format!(
                "uncompressed layer is larger than the limit of {} bytes",
                self.max_bytes
            ))));
        }
        let compressed = self.meter.compressed.get().max(1);
        if total > RATIO_FLOOR && total / compressed >= self.max_ratio {
            return Err(io::Error::other(LimitError(format!(
                "decompression bomb: {total} bytes from {compressed} compressed bytes exceeds the limit ratio of {}:1",
                self.max_ratio
            ))));
        }
        if self.hash {
            self.meter.tar_hash.borrow_mut().update(&buf[..n]);
        }
        Ok(n)
    }
}

/// The uncompressed stream, the compression found, and its meter.
pub(crate) type BlobStack<'a> = (Box<dyn Read + 'a>, Compression, Rc<Meter>);

/// Why [`open_blob`] failed.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// Reading the first bytes failed.
    Read(io::Error),
    /// The media type and the magic bytes disagree.
    Mismatch(String),
}

/// Builds the stack over `blob`. `declared` is what the media type says
/// (`None`: nothing, detect from the magic bytes). With `hash_tar` false
/// the uncompressed stream is not hashed, and the meter's diff_id means
/// nothing: the caller hashes the stream itself. A media type the bytes
/// contradict is an error, as umoci has it: compression the bytes do not
/// show, another compression than they show, or an uncompressed tar whose
/// bytes are gzip or zstd.
pub(crate) fn open_blob<'a>(
    blob: impl Read + 'a,
    declared: Option<Compression>,
    max_bytes: u64,
    max_ratio: u64,
    hash_tar: bool,
) -> Result<BlobStack<'a>, OpenError> {
    let meter = Rc::new(Meter::default());
    let mut src = BufReader::with_capacity(
        256 * 1024,
        SourceReader {
            inner: blob,
            meter: Rc::clone(&meter),
        },
    );
    let head = src.fill_buf().map_err(OpenError::Read)?;
    let detected = Compression::from_magic(head);
    let compression = match (declared, detected) {
        (None, Some(c)) => c,
        (None, None) | (Some(Compression::None), None) => Compression::None,
        (Some(d), Some(c)) if d == c => c,
        (Some(Compression::None), Some(c)) => {
            return Err(OpenError::Mismatch(format!(
                "the media type says an uncompressed tar but the blob starts with {} magic bytes",
                c.name()
            )))
        }
        (Some(d), Some(c)) => {
            return Err(OpenError::Mismatch(format!(
                "the media type says {} but the blob starts with {} magic bytes",
                d.name(),
                c.name()
            )))
        }
        (Some(c), None) => {
            return Err(OpenError::Mismatch(format!(
                "the media type says {} but the blob does not start with {} magic bytes",
                c.name(),
                c.name()
            )))
        }
    };
    // The stream's hash (the diff_id, wherever it is taken) covers every
    // byte of an uncompressed blob: the tar parser reads it to its end.
    meter.blob_is_stream.set(compression == Compression::None);
    let inner: Box<dyn Read + 'a> = match compression {
        Compression::None => Box::new(src),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(src)),
        Compression::Zstd => {
            Box::new(zstd::stream::read::Decoder::with_buffer(src).map_err(OpenError::Read)?)
        }
    };
    let limited = LimitReader {
        inner,
        compression,
        meter: Rc::clone(&meter),
        max_bytes,
        max_ratio,
        hash: hash_tar,
    };
    Ok((Box::new(limited), compression, meter))
}
