#!/usr/bin/env bash
# Installs what cairn needs on a Debian 12 machine, builds it, and shows it
# working (scripts/demo.sh). Also puts the built-in `demo` image (busybox)
# into the store. Safe to run again: it installs only what is missing, the
# demo image is reproducible and the demo cleans up after itself.
#
#   sudo ./setup.sh             install + build + demo image + demo
#   sudo ./setup.sh --no-demo   install + build + demo image (what .ci/run uses)
set -euo pipefail

cd "$(dirname "$(readlink -f "$0")")"

# cargo-fuzz version known to work here (see scripts/fuzz-smoke.sh).
CARGO_FUZZ_VERSION=0.13.2

# What cairn and its tests, demo, fuzzing and benchmarks use.
PACKAGES=(
  erofs-utils       # mkfs.erofs / fsck.erofs / dump.erofs: cross-checks and bench baseline
  fuse3             # FUSE (lazy-loading path)
  crun              # OCI runtime for `cairn run`
  docker-registry   # local registry for pull tests
  skopeo umoci      # build and copy test images
  busybox-static    # a static userland for test images
  fio               # read benchmarks
  btrfs-progs       # reflink tests on a loop-mounted btrfs
  systemd-container # systemd-nspawn: a baseline of bench/run3.sh
  uidmap            # newuidmap/newgidmap for user-namespace tests
  attr acl          # getfattr/setfattr, getfacl/setfacl
  e2fsprogs         # mkfs.ext4 (--upper disk:SIZE), chattr (benchmarks)
  hyperfine         # ad-hoc timing
  socat jq          # bench/lazy.sh: its shaped link and cairn's --json reports
  python3 python3-matplotlib  # bench helpers and plots
  debootstrap       # builds the Debian benchmark tree
  shellcheck        # lints the shell scripts in test.sh
  build-essential pkg-config  # C toolchain: libfuzzer-sys, crates with C parts
  musl-tools        # musl-gcc: cairn is a static musl binary (.cargo/config.toml)
  containerd runc   # `cairn snapshotter` tests: containerd 1.6 and ctr, runc for ctr run
  golang-github-containerd-containerd-dev  # containerd's snapshotter suite (tests/containerd-suite)
  stargz-snapshotter  # ctr-remote: eStargz images for the lazy eStargz tests
  golang-go         # builds that suite in GOPATH mode (/usr/local/go is used where present)
  qemu-system-x86 cpio kmod xz-utils zstd  # the kernel matrix (scripts/vm-test.sh): boot, initramfs, modules
)

demo=1
for arg in "$@"; do
  case "$arg" in
    --no-demo) demo=0 ;;
    -h | --help)
      sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "setup.sh: unknown option '$arg' (try --help)" >&2
      exit 2
      ;;
  esac
done

# shellcheck source=bench/lib/containerd2.sh
. bench/lib/containerd2.sh

step() { printf '\n==> %s\n' "$*"; }
die() {
  printf 'setup.sh: error: %s\n' "$*" >&2
  exit 1
}

[ "$(id -u)" -eq 0 ] || die "run as root (sudo ./setup.sh): it installs packages, and the demo mounts"

if [ -r /etc/os-release ]; then
  # shellcheck disable=SC1091
  . /etc/os-release
  if [ "${ID:-}" != debian ] || [ "${VERSION_ID:-}" != 12 ]; then
    echo "setup.sh: warning: written for Debian 12, this is ${PRETTY_NAME:-unknown}; carrying on" >&2
  fi
fi

step "System packages"
missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [ "$status" = installed ] || missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "all ${#PACKAGES[@]} packages already installed"
else
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi

step "Rust toolchain"
# rustup installs into ~/.cargo/bin, which a non-login root shell may not have on PATH.
if ! command -v cargo >/dev/null 2>&1 && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
  export PATH="${HOME:-/root}/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  cat >&2 <<'EOF'
setup.sh: error: cargo not found.
cairn needs Rust 1.88 or newer (rust-version in Cargo.toml); Debian 12's own rustc (1.63) is too old.
Install rustup, then run this script again:
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
    . "$HOME/.cargo/env"
EOF
  exit 1
fi
need_minor=$(sed -n 's/^rust-version = "1\.\([0-9]*\).*/\1/p' Cargo.toml)
have_minor=$(rustc --version | sed -n 's/^rustc 1\.\([0-9]*\).*/\1/p')
if [ -n "$need_minor" ] && [ -n "$have_minor" ] && [ "$have_minor" -lt "$need_minor" ]; then
  die "$(rustc --version) is older than the 1.$need_minor this workspace needs: rustup update stable"
fi
echo "$(cargo --version), $(rustc --version)"

# The target cairn is built for (see .cargo/config.toml).
target=$(sed -n 's/^target = "\(.*\)"/\1/p' .cargo/config.toml)
[ -n "$target" ] || die "no build target in .cargo/config.toml"
if rustc --print target-libdir --target "$target" 2>/dev/null | xargs -r test -d; then
  echo "Rust target $target already installed"
else
  command -v rustup >/dev/null 2>&1 ||
    die "the Rust target $target is missing and there is no rustup to add it (rustup target add $target)"
  echo "adding the Rust target $target (rustup)"
  rustup target add "$target" ||
    die "rustup could not add the target $target; cairn is built as a static musl binary (.cargo/config.toml)"
fi

if cargo fuzz --version >/dev/null 2>&1; then
  echo "$(cargo fuzz --version) already installed"
else
  echo "installing cargo-fuzz $CARGO_FUZZ_VERSION from crates.io"
  # From / so that this project's build target (.cargo/config.toml) does not apply.
  (cd / && cargo install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION")
fi

step "containerd $CONTAINERD2_VERSION (snapshotter tests; go install into $CONTAINERD2_BIN)"
install_containerd2 || die "could not build containerd $CONTAINERD2_VERSION with Go"
"$CONTAINERD2_BIN/containerd" --version
# The Go modules of the containerd 2.4 suite and client (tests/containerd2).
(cd tests/containerd2 && GOFLAGS=-mod=readonly "$(containerd2_go)" mod download) ||
  die "could not download the Go modules of tests/containerd2"

step "Build (cargo build --release)"
cargo build --release
cairn_bin=$(readlink -f "${CARGO_TARGET_DIR:-target}/$target/release/cairn")
echo "built $cairn_bin"

# The built-in demo image (`cairn run demo -- echo hello`), in both modes:
# tests and CI use it too. Reproducible, so running setup again changes nothing.
step "Demo image (busybox-static -> image 'demo' in ${CAIRN_ROOT:-/var/lib/cairn})"
scripts/make-demo-image.sh "$cairn_bin"

if [ "$demo" -eq 1 ]; then
  step "Demo"
  scripts/demo.sh "$cairn_bin"
fi

step "Done"
echo "run the test suite with: sudo ./test.sh"
