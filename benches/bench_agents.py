#!/usr/bin/env python3
"""An agent loop on each protocol: prefilled tokens and time to first
token with ds4 vs the same server without any prompt reuse.

Workload: a system prompt with eight tool schemas (3,402 SmolLM2 tokens
once rendered; 11,237 tokens for the byte-level reference model), then ``--turns``
agent turns: a question, the model's tool call, the tool's result, the
model's answer. Every request carries the whole history and echoes the
model's earlier replies, as agent clients do. One loop per protocol, each on
a fresh server with an empty cache directory (so every loop pays its own
first prefill): ``/v1/chat/completions`` with tools, ``/v1/messages``, and
``/v1/responses`` replaying its input items.

SmolLM2-135M never calls a tool on its own, so by default the question's
request forces one (``tool_choice`` ``required`` / Anthropic ``any``: the
call is constrained decoding's work) and the result's request leaves the
choice to the model, which answers. ``--engine scripted`` is the reference
model following the agent tests' script (tests/helpers/scripted_engine.py: a call
after a question, an answer after a result; nothing forced).

Baselines, in the same run:

* ``cold``: a ``--no-kv-cache`` server whose live session is replaced before
  each request, sent exactly the ds4 loop's request bodies (every request,
  or every ``--cold-every``-th and the last): no prompt cache at all. Each is
  checked to prefill the whole prompt; the prefilled tokens of a server
  without reuse are the sum of the loop's prompts. Its replies are compared
  with ds4's.
* ``no-kv`` (``--no-kv``): the loop on a ``--no-kv-cache`` server (no disk
  cache; the live session still reused).

Reported per protocol: prefilled tokens (prompt - cached) as a share of
no reuse's, the cached share of each request after the first, and the
server's own time to first token (``ds4.ttft_ms``) of each request after
the first as a ratio of the cold server's for the same request::

    python benches/bench_agents.py --engine llamacpp --turns 10 --cold-every 4
    python benches/bench_agents.py --engine scripted --ctx 32768 --max-tokens 200 --no-kv
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers.ports import free_port

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


class Server:
    """A ``ds4 serve`` on a free port, ready when ``/health`` answers;
    ``cmd`` (without ``--port``/``--ctx``) overrides the engine's command."""

    def __init__(self, engine: str, extra: list[str], log_path: str, ctx: int, cmd: list[str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        if cmd is None and engine == "scripted":  # the reference model following the tests' script (it calls tools)
            here = os.path.dirname(os.path.abspath(__file__))
            cmd = [
                sys.executable,
                os.path.join(here, "..", "tests", "helpers", "scripted_serve.py"),
                "--engine",
                "reference",
            ]
        elif cmd is None:
            cmd = [sys.executable, "-m", "ds4", "serve", "--engine", engine]
        args = [*cmd, "--port", str(self.port), "--ctx", str(ctx), "--sessions", "1"]  # one session, as measured
        self.proc = subprocess.Popen([*args, *extra], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"server did not start (log: {log_path})")

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.base + path, json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text}")
        return r.json()

    def timed(self, path: str, body: dict) -> tuple[dict, dict]:
        t = time.perf_counter()
        r = self.post(path, body)
        return r, {"ttft_ms": r["ds4"]["ttft_ms"], "wall_s": time.perf_counter() - t}

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
    """The client of /v1/chat/completions: it echoes each answer and sends
    a result for each call."""

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

    def results(self, turn: int) -> None:
        self.msgs += [{"role": "tool", "tool_call_id": i, "content": result(turn, a)} for i, a in self.calls]

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

    def results(self, turn: int) -> None:
        res = [{"type": "tool_result", "tool_use_id": i, "content": result(turn, a)} for i, a in self.calls]
        self.msgs.append({"role": "user", "content": res})

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

    def results(self, turn: int) -> None:
        self.msgs += [{"type": "function_call_output", "call_id": i, "output": result(turn, a)} for i, a in self.calls]

    @staticmethod
    def usage(r: dict) -> tuple[int, int]:
        u = r["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


PROTOCOLS: dict[str, type[Chat]] = {"chat": Chat, "messages": Messages, "responses": Responses}
MAX_STEPS = 4  # requests in one turn before the loop gives up on the model's calls
FORCE = {"chat": "required", "messages": {"type": "any"}, "responses": "required"}


def loop(srv: Server, name: str, turns: int, max_tokens: int, force: bool) -> dict:
    """``turns`` agent turns: a question (with the tool choice forced to a
    call when ``force``), then the results of each call until an answer
    without calls. Records every request body, so another server can be
    sent exactly the same requests."""
    c = PROTOCOLS[name](max_tokens)
    rows, answers, bodies = [], [], []
    t0 = time.perf_counter()
    for turn in range(turns):
        if turn:
            c.msgs.append(c.question(turn))
        for step in range(MAX_STEPS):
            body = json.loads(json.dumps(c.body()))  # a copy: the client's history grows on
            if step == 0 and force:
                body["tool_choice"] = FORCE[name]
            bodies.append(body)
            r, row = srv.timed(c.path, body)
            prompt, cached = c.usage(r)
            answers.append(c.answer(r))
            rows.append({**row, "prompt": prompt, "cached": cached, "turn": turn})
            if not c.calls:
                break
            c.results(turn)
        else:
            raise RuntimeError(f"{name}: turn {turn} still calling tools after {MAX_STEPS} requests")
    return {"rows": rows, "answers": answers, "bodies": bodies, "total_s": time.perf_counter() - t0}


def replay(srv: Server, name: str, ds4: dict, picks: list[int]) -> dict:
    """The requests ``picks`` of the ds4 loop, each on a fresh live session
    (no prompt cache at all: every request a full prefill)."""
    c = PROTOCOLS[name](0)
    rows, answers = {}, {}
    for i in picks:
        srv.reset()
        r, row = srv.timed(c.path, ds4["bodies"][i])
        prompt, cached = c.usage(r)
        answers[i] = c.answer(r)
        rows[i] = {**row, "prompt": prompt, "cached": cached}
    return {"rows": rows, "answers": answers}


def sample(n: int, every: int) -> list[int]:
    """Every ``every``-th request and the last (all with 1)."""
    return sorted({*range(0, n, every), n - 1})


def report(name: str, res: dict[str, dict]) -> list[str]:
    d = res["ds4"]
    n = len(d["rows"])
    no_reuse = sum(x["prompt"] for x in d["rows"])  # a server without reuse prefills every prompt whole
    cold = res["cold"]
    picks = sorted(cold["rows"])
    bad = [i for i in picks if cold["rows"][i]["cached"] or cold["rows"][i]["prompt"] != d["rows"][i]["prompt"]]
    if bad:
        raise RuntimeError(f"{name}: the cold server did not prefill requests {bad} whole: {cold['rows']} {d['rows']}")
    later = [i for i in picks if i > 0]
    out = [
        f"{name}: {n} requests over {d['rows'][-1]['turn'] + 1} turns, prompt {d['rows'][0]['prompt']} -> "
        f"{d['rows'][-1]['prompt']} tokens; cold run on requests {picks}"
    ]
    for label in ("ds4", "no-kv"):
        if label not in res:
            continue
        rows = res[label]["rows"]
        pref = sum(x["prompt"] - x["cached"] for x in rows)
        shares = [x["cached"] / x["prompt"] for x in rows[1:]]
        ratios = [rows[i]["ttft_ms"] / cold["rows"][i]["ttft_ms"] for i in later]
        same = all(res[label]["answers"][i] == cold["answers"][i] for i in picks)
        same = same and (label == "ds4" or res[label]["answers"] == d["answers"])
        out.append(
            f"  {label:6} prefilled {pref:7d} = {pref / no_reuse:6.1%} of no reuse ({no_reuse})"
            f"  cached share req 2..: min {min(shares):.1%} mean {statistics.mean(shares):.1%}"
            f"  ttft/cold req 2..: max {max(ratios):.1%} mean {statistics.mean(ratios):.1%}"
            f"  total {res[label]['total_s']:.1f} s  answers {'same' if same else 'DIFFERENT'}"
        )
    ttft = [cold["rows"][i]["ttft_ms"] for i in later]
    out.append(f"  cold   ttft of the sampled requests 2..: {min(ttft) / 1e3:.1f}-{max(ttft) / 1e3:.1f} s")
    for i, x in enumerate(d["rows"]):
        out.append(
            f"    req {i + 1:2d} turn {x['turn'] + 1:2d} prompt {x['prompt']:6d} cached {x['cached']:6d}"
            f" ttft {x['ttft_ms']:9.1f} ms"
            + (f"  cold {cold['rows'][i]['ttft_ms']:9.1f} ms" if i in cold["rows"] else "")
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="llamacpp")
    ap.add_argument("--turns", type=int, default=10, help="agent turns (question -> call -> result -> answer)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--protocols", default="chat,messages,responses")
    ap.add_argument("--no-kv", action="store_true", help="also run the loops on a --no-kv-cache server")
    ap.add_argument("--cold-every", type=int, default=1, help="run every k-th request (and the last) cold")
    ap.add_argument(
        "--force-calls",
        choices=("auto", "yes", "no"),
        default="auto",
        help="force a call on each question (tool_choice required; auto: unless --engine scripted)",
    )
    ap.add_argument("--json", help="write the raw rows here")
    a = ap.parse_args()
    force = a.force_calls == "yes" or (a.force_calls == "auto" and a.engine != "scripted")
    tmp = tempfile.mkdtemp(prefix="ds4-bench-agents-")
    results: dict[str, dict[str, dict]] = {}
    try:
        for name in a.protocols.split(","):
            res = results[name] = {}
            servers = [("ds4", ["--kv-disk-dir", os.path.join(tmp, f"kv-{name}")])]
            if a.no_kv:
                servers.append(("no-kv", ["--no-kv-cache"]))
            for label, extra in servers:  # a fresh server (and cache directory) per protocol
                srv = Server(a.engine, extra, os.path.join(tmp, f"{label}-{name}.log"), a.ctx)
                try:
                    res[label] = loop(srv, name, a.turns, a.max_tokens, force)
                finally:
                    srv.stop()
            srv = Server(a.engine, ["--no-kv-cache"], os.path.join(tmp, f"cold-{name}.log"), a.ctx)
            try:
                res["cold"] = replay(srv, name, res["ds4"], sample(len(res["ds4"]["rows"]), a.cold_every))
            finally:
                srv.stop()
            print("\n".join(report(name, res)), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {s: {"rows": v["rows"]} for s, v in by.items()} for k, by in results.items()}, f, indent=1)
    print(f"engine={a.engine} turns={a.turns} max_tokens={a.max_tokens} force_calls={force}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
