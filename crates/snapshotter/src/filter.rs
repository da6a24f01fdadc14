//! containerd's filter syntax, as `List` (ctr's and the CRI's `Walk`)
//! sends it, for the fields a snapshot has.
//!
//! A request carries several filters, any of which may match (OR); a
//! filter is selectors separated by `,`, all of which must match (AND). A
//! selector is a field path (`name`, `parent`, `kind`, `labels.KEY`; a
//! component may be a double-quoted string such as
//! `labels."containerd.io/gc.root"`) alone (the field is present) or
//! followed by `==` or `!=` and a value (bare up to the next `,`, or
//! double-quoted). The regular-expression operator `~=` is refused.

use crate::proto::{Info, Kind};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Present,
    Eq(String),
    Ne(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

/// A parsed list of filters.
#[derive(Debug, Clone, Default)]
pub struct Filters(Vec<Vec<Selector>>);

/// Longest filter string taken.
const MAX_FILTER: usize = 4096;

fn parse_quoted(s: &[char], i: &mut usize) -> Result<String, String> {
    // s[*i] is the opening quote.
    let q = s[*i];
    *i += 1;
    let mut out = String::new();
    while *i < s.len() {
        let c = s[*i];
        *i += 1;
        if c == q {
            return Ok(out);
        }
        if c == '\\' {
            let Some(&e) = s.get(*i) else { break };
            *i += 1;
            out.push(match e {
                'n' => '\n',
                't' => '\t',
                other => other,
            });
        } else {
            out.push(c);
        }
    }
    Err("unterminated quoted string".into())
}

fn parse_filter(f: &str) -> Result<Vec<Selector>, String> {
    if f.len() > MAX_FILTER {
        return Err(format!("longer than {MAX_FILTER} bytes"));
    }
    let s: Vec<char> = f.chars().collect();
    let mut i = 0;
    let mut sels = Vec::new();
    loop {
        while s.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        // Field path.
        let mut path = Vec::new();
        loop {
            match s.get(i) {
                Some('"') => path.push(parse_quoted(&s, &mut i)?),
                Some(c) if c.is_alphanumeric() || *c == '_' => {
                    let start = i;
                    while s.get(i).is_some_and(|c| c.is_alphanumeric() || *c == '_') {
                        i += 1;
                    }
                    path.push(s[start..i].iter().collect());
                }
                other => return Err(format!("expected a field name at {i}, found {other:?}")),
            }
            if s.get(i) == Some(&'.') {
                i += 1;
            } else {
                break;
            }
        }
        while s.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        let op = match (s.get(i), s.get(i + 1)) {
            (Some('='), Some('=')) | (Some('!'), Some('=')) => {
                let ne = s[i] == '!';
                i += 2;
                while s.get(i).is_some_and(|c| c.is_whitespace()) {
                    i += 1;
                }
                let v = if s.get(i) == Some(&'"') {
                    parse_quoted(&s, &mut i)?
                } else {
                    let start = i;
                    while s.get(i).is_some_and(|c| *c != ',') {
                        i += 1;
                    }
                    s[start..i].iter().collect::<String>().trim_end().to_owned()
                };
                if ne {
                    Op::Ne(v)
                } else {
                    Op::Eq(v)
                }
            }
            (Some('~'), Some('=')) => return Err("the ~= operator is not supported".into()),
            _ => Op::Present,
        };
        sels.push(Selector { path, op });
        while s.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        match s.get(i) {
            None => return Ok(sels),
            Some(',') => i += 1,
            Some(c) => return Err(format!("unexpected {c:?} at {i}")),
        }
    }
}

impl Filters {
    pub fn parse(filters: &[String]) -> Result<Filters, String> {
        let mut all = Vec::new();
        for f in filters {
            if f.trim().is_empty() {
                continue;
            }
            all.push(parse_filter(f).map_err(|e| format!("filter {f:?}: {e}"))?);
        }
        Ok(Filters(all))
    }

    pub fn matches(&self, info: &Info) -> bool {
        self.0.is_empty()
            || self
                .0
                .iter()
                .any(|sels| sels.iter().all(|s| s.matches(info)))
    }
}

impl Selector {
    fn field(&self, info: &Info) -> (String, bool) {
        let Some(first) = self.path.first() else {
            return (String::new(), false);
        };
        match first.as_str() {
            // Always present, as containerd's own adaptor has them: the
            // metadata store's Walk for a remote snapshot's target asks
            // for `parent==""` on a bottom layer.
            "name" => (info.name.clone(), true),
            "parent" => (info.parent.clone(), true),
            "kind" => {
                let k = match Kind::try_from(info.kind) {
                    Ok(Kind::Active) => "active",
                    Ok(Kind::View) => "view",
                    Ok(Kind::Committed) => "committed",
                    _ => "unknown",
                };
                (k.into(), true)
            }
            "labels" => {
                let key = self.path[1..].join(".");
                match info.labels.get(&key) {
                    Some(v) => (v.clone(), true),
                    None => (String::new(), false),
                }
            }
            _ => (String::new(), false),
        }
    }

    fn matches(&self, info: &Info) -> bool {
        let (v, present) = self.field(info);
        match &self.op {
            Op::Present => present,
            Op::Eq(want) => present && v == *want,
            Op::Ne(want) => v != *want,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, parent: &str, kind: Kind, labels: &[(&str, &str)]) -> Info {
        Info {
            name: name.into(),
            parent: parent.into(),
            kind: kind as i32,
            created_at: None,
            updated_at: None,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn m(filters: &[&str], i: &Info) -> bool {
        let f: Vec<String> = filters.iter().map(|s| s.to_string()).collect();
        Filters::parse(&f).unwrap().matches(i)
    }

    #[test]
    fn containerd_walk_filters() {
        let a = info(
            "a-wl",
            "p-wl",
            Kind::Active,
            &[("l", "2"), ("containerd.io/gc.root", "check-walk")],
        );
        let p = info(
            "p",
            "",
            Kind::Committed,
            &[("containerd.io/gc.root", "check-walk")],
        );
        assert!(m(&["labels.\"containerd.io/gc.root\"==check-walk"], &a));
        assert!(m(
            &["kind==active,labels.\"containerd.io/gc.root\"==check-walk"],
            &a
        ));
        assert!(!m(
            &["kind==view,labels.\"containerd.io/gc.root\"==check-walk"],
            &a
        ));
        assert!(m(&["name==p", "name==a-np-wl"], &p));
        assert!(m(&["name==a-wl,labels.l"], &a));
        assert!(!m(&["name==a-wl,labels.l"], &p));
        assert!(!m(&["parent==p"], &a));
        assert!(m(
            &["parent!=\"\",labels.\"containerd.io/gc.root\"==check-walk"],
            &a
        ));
        assert!(!m(&["parent!=\"\""], &p));
        // The metadata store's Walk for a remote snapshot's target.
        let t = info(
            "t",
            "",
            Kind::Committed,
            &[("containerd.io/snapshot.ref", "sha256:ab")],
        );
        assert!(m(
            &["labels.\"containerd.io/snapshot.ref\"==sha256:ab,parent==\"\""],
            &t
        ));
        assert!(!m(
            &["labels.\"containerd.io/snapshot.ref\"==sha256:ab,parent==\"x\""],
            &t
        ));
        assert!(m(&["labels.l==2"], &a));
        assert!(!m(&["labels.l==3"], &a));
        assert!(m(&[], &a));
        assert!(Filters::parse(&["name~=x".into()]).is_err());
        assert!(Filters::parse(&["labels.\"x".into()]).is_err());
    }
}
