//! The layers of one local image imported at once, as a registry pull
//! imports them (`cairn pull --jobs`): each layer is its own pipeline
//! (decompression thread, object workers), so an image of several layers
//! keeps more of the machine busy than its layers one after another.
//!
//! The first layer that fails stops the others: their readers return an
//! error at their next read, their imports publish nothing (an import
//! publishes its objects and record only once its stream is verified),
//! and that first error is the one the caller sees. Layers that finished
//! before it stay in the store, as after a failed pull; a retry finds
//! them in the layer cache.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use cairn_store::Store;

use crate::assemble::StagedImage;
use crate::early::{build_tree_as_imported, BuiltTree};
use crate::layer::{CheckedLayer, LayerInfo, LayerWatch};
use crate::LayerError;

/// Layers imported at once when the caller does not say (`cairn pull`'s
/// default `--jobs`).
pub const DEFAULT_LAYER_JOBS: usize = 3;

/// A reader that fails once `cancel` is set.
pub(crate) struct Cancellable<'a, R> {
    inner: R,
    cancel: &'a AtomicBool,
}

impl<'a, R> Cancellable<'a, R> {
    pub(crate) fn new(inner: R, cancel: &'a AtomicBool) -> Self {
        Cancellable { inner, cancel }
    }
}

impl<R: Read> Read for Cancellable<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.cancel.load(Ordering::Relaxed) {
            // Not `Interrupted`: readers retry that.
            return Err(io::Error::other(
                "stopped: another layer of the image, or its tree, failed",
            ));
        }
        self.inner.read(buf)
    }
}

/// Runs `import(i, cancel)` for `i` in `0..count`, `jobs` at a time (at
/// least one), and returns their results in order. `import` returns
/// `None` for a layer it did not import (in the cache, or a repeat of an
/// earlier layer of the image) and reads its blob through a
/// [`Cancellable`] on `cancel`. The first error stops the rest and is the
/// one returned.
pub(crate) fn import_each<F>(
    count: usize,
    jobs: usize,
    import: F,
) -> Result<Vec<Option<LayerInfo>>, LayerError>
where
    F: Fn(usize, &AtomicBool) -> Result<Option<LayerInfo>, LayerError> + Sync,
{
    import_each_until(count, jobs, &AtomicBool::new(false), import)
}

