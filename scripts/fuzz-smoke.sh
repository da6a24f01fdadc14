#!/usr/bin/env bash
# Fuzz smoke run: replays every saved crash input in fuzz/regressions/<target>/
# and then fuzzes each cargo-fuzz target for FUZZ_SECONDS (default 60).
# A crash, a hang (> FUZZ_TIMEOUT s on one input) or a leak fails the run, and
# the input is printed (base64) so that a CI log is enough to reproduce it.
#
# Environment:
#   FUZZ_SECONDS    seconds of fuzzing per target (default 60; 0 = replay only)
#   FUZZ_TARGETS    space-separated subset of targets (default: all)
#   FUZZ_TOOLCHAIN  rustup toolchain to build with, e.g. "nightly" (default: the
#                   default toolchain with RUSTC_BOOTSTRAP=1, which works on stable)
#   FUZZ_TIMEOUT    libFuzzer -timeout per input, seconds (default 10)
#   FUZZ_ARGS       extra libFuzzer arguments for the timed run
#
# Why RUSTC_BOOTSTRAP=1: cargo-fuzz passes -Zsanitizer=address and other -Z
# flags, which only nightly accepts; rustup cannot download a nightly without
# network. RUSTC_BOOTSTRAP=1 makes the stable compiler accept them, and the
# sanitizer runtimes ship with stable's rust-std. Found working with
# cargo-fuzz 0.13.2 and rustc 1.95.0.
set -euo pipefail

cd "$(dirname "$(readlink -f "$0")")/.."

seconds=${FUZZ_SECONDS:-60}
timeout_s=${FUZZ_TIMEOUT:-10}
read -r -a extra_args <<<"${FUZZ_ARGS:-}"

fail() {
  printf 'fuzz-smoke: FAILED: %s\n' "$*" >&2
  exit 1
}

[ -f fuzz/Cargo.toml ] || fail "no fuzz/Cargo.toml: the fuzz targets (cargo fuzz init) are missing from this checkout"

if ! cargo fuzz --version >/dev/null 2>&1; then
  fail "cargo-fuzz is not installed ($(cargo --version 2>&1)); install it with: cargo install --locked cargo-fuzz --version 0.13.2 (setup.sh does)"
fi

toolchain=()
if [ -n "${FUZZ_TOOLCHAIN:-}" ]; then
  toolchain=("+$FUZZ_TOOLCHAIN")
else
  export RUSTC_BOOTSTRAP=1
fi

mapfile -t all_targets < <(cargo fuzz list)
[ "${#all_targets[@]}" -gt 0 ] || fail "cargo fuzz list shows no targets in fuzz/"
if [ -n "${FUZZ_TARGETS:-}" ]; then
  read -r -a targets <<<"$FUZZ_TARGETS"
else
  targets=("${all_targets[@]}")
fi

logdir=fuzz/artifacts/logs
mkdir -p "$logdir"

echo "fuzz-smoke: $(cargo fuzz --version), $(rustc "${toolchain[@]}" --version), targets: ${targets[*]}, ${seconds}s each"

start=$SECONDS
if ! cargo "${toolchain[@]}" fuzz build --release >"$logdir/build.log" 2>&1; then
  tail -n 40 "$logdir/build.log" >&2
  fail "cargo ${toolchain[*]} fuzz build failed (log: $logdir/build.log; RUSTC_BOOTSTRAP=${RUSTC_BOOTSTRAP:-unset})"
fi
echo "fuzz-smoke: built in $((SECONDS - start))s"

# Prints a failing input so that it can be recovered from a log.
show_input() {
  local f=$1 size
  size=$(stat -c %s "$f")
  echo "  input: $f ($size bytes)"
  if [ "$size" -le 65536 ]; then
    echo "  base64 (save with: base64 -d > fuzz/regressions/<target>/<name>):"
    base64 -w 76 "$f" | sed 's/^/    /'
  fi
}

