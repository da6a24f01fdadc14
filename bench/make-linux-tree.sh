#!/usr/bin/env bash
# Unpacks a Linux source tree (Debian's linux-source-6.1: ~84k entries,
# ~1.3 GB) for benchmarks.
#
#   sudo bench/make-linux-tree.sh DIR
#
# Installs linux-source-6.1 if it is missing. DIR must not exist; its parent
# gets chattr +T (docs/machines.md: ext4 is slow to reuse inodes freed in the
# last minute, so use a fresh name rather than deleting and unpacking again).
set -euo pipefail
if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
dir=$1
[ ! -e "$dir" ] || {
  echo "make-linux-tree: $dir exists; give a new directory name" >&2
  exit 1
}
tarball=/usr/src/linux-source-6.1.tar.xz
if [ ! -f "$tarball" ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends linux-source-6.1 </dev/null
fi
mkdir -p "$(dirname "$dir")"
chattr +T "$(dirname "$dir")" 2>/dev/null || true
mkdir "$dir"
tar -C "$dir" --strip-components=1 -xJf "$tarball"
echo "$dir: $(find "$dir" | wc -l) entries, $(du -sh --apparent-size "$dir" | cut -f1)"
