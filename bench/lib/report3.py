#!/usr/bin/env python3
"""Turns bench/run3.sh's samples into a markdown report and a PNG chart.

  report3.py RUN_DIR PNG_PATH

RUN_DIR/meta.tsv: "key<TAB>value"; RUN_DIR/samples.tsv: "metric<TAB>method
<TAB>seconds". RUN_DIR/rows.tsv lists the rows in order: "metric<TAB>method
<TAB>label<TAB>baseline-method<TAB>target" (target: "le:1.25" = ratio at most
1.25, "speedup:10" = baseline/this at least 10, "" = reported only).
RUN_DIR/na.tsv: "metric<TAB>method<TAB>reason" for rows that could not run.
"""

import statistics
import sys


def read_tsv(path, n):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                rows.append(parts + [""] * (n - len(parts)))
    except FileNotFoundError:
        pass
    return rows


def fmt(v):
    if v is None:
        return "—"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3f}" if v >= 0.01 else f"{v:.4f}"


def main():
    run_dir, png = sys.argv[1], sys.argv[2]
    meta = dict((k, v) for k, v in read_tsv(f"{run_dir}/meta.tsv", 2))
    samples = {}
    for metric, method, value in read_tsv(f"{run_dir}/samples.tsv", 3):
        samples.setdefault((metric, method), []).append(float(value))
    na = {(m, k): why for m, k, why in read_tsv(f"{run_dir}/na.tsv", 3)}
    rows = read_tsv(f"{run_dir}/rows.tsv", 5)
    med = {k: statistics.median(v) for k, v in samples.items()}

    out = ["# cairn benchmark, part 3: starting containers", ""]
    for k in ["date", "host", "load", "cairn", "images", "runs", "cgroups", "notes"]:
        if meta.get(k):
            out.append(f"- {k}: {meta[k]}")
    out += ["", "| metric | method | median (s) | vs | ratio | target | result |",
            "| --- | --- | ---: | --- | ---: | --- | --- |"]
    missed = 0
    for metric, method, label, base, target in rows:
        key = (metric, method)
        if key in na:
            out.append(f"| {metric} | {label} | not available | | | {target or '—'} | {na[key]} |")
            continue
        v = med.get(key)
        b = med.get((metric, base)) if base else None
        ratio = v / b if v is not None and b else None
        result = ""
        if target and ratio is not None:
            kind, _, val = target.partition(":")
            val = float(val)
            if kind == "le":
                ok = ratio <= val
                tdesc = f"≤ {val:g}x"
            else:  # speedup
                ok = ratio > 0 and 1 / ratio >= val
                tdesc = f"≥ {val:g}x faster"
            result = "met" if ok else "MISSED"
            missed += not ok
        else:
            tdesc = "—"
        if ratio is None:
            rdesc = ""
        elif target.startswith("speedup") and ratio > 0:
            rdesc = f"{1 / ratio:.0f}x faster"
        else:
            rdesc = f"{ratio:.2f}x"
        out.append(f"| {metric} | {label} | {fmt(v)} | {base or ''} | {rdesc} | {tdesc} | {result} |")
    out += ["", "<details><summary>samples (s)</summary>", ""]
    for (metric, method), vals in sorted(samples.items()):
        out.append(f"- {metric} / {method}: " + ", ".join(f"{x:.4f}" for x in vals))
    out += ["", "</details>", ""]
    print("\n".join(out))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report3.py: no matplotlib; no chart", file=sys.stderr)
        return missed
    metrics = []
    for metric, *_ in rows:
        if metric not in metrics:
            metrics.append(metric)
    fig, axes = plt.subplots(len(metrics), 1, figsize=(9, 2.2 * len(metrics) + 1), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        # A row that only re-states another's figure against a different
        # baseline (cairn-vs-nspawn) adds nothing to the chart.
        bars = [(label, med.get((metric, method)), method)
                for m, method, label, base, _ in rows
                if m == metric and not method.endswith("-vs-" + base.split("-")[0])]
        kept = {b[2] for b in bars}
        bases = {base for m, method, _, base, _ in rows if m == metric and base and method in kept}
        labels = [b[0] for b in bars]
        vals = [b[1] or 0 for b in bars]
        colors = ["tab:gray" if b[2] in bases else ("tab:blue" if b[2].startswith("cairn") else "tab:orange")
                  for b in bars]
        present = [v for v in vals if v > 0]
        log = len(present) > 1 and max(present) / min(present) > 30
        if log:  # ms-scale starts next to a 1 s copy: bars on a linear axis vanish
            lo = min(present) / 2
            ax.set_xscale("log")
            ax.set_xlim(lo, max(present) * 6)
        else:
            lo = 0
            ax.set_xlim(0, max(present or [1]) * 1.18)
        ax.barh(labels, [max(v, lo) - lo for v in vals], left=lo, color=colors)
        for i, b in enumerate(bars):
            ax.text(max(vals[i], lo), i, f" {fmt(b[1])} s" if b[1] is not None else " not available",
                    va="center", fontsize=7)
        ax.set_title(metric + " (median s" + (", log scale" if log else "")
                     + "; gray: baseline, blue: cairn)", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"report3.py: chart {png}", file=sys.stderr)
    return missed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
