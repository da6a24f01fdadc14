//! Store management through the library: resolving names, the usage
//! report, garbage collection and fsck, on stores built by the test (images
//! written with the erofs crate over objects imported here; layer and image
//! records written through the record API).

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use cairn_erofs::tree::{Inode, RegularFile, Tree, S_IFDIR, S_IFREG};
use cairn_erofs::InodeData;
use cairn_store::{
    GcOptions, ImageRecord, ImageRecordLayer, ImageSource, LayerRecord, ObjectId, Problem, Repair,
    Store, StoreError, LAYER_FORMAT,
};

fn new_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store")).unwrap();
    (dir, store)
}

/// Deterministic content of `len` bytes, different for each `seed`.
fn content(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// Writes an image holding `files` (name → content, all at the root) into
/// the store, importing their contents as objects; returns its digest.
fn add_image(store: &Store, files: &[(&str, &[u8])]) -> String {
    let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
    for (name, data) in files {
        let id = store.import_bytes(data).unwrap();
        let mut inode = Inode::new(S_IFREG | 0o644).unwrap();
        inode.size = data.len() as u64;
        inode.data = InodeData::Regular(RegularFile {
            content: None,
            payload: Some(id.object_path().into_bytes()),
            digest: Some(id.0),
        });
        let n = tree.push(inode);
        tree.add_child(0, name.as_bytes(), n, false).unwrap();
    }
    let bytes = cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default()).unwrap();
    let mut w = store.image_writer().unwrap();
    w.write_all(&bytes).unwrap();
    w.commit().unwrap()
}

fn object_of(data: &[u8]) -> ObjectId {
    cairn_store::fsverity_digest(data).unwrap()
}

fn objects(store: &Store) -> BTreeSet<ObjectId> {
    store.list_objects().unwrap().map(Result::unwrap).collect()
}

fn images(store: &Store) -> BTreeSet<String> {
    store.list_images().unwrap().map(Result::unwrap).collect()
}

fn diff_id(n: u8) -> String {
    format!("sha256:{}", format!("{n:02x}").repeat(32))
}

/// Publishes a layer record `diff_id` whose dump names `objects`.
fn add_layer(store: &Store, diff_id: &str, contents: &[&[u8]]) {
    let mut dump = String::from("/ 0 40755 2 0 0 0 0.0 - - -\n");
    for (i, data) in contents.iter().enumerate() {
        let id = store.import_bytes(data).unwrap();
        dump.push_str(&format!(
            "/f{i} {} 100644 1 0 0 0 0.0 {} - {}\n",
            data.len(),
            id.object_path(),
            id
        ));
    }
    let mut w = store.layer_writer().unwrap();
    w.entries().write_all(dump.as_bytes()).unwrap();
    let record = LayerRecord {
        format: LAYER_FORMAT,
        diff_id: diff_id.to_owned(),
        blob_digest: None,
        media_type: None,
        compression: "none".into(),
        size: 0,
        compressed_size: 0,
        entries: contents.len() as u64 + 1,
        objects: contents.len() as u64,
    };
    assert!(w.commit(store, &record).unwrap());
}

/// Gives the image a record listing `layers`.
fn add_record(store: &Store, digest: &str, layers: &[String]) {
    let record = ImageRecord {
        image_digest: digest.to_owned(),
        manifest_digest: format!("sha256:{}", "1".repeat(64)),
        config_digest: format!("sha256:{}", "2".repeat(64)),
        manifest: "{}".into(),
        config: r#"{"created":"2024-01-02T03:04:05Z"}"#.into(),
        layers: layers
            .iter()
            .map(|d| ImageRecordLayer {
                diff_id: d.clone(),
                blob_digest: None,
                size: 0,
            })
            .collect(),
        created: Some("2024-01-02T03:04:05Z".into()),
        architecture: None,
        os: None,
        imported: "2024-01-02T03:04:05Z".into(),
        image_size: 0,
        content_size: 0,
        source: None,
        lazy: None,
    };
    store.write_image_record(&record).unwrap();
}

// ------------------------------------------------------------------ resolve

