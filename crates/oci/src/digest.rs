//! Content digests as the OCI image spec writes them: `sha256:<64 hex>`.
//!
//! Only SHA-256 is accepted: it is the one algorithm every registry and
//! image in use has, and the one the layer importer checks. A digest that
//! names another algorithm (`sha512` included) is refused with that said,
//! not misread. The parsing itself is `cairn_store::parse_digest`, shared
//! with the layer importer and the local image sources.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// A validated `sha256:` digest (lower-case hex).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<64 lower-case hex digits>` with the store's parser
    /// ([`cairn_store::parse_digest`], the spec's grammar), so that every
    /// crate agrees on what a digest is.
    pub fn parse(s: &str) -> Result<Digest, String> {
        cairn_store::parse_digest(s).map_err(|e| e.to_string())?;
        Ok(Digest(s.to_string()))
    }

    /// The SHA-256 digest of `data`.
    pub fn of(data: &[u8]) -> Digest {
        Digest(format!("sha256:{}", hex::encode(Sha256::digest(data))))
    }

    /// `sha256:…`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hex part.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// `sha256:` and the first 12 hex digits, for progress lines.
    pub fn short(&self) -> &str {
        &self.0[..("sha256:".len() + 12)]
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_compute() {
        let d = Digest::of(b"");
        assert_eq!(
            d.as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert_eq!(d.short(), "sha256:e3b0c44298fc");
        assert!(Digest::parse("sha512:00").is_err());
        assert!(Digest::parse(&d.as_str().to_uppercase().replace("SHA256", "sha256")).is_err());
        assert!(Digest::parse("sha256:").is_err());
        assert!(Digest::parse("e3b0").is_err());
    }
}
