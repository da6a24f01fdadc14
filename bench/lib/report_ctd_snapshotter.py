#!/usr/bin/env python3
"""Report of bench/containerd.sh: markdown on stdout, a PNG chart.

  report_ctd_snapshotter.py RUN_DIR PNG

RUN_DIR holds samples.tsv (image, mode, pull s, pull+run s, warm run s,
bytes from the registry), cmd.tsv (image, mode, pull + command s, bytes from
the registry), share.tsv ("share", mode, disk bytes, content store bytes,
page cache bytes) and meta.tsv (key, value).
"""

import statistics
import sys

MODES = [("overlayfs", "overlayfs snapshotter"),
         ("normal", "cairn, normal path"),
         ("remote", "cairn, remote path"),
         ("lazy", "cairn, remote lazy path")]


def main():
    run_dir, png = sys.argv[1], sys.argv[2]
    meta = dict(line.rstrip("\n").split("\t", 1) for line in open(f"{run_dir}/meta.tsv"))
    samples = {}
    for line in open(f"{run_dir}/samples.tsv"):
        img, mode, pull, run, warm, sent = line.split()
        samples.setdefault((img, mode), []).append((float(pull), float(run), float(warm), float(sent)))
    cmds = {}
    try:
        for line in open(f"{run_dir}/cmd.tsv"):
            img, mode, secs, sent = line.split()
            cmds.setdefault((img, mode), []).append((float(secs), float(sent)))
    except FileNotFoundError:
        pass
    share = {}
    try:
        for line in open(f"{run_dir}/share.tsv"):
            _, mode, disk, content, cache = line.split()
            share[mode] = (int(disk), int(content), int(cache))
    except FileNotFoundError:
        pass

    def med(img, mode, k, table=None):
        v = (samples if table is None else table).get((img, mode))
        return statistics.median(x[k] for x in v) if v else None

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "–"

    ctd = meta.get("containerd", "2.4.2")
    out = [f"# containerd snapshotter: overlayfs against cairn (containerd {ctd})", ""]
    out.append(f"{meta['date']}; {meta['host']}.  ")
    out.append(f"Load: {meta['load']}.  ")
    out.append(f"{meta['versions']}.  ")
    out.append(f"`{meta['command']}`; medians of {meta['runs']} interleaved cold samples "
               "(page cache dropped, fresh containerd root and cairn store each); a sample's warm "
               f"start is the median of its {meta.get('warm', '3')} warm starts."
               + (" A round takes the paths in the order overlayfs, remote, lazy, normal; "
                  f"its samples are deleted at its end, then {meta['settle']} s of pause, and "
                  "each normal-path sample (whose Commits delete the unpacked directories) is "
                  "followed by the same pause: journal-less ext4 is slow to create files within "
                  "a minute of many deletions."
                  if meta.get('settle') else ""))
    out.append("")
    out.append("The remote lazy path pulls a copy of the image that has a cairn lazy artifact "
               "(`cairn push`, with the prefetch list a first `cairn run --lazy --record-prefetch` of "
               "the command recorded), the snapshotter started `--lazy-fetch on-demand`: the pull "
               "fetches the metadata and the list's files, a run what it reads. The remote path is "
               "the snapshotter started `--no-lazy`. Bytes: what the registry sent (response bodies, "
               "its access log) during the sample.")
    out.append("")
    images = sorted({img for img, _ in samples})
    targets = []
    for img in images:
        out.append(f"## {img} image (gzip)")
        out.append("")
        out.append("| snapshotter | `ctr image pull` | pull + `ctr run --rm … /bin/true` | × overlayfs | fetched | warm `ctr run --rm` | × overlayfs |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        base_run, base_warm = med(img, "overlayfs", 1), med(img, "overlayfs", 2)
        for mode, label in MODES:
            p, r, w, b = (med(img, mode, k) for k in range(4))
            if p is None:
                continue
            out.append(f"| {label} | {p:.2f} s | {r:.2f} s | {ratio(r, base_run)} | {b / 1e6:.1f} MB | "
                       f"{w:.3f} s | {ratio(w, base_warm)} |")
        out.append("")
        cmd = meta.get(f"cmd {img}")
        base_cmd = med(img, "overlayfs", 0, cmds)
        if cmd and any((img, m) in cmds for m, _ in MODES):
            out.append(f"Cold pull and a first `ctr run --rm` of `{cmd}` (separate samples):")
            out.append("")
            out.append("| snapshotter | pull + command | × overlayfs | fetched |")
            out.append("|---|---:|---:|---:|")
            for mode, label in MODES:
                c, b = med(img, mode, 0, cmds), med(img, mode, 1, cmds)
                if c is None:
                    continue
                out.append(f"| {label} | {c:.2f} s | {ratio(c, base_cmd)} | {b / 1e6:.1f} MB |")
            out.append("")
            pf = meta.get(f"prefetch {img}")
            if pf:
                out.append(f"The lazy artifact's prefetch list: {pf} files.")
                out.append("")
        r = med(img, "remote", 1)
        if r is not None and base_run:
            targets.append((f"{img}: remote path pull-to-running ≤ 0.4× overlayfs", r / base_run, 0.4))
        r = med(img, "lazy", 1)
        if r is not None and base_run:
            targets.append((f"{img}: remote lazy path pull-to-running ≤ 0.15× overlayfs", r / base_run, 0.15))
        for mode in ("normal", "remote", "lazy"):
            w = med(img, mode, 2)
            if w is not None and base_warm:
                targets.append((f"{img}: warm start ({mode} path) ≤ 1.1× overlayfs", w / base_warm, 1.1))
    if share:
        out.append("## Three images sharing most files, ten containers reading the same files")
        out.append("")
        out.append("The python image's two layers re-tarred with three different mtimes (every layer "
                   "and diff_id differs, the contents do not). Disk: the snapshotter's storage "
                   "(overlayfs: its snapshots directory; cairn: its store) after pulling the three; "
                   "containerd's content store beside it. Page cache: `fincore` over the "
                   "snapshotter's backing files once ten containers (the three images in turn) "
                   "have read python3's and numpy's `.py` and `.so` files.")
        out.append("")
        out.append("| snapshotter | disk | × overlayfs | content store | page cache | × overlayfs |")
        out.append("|---|---:|---:|---:|---:|---:|")
        b = share.get("overlayfs")
        for mode, label in MODES:
            if mode not in share:
                continue
            d, c, pc = share[mode]
            out.append(f"| {label} | {d / 2**20:.0f} MiB | {d / b[0]:.2f} | {c / 2**20:.0f} MiB | "
                       f"{pc / 2**20:.0f} MiB | {pc / b[2]:.2f} |")
        out.append("")
        for mode in ("normal", "remote"):
            if mode in share:
                targets.append((f"disk, shared files ({mode} path) ≤ 0.5× overlayfs", share[mode][0] / b[0], 0.5))
                targets.append((f"page cache, shared files ({mode} path) ≤ 0.5× overlayfs", share[mode][2] / b[2], 0.5))
    out.append("## Targets")
    out.append("")
    out.append("| target | measured | met |")
    out.append("|---|---:|---|")
    for name, v, t in targets:
        out.append(f"| {name} | {v:.2f}× | {'yes' if v <= t else 'no'} |")
    print("\n".join(out))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(images) + (1 if share else 0)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, img in zip(axes[0], images):
        labels = [label for mode, label in MODES if (img, mode) in samples]
        pulls = [med(img, m, 0) for m, _ in MODES if (img, m) in samples]
        runs = [med(img, m, 1) - med(img, m, 0) for m, _ in MODES if (img, m) in samples]
        ax.bar(labels, pulls, label="ctr image pull")
        ax.bar(labels, runs, bottom=pulls, label="ctr run /bin/true")
        ax.set_title(f"{img}: cold pull to running (s)")
        ax.tick_params(axis="x", labelrotation=15)
        ax.legend()
    if share:
        ax = axes[0][-1]
        modes = [m for m, _ in MODES if m in share]
        x = range(len(modes))
        ax.bar([i - 0.2 for i in x], [share[m][0] / 2**20 for m in modes], width=0.4, label="disk (MiB)")
        ax.bar([i + 0.2 for i in x], [share[m][2] / 2**20 for m in modes], width=0.4, label="page cache (MiB)")
        ax.set_xticks(list(x), [dict(MODES)[m] for m in modes], rotation=15)
        ax.set_title("3 images sharing files, 10 containers")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
