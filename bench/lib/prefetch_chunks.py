#!/usr/bin/env python3
"""What a chunk-level prefetch list would save (issue 13; task pf7, step 1).

    prefetch_chunks.py INDEX LIST LAYER [--chunk-pages]

INDEX: a cairn lazy artifact's object index, decompressed (`zstd -dc`);
LIST: its prefetch list blob (v1: 32-byte object ids);
LAYER: the objects layer of a lazy mount that served the recorded start
with `--record-prefetch --no-passthrough` (so every read went through
FUSE READs into the FUSE inodes' page cache, as a recording server would
see them), still mounted: `<store>/lazy/<name>`.

For each listed object it asks mincore(2) which pages of `LAYER/ab/cdef…`
are cached (the pages the start read, readahead included; opening and
mapping the file reads nothing), and for a chunked object which 1 MiB
chunks those pages fall in. It prints the objects larger than one chunk
and the compressed bytes (frames in the packs) of the whole list against
a list that names only the chunks read. Read-only; run as root.
"""
import ctypes
import mmap
import os
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_index(b):
    magic, ver, chunk, nobj, nchunk, npack, _ = struct.unpack_from("<8sIIQQII", b, 0)
    assert magic == b"CAIRNLZI" and ver == 1, "not a v1 cairn index"
    off = 40 + 8 * npack
    objs = {}
    for i in range(nobj):
        oid, pack, chunks, offset, comp, size, first = struct.unpack_from("<32sIIQQQQ", b, off + 72 * i)
        objs[oid] = (pack, chunks, offset, comp, size, first)
    coff = off + 72 * nobj
    chunk_tab = [struct.unpack_from("<IIQQ", b, coff + 56 * j) for j in range(nchunk)]
    return chunk, objs, chunk_tab


def resident(path, size):
    if size == 0:
        return []
    fd = os.open(path, os.O_RDONLY)
    try:
        # copy-on-write (never written): ctypes wants a writable buffer
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    n = (size + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(n)
    buf = (ctypes.c_char * size).from_buffer(m)
    addr = ctypes.addressof(buf)
    if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore " + path)
    res = [vec.raw[i] & 1 for i in range(n)]
    del buf
    m.close()
    return res


def main():
    index, lst, layer = sys.argv[1:4]
    chunk, objs, chunk_tab = parse_index(open(index, "rb").read())
    raw = open(lst, "rb").read()
    ids = [raw[i:i + 32] for i in range(0, len(raw), 32)]
    whole_c = chunked_c = 0
    read_bytes = 0
    rows = []
    for oid in ids:
        if oid not in objs:
            continue
        pack, chunks, offset, comp, size, first = objs[oid]
        h = oid.hex()
        res = resident(os.path.join(layer, h[:2], h[2:]), size)
        read_bytes += sum(res) * PAGE
        if chunks == 0:
            whole_c += comp
            chunked_c += comp
            continue
        per = chunk // PAGE
        got = [k for k in range(chunks) if any(res[k * per:(k + 1) * per])]
        c_all = sum(chunk_tab[first + k][3] for k in range(chunks))
        c_got = sum(chunk_tab[first + k][3] for k in got)
        whole_c += c_all
        chunked_c += c_got
        rows.append((h[:12], size, chunks, len(got), sum(res) * PAGE, c_all, c_got, got))
    print("| object | size | chunks | chunks read | pages read | compressed whole | compressed, chunks read |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for h, size, n, g, rb, ca, cg, got in sorted(rows, key=lambda r: -r[5]):
        print(f"| {h} | {size / 1e6:.2f} MB | {n} | {g} | {rb / 1e6:.2f} MB | {ca / 1e6:.2f} MB | {cg / 1e6:.2f} MB |")
    for h, size, n, g, rb, ca, cg, got in rows:
        print(f"{h}: chunks read {got}")
    print(f"list: {len(ids)} objects, {len(rows)} chunked; pages read {read_bytes / 1e6:.2f} MB")
    print(f"compressed: whole objects {whole_c / 1e6:.2f} MB; chunk-level {chunked_c / 1e6:.2f} MB; "
          f"saved {(whole_c - chunked_c) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
