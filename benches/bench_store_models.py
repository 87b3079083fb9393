#!/usr/bin/env python3
"""One store, many models: what per-model names cost the index.

    python benches/bench_store_models.py [--n 10000] [--models 4] [--repeats 7] [--dir DIR]

Two directories of N checkpoints each (v2, a 64-byte payload, texts of
40 to 1,000 bytes): in one, N texts of one model; in the other, N / M texts
each saved by M models (M payload ABIs, so M files per text under
``<sha1>-<model tag>.kv``), as a directory shared by a model's quantizations
is. Rows, medians of --repeats, each directory measured alternately in
the same run:

1. open: ``KVStore(dir)`` with its index file (what a server start pays);
2. rebuild: ``KVStore(dir)`` after the index file is removed (every
   header read again);
3. lookup: ``KVStore.lookup(prompt, abi)`` for a prompt that extends one
   stored text (one SHA-1 pass, the ABI filter picking the model's rows).

Reported as M models ÷ one model (goal <= 1.1). The fixture is kept in
DIR (default: under the system temp dir) and reused."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from ds4 import KVStore
from ds4._core import sha1_hex
from ds4.checkpoint import write_checkpoint
from ds4.kvstore import checkpoint_name

ABI = "bench/1 model=sha256:{:016x} layout=1"


def text(i: int) -> bytes:
    return (f"conversation {i:06d}: " + "the tide and the harbour " * (1 + i % 40)).encode()


def fixture(d: str, n: int, models: int) -> None:
    """``n`` files: ``n // models`` texts, each under ``models`` ABIs."""
    if os.path.exists(os.path.join(d, ".done")):
        return
    os.makedirs(d, exist_ok=True)
    arrays = {"kv": np.zeros(16, dtype=np.float32)}
    for i in range(n // models):
        t = text(i)
        for m in range(models):
            abi = ABI.format(m)
            write_checkpoint(
                os.path.join(d, checkpoint_name(sha1_hex(t), abi)), t, arrays, abi=abi, tokens=64, ctx=4096
            )
    open(os.path.join(d, ".done"), "w").close()


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ds4-bench-store-models"))
    args = ap.parse_args()
    dirs = {
        1: os.path.join(args.dir, f"{args.n}-1"),
        args.models: os.path.join(args.dir, f"{args.n}-{args.models}"),
    }
    for m, d in dirs.items():
        fixture(d, args.n, m)
    prompt = text(7) + b" and what came in with the noon tide?"
    rows: dict[str, dict[int, list[float]]] = {k: {m: [] for m in dirs} for k in ("open", "rebuild", "lookup")}
    for _ in range(args.repeats):
        for m, d in dirs.items():  # alternated: the machine's noise falls on both
            KVStore(d, budget_mb=1 << 20, min_tokens=1)  # the index file written
            rows["open"][m].append(timed(lambda d=d: KVStore(d, budget_mb=1 << 20, min_tokens=1)))
            os.unlink(os.path.join(d, ".ds4.index"))
            rows["rebuild"][m].append(timed(lambda d=d: KVStore(d, budget_mb=1 << 20, min_tokens=1)))
            st = KVStore(d, budget_mb=1 << 20, min_tokens=1)
            hits = st.lookup(prompt, abi=ABI.format(0))
            assert len(hits) == 1, hits
            rows["lookup"][m].append(
                statistics.median(timed(lambda st=st: st.lookup(prompt, abi=ABI.format(0))) for _ in range(20))
            )
    one, many = 1, args.models
    print(
        f"{args.n} checkpoints: {args.n} texts x 1 model vs {args.n // many} texts x {many} models (ms, median of {args.repeats})"
    )
    print(f"| row | 1 model | {many} models | ratio |")
    print("|---|---:|---:|---:|")
    for k, by in rows.items():
        a, b = statistics.median(by[one]), statistics.median(by[many])
        print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