# Seeds, made at run time (no binaries in git): from the composefs test
# vectors, the dumpfiles for dump_parse and the images cairn writes from them
# for erofs_read (random bytes rarely get past the superblock); small GNU tar
# archives for tar_read; for oci_parse, see make_oci_seeds below.
make_seeds() {
  # The composefs test vectors, where the tests look for them.
  local vectors=${CAIRN_COMPOSEFS_VECTORS:-../shared/testdata/composefs} cairn f name
  [ -d "$vectors" ] || {
    make_tar_seeds
    return 0
  }
  mkdir -p fuzz/seeds/dump_parse fuzz/seeds/erofs_read
  cargo build --release -q -p cairn
  cairn="${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-musl/release/cairn"
  for f in "$vectors"/*.dump; do
    name=$(basename "$f")
    [ "$(stat -c %s "$f")" -le 1048576 ] && cp "$f" "fuzz/seeds/dump_parse/$name"
    case $name in should-fail-*) continue ;; esac
    "$cairn" mkfs --from-dump --lenient "$f" "fuzz/seeds/erofs_read/$name.img" >/dev/null 2>&1 ||
      rm -f "fuzz/seeds/erofs_read/$name.img"
  done
  echo "fuzz-smoke: seeds: $(find fuzz/seeds/dump_parse -type f | wc -l) dumpfiles, $(find fuzz/seeds/erofs_read -type f | wc -l) images"
  make_tar_seeds
}

# Small archives in each format GNU tar writes (sparse ones included) for
# tar_read: random bytes almost never pass a header checksum.
make_tar_seeds() {
  command -v tar >/dev/null || return 0
  local src dst=fuzz/seeds/tar_read fmt
  mkdir -p "$dst"
  src=$(mktemp -d)
  mkdir -p "$src/d/$(printf 'n%.0s' {1..90})"
  printf 'hello\n' >"$src/d/f"
  ln -s f "$src/d/s"
  ln "$src/d/f" "$src/d/h"
  printf 'data' | dd of="$src/sparse" bs=1 seek=20000 conv=notrunc 2>/dev/null
  printf 'end' >>"$src/sparse"
  for fmt in ustar gnu oldgnu v7 posix; do
    tar -C "$src" --format=$fmt -cf "$dst/$fmt.tar" d 2>/dev/null || rm -f "$dst/$fmt.tar"
  done
  tar -C "$src" --format=gnu --sparse -cf "$dst/sparse-gnu.tar" sparse 2>/dev/null || true
  for v in 0.0 0.1 1.0; do
    tar -C "$src" --format=posix --sparse --sparse-version=$v -cf "$dst/sparse-$v.tar" sparse 2>/dev/null || true
  done
  rm -rf "$src"
}
[ "$seconds" -gt 0 ] && make_seeds

# Seeds for oci_parse: an image manifest, an index, a config and digests,
# written here as text.
make_oci_seeds() {
  local d=fuzz/seeds/oci_parse z
  z=sha256:$(printf '%064d' 0)
  mkdir -p "$d"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":2},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"%s","size":3}]}' \
    "$z" "$z" >"$d/manifest.json"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":7,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"org.opencontainers.image.ref.name":"t"}}]}' \
    "$z" >"$d/index.json"
  printf '{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["%s"]}}' "$z" >"$d/config.json"
  printf '%s' "$z" >"$d/digest"
  printf 'sha512:%0128d' 0 >"$d/digest-sha512"
}
[ "$seconds" -gt 0 ] && make_oci_seeds

failed=()
for t in "${targets[@]}"; do
  printf '%s\n' "${all_targets[@]}" | grep -qxF "$t" || fail "no fuzz target '$t' (have: ${all_targets[*]})"

  # 1. Every kept crash input must now pass.
  n=0
  if [ -d "fuzz/regressions/$t" ]; then
    while IFS= read -r -d '' f; do
      n=$((n + 1))
      if ! cargo "${toolchain[@]}" fuzz run --release "$t" "$f" -- -timeout="$timeout_s" \
        >"$logdir/$t.regression.log" 2>&1; then
        echo "fuzz-smoke: $t: regression input fails again:" >&2
        grep -E 'panicked at|ERROR: |SUMMARY: ' "$logdir/$t.regression.log" | head -5 | sed 's/^/  /' >&2
        show_input "$f" >&2
        failed+=("$t:regression:$(basename "$f")")
      fi
    done < <(find "fuzz/regressions/$t" -type f ! -name ".*" -print0 | sort -z)
  fi
  echo "fuzz-smoke: $t: replayed $n regression input(s)"

  # 2. Fuzz for a while, seeded with the seeds and the regression inputs.
  [ "$seconds" -gt 0 ] || continue
  corpus=("fuzz/corpus/$t")
  mkdir -p "fuzz/corpus/$t"
  for d in "fuzz/seeds/$t" "fuzz/regressions/$t"; do
    [ -d "$d" ] && corpus+=("$d")
  done
  rm -rf "fuzz/artifacts/$t"
  if cargo "${toolchain[@]}" fuzz run --release "$t" "${corpus[@]}" -- \
    -max_total_time="$seconds" -timeout="$timeout_s" -print_final_stats=1 "${extra_args[@]}" \
    >"$logdir/$t.log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logdir/$t.log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+' "$logdir/$t.log" | tail -1)
    echo "fuzz-smoke: $t: ok, ${runs:-?} runs in ${seconds}s, ${cov:-cov: ?}"
  else
    echo "fuzz-smoke: $t: FAILED (log: $logdir/$t.log):" >&2
    grep -E 'panicked at|ERROR: |SUMMARY: |Test unit written' "$logdir/$t.log" | head -8 | sed 's/^/  /' >&2
    while IFS= read -r -d '' f; do
      show_input "$f" >&2
    done < <(find "fuzz/artifacts/$t" -type f -print0 2>/dev/null)
    echo "  reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run $t <input>; once fixed, add the input to fuzz/regressions/$t/" >&2
    failed+=("$t")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  fail "${failed[*]}"
fi
echo "fuzz-smoke: all ${#targets[@]} target(s) passed in $((SECONDS - start))s"