#[test]
fn resolve_by_ref_digest_prefix_and_path() {
    let (dir, store) = new_store();
    let a = add_image(&store, &[("a", &content(1, 10_000))]);
    store.set_ref("debian:12", &a).unwrap();
    store
        .set_ref(&cairn_store::ref_name_for("reg:5000/lib/debian:12"), &a)
        .unwrap();

    let by_ref = store.resolve_image("debian:12").unwrap();
    assert_eq!(by_ref.digest.as_deref(), Some(a.as_str()));
    assert_eq!(by_ref.source, ImageSource::Ref("debian:12".into()));
    assert_eq!(by_ref.path, store.image_path(&a));

    let mapped = store.resolve_image("reg:5000/lib/debian:12").unwrap();
    assert_eq!(mapped.digest.as_deref(), Some(a.as_str()));

    for arg in [
        a.clone(),
        format!("sha256:{a}"),
        a[..12].to_string(),
        format!("sha256:{}", &a[..20]),
        a.to_uppercase(),
    ] {
        let r = store
            .resolve_image(&arg)
            .unwrap_or_else(|e| panic!("{arg}: {e}"));
        assert_eq!(r.digest.as_deref(), Some(a.as_str()), "{arg}");
        assert_eq!(r.source, ImageSource::Digest, "{arg}");
    }
    // 11 digits are not a digest prefix.
    assert!(matches!(
        store.resolve_image(&a[..11]),
        Err(StoreError::NoSuchImage { .. })
    ));

    // A file; and a file with a ref's name, which ./ reaches.
    let file = dir.path().join("debian:12");
    fs::write(&file, b"not even an image").unwrap();
    let cwd = std::env::current_dir().unwrap();
    std::env::set_current_dir(dir.path()).unwrap();
    let by_path = store.resolve_image("./debian:12");
    let by_name = store.resolve_image("debian:12");
    std::env::set_current_dir(cwd).unwrap();
    let by_path = by_path.unwrap();
    assert_eq!(by_path.source, ImageSource::File);
    assert_eq!(by_path.digest, None);
    assert_eq!(by_path.path, PathBuf::from("./debian:12"));
    assert_eq!(
        by_name.unwrap().source,
        ImageSource::Ref("debian:12".into())
    );
    let abs = store.resolve_image(file.to_str().unwrap()).unwrap();
    assert_eq!((abs.source, abs.path), (ImageSource::File, file));

    let err = store.resolve_image("nope").unwrap_err();
    assert!(matches!(err, StoreError::NoSuchImage { .. }), "{err}");
    assert!(err.to_string().contains("\"nope\""), "{err}");
}

#[test]
fn an_ambiguous_prefix_names_every_candidate() {
    let (_dir, store) = new_store();
    // Two image files whose names share 14 digits (the store lists images
    // by name; resolving does not read them).
    let one = format!("abcdef01234567{}", "0".repeat(50));
    let two = format!("abcdef01234567{}", "1".repeat(50));
    for d in [&one, &two] {
        fs::write(store.image_path(d), b"x").unwrap();
    }
    let err = store.resolve_image("abcdef012345").unwrap_err();
    match &err {
        StoreError::AmbiguousImagePrefix { prefix, candidates } => {
            assert_eq!(prefix, "abcdef012345");
            assert_eq!(candidates, &vec![one.clone(), two.clone()]);
        }
        e => panic!("{e}"),
    }
    assert!(err.to_string().contains(&one) && err.to_string().contains(&two));
    // One digit more and it is unique.
    let r = store.resolve_image("abcdef012345671").unwrap();
    assert_eq!(r.digest, Some(two));
}

// ------------------------------------------------------------------ usage

