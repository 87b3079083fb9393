#!/usr/bin/env python3
"""What ``/metrics`` and ``/ui`` add, step by step, in process, each beside
the work it is paid with, measured in the same run on the reference engine:

* the observation of a turn's end (``Metrics.observer``'s ``done``: a dozen
  counter and histogram updates, one row in the recent-turns ring), against
  the turn itself (a resumed turn of a ``--tokens`` prompt, generated here);
* the observer's test on every other event (a ``text`` piece: one per
  generated token), against one decode step of that turn;
* a scrape (``generate_latest`` over every protocol and rung, 8 tenants and
  a store) and a ``/ui/data`` body over a full ring (2,048 turns), which
  run on the event loop's side, never the worker's.

    python benches/bench_metrics_steps.py [--tokens 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import timeit

import ds4
from ds4.server.metrics import PROTOCOLS, Metrics
from ds4.server.ui import Dashboard
from ds4.server.worker import Service
from ds4.turn import GenParams, TurnDriver


def per_call(fn, repeat: int = 7) -> float:
    """The median of ``repeat`` timings, seconds per call."""
    n, _ = timeit.Timer(fn).autorange()
    return statistics.median(t / n for t in timeit.Timer(fn).repeat(repeat, n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    a = ap.parse_args()
    eng = ds4.ReferenceEngine()
    store = ds4.KVStore(tempfile.mkdtemp(prefix="ds4-bench-metrics-"), budget_mb=256, min_tokens=64)
    gen = TurnDriver(eng, a.tokens + 256, store)
    service = Service(gen, "ds4-reference")
    try:
        base = "You are the support assistant of a harbour authority; answer precisely. " * (a.tokens // 16)
        prompt = eng.render_chat([{"role": "user", "content": base[: a.tokens - 64]}])
        params = GenParams(max_tokens=16)
        gen.generate(prompt, params)  # cold: prefill and save
        turns = []
        for i in range(5):  # resumed turns: the prompt again, a few tokens more (live rung)
            res = gen.generate(prompt + f" and {i}", params)
            turns.append(res)
        res = turns[-1]
        turn_s = statistics.median(r.total_s for r in turns)
        step_s = statistics.median(r.decode_s / max(1, r.completion_tokens - 1) for r in turns)

        metrics = Metrics(service)
        for p in PROTOCOLS.values():  # every series a busy server has: 4 protocols x 8 tenants
            for t in range(8):
                metrics.observer(p, f"tenant-{t}")("done", res)
        service._by_tenant.update({f"tenant-{t}": service.tenant_counters("x") for t in range(8)})
        observe = metrics.observer("chat", "tenant-0")
        done_s = per_call(lambda: observe("done", res))
        text_s = per_call(lambda: observe("text", "a"))
        scrape_s = per_call(metrics.exposition)
        dash = Dashboard(service, metrics, needs_key=False)
        for _ in range(2048):
            observe("done", res)
        data_s = per_call(lambda: asyncio.run(dash._operator_data()))
        size = len(metrics.exposition()[0])
    finally:
        service.close()

    print(
        f"\nreference engine, a resumed turn of {res.prompt_tokens} prompt tokens, {res.completion_tokens} generated\n"
    )
    rows = [
        ("observe a turn's end (done)", done_s, "the turn", turn_s),
        ("observe a text piece (ignored)", text_s, "one decode step", step_s),
        (f"a scrape ({size:,} bytes of text)", scrape_s, "the turn", turn_s),
        ("a /ui/data body, 2,048 turns in the ring", data_s, "the turn", turn_s),
    ]
    hdr = f"{'step':44} {'time':>10}   {'against':16} {'its time':>10} {'ratio':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, t, what, base_t in rows:
        print(f"{name:44} {t * 1e6:8.1f}µs   {what:16} {base_t * 1e3:8.2f}ms {100 * t / base_t:8.4f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
