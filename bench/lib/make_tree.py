#!/usr/bin/env python3
"""Writes a deterministic synthetic tree for quick benchmark runs.

The same --files and --seed give the same tree, byte for byte (contents,
names, modes, mtimes). Sizes follow a source-tree-like mix: mostly small
files, a few large ones. Some files repeat the content of others (the store
keeps one object for them), and there are symlinks and hardlinks.
"""

import argparse
import os
import random
import sys

# (weight, min size, max size): roughly the shape of a source tree.
SIZE_CLASSES = [
    (0.10, 0, 0),
    (0.35, 1, 1024),
    (0.30, 1025, 8192),
    (0.18, 8193, 32768),
    (0.065, 32769, 262144),
    (0.005, 262145, 2 << 20),
]
MTIME = 1_700_000_000  # fixed, so the tree is the same on every run


def pick_size(rng):
    r = rng.random()
    for weight, lo, hi in SIZE_CLASSES:
        if r < weight:
            return rng.randint(lo, hi)
        r -= weight
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="directory to create (must not exist)")
    ap.add_argument("--files", type=int, default=10000, help="regular files (default 10000)")
    ap.add_argument("--seed", type=int, default=1, help="seed (default 1)")
    ap.add_argument("--per-dir", type=int, default=24, help="entries per directory (default 24)")
    args = ap.parse_args()

    if os.path.lexists(args.dir):
        sys.exit(f"make_tree: {args.dir} exists; give a new directory name")
    rng = random.Random(args.seed)
    os.makedirs(args.dir)

    # Directories: a fan-out tree, about per_dir files in each leaf.
    ndirs = max(1, args.files // args.per_dir)
    dirs = [""]
    while len(dirs) < ndirs:
        parent = dirs[rng.randrange(len(dirs))]
        name = os.path.join(parent, f"d{len(dirs):05d}")
        os.mkdir(os.path.join(args.dir, name))
        dirs.append(name)

    files = []
    total = 0
    for i in range(args.files):
        d = dirs[rng.randrange(len(dirs))]
        rel = os.path.join(d, f"f{i:06d}{rng.choice(['.c', '.h', '.txt', '.py', '', '.so'])}")
        path = os.path.join(args.dir, rel)
        if files and rng.random() < 0.03:
            # Same content as an earlier file: one object in the store.
            src = os.path.join(args.dir, files[rng.randrange(len(files))])
            with open(src, "rb") as f:
                data = f.read()
        else:
            data = rng.randbytes(pick_size(rng))
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o755 if rng.random() < 0.1 else 0o644)
        files.append(rel)
        total += len(data)

    links = 0
    for i in range(args.files // 50):
        d = dirs[rng.randrange(len(dirs))]
        target = files[rng.randrange(len(files))]
        if rng.random() < 0.5:
            os.symlink(os.path.relpath(os.path.join(args.dir, target), os.path.join(args.dir, d)),
                       os.path.join(args.dir, d, f"s{i:05d}"))
        else:
            os.link(os.path.join(args.dir, target), os.path.join(args.dir, d, f"h{i:05d}"))
        links += 1

    # Fixed mtimes, deepest first so that setting a file's time is not undone
    # by creating entries in its directory afterwards.
    for root, dnames, fnames in os.walk(args.dir, topdown=False):
        for n in fnames + dnames:
            os.utime(os.path.join(root, n), (MTIME, MTIME), follow_symlinks=False)
    os.utime(args.dir, (MTIME, MTIME))

    print(f"{args.dir}: {len(dirs)} directories, {args.files} files ({total} bytes), {links} links")


if __name__ == "__main__":
    main()
