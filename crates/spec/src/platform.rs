//! Platforms (`os/arch[/variant]`): the one parser of a wanted platform,
//! the one normaliser of the names images and users give, and the choice
//! of one manifest from an index. A registry pull and a local import both
//! use it, so `--platform linux/x86_64` means the same to both.
//!
//! Names are normalised as containerd's `platforms` package does, so a
//! platform means what it means to docker and podman: `x86_64` and
//! `x86-64` are `amd64` (whose `v1` variant is the default, so none),
//! `aarch64` is `arm64` (whose default variant, `v8` or `8`, is none),
//! `i386` is `386`, `armhf` is `arm/v7`, `armel` is `arm/v6`, and `arm`
//! without a variant is `arm/v7`; a bare variant number gains its `v`.
//! The same rules apply to what an index entry states, so an entry for
//! `linux/arm64/v8` is the one `linux/arm64` wants. Pure: no I/O.

use std::fmt;

use crate::image::Descriptor;
pub use crate::image::Platform;

/// A `--platform` that is not `os/arch[/variant]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid platform {input:?}: {reason}")]
pub struct InvalidPlatform {
    pub input: String,
    pub reason: String,
}

/// No entry of an index is for the wanted platform.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "no image for platform {wanted} (available: {})",
    list_or_none(available)
)]
pub struct NoMatchingPlatform {
    /// The wanted platform, normalised.
    pub wanted: String,
    /// The platforms the index has, as it states them (`unknown/unknown`
    /// entries, which hold attestations, left out).
    pub available: Vec<String>,
}

fn list_or_none(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}

/// A wanted platform, normalised. `variant: None` means the
/// architecture's default variant (or, for architectures that have none,
/// any variant, an entry without one preferred).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformSpec {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl PlatformSpec {
    /// Parses and normalises `os/arch[/variant]` (e.g. `linux/arm64/v8`,
    /// `linux/x86_64`).
    pub fn parse(s: &str) -> Result<PlatformSpec, InvalidPlatform> {
        let bad = || InvalidPlatform {
            input: s.to_string(),
            reason: "expected os/arch[/variant]".to_string(),
        };
        let ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
        };
        let parts: Vec<&str> = s.split('/').collect();
        let (os, arch, variant) = match parts[..] {
            [os, arch] => (os, arch, None),
            [os, arch, variant] => (os, arch, Some(variant)),
            _ => return Err(bad()),
        };
        if !ok(os) || !ok(arch) || !variant.is_none_or(ok) {
            return Err(bad());
        }
        Ok(PlatformSpec::new(os, arch, variant))
    }

    /// `os`, `arch` and `variant` as an image or a user spells them,
    /// normalised.
    pub fn new(os: &str, arch: &str, variant: Option<&str>) -> PlatformSpec {
        let (architecture, variant) = normalize_arch(arch, variant);
        PlatformSpec {
            os: normalize_os(os),
            architecture,
            variant,
        }
    }

    /// The platform this process runs on (`linux/amd64` on x86_64). On
    /// 32-bit arm this is `arm/v7`, the normalised default, as containerd
    /// assumes without reading `/proc/cpuinfo`.
    pub fn host() -> PlatformSpec {
        PlatformSpec::new(std::env::consts::OS, host_arch(), None)
    }

    /// Whether an index entry's (or a config's) platform is this one.
    pub fn matches(&self, p: &Platform) -> bool {
        let have = PlatformSpec::new(&p.os, &p.architecture, p.variant.as_deref());
        have.os == self.os
            && have.architecture == self.architecture
            && (self.variant.is_none() || have.variant == self.variant)
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

/// The OCI (Go) name of the architecture this was compiled for.
fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        "powerpc64" => "ppc64",
        "loongarch64" => "loong64",
        other => other,
    }
}

fn normalize_os(os: &str) -> String {
    match os.to_ascii_lowercase().as_str() {
        "macos" => "darwin".to_string(),
        other => other.to_string(),
    }
}

/// Architecture and variant as uname, Rust or an image spells them → the
/// OCI names, the default variant dropped (containerd's `NormalizeArch`).
pub fn normalize_arch(arch: &str, variant: Option<&str>) -> (String, Option<String>) {
    let arch = arch.to_ascii_lowercase();
    let variant = variant
        .filter(|v| !v.is_empty())
        .map(str::to_ascii_lowercase);
    let (arch, variant) = match (arch.as_str(), variant.as_deref()) {
        ("i386" | "i686" | "x86", _) => ("386", None),
        ("x86_64" | "x86-64" | "amd64", Some("v1")) => ("amd64", None),
        ("x86_64" | "x86-64" | "amd64", v) => ("amd64", v),
        ("aarch64" | "arm64", Some("8" | "v8")) => ("arm64", None),
        ("aarch64" | "arm64", v) => ("arm64", v),
        ("armhf", _) => ("arm", Some("v7")),
        ("armel", _) => ("arm", Some("v6")),
        ("arm", None | Some("7")) => ("arm", Some("v7")),
        ("arm", Some(v @ ("5" | "6" | "8"))) => {
            return ("arm".to_string(), Some(format!("v{v}")));
        }
        ("powerpc64le", v) => ("ppc64le", v),
        ("powerpc64", v) => ("ppc64", v),
        ("loongarch64", v) => ("loong64", v),
        ("riscv64gc", v) => ("riscv64", v),
        (a, v) => (a, v),
    };
    (arch.to_string(), variant.map(str::to_string))
}

