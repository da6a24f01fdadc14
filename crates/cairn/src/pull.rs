//! `cairn pull`: an image from a registry into the store, with a progress
//! display.
//!
//! Progress goes to stderr: bars (per layer: bytes, rate, ETA) when stderr
//! is a terminal, otherwise one line per event (`layer 2/3 sha256:… done`)
//! that a script can read; `-q` silences both. The result goes to stdout
//! (`--json`: the whole report). The work is `cairn_oci::pull`.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use cairn_oci::{ImageRef, PlatformSpec, PullEvent, PullObserver, PullOptions, PullReport};

use crate::{output, Global};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// The image: [REGISTRY[:PORT]/]REPOSITORY[:TAG|@DIGEST] (default registry docker.io, tag latest).
    pub reference: String,
    /// The name to give the image in the store (default: the reference, e.g. alpine:latest).
    #[arg(long)]
    pub name: Option<String>,
    /// Which image of a multi-platform index (default: this host's, e.g. linux/amd64).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]")]
    pub platform: Option<String>,
    /// Plain HTTP instead of HTTPS (loopback registries get plain HTTP anyway).
    #[arg(long)]
    pub insecure: bool,
    /// Layers fetched at once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Credentials file (containers-auth.json(5) or Docker config.json format) instead of the default search.
    #[arg(long, value_name = "PATH")]
    pub authfile: Option<PathBuf>,
    /// Seconds to wait for a connection to the registry.
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub connect_timeout: u64,
    /// Seconds a transfer may go without data before it is retried.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub read_timeout: u64,
    /// Attempts per request or layer, the first included (transient errors only).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub attempts: u32,
    /// Metadata only: find the image's cairn lazy artifact (or REF is one), store the image as incomplete; `cairn fetch` completes it. Fails, saying why, for an image without one.
    #[arg(long)]
    pub lazy: bool,
    /// With --lazy: do not fetch the objects of the artifact's prefetch list now; the first lazy mount or run of the image fetches it in the background while it starts.
    #[arg(long, requires = "lazy")]
    pub no_prefetch: bool,
}

#[derive(Serialize)]
struct PullOutput {
    #[serde(flatten)]
    report: PullReport,
    seconds: f64,
}

