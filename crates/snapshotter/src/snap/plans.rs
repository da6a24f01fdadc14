//! The two halves of the calls that run without the snapshotter's lock:
//! a Commit's import ([`CommitPlan`]) and a remote Prepare's pull
//! ([`RemotePlan`]), each begun and finished by a [`Snapshotter`] method
//! with the lock held, and the functions the server calls for them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cairn_store::Store;

use super::{SnapError, Snapshotter};
use crate::commit::{commit_dir, Committed};
use crate::meta::{Kind, LazyChain, Record};
use crate::proto;
use crate::remote::{self, RemoteRequest};

/// A commit's import, prepared by [`Snapshotter::begin_commit`].
pub struct CommitPlan {
    pub(super) store: Arc<Store>,
    pub(super) fs: PathBuf,
    pub(super) ref_name: String,
    pub(super) name: String,
    pub(super) key: String,
    pub(super) labels: HashMap<String, String>,
    pub(super) record: Record,
    pub(super) parent_chain: Vec<String>,
    /// The parent was committed from a lazy artifact: the store has no
    /// layer records for its chain until the image is pulled in full.
    pub(super) parent_lazy: Option<LazyChain>,
}

impl CommitPlan {
    /// Imports the snapshot's directory as a layer, assembles the chain
    /// image and points the snapshot's ref at it, under the store's shared
    /// lock from the first object to the ref (gc waits).
    pub fn run(&self) -> Result<Committed, SnapError> {
        let _lock = self
            .store
            .lock_shared()
            .map_err(|e| SnapError::Internal(format!("locking the store: {e}")))?;
        if let Some(lz) = self
            .parent_lazy
            .as_ref()
            .filter(|_| !has_layers(&self.store, &self.parent_chain))
        {
            tracing::info!(
                "commit of {:?} on a layer of {} pulled lazily: pulling the image in full \
                 for its layer records",
                self.key,
                lz.image_ref
            );
            remote::pull_full(&self.store, &lz.image_ref, &lz.manifest_digest).map_err(|e| {
                SnapError::Internal(format!(
                    "committing {:?} on a layer of {} pulled lazily: {e}",
                    self.key, lz.image_ref
                ))
            })?;
        }
        let c = commit_dir(&self.store, &self.fs, &self.parent_chain)
            .map_err(|e| SnapError::Internal(format!("committing {:?}: {e}", self.key)))?;
        self.store
            .set_ref(&self.ref_name, &c.image)
            .map_err(|e| SnapError::Internal(format!("ref {}: {e}", self.ref_name)))?;
        Ok(c)
    }
}

/// Whether the store has the layer record of every diff_id of `chain`.
pub(super) fn has_layers(store: &Store, chain: &[String]) -> bool {
    chain.iter().all(|d| cairn_image::has_layer(store, d))
}

pub(super) fn warn_fallback(req: &RemoteRequest, why: &str) {
    tracing::warn!(
        "remote snapshot {} ({} of {}): {why}; containerd fetches and unpacks it",
        req.target,
        req.layer_digest,
        req.image_ref
    );
}

/// A remote Prepare's pull, prepared by [`Snapshotter::begin_remote`].
pub struct RemotePlan {
    /// Try the image's lazy artifact first.
    pub(super) lazy: bool,
    /// The parent is an intermediate layer placed in a pulled image (lazily
    /// or in full): that whole image and its manifest digest, to place
    /// this layer in without a pull.
    pub(super) lazy_parent: Option<(String, String)>,
    /// The manifest this layer belongs to: containerd's
    /// `cri.manifest-digest`, or what the image ref resolved to in this
    /// pull. The layer is placed in `lazy_parent` only if it is the same.
    pub(super) manifest: Option<String>,
    pub(super) store: Arc<Store>,
    pub(super) req: RemoteRequest,
    pub(super) parent: String,
    pub(super) parent_chain: Vec<String>,
    pub(super) labels: HashMap<String, String>,
}

/// What a remote pull made; holds the store's shared lock until recorded.
pub struct RemoteDone {
    pub(super) pulled: remote::Pulled,
    pub(super) image: String,
    pub(super) size: u64,
    pub(super) entries: u64,
    pub(super) lazy: Option<LazyChain>,
    /// The image is incomplete (pulled lazily).
    pub(super) incomplete: bool,
    /// The image ref was resolved (a pull), not taken from a parent.
    pub(super) resolved: bool,
    pub(super) _lock: cairn_store::StoreLock,
}

