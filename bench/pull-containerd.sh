#!/usr/bin/env bash
# Pull benchmark against containerd (issue 17): `cairn pull` against
# containerd 2.4.2 with its overlayfs snapshotter and with its EROFS
# snapshotter + EROFS differ, from a docker-registry on 127.0.0.1. Cold: page
# cache dropped, a fresh containerd root/state (containerd restarted) and a
# fresh cairn store for every sample; the three interleaved. Images: linux
# (one layer: a Linux source tree), debian (one layer: debootstrap minbase
# bookworm), python (debian + a layer with python3 and python3-numpy), each
# gzip and zstd; for python also the pull followed by a first
# `python3 -c 'import numpy'` in a container. Markdown report of medians and
# a PNG chart next to it.
#
#   sudo bench/pull-containerd.sh [options]
#
# Options:
#   --runs N          samples per figure (default 5)
#   --only LIST       images, of linux,debian,python (default all three)
#   --compression C   gzip, zstd or both (default both)
#   --cairn BIN       cairn binary (default target/x86_64-unknown-linux-musl/release/cairn)
#   --out FILE        report (default bench/results/pull-containerd.md); chart: FILE.png
#   --work DIR        scratch and cache of trees, layers and the registry's
#                     storage (default /var/tmp/cairn-bench-containerd)
#   --settle SECS     pause after deleting a group's samples (default 60: ext4
#                     is slow to reuse inodes freed in the last minute)
#   --install-only    install what is missing (below), then stop
#   --prepare-only    install, build the images and push them, then stop
#   --keep            keep the run directory (stores, containerd roots)
#
# Installs what is missing: containerd 2.4.2, ctr and containerd-shim-runc-v2
# (`go install`) and mkfs.erofs 1.8.6 (built from Debian trixie's source
# package with a private apt state: the machine's apt sources are not
# touched) into /usr/local/lib/cairn-bench/bin; Debian's runc, debootstrap,
# docker-registry, skopeo, zstd, time, python3-matplotlib. containerd runs
# with CONTAINERD_DISABLE_PIGZ=1 on a private socket. Needs root.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
all_args=("$@")
prefix=/usr/local/lib/cairn-bench
bin=$prefix/bin
erofs_version=1.8.6
runs=5 only=linux,debian,python compression=both settle=60 keep=0 stop_after=""
cairn=$repo/target/x86_64-unknown-linux-musl/release/cairn
out=$repo/bench/results/pull-containerd.md
work=/var/tmp/cairn-bench-containerd

usage() { sed -n '2,/^# docker-registry, skopeo/p' "$0" | sed 's/^# \{0,1\}//'; }
die() {
  echo "pull-containerd: $*" >&2
  exit 1
}
say() { echo "==> $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift ;;
    --only) only=$2; shift ;;
    --compression) compression=$2; shift ;;
    --cairn) cairn=$(readlink -f "$2"); shift ;;
    --out) out=$2; shift ;;
    --work) work=$2; shift ;;
    --settle) settle=$2; shift ;;
    --install-only) stop_after=install ;;
    --prepare-only) stop_after=prepare ;;
    --keep) keep=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
  shift
done
case "$compression" in
  gzip | zstd) comps=("$compression") ;;
  both) comps=(gzip zstd) ;;
  *) die "--compression: gzip, zstd or both" ;;
esac
IFS=, read -r -a images <<<"$only"
for img in "${images[@]}"; do
  case "$img" in linux | debian | python) ;; *) die "--only: linux, debian, python" ;; esac
done
[ "$runs" -ge 1 ] || die "--runs must be at least 1"
[ "$(id -u)" -eq 0 ] || die "run as root (containerd, mounts, drop_caches)"

# shellcheck source-path=SCRIPTDIR source=lib/registry.sh
. "$here/lib/registry.sh"
# matplotlib is Debian's; a python3 earlier in PATH (pyenv) may lack it.
py=/usr/bin/python3
[ -x "$py" ] || py=python3

# ================================================================ installs

apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" </dev/null >&2; }

