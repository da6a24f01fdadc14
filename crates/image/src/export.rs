//! Trees back out: a tree (with its file contents in the store) as one tar
//! stream ([`write_tar`]), and a stored image as an OCI image layout that
//! skopeo, umoci and containerd read ([`export_oci_layout`]).
//!
//! Layers are stored unpacked, so the original layer blobs are gone; an
//! export is the image's whole tree regenerated as **one** gzip-compressed
//! layer, and the config is rewritten to match it (`rootfs.diff_ids` holds
//! the new layer's diff_id, `history` one entry). Everything else in the
//! config (entrypoint, environment, labels, …) is kept.
//!
//! The tar stream is POSIX pax: ustar headers, with a pax header wherever a
//! field does not fit (long paths and link targets, nanosecond mtimes, big
//! ids and sizes) and for every xattr (`SCHILY.xattr.*`). Hardlinks are
//! link entries to the first name, directories come before what they hold,
//! the root is `./`. Sockets cannot be in a tar and are left out.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::num::NonZeroU64;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cairn_erofs::tree::{FileType, InodeData, InodeId, Tree, ROOT};
use cairn_store::{ObjectId, Store};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use cairn_spec::image::ANNOTATION_REF_NAME;
use cairn_spec::media_type as mt;
use cairn_spec::sha256_digest;

use crate::assemble::now_rfc3339;
use crate::LayerError;

/// What [`export_oci_layout`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedImage {
    pub manifest_digest: String,
    pub config_digest: String,
    pub layer_digest: String,
    pub diff_id: String,
    /// Bytes of the (compressed) layer blob.
    pub layer_size: u64,
    pub tag: String,
}

/// Where [`write_tar_from`] reads regular files' contents.
#[derive(Debug, Clone, Copy)]
pub enum TarContents<'a> {
    /// The store's objects (the tree names them).
    Store(&'a Store),
    /// The directory the tree was scanned from (`ScanOptions::metadata_only`):
    /// each file at its tar path, opened beneath the directory without
    /// following any symlink, and its size checked against the scan's.
    Dir(&'a Path),
}

/// Writes `tree` as a tar stream to `out`, reading regular file contents
/// from the store's objects. Returns the number of entries written.
pub fn write_tar(tree: &Tree, store: &Store, out: &mut impl Write) -> io::Result<u64> {
    write_tar_from(tree, TarContents::Store(store), out)
}

/// Writes `tree` as a tar stream to `out`, reading regular file contents
/// from `contents`. Returns the number of entries written.
///
/// From a directory, a few threads read ahead of the writer (see
/// [`ReadAhead`]): a tree that is not in the page cache is read with
/// several reads in flight instead of one file after another.
pub fn write_tar_from(
    tree: &Tree,
    contents: TarContents<'_>,
    out: &mut impl Write,
) -> io::Result<u64> {
    let source = match contents {
        TarContents::Store(s) => Source::Store(s),
        TarContents::Dir(d) => {
            let fd = rustix::fs::open(
                d,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| {
                io::Error::new(io::Error::from(e).kind(), format!("{}: {e}", d.display()))
            })?;
            Source::Dir(fd, d, ReadAhead::of(tree)?)
        }
    };
    let mut w = TarWriter {
        out,
        buf: vec![0; READ_BUF],
    };
    std::thread::scope(|s| {
        // The threads end when the writer does, however it ends (a panic
        // too: the scope waits for them before it unwinds).
        struct StopOnDrop<'r>(Option<&'r ReadAhead>);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                if let Some(ahead) = self.0 {
                    ahead.stop();
                }
            }
        }
        let _stop = StopOnDrop(match &source {
            Source::Dir(_, _, ahead) => Some(ahead),
            Source::Store(_) => None,
        });
        if let Source::Dir(fd, _, ahead) = &source {
            for k in 0..READ_AHEAD_THREADS {
                // Only an optimisation: without it, each file is read when
                // the writer gets to it.
                if let Err(e) = std::thread::Builder::new()
                    .name("cairn-readahead".into())
                    .spawn_scoped(s, move || ahead.run(fd, k))
                {
                    tracing::debug!("no read-ahead thread {k}: {e}");
                }
            }
        }
        walk(tree, |id, path, first| {
            w.entry(tree, id, path, first, &source)
        })
        .and_then(|count| w.out.write_all(&[0u8; 1024]).map(|()| count))
    })
}