impl RemotePlan {
    /// Pulls the image (lazily if it can, else in full) and places the
    /// layer in it, or places the layer in the image its parent was
    /// placed in, under the store's shared lock (kept in the result until
    /// the ref is written).
    pub fn run(&self) -> Result<RemoteDone, String> {
        let lock = self
            .store
            .lock_shared()
            .map_err(|e| format!("locking the store: {e}"))?;
        let what = || {
            format!(
                "remote snapshot {} ({} of {})",
                self.req.target, self.req.layer_digest, self.req.image_ref
            )
        };
        // A layer above one placed in a pulled image, of the same manifest:
        // placed in that image without a request. An incomplete image only
        // if this snapshotter can mount it.
        if let Some((image, manifest)) = &self.lazy_parent {
            let incomplete = self.incomplete(image);
            if self.manifest.as_ref() == Some(manifest) && (self.lazy || !incomplete) {
                match remote::place_layer(
                    &self.store,
                    image,
                    manifest,
                    &self.req,
                    &self.parent_chain,
                ) {
                    Ok(l) => return self.done(l, false, lock),
                    Err(why) => {
                        tracing::info!("{}: not placed in its parent's image: {why}", what())
                    }
                }
            }
        }
        if self.lazy {
            match remote::pull_layer_lazy(&self.store, &self.req, &self.parent_chain) {
                Ok(l) => return self.done(l, true, lock),
                Err(why) => tracing::info!("{}: not lazily: {why}; pulling it in full", what()),
            }
        }
        let l = remote::pull_layer(&self.store, &self.req, &self.parent_chain)?;
        self.done(l, true, lock)
    }

    fn incomplete(&self, image: &str) -> bool {
        super::image_incomplete(&self.store, image)
    }

    /// The layer placed in the whole image `l.image`: the top layer's
    /// snapshot names that image (its chain's tree); a layer below it names
    /// it too, marked `partial` (its own chain image is assembled only if
    /// something mounts it, see [`Snapshotter::materialize`]).
    fn done(
        &self,
        l: remote::LazyPulled,
        resolved: bool,
        lock: cairn_store::StoreLock,
    ) -> Result<RemoteDone, String> {
        let incomplete = self.incomplete(&l.image);
        let (size, entries) = if incomplete {
            if l.top {
                (l.object_bytes, l.objects)
            } else {
                (0, 0)
            }
        } else {
            let rec = self
                .store
                .layer_record(&l.diff_id)
                .map_err(|e| format!("reading layer {}: {e}", l.diff_id))?
                .ok_or_else(|| format!("layer {} is not in the store", l.diff_id))?;
            (rec.size, rec.entries)
        };
        let lazy = (incomplete || !l.top).then(|| LazyChain {
            image_ref: self.req.image_ref.clone(),
            manifest_digest: l.manifest_digest.clone(),
            partial: !l.top,
        });
        Ok(RemoteDone {
            pulled: remote::Pulled {
                diff_id: l.diff_id,
                chain: l.chain,
            },
            size,
            entries,
            lazy,
            incomplete,
            image: l.image,
            resolved,
            _lock: lock,
        })
    }
}

/// Prepare as the server runs it: a remote pull runs without the
/// snapshotter's lock, so that other calls go on meanwhile. The top layer
/// of an image pulled lazily has its chain mounted on a thread of its own
/// once Prepare has answered (see [`mount_in_background`]).
pub fn prepare(
    s: &Arc<Mutex<Snapshotter>>,
    key: &str,
    parent: &str,
    labels: HashMap<String, String>,
) -> Result<Vec<proto::Mount>, SnapError> {
    let lock = || s.lock().unwrap_or_else(|p| p.into_inner());
    let plan = lock().begin_remote(key, parent, &labels)?;
    if let Some(plan) = plan {
        let done = plan.run();
        let incomplete_top = done
            .as_ref()
            .ok()
            .filter(|d| d.incomplete && d.lazy.as_ref().is_some_and(|l| !l.partial))
            .map(|d| d.image.clone());
        let r = lock().finish_remote(plan, done);
        if let (Err(SnapError::AlreadyExists(_)), Some(img)) = (&r, incomplete_top) {
            mount_in_background(s, img);
        }
        r?;
    }
    lock().create(Kind::Active, key, parent, labels)
}

/// Mounts the incomplete chain image `img` (just pulled lazily, its top
/// layer committed) on a thread of its own, without the snapshotter's
/// lock: its lazy server starts and fetches the prefetch list while
/// containerd ends the pull, and the first container's Prepare finds the
/// chain mounted (or waits for the mount under way) instead of starting
/// the server itself (docs/snapshotter.md, "The lazy remote path").
fn mount_in_background(s: &Arc<Mutex<Snapshotter>>, img: String) {
    let s = s.clone();
    let name = img.clone();
    let spawned = std::thread::Builder::new()
        .name("cairn-chain-mount".into())
        .spawn(move || {
            let lock = || s.lock().unwrap_or_else(|p| p.into_inner());
            let Some(m) = lock().begin_background_mount(&img) else {
                return;
            };
            let r = m.run();
            lock().finish_background_mount(m, r);
        });
    if let Err(e) = spawned {
        tracing::warn!(
            "chain image {name}: not mounted ahead of its first container: starting a thread: {e}"
        );
    }
}

/// Commit as the server runs it: checked and recorded with the
/// snapshotter locked, imported without the lock, so that other calls
/// (another image's commit included) go on meanwhile.
pub fn commit(
    s: &Mutex<Snapshotter>,
    name: &str,
    key: &str,
    labels: HashMap<String, String>,
) -> Result<(), SnapError> {
    let lock = || s.lock().unwrap_or_else(|p| p.into_inner());
    let plan = lock().begin_commit(name, key, labels)?;
    let done = plan.run();
    lock().finish_commit(plan, done)
}
