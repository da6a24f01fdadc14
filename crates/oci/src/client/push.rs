//! Writing to a registry and reading parts of blobs: blob uploads
//! (`HEAD` to skip what is there, then `POST` and one monolithic `PUT`),
//! manifest and index `PUT`s, the referrers API, and `Range` reads of a
//! blob segment. Each goes through the same authentication, redirect and
//! retry logic as a pull.
//!
//! Nothing here checks a digest of what it reads: a segment of a blob has
//! no digest of its own, and its reader (`cairn-remote`) verifies the
//! objects it decodes from it before anything is published.

use std::io::Read;

use super::http::{error_message, paren, read_capped, read_exact_progress, Req};
use super::{BodySize, Failure, Registry};
use crate::digest::Digest;
use crate::PullError;

/// Largest referrers index read.
const MAX_REFERRERS: u64 = 4 << 20;
/// Largest blob segment read with one range request.
pub const MAX_RANGE: u64 = 256 << 20;

/// What `GET /v2/<name>/referrers/<digest>` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Referrers {
    /// The registry has the API; its answer (an image index), unparsed.
    Index(Vec<u8>),
    /// The registry has no referrers API (404 and the like): use the
    /// referrers tag schema instead.
    NoApi,
}

impl Registry {
    /// Whether blob `digest` is in `repo` (`HEAD`).
    pub fn blob_exists(&self, repo: &str, digest: &Digest) -> Result<bool, PullError> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        let what = format!("blob {digest}");
        self.with_retries(&what, || {
            let req = Req {
                method: "HEAD",
                ..Req::get(&path)
            };
            let answer = self.request(repo, &req, &what, None)?;
            Ok(answer.resp.status() != 404)
        })
    }

    /// Uploads `data` as blob `digest` of `repo` unless it is there
    /// already; returns whether it was uploaded. The caller vouches for
    /// the digest; the registry checks it too.
    pub fn push_blob(
        &self,
        repo: &str,
        digest: &Digest,
        data: &[u8],
        what: &str,
    ) -> Result<bool, PullError> {
        if self.blob_exists(repo, digest)? {
            return Ok(false);
        }
        let start = format!("/v2/{repo}/blobs/uploads/");
        self.with_retries(what, || {
            // A fresh upload session each attempt: a failed PUT may have
            // ended the last one.
            let req = Req {
                method: "POST",
                body: Some((&[], "application/octet-stream")),
                ..Req::get(&start)
            };
            let answer = self.request(
                repo,
                &req,
                what,
                Some(&|_, msg| self.upload_refused(repo, 404, msg, what)),
            )?;
            let status = answer.resp.status();
            let Some(location) = answer.resp.header("Location").map(str::to_string) else {
                return Err(PullError::Http {
                    what: what.to_string(),
                    registry: self.name.clone(),
                    status,
                    detail: " (an upload session without a Location)".to_string(),
                }
                .into());
            };
            let url = super::http::resolve_location(&format!("{}{start}", self.base), &location);
            let sep = if url.contains('?') { '&' } else { '?' };
            let put = format!("{url}{sep}digest={digest}");
            let req = Req {
                method: "PUT",
                body: Some((data, "application/octet-stream")),
                ..Req::get(&put)
            };
            let answer = self.request(
                repo,
                &req,
                what,
                Some(&|_, msg| self.upload_refused(repo, 404, msg, what)),
            )?;
            match answer.resp.status() {
                201 | 204 | 200 => Ok(true),
                s => Err(self
                    .upload_refused(repo, s, &error_message(answer.resp).1, what)
                    .into()),
            }
        })
    }

    /// Puts a manifest or index under `reference` (a tag or its digest).
    pub fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        bytes: &[u8],
        what: &str,
    ) -> Result<(), PullError> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let digest = Digest::of(bytes);
        self.with_retries(what, || {
            let req = Req {
                method: "PUT",
                body: Some((bytes, media_type)),
                ..Req::get(&path)
            };
            let answer = self.request(
                repo,
                &req,
                what,
                Some(&|_, msg| self.upload_refused(repo, 404, msg, what)),
            )?;
            let said = answer
                .resp
                .header("Docker-Content-Digest")
                .map(|d| d.trim().to_string());
            if let Some(said) = said.filter(|d| *d != digest.as_str()) {
                return Err(PullError::DigestMismatch {
                    what: format!("{what} (the registry's Docker-Content-Digest)"),
                    expected: digest.to_string(),
                    actual: said,
                }
                .into());
            }
            Ok(())
        })
    }

    /// `GET /v2/<repo>/referrers/<subject>?artifactType=…`.
    pub fn referrers(
        &self,
        repo: &str,
        subject: &Digest,
        artifact_type: Option<&str>,
    ) -> Result<Referrers, PullError> {
        let mut path = format!("/v2/{repo}/referrers/{subject}");
        if let Some(t) = artifact_type {
            path.push_str("?artifactType=");
            path.push_str(&t.replace('+', "%2B"));
        }
        let what = format!("referrers of {subject}");
        self.with_retries(&what, || {
            let req = Req {
                accept: Some(crate::spec::media_type::OCI_INDEX),
                ..Req::get(&path)
            };
            let answer = match self.request(repo, &req, &what, None) {
                Ok(a) => a,
                // Registries without the API answer 404, 400 or 405.
                Err(Failure::Fatal(PullError::Http {
                    status: 400 | 405, ..
                })) => return Ok(Referrers::NoApi),
                Err(e) => return Err(e),
            };
            if answer.resp.status() == 404 {
                let _ = error_message(answer.resp);
                return Ok(Referrers::NoApi);
            }
            let bytes = read_capped(answer.resp, BodySize::AtMost(MAX_REFERRERS), &what)?;
            Ok(Referrers::Index(bytes))
        })
    }

    /// Bytes `offset..offset + len` of blob `digest` (a `Range` request;
    /// where the registry ignores `Range`, the blob is read from its start
    /// and the bytes before `offset` dropped). Exactly `len` bytes, or an
    /// error. They are not verified here.
    pub fn fetch_blob_range(
        &self,
        repo: &str,
        digest: &Digest,
        offset: u64,
        len: u64,
        what: &str,
    ) -> Result<Vec<u8>, PullError> {
        self.fetch_blob_range_progress(repo, digest, offset, len, what, &mut |_| {})
    }

    /// [`fetch_blob_range`](Self::fetch_blob_range), calling `progress`
    /// with the bytes of the range that have arrived so far (a prefix,
    /// growing) each time more arrive, so that the caller can use the
    /// start of the range while the rest is on its way. A retry starts
    /// again from the range's first byte: `progress` then sees shorter
    /// prefixes again (of the same bytes, if the registry serves the same
    /// blob; nothing here checks that).
    pub fn fetch_blob_range_progress(
        &self,
        repo: &str,
        digest: &Digest,
        offset: u64,
        len: u64,
        what: &str,
        progress: &mut dyn FnMut(&[u8]),
    ) -> Result<Vec<u8>, PullError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        if len > MAX_RANGE {
            return Err(PullError::TooLarge {
                what: what.to_string(),
                size: Some(len),
                limit: MAX_RANGE,
            });
        }
        let last = offset
            .checked_add(len - 1)
            .ok_or_else(|| PullError::Invalid {
                what: what.to_string(),
                detail: format!("range {offset}+{len} overflows"),
            })?;
        let path = format!("/v2/{repo}/blobs/{digest}");
        self.with_retries(what, || {
            let req = Req {
                range: Some((offset, Some(last))),
                ..Req::get(&path)
            };
            let repository = format!("{}/{repo}", self.name);
            let not_found = |_: &str, _: &str| PullError::BlobUnknown {
                digest: digest.to_string(),
                repository: repository.clone(),
            };
            let answer = self.request(repo, &req, what, Some(&not_found))?;
            let resp = answer.resp;
            let partial = resp.status() == 206;
            if partial {
                let expected = format!("bytes {offset}-{last}/");
                let ok = resp
                    .header("Content-Range")
                    .is_some_and(|cr| cr.trim().starts_with(&expected));
                if !ok {
                    return Err(PullError::Http {
                        what: what.to_string(),
                        registry: self.name.clone(),
                        status: 206,
                        detail: paren(&format!(
                            "asked for bytes {offset}-{last}, got Content-Range {:?}",
                            resp.header("Content-Range").unwrap_or("")
                        )),
                    }
                    .into());
                }
                return read_exact_progress(resp, len, what, &mut *progress);
            }
            // No range support: skip to `offset`, then read `len` bytes.
            tracing::debug!("{what}: the registry ignored Range; reading from the start");
            let mut body = resp.into_reader();
            let skipped = std::io::copy(&mut (&mut body).take(offset), &mut std::io::sink());
            let mut buf = Vec::new();
            let read = skipped.and_then(|_| (&mut body).take(len).read_to_end(&mut buf));
            match read {
                Ok(_) if buf.len() as u64 == len => {
                    progress(&buf);
                    Ok(buf)
                }
                Ok(_) => Err(PullError::SizeMismatch {
                    what: what.to_string(),
                    expected: len,
                    actual: buf.len() as u64,
                }
                .into()),
                Err(e) => Err(Failure::Transient {
                    timed_out: matches!(
                        e.kind(),
                        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                    ),
                    detail: format!("reading the answer: {}", super::http::describe_io(&e)),
                    retry_after: None,
                }),
            }
        })
    }

    fn upload_refused(&self, repo: &str, status: u16, msg: &str, what: &str) -> PullError {
        PullError::Http {
            what: format!("{what} (uploading to {}/{repo})", self.name),
            registry: self.name.clone(),
            status,
            detail: paren(msg),
        }
    }
}
