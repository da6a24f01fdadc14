//! The `cairn` command: turn directory trees and composefs dumpfiles into
//! EROFS metadata images over a content-addressed store, read them back, and
//! mount them as root filesystems.
//!
//! This file only parses arguments, sets up logging and prints results; the
//! work is done by the library crates.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;

/// musl's allocator maps and unmaps memory for small allocations: at
/// start-up (argument parsing) that was a fifth of cairn's own time, and
/// with the scanner's threads it serialises. mimalloc is fast for both.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc counts the NUMA nodes at its first allocation by probing
/// `/sys/devices/system/node/node1`: a path walk through sysfs, whose
/// lock every EROFS mount and unmount (sysfs entries for the superblock
/// and its bdi) and every network namespace teardown takes for writing.
/// With ten `cairn run`s at once that probe waited 0.17 ms per start
/// (`perf sched timehist`). Telling mimalloc there is one node skips it;
/// it only makes mimalloc ignore NUMA locality for its arenas.
#[used]
#[link_section = ".init_array"]
static MIMALLOC_ONE_NUMA_NODE: extern "C" fn() = {
    extern "C" fn set() {
        // SAFETY: sets one option, before main and so before any
        // allocation of ours; mimalloc's options are plain globals.
        unsafe { libmimalloc_sys::mi_option_set(libmimalloc_sys::mi_option_use_numa_nodes, 1) }
    }
    set
};

mod import;
mod lazy_mount;
mod log;
#[cfg(all(target_env = "musl", target_arch = "x86_64"))]
mod memcpy;
mod mkfs;
mod pull;
mod remote_cmds;
mod run_cmds;
mod store_cmds;

/// cairn turns container images into root filesystems that mount in milliseconds.
#[derive(Parser, Debug)]
#[command(name = "cairn", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// The store when neither --root nor CAIRN_ROOT names one.
const DEFAULT_ROOT: &str = "/var/lib/cairn";

#[derive(Args, Debug, Clone)]
struct Global {
    /// The store: objects, images and refs live below this directory.
    #[arg(
        long,
        global = true,
        env = "CAIRN_ROOT",
        default_value = DEFAULT_ROOT
    )]
    root: PathBuf,
    /// Runtime state of containers (their records, names, crun's state): a
    /// tmpfs such as /run is the place for it. Default: /run/cairn for the
    /// default store, <root>/run for another one. Use the same for every
    /// command on a store.
    #[arg(long, global = true, env = "CAIRN_RUNROOT", value_name = "DIR")]
    runroot: Option<PathBuf>,
    /// Print results as JSON.
    #[arg(long, global = true)]
    json: bool,
    /// More log output (repeat for more).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
}

#[derive(Subcommand, Debug)]
#[command(defer = true)]
enum Command {
    /// Write a composefs EROFS metadata image from a directory or a dumpfile.
    Mkfs(mkfs::MkfsArgs),
    /// Print an image as a composefs dumpfile.
    Dump {
        /// The image: a name, a digest (or a prefix of at least 12 digits), or an image file (./NAME for a file named like an image).
        image: String,
    },
    /// Mount an image: EROFS metadata over the store's objects, via overlayfs.
    Mount(MountArgs),
    /// Pull an image from a registry into the store (--lazy: its metadata only, contents on demand).
    Pull(pull::PullArgs),
    /// Publish an image of the store as a lazy-image artifact (metadata, object index, packs) that `pull --lazy` finds.
    Push(remote_cmds::PushArgs),
    /// Complete an image pulled with --lazy: fetch the objects it lacks.
    Fetch(remote_cmds::FetchArgs),
    /// Show which kernel features cairn uses are present on this machine.
    Probe,
    /// Unmount what `cairn mount` mounted.
    Umount {
        /// The mount point.
        mountpoint: PathBuf,
        /// Detach now, clean up when no longer busy.
        #[arg(long)]
        lazy: bool,
    },
    /// Import an image: oci-layout:PATH[:TAG], docker-archive:PATH, or dir:PATH.
    Import(import::ImportArgs),
    /// Write an image out as an OCI image layout (one regenerated layer).
    Export(import::ExportArgs),
    /// Serve containerd's snapshots API on a unix socket (a proxy snapshotter over the store).
    Snapshotter {
        /// The unix socket to listen on (its directory is created 0700).
        #[arg(long, default_value = "/run/cairn/snapshotter.sock")]
        address: PathBuf,
        /// The remote path pulls every image in full, even where it has a cairn lazy artifact.
        #[arg(long)]
        no_lazy: bool,
        /// For images pulled lazily: once a container's rootfs stands on the image, fetch its prefetch list in the background, then the rest of it (background), or nothing beyond the list and what is read (on-demand).
        #[arg(long, value_enum, default_value = "background")]
        lazy_fetch: lazy_mount::LazyFetch,
        /// For images pulled lazily: an open of a missing file fails with EIO after this long without its data.
        #[arg(long, default_value = "30s", value_parser = lazy_mount::parse_duration)]
        fetch_timeout: std::time::Duration,
        /// For images pulled lazily: a missing file is fetched with the missing files after it in its pack, in one request of at most this many bytes (0: alone).
        #[arg(long, default_value = "1M", value_parser = lazy_mount::parse_bytes)]
        coalesce: u64,
    },
    /// The servers of lazy mounts (`mount --lazy`, `run --lazy`): list them, restart one.
    #[command(subcommand)]
    Lazy(lazy_mount::LazyCommand),
    #[command(flatten)]
    Store(store_cmds::StoreCommand),
    #[command(flatten)]
    Containers(run_cmds::RunCommand),
}

