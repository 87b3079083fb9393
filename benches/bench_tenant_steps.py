#!/usr/bin/env python3
"""What keys and tenants add to one request, step by step, in process:
the key check (SHA-256 of the presented key, ``compare_digest`` with each
configured key), the turn's namespace, and the key text of a prompt (the
namespace preamble and a join over the engine's key-bytes table), each
beside the request's work it is paid with: the key text against
``str.encode`` of the same prompt (what naming a checkpoint cost before
key texts) and against the engine's tokenization of it.

    python benches/bench_tenant_steps.py [--tokens 6000] [--engine reference|llamacpp]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit

from ds4.keytext import KeyRenderer, preamble
from ds4.server.guard import Guard
from ds4.server.tenants import namespace_for


def per_call(fn, repeat: int = 7) -> float:
    """The median of ``repeat`` timings, seconds per call."""
    n, _ = timeit.Timer(fn).autorange()
    return statistics.median(t / n for t in timeit.Timer(fn).repeat(repeat, n))


def engine_of(name: str):
    if name == "llamacpp":
        from ds4.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine()
    from ds4.engines.reference import ReferenceEngine

    return ReferenceEngine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--engine", default="reference", choices=("reference", "llamacpp"))
    a = ap.parse_args()
    engine = engine_of(a.engine)
    unit = "You are a coding agent. Read <before> you write; run the tests after each change. "
    text = unit
    while len(engine.tokenize(text)) < a.tokens:
        text += unit
    tokens = engine.tokenize(text)
    keys = [f"sk-test-{i:04d}-" + "x" * 40 for i in range(3)]
    guard = Guard([*keys[:2], ("team-b", keys[2])])
    ns = namespace_for("team-b", "salt-1")
    keys_r = KeyRenderer.of(engine)
    keys_r.render(tokens[:8])  # the table is built once per engine, not per request
    pre = preamble(ns)

    rows = [
        ("key check, 3 keys", per_call(lambda: guard.tenant(keys[2])), None),
        ("namespace of the turn (with a cache_salt)", per_call(lambda: namespace_for("team-b", "salt-1")), None),
    ]
    key_text = per_call(lambda: pre + keys_r.render(tokens))
    encode = per_call(lambda: text.encode("utf-8"))
    tokenize = per_call(lambda: engine.tokenize(text), repeat=3)
    rows.append((f"key text of {len(tokens)} tokens", key_text, None))
    rows.append(("  baseline: str.encode of the prompt", encode, key_text / encode))
    rows.append(("  baseline: tokenizing the prompt", tokenize, key_text / tokenize))
    print(f"engine={a.engine} prompt={len(tokens)} tokens ({len(text)} bytes)")
    print(f"{'step':46} {'per call':>12}  key text / baseline")
    for name, t, ratio in rows:
        r = f"{ratio:.2f}x" if ratio is not None else ""
        print(f"{name:46} {t * 1e6:10.2f} us  {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
