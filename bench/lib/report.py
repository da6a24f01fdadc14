#!/usr/bin/env python3
"""Turns the samples bench/run.sh collected into a markdown report.

  report.py RUN_DIR

RUN_DIR/meta.tsv holds "key<TAB>value" lines; RUN_DIR/samples.tsv holds
"metric<TAB>side<TAB>value" lines, side being "cairn" or "base". Each row of
the table is the median of the samples; the ratio is cairn / baseline.
"""

import statistics
import sys

# metric: (label, unit, baseline, target kind, target value)
#   target kinds: "le" ratio at most, "ge" ratio at least, "abs_lt" cairn value
#   below, None for figures reported without a target.
METRICS = {
    "mkfs_s": ("mkfs", "s", "mkfs.erofs (data in image, no compression)", None, None),
    "mkfs_sync_s": ("mkfs, then sync", "s", "mkfs.erofs, then sync", None, None),
    "mount_ms": ("mount + umount, per cycle", "ms", "overlayfs over the host tree", "abs_lt", 5.0),
    "ls_cold_s": ("`ls -lR`, cold cache", "s", "host tree", "le", 0.6),
    "ls_warm_s": ("`ls -lR`, warm cache", "s", "host tree", "le", 1.1),
    "ls_peak_mib": ("`ls -lR` peak memory, cold", "MiB", "host tree", "le", 1.5),
    "stat_cold_ms": ("lstat of {stat_count} random entries, cold", "ms", "host tree", None, None),
    "stat_warm_ms": ("lstat of {stat_count} random entries, warm", "ms", "host tree", None, None),
    "fio_seq_mibs": ("fio sequential read 1 MiB blocks, cold", "MiB/s", "host file", "ge", 0.95),
    "fio_rand_mibs": ("fio random read 4 KiB blocks, cold", "MiB/s", "host file", "ge", 0.95),
}


def fmt(v):
    if v is None:
        return "—"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if v >= 0.01 else f"{v:.2g}"


def main():
    run_dir = sys.argv[1]
    meta = {}
    with open(f"{run_dir}/meta.tsv") as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("\t")
            meta[k] = v
    samples = {}
    with open(f"{run_dir}/samples.tsv") as f:
        for line in f:
            metric, side, value = line.split("\t")
            samples.setdefault(metric, {}).setdefault(side, []).append(float(value))

    out = []
    out.append(f"# cairn benchmark: {meta.get('tree_name', '?')}")
    out.append("")
    for key, label in [
        ("date", "date"),
        ("host", "machine"),
        ("tree", "tree"),
        ("tree_stats", "tree holds"),
        ("cairn", "cairn"),
        ("runs", "runs per figure (median shown)"),
        ("image_sizes", "image sizes"),
        ("notes", "notes"),
    ]:
        if meta.get(key):
            out.append(f"- {label}: {meta[key]}")
    out.append("")
    out.append("| metric | cairn | baseline | ratio | target | result |")
    out.append("| --- | ---: | ---: | ---: | --- | --- |")
    failed = 0
    for metric, (label, unit, base_name, kind, target) in METRICS.items():
        if metric not in samples:
            continue
        label = label.format(stat_count=meta.get("stat_count", "?"))
        c = samples[metric].get("cairn")
        b = samples[metric].get("base")
        cm = statistics.median(c) if c else None
        bm = statistics.median(b) if b else None
        ratio = cm / bm if cm is not None and bm else None
        if kind is None:
            tgt, result = "—", "info"
        elif kind == "abs_lt":
            tgt = f"< {fmt(target)} {unit}"
            result = "pass" if cm is not None and cm < target else "FAIL"
        else:
            tgt = f"{'≤' if kind == 'le' else '≥'} {target}x"
            ok = ratio is not None and (ratio <= target if kind == "le" else ratio >= target)
            result = "pass" if ok else "FAIL"
        failed += result == "FAIL"
        out.append(
            f"| {label} ({unit}); baseline: {base_name} | {fmt(cm)} | {fmt(bm)} | "
            f"{'—' if ratio is None else f'{ratio:.2f}x'} | {tgt} | {result} |"
        )
    out.append("")
    out.append("Ratios are cairn / baseline, both measured in the same run (for times and "
               "memory lower is better, for fio throughput higher is better). Cold means "
               "`sync; echo 3 > /proc/sys/vm/drop_caches` before each sample; the cairn "
               "figures are taken on `cairn mount` (EROFS metadata image + overlayfs over the "
               "object store).")
    out.append("")
    out.append("<details><summary>all samples</summary>")
    out.append("")
    out.append("| metric | side | samples |")
    out.append("| --- | --- | --- |")
    for metric, sides in samples.items():
        for side, vals in sides.items():
            out.append(f"| {metric} | {side} | {' '.join(fmt(v) for v in vals)} |")
    out.append("")
    out.append("</details>")
    print("\n".join(out))
    sys.exit(3 if failed else 0)


if __name__ == "__main__":
    main()
