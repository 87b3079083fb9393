#!/usr/bin/env python3
"""An agent loop on each protocol: prefilled tokens and time with ds4 vs
the same server without reuse.

Workload: a ~2,000-token (SmolLM2; 11,500 bytes for the byte-level
reference model) system prompt with eight tool schemas, then ``--turns``
requests of an agent client: each carries the whole history, echoes the
model's answers, sends a result for each tool call and a new question after
each plain answer. One loop per protocol: ``/v1/chat/completions`` (tools),
``/v1/messages`` and ``/v1/responses`` (full replay of the input items).
Three servers on the same engine, one after the other, in this one run:

* ``ds4``: ``--kv-disk-dir`` (the live session, canonical tool checkpoints,
  the disk rung);
* ``no-kv``: ``--no-kv-cache`` (the live session is still reused);
* ``cold``: ``--no-kv-cache`` and the live session replaced before every
  turn: a server with no prompt cache at all (every turn a full prefill).

Per protocol and server: prefilled tokens (prompt - cached) over the loop,
the cached share of each turn after the first, the total time and the
server-side time to first token (``ds4.ttft_ms``) of turns 2.. as a ratio of
the cold server's. Answers are checked equal across the three servers
(greedy decoding).

``--engine scripted`` is the reference model whose replies follow the
agent tests' script (tests/scripted_engine.py: it calls the first tool after
a question and answers after a result; its KV state is computed as usual):
SmolLM2-135M never calls a tool, the script does, so the loop is a real
call -> result -> answer loop::

    python benches/bench_agents.py --engine scripted --ctx 32768 --max-tokens 200 [--turns 10]
    python benches/bench_agents.py --engine llamacpp [--turns 10] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import json
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

TOOL_NAMES = ["read_file", "write_file", "list_dir", "grep", "run_tests", "git_diff", "git_log", "http_get"]


def tools() -> list[dict]:
    out = []
    for i, name in enumerate(TOOL_NAMES):
        props = {f"arg{j}": {"type": "string", "description": f"The {j}th argument of {name}; " * 3} for j in range(4)}
        desc = f"{name}: a tool of the coding agent (number {i}). " * 6
        out.append({"name": name, "description": desc, "parameters": {"type": "object", "properties": props}})
    return out


SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {i}: read before you write, run the tests after each change, keep diffs small." for i in range(40)
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine: str, extra: list[str], log_path: str, ctx: int):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        if engine == "scripted":  # the reference model following the tests' script (it calls tools)
            here = os.path.dirname(os.path.abspath(__file__))
            cmd = [sys.executable, os.path.join(here, "..", "tests", "scripted_serve.py"), "--engine", "reference"]
        else:
            cmd = [sys.executable, "-m", "ds4", "serve", "--engine", engine]
        args = [*cmd, "--port", str(self.port), "--ctx", str(ctx)]
        self.proc = subprocess.Popen([*args, *extra], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.base + path, json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text}")
        return r.json()

    def reset(self) -> None:
        self.post("/v1/completions", {"model": "m", "prompt": "reset", "max_tokens": 1})

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.log.close()


# -- one agent loop, as each protocol carries it ---------------------------------
def result(turn: int, args: str) -> str:
    return f"(output of step {turn} for {args}) " + " ".join(f"line {k}: ok" for k in range(12))


class Chat:
    """The client of /v1/chat/completions: it echoes each answer, sends a
    result for each call, and a new question after each plain answer."""

    path = "/v1/chat/completions"

    def __init__(self, max_tokens: int):
        self.msgs: list[dict] = [{"role": "system", "content": SYSTEM}, self.question(0)]
        self.max_tokens = max_tokens
        self.calls: list[tuple[str, str]] = []  # (id, arguments) of the last answer

    @staticmethod
    def question(turn: int) -> dict:
        return {"role": "user", "content": f"Step {turn}: look at module {turn} and tell me what it does."}

    def body(self) -> dict:
        t = [{"type": "function", "function": f} for f in tools()]
        return {"model": "m", "messages": self.msgs, "tools": t, "max_tokens": self.max_tokens}

    def answer(self, r: dict) -> str:
        m = r["choices"][0]["message"]
        calls = m.get("tool_calls") or []
        self.msgs.append(
            {"role": "assistant", "content": m["content"] or "", **({"tool_calls": calls} if calls else {})}
        )
        self.calls = [(c["id"], c["function"]["arguments"]) for c in calls]
        return json.dumps([m["content"], [c["function"] for c in calls]])

    def next(self, turn: int) -> None:
        if self.calls:
            self.msgs += [{"role": "tool", "tool_call_id": i, "content": result(turn, a)} for i, a in self.calls]
        else:
            self.msgs.append(self.question(turn))

    @staticmethod
    def usage(r: dict) -> tuple[int, int]:
        u = r["usage"]
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


class Messages(Chat):
    path = "/v1/messages"

    def __init__(self, max_tokens: int):
        self.msgs = [self.question(0)]
        self.max_tokens = max_tokens
        self.calls = []

    def body(self) -> dict:
        t = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in tools()]
        return {"model": "m", "system": SYSTEM, "messages": self.msgs, "tools": t, "max_tokens": self.max_tokens}

    def answer(self, r: dict) -> str:
        self.msgs.append({"role": "assistant", "content": r["content"]})
        self.calls = [(b["id"], json.dumps(b["input"])) for b in r["content"] if b["type"] == "tool_use"]
        return json.dumps([{k: v for k, v in b.items() if k != "id"} for b in r["content"]])

    def next(self, turn: int) -> None:
        if self.calls:
            res = [{"type": "tool_result", "tool_use_id": i, "content": result(turn, a)} for i, a in self.calls]
            self.msgs.append({"role": "user", "content": res})
        else:
            self.msgs.append(self.question(turn))

    @staticmethod
    def usage(r: dict) -> tuple[int, int]:
        u = r["usage"]
        read = u["cache_read_input_tokens"]
        return u["input_tokens"] + read + u["cache_creation_input_tokens"], read


class Responses(Chat):
    """Full replay of the input items (no previous_response_id)."""

    path = "/v1/responses"

    def __init__(self, max_tokens: int):
        self.msgs = [self.question(0)]
        self.max_tokens = max_tokens
        self.calls = []

    def body(self) -> dict:
        t = [{"type": "function", **f} for f in tools()]
        return {"model": "m", "instructions": SYSTEM, "input": self.msgs, "tools": t, "max_output_tokens": self.max_tokens}  # fmt: skip

    def answer(self, r: dict) -> str:
        self.calls = []
        out = []
        for o in r["output"]:
            if o["type"] == "message":
                self.msgs.append({"role": "assistant", "content": o["content"][0]["text"]})
                out.append(o["content"][0]["text"])
            else:
                self.msgs.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
                self.calls.append((o["call_id"], o["arguments"]))
                out.append([o["name"], o["arguments"]])
        return json.dumps(out)

    def next(self, turn: int) -> None:
        if self.calls:
            self.msgs += [
                {"type": "function_call_output", "call_id": i, "output": result(turn, a)} for i, a in self.calls
            ]
        else:
            self.msgs.append(self.question(turn))

    @staticmethod
    def usage(r: dict) -> tuple[int, int]:
        u = r["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def loop(srv: Server, proto: type[Chat], turns: int, max_tokens: int, cold: bool) -> dict:
    c = proto(max_tokens)
    rows, answers = [], []
    t0 = time.perf_counter()
    for turn in range(turns):
        if turn:
            c.next(turn)
        if cold:
            srv.reset()
        t = time.perf_counter()
        r = srv.post(c.path, c.body())
        wall = time.perf_counter() - t
        prompt, cached = c.usage(r)
        answers.append(c.answer(r))
        rows.append({"prompt": prompt, "cached": cached, "ttft_ms": r["ds4"]["ttft_ms"], "wall_s": wall})
    total = time.perf_counter() - t0 if not cold else sum(x["wall_s"] for x in rows)
    return {"rows": rows, "answers": answers, "total_s": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="llamacpp")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--protocols", default="chat,messages,responses")
    a = ap.parse_args()
    protos = {"chat": Chat, "messages": Messages, "responses": Responses}
    tmp = tempfile.mkdtemp(prefix="ds4-bench-agents-")
    results: dict[str, dict[str, dict]] = {}
    try:
        for label, extra, cold in (
            ("ds4", ["--kv-disk-dir", os.path.join(tmp, "kv")], False),
            ("no-kv", ["--no-kv-cache"], False),
            ("cold", ["--no-kv-cache"], True),
        ):
            srv = Server(a.engine, extra, os.path.join(tmp, f"{label}.log"), a.ctx)
            try:
                for name in a.protocols.split(","):
                    results.setdefault(name, {})[label] = loop(srv, protos[name], a.turns, a.max_tokens, cold)
                    srv.reset()
            finally:
                srv.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"engine={a.engine} turns={a.turns} max_tokens={a.max_tokens}")
    print("protocol   server  prompt(t1) prefilled  vs-cold  cached-share(t2..) min/mean  ttft(t2..)/cold  total_s")
    for name, by in results.items():
        cold_pref = sum(x["prompt"] - x["cached"] for x in by["cold"]["rows"])
        cold_ttft = statistics.mean(x["ttft_ms"] for x in by["cold"]["rows"][1:])
        for label, res in by.items():
            rows = res["rows"]
            pref = sum(x["prompt"] - x["cached"] for x in rows)
            shares = [x["cached"] / x["prompt"] for x in rows[1:]]
            ttft = statistics.mean(x["ttft_ms"] for x in rows[1:])
            same = "same" if res["answers"] == by["cold"]["answers"] else "DIFFERENT answers"
            print(
                f"{name:10} {label:7} {rows[0]['prompt']:10d} {pref:9d} {pref / cold_pref:7.1%} "
                f"{min(shares):18.1%} / {statistics.mean(shares):.1%} {ttft / cold_ttft:15.1%} {res['total_s']:8.1f}  {same}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