install_debian_tools() {
  local want=() t
  for t in runc:runc debootstrap:debootstrap docker-registry:docker-registry skopeo:skopeo \
    zstd:zstd curl:curl /usr/bin/time:time; do
    command -v "${t%%:*}" >/dev/null || want+=("${t#*:}")
  done
  dpkg-query -W -f='${Status}' python3-matplotlib 2>/dev/null | grep -q "ok installed" || want+=(python3-matplotlib)
  [ ${#want[@]} -eq 0 ] || {
    say "installing ${want[*]}"
    apt_install "${want[@]}"
  }
}

# shellcheck source-path=SCRIPTDIR source=lib/containerd2.sh
. "$here/lib/containerd2.sh"
install_containerd() { install_containerd2 || die "installing containerd $CONTAINERD2_VERSION failed"; }

# The Debian mirror apt uses (the first URI of a /debian suite).
debian_mirror() {
  local m
  m=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
    grep -oE 'https?://[^ ]*/debian/?( |$)' | head -1 | tr -d ' ' || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# mkfs.erofs 1.8.6 from trixie's source package, built against bookworm's
# libraries. apt runs with its own source list, lists and cache under the
# scratch directory, so the machine's apt configuration stays as it was.
install_mkfs_erofs() {
  if [ -x "$bin/mkfs.erofs" ] && "$bin/mkfs.erofs" --version 2>/dev/null | grep -q " $erofs_version"; then
    return
  fi
  local src=$work/erofs-src
  rm -rf "$src"
  mkdir -p "$src/sources.d" "$src/lists/partial" "$src/cache/archives/partial"
  cat >"$src/sources.d/trixie-src.sources" <<EOF
Types: deb-src
URIs: $(debian_mirror)
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  local apt=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$src/sources.d"
    -o "Dir::State::Lists=$src/lists" -o "Dir::Cache=$src/cache")
  say "building mkfs.erofs $erofs_version from Debian trixie's erofs-utils source package"
  apt-get "${apt[@]}" update >&2
  # Build-Depends of erofs-utils 1.8.6-1 (without FUSE), from bookworm.
  apt_install autoconf automake libtool pkgconf make gcc dpkg-dev libdeflate-dev liblz4-dev \
    liblzma-dev libselinux1-dev libxxhash-dev libzstd-dev uuid-dev zlib1g-dev
  (cd "$src" && apt-get "${apt[@]}" source "erofs-utils/trixie" >&2)
  [ -d "$src/erofs-utils-$erofs_version" ] || die "trixie's erofs-utils is not $erofs_version: $(ls "$src")"
  (
    cd "$src/erofs-utils-$erofs_version"
    ./autogen.sh
    # debian/rules' flags, FUSE off (only mkfs.erofs is wanted).
    ./configure --prefix="$prefix" --enable-lzma --enable-multithreading --with-uuid --with-zlib \
      --with-libdeflate --with-libzstd --with-xxhash --with-selinux --disable-fuse
    make -j"$(nproc)"
  ) >"$src/build.log" 2>&1 || die "erofs-utils build failed (see $src/build.log)"
  mkdir -p "$bin"
  install -m 0755 "$src/erofs-utils-$erofs_version/mkfs/mkfs.erofs" "$bin/mkfs.erofs"
  rm -rf "$src"
}

versions() {
  echo "containerd: $("$bin/containerd" --version | awk '{ print $3 }'); ctr: $("$bin/ctr" --version | awk '{ print $3 }')"
  echo "; mkfs.erofs (containerd's): $("$bin/mkfs.erofs" --version | head -1 | awk '{ print $NF }')"
  echo "; runc: $(runc --version | head -1 | awk '{ print $3 }'); crun: $(crun --version | head -1 | awk '{ print $3 }')"
  echo "; cairn: $("$cairn" --version | awk '{ print $2 }') (${cairn_given:-$cairn}, built ${cairn_built:-$(date -u -r "$cairn" '+%Y-%m-%d %H:%M UTC')}$(cairn_head))"
}
# The checkout the binary sits in and its HEAD when the run started (the
# binary may be older).
cairn_head() {
  local h
  [ -z "${cairn_head_then:-}" ] || {
    echo "$cairn_head_then"
    return
  }
  h=$(git -C "$(dirname "${cairn_given:-$cairn}")" log -1 --format='%h, committed %cd' --date=format:'%H:%M' 2>/dev/null) || return 0
  echo "; its checkout at $h"
}

# ================================================================ images

images_dir=$work/images
blobs=$images_dir/blobs
# shellcheck source-path=SCRIPTDIR source=lib/epoch.sh
. "$here/lib/epoch.sh"
epoch=$(bench_epoch) || exit 1

# make_layer NAME DIR: NAME.tar.gz and NAME.tar.zst of DIR, reproducibly
# (sorted, numeric owners, pax without atime/ctime, mtimes clamped),
# NAME.diffid and NAME.entries.
make_layer() {
  local name=$1 dir=$2 tmp
  made_with_epoch "$blobs/$name.done" && return
  mkdir -p "$blobs"
  tmp=$blobs/$name.tar
  say "layer $name from $dir"
  tar -C "$dir" --sort=name --numeric-owner --format=pax \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    --mtime=@"$epoch" --clamp-mtime -cf "$tmp" .
  echo "sha256:$(sha256sum "$tmp" | cut -d' ' -f1)" >"$blobs/$name.diffid"
  tar -tf "$tmp" | wc -l >"$blobs/$name.entries"
  stat -c %s "$tmp" >"$blobs/$name.size"
  gzip -n -6 -c "$tmp" >"$blobs/$name.tar.gz" &
  zstd -q -3 -f -o "$blobs/$name.tar.zst" "$tmp"
  wait
  rm "$tmp"
  echo "$epoch" >"$blobs/$name.done"
}

tree_linux() {
  local t=$images_dir/linux-tree
  [ -f "$t.done" ] || {
    rm -rf "$t"
    "$here/make-linux-tree.sh" "$t" >&2
    touch "$t.done"
  }
  echo "$t"
}
tree_debian() {
  local t=$images_dir/debian-tree
  [ -f "$t.done" ] || {
    rm -rf "$t"
    mkdir -p "$images_dir"
    chattr +T "$images_dir" 2>/dev/null || true
    say "debootstrap --variant=minbase bookworm from $(debian_mirror)"
    debootstrap --variant=minbase bookworm "$t" "$(debian_mirror)" >&2
    # What a Debian image leaves out: the .debs debootstrap installed from,
    # apt's lists and caches, logs.
    rm -rf "$t"/var/cache/apt/archives/*.deb "$t"/var/lib/apt/lists/* "$t"/var/cache/apt/*.bin \
      "$t"/var/log/*.log "$t"/var/log/apt/*
    touch "$t.done"
  }
  echo "$t"
}
# The python layer: `apt-get install python3 python3-numpy` in a chroot on an
# overlay (the debian tree below, an empty upper), in a mount namespace of its
# own; the upper directory becomes the layer, overlay whiteouts turned into
# OCI ones (.wh.NAME files; .wh..wh..opq in opaque directories that hide one
# of the base: overlayfs marks every new directory opaque as well).
tree_python_upper() {
  local base u=$images_dir/python-upper
  base=$(tree_debian)
  [ -f "$u.done" ] || {
    rm -rf "$u" "$u.work" "$u.merged"
    mkdir -p "$u" "$u.work" "$u.merged"
    say "python3 python3-numpy on the debian tree (chroot on an overlay)"
    # shellcheck disable=SC2016 # expanded by the inner bash
    unshare -m --propagation private bash -euo pipefail -c '
      base=$1 u=$2 m=$2.merged
      mount -t overlay overlay -o "lowerdir=$base,upperdir=$u,workdir=$u.work,redirect_dir=off,metacopy=off,index=off,xino=off" "$m"
      mount -t proc proc "$m/proc"
      mount --bind /etc/resolv.conf "$m/etc/resolv.conf"
      chroot "$m" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive sh -ec "
        apt-get update -q
        apt-get install -y -q --no-install-recommends python3 python3-numpy
        apt-get clean
        rm -rf /var/lib/apt/lists/* /var/log/*.log /var/log/apt/* /var/cache/ldconfig/aux-cache
      "
      umount "$m/etc/resolv.conf" "$m/proc" "$m"
    ' _ "$base" "$u" </dev/null >&2
    "$py" - "$u" "$base" <<'EOF'
import os, stat, sys
root, base = sys.argv[1], sys.argv[2]
for d, dirs, files in os.walk(root):
    try:
        opaque = os.getxattr(d, "trusted.overlay.opaque") == b"y"
    except OSError:
        opaque = False
    if opaque:
        os.removexattr(d, "trusted.overlay.opaque")
        if os.path.isdir(os.path.join(base, os.path.relpath(d, root))):
            open(os.path.join(d, ".wh..wh..opq"), "w").close()
    for n in files:
        p = os.path.join(d, n)
        st = os.lstat(p)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            os.unlink(p)
            open(os.path.join(d, ".wh." + n), "w").close()
EOF
    # The resolv.conf mount point existed in the base: nothing to undo there.
    rm -rf "$u.work" "$u.merged"
    touch "$u.done"
  }
  echo "$u"
}

mtype() { case "$1" in gzip) echo application/vnd.oci.image.layer.v1.tar+gzip ;; zstd) echo application/vnd.oci.image.layer.v1.tar+zstd ;; esac; }
ext() { case "$1" in gzip) echo gz ;; zstd) echo zst ;; esac; }
layers_of() { case "$1" in linux) echo linux ;; debian) echo debian ;; python) echo "debian python" ;; esac; }
cmd_of() { case "$1" in linux) echo '["/bin/sh"]' ;; debian) echo '["bash"]' ;; python) echo '["python3"]' ;; esac; }

build_images() {
  local img c l specs
  for img in "${images[@]}"; do
    case "$img" in
      linux) make_layer linux "$(tree_linux)" ;;
      debian) make_layer debian "$(tree_debian)" ;;
      python)
        make_layer debian "$(tree_debian)"
        make_layer python "$(tree_python_upper)"
        ;;
    esac
    for c in "${comps[@]}"; do
      specs=()
      for l in $(layers_of "$img"); do
        specs+=("$blobs/$l.tar.$(ext "$c"):$(cat "$blobs/$l.diffid"):$(mtype "$c")")
      done
      "$py" "$here/lib/oci_layout.py" "$images_dir/layout" "$img-$c" "$(cmd_of "$img")" "${specs[@]}" >/dev/null
    done
  done
}

push_images() {
  local img c
  for img in "${images[@]}"; do
    for c in "${comps[@]}"; do
      HOME=$work skopeo copy -q --preserve-digests --dest-tls-verify=false \
        "oci:$images_dir/layout:$img-$c" "docker://$registry/bench/$img:$c"
    done
  done
}

# "N layers, X MiB compressed, Y MiB unpacked tar, Z entries"
describe_image() {
  local img=$1 c=$2 l n=0 cz=0 tz=0 e=0
  for l in $(layers_of "$img"); do
    n=$((n + 1))
    cz=$((cz + $(stat -c %s "$blobs/$l.tar.$(ext "$c")")))
    tz=$((tz + $(cat "$blobs/$l.size")))
    e=$((e + $(cat "$blobs/$l.entries")))
  done
  awk -v n="$n" -v c="$cz" -v t="$tz" -v e="$e" \
    'BEGIN { printf "%d layer%s, %.1f MiB compressed, %.0f MiB of tar, %d entries\n", n, (n > 1 ? "s" : ""), c / 1048576, t / 1048576, e }'
}

# ================================================================ containerd

ctd_pid="" ctd_dir="" sock=""

# start_containerd DIR SNAPSHOTTER: a containerd of its own in DIR (root,
# state, socket), configured for SNAPSHOTTER; stock settings for overlayfs,
# the issue's EROFS differ settings for erofs.
start_containerd() {
  ctd_dir=$1
  local sn=$2
  sock=$ctd_dir/containerd.sock
  mkdir -p "$ctd_dir"
  {
    cat <<EOF
version = 3
root = "$ctd_dir/root"
state = "$ctd_dir/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "$sock"

[ttrpc]
  address = "$sock.ttrpc"
EOF
    if [ "$sn" = erofs ]; then
      cat <<EOF

[plugins."io.containerd.differ.v1.erofs"]
  mkfs_options = ["-T0", "--mkfs-time", "--sort=none"]

[plugins."io.containerd.service.v1.diff-service"]
  default = ["erofs", "walking"]
EOF
    fi
  } >"$ctd_dir/config.toml"
  CONTAINERD_DISABLE_PIGZ=1 PATH=$bin:$PATH "$bin/containerd" --config "$ctd_dir/config.toml" \
    >"$ctd_dir/containerd.log" 2>&1 &
  ctd_pid=$!
  for _ in $(seq 200); do
    if [ -S "$sock" ] && "$bin/ctr" -a "$sock" version >/dev/null 2>&1; then return; fi
    kill -0 "$ctd_pid" 2>/dev/null || break
    sleep 0.05
  done
  die "containerd did not start (see $ctd_dir/containerd.log)"
}

# Shims started for a socket below DIR (their command line names it), by pid.
our_shims() {
  local p
  for p in /proc/[0-9]*; do
    if { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF -- "-address $1"; then
      echo "${p#/proc/}"
    fi
  done
}

# Unmounts everything below DIR, deepest first.
umount_below() {
  local m
  while IFS= read -r m; do
    [ -n "$m" ] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(findmnt -rn -o TARGET | grep -F "$1/" | sort -r)
}

stop_containerd() {
  [ -n "$ctd_pid" ] || return 0
  kill "$ctd_pid" 2>/dev/null || true
  wait "$ctd_pid" 2>/dev/null || true
  local p
  for p in $(our_shims "$sock"); do kill "$p" 2>/dev/null || true; done
  umount_below "$ctd_dir"
  ctd_pid=""
}

# Busy CPU seconds of the whole machine so far (every process: the registry,
# daemons, containers, and whatever else runs).
machine_cpu() { awk -v hz="$(getconf CLK_TCK)" '$1 == "cpu" { printf "%.2f", ($2 + $3 + $4 + $7 + $8 + $9) / hz }' /proc/stat; }

# CPU seconds of a process and its reaped children (mkfs.erofs for containerd).
proc_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15 + $16 + $17) / hz }' "/proc/$1/stat"; }

# ================================================================ samples

run_dir="" samples=""
cleanup() {
  stop_containerd
  registry_stop
  [ -z "$run_dir" ] || umount_below "$run_dir"
  if [ -n "$run_dir" ] && [ -d "$run_dir" ]; then
    if [ "$keep" -eq 1 ]; then
      echo "kept $run_dir" >&2
    elif findmnt -rn -o TARGET | grep -qF "$run_dir/"; then
      echo "pull-containerd: still mounted under $run_dir; not removing it" >&2
    else
      rm -rf "$run_dir"
    fi
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

drop_caches() {
  sync
  echo 3 >/proc/sys/vm/drop_caches
}
# fresh NAME: sets fresh_dir to a directory name never used in this run.
n_fresh=0 fresh_dir=""
fresh() {
  n_fresh=$((n_fresh + 1))
  fresh_dir=$run_dir/s/$n_fresh-$1
}

# timed FILE CMD...: runs CMD under /usr/bin/time; FILE gets "wall user sys
# maxrss_kb" (its last line), FILE.out the command's output.
timed() {
  local f=$1
  shift
  /usr/bin/time -f '%e %U %S %M' -o "$f" "$@" >"$f.out" 2>&1 || {
    cat "$f.out" >&2
    die "failed: $*"
  }
}
sum() { echo "$@" | awk '{ for (i = 1; i <= NF; i++) t += $i; printf "%.2f", t }'; }

# record IMG COMP FIGURE SYSTEM WALL CPU RSS_KB MACHINE_CPU
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$samples"; }

last_wall=""
sample_cairn() {
  local img=$1 c=$2 ref=$registry/bench/$1:$2 d w u s m w2 rest m0 m1 m2
  fresh "cairn-$img-$c"
  d=$fresh_dir
  mkdir -p "$d"
  drop_caches
  m0=$(machine_cpu)
  timed "$d/time-pull" "$cairn" --root "$d/store" -q pull "$ref"
  m1=$(machine_cpu)
  read -r w u s m <<<"$(tail -1 "$d/time-pull")"
  record "$img" "$c" pull cairn "$w" "$(sum "$u" "$s")" "$m" "$(sum "$m1" "-$m0")"
  if [ "$img" = python ]; then
    # The container is not cairn's child (its monitor is): no process CPU.
    timed "$d/time-run" "$cairn" --root "$d/store" -q run "$ref" python3 -c 'import numpy'
    m2=$(machine_cpu)
    read -r w2 rest <<<"$(tail -1 "$d/time-run")"
    record "$img" "$c" "pull+run" cairn "$(sum "$w" "$w2")" "" "" "$(sum "$m2" "-$m0")"
  fi
  last_wall=$w
}

sample_containerd() {
  local sn=$1 img=$2 c=$3 ref=$registry/bench/$2:$3 d w u s m w2 rest c0 c1 m0 m1 m2 m3 nl n
  fresh "$sn-$img-$c"
  d=$fresh_dir
  start_containerd "$d" "$sn"
  drop_caches
  c0=$(proc_cpu "$ctd_pid")
  m0=$(machine_cpu)
  timed "$d/time-pull" "$bin/ctr" -a "$sock" images pull --plain-http --snapshotter "$sn" "$ref"
  m1=$(machine_cpu)
  c1=$(proc_cpu "$ctd_pid")
  read -r w u s m <<<"$(tail -1 "$d/time-pull")"
  # CPU: ctr's own, and containerd's with the children it reaped (mkfs.erofs).
  record "$img" "$c" pull "$sn" "$w" "$(sum "$u" "$s" "$c1" "-$c0")" "" "$(sum "$m1" "-$m0")"
  # It unpacked: one committed snapshot per layer (and, for erofs, one
  # layer.erofs per layer, made by the EROFS differ or at commit).
  nl=$(layers_of "$img" | wc -w)
  n=$("$bin/ctr" -a "$sock" snapshots --snapshotter "$sn" ls 2>>"$d/ctr.log" | awk 'NR > 1 && $NF == "Committed"' | wc -l)
  [ "$n" -eq "$nl" ] || die "$sn: $n committed snapshots after pulling $ref, expected $nl"
  if [ "$sn" = erofs ]; then
    # ... and the EROFS differ made them from the tar: nothing was unpacked
    # into the snapshots' fs directories (the walking differ would have).
    local snaps=$d/root/io.containerd.snapshotter.v1.erofs/snapshots s
    n=$(find "$snaps" -mindepth 2 -maxdepth 2 -name layer.erofs | wc -l)
    [ "$n" -eq "$nl" ] || die "erofs: $n layer.erofs files after pulling $ref, expected $nl"
    for s in "$snaps"/*/layer.erofs; do
      [ -z "$(ls -A "${s%/layer.erofs}/fs")" ] || die "erofs: ${s%/layer.erofs}/fs is not empty: not the EROFS differ?"
    done
  fi
  if [ "$img" = python ]; then
    m3=$(machine_cpu)
    timed "$d/time-run" "$bin/ctr" -a "$sock" run --rm --snapshotter "$sn" "$ref" \
      "bench-$$-$n_fresh" python3 -c 'import numpy'
    m2=$(machine_cpu)
    read -r w2 rest <<<"$(tail -1 "$d/time-run")"
    # The verification between pull and run is left out of the machine's CPU.
    record "$img" "$c" "pull+run" "$sn" "$(sum "$w" "$w2")" "" "" "$(sum "$m1" "-$m0" "$m2" "-$m3")"
  fi
  stop_containerd
  last_wall=$w
}

# The EROFS differ really converted the layers (and was not skipped for
# lack of mkfs.erofs --tar): check once, on the plugin list.
check_plugins() {
  local d
  fresh plugins
  d=$fresh_dir
  start_containerd "$d" erofs
  "$bin/ctr" -a "$sock" plugins ls >"$d/plugins" 2>>"$d/ctr.log"
  stop_containerd
  grep -E 'io.containerd.differ.v1 +erofs .* ok' "$d/plugins" >/dev/null ||
    die "containerd's EROFS differ is not available: $(grep erofs "$d/plugins" | tr -s ' ')"
  grep -E 'io.containerd.snapshotter.v1 +erofs .* ok' "$d/plugins" >/dev/null ||
    die "containerd's EROFS snapshotter is not available: $(grep erofs "$d/plugins" | tr -s ' ')"
  grep -E 'io.containerd.snapshotter.v1 +overlayfs .* ok' "$d/plugins" >/dev/null ||
    die "containerd's overlayfs snapshotter is not available"
}

# ================================================================ main

install_debian_tools
install_containerd
install_mkfs_erofs
say "installed: $(versions | tr -d '\n')"
[ "$stop_after" != install ] || exit 0
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn BIN)"

build_images
registry_start "$work/registry"
say "registry $registry"
push_images
[ "$stop_after" != prepare ] || exit 0

mkdir -p "$work"
chattr +T "$work" 2>/dev/null || true
run_dir=$work/run-$(date +%s)-$$
mkdir -p "$run_dir/s"
# Each sample writes into a fresh directory of s/, spread by ext4 over other
# block groups than the trees deleted before it (docs/machines.md).
chattr +T "$run_dir/s" 2>/dev/null || true
samples=$run_dir/samples.tsv
: >"$samples"
# A copy: the binary given may be rebuilt while this runs.
cairn_built=$(date -u -r "$cairn" '+%Y-%m-%d %H:%M UTC')
cairn_head_then=$(cairn_head)
cp "$cairn" "$run_dir/cairn"
cairn_given=$cairn
cairn=$run_dir/cairn
mounts_before=$(findmnt -rn -o TARGET | sort)
# Processes using 5% of a CPU or more over one second (top's second frame).
busy_before=$(top -b -n 2 -d 1 -w 200 | awk '/^ *PID/ { frame++; next } frame == 2 && $9 + 0 >= 5 { printf "%s %s%%, ", $12, $9 }' | sed 's/, $//')
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
check_plugins

first=1
for img in "${images[@]}"; do
  for c in "${comps[@]}"; do
    if [ "$first" -eq 0 ] && [ "$settle" -gt 0 ]; then
      say "waiting ${settle}s (inodes freed by the last group)"
      sleep "$settle"
    fi
    first=0
    say "$img $c: $(describe_image "$img" "$c"); $runs runs"
    for r in $(seq 1 "$runs"); do
      sample_containerd overlayfs "$img" "$c"
      a=$last_wall
      sample_containerd erofs "$img" "$c"
      b=$last_wall
      sample_cairn "$img" "$c"
      k=$last_wall
      say "  $img $c run $r: overlayfs ${a}s, erofs ${b}s, cairn ${k}s"
    done
    if [ "$keep" -eq 0 ]; then
      umount_below "$run_dir/s"
      rm -rf "$run_dir/s"
      mkdir "$run_dir/s"
      chattr +T "$run_dir/s" 2>/dev/null || true
    fi
  done
done

mounts_after=$(findmnt -rn -o TARGET | sort)
[ "$mounts_before" = "$mounts_after" ] ||
  echo "pull-containerd: warning: mounts differ before and after: $(diff <(echo "$mounts_before") <(echo "$mounts_after") | grep '^[<>]' | tr '\n' ' ')" >&2
[ -z "$(our_shims "$run_dir/")" ] || echo "pull-containerd: warning: shims left: $(our_shims "$run_dir/" | tr '\n' ' ')" >&2

{
  printf 'date\t%s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  printf 'host\t%s\n' "$(nproc) cores, kernel $(uname -r), $(findmnt -no FSTYPE -T "$work") under $work"
  printf 'load\t%s\n' "load average $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end; busy processes at the start: ${busy_before:-none}"
  printf 'versions\t%s\n' "$(versions | tr -d '\n')"
  printf 'command\t%s\n' "bench/pull-containerd.sh ${all_args[*]}"
  printf 'runs\t%s\n' "$runs"
  for img in "${images[@]}"; do
    for c in "${comps[@]}"; do printf 'image %s %s\t%s\n' "$img" "$c" "$(describe_image "$img" "$c")"; done
  done
} >"$run_dir/meta.tsv"
mkdir -p "$(dirname "$out")"
"$py" "$here/lib/report_containerd.py" "$run_dir" "${out%.md}.png" | tee "$out"
echo "wrote $out and ${out%.md}.png" >&2