#[derive(Args, Debug)]
struct MountArgs {
    /// The image: a name, a digest (or a prefix of at least 12 digits), or an image file (copied into the store's images/ first).
    image: String,
    /// Where to mount it.
    mountpoint: PathBuf,
    /// Writable layer: none (read-only), tmpfs[:SIZE] (e.g. tmpfs:512M), or a host directory.
    #[arg(long, default_value = "none", value_parser = parse_upper)]
    upper: cairn_mount::UpperSpec,
    /// Idmap the mount for a user namespace: container ids 0..COUNT map to host UID.., GID.. .
    #[arg(long, value_name = "UID:GID:COUNT", value_parser = parse_idmap)]
    idmap: Option<cairn_mount::IdMap>,
    /// Kernel fs-verity checks of every object read (overlayfs verity=require): require (refuse to mount, naming the object, where one lacks fs-verity), auto (require where every object has it, else off; says which on stderr) or off.
    #[arg(long, default_value = "auto", value_name = "require|auto|off")]
    verity: cairn_store::VerityChoice,
    /// The fs-verity digest (sha256, hex) the image file must have, as composefs's image digest: checked with FS_IOC_MEASURE_VERITY before mounting; refused on a mismatch or where the image has no fs-verity.
    #[arg(long, value_name = "SHA256")]
    digest: Option<String>,
    /// For an image pulled with --lazy: mount it now, fetching each missing file from the registry when it is first opened (a server process serves the layer until the mount is gone). A complete image mounts as usual. `--lazy=on-demand` fetches only what is opened (and the prefetch list); see --lazy-fetch.
    #[arg(long, value_enum, value_name = "FETCH", num_args = 0..=1, require_equals = true)]
    lazy: Option<Option<lazy_mount::LazyFetch>>,
    #[command(flatten)]
    lazy_args: lazy_mount::LazyArgs,
    #[command(flatten)]
    client: remote_cmds::ClientArgs,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        Some('t' | 'T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("invalid size '{s}' (expected e.g. 512M, 2G)"))
}

fn parse_upper(s: &str) -> Result<cairn_mount::UpperSpec, String> {
    use cairn_mount::UpperSpec;
    Ok(match s {
        "none" => UpperSpec::None,
        "tmpfs" => UpperSpec::Tmpfs { size: None },
        _ if s.starts_with("tmpfs:") => UpperSpec::Tmpfs {
            size: Some(parse_size(&s["tmpfs:".len()..])?),
        },
        "" => return Err("empty upper".into()),
        _ => UpperSpec::Dir(PathBuf::from(s)),
    })
}

fn parse_idmap(s: &str) -> Result<cairn_mount::IdMap, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [uid, gid, count] = parts[..] else {
        return Err(format!("invalid idmap '{s}': expected UID:GID:COUNT"));
    };
    let num = |v: &str, what: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("invalid {what} '{v}' in idmap '{s}'"))
    };
    let map = cairn_mount::IdMap {
        uid: num(uid, "uid")?,
        gid: num(gid, "gid")?,
        count: num(count, "count")?,
    };
    if map.count == 0 {
        return Err(format!("invalid idmap '{s}': count must be at least 1"));
    }
    if map.uid.checked_add(map.count).is_none() || map.gid.checked_add(map.count).is_none() {
        return Err(format!("invalid idmap '{s}': range overflows 32 bits"));
    }
    Ok(map)
}

