//! Images: EROFS metadata images stored as `images/<sha256>`.
//!
//! This module owns writing images into the store ([`ImageWriter`],
//! [`Store::add_image`]) and finding them. It never looks inside an image
//! (that is the erofs crate's job) and never replaces or modifies one once
//! it is published.

use std::fs::{self, File};
use std::io::{self, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::object::{copy_contents, is_lower_hex, CopyError};
use crate::tmp::{sync_dir, TmpFile};
use crate::{Store, StoreError};

/// Whether `s` is an image digest as the store names images: 64 lowercase
/// hex digits.
pub fn is_image_digest(s: &str) -> bool {
    s.len() == 64 && is_lower_hex(s)
}

impl Store {
    /// `<root>/images`.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }

    /// `<root>/images/<digest>`. `digest` should pass [`is_image_digest`];
    /// this does not check (it cannot fail), so never pass it unchecked
    /// input.
    pub fn image_path(&self, digest: &str) -> PathBuf {
        debug_assert!(is_image_digest(digest), "bad image digest {digest:?}");
        self.images_dir().join(digest)
    }

    /// The bytes of the image's EROFS file; an error names the image.
    pub fn read_image(&self, digest: &str) -> Result<Vec<u8>, StoreError> {
        fs::read(self.image_path(digest)).map_err(|error| StoreError::Source {
            op: "reading",
            what: format!("image {digest}"),
            error,
        })
    }

    /// Whether the image is in the store. False for anything that is not a
    /// valid digest.
    pub fn has_image(&self, digest: &str) -> bool {
        is_image_digest(digest)
            && fs::symlink_metadata(self.image_path(digest))
                .map(|m| m.is_file())
                .unwrap_or(false)
    }

    /// Starts writing a new image into the staging area. Write it through
    /// `Write`/`Seek` (or [`ImageWriter::file`]), then
    /// [`commit`](ImageWriter::commit); dropping it uncommitted removes it.
    pub fn image_writer(&self) -> Result<ImageWriter, StoreError> {
        let tmp = self.staging()?.tmp_file("image")?;
        Ok(ImageWriter {
            tmp,
            images_dir: self.images_dir(),
            root: self.root.clone(),
            verity: self.verity_supported(),
        })
    }

    /// Copies the image file at `src` into the store (cloning its extents
    /// where the filesystem can) and returns its digest. The digest is of
    /// the copy, so a source changing meanwhile cannot mislabel it.
    pub fn add_image(&self, src: &Path) -> Result<String, StoreError> {
        let what = src.display().to_string();
        let src_err = |error| StoreError::Source {
            op: "reading",
            what: what.clone(),
            error,
        };
        let file = File::open(src).map_err(src_err)?;
        let len = file.metadata().map_err(src_err)?.len();
        let writer = self.image_writer()?;
        match copy_contents(&file, writer.file(), len) {
            Ok(()) => {}
            Err(CopyError::Short) => {
                return Err(StoreError::SourceChanged {
                    what,
                    root: self.root.clone(),
                })
            }
            Err(CopyError::Read(e)) => return Err(src_err(e)),
            Err(CopyError::Write(e)) => return Err(writer.tmp.err("writing image", e)),
        }
        writer.commit()
    }

    /// Every image digest in the store, in no particular order. Names that
    /// are not digests are skipped.
    pub fn list_images(&self) -> Result<Images, StoreError> {
        let dir = self.images_dir();
        let inner =
            fs::read_dir(&dir).map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
        Ok(Images {
            dir,
            root: self.root.clone(),
            inner,
        })
    }
}

/// Iterator over the image digests of a store; see [`Store::list_images`].
#[derive(Debug)]
pub struct Images {
    dir: PathBuf,
    root: PathBuf,
    inner: fs::ReadDir,
}

impl Iterator for Images {
    type Item = Result<String, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.inner.next()? {
                Ok(entry) => match entry.file_name().to_str() {
                    Some(name) if is_image_digest(name) => return Some(Ok(name.to_owned())),
                    _ => continue,
                },
                Err(e) => return Some(Err(StoreError::io("listing", &self.dir, &self.root, e))),
            }
        }
    }
}

/// A new image being written in the staging area. Nothing is visible in
/// `images/` until [`commit`](Self::commit); dropping the writer without
/// committing removes the staged file.
#[derive(Debug)]
pub struct ImageWriter {
    tmp: TmpFile,
    images_dir: PathBuf,
    root: PathBuf,
    /// Seal the image with fs-verity before publishing it (where the
    /// store's filesystem can): its fs-verity digest is what `cairn mount
    /// --digest` checks, as composefs's image digest.
    verity: bool,
}

impl ImageWriter {
    /// The staged file, for positional writes (`FileExt::write_at`).
    pub fn file(&self) -> &File {
        self.tmp.file()
    }

    /// Where the staged file is, for tools that write by path. It is
    /// removed if the writer is dropped uncommitted.
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// Syncs the image, names it by the SHA-256 of its bytes and moves it to
    /// `images/<sha256>`; returns the digest. If that image exists already,
    /// the staged copy is dropped and the existing one kept.
    pub fn commit(mut self) -> Result<String, StoreError> {
        let file = self.tmp.file();
        file.sync_all()
            .map_err(|e| self.tmp.err("syncing image", e))?;
        let digest = sha256_of(file).map_err(|e| self.tmp.err("reading image", e))?;
        file.set_permissions(fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE))
            .map_err(|e| self.tmp.err("setting mode of image", e))?;
        self.tmp.close();
        if self.verity {
            crate::kernel::enable_on_path(self.tmp.path()).map_err(|error| StoreError::Verity {
                path: self
                    .tmp
                    .path()
                    .strip_prefix(&self.root)
                    .unwrap_or(self.tmp.path())
                    .into(),
                root: self.root.clone(),
                error,
            })?;
        }
        let dest = self.images_dir.join(&digest);
        let persisted = self.tmp.persist(&dest, false)?;
        if persisted == crate::tmp::Persisted::Created {
            sync_dir(&self.images_dir, &self.root)?;
        }
        Ok(digest)
    }
}

impl Write for ImageWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tmp.file().write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Seek for ImageWriter {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.tmp.file().seek(pos)
    }
}

/// SHA-256 of the whole file, read positionally from offset 0.
fn sha256_of(file: &File) -> io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut off = 0u64;
    loop {
        let n = match file.read_at(&mut buf, off) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        off += n as u64;
    }
    Ok(hex::encode(hasher.finalize()))
}
