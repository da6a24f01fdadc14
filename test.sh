#!/usr/bin/env bash
# The whole test suite. Run as root: the integration tests really mount.
#
#   sudo ./test.sh
#
# Steps: shellcheck, cargo fmt --check, cargo clippy -D warnings, cargo test
# (release), the privileged mount tests again on the loop device path
# (CAIRN_EROFS_LOOP=1, then CAIRN_OVERLAY_PRIVATE_NS=1), the kernel matrix
# (scripts/vm-kernels.sh: the mount, verity and run tests on Debian's 6.12
# and the refusal on 6.1, under QEMU), a check that the tests
# left no mount or loop device behind, and
# the fuzz smoke run (scripts/fuzz-smoke.sh, FUZZ_SECONDS per target).
# Every step runs even when an earlier one failed; the exit status is non-zero
# if any failed, and the last line is "summary: N passed, N failed".
#
# Environment: FUZZ_SECONDS (default 30 here), TEST_TIMEOUT (seconds for cargo
# test, default 1800), CARGO_TEST_ARGS (extra arguments after `--` for the
# test binaries, e.g. "--test-threads=1").
set -euo pipefail

cd "$(dirname "$(readlink -f "$0")")"

if [ "$(id -u)" -ne 0 ]; then
  echo "test.sh: must run as root (sudo ./test.sh): the integration tests mount EROFS and overlayfs," >&2
  echo "and a mount test that cannot mount fails instead of being skipped." >&2
  exit 1
fi
if ! command -v cargo >/dev/null 2>&1 && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
  export PATH="${HOME:-/root}/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 || {
  echo "test.sh: cargo not found; run ./setup.sh first" >&2
  exit 1
}

logs=target/test-logs
mkdir -p "$logs"

steps_ok=()
steps_failed=()
tests_passed=0
tests_failed=0
tests_ignored=0

# step NAME COMMAND...: runs COMMAND, shows its output, records the outcome.
step() {
  local name=$1 start=$SECONDS rc=0
  shift
  printf '\n==> %s\n' "$name"
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    steps_ok+=("$name")
    printf -- '--- %s: ok (%ss)\n' "$name" "$((SECONDS - start))"
  else
    steps_failed+=("$name")
    printf -- '--- %s: FAILED, exit %s (%ss)\n' "$name" "$rc" "$((SECONDS - start))"
  fi
}

run_shellcheck() {
  command -v shellcheck >/dev/null 2>&1 || {
    echo "shellcheck not installed (apt-get install shellcheck, or ./setup.sh)"
    return 1
  }
  local files=(setup.sh test.sh .ci/run)
  mapfile -t -O "${#files[@]}" files < <(find scripts bench -name '*.sh' -type f 2>/dev/null | sort)
  shellcheck "${files[@]}" && echo "${#files[@]} scripts clean"
}

# Mounts of the kinds cairn makes, and loop devices: what a test could leak.
mount_snapshot() {
  findmnt -rn -o TARGET,FSTYPE | awk '$2 ~ /^(erofs|overlay|fuse)/' | sort
  losetup -n -l -O NAME,BACK-FILE 2>/dev/null | sort
}

run_cargo_test() {
  local rc=0
  # shellcheck disable=SC2086 # CARGO_TEST_ARGS is a list of words
  timeout "${TEST_TIMEOUT:-1800}" cargo test --workspace --release --no-fail-fast -- ${CARGO_TEST_ARGS:-} 2>&1 |
    tee "$logs/cargo-test.log" || rc=$?
  local p f i
  read -r p f i < <(awk '/^test result:/ {
      for (k = 1; k <= NF; k++) {
        if ($(k+1) ~ /^passed/) p += $k; if ($(k+1) ~ /^failed/) f += $k; if ($(k+1) ~ /^ignored/) i += $k
      } } END { print p+0, f+0, i+0 }' "$logs/cargo-test.log")
  tests_passed=$p tests_failed=$f tests_ignored=$i
  echo "cargo test: $p passed, $f failed, $i ignored"
  [ "$rc" -ne 124 ] || echo "cargo test: killed after ${TEST_TIMEOUT:-1800}s (TEST_TIMEOUT)"
  if [ "$rc" -eq 0 ] && [ "$p" -eq 0 ]; then
    echo "cargo test ran no test"
    return 1
  fi
  return "$rc"
}

# The privileged mount tests again with every EROFS image on a read-only
# loop device (CAIRN_EROFS_LOOP=1), the path kernels without file-backed
# EROFS take; the leftover check below covers its loop devices too.
run_loop_path_tests() {
  local rc=0
  CAIRN_EROFS_LOOP=1 timeout "${TEST_TIMEOUT:-1200}" \
    cargo test --release -p cairn-mount --test privileged_mount 2>&1 | tee "$logs/cargo-test-loop.log" || rc=1
  # And through the private mount namespace of kernels before 6.15 (a few
  # seconds): the path the 6.12 guest of the kernel matrix takes.
  CAIRN_OVERLAY_PRIVATE_NS=1 timeout "${TEST_TIMEOUT:-1200}" \
    cargo test --release -p cairn-mount --test privileged_mount 2>&1 | tee "$logs/cargo-test-privns.log" || rc=1
  return "$rc"
}

# The kernel matrix (scripts/vm-kernels.sh): Debian's 6.12 and 6.1 kernels
# booted under QEMU, the mount tests run inside. Needs /dev/kvm: without it
# this step fails under CI and says which kernels it skipped by hand.
run_kernel_matrix() {
  CAIRN_VM_PROFILE=release scripts/vm-kernels.sh 2>&1 | tee "$logs/kernel-matrix.log"
}

check_leftovers() {
  mount_snapshot >"$logs/mounts.after"
  comm -13 "$logs/mounts.before" "$logs/mounts.after" >"$logs/mounts.leaked"
  if [ -s "$logs/mounts.leaked" ]; then
    echo "the tests left these mounts or loop devices behind:"
    sed 's/^/  /' "$logs/mounts.leaked"
    return 1
  fi
  echo "no mount or loop device left behind"
}

step shellcheck run_shellcheck
step "cargo fmt" cargo fmt --all -- --check
step "cargo clippy" cargo clippy --workspace --all-targets -- -D warnings
mount_snapshot >"$logs/mounts.before"
step "cargo test" run_cargo_test
step "mount tests on loop devices" run_loop_path_tests
step "kernel matrix" run_kernel_matrix
step "leftover mounts" check_leftovers
FUZZ_SECONDS=${FUZZ_SECONDS:-30} step "fuzz smoke" scripts/fuzz-smoke.sh

# The summary counts each cargo test case, plus each other step as one check.
other_ok=0
for s in "${steps_ok[@]}"; do [ "$s" = "cargo test" ] || other_ok=$((other_ok + 1)); done
other_failed=0
cargo_test_failed=0
for s in "${steps_failed[@]}"; do
  if [ "$s" = "cargo test" ]; then cargo_test_failed=1; else other_failed=$((other_failed + 1)); fi
done
# A cargo test that failed without a failing test case (build error, timeout) still counts once.
if [ "$cargo_test_failed" -eq 1 ] && [ "$tests_failed" -eq 0 ]; then
  tests_failed=1
fi

echo
echo "steps ok: ${steps_ok[*]:-none}"
echo "steps failed: ${steps_failed[*]:-none}"
echo "cargo test: $tests_passed passed, $tests_failed failed, $tests_ignored ignored; other checks: $other_ok passed, $other_failed failed"
echo "summary: $((tests_passed + other_ok)) passed, $((tests_failed + other_failed)) failed"
[ "${#steps_failed[@]}" -eq 0 ]