/// Visits `tree` in tar order: depth-first, directories before their
/// contents, names in order; each later name of a hardlinked inode with
/// the path of its first. Sockets are left out (a tar cannot hold them).
/// Returns the number of entries visited.
fn walk(
    tree: &Tree,
    mut visit: impl FnMut(InodeId, &[u8], Option<&Vec<u8>>) -> io::Result<()>,
) -> io::Result<u64> {
    let mut primary: HashMap<InodeId, Vec<u8>> = HashMap::new();
    let mut count = 0u64;
    let mut stack: Vec<(InodeId, Vec<u8>)> = vec![(ROOT, Vec::new())];
    visit(ROOT, b"./", None)?;
    count += 1;
    while let Some((dir, prefix)) = stack.pop() {
        let Some(entries) = tree.inode(dir).entries() else {
            continue;
        };
        let mut subdirs = Vec::new();
        for (name, e) in entries {
            let mut path = prefix.clone();
            path.extend_from_slice(name);
            let inode = tree.inode(e.inode);
            if inode.file_type() == FileType::Socket {
                tracing::warn!(
                    "leaving socket {} out of the tar stream",
                    String::from_utf8_lossy(&path)
                );
                continue;
            }
            if inode.is_dir() {
                let mut p = path.clone();
                p.push(b'/');
                visit(e.inode, &p, None)?;
                subdirs.push((e.inode, p));
            } else if let Some(first) = primary.get(&e.inode) {
                visit(e.inode, &path, Some(first))?;
            } else {
                if inode.nlink > 1 {
                    primary.insert(e.inode, path.clone());
                }
                visit(e.inode, &path, None)?;
            }
            count += 1;
        }
        // Depth-first: the first subdirectory is popped next.
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(count)
}

/// Threads that read ahead of the tar writer from a directory.
const READ_AHEAD_THREADS: usize = 4;
/// How far ahead of the writer they go, in files and in bytes.
const READ_AHEAD_FILES: usize = 512;
const READ_AHEAD_BYTES: u64 = 64 << 20;

/// Read-ahead for a directory source: the files the writer will open, in
/// its order, each asked of the kernel (`POSIX_FADV_WILLNEED`) before the
/// writer gets there, at most [`READ_AHEAD_FILES`] files and
/// [`READ_AHEAD_BYTES`] ahead of it. Nothing is read into this process:
/// the kernel starts the reads and the page cache holds them, so memory
/// stays bounded by the window.
///
/// The threads work only within a window of files past the last one
/// found missing from the page cache, by the writer (its first read of
/// each file does not wait: [`ReadAhead::missed`]) or by a thread (a
/// one-byte read that does not wait, before advising). On a tree that is
/// cached, as the snapshotter's freshly unpacked layer is, they sleep and
/// open nothing.
/// A file the writer has already reached is skipped. Each file is opened
/// the way the writer opens it (beneath the directory, through no
/// symlink); a failure is left for the writer to find and report.
struct ReadAhead {
    /// Each file's tar path and size, in the writer's order.
    files: Vec<(Vec<u8>, u64)>,
    /// `ends[i]`: the bytes of files `0..=i`.
    ends: Vec<u64>,
    /// How many of `files` the writer has opened.
    opened: AtomicUsize,
    /// One past the furthest file found not cached, by the writer or by
    /// the read-ahead (0: none yet).
    last_miss: AtomicUsize,
    done: AtomicBool,
}

impl ReadAhead {
    fn of(tree: &Tree) -> io::Result<ReadAhead> {
        let mut files = Vec::new();
        walk(tree, |id, path, first| {
            let inode = tree.inode(id);
            if let (None, InodeData::Regular(r)) = (first, &inode.data) {
                if inode.size > 0 && r.content.is_none() {
                    files.push((path.to_vec(), inode.size));
                }
            }
            Ok(())
        })?;
        let mut total = 0;
        let ends = files
            .iter()
            .map(|(_, size)| {
                total += size;
                total
            })
            .collect();
        Ok(ReadAhead {
            files,
            ends,
            opened: AtomicUsize::new(0),
            last_miss: AtomicUsize::new(0),
            done: AtomicBool::new(false),
        })
    }

    /// The writer opened its next file.
    fn advance(&self) {
        self.opened.fetch_add(1, Ordering::Relaxed);
    }

    /// The writer's file was not in the page cache.
    fn missed(&self) {
        self.last_miss
            .fetch_max(self.opened.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn stop(&self) {
        self.done.store(true, Ordering::Relaxed);
    }

    /// Thread `k`'s share: every [`READ_AHEAD_THREADS`]th file from `k`.
    fn run(&self, dir: &OwnedFd, k: usize) {
        let mut i = k;
        while i < self.files.len() {
            loop {
                if self.done.load(Ordering::Relaxed) {
                    return;
                }
                let at = self.opened.load(Ordering::Relaxed);
                if i < at {
                    // The writer got there first: catch up.
                    i += (at - i).div_ceil(READ_AHEAD_THREADS) * READ_AHEAD_THREADS;
                    if i >= self.files.len() {
                        return;
                    }
                    continue;
                }
                let miss = self.last_miss.load(Ordering::Relaxed);
                let cold = miss != 0 && at < miss + READ_AHEAD_FILES;
                let behind = if at == 0 { 0 } else { self.ends[at - 1] };
                if cold && i - at < READ_AHEAD_FILES && self.ends[i] - behind <= READ_AHEAD_BYTES {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(if cold { 1 } else { 5 }));
            }
            let (path, size) = &self.files[i];
            if let Ok(f) = open_beneath(dir, path) {
                // A file found not cached here keeps the read-ahead going
                // (the writer, finding what this advised in the cache,
                // would not say so).
                let mut b = [0u8; 1];
                let uncached = matches!(
                    rustix::io::preadv2(
                        &f,
                        &mut [io::IoSliceMut::new(&mut b)],
                        0,
                        rustix::io::ReadWriteFlags::NOWAIT,
                    ),
                    Err(rustix::io::Errno::AGAIN)
                );
                if uncached {
                    self.last_miss.fetch_max(i + 1, Ordering::Relaxed);
                    let len = NonZeroU64::new((*size).min(READ_AHEAD_BYTES));
                    let _ = rustix::fs::fadvise(&f, 0, len, rustix::fs::Advice::WillNeed);
                }
            }
            i += READ_AHEAD_THREADS;
        }
    }
}

struct TarWriter<'a, W> {
    out: &'a mut W,
    /// What a file's content is read into on its way to `out`.
    buf: Vec<u8>,
}

/// The size of [`TarWriter::buf`]: most files in one read.
const READ_BUF: usize = 256 * 1024;

/// `pread`, retried when interrupted.
fn read_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    loop {
        match std::os::unix::fs::FileExt::read_at(f, buf, offset) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

const MAX_OCTAL_7: u64 = 0o7777777;
const MAX_OCTAL_11: u64 = 0o77777777777;

fn put_octal(field: &mut [u8], v: u64) {
    let s = format!("{:0width$o}\0", v, width = field.len() - 1);
    field.copy_from_slice(s.as_bytes());
}

fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    // The length counts itself: find the fixed point.
    let rest = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = rest + 1;
    loop {
        let total = rest + len.to_string().len();
        if total == len {
            break;
        }
        len = total;
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

impl<W: Write> TarWriter<'_, W> {
    fn header(
        &mut self,
        name: &[u8],
        typeflag: u8,
        size: u64,
        inode: &cairn_erofs::Inode,
        link: &[u8],
    ) -> io::Result<()> {
        let mut h = [0u8; 512];
        let n = name.len().min(100);
        h[..n].copy_from_slice(&name[..n]);
        put_octal(&mut h[100..108], u64::from(inode.mode & 0o7777));
        put_octal(&mut h[108..116], u64::from(inode.uid).min(MAX_OCTAL_7));
        put_octal(&mut h[116..124], u64::from(inode.gid).min(MAX_OCTAL_7));
        put_octal(&mut h[124..136], size.min(MAX_OCTAL_11));
        put_octal(
            &mut h[136..148],
            u64::try_from(inode.mtime.sec)
                .unwrap_or(0)
                .min(MAX_OCTAL_11),
        );
        h[156] = typeflag;
        let l = link.len().min(100);
        h[157..157 + l].copy_from_slice(&link[..l]);
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        if matches!(typeflag, b'3' | b'4') {
            let major = libc::major(inode.rdev);
            let minor = libc::minor(inode.rdev);
            put_octal(&mut h[329..337], u64::from(major).min(MAX_OCTAL_7));
            put_octal(&mut h[337..345], u64::from(minor).min(MAX_OCTAL_7));
        }
        h[148..156].copy_from_slice(b"        ");
        let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
        put_octal(&mut h[148..155], sum);
        h[155] = b' ';
        self.out.write_all(&h)
    }

    fn entry(
        &mut self,
        tree: &Tree,
        id: InodeId,
        path: &[u8],
        hardlink_to: Option<&Vec<u8>>,
        source: &Source<'_>,
    ) -> io::Result<()> {
        let inode = tree.inode(id);
        let (typeflag, link): (u8, &[u8]) = match hardlink_to {
            Some(first) => (b'1', first),
            None => match &inode.data {
                InodeData::Directory(_) => (b'5', b""),
                InodeData::Regular(_) => (b'0', b""),
                InodeData::Symlink(t) => (b'2', t),
                InodeData::Special => match inode.file_type() {
                    FileType::CharDevice => (b'3', b""),
                    FileType::BlockDevice => (b'4', b""),
                    _ => (b'6', b""),
                },
            },
        };
        let size = if typeflag == b'0' { inode.size } else { 0 };
        let mut pax = Vec::new();
        if path.len() > 100 {
            pax_record(&mut pax, b"path", path);
        }
        if link.len() > 100 {
            pax_record(&mut pax, b"linkpath", link);
        }
        if inode.mtime.nsec != 0 || inode.mtime.sec < 0 || inode.mtime.sec as u64 > MAX_OCTAL_11 {
            let t = if inode.mtime.sec < 0 && inode.mtime.nsec != 0 {
                // -1.5 s is sec -2, nsec 500000000.
                format!(
                    "-{}.{:09}",
                    -(inode.mtime.sec + 1),
                    1_000_000_000 - inode.mtime.nsec
                )
            } else {
                format!("{}.{:09}", inode.mtime.sec, inode.mtime.nsec)
            };
            pax_record(&mut pax, b"mtime", t.as_bytes());
        }
        if u64::from(inode.uid) > MAX_OCTAL_7 {
            pax_record(&mut pax, b"uid", inode.uid.to_string().as_bytes());
        }
        if u64::from(inode.gid) > MAX_OCTAL_7 {
            pax_record(&mut pax, b"gid", inode.gid.to_string().as_bytes());
        }
        if size > MAX_OCTAL_11 {
            pax_record(&mut pax, b"size", size.to_string().as_bytes());
        }
        if hardlink_to.is_none() {
            for (k, v) in &inode.xattrs {
                let mut key = b"SCHILY.xattr.".to_vec();
                key.extend_from_slice(k);
                pax_record(&mut pax, &key, v);
            }
        }
        if !pax.is_empty() {
            let mut pname = b"PaxHeaders/".to_vec();
            pname.extend_from_slice(&path[..path.len().min(80)]);
            self.header(&pname, b'x', pax.len() as u64, inode, b"")?;
            self.out.write_all(&pax)?;
            self.pad(pax.len() as u64)?;
        }
        self.header(path, typeflag, size, inode, link)?;
        if typeflag == b'0' && size > 0 {
            let InodeData::Regular(r) = &inode.data else {
                unreachable!("typeflag 0 is a regular file")
            };
            if let Some(content) = &r.content {
                if content.len() as u64 != size {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "{}: inline content of {} bytes for a file of {size}",
                            String::from_utf8_lossy(path),
                            content.len()
                        ),
                    ));
                }
                self.out.write_all(content)?;
            } else {
                let (f, what) = source.open(r, path, size)?;
                let copied = self.copy_file(&f, size, source)?;
                if copied != size {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "{}: {what} holds {copied} bytes, the file {size}",
                            String::from_utf8_lossy(path)
                        ),
                    ));
                }
            }
            self.pad(size)?;
        }
        Ok(())
    }

    /// Copies up to `size` bytes of `f` to the stream; returns how many
    /// there were. From a directory, the first read does not wait for the
    /// disk (`RWF_NOWAIT`): if the data is not in the page cache, the
    /// read-ahead threads are told, then the read waits.
    fn copy_file(&mut self, f: &File, size: u64, source: &Source<'_>) -> io::Result<u64> {
        let mut done = 0u64;
        let mut probe = matches!(source, Source::Dir(..));
        while done < size {
            let want = (size - done).min(self.buf.len() as u64) as usize;
            let buf = &mut self.buf[..want];
            let n = if std::mem::take(&mut probe) {
                match rustix::io::preadv2(
                    f,
                    &mut [io::IoSliceMut::new(buf)],
                    done,
                    rustix::io::ReadWriteFlags::NOWAIT,
                ) {
                    Ok(n) if n > 0 => n,
                    Err(rustix::io::Errno::AGAIN) => {
                        if let Source::Dir(_, _, ahead) = source {
                            ahead.missed();
                        }
                        read_at(f, buf, done)?
                    }
                    // End of file, or a filesystem without RWF_NOWAIT
                    // (FUSE, some network filesystems: EOPNOTSUPP): the
                    // plain read decides, and nothing is read ahead.
                    Ok(_) | Err(_) => read_at(f, buf, done)?,
                }
            } else {
                read_at(f, buf, done)?
            };
            if n == 0 {
                break;
            }
            self.out.write_all(&self.buf[..n])?;
            done += n as u64;
        }
        Ok(done)
    }

    fn pad(&mut self, size: u64) -> io::Result<()> {
        let pad = (512 - size % 512) % 512;
        self.out.write_all(&[0u8; 512][..pad as usize])
    }
}

