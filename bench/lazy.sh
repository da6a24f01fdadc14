#!/usr/bin/env bash
# Lazy images measured (issue 13, point 7): from nothing local to a
# command's completion, over a registry reached through a veth pair into a
# network namespace made here, shaped with tc netem (100 Mbit/s, 20 ms
# RTT) and unshaped. Four ways, each cold (page cache dropped, fresh store
# or directory), interleaved, medians of --runs:
#
#   classic        skopeo copy + umoci unpack + runc run (crun 1.8 refuses this host's hybrid cgroup layout)
#   cairn          cairn pull + cairn run
#   lazy           cairn pull --lazy + cairn run --lazy --lazy-fetch on-demand
#                  (an artifact pushed without a prefetch list)
#   lazy+list      the same from an artifact pushed with --prefetch, the list
#                  recorded by a first `cairn run --lazy --record-prefetch`
#
# Bytes fetched are counted on the host's end of the veth (received bytes:
# what the registry sent, TCP/IP headers included). Then, on the unshaped
# link, steady-state reads: the files the command opened, read again
# through a lazy mount of the lazy store (fetched, so read from the store directly) against
# the same files of a full pull's mount, cold and warm; and the peak RSS
# (VmHWM) after that of the lazy server's worker (the process that serves)
# and of its supervisor.
#
#   sudo bench/lazy.sh [--runs 3] [--only python,linux,model] [--links shaped,unshaped]
#       [--model-size 256M] [--cairn BIN] [--out bench/results/lazy.md]
#       [--work /var/tmp/cairn-bench-lazy] [--images /var/tmp/cairn-bench-containerd/images]
#       [--prepare-only] [--keep]
#
# Images (built once into --work/layers from the trees and layers that
# `bench/pull-containerd.sh --prepare-only` leaves in --images):
#   python  debian (debootstrap minbase) + python3 and numpy; `python3 -c 'import numpy'`
#   linux   debian + a Linux source tree under /usr/src/linux;
#           `ls -lR` of kernel/ and the head of the Makefile
#   model   debian + /models/model.bin (--model-size of incompressible bytes);
#           `dd` of 16 MiB from its middle, through sha256sum
# All gzip layers. The registry (Debian's docker-registry) runs inside the
# namespace; clients reach it at 127.0.0.1:PORT through socat, which
# forwards to the namespace's end of the veth (cairn takes loopback
# registries as plain HTTP). Needs root, socat, skopeo, umoci, runc, tc.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
all_args=("$@")
runs=3 only=python,linux,model links=shaped,unshaped model_size=256M keep=0 prepare_only=0
cairn=$repo/target/x86_64-unknown-linux-musl/release/cairn
out=$repo/bench/results/lazy.md
work=/var/tmp/cairn-bench-lazy
images=/var/tmp/cairn-bench-containerd/images

usage() { sed -n '2,/^# registries as plain/p' "$0" | sed 's/^# \{0,1\}//'; }
die() {
  echo "lazy.sh: $*" >&2
  exit 1
}
say() { echo "==> $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift ;;
    --only) only=$2; shift ;;
    --links) links=$2; shift ;;
    --model-size) model_size=$2; shift ;;
    --cairn) cairn=$(readlink -f "$2"); shift ;;
    --out) out=$2; shift ;;
    --work) work=$2; shift ;;
    --images) images=$2; shift ;;
    --prepare-only) prepare_only=1 ;;
    --keep) keep=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done
IFS=, read -r -a imgs <<<"$only"
IFS=, read -r -a link_list <<<"$links"
for i in "${imgs[@]}"; do case "$i" in python | linux | model) ;; *) die "--only: python, linux, model" ;; esac; done
for l in "${link_list[@]}"; do case "$l" in shaped | unshaped) ;; *) die "--links: shaped, unshaped" ;; esac; done
[ "$runs" -ge 1 ] || die "--runs must be at least 1"
[ "$(id -u)" -eq 0 ] || die "run as root (netns, mounts, drop_caches)"
for t in socat skopeo umoci runc tc ip docker-registry gzip openssl jq /usr/bin/time; do
  command -v "$t" >/dev/null || die "$t not found (apt-get install socat skopeo umoci runc iproute2 docker-registry jq time)"
