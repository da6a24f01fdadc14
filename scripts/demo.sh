#!/usr/bin/env bash
# Shows what cairn does today: runs `cairn run demo -- echo hello` in the
# built-in demo image (made by scripts/make-demo-image.sh; skipped with a note
# while this cairn has no `run`), then builds a small tree, turns it into an
# EROFS metadata image plus an object store, mounts it, looks at it and
# unmounts it. That part lives in a temporary directory removed at the end.
#
#   scripts/demo.sh [CAIRN_BINARY]     (default: target/x86_64-unknown-linux-musl/release/cairn; needs root)
set -euo pipefail

cd "$(dirname "$(readlink -f "$0")")/.."
cairn=$(readlink -f "${1:-target/x86_64-unknown-linux-musl/release/cairn}")

[ "$(id -u)" -eq 0 ] || {
  echo "demo.sh: run as root: mounting needs CAP_SYS_ADMIN" >&2
  exit 1
}
[ -x "$cairn" ] || {
  echo "demo.sh: no cairn binary at $cairn (cargo build --release)" >&2
  exit 1
}

work=$(mktemp -d "${TMPDIR:-/tmp}/cairn-demo.XXXXXX")
tree=$work/tree
store=$work/store
image=$work/demo.cfs
mnt=$work/mnt

cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then
    "$cairn" umount "$mnt" 2>/dev/null || umount -l "$mnt"
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Print a command, then run it.
run() {
  printf '\n$'
  printf ' %q' "$@"
  printf '\n'
  "$@"
}

# The built-in image first, where this cairn can run containers.
if "$cairn" run --help >/dev/null 2>&1; then
  if ! "$cairn" -q images 2>/dev/null | grep -qw demo; then
    run scripts/make-demo-image.sh "$cairn"
  fi
  run "$cairn" run demo -- echo hello
else
  echo "(this cairn has no 'run' command yet: skipping 'cairn run demo -- echo hello')"
fi

echo
echo "demo work directory: $work"

# A tree with one of most kinds of entry.
mkdir -p "$tree/etc" "$tree/usr/bin" "$tree/usr/share/doc" "$tree/var/empty" "$mnt"
printf 'hello from cairn\n' >"$tree/etc/motd"
printf 'NAME="cairn demo"\n' >"$tree/etc/os-release"
printf '#!/bin/sh\necho demo\n' >"$tree/usr/bin/demo"
chmod 0755 "$tree/usr/bin/demo"
ln "$tree/usr/bin/demo" "$tree/usr/bin/demo-hardlink"
ln -s ../usr/share/doc "$tree/etc/doc-link"
for i in $(seq 1 20); do
  printf 'document %d\n' "$i" >"$tree/usr/share/doc/file-$i.txt"
done
# A big-ish file (16 MiB of pseudo-random bytes) and an identical copy: the
# store keeps one object for both.
head -c 16M /dev/urandom >"$tree/usr/share/big.bin"
cp "$tree/usr/share/big.bin" "$tree/usr/share/big-copy.bin"
setfattr -n user.cairn.demo -v "an extended attribute" "$tree/etc/motd"

run "$cairn" --root "$store" mkfs --store "$tree" "$image"
run "$cairn" --root "$store" mount "$image" "$mnt"
printf '\n$ ls -lR %q | head -30\n' "$mnt"
# Through a file, so that head closing the pipe early cannot fail the script.
LC_ALL=C ls -lR "$mnt" >"$work/ls.txt"
head -30 "$work/ls.txt"
run cat "$mnt/etc/motd"
run getfattr --absolute-names -n user.cairn.demo "$mnt/etc/motd"
run stat -c '%n: inode %i, %h links' "$mnt/usr/bin/demo" "$mnt/usr/bin/demo-hardlink"
run findmnt "$mnt"
run "$cairn" umount "$mnt"
if mountpoint -q "$mnt"; then
  echo "demo.sh: $mnt is still mounted after cairn umount" >&2
  exit 1
fi
echo "(unmounted)"

tree_bytes=$(du -sb --apparent-size "$tree" | cut -f1)
image_bytes=$(stat -c %s "$image")
objects=$(find "$store/objects" -type f | wc -l)
store_bytes=$(du -sb --apparent-size "$store/objects" | cut -f1)
echo
echo "tree:   $(find "$tree" | wc -l) entries, $tree_bytes bytes"
echo "image:  $image_bytes bytes (metadata only)"
echo "store:  $objects object file(s), $store_bytes bytes (identical contents stored once; small files stay inline in the image)"
echo
echo "demo finished; $work is removed"
