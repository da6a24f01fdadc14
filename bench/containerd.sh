#!/usr/bin/env bash
# The containerd snapshotter benchmark (issue 14, part 5): containerd 2.4.2
# with its overlayfs snapshotter against `cairn snapshotter`, normal path
# (containerd fetches and unpacks, cairn imports on Commit) and remote path
# (cairn pulls the layers itself; containerd's transfer service passes the
# CRI layer labels because the proxy plugin exports
# enable_remote_snapshot_annotations). The remote lazy path is not built
# yet (docs/snapshotter.md): it is reported as missing, not measured.
#
# Figures, medians of --runs interleaved cold samples (page cache dropped,
# fresh containerd root and cairn store each):
#   - cold `ctr image pull` and `ctr run --rm IMAGE ID /bin/true` after it;
#   - warm `ctr run --rm IMAGE ID /bin/true` (the image pulled, 3 starts);
#   - disk used by three images that share most files (the python image's
#     two layers re-tarred with three different mtimes: every layer differs,
#     the files' contents do not): overlayfs's snapshots against cairn's
#     store (objects, EROFS images, records), containerd's content store
#     separately;
#   - page cache of ten containers of those three images reading the same
#     files (`fincore` over the snapshotter's backing files).
# The images come from bench/pull-containerd.sh's cache and registry storage
# (it is run with --prepare-only if they are missing).
#
#   sudo bench/containerd.sh [--runs N] [--only python,linux] [--cairn BIN]
#                            [--out FILE] [--work DIR]
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
all_args=("$@")
runs=3 only=python
cairn=$repo/target/x86_64-unknown-linux-musl/release/cairn
out=$repo/bench/results/containerd.md
work=/var/tmp/cairn-bench-containerd

die() {
  echo "containerd.sh: $*" >&2
  exit 1
}
say() { echo "==> $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift ;;
    --only) only=$2; shift ;;
    --cairn) cairn=$(readlink -f "$2"); shift ;;
    --out) out=$2; shift ;;
    --work) work=$2; shift ;;
    -h | --help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done
IFS=, read -r -a images <<<"$only"
[ "$(id -u)" -eq 0 ] || die "run as root"
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn BIN)"

# shellcheck source-path=SCRIPTDIR source=lib/registry.sh
. "$here/lib/registry.sh"
# shellcheck source-path=SCRIPTDIR source=lib/containerd2.sh
. "$here/lib/containerd2.sh"
bin=$CONTAINERD2_BIN
py=/usr/bin/python3
install_containerd2 || die "installing containerd $CONTAINERD2_VERSION failed"

for img in "${images[@]}"; do
  [ -d "$work/registry/data/docker/registry/v2/repositories/bench/$img/_manifests/tags/gzip" ] ||
    "$here/pull-containerd.sh" --prepare-only --only "$img" --compression gzip --work "$work"
done

