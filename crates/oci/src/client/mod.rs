//! The registry client: HTTP requests to one registry's `/v2/` API, with
//! authentication, redirects, retries and size-capped reads.
//!
//! What it does with each answer:
//! - **401**: read the `WWW-Authenticate` challenge; for `Basic`, send the
//!   credentials from the auth files; for `Bearer`, get a token from the
//!   realm (with the credentials, if any) for `repository:<name>:pull`,
//!   cache it per scope until it expires, and try again once. A second 401,
//!   or a 403, is an authentication failure.
//! - **3xx**: followed by hand (at most 5), so that `Authorization` goes only
//!   to the registry's own origin (blob redirects to a CDN carry their own
//!   signature) and HTTPS is never downgraded to HTTP.
//! - **429, 5xx, resets, short bodies, read timeouts**: retried with
//!   exponential backoff (honouring `Retry-After` seconds), at most
//!   `max_attempts` attempts in all. Connection refused counts as transient
//!   only once this registry has answered at all; before that it means the
//!   registry is not there, and the pull fails at once.
//!
//! Small bodies named by a descriptor (an index entry's manifest, a config)
//! must be exactly the descriptor's size ([`BodySize::Exactly`]): a
//! Content-Length that differs is refused before the body is read, and at
//! most one byte past the size is read. Blob bodies are streamed through
//! [`BlobReader`], which refuses a Content-Length other than the
//! descriptor's size, reads at most one byte past that size (to see that
//! the body ends there) and resumes a broken transfer with a
//! `Range` request (or, where the registry ignores `Range`, by fetching the
//! blob again and skipping what was already read). It does not hash: the
//! layer importer checks the digest before anything becomes visible.
//!
//! This module never writes to disk. Its parts: `http` sends one request
//! and follows redirects, `authorize` answers 401 challenges (basic and
//! bearer tokens), `blob` is the streaming, resuming [`BlobReader`]; this
//! file holds the client, its options and the retry loop.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::{self, Challenge, Credentials};
use crate::digest::Digest;
use crate::reference::ImageRef;
use crate::PullError;

mod authorize;
mod blob;
mod http;
mod push;

pub use blob::{BlobEvent, BlobReader};
use http::read_capped;
pub use push::Referrers;

/// Longest error body read for a message.
const MAX_ERROR_BODY: u64 = 64 << 10;
/// Longest token-endpoint answer read.
const MAX_TOKEN_BODY: u64 = 1 << 20;
const MAX_REDIRECTS: usize = 5;
/// Retry-After values above this are capped: a pull should fail in minutes,
/// not hang for hours on a registry's say-so.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// How the client talks to registries.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Plain HTTP for every registry (loopback registries get it anyway).
    pub insecure: bool,
    pub connect_timeout: Duration,
    /// How long a read may wait for data (idle, not total).
    pub read_timeout: Duration,
    /// Attempts per request or blob, the first included.
    pub max_attempts: u32,
    /// Delay before the first retry; doubled each time up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Auth files searched for credentials, in order.
    pub auth_files: Vec<std::path::PathBuf>,
    /// Credentials to use instead of any auth file.
    pub credentials: Option<Credentials>,
    pub user_agent: String,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            insecure: false,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            max_attempts: 4,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            auth_files: auth::default_auth_files(),
            credentials: None,
            user_agent: format!("cairn/{}", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// A manifest as served.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    pub bytes: Vec<u8>,
    pub content_type: Option<String>,
    /// The registry's `Docker-Content-Digest` header, unchecked.
    pub docker_digest: Option<String>,
}

/// How long a small body (manifest, index, config) may or must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodySize {
    /// Fetched by tag: no descriptor says its size, only a limit applies.
    AtMost(u64),
    /// Named by a descriptor of this size: a Content-Length that differs
    /// is refused before the body is read, and at most one byte more than
    /// this is read.
    Exactly(u64),
}

/// A client for one registry.
pub struct Registry {
    /// As references name it (`docker.io`, `127.0.0.1:5000`).
    name: String,
    /// `https://host[:port]` (or `http://`).
    base: String,
    agent: ureq::Agent,
    opts: ClientOptions,
    auth: Mutex<AuthState>,
    /// Set once the registry has answered anything.
    reached: AtomicBool,
    /// Tokens are asked for with `pull,push` scope.
    push: bool,
}

#[derive(Default)]
struct AuthState {
    /// The scheme the registry asked for last.
    challenge: Option<Challenge>,
    /// Bearer tokens by scope, with their expiry.
    tokens: HashMap<String, (String, Instant)>,
    /// Credentials found per repository (`None`: looked, found none).
    credentials: HashMap<String, Option<Credentials>>,
}

/// Why one attempt failed.
enum Failure {
    /// Worth another attempt.
    Transient {
        detail: String,
        retry_after: Option<Duration>,
        timed_out: bool,
    },
    Fatal(PullError),
}

impl From<PullError> for Failure {
    fn from(e: PullError) -> Self {
        Failure::Fatal(e)
    }
}

/// A successful (2xx) answer and whether it came from the registry's own
/// origin.
struct Answer {
    resp: ureq::Response,
}

