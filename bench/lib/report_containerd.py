#!/usr/bin/env python3
"""Turns bench/pull-containerd.sh's samples into a markdown report and a PNG chart.

  report_containerd.py RUN_DIR PNG_PATH

RUN_DIR/samples.tsv: "image<TAB>compression<TAB>figure<TAB>system<TAB>wall s
<TAB>cpu s<TAB>max rss KiB<TAB>machine cpu s" (cpu: the system's processes;
machine: busy time of every CPU, whatever ran; cpu and rss may be empty);
figure is "pull" or "pull+run", system "overlayfs", "erofs" or "cairn". RUN_DIR/meta.tsv:
"key<TAB>value". Markdown goes to stdout.
"""

import os
import statistics
import sys

SYSTEMS = ["overlayfs", "erofs", "cairn"]
LABELS = {"overlayfs": "containerd overlayfs", "erofs": "containerd EROFS", "cairn": "cairn"}
# Issue 17's targets: cairn / containerd EROFS, and cairn's CPU utilisation.
RATIO_TARGETS = {("linux", "pull"): 0.6, ("python", "pull"): 0.6, ("python", "pull+run"): 0.5}
SINGLE_LAYER = {"linux", "debian"}
CPU_TARGET = 1.8


def read_tsv(path):
    with open(path) as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def fnum(v):
    return float(v) if v not in ("", None) else None


def fmt(v):
    return "—" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.0f}")


