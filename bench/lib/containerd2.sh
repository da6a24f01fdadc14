# shellcheck shell=bash
# containerd 2.4.2 (containerd, ctr, containerd-shim-runc-v2) built with
# `go install` from its Go module into /usr/local/lib/cairn-bench/bin:
# sourced by setup.sh (for the snapshotter tests), bench/pull-containerd.sh,
# bench/containerd.sh and bench/commit-ab.sh. Go module downloads use the machine's Go proxy
# settings.

CONTAINERD2_VERSION=2.4.2
CONTAINERD2_BIN=/usr/local/lib/cairn-bench/bin

# The Go toolchain: /usr/local/go/bin/go where present (containerd 2.4.2
# needs Go 1.26; Debian 12's golang-go is 1.19), else go in PATH.
containerd2_go() {
  if [ -x /usr/local/go/bin/go ]; then
    echo /usr/local/go/bin/go
  else
    command -v go 2>/dev/null || echo go
  fi
}

# Installs what of containerd $CONTAINERD2_VERSION is missing or of another
# version. Prints what it does on stderr; fails if Go is missing.
install_containerd2() {
  local b go
  for b in containerd ctr containerd-shim-runc-v2; do
    if [ ! -x "$CONTAINERD2_BIN/$b" ] ||
      ! "$CONTAINERD2_BIN/$b" --version 2>/dev/null | grep -qF "$CONTAINERD2_VERSION"; then
      go=$(containerd2_go)
      command -v "$go" >/dev/null || {
        echo "no Go toolchain (go in PATH or /usr/local/go/bin/go) to build containerd $CONTAINERD2_VERSION" >&2
        return 1
      }
      echo "go install containerd $CONTAINERD2_VERSION into $CONTAINERD2_BIN" >&2
      mkdir -p "$CONTAINERD2_BIN"
      GOBIN=$CONTAINERD2_BIN GOFLAGS=-buildvcs=false "$go" install \
        "github.com/containerd/containerd/v2/cmd/containerd@v$CONTAINERD2_VERSION" \
        "github.com/containerd/containerd/v2/cmd/ctr@v$CONTAINERD2_VERSION" \
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@v$CONTAINERD2_VERSION"
      return
    fi
  done
}

# containerd2_cairn_config DIR SOCK SNAPSHOTTER_SOCK REMOTE: the config of a
# containerd 2.4 with its root, state and sockets in DIR (the CRI plugins
# off), `cairn snapshotter` at SNAPSHOTTER_SOCK as the proxy snapshotter
# `cairn` (with the remote snapshotter labels exported when REMOTE is 1),
# and both `overlayfs` and `cairn` unpacked by the walking differ.
containerd2_cairn_config() {
  local d=$1 sock=$2 snap_sock=$3 remote=$4
  cat <<EOC
version = 3
root = "$d/root"
state = "$d/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.nri.v1.nri"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[proxy_plugins.cairn]
  type = "snapshot"
  address = "$snap_sock"
EOC
  if [ "$remote" = 1 ]; then
    printf '  [proxy_plugins.cairn.exports]\n    enable_remote_snapshot_annotations = "true"\n'
  fi
  cat <<EOC
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "overlayfs"
  differ = "walking"
[[plugins."io.containerd.transfer.v1.local".unpack_config]]
  platform = "linux/amd64"
  snapshotter = "cairn"
  differ = "walking"
EOC
}
