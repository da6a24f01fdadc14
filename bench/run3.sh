#!/usr/bin/env bash
# Benchmark part 3: starting containers. cairn run against bare crun on a
# plain directory, the classic overlayfs-snapshotter path, systemd-nspawn
# --ephemeral (ext4 copies, btrfs snapshots), 10 in parallel, user-namespaced
# starts (idmap vs chown -R), pull-and-run cold, and a seeded fsstress-like
# workload. Medians of --runs; markdown to stdout (and --out), PNG chart in
# bench/results/.
#
#   sudo bench/run3.sh [--runs 5] [--out bench/results/run3.md] [options]
#
# Options:
#   --runs N        samples per figure (default 5)
#   --out FILE      also write the report to FILE; the chart goes next to it
#                   (FILE with .png), default bench/results/run3-DATE.png
#   --cairn PATH    cairn binary (default target/x86_64-unknown-linux-musl/release/cairn, env CAIRN_BIN)
#   --cairn-b PATH  a second cairn binary (e.g. another build of the same
#                   commit), started in the same rounds of the start phase,
#                   right after the first: a row "cairn run (warm), B"
#   --tree DIR      the Debian tree (default /var/tmp/cairn-trees/debian-bookworm)
#   --images LIST   busybox,debian (default both)
#   --only LIST     start,parallel,userns,pull,fsstress (default all)
#   --work DIR      scratch (default /var/tmp/cairn-bench3); fresh subdir per run
#   --keep          keep the scratch directory
#
# Needs root. cairn rows say "not available" while `cairn run` does not exist.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
die() {
  printf 'bench3: error: %s\n' "$*" >&2
  exit 1
}
say() { printf 'bench3: %s\n' "$*" >&2; }
usage() {
  sed -n '2,/^# Needs root/p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

all_args=("$@")
runs=5
out=
cairn=${CAIRN_BIN:-$repo/target/x86_64-unknown-linux-musl/release/cairn}
cairn_b=${CAIRN_B_BIN:-}
tree=/var/tmp/cairn-trees/debian-bookworm
images=busybox,debian
only=start,parallel,userns,pull,fsstress
work=/var/tmp/cairn-bench3
keep=0
inner=0
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --cairn) cairn=$2; shift 2 ;;
    --cairn-b) cairn_b=$2; shift 2 ;;
    --tree) tree=$2; shift 2 ;;
    --images) images=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --inner) inner=1; shift ;;
    -h | --help) usage 0 ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || die "--runs: expected a positive number"
[ "$(id -u)" -eq 0 ] || die "run as root"
phase() { [[ ",$only," == *",$1,"* ]]; }
want_image() { [[ ",$images," == *",$1,"* ]]; }

