//! Answering a registry's 401: the `WWW-Authenticate` challenge read,
//! credentials from the auth files, bearer tokens fetched from the realm
//! and cached per scope until they expire, and the message when it fails.

use std::io;
use std::time::{Duration, Instant};

use super::http::{
    describe_transport, error_message, io_error_kind, origin, paren, prefix, read_capped,
};
use super::{BodySize, Failure, Registry, MAX_TOKEN_BODY};
use crate::auth::{self, Challenge, Credentials};
use crate::reference::is_loopback_host;
use crate::PullError;

impl Registry {
    /// What to send as `Authorization` for a request in `repo`, from what
    /// the registry asked for before.
    pub(super) fn auth_header(&self, repo: &str) -> Option<String> {
        let st = self.auth.lock().unwrap_or_else(|p| p.into_inner());
        match st.challenge.as_ref()? {
            Challenge::Basic => st
                .credentials
                .get(repo)?
                .as_ref()
                .map(Credentials::basic_header),
            Challenge::Bearer { .. } => {
                let (token, expires) = st.tokens.get(&self.scope(repo))?;
                (Instant::now() < *expires).then(|| format!("Bearer {token}"))
            }
        }
    }

    /// The credentials for `repo` (explicit ones, else the auth files),
    /// looked up once.
    pub(super) fn credentials(&self, repo: &str) -> Result<Option<Credentials>, PullError> {
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
    pub(super) fn authenticate(
        &self,
        repo: &str,
        header: &str,
        msg: &str,
    ) -> Result<(), PullError> {
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
                let scope = scope.unwrap_or_else(|| self.scope(repo));
                let (token, secs) =
                    self.fetch_token(repo, &realm, service.as_deref(), &scope, creds.as_ref())?;
                // Renew a little early so a token never expires mid-request.
                let life = Duration::from_secs(secs).saturating_sub(Duration::from_secs(10));
                self.auth
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .tokens
                    .insert(self.scope(repo), (token, Instant::now() + life));
                Ok(())
            }
        }
    }

    /// `GET realm?service=…&scope=…`, with basic credentials when we have
    /// them. Credentials go only to an HTTPS realm, or to a plain-HTTP one
    /// when the registry itself is spoken to in plain HTTP.
    pub(super) fn fetch_token(
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

    pub(super) fn auth_failed(&self, repo: &str, status: u16, msg: &str) -> PullError {
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
impl Registry {
    /// The token scope this client asks for in `repo`: `pull`, or
    /// `pull,push` for a client made by [`Registry::for_push`].
    pub(super) fn scope(&self, repo: &str) -> String {
        if self.push {
            format!("repository:{repo}:pull,push")
        } else {
            format!("repository:{repo}:pull")
        }
    }
}
