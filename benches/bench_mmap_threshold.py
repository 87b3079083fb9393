#!/usr/bin/env python3
"""What ``ds4 serve``'s fixed glibc mmap threshold (4 MiB,
``ds4.server.serve.fix_mmap_threshold``) costs a session's prefill and
decode: each pair runs a fresh process with the threshold fixed and one
with glibc's default (which rises with the largest block freed), in turn,
and times a prefill of ``--prompt`` tokens and ``--decode`` greedy steps
inside it; reported are each arm's medians and the per-pair ratio
(fixed / default)::

    python benches/bench_mmap_threshold.py --engine llamacpp --pairs 5
    python benches/bench_mmap_threshold.py --engine reference --pairs 5 --decode 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
fix, engine, n_prompt, n_decode = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from ds4.server.serve import fix_mmap_threshold
if fix:
    assert fix_mmap_threshold()
import ds4
from ds4.config import build_engine
eng = build_engine(engine, None, None, None)
s = ds4.Session(eng, ctx=4096)
toks = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 200)[:n_prompt]
t = time.perf_counter(); s.sync(toks); prefill = time.perf_counter() - t
t = time.perf_counter(); s.generate(n_decode); decode = time.perf_counter() - t
print(json.dumps({"prefill": prefill, "decode": decode}))
"""


def run(fix: bool, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-c", CHILD, "1" if fix else "0", a.engine, str(a.prompt), str(a.decode)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="llamacpp", choices=("llamacpp", "reference"))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--decode", type=int, default=100)
    a = ap.parse_args()
    run(True, a)  # warm-up: the model's pages
    rows = [(run(True, a), run(False, a)) for _ in range(a.pairs)]
    for part in ("prefill", "decode"):
        fixed = [f[part] for f, _ in rows]
        default = [d[part] for _, d in rows]
        ratios = [f / d for f, d in zip(fixed, default, strict=True)]
        print(
            f"{part}: fixed {statistics.median(fixed) * 1000:.0f} ms, default {statistics.median(default) * 1000:.0f} ms;"
            f" fixed/default median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
        )
    print(f"engine={a.engine} pairs={a.pairs} prompt={a.prompt} decode={a.decode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
