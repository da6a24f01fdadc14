#!/usr/bin/env python3
"""Where a cold `cairn pull` spends its time, thread by thread (issue 17).

Runs one pull into a fresh store with the page cache dropped, and samples
every 20 ms until it ends:

- each thread of cairn: time on a CPU and time runnable but waiting for
  one (/proc/PID/task/TID/schedstat), user and system time (.../stat);
- the machine: busy, idle, iowait and steal time (/proc/stat), in total and
  per interval.

A thread's figures are its last sample, up to 20 ms before it ended. Run it
as root (it drops the page cache) on an otherwise idle machine:

    sudo bench/import-threads.py --cairn BIN --root DIR REGISTRY/REPO:TAG

DIR must not exist; it is left behind (remove it, and mind ext4's
reluctance to reuse inodes freed in the last minutes: docs/machines.md).
"""

import argparse
import os
import subprocess
import sys
import time


def machine():
    # user nice system idle iowait irq softirq steal, in clock ticks
    return [int(x) for x in open("/proc/stat").readline().split()[1:9]]


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            comm = open(f"{base}/comm").read().strip()
            run, wait = open(f"{base}/schedstat").read().split()[:2]
            stat = open(f"{base}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tick = os.sysconf("SC_CLK_TCK")
        out[int(tid)] = (comm, int(run) / 1e9, int(wait) / 1e9,
                         int(stat[11]) / tick, int(stat[12]) / tick)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cairn", required=True, help="cairn binary")
    ap.add_argument("--root", required=True, help="fresh store directory")
    ap.add_argument("--interval", type=float, default=0.25,
                    help="seconds per line of the machine's timeline")
    ap.add_argument("image", help="REGISTRY/REPO:TAG (plain HTTP on 127.0.0.1)")
    a = ap.parse_args()
    if os.path.exists(a.root):
        sys.exit(f"import-threads: {a.root} exists")
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    tick = os.sysconf("SC_CLK_TCK")
    m0 = machine()
    t0 = time.monotonic()
    p = subprocess.Popen([a.cairn, "--root", a.root, "-q", "pull", a.image])
    last, timeline = {}, []
    prev, prev_t = m0, t0
    while p.poll() is None:
        try:
            last.update(threads(p.pid))
        except OSError:
            pass
        time.sleep(0.02)
        now, now_t = machine(), time.monotonic()
        if now_t - prev_t >= a.interval:
            timeline.append((now_t - t0, [b - c for b, c in zip(now, prev)]))
            prev, prev_t = now, now_t
    wall = time.monotonic() - t0
    d = [(b - c) / tick for b, c in zip(machine(), m0)]
    if p.returncode != 0:
        sys.exit(f"import-threads: cairn pull failed ({p.returncode})")
    print(f"wall {wall:.2f} s; machine CPU-s: user {d[0]:.2f}, system {d[2]:.2f}, "
          f"softirq {d[6]:.2f}, idle {d[3]:.2f}, iowait {d[4]:.2f}, steal {d[7]:.2f}")
    print()
    print("| thread | on CPU (s) | runnable, waiting (s) | user (s) | system (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for _, (comm, run, wait, user, system) in sorted(last.items()):
        print(f"| {comm} | {run:.2f} | {wait:.2f} | {user:.2f} | {system:.2f} |")
    print()
    print("| s | busy | idle | iowait | steal |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for t, v in timeline:
        total = sum(v) or 1
        busy = v[0] + v[1] + v[2] + v[5] + v[6]
        print(f"| {t:.2f} | {100 * busy // total}% | {100 * v[3] // total}% | "
              f"{100 * v[4] // total}% | {100 * v[7] // total}% |")


if __name__ == "__main__":
    main()
