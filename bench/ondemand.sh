#!/usr/bin/env bash
# On-demand start (`cairn run -d --listen`): time to first byte of an HTTP
# request (busybox httpd serving a small file from the image)
#   - cold: the listener is waiting, the request starts the container
#     through the proxy (start_detached + port poll + forward);
#   - warm through the proxy: the container already runs;
#   - warm direct: straight to the container's port, no proxy.
# Medians (and min/max) of --runs samples, curl's time_starttransfer;
# a markdown table on stdout (and --out).
#
#   sudo bench/ondemand.sh [--runs 5] [--cairn PATH] [--out FILE]
#
# Options:
#   --runs N      samples per figure (default 5)
#   --cairn PATH  cairn binary (default target/x86_64-unknown-linux-musl/release/cairn, env CAIRN_BIN)
#   --out FILE    also write the table to FILE
#   --work DIR    scratch (default: a fresh mktemp -d), removed at the end
#
# Needs root, crun, busybox-static, curl.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
repo=$(dirname "$here")
die() {
  printf 'ondemand: error: %s\n' "$*" >&2
  exit 1
}
say() { printf 'ondemand: %s\n' "$*" >&2; }

runs=5
out=
work=
cairn=${CAIRN_BIN:-$repo/target/x86_64-unknown-linux-musl/release/cairn}
while [ $# -gt 0 ]; do
  case $1 in
  --runs) runs=$2; shift 2 ;;
  --cairn) cairn=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  --work) work=$2; shift 2 ;;
  -h | --help) sed -n '2,/^# Needs root/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown option $1" ;;
  esac
done
[ "$(id -u)" = 0 ] || die "needs root (it runs containers)"
[ -x "$cairn" ] || die "no cairn binary at $cairn (cargo build --release, or --cairn)"
command -v curl >/dev/null || die "curl is needed"
command -v python3 >/dev/null || die "python3 is needed"
[ -x /bin/busybox ] || die "busybox-static is needed"

work=${work:-$(mktemp -d /var/tmp/cairn-ondemand.XXXXXX)}
mkdir -p "$work"
root=$work/store
c() { "$cairn" --root "$root" "$@"; }
cleanup() {
  c stop -t 0 od >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

tree=$work/tree
mkdir -p "$tree/bin" "$tree/www"
cp /bin/busybox "$tree/bin/"
for a in sh httpd; do ln -sf busybox "$tree/bin/$a"; done
echo "hello from an on-demand container" >"$tree/www/index.html"
c mkfs --store --name od "$tree" >/dev/null 2>&1

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
hp=$(free_port)
cp=$(free_port)
while [ "$cp" = "$hp" ]; do cp=$(free_port); done

# A long idle stop: the script stops the container itself between cold
# samples (`cairn stop` of the container, not of the listener).
c run -d --name od --listen "127.0.0.1:$hp:$cp" --idle-stop 1h --stop-timeout 0 \
  od httpd -f -p "127.0.0.1:$cp" -h /www >/dev/null

ttfb() { curl -s -o /dev/null -w '%{time_starttransfer}\n' "http://127.0.0.1:$1/index.html"; }
status() {
  c --json ps | python3 -c '
import json,sys
rows=json.load(sys.stdin)
l=[r for r in rows if r.get("listen")]
ctrs=[r for r in rows if not r.get("listen")]
print(l[0]["status"] if l else "gone", len(ctrs))'
}
wait_waiting() {
  for _ in $(seq 500); do
    [ "$(status)" = "waiting 0" ] && return 0
    sleep 0.02
  done
  die "the listener did not go back to waiting"
}
ctr_id() {
  c --json ps | python3 -c '
import json,sys
print([r["id"] for r in json.load(sys.stdin) if not r.get("listen")][0])'
}

cold=()
warm=()
direct=()
say "cold: $runs starts through the proxy"
for _ in $(seq "$runs"); do
  wait_waiting
  cold+=("$(ttfb "$hp")")
  # Stop the container (not the listener): the next sample is cold again.
  c stop -t 0 "$(ctr_id)" >/dev/null
done
wait_waiting
ttfb "$hp" >/dev/null # start it once more, for the warm samples
say "warm: $runs requests through the proxy, $runs direct"
for _ in $(seq "$runs"); do warm+=("$(ttfb "$hp")"); done
for _ in $(seq "$runs"); do direct+=("$(ttfb "$cp")"); done

table=$(python3 - "$runs" "${cold[*]}" "${warm[*]}" "${direct[*]}" <<'EOF'
import statistics, sys
runs = sys.argv[1]
rows = [
    ("cold start through the proxy (container not running)", sys.argv[2]),
    ("warm, through the proxy (container running)", sys.argv[3]),
    ("warm, direct to the container's port (no proxy)", sys.argv[4]),
]
print(f"| time to first byte, busybox httpd (medians of {runs}) | median | min | max |")
print("|---|---:|---:|---:|")
for name, vals in rows:
    v = [float(x) * 1000 for x in vals.split()]
    print(f"| {name} | {statistics.median(v):.2f} ms | {min(v):.2f} ms | {max(v):.2f} ms |")
EOF
)
printf '%s\n' "$table"
if [ -n "$out" ]; then printf '%s\n' "$table" >"$out"; fi
