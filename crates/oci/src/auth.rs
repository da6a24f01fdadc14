//! Registry credentials and the pieces of the auth handshake that are pure
//! parsing: auth files, `WWW-Authenticate` challenges, token responses.
//!
//! Credentials come from the first of these files that has an entry for the
//! registry (containers-auth.json(5) order, then Docker's):
//! `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json`,
//! `$XDG_CONFIG_HOME/containers/auth.json` (default
//! `~/.config/containers/auth.json`), `~/.docker/config.json`. Keys are
//! matched most specific first (`host/ns/repo`, `host/ns`, `host`), with or
//! without an `http(s)://` prefix and a `/v1/`-style path, as Docker writes
//! them. Only `auth` (base64 `user:password`) and `username`/`password` are
//! read: credential helpers (`credHelpers`, `credsStore`) and identity tokens
//! are not supported, and an entry that relies on one is skipped with a
//! debug message. This module never sends anything over the network.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;

use crate::PullError;

/// A username and password for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
    /// The file they came from (for messages).
    pub source: Option<PathBuf>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("source", &self.source)
            .finish()
    }
}

impl Credentials {
    /// The value of a `Authorization: Basic …` header.
    pub fn basic_header(&self) -> String {
        let raw = format!("{}:{}", self.username, self.password);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }
}

/// The auth files searched, in order, from the environment.
pub fn default_auth_files() -> Vec<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut files = Vec::new();
    if let Some(p) = env("REGISTRY_AUTH_FILE") {
        files.push(p);
    }
    if let Some(d) = env("XDG_RUNTIME_DIR") {
        files.push(d.join("containers/auth.json"));
    }
    let home = env("HOME");
    match (env("XDG_CONFIG_HOME"), &home) {
        (Some(c), _) => files.push(c.join("containers/auth.json")),
        (None, Some(h)) => files.push(h.join(".config/containers/auth.json")),
        (None, None) => {}
    }
    if let Some(h) = &home {
        files.push(h.join(".docker/config.json"));
    }
    files
}

#[derive(Deserialize)]
struct AuthFile {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: BTreeMap<String, String>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// The credentials for `registry/repository` from the first of `files`
/// (missing files are skipped) that has them. A file that exists but cannot
/// be read or parsed is an error naming it: a silently ignored typo would
/// show up later as a puzzling authentication failure.
pub fn find_credentials(
    files: &[PathBuf],
    registry: &str,
    repository: &str,
) -> Result<Option<Credentials>, PullError> {
    let keys = lookup_keys(registry, repository);
    for path in files {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(PullError::Credentials {
                    path: path.clone(),
                    detail: e.to_string(),
                })
            }
        };
        if let Some(c) = credentials_in(&text, path, &keys, registry)? {
            return Ok(Some(c));
        }
    }
    Ok(None)
}

/// Keys to look up, most specific first. Docker Hub is also known by its
/// legacy names.
fn lookup_keys(registry: &str, repository: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let comps: Vec<&str> = repository.split('/').collect();
    for n in (1..=comps.len()).rev() {
        keys.push(format!("{registry}/{}", comps[..n].join("/")));
    }
    keys.push(registry.to_string());
    if registry == crate::reference::DOCKER_HUB {
        keys.push("index.docker.io".to_string());
        keys.push("registry-1.docker.io".to_string());
    }
    keys
}

/// An auth-file key as Docker and podman write it, reduced to
/// `host[/path]`: no scheme, and no `/v1/`/`/v2/` API path.
fn normalize_key(key: &str) -> String {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let had_scheme = k.len() != key.len();
    let k = k.trim_end_matches('/');
    if had_scheme {
        // A URL key names a host: Docker writes https://index.docker.io/v1/.
        k.split('/').next().unwrap_or(k).to_string()
    } else {
        k.to_string()
    }
}

