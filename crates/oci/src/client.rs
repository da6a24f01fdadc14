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
//! This module never writes to disk.

use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::{self, Challenge, Credentials};
use crate::digest::Digest;
use crate::reference::{is_loopback_host, ImageRef};
use crate::PullError;

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

    /// One attempt at `GET path`, with authentication (a 401 leads to one
    /// handshake and one more try, not counted as an attempt) and
    /// redirects. A 404 becomes `not_found(code, message)`.
    fn request_once(
        &self,
        repo: &str,
        path: &str,
        accept: Option<&str>,
        range_from: Option<u64>,
        what: &str,
        not_found: &dyn Fn(&str, &str) -> PullError,
    ) -> Result<Answer, Failure> {
        let mut authenticated = false;
        loop {
            let (resp, own_origin) = self.send(repo, path, accept, range_from, what)?;
            self.reached.store(true, Ordering::Relaxed);
            let status = resp.status();
            match status {
                200..=299 => return Ok(Answer { resp }),
                401 if own_origin && !authenticated => {
                    let header = resp.header("WWW-Authenticate").unwrap_or("").to_string();
                    let (_, msg) = error_message(resp);
                    self.authenticate(repo, &header, &msg)?;
                    authenticated = true;
                }
                401 | 403 => {
                    let (_, msg) = error_message(resp);
                    return Err(self.auth_failed(repo, status, &msg).into());
                }
                404 => {
                    let (code, msg) = error_message(resp);
                    return Err(not_found(&code, &msg).into());
                }
                408 | 429 | 500 | 502 | 503 | 504 => {
                    let retry_after = resp
                        .header("Retry-After")
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(Duration::from_secs);
                    let (_, msg) = error_message(resp);
                    return Err(Failure::Transient {
                        detail: format!("registry {} answered {status}{}", self.name, paren(&msg)),
                        retry_after,
                        timed_out: false,
                    });
                }
                _ => {
                    let (_, msg) = error_message(resp);
                    return Err(PullError::Http {
                        what: what.to_string(),
                        registry: self.name.clone(),
                        status,
                        detail: paren(&msg),
                    }
                    .into());
                }
            }
        }
    }

    /// Sends the request, following redirects. Returns the final response
    /// (any status) and whether it came from the registry's own origin.
    fn send(
        &self,
        repo: &str,
        path: &str,
        accept: Option<&str>,
        range_from: Option<u64>,
        what: &str,
    ) -> Result<(ureq::Response, bool), Failure> {
        let mut url = format!("{}{path}", self.base);
        let mut own_origin = true;
        let mut last_status = 0;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&url);
            if let Some(a) = accept {
                req = req.set("Accept", a);
            }
            if let Some(from) = range_from {
                req = req.set("Range", &format!("bytes={from}-"));
            }
            if own_origin {
                if let Some(h) = self.auth_header(repo) {
                    req = req.set("Authorization", &h);
                }
            }
            let resp = match req.call() {
                Ok(r) | Err(ureq::Error::Status(_, r)) => r,
                Err(ureq::Error::Transport(t)) => return Err(self.transport_failure(&t)),
            };
            if !matches!(resp.status(), 301 | 302 | 303 | 307 | 308) {
                return Ok((resp, own_origin));
            }
            last_status = resp.status();
            let Some(location) = resp.header("Location") else {
                return Err(Failure::Fatal(PullError::Http {
                    what: what.to_string(),
                    registry: self.name.clone(),
                    status: resp.status(),
                    detail: " (a redirect without a Location)".to_string(),
                }));
            };
            let next = resolve_location(&url, location);
            if url.starts_with("https://") && next.starts_with("http://") && !self.opts.insecure {
                return Err(Failure::Fatal(PullError::Http {
                    what: what.to_string(),
                    registry: self.name.clone(),
                    status: resp.status(),
                    detail: format!(" (refusing a redirect from HTTPS to plain HTTP: {next})"),
                }));
            }
            own_origin = origin(&next) == origin(&self.base);
            url = next;
        }
        Err(Failure::Fatal(PullError::Http {
            what: what.to_string(),
            registry: self.name.clone(),
            status: last_status,
            detail: format!(" (more than {MAX_REDIRECTS} redirects)"),
        }))
    }

    fn transport_failure(&self, t: &ureq::Transport) -> Failure {
        let io_kind = io_error_kind(t);
        let detail = describe_transport(t, io_kind, self.opts.connect_timeout);
        let unreachable = || {
            Failure::Fatal(PullError::Unreachable {
                registry: self.name.clone(),
                detail: detail.clone(),
            })
        };
        match t.kind() {
            ureq::ErrorKind::Dns | ureq::ErrorKind::InvalidUrl | ureq::ErrorKind::UnknownScheme => {
                unreachable()
            }
            ureq::ErrorKind::ConnectionFailed if !self.reached.load(Ordering::Relaxed) => {
                unreachable()
            }
            _ => Failure::Transient {
                timed_out: matches!(
                    io_kind,
                    Some(io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
                ),
                detail,
                retry_after: None,
            },
        }
    }

    /// What to send as `Authorization` for a request in `repo`, from what
    /// the registry asked for before.
    fn auth_header(&self, repo: &str) -> Option<String> {
        let st = self.auth.lock().unwrap_or_else(|p| p.into_inner());
        match st.challenge.as_ref()? {
            Challenge::Basic => st
                .credentials
                .get(repo)?
                .as_ref()
                .map(Credentials::basic_header),
            Challenge::Bearer { .. } => {
                let (token, expires) = st.tokens.get(&pull_scope(repo))?;
                (Instant::now() < *expires).then(|| format!("Bearer {token}"))
            }
        }
    }

    /// The credentials for `repo` (explicit ones, else the auth files),
    /// looked up once.
    fn credentials(&self, repo: &str) -> Result<Option<Credentials>, PullError> {
        if let Some(c) = &self.opts.credentials {
            return Ok(Some(c.clone()));
        }
        if let Some(c) = self
            .auth
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .credentials
            .get(repo)
        {
            return Ok(c.clone());
        }
        let found = auth::find_credentials(&self.opts.auth_files, &self.name, repo)?;
        self.auth
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .credentials
            .insert(repo.to_string(), found.clone());
        Ok(found)
    }

    /// Answers a 401: remembers the challenge and gets what it asks for.
    fn authenticate(&self, repo: &str, header: &str, msg: &str) -> Result<(), PullError> {
        let Some(challenge) = auth::parse_challenge(header) else {
            let why = if header.is_empty() {
                "no WWW-Authenticate challenge".to_string()
            } else {
                format!("unsupported challenge {header:?}")
            };
            return Err(self.auth_failed(
                repo,
                401,
                &format!("{msg}{}{why}", if msg.is_empty() { "" } else { "; " }),
            ));
        };
        let creds = self.credentials(repo)?;
        {
            let mut st = self.auth.lock().unwrap_or_else(|p| p.into_inner());
            st.credentials.insert(repo.to_string(), creds.clone());
            st.challenge = Some(challenge.clone());
        }
        match challenge {
            Challenge::Basic => {
                if creds.is_none() {
                    return Err(self.auth_failed(
                        repo,
                        401,
                        &format!("{}basic auth required", prefix(msg)),
                    ));
                }
                Ok(())
            }
            Challenge::Bearer {
                realm,
                service,
                scope,
            } => {
                let scope = scope.unwrap_or_else(|| pull_scope(repo));
                let (token, secs) =
                    self.fetch_token(repo, &realm, service.as_deref(), &scope, creds.as_ref())?;
                // Renew a little early so a token never expires mid-request.
                let life = Duration::from_secs(secs).saturating_sub(Duration::from_secs(10));
                self.auth
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .tokens
                    .insert(pull_scope(repo), (token, Instant::now() + life));
                Ok(())
            }
        }
    }

    /// `GET realm?service=…&scope=…`, with basic credentials when we have
    /// them. Credentials go only to an HTTPS realm, or to a plain-HTTP one
    /// when the registry itself is spoken to in plain HTTP.
    fn fetch_token(
        &self,
        repo: &str,
        realm: &str,
        service: Option<&str>,
        scope: &str,
        creds: Option<&Credentials>,
    ) -> Result<(String, u64), PullError> {
        let what = format!("token for {}/{repo} from {realm}", self.name);
        let plain_ok = self.base.starts_with("http://")
            || is_loopback_host(origin(realm).split("://").nth(1).unwrap_or(""));
        if !(realm.starts_with("https://") || (realm.starts_with("http://") && plain_ok)) {
            return Err(self.auth_failed(
                repo,
                401,
                &format!("refusing token realm {realm:?}: not an HTTPS URL"),
            ));
        }
        self.with_retries(&what, || {
            let mut req = self.agent.get(realm).query("scope", scope);
            if let Some(s) = service {
                req = req.query("service", s);
            }
            if let Some(c) = creds {
                req = req.set("Authorization", &c.basic_header());
            }
            let resp = match req.call() {
                Ok(r) | Err(ureq::Error::Status(_, r)) => r,
                Err(ureq::Error::Transport(t)) => {
                    let kind = io_error_kind(&t);
                    return Err(match t.kind() {
                        ureq::ErrorKind::Dns
                        | ureq::ErrorKind::InvalidUrl
                        | ureq::ErrorKind::UnknownScheme => {
                            Failure::Fatal(PullError::Unreachable {
                                registry: format!("{} (token endpoint {realm})", self.name),
                                detail: describe_transport(&t, kind, self.opts.connect_timeout),
                            })
                        }
                        _ => Failure::Transient {
                            detail: describe_transport(&t, kind, self.opts.connect_timeout),
                            retry_after: None,
                            timed_out: matches!(
                                kind,
                                Some(io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
                            ),
                        },
                    });
                }
            };
            match resp.status() {
                200 => {}
                s @ (401 | 403) => {
                    let (_, msg) = error_message(resp);
                    return Err(self
                        .auth_failed(
                            repo,
                            s,
                            &format!("{}token endpoint {realm} refused", prefix(&msg)),
                        )
                        .into());
                }
                s @ (429 | 500..=599) => {
                    return Err(Failure::Transient {
                        detail: format!("token endpoint answered {s}"),
                        retry_after: None,
                        timed_out: false,
                    })
                }
                s => {
                    let (_, msg) = error_message(resp);
                    return Err(PullError::Http {
                        what: what.clone(),
                        registry: self.name.clone(),
                        status: s,
                        detail: paren(&msg),
                    }
                    .into());
                }
            }
            let body = read_capped(resp, BodySize::AtMost(MAX_TOKEN_BODY), &what)?;
            let parsed: auth::TokenResponse =
                serde_json::from_slice(&body).map_err(|e| PullError::Invalid {
                    what: what.clone(),
                    detail: e.to_string(),
                })?;
            parsed.into_token().ok_or_else(|| {
                Failure::Fatal(PullError::Invalid {
                    what: what.clone(),
                    detail: "no token in the answer".to_string(),
                })
            })
        })
    }

    fn auth_failed(&self, repo: &str, status: u16, msg: &str) -> PullError {
        let creds = self
            .auth
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .credentials
            .get(repo)
            .cloned()
            .flatten()
            .or_else(|| self.opts.credentials.clone());
        let whose = match creds {
            Some(Credentials {
                username,
                source: Some(p),
                ..
            }) => {
                format!("as {username:?} with credentials from {}", p.display())
            }
            Some(Credentials { username, .. }) => format!("as {username:?}"),
            None => "anonymously: no credentials found".to_string(),
        };
        let msg = if msg.is_empty() { "unauthorized" } else { msg };
        PullError::AuthFailed {
            target: format!("{}/{repo}", self.name),
            status,
            detail: format!("{msg}; tried {whose}"),
        }
    }
}

fn pull_scope(repo: &str) -> String {
    format!("repository:{repo}:pull")
}

fn paren(msg: &str) -> String {
    if msg.is_empty() {
        String::new()
    } else {
        format!(" ({msg})")
    }
}

fn prefix(msg: &str) -> String {
    if msg.is_empty() {
        String::new()
    } else {
        format!("{msg}; ")
    }
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let end = url[after_scheme..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| after_scheme + i);
    &url[..end]
}

/// Resolves a `Location` against the URL that answered with it.
fn resolve_location(current: &str, location: &str) -> String {
    if location.starts_with("http://") || location.starts_with("https://") {
        location.to_string()
    } else if let Some(rest) = location.strip_prefix("//") {
        let scheme = current.split("://").next().unwrap_or("https");
        format!("{scheme}://{rest}")
    } else if location.starts_with('/') {
        format!("{}{location}", origin(current))
    } else {
        let base = current.split(['?', '#']).next().unwrap_or(current);
        let dir = &base[..base.rfind('/').map_or(base.len(), |i| i + 1)];
        format!("{dir}{location}")
    }
}

/// Reads a body of `size` bytes (checking Content-Length first), never
/// more than one byte past the limit or the exact size.
fn read_capped(resp: ureq::Response, size: BodySize, what: &str) -> Result<Vec<u8>, Failure> {
    let content_length = resp
        .header("Content-Length")
        .and_then(|v| v.trim().parse::<u64>().ok());
    let limit = match size {
        BodySize::AtMost(limit) => {
            if let Some(len) = content_length.filter(|&len| len > limit) {
                return Err(PullError::TooLarge {
                    what: what.to_string(),
                    size: Some(len),
                    limit,
                }
                .into());
            }
            limit
        }
        BodySize::Exactly(expected) => {
            if let Some(len) = content_length.filter(|&len| len != expected) {
                return Err(PullError::SizeMismatch {
                    what: what.to_string(),
                    expected,
                    actual: len,
                }
                .into());
            }
            expected
        }
    };
    let mut buf = Vec::new();
    match resp
        .into_reader()
        .take(limit.saturating_add(1))
        .read_to_end(&mut buf)
    {
        Ok(_) if buf.len() as u64 > limit => Err(match size {
            BodySize::AtMost(_) => PullError::TooLarge {
                what: what.to_string(),
                size: None,
                limit,
            },
            BodySize::Exactly(expected) => PullError::TooLong {
                what: what.to_string(),
                expected,
            },
        }
        .into()),
        Ok(_) => match size {
            // The body ended cleanly (no Content-Length promised more).
            BodySize::Exactly(expected) if buf.len() as u64 != expected => {
                Err(PullError::SizeMismatch {
                    what: what.to_string(),
                    expected,
                    actual: buf.len() as u64,
                }
                .into())
            }
            _ => Ok(buf),
        },
        Err(e) => Err(Failure::Transient {
            timed_out: matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            detail: format!("reading the answer: {}", describe_io(&e)),
            retry_after: None,
        }),
    }
}

/// The registry's error code and message from an error answer's body
/// (`{"errors":[{"code":…,"message":…}]}`), else the start of the body.
fn error_message(resp: ureq::Response) -> (String, String) {
    let mut body = Vec::new();
    let _ = resp
        .into_reader()
        .take(MAX_ERROR_BODY)
        .read_to_end(&mut body);
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<ErrorEntry>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorEntry {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    if let Ok(e) = serde_json::from_slice::<Errors>(&body) {
        if let Some(first) = e.errors.first() {
            let msg = match (first.code.is_empty(), first.message.is_empty()) {
                (false, false) => format!("{}: {}", first.code, first.message),
                (false, true) => first.code.clone(),
                _ => first.message.clone(),
            };
            return (first.code.clone(), msg);
        }
    }
    let text: String = String::from_utf8_lossy(&body)
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect();
    (String::new(), text.trim().to_string())
}

fn io_error_kind(t: &ureq::Transport) -> Option<io::ErrorKind> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(t);
    while let Some(e) = src {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return Some(io.kind());
        }
        src = e.source();
    }
    None
}

