#!/usr/bin/env python3
"""The first request after a start against the second: both resumed from disk.

A ``ds4 serve`` (llama.cpp, one live session) prefills two conversations
of about ``--tokens`` tokens each and is stopped (their checkpoints on disk).
Then, ``--repeats`` times: the server is started again and, as soon as its
port accepts a connection (no ``/health`` before: the first request is the
first thing it serves), the next turn of one conversation is sent, then the
next turn of the other (which conversation goes first alternates). Both are
disk resumes of the same length. Printed: the medians of the client's time
to the first streamed token and the server's ``ttft_ms`` for the first and
the second request, and their ratios (goal: first <= 1.1 x second)::

    python benches/bench_restart.py [--model smollm2|gemma3|PATH] [--tokens 1500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_server import Server, system_prompt
from helpers import models


def serve(model: str, kv: str, log_path: str, ctx: int) -> Server:
    """``ds4 serve`` (llama.cpp, one live session) on ``kv``, taken as soon
    as its port accepts a connection: nothing asked of it before."""
    return Server("llamacpp", ["--model", model, "--kv-disk-dir", kv], log_path, ctx, ready="port")


def turn(srv: Server, messages: list[dict], max_tokens: int = 8) -> tuple[float, float, str, str | None]:
    """(client TTFT s, server ttft_ms, reply, rung) of a streamed chat."""
    t0 = time.perf_counter()
    stream = srv.client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, parts, info = None, [], {}
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
        info = (ch.model_extra or {}).get("ds4") or info
    return ttft or float("nan"), float(info.get("ttft_ms", "nan")), "".join(parts), info.get("rung")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3 (tests/helpers/models.py) or a GGUF's path")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    model = a.model if os.path.isfile(a.model) else models.model_path(a.model)
    tmp = tempfile.mkdtemp(prefix="ds4-restart-")
    kv = os.path.join(tmp, "kv")
    sysp = system_prompt(a.tokens * 4)
    convs = [
        [{"role": "system", "content": f"Desk {c}. {sysp}"}, {"role": "user", "content": f"Berth {c}: tide?"}]
        for c in range(2)
    ]
    try:
        srv = serve(model, kv, os.path.join(tmp, "cold.log"), ctx=a.tokens + 1024)
        for c in convs:
            _, _, reply, _ = turn(srv, c)
            c += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]
        srv.stop()
        rows = {"first": ([], []), "second": ([], [])}
        for r in range(a.repeats):
            srv = serve(model, kv, os.path.join(tmp, f"restart-{r}.log"), ctx=a.tokens + 1024)
            try:
                for slot, c in zip(("first", "second"), (convs[r % 2], convs[1 - r % 2]), strict=True):
                    client_s, server_ms, _, rung = turn(srv, c)
                    if rung != "disk":
                        raise SystemExit(f"the {slot} request was served by {rung!r}, not from disk")
                    rows[slot][0].append(client_s * 1000)
                    rows[slot][1].append(server_ms)
            finally:
                srv.stop()
        med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in rows.items()}
        print(f"model {os.path.basename(model)}, about {a.tokens} tokens a conversation, {a.repeats} restarts")
        for k, (c, s) in med.items():
            print(
                f"  {k:6s} request: client TTFT {c:8.1f} ms   server ttft_ms {s:8.1f}   (all client: {[round(x) for x in rows[k][0]]})"
            )
        print(
            f"  first / second: client {med['first'][0] / med['second'][0]:.2f}x, server {med['first'][1] / med['second'][1]:.2f}x"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
