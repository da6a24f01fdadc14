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
    /// The image file to write (optional with --name: the image is then only in the store).
    #[arg(required_unless_present = "name")]
    pub image: Option<PathBuf>,
    /// SOURCE is a composefs dumpfile.
    #[arg(long)]
    pub from_dump: bool,
    /// Accept what composefs accepts when not strict (only with --from-dump).
    #[arg(long, requires = "from_dump")]
    pub lenient: bool,
    /// Also copy file contents into the store's objects/ (reflinked where possible).
    #[arg(long, conflicts_with = "from_dump")]
    pub store: bool,
    /// Also put the image into the store (images/) under this name (any image name, e.g. mytree:1); needs --store.
    #[arg(long, requires = "store")]
    pub name: Option<String>,
    /// Write exactly this composefs format version (default: 0, or 1 where the tree has whiteouts).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1))]
    pub format_version: Option<u32>,
    /// Keep regular files of up to this many bytes inside the image.
    #[arg(long, value_name = "BYTES", default_value_t = cairn_erofs::tree::DEFAULT_INLINE_THRESHOLD, conflicts_with = "from_dump")]
    pub inline_threshold: u64,
    /// Leave extended attributes out.
    #[arg(long, conflicts_with = "from_dump")]
    pub skip_xattrs: bool,
    /// Threads reading and hashing files (0: four per core, since
    /// reading a cold tree waits on the disk more than it computes).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        conflicts_with = "from_dump"
    )]
    pub threads: usize,
}

#[derive(Serialize)]
struct MkfsReport {
    image: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
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
    let ref_name = match &args.name {
        Some(name) => {
            let r = cairn_store::ref_name_for(name);
            cairn_store::validate_ref_name(&r).with_context(|| format!("name {name:?}"))?;
            Some(r)
        }
        None => None,
    };
    let mut store = None;
    // Writers hold the store lock shared from their first object to the
    // ref that makes the image reachable, so gc never takes half of it.
    let mut _lock = None;
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
        if args.store {
            let s = cairn_store::Store::open(&g.root)
                .with_context(|| format!("opening the store at {}", g.root.display()))?;
            _lock = Some(s.lock_shared().context("locking the store")?);
            store = Some(s);
        }
        let opts = cairn_image::ScanOptions {
            store: store.as_ref(),
            inline_threshold: args.inline_threshold,
            skip_xattrs: args.skip_xattrs,
            threads: args.threads,
            metadata_only: false,
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
    let write = |w: &mut dyn Write| {
        cairn_erofs::writer::mkfs_erofs(&tree, &wopts, &mut &mut *w).map_err(anyhow::Error::from)
    };
    let (info, sha256, image) = match (&args.image, &store) {
        (Some(path), _) => {
            let (info, sha256) = write_image_atomically(path, |w| write(w))?;
            (info, sha256, path.clone())
        }
        (None, Some(store)) => {
            let mut w = BufWriter::with_capacity(1 << 20, store.image_writer()?);
            let info = write(&mut w).context("writing image into the store")?;
            let writer = w
                .into_inner()
                .map_err(|e| e.into_error())
                .context("writing image into the store")?;
            let digest = writer.commit().context("adding the image to the store")?;
            let path = store.image_path(&digest);
            (info, digest, path)
        }
        (None, None) => bail!("no image path and no --name"),
    };
    if let (Some(store), Some(ref_name)) = (&store, &ref_name) {
        let digest = if args.image.is_some() {
            store
                .add_image(&image)
                .with_context(|| format!("copying image {} into the store", image.display()))?
        } else {
            sha256.clone()
        };
        store.set_ref(ref_name, &digest).with_context(|| {
            format!(
                "naming image {digest} {:?}",
                args.name.as_deref().unwrap_or("")
            )
        })?;
    }
    let report = MkfsReport {
        image,
        name: args.name.clone(),
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
