"""Server processes over the scripted engine, for the agent-protocol tests:
the server, its tools and system prompt, a module's cold and warm servers,
and a cold server's answer."""

from __future__ import annotations

import os
import sys

import httpx

from helpers.server import Server

HERE = os.path.dirname(os.path.abspath(__file__))
KV_FLAGS = ["--kv-cache-min-tokens", "64", "--kv-cache-boundary-align-tokens", "64"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a number up in the table.",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "note",
            "description": "Write a note.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    },
]
#: TOOLS as the Responses API takes them (flat function tools)
RTOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
#: TOOLS as Anthropic Messages takes them
ATOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
SYSTEM = "You are an agent. Use the tools to answer. " + " ".join(f"rule-{i}: be exact." for i in range(40))


class ScriptedServer(Server):
    """``ds4 serve`` over the scripted engine (or, with ``engine``, a real
    one), in a subprocess: :class:`helpers.server.Server`'s life cycle with
    the scripted engine's command line (``env``: more of its environment,
    e.g. ``DS4_SCRIPTED_TEMPLATE``)."""

    def __init__(self, tmp, name, *args, ctx=8192, engine=None, env=None):
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
        super().__init__(str(tmp), name, ctx=ctx, env=env)
        cmd = [sys.executable, os.path.join(HERE, "scripted_serve.py"), "--engine", "reference"]
        if engine is not None:
            cmd = [sys.executable, "-m", "ds4", "serve", "--engine", engine]
        self.args = [*cmd, "--port", str(self.port), "--ctx", str(ctx), "--sessions", "1", *args]

    def reset(self) -> None:
        """Replace the live session with an unrelated one (a cold run next)."""
        r = httpx.post(self.base + "/v1/completions", json={"model": "x", "prompt": "reset", "max_tokens": 1})
        assert r.status_code == 200, r.text


def tool_results(msg):
    """The Anthropic user message answering every ``tool_use`` block of the
    assistant message ``msg`` (the scripted engine's ``lookup`` calls)."""
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"value of n={b['input']['n']} is 42"}
            for b in msg["content"]
            if b["type"] == "tool_use"
        ],
    }


def cold_server(serve_module):
    """A module's cold server: no disk cache (the replies a cold prefill
    gives). A module's fixture as
    ``cold = pytest.fixture(scope="module", name="cold")(cold_server)``."""
    return serve_module("--no-kv-cache", name="cold", cls=ScriptedServer)


def warm_server(serve_module):
    """A module's server with a disk cache (``srv.kv_dir``), a fixture as
    :func:`cold_server` is."""
    return serve_module(*KV_FLAGS, name="warm", cls=ScriptedServer, kv=True)


def cold_answer(ask, cold, messages, **kw):
    """What ``cold`` (a :func:`cold_server`) answers to ``messages`` through
    ``ask(srv, messages, **kw)`` (a module's one turn of its protocol, which
    returns the message to append, the stop or finish reason and the usage
    first) with its live session replaced first: (message, reason), no
    prompt token served from a cache (asserted, in an OpenAI or an
    Anthropic usage)."""
    cold.reset()
    msg, reason, usage, *_ = ask(cold, messages, **kw)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = usage.cache_read_input_tokens if details is None else details.cached_tokens
    assert cached == 0
    return msg, reason