#[test]
fn usage_counts_shared_and_unique_bytes() {
    let (_dir, store) = new_store();
    let common = content(1, 100_000);
    let ab = content(2, 20_000);
    let only_a = content(3, 3_000);
    let only_b = content(4, 4_000);
    let only_c = content(5, 5_000);
    let a = add_image(&store, &[("common", &common), ("ab", &ab), ("a", &only_a)]);
    let b = add_image(
        &store,
        &[
            ("common", &common),
            ("ab", &ab),
            ("b", &only_b),
            ("b2", &only_b),
        ],
    );
    let c = add_image(&store, &[("common", &common), ("c", &only_c)]);
    store.set_ref("a", &a).unwrap();
    store.set_ref("b", &b).unwrap();
    store.set_ref("b-again", &b).unwrap();
    store.set_ref("c", &c).unwrap();

    let u = store.usage().unwrap();
    assert_eq!(u.images.len(), 3);
    let get = |d: &str| u.images.iter().find(|i| i.digest == d).unwrap();
    let size = |d: &str| fs::metadata(store.image_path(d)).unwrap().len();

    let ia = get(&a);
    assert_eq!(ia.names, vec!["a".to_string()]);
    assert_eq!(ia.objects, 3);
    assert_eq!(ia.object_bytes, 123_000);
    assert_eq!(ia.shared_bytes, 120_000);
    assert_eq!(ia.unique_bytes, size(&a) + 3_000);
    assert_eq!(ia.logical_bytes, 123_000);
    assert_eq!(ia.total_bytes(), size(&a) + 123_000);

    let ib = get(&b);
    assert_eq!(ib.names, vec!["b".to_string(), "b-again".to_string()]);
    assert_eq!(ib.objects, 3, "b and b2 are one object");
    assert_eq!(ib.shared_bytes, 120_000);
    assert_eq!(ib.unique_bytes, size(&b) + 4_000);
    assert_eq!(
        ib.logical_bytes, 128_000,
        "each name counts in what the image shows"
    );

    let ic = get(&c);
    assert_eq!(ic.shared_bytes, 100_000);
    assert_eq!(ic.unique_bytes, size(&c) + 5_000);

    // Totals: 5 distinct objects; logical counts every image's files.
    assert_eq!(u.objects.count, 5);
    assert_eq!(u.objects.bytes, 100_000 + 20_000 + 3_000 + 4_000 + 5_000);
    assert_eq!(u.image_files.count, 3);
    assert_eq!(u.image_files.bytes, size(&a) + size(&b) + size(&c));
    assert_eq!(u.logical_bytes, 123_000 + 128_000 + 105_000);
    assert_eq!(u.physical_bytes(), u.objects.bytes + u.image_files.bytes);
    let ratio = u.logical_bytes as f64 / u.physical_bytes() as f64;
    assert!((u.dedup_ratio() - ratio).abs() < 1e-9);
    assert_eq!(u.unreferenced.count, 0);
    assert_eq!(u.refs, 4);

    // Without a name, c and its unique object become reclaimable.
    store.remove_ref("c").unwrap();
    let u = store.usage().unwrap();
    assert_eq!(u.unreferenced.count, 2);
    assert_eq!(u.unreferenced.bytes, size(&c) + 5_000);
}

// ------------------------------------------------------------------ gc

#[test]
fn gc_removes_exactly_what_no_ref_reaches() {
    let (_dir, store) = new_store();
    let shared = content(1, 50_000);
    let only_kept = content(2, 6_000);
    let only_gone = content(3, 7_000);
    let kept = add_image(&store, &[("s", &shared), ("k", &only_kept)]);
    let gone = add_image(&store, &[("s", &shared), ("g", &only_gone)]);
    let stray = store.import_bytes(&content(4, 999)).unwrap();
    store.set_ref("kept", &kept).unwrap();
    store.set_ref("gone", &gone).unwrap();
    store.remove_ref("gone").unwrap();
    // A ref to an image that is not there is no root and no obstacle.
    fs::write(
        store.refs_dir().join("dangling"),
        format!("{}\n", "e".repeat(64)),
    )
    .unwrap();

    let before_objects = objects(&store);
    let dry = store.gc(&GcOptions { dry_run: true }).unwrap();
    assert!(dry.dry_run);
    assert_eq!(objects(&store), before_objects, "a dry run removes nothing");
    assert_eq!(images(&store).len(), 2);

    let report = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(
        (report.images.len(), report.objects, report.layers.len()),
        (dry.images.len(), dry.objects, dry.layers.len()),
        "the dry run told what the real one did"
    );
    assert_eq!(report.bytes_freed(), dry.bytes_freed());
    assert_eq!(report.images.len(), 1);
    assert_eq!(report.images[0].name, gone);
    assert_eq!(report.objects, 2);
    assert_eq!(report.object_bytes, 7_000 + 999);
    assert_eq!(report.bytes_freed(), 7_000 + 999 + report.images[0].bytes);
    assert_eq!(images(&store), BTreeSet::from([kept.clone()]));
    assert_eq!(
        objects(&store),
        BTreeSet::from([object_of(&shared), object_of(&only_kept)])
    );
    assert!(!objects(&store).contains(&stray));
    assert_eq!(report.kept_images, 1);
    assert_eq!(report.kept_objects, 2);
    assert_eq!(
        store.get_ref("kept").unwrap().as_deref(),
        Some(kept.as_str())
    );

    // Nothing left to take.
    let again = store.gc(&GcOptions::default()).unwrap();
    assert_eq!((again.images.len(), again.objects), (0, 0));
}

