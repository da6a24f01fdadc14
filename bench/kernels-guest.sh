#!/bin/sh
# Runs inside the kernel-matrix guest (scripts/vm-test.sh with
# CAIRN_VM_BENCH=bench/kernels-guest.sh; bench/kernels.sh drives it), with
# the store on the scratch ext4 disk (-O verity). Prints one line per
# measurement: "BENCH <case> <round> <ms per operation>".
#
# Cases, each ROUNDS rounds of N operations timed together (busybox has
# no sub-second clock; /proc/uptime counts centiseconds, so N operations
# per round give per-operation resolution of 10/N ms):
#   mount-file-off / mount-file-verity   cairn mount + cairn umount, file-backed EROFS
#   mount-loop-off / mount-loop-verity   the same with CAIRN_EROFS_LOOP=1
#   run-off / run-verity                 warm `cairn run --rm T /bin/true`
# All cases of a round run one after another, so a drift of the (emulated)
# machine affects each case alike.
set -u
ROUNDS=${ROUNDS:-5}
N=${N:-10}
NRUN=${NRUN:-5}
base=/tmp/bench
rm -rf "$base"
mkdir -p "$base/tree/bin" "$base/tree/etc" "$base/mnt"
export CAIRN_ROOT=$base/store
cp /bin/busybox "$base/tree/bin/busybox"
for a in sh true echo cat ls; do ln -s busybox "$base/tree/bin/$a"; done
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$base/tree/etc/passwd"
printf 'root:x:0:\n' >"$base/tree/etc/group"
i=0
while [ $i -lt 50 ]; do
  # 100 bytes: above the inline threshold, so each is an object.
  printf 'file %03d %090d\n' "$i" 0 >"$base/tree/etc/f$i"
  i=$((i + 1))
done
cairn -q mkfs --store --name T "$base/tree" || {
  echo "BENCH-ERROR mkfs"
  exit 1
}
now() { cut -d' ' -f1 /proc/uptime | tr -d .; } # centiseconds
# ms per op for N ops of "$@", as a decimal with one digit.
timed() {
  n=$1
  shift
  t0=$(now)
  j=0
  while [ $j -lt "$n" ]; do
    "$@" || {
      echo "BENCH-ERROR $*"
      return 1
    }
    j=$((j + 1))
  done
  t1=$(now)
  # (t1-t0) cs * 10 ms/cs / n, with one decimal
  echo $(((t1 - t0) * 100 / n)) | sed 's/\(.\)$/.\1/'
}
mount_umount() {
  cairn -q mount --verity "$1" T "$base/mnt" >/dev/null && cairn -q umount "$base/mnt"
}
run_true() {
  cairn -q run --rm --verity "$1" T /bin/true </dev/null >/dev/null
}
# Warm: one of each first.
if ! { mount_umount off && mount_umount require && run_true off && run_true require; }; then
  echo "BENCH-ERROR warm-up"
  exit 1
fi
r=1
while [ $r -le "$ROUNDS" ]; do
  unset CAIRN_EROFS_LOOP
  echo "BENCH mount-file-off $r $(timed "$N" mount_umount off)"
  echo "BENCH mount-file-verity $r $(timed "$N" mount_umount require)"
  export CAIRN_EROFS_LOOP=1
  echo "BENCH mount-loop-off $r $(timed "$N" mount_umount off)"
  echo "BENCH mount-loop-verity $r $(timed "$N" mount_umount require)"
  unset CAIRN_EROFS_LOOP
  echo "BENCH run-off $r $(timed "$NRUN" run_true off)"
  echo "BENCH run-verity $r $(timed "$NRUN" run_true require)"
  r=$((r + 1))
done
echo "BENCH-DONE"
