#!/usr/bin/env bash
# Builds the built-in demo image: Debian's busybox-static as a tiny root
# filesystem (/bin/busybox and a symlink per applet, /etc/passwd and
# /etc/group with root and nobody, /tmp 1777, /root), put into the store as
# `demo` with `cairn mkfs --store --name`, so that `cairn run demo -- echo
# hello` works offline.
#
#   scripts/make-demo-image.sh [CAIRN_BINARY] [--name NAME] [--tree DIR [--tree-only]]
#
# The store is $CAIRN_ROOT (default /var/lib/cairn). The tree is built in a
# temporary directory (removed afterwards) unless --tree DIR keeps it there;
# --tree-only stops there (no cairn needed: bench/run3.sh uses it).
# Every timestamp in the tree is fixed, so the same busybox gives a
# byte-identical image: running this again changes nothing. Needs root (the
# tree holds root-owned files) and busybox-static.
set -euo pipefail

cd "$(dirname "$(readlink -f "$0")")/.."

cairn=target/x86_64-unknown-linux-musl/release/cairn
name=demo
keep_tree=
tree_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --tree) keep_tree=$2; shift 2 ;;
    --tree-only) tree_only=1; shift ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "make-demo-image.sh: unknown option $1 (try --help)" >&2
      exit 2
      ;;
    *) cairn=$1; shift ;;
  esac
done
# -m: a missing path is named in the error below (with -f, `set -e` would
# end the script here without a word when its directory is missing too).
cairn=$(readlink -m "$cairn")

die() {
  printf 'make-demo-image.sh: error: %s\n' "$*" >&2
  exit 1
}
[ "$(id -u)" -eq 0 ] || die "run as root: the image's files belong to root"
[ "$tree_only" -eq 0 ] || [ -n "$keep_tree" ] || die "--tree-only needs --tree DIR"
[ "$tree_only" -eq 1 ] || [ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release)"
busybox=/bin/busybox
[ -x "$busybox" ] || die "no $busybox: apt-get install busybox-static"
# A dynamically linked busybox (package busybox) would need libc in the image.
case "$(LC_ALL=C ldd "$busybox" 2>&1 || true)" in
  *"not a dynamic executable"* | *"statically linked"*) ;;
  *) die "$busybox is not static: apt-get install busybox-static" ;;
esac

if [ -n "$keep_tree" ]; then
  [ ! -e "$keep_tree" ] || die "$keep_tree exists; name a new directory"
  mkdir -p "$keep_tree"
  tree=$(readlink -f "$keep_tree")
  work=
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/cairn-demo-image.XXXXXX")
  tree=$work/rootfs
  mkdir "$tree"
fi
cleanup() { [ -z "$work" ] || rm -rf "$work"; }
trap cleanup EXIT

umask 022
mkdir -p "$tree"/{bin,etc,root,tmp,proc,sys,dev,run,var,usr}
chmod 1777 "$tree/tmp"
chmod 0700 "$tree/root"
cp "$busybox" "$tree/bin/busybox"
chmod 0755 "$tree/bin/busybox"
n=0
while IFS= read -r applet; do
  case "$applet" in
    '' | */* | busybox) continue ;;
  esac
  ln -sf busybox "$tree/bin/$applet"
  n=$((n + 1))
done < <("$busybox" --list)
[ -e "$tree/bin/sh" ] || die "busybox has no sh applet?"

cat >"$tree/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$tree/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
printf 'cairn demo image (busybox %s)\n' "$("$busybox" 2>&1 | sed -n '1s/^BusyBox \(v[^ ]*\).*/\1/p')" >"$tree/etc/motd"
printf 'NAME="cairn demo"\nID=cairn-demo\n' >"$tree/etc/os-release"
chown -R 0:0 "$tree"

# Fixed timestamps: same busybox, same image digest.
find "$tree" -exec touch -h -d @0 {} +

if [ "$tree_only" -eq 1 ]; then
  echo "tree in $tree: busybox with $n applets"
  exit 0
fi
"$cairn" -q mkfs --store --name "$name" "$tree"
echo "image '$name' in ${CAIRN_ROOT:-/var/lib/cairn}: busybox with $n applets ($(du -sh --apparent-size "$tree" | cut -f1) tree)"
