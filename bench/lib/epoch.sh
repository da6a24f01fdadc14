# shellcheck shell=bash
# The date the benchmarks' layers clamp mtimes to (tar --clamp-mtime), so
# that a layer built twice from the same tree has the same digest.
#
# It is the newest `Date:` of the machine's apt Release files: the Debian
# snapshot the trees are installed from. Every file a package installed is
# at most that old and keeps its own mtime; only what debootstrap and apt
# made while building (logs, dpkg's state, the .pyc files py3compile
# writes) is clamped. A fixed date older than the packages (it was
# 2025-05-20 until 2026-11-26, when the mirror served python3.11 built in
# May 2026) rewrote the mtime of every .py file, and a .pyc records the
# mtime of its source: python then found 55 of the .pyc files `import
# numpy` loads stale and compiled their modules again at every start
# (0.3 s of each python start, in every way measured).
#
# Caches built from the trees (layers, layouts, registry contents) record
# the epoch they were made with, and are rebuilt when it changes.
bench_epoch() {
  local f d s newest=0
  for f in /var/lib/apt/lists/*Release; do
    [ -f "$f" ] || continue
    d=$(sed -n 's/^Date: //p' "$f" | head -n 1)
    [ -n "$d" ] || continue
    s=$(date -d "$d" +%s 2>/dev/null) || continue
    [ "$s" -gt "$newest" ] && newest=$s
  done
  if [ "$newest" -eq 0 ]; then
    echo "bench: no Date in /var/lib/apt/lists/*Release (run apt-get update): cannot tell the Debian snapshot's date" >&2
    return 1
  fi
  echo "$newest"
}

# made_with_epoch MARKER: whether MARKER exists and records the epoch the
# sourcing script set (epoch=$(bench_epoch)).
made_with_epoch() {
  [ -f "$1" ] && [ "$(cat "$1")" = "${epoch:?epoch is not set}" ]
}