fn init_logging(g: &Global, daemon: bool) {
    use tracing_subscriber::filter::Targets;
    let level = if g.quiet {
        "error"
    } else {
        match g.verbose {
            0 => "warn",
            1 => "info",
            2 => "debug",
            _ => "trace",
        }
    };
    // `CAIRN_LOG` takes `level` or `target=level,…` directives (`Targets`,
    // not `EnvFilter`: the latter's span and field matching compiles regular
    // expressions, whose Unicode tables add thousands of relocations that
    // every start of this static PIE pays for; issue 12's start-time work).
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let default = || level.parse::<Targets>().expect("a plain level parses");
    let (filter, bad) = match std::env::var("CAIRN_LOG") {
        Ok(directives) => match directives.parse::<Targets>() {
            Ok(t) => (t, None),
            Err(e) => (default(), Some((directives, e))),
        },
        Err(_) => (default(), None),
    };
    use std::io::IsTerminal;
    if daemon {
        log::as_daemon();
    }
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .event_format(log::Lines::new())
        .finish()
        .with(filter)
        .init();
    if let Some((directives, e)) = bad {
        tracing::warn!("ignoring CAIRN_LOG={directives:?}: {e}");
    }
}

/// Prints `value` as JSON or through `human`.
pub(crate) fn output<T: Serialize>(
    g: &Global,
    value: &T,
    human: impl FnOnce(&T) -> String,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if g.json {
        serde_json::to_writer_pretty(&mut out, value)?;
        writeln!(out)?;
    } else if !g.quiet {
        let text = human(value);
        if !text.is_empty() {
            writeln!(out, "{text}")?;
        }
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse_from(run_cmds::rewrite_volume_flags(std::env::args_os()));
    // A daemon's log lines carry the time; a command's do not (log.rs).
    init_logging(
        &cli.global,
        matches!(cli.command, Command::Snapshotter { .. }),
    );
    // The commands that import layers or stage objects open thousands of
    // files from several threads, and growing a shared descriptor table
    // stalls them all: grow it now, while the process has one thread
    // (cairn_store::reserve_descriptors). The others (`run` among them)
    // keep the default table.
    if matches!(
        cli.command,
        Command::Pull(_)
            | Command::Import(_)
            | Command::Mkfs(_)
            | Command::Fetch(_)
            | Command::Snapshotter { .. }
    ) {
        let _ = cairn_store::reserve_descriptors();
    }
    let code = match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("cairn: {e:#}");
            1
        }
    };
    cairn_run::exit_now(code)
}

fn run(cli: Cli) -> Result<()> {
    let g = &cli.global;
    match cli.command {
        Command::Mkfs(args) => mkfs::run(g, &args),
        Command::Dump { image } => dump(g, &image),
        Command::Pull(args) => pull::run(g, &args),
        Command::Push(args) => remote_cmds::push(g, &args),
        Command::Fetch(args) => remote_cmds::fetch(g, &args),
        Command::Probe => probe(g),
        Command::Mount(args) => mount(g, &args),
        Command::Umount { mountpoint, lazy } => {
            cairn_mount::umount_with(&mountpoint, cairn_mount::UmountOptions { lazy })
                .with_context(|| format!("unmounting {}", mountpoint.display()))
        }
        Command::Lazy(cmd) => lazy_mount::command(&g.root, cmd),
        Command::Store(cmd) => store_cmds::run(g, cmd),
        Command::Containers(cmd) => run_cmds::run(g, cmd),
        Command::Import(args) => import::import(g, &args),
        Command::Export(args) => import::export(g, &args),
        Command::Snapshotter {
            address,
            no_lazy,
            lazy_fetch,
            fetch_timeout,
            coalesce,
        } => {
            let options = cairn_snapshotter::Options {
                lazy: (!no_lazy).then(|| {
                    std::sync::Arc::new(lazy_mount::ChainMounter {
                        lazy_fetch,
                        fetch_timeout,
                        coalesce,
                    }) as std::sync::Arc<dyn cairn_snapshotter::LazyMounter>
                }),
            };
            cairn_snapshotter::serve_with(&g.root, &address, options)
                .with_context(|| format!("snapshotter on {}", address.display()))
        }
    }
}

