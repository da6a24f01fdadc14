#!/usr/bin/env bash
# Boots a Debian kernel under QEMU/KVM and runs cairn's privileged tests in it.
#
#   sudo scripts/vm-test.sh KERNEL-PACKAGE [TEST-FILTER]
#   sudo scripts/vm-test.sh linux-image-6.12.117+deb12-cloud-amd64 loop_path
#
# KERNEL-PACKAGE is a Debian kernel image package that apt can download
# (bookworm's linux-image-6.1.0-*-cloud-amd64; 6.12 from bookworm-backports,
# which `scripts/vm-kernels.sh --add-suite` adds). The package is unpacked,
# never installed. The guest is an initramfs built here: busybox-static, the
# kernel's modules that the tests need (with their dependencies, from the
# package's modules.dep), mkfs.erofs and crun with their libraries, `cairn`
# and the test binaries built on this host (static musl binaries), plus a
# scratch disk formatted ext4 with the `verity` feature, mounted at /scratch
# with /tmp on it (EROFS cannot read image files on tmpfs).
#
# The guest runs `cairn probe`, then each test binary of CAIRN_VM_TESTS
# ("crate:test[:filter,filter…]" entries; TEST-FILTER, when given, replaces
# every entry's filters). The default: the mount crate's privileged_mount
# (once as it is and once with CAIRN_EROFS_LOOP=1), cairn's
# privileged_verity (with CAIRN_TEST_EXPECT_VERITY=1 where ext4 has
# fs-verity, so the kernel's checks must run) and two of cairn's
# privileged_run tests (crun, plain and idmapped). On a kernel that cannot
# run the stack only the mount crate's refusal test runs. The guest first
# moves its root from the initramfs (rootfs, which pivot_root refuses, and
# crun pivots) to a tmpfs. Its
# console is printed as it comes, each guest line prefixed with "vm: ",
# except the test harness's own lines ("test NAME ... ok", "test result:
# ..."), which are printed as they are so that the host's test summary
# counts them. The exit status is the tests' (non-zero if any failed), 3
# when the guest did not finish (timeout, kernel panic) and 2 when there is
# no /dev/kvm.
#
# CAIRN_VM_BENCH=SCRIPT runs that shell script in the guest instead of the
# tests (bench/kernels.sh uses bench/kernels-guest.sh); its lines come back
# prefixed "vm: " like the rest of the console.
#
# Environment: CAIRN_VM_DIR (work directory, default /var/tmp/cairn-vm),
# CAIRN_VM_TIMEOUT (seconds for the guest, default 600), CAIRN_VM_TESTS
# ("crate:test ..." pairs), CARGO_TARGET_DIR as for cargo.
set -euo pipefail

usage() {
  echo "usage: $0 KERNEL-PACKAGE [TEST-FILTER]" >&2
  exit 64
}
if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
pkg=$1
filter=${2:-}
case $pkg in
  linux-image-*) ;;
  *) usage ;;
esac

repo=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
work=${CAIRN_VM_DIR:-/var/tmp/cairn-vm}
tests=${CAIRN_VM_TESTS:-cairn-mount:privileged_mount cairn:privileged_verity cairn:privileged_run:privileged_run_echo_exit_codes_and_signals,privileged_run_userns_auto_ranges_and_ownership}
timeout_s=${CAIRN_VM_TIMEOUT:-600}
bench=${CAIRN_VM_BENCH:-}
if [ -n "$bench" ]; then
  bench=$(readlink -f "$bench")
  [ -f "$bench" ] || { echo "vm-test: no bench script $bench" >&2; exit 64; }
  tests=
fi

log() { printf 'vm-test: %s\n' "$*" >&2; }
die() {
  log "$*"
  exit 1
}

if [ "$(id -u)" -ne 0 ]; then
  die "must run as root (apt-get, mkfs.ext4 and KVM)"
fi
if [ ! -c /dev/kvm ] || ! [ -r /dev/kvm ] || ! [ -w /dev/kvm ]; then
  log "no usable /dev/kvm on this machine: cannot boot $pkg (the kernel matrix needs KVM)"
  exit 2
