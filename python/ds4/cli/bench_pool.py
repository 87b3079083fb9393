"""``ds4 bench --concurrency K``: K conversations interleaved against a pool
of K resident sessions, and the same conversations against one session
(today's default server), in one run.

Each conversation opens with one shared system prompt (``--tokens`` long)
and a question of its own, then ``--turns`` turns: the model's reply (up to
``--max-tokens``, greedy) and a next user message. The K clients are
closed loops, each sending its next turn when its reply is in, all at once
(so the one-session server switches between them on every turn: its state
saved, another loaded from disk). Both runs drive the server's own worker
(:class:`ds4.server.worker.Service`: its queue, lanes, pool and ladder) in
this process over the same engine, each with a fresh store in a temp dir.

Reported for each: aggregate generated tokens/s (all conversations' tokens
over the run's wall time), the time to first token as a client sees it
(submit to first text, queue wait included) at p50 and p95, the prefilled
tokens (prompt tokens the ladder did not reuse) and the turns each cache
level served; then the pool's figures as ratios of one session's. The
replies of the two runs are compared (greedy decoding on the same engine:
they must be identical; exit 1 when they are not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sized
from typing import Any

from ..engine import Engine
from ..kvstore import KVStore
from ..server.pool import Pool
from ..server.worker import Job, Service
from ..turn import GenParams, GenResult, TurnDriver
from .bench import bench_engine
from .term import EXIT_OK, EXIT_USAGE

__all__ = ["SYSTEM_RULE", "cmd_bench_concurrency", "system_prompt", "ttft_figures"]

SYSTEM_RULE = "Rule {i}: read the file before you change it, run the tests after each change, keep each diff small."


@dataclasses.dataclass(frozen=True)
class ChatWork:
    """A bench turn: the engine's own chat rendering of ``messages``."""

    messages: tuple[tuple[str, str], ...]

    def render(self, engine: Engine, namespace: str | None = None) -> str:
        return engine.render_chat([{"role": r, "content": c} for r, c in self.messages])

    def done(self, res: GenResult) -> None:
        """Nothing follows a bench turn's decoding."""


def system_prompt(tokenize: Callable[[str], Sized], n_tokens: int) -> str:
    """A system text of at least ``n_tokens`` tokens of ``tokenize``."""
    rules: list[str] = []
    while len(tokenize(" ".join(rules))) < n_tokens:
        rules.append(SYSTEM_RULE.format(i=len(rules)))
    return " ".join(rules)


def ttft_figures(ttfts: list[float]) -> dict[str, float]:
    """``ttft_p50_ms`` and ``ttft_p95_ms`` of times to first token (s)."""
    ts = sorted(ttfts)
    return {
        "ttft_p50_ms": 1000 * statistics.median(ts),
        "ttft_p95_ms": 1000 * ts[min(len(ts) - 1, round(0.95 * (len(ts) - 1)))],
    }


@dataclasses.dataclass
class Turn:
    ttft_s: float
    prefilled: int
    completion: int
    rung: str
    text: str


def _conversation(svc: Service, system: str, k: int, turns: int, max_tokens: int, out: list[Turn]) -> None:
    msgs: list[tuple[str, str]] = [("system", system), ("user", f"Task {k}: list the files of module {k}.")]
    for t in range(turns):
        first: list[float] = []
        done = threading.Event()
        box: dict[str, Any] = {}

        def post(kind: str, value: Any, first: list[float] = first, done: threading.Event = done, box=box) -> None:
            if kind == "text" and not first:
                first.append(time.perf_counter())
            elif kind in ("done", "error"):
                box[kind] = value
                done.set()

        t0 = time.perf_counter()
        svc.submit(Job(ChatWork(tuple(msgs)), GenParams(max_tokens=max_tokens), post))
        done.wait()
        if "error" in box:
            raise RuntimeError(f"conversation {k}, turn {t}: {box['error']!r}")
        res: GenResult = box["done"]
        t1 = first[0] if first else time.perf_counter()
        out.append(
            Turn(t1 - t0, res.prompt_tokens - res.cached_tokens, res.completion_tokens, res.report.rung, res.text)
        )
        msgs += [("assistant", res.text), ("user", f"Tool result {t} for task {k}: 3 files, 120 lines, tests pass.")]


