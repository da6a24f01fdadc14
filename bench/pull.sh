#!/usr/bin/env bash
# Pull benchmark: `cairn pull` against a classic unpack (download each layer
# blob, gunzip | tar -x into its own directory, as containerd's overlayfs
# snapshotter does) and against `skopeo copy` + `umoci unpack`, all from a
# local docker-registry on 127.0.0.1. Medians of N runs, ratios against the
# classic unpack measured in the same run.
#
#   sudo bench/pull.sh TREE [--runs 5] [--layers 4] [--jobs 3] [--out FILE]
#                           [--cairn BIN] [--work DIR] [--keep]
#
# TREE is split into LAYERS gzip layers (directories and the first files in
# the first layer, the other files in size order across the rest) to make
# three images: base (all layers but the last), full (all), and other (base
# plus a rebuilt top layer: the last layer's files and one more).
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
runs=5 layers=4 jobs=3 out="" keep=0
cairn="$repo/target/x86_64-unknown-linux-musl/release/cairn"
work=/var/tmp/cairn-bench-pull

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
die() {
  echo "pull.sh: $*" >&2
  exit 1
}

[ $# -ge 1 ] || {
  usage
  exit 2
}
case "$1" in -h | --help)
  usage
  exit 0
  ;;
esac
tree=$(readlink -f "$1")
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --runs)
      runs=$2
      shift
      ;;
    --layers)
      layers=$2
      shift
      ;;
    --jobs)
      jobs=$2
      shift
      ;;
    --out)
      out=$2
      shift
      ;;
    --cairn)
      cairn=$(readlink -f "$2")
      shift
      ;;
    --work)
      work=$2
      shift
      ;;
    --keep) keep=1 ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done

[ "$(id -u)" -eq 0 ] || die "run as root (the classic unpack keeps owners and device nodes)"
[ -d "$tree" ] || die "$tree is not a directory"
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn BIN)"
[ "$layers" -ge 2 ] || die "--layers must be at least 2"
for t in docker-registry skopeo umoci curl tar gzip sha256sum python3; do
  command -v "$t" >/dev/null || die "$t not found (sudo ./setup.sh installs it)"
done

mkdir -p "$work"
chattr +T "$work" 2>/dev/null || true
run="$work/run-$(date +%s)-$$"
mkdir "$run"
# shellcheck source-path=SCRIPTDIR source=lib/registry.sh
. "$here/lib/registry.sh"
cleanup() {
  registry_stop
  if [ "$keep" -eq 0 ]; then rm -rf "$run"; else echo "kept $run" >&2; fi
}
trap cleanup EXIT

now() { date +%s.%N; }
since() { awk -v s="$1" -v e="$(now)" 'BEGIN { printf "%.3f", e - s }'; }
median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }'; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
# Physical bytes (allocated blocks) under the given paths, hardlinks once.
du_bytes() { du -s --block-size=1 -c "$@" | tail -1 | cut -f1; }

# ---------------------------------------------------------------- layers
echo "==> splitting $tree into $layers layers" >&2
mkdir -p "$run/lists" "$run/blobs"
(cd "$tree" && find . -mindepth 1 -type d | LC_ALL=C sort) >"$run/lists/dirs"
(cd "$tree" && find . -mindepth 1 ! -type d -printf '%s\t%p\n' | LC_ALL=C sort -k2) >"$run/lists/files"
awk -F'\t' -v n="$layers" -v dir="$run/lists" '
  { size[NR] = $1; path[NR] = $2; total += $1 }
  END {
    per = total / n
    for (i = 1; i <= NR; i++) {
      l = int(cum / per); if (l >= n) l = n - 1
      print path[i] > (dir "/layer" l)
      cum += size[i]
    }
  }' "$run/lists/files"
cat "$run/lists/dirs" "$run/lists/layer0" >"$run/lists/layer0.all"
mv "$run/lists/layer0.all" "$run/lists/layer0"
for i in $(seq 1 $((layers - 1))); do touch "$run/lists/layer$i"; done

# make_layer NAME LIST [EXTRA_DIR]: tar (+ EXTRA_DIR's contents appended), gzip, digests.
make_layer() {
  local name=$1 list=$2 extra=${3:-}
  local tarf="$run/blobs/$name.tar"
  tar --numeric-owner --no-recursion -C "$tree" -cf "$tarf" -T "$list"
  [ -z "$extra" ] || tar --numeric-owner -C "$extra" -rf "$tarf" .
  sha256sum "$tarf" | cut -d' ' -f1 >"$run/blobs/$name.diffid"
  gzip -n -6 -c "$tarf" >"$run/blobs/$name.gz"
  sha256sum "$run/blobs/$name.gz" | cut -d' ' -f1 >"$run/blobs/$name.digest"
  rm "$tarf"
}
for i in $(seq 0 $((layers - 1))); do make_layer "l$i" "$run/lists/layer$i" & done
mkdir -p "$run/extra-src/cairn-bench"
echo "rebuilt top layer $(date +%s%N)" >"$run/extra-src/cairn-bench/stamp"
make_layer extra "$run/lists/layer$((layers - 1))" "$run/extra-src" &
wait