/// [`TarContents`], with the directory open.
enum Source<'a> {
    Store(&'a Store),
    Dir(OwnedFd, &'a Path, ReadAhead),
}

impl Source<'_> {
    /// The open file with `r`'s content (at tar path `path`), and what it
    /// is, for errors.
    fn open(
        &self,
        r: &cairn_erofs::RegularFile,
        path: &[u8],
        size: u64,
    ) -> io::Result<(File, String)> {
        let name = || String::from_utf8_lossy(path);
        match self {
            Source::Store(store) => {
                let object = object_of(r, path)?;
                let f = File::open(store.object_path(&object)).map_err(|e| {
                    io::Error::new(e.kind(), format!("{}: object {object}: {e}", name()))
                })?;
                Ok((f, format!("object {object}")))
            }
            Source::Dir(fd, dir, ahead) => {
                ahead.advance();
                let f = open_beneath(fd, path).map_err(|e| {
                    io::Error::new(
                        io::Error::from(e).kind(),
                        format!("{} in {}: {e}", name(), dir.display()),
                    )
                })?;
                let f = File::from(f);
                let meta = f.metadata()?;
                if !meta.is_file() || meta.len() != size {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "{} in {}: changed since it was scanned (a file of {size} bytes, now {})",
                            name(),
                            dir.display(),
                            if meta.is_file() {
                                format!("{} bytes", meta.len())
                            } else {
                                "not a regular file".to_owned()
                            }
                        ),
                    ));
                }
                Ok((f, format!("{} in {}", name(), dir.display())))
            }
        }
    }
}