done
py=/usr/bin/python3
blobs=$images/blobs
# shellcheck source-path=SCRIPTDIR source=lib/epoch.sh
. "$here/lib/epoch.sh"
epoch=$(bench_epoch) || exit 1
for b in debian python; do
  made_with_epoch "$blobs/$b.done" ||
    die "no $blobs/$b.tar.gz clamped to the Debian snapshot's date: run bench/pull-containerd.sh --prepare-only first"
done
[ -f "$images/linux-tree.done" ] || die "no $images/linux-tree: run bench/pull-containerd.sh --prepare-only first"

layers=$work/layers
layout=$work/layout

# ================================================================ images

# layer NAME: $layers/NAME.tar.gz and NAME.diffid from a tar on stdin.
layer_from_stdin() {
  local name=$1
  local tmp=$layers/$name.tar
  cat >"$tmp"
  echo "sha256:$(sha256sum "$tmp" | cut -d' ' -f1)" >"$layers/$name.diffid"
  stat -c %s "$tmp" >"$layers/$name.size"
  gzip -n -6 -c "$tmp" >"$layers/$name.tar.gz"
  rm "$tmp"
  echo "$epoch" >"$layers/$name.done"
}

build_layers() {
  mkdir -p "$layers"
  if ! made_with_epoch "$layers/linux.done"; then
    say "linux layer: $images/linux-tree under usr/src/linux (gzip -6, a few minutes)"
    tar -C "$images/linux-tree" --sort=name --numeric-owner --format=pax \
      --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      --mtime=@"$epoch" --clamp-mtime --transform 's,^\./*,usr/src/linux/,' -cf - . |
      layer_from_stdin linux
  fi
  if ! made_with_epoch "$layers/model-$model_size.done"; then
    say "model layer: models/model.bin, $model_size of AES-CTR keystream (incompressible, reproducible)"
    local t=$layers/model-tree
    rm -rf "$t"
    mkdir -p "$t/models"
    openssl enc -aes-128-ctr -nosalt -K 000102030405060708090a0b0c0d0e0f -iv 0 -in /dev/zero 2>/dev/null |
      head -c "$(numfmt --from=iec "$model_size")" >"$t/models/model.bin" || true
    [ "$(stat -c %s "$t/models/model.bin")" -eq "$(numfmt --from=iec "$model_size")" ] || die "model file short"
    tar -C "$t" --sort=name --numeric-owner --owner=0 --group=0 --mtime=@"$epoch" -cf - . |
      layer_from_stdin "model-$model_size"
    rm -rf "$t"
  fi
  local b
  for b in debian python; do
    made_with_epoch "$layers/$b.done" || {
      ln -f "$blobs/$b.tar.gz" "$layers/$b.tar.gz" 2>/dev/null || cp "$blobs/$b.tar.gz" "$layers/$b.tar.gz"
      cp "$blobs/$b.diffid" "$blobs/$b.size" "$layers/"
      echo "$epoch" >"$layers/$b.done"
    }
  done
}

layers_of() { case "$1" in python) echo "debian python" ;; linux) echo "debian linux" ;; model) echo "debian model-$model_size" ;; esac; }
cmd_json() {
  case "$1" in
    python) echo '["python3", "-c", "import numpy; print(numpy.__version__)"]' ;;
    linux) echo '["sh", "-c", "ls -lR /usr/src/linux/kernel | wc -l; head -6 /usr/src/linux/Makefile"]' ;;
    model) echo '["sh", "-c", "dd if=/models/model.bin bs=1M skip=100 count=16 status=none | sha256sum"]' ;;
  esac
}
# The command as arguments, one a line.
cmd_lines() { cmd_json "$1" | jq -r '.[]'; }