def run_pool(
    eng: Engine, size: int, convs: int, system: str, args: argparse.Namespace, batched: bool = False
) -> dict[str, Any]:
    """The conversations on a pool of ``size`` residents (``batched``: its
    decode steps batched, where the engine can): its figures."""
    ctx = min(eng.max_ctx, args.tokens + args.turns * (args.max_tokens + 64) + 512)
    with tempfile.TemporaryDirectory(prefix="ds4-bench-pool-") as tmp:
        store = KVStore(tmp, budget_mb=8192, min_tokens=16)
        gen = TurnDriver(eng, ctx, store)
        pool = Pool(gen, size, batched=batched)
        svc = Service(gen, "bench", max_queue=convs + 1, pool=pool)
        results: list[list[Turn]] = [[] for _ in range(convs)]
        errors: list[BaseException] = []

        def client(k: int) -> None:
            try:
                _conversation(svc, system, k, args.turns, args.max_tokens, results[k])
            except BaseException as e:
                errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(convs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        svc.close()
    if errors:
        raise errors[0]
    turns = [t for r in results for t in r]
    levels: dict[str, int] = {}
    for t in turns:
        levels[t.rung] = levels.get(t.rung, 0) + 1
    return {
        "sessions": size,
        "batched": None if pool.shared is None else pool.shared.view()["steps"],
        "wall_s": wall,
        "tokens_per_s": sum(t.completion for t in turns) / wall,
        **ttft_figures([t.ttft_s for t in turns]),
        "prefilled_tokens": sum(t.prefilled for t in turns),
        "levels": levels,
        "replies": [[t.text for t in r] for r in results],
    }


_FIGURES = (
    ("generated tokens/s", "tokens_per_s"),
    ("TTFT p50 (ms)", "ttft_p50_ms"),
    ("TTFT p95 (ms)", "ttft_p95_ms"),
    ("prefilled tokens", "prefilled_tokens"),
)


def cmd_bench_concurrency(args: argparse.Namespace) -> int:
    """``ds4 bench --concurrency K``."""
    if args.concurrency < 1 or args.turns < 1 or args.max_tokens < 1:
        print("ds4 bench: --concurrency, --turns and --max-tokens must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    args.tokens = 2000 if args.tokens is None else args.tokens
    eng = bench_engine(args)
    k = args.concurrency
    system = system_prompt(eng.tokenize, args.tokens)
    eng.tokenize("warm-up")
    runs = {"1 session": run_pool(eng, 1, k, system, args), f"{k} sessions": run_pool(eng, k, k, system, args)}
    if k > 1:
        batched = run_pool(eng, k, k, system, args, batched=True)
        if batched["batched"] is not None:  # the engine batches its decode steps (llama.cpp)
            runs[f"{k}, batched"] = batched
    one = runs["1 session"]
    same = all(r["replies"] == one["replies"] for r in runs.values())
    ratios = {
        name: {key: r[key] / max(1e-9, one[key]) for _n, key in _FIGURES} for name, r in runs.items() if r is not one
    }
    if args.json:
        out = [{key: v for key, v in r.items() if key != "replies"} for r in runs.values()]
        print(json.dumps({"concurrency": k, "runs": out, "ratios": ratios, "replies_identical": same}, indent=1))
    else:
        print(f"{k} conversations x {args.turns} turns, a {args.tokens}-token shared system prompt, engine {eng.name}")
        print(f"{'':22}" + "".join(f"{n:>14}" for n in runs) + "".join(f"{'ratio ' + n[:8]:>16}" for n in ratios))
        for name, key in _FIGURES:
            cells = "".join(f"{r[key]:14.1f}" for r in runs.values())
            print(f"{name:22}{cells}" + "".join(f"{q[key]:16.2f}" for q in ratios.values()))
        for n, r in runs.items():
            lv = ", ".join(f"{rung} {c}" for rung, c in sorted(r["levels"].items()))
            steps = f"; batched steps by size: {r['batched']}" if r["batched"] is not None else ""
            print(f"levels, {n}: {lv}{steps}")
        print(f"replies identical: {'yes' if same else 'NO'}")
    if not same:
        print("ds4 bench: the pool's replies differ from one session's", file=sys.stderr)
        return 1
    return EXIT_OK
