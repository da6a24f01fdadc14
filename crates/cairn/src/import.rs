//! `cairn import` (an OCI layout, a `docker save` archive or a directory →
//! an image in the store) and `cairn export` (an image in the store → an
//! OCI layout).
//!
//! This module parses the source and destination strings and prints; the
//! image crate does the work (`cairn_image::import_oci_layout`, …).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use cairn_image::{ImportOptions, ImportedImage, PlatformSpec};
use cairn_store::Store;

use crate::{output, Global};

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// What to import: oci-layout:PATH[:TAG], docker-archive:PATH, or dir:PATH.
    pub source: String,
    /// The name to give the image (default: the tag, the archive's first RepoTags entry, or the directory's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Pick this platform from an image index (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = PlatformSpec::parse)]
    pub platform: Option<PlatformSpec>,
    /// Layers imported at once (oci-layout and docker-archive).
    #[arg(long, default_value_t = cairn_image::DEFAULT_LAYER_JOBS as u16, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The image: a name, or a digest (or a prefix of at least 12 digits).
    pub image: String,
    /// Where: oci-layout:PATH[:TAG] (TAG defaults to the image name's tag, else "latest").
    pub dest: String,
}

/// A parsed import source.
#[derive(Debug, PartialEq, Eq)]
enum Source {
    OciLayout { path: PathBuf, tag: Option<String> },
    DockerArchive(PathBuf),
    Dir(PathBuf),
}

/// Splits `PATH[:TAG]`: the whole string is the path when it names an
/// existing directory, else the part after the last `:` is the tag (if it
/// has no `/`).
fn split_tag(s: &str) -> (PathBuf, Option<String>) {
    if Path::new(s).is_dir() {
        return (PathBuf::from(s), None);
    }
    match s.rsplit_once(':') {
        Some((path, tag)) if !tag.is_empty() && !tag.contains('/') && !path.is_empty() => {
            (PathBuf::from(path), Some(tag.to_owned()))
        }
        _ => (PathBuf::from(s), None),
    }
}

fn parse_source(s: &str) -> Result<Source> {
    if let Some(rest) = s.strip_prefix("oci-layout:") {
        let (path, tag) = split_tag(rest);
        return Ok(Source::OciLayout { path, tag });
    }
    if let Some(rest) = s.strip_prefix("docker-archive:") {
        return Ok(Source::DockerArchive(PathBuf::from(rest)));
    }
    if let Some(rest) = s.strip_prefix("dir:") {
        return Ok(Source::Dir(PathBuf::from(rest)));
    }
    bail!("unknown import source {s:?}: expected oci-layout:PATH[:TAG], docker-archive:PATH or dir:PATH")
}

#[derive(Serialize)]
struct LayerReport {
    diff_id: String,
    blob_digest: Option<String>,
    size: u64,
    entries: u64,
    /// Whether the layer was in the store already (not read again).
    cached: bool,
}

#[derive(Serialize)]
struct ImportReport {
    source: String,
    name: Option<String>,
    image: String,
    manifest_digest: String,
    config_digest: String,
    layers: Vec<LayerReport>,
    seconds: f64,
}

fn open_store(g: &Global) -> Result<Store> {
    Store::open(&g.root).with_context(|| format!("opening the store at {}", g.root.display()))
}

pub fn import(g: &Global, args: &ImportArgs) -> Result<()> {
    let start = Instant::now();
    let source = parse_source(&args.source)?;
    let store = open_store(g)?;
    // Held across layer import and assembly, so gc never takes the layers
    // between the two.
    let _lock = store.lock_shared().context("locking the store")?;
    let opts = ImportOptions {
        name: args.name.clone(),
        platform: args.platform.clone(),
        limits: Default::default(),
        jobs: usize::from(args.jobs),
    };
    let image: ImportedImage = match &source {
        Source::OciLayout { path, tag } => {
            cairn_image::import_oci_layout(&store, path, tag.as_deref(), &opts)
        }
        Source::DockerArchive(path) => cairn_image::import_docker_archive(&store, path, &opts),
        Source::Dir(path) => cairn_image::import_dir(&store, path, &opts),
    }
    .map_err(|e| match e {
        // These name the source already.
        e @ cairn_image::LayerError::Archive { .. } => anyhow::Error::from(e),
        e => anyhow::Error::from(e).context(format!("importing {}", args.source)),
    })?;
    let report = ImportReport {
        source: args.source.clone(),
        name: image.name.clone(),
        image: image.image_digest.clone(),
        manifest_digest: image.manifest_digest.clone(),
        config_digest: image.config_digest.clone(),
        layers: image
            .layers
            .iter()
            .map(|l| LayerReport {
                diff_id: l.diff_id.clone(),
                blob_digest: l.blob_digest.clone(),
                size: l.size,
                entries: l.entries,
                cached: l.cached,
            })
            .collect(),
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &report, |r| {
        let fresh = r.layers.iter().filter(|l| !l.cached).count();
        format!(
            "{} {} ({} layers, {} imported, {} already in the store) in {:.2}s",
            r.name.as_deref().unwrap_or("(unnamed)"),
            r.image,
            r.layers.len(),
            fresh,
            r.layers.len() - fresh,
            r.seconds
        )
    })
}

