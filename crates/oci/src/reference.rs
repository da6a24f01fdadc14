//! Image references: `[registry[:port]/]repository[:tag][@digest]`, read the
//! way docker reads them.
//!
//! The first path component is a registry when it has a `.` or a `:`, is
//! `localhost`, or has an upper-case letter; otherwise the registry is
//! `docker.io` and a single-component name gets the `library/` prefix. With
//! neither tag nor digest the tag is `latest`. This module only parses and
//! prints; it never touches the network.

use std::fmt;
use std::net::IpAddr;

use crate::digest::Digest;
use crate::PullError;

/// Docker Hub's name in references, and the host that serves its API.
pub const DOCKER_HUB: &str = "docker.io";
const DOCKER_HUB_API: &str = "registry-1.docker.io";
const DEFAULT_TAG: &str = "latest";

/// Longest repository name (registry included), as in the distribution spec's
/// reference grammar.
const MAX_NAME: usize = 255;
const MAX_TAG: usize = 128;

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// As written in references: `docker.io`, `127.0.0.1:5000`, `[::1]:5000`.
    pub registry: String,
    /// `library/alpine`, `foo/bar`.
    pub repository: String,
    /// The tag, if any (`latest` when neither a tag nor a digest was given).
    pub tag: Option<String>,
    /// A pinned manifest digest; when present, the manifest fetched must
    /// have it.
    pub digest: Option<Digest>,
}

impl ImageRef {
    /// Parses a reference. See the module documentation for the rules.
    pub fn parse(input: &str) -> Result<ImageRef, PullError> {
        let bad = |reason: &str| PullError::InvalidReference {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        if input.is_empty() {
            return Err(bad("empty"));
        }
        if input.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("contains whitespace or control characters"));
        }
        let (name_tag, digest) = match input.split_once('@') {
            Some((n, d)) => (
                n,
                Some(Digest::parse(d).map_err(|e| bad(&format!("digest: {e}")))?),
            ),
            None => (input, None),
        };
        // A tag is the part after the last ':' that comes after the last '/'
        // (an earlier ':' is a registry port).
        let last_slash = name_tag.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match name_tag[last_slash..].rfind(':') {
            Some(i) => {
                let at = last_slash + i;
                (&name_tag[..at], Some(&name_tag[at + 1..]))
            }
            None => (name_tag, None),
        };
        if let Some(t) = tag {
            validate_tag(t).map_err(|r| bad(&r))?;
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, rest))
                if first.contains(['.', ':'])
                    || first == "localhost"
                    || first.chars().any(|c| c.is_ascii_uppercase()) =>
            {
                validate_registry(first).map_err(|r| bad(&r))?;
                (first.to_string(), rest.to_string())
            }
            _ => (DOCKER_HUB.to_string(), name.to_string()),
        };
        let registry = if registry == "index.docker.io" {
            DOCKER_HUB.to_string()
        } else {
            registry
        };
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        validate_repository(&repository).map_err(|r| bad(&r))?;
        if registry.len() + 1 + repository.len() > MAX_NAME {
            return Err(bad("name longer than 255 characters"));
        }
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_string()),
            (None, Some(_)) => None,
            (None, None) => Some(DEFAULT_TAG.to_string()),
        };
        Ok(ImageRef {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// The host (and port) that serves the registry API.
    pub fn api_host(&self) -> &str {
        if self.registry == DOCKER_HUB {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// What goes after `/manifests/`: the digest when pinned, else the tag.
    pub fn manifest_reference(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => DEFAULT_TAG.to_string(),
        }
    }

    /// `registry/repository`, how auth errors name the target.
    pub fn name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    /// The short form docker shows: Docker Hub's `docker.io/` and
    /// `library/` left out, the tag always there (`alpine:latest`,
    /// `127.0.0.1:5000/foo:latest`), the digest when pinned. cairn names
    /// pulled images this way by default.
    pub fn familiar(&self) -> String {
        let mut s = if self.registry == DOCKER_HUB {
            self.repository
                .strip_prefix("library/")
                .filter(|r| !r.contains('/'))
                .unwrap_or(&self.repository)
                .to_string()
        } else {
            self.name()
        };
        if let Some(t) = &self.tag {
            s.push(':');
            s.push_str(t);
        }
        if let Some(d) = &self.digest {
            s.push('@');
            s.push_str(d.as_str());
        }
        s
    }

    /// Whether the registry host is a loopback address (`127.0.0.0/8`, `::1`,
    /// `localhost`): such registries are spoken to in plain HTTP by default.
    pub fn is_loopback(&self) -> bool {
        is_loopback_host(&self.registry)
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// Splits `host[:port]` (host possibly a bracketed IPv6 address) and says
/// whether the host is loopback.
pub fn is_loopback_host(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        registry.split(':').next().unwrap_or("")
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn validate_tag(t: &str) -> Result<(), String> {
    let ok = !t.is_empty()
        && t.len() <= MAX_TAG
        && t.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && t.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tag {t:?}: expected 1 to 128 of [A-Za-z0-9_.-], not starting with '.' or '-'"
        ))
    }
}

fn validate_registry(r: &str) -> Result<(), String> {
    let bad = || Err(format!("registry {r:?}: expected host[:port]"));
    let (host, port) = if let Some(rest) = r.strip_prefix('[') {
        let Some((ip, after)) = rest.split_once(']') else {
            return bad();
        };
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return bad();
        }
        match after {
            "" => (ip, None),
            p => match p.strip_prefix(':') {
                Some(p) => (ip, Some(p)),
                None => return bad(),
            },
        }
    } else {
        match r.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (r, None),
        }
    };
    let host_ok = r.starts_with('[')
        || (!host.is_empty()
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            }));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
    if host_ok && port_ok {
        Ok(())
    } else {
        bad()
    }
}

