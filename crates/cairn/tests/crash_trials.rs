//! Crash safety: `cairn pull` and `cairn import` killed with SIGKILL at
//! random moments leave a store that `cairn fsck` finds clean, with no ref
//! pointing at an incomplete image and nothing but `tmp/` debris, which the
//! next writing command (the retry, or `cairn gc`) removes; the retried
//! pull or import succeeds, fetches or reads only the layers the store
//! lacks, and yields the very tree an uninterrupted run yields.
//!
//! The image is four gzip layers, about 4 MB compressed and 1100 files
//! (`support::images`). Pulls come from Debian's `docker-registry` on
//! 127.0.0.1 through a throttling proxy (`support::proxy`), so that an
//! uninterrupted pull lasts about a second; imports read an OCI layout.
//! Nothing in cairn is hooked or slowed for the test.
//!
//! Kill moments come from a seeded RNG (the seed is printed; set
//! `CAIRN_CRASH_SEED` to replay a run's plan): one at once, jittered strata
//! over the measured length of an uninterrupted run (so some land within
//! milliseconds of the start and some at its very end), and, for the short
//! phases, moments anchored on what the process says or does: its
//! progress lines ("assembling"), the importer's debug lines (`-vv`: a
//! layer's objects or record published), and the store itself (the image
//! staged in `tmp/`, published in `images/`, the ref staged), polled every
//! 50 µs. Every 4th trial starts from a store that already holds an image
//! sharing the base layer; every 3rd runs `cairn gc` between the kill and
//! the retry. Where each kill landed is read from what the killed process
//! left (its staging files, layers, images, refs, progress lines, whether
//! it had connected to the registry), and the counts are printed
//! (`--nocapture`).
//!
//! The stores are made before the trials: a kill while `Store::open`
//! creates a brand-new store's directories would leave a half-made layout
//! that read-only commands (`fsck`) report as "no cairn store" until the
//! next writing command completes it, which is not what is tested here.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::images::ImageSet;
use support::proxy::SlowProxy;
use support::registry::LocalRegistry;
use support::{
    assert_fsck_clean, assert_refs_complete, cairn_cmd, cairn_ok, copy_store, listing,
    seed_from_env, tmp_tree, Rng,
};

/// The name the crash image gets in the store.
const NAME: &str = "crash";
/// The test image killed pulls and imports bring in (all four layers).
const TAG: &str = "full";
/// Repository on the registry.
const REPO: &str = "crash/img";
/// Proxy chunk and the pause after each: about 2 MB/s per connection.
const CHUNK: usize = 16 * 1024;
const CHUNK_DELAY: Duration = Duration::from_millis(8);

/// Where a kill landed, in the order a pull or import goes through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Nothing asked of the registry, nothing written to the store.
    Startup,
    /// Talking to the registry (manifest, config), no layer yet.
    Manifest,
    /// Layer blobs streaming into the importer (objects staged).
    Layers,
    /// A layer record being published.
    LayerRecord,
    /// Every layer in, applying them (no image file yet).
    Assemble,
    /// The EROFS image being written in tmp/.
    ImageWrite,
    /// The image published; its record or ref not yet.
    ImagePublished,
    /// The ref being written.
    RefUpdate,
    /// The ref was there: the kill came after the work was done.
    Done,
}

/// What a killed run left behind, to tell where it was.
struct Aftermath {
    /// Names in the killed process's staging directory.
    staging: Vec<String>,
    had_staging: bool,
    /// Layers the run needed that were not in the store before it, and how
    /// many of them are in now.
    layers_needed: usize,
    layers_in: usize,
    image_in: bool,
    ref_set: bool,
    /// Pull progress lines seen.
    resolved: bool,
    assembling: bool,
    /// Whether the registry (proxy) saw a connection from this run.
    requests: bool,
}

