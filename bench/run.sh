#!/usr/bin/env bash
# Benchmarks cairn on a tree against baselines measured in the same run and
# prints a markdown table (medians of --runs samples, ratios, targets).
#
#   sudo bench/run.sh TREE [--runs N] [--out FILE] [options]
#
# Options:
#   --runs N          samples per figure (default 5)
#   --out FILE        also write the report to FILE (e.g. bench/results/linux.md)
#   --cairn PATH      cairn binary (default target/x86_64-unknown-linux-musl/release/cairn, env CAIRN_BIN)
#   --work DIR        scratch directory on the filesystem to test (default
#                     /var/tmp/cairn-bench); each run uses a fresh subdirectory
#   --only LIST       comma-separated phases: mkfs,mount,ls,stat,fio (default all)
#   --cycles N        mount+umount cycles per sample (default 50)
#   --stat-count N    entries to lstat (default 1000)
#   --fio-size SIZE   size of the file fio reads (default 1G)
#   --fio-rand-io SIZE  bytes of 4 KiB random reads per sample (default 256M)
#   --seed N          seed for the stat sample and fio (default 1)
#   --keep            keep the scratch directory (stores, images) afterwards
#   --strict          exit 3 when a target is missed
#
# Needs root (mounts, drop_caches, cgroups). See bench/README.md.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")

usage() {
  sed -n '2,/^# Needs root/p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}
die() {
  printf 'bench: error: %s\n' "$*" >&2
  exit 1
}
say() { printf 'bench: %s\n' "$*" >&2; }

runs=5
out=
cairn=${CAIRN_BIN:-$repo/target/x86_64-unknown-linux-musl/release/cairn}
work=/var/tmp/cairn-bench
only=mkfs,mount,ls,stat,fio
cycles=50
stat_count=1000
fio_size=1G
fio_rand_io=256M
seed=1
keep=0
strict=0
tree=
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --cairn) cairn=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --cycles) cycles=$2; shift 2 ;;
    --stat-count) stat_count=$2; shift 2 ;;
    --fio-size) fio_size=$2; shift 2 ;;
    --fio-rand-io) fio_rand_io=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --strict) strict=1; shift ;;
    -h | --help) usage 0 ;;
    -*) die "unknown option $1 (try --help)" ;;
    *)
      [ -z "$tree" ] || die "one TREE only (got '$tree' and '$1')"
      tree=$1
      shift
      ;;
  esac
done
[ -n "$tree" ] || usage 2
for n in "$runs" "$cycles" "$stat_count" "$seed"; do
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    die "expected a positive number, got '$n'"
  fi
done
phase() { [[ ",$only," == *",$1,"* ]]; }

[ "$(id -u)" -eq 0 ] || die "run as root: the benchmark mounts, drops caches and makes cgroups"
[ -d "$tree" ] || die "no directory $tree"
tree=$(readlink -f "$tree")
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn PATH)"
cairn=$(readlink -f "$cairn")
for tool in mkfs.erofs fio python3 findmnt chattr numfmt; do
  command -v "$tool" >/dev/null || die "$tool not found (sudo ./setup.sh installs it)"
done
fio_bytes=$(numfmt --from=iec "$fio_size")
fio_rand_bytes=$(numfmt --from=iec "$fio_rand_io")

# ---------------------------------------------------------------- scratch space
# ext4 is slow to reuse inodes freed in the last minute (docs/machines.md): every
# run writes into a fresh directory, and the parent has the Orlov "top
# directory" flag (chattr +T) so that new trees spread over block groups.
mkdir -p "$work"
chattr +T "$work" 2>/dev/null || say "chattr +T $work failed (not ext4?); carrying on"
run_dir=$work/run-$(date +%Y%m%d-%H%M%S)-$$
mkdir "$run_dir"
samples=$run_dir/samples.tsv
meta=$run_dir/meta.tsv
: >"$samples"
: >"$meta"

cgroups=()
memcg_kind=none
memcg_parent=
memcg_subtree_changed=0

cleanup() {
  local m
  # Deepest mount first; cairn's own umount, then the plain one, then lazily.
  while IFS= read -r m; do
    [ -n "$m" ] || continue
    "$cairn" umount "$m" 2>/dev/null || umount "$m" 2>/dev/null || umount -l "$m" || true
  done < <(findmnt -rn -o TARGET | grep -F "$run_dir/" | sort -r)
  for m in "${cgroups[@]}"; do
    [ -d "$m" ] && rmdir "$m" 2>/dev/null
  done
  if [ "$memcg_subtree_changed" -eq 1 ]; then
    echo -memory >"$memcg_parent/cgroup.subtree_control" 2>/dev/null || true
  fi
  if findmnt -rn -o TARGET | grep -qF "$run_dir/"; then
    say "WARNING: something is still mounted under $run_dir; not removing it"
  elif [ "$keep" -eq 1 ]; then
    say "kept $run_dir"
  else
    rm -rf "$run_dir"
  fi
}
trap cleanup EXIT