fi

# ---------------------------------------------------------------- tools --
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v cpio >/dev/null || need+=(cpio)
command -v depmod >/dev/null || need+=(kmod)
command -v xz >/dev/null || need+=(xz-utils)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v mkfs.erofs >/dev/null || need+=(erofs-utils)
command -v crun >/dev/null || need+=(crun)
if [ "${#need[@]}" -gt 0 ]; then
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2
fi
if ldd /bin/busybox >/dev/null 2>&1; then
  die "/bin/busybox is not static (apt-get install busybox-static)"
fi

# --------------------------------------------------------------- kernel --
kdir=$work/kernels/$pkg
if [ ! -d "$kdir/root/boot" ]; then
  mkdir -p "$kdir/deb"
  log "downloading $pkg"
  if ! (cd "$kdir/deb" && apt-get download "$pkg" >&2); then
    die "apt cannot download $pkg (for 6.12: scripts/vm-kernels.sh --add-suite, then apt-get update)"
  fi
  rm -rf "$kdir/root.tmp"
  dpkg-deb -x "$kdir"/deb/*.deb "$kdir/root.tmp"
  mv "$kdir/root.tmp" "$kdir/root"
fi
kver=$(ls "$kdir/root/lib/modules")
vmlinuz=$kdir/root/boot/vmlinuz-$kver
[ -f "$vmlinuz" ] || die "no $vmlinuz in $pkg"
[ -f "$kdir/root/lib/modules/$kver/modules.dep" ] || depmod -b "$kdir/root" "$kver"

# The modules the tests need, dependencies first (modules.dep lists a
# module's dependencies after it, deepest last). Built-in ones are skipped.
moddir=$kdir/root/lib/modules/$kver
declare -A seen=()
order=()
add_module() {
  local name=$1 line path dep
  line=$(grep -E "(^|/)${name}\.ko(\.xz|\.zst|\.gz)?:" "$moddir/modules.dep" || true)
  [ -n "$line" ] || return 0 # built in, or not built at all
  path=${line%%:*}
  [ -z "${seen[$path]:-}" ] || return 0
  seen[$path]=1
  for dep in ${line#*:}; do
    dep=$(basename "$dep")
    add_module "${dep%%.ko*}"
  done
  order+=("$path")
}
for m in virtio_blk virtio_pci ext4 loop erofs overlay fuse; do
  add_module "$m"
done

# --------------------------------------------------------- test binaries --
cd "$repo"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
# CAIRN_VM_PROFILE: release (what setup.sh and test.sh build, so CI reuses
# it) or debug (quicker to build by hand).
profile=${CAIRN_VM_PROFILE:-release}
case $profile in
  release) cargo_profile=(--release) ;;
  debug) cargo_profile=() ;;
  *) die "CAIRN_VM_PROFILE must be release or debug" ;;
esac
bins=()
names=()
filters=()
for t in $tests; do
  crate=${t%%:*} name=${t#*:}
  tfilter=
  case $name in *:*) tfilter=${name#*:} name=${name%%:*} ;; esac
  log "building $crate --test $name ($profile)"
  # (Not tee /dev/stderr: where stderr is a file, reopening it truncates it.)
  built=$(cargo test "${cargo_profile[@]}" -p "$crate" --test "$name" --no-run 2>&1) || {
    printf '%s\n' "$built" >&2
    die "building $crate --test $name failed"
  }
  printf '%s\n' "$built" >&2
  exe=$(sed -n 's/^ *Executable .*(\(.*\))$/\1/p' <<<"$built" | tail -1)
  [ -x "$exe" ] || die "no test binary for $crate --test $name"
  bins+=("$exe")
  names+=("$crate-$name")
  filters+=("${filter:-${tfilter//,/ }}")
done
log "building cairn ($profile)"
if [ "$profile" = release ]; then
  cargo build --release >&2 # the whole workspace, as setup.sh builds it: nothing to redo in CI
else
  cargo build -p cairn >&2
fi
# The build target of .cargo/config.toml.
cairn_bin=$CARGO_TARGET_DIR/x86_64-unknown-linux-musl/$profile/cairn
[ -x "$cairn_bin" ] || die "no $cairn_bin"

# ------------------------------------------------------------ initramfs --
run=$work/run/$pkg
rm -rf "$run"
mkdir -p "$run/root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,run,tmp,scratch,modules,cairn/tests,etc}
root=$run/root
cp /bin/busybox "$root/bin/busybox"
: >"$root/modules/order"
for path in "${order[@]}"; do
  base=$(basename "$path")
  case $base in
    *.xz) xz -dc "$moddir/$path" >"$root/modules/${base%.xz}" && base=${base%.xz} ;;
    *.zst) zstd -qdc "$moddir/$path" >"$root/modules/${base%.zst}" && base=${base%.zst} ;;
    *.gz) gzip -dc "$moddir/$path" >"$root/modules/${base%.gz}" && base=${base%.gz} ;;
    *) cp "$moddir/$path" "$root/modules/$base" ;;
  esac
  echo "$base" >>"$root/modules/order"
done

# A dynamically linked program with its libraries, at the same paths.
copy_with_libs() {
  local prog lib
  prog=$(command -v "$1")
  install -D "$prog" "$root$prog"
  for lib in $(ldd "$prog" | awk '/=>/ { print $3 } /^\t\/lib/ { print $1 }'); do
    [ -f "$root$lib" ] || install -D "$(readlink -f "$lib")" "$root$lib"
  done
}
copy_with_libs mkfs.erofs
copy_with_libs crun
install -D "$cairn_bin" "$root/usr/bin/cairn"
strip "$root/usr/bin/cairn" 2>/dev/null || true
# The cairn crate's tests run the binary at the path cargo compiled into
# them (CARGO_BIN_EXE_cairn): the same one, there too.
mkdir -p "$root$(dirname "$cairn_bin")"
ln -s /usr/bin/cairn "$root$cairn_bin"
: >"$root/cairn/tests/list"
for i in "${!bins[@]}"; do
  install "${bins[$i]}" "$root/cairn/tests/${names[$i]}"
  strip "$root/cairn/tests/${names[$i]}" 2>/dev/null || true
  # One line per binary: its name and its filters (may be empty).
  printf '%s %s\n' "${names[$i]}" "${filters[$i]}" >>"$root/cairn/tests/list"
done
if [ -n "$bench" ]; then install -m 755 "$bench" "$root/cairn/bench.sh"; fi
echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
echo "root:x:0:" >"$root/etc/group"

cat >"$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/bin:/usr/sbin:/bin:/sbin HOME=/root
if [ ! -e /.on-tmpfs ]; then
  # rootfs cannot be pivoted away from (crun pivot_roots): copy the tree
  # to a tmpfs and start again there.
  mkdir -p /newroot
  mount -t tmpfs -o size=90% tmpfs /newroot
  for d in /*; do
    case $d in /newroot | /proc | /sys | /dev) ;; *) cp -a "$d" /newroot/ ;; esac
  done
  mkdir -p /newroot/proc /newroot/sys /newroot/dev
  : >/newroot/.on-tmpfs
  exec switch_root /newroot /init
fi
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/shm /dev/pts /sys/fs/cgroup
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
while read -r m; do
  insmod "/modules/$m" || echo "CAIRN-VM: insmod $m failed"
done </modules/order
i=0
while [ ! -b /dev/vda ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
mount -t ext4 /dev/vda /scratch || echo "CAIRN-VM: cannot mount the scratch disk"
mkdir -p /scratch/tmp
mount --bind /scratch/tmp /tmp
echo "CAIRN-VM: kernel $(uname -r)"
# The store's filesystem is the scratch disk's (/tmp is bound there).
mkdir -p /tmp/probe-store
CAIRN_ROOT=/tmp/probe-store cairn probe >/tmp/probe.txt 2>&1
cat /tmp/probe.txt
probe_rc=0
if grep -q "^cairn mount and cairn run: supported" /tmp/probe.txt; then
  # ext4 with fs-verity (the scratch disk has the feature): the verity
  # tests must then take the kernel's branch, and the probe's line for the
  # store's filesystem must say so. (Not the line "fs-verity": it asks
  # cairn's own binary, here on a tmpfs.)
  if [ -e /sys/fs/ext4/features/verity ]; then
    export CAIRN_TEST_EXPECT_VERITY=1
    echo "CAIRN-VM: ext4 has fs-verity: the verity tests must take the kernel's branch"
    if ! grep -q "^  yes  fs-verity on the store's filesystem (/tmp/probe-store)" /tmp/probe.txt; then
      echo "CAIRN-VM: FAILED: cairn probe does not see fs-verity on the store's ext4"
      probe_rc=1
    fi
  fi
else
  # The kernel lacks the stack: what is left to test is that cairn says so
  # and leaves nothing behind.
  echo "CAIRN-VM: this kernel cannot run the composefs stack; testing its refusal only"
  refusal=check
fi
rc=$probe_rc
if [ -x /cairn/bench.sh ]; then
  /cairn/bench.sh || rc=1
  echo "CAIRN-VM-EXIT $rc"
  sync
  poweroff -f
fi
if [ -n "${refusal:-}" ]; then
  # cairn mount itself: one line naming what is missing, nothing left.
  export CAIRN_ROOT=/tmp/refusal/store
  mkdir -p /tmp/refusal/src /tmp/refusal/mnt
  echo hello >/tmp/refusal/src/hello
  before=$(cat /proc/self/mountinfo | wc -l)
  if ! cairn mkfs --store /tmp/refusal/src /tmp/refusal/image.cfs; then
    echo "CAIRN-VM: cairn mkfs failed"
    rc=1
  elif cairn mount /tmp/refusal/image.cfs /tmp/refusal/mnt 2>/tmp/refusal/err; then
    echo "CAIRN-VM: cairn mount succeeded where the probe said it cannot"
    rc=1
  else
    echo "CAIRN-VM: cairn mount said: $(cat /tmp/refusal/err)"
    lines=$(wc -l </tmp/refusal/err)
    after=$(cat /proc/self/mountinfo | wc -l)
    loops=$(cat /sys/block/loop*/loop/backing_file 2>/dev/null | wc -l)
    if [ "$lines" -eq 1 ] && [ "$before" -eq "$after" ] && [ "$loops" -eq 0 ]; then
      echo "CAIRN-VM: refusal ok: one line, nothing mounted, no loop device"
    else
      echo "CAIRN-VM: refusal NOT ok: $lines lines, mounts $before -> $after, loop devices $loops"
      rc=1
    fi
  fi
  unset CAIRN_ROOT
