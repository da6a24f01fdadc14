//! Platforms (`os/arch[/variant]`) and choosing one manifest from an index.
//!
//! Architecture names are the OCI (Go) ones: `amd64`, `arm64`, `arm`, …; the
//! host's Rust names are mapped to them. `arm64` without a variant means
//! `v8`, as the image spec says. Pure: no I/O.

use std::fmt;

use crate::spec::{Descriptor, Platform};
use crate::PullError;

/// A wanted platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformSpec {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl PlatformSpec {
    /// Parses `os/arch[/variant]` (e.g. `linux/arm64/v8`).
    pub fn parse(s: &str) -> Result<PlatformSpec, PullError> {
        let bad = |reason: &str| PullError::InvalidPlatform {
            input: s.to_string(),
            reason: reason.to_string(),
        };
        let parts: Vec<&str> = s.split('/').collect();
        let ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
        };
        match parts[..] {
            [os, arch] | [os, arch, _] if !ok(os) || !ok(arch) => {
                Err(bad("expected os/arch[/variant]"))
            }
            [_, _, v] if !ok(v) => Err(bad("expected os/arch[/variant]")),
            [os, arch] => Ok(PlatformSpec {
                os: os.to_ascii_lowercase(),
                architecture: normalize_arch(&arch.to_ascii_lowercase()),
                variant: None,
            }),
            [os, arch, variant] => Ok(PlatformSpec {
                os: os.to_ascii_lowercase(),
                architecture: normalize_arch(&arch.to_ascii_lowercase()),
                variant: Some(variant.to_ascii_lowercase()),
            }),
            _ => Err(bad("expected os/arch[/variant]")),
        }
    }

    /// The platform this process runs on (`linux/amd64` on x86_64).
    pub fn host() -> PlatformSpec {
        PlatformSpec {
            os: std::env::consts::OS.to_string(),
            architecture: normalize_arch(std::env::consts::ARCH),
            variant: None,
        }
    }

    fn matches(&self, p: &Platform) -> bool {
        if p.os != self.os || normalize_arch(&p.architecture) != self.architecture {
            return false;
        }
        match &self.variant {
            None => true,
            Some(want) => {
                normalize_variant(&self.architecture, Some(want))
                    == normalize_variant(&self.architecture, p.variant.as_deref())
            }
        }
    }
}

impl fmt::Display for PlatformSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// Rust and uname spellings → OCI ones.
pub fn normalize_arch(arch: &str) -> String {
    match arch {
        "x86_64" | "x86-64" => "amd64",
        "aarch64" => "arm64",
        "x86" | "i386" | "i686" => "386",
        "powerpc64" => "ppc64",
        "powerpc64le" => "ppc64le",
        "loongarch64" => "loong64",
        "riscv64gc" => "riscv64",
        other => other,
    }
    .to_string()
}

fn normalize_variant(arch: &str, variant: Option<&str>) -> Option<String> {
    match (arch, variant) {
        ("arm64", None | Some("v8")) => None,
        (_, v) => v.map(str::to_ascii_lowercase),
    }
}

/// `os/arch[/variant]` of an index entry.
pub fn describe(p: &Platform) -> String {
    match &p.variant {
        Some(v) if !v.is_empty() => format!("{}/{}/{v}", p.os, p.architecture),
        _ => format!("{}/{}", p.os, p.architecture),
    }
}

/// Picks the entry of an index for `want`. Entries without a platform are
/// skipped unless the index has only one entry and it has none (as some
/// single-image indexes do). Without a wanted variant, an entry without one
/// (or with the architecture's default) is preferred over the others.
pub fn choose<'a>(
    manifests: &'a [Descriptor],
    want: &PlatformSpec,
    reference: &str,
) -> Result<&'a Descriptor, PullError> {
    if let [only] = manifests {
        if only.platform.is_none() {
            return Ok(only);
        }
    }
    let candidates: Vec<&Descriptor> = manifests
        .iter()
        .filter(|d| d.platform.as_ref().is_some_and(|p| want.matches(p)))
        .collect();
    let preferred = candidates
        .iter()
        .find(|d| {
            d.platform.as_ref().is_some_and(|p| {
                normalize_variant(&want.architecture, p.variant.as_deref()).is_none()
            })
        })
        .or(candidates.first());
    preferred.copied().ok_or_else(|| {
        let mut available: Vec<String> = manifests
            .iter()
            .filter_map(|d| d.platform.as_ref())
            .filter(|p| p.os != "unknown")
            .map(describe)
            .collect();
        available.dedup();
        PullError::NoMatchingPlatform {
            reference: reference.to_string(),
            wanted: want.to_string(),
            available,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(os: &str, arch: &str, variant: Option<&str>, n: u8) -> Descriptor {
        Descriptor {
            media_type: crate::spec::media_type::OCI_MANIFEST.into(),
            digest: format!("sha256:{}", format!("{n:02x}").repeat(32)),
            size: 1,
            urls: vec![],
            platform: Some(Platform {
                architecture: arch.into(),
                os: os.into(),
                os_version: None,
                variant: variant.map(Into::into),
            }),
            annotations: Default::default(),
        }
    }

    #[test]
    fn parse_platforms() {
        let p = PlatformSpec::parse("linux/arm64/v8").unwrap();
        assert_eq!(p.to_string(), "linux/arm64/v8");
        assert_eq!(
            PlatformSpec::parse("linux/x86_64").unwrap().architecture,
            "amd64"
        );
        for bad in ["linux", "linux/", "/amd64", "a/b/c/d", "linux/amd 64"] {
            assert!(PlatformSpec::parse(bad).is_err(), "{bad}");
        }
        let host = PlatformSpec::host();
        assert_eq!(host.os, "linux");
        assert!(!host.architecture.contains('_'));
    }

    #[test]
    fn choose_platform() {
        let idx = [
            desc("linux", "amd64", None, 1),
            desc("linux", "arm", Some("v7"), 2),
            desc("linux", "arm64", Some("v8"), 3),
            desc("unknown", "unknown", None, 4),
        ];
        let pick =
            |s: &str| choose(&idx, &PlatformSpec::parse(s).unwrap(), "r").map(|d| d.digest.clone());
        assert_eq!(pick("linux/amd64").unwrap(), idx[0].digest);
        assert_eq!(pick("linux/arm64").unwrap(), idx[2].digest);
        assert_eq!(pick("linux/arm64/v8").unwrap(), idx[2].digest);
        assert_eq!(pick("linux/arm/v7").unwrap(), idx[1].digest);
        let e = pick("linux/s390x").unwrap_err().to_string();
        assert_eq!(
            e,
            "no image for platform linux/s390x in r (available: linux/amd64, linux/arm/v7, linux/arm64/v8)"
        );
        assert!(pick("linux/arm/v6").is_err());
    }
}
