#!/usr/bin/env bash
# Interleaved A/B of `cairn fetch` of a lazily pulled image (issues 13/17).
#
#   sudo REF=HOST:PORT/REPO:TAG bench/fetch-ab.sh ROUNDS LABEL=BINARY...
#
# REF must have a cairn lazy artifact (`cairn push`), e.g. bench/containerd.sh's
# `bench/python-lazy:gzip` in its registry storage (start one on it with
# bench/lib/registry.sh's `registry_start`). PAUSE: seconds after each
# round's deletions (default 60, see import-ab.sh: journal-less ext4 skips
# inodes freed in the last ~60 s).
# Per run: a fresh store under a `chattr +T` parent, `pull --lazy
# --no-prefetch` (metadata only, not timed), `sync`, caches dropped, then
# /usr/bin/time of `cairn fetch REF` (wall, user, sys, CPU%, peak RSS KiB).
set -uo pipefail

rounds=${1:?usage: REF=... bench/fetch-ab.sh ROUNDS LABEL=BINARY...}
shift
ref=${REF:?REF: a lazily pullable image reference}
parent=/var/tmp/fetch-ab
mkdir -p "$parent"
chattr +T "$parent" 2>/dev/null || true
echo "ref=$ref"
for i in $(seq 1 "$rounds"); do
  # Even rounds run the binaries in the reverse order: the first run of a
  # round follows the last round's deletions, and was the slower one in 13
  # of 15 rounds of session 37's A/Bs whichever binary it was.
  order=("$@")
  if [ $((i % 2)) -eq 0 ]; then
    order=()
    for ((k = $#; k >= 1; k--)); do order+=("${!k}"); done
  fi
  for lb in "${order[@]}"; do
    l=${lb%%=*} b=${lb#*=}
    r=$parent/$l-$i
    rm -rf "$r"
    if ! "$b" --root "$r" -q pull --lazy --no-prefetch "$ref" >/dev/null 2>"/tmp/fetch-ab-err.$l"; then
      echo "$l round $i: pull --lazy failed: $(tail -1 "/tmp/fetch-ab-err.$l")" >&2
      exit 1
    fi
    sync
    echo 3 >/proc/sys/vm/drop_caches
    if ! /usr/bin/time -o "/tmp/fetch-ab-t.$l" -f "%e %U %S %P %M" \
      "$b" --root "$r" -q fetch "$ref" >/dev/null 2>"/tmp/fetch-ab-err.$l"; then
      echo "$l round $i: fetch failed: $(tail -1 "/tmp/fetch-ab-err.$l")" >&2
      exit 1
    fi
    echo "$l $i $(cat "/tmp/fetch-ab-t.$l")"
  done
  for lb in "$@"; do rm -rf "$parent/${lb%%=*}-$i"; done
  sleep "${PAUSE:-60}"
done