fi
while read -r name filter; do
  t=/cairn/tests/$name
  modes=file
  if [ "$name" = cairn-mount-privileged_mount ]; then
    modes="file loop"
    if [ -n "${refusal:-}" ]; then
      modes=file
      filter=privileged_mount_follows_the_probe
    fi
  elif [ -n "${refusal:-}" ]; then
    continue
  fi
  for mode in $modes; do
    echo "CAIRN-VM: running $name ($mode path) ${filter:+filter $filter}"
    if [ "$mode" = loop ]; then export CAIRN_EROFS_LOOP=1; else unset CAIRN_EROFS_LOOP; fi
    s0=$(cut -d. -f1 /proc/uptime)
    # shellcheck disable=SC2086
    "$t" --test-threads=2 $filter </dev/null || rc=1
    echo "CAIRN-VM: $name ($mode path) took $(($(cut -d. -f1 /proc/uptime) - s0))s"
  done
done </cairn/tests/list
unset CAIRN_EROFS_LOOP
echo "CAIRN-VM: loop devices left: $(cat /sys/block/loop*/loop/backing_file 2>/dev/null | wc -l)"
echo "CAIRN-VM-EXIT $rc"
sync
poweroff -f
INIT
chmod 755 "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet) >"$run/initrd.cpio"

