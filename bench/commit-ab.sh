#!/usr/bin/env bash
# Interleaved A/B of cold `ctr image pull` through the cairn snapshotter
# (issue 14): the normal path (containerd fetches and unpacks, cairn
# imports each layer on Commit) by default, the remote path, or the remote
# lazy path (then the first `ctr run --rm … /bin/true` is timed too).
#
#   sudo bench/commit-ab.sh ROUNDS LABEL=BINARY...
#
# Environment: IMAGE (default bench/python:gzip, from the registry storage
# bench/containerd.sh prepares under WORK, default
# /var/tmp/cairn-bench-containerd: run that once first; bench/python-lazy:gzip
# for MODE=lazy), MODE (normal, remote or lazy: the snapshotter started
# `--lazy-fetch on-demand`, as bench/containerd.sh does), LOG (the snapshotter's CAIRN_LOG, default info; with debug its
# log says how long each Prepare and Commit took), KEEP=1 (keep each run's
# directory, with the containerd and snapshotter logs).
# Per run: containerd 2.4.2 and `cairn snapshotter` started on a fresh
# directory (made with `chattr +T`, as bench/containerd.sh makes its
# samples', so ext4 puts it in block groups of its own), `sync`, caches
# dropped, then the wall time of `ctr image pull` (and for MODE=lazy, of
# the pull and the first `ctr run --rm IMAGE ID /bin/true` after it) and
# the CPU seconds of the snapshotter (once the snapshot directories it
# empties in the background are gone), containerd, the lazy chain mount's
# servers (MODE=lazy) and the registry. Prints one line per run. What an
# earlier run left under WORK/commit-ab is removed first. The runs'
# directories are removed at the end, not between runs: journal-less ext4
# skips inodes freed in the last minute (`recently_deleted`, see
# docs/machines.md), which charged a run for the one before it (pulls of
# 5-9.5 s instead of 4.1-4.9 s here) even with `chattr +T`.
set -uo pipefail

rounds=${1:?usage: bench/commit-ab.sh ROUNDS LABEL=BINARY...}
shift
[ "$#" -ge 1 ] || { echo "usage: bench/commit-ab.sh ROUNDS LABEL=BINARY..." >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "run as root" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
work=${WORK:-/var/tmp/cairn-bench-containerd}
mode=${MODE:-normal}
case $mode in
  normal | remote) image=${IMAGE:-bench/python:gzip} ;;
  lazy) image=${IMAGE:-bench/python-lazy:gzip} ;;
  *) echo "MODE: normal, remote or lazy" >&2; exit 2 ;;
esac
# shellcheck source-path=SCRIPTDIR source=lib/registry.sh
. "$here/lib/registry.sh"
# shellcheck source-path=SCRIPTDIR source=lib/containerd2.sh
. "$here/lib/containerd2.sh"
bin=$CONTAINERD2_BIN
install_containerd2 || { echo "installing containerd $CONTAINERD2_VERSION failed" >&2; exit 1; }
[ -d "$work/registry" ] || { echo "no registry storage in $work: run bench/containerd.sh first" >&2; exit 1; }

base=$work/commit-ab
snap_pid="" ctd_pid=""
# stop_run: the run's containerd and snapshotter, and its mounts.
stop_run() {
  [ -z "$ctd_pid" ] || { kill "$ctd_pid" 2>/dev/null; wait "$ctd_pid" 2>/dev/null; }
  [ -z "$snap_pid" ] || { kill "$snap_pid" 2>/dev/null; wait "$snap_pid" 2>/dev/null; }
  ctd_pid="" snap_pid=""
  findmnt -rn -o TARGET | grep -F "$base/" | sort -r | while IFS= read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m"
  done
  # A lazy chain mount's server exits once its mount is gone.
  for _ in $(seq 100); do
    compgen -G "$base/*/store/lazy/*.pid" >/dev/null || break
    sleep 0.1
  done
}
# cpu_s PID...: user + system CPU seconds of the processes (0 if gone).
cpu_s() {
  local p t=0
  for p in "$@"; do
    [ -r "/proc/$p/stat" ] || continue
    t=$(awk -v t="$t" '{ print t + ($14 + $15) / 100 }' "/proc/$p/stat")
  done
  printf '%.2f' "$t"
}
trap 'stop_run; registry_stop' EXIT
trap 'exit 130' INT TERM
# What an earlier run left (KEEP=1, or stopped): every run starts cold.
stop_run
rm -rf "$base"
mkdir -p "$base"
chattr +T "$base" 2>/dev/null || true
registry_start "$work/registry" || { echo "the registry did not start" >&2; exit 1; }

