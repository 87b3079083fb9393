"""Decode speed of one session: ``--exact canonical`` against ``strict`` and
against plain llama-cpp-python (a ``llama_cpp.Llama`` on the same GGUF,
threads, context and batch), in the same run.

For each model and prompt length N: the prompt is prefilled, then
``--gen`` tokens are decoded greedily, one at a time, the next token the
argmax of the last logits in every variant (the loop a server runs). The
decode rate is tokens over the decode's wall time, prefill excluded. For
``canonical`` the canonicalization of the reply (the reply's positions
prefilled again, :meth:`LlamaCppContext.canonicalize`, what a later turn,
a save or a copy waits for) is timed apart and given as a share of the
decode it replaces. Medians of ``--repeats``, the variants alternated::

    python benches/bench_decode.py [--models smollm2 gemma3] [--tokens 300 2200] [--gen 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from helpers.models import model_path, text_tokens

import ds4
from ds4.engines.llamacpp import LlamaCppEngine


def ds4_decode(eng: LlamaCppEngine, toks: list[int], gen: int, ctx: int) -> tuple[float, float, list[int]]:
    """(decode s, canonicalize s, generated ids) of a ds4 session."""
    s = ds4.Session(eng, ctx=ctx)
    s.sync(toks)
    out = []
    t0 = time.perf_counter()
    for _ in range(gen):
        t = int(np.argmax(s.logits))
        out.append(t)
        s.eval_token(t)
    dec = time.perf_counter() - t0
    t0 = time.perf_counter()
    s._ectx.canonicalize()  # what the next use of the state would do first
    can = time.perf_counter() - t0
    return dec, can, out


def plain_decode(llm, toks: list[int], gen: int) -> tuple[float, list[int]]:
    """(decode s, generated ids) of llama-cpp-python's own ``Llama``."""
    llm.reset()
    llm.eval(toks)
    out = []
    t0 = time.perf_counter()
    import llama_cpp

    n_vocab = llm.n_vocab()
    for _ in range(gen):
        # the last logits as llama.cpp holds them (what Llama.eval copied into its scores)
        last = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        t = int(np.argmax(np.ctypeslib.as_array(last, shape=(n_vocab,))))
        out.append(t)
        llm.eval([t])
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[300, 2200])
    ap.add_argument("--gen", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import llama_cpp

    hdr = f"{'model':<8} {'N':>5} {'plain tok/s':>11} {'strict':>8} {'canonical':>9} {'can/plain':>9} {'can/strict':>10} {'canonicalize/decode':>19}"
    print(hdr)
    for m in a.models:
        path = model_path(m)
        engines = {mode: LlamaCppEngine(model_path=path, exact=mode) for mode in ("strict", "canonical")}
        threads = engines["strict"].n_threads
        for n in a.tokens:
            ctx = n + a.gen + 64
            toks = text_tokens(engines["strict"], n)
            llm = llama_cpp.Llama(
                path, n_ctx=ctx, n_threads=threads, n_batch=512, n_ubatch=512, logits_all=False, verbose=False
            )
            rates: dict[str, list[float]] = {"plain": [], "strict": [], "canonical": []}
            share = []
            for _ in range(a.repeats):
                d, _ = plain_decode(llm, toks, a.gen)
                rates["plain"].append(a.gen / d)
                for mode, eng in engines.items():
                    d, c, _ = ds4_decode(eng, toks, a.gen, ctx)
                    rates[mode].append(a.gen / d)
                    if mode == "canonical":
                        share.append(c / d)
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(
                f"{m:<8} {n:>5} {med['plain']:>11.1f} {med['strict']:>8.1f} {med['canonical']:>9.1f} "
                f"{med['canonical'] / med['plain']:>9.2f} {med['canonical'] / med['strict']:>10.2f} "
                f"{statistics.median(share):>19.3f}"
            )
            del llm


if __name__ == "__main__":
    main()