fn probe(g: &Global) -> Result<()> {
    let features = cairn_mount::probe();
    #[derive(Serialize)]
    struct Row {
        feature: String,
        present: bool,
        detail: String,
    }
    let mut rows: Vec<Row> = cairn_mount::Feature::ALL
        .iter()
        .map(|&f| Row {
            feature: f.description().to_string(),
            present: features.has(f),
            detail: format!("{:?}", features.support(f)),
        })
        .collect();
    // Two summary rows: how EROFS reads images here (file-backed or a loop
    // device), and whether the whole stack of `cairn mount`/`run` works.
    let summary = |feature: &str, answer: Result<String, cairn_mount::MissingFeature>| Row {
        feature: feature.to_string(),
        present: answer.is_ok(),
        detail: answer.unwrap_or_else(|e| e.to_string()),
    };
    // The fs-verity row above asks through cairn's own file; what sealing
    // needs is the store's filesystem (its root, or the nearest directory
    // above it that exists).
    let store_dir = g
        .root
        .ancestors()
        .find(|p| p.is_dir())
        .unwrap_or(Path::new("/"));
    let verity = cairn_mount::probe::verity_support_at(store_dir);
    rows.push(Row {
        feature: format!(
            "fs-verity on the store's filesystem ({})",
            store_dir.display()
        ),
        present: matches!(verity, cairn_mount::Support::Present),
        detail: format!("{verity:?}"),
    });
    rows.push(summary(
        "EROFS image path",
        features.erofs_path().map(|p| p.to_string()),
    ));
    rows.push(summary(
        "cairn mount and cairn run",
        features
            .require(&cairn_mount::STACK_FEATURES)
            .and_then(|()| features.erofs_path())
            .map(|_| format!("supported; overlay layers {}", features.layer_path())),
    ));
    // In the feature list's own form, right after it.
    let store_line = match &verity {
        cairn_mount::Support::Present => format!(
            "  yes  fs-verity on the store's filesystem ({}): new objects and images are sealed",
            store_dir.display()
        ),
        cairn_mount::Support::Absent(why) | cairn_mount::Support::NotPermitted(why) => format!(
            "  no   fs-verity on the store's filesystem ({}): {why}",
            store_dir.display()
        ),
    };
    output(g, &rows, |_| {
        let text = features.to_string();
        // After the feature rows, before the summary that follows them.
        match text.find("\nEROFS images") {
            Some(at) => format!("{}\n{store_line}{}", &text[..at], &text[at..]),
            None => format!("{text}\n{store_line}"),
        }
    })
}

/// The first block of an image file: composefs header and superblock.
pub(crate) fn read_image_head(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut head = Vec::with_capacity(4096);
    std::fs::File::open(path)
        .and_then(|f| f.take(4096).read_to_end(&mut head))
        .with_context(|| format!("reading image {}", path.display()))?;
    Ok(head)
}

fn read_image_file(path: &Path) -> Result<Vec<u8>> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("opening image {}", path.display()))?;
    if !meta.is_file() {
        bail!("image {} is not a regular file", path.display());
    }
    std::fs::read(path).with_context(|| format!("reading image {}", path.display()))
}

fn dump(g: &Global, arg: &str) -> Result<()> {
    let resolved = store_cmds::resolve_for_reading(g, arg)?;
    let image = resolved.path.as_path();
    let data = read_image_file(image)?;
    let tree = cairn_erofs::reader::read_image(&data)
        .with_context(|| format!("reading image {}", image.display()))?;
    let mut out = BufWriter::new(std::io::stdout().lock());
    cairn_erofs::dump::print_dump(&tree, &mut out)
        .and_then(|()| out.flush())
        .context("writing the dump to stdout")?;
    Ok(())
}