impl Aftermath {
    fn phase(&self) -> Phase {
        let staged = |prefix: &str| self.staging.iter().any(|n| n.starts_with(prefix));
        if self.ref_set {
            Phase::Done
        } else if staged("ref.") {
            Phase::RefUpdate
        } else if staged("record.") || self.image_in {
            Phase::ImagePublished
        } else if staged("image.") {
            Phase::ImageWrite
        } else if self.assembling
            || (self.layers_needed > 0 && self.layers_in == self.layers_needed)
        {
            Phase::Assemble
        } else if staged("layer.") {
            Phase::LayerRecord
        } else if self.resolved || self.layers_in > 0 || self.had_staging {
            Phase::Layers
        } else if self.requests {
            Phase::Manifest
        } else {
            Phase::Startup
        }
    }
}

/// The killed process's staging directory entries (`tmp/s.<pid>.*/…`).
fn staging_of(root: &Path, pid: u32) -> (bool, Vec<String>) {
    let prefix = format!("s.{pid}.");
    let mut found = false;
    let mut names = Vec::new();
    for dir in listing(root, "tmp") {
        if dir.starts_with(&prefix) {
            found = true;
            names.extend(listing(root, &format!("tmp/{dir}")));
        }
    }
    (found, names)
}

/// How a trial picks its kill moment.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// This long after the process was started.
    AfterStart(Duration),
    /// This long after the `nth` stderr line containing `marker` (a
    /// progress line of the pull, or a debug line of the layer importer).
    AfterLine {
        marker: &'static str,
        nth: Nth,
        delay: Duration,
    },
    /// This long after the store shows `Watch` (polled every 50 µs): for
    /// the phases after assembly, too short to hit by time alone.
    OnStore { watch: Watch, delay: Duration },
}

/// What to watch the store for.
#[derive(Debug, Clone, Copy)]
enum Watch {
    /// The EROFS image being written in the process's staging directory.
    ImageStaged,
    /// The image under `images/` (its record and ref still to come).
    ImagePublished,
    /// The ref being written in the staging directory.
    RefStaged,
}

impl Watch {
    fn seen(self, root: &Path, pid: u32, image_digest: &str) -> bool {
        let staged = |prefix: &str| {
            staging_of(root, pid)
                .1
                .iter()
                .any(|n| n.starts_with(prefix))
        };
        match self {
            Watch::ImageStaged => staged("image."),
            Watch::ImagePublished => root.join("images").join(image_digest).exists(),
            Watch::RefStaged => staged("ref."),
        }
    }
}

/// Which occurrence of a line.
#[derive(Debug, Clone, Copy)]
enum Nth {
    /// The one for the last layer the run has to import.
    LastLayer,
    /// One of the layers the run has to import, picked by this number.
    SomeLayer(u64),
    First,
}

impl Nth {
    fn resolve(self, layers_needed: usize) -> usize {
        match self {
            Nth::LastLayer => layers_needed.max(1),
            Nth::SomeLayer(r) => (r % layers_needed.max(1) as u64) as usize + 1,
            Nth::First => 1,
        }
    }
}

/// Debug line of the layer importer once a layer's objects are published
/// (its record comes next).
const OBJECTS_PUBLISHED: &str = ": objects published at ";
/// Debug line of the layer importer once a layer's record is published.
const RECORD_PUBLISHED: &str = ": record published at ";

struct Trial {
    kill: KillAt,
    /// Start from a store holding the `base` image (named `seed`).
    seeded: bool,
    /// Run `cairn gc` between the kill and the retry.
    gc_between: bool,
}

#[derive(Default)]
struct Tally {
    phases: BTreeMap<Phase, usize>,
    /// Trials whose kill left something under tmp/.
    with_debris: usize,
    lines: Vec<String>,
}

impl Tally {
    fn print(&self, what: &str, seed: u64, started: Instant) {
        println!(
            "{what}: {} trials in {:.1} s (seed {seed}); kills landed in:",
            self.phases.values().sum::<usize>(),
            started.elapsed().as_secs_f64()
        );
        for (p, n) in &self.phases {
            println!("  {p:?}: {n}");
        }
        println!(
            "  {} kills left tmp/ debris; the next command removed it every time",
            self.with_debris
        );
        for l in &self.lines {
            println!("  {l}");
        }
    }
}

