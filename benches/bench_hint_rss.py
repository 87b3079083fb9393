#!/usr/bin/env python3
"""What a flood of distinct routing hints costs a server's memory: ``ds4
serve --engine reference --sessions 2 --no-kv-cache --max-body-mb 16``
sent N chat requests, each with a distinct 8 MiB ``prompt_cache_key``
(over the hint bound: ignored), against the same N bodies with the 8 MiB
in a field the server ignores, and against N requests with distinct short
hints (each kept, a 16-byte digest); each arm a fresh server process::

    python benches/bench_hint_rss.py --requests 120
    python benches/bench_hint_rss.py --requests 1000 --arms hint

Reported: the server's VmRSS after its first (warm-up) request and after
the N, and the growth; the hint table's own accounting (the operator's
``/health``, ``hints``). An arm's growth against
the ignored-field arm is what the hints cost beyond reading the bodies."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

BIG = 8 << 20


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _body(i: int, arm: str) -> dict:
    b: dict = {"model": "m", "messages": [{"role": "user", "content": f"hello {i % 7}"}], "max_tokens": 1}
    if arm == "hint":
        b["prompt_cache_key"] = f"{i:08d}" + "k" * (BIG - 8)
    elif arm == "ignored":
        b["ignored_field"] = f"{i:08d}" + "k" * (BIG - 8)
    elif arm == "short":
        b["prompt_cache_key"] = f"conversation-{i:08d}"
    return b


def run_arm(arm: str, n: int, env: dict[str, str]) -> dict:
    port = _port()
    cmd = [sys.executable, "-m", "ds4", "serve", "--engine", "reference", "--port", str(port)]
    cmd += ["--sessions", "2", "--no-kv-cache", "--max-body-mb", "16", "--ctx", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with httpx.Client(timeout=120) as c:
            c.post(base + "/v1/chat/completions", content=json.dumps(_body(0, arm)).encode())
            before = _rss_kib(proc.pid)
            for i in range(1, n + 1):
                r = c.post(
                    base + "/v1/chat/completions",
                    content=json.dumps(_body(i, arm)).encode(),
                    headers={"content-type": "application/json"},
                )
                assert r.status_code == 200, r.text[:300]
            time.sleep(0.5)
            after = _rss_kib(proc.pid)
            health = c.get(base + "/health").json()
    finally:
        proc.terminate()
        proc.wait(60)
    return {
        "arm": arm,
        "requests": n,
        "rss_before_mib": round(before / 1024, 1),
        "rss_after_mib": round(after / 1024, 1),
        "growth_mib": round((after - before) / 1024, 1),
        "hints": health.get("hints"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--arms", nargs="+", default=["ignored", "hint", "short"], choices=["ignored", "hint", "short"])
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="more environment for the server")
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    rows = [run_arm(a, args.requests, env) for a in args.arms]
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
