"""``ds4 bench``: headline figures on this machine: time to first token
cold and resumed, checkpoint save and load (on the reference engine, or
with ``--model PATH`` a GGUF through llama.cpp), SHA-1 speed and the
one-pass prefix lookup."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import numpy as np

from .. import _core
from ..checkpoint import open_checkpoint
from ..config import build_engine
from ..engine import Engine
from ..keytext import tokenize_prompt
from ..kvstore import KVStore
from ..recovery import recover
from ..session import Session
from .progress import ProgressBar
from .term import EXIT_OK, EXIT_USAGE, human_bytes

__all__ = ["cmd_bench"]

Row = tuple[str, float, str]


#: the store's shortest prefix in the bench (its one checkpoint must be stored)
MIN_STORED = 16


def _msgs(body: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a benchmark."}, {"role": "user", "content": body}]


def token_range(eng: Engine) -> tuple[int, int]:
    """The ``--tokens`` the bench can build: a prompt with a one-token
    question that the store keeps, up to half the engine's context (the
    session's context is twice the prompt)."""
    least = len(tokenize_prompt(eng, eng.render_chat(_msgs("?"))))
    return max(least, MIN_STORED), eng.max_ctx // 2


def _prompt(eng: Engine, n_tokens: int) -> tuple[list[dict[str, str]], str, list[int]]:
    """A chat of ``n_tokens`` tokens (exactly so with the reference engine's
    byte tokens; at most so with a GGUF's), within :func:`token_range`: its
    messages, prompt and tokens."""
    reps = n_tokens // 40 + 2  # enough in bytes; a GGUF's tokens take ~10 a sentence
    while True:
        body = "The quick brown fox jumps over the lazy dog. " * reps
        msgs = _msgs(body)
        prompt = eng.render_chat(msgs)
        toks = tokenize_prompt(eng, prompt)
        if len(toks) >= n_tokens:
            break
        reps *= 2
    while len(toks) > n_tokens:
        body = body[: len(body) - (len(toks) - n_tokens)]
        msgs[1]["content"] = body
        prompt = eng.render_chat(msgs)
        toks = tokenize_prompt(eng, prompt)
    return msgs, prompt, toks


def bench_engine(args: argparse.Namespace) -> Engine:
    """The engine the session rows run on: the reference engine, or with
    ``--model`` (or ``--engine llamacpp``) llama.cpp."""
    kind = args.engine or ("llamacpp" if args.model else "reference")
    return build_engine(kind, args.model, args.threads, getattr(args, "exact", None))


def _session_rows(args: argparse.Namespace, eng: Engine) -> list[Row]:
    rows: list[Row] = []
    ctx = min(eng.max_ctx, max(8192, args.tokens * 2))
    msgs, prompt, toks = _prompt(eng, args.tokens)
    n = len(toks)
    # the next turn, in the engine's own chat format
    follow = eng.render_chat(
        [*msgs, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And in one word?"}]
    )
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        store = KVStore(args.kv_disk_dir or tmp, budget_mb=4096, min_tokens=16)
        Session(eng, ctx=ctx).sync(toks[:512])  # warm-up: first-call allocations and tables
        # cold: full prefill then the first token
        s = Session(eng, ctx=ctx)
        bar = ProgressBar("cold prefill")  # on stderr, a terminal's only: the figures are stdout's
        t0 = time.perf_counter()
        s.sync(toks, progress=bar)
        s.argmax()
        cold = time.perf_counter() - t0
        bar.close()  # after the clock: erasing the bar is not the prefill's time
        rows.append((f"TTFT cold ({n} tokens, full prefill)", cold * 1000, "ms"))
        t0 = time.perf_counter()
        path = store.store_live_prefix(s, "cold")
        save = time.perf_counter() - t0
        assert path is not None
        rows.append((f"checkpoint save ({human_bytes(os.path.getsize(path))}, fsync)", save * 1000, "ms"))
        t0 = time.perf_counter()
        ck = open_checkpoint(path, prompt=prompt, expected_abi=s.payload_abi, ctx=ctx - 1)
        Session(eng, ctx=ctx).load_checkpoint(ck)
        rows.append(("checkpoint verify + load", (time.perf_counter() - t0) * 1000, "ms"))
        # resumed: a new process would start with an empty session
        s3 = Session(eng, ctx=ctx)
        bar = ProgressBar("resumed")
        t0 = time.perf_counter()
        rep = recover(s3, store, follow, progress=bar)
        s3.argmax()
        resumed = time.perf_counter() - t0
        bar.close()
        label = f"TTFT resumed from disk (+{rep.prompt_tokens - rep.reused_tokens} new tokens, rung={rep.rung})"
        rows.append((label, resumed * 1000, "ms"))
        s4 = Session(eng, ctx=ctx)
        bar = ProgressBar("cold follow-up")
        t0 = time.perf_counter()
        s4.sync(tokenize_prompt(eng, follow), progress=bar)
        s4.argmax()
        cold2 = time.perf_counter() - t0
        bar.close()
        rows.append(("TTFT same follow-up, cold", cold2 * 1000, "ms"))
        rows.append(("speed-up resumed vs cold", cold2 / max(resumed, 1e-9), "x"))
        del ck
    return rows


def _sha_rows(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    data = np.random.default_rng(0).integers(0, 256, size=args.sha_mb << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    a = _core.sha1_hex(data)
    t_core = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = hashlib.sha1(data).hexdigest()
    t_lib = time.perf_counter() - t0
    assert a == b
    mb = len(data) / 2**20
    rows.append(("SHA-1 ds4 core", mb / t_core, "MiB/s"))
    rows.append(("SHA-1 hashlib", mb / t_lib, "MiB/s"))
    pb = data[: 1 << 20]
    lengths = sorted({int(x) for x in np.linspace(1024, len(pb), 64)})
    t0 = time.perf_counter()
    _core.sha1_prefixes(pb, lengths)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for L in lengths:
        hashlib.sha1(pb[:L]).digest()
    t_each = time.perf_counter() - t0
    rows.append((f"prefix lookup, {len(lengths)} candidates in 1 MiB: one pass", t_one * 1000, "ms"))
    rows.append((f"prefix lookup, {len(lengths)} candidates in 1 MiB: hashlib each", t_each * 1000, "ms"))
    return rows


def cmd_bench(args: argparse.Namespace) -> int:
    """``ds4 bench`` (with ``--concurrency``, the CLI runs
    :func:`ds4.cli.bench_pool.cmd_bench_concurrency` instead)."""
    args.tokens = 4096 if args.tokens is None else args.tokens
    eng = bench_engine(args)
    lo, hi = token_range(eng)
    if not lo <= args.tokens <= hi:
        print(f"ds4 bench: --tokens must be between {lo} and {hi} (a chat prompt the store keeps)", file=sys.stderr)
        return EXIT_USAGE
    rows = _session_rows(args, eng) + _sha_rows(args)
    if args.json:
        print(json.dumps([{"name": r[0], "value": r[1], "unit": r[2]} for r in rows], indent=1))
        return EXIT_OK
    w = max(len(r[0]) for r in rows)
    print(f"{'measure'.ljust(w)}  {'value':>10}  unit")
    for name, v, unit in rows:
        print(f"{name.ljust(w)}  {v:10.2f}  {unit}")
    return EXIT_OK
