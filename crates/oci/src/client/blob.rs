//! [`BlobReader`]: a layer blob streamed from the registry, its size
//! held to the descriptor's, resumed with `Range` after transient errors.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::http::describe_io;
use super::{Failure, Registry};
use crate::digest::Digest;
use crate::PullError;

impl Registry {
    /// A reader of blob `digest` of `size` bytes, fetched lazily and resumed
    /// on transient errors. `on_event` hears about progress and retries.
    pub fn blob_reader<'a>(
        &'a self,
        repo: &str,
        digest: &Digest,
        size: u64,
        cancel: Option<&'a AtomicBool>,
        on_event: Box<dyn FnMut(BlobEvent) + Send + 'a>,
    ) -> BlobReader<'a> {
        BlobReader {
            reg: self,
            repo: repo.to_string(),
            path: format!("/v2/{repo}/blobs/{digest}"),
            what: format!("blob {digest}"),
            digest: digest.to_string(),
            size,
            pos: 0,
            body: None,
            failures: 0,
            cancel,
            on_event,
            error: Arc::new(Mutex::new(None)),
        }
    }
}

/// What a [`BlobReader`] reports as it goes.
#[derive(Debug, Clone)]
pub enum BlobEvent {
    /// Bytes of the blob read so far.
    Progress(u64),
    /// A transient failure; `attempt` (2, 3, …) comes next.
    Retry { attempt: u32, detail: String },
}

/// A blob as a `Read`: fetched on first read, never read more than one
/// byte past its stated size (a body that has that byte is
/// [`PullError::TooLong`]), resumed after transient errors. A failure that ends it is kept in
/// [`BlobReader::error_slot`], so the caller can report it as it was rather
/// than as the `io::Error` the consumer of the stream saw.
pub struct BlobReader<'a> {
    reg: &'a Registry,
    repo: String,
    path: String,
    what: String,
    digest: String,
    size: u64,
    pos: u64,
    body: Option<Box<dyn Read + Send + Sync + 'static>>,
    /// Failed attempts so far.
    failures: u32,
    cancel: Option<&'a AtomicBool>,
    on_event: Box<dyn FnMut(BlobEvent) + Send + 'a>,
    error: Arc<Mutex<Option<PullError>>>,
}

impl BlobReader<'_> {
    /// Where the error that ended this reader is kept.
    pub fn error_slot(&self) -> Arc<Mutex<Option<PullError>>> {
        Arc::clone(&self.error)
    }

    /// Bytes read so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Records a fatal error and turns it into the `io::Error` the consumer sees.
    fn fail(&mut self, e: PullError) -> io::Error {
        let err = io::Error::other(e.to_string());
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        err
    }

    /// After a transient failure: gives up when attempts are spent, else
    /// waits and lets the next read reopen.
    fn transient(
        &mut self,
        detail: String,
        retry_after: Option<Duration>,
        timed_out: bool,
    ) -> io::Result<()> {
        self.body = None;
        self.failures += 1;
        let max = self.reg.opts.max_attempts.max(1);
        if self.failures >= max {
            let e = self
                .reg
                .gave_up(&self.what, detail, timed_out, self.failures);
            return Err(self.fail(e));
        }
        let delay = self.reg.delay(self.failures, retry_after);
        tracing::info!(
            "{}: {detail} at byte {}; retrying in {delay:?}",
            self.what,
            self.pos
        );
        (self.on_event)(BlobEvent::Retry {
            attempt: self.failures + 1,
            detail,
        });
        std::thread::sleep(delay);
        Ok(())
    }

    /// Opens the body at `self.pos`.
    fn open(&mut self) -> io::Result<()> {
        let range = (self.pos > 0).then_some(self.pos);
        let digest = self.digest.clone();
        let repo = format!("{}/{}", self.reg.name, self.repo);
        let not_found = move |_: &str, _: &str| PullError::BlobUnknown {
            digest: digest.clone(),
            repository: repo.clone(),
        };
        let answer = match self
            .reg
            .request_once(&self.repo, &self.path, None, range, &self.what, &not_found)
        {
            Ok(a) => a,
            Err(Failure::Fatal(e)) => return Err(self.fail(e)),
            Err(Failure::Transient {
                detail,
                retry_after,
                timed_out,
            }) => return self.transient(detail, retry_after, timed_out),
        };
        let resp = answer.resp;
        let status = resp.status();
        let content_length = resp
            .header("Content-Length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        let resumed = status == 206
            && resp
                .header("Content-Range")
                .is_some_and(|cr| cr.trim().starts_with(&format!("bytes {}-", self.pos)));
        let remaining = self.size - if resumed { self.pos } else { 0 };
        if let Some(len) = content_length {
            if len != remaining {
                let e = PullError::SizeMismatch {
                    what: self.what.clone(),
                    expected: self.size,
                    actual: if resumed { self.pos + len } else { len },
                };
                return Err(self.fail(e));
            }
        }
        let mut body = resp.into_reader();
        if range.is_some() && !resumed {
            // The registry ignored Range: fetch it all again and skip what
            // the consumer already has. The digest check covers both parts.
            tracing::debug!(
                "{}: no range support; skipping {} bytes",
                self.what,
                self.pos
            );
            let skipped = io::copy(&mut (&mut body).take(self.pos), &mut io::sink());
            match skipped {
                Ok(n) if n == self.pos => {}
                Ok(n) => {
                    return self.transient(
                        format!("connection closed after {n} of {} bytes", self.size),
                        None,
                        false,
                    )
                }
                Err(e) => {
                    let timed_out = matches!(
                        e.kind(),
                        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                    );
                    return self.transient(describe_io(&e), None, timed_out);
                }
            }
        }
        self.body = Some(body);
        Ok(())
    }
}

impl Read for BlobReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.pos >= self.size {
            // One byte past the descriptor's size: a body that goes on is
            // longer than the descriptor says (without a Content-Length to
            // have said so first). A failure here is no loss: every byte
            // the consumer needs has come.
            if let Some(mut body) = self.body.take() {
                let mut probe = [0u8; 1];
                if matches!(body.read(&mut probe), Ok(1)) {
                    let e = PullError::TooLong {
                        what: self.what.clone(),
                        expected: self.size,
                    };
                    return Err(self.fail(e));
                }
            }
            return Ok(0);
        }
        loop {
            if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(self.fail(PullError::Cancelled));
            }
            if self.body.is_none() {
                self.open()?;
                if self.body.is_none() {
                    continue;
                }
            }
            let want = buf
                .len()
                .min(usize::try_from(self.size - self.pos).unwrap_or(usize::MAX));
            let Some(body) = self.body.as_mut() else {
                continue;
            };
            match body.read(&mut buf[..want]) {
                Ok(0) => {
                    let detail = format!(
                        "connection closed after {} of {} bytes",
                        self.pos, self.size
                    );
                    self.transient(detail, None, false)?;
                }
                Ok(n) => {
                    self.pos += n as u64;
                    (self.on_event)(BlobEvent::Progress(self.pos));
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let timed_out = matches!(
                        e.kind(),
                        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                    );
                    self.transient(describe_io(&e), None, timed_out)?;
                }
            }
        }
    }
}