/// Everything a trial needs to know about the image it kills.
struct Subject<'a> {
    /// Arguments of the command (after `--root`), e.g. `pull --name crash REF`.
    args: Vec<String>,
    /// Arguments of the retry (unthrottled, `-q --json`).
    retry_args: Vec<String>,
    /// diff_ids of the image.
    diff_ids: Vec<String>,
    /// `cairn dump` of the image from an uninterrupted run, and its digest.
    dump: &'a str,
    image_digest: &'a str,
    /// Dump of the `seed` image in seeded stores.
    seed_dump: &'a str,
    empty_store: &'a Path,
    seeded_store: &'a Path,
    proxy: Option<&'a SlowProxy>,
}

/// Runs one trial; returns where the kill landed and whether it left
/// debris.
fn run_trial(s: &Subject<'_>, t: &Trial, dir: &Path, label: &str) -> (Phase, bool) {
    let root = dir.join("store");
    std::fs::create_dir_all(dir).unwrap();
    copy_store(
        if t.seeded {
            s.seeded_store
        } else {
            s.empty_store
        },
        &root,
    );
    let layers_before: BTreeSet<String> = listing(&root, "layers").into_iter().collect();
    let needed: Vec<&String> = s
        .diff_ids
        .iter()
        .filter(|d| !layers_before.contains(*d))
        .collect();
    if let Some(p) = s.proxy {
        p.set_delay(CHUNK_DELAY);
    }
    let conns_before = s.proxy.map_or(0, |p| p.connections());

    let mut child = cairn_cmd(&root)
        .args(&s.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting cairn");
    let started = Instant::now();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let anchor = match t.kill {
        KillAt::AfterLine { marker, nth, .. } => Some((marker, nth.resolve(needed.len()))),
        KillAt::AfterStart(_) | KillAt::OnStore { .. } => None,
    };
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        let mut seen = 0;
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some((marker, nth)) = anchor {
                if line.contains(marker) {
                    seen += 1;
                    if seen == nth {
                        let _ = tx.send(());
                    }
                }
            }
            lines.push(line);
        }
        lines
    });
    match t.kill {
        KillAt::AfterStart(d) => std::thread::sleep(d.saturating_sub(started.elapsed())),
        KillAt::AfterLine { delay, .. } => {
            // Disconnected: the process ended (or failed) before the line.
            if rx.recv_timeout(Duration::from_secs(60)).is_ok() {
                std::thread::sleep(delay);
            }
        }
        KillAt::OnStore { watch, delay } => {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !watch.seen(&root, pid, s.image_digest)
                && child.try_wait().unwrap().is_none()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_micros(50));
            }
            std::thread::sleep(delay);
        }
    }
    let exited_first = child.try_wait().unwrap();
    let _ = child.kill();
    child.wait().unwrap();
    let killed_at = started.elapsed();
    let lines = reader.join().unwrap();
    if let Some(st) = exited_first {
        assert!(
            st.success(),
            "{label}: the run failed on its own ({st}): {lines:?}"
        );
    }

    let (had_staging, staging) = staging_of(&root, pid);
    let layers_after: BTreeSet<String> = listing(&root, "layers").into_iter().collect();
    let after = Aftermath {
        had_staging,
        staging,
        layers_needed: needed.len(),
        layers_in: needed
            .iter()
            .filter(|d| layers_after.contains(d.as_str()))
            .count(),
        image_in: root.join("images").join(s.image_digest).is_file(),
        ref_set: root.join("refs").join(NAME).exists(),
        resolved: lines.iter().any(|l| l.starts_with("resolved ")),
        assembling: lines.iter().any(|l| l.starts_with("assembling")),
        requests: s.proxy.is_some_and(|p| p.connections() > conns_before),
    };
    let phase = after.phase();
    let debris = !tmp_tree(&root).is_empty();
    let context = format!("{label} (killed at {killed_at:?} in {phase:?})");

    // The store right after the kill: every ref complete, fsck clean
    // (debris under tmp/ allowed), the named image whole if named at all.
    let refs = assert_refs_complete(&root, &context);
    assert_fsck_clean(&root, &context);
    for (name, digest) in &refs {
        match name.as_str() {
            NAME => {
                assert_eq!(digest, s.image_digest, "{context}");
                assert_eq!(cairn_ok(&root, &["dump", NAME]), s.dump, "{context}");
            }
            "seed" => assert_eq!(cairn_ok(&root, &["dump", "seed"]), s.seed_dump, "{context}"),
            other => panic!("{context}: unexpected ref {other}"),
        }
    }
    if t.gc_between {
        cairn_ok(&root, &["gc"]);
        assert!(
            tmp_tree(&root).is_empty(),
            "{context}: gc left {:?} under tmp/",
            tmp_tree(&root)
        );
        assert_fsck_clean(&root, &format!("{context}, after gc"));
    }

    // The retry: fetches exactly the layers the store lacks, cleans tmp/.
    if let Some(p) = s.proxy {
        p.set_delay(Duration::ZERO);
    }
    let have: BTreeSet<String> = listing(&root, "layers").into_iter().collect();
    let out = cairn_ok(&root, &s.retry_args);
    let report: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("{context}: retry output: {e}: {out}"));
    for l in report["layers"].as_array().expect("layers in the report") {
        let diff_id = l["diff_id"].as_str().unwrap();
        // pull says "fetched", import says "cached".
        let reused = match (l.get("fetched"), l.get("cached")) {
            (Some(f), _) => f == false,
            (_, Some(c)) => c == true,
            _ => panic!("{context}: layer report {l}"),
        };
        assert_eq!(
            reused,
            have.contains(diff_id),
            "{context}: retry and layer {diff_id} (in the store: {})",
            have.contains(diff_id)
        );
    }
    assert!(
        tmp_tree(&root).is_empty(),
        "{context}: the retry left {:?} under tmp/",
        tmp_tree(&root)
    );
    assert_refs_complete(&root, &context);
    assert_fsck_clean(&root, &format!("{context}, after the retry"));
    assert_eq!(
        cairn_ok(&root, &["dump", NAME]),
        s.dump,
        "{context}: retried image differs"
    );
    if t.seeded {
        assert_eq!(cairn_ok(&root, &["dump", "seed"]), s.seed_dump, "{context}");
    }
    std::fs::remove_dir_all(dir).unwrap();
    (phase, debris)
}

