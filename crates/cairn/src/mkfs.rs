//! `cairn mkfs`: directory or dumpfile → composefs EROFS image.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::{output, Global};

#[derive(Args, Debug)]
pub struct MkfsArgs {
    /// A directory, or with --from-dump a composefs dumpfile ('-' for stdin).
    pub source: PathBuf,
    /// The image file to write.
    pub image: PathBuf,
    /// SOURCE is a composefs dumpfile.
    #[arg(long)]
    pub from_dump: bool,
    /// Accept what composefs accepts when not strict (only with --from-dump).
    #[arg(long, requires = "from_dump")]
    pub lenient: bool,
    /// Also copy file contents into the store's objects/ (reflinked where possible).
    #[arg(long, conflicts_with = "from_dump")]
    pub store: bool,
    /// Write exactly this composefs format version (default: 0, or 1 where the tree has whiteouts).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1))]
    pub format_version: Option<u32>,
    /// Keep regular files of up to this many bytes inside the image.
    #[arg(long, value_name = "BYTES", default_value_t = cairn_erofs::tree::DEFAULT_INLINE_THRESHOLD, conflicts_with = "from_dump")]
    pub inline_threshold: u64,
    /// Leave extended attributes out.
    #[arg(long, conflicts_with = "from_dump")]
    pub skip_xattrs: bool,
}

#[derive(Serialize)]
struct MkfsReport {
    image: PathBuf,
    sha256: String,
    bytes: u64,
    inodes: u64,
    format_version: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    files_stored: Option<u64>,
    seconds: f64,
}

/// A `Write` that hashes what goes through it.
struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

pub fn run(g: &Global, args: &MkfsArgs) -> Result<()> {
    let start = Instant::now();
    let mut stored = None;
    let tree = if args.from_dump {
        let opts = cairn_erofs::dump::ParseOptions {
            strict: !args.lenient,
        };
        let parsed = if args.source.as_os_str() == "-" {
            cairn_erofs::dump::parse_dump(std::io::stdin().lock(), &opts)
        } else {
            let f = File::open(&args.source)
                .with_context(|| format!("opening dumpfile {}", args.source.display()))?;
            cairn_erofs::dump::parse_dump(BufReader::new(f), &opts)
        };
        parsed.with_context(|| format!("dumpfile {}", args.source.display()))?
    } else {
        let store = if args.store {
            Some(
                cairn_store::Store::open(&g.root)
                    .with_context(|| format!("opening the store at {}", g.root.display()))?,
            )
        } else {
            None
        };
        let opts = cairn_image::ScanOptions {
            store: store.as_ref(),
            inline_threshold: args.inline_threshold,
            skip_xattrs: args.skip_xattrs,
            threads: 0,
        };
        let (tree, stats) = cairn_image::scan_dir(&args.source, &opts)
            .with_context(|| format!("reading directory {}", args.source.display()))?;
        if args.store {
            stored = Some(stats.regular_files - stats.inline_files);
        }
        tree
    };
    let wopts = match args.format_version {
        Some(v) => cairn_erofs::writer::WriteOptions::pinned(v),
        None => cairn_erofs::writer::WriteOptions::default(),
    };
    let (info, sha256) = write_image_atomically(&args.image, |w| {
        cairn_erofs::writer::mkfs_erofs(&tree, &wopts, w).map_err(anyhow::Error::from)
    })?;
    let report = MkfsReport {
        image: args.image.clone(),
        sha256,
        bytes: info.size,
        inodes: info.inodes,
        format_version: info.version,
        files_stored: stored,
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &report, |r| {
        format!(
            "{}: {} bytes, {} inodes, composefs format {}, sha256 {}",
            r.image.display(),
            r.bytes,
            r.inodes,
            r.format_version,
            r.sha256
        )
    })
}

/// Writes the image next to its destination and renames it into place, so
/// a failure never leaves a half-written image under the final name.
fn write_image_atomically<T>(
    dest: &Path,
    write: impl FnOnce(&mut HashingWriter<BufWriter<File>>) -> Result<T>,
) -> Result<(T, String)> {
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dest
        .file_name()
        .with_context(|| format!("image path {} has no file name", dest.display()))?;
    if dest.is_dir() {
        bail!("image path {} is a directory", dest.display());
    }
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = HashingWriter {
            inner: BufWriter::with_capacity(1 << 20, f),
            hash: Sha256::new(),
        };
        let v = write(&mut w).with_context(|| format!("writing image {}", dest.display()))?;
        w.flush()
            .with_context(|| format!("writing image {}", dest.display()))?;
        let HashingWriter { inner, hash } = w;
        let f = inner
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing image {}", dest.display()))?;
        f.sync_all()
            .with_context(|| format!("syncing image {}", dest.display()))?;
        std::fs::rename(&tmp, dest)
            .with_context(|| format!("renaming {} to {}", tmp.display(), dest.display()))?;
        Ok((v, hex::encode(hash.finalize())))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
