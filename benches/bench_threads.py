#!/usr/bin/env python3
"""SmolLM2 prefill time with the engine's default thread count
(``default_threads``: the physical cores, at most 4) against 1 thread, in
alternation in one run: the ratio says what the default buys on this
machine.

    python benches/bench_threads.py [--tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import ds4
from ds4.engines.llamacpp import LlamaCppEngine
from ds4.engines.llamacpp_lib import default_threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    counts = sorted({1, default_threads()})
    engines = {n: LlamaCppEngine(n_threads=n) for n in counts}
    times: dict[int, list[float]] = {n: [] for n in counts}
    text = "You are a careful assistant. " * (a.tokens // 4)
    for _ in range(a.repeats):
        for n in counts:
            eng = engines[n]
            tokens = eng.tokenize(text)[: a.tokens]
            s = ds4.Session(eng, ctx=max(2048, a.tokens + 16))
            t = time.perf_counter()
            s.sync(tokens)
            times[n].append(time.perf_counter() - t)
            del s  # its context goes back to the engine (kept for the next one)
    for n in counts:
        row = ", ".join(f"{x:.2f}" for x in times[n])
        print(f"{n} thread(s): prefill of {a.tokens} tokens, median {statistics.median(times[n]):.2f} s ({row})")
    if len(counts) > 1:
        d = statistics.median(times[counts[-1]]) / statistics.median(times[1])
        print(f"default ({counts[-1]} threads) / 1 thread: {d:.2f}x the time")
    else:
        print("the default is 1 thread on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
