//! Content digests as the OCI image spec writes them (`descriptor.md`): the
//! one parser every crate runs on a digest from outside (a manifest, an
//! index, a config's `rootfs.diff_ids`, a layout's blob name, a reference)
//! before the digest names a file, a URL or a record.
//!
//! The grammar is the spec's:
//!
//! ```text
//! digest     := algorithm ":" encoded
//! algorithm  := component (separator component)*
//! component  := [a-z0-9]+
//! separator  := [+._-]
//! encoded    := [a-zA-Z0-9=_-]+
//! ```
//!
//! and the registered algorithms fix the encoding: `sha256` is 64 and
//! `sha512` 128 lower-case hex digits. Upper-case hex is refused, not
//! folded: the spec says lower-case, and two spellings of one digest would
//! name two files. cairn verifies SHA-256 only, so a well-formed `sha512`
//! digest is refused as unsupported and any other algorithm as
//! unregistered; either way the message says which. Pure: no I/O.
//!
//! [`Digest`] is a string that passed [`parse_digest`], for code that keeps
//! digests around (the registry client, references) and wants the type to
//! say they were checked.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// The longest digest string an error message quotes in full.
const MAX_QUOTED: usize = 100;

/// Why a string is not a digest cairn can verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    /// Not `algorithm:encoded` by the spec's grammar.
    #[error("{digest} is not a digest ({reason}; expected sha256:<64 lower-case hex digits>)")]
    Malformed { digest: Quoted, reason: String },
    /// A registered algorithm with an encoding the spec does not allow.
    #[error("{digest}: a {algorithm} digest is {len} lower-case hex digits")]
    Encoding {
        digest: Quoted,
        algorithm: &'static str,
        len: usize,
    },
    /// Registered but not verified by cairn (`sha512`).
    #[error("{digest}: {algorithm} digests are not supported (cairn verifies sha256 only)")]
    Unsupported {
        digest: Quoted,
        algorithm: &'static str,
    },
    /// Well-formed, but an algorithm the image spec does not register.
    #[error(
        "{digest}: unregistered digest algorithm {algorithm:?} (the OCI image spec registers \
         sha256 and sha512; cairn verifies sha256)"
    )]
    Unregistered { digest: Quoted, algorithm: String },
}

/// A digest string as error messages show it: quoted, escaped, and cut
/// short when long (a hostile manifest's "digest" may be megabytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quoted(String);

impl Quoted {
    fn new(s: &str) -> Quoted {
        if s.chars().count() <= MAX_QUOTED {
            Quoted(format!("{s:?}"))
        } else {
            let head: String = s.chars().take(MAX_QUOTED).collect();
            Quoted(format!("{head:?}… ({} bytes)", s.len()))
        }
    }
}

impl fmt::Display for Quoted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn is_lower_hex_of(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Parses `s` as a digest cairn verifies, `sha256:<64 lower-case hex
/// digits>`, and returns its hex part. Everything else is an error that
/// says what is wrong: the grammar, the encoding of a registered
/// algorithm, or the algorithm.
pub fn parse_digest(s: &str) -> Result<&str, DigestError> {
    let malformed = |reason: &str| DigestError::Malformed {
        digest: Quoted::new(s),
        reason: reason.to_owned(),
    };
    let Some((algorithm, encoded)) = s.split_once(':') else {
        return Err(malformed("no ':' between algorithm and encoded part"));
    };
    let components_ok = algorithm
        .split(['+', '.', '_', '-'])
        .all(|c| !c.is_empty() && c.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9')));
    if !components_ok {
        return Err(malformed(
            "the algorithm must be [a-z0-9]+ components joined by one of +._-",
        ));
    }
    if encoded.is_empty()
        || !encoded
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'=' | b'_' | b'-'))
    {
        return Err(malformed("the encoded part must be [a-zA-Z0-9=_-]+"));
    }
    match algorithm {
        "sha256" if is_lower_hex_of(encoded, 64) => Ok(encoded),
        "sha256" => Err(DigestError::Encoding {
            digest: Quoted::new(s),
            algorithm: "sha256",
            len: 64,
        }),
        "sha512" if is_lower_hex_of(encoded, 128) => Err(DigestError::Unsupported {
            digest: Quoted::new(s),
            algorithm: "sha512",
        }),
        "sha512" => Err(DigestError::Encoding {
            digest: Quoted::new(s),
            algorithm: "sha512",
            len: 128,
        }),
        other => Err(DigestError::Unregistered {
            digest: Quoted::new(s),
            algorithm: other.to_owned(),
        }),
    }
}

