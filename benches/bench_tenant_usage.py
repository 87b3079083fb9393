#!/usr/bin/env python3
"""What the operator's ``kv.tenants`` costs (``KVStore.tenant_usage``,
taken in the worker's snapshot after every job): the core's per-namespace
sums (``StoreIndex.namespace_usage``) against the same sums built in
Python from every row of the index (``StoreIndex.entries()``), in the same
run, on the same store.

    python benches/bench_tenant_usage.py [--n 10000] [--tenants 20] [--repeats 50]

Fixture: N small v2 checkpoints (a 64-byte payload) in a temp directory,
their texts in ``--tenants`` namespaces (one tenant in two, salted once);
removed afterwards. Best of ``--repeats`` calls each, warm.

Prints a table and one JSON line (prefix ``BENCH_JSON``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np

from ds4.checkpoint import write_checkpoint
from ds4.keytext import preamble
from ds4.kvstore import KVStore, tenant_usage


def _fixture(d: str, n: int, tenants: int) -> None:
    arrays = {"kv": np.zeros(16, dtype=np.float32)}
    for i in range(n):
        t = i % tenants
        ns = f"t{t}" + (f"/salt-{i % 3}" if t % 2 else "")
        text = preamble(ns) + f"prompt {i} ".encode() * 4
        path = os.path.join(d, hashlib.sha1(text).hexdigest() + ".kv")
        write_checkpoint(path, text, arrays, abi="bench/1", tokens=8, ctx=4096, created=1_700_000_000)


def _best(f: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ds4-bench-tenants-")
    try:
        _fixture(d, args.n, args.tenants)
        st = KVStore(d, min_tokens=1)
        rows_of = st.rows  # the bench compares two readings of one index
        core = st.tenant_usage()
        rows = tenant_usage((r[11], r[10][1], 1) for r in rows_of())
        assert core == rows and sum(t["checkpoints"] for t in core.values()) == args.n
        out = {
            "n": args.n,
            "tenants": len(core),
            "core_ms": _best(st.tenant_usage, args.repeats),
            "rows_ms": _best(lambda: tenant_usage((r[11], r[10][1], 1) for r in rows_of()), args.repeats),
            "summary_ms": _best(st.summary, args.repeats),
        }
        out["ratio"] = out["core_ms"] / out["rows_ms"]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"{args.n} files, {out['tenants']} tenants (best of {args.repeats})")
    print(f"  KVStore.tenant_usage (core sums per namespace) {out['core_ms']:.3f} ms")
    print(f"  the same from every index row in Python       {out['rows_ms']:.3f} ms")
    print(f"  ratio                                         {out['ratio']:.3f}x")
    print(f"  KVStore.summary() (with tenants)              {out['summary_ms']:.3f} ms")
    print("BENCH_JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
