"""What the token check (issue 34, item 4) costs a resumed turn.

Before a live, disk or remote state is reused, the ladder compares its
tokens with the prompt's own tokenization (``_Ladder.token_check``: the
longest common token prefix, in the Rust core). This bench prefills a
prompt of N tokens on a model, saves it, and resumes ``prompt + suffix`` in
a new session from disk, R times; it reports the token check's time as a
share of the resumed turn's TTFT (the ladder's ``total_ms``, tokenization,
load and suffix prefill included), both measured in the same run.

    python benches/bench_token_check.py [--model NAME] [--tokens 2000 16000 64000] [--repeats 5]

NAME is a tests/helpers/models.py name (default ``qwen3``, the tiny random-weight
GQA model: its 131,072-token context holds 64k prompts)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ds4
from ds4 import recovery


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 16000, 64000])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from helpers.models import engine

    eng = engine(args.model)
    spent: list[float] = []
    real = recovery._Ladder.token_check

    def timed(self: recovery._Ladder, against: str) -> int:
        t = time.perf_counter()
        try:
            return real(self, against)
        finally:
            spent.append((time.perf_counter() - t) * 1000)

    recovery._Ladder.token_check = timed  # type: ignore[method-assign]
    print(f"model {args.model}: token check / resumed turn (disk rung, ms, median of {args.repeats})")
    print("| prompt tokens | token check ms | resumed TTFT ms | share |")
    print("|---:|---:|---:|---:|")
    unit = "The quick brown fox jumps over the lazy dog near the river bank. "
    for n in args.tokens:
        text = unit * (n // 13 + 1)
        toks = ds4.keytext.tokenize_prompt(eng, text)[:n]
        text = eng.detokenize(toks)
        ctx = n + 1024
        with tempfile.TemporaryDirectory() as d:
            st = ds4.KVStore(d, budget_mb=1 << 16, min_tokens=16)
            s = ds4.Session(eng, ctx=ctx)
            ds4.recover(s, None, text)
            st.store_live_prefix(s, "continued")
            del s
            checks, totals = [], []
            for _ in range(args.repeats):
                spent.clear()
                s2 = ds4.Session(eng, ctx=ctx)
                rep = ds4.recover(s2, st, text + " And the heron waited.", evict_save=False, prompt_save=False)
                assert rep.rung == "disk", rep.events
                checks.append(sum(spent))
                totals.append(rep.timings["total_ms"])
                del s2
            c, t = statistics.median(checks), statistics.median(totals)
            print(f"| {n:,} | {c:.3f} | {t:.1f} | {100 * c / t:.2f}% |")


if __name__ == "__main__":
    main()