/// [`import_each`] with a cancel flag the caller may set too: once it is
/// set from outside, every import stops, and the result is
/// [`LayerError::Stopped`] (what set it has the error to report).
pub(crate) fn import_each_until<F>(
    count: usize,
    jobs: usize,
    cancel: &AtomicBool,
    import: F,
) -> Result<Vec<Option<LayerInfo>>, LayerError>
where
    F: Fn(usize, &AtomicBool) -> Result<Option<LayerInfo>, LayerError> + Sync,
{
    let results: Vec<Mutex<Option<LayerInfo>>> = (0..count).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<LayerError>> = Mutex::new(None);
    let worker = || {
        while !cancel.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count {
                break;
            }
            match import(i, cancel) {
                Ok(info) => *results[i].lock().unwrap_or_else(|p| p.into_inner()) = info,
                Err(e) => {
                    // Whoever stops the others first has the error that
                    // matters; the ones it stopped fail with "stopped".
                    if !cancel.swap(true, Ordering::Relaxed) {
                        *first_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                    break;
                }
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..jobs.clamp(1, count.max(1)) {
            s.spawn(worker);
        }
        worker();
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if cancel.load(Ordering::Relaxed) {
        return Err(LayerError::Stopped {
            layer: format!("1 to {count} of the image"),
            reason: "stopped from outside the import",
        });
    }
    Ok(results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect())
}

/// The tree [`import_each_staged`] built, and the stream size of each
/// layer whose import reported one.
pub(crate) type TreeAndSizes = (BuiltTree, Vec<Option<u64>>);

/// [`import_each`], and the image's tree built as the layers are imported
/// ([`crate::build_tree_as_imported`], on the calling thread), then staged
/// with `stage` while the last layers are still published. `import(i,
/// cancel, watch)` imports layer `i` with `watch` as
/// [`crate::import_layer_with`]'s, or returns `None` for a layer it does
/// not import (its record is read from the store). `stage` gets the tree
/// and each layer's stream size where the import reported one; without
/// `overlap` (a layer imported now is in the image twice, and the image
/// reads it from its record), it gets `None` after the last import and
/// builds the image from the records. An import that fails after its
/// lines were applied fails the whole: the tree (or the staged image) is
/// dropped and publishes nothing.
pub(crate) fn import_each_staged<'s, F>(
    store: &Store,
    diff_ids: &[String],
    jobs: usize,
    overlap: bool,
    import: F,
    stage: &mut dyn FnMut(Option<TreeAndSizes>) -> Result<StagedImage<'s>, LayerError>,
) -> Result<(Vec<Option<LayerInfo>>, StagedImage<'s>), LayerError>
where
    F: Fn(usize, &AtomicBool, &mut dyn LayerWatch) -> Result<Option<LayerInfo>, LayerError> + Sync,
{
    let count = diff_ids.len();
    if !overlap {
        let infos = import_each(count, jobs, |i, cancel| {
            import(i, cancel, &mut |_: CheckedLayer| {})
        })?;
        return Ok((infos, stage(None)?));
    }
    let (feeds, reports, mut ends) = crate::early::reports(&vec![true; count]);
    let (infos, staged) = std::thread::scope(|s| {
        // The reports (the taps and their channel) go with the importer:
        // once it has ended, the tree below stops waiting for them.
        let import = &import;
        let importer = s.spawn(move || {
            let reports = reports;
            import_each_until(count, jobs, reports.stop(), |i, cancel| {
                reports.import(i, |watch| import(i, cancel, watch))
            })
        });
        let built = build_tree_as_imported(store, diff_ids, feeds, &mut |i| ends.end(i));
        let staged = built.and_then(|tree| stage(Some((tree, ends.sizes().to_vec()))));
        if staged.is_err() {
            // No image will be written: the imports need not run on.
            ends.stop();
        }
        let infos = importer
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (infos, staged)
    });
    match (infos, staged) {
        (Ok(infos), Ok(staged)) => Ok((infos, staged)),
        // The tree (or the image) failed first and stopped the imports.
        (Ok(_) | Err(LayerError::Stopped { .. }), Err(e)) => Err(e),
        // An import's own error says more than the tree's "stopped".
        (Err(e), _) => Err(e),
    }
}

/// For each layer, whether it is the first of the image with its diff_id
/// (a repeat is imported once).
pub(crate) fn first_of_each<S: AsRef<str>>(diff_ids: &[S]) -> Vec<bool> {
    let mut seen = std::collections::HashSet::new();
    diff_ids.iter().map(|d| seen.insert(d.as_ref())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(n: u64) -> LayerInfo {
        LayerInfo {
            diff_id: format!("sha256:{n:064x}"),
            blob_digest: None,
            entries: 0,
            size: n,
            compressed_size: 0,
            cached: false,
        }
    }

    #[test]
    fn results_come_back_in_order_whatever_the_jobs() {
        for jobs in [0, 1, 2, 3, 8] {
            let r = import_each(5, jobs, |i, _| Ok((i % 2 == 0).then(|| info(i as u64)))).unwrap();
            let sizes: Vec<Option<u64>> = r.iter().map(|o| o.as_ref().map(|i| i.size)).collect();
            assert_eq!(
                sizes,
                vec![Some(0), None, Some(2), None, Some(4)],
                "jobs {jobs}"
            );
        }
        assert!(import_each(0, 3, |_, _| unreachable!()).unwrap().is_empty());
    }

    #[test]
    fn the_first_failure_stops_the_others_and_is_returned() {
        let started = AtomicUsize::new(0);
        let e = import_each(50, 2, |i, cancel| {
            started.fetch_add(1, Ordering::Relaxed);
            if i == 1 {
                return Err(LayerError::Invalid {
                    layer: "one".into(),
                    reason: "bad".into(),
                });
            }
            // A long layer: reads until it is stopped.
            let mut r = Cancellable::new(io::repeat(0), cancel);
            let mut buf = [0u8; 16];
            loop {
                if let Err(e) = r.read(&mut buf) {
                    return Err(LayerError::Read {
                        layer: format!("{i}"),
                        source: e,
                    });
                }
            }
        })
        .unwrap_err();
        assert!(
            matches!(&e, LayerError::Invalid { layer, .. } if layer == "one"),
            "{e}"
        );
        assert!(started.load(Ordering::Relaxed) <= 3);
    }

    /// The tree fails on the first line a layer's tap sends (a corrupt
    /// record line): the imports are stopped, and the tree's error is the
    /// one returned. Without the stop, the import below would read on
    /// for ten seconds and then succeed. The second layer's import may
    /// never start (its thread can find the imports stopped before it
    /// takes a layer); if it did, it was stopped too.
    #[test]
    fn a_tree_that_fails_stops_the_imports_and_its_error_is_returned() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(d.path()).unwrap();
        let diff_ids = vec![format!("sha256:{:064x}", 1), format!("sha256:{:064x}", 2)];
        let started = [AtomicBool::new(false), AtomicBool::new(false)];
        let stopped = [AtomicBool::new(false), AtomicBool::new(false)];
        let e = import_each_staged(
            &store,
            &diff_ids,
            2,
            true,
            |i, cancel, watch| {
                started[i].store(true, Ordering::Relaxed);
                if i == 0 {
                    let mut tap = watch.tap().expect("a tap for every layer");
                    assert!(tap.send(b"not a record line\n"));
                }
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                let mut r = Cancellable::new(io::repeat(0), cancel);
                let mut buf = [0u8; 4096];
                while std::time::Instant::now() < deadline {
                    if let Err(e) = r.read(&mut buf) {
                        stopped[i].store(true, Ordering::Relaxed);
                        return Err(LayerError::Read {
                            layer: format!("{i}"),
                            source: e,
                        });
                    }
                }
                Ok(Some(info(i as u64)))
            },
            &mut |_| unreachable!("the tree failed: nothing to stage"),
        )
        .map(|_| ())
        .unwrap_err();
        assert!(
            matches!(&e, LayerError::Apply { layer, reason, .. }
                if layer == &diff_ids[0] && reason.contains("corrupt layer record")),
            "{e}"
        );
        assert!(
            stopped[0].load(Ordering::Relaxed),
            "the failing layer's import was stopped"
        );
        for (i, (started, stopped)) in started.iter().zip(&stopped).enumerate() {
            assert_eq!(
                started.load(Ordering::Relaxed),
                stopped.load(Ordering::Relaxed),
                "layer {i}: an import that started was stopped"
            );
        }
    }

    #[test]
    fn repeats_of_a_diff_id_are_imported_once() {
        assert_eq!(
            first_of_each(&["a", "b", "a", "c", "b"]),
            vec![true, true, false, true, false]
        );
    }
}
