#!/usr/bin/env bash
# Writes a deterministic synthetic tree for quick benchmark runs.
#
#   bench/make-tree.sh DIR [--files N] [--seed S] [--per-dir N]
#
# Default: 10,000 files (about 200 MiB), seed 1. Same arguments, same tree.
# DIR must not exist; its parent gets chattr +T (see docs/machines.md: ext4 is
# slow to reuse inodes freed in the last minute).
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
parent=$(dirname "$1")
mkdir -p "$parent"
chattr +T "$parent" 2>/dev/null || true
exec python3 "$here/lib/make_tree.py" "$@"
