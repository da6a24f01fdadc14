#!/usr/bin/env bash
# The kernel matrix: scripts/vm-test.sh on each kernel cairn is tested on.
#
#   sudo scripts/vm-kernels.sh [TEST-FILTER]    # every kernel of the matrix
#   sudo scripts/vm-kernels.sh --add-suite      # only add bookworm-backports to apt
#
# The kernels: the newest linux-image-6.1.0-*-cloud-amd64 (bookworm) and the
# newest linux-image-6.12.*-cloud-amd64 (bookworm-backports, added to apt
# with the same URI as the machine's Debian source when apt knows no 6.12;
# CAIRN_VM_KERNELS="PKG ..." names others). The host's own kernel is tested
# by the ordinary test suite.
#
# Without /dev/kvm the matrix cannot run: under CI (CI=true) that is a
# failure; run by hand it says which kernels it skipped and exits 0.
# Prints one line per kernel (ok, FAILED, skipped) and exits non-zero if
# any failed.
set -euo pipefail

here=$(dirname "$(readlink -f "$0")")
log() { printf 'vm-kernels: %s\n' "$*" >&2; }

add_suite() {
  local list=/etc/apt/sources.list.d/cairn-bookworm-backports.sources uri
  if apt-cache policy 2>/dev/null | grep -q 'bookworm-backports'; then
    return 0
  fi
  # The URI of the Debian source already configured (deb822 or one-line).
  uri=$(sed -n 's/^URIs: *\([^ ]*debian\/*\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  if [ -z "$uri" ]; then
    uri=$(awk '$1 == "deb" && $3 ~ /^bookworm$/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
  fi
  [ -n "$uri" ] || {
    log "no Debian source in apt's lists to take the URI from"
    return 1
  }
  log "adding bookworm-backports from $uri"
  cat >"$list" <<SOURCES
Types: deb
URIs: $uri
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  apt-get update -q >&2
}

newest() {
  apt-cache search --names-only "$1" | awk '{ print $1 }' | grep -v -- '-dbg$' | sort -V | tail -1
}

if [ "${1:-}" = "--add-suite" ]; then
  add_suite
  exit
fi
filter=${1:-}

if [ -n "${CAIRN_VM_KERNELS:-}" ]; then
  read -r -a kernels <<<"$CAIRN_VM_KERNELS"
else
  [ -n "$(newest '^linux-image-6\.12\..*-cloud-amd64$')" ] || add_suite
  kernels=("$(newest '^linux-image-6\.12\..*-cloud-amd64$')" "$(newest '^linux-image-6\.1\.0-.*-cloud-amd64$')")
fi

if [ ! -c /dev/kvm ]; then
  if [ "${CI:-}" = true ]; then
    log "no /dev/kvm: the kernel matrix cannot run (${kernels[*]}); failing, as CI requires it"
    exit 1
  fi
  for k in "${kernels[@]}"; do echo "kernel matrix: $k skipped (no /dev/kvm)"; done
  exit 0
fi

failed=0
results=()
for k in "${kernels[@]}"; do
  if [ -z "$k" ]; then
    results+=("kernel matrix: a kernel package was not found in apt FAILED")
    failed=1
    continue
  fi
  rc=0
  "$here/vm-test.sh" "$k" ${filter:+"$filter"} || rc=$?
  if [ "$rc" -eq 0 ]; then
    results+=("kernel matrix: $k ok")
  else
    results+=("kernel matrix: $k FAILED (exit $rc)")
    failed=1
  fi
done
printf '%s\n' "${results[@]}"
exit "$failed"
