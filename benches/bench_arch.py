"""Per architecture (issue 34's benchmark): what a resumed turn costs
against a cold one, on the models tests/helpers/models.py names.

For each model and prompt length N (a chat: a long first user turn, a
reply, a second user turn), measured in the same run, medians of R:

* **cold**: a fresh session prefills the second turn's prompt;
* **disk**: a fresh session resumes the same prompt from the checkpoint of
  the first turn's prompt + reply (the ladder, token check included);
* **edit**: a live session that served the second turn gets the second
  user turn edited: a rewind where the memory can, else the RAM snapshot
  of the first turn's prompt (``ds4.snapshots``);
* **snapshot bytes**: what one turn-boundary snapshot of the session holds.

TTFT here is the ladder's ``total_ms`` (tokenization, lookup, load,
prefill: the first token follows from the logits). Cold and disk run with
the engine's span tokenizations forgotten (``SpanTokens.clear``: a fresh
process's), the edit with those of the turns before it (a live session's).

    python benches/bench_arch.py [--models mamba2 lfm2 granitehybrid qwen3 phi3] [--tokens 2000 8000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ds4
from ds4.keytext import span_tokens


def chat(eng, n: int, second: str) -> tuple[str, str]:
    """The first turn's prompt (about ``n`` tokens) and the second's."""
    first = "The quick brown fox jumps over the lazy dog near the river bank. " * max(1, n // 13)
    p1 = eng.render_chat([{"role": "user", "content": first}])
    p2 = eng.render_chat(
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": "The fox ran away."},
            {"role": "user", "content": second},
        ]
    )
    return p1, p2


def one(eng, n: int, repeats: int) -> dict[str, float]:
    p1, p2 = chat(eng, n, "What did the heron do?")
    _, edited = chat(eng, n, "What did the otters do instead?")
    ctx = n + 1024
    cold, disk, edit, rungs = [], [], [], set()
    snap_bytes = 0
    with tempfile.TemporaryDirectory() as d:
        st = ds4.KVStore(d, budget_mb=1 << 16, min_tokens=16)
        s = ds4.Session(eng, ctx=ctx)
        ds4.recover(s, st, p1)
        st.store_live_prefix(s, "continued")
        spans = span_tokens(eng)
        for _ in range(repeats):
            if spans is not None:
                spans.clear()
            c = ds4.Session(eng, ctx=ctx)
            c.snapshots.configure(0, 0, 0)
            cold.append(ds4.recover(c, None, p2).timings["total_ms"])
            del c
            if spans is not None:
                spans.clear()
            r = ds4.Session(eng, ctx=ctx)
            rep = ds4.recover(r, st, p2, evict_save=False, prompt_save=False)
            assert rep.rung == "disk", rep.events
            disk.append(rep.timings["total_ms"])
            del r
            live = ds4.Session(eng, ctx=ctx)
            ds4.recover(live, None, p1)
            ds4.recover(live, None, p2)
            snap_bytes = live.snapshots.nbytes // max(1, len(live.snapshots))
            rep = ds4.recover(live, None, edited)
            rungs.add(f"{rep.rung}/{rep.source}")
            edit.append(rep.timings["total_ms"])
            del live
    return {
        "cold": statistics.median(cold),
        "disk": statistics.median(disk),
        "edit": statistics.median(edit),
        "snap": snap_bytes,
        "rungs": ",".join(sorted(rungs)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mamba2", "lfm2", "granitehybrid", "qwen3", "phi3"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from helpers.models import engine

    print(
        "| model | prompt | cold ms | disk ms | disk / cold | edit ms | edit / cold | edit served by | snapshot bytes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name in args.models:
        eng = engine(name)
        for n in args.tokens:
            r = one(eng, n, args.repeats)
            print(
                f"| {name} ({eng.facts()['batch']}) | ~{n:,} | {r['cold']:.1f} | {r['disk']:.1f} | "
                f"{r['disk'] / r['cold']:.3f} | {r['edit']:.1f} | {r['edit'] / r['cold']:.3f} | {r['rungs']} | "
                f"{int(r['snap']):,} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
