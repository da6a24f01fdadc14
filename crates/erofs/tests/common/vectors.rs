//! Where the composefs test vectors are: the dumpfiles of composefs's
//! `tests/assets` with the sha256 of the image the reference `mkcomposefs`
//! writes for each. They are not part of this repository; the tests that
//! compare against them (the writer's byte-exactness, the parser's
//! strictness) need them and stop with a message naming what is missing.
//!
//! Included by path by every test that reads them (the integration tests
//! and the dump module's unit tests), so the rule is written once.

use std::path::{Path, PathBuf};

/// The variable that names the vectors' directory. A relative path is
/// taken from the workspace root.
pub const VECTORS_VAR: &str = "CAIRN_COMPOSEFS_VECTORS";

/// Where the vectors are when the variable is unset, from the workspace
/// root: the project's shared folder beside the clone.
pub const DEFAULT_VECTORS: &str = "../shared/testdata/composefs";

/// The directory holding the vectors.
///
/// # Panics
///
/// If it is missing or holds no vector, with a message naming the path and
/// the variable: these tests cannot pass without the vectors, and skipping
/// them quietly would leave the writer unchecked (CI has the folder).
pub fn vectors_dir() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let configured = std::env::var_os(VECTORS_VAR);
    let dir = workspace.join(configured.as_deref().unwrap_or(DEFAULT_VECTORS.as_ref()));
    let has_vectors = std::fs::read_dir(&dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".sha256"))
    });
    if !has_vectors {
        let how = match configured {
            Some(_) => format!("as {VECTORS_VAR} says"),
            None => format!("{VECTORS_VAR} is unset, so {DEFAULT_VECTORS} from the workspace root"),
        };
        panic!(
            "the composefs test vectors are missing: {} ({how}) is not a directory of \
             vectors. Set {VECTORS_VAR} to a directory holding composefs's tests/assets \
             (NAME.dump[.gz] and NAME.dump[.gz].sha256), or put them at {DEFAULT_VECTORS} \
             beside the clone.",
            dir.display()
        );
    }
    dir
}