/// Runs an uninterrupted `args` in a copy of `store`; returns its stderr
/// lines with the time each came (from the start), and the time to exit.
fn timed_run(store: &Path, dir: &Path, args: &[String]) -> (Vec<(Duration, String)>, Duration) {
    let root = dir.join("timed");
    let _ = std::fs::remove_dir_all(&root);
    copy_store(store, &root);
    let mut child = cairn_cmd(&root)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let mut lines = Vec::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        lines.push((start.elapsed(), line.unwrap()));
    }
    let st = child.wait().unwrap();
    let total = start.elapsed();
    assert!(st.success(), "uninterrupted run failed: {lines:?}");
    std::fs::remove_dir_all(&root).unwrap();
    (lines, total)
}

/// When the first line containing `marker` came.
fn first(lines: &[(Duration, String)], marker: &str) -> Duration {
    lines
        .iter()
        .find(|(_, l)| l.contains(marker))
        .unwrap_or_else(|| panic!("no line {marker:?} in {lines:?}"))
        .0
}

/// When the last line containing `marker` came.
fn last(lines: &[(Duration, String)], marker: &str) -> Duration {
    lines
        .iter()
        .rev()
        .find(|(_, l)| l.contains(marker))
        .unwrap_or_else(|| panic!("no line {marker:?} in {lines:?}"))
        .0
}

