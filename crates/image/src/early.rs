//! An image's tree built while its layers are imported.
//!
//! Each layer being imported sends the record lines it writes through a
//! [`LineTap`] (about 1 MiB at a time), and [`build_tree_as_imported`]
//! applies them, bottom layer first, as they arrive. A layer above one
//! that is still being applied keeps its lines in its tap. The taps of one
//! image together hold at most [`TAP_BUDGET`] bytes: a tap that would go
//! over it, or whose channel is full, stops sending, and the lines it did
//! not send are read from the layer's entries file, from where the tap
//! stopped, once the layer is checked. So what is held in memory is
//! bounded whatever the number and size of the layers, and the tree is
//! the one the entries files make, byte for byte.
//!
//! Nothing in the tree counts until every layer fed this way is checked
//! (its stream read to the end and both digests matched): a layer that
//! fails later sends lines too, and the tree is then dropped.
//!
//! The pieces, as `cairn pull` and the OCI layout and docker archive
//! imports use them: [`reports`] makes the taps and the channels for one
//! image; each import runs through [`Reports::import`], which hands its
//! layer's tap and the report of its end to
//! [`crate::import_layer_with`]; the importing caller builds the tree with
//! [`build_tree_as_imported`] and [`Ends::end`], and writes the image with
//! [`crate::StagedImage::from_tree`].

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};

use cairn_erofs::Tree;
use cairn_store::Store;

use crate::apply::{apply_layer, compact, empty_image};
use crate::layer::{CheckedLayer, LayerWatch};
use crate::LayerError;

/// Bytes of record lines the taps of one image hold at most, together.
pub const TAP_BUDGET: usize = 32 << 20;

/// Chunks one tap's channel holds at most (the budget is the real bound).
const TAP_CHUNKS: usize = 64;

/// Bytes held in the taps of one image.
#[derive(Debug)]
struct Budget {
    used: AtomicUsize,
    limit: usize,
}

/// A chunk of whole record lines sent through a [`LineTap`]. Its bytes
/// count against the taps' budget until it is dropped.
#[derive(Debug)]
pub struct TapChunk {
    bytes: Vec<u8>,
    budget: Arc<Budget>,
}

impl Drop for TapChunk {
    fn drop(&mut self) {
        self.budget
            .used
            .fetch_sub(self.bytes.len(), Ordering::Relaxed);
    }
}

/// The entry lines of a layer being imported, as they are written to its
/// record; see the module docs. Best effort: the first chunk that finds
/// the channel full or gone, or the taps' budget spent, ends the tap (it
/// drops its sender, so the receiver sees the channel close).
#[derive(Debug)]
pub struct LineTap {
    tx: Option<SyncSender<TapChunk>>,
    budget: Arc<Budget>,
}

impl LineTap {
    /// Sends `lines` (whole lines, the next ones of the record); says
    /// whether they went. Once they did not, nothing more goes.
    pub fn send(&mut self, lines: &[u8]) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        let n = lines.len();
        let before = self.budget.used.fetch_add(n, Ordering::Relaxed);
        let chunk = TapChunk {
            bytes: lines.to_vec(),
            budget: Arc::clone(&self.budget),
        };
        // A refused chunk is dropped here, and gives its bytes back.
        if before + n > self.budget.limit || tx.try_send(chunk).is_err() {
            self.tx = None;
            return false;
        }
        true
    }
}

/// Where a layer's entries come from for [`build_tree_as_imported`].
pub enum LayerFeed {
    /// Its record in the store.
    Store,
    /// Being imported: the receiving end of its [`LineTap`].
    Lines(Receiver<TapChunk>),
}

/// What [`build_tree_as_imported`] learns of a layer fed by
/// [`LayerFeed::Lines`] once its tap has closed.
pub enum LayerEnd {
    /// Checked: its entries file ([`CheckedLayer::entries`]).
    Checked(File),
    /// In the store already: its import wrote no line and no record.
    InStore,
    /// Its import failed.
    Failed,
}

/// Makes the feeds of an image's layers and the taps that fill them: for
/// each layer with `imported[i]`, a [`LayerFeed::Lines`] and its tap (the
/// taps share one budget, [`TAP_BUDGET`]); for the others,
/// [`LayerFeed::Store`] and no tap.
pub fn taps(imported: &[bool]) -> (Vec<LayerFeed>, Vec<Option<LineTap>>) {
    taps_with_budget(imported, TAP_BUDGET)
}

