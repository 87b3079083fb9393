#!/usr/bin/env python3
"""An agent session replayed against the store (issue 23, items 4-5): a
40-turn conversation growing to about 30,000 tokens with continued saves
every 2,048 tokens, and 10 short conversations sharing its system prompt,
interleaved with it, through one live session (``ds4.turn.TurnDriver`` on
the reference engine, the store a real ``KVStore``), once per arm:

* ``before``: the store before items 4-5: no supersede pruning
  (``StorePolicy.supersede=False``), ``explicit_weight=1`` (ds4's one
  score), ``fresh_guard_s=0`` (no guard);
* ``after``: the defaults (supersede on, weight 4, guard 60 s);
* ``blocks``: the defaults with shared blocks (``StorePolicy.blocks``): a
  checkpoint's K/V in block files every checkpoint of the same tokens
  shares, the checkpoint a manifest naming them.

Each arm runs at a budget and at a quarter of it: ``--budget-mb`` (default
4096, ds4 serve's) and, unless ``--no-scaled``, the same budgets scaled by
the reference engine's checkpoint bytes per token over SmolLM2's (533 /
23,052), which is how full a real model's files would make that budget.

Turns are driven by ``TurnDriver.prepare`` (the ladder, its evict save of
the other conversation, its cold and continued saves); nothing is decoded:
the prompt grows by fixed user and assistant texts (the reference engine's
replies are seldom valid UTF-8). The clock is virtual: the store's,
the writer's and the hit stamps' ``time.time`` read it, and it moves
``--turn-s`` seconds per turn (default 10), so "younger than 60 s" means
what it would in a session of that pace.

Per arm: bytes written (the store's count: every checkpoint file, and
every block file, written), bytes on disk at the end (files and blocks), evictions of never-hit files younger than 60 s, files superseded,
and the hit rate (turns whose rung is ``live``, ``rewrite`` or ``disk`` /
turns), for the long conversation and the short ones.

    python benches/bench_store_replay.py [--budget-mb 4096] [--turn-s 10] [--no-scaled] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import types

import ds4
from ds4 import checkpoint as ds4_checkpoint
from ds4.kvstore import KVStore, StorePolicy
from ds4.kvstore import admission as kv_loads
from ds4.kvstore import eviction as kv_eviction
from ds4.kvstore import save as kv_save
from ds4.turn import TurnDriver

#: checkpoint bytes per token: the reference engine's (measured) and SmolLM2's (README)
REF_BYTES_PER_TOKEN = 533
SMOLLM2_BYTES_PER_TOKEN = 23_052
LONG_TURNS = 40
SHORT_CONVERSATIONS = 10
SHORT_TURNS = 2
CONTINUED_EVERY = 2048
YOUNG_S = 60.0

SYSTEM = (
    "You are a coding agent working in a large repository. Follow the house rules: read before you write, "
    "keep changes small, run the tests, explain what you did and why. "
) * 7
USER = "Step {i}: look at module {i} and tell me what to change next; keep the plan short. "
ASSISTANT = "Module {i} reads its input, checks it and writes the result; the next change is a smaller loop. " * 6
SHORT_USER = "Question {j}.{k}: what does the option number {k} do in the tool {j}? Answer in a sentence. "
SHORT_ASSISTANT = "Option {k} of tool {j} turns the verbose output on; nothing else changes. " * 3

ARMS = {
    "before": {"supersede": False, "explicit_weight": 1.0, "fresh_guard_s": 0.0},
    "after": {},
    "blocks": {"blocks": True},  # the defaults with shared blocks (--kv-blocks on)
}


class Clock:
    """The virtual ``time.time`` of the replay (seconds)."""

    def __init__(self, start: float = 2_000_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def _with_clock(clock: Clock) -> types.SimpleNamespace:
    """The ``time`` module with ``time.time`` replaced by ``clock``."""
    names = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    return types.SimpleNamespace(**{**names, "time": clock})


class CountingStore(KVStore):
    """A KVStore that records what its evictions removed (by the plan)."""

    def __init__(self, *a, clock: Clock, **kw):
        self.clock = clock
        self.victims: list[tuple[str, int, float]] = []  # name, hits, age
        super().__init__(*a, **kw)

    def plan_evict(self, entries, protect=None):
        out = super().plan_evict(entries, protect)
        now = self.clock()
        self.victims.extend((e.name, e.hits, now - e.created) for e in out)
        return out


def _script() -> list[tuple[str, int]]:
    """The replay's order: (conversation, turn); a short conversation's
    turns after every fourth turn of the long one."""
    out, short = [], 0
    for i in range(LONG_TURNS):
        out.append(("long", i))
        if i % 4 == 3 and short < SHORT_CONVERSATIONS:
            out += [(f"short{short}", k) for k in range(SHORT_TURNS)]
            short += 1
    return out


def _prompt(eng, conv: str, turn: int) -> str:
    msgs = [{"role": "system", "content": SYSTEM}]
    if conv == "long":
        for i in range(turn):
            msgs += [
                {"role": "user", "content": USER.format(i=i)},
                {"role": "assistant", "content": ASSISTANT.format(i=i)},
            ]
        msgs.append({"role": "user", "content": USER.format(i=turn)})
    else:
        j = int(conv[5:])
        for k in range(turn):
            msgs += [
                {"role": "user", "content": SHORT_USER.format(j=j, k=k)},
                {"role": "assistant", "content": SHORT_ASSISTANT.format(j=j, k=k)},
            ]
        msgs.append({"role": "user", "content": SHORT_USER.format(j=j, k=turn)})
    return eng.render_chat(msgs)


def replay(eng, budget_mb: float, arm: str, turn_s: float) -> dict[str, object]:
    clock = Clock()
    shim = _with_clock(clock)
    saved = {m: m.time for m in (ds4_checkpoint, kv_eviction, kv_loads)}
    written: list[int] = []
    real_write = kv_save.write_live

    def counting_write(*a, **kw):
        size = real_write(*a, **kw)
        if isinstance(size, int):  # not a SaveSkip (over the budget)
            written.append(size)
        return size

    d = tempfile.mkdtemp(prefix="ds4-replay-")
    for m in saved:
        m.time = shim
    kv_save.write_live = counting_write
    try:
        policy = StorePolicy(budget_mb=budget_mb, continued_interval_tokens=CONTINUED_EVERY, **ARMS[arm])
        store = CountingStore(d, policy=policy, clock=clock)
        gen = TurnDriver(eng, ctx=40000, store=store)
        rungs: dict[str, list[str]] = {"long": [], "short": []}
        longest = 0
        t0 = time.perf_counter()
        for conv, turn in _script():
            clock.now += turn_s
            rep = gen.prepare(_prompt(eng, conv, turn))
            rungs["long" if conv == "long" else "short"].append(rep.rung)
            longest = max(longest, gen.sess.n_past)
        wall = time.perf_counter() - t0
        store.refresh(force=True)
        on_disk = store.total_bytes()  # the files and the block files
        young = [v for v in store.victims if v[1] == 0 and v[2] < YOUNG_S]
        hit = lambda rs: sum(r in ("live", "rewrite", "disk") for r in rs)  # noqa: E731
        turns = rungs["long"] + rungs["short"]
        return {
            "arm": arm,
            "budget_mb": round(budget_mb, 2),
            "bytes_written": store.stats["bytes_written"],  # the store's count: files, and blocks with blocks on
            "files_written": len(written),
            "bytes_on_disk": on_disk,
            "files_on_disk": len(store.entries()),
            "evictions": len(store.victims),
            "young_never_hit_evictions": len(young),
            "superseded": store.stats["superseded"],
            "hit_rate": hit(turns) / len(turns),
            "long_hit_rate": hit(rungs["long"]) / len(rungs["long"]),
            "short_hit_rate": hit(rungs["short"]) / len(rungs["short"]),
            "rungs": {r: turns.count(r) for r in sorted(set(turns))},
            "longest_tokens": longest,
            "wall_s": round(wall, 1),
        }
    finally:
        for m, t in saved.items():
            m.time = t
        kv_save.write_live = real_write
        shutil.rmtree(d, ignore_errors=True)


def _mb(b: int) -> str:
    return f"{b / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mb", type=float, default=4096.0)
    ap.add_argument("--turn-s", type=float, default=10.0, help="virtual seconds per turn (default 10)")
    ap.add_argument("--no-scaled", action="store_true", help="only the literal budgets")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    eng = ds4.ReferenceEngine()
    budgets = [args.budget_mb, args.budget_mb / 4]
    if not args.no_scaled:
        scale = REF_BYTES_PER_TOKEN / SMOLLM2_BYTES_PER_TOKEN
        budgets += [b * scale for b in budgets[:2]]
    rows = [replay(eng, b, arm, args.turn_s) for b in budgets for arm in ARMS]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    head = "budget      arm     written     on disk    evictions young<60s superseded hit rate (long, short)  rungs"
    print(head)
    for r in rows:
        print(
            f"{r['budget_mb']:>9,.1f}  {r['arm']:<6} {_mb(r['bytes_written']):>11} {_mb(r['bytes_on_disk']):>11} "
            f"{r['evictions']:>9} {r['young_never_hit_evictions']:>9} {r['superseded']:>10} "
            f"{r['hit_rate']:>7.1%} ({r['long_hit_rate']:.0%}, {r['short_hit_rate']:.0%})  {r['rungs']}"
            f"  [{r['longest_tokens']} tok, {r['wall_s']} s]"
        )
    print("BENCH_JSON " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