#[test]
fn gc_keeps_the_layers_of_named_images_and_what_they_hold() {
    let (_dir, store) = new_store();
    let in_image = content(1, 10_000);
    let layer_only = content(2, 11_000);
    let orphan_layer_obj = content(3, 12_000);
    let img = add_image(&store, &[("f", &in_image)]);
    add_layer(&store, &diff_id(1), &[&in_image, &layer_only]);
    add_layer(&store, &diff_id(2), &[&orphan_layer_obj]);
    add_record(&store, &img, &[diff_id(1)]);
    store.set_ref("img", &img).unwrap();
    // An image record whose image is gone.
    let ghost = "9".repeat(64);
    fs::write(store.images_dir().join(format!("{ghost}.json")), b"{}").unwrap();

    let u = store.usage().unwrap();
    assert_eq!(u.layers.count, 2);
    assert!(u.layers.bytes > 0);
    let layer2 = fs::read_dir(store.layer_dir(&diff_id(2)))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum::<u64>();
    assert_eq!(u.unreferenced.count, 2, "layer 2 and its object");
    assert_eq!(u.unreferenced.bytes, layer2 + 12_000);
    let record = fs::metadata(store.image_record_path(&img)).unwrap().len();
    assert_eq!(
        u.image_files.bytes,
        fs::metadata(store.image_path(&img)).unwrap().len() + record,
        "an image's record counts with it"
    );

    let report = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(
        report
            .layers
            .iter()
            .map(|l| l.name.clone())
            .collect::<Vec<_>>(),
        vec![diff_id(2)]
    );
    assert!(report.layers[0].bytes > 0);
    assert_eq!(report.objects, 1, "only the unused layer's object goes");
    assert!(store.has_layer_record(&diff_id(1)));
    assert!(!store.layer_dir(&diff_id(2)).exists());
    assert!(
        store.image_record_path(&img).exists(),
        "a kept image keeps its record"
    );
    assert!(!store.images_dir().join(format!("{ghost}.json")).exists());
    assert_eq!(
        objects(&store),
        BTreeSet::from([object_of(&in_image), object_of(&layer_only)])
    );

    // Unnamed, the image goes with its record, its layer and all objects.
    store.remove_ref("img").unwrap();
    let report = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(report.images.len(), 1);
    assert_eq!(report.layers.len(), 1);
    assert!(!store.image_record_path(&img).exists());
    assert!(objects(&store).is_empty());
    assert!(images(&store).is_empty());
    assert!(fs::read_dir(store.layers_dir()).unwrap().next().is_none());
    assert!(fs::read_dir(store.images_dir()).unwrap().next().is_none());
}

#[test]
fn gc_refuses_when_it_cannot_tell_what_a_root_needs() {
    let (_dir, store) = new_store();
    let data = content(1, 9_000);
    let img = add_image(&store, &[("f", &data)]);
    store.set_ref("img", &img).unwrap();
    store.import_bytes(&content(9, 100)).unwrap();
    let before = objects(&store);

    // A corrupt ref.
    fs::write(store.refs_dir().join("broken"), b"not a digest\n").unwrap();
    let err = store.gc(&GcOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::GcRefused { .. }), "{err}");
    assert!(err.to_string().contains("\"broken\""), "{err}");
    assert_eq!(objects(&store), before);
    fs::remove_file(store.refs_dir().join("broken")).unwrap();

    // A named image that cannot be read.
    let path = store.image_path(&img);
    let mut perms = fs::metadata(&path).unwrap().permissions();
    perms.set_mode(0o644);
    fs::set_permissions(&path, perms).unwrap();
    let full = fs::read(&path).unwrap();
    fs::write(&path, &full[..100]).unwrap();
    let err = store.gc(&GcOptions::default()).unwrap_err();
    assert!(err.to_string().contains(&img), "{err}");
    assert_eq!(objects(&store), before);
    fs::write(&path, &full).unwrap();

    // A layer record of a named image that cannot be read.
    add_layer(&store, &diff_id(7), &[&data]);
    add_record(&store, &img, &[diff_id(7)]);
    fs::write(store.layer_dir(&diff_id(7)).join("layer.json"), b"{").unwrap();
    let err = store.gc(&GcOptions::default()).unwrap_err();
    assert!(err.to_string().contains(&diff_id(7)), "{err}");
    assert_eq!(objects(&store), before);
}

