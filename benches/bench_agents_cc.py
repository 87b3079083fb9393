#!/usr/bin/env python3
"""A Claude-Code-shaped tool loop (issue 21): prefilled tokens and time to
first token per turn with ds4 vs the same server with ``--no-kv-cache``, and
vs a cold prefill of the same request, in the same run.

The loop (tests/helpers/cc_loop.py, the same as tests/test_agents_cc_loop.py's):
``/v1/messages`` through the official ``anthropic`` client, every request
with Claude Code's billing line (a new ``cch`` each request; ``--form``:
its own system block by default), a system text of ``--size`` bytes (about
3,000 SmolLM2 tokens by default) whose environment block says ``Today's
date is ...`` with the clock moved on every turn, six Claude Code tools, and
the history growing as Claude Code grows it: the assistant's ``tool_use``
echoed, then a user message of ``tool_result`` blocks plus a
``<system-reminder>`` text block (``--no-reminder``: the results alone, the
turns the server continues from its live tool state). Both servers run
with ``--prompt-volatile "^Today's date is "`` (drop; ``--volatile-mode``
tail, or off for no flag). Every turn answers with a call: on SmolLM2
(``--engine llamacpp``) ``tool_choice`` ``any`` (one call) makes
constrained decoding write it (the tools' strings are at most 32
characters, so a call ends within ``--max-tokens``); on ``--engine reference`` the scripted
reference engine calls ``Bash`` on every request (tests/helpers/cc_serve.py).

Baselines, in the same run:

* ``no-kv``: the same loop on a ``--no-kv-cache`` server (no disk cache;
  its live session is still reused);
* ``cold``: the ds4 loop's exact requests for the turns in ``--cold``, sent
  to the no-kv server after replacing its live session: a full prefill of
  the prompt (checked: nothing read from a cache). Turn 1 of each loop is
  cold too (a fresh server, an empty cache).

Reported: per turn, the prompt, the tokens prefilled (prompt - cache read)
and time to first token (the server's ``ds4.ttft_ms``) of each; then for
turns 2.. the median and max of prefilled / prompt, the median of ds4's
TTFT / no-kv's, ds4's TTFT against the cold ones, and the longest span of a
turn's prefill that an earlier turn prefilled too (by token position)::

    python benches/bench_agents_cc.py --engine llamacpp
    python benches/bench_agents_cc.py --engine reference
    python benches/bench_agents_cc.py --engine llamacpp --quick   # 6 turns
    python benches/bench_agents_cc.py --engine llamacpp --model gemma3 --quick --transient --transient-builtin
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import bench_agents
from helpers import cc_loop

VOLATILE = ["--prompt-volatile", cc_loop.DATE_RE]


class Server(bench_agents.Server):
    """bench_agents' server: the reference engine runs tests/helpers/cc_serve.py's
    script (a call on every request), llama.cpp gets ``--threads``."""

    def __init__(self, engine: str, extra: list[str], log_path: str, ctx: int, threads: int, model: str | None = None):
        if engine == "reference":
            cmd = cc_loop.serve_command()
        else:
            cmd = [sys.executable, "-m", "ds4", "serve", "--engine", engine, "--threads", str(threads)]
            if model is not None:
                cmd += ["--model", model]
        super().__init__(engine, extra, log_path, ctx, cmd)


def reply(row: dict) -> str:
    return json.dumps([{k: v for k, v in b.items() if k != "id"} for b in row["content"]])


def cold_run(srv: Server, rows: list[dict], turns: list[int]) -> dict[int, dict]:
    out = {}
    with cc_loop.client(srv.base) as c:
        for t in turns:
            srv.reset()
            out[t] = cc_loop.send(c, rows[t]["body"], t)
            # at most the BOS token in common with the reset prompt (Gemma adds one)
            if out[t]["cache_read"] > 1 or out[t]["prompt"] != rows[t]["prompt"]:
                raise RuntimeError(f"turn {t + 1}: the cold request was not a whole prefill: {out[t]}")
    return out


def pref(x: dict) -> int:
    return x["prompt"] - x["cache_read"]


def twice_prefilled(spans: list[tuple[int, int]]) -> list[int]:
    """For each turn from the second, the most tokens of its prefilled span
    ``(start, end)`` (cached tokens, prompt tokens) that one earlier turn
    prefilled too (by token position: each prompt extends the last one's
    history)."""
    return [
        max((max(0, min(b, bj) - max(a, aj)) for aj, bj in spans[:i]), default=0)
        for i, (a, b) in enumerate(spans)
        if i > 0
    ]


def report(res: dict, a: argparse.Namespace) -> list[str]:
    d, n, cold = res["ds4"], res["no-kv"], res["cold"]
    out = [
        f"{len(d)} turns, prompt {d[0]['prompt']} -> {d[-1]['prompt']} tokens; stop reasons: "
        + ", ".join(f"{s} {sum(x['stop_reason'] == s for x in d)}" for s in sorted({x["stop_reason"] for x in d})),
        f"{'turn':>4} {'prompt':>6} | {'ds4 pref':>8} {'share':>6} {'ttft ms':>9} | {'no-kv pref':>10} {'ttft ms':>9}"
        f" | {'ds4/no-kv':>9} | {'cold ms':>9} {'ds4/cold':>8}",
    ]
    for i, (x, y) in enumerate(zip(d, n, strict=True)):
        c = cold.get(i)
        tail = f" | {c['ds4']['ttft_ms']:9.1f} {x['ds4']['ttft_ms'] / c['ds4']['ttft_ms']:8.1%}" if c else ""
        out.append(
            f"{i + 1:4d} {x['prompt']:6d} | {pref(x):8d} {pref(x) / x['prompt']:6.1%} {x['ds4']['ttft_ms']:9.1f}"
            f" | {pref(y):10d} {y['ds4']['ttft_ms']:9.1f} | {x['ds4']['ttft_ms'] / y['ds4']['ttft_ms']:9.1%}{tail}"
        )
    later = range(1, len(d))
    for label, rows in (("ds4", d), ("no-kv", n)):
        shares = [pref(rows[i]) / rows[i]["prompt"] for i in later]
        vs_first = [rows[i]["ds4"]["ttft_ms"] / rows[0]["ds4"]["ttft_ms"] for i in later]
        out.append(
            f"{label:6} turns 2..: prefilled/prompt median {statistics.median(shares):.2%} max {max(shares):.2%};"
            f" ttft vs its cold turn 1 median {statistics.median(vs_first):.2%} max {max(vs_first):.2%};"
            f" loop {sum(x['wall_s'] for x in rows):.1f} s"
        )
    ratio = [d[i]["ds4"]["ttft_ms"] / n[i]["ds4"]["ttft_ms"] for i in later]
    out.append(f"ds4 ttft / no-kv ttft, turns 2..: median {statistics.median(ratio):.1%} max {max(ratio):.1%}")
    vs = [d[i]["ds4"]["ttft_ms"] / cold[i]["ds4"]["ttft_ms"] for i in sorted(cold) if i > 0]
    if vs:
        out.append(
            f"ds4 ttft / cold ttft of the same request, turns {[i + 1 for i in sorted(cold) if i > 0]}:"
            f" median {statistics.median(vs):.2%} max {max(vs):.2%}"
        )
    twice = twice_prefilled([(x["cache_read"], x["prompt"]) for x in d])
    out.append(f"ds4 longest span prefilled twice: {max(twice, default=0)} tokens (turns 2..: {twice})")
    same = [i + 1 for i in later if reply(d[i]) != reply(n[i])]
    same += [i + 1 for i in cold if reply(d[i]) != reply(cold[i])]
    out.append("replies: ds4 = no-kv = cold" if not same else f"replies DIFFER at turns {sorted(set(same))}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="llamacpp", choices=("llamacpp", "reference"))
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="6 turns")
    ap.add_argument("--form", default="separate", choices=cc_loop.FORMS, help="where the billing line is")
    ap.add_argument("--size", type=int, default=12000, help="system text bytes (~3,000 SmolLM2 tokens)")
    ap.add_argument("--max-tokens", type=int, help="default 64 (llamacpp), 300 (reference: a token a byte)")
    ap.add_argument("--ctx", type=int, help="default 8192 (llamacpp), 32768 (reference)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="a GGUF for --engine llamacpp (gemma3: the assembled Gemma 3 270M)")
    ap.add_argument("--cold", default="2,last", help="turns (1-based, 'last') replayed cold; '' for none")
    ap.add_argument("--no-reminder", action="store_true", help="tool results alone (live continuations)")
    ap.add_argument(
        "--transient",
        action="store_true",
        help="the reminder changes every turn and older ones are dropped from the history (Claude Code's way)",
    )
    ap.add_argument("--transient-builtin", action="store_true", help="both servers run with --prompt-transient-builtin")
    ap.add_argument(
        "--volatile-mode",
        default="drop",
        choices=("drop", "tail", "off"),
        help="--prompt-volatile-mode of both servers for the date line (off: no --prompt-volatile)",
    )
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    model = a.model
    if model == "gemma3":
        from helpers import models

        model = models.gemma_path()
    turns = 6 if a.quick else a.turns
    max_tokens = a.max_tokens or (64 if a.engine == "llamacpp" else 300)
    ctx = a.ctx or (8192 if a.engine == "llamacpp" else 32768)
    choice = {"type": "any", "disable_parallel_tool_use": True} if a.engine == "llamacpp" else None
    picks = sorted({turns - 1 if t == "last" else int(t) - 1 for t in a.cold.split(",") if t})
    tmp = tempfile.mkdtemp(prefix="ds4-bench-cc-")
    res: dict = {}
    volatile = [] if a.volatile_mode == "off" else [*VOLATILE, "--prompt-volatile-mode", a.volatile_mode]
    volatile += ["--prompt-transient-builtin"] if a.transient_builtin else []
    try:
        for label, extra in (("ds4", ["--kv-disk-dir", os.path.join(tmp, "kv")]), ("no-kv", ["--no-kv-cache"])):
            srv = Server(a.engine, [*extra, *volatile], os.path.join(tmp, f"{label}.log"), ctx, a.threads, model)
            try:

                def show(t: int, row: dict, label: str = label) -> None:
                    print(f"  {label} turn {t + 1}: prompt {row['prompt']} read {row['cache_read']}"
                          f" ttft {row['ds4']['ttft_ms']:.0f} ms {row['stop_reason']}", file=sys.stderr, flush=True)  # fmt: skip

                res[label] = cc_loop.loop(
                    srv.base, turns, a.form, size=a.size, reminder=not a.no_reminder, transient=a.transient,
                    max_tokens=max_tokens, tool_choice=choice, on_turn=show,
                )  # fmt: skip
                if label == "no-kv":
                    res["cold"] = cold_run(srv, res["ds4"], picks)
            finally:
                srv.stop()
        print("\n".join(report(res, a)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            strip = {k: [{c: v for c, v in x.items() if c != "body"} for x in (rows.values() if isinstance(rows, dict) else rows)] for k, rows in res.items()}  # fmt: skip
            json.dump(strip, f, indent=1)
    print(
        f"engine={a.engine} model={a.model or 'default'} turns={turns} form={a.form} size={a.size} max_tokens={max_tokens} ctx={ctx}"
        f" reminder={not a.no_reminder} transient={a.transient} builtin={a.transient_builtin}"
        f" volatile={a.volatile_mode} tool_choice={choice} threads={a.threads}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