fn credentials_in(
    text: &[u8],
    path: &Path,
    keys: &[String],
    registry: &str,
) -> Result<Option<Credentials>, PullError> {
    let err = |detail: String| PullError::Credentials {
        path: path.to_path_buf(),
        detail,
    };
    let file: AuthFile = serde_json::from_slice(text).map_err(|e| err(e.to_string()))?;
    let entries: BTreeMap<String, &AuthEntry> = file
        .auths
        .iter()
        .map(|(k, v)| (normalize_key(k), v))
        .collect();
    for key in keys {
        let Some(entry) = entries.get(key) else {
            continue;
        };
        if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .map_err(|e| err(format!("auths.{key}.auth is not base64: {e}")))?;
            let raw = String::from_utf8(raw)
                .map_err(|_| err(format!("auths.{key}.auth is not UTF-8")))?;
            let (user, pass) = raw
                .split_once(':')
                .ok_or_else(|| err(format!("auths.{key}.auth is not user:password")))?;
            return Ok(Some(Credentials {
                username: user.to_string(),
                password: pass.trim_end_matches('\n').to_string(),
                source: Some(path.to_path_buf()),
            }));
        }
        if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
            return Ok(Some(Credentials {
                username: u.clone(),
                password: p.clone(),
                source: Some(path.to_path_buf()),
            }));
        }
    }
    if file.cred_helpers.contains_key(registry) || file.creds_store.is_some() {
        tracing::debug!(
            "{}: credential helpers are not supported; no inline credentials for {registry}",
            path.display()
        );
    }
    Ok(None)
}

/// One `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

/// Parses a `WWW-Authenticate` header value: a scheme, then
/// comma-separated `key=value` or `key="quoted value"` parameters. Returns
/// the first Bearer or Basic challenge (a header may carry several).
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let mut rest = header.trim();
    loop {
        let (scheme, after) = rest
            .split_once(|c: char| c.is_whitespace())
            .unwrap_or((rest, ""));
        let (params, next) = parse_params(after);
        match scheme.to_ascii_lowercase().as_str() {
            "basic" => return Some(Challenge::Basic),
            "bearer" => {
                let get = |k: &str| {
                    params
                        .iter()
                        .find(|(pk, _)| pk.eq_ignore_ascii_case(k))
                        .map(|(_, v)| v.clone())
                };
                let realm = get("realm")?;
                return Some(Challenge::Bearer {
                    realm,
                    service: get("service"),
                    scope: get("scope"),
                });
            }
            _ => {}
        }
        rest = next?.trim();
        if rest.is_empty() {
            return None;
        }
    }
}

/// Reads `k=v, k="v"` pairs until the end or the start of another challenge
/// (a token not followed by `=`), which is returned as the rest.
fn parse_params(s: &str) -> (Vec<(String, String)>, Option<&str>) {
    let mut out = Vec::new();
    let mut s = s.trim_start();
    loop {
        s = s.trim_start_matches([',', ' ', '\t']);
        if s.is_empty() {
            return (out, None);
        }
        let key_end = s
            .find(|c: char| c == '=' || c == ',' || c.is_whitespace())
            .unwrap_or(s.len());
        let key = &s[..key_end];
        let after_key = s[key_end..].trim_start();
        let Some(after_eq) = after_key.strip_prefix('=') else {
            // Not a parameter: the next challenge's scheme.
            return (out, Some(s));
        };
        let after_eq = after_eq.trim_start();
        let (value, rest) = if let Some(q) = after_eq.strip_prefix('"') {
            let mut v = String::new();
            let mut chars = q.char_indices();
            let mut end = q.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            v.push(n);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => v.push(c),
                }
            }
            (v, &q[end.min(q.len())..])
        } else {
            let end = after_eq.find(',').unwrap_or(after_eq.len());
            (after_eq[..end].trim().to_string(), &after_eq[end..])
        };
        out.push((key.to_string(), value));
        s = rest;
    }
}

