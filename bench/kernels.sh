#!/usr/bin/env bash
# Mount and run costs on the 6.12 guest of the kernel matrix: verity
# required against off, and EROFS on a loop device against file-backed.
#
#   sudo bench/kernels.sh [KERNEL-PACKAGE]   # default: the 6.12 kernel vm-kernels.sh uses
#
# Boots the kernel with scripts/vm-test.sh in bench mode (the guest runs
# bench/kernels-guest.sh), then writes bench/results/kernels-<kernel>.md
# with the median of each case and the ratios. The guest is a QEMU VM,
# under TCG (emulated, one vCPU) on the development machine: absolute
# figures say little; compare the ratios within one run.
set -euo pipefail
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
repo=$(dirname "$here")
pkg=${1:-linux-image-6.12.117+deb12-cloud-amd64}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
CAIRN_VM_BENCH=$here/kernels-guest.sh CAIRN_VM_TIMEOUT=${CAIRN_VM_TIMEOUT:-1200} \
  "$repo/scripts/vm-test.sh" "$pkg" 2>&1 | tee "$log" >&2
grep -q "BENCH-DONE" "$log" || { echo "bench: the guest did not finish" >&2; exit 1; }
accel=$(sed -n 's/.*guest finished under \([a-z]*\) in.*/\1/p' "$log" | tail -1)
kver=$(sed -n 's/^vm: CAIRN-VM: kernel //p' "$log" | tail -1)
median() { # case -> median of its rounds
  grep "^vm: BENCH $1 " "$log" | awk '{ print $5 }' | sort -n |
    awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2]; else printf "%.1f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
rounds=$(grep -c "^vm: BENCH mount-file-off " "$log")
out=$repo/bench/results/kernels-${kver:-$pkg}.md
{
  echo "# Mount and run on Linux ${kver:-$pkg} (kernel matrix guest)"
  echo
  echo "Measured by \`bench/kernels.sh\` on $(date -u +%Y-%m-%d). **The guest is a QEMU"
  echo "virtual machine under ${accel:-?}$([ "${accel:-}" = tcg ] && echo " (instructions emulated, one vCPU)"),"
  echo "itself on a virtual machine**: absolute times are many times those of real"
  echo "hardware; only the ratios within this run mean something. Store and image on"
  echo "the guest's ext4 scratch disk (\`-O verity\`), objects sealed with fs-verity."
  echo "The image: busybox and 50 files of 100 bytes (51 objects). Each figure is the median of $rounds"
  echo "rounds; a round times 10 mount+umount (5 runs) back to back with"
  echo "/proc/uptime (centiseconds)."
  echo
  echo "| case | ms per operation (median) |"
  echo "| --- | --- |"
  for c in mount-file-off mount-file-verity mount-loop-off mount-loop-verity run-off run-verity; do
    echo "| $c | $(median $c) |"
  done
  echo
  echo "| ratio | |"
  echo "| --- | --- |"
  echo "| mount+umount, verity=require / off (file-backed) | $(ratio "$(median mount-file-verity)" "$(median mount-file-off)") |"
  echo "| mount+umount, verity=require / off (loop) | $(ratio "$(median mount-loop-verity)" "$(median mount-loop-off)") |"
  echo "| mount+umount, loop / file-backed (verity off) | $(ratio "$(median mount-loop-off)" "$(median mount-file-off)") |"
  echo "| warm cairn run, verity=require / off | $(ratio "$(median run-verity)" "$(median run-off)") |"
  echo
  echo "Every mount on this kernel goes through the private-namespace path"
  echo "(no detached overlay layers before 6.15), and each \`cairn mount\` is a"
  echo "new process, so each probes the kernel (a few ms). With \`--verity off\`"
  echo "it first tries detached layers, which fails, then probes and builds the"
  echo "stack again; \`--verity require\` probes first (no failed attempt) but"
  echo "reads the image and \`statx\`es each of its objects (51 here). The two"
  echo "extra costs are of the same order here, which is why the ratios are"
  echo "near 1. The development machine was loaded by other builds meanwhile"
  echo "(load average 15-20 on 2 cores): the rounds spread widely (raw lines)."
  echo
  echo "Raw lines:"
  echo
  echo '```'
  grep "^vm: BENCH " "$log" | sed 's/^vm: //'
  echo '```'
} >"$out"
echo "bench: wrote $out" >&2
