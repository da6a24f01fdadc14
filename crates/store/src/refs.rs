//! Refs: names under `refs/` that point at image digests.
//!
//! This module owns `refs/`: checking names, and writing each ref atomically
//! (staged, fsynced, renamed over the old one). A ref file holds the image
//! digest and a newline. It must never write a ref to an image that is not
//! in `images/`, and never let a name leave `refs/` (no `/`, no `..`).

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use crate::image::is_image_digest;
use crate::tmp::sync_dir;
use crate::{Store, StoreError};

/// Longest ref name: a single path component on any Linux filesystem.
pub const MAX_REF_NAME: usize = 255;

/// Checks that `name` can be a ref: 1 to 255 bytes, no `/`, no NUL or other
/// control characters, not starting with `.` and without `..` anywhere (so
/// it is never `.`/`..` and never collides with hidden or staging files).
/// Everything else (`:`, `@`, letters of any script) is allowed, so image
/// tags fit once the caller maps their `/`.
pub fn validate_ref_name(name: &str) -> Result<(), StoreError> {
    let reject = |reason| {
        Err(StoreError::InvalidRefName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return reject("empty");
    }
    if name.len() > MAX_REF_NAME {
        return reject("longer than 255 bytes");
    }
    if name.contains('/') {
        return reject("contains '/'");
    }
    if name.starts_with('.') {
        return reject("starts with '.'");
    }
    if name.contains("..") {
        return reject("contains '..'");
    }
    if name.chars().any(char::is_control) {
        return reject("contains a control character");
    }
    Ok(())
}

impl Store {
    /// `<root>/refs`.
    pub fn refs_dir(&self) -> PathBuf {
        self.root.join("refs")
    }

    fn ref_path(&self, name: &str) -> Result<PathBuf, StoreError> {
        validate_ref_name(name)?;
        Ok(self.refs_dir().join(name))
    }

    /// Points `name` at the image `digest`, replacing what it pointed at.
    /// The image must be in the store.
    pub fn set_ref(&self, name: &str, digest: &str) -> Result<(), StoreError> {
        let path = self.ref_path(name)?;
        if !is_image_digest(digest) {
            return Err(StoreError::InvalidImageDigest(digest.to_owned()));
        }
        if !self.has_image(digest) {
            return Err(StoreError::ImageNotFound {
                digest: digest.to_owned(),
                root: self.root.clone(),
            });
        }
        let tmp = self.staging()?.tmp_file("ref")?;
        let mut file = tmp.file();
        file.write_all(format!("{digest}\n").as_bytes())
            .map_err(|e| tmp.err("writing ref", e))?;
        file.set_permissions(fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE))
            .map_err(|e| tmp.err("setting mode of ref", e))?;
        file.sync_all().map_err(|e| tmp.err("syncing ref", e))?;
        tmp.persist(&path, true)?;
        sync_dir(&self.refs_dir(), &self.root)
    }

    /// The image digest `name` points at, or `None` if there is no such ref.
    pub fn get_ref(&self, name: &str) -> Result<Option<String>, StoreError> {
        let path = self.ref_path(name)?;
        let text = match fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io("reading ref", &path, &self.root, e)),
        };
        let corrupt = |reason: &str| StoreError::CorruptRef {
            name: name.to_owned(),
            root: self.root.clone(),
            reason: reason.to_owned(),
        };
        let text = std::str::from_utf8(&text).map_err(|_| corrupt("not UTF-8"))?;
        let digest = text.strip_suffix('\n').unwrap_or(text);
        if !is_image_digest(digest) {
            return Err(corrupt(&format!(
                "holds {:?}, not an image digest",
                digest.chars().take(80).collect::<String>()
            )));
        }
        Ok(Some(digest.to_owned()))
    }

    /// All refs as `(name, digest)`, sorted by name. Entries whose names are
    /// not valid ref names are skipped; a ref that does not hold a digest is
    /// an error.
    pub fn list_refs(&self) -> Result<Vec<(String, String)>, StoreError> {
        let dir = self.refs_dir();
        let entries =
            fs::read_dir(&dir).map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
        let mut refs = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| StoreError::io("listing", &dir, &self.root, e))?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if validate_ref_name(&name).is_err() {
                continue;
            }
            // Removed since the listing: not an error, just gone.
            if let Some(digest) = self.get_ref(&name)? {
                refs.push((name, digest));
            }
        }
        refs.sort();
        Ok(refs)
    }

    /// Removes the ref; returns whether it existed.
    pub fn remove_ref(&self, name: &str) -> Result<bool, StoreError> {
        let path = self.ref_path(name)?;
        match fs::remove_file(&path) {
            Ok(()) => {
                sync_dir(&self.refs_dir(), &self.root)?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::io("removing ref", &path, &self.root, e)),
        }
    }
}