meta() { printf '%s\t%s\n' "$1" "$2" >>"$meta"; }
# rec METRIC SIDE VALUE
rec() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$samples"; }
# Microsecond clock without forking.
now() { t=${EPOCHREALTIME/./}; }
us_s() { printf '%d.%06d' $(($1 / 1000000)) $(($1 % 1000000)); }
us_ms() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }
drop_caches() {
  sync
  echo 3 >/proc/sys/vm/drop_caches
}
mounts_and_loops() {
  findmnt -rn -o TARGET,FSTYPE | awk '$2 ~ /^(erofs|overlay|fuse)/' | sort
  losetup -n -l -O NAME,BACK-FILE 2>/dev/null | sort
}
dir_bytes() { du -sb --apparent-size "$1" | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# ---------------------------------------------------------------- memory cgroup
# Peak memory of one command: a memory cgroup of our own, made per sample and
# removed afterwards. cgroup v1 (this machine: the memory controller is on the
# v1 hierarchy) reports memory.max_usage_in_bytes; cgroup v2 memory.peak.
memcg_setup() {
  if [ -f /sys/fs/cgroup/memory/memory.max_usage_in_bytes ]; then
    memcg_kind=v1
    memcg_parent=/sys/fs/cgroup/memory
  else
    local p
    for p in /sys/fs/cgroup /sys/fs/cgroup/unified; do
      if [ -f "$p/cgroup.controllers" ] && grep -qw memory "$p/cgroup.controllers"; then
        memcg_kind=v2
        memcg_parent=$p
        if ! grep -qw memory "$p/cgroup.subtree_control"; then
          echo +memory >"$p/cgroup.subtree_control"
          memcg_subtree_changed=1
        fi
        break
      fi
    done
  fi
  say "memory cgroup: $memcg_kind${memcg_parent:+ ($memcg_parent)}"
}

# timed_in_memcg SIDE METRIC_PREFIX COMMAND...: runs COMMAND (stdout to
# /dev/null) in a fresh memory cgroup, records its wall time (s) and its peak
# memory (MiB).
timed_in_memcg() {
  local side=$1 prefix=$2 cg t0 peak
  shift 2
  if [ "$memcg_kind" = none ]; then
    now; t0=$t
    "$@" >/dev/null
    now; rec "${prefix}_s" "$side" "$(us_s $((t - t0)))"
    return
  fi
  cg=$memcg_parent/cairn-bench-$$-${#cgroups[@]}
  mkdir "$cg"
  cgroups+=("$cg")
  now; t0=$t
  bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cg" "$@" >/dev/null
  now; rec "${prefix}_s" "$side" "$(us_s $((t - t0)))"
  if [ "$memcg_kind" = v1 ]; then
    peak=$(cat "$cg/memory.max_usage_in_bytes")
  else
    [ -f "$cg/memory.peak" ] || die "cgroup2 without memory.peak (kernel < 5.19?)"
    peak=$(cat "$cg/memory.peak")
  fi
  rec ls_peak_mib "$side" "$(awk -v b="$peak" 'BEGIN { printf "%.3f", b / 1048576 }')"
  rmdir "$cg"
}

# Both sides list a relative "." from inside the tree, so path lengths match.
lsr() { (cd "$1" && LC_ALL=C ls -lR . >/dev/null); }

# ---------------------------------------------------------------- description
say "tree $tree; scratch $run_dir; $runs runs"
read -r n_entries n_files n_dirs n_bytes < <(find "$tree" -printf '%y %s\n' |
  awk '{ n++; if ($1 == "f") { f++; b += $2 } else if ($1 == "d") d++ } END { print n+0, f+0, d+0, b+0 }')
avail=$(df --output=avail -B1 "$run_dir" | tail -1)
need=$((n_bytes * (runs + 1) + 2 * fio_bytes))
[ "$avail" -gt "$need" ] || die "need about $(mib "$need") free under $work, have $(mib "$avail")"

rev=$(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)
meta date "$(date -u '+%Y-%m-%d %H:%M UTC')"
meta host "$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), Linux $(uname -r), tree on $(findmnt -no FSTYPE -T "$tree"), scratch on $(findmnt -no FSTYPE -T "$run_dir")"
meta tree "$tree"
meta tree_name "$(basename "$tree")"
meta tree_stats "$n_entries entries ($n_files files, $n_dirs directories), $(mib "$n_bytes") in files"
meta cairn "$("$cairn" --version 2>/dev/null | head -1) (git $rev)"
meta runs "$runs"
meta stat_count "$stat_count"

# ---------------------------------------------------------------- mkfs
# Source tree warm in the page cache for both tools; each sample writes into a
# fresh store and image. "mkfs, then sync" counts until everything written is on
# disk, which is fair whichever tool fsyncs on its own.
say "warming the page cache with the tree"
tar -C "$tree" -cf - . | cat >/dev/null

store=$run_dir/mkfs-1/store
image=$run_dir/mkfs-1/cairn.img
if phase mkfs; then
  for i in $(seq 1 "$runs"); do
    d=$run_dir/mkfs-$i
    mkdir -p "$d"
    sync
    now; t0=$t
    "$cairn" -q --root "$d/store" mkfs --store --name bench "$tree" "$d/cairn.img"
    now; t1=$t
    sync
    now
    rec mkfs_s cairn "$(us_s $((t1 - t0)))"
    rec mkfs_sync_s cairn "$(us_s $((t - t0)))"

    now; t0=$t
    mkfs.erofs --quiet "$d/erofs.img" "$tree" >/dev/null
    now; t1=$t
    sync
    now
    rec mkfs_s base "$(us_s $((t1 - t0)))"
    rec mkfs_sync_s base "$(us_s $((t - t0)))"
    erofs_size=$(stat -c %s "$d/erofs.img")
    rm -f "$d/erofs.img" # one file: no inode-reuse penalty, and it saves space
    say "mkfs $i/$runs: cairn $(tail -4 "$samples" | awk 'NR == 1 { print $3 }')s, mkfs.erofs $(tail -2 "$samples" | awk 'NR == 1 { print $3 }')s"
  done
else
  mkdir -p "$run_dir/mkfs-1"
  "$cairn" -q --root "$store" mkfs --store --name bench "$tree" "$image"
fi
meta image_sizes "cairn image $(mib "$(stat -c %s "$image")") + store objects $(mib "$(dir_bytes "$store/objects")")${erofs_size:+; mkfs.erofs image $(mib "$erofs_size")}"

# ---------------------------------------------------------------- mount
if phase mount; then
  mnt=$run_dir/mnt-cycle
  empty=$run_dir/empty
  mkdir -p "$mnt" "$empty"
  mounts_and_loops >"$run_dir/mounts.before"
  # One untimed cycle each first.
  "$cairn" --root "$store" mount bench "$mnt" && "$cairn" umount "$mnt"
  mount -t overlay overlay -o "ro,lowerdir=$tree:$empty" "$mnt" && umount "$mnt"
  for i in $(seq 1 "$runs"); do
    now; t0=$t
    for _ in $(seq 1 "$cycles"); do
      "$cairn" --root "$store" mount bench "$mnt"
      "$cairn" umount "$mnt"
    done
    now
    rec mount_ms cairn "$(us_ms $(((t - t0) / cycles)))"
    now; t0=$t
    for _ in $(seq 1 "$cycles"); do
      mount -t overlay overlay -o "ro,lowerdir=$tree:$empty" "$mnt"
      umount "$mnt"
    done
    now
    rec mount_ms base "$(us_ms $(((t - t0) / cycles)))"
  done
  mounts_and_loops >"$run_dir/mounts.after"
  if ! cmp -s "$run_dir/mounts.before" "$run_dir/mounts.after"; then
    say "WARNING: mounts or loop devices changed across the mount cycles:"
    diff "$run_dir/mounts.before" "$run_dir/mounts.after" >&2 || true
    meta notes "mounts or loop devices were left behind by the mount cycles"
  fi
fi

# ---------------------------------------------------------------- the mounted tree
mnt=$run_dir/mnt
mkdir -p "$mnt"
"$cairn" --root "$store" mount bench "$mnt"
m_entries=$(find "$mnt" | wc -l)
[ "$m_entries" -eq "$n_entries" ] || die "the mount shows $m_entries entries, the tree $n_entries"

if phase ls; then
  memcg_setup
  for i in $(seq 1 "$runs"); do
    drop_caches
    # shellcheck disable=SC2016 # $1 is expanded by the inner sh
    timed_in_memcg cairn ls_cold sh -c 'cd "$1" && LC_ALL=C exec ls -lR .' _ "$mnt"
    drop_caches
    # shellcheck disable=SC2016 # $1 is expanded by the inner sh
    timed_in_memcg base ls_cold sh -c 'cd "$1" && LC_ALL=C exec ls -lR .' _ "$tree"
  done
  lsr "$mnt"
  lsr "$tree"
  for i in $(seq 1 "$runs"); do
    now; t0=$t
    lsr "$mnt"
    now; rec ls_warm_s cairn "$(us_s $((t - t0)))"
    now; t0=$t
    lsr "$tree"
    now; rec ls_warm_s base "$(us_s $((t - t0)))"
  done
  say "ls -lR done"
fi

if phase stat; then
  list=$run_dir/stat.list
  python3 "$here/lib/statbench.py" sample "$tree" "$stat_count" "$seed" >"$list"
  # Contents must match too: compare the first regular files of the sample.
  checked=0
  while IFS= read -r -d '' p; do
    if [ -L "$tree/$p" ] || [ ! -f "$tree/$p" ]; then
      continue
    fi
    cmp -s "$tree/$p" "$mnt/$p" || die "$p differs between the tree and the mount"
    checked=$((checked + 1))
    [ "$checked" -lt 20 ] || break
  done <"$list"
  stat_ms() { awk -v s="$(python3 "$here/lib/statbench.py" run "$1" "$list")" 'BEGIN { printf "%.3f", s * 1000 }'; }
  for i in $(seq 1 "$runs"); do
    drop_caches
    rec stat_cold_ms cairn "$(stat_ms "$mnt")"
    drop_caches
    rec stat_cold_ms base "$(stat_ms "$tree")"
  done
  stat_ms "$mnt" >/dev/null
  stat_ms "$tree" >/dev/null
  for i in $(seq 1 "$runs"); do
    rec stat_warm_ms cairn "$(stat_ms "$mnt")"
    rec stat_warm_ms base "$(stat_ms "$tree")"
  done
  say "stat done"
fi

# ---------------------------------------------------------------- fio
if phase fio; then
  fiotree=$run_dir/fiotree
  mkdir -p "$fiotree" "$run_dir/fio" "$run_dir/mnt-fio"
  say "writing a $fio_size file for fio"
  python3 - "$fiotree/big.bin" "$fio_bytes" "$seed" <<'EOF'
import random, sys
path, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
with open(path, "wb") as f:
    while size > 0:
        n = min(size, 1 << 20)
        f.write(rng.randbytes(n))
        size -= n
EOF
  "$cairn" -q --root "$run_dir/fio/store" mkfs --store "$fiotree" "$run_dir/fio/fio.img"
  "$cairn" --root "$run_dir/fio/store" mount "$run_dir/fio/fio.img" "$run_dir/mnt-fio"
  cmp "$fiotree/big.bin" "$run_dir/mnt-fio/big.bin" || die "big.bin reads back different through the mount"
  # fio_mibs FILE RW BS [ARGS...]: MiB/s of one cold fio job.
  fio_mibs() {
    local file=$1 rw=$2 bs=$3
    shift 3
    drop_caches
    fio --name=bench --filename="$file" --readonly --rw="$rw" --bs="$bs" --size="$fio_bytes" \
      --ioengine=psync --direct=0 --invalidate=1 --randrepeat=1 --randseed="$seed" \
      --output-format=json --output="$run_dir/fio.json" "$@" >/dev/null
    python3 -c 'import json, sys; print("%.3f" % (json.load(open(sys.argv[1]))["jobs"][0]["read"]["bw_bytes"] / 1048576))' "$run_dir/fio.json"
  }
  for i in $(seq 1 "$runs"); do
    rec fio_seq_mibs cairn "$(fio_mibs "$run_dir/mnt-fio/big.bin" read 1M)"
    rec fio_seq_mibs base "$(fio_mibs "$fiotree/big.bin" read 1M)"
    rec fio_rand_mibs cairn "$(fio_mibs "$run_dir/mnt-fio/big.bin" randread 4k --io_size="$fio_rand_bytes")"
    rec fio_rand_mibs base "$(fio_mibs "$fiotree/big.bin" randread 4k --io_size="$fio_rand_bytes")"
  done
  say "fio done"
fi

# ---------------------------------------------------------------- report
rc=0
python3 "$here/lib/report.py" "$run_dir" >"$run_dir/report.md" || rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 3 ] || die "report.py failed"
cat "$run_dir/report.md"
if [ -n "$out" ]; then
  mkdir -p "$(dirname "$out")"
  cp "$run_dir/report.md" "$out"
  say "report written to $out"
fi
if [ "$rc" -eq 3 ] && [ "$strict" -eq 1 ]; then
  exit 3
fi