/// Opens `path` beneath the directory `dir` for reading, through no
/// symlink: a tree that changes under the walk cannot send the read
/// elsewhere. Without blocking: a FIFO put in a file's place must not hang
/// the open (the caller then finds it is not a regular file); reads of a
/// regular file do not heed `O_NONBLOCK`.
fn open_beneath(dir: &OwnedFd, path: &[u8]) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(
        dir,
        std::ffi::OsStr::from_bytes(path),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
}

fn object_of(r: &cairn_erofs::RegularFile, path: &[u8]) -> io::Result<ObjectId> {
    if let Some(d) = r.digest {
        return Ok(ObjectId(d));
    }
    let payload = r.payload.as_deref().unwrap_or_default();
    let hex: String = String::from_utf8_lossy(payload)
        .trim_start_matches('/')
        .replace('/', "");
    ObjectId::from_hex(&hex).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: payload {:?} does not name an object",
                String::from_utf8_lossy(path),
                String::from_utf8_lossy(payload)
            ),
        )
    })
}

/// A `Write` that hashes and counts what goes through it.
pub(crate) struct HashWriter<W> {
    pub inner: W,
    pub hash: Sha256,
    pub count: u64,
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn export_err(dest: &Path, reason: impl std::fmt::Display) -> LayerError {
    LayerError::Archive {
        archive: format!("oci-layout:{}", dest.display()),
        reason: reason.to_string(),
    }
}

/// Writes a blob into `blobs/sha256/` (if missing) and returns its digest.
fn put_blob(dest: &Path, data: &[u8]) -> Result<String, LayerError> {
    let digest = sha256_digest(data);
    let path = dest
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"));
    if !path.exists() {
        write_atomic(&path, data)
            .map_err(|e| export_err(dest, format!("writing {}: {e}", path.display())))?;
    }
    Ok(digest)
}

fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Writes the stored image `image_digest` into the OCI layout at `dest`
/// (created if missing; an existing layout keeps its other images), tagged
/// `tag`. The config comes from the image record when there is one, with
/// `rootfs` and `history` rewritten for the single regenerated layer; an
/// image without a record gets a minimal config for the host platform.
pub fn export_oci_layout(
    store: &Store,
    image_digest: &str,
    dest: &Path,
    tag: &str,
) -> Result<ExportedImage, LayerError> {
    if !cairn_store::is_image_digest(image_digest) || !store.has_image(image_digest) {
        return Err(LayerError::Image {
            what: "export",
            reason: format!("image {image_digest} is not in the store"),
        });
    }
    let data = fs::read(store.image_path(image_digest))
        .map_err(|e| export_err(dest, format!("reading image {image_digest}: {e}")))?;
    let tree = cairn_erofs::reader::read_image(&data)
        .map_err(|e| export_err(dest, format!("reading image {image_digest}: {e}")))?;
    drop(data);
    let record = store
        .image_record(image_digest)
        .map_err(LayerError::store("reading the image record"))?;

    fs::create_dir_all(dest.join("blobs/sha256"))
        .map_err(|e| export_err(dest, format!("creating blobs/sha256: {e}")))?;
    // The layer: tar → gzip → file, hashing both sides.
    let tmp = dest.join(format!("blobs/sha256/.layer-tmp-{}", std::process::id()));
    let layer = (|| -> io::Result<(String, String, u64)> {
        let file = File::create(&tmp)?;
        let blob = HashWriter {
            inner: io::BufWriter::with_capacity(1 << 20, file),
            hash: Sha256::new(),
            count: 0,
        };
        let gz = flate2::write::GzEncoder::new(blob, flate2::Compression::fast());
        let mut tar = HashWriter {
            inner: gz,
            hash: Sha256::new(),
            count: 0,
        };
        write_tar(&tree, store, &mut tar)?;
        let diff_id = format!("sha256:{}", hex::encode(tar.hash.finalize()));
        let mut blob = tar.inner.finish()?;
        blob.flush()?;
        let digest = format!("sha256:{}", hex::encode(blob.hash.finalize()));
        let size = blob.count;
        let file = blob.inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok((diff_id, digest, size))
    })();
    let (diff_id, layer_digest, layer_size) = match layer {
        Ok(v) => v,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(export_err(dest, format!("writing the layer: {e}")));
        }
    };
    let layer_path = dest
        .join("blobs/sha256")
        .join(layer_digest.trim_start_matches("sha256:"));
    fs::rename(&tmp, &layer_path)
        .map_err(|e| export_err(dest, format!("writing {}: {e}", layer_path.display())))?;