fn taps_with_budget(imported: &[bool], limit: usize) -> (Vec<LayerFeed>, Vec<Option<LineTap>>) {
    let budget = Arc::new(Budget {
        used: AtomicUsize::new(0),
        limit,
    });
    imported
        .iter()
        .map(|&imported| {
            if !imported {
                return (LayerFeed::Store, None);
            }
            let (tx, rx) = mpsc::sync_channel(TAP_CHUNKS);
            let tap = LineTap {
                tx: Some(tx),
                budget: Arc::clone(&budget),
            };
            (LayerFeed::Lines(rx), Some(tap))
        })
        .unzip()
}

/// The importing side of an image's layers: each import takes its tap
/// here and reports how it ended. Once it is dropped (with the thread
/// that imports), every layer not reported counts as failed. Its
/// [`Reports::stop`] flag is the imports' cancel flag: [`Ends::stop`]
/// sets it when the tree fails, so that the imports do not run on for an
/// image that will not be written.
pub struct Reports {
    taps: Vec<Mutex<Option<LineTap>>>,
    tx: Sender<(usize, Option<CheckedLayer>)>,
    stop: Arc<AtomicBool>,
}

/// The tree's side of [`Reports`]: how each layer's import ended.
pub struct Ends {
    rx: Receiver<(usize, Option<CheckedLayer>)>,
    reported: Vec<Option<Option<CheckedLayer>>>,
    sizes: Vec<Option<u64>>,
    stop: Arc<AtomicBool>,
}

/// The feeds, reports and ends of an image whose layers with
/// `imported[i]` are imported now ([`taps`]).
pub fn reports(imported: &[bool]) -> (Vec<LayerFeed>, Reports, Ends) {
    let (feeds, taps) = taps(imported);
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let reports = Reports {
        taps: taps.into_iter().map(Mutex::new).collect(),
        tx,
        stop: Arc::clone(&stop),
    };
    let ends = Ends {
        rx,
        reported: imported.iter().map(|_| None).collect(),
        sizes: vec![None; imported.len()],
        stop,
    };
    (feeds, reports, ends)
}

impl Reports {
    /// The imports' cancel flag (set by [`Ends::stop`]); the importer
    /// stops every import once it is set, as after a failed layer.
    pub fn stop(&self) -> &AtomicBool {
        &self.stop
    }

    /// Runs `import` for layer `index` with a [`LayerWatch`] that gives it
    /// the layer's tap and reports the checked layer; an import that
    /// returns `Ok` without having checked one (the store had the layer)
    /// is reported as [`LayerEnd::InStore`], one that fails not at all.
    pub fn import<T, E>(
        &self,
        index: usize,
        import: impl FnOnce(&mut dyn LayerWatch) -> Result<T, E>,
    ) -> Result<T, E> {
        let tap = self
            .taps
            .get(index)
            .and_then(|t| t.lock().unwrap_or_else(|p| p.into_inner()).take());
        let mut watch = Watch {
            index,
            tap,
            tx: &self.tx,
            sent: false,
        };
        let result = import(&mut watch);
        if result.is_ok() && !watch.sent {
            // The receiver may be gone (its tree failed): nothing to do.
            let _ = self.tx.send((index, None));
        }
        result
    }
}

/// One layer's [`LayerWatch`] in [`Reports::import`]. Dropped, it drops
/// the tap if the import never took it.
struct Watch<'a> {
    index: usize,
    tap: Option<LineTap>,
    tx: &'a Sender<(usize, Option<CheckedLayer>)>,
    sent: bool,
}

impl LayerWatch for Watch<'_> {
    fn tap(&mut self) -> Option<LineTap> {
        self.tap.take()
    }

    fn checked(&mut self, layer: CheckedLayer) {
        let _ = self.tx.send((self.index, Some(layer)));
        self.sent = true;
    }
}

impl Ends {
    /// Waits until layer `index`'s import has ended, and says how.
    pub fn end(&mut self, index: usize) -> LayerEnd {
        loop {
            if let Some(layer) = self.reported.get_mut(index).and_then(Option::take) {
                return match layer {
                    Some(l) => {
                        self.sizes[index] = Some(l.size);
                        LayerEnd::Checked(l.entries)
                    }
                    None => LayerEnd::InStore,
                };
            }
            match self.rx.recv() {
                Ok((i, layer)) if i < self.reported.len() => self.reported[i] = Some(layer),
                Ok(_) => {}
                Err(_) => return LayerEnd::Failed,
            }
        }
    }

    /// The stream size of each layer whose checked end was taken.
    pub fn sizes(&self) -> &[Option<u64>] {
        &self.sizes
    }