build_layout() {
  local img l specs
  for img in "${imgs[@]}"; do
    specs=()
    for l in $(layers_of "$img"); do
      specs+=("$layers/$l.tar.gz:$(cat "$layers/$l.diffid"):application/vnd.oci.image.layer.v1.tar+gzip")
    done
    "$py" "$here/lib/oci_layout.py" "$layout" "$img" "$(cmd_json "$img")" "${specs[@]}" >/dev/null
  done
}

# image_bytes IMG: compressed layer bytes (what a full pull fetches).
image_bytes() {
  local l t=0
  for l in $(layers_of "$1"); do t=$((t + $(stat -c %s "$layers/$l.tar.gz"))); done
  echo "$t"
}
tar_bytes() {
  local l t=0
  for l in $(layers_of "$1"); do t=$((t + $(cat "$layers/$l.size"))); done
  echo "$t"
}

# ================================================================ network

ns="" vh="" vn="" fwd_pid="" reg_pid="" registry="" run_dir=""
host_ip=10.231.0.1 ns_ip=10.231.0.2

net_up() {
  ns=cairn-lazy-$$
  vh=clzh$$ vn=clzn$$
  ip netns add "$ns"
  ip link add "$vh" type veth peer name "$vn"
  ip link set "$vn" netns "$ns"
  ip addr add "$host_ip/30" dev "$vh"
  ip link set "$vh" up
  ip -n "$ns" addr add "$ns_ip/30" dev "$vn"
  ip -n "$ns" link set "$vn" up
  ip -n "$ns" link set lo up
}

# shape LINK: rate on both ends of the veth with tbf (100 Mbit/s each way)
# and the forwarder on the host: socat unshaped, bench/lib/delay_proxy.py
# (10 ms each way, 20 ms RTT) shaped. With a netem qdisc (not in every
# kernel: this VM's has none) the delay would be netem's; the bench says
# which it used.
fwd_port="" delay_by=""
shape() {
  local l=$1
  if [ "$l" = shaped ]; then
    tc qdisc replace dev "$vh" root tbf rate 100mbit burst 64kb latency 200ms
    ip netns exec "$ns" tc qdisc replace dev "$vn" root tbf rate 100mbit burst 64kb latency 200ms
  else
    tc qdisc del dev "$vh" root 2>/dev/null || true
    ip netns exec "$ns" tc qdisc del dev "$vn" root 2>/dev/null || true
  fi
  forwarder "$l"
}

forwarder() {
  [ -z "$fwd_pid" ] || {
    kill "$fwd_pid" 2>/dev/null || true
    wait "$fwd_pid" 2>/dev/null || true
  }
  if [ "$1" = shaped ]; then
    "$py" "$here/lib/delay_proxy.py" "$fwd_port" "$ns_ip" 5000 10 >"$run_dir/forwarder.log" 2>&1 &
    delay_by="bench/lib/delay_proxy.py, 10 ms each way"
  else
    delay_by=""
    socat "TCP-LISTEN:$fwd_port,bind=127.0.0.1,reuseaddr,fork" "TCP:$ns_ip:5000" >"$run_dir/forwarder.log" 2>&1 &
  fi
  fwd_pid=$!
  for _ in $(seq 100); do
    if curl -sf "http://$registry/v2/" >/dev/null; then return; fi
    sleep 0.1
  done
  die "the registry did not answer through $registry ($1)"
}

registry_up() {
  local dir=$1 port
  mkdir -p "$dir"
  cat >"$dir/registry.yml" <<YML
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $dir/data
http:
  addr: $ns_ip:5000
YML
  ip netns exec "$ns" docker-registry serve "$dir/registry.yml" >"$dir/registry.log" 2>&1 &
  reg_pid=$!
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fwd_port=$port
  registry=127.0.0.1:$port
  for _ in $(seq 100); do
    if ip netns exec "$ns" curl -sf "http://$ns_ip:5000/v2/" >/dev/null; then return; fi
    sleep 0.1
  done
  die "the registry did not start (see $dir/registry.log)"
}

