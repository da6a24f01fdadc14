//! One request to the registry: `GET` with the `Authorization` the
//! registry asked for, redirects followed by hand (the origin checks that
//! keep credentials at home and HTTPS from being downgraded), error
//! bodies and transport errors turned into messages, and bodies read
//! within their size.

use std::io::{self, Read};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Answer, BodySize, Failure, Registry, MAX_ERROR_BODY, MAX_REDIRECTS};

/// Makes the error for a 404 from the registry's error code and message.
pub(super) type NotFound<'a> = &'a dyn Fn(&str, &str) -> PullError;

/// One request: method, path (or a whole URL of the registry's), and what
/// goes with it.
pub(super) struct Req<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub accept: Option<&'a str>,
    /// `bytes=FROM-` or `bytes=FROM-LAST` (inclusive).
    pub range: Option<(u64, Option<u64>)>,
    /// The body and its Content-Type.
    pub body: Option<(&'a [u8], &'a str)>,
}

impl<'a> Req<'a> {
    pub fn get(path: &'a str) -> Req<'a> {
        Req {
            method: "GET",
            path,
            accept: None,
            range: None,
            body: None,
        }
    }
}
use crate::PullError;

impl Registry {
    /// One attempt at `GET path`, with authentication (a 401 leads to one
    /// handshake and one more try, not counted as an attempt) and
    /// redirects. A 404 becomes `not_found(code, message)`.
    pub(super) fn request_once(
        &self,
        repo: &str,
        path: &str,
        accept: Option<&str>,
        range_from: Option<u64>,
        what: &str,
        not_found: &dyn Fn(&str, &str) -> PullError,
    ) -> Result<Answer, Failure> {
        let req = Req {
            accept,
            range: range_from.map(|from| (from, None)),
            ..Req::get(path)
        };
        self.request(repo, &req, what, Some(not_found))
    }