/// Path components of lower-case letters and digits, joined inside by `.`,
/// `_`, `__` or runs of `-`.
fn validate_repository(repo: &str) -> Result<(), String> {
    if repo.is_empty() {
        return Err("empty repository name".to_string());
    }
    for comp in repo.split('/') {
        let bytes = comp.as_bytes();
        let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        let mut ok =
            bytes.first().is_some_and(|&b| alnum(b)) && bytes.last().is_some_and(|&b| alnum(b));
        let mut i = 0;
        while ok && i < bytes.len() {
            let b = bytes[i];
            if alnum(b) {
                i += 1;
                continue;
            }
            // A separator: '.', '_', "__", or one or more '-'.
            let sep_len = match b {
                b'.' => 1,
                b'_' if bytes.get(i + 1) == Some(&b'_') => 2,
                b'_' => 1,
                b'-' => bytes[i..].iter().take_while(|&&c| c == b'-').count(),
                _ => {
                    ok = false;
                    break;
                }
            };
            i += sep_len;
            ok = bytes.get(i).is_some_and(|&c| alnum(c));
        }
        if !ok {
            return Err(format!(
                "repository component {comp:?}: expected lower-case letters and digits, \
                 separated by '.', '_', '__' or '-'"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> (String, String, Option<String>, Option<String>) {
        let r = ImageRef::parse(s).unwrap();
        (
            r.registry,
            r.repository,
            r.tag,
            r.digest.map(|d| d.to_string()),
        )
    }

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn parses_like_docker() {
        let s = |v: &str| v.to_string();
        assert_eq!(
            p("alpine"),
            (s("docker.io"), s("library/alpine"), Some(s("latest")), None)
        );
        assert_eq!(
            p("alpine:3.20"),
            (s("docker.io"), s("library/alpine"), Some(s("3.20")), None)
        );
        assert_eq!(
            p("foo/bar"),
            (s("docker.io"), s("foo/bar"), Some(s("latest")), None)
        );
        assert_eq!(
            p("docker.io/library/alpine:3.20"),
            (s("docker.io"), s("library/alpine"), Some(s("3.20")), None)
        );
        assert_eq!(
            p("index.docker.io/alpine"),
            (s("docker.io"), s("library/alpine"), Some(s("latest")), None)
        );
        assert_eq!(
            p("127.0.0.1:5000/debian:bookworm"),
            (s("127.0.0.1:5000"), s("debian"), Some(s("bookworm")), None)
        );
        assert_eq!(
            p("localhost/a/b/c"),
            (s("localhost"), s("a/b/c"), Some(s("latest")), None)
        );
        assert_eq!(
            p("[::1]:5000/x:y"),
            (s("[::1]:5000"), s("x"), Some(s("y")), None)
        );
        assert_eq!(
            p("quay.io/a_b/c-d:v1.0"),
            (s("quay.io"), s("a_b/c-d"), Some(s("v1.0")), None)
        );
        assert_eq!(
            p(&format!("127.0.0.1:5000/foo@{D}")),
            (s("127.0.0.1:5000"), s("foo"), None, Some(s(D)))
        );
        assert_eq!(
            p(&format!("127.0.0.1:5000/foo:t@{D}")),
            (s("127.0.0.1:5000"), s("foo"), Some(s("t")), Some(s(D)))
        );
        // A port-looking suffix on a docker.io name is a tag.
        assert_eq!(
            p("foo:5000"),
            (s("docker.io"), s("library/foo"), Some(s("5000")), None)
        );
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "docker.io/library/alpine:3.20",
            "127.0.0.1:5000/foo:bar",
            "[::1]:5000/x:latest",
        ] {
            assert_eq!(ImageRef::parse(s).unwrap().to_string(), s);
        }
        let r = ImageRef::parse(&format!("h.io/a@{D}")).unwrap();
        assert_eq!(r.to_string(), format!("h.io/a@{D}"));
        assert_eq!(r.manifest_reference(), D);
        assert_eq!(
            ImageRef::parse("alpine").unwrap().api_host(),
            "registry-1.docker.io"
        );
        let fam = |s: &str| ImageRef::parse(s).unwrap().familiar();
        assert_eq!(fam("alpine"), "alpine:latest");
        assert_eq!(fam("docker.io/library/alpine:3.20"), "alpine:3.20");
        assert_eq!(fam("foo/bar"), "foo/bar:latest");
        assert_eq!(fam("127.0.0.1:5000/foo"), "127.0.0.1:5000/foo:latest");
        assert_eq!(fam(&format!("h.io/a@{D}")), format!("h.io/a@{D}"));
    }

    #[test]
    fn rejects_bad_references() {
        for s in [
            "",
            "Foo",
            "foo/Bar",
            "foo:",
            "foo:-x",
            "foo@sha256:abc",
            "foo@md5:0123",
            "a..b",
            "-a",
            "a-",
            "h.io/",
            "h.io//a",
            "h.io:99999/a",
            "h.io:/a",
            "[::1/a",
            "a b",
            "foo/bar:t:u",
        ] {
            assert!(ImageRef::parse(s).is_err(), "{s:?} should not parse");
        }
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "127.0.0.1:5000",
            "127.1.2.3",
            "localhost:5000",
            "[::1]:5000",
            "LOCALHOST",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "10.0.0.1:5000",
            "docker.io",
            "[::2]:5000",
            "localhost.example.com",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }
}