/// `os/arch[/variant]` of an index entry, as it states it.
pub fn describe(p: &Platform) -> String {
    match &p.variant {
        Some(v) if !v.is_empty() => format!("{}/{}/{v}", p.os, p.architecture),
        _ => format!("{}/{}", p.os, p.architecture),
    }
}

/// Picks the entry of an index for `want`. Entries without a platform are
/// skipped unless the index has only one entry and it has none (as some
/// single-image indexes do). Without a wanted variant, an entry without one
/// (after normalisation: with the architecture's default) is preferred
/// over the others, then the first.
pub fn choose<'a>(
    manifests: &'a [Descriptor],
    want: &PlatformSpec,
) -> Result<&'a Descriptor, NoMatchingPlatform> {
    choose_by(manifests, |d| d.platform.as_ref(), want)
}

/// [`choose`] over entries of any type, `platform_of` giving each one's
/// platform: for a reader that checks an entry only once it is chosen.
pub fn choose_by<'a, T>(
    entries: &'a [T],
    platform_of: impl Fn(&T) -> Option<&Platform>,
    want: &PlatformSpec,
) -> Result<&'a T, NoMatchingPlatform> {
    if let [only] = entries {
        if platform_of(only).is_none() {
            return Ok(only);
        }
    }
    let candidates: Vec<(&T, &Platform)> = entries
        .iter()
        .filter_map(|e| Some((e, platform_of(e)?)))
        .filter(|(_, p)| want.matches(p))
        .collect();
    let preferred = candidates
        .iter()
        .find(|(_, p)| normalize_arch(&p.architecture, p.variant.as_deref()).1 == want.variant)
        .or(candidates.first());
    preferred.map(|(e, _)| *e).ok_or_else(|| {
        let mut available: Vec<String> = entries
            .iter()
            .filter_map(&platform_of)
            .filter(|p| p.os != "unknown")
            .map(describe)
            .collect();
        available.dedup();
        NoMatchingPlatform {
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
            media_type: crate::media_type::OCI_MANIFEST.into(),
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
    fn parse_and_normalise() {
        let p = |s: &str| PlatformSpec::parse(s).unwrap().to_string();
        assert_eq!(p("linux/arm64/v8"), "linux/arm64");
        assert_eq!(p("linux/aarch64"), "linux/arm64");
        assert_eq!(p("linux/x86_64"), "linux/amd64");
        assert_eq!(p("Linux/X86-64"), "linux/amd64");
        assert_eq!(p("linux/amd64/v1"), "linux/amd64");
        assert_eq!(p("linux/amd64/v3"), "linux/amd64/v3");
        assert_eq!(p("linux/arm"), "linux/arm/v7");
        assert_eq!(p("linux/arm/6"), "linux/arm/v6");
        assert_eq!(p("linux/armhf"), "linux/arm/v7");
        assert_eq!(p("linux/armel"), "linux/arm/v6");
        assert_eq!(p("linux/i386"), "linux/386");
        for bad in [
            "linux",
            "linux/",
            "/amd64",
            "a/b/c/d",
            "linux/amd 64",
            "linux/arm/",
        ] {
            let e = PlatformSpec::parse(bad).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("invalid platform {bad:?}: expected os/arch[/variant]")
            );
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
            |s: &str| choose(&idx, &PlatformSpec::parse(s).unwrap()).map(|d| d.digest.clone());
        assert_eq!(pick("linux/amd64").unwrap(), idx[0].digest);
        assert_eq!(pick("linux/x86_64").unwrap(), idx[0].digest);
        assert_eq!(pick("linux/arm64").unwrap(), idx[2].digest);
        assert_eq!(pick("linux/aarch64").unwrap(), idx[2].digest);
        assert_eq!(pick("linux/arm64/v8").unwrap(), idx[2].digest);
        assert_eq!(pick("linux/arm/v7").unwrap(), idx[1].digest);
        assert_eq!(pick("linux/arm").unwrap(), idx[1].digest);
        let e = pick("linux/s390x").unwrap_err().to_string();
        assert_eq!(
            e,
            "no image for platform linux/s390x (available: linux/amd64, linux/arm/v7, linux/arm64/v8)"
        );
        assert!(pick("linux/arm/v6").is_err());
        // An entry with a non-default variant is taken only when no
        // default one is there.
        let v3 = [
            desc("linux", "amd64", Some("v3"), 5),
            desc("linux", "x86_64", None, 6),
        ];
        let want = PlatformSpec::parse("linux/amd64").unwrap();
        assert_eq!(choose(&v3, &want).unwrap().digest, v3[1].digest);
        assert_eq!(choose(&v3[..1], &want).unwrap().digest, v3[0].digest);
    }
}
