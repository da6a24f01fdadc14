//! What an image says about how to run it (the OCI image config's
//! `config` object: Entrypoint, Cmd, Env, WorkingDir, User, StopSignal),
//! how the `cairn run` flags override it, and the lookup of user and group
//! names in the image's `/etc/passwd` and `/etc/group`.
//!
//! Pure functions over strings; reading the files out of the mounted
//! rootfs is the caller's business.

use crate::spec::DEFAULT_PATH;

/// The parts of an OCI image config that `run` uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub stop_signal: Option<String>,
}

impl ImageConfig {
    /// What an image without a config (made by `cairn mkfs`) runs: a shell.
    pub fn fallback() -> Self {
        ImageConfig {
            cmd: vec!["/bin/sh".into()],
            env: vec![format!("PATH={DEFAULT_PATH}")],
            ..Default::default()
        }
    }

    /// Parses an OCI image config JSON document (with `cairn-spec`'s
    /// types, the ones the importer checked it with).
    pub fn parse(json: &str) -> Result<Self, String> {
        let file: cairn_spec::ImageConfig =
            serde_json::from_str(json).map_err(|e| format!("invalid image config: {e}"))?;
        let c = file.config.unwrap_or_default();
        let nonempty = |s: Option<String>| s.filter(|s| !s.is_empty());
        Ok(ImageConfig {
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            env: c.env.unwrap_or_default(),
            working_dir: nonempty(c.working_dir),
            user: nonempty(c.user),
            stop_signal: nonempty(c.stop_signal),
        })
    }

    /// The process arguments, as docker and podman combine them: an
    /// `--entrypoint` replaces the image's and drops its Cmd; a command
    /// given on the command line replaces Cmd.
    pub fn args(&self, entrypoint: Option<&[String]>, command: &[String]) -> Vec<String> {
        let (entry, default_cmd): (&[String], &[String]) = match entrypoint {
            Some(e) => (e, &[]),
            None => (&self.entrypoint, &self.cmd),
        };
        let cmd = if command.is_empty() {
            default_cmd
        } else {
            command
        };
        entry.iter().chain(cmd.iter()).cloned().collect()
    }
}

/// A resolved `user[:group]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedUser {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    /// From /etc/passwd, for `HOME`.
    pub home: Option<String>,
}

/// Resolves `spec` (`user`, `uid`, `user:group`, `uid:gid`) against the
/// contents of the image's `/etc/passwd` and `/etc/group` (`None` when the
/// image has no such file).
pub fn resolve_user(
    spec: &str,
    passwd: Option<&str>,
    group: Option<&str>,
) -> Result<ResolvedUser, String> {
    let (user, grp) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let users: Vec<Vec<&str>> = passwd
        .unwrap_or("")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 4)
        .collect();
    let groups: Vec<Vec<&str>> = group
        .unwrap_or("")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 3)
        .collect();
    let entry = match user.parse::<u32>() {
        Ok(uid) => users.iter().find(|f| f[2].parse() == Ok(uid)),
        Err(_) => users.iter().find(|f| f[0] == user),
    };
    let uid = match (user.parse::<u32>(), entry) {
        (Ok(uid), _) => uid,
        (Err(_), Some(f)) => f[2]
            .parse()
            .map_err(|_| format!("bad uid for {user:?} in /etc/passwd"))?,
        (Err(_), None) => {
            return Err(format!(
                "no user {user:?} in the image's /etc/passwd{}",
                if passwd.is_none() {
                    " (the image has none)"
                } else {
                    ""
                }
            ))
        }
    };
    let gid = match grp {
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => groups
                .iter()
                .find(|f| f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| format!("no group {g:?} in the image's /etc/group"))?,
        },
        None => entry.and_then(|f| f[3].parse().ok()).unwrap_or(0),
    };
    let name = entry.map(|f| f[0]);
    let mut additional_gids: Vec<u32> = match (grp, name) {
        (None, Some(name)) => groups
            .iter()
            .filter(|f| f.get(3).is_some_and(|m| m.split(',').any(|m| m == name)))
            .filter_map(|f| f[2].parse().ok())
            .filter(|g| *g != gid)
            .collect(),
        _ => Vec::new(),
    };
    additional_gids.sort_unstable();
    additional_gids.dedup();
    Ok(ResolvedUser {
        uid,
        gid,
        additional_gids,
        home: entry.and_then(|f| f.get(5)).map(|s| s.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                          daemon:x:1:1::/usr/sbin:/bin/false\n\
                          alice:x:1000:1000::/home/alice:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nwheel:x:10:alice\nalice:x:1000:\nstaff:x:50:bob,alice\n";

    #[test]
    fn parses_config_and_combines_args() {
        let c = ImageConfig::parse(
            r#"{"config":{"Entrypoint":["/init"],"Cmd":["serve","-v"],"Env":["A=1"],
                "WorkingDir":"/srv","User":"alice","StopSignal":"SIGQUIT"}}"#,
        )
        .unwrap();
        assert_eq!(c.args(None, &[]), ["/init", "serve", "-v"]);
        assert_eq!(c.args(None, &["x".into()]), ["/init", "x"]);
        assert_eq!(c.args(Some(&["/bin/sh".into()]), &[]), ["/bin/sh"]);
        assert_eq!(
            c.args(Some(&["/bin/sh".into()]), &["-c".into(), "id".into()]),
            ["/bin/sh", "-c", "id"]
        );
        assert_eq!(c.working_dir.as_deref(), Some("/srv"));
        assert_eq!(c.stop_signal.as_deref(), Some("SIGQUIT"));
        let empty = ImageConfig::parse(r#"{"architecture":"amd64"}"#).unwrap();
        assert!(empty.args(None, &[]).is_empty());
        assert!(ImageConfig::parse("not json").is_err());
    }

    #[test]
    fn resolves_names_numbers_and_groups() {
        let r = resolve_user("alice", Some(PASSWD), Some(GROUP)).unwrap();
        assert_eq!((r.uid, r.gid), (1000, 1000));
        assert_eq!(r.additional_gids, [10, 50]);
        assert_eq!(r.home.as_deref(), Some("/home/alice"));
        let r = resolve_user("1000:wheel", Some(PASSWD), Some(GROUP)).unwrap();
        assert_eq!((r.uid, r.gid), (1000, 10));
        assert!(r.additional_gids.is_empty());
        let r = resolve_user("4242:77", None, None).unwrap();
        assert_eq!((r.uid, r.gid, r.home), (4242, 77, None));
        let r = resolve_user("4242", None, None).unwrap();
        assert_eq!(r.gid, 0);
        assert!(resolve_user("bob", Some(PASSWD), Some(GROUP))
            .unwrap_err()
            .contains("no user"));
        assert!(resolve_user("bob", None, None)
            .unwrap_err()
            .contains("has none"));
        assert!(resolve_user("alice:nogroup", Some(PASSWD), Some(GROUP)).is_err());
    }
}