# ---------------------------------------------------------------- cgroups
# crun 1.8 refuses a hybrid cgroup layout (docs/machines.md): the outer
# invocation makes a cgroup2 group of its own under /sys/fs/cgroup/unified,
# moves into it and re-runs this script inside `unshare -C -m` with cgroup2
# mounted on /sys/fs/cgroup; the group is removed afterwards. The private
# mount namespace also means no mount made here can outlive the run. On a
# pure cgroup2 host the script runs as it is (still in a private mount
# namespace).
if [ "$inner" -eq 0 ]; then
  [ -x "$cairn" ] && cairn=$(readlink -f "$cairn")
  if [ -n "$cairn_b" ]; then
    [ -x "$cairn_b" ] || die "--cairn-b: no executable at $cairn_b"
    cairn_b=$(readlink -f "$cairn_b")
  fi
  if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then
    layout=cgroup2
    exec unshare -m --propagation private env BENCH3_CGROUPS="pure cgroup2" CAIRN_BIN="$cairn" CAIRN_B_BIN="$cairn_b" "$0" --inner "${all_args[@]}"
  fi
  [ -d /sys/fs/cgroup/unified ] || die "neither a cgroup2 nor a hybrid layout with /sys/fs/cgroup/unified"
  layout=hybrid
  cg=/sys/fs/cgroup/unified/cairn-bench3-$$
  mkdir "$cg"
  rc=0
  bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$cg" \
    unshare -C -m --propagation private env BENCH3_CGROUPS="hybrid host: crun baselines in an own cgroup2 group + cgroup namespace (docs/machines.md workaround); cairn and nspawn in the host's hybrid view" \
    BENCH3_OUTER=$$ CAIRN_BIN="$cairn" CAIRN_B_BIN="$cairn_b" "$0" --inner "${all_args[@]}" || rc=$?
  # Children crun or cairn may have left (they should not), deepest first.
  find "$cg" -mindepth 1 -depth -type d -exec rmdir {} \; 2>/dev/null || true
  rmdir "$cg" || say "WARNING: could not remove $cg"
  # systemd-nspawn on a hybrid host mirrors its cgroup2 path into the v1
  # name=systemd hierarchy (payload/, supervisor/ under it): remove those too.
  for h in /sys/fs/cgroup/*/; do
    [ -d "$h/cairn-bench3-$$" ] || continue
    find "$h/cairn-bench3-$$" -depth -type d -exec rmdir {} \; 2>/dev/null ||
      say "WARNING: could not remove $h/cairn-bench3-$$"
  done
  say "cgroup layout: $layout"
  exit "$rc"
fi

# ---------------------------------------------------------------- inner
if [ "${BENCH3_CGROUPS#hybrid}" != "$BENCH3_CGROUPS" ]; then
  mount -t cgroup2 none /sys/fs/cgroup
  # Out of the namespace's root group into a leaf: crun enables controllers
  # in the root's subtree_control, which fails with EBUSY while a process is
  # in it, and crun 1.8 retries that for 2 s (seen with strace).
  mkdir /sys/fs/cgroup/bench3
  echo $$ >/sys/fs/cgroup/bench3/cgroup.procs
fi
# systemd-nspawn --ephemeral refuses to clean up its propagation directory
# when /run is not a tmpfs (here it is not: PID 1 is not systemd); give it
# one in this private mount namespace.
if [ "$(stat -fc %T /run)" != tmpfs ]; then
  mkdir -p /run/systemd/nspawn
  mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn
fi
for t in crun python3 gcc tar findmnt chattr nsenter; do
  command -v "$t" >/dev/null || die "$t not found (sudo ./setup.sh installs it)"
done

have_cairn_run=0
cairn_na="cairn run not available (this cairn has no 'run')"
if [ -x "$cairn" ] && "$cairn" run --help >/dev/null 2>&1; then
  have_cairn_run=1
elif [ ! -x "$cairn" ]; then
  cairn_na="no cairn binary at $cairn"
fi
have_cairn=0
[ -x "$cairn" ] && "$cairn" mkfs --help 2>/dev/null | grep -q -- --name && have_cairn=1

mkdir -p "$work"
chattr +T "$work" 2>/dev/null || true
stamp=$(date +%Y%m%d-%H%M%S)
run=$work/run-$stamp-$$
mkdir "$run"
export CAIRN_ROOT=$run/store
# Runtime state on a tmpfs, as on a systemd host, where /run is one: bare
# crun's default --root (/run/crun) and cairn's run root. PID 1 is not
# systemd here and /run is on the root ext4 (no journal, online discard),
# where each file created and removed costs a block allocation, a
# synchronous discard and a slow inode reuse (docs/machines.md): ~0.15 ms of a
# bare crun start, more of a cairn run, which writes more files. The
# "runtime state on disk" rows measure both that way too. The mounts are in
# this private mount namespace only.
runtime_fs=$(stat -fc %T /run)
mkdir -p "$run/runroot"
mount -t tmpfs -o mode=0700 tmpfs "$run/runroot"
export CAIRN_RUNROOT=$run/runroot
if [ "$runtime_fs" != tmpfs ]; then
  mkdir -p /run/crun
  mount -t tmpfs -o mode=0700 tmpfs /run/crun
fi
samples=$run/samples.tsv
: >"$samples"
: >"$run/meta.tsv"
: >"$run/rows.tsv"
: >"$run/na.tsv"
# shellcheck source-path=SCRIPTDIR source=lib/registry.sh
. "$here/lib/registry.sh"
loopdev=

cleanup() {
  local m
  registry_stop
  while IFS= read -r m; do
    [ -n "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(findmnt -rn -o TARGET | grep -F "$run/" | sort -r)
  [ -z "$loopdev" ] || losetup -d "$loopdev" 2>/dev/null || true
  if [ "$keep" -eq 1 ]; then
    say "kept $run"
  elif findmnt -rn -o TARGET | grep -qF "$run/"; then
    say "WARNING: still mounted under $run; not removing it"
  else
    rm -rf "$run"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

meta() { printf '%s\t%s\n' "$1" "$2" >>"$run/meta.tsv"; }
rec() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$samples"; }
# row METRIC METHOD LABEL [BASELINE-METHOD] [TARGET]
row() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" "${5:-}" >>"$run/rows.tsv"; }
na() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$run/na.tsv"; }
now() { t=${EPOCHREALTIME/./}; }
secs() { printf '%d.%06d' $(($1 / 1000000)) $(($1 % 1000000)); }
# timeit METRIC METHOD COMMAND...: one sample of COMMAND's wall time.
timeit() {
  local metric=$1 method=$2 t0
  shift 2
  now; t0=$t
  "$@" >/dev/null
  now
  rec "$metric" "$method" "$(secs $((t - t0)))"
}
# hostview COMMAND...: COMMAND in the host's own cgroup view, as a user of
# this machine runs it. On a hybrid host the script itself sits in a cgroup
# namespace with cgroup2 mounted over /sys/fs/cgroup (for bare crun), where
# systemd-nspawn fails ("Failed to determine supported controllers": the
# root cgroup it looks for is outside the namespace) and cairn would take
# its pure-cgroup2 path instead of the one it takes on this host. So: enter
# the outer shell's cgroup namespace and a child mount namespace of this
# one (the btrfs and /run/systemd/nspawn mounts stay visible) in which the
# cgroup2 mount is taken off again, uncovering the hybrid tmpfs.
hostview() {
  if [ -n "${BENCH3_OUTER:-}" ]; then
    nsenter -t "$BENCH3_OUTER" -C -- unshare -m --propagation private \
      bash -c 'umount /sys/fs/cgroup && "$@"' _ "$@"
  else
    "$@"
  fi
}
# hv_timeit METRIC METHOD FUNCTION ARGS...: timeit in the host view; the
# clock runs inside it, so nsenter/unshare/umount are not counted.
hv_timeit() {
  local metric=$1 method=$2 us
  shift 2
  # shellcheck disable=SC2016 # expanded by the child bash
  us=$(hostview bash -c 't0=${EPOCHREALTIME/./}; "$@" >/dev/null || exit; t1=${EPOCHREALTIME/./}; echo $((t1 - t0))' _ "$@")
  rec "$metric" "$method" "$(secs "$us")"
}
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# settle: written-back data and a moment for deferred work (inode and
# block freeing, discards, RCU callbacks) after a heavy method.
settle() { sync; sleep 1; }
seq_id=0
fresh() { seq_id=$((seq_id + 1)); printf '%s/%s-%d-%d' "$run" "$1" "$BASHPID" "$seq_id"; }

meta date "$(date -u '+%Y-%m-%d %H:%M UTC')"
meta host "$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), Linux $(uname -r), scratch on $(findmnt -no FSTYPE -T "$run"), $(crun --version | head -1)"
meta cairn "$([ -x "$cairn" ] && "$cairn" --version 2>/dev/null | head -1) (git $(git -C "$repo" describe --always --dirty 2>/dev/null || echo ?))$([ "$have_cairn_run" -eq 1 ] || echo "; $cairn_na")"
meta runtime "crun's --root and cairn's --runroot on a tmpfs, as /run is on a systemd host (here /run is $runtime_fs); the \"runtime state on the scratch disk\" rows put both there"
meta runs "$runs"
cairn_b_desc=
if [ -n "$cairn_b" ]; then
  [ "$have_cairn_run" -eq 1 ] || die "--cairn-b needs a first binary with 'cairn run' to compare with"
  # readelf (binutils, with build-essential) says whether a build is PIE.
  elf_type() { readelf -h "$1" 2>/dev/null | sed -n 's/^ *Type: *//p'; }
  cairn_b_desc="$("$cairn_b" --version 2>/dev/null | head -1), ELF $(elf_type "$cairn_b")"
  meta cairn-b "$cairn_b ($cairn_b_desc); the first binary: ELF $(elf_type "$cairn")"
