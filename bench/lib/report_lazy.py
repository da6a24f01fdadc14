#!/usr/bin/env python3
"""Markdown report and PNG chart of a bench/lazy.sh run.

  report_lazy.py RUN_DIR... PNG

Several RUN_DIRs (runs of different images) are reported together. Each
holds samples.tsv (link, image, mode, run, seconds, bytes),
steady.tsv (image, local|lazy, cold|warm, rep, bytes, seconds) and meta.tsv
(key, value...). Prints the markdown; writes the chart to PNG.
"""

import os
import statistics
import sys

MODES = ["classic", "cairn", "lazy", "lazy+list"]
MODE_TEXT = {
    "classic": "skopeo copy + umoci unpack + runc run",
    "cairn": "`cairn pull` + `cairn run`",
    "lazy": "`cairn pull --lazy` + `cairn run --lazy` (no prefetch list)",
    "lazy+list": "the same, artifact with a prefetch list",
}
MB = 1e6


def read_tsv(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    run_dirs, png = sys.argv[1:-1], sys.argv[-1]
    samples, steady, meta = [], [], {}
    for run_dir in run_dirs:
        samples += read_tsv(os.path.join(run_dir, "samples.tsv"))
        steady += read_tsv(os.path.join(run_dir, "steady.tsv"))
        for r in read_tsv(os.path.join(run_dir, "meta.tsv")):
            if r[0] in meta and r[0] in ("date", "load", "command", "runs"):
                meta[r[0]] = [meta[r[0]][0] + "; " + r[1]]
            else:
                meta[r[0]] = r[1:]
    images = [k.split(" ", 1)[1] for k in meta if k.startswith("image ")]
    links = []
    for s in samples:
        if s[0] not in links:
            links.append(s[0])

    wall, fetched = {}, {}
    for link, img, mode, _run, secs, nbytes in samples:
        wall.setdefault((link, img, mode), []).append(float(secs))
        fetched.setdefault((link, img, mode), []).append(int(nbytes))

    out = []
    p = out.append
    p("# Lazy images: from nothing local to the command's completion")
    p("")
    p("`bench/lazy.sh` (issue 13, point 7). The registry (Debian's docker-registry)")
    p("runs in a network namespace made by the bench and is reached through a veth")
    p("pair, shaped to 100 Mbit/s and 20 ms RTT (100 Mbit/s each way with `tc tbf`")
    p("on both ends, 10 ms each way added by a relay on the host, because this")
    p("kernel has no `netem` qdisc) or unshaped. Every sample is cold: page cache dropped,")
    p("a fresh store or directory; the four ways run interleaved, and the figures")
    p("are medians. Bytes are what the registry sent, counted on the host's end of")
    p("the veth (TCP/IP headers included); MB = 10^6 bytes. The lazy runs use")
    p("`--lazy-fetch on-demand` (only what is opened, with its neighbours in a")
    p("pack up to `--coalesce` 1 MiB), so the bytes are what the command needed.")
    p("")
    for key in ("date", "host", "load", "versions", "command", "runs", "link"):
        if key in meta:
            p(f"- {key}: {meta[key][0]}")
    p("- times carry whatever else ran on the machine: read the load above")
    p("")
    p("| image | layers (gzip) | unpacked tar | cairn artifact packs | files opened | command |")
    p("| --- | --- | --- | --- | --- | --- |")
    size = {}
    for img in images:
        gz, tar, packs, opened, cmd = meta[f"image {img}"][:5]
        size[img] = int(gz)
        cmd = cmd.replace("|", "\\|")
        p(f"| {img} | {int(gz) / MB:.1f} MB | {int(tar) / MB:.1f} MB | {int(packs) / MB:.1f} MB | {opened} | `{cmd}` |")
    p("")
    p("Ways: " + "; ".join(f"**{m}**: {MODE_TEXT[m]}" for m in MODES) + ".")
    p("")
    for link in links:
        p(f"## {link.capitalize()} link")
        p("")
        p("| image | way | time (median) | vs cairn pull+run | bytes fetched | of the image's layers |")
        p("| --- | --- | --- | --- | --- | --- |")
        for img in images:
            base = med(wall.get((link, img, "cairn"), []))
            for mode in MODES:
                w = wall.get((link, img, mode))
                if not w:
                    continue
                b = med(fetched[(link, img, mode)])
                p(f"| {img} | {mode} | {med(w):.2f} s | {med(w) / base:.2f}x | {b / MB:.1f} MB | {100 * b / size[img]:.1f}% |")
        p("")

    # Steady state.
    st = {}
    for img, kind, temp, _rep, nbytes, secs in steady:
        st.setdefault((img, kind, temp), []).append((int(nbytes), float(secs)))
    ratios = {}
    if steady:
        p("## Steady-state reads of fetched files")
        p("")
        p("The files the command opened (its recorded prefetch list), read again:")
        p("through a lazy mount of the last lazy+list store and through a full pull's")
        p("mount. An image's row is the files whose object that store holds (fetched")
        p("and stored, so read from the store, the mount's first data-only layer),")
        p("read whole. A row \"read in part\" is the large files the command read in")
        p("part whose object the store does not hold (on demand, such an object is")
        p("fetched only in the chunks asked for, and not stored), read in the 1 MiB")
        p("chunks the command read: the lazy server serves those itself. Cold: seven")
        p("reads through each mount, caches dropped before each. Warm: one read through")
        p("each mount, then 30 through each, the two mounts in turn. Medians.")
        p("")
        p("| files | bytes read | cold: local | cold: lazy | lazy/local | warm: local | warm: lazy | lazy/local |")
        p("| --- | --- | --- | --- | --- | --- | --- | --- |")
        labels = []
        for row in steady:
            if row[0] not in labels:
                labels.append(row[0])
        for img in labels:
            row = [img]
            nb = None
            cells = []
            for temp in ("cold", "warm"):
                speeds = {}
                for kind in ("local", "lazy"):
                    xs = st.get((img, kind, temp), [])
                    if xs:
                        nb = xs[0][0]
                        speeds[kind] = med([b / s for b, s in xs if s > 0])
                if len(speeds) == 2:
                    r = speeds["lazy"] / speeds["local"]
                    ratios[(img, temp)] = r
                    cells += [f"{speeds['local'] / MB:.0f} MB/s", f"{speeds['lazy'] / MB:.0f} MB/s", f"{r:.2f}x"]
                else:
                    cells += ["—", "—", "—"]
            if nb is None:
                continue
            row.append(f"{nb / MB:.1f} MB")
            p("| " + " | ".join(row + cells) + " |")
        p("")
    after = {}
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "after.tsv")
        if os.path.exists(path):
            for link, img, mode, _run, nbytes in read_tsv(path):
                after.setdefault((link, img, mode), []).append(int(nbytes))
    if after:
        big = [f"{img} {mode} ({link}): {med(v) / MB:.1f} MB"
               for (link, img, mode), v in sorted(after.items()) if med(v) >= 0.1 * MB]
        p("After the command: what the lazy server fetched between the command's end")
        p("and its own exit (not in the tables above), median. A large object the")
        p("command opened is completed there (read-behind), so that it can be stored,")
        p("and what is left of the prefetch list is fetched. "
          + ("; ".join(big) + "." if big else "Nothing over 0.1 MB."))
        p("")
    servers = [(k.split(" ", 1)[1], v[0]) for k, v in meta.items() if k.startswith("server ")]
    if servers:
        p("Lazy server memory: " + "; ".join(f"{img}: {v}" for img, v in servers) + ".")
        p("")

    # Targets.
    p("## Targets")
    p("")
    verdict = lambda ok: "**met**" if ok else "**missed**"
    if "shaped" in links:
        for img in images:
            base = med(wall.get(("shaped", img, "cairn"), []))
            for mode in ("lazy", "lazy+list"):
                w = med(wall.get(("shaped", img, mode), []))
                if w == w and base == base:
                    p(f"- {img}, {mode}, shaped: time ≤ 0.25x of cairn pull+run: {verdict(w / base <= 0.25)} ({w:.2f} s against {base:.2f} s, {w / base:.2f}x)")
    for link in links:
        if "python" in images:
            b = med(fetched.get((link, "python", "lazy+list"), []))
            if b == b:
                p(f"- python, lazy+list, {link}: bytes ≤ 15% of the image: {verdict(b <= 0.15 * size['python'])} ({b / MB:.1f} MB of {size['python'] / MB:.1f} MB, {100 * b / size['python']:.1f}%)")
    for (img, temp), r in sorted(ratios.items()):
        if img in images:
            p(f"- {img}, {temp} steady-state reads of fetched (stored) files ≥ 0.95x of a local image: {verdict(r >= 0.95)} ({r:.2f}x)")
    inpart = sorted((img, temp, r) for (img, temp), r in ratios.items() if img not in images)
    if inpart:
        p("- not a target (a partial object is not local): " + "; ".join(f"{img}, {temp}: {r:.2f}x" for img, temp, r in inpart))
    if "unshaped" in links and "python" in images:
        w = med(wall.get(("unshaped", "python", "lazy+list"), []))
        b = med(fetched.get(("unshaped", "python", "lazy+list"), []))
        if w == w:
            p(f"- python, lazy+list, unshaped: ≤ 0.8 s and ≤ 15 MB (issue's reference: containerd overlayfs 6.22 s / 100.7 MB, stargz 1.60 s / 19.7 MB): time {verdict(w <= 0.8)} ({w:.2f} s), bytes {verdict(b <= 15 * MB)} ({b / MB:.1f} MB)")
    p("")
    p("<details><summary>All samples</summary>")
    p("")
    p("| link | image | way | run | seconds | bytes |")
    p("| --- | --- | --- | --- | --- | --- |")
    for s in samples:
        p("| " + " | ".join(s) + " |")
    if steady:
        p("")
        p("| image | tree | cache | rep | bytes | seconds |")
        p("| --- | --- | --- | --- | --- | --- |")
        for s in steady:
            p("| " + " | ".join(s) + " |")
    p("")
    p("</details>")
    print("\n".join(out))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no chart)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, max(1, len(links)), figsize=(6 * max(1, len(links)), 4.5), squeeze=False)
    width = 0.2
    for ax, link in zip(axes[0], links):
        for i, mode in enumerate(MODES):
            ys = [med(wall.get((link, img, mode), [])) for img in images]
            xs = [j + (i - 1.5) * width for j in range(len(images))]
            bars = ax.bar(xs, ys, width, label=mode)
            for x, y in zip(xs, ys):
                if y == y:
                    ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
            del bars
        ax.set_xticks(range(len(images)))
        ax.set_xticklabels(images)
        ax.set_ylabel("seconds to completion (median, cold)")
        ax.set_title(f"{link} link" + (" (100 Mbit/s, 20 ms RTT)" if link == "shaped" else ""))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
