"""Server processes over the scripted engine, for the agent-protocol tests."""

from __future__ import annotations

import os
import sys

import httpx
from test_server import Server

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
SYSTEM = "You are an agent. Use the tools to answer. " + " ".join(f"rule-{i}: be exact." for i in range(40))


class ScriptedServer(Server):
    """``ds4 serve`` over the scripted engine (or, with ``engine``, a real
    one), in a subprocess: :class:`test_server.Server`'s life cycle with
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


def cold_server(tmp_path_factory):
    """A module's cold server: no disk cache (the replies a cold prefill gives)."""
    srv = ScriptedServer(tmp_path_factory.mktemp("cold"), "cold", "--no-kv-cache").start()
    yield srv
    srv.stop()


def warm_server(tmp_path_factory):
    """A module's server with a disk cache."""
    tmp = tmp_path_factory.mktemp("warm")
    srv = ScriptedServer(tmp, "warm", "--kv-disk-dir", str(tmp / "kv"), *KV_FLAGS).start()
    yield srv
    srv.stop()