pub fn run(g: &Global, args: &PullArgs) -> Result<()> {
    let start = Instant::now();
    let reference = ImageRef::parse(&args.reference)?;
    let platform = args
        .platform
        .as_deref()
        .map(PlatformSpec::parse)
        .transpose()?;
    let mut client = cairn_oci::ClientOptions {
        insecure: args.insecure,
        connect_timeout: Duration::from_secs(args.connect_timeout),
        read_timeout: Duration::from_secs(args.read_timeout),
        max_attempts: args.attempts,
        ..cairn_oci::ClientOptions::default()
    };
    if let Some(f) = &args.authfile {
        client.auth_files = vec![f.clone()];
    }
    let opts = PullOptions {
        client,
        platform,
        jobs: usize::from(args.jobs),
        name: Some(args.name.clone().unwrap_or_else(|| reference.familiar())),
        limits: cairn_image::Limits::default(),
    };
    let store = cairn_store::Store::open(&g.root)
        .with_context(|| format!("opening the store at {}", g.root.display()))?;
    if args.lazy {
        return lazy(g, &store, &reference, opts, !args.no_prefetch, start);
    }
    let progress: Box<dyn PullObserver> = if g.quiet {
        Box::new(|_: &PullEvent<'_>| {})
    } else if std::io::stderr().is_terminal() {
        Box::new(Bars::new())
    } else {
        Box::new(Lines::default())
    };
    // The error names the reference, blob or registry itself.
    let report = cairn_oci::pull(&store, &reference, &opts, progress.as_ref())?;
    drop(progress);
    let out = PullOutput {
        report,
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &out, |o| {
        let r = &o.report;
        let fetched = r.layers.iter().filter(|l| l.fetched).count();
        format!(
            "pulled {}: image {} (manifest {}; {} layers: {fetched} fetched, {} cached; {} in {:.1} s)",
            r.name.as_deref().unwrap_or(&r.reference),
            r.image_digest,
            r.manifest_digest,
            r.layers.len(),
            r.layers.len() - fetched,
            human_bytes(r.bytes_fetched),
            o.seconds
        )
    })
}

/// `cairn pull --lazy`.
fn lazy(
    g: &Global,
    store: &cairn_store::Store,
    reference: &ImageRef,
    opts: PullOptions,
    prefetch: bool,
    start: Instant,
) -> Result<()> {
    let lazy_opts = cairn_remote::LazyPullOptions {
        client: opts.client,
        platform: opts.platform,
        name: opts.name,
        prefetch,
        ..Default::default()
    };
    let report = cairn_remote::pull_lazy(store, reference, &lazy_opts)?;
    #[derive(Serialize)]
    struct Out {
        #[serde(flatten)]
        report: cairn_remote::LazyPullReport,
        seconds: f64,
    }
    let out = Out {
        report,
        seconds: start.elapsed().as_secs_f64(),
    };
    output(g, &out, |o| {
        let r = &o.report;
        if r.complete {
            format!(
                "pulled {} lazily: image {} is complete in the store already",
                r.name.as_deref().unwrap_or(&r.reference),
                r.image_digest
            )
        } else {
            format!(
                "pulled {} lazily: image {} (artifact {}; {} fetched; {} of {} objects local, {} prefetched; {} in all; {:.1} s)",
                r.name.as_deref().unwrap_or(&r.reference),
                r.image_digest,
                r.artifact_digest,
                human_bytes(r.bytes_fetched),
                r.objects_local + r.prefetched,
                r.objects,
                r.prefetched,
                human_bytes(r.object_bytes),
                o.seconds
            )
        }
    })
}

pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Non-terminal progress: one line per event on stderr.
#[derive(Default)]
struct Lines {
    layers: Mutex<usize>,
}

impl PullObserver for Lines {
    fn event(&self, e: &PullEvent<'_>) {
        let n = *self.layers.lock().unwrap_or_else(|p| p.into_inner());
        let line = match e {
            PullEvent::Resolved(r) => {
                *self.layers.lock().unwrap_or_else(|p| p.into_inner()) = r.layers.len();
                format!(
                    "resolved {} manifest {}{} ({} layers, {})",
                    r.reference,
                    r.manifest_digest,
                    r.platform
                        .as_deref()
                        .map(|p| format!(" for {p}"))
                        .unwrap_or_default(),
                    r.layers.len(),
                    human_bytes(r.layers.iter().map(|l| l.size).sum())
                )
            }
            PullEvent::LayerCached { index, layer } => {
                format!("layer {}/{n} {} cached", index + 1, layer.digest)
            }
            PullEvent::LayerStart { index, layer } => {
                format!(
                    "layer {}/{n} {} fetching {} bytes",
                    index + 1,
                    layer.digest,
                    layer.size
                )
            }
            PullEvent::LayerRetry {
                index,
                attempt,
                detail,
            } => {
                format!(
                    "layer {}/{n} retry (attempt {attempt}): {detail}",
                    index + 1
                )
            }
            PullEvent::LayerDone { index, layer } => {
                format!("layer {}/{n} {} done", index + 1, layer.digest)
            }
            PullEvent::Assembling => "assembling".to_string(),
            PullEvent::LayerProgress { .. } => return,
        };
        eprintln!("{line}");
    }
}

/// Terminal progress: a bar per layer.
struct Bars {
    multi: MultiProgress,
    bars: Mutex<HashMap<usize, ProgressBar>>,
    layers: Mutex<usize>,
    style: ProgressStyle,
}

impl Bars {
    fn new() -> Bars {
        let style = ProgressStyle::with_template(
            "{prefix} [{bar:25}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        Bars {
            multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
            bars: Mutex::new(HashMap::new()),
            layers: Mutex::new(0),
            style,
        }
    }

    fn prefix(&self, index: usize, digest: &cairn_oci::Digest) -> String {
        let n = *self.layers.lock().unwrap_or_else(|p| p.into_inner());
        format!("{}/{n} {}", index + 1, digest.short())
    }

    fn bar(&self, index: usize) -> Option<ProgressBar> {
        self.bars
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index)
            .cloned()
    }
}

impl PullObserver for Bars {
    fn event(&self, e: &PullEvent<'_>) {
        match e {
            PullEvent::Resolved(r) => {
                *self.layers.lock().unwrap_or_else(|p| p.into_inner()) = r.layers.len();
                let _ = self.multi.println(format!(
                    "{}: manifest {}{}",
                    r.reference,
                    r.manifest_digest,
                    r.platform
                        .as_deref()
                        .map(|p| format!(" ({p})"))
                        .unwrap_or_default()
                ));
            }
            PullEvent::LayerCached { index, layer } => {
                let _ = self
                    .multi
                    .println(format!("{} cached", self.prefix(*index, &layer.digest)));
            }
            PullEvent::LayerStart { index, layer } => {
                let bar = self.multi.add(ProgressBar::new(layer.size));
                bar.set_style(self.style.clone());
                bar.set_prefix(self.prefix(*index, &layer.digest));
                self.bars
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(*index, bar);
            }
            PullEvent::LayerProgress { index, bytes } => {
                if let Some(b) = self.bar(*index) {
                    b.set_position(*bytes);
                }
            }
            PullEvent::LayerRetry {
                index,
                attempt,
                detail,
            } => {
                if let Some(b) = self.bar(*index) {
                    b.set_message(format!("retry {attempt}: {detail}"));
                }
            }
            PullEvent::LayerDone { index, .. } => {
                if let Some(b) = self.bar(*index) {
                    b.set_message("done");
                    b.finish();
                }
            }
            PullEvent::Assembling => {
                let _ = self.multi.println("assembling the image");
            }
        }
    }
}

impl Drop for Bars {
    fn drop(&mut self) {
        // Bars of layers that never finished (an error) must not stay drawn
        // as if still running.
        for b in self.bars.lock().unwrap_or_else(|p| p.into_inner()).values() {
            if !b.is_finished() {
                b.abandon();
            }
        }
    }
}
