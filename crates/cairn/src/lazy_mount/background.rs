//! What the lazy layer's server fetches besides what is opened: the
//! prefetch list first, then (`--lazy-fetch background`) every other
//! object in pack order; and the list a recording start writes
//! (`--record-prefetch`).

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use cairn_fuse::ObjectSource;
use cairn_store::{ObjectId, Store};

use super::{Remote, RemoteSource, BACKGROUND_JOBS};
use crate::log::logline;

/// Writes the paths of `opened` (objects, in first-open order) to `file`,
/// one a line, each the first path in the image backed by that object,
/// followed for a large file read in part by the chunks read
/// (`<TAB>chunks=0-1,6`, `cairn_remote::push::parse_prefetch_line`);
/// atomically (a temporary file renamed over it). Returns how many.
pub(super) fn write_prefetch(
    store: &Store,
    digest: &str,
    opened: &[(ObjectId, Option<Vec<u32>>)],
    file: &Path,
) -> Result<usize> {
    let contents = store
        .image_contents(digest)
        .with_context(|| format!("reading image {digest} to name the opened files"))?;
    let mut out = Vec::new();
    let mut n = 0;
    for (id, chunks) in opened {
        // A path with a newline cannot be a line of the list, nor one
        // that holds what starts a line's chunks.
        let Some(u) = contents.objects.get(id).filter(|u| {
            !u.path.contains(&b'\n')
                && !u
                    .path
                    .windows(cairn_remote::push::CHUNKS_TAG.len())
                    .any(|w| w == cairn_remote::push::CHUNKS_TAG)
        }) else {
            continue;
        };
        if !u.path.starts_with(b"/") {
            out.push(b'/');
        }
        out.extend_from_slice(&u.path);
        // A large file read in part: the chunks that were read.
        // (Opened but not read at all: its first chunk, where a reader
        // starts.)
        if let Some(c) = chunks {
            let c = if c.is_empty() { &[0][..] } else { &c[..] };
            out.extend_from_slice(cairn_remote::push::CHUNKS_TAG);
            out.extend_from_slice(cairn_remote::push::format_chunks(c).as_bytes());
        }
        out.push(b'\n');
        n += 1;
    }
    let tmp = file.with_extension("cairn-tmp");
    fs::write(&tmp, &out).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, file)
        .with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
    Ok(n)
}

