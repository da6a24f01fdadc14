#!/usr/bin/env bash
# The containerd snapshotter benchmark (issue 14, part 5): containerd (2.4.2,
# or Debian's 1.6 with --containerd 1.6) with its overlayfs snapshotter
# against `cairn snapshotter`, on three paths:
#   normal       containerd fetches and unpacks, cairn imports on Commit;
#   remote       cairn pulls the layers itself (`--no-lazy`); containerd
#                passes the CRI layer labels: 2.4's transfer service
#                because the proxy plugin exports
#                enable_remote_snapshot_annotations (`ctr image pull`), 1.6
#                through the CRI's label handler in a small Go client
#                (tests/containerd-rpull, built here in GOPATH mode);
#   remote lazy  the same pull of an image that has a cairn lazy artifact
#                (pushed by the prepare stage, with a prefetch list recorded
#                by `cairn run --lazy --record-prefetch` of the image's
#                command), the snapshotter started `--lazy-fetch on-demand`:
#                only the metadata and the prefetch list's files are pulled,
#                the rest is fetched as it is read.
#
# Figures, medians of --runs interleaved cold samples (page cache dropped,
# fresh containerd root and cairn store each):
#   - cold `ctr image pull` and `ctr run --rm IMAGE ID /bin/true` after it;
#   - warm `ctr run --rm IMAGE ID /bin/true` (the image pulled, its pull's
#     writeback and background removals done: `quiet_after_pull`; the
#     median of --warm starts, 7 by default: the figures differ by 20-30
#     ms, and a median of 3 moved by 0.1x between runs);
#   - cold pull and a first run of the image's command (python:
#     `python3 -c 'import numpy'`; linux: `ls -lR` of kernel/ and the head
#     of the Makefile), separate samples;
#   - bytes the registry sent for each cold sample (its access log);
#   - disk used by three images that share most files (the python image's
#     two layers re-tarred with three different mtimes: every layer differs,
#     the files' contents do not): overlayfs's snapshots against cairn's
#     store (objects, EROFS images, records), containerd's content store
#     separately;
#   - page cache of ten containers of those three images reading the same
#     files (`fincore` over the snapshotter's backing files).
# Images: python (debian + python3 and numpy) and linux (debian + a Linux
# source tree under /usr/src/linux), gzip, built from bench/pull-containerd.sh's
# trees and layers (it is run with --prepare-only if they are missing) and
# pushed to its registry storage with their lazy artifacts (bench/IMG-lazy).
#
#   sudo bench/containerd.sh [--runs N] [--only python,linux] [--containerd 2.4|1.6]
#                            [--warm N] [--cairn BIN] [--out FILE] [--work DIR]
#                            [--settle SECS]
#
# A round's samples (the four paths, each with its /bin/true and its
# command sample) are deleted together at the round's end, then the script
# pauses --settle seconds (default 60) before the next round: journal-less
# ext4 makes every file created within about a minute of many deletions
# slow (`recently_deleted()`, docs/machines.md), which charged each sample
# for the one deleted just before it, also under `chattr +T`. The normal
# path deletes too (each Commit empties the snapshot directory containerd
# unpacked into, tens of thousands of files for the Linux tree): its
# samples come last in a round, each followed by the pause.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
all_args=("$@")
runs=3 warm_runs=7 only=python ctd_version=2.4 settle=60
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
    --warm) warm_runs=$2; shift ;;
    --only) only=$2; shift ;;
    --cairn) cairn=$(readlink -f "$2"); shift ;;
    --out) out=$2; shift ;;
    --work) work=$2; shift ;;
    --containerd) ctd_version=$2; shift ;;
    --settle) settle=$2; shift ;;
    -h | --help) sed -n '2,/^#  *\[--cairn/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done
IFS=, read -r -a images <<<"$only"
for img in "${images[@]}"; do case "$img" in python | linux) ;; *) die "--only: python, linux" ;; esac; done
case "$ctd_version" in 1.6 | 2.4) ;; *) die "--containerd: 1.6 (Debian's) or 2.4 (2.4.2)" ;; esac
[[ "$warm_runs" =~ ^[1-9][0-9]*$ ]] || die "--warm: a number of starts, at least 1"
[[ "$settle" =~ ^[0-9]+$ ]] || die "--settle: a number of seconds"
[ "$(id -u)" -eq 0 ] || die "run as root"
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn BIN)"