    let mut config: Value = match &record {
        Some(r) => serde_json::from_str(&r.config)
            .map_err(|e| export_err(dest, format!("the recorded config: {e}")))?,
        None => {
            let p = cairn_spec::PlatformSpec::host();
            json!({"architecture": p.architecture, "os": p.os, "config": {}})
        }
    };
    let created = now_rfc3339();
    config["rootfs"] = json!({"type": "layers", "diff_ids": [diff_id]});
    config["history"] =
        json!([{"created": created, "created_by": "cairn export (all layers as one)"}]);
    let config_bytes = serde_json::to_vec(&config).expect("JSON values serialise");
    let config_digest = put_blob(dest, &config_bytes)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": mt::OCI_MANIFEST,
        "config": {
            "mediaType": mt::OCI_CONFIG,
            "digest": config_digest,
            "size": config_bytes.len(),
        },
        "layers": [{
            "mediaType": mt::OCI_LAYER_GZIP,
            "digest": layer_digest,
            "size": layer_size,
        }],
    });
    let manifest_bytes = serde_json::to_vec(&manifest).expect("JSON values serialise");
    let manifest_digest = put_blob(dest, &manifest_bytes)?;

    write_atomic(
        &dest.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .map_err(|e| export_err(dest, format!("writing oci-layout: {e}")))?;
    let index_path = dest.join("index.json");
    let mut index: Value = match fs::read(&index_path) {
        Ok(d) => serde_json::from_slice(&d)
            .map_err(|e| export_err(dest, format!("existing index.json: {e}")))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => json!({
            "schemaVersion": 2,
            "mediaType": mt::OCI_INDEX,
            "manifests": [],
        }),
        Err(e) => return Err(export_err(dest, format!("reading index.json: {e}"))),
    };
    let platform = cairn_spec::PlatformSpec::host();
    let desc = json!({
        "mediaType": mt::OCI_MANIFEST,
        "digest": manifest_digest,
        "size": manifest_bytes.len(),
        "annotations": {ANNOTATION_REF_NAME: tag},
        "platform": {
            "architecture": config.get("architecture").and_then(Value::as_str).unwrap_or(&platform.architecture),
            "os": config.get("os").and_then(Value::as_str).unwrap_or(&platform.os),
        },
    });
    let manifests = index
        .get_mut("manifests")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| export_err(dest, "existing index.json has no manifests list"))?;
    manifests.retain(|m| crate::archive::ref_name(m) != Some(tag));
    manifests.push(desc);
    let index_bytes = serde_json::to_vec_pretty(&index).expect("JSON values serialise");
    write_atomic(&index_path, &index_bytes)
        .map_err(|e| export_err(dest, format!("writing index.json: {e}")))?;
    Ok(ExportedImage {
        manifest_digest,
        config_digest,
        layer_digest,
        diff_id,
        layer_size,
        tag: tag.to_owned(),
    })
}