/// The background fetch, started once serving, in every mode: first the
/// image's prefetch list (the files a recorded start opened), a run of
/// listed neighbours a request (and no unlisted one); then, if `all`
/// (`--lazy-fetch background`), every other object in pack order, and the
/// image is marked complete. `BACKGROUND_JOBS` at a time through the
/// layer's fetcher: opens have their own slots and never wait behind
/// these, and an open of an object fetched here joins that fetch. An
/// object that fails is retried with backoff (1 s doubling to 60 s), up
/// to `ATTEMPTS` times; the image then stays incomplete. Stops when the
/// layer goes away. Logs one line for the list, nothing per object that
/// succeeds.
pub(super) fn background(
    store: &Arc<Store>,
    source: &Arc<RemoteSource>,
    bg: &cairn_fuse::Background,
    digest: &str,
    client: &cairn_oci::ClientOptions,
    first: &[ObjectId],
    all: bool,
) {
    let began = std::time::Instant::now();
    // A v2 list's entries for large objects read in part: their chunks.
    let mut chunk_entries: Vec<(ObjectId, Vec<u32>)> = Vec::new();
    let (mut list, mut rest) = match &source.remote {
        Remote::Artifact(r) => {
            let rest = if all { r.pack_order() } else { Vec::new() };
            match r.prefetch_entries() {
                Ok(entries) => (
                    entries
                        .into_iter()
                        .map(|e| {
                            if let Some(c) = e.chunks {
                                chunk_entries.push((e.id, c));
                            }
                            e.id
                        })
                        .collect(),
                    rest,
                ),
                Err(e) => {
                    logline!(
                        "cairn lazy layer for image {digest}: the prefetch list: {e}; going on \
                         without it"
                    );
                    (Vec::new(), rest)
                }
            }
        }
        // The files before each layer's prefetch landmark.
        Remote::Estargz(e) => (
            e.prefetch_order().to_vec(),
            if all {
                e.all_files().to_vec()
            } else {
                Vec::new()
            },
        ),
    };
    if let Remote::Estargz(_) = &source.remote {
        // The TOCs list files that upper layers delete: only what the
        // image uses.
        match store.image_contents(digest) {
            Ok(c) => {
                list.retain(|id| c.objects.contains_key(id));
                rest.retain(|id| c.objects.contains_key(id));
            }
            Err(e) => {
                logline!("cairn lazy layer for image {digest}: no background fetch: {e}");
                return;
            }
        }
    }
    let local = |id: &ObjectId| source.local_id(id).is_some_and(|l| store.has_object(&l));
    // Only the listed chunks of a large object read in part, into a
    // partial that its opens will read (pinned while the layer is
    // served); the rest of it only when read (on-demand) or by the walk
    // below (background). Where no partial can be started, the object is
    // fetched whole with the list.
    for (id, chunks) in &chunk_entries {
        if !local(id) && bg.prefetch_chunks(id, chunks, all) {
            list.retain(|l| l != id);
        }
    }
    put_first(&mut list, first);
    let mut seen: std::collections::HashSet<ObjectId> = list.iter().copied().collect();
    let _ = source.listed.set(seen.clone());
    // The list phase fetches each run of listed neighbours once, by its
    // first object: two jobs never start on the same run.
    let mut heads = Vec::new();
    let mut covered = std::collections::HashSet::new();
    let mut listed_missing = 0usize;
    for id in &list {
        if covered.contains(id) || local(id) {
            continue;
        }
        listed_missing += 1;
        covered.extend(source.group(store, id));
        covered.insert(*id);
        heads.push(*id);
    }
    drop(covered);
    // Large (chunked) objects last: one the start opens before the list
    // reaches it is then read chunk by chunk (answered as soon as the
    // chunks it reads are in, the rest following), instead of waiting for
    // the list's fetch of the whole object, which it would join.
    let (mut heads, chunked): (Vec<ObjectId>, Vec<ObjectId>) = heads
        .into_iter()
        .partition(|id| source.chunks(id).is_none());
    heads.extend(chunked);
    let mut given_up = fetch_all(bg, &heads, &local, digest);
    if bg.stopped() {
        return;
    }
    if !list.is_empty() {
        let still = list.iter().filter(|id| !local(id)).count();
        logline!(
            "cairn lazy layer for image {digest}: the start files and the prefetch list: {} of \
             {} objects local after {:.2} s ({listed_missing} were missing{})",
            list.len() - still,
            list.len(),
            began.elapsed().as_secs_f64(),
            if still > 0 {
                format!("; {still} still missing")
            } else {
                String::new()
            }
        );
    }
    if !all {
        return;
    }
    rest.retain(|id| seen.insert(*id));
    drop(seen);
    given_up += fetch_all(bg, &rest, &local, digest);
    if bg.stopped() {
        return;
    }
    let order: Vec<ObjectId> = list.into_iter().chain(rest).collect();
    let missing = order.iter().filter(|id| !local(id)).count();
    if missing > 0 {
        logline!(
            "cairn lazy layer for image {digest}: background fetch done; {missing} objects still \
             missing ({given_up} given up on); the image stays incomplete"
        );
        return;
    }
    if let Remote::Estargz(_) = source.remote {
        // Its image names files by sha256: written again with the stored
        // objects' names, as another image that the names move to.
        let done = store
            .lock_shared()
            .map_err(cairn_remote::RemoteError::from)
            .and_then(|_lock| cairn_remote::estargz_fetch::complete_from_local(store, digest));
        match done {
            Ok(Some(complete)) => logline!(
                "cairn lazy layer for image {digest}: every file is local; the image is complete \
                 as {complete}"
            ),
            Ok(None) => logline!(
                "cairn lazy layer for image {digest}: a file is not local after all; the image \
                 stays incomplete"
            ),
            Err(e) => {
                logline!("cairn lazy layer for image {digest}: marking the image complete: {e}")
            }
        }
        return;
    }
    // Every object is local: `cairn fetch` finds nothing to fetch, checks
    // that under the store's rules, and marks the image complete.
    let opts = cairn_remote::FetchOptions {
        client: client.clone(),
        ..cairn_remote::FetchOptions::default()
    };
    match cairn_remote::fetch_image(store, digest, &opts) {
        Ok(r) => logline!(
            "cairn lazy layer for image {digest}: every object is local; the image is complete \
             ({} fetched at the end)",
            r.fetched_objects
        ),
        Err(e) => logline!("cairn lazy layer for image {digest}: marking the image complete: {e}"),
    }
}

