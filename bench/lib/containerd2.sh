# shellcheck shell=bash
# containerd 2.4.2 (containerd, ctr, containerd-shim-runc-v2) built with
# `go install` from its Go module into /usr/local/lib/cairn-bench/bin:
# sourced by setup.sh (for the snapshotter tests), bench/pull-containerd.sh
# and bench/containerd.sh. Go module downloads use the machine's Go proxy
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