    /// Stops the imports (their [`Reports::stop`] flag): the tree or the
    /// image failed, and nothing they still do would be used.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// An image's tree, built while its layers were imported; see
/// [`build_tree_as_imported`].
pub struct BuiltTree {
    pub(crate) tree: Tree,
    pub(crate) diff_ids: Vec<String>,
    /// Some layer was read from its record in the store.
    pub(crate) from_store: bool,
}

/// Builds the tree of an image whose layers are being imported, while
/// they are: each layer's lines are applied as its import writes them,
/// bottom first (see the module docs). `end(i)` waits until layer `i`'s
/// import has ended ([`Ends::end`]); it is asked once per layer fed by
/// lines, once its tap has closed. The tree is final once every such layer
/// is checked; hand it to [`crate::StagedImage::from_tree`].
///
/// The caller holds [`Store::lock_shared`], as for any import: the
/// records of layers in the store are read here.
pub fn build_tree_as_imported(
    store: &Store,
    diff_ids: &[String],
    mut feeds: Vec<LayerFeed>,
    end: &mut dyn FnMut(usize) -> LayerEnd,
) -> Result<BuiltTree, LayerError> {
    let started = std::time::Instant::now();
    let mut image = empty_image();
    let mut from_store = false;
    for (i, diff_id) in diff_ids.iter().enumerate() {
        let feed = feeds
            .get_mut(i)
            .map(|f| std::mem::replace(f, LayerFeed::Store));
        match feed {
            Some(LayerFeed::Lines(rx)) => {
                let mut unchecked = false;
                let fed = FedLines {
                    rx: Some(rx),
                    chunk: None,
                    pos: 0,
                    got: 0,
                    rest: None,
                    end: &mut || end(i),
                    store,
                    diff_id,
                    from_store: &mut from_store,
                    unchecked: &mut unchecked,
                };
                let applied = apply_layer(
                    &mut image,
                    BufReader::with_capacity(64 * 1024, fed),
                    diff_id,
                );
                if unchecked {
                    // Not a fault of the lines: say so, rather than
                    // "corrupt layer record" (the import's error says why).
                    return Err(LayerError::Stopped {
                        layer: diff_id.clone(),
                        reason: "its import ended before the layer was checked",
                    });
                }
                applied?;
            }
            _ => {
                from_store = true;
                apply_layer(&mut image, open_record(store, diff_id)?, diff_id)?;
            }
        }
    }
    let tree = compact(image);
    tracing::debug!(
        "image: {} inodes from {} layers, the last applied {:?} after the start",
        tree.inodes.len(),
        diff_ids.len(),
        started.elapsed()
    );
    Ok(BuiltTree {
        tree,
        diff_ids: diff_ids.to_vec(),
        from_store,
    })
}

/// A layer's record in the store, to read.
fn open_record(store: &Store, diff_id: &str) -> Result<BufReader<File>, LayerError> {
    let path = store.layer_entries_path(diff_id);
    let file = File::open(&path).map_err(|e| LayerError::Apply {
        layer: diff_id.to_owned(),
        path: path.display().to_string(),
        reason: format!("opening the layer record: {e}"),
    })?;
    Ok(BufReader::with_capacity(1 << 20, file))
}

/// A layer's entry lines: those its tap sends, then the rest of its
/// entries file, from where the tap stopped.
struct FedLines<'a> {
    rx: Option<Receiver<TapChunk>>,
    /// The chunk being read (its bytes count against the budget).
    chunk: Option<TapChunk>,
    pos: usize,
    /// Bytes the tap sent.
    got: u64,
    rest: Option<BufReader<File>>,
    end: &'a mut dyn FnMut() -> LayerEnd,
    store: &'a Store,
    diff_id: &'a str,
    from_store: &'a mut bool,
    /// Set when the import ended without checking the layer.
    unchecked: &'a mut bool,
}