/// `--digest`: the image file's fs-verity digest, as the kernel measures
/// it, must be `expected`. (Checked on the file by its path just before
/// mounting: the image is the store's, which is immutable and sealed, so
/// only root replacing it by rename in that moment could slip by.)
fn check_image_digest(image: &Path, expected: &str) -> Result<()> {
    let expected = expected.trim().to_ascii_lowercase();
    let expected = expected.strip_prefix("sha256:").unwrap_or(&expected);
    let want: cairn_store::ObjectId = expected
        .parse()
        .map_err(|e| anyhow::anyhow!("--digest {expected}: {e}"))?;
    match cairn_store::measure_verity(image) {
        Ok(Some(got)) if got == want => Ok(()),
        Ok(Some(got)) => bail!(
            "image {} has fs-verity digest {got}, not {want} (--digest): refusing to mount",
            image.display()
        ),
        Ok(None) => bail!(
            "image {} has no fs-verity, so its digest cannot be checked (--digest): \
             refusing to mount",
            image.display()
        ),
        Err(e) => bail!(
            "measuring the fs-verity digest of image {} (--digest): {e}: refusing to mount",
            image.display()
        ),
    }
}

#[derive(Serialize)]
struct MountReport {
    image: PathBuf,
    mountpoint: PathBuf,
    objects: PathBuf,
    upper: String,
    idmap: Option<String>,
    /// The supervisor of the processes serving an incomplete image's data
    /// layer (`--lazy`): it holds the FUSE connection; its worker, which
    /// serves, is in `cairn lazy list`.
    lazy_server: Option<i32>,
}

fn mount(g: &Global, args: &MountArgs) -> Result<()> {
    let store = cairn_store::Store::open(&g.root)
        .with_context(|| format!("opening the store at {}", g.root.display()))?;
    // An incomplete image's data layer is served by a process of its own,
    // forked now, while this one holds no lock and has one thread.
    let lazy = if let Some(mode) = args.lazy {
        let lazy_args = args.lazy_args.with_mode(mode)?;
        let (digest, _) = {
            let _lock = store.lock_shared().context("locking the store")?;
            store_cmds::resolve_into_store(&store, &args.image)?
        };
        let incomplete = store
            .image_record(&digest)
            .ok()
            .flatten()
            .is_some_and(|r| r.lazy.is_some());
        if incomplete {
            let layer = lazy_mount::LazyLayer::start(
                store.root(),
                &digest,
                &args.client.options(),
                &lazy_args,
            )?;
            Some((digest, layer))
        } else {
            tracing::info!("image {} is complete: mounted from the store", args.image);
            None
        }
    } else {
        None
    };
    // Held until the mount is attached (and so in the mount table, where gc
    // looks for live mounts): gc cannot remove the image in between.
    let _lock = store.lock_shared().context("locking the store")?;
    // A file is checked and copied into images/, so the mount's source
    // names the store's image and gc sees what it uses.
    let (digest, _) = store_cmds::resolve_into_store(&store, &args.image)?;
    let objects = match &lazy {
        Some((lazy_digest, layer)) => {
            if *lazy_digest != digest {
                bail!(
                    "image {} changed while its lazy layer was being started ({} then {digest})",
                    args.image,
                    lazy_digest
                );
            }
            layer.path().to_path_buf()
        }
        None => {
            refuse_incomplete(&store, &digest, &args.image)?;
            store.objects_dir()
        }
    };
    let image = store.image_path(&digest);
    if let Some(expected) = &args.digest {
        check_image_digest(&image, expected)?;
    }
    let verity = store.decide_verity(&digest, args.verity, lazy.is_some())?;
    tracing::debug!(%verity, "overlay fs-verity");
    // A lazy mount reads the files the store has from it directly, and
    // only the missing ones through its lazy layer; except while recording
    // a prefetch list, which must name every file opened.
    let store_objects = store.objects_dir();
    let local_objects = (lazy.is_some() && args.lazy_args.record_prefetch.is_none())
        .then_some(store_objects.as_path());
    let opts = cairn_mount::MountOptions {
        image: &image,
        objects: &objects,
        local_objects,
        target: &args.mountpoint,
        upper: args.upper.clone(),
        idmap: args.idmap,
        verity: verity.mode,
    };
    cairn_mount::mount_image(&opts).with_context(|| {
        format!(
            "mounting {} on {}",
            image.display(),
            args.mountpoint.display()
        )
    })?;
    // Said once mounted, so that a refusal stays one line.
    if args.verity == cairn_store::VerityChoice::Auto {
        eprintln!("cairn: {verity}");
    }
    let lazy_server = match lazy {
        Some((_, layer)) => {
            let pid = layer.pid();
            layer.attached()?;
            Some(pid)
        }
        None => None,
    };
    let report = MountReport {
        image,
        mountpoint: args.mountpoint.clone(),
        objects,
        lazy_server,
        upper: format!("{:?}", args.upper),
        idmap: args
            .idmap
            .map(|m| format!("{}:{}:{}", m.uid, m.gid, m.count)),
    };
    output(g, &report, |_| String::new())
}

