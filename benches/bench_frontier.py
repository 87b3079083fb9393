"""What the frontier guard saves (``--kv-frontier-tokens``): two agents
interleaved on one live session (``--sessions 1``), each sending its
replies back elided (as an agent that drops a reply's reasoning does), so
a turn's whole checkpoint (prompt + reply) is never a prefix of the next
prompt. SmolLM2 through llama.cpp, in process (``ds4.turn.TurnDriver`` on
one ``KVStore``), the same conversations with the guard at 512 and off
(0), in the same run.

Reported per arm: tokens prefilled over all turns after each agent's
first, the longest span a turn prefilled that an earlier turn of the same
agent prefilled too (by token position), the frontier saves and the bytes
the store wrote, and the summed time to the first token::

    python benches/bench_frontier.py [--turns 4] [--lines 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agents_cc import twice_prefilled

import ds4
from ds4.turn import GenParams, TurnDriver

CTX = 8192


def system(k: int) -> str:
    return f"You are agent {k}. Answer in one short sentence and never use lists. " * 20


def task(k: int, turn: int, lines: int) -> str:
    return f"Task {turn} of agent {k}: read the log lines below and say which failed.\n" + "".join(
        f"line {turn}.{i}: job {k * 100 + i} finished with status {'ok' if i % 7 else 'failed'}\n" for i in range(lines)
    )


def run(eng, limit: int, turns: int, lines: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        store = ds4.KVStore(d, min_tokens=64, frontier_tokens=limit)
        gen = TurnDriver(eng, CTX, store)
        msgs = {k: [{"role": "system", "content": system(k)}] for k in (0, 1)}
        spans: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        later, ttft, saves = 0, 0.0, 0
        for t in range(1, turns + 1):
            for k in (0, 1):
                msgs[k].append({"role": "user", "content": task(k, t, lines)})
                res = gen.generate(eng.render_chat(msgs[k]), GenParams(max_tokens=16))
                rep = res.report
                ttft += res.ttft_s if t > 1 else 0.0
                spans[k].append((rep.reused_tokens, rep.prompt_tokens))
                later += (rep.prompt_tokens - rep.reused_tokens) if t > 1 else 0
                saves += rep.frontier_saved is not None
                msgs[k].append({"role": "assistant", "content": f"(reply {t} elided)"})
        twice = max((n for sp in spans.values() for n in twice_prefilled(sp)), default=0)
        written = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".kv"))
        return {"later": later, "twice": twice, "saves": saves, "bytes": written, "ttft": ttft}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--lines", type=int, default=32, help="log lines per task (32: about 550 tokens)")
    a = ap.parse_args()
    eng = ds4.LlamaCppEngine()
    rows = {limit: run(eng, limit, a.turns, a.lines) for limit in (512, 0)}
    print(
        "| --kv-frontier-tokens | prefilled, turns 2.. | longest span prefilled twice | frontier saves | bytes on disk at the end | TTFT summed, turns 2.. |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for limit, r in rows.items():
        print(
            f"| {limit} | {r['later']:,} | {r['twice']:,} | {r['saves']} | {r['bytes'] / 2**20:.1f} MiB | {r['ttft']:.2f} s |"
        )
    on, off = rows[512], rows[0]
    print(f"prefilled on/off: {on['later'] / off['later']:.3f}; TTFT on/off: {on['ttft'] / off['ttft']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