python3 - "$run" "$layers" <<'EOF'
import hashlib, json, os, shutil, sys
run, n = sys.argv[1], int(sys.argv[2])
blobs = os.path.join(run, "layout", "blobs", "sha256")
os.makedirs(blobs)
def put(data):
    d = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, d), "wb") as f:
        f.write(data)
    return "sha256:" + d, len(data)
def layer(name):
    rd = lambda ext: open(os.path.join(run, "blobs", f"{name}.{ext}")).read().strip()
    src = os.path.join(run, "blobs", f"{name}.gz")
    os.rename(src, os.path.join(blobs, rd("digest")))
    return {"digest": "sha256:" + rd("digest"), "diff_id": "sha256:" + rd("diffid"),
            "size": os.path.getsize(os.path.join(blobs, rd("digest")))}
ls = [layer(f"l{i}") for i in range(n)]
extra = layer("extra")
images = {"base": ls[:-1], "full": ls, "other": ls[:-1] + [extra]}
index = []
for tag, lys in images.items():
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/sh"]},
                      "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in lys]}}).encode()
    cd, cs = put(cfg)
    man = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
                      "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                  "digest": l["digest"], "size": l["size"]} for l in lys]}).encode()
    md, ms = put(man)
    index.append({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
                  "annotations": {"org.opencontainers.image.ref.name": tag}})
    with open(os.path.join(run, f"{tag}.layers"), "w") as f:
        f.write("\n".join(l["digest"] for l in lys) + "\n")
json.dump({"schemaVersion": 2, "manifests": index}, open(os.path.join(run, "layout", "index.json"), "w"))
json.dump({"imageLayoutVersion": "1.0.0"}, open(os.path.join(run, "layout", "oci-layout"), "w"))
EOF

# ---------------------------------------------------------------- registry
registry_start "$run/registry" || die "no registry"
reg=$registry
for tag in base full other; do
  HOME="$run" skopeo copy -q --dest-tls-verify=false "oci:$run/layout:$tag" "docker://$reg/bench/$tag:v1"
done
full_bytes=0
while read -r d; do full_bytes=$((full_bytes + $(stat -c %s "$run/layout/blobs/sha256/${d#sha256:}"))); done <"$run/full.layers"
echo "==> registry $reg: base, full ($(wc -l <"$run/full.layers") layers, $(mib "$full_bytes") of gzip), other" >&2

# ---------------------------------------------------------------- methods
# Each writes into its own fresh directory $1.
m_cairn() { "$cairn" --root "$1/store" -q pull --jobs "$jobs" "$reg/bench/full:v1"; }
unpack_layer() { # DIR DIGEST
  mkdir -p "$1"
  curl -sf "http://$reg/v2/bench/full/blobs/$2" | gzip -dc | tar -x --numeric-owner -C "$1"
}
m_classic() {
  local i=0
  while read -r d; do
    unpack_layer "$1/layers/$i" "$d"
    i=$((i + 1))
  done <"$run/full.layers"
}
# shellcheck disable=SC2016 # the single-quoted script is expanded by the inner bash
m_classic_par() {
  export -f unpack_layer
  export reg
  awk -v dir="$1/layers" '{ print dir "/" NR - 1, $1 }' "$run/full.layers" |
    xargs -P "$jobs" -n 2 bash -c 'unpack_layer "$0" "$1"'
}
m_umoci() {
  HOME="$run" skopeo copy -q --src-tls-verify=false "docker://$reg/bench/full:v1" "oci:$1/oci:full"
  umoci unpack --image "$1/oci:full" "$1/bundle" >/dev/null
}
# The second image: base is in the store already (not timed), full is pulled.
m_cairn_second() { "$cairn" --root "$1/store" -q pull --jobs "$jobs" "$reg/bench/full:v1"; }
m_cairn_second_prep() { "$cairn" --root "$1/store" -q pull --jobs "$jobs" "$reg/bench/base:v1"; }
m_classic_second() { unpack_layer "$1/layers/top" "$(tail -1 "$run/full.layers")"; }

declare -A samples
# sample NAME [--sync] [--prep FN]: times one run of m_NAME in a fresh directory.
sample() {
  local name=$1 sync=0 prep="" d s t
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --sync) sync=1 ;;
      --prep)
        prep=$2
        shift
        ;;
    esac
    shift
  done
  d="$run/s-$name-$RANDOM$RANDOM"
  mkdir -p "$d"
  [ -z "$prep" ] || "$prep" "$d"
  sync
  s=$(now)
  "m_$name" "$d"
  [ "$sync" -eq 0 ] || sync
  t=$(since "$s")
  local key=$name
  [ "$sync" -eq 0 ] || key="$name+sync"
  samples[$key]="${samples[$key]:-} $t"
}

