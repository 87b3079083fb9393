#!/usr/bin/env python3
"""The page cache and the writer's RSS under 100 saves, with and without
the hint that drops a checkpoint's pages once it is durable (issue 23,
item 6).

    python benches/bench_page_cache.py [--saves 100] [--mib 8] [--rounds 2] [--dir DIR]

Each mode runs in a child process of its own: ``saves`` checkpoints of a
``mib`` MiB payload (four float32 tensors, random), each of another text,
written by ``write_checkpoint`` (what a store's save calls: temp file,
fsync, rename, fsync of the directory) into a fresh directory under
``--dir`` (a disk-backed filesystem: on tmpfs the page cache *is* the file
and the hint can do nothing). ``drop_cache=False`` is the baseline, measured
in the same run; ``rounds`` rounds alternate the order (keep then drop,
then drop then keep) and each figure is the median over the rounds. After the saves the child reports:

- ``resident``: bytes of the written files in the page cache (``mincore``
  over each file, tests/helpers/page_cache.py): what the saves left there;
- ``cached``: the growth of ``Cached`` in /proc/meminfo over the saves
  (the whole machine's: noisy when other jobs run);
- ``rss``/``hwm``: the child's VmRSS at the end and its peak (VmHWM);
- ``save``: the median time of one save.

Prints a table and one JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(saves: int, mib: int, d: str, drop: bool) -> dict[str, float]:
    import numpy as np
    from helpers.page_cache import resident_bytes

    from ds4.checkpoint import write_checkpoint

    rng = np.random.default_rng(23)
    n = (mib << 20) // 4 // 4
    arrays = {f"layer{i}.kv": rng.standard_normal(n, dtype=np.float32) for i in range(4)}
    cached0 = _meminfo("Cached")
    times, paths = [], []
    for i in range(saves):
        text = f"page-cache bench save {i} ".encode() * 40
        path = os.path.join(d, hashlib.sha1(text).hexdigest() + ".kv")
        t0 = time.perf_counter()
        write_checkpoint(path, text, arrays, abi="bench/page-cache", tokens=100, ctx=1 << 20, drop_cache=drop)
        times.append(time.perf_counter() - t0)
        paths.append(path)
    cached1 = _meminfo("Cached")
    return {
        "written": float(sum(os.path.getsize(p) for p in paths)),
        "resident": float(sum(resident_bytes(p) for p in paths)),
        "cached": float(cached1 - cached0),
        "rss": float(_status("VmRSS")),
        "hwm": float(_status("VmHWM")),
        "save": statistics.median(times),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=100)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", choices=["drop", "keep"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.saves, a.mib, a.dir, a.child == "drop")))
        return 0
    runs: dict[str, list[dict[str, float]]] = {"keep": [], "drop": []}
    for r in range(a.rounds):  # the order alternates: keep, drop, drop, keep, ...
        for mode in ("keep", "drop") if r % 2 == 0 else ("drop", "keep"):
            d = tempfile.mkdtemp(prefix=f"ds4-page-cache-{mode}-", dir=a.dir)
            try:
                cmd = [sys.executable, __file__, "--child", mode, "--saves", str(a.saves), "--mib", str(a.mib)]
                res = subprocess.run([*cmd, "--dir", d], check=True, capture_output=True, text=True)
                runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    out = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    mi = 2**20
    print(
        f"{a.rounds} rounds of {a.saves} saves of {a.mib} MiB payload ({out['keep']['written'] / mi:.0f} MiB written per mode)"
    )
    print(f"{'':>22} {'without the hint':>18} {'with it':>12}")
    for k, label in (
        ("resident", "files resident, MiB"),
        ("cached", "Cached growth, MiB"),
        ("rss", "writer RSS, MiB"),
        ("hwm", "writer peak RSS, MiB"),
    ):
        print(f"{label:>22} {out['keep'][k] / mi:18.1f} {out['drop'][k] / mi:12.1f}")
    print(f"{'median save, ms':>22} {out['keep']['save'] * 1e3:18.1f} {out['drop']['save'] * 1e3:12.1f}")
    ratio = out["drop"]["save"] / out["keep"]["save"]
    print(f"save time with / without: {ratio:.2f}x")
    print(
        "BENCH_JSON "
        + json.dumps({"saves": a.saves, "mib": a.mib, "rounds": a.rounds, "keep": out["keep"], "drop": out["drop"]})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