/// A validated `sha256:` digest (lower-case hex): only [`Digest::parse`]
/// and [`Digest::of`] make one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<64 lower-case hex digits>` with [`parse_digest`].
    pub fn parse(s: &str) -> Result<Digest, DigestError> {
        parse_digest(s)?;
        Ok(Digest(s.to_owned()))
    }

    /// The SHA-256 digest of `data`.
    pub fn of(data: &[u8]) -> Digest {
        Digest(sha256_digest(data))
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

/// `sha256:<hex>` of `data`, as a string: how descriptors and diff_ids
/// name content.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_type_parses_and_computes() {
        let d = Digest::of(b"");
        assert_eq!(
            d.as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert_eq!(d.short(), "sha256:e3b0c44298fc");
        assert_eq!(d.hex().len(), 64);
        let upper = format!("sha256:{}", d.hex().to_uppercase());
        assert!(matches!(
            Digest::parse(&upper),
            Err(DigestError::Encoding { .. })
        ));
        assert!(Digest::parse("sha256:").is_err());
        assert!(Digest::parse("e3b0").is_err());
    }

    #[test]
    fn sha256_only_lower_case() {
        let hex = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(parse_digest(&format!("sha256:{hex}")), Ok(hex));
        let upper = format!("sha256:{}", hex.to_uppercase());
        assert_eq!(
            parse_digest(&upper).unwrap_err().to_string(),
            format!("{upper:?}: a sha256 digest is 64 lower-case hex digits")
        );
        assert!(matches!(
            parse_digest(&format!("sha256:{}", &hex[1..])),
            Err(DigestError::Encoding { .. })
        ));
        assert!(matches!(
            parse_digest(&format!("SHA256:{hex}")),
            Err(DigestError::Malformed { .. })
        ));
    }

    #[test]
    fn other_algorithms_say_why() {
        let e = parse_digest(&format!("sha512:{}", "ab".repeat(64))).unwrap_err();
        assert!(matches!(e, DigestError::Unsupported { .. }), "{e}");
        assert!(
            e.to_string().contains("sha512 digests are not supported"),
            "{e}"
        );
        let e = parse_digest("sha512:abc").unwrap_err();
        assert!(matches!(e, DigestError::Encoding { len: 128, .. }), "{e}");
        let e = parse_digest("multihash+base58:QmRZxt2b1FVZPNqd8hsiykDL3TdBDeTSPX9Kv46HmX4Gx8")
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("unregistered digest algorithm \"multihash+base58\""),
            "{e}"
        );
        for other in [
            "md5:d41d8cd98f00b204e9800998ecf8427e",
            "sha+256:ab",
            "x.y-z_1:A=",
        ] {
            assert!(
                matches!(parse_digest(other), Err(DigestError::Unregistered { .. })),
                "{other}"
            );
        }
    }

    #[test]
    fn malformed_and_path_like() {
        for bad in [
            "",
            ":",
            "sha256:",
            ":abc",
            "sha256",
            "sha256:../../x",
            "sha256:ab/cd",
            "sha256:ab\0cd",
            "../sha256:ab",
            "sha256+:ab",
            "sha__256:ab",
            "Sha256:ab",
            "sha256:ab:cd",
            "sha256:ab cd",
        ] {
            let e = parse_digest(bad).unwrap_err();
            assert!(matches!(e, DigestError::Malformed { .. }), "{bad:?}: {e}");
        }
    }

    #[test]
    fn long_inputs_are_quoted_short() {
        let long = format!("sha256:{}", "x/".repeat(100_000));
        let msg = parse_digest(&long).unwrap_err().to_string();
        assert!(msg.len() < 400, "{msg}");
        assert!(msg.contains("(200007 bytes)"), "{msg}");
    }
}