echo "==> $runs runs (warm page cache: the registry's blobs stay cached)" >&2
for r in $(seq 1 "$runs"); do
  sample cairn
  sample classic
  sample cairn --sync
  sample classic --sync
  sample classic_par
  sample umoci
  sample cairn_second --prep m_cairn_second_prep
  sample classic_second
  echo "   run $r: cairn $(echo "${samples[cairn]}" | awk '{ print $NF }') s, classic $(echo "${samples[classic]}" | awk '{ print $NF }') s" >&2
done

# ---------------------------------------------------------------- checks and sizes
check="$run/check"
mkdir -p "$check"
for tag in base full other; do
  "$cairn" --root "$check/store" -q pull --jobs "$jobs" "$reg/bench/$tag:v1"
done
entries_tree=$(cd "$tree" && find . | wc -l)
entries_cairn=$("$cairn" --root "$check/store" dump "$reg/bench/full:v1" | wc -l)
[ "$entries_tree" -eq "$entries_cairn" ] ||
  echo "pull.sh: warning: the pulled image has $entries_cairn entries, the tree $entries_tree" >&2
store_bytes=$(du_bytes "$check/store")
# The same three images unpacked the classic way: one rootfs each...
rootfs_sum=0
for tag in base full other; do
  mkdir -p "$check/rootfs-$tag"
  while read -r d; do
    curl -sf "http://$reg/v2/bench/$tag/blobs/$d" | gzip -dc | tar -x --numeric-owner -C "$check/rootfs-$tag"
  done <"$run/$tag.layers"
  rootfs_sum=$((rootfs_sum + $(du_bytes "$check/rootfs-$tag")))
done
# ...and as per-layer snapshot directories, each distinct layer once.
sort -u "$run/base.layers" "$run/full.layers" "$run/other.layers" >"$run/distinct.layers"
while read -r d; do
  mkdir -p "$check/snap/$d"
  for tag in full other; do
    if curl -sfI "http://$reg/v2/bench/$tag/blobs/$d" >/dev/null; then
      curl -sf "http://$reg/v2/bench/$tag/blobs/$d" | gzip -dc | tar -x --numeric-owner -C "$check/snap/$d"
      break
    fi
  done
done <"$run/distinct.layers"
snap_bytes=$(du_bytes "$check/snap")

# ---------------------------------------------------------------- report
med() { echo "${samples[$1]}" | median; }
c=$(med cairn) k=$(med classic) cs=$(med cairn+sync) ks=$(med classic+sync)
kp=$(med classic_par) u=$(med umoci) c2=$(med cairn_second) k2=$(med classic_second)
verdict() { awk -v r="$1" -v t="$2" 'BEGIN { print (r + 0 <= t) ? "met" : "missed" }'; }
report=$(
  cat <<EOF
## cairn pull: $(basename "$tree") ($(wc -l <"$run/full.layers") gzip layers, $(mib "$full_bytes"), $entries_tree entries), $runs runs, jobs $jobs

Medians in seconds; ratios against the classic unpack (curl | gunzip | tar -x, one directory per layer, layers one after the other) measured in the same run.

| figure | cairn | classic | ratio | target |
| --- | --- | --- | --- | --- |
| pull + import | $c | $k | $(ratio "$c" "$k") | ≤ 1.0x ($(verdict "$(ratio "$c" "$k")" 1.0)) |
| pull + import, then sync | $cs | $ks | $(ratio "$cs" "$ks") | — |
| second image sharing the base (only the top layer is new) | $c2 | $k2 | $(ratio "$c2" "$k2") | — |

Other ways, same run: classic with $jobs layers at once $kp s ($(ratio "$kp" "$k") of classic); \`skopeo copy\` + \`umoci unpack\` $u s ($(ratio "$u" "$k")).

| disk, three images (base, full, other) | bytes | vs cairn store |
| --- | --- | --- |
| cairn store (\`du\` of objects, images, layer records) | $(mib "$store_bytes") | 1.00x |
| one unpacked rootfs per image (sum) | $(mib "$rootfs_sum") | $(ratio "$rootfs_sum" "$store_bytes") |
| one directory per distinct layer (snapshotter) | $(mib "$snap_bytes") | $(ratio "$snap_bytes" "$store_bytes") |

Samples (s): $(for key in cairn classic cairn+sync classic+sync classic_par umoci cairn_second classic_second; do printf '%s:%s; ' "$key" "${samples[$key]}"; done)
EOF
)
echo "$report"
if [ -n "$out" ]; then
  mkdir -p "$(dirname "$out")"
  echo "$report" >"$out"
  echo "wrote $out" >&2
fi