/// `n` delays in jittered strata over `[0, span)`, shuffled.
fn strata(rng: &mut Rng, n: usize, span: Duration) -> Vec<Duration> {
    let mut v: Vec<Duration> = (0..n)
        .map(|k| span.mul_f64((k as f64 + rng.unit()) / n as f64))
        .collect();
    rng.shuffle(&mut v);
    v
}

fn base_dir(what: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cairn-crash-{what}"))
        .tempdir()
        .unwrap()
}

/// Makes an empty store, and a copy holding `seed_args`' image as `seed`.
fn template_stores(base: &Path, seed_args: &[String]) -> (PathBuf, PathBuf) {
    let empty = base.join("empty");
    cairn_ok(&empty, &["gc"]);
    let seeded = base.join("seeded");
    copy_store(&empty, &seeded);
    cairn_ok(&seeded, seed_args);
    (empty, seeded)
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Runs one trial per kill plan (every 4th from the seeded store, every
/// 3rd with gc before the retry) and tallies where the kills landed.
fn run_trials(
    subject: &Subject<'_>,
    kills: Vec<KillAt>,
    what: &str,
    seed: u64,
    base: &Path,
) -> Tally {
    let started = Instant::now();
    let mut tally = Tally::default();
    for (i, kill) in kills.into_iter().enumerate() {
        let trial = Trial {
            kill,
            seeded: i % 4 == 3,
            gc_between: i % 3 == 2,
        };
        let label = format!(
            "{what} trial {i} (seed {seed}, {kill:?}, seeded {}, gc {})",
            trial.seeded, trial.gc_between
        );
        let t0 = Instant::now();
        let (phase, debris) = run_trial(subject, &trial, &base.join(format!("t{i}")), &label);
        *tally.phases.entry(phase).or_default() += 1;
        tally.with_debris += usize::from(debris);
        tally.lines.push(format!(
            "{i:2}: {kill:?} seeded={} gc={} -> {phase:?} ({:.2} s)",
            trial.seeded,
            trial.gc_between,
            t0.elapsed().as_secs_f64()
        ));
    }
    tally.print(what, seed, started);
    tally
}

/// `n` kills this long after the `nth` line with `marker`, the delays in
/// jittered strata over `[0, span)`.
fn after_line(
    rng: &mut Rng,
    n: usize,
    marker: &'static str,
    nth: impl Fn(&mut Rng) -> Nth,
    span: Duration,
) -> Vec<KillAt> {
    strata(rng, n, span)
        .into_iter()
        .map(|delay| KillAt::AfterLine {
            marker,
            nth: nth(rng),
            delay,
        })
        .collect()
}

/// 5 kills as the image is staged (2), published (2) and named (1), at
/// most half a millisecond later.
fn on_store(rng: &mut Rng) -> Vec<KillAt> {
    [
        Watch::ImageStaged,
        Watch::ImageStaged,
        Watch::ImagePublished,
        Watch::ImagePublished,
        Watch::RefStaged,
    ]
    .into_iter()
    .map(|watch| KillAt::OnStore {
        watch,
        delay: Duration::from_micros(rng.next_u64() % 500),
    })
    .collect()
}

#[test]
fn pull_killed_at_random_moments_leaves_a_clean_store_and_the_retry_succeeds() {
    let seed = seed_from_env("CAIRN_CRASH_SEED");
    eprintln!("pull crash trials: seed {seed} (replay with CAIRN_CRASH_SEED={seed})");
    let mut rng = Rng::new(seed);

    let set = ImageSet::get();
    let reg = LocalRegistry::start();
    set.push(&reg, REPO);
    let proxy = SlowProxy::start(&reg.addr, CHUNK);
    let base = base_dir("pull");
    let direct = format!("{}/{REPO}", reg.addr);
    let slow = format!("{}/{REPO}", proxy.addr);
    let (empty, seeded) = template_stores(
        base.path(),
        &strings(&["-q", "pull", "--name", "seed", &format!("{direct}:base")]),
    );

    // The reference: an uninterrupted pull.
    let refstore = base.path().join("reference");
    copy_store(&empty, &refstore);
    let out = cairn_ok(
        &refstore,
        &[
            "-q",
            "--json",
            "pull",
            "--name",
            NAME,
            &format!("{direct}:{TAG}"),
        ],
    );
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let image_digest = report["image_digest"].as_str().unwrap().to_owned();
    let dump = cairn_ok(&refstore, &["dump", NAME]);
    let seed_dump = cairn_ok(&seeded, &["dump", "seed"]);
    let full = set.image(TAG);

    // -vv: the importer's debug lines say when a layer's objects and
    // record are published.
    let args = strings(&["-vv", "pull", "--name", NAME, &format!("{slow}:{TAG}")]);
    proxy.set_delay(CHUNK_DELAY);
    // The quicker of two runs (see the import test).
    let (lines, total) = (0..2)
        .map(|_| timed_run(&empty, base.path(), &args))
        .min_by_key(|r| r.1)
        .unwrap();
    proxy.set_delay(Duration::ZERO);
    let resolved = first(&lines, "resolved ");
    let assembling = first(&lines, "assembling");
    eprintln!(
        "uninterrupted throttled pull of {} bytes in {} layers: resolved at {resolved:?}, \
         assembling at {assembling:?}, exit at {total:?}",
        set.blob_bytes(TAG),
        full.layers.len(),
    );
    assert!(
        total >= Duration::from_millis(500),
        "the throttled pull is too quick ({total:?}) to be interrupted in its phases"
    );

    // 31 kills: at once and 3 more before the manifest is resolved, 14
    // over the whole run,
    // 4 right after a layer's objects are published (its record is next),
    // 4 after assembling began, 5 as the image is written and named.
    let mut kills: Vec<KillAt> = std::iter::once(Duration::ZERO)
        .chain(strata(&mut rng, 3, resolved.mul_f64(1.5)))
        .chain(strata(&mut rng, 14, total.mul_f64(1.02)))
        .map(KillAt::AfterStart)
        .collect();
    kills.extend(after_line(
        &mut rng,
        4,
        OBJECTS_PUBLISHED,
        |r| Nth::SomeLayer(r.next_u64()),
        Duration::from_millis(2),
    ));
    kills.extend(after_line(
        &mut rng,
        4,
        "assembling",
        |_| Nth::First,
        total.saturating_sub(assembling).mul_f64(1.1),
    ));
    kills.extend(on_store(&mut rng));
    rng.shuffle(&mut kills);

    let subject = Subject {
        args,
        retry_args: strings(&[
            "-q",
            "--json",
            "pull",
            "--name",
            NAME,
            &format!("{slow}:{TAG}"),
        ]),
        diff_ids: full
            .layers
            .iter()
            .map(|&i| set.layers[i].diff_id.clone())
            .collect(),
        dump: &dump,
        image_digest: &image_digest,
        seed_dump: &seed_dump,
        empty_store: &empty,
        seeded_store: &seeded,
        proxy: Some(&proxy),
    };
    let tally = run_trials(&subject, kills, "pull", seed, base.path());

    // The kills must have hit the long phase and the short ones around it.
    assert!(
        // A layer's record is staged from its first entry on (it is
        // written as the layer streams), so a kill mid-layer may count as
        // either.
        tally.phases.contains_key(&Phase::Layers) || tally.phases.contains_key(&Phase::LayerRecord),
        "no kill landed during the layer downloads (seed {seed})"
    );
    assert!(
        tally
            .phases
            .range(Phase::Assemble..Phase::Done)
            .next()
            .is_some(),
        "no kill landed between assembling and the ref (seed {seed})"
    );
    assert!(
        tally.phases.len() >= 4,
        "kills landed in too few phases: {:?}",
        tally.phases
    );
}

#[test]
fn import_killed_at_random_moments_leaves_a_clean_store_and_the_retry_succeeds() {
    let seed = seed_from_env("CAIRN_CRASH_SEED").rotate_left(17);
    eprintln!("import crash trials: seed {seed} (derived from CAIRN_CRASH_SEED)");
    let mut rng = Rng::new(seed);

    let set = ImageSet::get();
    let base = base_dir("import");
    let layout = base.path().join("layout");
    set.write_layout(&layout);
    let source = |tag: &str| format!("oci-layout:{}:{tag}", layout.display());
    let (empty, seeded) = template_stores(
        base.path(),
        &strings(&["-q", "import", "--name", "seed", &source("base")]),
    );

    let refstore = base.path().join("reference");
    copy_store(&empty, &refstore);
    let out = cairn_ok(
        &refstore,
        &["-q", "--json", "import", "--name", NAME, &source(TAG)],
    );
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let image_digest = report["image"].as_str().unwrap().to_owned();
    let dump = cairn_ok(&refstore, &["dump", NAME]);
    let seed_dump = cairn_ok(&seeded, &["dump", "seed"]);
    let full = set.image(TAG);

    let args = strings(&["-vv", "import", "--name", NAME, &source(TAG)]);
    // The quickest of three runs: kills planned over a slower one would
    // mostly come after the end.
    let mut runs: Vec<_> = (0..3)
        .map(|_| timed_run(&empty, base.path(), &args))
        .collect();
    runs.sort_by_key(|r| r.1);
    let (lines, total) = &runs[0];
    let total = *total;
    let assembling = last(lines, RECORD_PUBLISHED);
    eprintln!(
        "uninterrupted import of {} bytes in {} layers: {:?}; assembling from {assembling:?}",
        set.blob_bytes(TAG),
        full.layers.len(),
        runs.iter().map(|r| r.1).collect::<Vec<_>>()
    );

    // 27 kills: one at once and 13 over the whole run, 4 right after a layer's objects are
    // published, 4 after the last layer record (assembly), 5 as the image
    // is written and named.
    let mut kills: Vec<KillAt> = std::iter::once(Duration::ZERO)
        .chain(strata(&mut rng, 13, total.mul_f64(1.05)))
        .map(KillAt::AfterStart)
        .collect();
    kills.extend(after_line(
        &mut rng,
        4,
        OBJECTS_PUBLISHED,
        |r| Nth::SomeLayer(r.next_u64()),
        Duration::from_millis(2),
    ));
    kills.extend(after_line(
        &mut rng,
        4,
        RECORD_PUBLISHED,
        |_| Nth::LastLayer,
        total.saturating_sub(assembling).mul_f64(1.1),
    ));
    kills.extend(on_store(&mut rng));
    rng.shuffle(&mut kills);

    let subject = Subject {
        args,
        retry_args: strings(&["-q", "--json", "import", "--name", NAME, &source(TAG)]),
        diff_ids: full
            .layers
            .iter()
            .map(|&i| set.layers[i].diff_id.clone())
            .collect(),
        dump: &dump,
        image_digest: &image_digest,
        seed_dump: &seed_dump,
        empty_store: &empty,
        seeded_store: &seeded,
        proxy: None,
    };
    let tally = run_trials(&subject, kills, "import", seed, base.path());
    assert!(
        // A layer's record is staged from its first entry on (it is
        // written as the layer streams), so a kill mid-layer may count as
        // either.
        tally.phases.contains_key(&Phase::Layers) || tally.phases.contains_key(&Phase::LayerRecord),
        "no kill landed during the layer imports (seed {seed})"
    );
    assert!(
        tally
            .phases
            .range(Phase::Assemble..Phase::Done)
            .next()
            .is_some(),
        "no kill landed between assembling and the ref (seed {seed})"
    );
    assert!(
        tally.phases.len() >= 3,
        "kills landed in too few phases: {:?}",
        tally.phases
    );
}
