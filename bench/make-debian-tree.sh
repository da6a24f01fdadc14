#!/usr/bin/env bash
# Builds a Debian bookworm root filesystem with python3 (debootstrap; ~13k
# entries, ~260 MB) for benchmarks, from the mirror apt is configured with.
#
#   sudo bench/make-debian-tree.sh DIR [MIRROR]
#
# DIR must not exist; its parent gets chattr +T (see docs/machines.md). The
# tree holds device nodes under /dev, as a real image does.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
dir=$1
# The first Debian mirror apt uses (deb822 .sources or one-line lists).
mirror=${2:-$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
  grep -oE 'https?://[^ ]*/debian/?( |$)' | head -1 | tr -d ' ' || true)}
mirror=${mirror:-http://deb.debian.org/debian}
[ ! -e "$dir" ] || {
  echo "make-debian-tree: $dir exists; give a new directory name" >&2
  exit 1
}
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap </dev/null
mkdir -p "$(dirname "$dir")"
chattr +T "$(dirname "$dir")" 2>/dev/null || true
echo "debootstrap bookworm from $mirror"
debootstrap --include=python3 bookworm "$dir" "$mirror"
echo "$dir: $(find "$dir" | wc -l) entries, $(du -sh --apparent-size "$dir" | cut -f1)"
