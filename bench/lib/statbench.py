#!/usr/bin/env python3
"""lstat of a fixed random sample of a tree's entries.

  statbench.py sample TREE COUNT SEED > LIST   pick COUNT non-directory entries
  statbench.py run ROOT LIST                   lstat ROOT/<each>, print seconds

The sample is drawn from the sorted list of entries, so the same tree and seed
give the same list; the same list is then timed under the mount and on the
host tree. Only the lstat loop is timed, not the interpreter's start.
"""

import os
import random
import sys
import time


def sample(tree, count, seed):
    entries = []
    for root, dirs, files in os.walk(tree):
        dirs.sort()
        rel = os.path.relpath(root, tree)
        for f in files:  # os.walk lists symlinks to directories under dirs; fine to miss them
            entries.append(os.path.normpath(os.path.join(rel, f)))
    entries.sort()
    rng = random.Random(seed)
    picked = rng.sample(entries, min(count, len(entries)))
    sys.stdout.buffer.write(b"".join(os.fsencode(p) + b"\0" for p in picked))


def run(root, listfile):
    with open(listfile, "rb") as f:
        paths = [os.path.join(os.fsencode(root), p) for p in f.read().split(b"\0") if p]
    lstat = os.lstat
    t0 = time.perf_counter()
    for p in paths:
        lstat(p)
    print(f"{time.perf_counter() - t0:.6f}")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "sample":
        sample(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
