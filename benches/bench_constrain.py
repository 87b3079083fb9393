"""Constrained decoding cost (issue #9, item 2): tokens/s of a decode under a
JSON schema vs the same engine unconstrained, in the same run, and the
grammar's own per-step cost (mask + advance) replayed alone over the
constrained answer's tokens, as a share of the engine's time per token.

Both engines: the reference engine (260-token byte vocabulary) and SmolLM2
through llama.cpp (49,152 tokens). Decoding is greedy from the same prompt;
each figure is the median of ``--repeats`` turns (the prompt is a live hit,
so decode_s is decoding alone).

    python benches/bench_constrain.py [--repeats 5] [--skip-llama] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import ds4
from ds4.constrain import Constraint
from ds4.turn import GenParams, TurnDriver

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror", "documentary"]}, "maxItems": 3},
        "cast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "role": {"type": "string", "maxLength": 24},
                },
                "required": ["name", "role"],
                "additionalProperties": False,
            },
            "maxItems": 6,
        },
    },
    "required": ["title", "year", "genres", "cast"],
    "additionalProperties": False,
}
QUESTION = "Describe a film as JSON: title, year, genres and its cast (name and role of each actor)."


def _decode_rates(g: TurnDriver, prompt: str, runs: dict[str, GenParams], repeats: int) -> dict[str, tuple]:
    """Per run: median tokens/s of the decode (first token excluded), its
    tokens, and the last answer's tokens. The runs alternate (load on a
    shared machine changes over seconds)."""
    rates: dict[str, list[float]] = {k: [] for k in runs}
    last: dict[str, list[int]] = {}
    for _ in range(repeats):
        for k, params in runs.items():
            res = g.generate(prompt, params)
            last[k] = res.tokens
            if len(res.tokens) > 1 and res.decode_s > 0:
                rates[k].append((len(res.tokens) - 1) / res.decode_s)
    return {k: (statistics.median(rates[k]), len(last[k]), last[k]) for k in runs}


def _guide_cost(eng, g: TurnDriver, constraint: Constraint, tokens: list[int], repeats: int) -> float:
    """Median microseconds per step of mask + advance alone, over ``tokens``."""
    logits = np.zeros(eng.vocab_size, dtype=np.float32)
    per = []
    for _ in range(repeats):
        guide = constraint.start(eng, g.stop_ids)
        t0 = time.perf_counter()
        for t in tokens:
            guide.mask(logits)
            guide.advance(t)
        per.append((time.perf_counter() - t0) / max(1, len(tokens)) * 1e6)
    return statistics.median(per)


def bench_engine(name: str, eng, max_tokens: int, repeats: int) -> dict:
    g = TurnDriver(eng, 2048)
    prompt = eng.render_chat([{"role": "user", "content": QUESTION}])
    t0 = time.perf_counter()
    constraint = Constraint.json_schema(SCHEMA)
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    constraint.start(eng, g.stop_ids)  # the first start builds the engine's vocabulary (cached)
    first_start_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    constraint.start(eng, g.stop_ids)
    start_ms = (time.perf_counter() - t0) * 1e3
    g.generate(prompt, GenParams(max_tokens=1))  # prefill once: every timed turn below is a live hit
    runs = {"plain": GenParams(max_tokens=max_tokens), "cons": GenParams(max_tokens=max_tokens, constraint=constraint)}
    out = _decode_rates(g, prompt, runs, repeats)
    (plain, n_plain, _), (cons, n_cons, toks) = out["plain"], out["cons"]
    guide_us = _guide_cost(eng, g, constraint, toks, repeats)
    step_us = 1e6 / plain
    return {
        "engine": name,
        "vocab": int(eng.vocab_size),
        "plain_tok_s": plain,
        "plain_tokens": n_plain,
        "constrained_tok_s": cons,
        "constrained_tokens": n_cons,
        "ratio": cons / plain,
        "guide_us_per_token": guide_us,
        "engine_us_per_token": step_us,
        "guide_share": guide_us / step_us,
        "schema_compile_ms": compile_ms,
        "first_start_ms": first_start_ms,
        "start_ms": start_ms,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--json", default=None, help="write the rows here too")
    a = ap.parse_args()
    rows = [bench_engine("reference", ds4.ReferenceEngine(), a.max_tokens, a.repeats)]
    if not a.skip_llama:
        eng = ds4.LlamaCppEngine()
        rows.append(bench_engine("llamacpp (SmolLM2-135M)", eng, a.max_tokens, a.repeats))
        eng.close()
    print(
        "| engine | vocab | unconstrained tok/s | constrained tok/s | ratio | mask+advance per token | "
        "engine per token | share | schema compile | first start (vocabulary) | start |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['vocab']:,} | {r['plain_tok_s']:.1f} ({r['plain_tokens']} tok) "
            f"| {r['constrained_tok_s']:.1f} ({r['constrained_tokens']} tok) | {r['ratio']:.2f}x "
            f"| {r['guide_us_per_token']:.0f} µs | {r['engine_us_per_token']:.0f} µs | {r['guide_share'] * 100:.1f} % "
            f"| {r['schema_compile_ms']:.2f} ms | {r['first_start_ms']:.0f} ms | {r['start_ms']:.2f} ms |"
        )
    print("BENCH_JSON " + json.dumps(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
