"""Server under load (issue #5, item 6): many concurrent clients on loopback
for a bounded time, a share of them sending malformed requests, while a
prober hits /health. Pass: zero 5xx, zero transport errors, /health answering
throughout, every well-formed answer equal to the same request's answer on a
cold server (the reference engine is bit-exact), and every checkpoint left in
the cache directory verifying.

    python scripts/server_load.py --seconds 120 --clients 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

import ds4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, kv_dir=None):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ds4",
        "serve",
        "--engine",
        "reference",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ctx",
        "4096",
        "--default-max-tokens",
        "8",
        "--max-queue",
        "1000",
    ]
    cmd += (
        [
            "--kv-disk-dir",
            kv_dir,
            "--kv-cache-min-tokens",
            "32",
            "--kv-cache-boundary-align-tokens",
            "64",
            "--kv-cache-continued-interval-tokens",
            "256",
            "--kv-disk-space-mb",
            "64",
        ]
        if kv_dir
        else ["--no-kv-cache"]
    )
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return p, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit("server did not start")


CONVERSATIONS = [
    [
        {"role": "system", "content": f"You are assistant number {k}. " * 4},
        {"role": "user", "content": f"Tell me about subject {k}, please. " * (3 + k)},
    ]
    for k in range(6)
]

MALFORMED = [
    (b"{not json", "application/json"),
    (json.dumps({"model": "ds4-reference", "messages": "nope"}).encode(), "application/json"),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), "application/json"),
    (
        json.dumps({"model": "ds4-reference", "messages": [{"role": "user", "content": "x" * 50000}]}).encode(),
        "application/json",
    ),
    (
        json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        "application/json",
    ),
    (
        json.dumps(
            {"model": "ds4-reference", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}
        ).encode(),
        "application/json",
    ),
    (b"\xff\xfe\x00garbage", "application/octet-stream"),
]


def expected_answers(a) -> dict:
    """Each conversation's answer from a cold server without a cache."""
    cold, cbase = start(a)
    expected = {}
    try:
        for k, msgs in enumerate(CONVERSATIONS):
            r = httpx.post(
                cbase + "/v1/chat/completions",
                json={"model": "ds4-reference", "messages": msgs, "max_tokens": 8},
                timeout=120,
            )
            expected[k] = r.json()["choices"][0]["message"]["content"]
    finally:
        cold.send_signal(signal.SIGTERM)
        cold.wait(30)
    return expected


class Load:
    """Clients sending good and malformed requests, and a health prober,
    until ``stop``; counts what they see."""

    def __init__(self, a, base: str, expected: dict):
        self.a, self.base, self.expected = a, base, expected
        self.stats = {
            "ok": 0,
            "4xx": 0,
            "5xx": 0,
            "transport_errors": 0,
            "wrong_answers": 0,
            "health_ok": 0,
            "health_fail": 0,
            "cached_tokens": 0,
        }
        self.lock = threading.Lock()
        self.stop = time.monotonic() + a.seconds

    def bump(self, k, n=1):
        with self.lock:
            self.stats[k] += n

    def request(self, c, rnd):
        if rnd.random() < self.a.bad_share:
            body, ctype = rnd.choice(MALFORMED)
            return c.post(self.base + "/v1/chat/completions", content=body, headers={"content-type": ctype})
        k = rnd.randrange(len(CONVERSATIONS))
        r = c.post(
            self.base + "/v1/chat/completions",
            json={"model": "ds4-reference", "messages": CONVERSATIONS[k], "max_tokens": 8},
        )
        if r.status_code == 200:
            j = r.json()
            if j["choices"][0]["message"]["content"] != self.expected[k]:
                self.bump("wrong_answers")
            self.bump("cached_tokens", j["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
        return r

    def client(self, i):
        rnd = random.Random(i)
        with httpx.Client(timeout=300) as c:
            while time.monotonic() < self.stop:
                try:
                    r = self.request(c, rnd)
                except httpx.HTTPError:
                    self.bump("transport_errors")
                    continue
                self.bump("5xx" if r.status_code >= 500 else "4xx" if r.status_code >= 400 else "ok")

    def prober(self):
        with httpx.Client(timeout=5) as c:
            while time.monotonic() < self.stop:
                try:
                    self.bump("health_ok" if c.get(self.base + "/health").status_code == 200 else "health_fail")
                except httpx.HTTPError:
                    self.bump("health_fail")
                time.sleep(0.25)

    def run(self):
        threads = [threading.Thread(target=self.client, args=(i,)) for i in range(self.a.clients)]
        threads.append(threading.Thread(target=self.prober))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.stats["seconds"] = round(time.monotonic() - t0, 1)


def check_dir(kv: str, stats: dict) -> None:
    """Every checkpoint left verifies; no temp file is left."""
    files = [f for f in os.listdir(kv) if f.endswith(".kv")]
    bad = []
    for f in files:
        try:
            ds4.open_checkpoint(os.path.join(kv, f))
        except ds4.errors.CheckpointError as e:
            bad.append(f"{f}: {e.code}")
    stats["checkpoints"] = len(files)
    stats["checkpoints_failing"] = bad
    stats["temp_files"] = [f for f in os.listdir(kv) if ".tmp." in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--bad-share", type=float, default=0.25)
    a = ap.parse_args()

    expected = expected_answers(a)
    kv = tempfile.mkdtemp(prefix="ds4-load-")
    srv, base = start(a, kv)
    load = Load(a, base, expected)
    load.run()
    srv.send_signal(signal.SIGTERM)
    srv.wait(60)
    stats = load.stats
    check_dir(kv, stats)
    stats["clients"] = a.clients
    print(json.dumps(stats, indent=2))
    ok = (
        stats["5xx"] == 0
        and stats["transport_errors"] == 0
        and stats["wrong_answers"] == 0
        and not stats["checkpoints_failing"]
        and stats["health_fail"] == 0
        and stats["ok"] > 0
        and not stats["temp_files"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