run_dir=$work/ctd-$(date +%s)-$$
ctd_pid="" snap_pid="" sock=""
umount_below() {
  local m
  while IFS= read -r m; do
    [ -n "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(findmnt -rn -o TARGET | grep -F "$1/" | sort -r)
}
our_shims() {
  local p
  for p in /proc/[0-9]*; do
    if { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF -- "-address $1"; then echo "${p#/proc/}"; fi
  done
}
stop_all() {
  local p
  if [ -n "$ctd_pid" ]; then
    kill "$ctd_pid" 2>/dev/null || true
    wait "$ctd_pid" 2>/dev/null || true
    for p in $(our_shims "$sock"); do kill "$p" 2>/dev/null || true; done
    ctd_pid=""
  fi
  if [ -n "$snap_pid" ]; then
    # SIGTERM waits for calls in flight (a remote pull): SIGKILL after 10 s.
    kill "$snap_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$snap_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$snap_pid" 2>/dev/null || true
    wait "$snap_pid" 2>/dev/null || true
    snap_pid=""
  fi
  umount_below "$run_dir"
}
cleanup() {
  stop_all
  registry_stop
  if [ -d "$run_dir" ] && ! findmnt -rn -o TARGET | grep -qF "$run_dir/"; then rm -rf "$run_dir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

drop_caches() {
  sync
  echo 3 >/proc/sys/vm/drop_caches
}

# start D MODE: containerd 2.4.2 in D; MODE overlayfs, normal or remote
# (the last two with `cairn snapshotter` on D/store).
start() {
  local d=$1 mode=$2
  mkdir -p "$d"
  sock=$d/containerd.sock
  if [ "$mode" != overlayfs ]; then
    CAIRN_LOG=info "$cairn" --root "$d/store" snapshotter --address "$d/cairn.sock" 2>"$d/snapshotter.log" &
    snap_pid=$!
    for _ in $(seq 200); do [ -S "$d/cairn.sock" ] && break; sleep 0.05; done
    [ -S "$d/cairn.sock" ] || die "cairn snapshotter did not start ($d/snapshotter.log)"
  fi
  cat >"$d/config.toml" <<EOF
version = 3
root = "$d/root"
state = "$d/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.nri.v1.nri"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[proxy_plugins.cairn]
  type = "snapshot"
  address = "$d/cairn.sock"
$([ "$mode" = remote ] && printf '  [proxy_plugins.cairn.exports]\n    enable_remote_snapshot_annotations = "true"\n')
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "overlayfs"
  differ = "walking"
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "cairn"
  differ = "walking"
EOF
  CONTAINERD_DISABLE_PIGZ=1 PATH=$bin:$PATH "$bin/containerd" --config "$d/config.toml" >"$d/containerd.log" 2>&1 &
  ctd_pid=$!
  for _ in $(seq 200); do
    if [ -S "$sock" ] && "$bin/ctr" -a "$sock" version >/dev/null 2>&1; then return; fi
    sleep 0.05
  done
  die "containerd did not start ($d/containerd.log)"
}
sn_of() { if [ "$1" = overlayfs ]; then echo overlayfs; else echo cairn; fi; }
ctr() { "$bin/ctr" -a "$sock" -n bench "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }

mkdir -p "$run_dir"
samples=$run_dir/samples.tsv
: >"$samples"
cp "$cairn" "$run_dir/cairn.bin"
cairn_given=$cairn cairn=$run_dir/cairn.bin
registry_start "$work/registry"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
n=0

# ---------------------------------------------------------------- sharing
# Three images: the python image's two layers re-tarred with mtimes
# epoch+1..3 (so every layer blob and diff_id differs, the file contents
# do not).
epoch=1747699200
blobs=$work/images/blobs
layout=$run_dir/layout
share_refs=()
for v in 1 2 3; do
  specs=()
  for l in debian python; do
    case $l in debian) src=$work/images/debian-tree ;; python) src=$work/images/python-upper ;; esac
    t=$run_dir/$l-v$v.tar
    tar -C "$src" --sort=name --numeric-owner --format=pax \
      --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      --mtime=@$((epoch + v)) --clamp-mtime -cf "$t" .
    diffid=sha256:$(sha256sum "$t" | cut -d' ' -f1)
    gzip -1 -n "$t"
    specs+=("$t.gz:$diffid:application/vnd.oci.image.layer.v1.tar+gzip")
  done
  "$py" "$here/lib/oci_layout.py" "$layout" "share-$v" '["python3"]' "${specs[@]}" >/dev/null
  HOME=$run_dir skopeo copy -q --dest-tls-verify=false "oci:$layout:share-$v" "docker://$registry/bench/share:v$v"
  rm -f "$run_dir"/*-v"$v".tar.gz
  share_refs+=("$registry/bench/share:v$v")
done
[ -f "$blobs/python.done" ] || die "no python layer in $blobs"

# The files every container reads: python3 and numpy's modules.
read_cmd='find /usr/lib/python3 /usr/lib/python3.11 -type f -name "*.py" -o -type f -name "*.so" | xargs cat >/dev/null; touch /read-done; sleep 600'
for mode in overlayfs normal remote; do
  n=$((n + 1))
  d=$run_dir/$n-share-$mode
  sn=$(sn_of "$mode")
  start "$d" "$mode"
  for ref in "${share_refs[@]}"; do
    ctr image pull --plain-http --snapshotter "$sn" "$ref" >"$d/pull.out" 2>&1 || die "pull $ref ($mode)"
  done
  sync
  case $mode in
    overlayfs) disk=$(du -sx --block-size=1 "$d/root/io.containerd.snapshotter.v1.overlayfs" | cut -f1) ;;
    *) disk=$(du -sx --block-size=1 "$d/store" | cut -f1) ;;
  esac
  content=$(du -sx --block-size=1 "$d/root/io.containerd.content.v1.content" | cut -f1)
  drop_caches
  for i in $(seq 1 10); do
    ref=${share_refs[$(((i - 1) % 3))]}
    ctr run -d --snapshotter "$sn" "$ref" "s$n-$i" sh -c "$read_cmd" >/dev/null 2>&1 || die "run -d ($mode)"
  done
  # Until every container has read its files (each leaves /read-done in
  # its root filesystem, which containerd mounts under its state).
  for _ in $(seq 600); do
    busy=0
    for i in $(seq 1 10); do
      [ -e "$d/state/io.containerd.runtime.v2.task/bench/s$n-$i/rootfs/read-done" ] || busy=1
    done
    [ "$busy" -eq 0 ] && break
    sleep 0.5
  done
  [ "$busy" -eq 0 ] || die "share ($mode): the containers did not finish reading in 5 minutes"
  case $mode in
    overlayfs) files_root=$d/root/io.containerd.snapshotter.v1.overlayfs ;;
    *) files_root=$d/store ;;
  esac
  cache=$(find "$files_root" -xdev -type f -print0 | xargs -0 -r fincore -b -n -o RES 2>/dev/null | awk '{ t += $1 } END { printf "%d", t }')
  printf 'share\t%s\t%s\t%s\t%s\n' "$mode" "$disk" "$content" "$cache" >>"$run_dir/share.tsv"
  say "share $mode: disk $disk, content store $content, page cache $cache"
  for i in $(seq 1 10); do
    ctr task kill -s SIGKILL "s$n-$i" >/dev/null 2>&1 || true
  done
  sleep 1
  for i in $(seq 1 10); do
    ctr task rm -f "s$n-$i" >/dev/null 2>&1 || true
    ctr containers rm "s$n-$i" >/dev/null 2>&1 || true
  done
  stop_all
  rm -rf "$d"
done

# ---------------------------------------------------------------- cold + warm
for img in "${images[@]}"; do
  ref=$registry/bench/$img:gzip
  for r in $(seq 1 "$runs"); do
    for mode in overlayfs normal remote; do
      n=$((n + 1))
      d=$run_dir/$n-$mode
      sn=$(sn_of "$mode")
      start "$d" "$mode"
      drop_caches
      t0=$(now)
      ctr image pull --plain-http --snapshotter "$sn" "$ref" >"$d/pull.out" 2>&1 || die "pull ($mode): $(tail -3 "$d/pull.out")"
      tp=$(since "$t0")
      ctr run --rm --snapshotter "$sn" "$ref" "c$n" /bin/true >"$d/run.out" 2>&1 || die "run ($mode): $(cat "$d/run.out")"
      tr=$(since "$t0")
      if [ "$mode" = remote ]; then
        k=$(grep -c "pulled by cairn" "$d/snapshotter.log" || true)
        [ "$k" -ge 1 ] || die "remote: no layer went through the remote path ($d/snapshotter.log)"
      fi
      w=()
      for i in 1 2 3; do
        t1=$(now)
        ctr run --rm --snapshotter "$sn" "$ref" "w$n-$i" /bin/true >/dev/null 2>&1 || die "warm run ($mode)"
        w+=("$(since "$t1")")
      done
      warm=$(printf '%s\n' "${w[@]}" | sort -n | sed -n 2p)
      printf '%s\t%s\t%s\t%s\t%s\n' "$img" "$mode" "$tp" "$tr" "$warm" >>"$samples"
      say "$img run $r $mode: pull ${tp}s, pull+run ${tr}s, warm run ${warm}s"
      stop_all
      rm -rf "$d"
    done
  done
done

{
  printf 'date\t%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'host\t%s\n' "$(nproc) cores, kernel $(uname -r), $(findmnt -no FSTYPE -T "$work") under $work"
  printf 'load\t%s\n' "load average $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end (other work runs on this machine)"
  printf 'versions\t%s\n' "containerd $("$bin/containerd" --version | awk '{ print $3 }'), runc $(runc --version | head -1 | awk '{ print $3 }'), cairn $("$cairn" --version | awk '{ print $2 }') ($cairn_given, $(git -C "$repo" log -1 --format=%h 2>/dev/null))"
  printf 'command\t%s\n' "bench/containerd.sh ${all_args[*]}"
  printf 'runs\t%s\n' "$runs"
} >"$run_dir/meta.tsv"
mkdir -p "$(dirname "$out")"
"$py" "$here/lib/report_ctd_snapshotter.py" "$run_dir" "${out%.md}.png" | tee "$out"
echo "wrote $out and ${out%.md}.png" >&2