# one LABEL BINARY ROUND: one cold pull; prints its line.
one() {
  local label=$1 cairn=$2 d=$base/$1-$3 sock t0 t1 t2 snap_cpu ctd_cpu reg_cpu0
  mkdir -p "$d"
  chattr +T "$d" 2>/dev/null || true
  sock=$d/containerd.sock
  local args=()
  case $mode in
    remote) args=(--no-lazy) ;;
    lazy) args=(--lazy-fetch on-demand) ;;
  esac
  CAIRN_LOG=${LOG:-info} "$cairn" --root "$d/store" snapshotter --address "$d/cairn.sock" ${args[@]+"${args[@]}"} \
    2>"$d/snapshotter.log" &
  snap_pid=$!
  for _ in $(seq 200); do [ -S "$d/cairn.sock" ] && break; sleep 0.05; done
  [ -S "$d/cairn.sock" ] || { echo "the snapshotter did not start ($d/snapshotter.log)" >&2; exit 1; }
  local remote=0
  [ "$mode" = normal ] || remote=1
  containerd2_cairn_config "$d" "$sock" "$d/cairn.sock" "$remote" >"$d/config.toml"
  CONTAINERD_DISABLE_PIGZ=1 PATH=$bin:$PATH "$bin/containerd" --config "$d/config.toml" >"$d/containerd.log" 2>&1 &
  ctd_pid=$!
  local up=""
  for _ in $(seq 200); do
    [ -S "$sock" ] && "$bin/ctr" -a "$sock" version >/dev/null 2>&1 && { up=1; break; }
    sleep 0.05
  done
  [ -n "$up" ] || { echo "containerd did not start ($d/containerd.log)" >&2; exit 1; }
  sync
  echo 3 >/proc/sys/vm/drop_caches
  reg_cpu0=$(cpu_s "$registry_pid")
  t0=$(date +%s.%N)
  if ! "$bin/ctr" -a "$sock" -n bench image pull --plain-http --snapshotter cairn "$registry/$image" >"$d/pull.out" 2>&1; then
    echo "FAIL $label: $(tail -1 "$d/pull.out")"
  fi
  t1=$(date +%s.%N)
  local run=""
  if [ "$mode" = lazy ]; then
    if ! "$bin/ctr" -a "$sock" -n bench run --rm --snapshotter cairn "$registry/$image" "c$3" /bin/true >"$d/run.out" 2>&1; then
      echo "FAIL $label: run: $(tail -1 "$d/run.out")"
    fi
    t2=$(date +%s.%N)
    grep -q "pulled lazily by cairn" "$d/snapshotter.log" || echo "FAIL $label: not pulled lazily ($d/snapshotter.log)"
    run=" pull_run_s=$(awk -v a="$t0" -v b="$t2" 'BEGIN { printf "%.3f", b - a }')"
    local lazy_pids=() f
    # Each server's status file names its supervisor and worker.
    for f in "$d"/store/lazy/*.pid; do
      [ -e "$f" ] && mapfile -t -O "${#lazy_pids[@]}" lazy_pids < <(awk '$1 == "supervisor" || $1 == "worker" { print $2 }' "$f")
    done
    run+=" lazy_server_cpu_s=$(cpu_s ${lazy_pids[@]+"${lazy_pids[@]}"})"
  fi
  run+=" registry_cpu_s=$(awk -v a="$reg_cpu0" -v b="$(cpu_s "$registry_pid")" 'BEGIN { printf "%.2f", b - a }')"
  # The CPU of the whole job: the snapshot directories the snapshotter
  # empties in the background (snapshots/tmp/rm.*) count too.
  for _ in $(seq 600); do
    compgen -G "$d/store/snapshots/tmp/rm.*" >/dev/null || break
    sleep 0.05
  done
  snap_cpu=$(awk '{ printf "%.2f", ($14 + $15) / 100 }' "/proc/$snap_pid/stat")
  ctd_cpu=$(awk '{ printf "%.2f", ($14 + $15) / 100 }' "/proc/$ctd_pid/stat")
  stop_run
  echo "round=$3 $label pull_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')$run snapshotter_cpu_s=$snap_cpu containerd_cpu_s=$ctd_cpu"
}

echo "image=$image mode=$mode registry=$registry"
for i in $(seq 1 "$rounds"); do
  for lb in "$@"; do
    one "${lb%%=*}" "${lb#*=}" "$i"
  done
done
if [ -n "${KEEP:-}" ]; then
  echo "the runs' directories, with their logs: $base"
else
  rm -rf "$base"
fi