fi
BENCH3_LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
meta cgroups "$BENCH3_CGROUPS"

# ---------------------------------------------------------------- images
# Each image: a plain rootfs directory (bare crun's bundle), the same tree
# split into two layer tarballs (classic path), and a cairn image in a
# store of this run.
make_bundle_config() { # DIR ROOTFS ARGS_JSON [userns]
  (cd "$1" && rm -f config.json && crun spec >/dev/null)
  python3 - "$1/config.json" "$2" "$3" "${4:-}" <<'EOF'
import json, sys
path, root, args, userns = sys.argv[1:5]
c = json.load(open(path))
c["root"] = {"path": root, "readonly": False}
c["process"]["args"] = json.loads(args)
c["process"]["terminal"] = False
c["hostname"] = "bench"
lin = c["linux"]
lin.pop("resources", None)  # limits fail here (docs/machines.md); nothing to limit
if userns:
    lin["namespaces"].append({"type": "user"})
    lin["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    lin["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    # sysfs cannot be mounted from a user namespace without a netns of its own
    # owned by it; bind it instead, as rootless runtimes do.
    for m in c["mounts"]:
        if m["destination"] == "/sys":
            m.update(type="bind", source="/sys", options=["rbind", "nosuid", "noexec", "nodev", "ro"])
json.dump(c, open(path, "w"), indent=1)
EOF
}

img_list=()
if want_image busybox; then
  say "building the busybox image tree"
  "$repo/scripts/make-demo-image.sh" --tree "$run/tree-busybox" --tree-only >/dev/null
  img_list+=(busybox)
fi
if want_image debian; then
  [ -x "$tree/usr/bin/python3" ] || die "$tree has no python3 (sudo bench/make-debian-tree.sh $tree)"
  img_list+=(debian)
fi
[ "${#img_list[@]}" -gt 0 ] || die "no images (--images busybox,debian)"

src_of() { if [ "$1" = busybox ]; then echo "$run/tree-busybox"; else echo "$tree"; fi; }
descr=()
for img in "${img_list[@]}"; do
  src=$(src_of "$img")
  say "$img: plain copy, layer tarballs, cairn image"
  cp -a "$src" "$run/plain-$img"
  mkdir -p "$run/bundle-$img"
  make_bundle_config "$run/bundle-$img" "$run/plain-$img" '["/bin/true"]'
  # Two layers: everything but usr/share, then usr/share (classic snapshotter).
  tar -C "$src" --exclude=./usr/share -cf "$run/layer1-$img.tar" .
  if [ -d "$src/usr/share" ]; then
    tar -C "$src" -cf "$run/layer2-$img.tar" ./usr/share
  else
    tar -cf "$run/layer2-$img.tar" -T /dev/null
  fi
  if [ "$have_cairn" -eq 1 ]; then
    "$cairn" -q mkfs --store --name "bench3-$img" "$src"
  fi
  descr+=("$img: $(find "$src" | wc -l) entries, $(du -sh --apparent-size "$src" | cut -f1)")
done
meta images "${descr[*]}"

# ---------------------------------------------------------------- methods
# Each method runs /bin/true (or ARGS) in IMAGE once; setup that a warm
# start does not repeat (bundle, unpacked layers) is done above.
cairn_true() { "$cairn" run "bench3-$1" /bin/true; }
cairn_b_true() { "$cairn_b" run "bench3-$1" /bin/true; }
crun_true() { crun run --bundle "$run/bundle-$1" "b3-$BASHPID-$RANDOM" </dev/null || { echo "crun failed: rc $?" >&2; return 1; }; }
# The same with the runtime state on the scratch disk (see CAIRN_RUNROOT above).
cairn_true_disk() { CAIRN_RUNROOT=$CAIRN_ROOT/run "$cairn" run "bench3-$1" /bin/true; }
crun_true_disk() { crun --root "$run/crun-state" run --bundle "$run/bundle-$1" "b3-$BASHPID-$RANDOM" </dev/null || { echo "crun failed: rc $?" >&2; return 1; }; }

# Classic: the layers unpacked into directories (once, like a snapshotter's
# cache), then per start an overlay over them with a tmpfs upper, crun, umount.
prepare_classic() {
  local img=$1 d=$run/classic-$1
  mkdir -p "$d/l1" "$d/l2"
  tar -C "$d/l1" -xf "$run/layer1-$img.tar"
  tar -C "$d/l2" -xf "$run/layer2-$img.tar"
}
classic_true() {
  local img=$1 d
  d=$(fresh "cl-$img")
  mkdir -p "$d/up" "$d/root" "$d/b"
  mount -t tmpfs tmpfs "$d/up"
  mkdir "$d/up/u" "$d/up/w"
  mount -t overlay overlay -o "lowerdir=$run/classic-$img/l2:$run/classic-$img/l1,upperdir=$d/up/u,workdir=$d/up/w" "$d/root"
  sed "s|\"path\": \"$run/plain-$img\"|\"path\": \"$d/root\"|" "$run/bundle-$img/config.json" >"$d/b/config.json"
  crun run --bundle "$d/b" "b3-$BASHPID-$RANDOM" </dev/null
  umount "$d/root"
  umount "$d/up"
}

nspawn_ok=0
if command -v systemd-nspawn >/dev/null; then nspawn_ok=1; fi
nspawn_true() { # DIR
  SYSTEMD_NSPAWN_TMPFS_TMP=0 systemd-nspawn -q --register=no --keep-unit --ephemeral \
    -D "$1" /bin/true </dev/null
}
btrfs_ok=0
setup_btrfs() {
  command -v mkfs.btrfs >/dev/null || return 1
  local size
  size=$(($(du -sb "$run"/plain-* | awk '{ s += $1 } END { print s }') * 3 / 1048576 + 512))
  truncate -s "${size}M" "$run/btrfs.img"
  mkfs.btrfs -q "$run/btrfs.img" >/dev/null
  mkdir "$run/btrfs"
  loopdev=$(losetup -f --show "$run/btrfs.img")
  mount "$loopdev" "$run/btrfs"
  for img in "${img_list[@]}"; do
    btrfs -q subvolume create "$run/btrfs/$img" >/dev/null
    cp -a --reflink=auto "$run/plain-$img/." "$run/btrfs/$img/"
  done
}

# The host-view helpers run these in a child bash.
export cairn cairn_b run
export -f cairn_true cairn_b_true cairn_true_disk nspawn_true

# ---------------------------------------------------------------- start
if phase start; then
  for img in "${img_list[@]}"; do
    prepare_classic "$img"
  done
  if [ "$nspawn_ok" -eq 1 ]; then
    if setup_btrfs; then btrfs_ok=1; else say "btrfs loop filesystem failed; no btrfs rows"; fi
    # nspawn's check that the tree is an OS tree: /usr/lib/os-release or /etc/os-release.
    for img in "${img_list[@]}"; do
      if ! hostview nspawn_true "$run/plain-$img" >"$run/nspawn-check.log" 2>&1; then
        say "nspawn fails on $img: $(tail -1 "$run/nspawn-check.log")"
        nspawn_ok=0
      fi
    done
  fi
  for img in "${img_list[@]}"; do
    m="start $img"
    row "$m" crun "bare crun, plain directory"
    row "$m" cairn "cairn run (warm)" crun le:1.25
    [ -z "$cairn_b" ] || row "$m" cairn-b "cairn run (warm), B: $cairn_b_desc" crun
    [ -z "${BENCH3_OUTER:-}" ] || row "$m" cairn-cg2 "cairn run (warm), in bare crun's cgroup2 view" crun
    row "$m" crun-disk "bare crun, runtime state on the scratch disk ($(findmnt -no FSTYPE -T "$run"))"
    row "$m" cairn-disk "cairn run (warm), runtime state on the scratch disk" crun-disk
    row "$m" classic "overlay over unpacked layers + crun" crun
    row "$m" nspawn-ext4 "nspawn --ephemeral, ext4 (copy)" crun
    row "$m" nspawn-btrfs "nspawn --ephemeral, btrfs (snapshot)" crun
    if [ "$have_cairn_run" -eq 0 ]; then
      na "$m" cairn "$cairn_na"
      [ -z "${BENCH3_OUTER:-}" ] || na "$m" cairn-cg2 "$cairn_na"
      na "$m" cairn-disk "$cairn_na"
    fi
    [ "$nspawn_ok" -eq 1 ] || na "$m" nspawn-ext4 "systemd-nspawn missing or failing"
    if [ "$nspawn_ok" -eq 0 ] || [ "$btrfs_ok" -eq 0 ]; then na "$m" nspawn-btrfs "no btrfs loop filesystem or nspawn"; fi
    if [ "$img" = debian ]; then
      row "$m" cairn-vs-nspawn "cairn run (warm), against nspawn ext4" nspawn-ext4 speedup:10
      [ "$have_cairn_run" -eq 1 ] || na "$m" cairn-vs-nspawn "$cairn_na"
      [ "$nspawn_ok" -eq 1 ] || na "$m" cairn-vs-nspawn "systemd-nspawn missing or failing"
    fi
    # One untimed start of each method warms the caches.
    crun_true "$img" >/dev/null
    crun_true_disk "$img" >/dev/null
    classic_true "$img" >/dev/null
    if [ "$have_cairn_run" -eq 1 ]; then
      hostview cairn_true "$img" >/dev/null
      [ -z "$cairn_b" ] || hostview cairn_b_true "$img" >/dev/null
      hostview cairn_true_disk "$img" >/dev/null
      [ -z "${BENCH3_OUTER:-}" ] || cairn_true "$img" >/dev/null
    fi
    for i in $(seq 1 "$runs"); do
      timeit "$m" crun crun_true "$img"
      if [ "$have_cairn_run" -eq 1 ]; then
        hv_timeit "$m" cairn cairn_true "$img"
        [ -z "$cairn_b" ] || hv_timeit "$m" cairn-b cairn_b_true "$img"
        [ -z "${BENCH3_OUTER:-}" ] || timeit "$m" cairn-cg2 cairn_true "$img"
      fi
      timeit "$m" crun-disk crun_true_disk "$img"
      [ "$have_cairn_run" -eq 0 ] || hv_timeit "$m" cairn-disk cairn_true_disk "$img"
      timeit "$m" classic classic_true "$img"
      if [ "$nspawn_ok" -eq 1 ]; then
        hv_timeit "$m" nspawn-ext4 nspawn_true "$run/plain-$img"
        [ "$btrfs_ok" -eq 0 ] || hv_timeit "$m" nspawn-btrfs nspawn_true "$run/btrfs/$img"
        # nspawn's copy (11k files for Debian) and its removal leave the
        # disk and the kernel busy for a while; the next sample starts on a
        # quiet machine.
        settle
      fi
      say "$m $i/$runs: $(tail -8 "$samples" | awk -F'\t' -v m="$m" '$1 == m { printf "%s %s  ", $2, $3 }')"
    done
    if [ "$have_cairn_run" -eq 1 ] && [ "$img" = debian ]; then
      awk -F'\t' -v m="$m" '$1 == m && $2 == "cairn" { print m "\tcairn-vs-nspawn\t" $3 }' "$samples" >"$run/extra.tsv"
      cat "$run/extra.tsv" >>"$samples"
    fi
  done
fi

# ---------------------------------------------------------------- parallel
# N at once (lxd-benchmark launch --count 10 --parallel 10): the wall time
# until all ten have exited, against one.
par10() {
  local fn=$1 img=$2 pids=() p rc=0
  for _ in $(seq 1 10); do
    "$fn" "$img" >/dev/null 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return "$rc"
}
export -f par10
if phase parallel; then
  for img in "${img_list[@]}"; do
    phase start || prepare_classic "$img"
    m="10 parallel $img"
    row "$m" crun-1 "bare crun, one"
    row "$m" crun-10 "bare crun, 10 at once" crun-1
    row "$m" classic-10 "overlay + crun, 10 at once" crun-1
    row "$m" cairn-1 "cairn run, one"
    row "$m" cairn-10 "cairn run, 10 at once" cairn-1 le:6
    if [ "$have_cairn_run" -eq 0 ]; then na "$m" cairn-1 "$cairn_na"; na "$m" cairn-10 "$cairn_na"; fi
    for i in $(seq 1 "$runs"); do
      timeit "$m" crun-1 crun_true "$img"
      timeit "$m" crun-10 par10 crun_true "$img"
      timeit "$m" classic-10 par10 classic_true "$img"
      if [ "$have_cairn_run" -eq 1 ]; then
        hv_timeit "$m" cairn-1 cairn_true "$img"
        hv_timeit "$m" cairn-10 par10 cairn_true "$img"
      fi
      say "$m $i/$runs done"
    done
  done
fi

# ---------------------------------------------------------------- userns
# containerd's idmap-vs-chown measurement: a start in a user namespace
# (container root = host 100000). cairn: --userns auto, the rootfs idmapped,
# nothing copied. Classic: cp -a of the rootfs, chown -R 100000:100000, crun
# with uid/gid mappings (the copy is removed after the sample, untimed).
chown_true() {
  local img=$1 d
  d=$(fresh "ch-$img")
  mkdir -p "$d/b"
  cp -a "$run/plain-$img" "$d/root"
  chown -R -h 100000:100000 "$d/root"
  sed "s|\"path\": \"$run/plain-$img\"|\"path\": \"$d/root\"|" "$run/bundle-userns-$img/config.json" >"$d/b/config.json"
  # Pipes, never /dev/null or a file: crun fchowns the stdio it is given to
  # the container's root (here host uid 100000), which would chown the host's
  # /dev/null.
  : | crun run --bundle "$d/b" "b3-$BASHPID-$RANDOM" 2>&1 | cat
}
cairn_userns_true() { "$cairn" run --userns auto "bench3-$1" /bin/true; }
export -f cairn_userns_true
if phase userns; then
  for img in "${img_list[@]}"; do
    mkdir -p "$run/bundle-userns-$img"
    make_bundle_config "$run/bundle-userns-$img" "$run/plain-$img" '["/bin/true"]' userns
    m="userns $img"
    row "$m" chown "cp -a + chown -R + crun (userns)"
    row "$m" cairn-auto "cairn run --userns auto (idmapped)" chown
    [ "$have_cairn_run" -eq 1 ] || na "$m" cairn-auto "$cairn_na"
    for i in $(seq 1 "$runs"); do
      timeit "$m" chown chown_true "$img"
      rm -rf "$run"/ch-"$img"-*
      [ "$have_cairn_run" -eq 0 ] || hv_timeit "$m" cairn-auto cairn_userns_true "$img"
      say "$m $i/$runs: $(tail -2 "$samples" | cut -f2,3 | tr '\t\n' '  ')"
    done
  done
fi

# ---------------------------------------------------------------- pull
# Cold pull-and-run from a local registry: page cache dropped, empty store /
# empty directories. cairn: pull into a fresh store, run. Baseline: skopeo
# copy to an OCI layout, umoci unpack, crun.
if phase pull; then
  for t in docker-registry skopeo umoci curl; do
    command -v "$t" >/dev/null || die "$t not found (sudo ./setup.sh installs it)"
  done
  registry_start "$run/registry" || die "no registry"
  reg=$registry
  for img in "${img_list[@]}"; do
    say "pushing $img to $reg"
    lay=$run/layout-$img
    umoci init --layout "$lay"
    umoci new --image "$lay:v1"
    umoci insert --image "$lay:v1" "$(src_of "$img")" / >/dev/null
    HOME=$run skopeo copy -q --dest-tls-verify=false "oci:$lay:v1" "docker://$reg/bench3/$img:v1"
    mkdir -p "$run/pull-template-$img"
    make_bundle_config "$run/pull-template-$img" rootfs '["/bin/true"]'
  done
  pull_umoci() {
    local img=$1 d
    d=$(fresh "pu-$img")
    mkdir -p "$d"
    HOME=$run skopeo copy -q --src-tls-verify=false "docker://$reg/bench3/$img:v1" "oci:$d/oci:v1"
    umoci unpack --image "$d/oci:v1" "$d/b" >/dev/null
    cp "$run/pull-template-$img/config.json" "$d/b/config.json"
    crun run --bundle "$d/b" "b3-$BASHPID-$RANDOM" </dev/null
  }
  pull_cairn() { # STORE REFERENCE
    CAIRN_ROOT=$1 "$cairn" -q pull "$2"
    CAIRN_ROOT=$1 "$cairn" run "$2" /bin/true
  }
  export -f pull_cairn
  for img in "${img_list[@]}"; do
    m="pull+run cold $img"
    row "$m" umoci "skopeo copy + umoci unpack + crun"
    row "$m" cairn "cairn pull + cairn run" umoci
    [ "$have_cairn_run" -eq 1 ] || na "$m" cairn "$cairn_na"
    for i in $(seq 1 "$runs"); do
      drop_caches
      timeit "$m" umoci pull_umoci "$img"
      if [ "$have_cairn_run" -eq 1 ]; then
        drop_caches
        hv_timeit "$m" cairn pull_cairn "$(fresh "pc-$img")/store" "$reg/bench3/$img:v1"
      fi
      say "$m $i/$runs: $(tail -2 "$samples" | cut -f2,3 | tr '\t\n' '  ')"
    done
  done
fi

# ---------------------------------------------------------------- fsstress
# 20 workers x 500 seeded operations (bench/lib/fsstress.c, static) in a
# busybox container on a tmpfs upper and a disk upper, and on the host's
# filesystem (the scratch directory). The figure is the tool's own time.
if phase fsstress; then
  gcc -static -O2 -o "$run/fsstress" "$here/lib/fsstress.c"
  fss() { awk -F'seconds=' '/seconds=/ { print $2 }'; }
  cimg=busybox
  want_image busybox || cimg=${img_list[0]}
  m="fsstress 20x500"
  row "$m" host "host filesystem ($(findmnt -no FSTYPE -T "$run"))"
  row "$m" crun-overlay-tmpfs "crun, overlay with tmpfs upper" host
  row "$m" cairn-tmpfs "cairn run --upper tmpfs" host
  row "$m" cairn-disk "cairn run --upper disk" host
  if [ "$have_cairn_run" -eq 0 ]; then na "$m" cairn-tmpfs "$cairn_na"; na "$m" cairn-disk "$cairn_na"; fi
  phase start || phase parallel || prepare_classic "$cimg"
  for i in $(seq 1 "$runs"); do
    d=$(fresh fss-host)
    rec "$m" host "$("$run/fsstress" -d "$d" -n 500 -p 20 -s "$i" | fss)"
    # crun over the classic overlay, tmpfs upper, the binary bind-mounted.
    d=$(fresh fss-crun)
    mkdir -p "$d/up" "$d/root" "$d/b"
    mount -t tmpfs tmpfs "$d/up"
    mkdir "$d/up/u" "$d/up/w"
    mount -t overlay overlay -o "lowerdir=$run/classic-$cimg/l2:$run/classic-$cimg/l1,upperdir=$d/up/u,workdir=$d/up/w" "$d/root"
    make_bundle_config "$d/b" "$d/root" "[\"/fsstress\", \"-d\", \"/tmp/w\", \"-n\", \"500\", \"-p\", \"20\", \"-s\", \"$i\"]"
    python3 - "$d/b/config.json" "$run/fsstress" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["mounts"].append({"destination": "/fsstress", "type": "bind", "source": sys.argv[2], "options": ["bind", "ro"]})
json.dump(c, open(sys.argv[1], "w"))
EOF
    rec "$m" crun-overlay-tmpfs "$(crun run --bundle "$d/b" "b3-$BASHPID-$RANDOM" </dev/null | fss)"
    umount "$d/root"
    umount "$d/up"
    if [ "$have_cairn_run" -eq 1 ]; then
      for up in tmpfs disk; do
        rec "$m" "cairn-$up" "$(hostview "$cairn" run --upper "$up" -v "$run/fsstress:/fsstress:ro" "bench3-$cimg" \
          /fsstress -d /tmp/w -n 500 -p 20 -s "$i" | fss)"
      done
    fi
    say "$m $i/$runs done"
  done
fi

# ---------------------------------------------------------------- report
meta notes "warm = caches warm, the image already in the store / the layers already unpacked; cold = page cache dropped, nothing local. cairn and nspawn run in the host's own cgroup view (bench/README.md: host view). nspawn: --register=no --keep-unit -q (PID 1 is not systemd here); the tree must hold /etc/os-release or /usr/lib/os-release."
meta load "before: $BENCH3_LOAD; after: $(cut -d' ' -f1-3 /proc/loadavg)"
leftover=$(findmnt -rn -o TARGET | grep -cF "$run/" || true)
[ "$leftover" -le 1 ] || say "WARNING: $leftover mounts under $run before cleanup"
mkdir -p "$repo/bench/results"
if [ -n "$out" ]; then png=${out%.md}.png; else png=$repo/bench/results/run3-$stamp.png; fi
# The chart needs matplotlib; a python3 first in PATH (pyenv, venv) may lack
# it where the distribution's has it (setup.sh installs python3-matplotlib).
py=python3
if ! python3 -c 'import matplotlib' 2>/dev/null && /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  py=/usr/bin/python3
fi
"$py" "$here/lib/report3.py" "$run" "$png" >"$run/report.md" || true
cat "$run/report.md"
[ -z "$out" ] || cp "$run/report.md" "$out"
say "chart: $png"
