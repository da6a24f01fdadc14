//! `cairn push` and `cairn fetch`: publishing an image as a lazy-image
//! artifact, and completing an image pulled with `--lazy`. The work is
//! `cairn_remote`'s; this file parses arguments and prints results.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use crate::pull::human_bytes;
use crate::{output, Global};

/// Registry client flags shared by push, fetch and pull.
#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    /// Plain HTTP instead of HTTPS (loopback registries get plain HTTP anyway).
    #[arg(long)]
    pub insecure: bool,
    /// Credentials file (containers-auth.json(5) or Docker config.json format) instead of the default search.
    #[arg(long, value_name = "PATH")]
    pub authfile: Option<PathBuf>,
    /// Attempts per request, the first included (transient errors only).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub attempts: u32,
}

impl ClientArgs {
    pub fn options(&self) -> cairn_oci::ClientOptions {
        let mut c = cairn_oci::ClientOptions {
            insecure: self.insecure,
            max_attempts: self.attempts,
            read_timeout: Duration::from_secs(30),
            ..cairn_oci::ClientOptions::default()
        };
        if let Some(f) = &self.authfile {
            c.auth_files = vec![f.clone()];
        }
        c
    }
}

#[derive(Args, Debug)]
pub struct PushArgs {
    /// The image: a name or digest of the store (pulled or imported, so that its manifest is known).
    pub image: String,
    /// Where to: REGISTRY[:PORT]/REPOSITORY:TAG. Push to the image's own repository so that `cairn pull --lazy` finds the artifact from the image's reference.
    pub target: String,
    /// Close a pack once it holds this many bytes (e.g. 64M).
    #[arg(long, default_value = "64M", value_parser = crate::parse_size)]
    pub pack_size: u64,
    /// A file listing paths of the image (one per line) whose contents are packed, and fetched, first.
    #[arg(long, value_name = "FILE")]
    pub prefetch: Option<PathBuf>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// The incomplete image: a name or digest of the store.
    pub image: String,
    /// Neighbouring objects of a pack are fetched in one request up to this many bytes (e.g. 1M).
    #[arg(long, default_value = "1M", value_parser = crate::parse_size)]
    pub coalesce: u64,
    /// Range requests in flight at once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Serialize)]
struct Timed<T: Serialize> {
    #[serde(flatten)]
    report: T,
    seconds: f64,
}

fn image_digest(store: &cairn_store::Store, arg: &str) -> Result<String> {
    let resolved = store.resolve_image(arg)?;
    match resolved.digest {
        Some(d) => Ok(d),
        None => bail!(
            "{arg} is an image file, not an image of the store at {}",
            store.root().display()
        ),
    }
}

pub fn push(g: &Global, args: &PushArgs) -> Result<()> {
    let start = Instant::now();
    let target = cairn_oci::ImageRef::parse(&args.target)?;
    let store = cairn_store::Store::open(&g.root)
        .with_context(|| format!("opening the store at {}", g.root.display()))?;
    let digest = image_digest(&store, &args.image)?;
    let prefetch = match &args.prefetch {
        Some(f) => std::fs::read(f)
            .with_context(|| format!("reading the prefetch list {}", f.display()))?
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let mut p = l.to_vec();
                if !p.starts_with(b"/") {
                    p.insert(0, b'/');
                }
                p
            })
            .collect(),
        None => Vec::new(),
    };
    let opts = cairn_remote::PushOptions {
        client: args.client.options(),
        pack_size: args.pack_size,
        prefetch,
        ..cairn_remote::PushOptions::default()
    };
    let report = cairn_remote::push(&store, &digest, &target, &opts)?;
    let out = Timed {
        report,
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &out, |o| {
        let r = &o.report;
        format!(
            "pushed image {} to {}: artifact {} (subject {}; {} objects, {} in {} packs of {}; referrers by {}; {:.1} s)",
            &r.image_digest[..12],
            r.target,
            r.artifact_digest,
            r.subject_digest,
            r.objects,
            human_bytes(r.object_bytes),
            r.packs,
            human_bytes(r.pack_bytes),
            r.referrers,
            o.seconds
        )
    })
}

pub fn fetch(g: &Global, args: &FetchArgs) -> Result<()> {
    let start = Instant::now();
    let store = cairn_store::Store::open(&g.root)
        .with_context(|| format!("opening the store at {}", g.root.display()))?;
    let digest = image_digest(&store, &args.image)?;
    let opts = cairn_remote::FetchOptions {
        client: args.client.options(),
        coalesce: args.coalesce,
        jobs: usize::from(args.jobs),
    };
    let report = cairn_remote::fetch_image(&store, &digest, &opts)
        .with_context(|| format!("fetching image {}", args.image))?;
    let out = Timed {
        report,
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &out, |o| {
        let r = &o.report;
        if let Some(done) = &r.completed_as {
            format!(
                "completed eStargz image {} by pulling its layers: image {} ({:.1} s)",
                &r.image_digest[..12],
                &done[..12.min(done.len())],
                o.seconds
            )
        } else if r.was_complete {
            format!(
                "image {} is complete ({} objects)",
                &r.image_digest[..12],
                r.objects
            )
        } else {
            format!(
                "fetched image {}: {} of {} objects ({}) in {} requests; complete ({:.1} s)",
                &r.image_digest[..12],
                r.fetched_objects,
                r.objects,
                human_bytes(r.fetched_bytes),
                r.requests,
                o.seconds
            )
        }
    })
}