#[derive(Serialize)]
struct ExportReport {
    image: String,
    dest: PathBuf,
    tag: String,
    manifest_digest: String,
    config_digest: String,
    layer_digest: String,
    diff_id: String,
    layer_size: u64,
    seconds: f64,
}

/// The tag an image name carries (`repo:tag` → `tag`), if any.
fn tag_of(name: &str) -> Option<&str> {
    let last = name.rsplit('/').next().unwrap_or(name);
    let last = last.split('@').next().unwrap_or(last);
    last.rsplit_once(':')
        .map(|(_, t)| t)
        .filter(|t| !t.is_empty())
}

pub fn export(g: &Global, args: &ExportArgs) -> Result<()> {
    let start = Instant::now();
    let Some(rest) = args.dest.strip_prefix("oci-layout:") else {
        bail!(
            "unknown export destination {:?}: expected oci-layout:PATH[:TAG]",
            args.dest
        );
    };
    let (path, tag) = split_tag(rest);
    let tag = tag
        .or_else(|| tag_of(&args.image).map(str::to_owned))
        .unwrap_or_else(|| "latest".into());
    let store = open_store(g)?;
    let _lock = store.lock_shared().context("locking the store")?;
    let resolved = store
        .resolve_image(&args.image)
        .with_context(|| format!("finding image {}", args.image))?;
    let Some(digest) = resolved.digest else {
        bail!(
            "{} is an image file, not an image in the store: import it first",
            args.image
        );
    };
    crate::refuse_incomplete(&store, &digest, &args.image)?;
    let out = cairn_image::export_oci_layout(&store, &digest, &path, &tag)
        .with_context(|| format!("exporting {} to {}", args.image, args.dest))?;
    let report = ExportReport {
        image: digest,
        dest: path,
        tag: out.tag,
        manifest_digest: out.manifest_digest,
        config_digest: out.config_digest,
        layer_digest: out.layer_digest,
        diff_id: out.diff_id,
        layer_size: out.layer_size,
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &report, |r| {
        format!(
            "{}:{} ← {} (one layer, {} bytes) in {:.2}s",
            r.dest.display(),
            r.tag,
            r.image,
            r.layer_size,
            r.seconds
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--platform` is read by the parser `cairn pull` uses, so uname's
    /// names work for an import too.
    #[test]
    fn platform_flag_normalises_like_pull() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            import: ImportArgs,
        }
        let parse = |p: &str| {
            <Cli as clap::Parser>::try_parse_from(["import", "oci-layout:x", "--platform", p])
                .map(|c| c.import.platform.unwrap().to_string())
        };
        assert_eq!(parse("linux/x86_64").unwrap(), "linux/amd64");
        assert_eq!(parse("linux/aarch64").unwrap(), "linux/arm64");
        let e = parse("linux").unwrap_err().to_string();
        assert!(e.contains("expected os/arch[/variant]"), "{e}");
    }

    #[test]
    fn sources() {
        assert_eq!(
            parse_source("oci-layout:/no/such/dir:v1").unwrap(),
            Source::OciLayout {
                path: "/no/such/dir".into(),
                tag: Some("v1".into())
            }
        );
        assert_eq!(
            parse_source("oci-layout:/no/such/dir").unwrap(),
            Source::OciLayout {
                path: "/no/such/dir".into(),
                tag: None
            }
        );
        assert_eq!(
            parse_source("docker-archive:x.tar").unwrap(),
            Source::DockerArchive("x.tar".into())
        );
        assert_eq!(
            parse_source("dir:/tmp").unwrap(),
            Source::Dir("/tmp".into())
        );
        assert!(parse_source("registry:foo").is_err());
        assert_eq!(tag_of("127.0.0.1:5000/debian:12"), Some("12"));
        assert_eq!(tag_of("127.0.0.1:5000/debian"), None);
        assert_eq!(tag_of("debian@sha256:abc"), None);
    }
}
