//! Naming images: what a user types for an image (a ref, an image digest or
//! a prefix of one, a path to an image file) turned into the image.
//!
//! This module owns the lookup rules and nothing else. It never writes to
//! the store, and never reads an image's contents (a path that exists is
//! returned as a file whatever it holds; the caller's reader judges it).
//!
//! # Rules, in order
//!
//! 1. An argument that starts with `/`, `./` or `../` is a path, nothing
//!    else (the way to name a file that has the name of a ref).
//! 2. A ref of that name (an image name whose `/` the store maps, through
//!    [`Store::ref_candidates`]).
//! 3. An image digest, with or without `sha256:`: 64 hex digits, or a prefix
//!    of at least [`MIN_DIGEST_PREFIX`] that exactly one image starts with
//!    (more than one is an error listing them).
//! 4. An existing file.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::image::is_image_digest;
use crate::object::is_lower_hex;
use crate::refs::validate_ref_name;
use crate::{Store, StoreError};

/// Fewest hex digits a digest prefix needs: short ones (`ab12`) are too
/// easily a name or a typo.
pub const MIN_DIGEST_PREFIX: usize = 12;

/// How a name was resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// Through this ref.
    Ref(String),
    /// By its digest or a prefix of it.
    Digest,
    /// A file that is not (known to be) in the store.
    File,
}

/// An image found by [`Store::resolve_image`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The image file: `images/<digest>` for images in the store.
    pub path: PathBuf,
    /// The image digest, for images in the store; `None` for a file.
    pub digest: Option<String>,
    pub source: ImageSource,
}

impl Store {
    /// Opens an existing store without creating, cleaning or locking
    /// anything: for commands that only read. Fails if `root` has no
    /// `images/` and `refs/` directories.
    pub fn open_existing(root: &Path) -> Result<Store, StoreError> {
        let root = std::path::absolute(root)
            .map_err(|e| StoreError::io("resolving store root", root, root, e))?;
        for dir in ["images", "refs", "objects"] {
            let path = root.join(dir);
            match fs::metadata(&path) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(StoreError::io(
                        "opening store directory",
                        &path,
                        &root,
                        io::Error::from(io::ErrorKind::NotADirectory),
                    ))
                }
                Err(e) => return Err(StoreError::io("opening store directory", &path, &root, e)),
            }
        }
        Ok(Store {
            root,
            staging: Mutex::new(None),
            verity: OnceLock::new(),
            fanouts: OnceLock::new(),
            anonymous: OnceLock::new(),
        })
    }

    /// Finds the image `arg` names; see the module docs for the rules.
    pub fn resolve_image(&self, arg: &str) -> Result<ResolvedImage, StoreError> {
        let explicit_path = arg.starts_with('/') || arg.starts_with("./") || arg.starts_with("../");
        if !explicit_path {
            for name in self.ref_candidates(arg) {
                if let Some(digest) = self.get_ref(&name)? {
                    return Ok(ResolvedImage {
                        path: self.image_path(&digest),
                        digest: Some(digest),
                        source: ImageSource::Ref(name),
                    });
                }
            }
            if let Some(hex) = digest_like(arg) {
                if let Some(digest) = self.find_image_by_prefix(&hex)? {
                    return Ok(ResolvedImage {
                        path: self.image_path(&digest),
                        digest: Some(digest),
                        source: ImageSource::Digest,
                    });
                }
            }
        }
        match fs::metadata(arg) {
            Ok(m) if m.is_file() => Ok(ResolvedImage {
                path: PathBuf::from(arg),
                digest: None,
                source: ImageSource::File,
            }),
            _ => Err(StoreError::NoSuchImage {
                name: arg.to_owned(),
                root: self.root.clone(),
            }),
        }
    }

    /// The image whose digest starts with `prefix` (lowercase hex, at least
    /// [`MIN_DIGEST_PREFIX`] digits), `None` if there is none, an error if
    /// there are several.
    pub fn find_image_by_prefix(&self, prefix: &str) -> Result<Option<String>, StoreError> {
        if is_image_digest(prefix) {
            return Ok(self.has_image(prefix).then(|| prefix.to_owned()));
        }
        if prefix.len() < MIN_DIGEST_PREFIX || !is_lower_hex(prefix) {
            return Ok(None);
        }
        let mut found = Vec::new();
        for digest in self.list_images()? {
            let digest = digest?;
            if digest.starts_with(prefix) {
                found.push(digest);
            }
        }
        found.sort();
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => Err(StoreError::AmbiguousImagePrefix {
                prefix: prefix.to_owned(),
                candidates: found,
            }),
        }
    }

    /// The ref names `arg` may be stored under: itself when it is a valid
    /// ref name, then what the image-name mapping makes of it (image names
    /// hold `/`, ref names cannot).
    pub fn ref_candidates(&self, arg: &str) -> Vec<String> {
        let mut names = Vec::new();
        if validate_ref_name(arg).is_ok() {
            names.push(arg.to_owned());
        }
        if let Some(mapped) = crate::graph::mapped_ref_name(arg) {
            if !names.contains(&mapped) && validate_ref_name(&mapped).is_ok() {
                names.push(mapped);
            }
        }
        names
    }

    /// The names (refs) that point at `digest`, sorted.
    pub fn names_of(&self, digest: &str) -> Result<Vec<String>, StoreError> {
        Ok(self
            .list_refs()?
            .into_iter()
            .filter(|(_, d)| d == digest)
            .map(|(n, _)| n)
            .collect())
    }
}

/// The lowercase hex digits of `arg` if it looks like a digest or a prefix
/// of one (`sha256:` optional, either case).
fn digest_like(arg: &str) -> Option<String> {
    let hex = arg
        .strip_prefix("sha256:")
        .unwrap_or(arg)
        .to_ascii_lowercase();
    (hex.len() >= MIN_DIGEST_PREFIX && hex.len() <= 64 && is_lower_hex(&hex)).then_some(hex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_like_takes_prefixes_with_and_without_algorithm() {
        assert_eq!(
            digest_like("sha256:ABCDEF012345").as_deref(),
            Some("abcdef012345")
        );
        assert_eq!(digest_like("abcdef012345").as_deref(), Some("abcdef012345"));
        assert_eq!(digest_like("abcdef01234"), None, "11 digits is too short");
        assert_eq!(digest_like("debian:12"), None);
        assert_eq!(digest_like(&"a".repeat(65)), None);
    }
}