def main():
    run_dir, png = sys.argv[1], sys.argv[2]
    meta = {r[0]: r[1] for r in read_tsv(os.path.join(run_dir, "meta.tsv"))}
    samples = {}
    order = []
    for row in read_tsv(os.path.join(run_dir, "samples.tsv")):
        img, comp, fig, system, wall, cpu, rss, mcpu = row + [""] * (8 - len(row))
        key = (img, comp, fig)
        if key not in order:
            order.append(key)
        samples.setdefault(key + (system,), []).append((float(wall), fnum(cpu), fnum(rss), fnum(mcpu)))

    def med(key, i=0):
        vals = [s[i] for s in samples.get(key, []) if s[i] is not None]
        return statistics.median(vals) if vals else None

    def util(key, i=1):
        vals = [s[i] / s[0] for s in samples.get(key, []) if s[i] is not None and s[0] > 0]
        return statistics.median(vals) if vals else None

    def pct(v):
        return "—" if v is None else f"{v * 100:.0f}%"

    out = ["# cairn pull against containerd 2.4 (issue 17)", ""]
    for k in ["date", "host", "load", "versions", "command", "runs"]:
        if meta.get(k):
            out.append(f"- {k}: {meta[k]}")
    out.append("- containerd ran with `CONTAINERD_DISABLE_PIGZ=1` (Go's gzip instead of unpigz), "
               "its own root, state and socket per sample, the CRI plugin disabled; "
               "EROFS differ: `mkfs_options = [\"-T0\", \"--mkfs-time\", \"--sort=none\"]`, "
               "diff-service `default = [\"erofs\", \"walking\"]`; overlayfs runs use the stock configuration")
    out.append("- cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before each sample (after containerd started); "
               "containerd: `ctr images pull --plain-http --snapshotter S` (it unpacks; checked: one committed "
               "snapshot, and for EROFS one layer.erofs, per layer); cairn: `cairn --root FRESH pull`; "
               "pull+run adds `ctr run --rm --snapshotter S IMG ID python3 -c 'import numpy'` (runc) or "
               "`cairn run IMG python3 -c 'import numpy'` (crun) right after the pull")
    out.append("- order per run: overlayfs, EROFS, cairn (interleaved); wall time of the client command "
               "(containerd's start not counted)")
    out.append("- CPU utilisation = CPU seconds / wall, median of the samples, 100% = one core. \"process\": "
               "user + sys of the command and the children it waited for (/usr/bin/time); for containerd, ctr's "
               "plus the daemon's with the children it reaped (mkfs.erofs), from /proc/PID/stat; not measured "
               "for pull+run, where the container runs under cairn's monitor or containerd's shim. "
               "\"machine\": busy time of all CPUs from /proc/stat over the same interval: includes the "
               "registry, the container, and anything else running on the machine")
    out.append("")
    for k, v in meta.items():
        if k.startswith("image "):
            out.append(f"- {k[6:]}: {v}")
    out += ["", "Medians in seconds; ratios are cairn / containerd measured in the same run.", "",
            "| image | comp. | figure | overlayfs | EROFS | cairn | cairn / EROFS | cairn / overlayfs "
            "| target (vs EROFS) | cairn CPU process | cairn CPU machine | EROFS CPU process "
            "| EROFS CPU machine | overlayfs CPU process | cairn max RSS |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    missed = 0
    for img, comp, fig in order:
        key = (img, comp, fig)
        m = {s: med(key + (s,)) for s in SYSTEMS}
        c, e, o = m["cairn"], m["erofs"], m["overlayfs"]
        re_ = c / e if c and e else None
        ro = c / o if c and o else None
        target = RATIO_TARGETS.get((img, fig))
        tdesc = "—"
        if target is not None and re_ is not None:
            ok = re_ <= target
            missed += not ok
            tdesc = f"≤ {target}x: {'met' if ok else 'MISSED'}"
        cu = util(key + ("cairn",))
        cdesc = "—" if cu is None else f"{cu * 100:.0f}%"
        if fig == "pull" and img in SINGLE_LAYER and cu is not None:
            ok = cu >= CPU_TARGET
            missed += not ok
            cdesc += f" (≥ {CPU_TARGET * 100:.0f}%: {'met' if ok else 'MISSED'})"
        rss = med(key + ("cairn",), 2)
        out.append(f"| {img} | {comp} | {fig} | {fmt(o)} | {fmt(e)} | {fmt(c)} | "
                   f"{'—' if re_ is None else f'{re_:.2f}x'} | {'—' if ro is None else f'{ro:.2f}x'} | {tdesc} | "
                   f"{cdesc} | {pct(util(key + ('cairn',), 3))} | {pct(util(key + ('erofs',)))} | "
                   f"{pct(util(key + ('erofs',), 3))} | {pct(util(key + ('overlayfs',)))} | "
                   f"{'—' if rss is None else f'{rss / 1024:.0f} MiB'} |")
    out += ["", "<details><summary>samples (wall s / process CPU s / machine CPU s)</summary>", ""]
    for img, comp, fig in order:
        for s in SYSTEMS:
            vals = samples.get((img, comp, fig, s), [])
            out.append(f"- {img} {comp} {fig} {s}: " + ", ".join(
                f"{w:.2f}/{'—' if cpu is None else f'{cpu:.2f}'}/{'—' if mc is None else f'{mc:.2f}'}"
                for w, cpu, _, mc in vals))
    out += ["", "</details>", ""]
    print("\n".join(out))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report_containerd.py: no matplotlib; no chart", file=sys.stderr)
        return missed
    colors = {"overlayfs": "tab:gray", "erofs": "tab:orange", "cairn": "tab:blue"}
    fig_, axes = plt.subplots(len(order), 1, figsize=(8, 1.3 * len(order) + 0.8), squeeze=False)
    for ax, key in zip(axes[:, 0], order):
        vals = [med(key + (s,)) for s in SYSTEMS]
        present = [v for v in vals if v]
        ax.barh([LABELS[s] for s in SYSTEMS], [v or 0 for v in vals], color=[colors[s] for s in SYSTEMS])
        ax.set_xlim(0, max(present or [1]) * 1.3)
        e, c = vals[1], vals[2]
        for i, v in enumerate(vals):
            label = " —" if v is None else f" {v:.2f} s"
            if i == 2 and v and e:
                label += f" ({v / e:.2f}x EROFS)"
            ax.text(v or 0, i, label, va="center", fontsize=7)
        ax.set_title(f"{key[0]}, {key[1]}: {key[2]} (median s, cold)", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    fig_.tight_layout()
    fig_.savefig(png, dpi=110)
    print(f"report_containerd.py: chart {png}", file=sys.stderr)
    return missed


if __name__ == "__main__":
    main()
