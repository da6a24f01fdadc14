#!/bin/bash
# Interleaved A/B of `cairn import` of one OCI layout (issue 17).
# usage: bench/import-ab.sh ROUNDS label=binary...
#   env: PFX="taskset -c 0", LAYOUT=DIR (default /var/tmp/imp/linux-gz), PAUSE=seconds
# Fresh store directory per run; stores removed after each round, then 60 s
# pause (ext4 recently_deleted quirk).
N=$1; shift
for i in $(seq 1 $N); do
  for lb in "$@"; do
    l=${lb%%=*}; b=${lb#*=}
    r=/var/tmp/import-ab-$l-$i; rm -rf $r; sync; echo 3 > /proc/sys/vm/drop_caches
    ld=$(cut -d' ' -f1 /proc/loadavg)
    /usr/bin/time -o /tmp/import-ab-t.$l -f "%e %U %S %P %M" $PFX $b --root $r import oci-layout:${LAYOUT:-/var/tmp/imp/linux-gz}:linux >/dev/null 2>/tmp/import-ab-err.$l || { echo FAIL $l; tail -3 /tmp/import-ab-err.$l; }
    echo "round=$i $l wall,user,sys,cpu%,maxrss_kb: $(cat /tmp/import-ab-t.$l) load=$ld"
  done
  for lb in "$@"; do l=${lb%%=*}; rm -rf /var/tmp/import-ab-$l-$i; done
  sync; sleep ${PAUSE:-60}
done
