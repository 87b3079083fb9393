#!/usr/bin/env python3
"""The store at 10,000 and 100,000 checkpoints (issue 12): a fresh process's
open + first lookup against ds4's algorithm in C, the warm lookup against
one SHA-1 pass over the prompt, and the index's memory.

    python benches/bench_index.py --n 10000 [--n 100000] [--dir DIR] [--repeats N]

Fixture: N checkpoints (v2, a 64-byte payload each) whose texts are 1 KiB
to 1 MiB long (uniform, seeded); 20 of them are prefixes of the 1 MiB
prompt, the others other texts. The texts that are not prefixes are
written sparse (their middle is a hole), so 10,000 files take about 100 MB
of disk instead of 5 GB; every file is a valid checkpoint all the same (its
name is the SHA-1 of its text, which reads as zeros in the hole). The
fixture is kept in DIR (default: a directory under the system temp dir)
and reused by later runs.

Rows (median of --repeats runs, warm page cache):

1. fresh process: ``KVStore(dir)`` + ``lookup(prompt)`` (timed inside a new
   Python process, after its imports), against ``ds4_find_prefix.c`` (ds4's
   directory rescan, 52-byte header reads and find_text_prefix, compiled
   here with ``cc -O2 ... -lcrypto``), timed inside its own process.
   Target at 10,000: ds4 / C <= 1.0.
2. warm lookup (``KVStore.lookup``, refresh included) against one SHA-1 of
   the whole prompt (``_core.sha1_hex``). Target: <= 1.5.
3. the index's memory per entry: ``StoreIndex.heap_bytes()`` and the RSS
   growth of a process that loads the index file, each / N; the index
   file's bytes / N.

Prints a table and one JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ds4 import _core
from ds4.checkpoint import write_checkpoint
from ds4.kvstore import INDEX_NAME, KVStore

PROMPT_BYTES = 1 << 20
MATCHING = 20
HERE = os.path.dirname(os.path.abspath(__file__))


def _prompt() -> bytes:
    return np.random.default_rng(12).integers(0, 256, PROMPT_BYTES, dtype=np.uint8).tobytes()


def _write_sparse(src: str, dst: str, text_len: int, keep_head: int) -> None:
    """Copy checkpoint ``src`` to ``dst`` leaving a hole where its text is
    zero (from ``keep_head`` bytes into the text to 8 bytes before its end)."""
    with open(src, "rb") as f:
        raw = f.read()
    meta = int.from_bytes(raw[20:24], "little")
    t0 = 96 + meta
    hole_from, hole_to = t0 + keep_head, t0 + text_len - 8
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, raw[:hole_from], 0)
        os.pwrite(fd, raw[hole_to:], hole_to)
        os.ftruncate(fd, len(raw))
    finally:
        os.close(fd)


def build_fixture(d: str, n: int, prompt: bytes) -> list[int]:
    """N checkpoints in ``d`` (kept across runs: a marker file records N);
    returns the lengths of the stored prefixes of ``prompt``."""
    marker = os.path.join(d, "fixture.json")
    if os.path.exists(marker):
        with open(marker) as f:
            info = json.load(f)
        if info["n"] == n:
            return list(info["matching"])
        shutil.rmtree(d)
    os.makedirs(d, mode=0o700, exist_ok=True)
    rng = np.random.default_rng(n)
    lengths = rng.integers(1024, PROMPT_BYTES, n)
    matching = {int(x) for x in rng.choice(lengths, MATCHING, replace=False)}
    arrays = {"kv": np.zeros(16, dtype=np.float32)}
    zeros = bytes(PROMPT_BYTES)
    scratch = tempfile.mkdtemp(prefix="ds4-fixture-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tmp = os.path.join(scratch, "one.kv")
    t0 = time.perf_counter()
    try:
        for i, length in enumerate(int(x) for x in lengths):
            if length in matching:
                text = prompt[:length]
            else:
                tag, tail = rng.bytes(32), rng.bytes(8)
                text = tag + zeros[: length - 40] + tail
            name = _core.sha1_hex(text) + ".kv"
            write_checkpoint(tmp, text, arrays, abi="bench/1", tokens=max(1, length // 4), ctx=1 << 30)
            if length in matching:
                shutil.copyfile(tmp, os.path.join(d, name))
            else:
                _write_sparse(tmp, os.path.join(d, name), length, 32)
            if i % 10000 == 9999:
                print(f"  fixture: {i + 1}/{n} files, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(marker, "w") as f:
        json.dump({"n": n, "matching": sorted(matching)}, f)
    return sorted(matching)


_FRESH = r"""
import sys, time, json
from ds4.kvstore import KVStore
prompt = open(sys.argv[2], "rb").read()
t0 = time.perf_counter()
st = KVStore(sys.argv[1], budget_mb=1 << 30, min_tokens=1)
t1 = time.perf_counter()
hits = st.lookup(prompt)
t2 = time.perf_counter()
print(json.dumps({"open_ms": (t1 - t0) * 1e3, "lookup_ms": (t2 - t1) * 1e3, "best": hits[0].text_bytes,
                  "files": st.summary()["files"], "rebuilds": st.stats["index_rebuilds"]}))