/// Puts `first` (the objects of `START_FILES`) at the head of `list`, in
/// their order and once each, also where the list has them further down.
fn put_first(list: &mut Vec<ObjectId>, first: &[ObjectId]) {
    let mut ahead: Vec<ObjectId> = Vec::new();
    for id in first {
        if !ahead.contains(id) {
            ahead.push(*id);
        }
    }
    list.retain(|id| !ahead.contains(id));
    list.splice(0..0, ahead);
}

/// Fetches `ids` in order through the layer's fetcher, `BACKGROUND_JOBS`
/// at a time, each retried with backoff (1 s doubling to 60 s) up to
/// `ATTEMPTS` times; stops when the layer goes away. Returns how many
/// were given up on. Logs failures only.
fn fetch_all(
    bg: &cairn_fuse::Background,
    ids: &[ObjectId],
    local: &(dyn Fn(&ObjectId) -> bool + Sync),
    digest: &str,
) -> usize {
    const ATTEMPTS: u32 = 8;
    let next = AtomicUsize::new(0);
    let given_up = AtomicUsize::new(0);
    let job = || loop {
        if bg.stopped() {
            return;
        }
        let Some(id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) else {
            return;
        };
        let mut wait = Duration::from_secs(1);
        for attempt in 1..=ATTEMPTS {
            if local(id) || bg.stopped() {
                break;
            }
            match bg.fetch(id) {
                Ok(()) => break,
                Err(_) if bg.stopped() => return,
                Err(e) => {
                    logline!(
                        "cairn lazy layer for image {digest}: background fetch of object {id} \
                         (attempt {attempt} of {ATTEMPTS}): {e}"
                    );
                    if attempt == ATTEMPTS {
                        given_up.fetch_add(1, Ordering::Relaxed);
                    } else {
                        std::thread::sleep(wait);
                        wait = (wait * 2).min(Duration::from_secs(60));
                    }
                }
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..BACKGROUND_JOBS.min(ids.len().max(1)) {
            s.spawn(job);
        }
        job();
    });
    given_up.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ObjectId {
        ObjectId::from_hex(&format!("{n:02x}").repeat(32)).unwrap()
    }

    /// The start files go first: added where the list lacks them, moved
    /// up where it has them further down, never twice.
    #[test]
    fn start_files_go_first() {
        let mut list = vec![id(1), id(2), id(9), id(3)];
        put_first(&mut list, &[id(9), id(8), id(9)]);
        assert_eq!(list, vec![id(9), id(8), id(1), id(2), id(3)]);
        let mut empty = Vec::new();
        put_first(&mut empty, &[id(7)]);
        assert_eq!(empty, vec![id(7)]);
        let mut unchanged = vec![id(1), id(2)];
        put_first(&mut unchanged, &[]);
        assert_eq!(unchanged, vec![id(1), id(2)]);
    }
}