# shellcheck source-path=SCRIPTDIR source=lib/registry.sh
. "$here/lib/registry.sh"
# shellcheck source-path=SCRIPTDIR source=lib/containerd2.sh
. "$here/lib/containerd2.sh"
py=/usr/bin/python3
if [ "$ctd_version" = 2.4 ]; then
  bin=$CONTAINERD2_BIN
  install_containerd2 || die "installing containerd $CONTAINERD2_VERSION failed"
else
  bin=/usr/bin
  [ -x /usr/bin/containerd ] || die "no /usr/bin/containerd (apt-get install containerd)"
fi

# The layers (pull-containerd.sh's cache): debian and python for both
# images, the Linux tree for linux.
blobs=$work/images/blobs
# shellcheck source-path=SCRIPTDIR source=lib/epoch.sh
. "$here/lib/epoch.sh"
epoch=$(bench_epoch) || exit 1
# What the registry's storage keeps from earlier runs (the linux image, the
# lazy artifacts and their lists) was made from layers of one epoch: from
# another, it goes.
if ! made_with_epoch "$work/registry/epoch"; then
  rm -rf "$work/registry/data/docker/registry/v2/repositories/bench" "$work/registry"/*.prefetch
  mkdir -p "$work/registry"
fi
for img in "${images[@]}"; do
  case $img in
    python)
      { made_with_epoch "$blobs/python.done" &&
        [ -d "$work/registry/data/docker/registry/v2/repositories/bench/python/_manifests/tags/gzip" ]; } ||
        "$here/pull-containerd.sh" --prepare-only --only python --compression gzip --work "$work" --cairn "$cairn"
      ;;
    linux)
      { [ -f "$work/images/linux-tree.done" ] && made_with_epoch "$blobs/debian.done"; } ||
        "$here/pull-containerd.sh" --prepare-only --only linux,debian --compression gzip --work "$work" --cairn "$cairn"
      ;;
  esac
done
echo "$epoch" >"$work/registry/epoch"

# The 1.6 client that pulls with the CRI's labels (remote and lazy paths).
rpull=""
if [ "$ctd_version" = 1.6 ]; then
  gopath=/usr/share/gocode
  [ -d "$gopath/src/github.com/containerd/containerd/pkg/snapshotters" ] ||
    die "no containerd 1.6 sources in $gopath (apt-get install golang-github-containerd-containerd-dev)"
  go=$(containerd2_go)
  mkdir -p "$work/rpull"
  rpull=$work/rpull/rpull
  (cd "$repo/tests/containerd-rpull" && GO111MODULE=off GOPATH=$gopath GOFLAGS="" GOCACHE=$work/rpull/cache \
    "$go" build -o "$rpull" .) || die "building tests/containerd-rpull"
fi

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
  # A lazy chain mount's server exits once its mount is gone (it removes
  # its pid file under the store's lazy/ as it goes).
  for _ in $(seq 100); do
    compgen -G "$run_dir/*/store/lazy/*.pid" >/dev/null || break
    sleep 0.1
  done
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
# settle_now: the pause after deleting samples (see the top of this file).
settle_now() {
  [ "$settle" -gt 0 ] || return 0
  say "waiting ${settle}s (inodes freed by the deleted samples)"
  sleep "$settle"
}

# start D MODE: containerd in D; MODE overlayfs, normal, remote or lazy
# (the last three with `cairn snapshotter` on D/store).
start() {
  local d=$1 mode=$2 snap_args=()
  mkdir -p "$d"
  sock=$d/containerd.sock
  case $mode in
    remote) snap_args=(--no-lazy) ;;
    lazy) snap_args=(--lazy-fetch on-demand) ;;
  esac
  if [ "$mode" != overlayfs ]; then
    CAIRN_LOG=info "$cairn" --root "$d/store" snapshotter --address "$d/cairn.sock" "${snap_args[@]}" 2>"$d/snapshotter.log" &
    snap_pid=$!
    for _ in $(seq 200); do [ -S "$d/cairn.sock" ] && break; sleep 0.05; done
    [ -S "$d/cairn.sock" ] || die "cairn snapshotter did not start ($d/snapshotter.log)"
  fi
  if [ "$ctd_version" = 1.6 ]; then
    cat >"$d/config.toml" <<EOF
version = 2
root = "$d/root"
state = "$d/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/opt"
[proxy_plugins.cairn]
  type = "snapshot"
  address = "$d/cairn.sock"
EOF
  else
    local remote=0
    case $mode in remote | lazy) remote=1 ;; esac
    containerd2_cairn_config "$d" "$sock" "$d/cairn.sock" "$remote" >"$d/config.toml"
  fi
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
# pull MODE REF: containerd pulls (and unpacks) REF for MODE. containerd
# 1.6's `ctr image pull` sets no CRI labels: the remote paths pull there
# with the Go client that does.
pull() {
  if [ "$ctd_version" = 1.6 ] && { [ "$1" = remote ] || [ "$1" = lazy ]; }; then
    "$rpull" "$sock" bench cairn "$2"
  else
    ctr image pull --plain-http --snapshotter "$(sn_of "$1")" "$2"
  fi
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
# Bytes the registry sent since access-log line $1 (response bodies).
access_lines() { wc -l <"$work/registry/access.log"; }
sent_since() {
  sleep 0.2
  tail -n +"$(($1 + 1))" "$work/registry/access.log" | awk '$10 ~ /^[0-9]+$/ { t += $10 } END { printf "%d", t }'
}

# Every sample makes a fresh containerd root and cairn store. `chattr +T`
# asks ext4 to spread each new sample directory over block groups of its
# own; it does not hide the inodes freed a moment ago (docs/machines.md,
# `recently_deleted()`), hence the deletions once a round and --settle.
chattr +T "$work" 2>/dev/null || true
mkdir -p "$run_dir"
chattr +T "$run_dir" 2>/dev/null || true
samples=$run_dir/samples.tsv cmds=$run_dir/cmd.tsv
: >"$samples"
: >"$cmds"
cp "$cairn" "$run_dir/cairn.bin"
cairn_given=$cairn cairn=$run_dir/cairn.bin
registry_start "$work/registry" accesslog
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
n=0
layout=$run_dir/layout

# ---------------------------------------------------------------- images
# repo_of IMG: its repository (bench/linux is pull-containerd.sh's bare
# Linux tree, which has no /bin/true: the linux image here is bench/linuxsrc).
repo_of() { case "$1" in python) echo bench/python ;; linux) echo bench/linuxsrc ;; esac; }
cmd_json() {
  case "$1" in
    python) echo '["python3", "-c", "import numpy"]' ;;
    linux) echo '["sh", "-c", "ls -lR /usr/src/linux/kernel | wc -l; head -6 /usr/src/linux/Makefile"]' ;;
  esac
}
cmd_lines() { "$py" -c 'import json, sys; print("\n".join(json.loads(sys.argv[1])))' "$(cmd_json "$1")"; }
tag_exists() { [ -d "$work/registry/data/docker/registry/v2/repositories/$1/_manifests/tags/$2" ]; }
skopeo_copy() { HOME=$run_dir skopeo copy -q --preserve-digests --src-tls-verify=false --dest-tls-verify=false "$@"; }

# The linux image: debian + the Linux tree under usr/src/linux (gzip -6,
# as bench/lazy.sh builds it).
if [[ " ${images[*]} " == *" linux "* ]] && ! tag_exists bench/linuxsrc gzip; then
  if ! made_with_epoch "$blobs/linuxsrc.done"; then
    say "linux image: $work/images/linux-tree under usr/src/linux (gzip -6, a few minutes)"
    tar -C "$work/images/linux-tree" --sort=name --numeric-owner --format=pax \
      --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      --mtime=@"$epoch" --clamp-mtime --transform 's,^\./*,usr/src/linux/,' -cf "$blobs/linuxsrc.tar" .
    echo "sha256:$(sha256sum "$blobs/linuxsrc.tar" | cut -d' ' -f1)" >"$blobs/linuxsrc.diffid"
    gzip -n -6 -f "$blobs/linuxsrc.tar"
    echo "$epoch" >"$blobs/linuxsrc.done"
  fi
  gz=application/vnd.oci.image.layer.v1.tar+gzip
  "$py" "$here/lib/oci_layout.py" "$work/images/layout" linuxsrc-gzip '["/bin/sh"]' \
    "$blobs/debian.tar.gz:$(cat "$blobs/debian.diffid"):$gz" "$blobs/linuxsrc.tar.gz:$(cat "$blobs/linuxsrc.diffid"):$gz" >/dev/null
  skopeo_copy "oci:$work/images/layout:linuxsrc-gzip" "docker://$registry/bench/linuxsrc:gzip"
fi

# The lazy images: IMG copied to IMG-lazy, with a cairn lazy artifact
# (`cairn push`) whose prefetch list is what the image's command opened in
# a first lazy run (recorded on a scratch copy, IMG-rec, with an artifact
# without a list). Kept in the registry's storage for later runs.
for img in "${images[@]}"; do
  r=$(repo_of "$img")
  tag_exists "$r-lazy" gzip-lazy && continue
  say "$img: pushing its lazy artifact (and recording its prefetch list)"
  seed=$run_dir/seed-$img rec=$run_dir/rec-$img list=$run_dir/$img.prefetch
  skopeo_copy "docker://$registry/$r:gzip" "docker://$registry/$r-rec:gzip"
  skopeo_copy "docker://$registry/$r:gzip" "docker://$registry/$r-lazy:gzip"
  "$cairn" --root "$seed" -q pull "$registry/$r-rec:gzip"
  "$cairn" --root "$seed" -q push "$registry/$r-rec:gzip" "$registry/$r-rec:gzip-lazy"
  "$cairn" --root "$rec" -q pull --lazy "$registry/$r-rec:gzip"
  mapfile -t cmd < <(cmd_lines "$img")
  "$cairn" --root "$rec" -q run --lazy --lazy-fetch on-demand --fetch-timeout 10m --record-prefetch "$list" \
    "$registry/$r-rec:gzip" "${cmd[@]}" >/dev/null </dev/null || die "$img: the recording run failed"
  for _ in $(seq 200); do
    compgen -G "$rec/lazy/*.pid" >/dev/null || break
    sleep 0.1
  done
  [ -s "$list" ] || die "$img: no prefetch list recorded"
  "$cairn" --root "$seed" -q pull "$registry/$r-lazy:gzip"
  "$cairn" --root "$seed" -q push --prefetch "$list" "$registry/$r-lazy:gzip" "$registry/$r-lazy:gzip-lazy"
  cp "$list" "$work/registry/$img.prefetch"
  rm -rf "$seed" "$rec"
done

# ---------------------------------------------------------------- sharing
# Three images: the python image's two layers re-tarred with mtimes
# epoch+1..3 (so every layer blob and diff_id differs, the file contents
# do not).
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
made_with_epoch "$blobs/python.done" || die "no python layer of this epoch in $blobs"

# The files every container reads: python3 and numpy's modules.
read_cmd='find /usr/lib/python3 /usr/lib/python3.11 -type f -name "*.py" -o -type f -name "*.so" | xargs cat >/dev/null; touch /read-done; sleep 600'
for mode in overlayfs normal remote; do
  n=$((n + 1))
  d=$run_dir/$n-share-$mode
  sn=$(sn_of "$mode")
  start "$d" "$mode"
  for ref in "${share_refs[@]}"; do
    pull "$mode" "$ref" >"$d/pull.out" 2>&1 || die "pull $ref ($mode)"
  done
  # The snapshotter empties the directories of committed snapshots in the
  # background (snapshots/tmp/rm.*): the disk figure is taken once it has.
  for _ in $(seq 600); do
    compgen -G "$d/store/snapshots/tmp/rm.*" >/dev/null || break
    sleep 0.1
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
settle_now

# ---------------------------------------------------------------- cold + warm
# quiet_after_pull D: before the warm starts, every path waits until what
# its cold pull left running is done: the page cache written back (`sync`)
# and, on the cairn paths, the snapshotter's background removal of the
# directories containerd unpacked into (snapshots/tmp/rm.*, the normal
# path: tens of thousands of files for the Linux image). A warm start then
# measures the start of an image in place, not its pull's leftovers, for
# the overlayfs snapshotter as for cairn. (Before session 42 the warm
# starts followed the cold run at once.)
quiet_after_pull() {
  for _ in $(seq 600); do
    compgen -G "$1/store/snapshots/tmp/rm.*" >/dev/null || break
    sleep 0.1
  done
  sync
}
# check_path D MODE: the pull took the path MODE names (the snapshotter's log).
check_path() {
  local k
  case $2 in
    remote)
      k=$(grep -c "pulled by cairn" "$1/snapshotter.log" || true)
      [ "$k" -ge 1 ] || die "remote: no layer went through the remote path ($1/snapshotter.log)"
      ;;
    lazy)
      k=$(grep -c "pulled lazily by cairn" "$1/snapshotter.log" || true)
      [ "$k" -ge 1 ] || die "lazy: no layer was pulled lazily ($1/snapshotter.log: $(grep -m1 'not lazily' "$1/snapshotter.log"))"
      ;;
  esac
}
# check_output IMG FILE: the command printed what the first sample printed.
check_output() {
  local want=$run_dir/$1.want
  if [ ! -f "$want" ]; then
    cp "$2" "$want"
  elif ! cmp -s "$want" "$2"; then
    die "$1: output differs from the first sample's: $(diff "$want" "$2" | head -5 | tr '\n' ' ')"
  fi
}
modes=(overlayfs remote lazy normal)
done_dirs=()
for img in "${images[@]}"; do
  mapfile -t cmd < <(cmd_lines "$img")
  for r in $(seq 1 "$runs"); do
    for mode in "${modes[@]}"; do
      ref=$registry/$(repo_of "$img"):gzip
      [ "$mode" != lazy ] || ref=$registry/$(repo_of "$img")-lazy:gzip
      sn=$(sn_of "$mode")
      # Pull, /bin/true, warm starts.
      n=$((n + 1))
      d=$run_dir/$n-$mode
      start "$d" "$mode"
      drop_caches
      a0=$(access_lines)
      t0=$(now)
      pull "$mode" "$ref" >"$d/pull.out" 2>&1 || die "pull ($mode): $(tail -3 "$d/pull.out")"
      tp=$(since "$t0")
      ctr run --rm --snapshotter "$sn" "$ref" "c$n" /bin/true >"$d/run.out" 2>&1 || die "run ($mode): $(cat "$d/run.out")"
      tr=$(since "$t0")
      bytes=$(sent_since "$a0")
      check_path "$d" "$mode"
      quiet_after_pull "$d"
      w=()
      for i in $(seq 1 "$warm_runs"); do
        t1=$(now)
        ctr run --rm --snapshotter "$sn" "$ref" "w$n-$i" /bin/true >/dev/null 2>&1 || die "warm run ($mode)"
        w+=("$(since "$t1")")
      done
      warm=$(printf '%s\n' "${w[@]}" | sort -n | sed -n "$(((warm_runs + 1) / 2))p")
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$img" "$mode" "$tp" "$tr" "$warm" "$bytes" >>"$samples"
      say "$img run $r $mode: pull ${tp}s, pull+run ${tr}s, warm run ${warm}s, ${bytes} bytes from the registry"
      stop_all
      done_dirs+=("$d")
      [ "$mode" != normal ] || settle_now
      # Pull and the image's command.
      n=$((n + 1))
      d=$run_dir/$n-$mode-cmd
      start "$d" "$mode"
      drop_caches
      a0=$(access_lines)
      t0=$(now)
      pull "$mode" "$ref" >"$d/pull.out" 2>&1 || die "pull ($mode): $(tail -3 "$d/pull.out")"
      ctr run --rm --snapshotter "$sn" "$ref" "x$n" "${cmd[@]}" >"$d/run.out" 2>"$d/run.err" || die "run ($mode): $(cat "$d/run.err")"
      tc=$(since "$t0")
      bytes=$(sent_since "$a0")
      check_path "$d" "$mode"
      check_output "$img" "$d/run.out"
      printf '%s\t%s\t%s\t%s\n' "$img" "$mode" "$tc" "$bytes" >>"$cmds"
      say "$img run $r $mode: pull + $(cmd_json "$img") ${tc}s, ${bytes} bytes from the registry"
      stop_all
      done_dirs+=("$d")
    done
    rm -rf "${done_dirs[@]}"
    done_dirs=()
    [ "$r" -eq "$runs" ] || settle_now
  done
  [ "$img" = "${images[-1]}" ] || settle_now
done

{
  printf 'date\t%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'host\t%s\n' "$(nproc) cores, kernel $(uname -r), $(findmnt -no FSTYPE -T "$work") under $work"
  printf 'load\t%s\n' "load average $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end (other work runs on this machine)"
  printf 'containerd\t%s\n' "$("$bin/containerd" --version | awk '{ print $3 }')"
  printf 'versions\t%s\n' "containerd $("$bin/containerd" --version | awk '{ print $3 }'), runc $(runc --version | head -1 | awk '{ print $3 }'), cairn $("$cairn" --version | awk '{ print $2 }') ($cairn_given, $(git -C "$repo" log -1 --format=%h 2>/dev/null))"
  printf 'command\t%s\n' "bench/containerd.sh ${all_args[*]}"
  printf 'runs\t%s\n' "$runs"
  printf 'warm\t%s\n' "$warm_runs"
  printf 'settle\t%s\n' "$settle"
  for img in "${images[@]}"; do
    printf 'cmd %s\t%s\n' "$img" "$(cmd_json "$img")"
    printf 'prefetch %s\t%s\n' "$img" "$(wc -l <"$work/registry/$img.prefetch" 2>/dev/null || echo '?')"
  done
} >"$run_dir/meta.tsv"
mkdir -p "$(dirname "$out")"
"$py" "$here/lib/report_ctd_snapshotter.py" "$run_dir" "${out%.md}.png" | tee "$out"
echo "wrote $out and ${out%.md}.png" >&2
