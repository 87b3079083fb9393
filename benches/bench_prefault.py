#!/usr/bin/env python3
"""Load time against how the file entered the page cache (issue 12, item 5).

    python benches/bench_prefault.py [--mib 256] [--repeats 7]

One checkpoint (a 256 MiB payload) is loaded (``open_checkpoint``: the
whole pipeline, checksum included, then ``arrays()`` and a read of every
page, as an import does), memory-mapped, with the file's pages put in the
page cache three ways before each load:

- ``written``: the file was just written (``write_checkpoint``);
- ``read``: the file was read with ``read()`` (another reader, a backup);
- ``mapped``: the file was read through another process's map.

A fourth row, ``pread``, is the pread mode after a ``read()``. The swing is
the slowest way over the fastest (mmap rows). Target: < 2.5x (the issue
measured 2.5x before the mapping was prefaulted). Prints a table and one
JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ds4.checkpoint import open_checkpoint, write_checkpoint


def _drop(path: str) -> None:
    """Evict the file's pages from the page cache (fadvise DONTNEED after a
    sync), so that the next way of reading it is the one that loads them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def _mapped(path: str) -> None:
    code = (
        "import mmap,sys\n"
        "f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,access=mmap.ACCESS_READ)\n"
        "s=0\n"
        "for i in range(0,len(m),4096): s+=m[i]\n"
    )
    subprocess.run([sys.executable, "-c", code, path], check=True)


def _load(path: str, text: bytes, use_mmap: bool) -> float:
    t0 = time.perf_counter()
    ck = open_checkpoint(path, prompt=text, verify_checksum=True, mmap=use_mmap)
    total = 0
    for a in ck.arrays().values():
        b = a.view(np.uint8).reshape(-1)
        total += int(b[:: mmap.PAGESIZE].sum())  # touch every page, as an import does
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ds4-prefault-", dir=a.dir)
    n = (a.mib << 20) // 4 // 4
    rng = np.random.default_rng(5)
    arrays = {f"layer{i}.kv": rng.standard_normal(n, dtype=np.float32) for i in range(4)}
    text = b"prefault bench " * 100
    import hashlib

    path = os.path.join(d, hashlib.sha1(text).hexdigest() + ".kv")
    ways = {
        "written": lambda: write_checkpoint(path, text, arrays, abi="bench/1", tokens=100, ctx=1 << 20),
        "read": lambda: (_drop(path), _read(path)),
        "mapped": lambda: (_drop(path), _mapped(path)),
    }
    write_checkpoint(path, text, arrays, abi="bench/1", tokens=100, ctx=1 << 20)
    times: dict[str, list[float]] = {k: [] for k in (*ways, "pread")}
    for _ in range(a.repeats):
        for way, prep in ways.items():
            prep()
            times[way].append(_load(path, text, True))
        _drop(path)
        _read(path)
        times["pread"].append(_load(path, text, False))
    med = {k: statistics.median(v) for k, v in times.items()}
    mm = [med[k] for k in ways]
    swing = max(mm) / min(mm)
    for k, v in med.items():
        print(f"{k:>8}: {v * 1e3:8.1f} ms  ({(a.mib << 20) / v / 1e9:.2f} GB/s)")
    print(f"swing (slowest / fastest mmap way): {swing:.2f}x  target < 2.5x: {'PASS' if swing < 2.5 else 'MISS'}")
    print("BENCH_JSON " + json.dumps({"mib": a.mib, "median_s": med, "swing": swing}))
    os.unlink(path)
    os.rmdir(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
