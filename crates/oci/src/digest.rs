//! Content digests as the OCI image spec writes them: `sha256:<64 hex>`.
//!
//! Only SHA-256 is accepted: it is the one algorithm every registry and
//! image in use has, and the one the layer importer checks. A digest that
//! names another algorithm is refused with that said, not misread.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// A validated `sha256:` digest (lower-case hex).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<64 lower-case hex digits>`.
    pub fn parse(s: &str) -> Result<Digest, String> {
        let Some((algo, hex)) = s.split_once(':') else {
            return Err(format!("{s:?} is not of the form algorithm:hex"));
        };
        if algo != "sha256" {
            return Err(format!(
                "unsupported digest algorithm {algo:?} (only sha256)"
            ));
        }
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(format!(
                "{s:?}: expected 64 lower-case hex digits after sha256:"
            ));
        }
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