fn describe_io(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "read timed out".to_string(),
        io::ErrorKind::ConnectionReset => "connection reset".to_string(),
        io::ErrorKind::UnexpectedEof => "connection closed early".to_string(),
        _ => e.to_string(),
    }
}

fn describe_transport(
    t: &ureq::Transport,
    kind: Option<io::ErrorKind>,
    connect_timeout: Duration,
) -> String {
    match (t.kind(), kind) {
        (_, Some(io::ErrorKind::ConnectionRefused)) => "connection refused".to_string(),
        (
            ureq::ErrorKind::ConnectionFailed,
            Some(io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock),
        ) => {
            format!(
                "connection timed out after {} s",
                connect_timeout.as_secs_f64()
            )
        }
        (_, Some(io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)) => {
            "read timed out".to_string()
        }
        (_, Some(io::ErrorKind::ConnectionReset)) => "connection reset".to_string(),
        (_, Some(io::ErrorKind::UnexpectedEof)) => "connection closed early".to_string(),
        (ureq::ErrorKind::Dns, _) => format!(
            "cannot resolve host ({})",
            t.message().unwrap_or("DNS lookup failed")
        ),
        _ => {
            let s = t.to_string();
            // ureq prefixes the URL; the registry is named by the caller.
            s.split_once(": ")
                .map_or(s.clone(), |(_, rest)| rest.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(origin("https://h.io:5000/v2/x?y"), "https://h.io:5000");
        assert_eq!(origin("http://h"), "http://h");
        assert_eq!(
            resolve_location("https://a/v2/x/blobs/y", "https://cdn/z?sig=1"),
            "https://cdn/z?sig=1"
        );
        assert_eq!(
            resolve_location("https://a/v2/x/blobs/y", "/other"),
            "https://a/other"
        );
        assert_eq!(
            resolve_location("https://a/v2/x/blobs/y", "//cdn/z"),
            "https://cdn/z"
        );
        assert_eq!(
            resolve_location("https://a/v2/x/blobs/y?q", "z"),
            "https://a/v2/x/blobs/z"
        );
    }

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
