#!/usr/bin/env bash
# Interleaved A/B of `cairn import` of one OCI layout (issue 17).
#
#   sudo bench/import-ab.sh ROUNDS LABEL=BINARY...
#
# Environment: PFX (a command prefix, split on spaces, e.g. "taskset -c 0"),
# LAYOUT (default /var/tmp/imp/linux-gz, image name `linux`), SOURCE (what
# to import instead of that layout, e.g. `dir:/var/tmp/linux-tree`), WARM=1
# (the source stays in the page cache: caches are not dropped, and the
# source is read once before the first round), PAUSE (seconds after each
# round, default 60).
# Per run: a fresh store directory, `sync`, caches dropped (unless WARM),
# then /usr/bin/time of the import (wall, user, sys, CPU%, peak RSS in KiB).
# The stores are removed after each round, then the pause: journal-less
# ext4 skips inodes freed in the last ~60 s (`recently_deleted`), which
# would charge the next run for the previous one's deletion.
set -uo pipefail

rounds=${1:?usage: bench/import-ab.sh ROUNDS LABEL=BINARY...}
shift
read -r -a prefix <<<"${PFX:-}"
layout=${LAYOUT:-/var/tmp/imp/linux-gz}
source=${SOURCE:-oci-layout:$layout:linux}
warm=${WARM:-0}
if [ "$warm" = 1 ]; then
  case $source in
    dir:*) tar -cf - -C "${source#dir:}" . | cat >/dev/null ;;
    *) tar -cf - -C "$layout" . | cat >/dev/null ;;
  esac
fi
echo "source=$source warm=$warm"
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
    r=/var/tmp/import-ab-$l-$i
    rm -rf "$r"
    sync
    [ "$warm" = 1 ] || echo 3 >/proc/sys/vm/drop_caches
    ld=$(cut -d' ' -f1 /proc/loadavg)
    if ! /usr/bin/time -o "/tmp/import-ab-t.$l" -f "%e %U %S %P %M" \
      "${prefix[@]}" "$b" --root "$r" import "$source" >/dev/null 2>"/tmp/import-ab-err.$l"; then
      echo "FAIL $l"
      tail -3 "/tmp/import-ab-err.$l"
    fi
    echo "round=$i $l wall,user,sys,cpu%,maxrss_kb: $(cat "/tmp/import-ab-t.$l") load=$ld"
  done
  for lb in "$@"; do rm -rf "/var/tmp/import-ab-${lb%%=*}-$i"; done
  sync
  sleep "${PAUSE:-60}"
done