# --------------------------------------------------------- scratch disk --
truncate -s 2G "$run/scratch.img"
mkfs.ext4 -q -F -O verity -E nodiscard "$run/scratch.img"

# ------------------------------------------------------------------ boot --
# KVM by default. -cpu: the host's model without IA32_ARCH_CAPABILITIES,
# which a nested KVM (the development machine is itself a VM) refuses to
# set. That machine's KVM (kvm-pvm) cannot run Debian's kernels at all: it
# cannot emulate the VEX instructions of 6.12's boot decompressor ("KVM
# internal error") and 6.1 never gets past decompression. A guest that
# has not reached its init within CAIRN_VM_BOOT_TIMEOUT seconds (default
# 60), or that KVM gives up on, is booted again under TCG, which says so;
# CAIRN_VM_ACCEL=tcg starts there.
boot_timeout=${CAIRN_VM_BOOT_TIMEOUT:-60}
run_guest() {
  local accel=$1 qemu watchdog
  # Under TCG one vCPU: with two, a 6.12 guest crashed at boot on an int3
  # left by its own code patching (text_poke_bp) in CI, a race of QEMU's
  # multi-threaded TCG with cross-modifying code.
  local accel_args=(-accel tcg -cpu max -smp 1)
  if [ "$accel" = kvm ]; then
    accel_args=(-enable-kvm -cpu "${CAIRN_VM_CPU:-host,-arch-capabilities}" -smp 2)
  fi
  rm -f "$run/console.log" "$run/gave-up"
  : >"$run/console.log"
  log "booting $kver under $accel ($(du -h "$run/initrd.cpio" | cut -f1) initramfs, ${#order[@]} modules)"
  timeout "$timeout_s" qemu-system-x86_64 "${accel_args[@]}" \
    -m 2G -nodefaults -vga none -display none -serial stdio \
    -no-reboot -kernel "$vmlinuz" -initrd "$run/initrd.cpio" \
    -append "console=ttyS0 quiet panic=-1 rdinit=/init" \
    -drive "file=$run/scratch.img,if=virtio,format=raw" \
    -nic none </dev/null >"$run/console.log" 2>&1 &
  qemu=$!
  (
    sleep "$boot_timeout"
    if ! grep -aq "^CAIRN-VM: kernel" "$run/console.log"; then
      echo "no init after ${boot_timeout}s" >"$run/gave-up"
      kill "$qemu" 2>/dev/null
    fi
  ) &
  watchdog=$!
  tail -n +1 -f --pid="$qemu" "$run/console.log" 2>/dev/null | while IFS= read -r line; do
    line=${line%$'\r'}
    case $line in
      "KVM internal error"*)
        printf 'vm: %s\n' "$line"
        echo "KVM internal error" >"$run/gave-up"
        kill "$qemu" 2>/dev/null || true
        ;;
      "test "* | "running "* | "failures:"* | "---- "*) printf '%s\n' "$line" ;;
      *) printf 'vm: %s\n' "$line" ;;
    esac
  done
  wait "$qemu" || true
  kill "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
}

start=$SECONDS
accel=${CAIRN_VM_ACCEL:-kvm}
run_guest "$accel"
if [ "$accel" = kvm ] && [ -s "$run/gave-up" ]; then
  log "KVM could not boot $kver on this machine ($(cat "$run/gave-up")): booting it under TCG instead"
  accel=tcg
  run_guest tcg
fi
exit_line=$(tr -d '\r' <"$run/console.log" | sed -n 's/^CAIRN-VM-EXIT \([0-9]*\)$/\1/p' | tail -1)
if [ -z "$exit_line" ]; then
  log "$kver: the guest did not finish under $accel within ${timeout_s}s (console in $run/console.log)"
  exit 3
fi
log "$kver: guest finished under $accel in $((SECONDS - start))s, tests exit $exit_line"
[ "$exit_line" -eq 0 ]