"""

_RSS = r"""
import sys, json
from ds4 import _core
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
r0 = rss()
idx, _stamp = _core.StoreIndex.load(sys.argv[1])
idx.lookup(b"x", min_tokens=0)  # builds the lookup table too
r1 = rss()
print(json.dumps({"rss": r1 - r0, "heap": idx.heap_bytes(), "n": len(idx)}))
"""


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def bench(d: str, n: int, repeats: int, c_bin: str) -> dict[str, object]:
    prompt = _prompt()
    t0 = time.perf_counter()
    matching = build_fixture(d, n, prompt)
    built = time.perf_counter() - t0
    pfile = os.path.join(d, "prompt.bin")
    with open(pfile, "wb") as f:
        f.write(prompt)
    # one open writes the index file (a rebuild from the headers when it is missing)
    t0 = time.perf_counter()
    first = KVStore(d, budget_mb=1 << 30, min_tokens=1)
    first_open_s = time.perf_counter() - t0
    rebuilt = first.stats["index_rebuilds"]
    del first
    ours, theirs = [], []
    for i in range(repeats * 2):  # alternated, so drift hits both
        if i % 2 == 0:
            ours.append(json.loads(_run([sys.executable, "-c", _FRESH, d, pfile])))
        else:
            o, lk, best, files, hashed = _run([c_bin, d, pfile]).split()
            theirs.append(
                {
                    "open_ms": float(o),
                    "lookup_ms": float(lk),
                    "best": int(best),
                    "files": int(files),
                    "hashed": int(hashed),
                }
            )
    files = sum(1 for name in os.listdir(d) if name.endswith(".kv"))  # a few lengths repeat: n or a few less
    assert all(r["best"] == max(matching) and r["files"] == files and r["rebuilds"] == 0 for r in ours), ours
    assert all(r["best"] == max(matching) and r["files"] == files for r in theirs), theirs
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    ours_total = statistics.median(r["open_ms"] + r["lookup_ms"] for r in ours)
    c_total = statistics.median(r["open_ms"] + r["lookup_ms"] for r in theirs)

    st = KVStore(d, budget_mb=1 << 30, min_tokens=1)
    st.lookup(prompt)
    warm, sha = [], []
    for _ in range(max(5, repeats * 3)):
        t0 = time.perf_counter()
        hits = st.lookup(prompt)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _core.sha1_hex(prompt)
        sha.append(time.perf_counter() - t0)
    assert hits[0].text_bytes == max(matching)
    mem = json.loads(_run([sys.executable, "-c", _RSS, os.path.join(d, INDEX_NAME)]))
    index_file = os.path.getsize(os.path.join(d, INDEX_NAME))
    return {
        "n": n,
        "files": files,
        "fixture_build_s": round(built, 1),
        "index_rebuild_s": round(first_open_s, 3) if rebuilt else None,
        "fresh_open_ms": med(ours, "open_ms"),
        "fresh_lookup_ms": med(ours, "lookup_ms"),
        "fresh_total_ms": ours_total,
        "c_open_ms": med(theirs, "open_ms"),
        "c_lookup_ms": med(theirs, "lookup_ms"),
        "c_total_ms": c_total,
        "c_hashed": theirs[0]["hashed"],
        "fresh_ratio": ours_total / c_total,
        "warm_lookup_ms": statistics.median(warm) * 1e3,
        "sha1_pass_ms": statistics.median(sha) * 1e3,
        "warm_ratio": statistics.median(warm) / statistics.median(sha),
        "heap_bytes_per_entry": mem["heap"] / files,
        "rss_bytes_per_entry": mem["rss"] / files,
        "index_file_bytes_per_entry": index_file / files,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, action="append", help="checkpoints in the fixture (repeatable)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ds4-bench-index"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    sizes = args.n or [10000]
    c_bin = os.path.join(tempfile.mkdtemp(prefix="ds4-c-"), "ds4_find_prefix")
    subprocess.run(["cc", "-O2", "-o", c_bin, os.path.join(HERE, "ds4_find_prefix.c"), "-lcrypto"], check=True)
    rows = [bench(os.path.join(args.dir, str(n)), n, args.repeats, c_bin) for n in sizes]
    for r in rows:
        n = r["n"]
        print(f"== {n:,} checkpoints ({r['files']:,} files; fixture built in {r['fixture_build_s']} s)")
        print(
            f"  fresh process open + first lookup: ds4 {r['fresh_total_ms']:.1f} ms "
            f"(open {r['fresh_open_ms']:.1f} + lookup {r['fresh_lookup_ms']:.1f}) vs C {r['c_total_ms']:.1f} ms "
            f"(open {r['c_open_ms']:.1f} + lookup {r['c_lookup_ms']:.1f}, {r['c_hashed']} prefixes hashed): "
            f"{r['fresh_ratio']:.3f}x"
            + ("  target <= 1.0: " + ("PASS" if r["fresh_ratio"] <= 1.0 else "MISS") if n == 10000 else "")
        )
        print(
            f"  warm lookup {r['warm_lookup_ms']:.3f} ms vs one SHA-1 pass {r['sha1_pass_ms']:.3f} ms: "
            f"{r['warm_ratio']:.2f}x  target <= 1.5: {'PASS' if r['warm_ratio'] <= 1.5 else 'MISS'}"
        )
        print(
            f"  index memory: heap {r['heap_bytes_per_entry']:.0f} B/entry, RSS {r['rss_bytes_per_entry']:.0f} B/entry;"
            f" file {r['index_file_bytes_per_entry']:.0f} B/entry"
        )
    print("BENCH_JSON " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