#[test]
fn gc_clears_dead_writers_staging_but_waits_for_live_writers() {
    let (dir, store) = new_store();
    let img = add_image(&store, &[("f", &content(1, 5_000))]);
    store.set_ref("img", &img).unwrap();
    // A live writer in another Store (another process, as far as locks go)
    // holds the lock shared: gc waits for it.
    let writer = Store::open(&dir.path().join("store")).unwrap();
    // Debris of a writer that died.
    let debris = store.tmp_dir().join("s.999999.1.0");
    fs::create_dir(&debris).unwrap();
    fs::write(debris.join("o.0"), b"half").unwrap();
    let lock = writer.lock_shared().unwrap();
    let staged = writer.import_bytes(&content(2, 3_000)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let root = store.root().to_path_buf();
    let gc = std::thread::spawn(move || {
        let s = Store::open_existing(&root).unwrap();
        let r = s.gc(&GcOptions::default()).unwrap();
        tx.send(()).unwrap();
        r
    });
    // gc shows in /proc/locks as blocked on the store lock; had it not
    // waited, it would have finished (and sent) first.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while cairn_store::flock_waiters(&writer.lock_path()).is_empty() {
        assert!(rx.try_recv().is_err(), "gc must wait for the writer's lock");
        assert!(
            std::time::Instant::now() < deadline,
            "gc never blocked on the store lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(rx.try_recv().is_err(), "gc must wait for the writer's lock");
    // The writer names what it wrote, then lets go.
    let img2 = add_image(&writer, &[("g", &content(2, 3_000))]);
    writer.set_ref("img2", &img2).unwrap();
    drop(lock);
    let report = gc.join().unwrap();
    assert!(report.tmp_entries >= 1);
    assert!(!debris.exists());
    assert!(store.has_object(&staged), "what the writer named survives");
    assert!(store.has_image(&img2));
    assert_eq!(report.images.len(), 0);
}

// ------------------------------------------------------------------ fsck

fn make_writable(path: &std::path::Path) {
    let mut perms = fs::metadata(path).unwrap().permissions();
    perms.set_mode(0o644);
    fs::set_permissions(path, perms).unwrap();
}

#[test]
fn fsck_reports_every_problem_and_repair_leaves_a_clean_store() {
    let (_dir, store) = new_store();
    let good_data = content(1, 40_000);
    let flipped_data = content(2, 30_000);
    let missing_data = content(3, 20_000);
    let good = add_image(&store, &[("good", &good_data)]);
    let uses_flipped = add_image(&store, &[("good", &good_data), ("flip", &flipped_data)]);
    let uses_missing = add_image(&store, &[("gone", &missing_data)]);
    let truncated = add_image(&store, &[("t", &content(4, 1_000))]);
    for (n, d) in [
        ("good", &good),
        ("flipped", &uses_flipped),
        ("missing", &uses_missing),
        ("truncated", &truncated),
    ] {
        store.set_ref(n, d).unwrap();
    }
    add_layer(&store, &diff_id(1), &[&good_data]);
    add_layer(&store, &diff_id(2), &[&missing_data]);
    add_layer(&store, &diff_id(3), &[&good_data]);
    add_record(&store, &good, &[diff_id(1), diff_id(3)]);
    assert!(store.fsck(&Default::default()).unwrap().is_clean());

    // A flipped byte in an object.
    let flipped = object_of(&flipped_data);
    let p = store.object_path(&flipped);
    make_writable(&p);
    let mut bytes = fs::read(&p).unwrap();
    bytes[12_345] ^= 0x01;
    fs::write(&p, &bytes).unwrap();
    // A missing object.
    let missing = object_of(&missing_data);
    fs::remove_file(store.object_path(&missing)).unwrap();
    // A truncated image.
    let p = store.image_path(&truncated);
    make_writable(&p);
    let len = fs::metadata(&p).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    // A dangling ref and a corrupt one.
    fs::write(
        store.refs_dir().join("dangling"),
        format!("{}\n", "d".repeat(64)),
    )
    .unwrap();
    fs::write(store.refs_dir().join("garbled"), b"hello\n").unwrap();
    // A corrupt layer record.
    fs::write(store.layer_dir(&diff_id(3)).join("layer.json"), b"[]").unwrap();

    let before_objects = objects(&store);
    let report = store.fsck(&Default::default()).unwrap();
    assert_eq!(objects(&store), before_objects, "a check changes nothing");
    let kinds: BTreeSet<&str> = report.problems.iter().map(Problem::kind).collect();
    for kind in [
        "corrupt-object",
        "corrupt-object-used",
        "missing-object",
        "image-digest-mismatch",
        "unreadable-image",
        "dangling-ref",
        "corrupt-ref",
        "ref-to-broken-image",
        "layer-missing-object",
        "corrupt-layer",
    ] {
        assert!(
            kinds.contains(kind),
            "{kind} not reported: {:#?}",
            report.problems
        );
    }
    let text: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    let has = |needle: &str| text.iter().any(|t| t.contains(needle));
    assert!(has(&flipped.to_string()));
    assert!(
        has(&format!(
            "image {uses_missing}: /gone: object {missing} is missing"
        )),
        "{text:#?}"
    );
    assert!(
        has(&format!(
            "image {uses_flipped}: /flip: object {flipped} is corrupt"
        )),
        "{text:#?}"
    );
    assert!(has(&truncated));
    assert!(has("ref \"dangling\""));
    assert!(has("ref \"garbled\""));
    for name in ["flipped", "missing", "truncated"] {
        assert!(has(&format!("ref \"{name}\": image")), "{name}: {text:#?}");
    }
    assert!(
        !has(&format!("image {good}")),
        "the good image is fine: {text:#?}"
    );
    assert_eq!(report.objects, 3);
    assert_eq!(report.images, 4);
    assert_eq!(report.layers, 3);
    assert_eq!(report.refs, 6);

    let repaired = store
        .fsck(&cairn_store::FsckOptions {
            repair: true,
            threads: 2,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(repaired.problems, report.problems);
    let removed: BTreeSet<String> = repaired.repairs.iter().map(Repair::to_string).collect();
    for expected in [
        format!("removed object {flipped}"),
        format!("removed image {uses_flipped}"),
        format!("removed image {uses_missing}"),
        format!("removed image {truncated}"),
        format!("removed layer {}", diff_id(2)),
        format!("removed layer {}", diff_id(3)),
        "removed ref \"dangling\"".to_string(),
        "removed ref \"garbled\"".to_string(),
        "removed ref \"flipped\"".to_string(),
        "removed ref \"missing\"".to_string(),
        "removed ref \"truncated\"".to_string(),
    ] {
        assert!(
            removed.contains(&expected),
            "{expected} not in {removed:#?}"
        );
    }
    assert_eq!(removed.len(), 11, "{removed:#?}");

    let after = store.fsck(&Default::default()).unwrap();
    assert!(after.is_clean(), "{:#?}", after.problems);
    assert_eq!(
        store.list_refs().unwrap(),
        vec![("good".to_string(), good.clone())]
    );
    assert!(store.has_layer_record(&diff_id(1)));
    assert!(store.has_object(&object_of(&good_data)));
    // And gc runs again on what is left.
    store.gc(&GcOptions::default()).unwrap();
    assert!(store.fsck(&Default::default()).unwrap().is_clean());
}

#[test]
fn fsck_checks_sizes_payloads_and_non_files() {
    let (_dir, store) = new_store();
    let data = content(1, 8_000);
    let id = store.import_bytes(&data).unwrap();
    // An image that claims another size for the object, and one whose file
    // points outside the store's naming.
    let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755).unwrap()).unwrap();
    for (name, size, payload) in [
        ("wrong-size", 9_000u64, id.object_path()),
        ("elsewhere", 10, "../etc/passwd".to_string()),
    ] {
        let mut inode = Inode::new(S_IFREG | 0o644).unwrap();
        inode.size = size;
        inode.data = InodeData::Regular(RegularFile {
            content: None,
            payload: Some(payload.into_bytes()),
            digest: None,
        });
        let n = tree.push(inode);
        tree.add_child(0, name.as_bytes(), n, false).unwrap();
    }
    let bytes = cairn_erofs::writer::mkfs_erofs_to_vec(&tree, &Default::default()).unwrap();
    let mut w = store.image_writer().unwrap();
    w.write_all(&bytes).unwrap();
    let img = w.commit().unwrap();
    // A directory where an object should be.
    let fake = ObjectId([0xab; 32]);
    fs::create_dir_all(store.object_path(&fake)).unwrap();

    let report = store.fsck(&Default::default()).unwrap();
    let kinds: Vec<&str> = report.problems.iter().map(Problem::kind).collect();
    assert!(kinds.contains(&"object-size-mismatch"), "{kinds:?}");
    assert!(kinds.contains(&"bad-payload"), "{kinds:?}");
    assert!(kinds.contains(&"unreadable-object"), "{kinds:?}");
    let repaired = store
        .fsck(&cairn_store::FsckOptions {
            repair: true,
            threads: 0,
            ..Default::default()
        })
        .unwrap();
    assert!(repaired.repairs.contains(&Repair::RemovedImage(img)));
    assert!(repaired.repairs.contains(&Repair::RemovedObject(fake)));
    assert!(store.fsck(&Default::default()).unwrap().is_clean());
    assert!(store.has_object(&id), "a sound object stays");
}

#[test]
fn live_mounts_of_a_store_without_mounts_are_none() {
    let (_dir, store) = new_store();
    add_image(&store, &[("f", &content(1, 100))]);
    assert!(store.live_mounts().unwrap().is_empty());
}

#[test]
fn layer_record_of_an_older_format_is_replaced() {
    let (_d, store) = new_store();
    // A record as format 1 wrote it: layer.json and a `dump`.
    let dir = store.layer_dir(&diff_id(9));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("dump"), "/ 0 40755 2 0 0 0 0.0 - - -\n").unwrap();
    let old = serde_json::json!({
        "format": 1, "diff_id": diff_id(9), "blob_digest": null, "media_type": null,
        "compression": "none", "size": 0, "compressed_size": 0, "entries": 1, "objects": 0,
    });
    std::fs::write(dir.join("layer.json"), old.to_string()).unwrap();
    assert!(!store.has_layer_record(&diff_id(9)));
    let err = store.layer_record(&diff_id(9)).unwrap_err().to_string();
    assert!(err.contains("format 1"), "{err}");
    // Importing the layer again puts a current record in its place.
    add_layer(&store, &diff_id(9), &[b"again"]);
    assert!(store.has_layer_record(&diff_id(9)));
    assert!(!dir.join("dump").exists());
    assert_eq!(store.layer_record_objects(&diff_id(9)).unwrap().len(), 1);
}

// ------------------------------------------------------------ incomplete images

/// An incomplete image (pulled with --lazy): its missing objects are not
/// problems, its lazy index must hash to what its record says, gc keeps
/// the objects it has and removes the index with the image.
#[test]
fn incomplete_images_in_fsck_and_gc() {
    let (_dir, store) = new_store();
    let (have, lack) = (content(1, 9_000), content(2, 7_000));
    let digest = add_image(&store, &[("have", &have), ("lack", &lack)]);
    // Make it incomplete: one object gone, a record with a lazy source.
    let gone = object_of(&lack);
    fs::remove_file(store.object_path(&gone)).unwrap();
    let index = b"an index blob".to_vec();
    store.write_lazy_index(&digest, &index).unwrap();
    add_record(&store, &digest, &[]);
    let mut record = store.image_record(&digest).unwrap().unwrap();
    record.lazy = Some(cairn_store::LazySource {
        registry: "127.0.0.1:5000".into(),
        repository: "x/y".into(),
        artifact_digest: format!("sha256:{}", "3".repeat(64)),
        artifact_manifest: "{}".into(),
        index_digest: format!(
            "sha256:{}",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&index))
        ),
        objects: 2,
        object_bytes: 16_000,
        estargz: false,
    });
    store.write_image_record(&record).unwrap();
    store.set_ref("lazy", &digest).unwrap();
    let report = store.fsck(&Default::default()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);

    // gc keeps it and the object it has.
    store.gc(&GcOptions::default()).unwrap();
    assert!(store.has_object(&object_of(&have)));
    assert!(store.lazy_index_path(&digest).is_file());

    // A lazy index that does not match its record is a problem.
    fs::write(store.lazy_index_path(&digest), b"something else").unwrap();
    let report = store.fsck(&Default::default()).unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| matches!(p, Problem::CorruptImageRecord { reason, .. } if reason.contains("lazy index"))),
        "{:?}",
        report.problems
    );

    // Unnamed, gc removes the image with its record and its index.
    store.remove_ref("lazy").unwrap();
    store.gc(&GcOptions::default()).unwrap();
    assert!(!store.has_image(&digest));
    assert!(!store.lazy_index_path(&digest).exists());
    assert!(!store.image_record_path(&digest).exists());
}