rx() { cat "/sys/class/net/$vh/statistics/rx_bytes"; }

umount_below() {
  local m
  while IFS= read -r m; do
    [ -n "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(findmnt -rn -o TARGET | grep -F "$1/" | sort -r)
}

cleanup() {
  [ -z "$fwd_pid" ] || kill "$fwd_pid" 2>/dev/null || true
  if [ -n "$reg_pid" ]; then
    kill "$reg_pid" 2>/dev/null || true
    wait "$reg_pid" 2>/dev/null || true
  fi
  # The registry runs under `ip netns exec`: its child may outlive the kill.
  [ -z "$ns" ] || ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  [ -z "$vh" ] || ip link del "$vh" 2>/dev/null || true
  [ -z "$ns" ] || ip netns del "$ns" 2>/dev/null || true
  if [ -n "$run_dir" ] && [ -d "$run_dir" ]; then
    umount_below "$run_dir"
    if [ "$keep" -eq 1 ]; then
      echo "kept $run_dir" >&2
    elif findmnt -rn -o TARGET | grep -qF "$run_dir/"; then
      echo "lazy.sh: still mounted under $run_dir; not removing it" >&2
    else
      rm -rf "$run_dir"
    fi
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ================================================================ samples

drop_caches() {
  sync
  echo 3 >/proc/sys/vm/drop_caches
}
n_fresh=0 fresh_dir=""
fresh() {
  n_fresh=$((n_fresh + 1))
  fresh_dir=$run_dir/s/$n_fresh-$1
  mkdir -p "$fresh_dir"
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

# Waits until no lazy server of the store at $1 is left: at most the
# runs' fetch timeout (10 min), then it is killed. A server outlives its
# command while it completes a large object the command read in part
# (the partial's read-behind) or the prefetch list; until session 27 the
# wait was 20 s, and what a server fetched after that was counted in the
# next sample's bytes (the model's lazy+list left about 40 MB to the next
# classic sample).
wait_lazy_gone() {
  local i pidf
  for i in $(seq 12000); do
    [ -z "$(ls -A "$1/lazy" 2>/dev/null)" ] && return 0
    sleep 0.05
  done
  echo "lazy.sh: warning: a lazy server of $1 is still there after 10 min: killed" >&2
  for pidf in "$1"/lazy/*.pid; do
    [ -e "$pidf" ] || continue
    awk '/^(supervisor|worker) / { print $2 }' "$pidf" | xargs -r kill -KILL 2>/dev/null || true
  done
}

samples="" steady=""
# record LINK IMG MODE RUN WALL BYTES
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$samples"; }

# check_output IMG FILE: the command printed what the classic run printed.
check_output() {
  local want=$run_dir/$1.want
  if [ ! -f "$want" ]; then
    cp "$2" "$want"
  elif ! cmp -s "$want" "$2"; then
    die "$1: output differs from the first run's: $(diff "$want" "$2" | head -5 | tr '\n' ' ')"
  fi
}

sample_classic() {
  local link=$1 img=$2 r=$3 d t0 t1 b0 b1 id
  fresh "classic-$img"
  d=$fresh_dir
  id=lazybench-$$-$n_fresh
  drop_caches
  b0=$(rx)
  t0=$(now)
  HOME=$d skopeo copy -q --src-tls-verify=false "docker://$registry/bench/$img:1" "oci:$d/oci:img" >"$d/log" 2>&1 ||
    die "skopeo copy failed: $(cat "$d/log")"
  umoci unpack --image "$d/oci:img" "$d/bundle" >>"$d/log" 2>&1 || die "umoci unpack failed: $(cat "$d/log")"
  jq --argjson args "$(cmd_json "$img")" '.process.args = $args | .process.terminal = false' \
    "$d/bundle/config.json" >"$d/config.json" && mv "$d/config.json" "$d/bundle/config.json"
  runc run --bundle "$d/bundle" "$id" >"$d/out" 2>>"$d/log" </dev/null || die "runc run failed: $(cat "$d/log")"
  t1=$(now)
  b1=$(rx)
  check_output "$img" "$d/out"
  record "$link" "$img" classic "$r" "$(elapsed "$t0" "$t1")" $((b1 - b0))
  rm -rf "$d/oci" "$d/bundle"
}

sample_cairn() {
  local link=$1 img=$2 r=$3 d t0 t1 b0 b1 ref=$registry/bench/$2:1
  fresh "cairn-$img"
  d=$fresh_dir
  mapfile -t cmd < <(cmd_lines "$img")
  drop_caches
  b0=$(rx)
  t0=$(now)
  "$cairn" --root "$d/store" -q pull "$ref" >"$d/log" 2>&1 || die "cairn pull failed: $(cat "$d/log")"
  "$cairn" --root "$d/store" -q run "$ref" "${cmd[@]}" >"$d/out" 2>>"$d/log" </dev/null || die "cairn run failed: $(cat "$d/log")"
  t1=$(now)
  b1=$(rx)
  check_output "$img" "$d/out"
  record "$link" "$img" cairn "$r" "$(elapsed "$t0" "$t1")" $((b1 - b0))
  rm -rf "$d/store"
}

# sample_lazy LINK IMG RUN MODE: MODE lazy (artifact without a list) or
# lazy+list. The store is kept (steady-state reads use the last one).
last_lazy=""
sample_lazy() {
  local link=$1 img=$2 r=$3 mode=$4 d t0 t1 b0 b1 repo=bench/$2
  [ "$mode" = lazy ] || repo=bench/$img-pf
  local ref=$registry/$repo:1
  fresh "$mode-$img"
  d=$fresh_dir
  mapfile -t cmd < <(cmd_lines "$img")
  drop_caches
  b0=$(rx)
  t0=$(now)
  "$cairn" --root "$d/store" -q pull --lazy "$ref" >"$d/log" 2>&1 || die "cairn pull --lazy failed: $(cat "$d/log")"
  "$cairn" --root "$d/store" -q run --lazy --lazy-fetch on-demand --fetch-timeout 10m "$ref" "${cmd[@]}" >"$d/out" 2>>"$d/log" </dev/null ||
    die "cairn run --lazy failed: $(cat "$d/log")"
  t1=$(now)
  b1=$(rx)
  check_output "$img" "$d/out"
  record "$link" "$img" "$mode" "$r" "$(elapsed "$t0" "$t1")" $((b1 - b0))
  wait_lazy_gone "$d/store"
  # What the server fetched after the command ended, before it exited.
  printf '%s\t%s\t%s\t%s\t%s\n' "$link" "$img" "$mode" "$r" $(($(rx) - b1)) >>"$run_dir/after.tsv"
  last_lazy=$d
}

# prepare_image IMG: pushed as bench/IMG:1 and bench/IMG-pf:1; a full pull
# in $run_dir/seed pushes the artifacts: bench/IMG:1-lazy without a list,
# bench/IMG-pf:1-lazy with the list a first lazy run recorded.
prepare_image() {
  local img=$1 seed=$run_dir/seed rec ref=$registry/bench/$1:1 pf=$registry/bench/$1-pf:1
  say "$img: pushing the image and its artifacts"
  HOME=$run_dir skopeo copy -q --dest-tls-verify=false "oci:$layout:$img" "docker://$ref"
  HOME=$run_dir skopeo copy -q --dest-tls-verify=false "oci:$layout:$img" "docker://$pf"
  "$cairn" --root "$seed" -q pull "$ref"
  "$cairn" --root "$seed" --json push "$ref" "$ref-lazy" >"$run_dir/$img.push.json"
  rec=$run_dir/rec-$img
  mapfile -t cmd < <(cmd_lines "$img")
  "$cairn" --root "$rec" -q pull --lazy "$ref"
  "$cairn" --root "$rec" -q run --lazy --lazy-fetch on-demand --fetch-timeout 10m --record-prefetch "$run_dir/$img.prefetch" \
    "$ref" "${cmd[@]}" >/dev/null </dev/null
  wait_lazy_gone "$rec"
  [ -s "$run_dir/$img.prefetch" ] || die "$img: no prefetch list recorded"
  "$cairn" --root "$seed" -q pull "$pf"
  "$cairn" --root "$seed" --json push --prefetch "$run_dir/$img.prefetch" "$pf" "$pf-lazy" >"$run_dir/$img.push-pf.json"
  rm -rf "$rec"
}

# steady IMG: the files of the prefetch list (what the command opened),
# read through a lazy mount of the last lazy+list store and through a full
# pull's mount: 7 cold reads of each, then $steady_warm warm reads of each
# in turn. Two sets, each a row of its own:
# - IMG: the files whose object the lazy store holds (every whole object
#   the list names: `pull --lazy` fetched them), read whole; a large file
#   read in part only if its object was completed and stored;
# - "IMG, read in part": large files the command read in part whose
#   object the lazy store does not hold (on demand, a partial object is
#   fetched only in the chunks asked for, and not stored), read in those
#   1 MiB chunks (list lines `path<TAB>chunks=0,6`): the lazy server
#   serves them from its memory of the chunks, or fetches them again.
# Until session 27 the second set was skipped without a word and the
# first was read the same way.
steady_warm=30
# The reading program: LABEL LIST cold REP KIND ROOT (one read, after the
# caller's drop) or LABEL LIST warm N KIND ROOT KIND ROOT (one untimed
# pass of each, then N timed passes of each in turn); a line a read:
# label, kind, cold|warm, rep, bytes, seconds. A whole-file line of the
# list is read whole, a `<TAB>chunks=` line in those 1 MiB chunks.
steady_py=$(
  cat <<'EOF'
import os, sys, time
label, listing, temp, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mounts = list(zip(sys.argv[5::2], sys.argv[6::2]))
CHUNK = 1 << 20  # cairn_remote::index::CHUNK_SIZE
reads = []  # (path, [(offset, length)] or None for the whole file)
for line in open(listing):
    line = line.rstrip("\n")
    if not line:
        continue
    path, _, chunks = line.partition("\tchunks=")
    spans = None
    if chunks:
        spans = []
        for part in chunks.split(","):
            a, _, b = part.partition("-")
            for i in range(int(a), int(b or a) + 1):
                spans.append((i * CHUNK, CHUNK))
    reads.append((path, spans))

def once(root):
    total = 0
    t = time.perf_counter()
    for p, spans in reads:
        try:
            fd = os.open(root + p, os.O_RDONLY)
        except (IsADirectoryError, FileNotFoundError):
            continue
        try:
            if spans is None:
                while b := os.read(fd, 1 << 20):
                    total += len(b)
            else:
                for off, ln in spans:
                    total += len(os.pread(fd, ln, off))
        except IsADirectoryError:
            pass
        finally:
            os.close(fd)
    return total, time.perf_counter() - t

if temp == "cold":
    (kind, root), = mounts
    total, secs = once(root)
    print(f"{label}\t{kind}\tcold\t{n}\t{total}\t{secs:.6f}")
else:
    for kind, root in mounts:
        once(root)
    for rep in range(1, n + 1):
        for kind, root in mounts:
            total, secs = once(root)
            print(f"{label}\t{kind}\twarm\t{rep}\t{total}\t{secs:.6f}")
EOF
)
sample_steady() {
  local img=$1 lazy=$last_lazy full ref_pf=$registry/bench/$1-pf:1 supervisor worker rep mnt set label
  fresh "full-$img"
  full=$fresh_dir
  "$cairn" --root "$full/store" -q pull "$ref_pf"
  mkdir -p "$full/mnt" "$lazy/mnt"
  "$cairn" --root "$full/store" -q mount "$ref_pf" "$full/mnt"
  # `lazy_server` is the supervisor (one thread, holds /dev/fuse, serves
  # nothing); the worker it forks serves, and `cairn lazy list` names it.
  supervisor=$("$cairn" --root "$lazy/store" --json mount --lazy --lazy-fetch on-demand "$ref_pf" "$lazy/mnt" | jq -r '.lazy_server // empty')
  # (The supervisor notes its worker just after forking it: a few tries.)
  worker=""
  if [ -n "$supervisor" ]; then
    for _ in $(seq 1 50); do
      worker=$("$cairn" --root "$lazy/store" lazy list --json |
        jq -r --argjson s "$supervisor" '.[] | select(.supervisor == $s) | .worker')
      [ -z "$worker" ] || break
      sleep 0.1
    done
  fi
  "$cairn" --root "$lazy/store" dump "$ref_pf" >"$run_dir/$img.dump"
  "$py" - "$run_dir/$img.dump" "$run_dir/$img.prefetch" "$lazy/store/objects" "$run_dir/$img.stored" "$run_dir/$img.inpart" <<'EOF'
import os, re, sys
dump, listing, objects, stored, inpart = sys.argv[1:]
unescape = lambda s: re.sub(rb"\\x([0-9a-fA-F]{2})|\\(.)", lambda m: bytes([int(m[1], 16)]) if m[1] else m[2], s)
backing = {}
for line in open(dump, "rb"):
    f = line.rstrip(b"\n").split(b" ")
    if len(f) > 8 and len(f[8]) == 65 and f[8][2:3] == b"/":
        backing[unescape(f[0])] = f[8].decode()
with open(stored, "wb") as a, open(inpart, "wb") as b:
    for line in open(listing, "rb"):
        path = line.rstrip(b"\n").split(b"\t")[0]
        obj = backing.get(path)
        local = obj is None or os.path.exists(os.path.join(objects, obj))
        (a if local or b"\tchunks=" not in line else b).write(line)
EOF
  for set in stored inpart; do
    [ -s "$run_dir/$img.$set" ] || continue
    label=$img
    [ "$set" = stored ] || label="$img, read in part"
    # Cold: caches dropped before each read; 7 of each (with 3, a few ms
    # of disk noise moved the model's 2.4 MB row between 0.91x and 1.14x).
    for rep in 1 2 3 4 5 6 7; do
      for mnt in local:"$full/mnt" lazy:"$lazy/mnt"; do
        drop_caches
        "$py" - "$label" "$run_dir/$img.$set" cold "$rep" "${mnt%%:*}" "${mnt#*:}" <<<"$steady_py" >>"$steady"
      done
    done
    # Warm: every file in the page cache through both mounts, then the two
    # mounts read in turn, so that drift in the machine's speed falls on
    # both alike (until session 27 each mount's warm reads followed its own
    # cold read in a process of their own, a few ms apart, and the python
    # figure swung between 0.78x and 1.02x from one run to the next).
    "$py" - "$label" "$run_dir/$img.$set" warm "$steady_warm" local "$full/mnt" lazy "$lazy/mnt" <<<"$steady_py" >>"$steady"
  done
  local hwm="" sup_hwm=""
  [ -z "$worker" ] || hwm=$(awk '/^VmHWM/ { print $2 }' "/proc/$worker/status" 2>/dev/null || true)
  [ -z "$supervisor" ] || sup_hwm=$(awk '/^VmHWM/ { print $2 }' "/proc/$supervisor/status" 2>/dev/null || true)
  printf "server %s\t%s KiB peak RSS (VmHWM) of the lazy server's worker (its supervisor: %s KiB) after reading its files %s times\n" "$img" "${hwm:-?}" "${sup_hwm:-?}" "$((7 + 1 + steady_warm)) (each set)" >>"$run_dir/meta.tsv"
  "$cairn" --root "$lazy/store" -q umount "$lazy/mnt"
  "$cairn" --root "$full/store" -q umount "$full/mnt"
}

# ================================================================ main

build_layers
build_layout
[ "$prepare_only" -eq 0 ] || {
  say "layers and layout ready in $work"
  exit 0
}
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn BIN)"
mkdir -p "$work"
chattr +T "$work" 2>/dev/null || true
run_dir=$work/run-$(date +%s)-$$
mkdir -p "$run_dir/s"
samples=$run_dir/samples.tsv steady=$run_dir/steady.tsv
: >"$samples"
: >"$steady"
: >"$run_dir/meta.tsv"
cp "$cairn" "$run_dir/cairn"
cairn_given=$cairn
cairn=$run_dir/cairn
busy_before=$(top -b -n 2 -d 1 -w 200 | awk '/^ *PID/ { frame++; next } frame == 2 && $9 + 0 >= 5 { printf "%s %s%%, ", $12, $9 }' | sed 's/, $//')
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

net_up
registry_up "$run_dir/registry"
shape unshaped
say "registry in netns $ns at $ns_ip:5000, reached at $registry"
for img in "${imgs[@]}"; do prepare_image "$img"; done

for link in "${link_list[@]}"; do
  shape "$link"
  say "link: $link ($(tc qdisc show dev "$vh" | head -1); ${delay_by:-no delay})"
  for img in "${imgs[@]}"; do
    for r in $(seq 1 "$runs"); do
      sample_classic "$link" "$img" "$r"
      sample_cairn "$link" "$img" "$r"
      sample_lazy "$link" "$img" "$r" lazy
      sample_lazy "$link" "$img" "$r" lazy+list
      say "  $link $img run $r: $(awk -F'\t' -v l="$link" -v i="$img" -v r="$r" '$1 == l && $2 == i && $4 == r { printf "%s %ss %.1fMB, ", $3, $5, $6 / 1e6 }' "$samples")"
    done
    if [ "$link" = unshaped ]; then sample_steady "$img"; fi
    umount_below "$run_dir/s"
    rm -rf "$run_dir/s"
    mkdir "$run_dir/s"
  done
done
shape unshaped

{
  printf 'date\t%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'host\t%s\n' "$(nproc) cores, kernel $(uname -r), $(findmnt -no FSTYPE -T "$work") under $work"
  printf 'load\t%s\n' "load average $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end; busy processes at the start: ${busy_before:-none}"
  printf 'versions\t%s\n' "cairn $("$cairn" --version | awk '{ print $2 }') ($cairn_given, built $(date -u -r "$cairn_given" '+%Y-%m-%d %H:%M UTC')); skopeo $(skopeo --version | awk '{ print $3 }'); umoci $(umoci --version | awk '{ print $3 }'); runc $(runc --version | head -1 | awk '{ print $3 }')"
  printf 'command\t%s\n' "bench/lazy.sh ${all_args[*]}"
  printf 'link\t%s\n' "shaped: tbf rate 100mbit on both ends of the veth, and 10 ms each way added by bench/lib/delay_proxy.py (this kernel has no netem qdisc); unshaped: no qdisc, socat"
  printf 'runs\t%s\n' "$runs"
  for img in "${imgs[@]}"; do
    printf 'image %s\t%s\t%s\t%s\t%s\t%s\n' "$img" "$(image_bytes "$img")" "$(tar_bytes "$img")" \
      "$(jq -r .pack_bytes "$run_dir/$img.push.json")" "$(wc -l <"$run_dir/$img.prefetch")" "$(cmd_json "$img" | jq -c .)"
  done
} >>"$run_dir/meta.tsv"
mkdir -p "$(dirname "$out")"
"$py" "$here/lib/report_lazy.py" "$run_dir" "${out%.md}.png" | tee "$out"
echo "wrote $out and ${out%.md}.png" >&2
