#!/usr/bin/env python3
"""usage: bench/publish-strategies.py N DIR METHODS   (ROUNDS=3 by default)
e.g.   bench/publish-strategies.py 15000 /var/tmp/pubbench rename,tmpfile,fsync

Object publication strategies on the store's filesystem: N files of
random-ish sizes (from the Linux tree's size distribution, approximated),
written and made durable + visible under objects/xx/yyyy.
  rename:   create in staging, write, close; syncfs; rename each into place
  tmpfile:  O_TMPFILE in objects/, write, keep fd; syncfs; linkat each; close
  fsync:    create in staging, write, fsync, close; rename each; (no syncfs)
Reports wall and process CPU (user+sys) for the write phase and the publish phase.
The store uses `rename` (issue 17's measurement: bench/results/publish-strategies.md).
N must stay below the open-file limit for `tmpfile`, which holds every file open
until the sync: that is its catch."""
import os, sys, time, random, hashlib, shutil, resource, ctypes
libc = ctypes.CDLL(None, use_errno=True)
N = int(sys.argv[1]); base = sys.argv[2]; methods = sys.argv[3].split(',')
rnd = random.Random(1)
sizes = [min(int(rnd.lognormvariate(8.7, 1.3)), 4 << 20) for _ in range(N)]
blob = os.urandom(5 << 20)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def run(m):
    root = os.path.join(base, m); shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root + "/tmp"); os.makedirs(root + "/objects")
    for b in range(256): os.mkdir(root + "/objects/%02x" % b)
    os.sync()
    stg = os.open(root + "/tmp", os.O_RDONLY | os.O_DIRECTORY)
    obj = os.open(root + "/objects", os.O_RDONLY | os.O_DIRECTORY)
    fan = [os.open("%02x" % b, os.O_RDONLY | os.O_DIRECTORY, dir_fd=obj) for b in range(256)]
    t0 = time.monotonic(); c0 = cpu(); held = []
    for i, sz in enumerate(sizes):
        name = hashlib.sha256(str(i).encode()).hexdigest()
        if m == "tmpfile":
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o644, dir_fd=obj)
        else:
            fd = os.open("o.%d" % i, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644, dir_fd=stg)
        off = (i * 4099) % (len(blob) - sz - 1)
        os.write(fd, blob[off:off + sz])
        if m == "fsync": os.fsync(fd)
        if m == "tmpfile": held.append((fd, name))
        else: os.close(fd); held.append((i, name))
    t1 = time.monotonic(); c1 = cpu()
    if m != "fsync": assert libc.syncfs(stg) == 0
    t2 = time.monotonic(); c2 = cpu()
    for x, name in held:
        b = int(name[:2], 16)
        if m == "tmpfile":
            os.link("/proc/self/fd/%d" % x, name[2:], dst_dir_fd=fan[b], follow_symlinks=True); os.close(x)
        else:
            os.rename("o.%d" % x, name[2:], src_dir_fd=stg, dst_dir_fd=fan[b])
    for f in fan: os.fsync(f)
    t3 = time.monotonic(); c3 = cpu()
    print(f"{m:8} N={N} write {t1-t0:6.2f}s cpu {c1-c0:5.2f} | sync {t2-t1:5.2f}s | publish {t3-t2:5.2f}s cpu {c3-c2:5.2f} | total {t3-t0:6.2f}s cpu {c3-c0:5.2f}", flush=True)
    for f in fan: os.close(f)
    os.close(stg); os.close(obj)
for r in range(int(os.environ.get("ROUNDS", "3"))):
    for m in methods: run(m)