/// A token endpoint's answer (Docker token auth spec: `token`, or the
/// OAuth2 spelling `access_token`; `expires_in` seconds, default 60).
#[derive(Debug, Deserialize)]
pub struct TokenResponse {
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub access_token: Option<String>,
    #[serde(default)]
    pub expires_in: Option<u64>,
}

impl TokenResponse {
    /// The token and its lifetime in seconds.
    pub fn into_token(self) -> Option<(String, u64)> {
        let token = self.token.or(self.access_token).filter(|t| !t.is_empty())?;
        // The spec's minimum lifetime is 60 s; a shorter stated one is taken
        // as 60 rather than making every request fetch a new token.
        Some((token, self.expires_in.unwrap_or(60).max(60)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:samalba/my-app:pull,push""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:samalba/my-app:pull,push".into()),
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(
            parse_challenge(r#"bearer realm=http://127.0.0.1:1/t, service=x"#),
            Some(Challenge::Bearer {
                realm: "http://127.0.0.1:1/t".into(),
                service: Some("x".into()),
                scope: None
            })
        );
        assert_eq!(
            parse_challenge(r#"Negotiate abc, Bearer realm="a\"b""#),
            Some(Challenge::Bearer {
                realm: "a\"b".into(),
                service: None,
                scope: None
            })
        );
        assert_eq!(parse_challenge("Bearer service=x"), None);
        assert_eq!(parse_challenge(""), None);
        assert_eq!(parse_challenge("Digest realm=x, nonce=y"), None);
    }

    #[test]
    fn credentials_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let podman = dir.path().join("auth.json");
        std::fs::write(
            &podman,
            format!(
                r#"{{"auths":{{"reg.io/team":{{"auth":"{}"}},"reg.io":{{"auth":"{}"}},"helper.io":{{}}}},"credHelpers":{{"helper.io":"pass"}}}}"#,
                b64("team:t"),
                b64("all:a:b")
            ),
        )
        .unwrap();
        let docker = dir.path().join("config.json");
        std::fs::write(
            &docker,
            format!(
                r#"{{"auths":{{"https://index.docker.io/v1/":{{"auth":"{}"}},"http://127.0.0.1:5000":{{"username":"u","password":"p"}}}}}}"#,
                b64("hub:h")
            ),
        )
        .unwrap();
        let files = [
            dir.path().join("missing.json"),
            podman.clone(),
            docker.clone(),
        ];
        let find = |r: &str, repo: &str| {
            find_credentials(&files, r, repo)
                .unwrap()
                .map(|c| (c.username, c.password))
        };
        let s = |a: &str, b: &str| Some((a.to_string(), b.to_string()));
        assert_eq!(find("reg.io", "team/app"), s("team", "t"));
        assert_eq!(find("reg.io", "other/app"), s("all", "a:b"));
        assert_eq!(find("docker.io", "library/alpine"), s("hub", "h"));
        assert_eq!(find("127.0.0.1:5000", "x"), s("u", "p"));
        assert_eq!(find("helper.io", "x"), None);
        assert_eq!(find("none.io", "x"), None);
        let c = find_credentials(&files, "reg.io", "x").unwrap().unwrap();
        assert_eq!(c.source.as_deref(), Some(podman.as_path()));
        assert!(!format!("{c:?}").contains("a:b"));

        std::fs::write(&podman, "{not json").unwrap();
        let e = find_credentials(&files, "reg.io", "x")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "reading registry credentials from {}",
                podman.display()
            )),
            "{e}"
        );
    }

    #[test]
    fn token_responses() {
        let t: TokenResponse = serde_json::from_str(r#"{"token":"abc","expires_in":300}"#).unwrap();
        assert_eq!(t.into_token(), Some(("abc".into(), 300)));
        let t: TokenResponse =
            serde_json::from_str(r#"{"access_token":"x","expires_in":5}"#).unwrap();
        assert_eq!(t.into_token(), Some(("x".into(), 60)));
        let t: TokenResponse = serde_json::from_str(r#"{}"#).unwrap();
        assert_eq!(t.into_token(), None);
    }
}
