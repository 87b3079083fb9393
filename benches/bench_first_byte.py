#!/usr/bin/env python3
"""First SSE byte of a streamed request on each protocol, idle and under load.

One ``ds4 serve`` (the reference engine) on 127.0.0.1. A streamed request
with a short prompt is sent on ``/v1/chat/completions``, ``/v1/messages``
and ``/v1/responses`` in turn (the order rotated each round) and the time
from sending it to the first byte of its body is taken. Under load,
``--load`` client threads keep the worker busy with long non-streamed
prompts (each its own, so each is a full prefill), so a measured request
waits behind them: its headers and first event should still go out at
once. Each protocol's median is printed with its ratio to Messages' median
in the same run::

    python benches/bench_first_byte.py [--rounds 8] [--load 2] [--load-chars 3000] [--chat-format]

``--chat-format``: the chat requests carry a ``response_format`` JSON
schema (its compile is part of what a chat request's first byte waits for).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_server import Server

PROTOCOLS = {
    "chat": ("/v1/chat/completions", lambda m: {"model": "m", "max_tokens": 4, "messages": m}),
    "messages": ("/v1/messages", lambda m: {"model": "m", "max_tokens": 4, "messages": m}),
    "responses": ("/v1/responses", lambda m: {"model": "m", "max_output_tokens": 4, "input": m}),
}


FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "greeting",
        "schema": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
            "required": ["text", "n"],
        },
    },
}


def first_byte(base: str, proto: str, text: str, fmt: bool = False) -> float:
    path, build = PROTOCOLS[proto]
    body = {**build([{"role": "user", "content": text}]), "stream": True}
    if fmt and proto == "chat":
        body["response_format"] = FORMAT
    t0 = time.perf_counter()
    with httpx.stream("POST", base + path, json=body, timeout=600) as r:
        r.raise_for_status()
        dt = None
        for chunk in r.iter_raw():  # read to the end: the next one starts with the worker as the load left it
            if chunk and dt is None:
                dt = time.perf_counter() - t0
    assert dt is not None
    return dt


def load_loop(base: str, chars: int, stop: threading.Event, k: int) -> None:
    for i in itertools.count():
        if stop.is_set():
            return
        words = " ".join(f"w{k}x{i}y{j % 97}" for j in range(chars // 8))[:chars]
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": words}]}
        try:
            httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
        except httpx.HTTPError:
            return


def measure(srv: Server, rounds: int, tag: str, fmt: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
    names = list(PROTOCOLS)
    for r in range(rounds):
        order = names[r % 3 :] + names[: r % 3]
        for p in order:
            out[p].append(first_byte(srv.base, p, f"{tag} round {r} on {p}: say hello", fmt))
    return out


def report(label: str, res: dict[str, list[float]]) -> None:
    ref = statistics.median(res["messages"])
    print(f"\n{label}")
    print(f"{'protocol':10} {'median':>9} {'max':>9} {'/messages':>10}")
    for p, xs in res.items():
        m = statistics.median(xs)
        print(f"{p:10} {m * 1000:7.0f}ms {max(xs) * 1000:7.0f}ms {m / ref:9.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--load", type=int, default=2, help="client threads sending long prompts meanwhile")
    ap.add_argument("--load-chars", type=int, default=3000, help="each load prompt's length (bytes = tokens)")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--chat-format", action="store_true", help="chat requests carry a response_format schema")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ds4-bench-first-byte-")
    srv = Server("reference", ["--kv-disk-dir", os.path.join(tmp, "kv")], os.path.join(tmp, "server.log"), args.ctx)
    try:
        for p in PROTOCOLS:  # warm-up: imports, first allocations
            first_byte(srv.base, p, f"warm-up {p}", args.chat_format)
        idle = measure(srv, args.rounds, "idle", args.chat_format)
        stop = threading.Event()
        threads = [
            threading.Thread(target=load_loop, args=(srv.base, args.load_chars, stop, k), daemon=True)
            for k in range(args.load)
        ]
        for t in threads:
            t.start()
        while not httpx.get(srv.base + "/health").json()["busy"]:
            time.sleep(0.01)
        try:
            loaded = measure(srv, args.rounds, "load", args.chat_format)
        finally:
            stop.set()
            for t in threads:
                t.join()
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.chat_format:
        print("\nchat requests with a response_format schema")
    report(f"idle: {args.rounds} rounds", idle)
    report(f"under load: {args.load} clients of {args.load_chars}-token prompts, {args.rounds} rounds", loaded)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
