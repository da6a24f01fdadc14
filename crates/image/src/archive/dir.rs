//! A directory imported as a one-layer image: scanned like `cairn mkfs`,
//! written as one tar stream through a channel to the importer (in memory,
//! never on disk), with a minimal config for the host.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::mpsc;

use cairn_spec::media_type as mt;
use cairn_spec::platform::PlatformSpec;
use cairn_spec::sha256_digest;
use cairn_store::Store;
use serde_json::json;

use super::{archive_err, mark_fresh, ImportOptions};
use crate::assemble::{now_rfc3339, ImportedImage, StagedImage};
use crate::export::TarContents;
use crate::layer::{import_layer_with, CheckedLayer};
use crate::scan::{scan_dir, ScanOptions};
use crate::LayerError;

/// A `Read` fed by another thread through a channel.
struct ChannelReader {
    rx: mpsc::Receiver<io::Result<Vec<u8>>>,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            match self.rx.recv() {
                Ok(Ok(chunk)) => {
                    self.buf = chunk;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The writing end of a [`ChannelReader`].
struct ChannelWriter {
    tx: mpsc::SyncSender<io::Result<Vec<u8>>>,
    buf: Vec<u8>,
}

const CHANNEL_CHUNK: usize = 256 * 1024;

impl io::Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHANNEL_CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHANNEL_CHUNK));
        self.tx
            .send(Ok(chunk))
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))
    }
}

/// Imports the directory at `dir` as a one-layer image. The default name
/// is the directory's name.
pub fn import_dir(
    store: &Store,
    dir: &Path,
    opts: &ImportOptions,
) -> Result<ImportedImage, LayerError> {
    let what = format!("dir:{}", dir.display());
    // Held from the first layer to the ref, so gc never takes a layer
    // between its import and the image that needs it.
    let _lock = store
        .lock_shared()
        .map_err(LayerError::store("locking the store"))?;

    // One pass: the scan reads metadata only; the tar writer reads each
    // file from the directory and the importer digests and stores it, as
    // the snapshotter's commit does (`write_tar_from` checks each file
    // against the scan, beneath the directory, following no symlink).
    let scan = ScanOptions {
        metadata_only: true,
        ..ScanOptions::default()
    };
    let (tree, _) = scan_dir(dir, &scan).map_err(|e| archive_err(&what, e))?;
    let name = opts.name.clone().or_else(|| {
        dir.canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    });
    let platform = PlatformSpec::host();
    let stage = |diff_id: &str, size: u64, entries: Option<File>| {
        let mut config = json!({
            "created": now_rfc3339(),
            "architecture": platform.architecture,
            "os": platform.os,
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": format!("cairn import {what}")}],
        });
        if let Some(v) = &platform.variant {
            config["variant"] = json!(v);
        }
        let config = serde_json::to_vec(&config).expect("JSON values serialise");
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": mt::OCI_MANIFEST,
            "config": {
                "mediaType": mt::OCI_CONFIG,
                "digest": sha256_digest(&config),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": mt::OCI_LAYER_TAR,
                "digest": diff_id,
                "size": size,
            }],
        }))
        .expect("JSON values serialise");
        StagedImage::stage(
            store,
            &manifest,
            &config,
            name.as_deref(),
            Some(&what),
            vec![entries],
        )
    };
    let (tx, rx) = mpsc::sync_channel(4);
    let (checked_tx, checked_rx) = mpsc::channel::<CheckedLayer>();
    let (info, staged) = std::thread::scope(|s| {
        let tree = &tree;
        // The image is written on its own thread while the layer's last
        // objects and its record are published, as a pull writes it.
        let stage = &stage;
        let stager = s.spawn(move || {
            checked_rx
                .recv()
                .ok()
                .map(|l| stage(&l.diff_id, l.size, Some(l.entries)))
        });
        s.spawn(move || {
            let mut w = ChannelWriter {
                tx: tx.clone(),
                buf: Vec::with_capacity(CHANNEL_CHUNK),
            };
            let r = crate::export::write_tar_from(tree, TarContents::Dir(dir), &mut w)
                .and_then(|_| io::Write::flush(&mut w));
            if let Err(e) = r {
                let _ = tx.send(Err(e));
            }
        });
        let reader = ChannelReader {
            rx,
            buf: Vec::new(),
            pos: 0,
        };
        let info = import_layer_with(
            store,
            reader,
            Some(mt::OCI_LAYER_TAR),
            None,
            None,
            &opts.limits,
            &mut |layer: CheckedLayer| {
                // The receiver is there until this send or the end.
                let _ = checked_tx.send(layer);
            },
        );
        drop(checked_tx);
        let staged = stager
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (info, staged)
    });
    let info = info?;
    let staged = match staged {
        Some(staged) => staged?,
        None => stage(&info.diff_id, info.size, None)?,
    };
    let mut result = staged.publish()?;
    mark_fresh(&mut result.layers, &[Some(info)]);
    result.name = name;
    Ok(result)
}
