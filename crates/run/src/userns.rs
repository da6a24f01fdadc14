//! The `--userns auto` pool: distinct, non-overlapping id ranges for
//! containers, like `/etc/subuid` entries handed out one per container.
//!
//! The pool is `ranges` slots of `size` ids starting at host id `start`
//! (uid and gid alike), configured in `<root>/userns.conf`:
//!
//! ```text
//! # first host id, ids per container (65536 gives a full 16-bit range), slots
//! start = 100000
//! size = 65536
//! ranges = 1024
//! ```
//!
//! Slot `n` is taken by creating `containers/userns/<n>` with `O_EXCL`
//! (holding the container id): creation is atomic, so parallel runs never
//! get the same slot and no lock is needed. Teardown unlinks the file; a
//! slot whose container directory is gone (a crash between allocation and
//! the state being written) is freed by the reaper.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};

use crate::state::{Paths, UsernsRange};
use crate::RunError;

/// The pool's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    pub start: u32,
    pub size: u32,
    pub ranges: u32,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            start: 100_000,
            size: 65_536,
            ranges: 1024,
        }
    }
}

impl Pool {
    /// Reads `userns.conf` (defaults for what it does not set).
    pub fn load(paths: &Paths) -> Result<Pool, RunError> {
        let path = paths.userns_conf();
        match fs::read_to_string(&path) {
            Ok(text) => Pool::parse(&text)
                .map_err(|e| RunError::Invalid(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Pool::default()),
            Err(e) => Err(RunError::Io {
                what: "reading".into(),
                path,
                source: e,
            }),
        }
    }

    pub fn parse(text: &str) -> Result<Pool, String> {
        let mut pool = Pool::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("line {}: expected KEY = VALUE", n + 1))?;
            let v: u32 = v
                .trim()
                .parse()
                .map_err(|_| format!("line {}: {:?} is not a number", n + 1, v.trim()))?;
            match k.trim() {
                "start" => pool.start = v,
                "size" => pool.size = v,
                "ranges" => pool.ranges = v,
                other => return Err(format!("line {}: unknown key {other:?}", n + 1)),
            }
        }
        if pool.start == 0 || pool.size == 0 || pool.ranges == 0 {
            return Err(
                "start, size and ranges must all be at least 1 (id 0 is the host's root)".into(),
            );
        }
        let end = u64::from(pool.start) + u64::from(pool.size) * u64::from(pool.ranges);
        if end > u64::from(u32::MAX) {
            return Err(format!("the pool ends at id {end}, past the largest id"));
        }
        Ok(pool)
    }

    fn range(&self, slot: u32) -> UsernsRange {
        let base = self.start + slot * self.size;
        UsernsRange {
            uid: base,
            gid: base,
            count: self.size,
            slot: Some(slot),
        }
    }
}

/// Takes the lowest free slot for container `id`.
pub fn allocate(paths: &Paths, pool: &Pool, id: &str) -> Result<UsernsRange, RunError> {
    let dir = paths.userns();
    fs::create_dir_all(&dir).map_err(|e| RunError::Io {
        what: "creating".into(),
        path: dir.clone(),
        source: e,
    })?;
    for slot in 0..pool.ranges {
        let path = dir.join(slot.to_string());
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                f.write_all(id.as_bytes()).map_err(|e| RunError::Io {
                    what: "writing".into(),
                    path: path.clone(),
                    source: e,
                })?;
                return Ok(pool.range(slot));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(RunError::Io {
                    what: "creating".into(),
                    path,
                    source: e,
                })
            }
        }
    }
    Err(RunError::Invalid(format!(
        "all {} user namespace ranges of the pool are in use (see {})",
        pool.ranges,
        paths.userns_conf().display()
    )))
}

/// Frees `slot` if it belongs to container `id`.
pub fn free(paths: &Paths, slot: u32, id: &str) {
    let path = paths.userns().join(slot.to_string());
    if fs::read_to_string(&path).is_ok_and(|owner| owner == id) {
        let _ = fs::remove_file(&path);
    }
}

/// Frees slots whose container directory is gone. Returns how many.
pub fn free_orphans(paths: &Paths) -> usize {
    let Ok(rd) = fs::read_dir(paths.userns()) else {
        return 0;
    };
    let mut freed = 0;
    for e in rd.flatten() {
        let owner = fs::read_to_string(e.path()).unwrap_or_default();
        let gone = owner.is_empty() || !paths.container(owner.trim()).is_dir();
        // A slot file is written right after it is created; an empty one
        // may be a live allocation in progress: give it a minute.
        let young = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() < 60);
        if gone && !(owner.is_empty() && young) && fs::remove_file(e.path()).is_ok() {
            freed += 1;
        }
    }
    freed
}

/// Slots in use.
pub fn in_use(paths: &Paths) -> Vec<u32> {
    let mut slots: Vec<u32> = fs::read_dir(paths.userns())
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    slots.sort_unstable();
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_config_and_rejects_overflow() {
        let p = Pool::parse("# pool\nstart = 200000\nsize=65536\nranges = 4\n").unwrap();
        assert_eq!(
            p,
            Pool {
                start: 200_000,
                size: 65_536,
                ranges: 4
            }
        );
        assert!(Pool::parse("ranges = 100000").unwrap_err().contains("past"));
        assert!(Pool::parse("colour = 1").is_err());
        assert!(Pool::parse("start = 0").is_err());
    }

    #[test]
    fn slots_are_distinct_and_freed() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Paths::new(tmp.path());
        let pool = Pool {
            start: 100_000,
            size: 65_536,
            ranges: 2,
        };
        fs::create_dir_all(paths.container("a")).unwrap();
        fs::create_dir_all(paths.container("b")).unwrap();
        let a = allocate(&paths, &pool, "a").unwrap();
        let b = allocate(&paths, &pool, "b").unwrap();
        assert_eq!((a.uid, b.uid), (100_000, 165_536));
        assert!(allocate(&paths, &pool, "c").is_err());
        free(&paths, b.slot.unwrap(), "a");
        assert_eq!(in_use(&paths), [0, 1], "not a's slot to free");
        free(&paths, b.slot.unwrap(), "b");
        assert_eq!(in_use(&paths), [0]);
        fs::remove_dir_all(paths.container("a")).unwrap();
        assert_eq!(free_orphans(&paths), 1);
        assert!(in_use(&paths).is_empty());
    }
}
