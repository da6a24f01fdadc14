//! The store management commands: `images`, `tag`, `rm`, `inspect`, `df`,
//! `gc`, `fsck`; and how every command that takes an image finds it (a
//! name, a digest or a prefix of one, or a file).
//!
//! This module parses, locks where a command writes, and prints; the
//! store crate does the work. Names are shown as image names (refs are
//! stored with `/` escaped, see `cairn_store::ref_name_for`).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::Serialize;
use serde_json::Value;

use cairn_store::{image_name_for, ref_name_for, ImageSource, ResolvedImage, Store};

use crate::{output, Global};

#[derive(Subcommand, Debug)]
#[command(defer = true)]
pub enum StoreCommand {
    /// List the images in the store: names, digest, created, size, bytes shared with other images and unique.
    Images,
    /// Give an image another name.
    Tag {
        /// The image: a name, a digest (or a prefix of at least 12 digits), or an image file.
        source: String,
        /// The new name (any image name, e.g. registry:5000/debian:12).
        name: String,
    },
    /// Remove names. The image goes at the next `cairn gc`, once no name and no mount uses it.
    Rm(RmArgs),
    /// Show an image as JSON: digest, names, sizes and, for imported images, manifest, config and layers.
    Inspect {
        /// A name, a digest (or a prefix of at least 12 digits), or an image file.
        image: String,
    },
    /// Show the store's disk use: logical bytes against physical, dedup ratio, and what gc would free.
    Df,
    /// Remove the images, layers and objects that no name and no live mount reaches.
    Gc {
        /// Show what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Check every object, image, layer record and ref, and that the store and the run root are private (0700); report every problem.
    ///
    /// Exits non-zero when a problem is found, or with --repair when one is left.
    Fsck {
        /// Remove what is corrupt (and names of images that are gone), so the next pull fetches it again; make the store and the run root private.
        #[arg(long)]
        repair: bool,
    },
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Names; a digest (or a prefix) removes every name of that image.
    #[arg(required = true)]
    names: Vec<String>,
    /// Remove every name of an image named by digest even when it has several.
    #[arg(long, short)]
    force: bool,
}

pub fn run(g: &Global, cmd: StoreCommand) -> Result<()> {
    match cmd {
        StoreCommand::Images => images(g),
        StoreCommand::Tag { source, name } => tag(g, &source, &name),
        StoreCommand::Rm(args) => rm(g, &args),
        StoreCommand::Inspect { image } => inspect(g, &image),
        StoreCommand::Df => df(g),
        StoreCommand::Gc { dry_run } => gc(g, dry_run),
        StoreCommand::Fsck { repair } => fsck(g, repair),
    }
}

fn open_existing(g: &Global) -> Result<Store> {
    Store::open_existing(&g.root).with_context(|| format!("no cairn store at {}", g.root.display()))
}

fn open(g: &Global) -> Result<Store> {
    Store::open(&g.root).with_context(|| format!("opening the store at {}", g.root.display()))
}

/// Finds the image `arg` names, for a command that only reads it: through
/// the store at `--root` if there is one, else as a file.
pub(crate) fn resolve_for_reading(g: &Global, arg: &str) -> Result<ResolvedImage> {
    match Store::open_existing(&g.root) {
        Ok(store) => store.resolve_image(arg).map_err(anyhow::Error::from),
        Err(_) if Path::new(arg).is_file() => Ok(ResolvedImage {
            path: PathBuf::from(arg),
            digest: None,
            source: ImageSource::File,
        }),
        Err(_) => bail!(
            "no image file {arg:?}, and no store at {} to look the name up in",
            g.root.display()
        ),
    }
}

/// Finds the image `arg` names and makes sure it is in the store, for a
/// command that uses its objects (mount, tag). A file is checked to be an
/// image and copied into `images/` (it is small: metadata only), so that
/// what uses it can be traced to the store and gc keeps its objects. The
/// caller holds the store lock shared.
pub(crate) fn resolve_into_store(store: &Store, arg: &str) -> Result<(String, ResolvedImage)> {
    let resolved = store.resolve_image(arg)?;
    if let Some(digest) = &resolved.digest {
        return Ok((digest.clone(), resolved));
    }
    let path = &resolved.path;
    let head = crate::read_image_head(path)?;
    cairn_erofs::reader::read_header(&head).with_context(|| format!("image {}", path.display()))?;
    // Hash first: an image already in the store is not copied again.
    let digest = sha256_file(path)?;
    if store.has_image(&digest) {
        return Ok((digest, resolved));
    }
    let digest = store
        .add_image(path)
        .with_context(|| format!("copying image {} into the store", path.display()))?;
    Ok((digest, resolved))
}

fn sha256_file(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut f =
        std::fs::File::open(path).with_context(|| format!("opening image {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading image {}", path.display()))?;
    Ok(hex::encode(h.finalize()))
}

/// A ref name shown as the image name it stands for.
fn shown(ref_name: &str) -> String {
    image_name_for(ref_name)
}

// ---------------------------------------------------------------- images

#[derive(Serialize)]
struct ImageRow {
    names: Vec<String>,
    digest: String,
    /// `created` of the image config, when the image has one.
    created: Option<String>,
    /// When the image entered this store.
    stored: Option<String>,
    /// Image file plus the objects it uses.
    size: u64,
    image_bytes: u64,
    object_bytes: u64,
    objects: u64,
    shared_bytes: u64,
    unique_bytes: u64,
    logical_bytes: u64,
    files: u64,
    missing_objects: u64,
    mounted_on: Vec<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// For an incomplete image (pulled with --lazy): how much of it is local.
    #[serde(skip_serializing_if = "Option::is_none")]
    incomplete: Option<LocalShare>,
}

/// How much of an incomplete image is in the store.
#[derive(Serialize)]
struct LocalShare {
    objects_local: u64,
    objects: u64,
    bytes_local: u64,
    bytes: u64,
    /// Where the rest comes from: `registry/repository@artifact`.
    source: String,
}

/// How much of an image is local, if it is incomplete (its record has a
/// lazy source).
fn local_share(
    record: &cairn_store::ImageRecord,
    i: &cairn_store::ImageUsage,
) -> Option<LocalShare> {
    record.lazy.as_ref().map(|l| LocalShare {
        objects_local: i.objects - i.missing_objects,
        objects: i.objects,
        bytes_local: i.object_bytes,
        bytes: l.object_bytes,
        source: format!("{}/{}@{}", l.registry, l.repository, l.artifact_digest),
    })
}

fn images(g: &Global) -> Result<()> {
    let store = open_existing(g)?;
    let usage = store.usage().context("measuring the store")?;
    let rows: Vec<ImageRow> = usage
        .images
        .iter()
        .map(|i| {
            let record = store.image_record(&i.digest).ok().flatten();
            let incomplete = record.as_ref().and_then(|r| local_share(r, i));
            let created = record.and_then(|r| r.created);
            ImageRow {
                names: i.names.iter().map(|n| shown(n)).collect(),
                digest: i.digest.clone(),
                created,
                stored: i.stored.map(rfc3339),
                size: i.total_bytes(),
                image_bytes: i.image_bytes,
                object_bytes: i.object_bytes,
                objects: i.objects,
                shared_bytes: i.shared_bytes,
                unique_bytes: i.unique_bytes,
                logical_bytes: i.logical_bytes,
                files: i.regular_files,
                missing_objects: i.missing_objects,
                mounted_on: i.mounts.clone(),
                error: i.error.clone(),
                incomplete,
            }
        })
        .collect();
    output(g, &rows, |rows| {
        let mut t = Table::new(&[
            "NAME", "DIGEST", "CREATED", "SIZE", "SHARED", "UNIQUE", "FILES", "MOUNTED", "LOCAL",
        ]);
        for r in rows {
            let names = if r.names.is_empty() {
                vec!["<none>".to_string()]
            } else {
                r.names.clone()
            };
            let created = r
                .created
                .clone()
                .or_else(|| r.stored.clone())
                .unwrap_or_default();
            for n in names {
                t.row(vec![
                    n,
                    r.digest[..12].to_string(),
                    created.clone(),
                    human_bytes(r.size),
                    human_bytes(r.shared_bytes),
                    human_bytes(r.unique_bytes),
                    r.files.to_string(),
                    match (&r.error, r.mounted_on.len()) {
                        (Some(_), _) => "unreadable (run cairn fsck)".into(),
                        (None, 0) => String::new(),
                        (None, n) => format!("{n}"),
                    },
                    match &r.incomplete {
                        Some(l) => format!(
                            "{}/{} objects, {}/{} (incomplete)",
                            l.objects_local,
                            l.objects,
                            human_bytes(l.bytes_local),
                            human_bytes(l.bytes)
                        ),
                        None => String::new(),
                    },
                ]);
            }
        }
        t.render()
    })
}

// ---------------------------------------------------------------- tag, rm

#[derive(Serialize)]
struct TagReport {
    name: String,
    digest: String,
}

fn tag(g: &Global, source: &str, name: &str) -> Result<()> {
    let ref_name = ref_name_for(name);
    cairn_store::validate_ref_name(&ref_name).with_context(|| format!("name {name:?}"))?;
    let store = open(g)?;
    let _lock = store.lock_shared().context("locking the store")?;
    let (digest, _) = resolve_into_store(&store, source)?;
    // A name must only ever point at an image whose objects are all there.
    let contents = store
        .image_contents(&digest)
        .with_context(|| format!("reading image {digest}"))?;
    let missing: Vec<_> = contents
        .objects
        .iter()
        .filter(|(id, _)| !store.has_object(id))
        .collect();
    if let Some((id, used)) = missing.first() {
        bail!(
            "image {digest} uses {} object(s) the store lacks (first: {id} for {}); not naming it",
            missing.len(),
            String::from_utf8_lossy(&used.path)
        );
    }
    store
        .set_ref(&ref_name, &digest)
        .with_context(|| format!("naming image {digest} {name:?}"))?;
    let report = TagReport {
        name: name.to_owned(),
        digest,
    };
    output(g, &report, |r| format!("{} → {}", r.name, r.digest))
}

#[derive(Serialize, Default)]
struct RmReport {
    removed: Vec<TagReport>,
    /// Images left without a name (gc removes them unless mounted).
    unnamed: Vec<String>,
}

fn rm(g: &Global, args: &RmArgs) -> Result<()> {
    let store = open_existing(g)?;
    let mut report = RmReport::default();
    let mut failures = Vec::new();
    for arg in &args.names {
        match rm_one(&store, arg, args.force, &mut report) {
            Ok(()) => {}
            Err(e) => failures.push(format!("{arg}: {e:#}")),
        }
    }
    for digest in report.removed.iter().map(|r| &r.digest) {
        if !report.unnamed.contains(digest) && store.names_of(digest)?.is_empty() {
            report.unnamed.push(digest.clone());
        }
    }
    output(g, &report, |r| {
        let mut lines: Vec<String> = r
            .removed
            .iter()
            .map(|t| format!("removed {} (image {})", t.name, &t.digest[..12]))
            .collect();
        for d in &r.unnamed {
            lines.push(format!(
                "image {} has no name left: `cairn gc` deletes it once nothing mounts it",
                &d[..12]
            ));
        }
        lines.join("\n")
    })?;
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    Ok(())
}

fn rm_one(store: &Store, arg: &str, force: bool, report: &mut RmReport) -> Result<()> {
    for ref_name in store.ref_candidates(arg) {
        if let Some(digest) = store.get_ref(&ref_name)? {
            store.remove_ref(&ref_name)?;
            report.removed.push(TagReport {
                name: shown(&ref_name),
                digest,
            });
            return Ok(());
        }
    }
    let resolved = store.resolve_image(arg)?;
    let Some(digest) = resolved.digest else {
        bail!("not a name or image digest in the store (a file is not removed)");
    };
    let names = store.names_of(&digest)?;
    if names.len() > 1 && !force {
        bail!(
            "image {digest} has {} names ({}): remove them by name, or use --force",
            names.len(),
            names
                .iter()
                .map(|n| shown(n))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if names.is_empty() && !report.unnamed.contains(&digest) {
        report.unnamed.push(digest.clone());
    }
    for n in names {
        store.remove_ref(&n)?;
        report.removed.push(TagReport {
            name: shown(&n),
            digest: digest.clone(),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------- inspect

#[derive(Serialize)]
struct Inspect {
    digest: String,
    names: Vec<String>,
    path: PathBuf,
    /// Whether the image is in the store (not just a file).
    in_store: bool,
    image_bytes: u64,
    inodes: u64,
    files: u64,
    logical_bytes: u64,
    inline_bytes: u64,
    objects: u64,
    object_bytes: u64,
    missing_objects: u64,
    mounted_on: Vec<PathBuf>,
    /// The image record of an imported image: manifest, config and layers.
    record: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    record_error: Option<String>,
}

fn inspect(g: &Global, arg: &str) -> Result<()> {
    let resolved = resolve_for_reading(g, arg)?;
    let store = Store::open_existing(&g.root).ok();
    let data = crate::read_image_file(&resolved.path)?;
    let digest = match &resolved.digest {
        Some(d) => d.clone(),
        None => {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(&data))
        }
    };
    let contents = cairn_store::ImageContents::from_image_bytes(&data)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("reading image {}", resolved.path.display()))?;
    drop(data);
    let in_store = store.as_ref().is_some_and(|s| s.has_image(&digest));
    let (mut names, mut mounted_on, mut record, mut record_error) = (vec![], vec![], None, None);
    let (mut object_bytes, mut missing) = (0, 0);
    if let Some(store) = &store {
        // An incomplete eStargz image's files are stored under other names.
        let stored_as = store.lazy_names(&digest);
        for id in contents.objects.keys() {
            let id = stored_as.get(id).unwrap_or(id);
            match std::fs::symlink_metadata(store.object_path(id)) {
                Ok(m) => object_bytes += m.len(),
                Err(_) => missing += 1,
            }
        }
        if in_store {
            names = store.names_of(&digest)?.iter().map(|n| shown(n)).collect();
            mounted_on = store
                .live_mounts()?
                .into_iter()
                .filter(|m| m.digest == digest)
                .map(|m| m.mount_point)
                .collect();
            match store.image_record(&digest) {
                Ok(Some(r)) => record = Some(record_json(&r)?),
                Ok(None) => {}
                Err(e) => record_error = Some(e.to_string()),
            }
        }
    }
    let report = Inspect {
        path: if in_store {
            store
                .as_ref()
                .map_or(resolved.path.clone(), |s| s.image_path(&digest))
        } else {
            resolved.path.clone()
        },
        digest,
        names,
        in_store,
        image_bytes: contents.image_bytes,
        inodes: contents.inodes,
        files: contents.regular_files,
        logical_bytes: contents.logical_bytes,
        inline_bytes: contents.inline_bytes,
        objects: contents.objects.len() as u64,
        object_bytes,
        missing_objects: missing,
        mounted_on,
        record,
        record_error,
    };
    // inspect always prints JSON: it is for reading by people and programs alike.
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, &report)?;
    std::io::Write::write_all(&mut out, b"\n")?;
    Ok(())
}

/// The record as JSON, with the manifest and config (stored as the exact
/// bytes imported) shown as JSON too when they parse.
fn record_json(r: &cairn_store::ImageRecord) -> Result<Value> {
    let mut v = serde_json::to_value(r)?;
    if let Value::Object(map) = &mut v {
        for key in ["manifest", "config"] {
            if let Some(Value::String(s)) = map.get(key) {
                if let Ok(parsed) = serde_json::from_str::<Value>(s) {
                    map.insert(key.to_string(), parsed);
                }
            }
        }
    }
    Ok(v)
}

// ---------------------------------------------------------------- df

#[derive(Serialize)]
struct CategoryRow {
    category: &'static str,
    count: u64,
    bytes: u64,
    disk_bytes: u64,
}

#[derive(Serialize)]
struct DfReport {
    categories: Vec<CategoryRow>,
    images: u64,
    refs: u64,
    /// Sum over images of their files' sizes.
    logical_bytes: u64,
    /// Objects, images and layer records.
    physical_bytes: u64,
    dedup_ratio: f64,
    /// What `cairn gc` would free.
    reclaimable: CategoryRow,
    broken_refs: Vec<String>,
    /// Images pulled with --lazy and not yet complete.
    incomplete: Vec<IncompleteRow>,
}

#[derive(Serialize)]
struct IncompleteRow {
    digest: String,
    names: Vec<String>,
    #[serde(flatten)]
    local: LocalShare,
}

fn df(g: &Global) -> Result<()> {
    let store = open_existing(g)?;
    let u = store.usage().context("measuring the store")?;
    let row = |category, c: &cairn_store::Category| CategoryRow {
        category,
        count: c.count,
        bytes: c.bytes,
        disk_bytes: c.disk_bytes,
    };
    let report = DfReport {
        categories: vec![
            row("objects", &u.objects),
            row("images", &u.image_files),
            row("layers", &u.layers),
            row("tmp", &u.tmp),
        ],
        images: u.images.len() as u64,
        refs: u.refs,
        logical_bytes: u.logical_bytes,
        physical_bytes: u.physical_bytes(),
        dedup_ratio: u.dedup_ratio(),
        reclaimable: row("reclaimable", &u.unreferenced),
        broken_refs: u.broken_refs.iter().map(|n| shown(n)).collect(),
        incomplete: u
            .images
            .iter()
            .filter_map(|i| {
                let record = store.image_record(&i.digest).ok().flatten()?;
                Some(IncompleteRow {
                    digest: i.digest.clone(),
                    names: i.names.iter().map(|n| shown(n)).collect(),
                    local: local_share(&record, i)?,
                })
            })
            .collect(),
    };
    output(g, &report, |r| {
        let mut t = Table::new(&["CATEGORY", "COUNT", "SIZE", "ON DISK"]);
        for c in r.categories.iter().chain(std::iter::once(&r.reclaimable)) {
            t.row(vec![
                c.category.to_string(),
                c.count.to_string(),
                human_bytes(c.bytes),
                human_bytes(c.disk_bytes),
            ]);
        }
        let mut text = t.render();
        text.push_str(&format!(
            "\n\n{} images, {} names. Logical {} (the images' files), physical {} \
             (objects, images, layers): dedup ratio {:.2}",
            r.images,
            r.refs,
            human_bytes(r.logical_bytes),
            human_bytes(r.physical_bytes),
            r.dedup_ratio
        ));
        for i in &r.incomplete {
            text.push_str(&format!(
                "\nincomplete (pulled with --lazy): {} ({}): {}/{} objects, {}/{} local; \
                 the rest from {}",
                i.names.first().map_or("<none>", String::as_str),
                &i.digest[..12],
                i.local.objects_local,
                i.local.objects,
                human_bytes(i.local.bytes_local),
                human_bytes(i.local.bytes),
                i.local.source
            ));
        }
        if !r.broken_refs.is_empty() {
            text.push_str(&format!(
                "\nnames without a sound image (run cairn fsck): {}",
                r.broken_refs.join(", ")
            ));
        }
        text
    })
}

// ---------------------------------------------------------------- gc

#[derive(Serialize)]
struct GcOut {
    dry_run: bool,
    images: Vec<Freed>,
    layers: Vec<Freed>,
    objects: u64,
    object_bytes: u64,
    tmp_entries: usize,
    bytes_freed: u64,
    kept_images: u64,
    kept_layers: u64,
    kept_objects: u64,
    live_mounts: Vec<MountOut>,
}

#[derive(Serialize)]
struct Freed {
    name: String,
    bytes: u64,
}

#[derive(Serialize)]
struct MountOut {
    digest: String,
    mount_point: PathBuf,
    pid: u32,
}

fn gc(g: &Global, dry_run: bool) -> Result<()> {
    let store = open(g)?;
    let r = store
        .gc(&cairn_store::GcOptions { dry_run })
        .context("collecting garbage")?;
    let freed = |v: &[cairn_store::Removed]| {
        v.iter()
            .map(|x| Freed {
                name: x.name.clone(),
                bytes: x.bytes,
            })
            .collect::<Vec<_>>()
    };
    let out = GcOut {
        dry_run,
        images: freed(&r.images),
        layers: freed(&r.layers),
        objects: r.objects,
        object_bytes: r.object_bytes,
        tmp_entries: r.tmp_entries,
        bytes_freed: r.bytes_freed(),
        kept_images: r.kept_images,
        kept_layers: r.kept_layers,
        kept_objects: r.kept_objects,
        live_mounts: r
            .live_mounts
            .iter()
            .map(|m| MountOut {
                digest: m.digest.clone(),
                mount_point: m.mount_point.clone(),
                pid: m.pid,
            })
            .collect(),
    };
    output(g, &out, |o| {
        let verb = if o.dry_run { "would remove" } else { "removed" };
        let mut lines = Vec::new();
        for i in &o.images {
            lines.push(format!(
                "{verb} image {} ({})",
                i.name,
                human_bytes(i.bytes)
            ));
        }
        for l in &o.layers {
            lines.push(format!(
                "{verb} layer {} ({})",
                l.name,
                human_bytes(l.bytes)
            ));
        }
        if o.objects > 0 {
            lines.push(format!(
                "{verb} {} objects ({})",
                o.objects,
                human_bytes(o.object_bytes)
            ));
        }
        if o.tmp_entries > 0 {
            lines.push(format!("removed {} stale staging entries", o.tmp_entries));
        }
        for m in &o.live_mounts {
            lines.push(format!(
                "kept image {} (mounted on {})",
                &m.digest[..12],
                m.mount_point.display()
            ));
        }
        lines.push(format!(
            "{} {}; kept {} images, {} layers, {} objects",
            if o.dry_run { "would free" } else { "freed" },
            human_bytes(o.bytes_freed),
            o.kept_images,
            o.kept_layers,
            o.kept_objects
        ));
        lines.join("\n")
    })
}

// ---------------------------------------------------------------- fsck

#[derive(Serialize)]
struct FsckOut {
    objects: u64,
    object_bytes: u64,
    images: u64,
    layers: u64,
    refs: u64,
    problems: Vec<ProblemOut>,
    repairs: Vec<String>,
    clean: bool,
}

#[derive(Serialize)]
struct ProblemOut {
    kind: &'static str,
    message: String,
}

fn fsck(g: &Global, repair: bool) -> Result<()> {
    let store = if repair { open(g)? } else { open_existing(g)? };
    // The containers' run root holds their records and crun's state: it
    // must be as private as the store.
    let paths = crate::run_cmds::paths(g);
    let private_dirs = [paths.runroot()];
    let opts = cairn_store::FsckOptions {
        repair,
        threads: 0,
        private_dirs: &private_dirs,
    };
    let r = store.fsck(&opts).context("checking the store")?;
    let out = FsckOut {
        objects: r.objects,
        object_bytes: r.object_bytes,
        images: r.images,
        layers: r.layers,
        refs: r.refs,
        problems: r
            .problems
            .iter()
            .map(|p| ProblemOut {
                kind: p.kind(),
                message: p.to_string(),
            })
            .collect(),
        repairs: r.repairs.iter().map(|x| x.to_string()).collect(),
        clean: r.is_clean(),
    };
    output(g, &out, |o| {
        let mut lines: Vec<String> = o.problems.iter().map(|p| p.message.clone()).collect();
        lines.extend(o.repairs.iter().map(|x| format!("repair: {x}")));
        lines.push(format!(
            "checked {} objects ({}), {} images, {} layers, {} names: {}",
            o.objects,
            human_bytes(o.object_bytes),
            o.images,
            o.layers,
            o.refs,
            match o.problems.len() {
                0 => "clean".to_string(),
                1 => "1 problem".to_string(),
                n => format!("{n} problems"),
            }
        ));
        lines.join("\n")
    })?;
    if !r.is_clean() && !repair {
        bail!(
            "{} problem(s) in the store at {}; `cairn fsck --repair` removes what is broken and makes private what lets other users in",
            r.problems.len(),
            g.root.display()
        );
    }
    if repair {
        // What a repair leaves must check clean; say so if it does not.
        let again = store
            .fsck(&cairn_store::FsckOptions {
                repair: false,
                ..opts
            })
            .context("checking the store after repairing it")?;
        if !again.is_clean() {
            bail!(
                "{} problem(s) left after repairing the store at {}: {}",
                again.problems.len(),
                g.root.display(),
                again
                    .problems
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- output helpers

/// A plain text table, columns padded to their widest cell.
struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str]) -> Table {
        Table {
            rows: vec![header.iter().map(|s| s.to_string()).collect()],
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        self.rows
            .iter()
            .map(|r| {
                let mut line = String::new();
                for (i, cell) in r.iter().enumerate() {
                    if i + 1 == r.len() {
                        line.push_str(cell);
                    } else {
                        line.push_str(&format!("{cell:<w$}  ", w = widths[i]));
                    }
                }
                line.trim_end().to_string()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Bytes in decimal units, as `df -H` and registries show them.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if v < 1000.0 {
            break;
        }
        v /= 1000.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

/// `YYYY-MM-DDTHH:MM:SSZ`, UTC.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let secs = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs() as i64),
    };
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_times_and_sizes() {
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        assert_eq!(rfc3339(t(0)), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(t(951_782_400)), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(t(1_718_454_645)), "2024-06-15T12:30:45Z");
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1000), "1.0 kB");
        assert_eq!(human_bytes(1_234_567), "1.2 MB");
    }
}