impl Registry {
    /// A client for the registry of `r`.
    pub fn new(r: &ImageRef, opts: &ClientOptions) -> Registry {
        let plain = opts.insecure || r.is_loopback();
        let scheme = if plain { "http" } else { "https" };
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(opts.connect_timeout)
            .timeout_read(opts.read_timeout)
            .timeout_write(opts.read_timeout)
            .redirects(0)
            .user_agent(&opts.user_agent)
            .build();
        Registry {
            name: r.registry.clone(),
            base: format!("{scheme}://{}", r.api_host()),
            agent,
            opts: opts.clone(),
            auth: Mutex::new(AuthState::default()),
            reached: AtomicBool::new(false),
            push: false,
        }
    }

    /// A client for the registry of `r` that uploads: its bearer tokens
    /// are asked for with the scope `repository:<name>:pull,push`.
    pub fn for_push(r: &ImageRef, opts: &ClientOptions) -> Registry {
        Registry {
            push: true,
            ..Registry::new(r, opts)
        }
    }

    /// The registry as references name it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `http(s)://host[:port]`.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// Fetches a manifest (`reference`: tag or digest), accepting the media
    /// types `accept`, of `size` bytes.
    pub fn fetch_manifest(
        &self,
        repo: &str,
        reference: &str,
        accept: &[&str],
        size: BodySize,
        display: &str,
    ) -> Result<FetchedManifest, PullError> {
        let what = format!("manifest {display}");
        let path = format!("/v2/{repo}/manifests/{reference}");
        let accept = accept.join(", ");
        self.with_retries(&what, || {
            let answer =
                self.request_once(repo, &path, Some(&accept), None, &what, &|code, msg| {
                    if code == "NAME_UNKNOWN" {
                        PullError::ManifestUnknown {
                            reference: display.to_string(),
                            detail: format!(
                                " (repository {}/{repo} is not known to the registry)",
                                self.name
                            ),
                        }
                    } else {
                        PullError::ManifestUnknown {
                            reference: display.to_string(),
                            detail: if msg.is_empty() || code == "MANIFEST_UNKNOWN" {
                                String::new()
                            } else {
                                format!(" ({msg})")
                            },
                        }
                    }
                })?;
            let content_type = answer.resp.header("Content-Type").map(str::to_string);
            let docker_digest = answer
                .resp
                .header("Docker-Content-Digest")
                .map(str::to_string);
            let bytes = read_capped(answer.resp, size, &what)?;
            Ok(FetchedManifest {
                bytes,
                content_type,
                docker_digest,
            })
        })
    }

    /// Fetches a whole small blob (a config) of `size` bytes.
    pub fn fetch_blob_bytes(
        &self,
        repo: &str,
        digest: &Digest,
        size: BodySize,
        what: &str,
    ) -> Result<Vec<u8>, PullError> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        self.with_retries(what, || {
            let answer = self.request_once(repo, &path, None, None, what, &|_, _| {
                PullError::BlobUnknown {
                    digest: digest.to_string(),
                    repository: format!("{}/{repo}", self.name),
                }
            })?;
            read_capped(answer.resp, size, what)
        })
    }

    /// Runs `attempt` until it succeeds, fails for good, or `max_attempts`
    /// attempts have failed transiently (sleeping with backoff in between).
    fn with_retries<T>(
        &self,
        what: &str,
        mut attempt: impl FnMut() -> Result<T, Failure>,
    ) -> Result<T, PullError> {
        let max = self.opts.max_attempts.max(1);
        let mut n = 1;
        loop {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Transient {
                    detail,
                    retry_after,
                    timed_out,
                }) => {
                    if n >= max {
                        return Err(self.gave_up(what, detail, timed_out, n));
                    }
                    let delay = self.delay(n, retry_after);
                    tracing::info!(
                        "{what}: {detail}; retrying in {delay:?} (attempt {} of {max})",
                        n + 1
                    );
                    std::thread::sleep(delay);
                    n += 1;
                }
            }
        }
    }

    fn gave_up(&self, what: &str, detail: String, timed_out: bool, attempts: u32) -> PullError {
        if timed_out {
            PullError::Timeout {
                what: what.to_string(),
                registry: self.name.clone(),
                secs: self.opts.read_timeout.as_secs().max(1),
                attempts,
            }
        } else {
            PullError::Network {
                what: what.to_string(),
                detail,
                attempts,
            }
        }
    }

    /// The wait before attempt `n + 1`.
    fn delay(&self, n: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(d) = retry_after {
            return d.min(MAX_RETRY_AFTER);
        }
        let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
        self.opts
            .backoff
            .saturating_mul(factor)
            .min(self.opts.max_backoff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let r = ImageRef::parse("127.0.0.1:1/x").unwrap();
        let opts = ClientOptions {
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            ..ClientOptions::default()
        };
        let reg = Registry::new(&r, &opts);
        assert_eq!(reg.base_url(), "http://127.0.0.1:1");
        assert_eq!(reg.delay(1, None), Duration::from_millis(100));
        assert_eq!(reg.delay(2, None), Duration::from_millis(200));
        assert_eq!(reg.delay(3, None), Duration::from_millis(350));
        assert_eq!(reg.delay(40, None), Duration::from_millis(350));
        assert_eq!(
            reg.delay(1, Some(Duration::from_secs(600))),
            MAX_RETRY_AFTER
        );
        let hub = Registry::new(
            &ImageRef::parse("alpine").unwrap(),
            &ClientOptions::default(),
        );
        assert_eq!(hub.base_url(), "https://registry-1.docker.io");
    }
}
