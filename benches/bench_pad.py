"""What exactness costs a decode step (issue 20): one generated token
evaluated padded to the engine's batch policy (exact mode: SmolLM2 2x1,
Gemma 3 8x4) against the same token evaluated alone (exact=False), both
after the same 512-token prefill, in the same run; medians of 40 steps.

    python benches/bench_pad.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from helpers.models import MODELS, model_path, text_tokens

from ds4.engines.llamacpp import LlamaCppEngine


def step_ms(eng: LlamaCppEngine, toks: list[int], n: int = 40) -> float:
    ctx = eng.new_context(1024)
    ctx.eval(toks)
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        ctx.eval([toks[i]])
        ts.append(time.perf_counter() - t0)
    ctx.close()
    return statistics.median(ts) * 1000


def main() -> None:
    print(f"{'model':<8} {'policy':>7} {'padded ms':>10} {'alone ms':>9} {'ratio':>6}")
    for m in MODELS:
        exact = LlamaCppEngine(model_path=model_path(m))
        fast = LlamaCppEngine(model_path=model_path(m), exact=False)
        toks = text_tokens(exact, 512)
        a, b = [], []
        for _ in range(3):  # alternate to spread the machine's noise over both
            a.append(step_ms(exact, toks))
            b.append(step_ms(fast, toks))
        pa, pb = statistics.median(a), statistics.median(b)
        pol = f"{exact.batch_floor}x{exact.batch_multiple}"
        print(f"{m:<8} {pol:>7} {pa:>10.2f} {pb:>9.2f} {pa / pb:>5.2f}x")


if __name__ == "__main__":
    main()