/// An image pulled with --lazy lacks objects: overlayfs would fail its
/// reads (and an export its copies), so it is not mounted or exported
/// until `cairn fetch` completes it.
pub(crate) fn refuse_incomplete(store: &cairn_store::Store, digest: &str, arg: &str) -> Result<()> {
    if let Some(lazy) = store
        .image_record(digest)
        .ok()
        .flatten()
        .and_then(|r| r.lazy)
    {
        let mut lookup = store.object_lookup();
        let local = store
            .image_contents(digest)
            .map(|c| c.objects.keys().filter(|id| lookup.has(id)).count())
            .unwrap_or(0);
        bail!(
            "image {arg} is incomplete (pulled with --lazy): {local} of its {} objects are \
             local; `cairn fetch {arg}` fetches the rest (or `cairn mount --lazy` fetches \
             each file when it is first read)",
            lazy.objects
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own consistency checks, over every subcommand: they are
    /// deferred (built only when chosen), so a mistake in one that no
    /// test runs would otherwise only show when a user runs it.
    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        // Builds the whole tree, deferred parts included, and asserts.
        Cli::command().debug_assert();
        // Global flags reach a deferred subcommand, before and after it.
        let before = Cli::try_parse_from(["cairn", "-q", "ps", "-a"]).expect("-q before ps");
        assert!(before.global.quiet && !before.global.json);
        let after = Cli::try_parse_from(["cairn", "ps", "-a", "--json"]).expect("--json after ps");
        assert!(after.global.json && !after.global.quiet);
    }

    /// `--lazy` alone, `--lazy=MODE`, and `--lazy` with `--lazy-fetch`:
    /// the mode the lazy server gets, and the refusal of two that differ.
    #[test]
    fn lazy_takes_its_fetch_mode_after_an_equals_sign() {
        use lazy_mount::LazyFetch::{self, Background, OnDemand};
        let mode = |args: &[&str]| -> Result<LazyFetch, String> {
            let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
            let Command::Mount(m) = cli.command else {
                panic!("not a mount: {args:?}");
            };
            let lazy = m.lazy.ok_or("no --lazy")?;
            let lazy_args = m.lazy_args.with_mode(lazy).map_err(|e| e.to_string())?;
            Ok(lazy_args.fetch())
        };
        let m = |extra: &[&str]| {
            let mut a = vec!["cairn", "mount"];
            a.extend_from_slice(extra);
            a.extend(["img", "/mnt"]);
            mode(&a)
        };
        assert_eq!(m(&["--lazy"]), Ok(Background));
        assert_eq!(m(&["--lazy=on-demand"]), Ok(OnDemand));
        assert_eq!(m(&["--lazy=background"]), Ok(Background));
        assert_eq!(m(&["--lazy", "--lazy-fetch", "on-demand"]), Ok(OnDemand));
        assert_eq!(
            m(&["--lazy=on-demand", "--lazy-fetch", "on-demand"]),
            Ok(OnDemand)
        );
        let both = m(&["--lazy=on-demand", "--lazy-fetch", "background"]).unwrap_err();
        assert!(both.contains("name different modes"), "{both}");
        // No value without `=`: the image is not taken for a mode.
        assert_eq!(m(&["--lazy"]), Ok(Background));
        assert!(m(&["--lazy=sometimes"]).is_err());
        // Without --lazy the mount is not lazy.
        assert_eq!(m(&[]), Err("no --lazy".to_owned()));
        // `cairn run` reads it the same way.
        Cli::try_parse_from(["cairn", "run", "--lazy=on-demand", "img", "true"])
            .expect("run --lazy=on-demand");
    }
}