impl Read for FedLines<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(chunk) = &self.chunk {
                if self.pos < chunk.bytes.len() {
                    let n = out.len().min(chunk.bytes.len() - self.pos);
                    out[..n].copy_from_slice(&chunk.bytes[self.pos..self.pos + n]);
                    self.pos += n;
                    return Ok(n);
                }
                self.chunk = None;
            }
            if let Some(rest) = &mut self.rest {
                return rest.read(out);
            }
            if let Some(rx) = &self.rx {
                if let Ok(chunk) = rx.recv() {
                    self.got += chunk.bytes.len() as u64;
                    self.chunk = Some(chunk);
                    self.pos = 0;
                    continue;
                }
                self.rx = None;
            }
            // The tap is closed: the rest is in the entries file.
            let mut file = match (self.end)() {
                LayerEnd::Checked(file) => file,
                LayerEnd::InStore if self.got == 0 => {
                    *self.from_store = true;
                    let path = self.store.layer_entries_path(self.diff_id);
                    File::open(&path).map_err(|e| {
                        io::Error::new(
                            e.kind(),
                            format!("opening the layer record {}: {e}", path.display()),
                        )
                    })?
                }
                LayerEnd::InStore => {
                    return Err(io::Error::other(
                        "the layer's import sent lines, then found its record in the store",
                    ))
                }
                LayerEnd::Failed => {
                    *self.unchecked = true;
                    return Err(io::Error::other("the layer's import failed"));
                }
            };
            file.seek(SeekFrom::Start(self.got))?;
            self.rest = Some(BufReader::with_capacity(1 << 20, file));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn record() -> Vec<u8> {
        (0..10_000u32)
            .flat_map(|i| format!("/line{i} 100644\n").into_bytes())
            .collect()
    }

    /// Reads a layer's lines as [`build_tree_as_imported`] does: what a
    /// tap sent of `record` in chunks of `chunk` bytes (with room for
    /// `room` chunks and a budget of `budget` bytes), then the rest of the
    /// entries file.
    fn fed(store: &Store, record: &[u8], chunk: usize, room: usize, budget: usize) -> Vec<u8> {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(record).unwrap();
        let (feeds, mut taps) = taps_with_budget(&[true], budget);
        let (rx, mut tap) = match (feeds.into_iter().next(), taps.pop()) {
            (Some(LayerFeed::Lines(rx)), Some(Some(tap))) => (rx, tap),
            _ => unreachable!("one tap"),
        };
        let (small_tx, small_rx) = mpsc::sync_channel(room);
        tap.tx = Some(small_tx);
        drop(rx);
        let mut went = 0;
        let mut stopped = false;
        for c in record.chunks(chunk) {
            if !tap.send(c) {
                stopped = true;
                break;
            }
            went += 1;
        }
        if stopped {
            // Once a chunk did not go, none does.
            assert!(!tap.send(b"/x 100644\n"), "the tap ended");
        }
        assert_eq!(small_rx.try_iter().count(), went, "chunks in the channel");
        drop(tap);
        // Sent again for the reader: the same chunks the tap let through.
        let (tx, rx) = mpsc::sync_channel(went.max(1));
        let budget = Arc::new(Budget {
            used: AtomicUsize::new(0),
            limit: usize::MAX,
        });
        for c in record.chunks(chunk).take(went) {
            tx.send(TapChunk {
                bytes: c.to_vec(),
                budget: Arc::clone(&budget),
            })
            .unwrap();
        }
        drop(tx);
        let mut from_store = false;
        let mut unchecked = false;
        let mut file = Some(file);
        let mut lines = FedLines {
            rx: Some(rx),
            chunk: None,
            pos: 0,
            got: 0,
            rest: None,
            end: &mut || LayerEnd::Checked(file.take().expect("asked once")),
            store,
            diff_id: "sha256:0",
            from_store: &mut from_store,
            unchecked: &mut unchecked,
        };
        let mut out = Vec::new();
        lines.read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn a_layers_lines_are_the_taps_then_the_rest_of_its_entries() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(d.path()).unwrap();
        let record = record();
        // (chunk size, chunks the channel holds, budget in bytes)
        for (chunk, room, budget) in [
            (4096, 0, usize::MAX),
            (4096, 1, usize::MAX),
            (4096, 3, usize::MAX),
            (4096, 1000, usize::MAX),
            (4096, 1000, 3 * 4096),
            (1, 7, usize::MAX),
            (record.len(), 1, usize::MAX),
        ] {
            assert!(
                fed(&store, &record, chunk, room, budget) == record,
                "chunks of {chunk}, room for {room}, budget {budget}"
            );
        }
    }

    #[test]
    fn the_taps_of_an_image_share_one_budget() {
        let (feeds, taps) = taps_with_budget(&[true, false, true], 10);
        assert!(matches!(feeds[1], LayerFeed::Store));
        let mut taps: Vec<LineTap> = taps.into_iter().flatten().collect();
        assert_eq!(taps.len(), 2);
        assert!(taps[0].send(b"123456\n"));
        // 7 bytes held: 4 more would pass the budget of 10.
        assert!(!taps[1].send(b"abc\n"));
        assert!(!taps[1].send(b"\n"), "a tap that gave up stays closed");
        // The chunk taken and dropped gives its bytes back.
        let LayerFeed::Lines(rx) = &feeds[0] else {
            unreachable!()
        };
        let chunk = rx.try_recv().unwrap();
        assert_eq!(chunk.budget.used.load(Ordering::Relaxed), 7);
        drop(chunk);
        assert!(taps[0].send(b"abcdefghi\n"));
    }
}