    /// One attempt at `req`, as [`request_once`](Self::request_once) says;
    /// without `not_found`, a 404 is an answer like a 2xx (the caller looks
    /// at its status).
    pub(super) fn request(
        &self,
        repo: &str,
        req: &Req<'_>,
        what: &str,
        not_found: Option<NotFound<'_>>,
    ) -> Result<Answer, Failure> {
        let mut authenticated = false;
        loop {
            let (resp, own_origin) = self.send(repo, req, what)?;
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
                    let Some(not_found) = not_found else {
                        return Ok(Answer { resp });
                    };
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
    pub(super) fn send(
        &self,
        repo: &str,
        r: &Req<'_>,
        what: &str,
    ) -> Result<(ureq::Response, bool), Failure> {
        // An upload's `Location` may be a whole URL; it must still be the
        // registry's own origin for credentials to go there.
        let mut url = if r.path.starts_with("http://") || r.path.starts_with("https://") {
            r.path.to_string()
        } else {
            format!("{}{}", self.base, r.path)
        };
        let mut own_origin = origin(&url) == origin(&self.base);
        let mut last_status = 0;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.request(r.method, &url);
            if let Some(a) = r.accept {
                req = req.set("Accept", a);
            }
            match r.range {
                Some((from, None)) => req = req.set("Range", &format!("bytes={from}-")),
                Some((from, Some(last))) => req = req.set("Range", &format!("bytes={from}-{last}")),
                None => {}
            }
            if own_origin {
                if let Some(h) = self.auth_header(repo) {
                    req = req.set("Authorization", &h);
                }
            }
            let sent = match r.body {
                Some((data, content_type)) => {
                    req.set("Content-Type", content_type).send_bytes(data)
                }
                None => req.call(),
            };
            let resp = match sent {
                Ok(r) | Err(ureq::Error::Status(_, r)) => r,
                Err(ureq::Error::Transport(t)) => return Err(self.transport_failure(&t)),
            };
            // Only reads follow redirects: an upload answered with one is
            // an error, not something to send again elsewhere.
            let reading = matches!(r.method, "GET" | "HEAD");
            if !reading || !matches!(resp.status(), 301 | 302 | 303 | 307 | 308) {
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

    pub(super) fn transport_failure(&self, t: &ureq::Transport) -> Failure {
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
}

pub(super) fn paren(msg: &str) -> String {
    if msg.is_empty() {
        String::new()
    } else {
        format!(" ({msg})")
    }
}

pub(super) fn prefix(msg: &str) -> String {
    if msg.is_empty() {
        String::new()
    } else {
        format!("{msg}; ")
    }
}

/// `scheme://host[:port]` of a URL.
pub(super) fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let end = url[after_scheme..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| after_scheme + i);
    &url[..end]
}

/// Resolves a `Location` against the URL that answered with it.
pub(super) fn resolve_location(current: &str, location: &str) -> String {
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
pub(super) fn read_capped(
    resp: ureq::Response,
    size: BodySize,
    what: &str,
) -> Result<Vec<u8>, Failure> {
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
            promised_exactly(content_length, expected, what)?;
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
        Err(e) => Err(reading_failed(&e)),
    }
}

/// A Content-Length (if any) that is not the `expected` size.
fn promised_exactly(content_length: Option<u64>, expected: u64, what: &str) -> Result<(), Failure> {
    match content_length {
        Some(len) if len != expected => Err(PullError::SizeMismatch {
            what: what.to_string(),
            expected,
            actual: len,
        }
        .into()),
        _ => Ok(()),
    }
}

/// A body that could not be read to its end: worth a retry.
fn reading_failed(e: &io::Error) -> Failure {
    Failure::Transient {
        timed_out: matches!(
            e.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        ),
        detail: format!("reading the answer: {}", describe_io(e)),
        retry_after: None,
    }
}

/// Reads a body of exactly `expected` bytes as [`read_capped`] does, and
/// calls `progress` with all the bytes read so far each time more have
/// arrived (so a caller can use the start of a large range before its
/// end is in). Each prefix is a view of the buffer that is returned, not
/// a copy. The buffer is allocated whole at the start (`expected` is
/// bounded by the caller: a range of at most `MAX_RANGE`; the pages the
/// body never reaches are not touched).
pub(super) fn read_exact_progress(
    resp: ureq::Response,
    expected: u64,
    what: &str,
    progress: &mut dyn FnMut(&[u8]),
) -> Result<Vec<u8>, Failure> {
    let content_length = resp
        .header("Content-Length")
        .and_then(|v| v.trim().parse::<u64>().ok());
    promised_exactly(content_length, expected, what)?;
    let mut buf = vec![0u8; expected as usize];
    let mut filled = 0usize;
    let mut reader = resp.into_reader();
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(PullError::SizeMismatch {
                    what: what.to_string(),
                    expected,
                    actual: filled as u64,
                }
                .into())
            }
            Ok(n) => {
                filled += n;
                progress(&buf[..filled]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(reading_failed(&e)),
        }
    }
    // A body longer than promised (no Content-Length said so).
    let mut probe = [0u8; 1];
    match reader.read(&mut probe) {
        Ok(0) => Ok(buf),
        Ok(_) => Err(PullError::TooLong {
            what: what.to_string(),
            expected,
        }
        .into()),
        Err(e) => Err(reading_failed(&e)),
    }
}

/// The registry's error code and message from an error answer's body
/// (`{"errors":[{"code":…,"message":…}]}`), else the start of the body.
pub(super) fn error_message(resp: ureq::Response) -> (String, String) {
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

pub(super) fn io_error_kind(t: &ureq::Transport) -> Option<io::ErrorKind> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(t);
    while let Some(e) = src {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return Some(io.kind());
        }
        src = e.source();
    }
    None
}

pub(super) fn describe_io(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "read timed out".to_string(),
        io::ErrorKind::ConnectionReset => "connection reset".to_string(),
        io::ErrorKind::UnexpectedEof => "connection closed early".to_string(),
        _ => e.to_string(),
    }
}

pub(super) fn describe_transport(
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
}
