"""Server processes over the scripted engine, for the agent-protocol tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

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
SYSTEM = "You are an agent. Use the tools to answer. " + " ".join(f"rule-{i}: be exact." for i in range(40))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedServer:
    """``ds4 serve`` over the scripted engine (or, with ``engine``, a real
    one), in a subprocess."""

    def __init__(self, tmp, name, *args, ctx=8192, engine=None):
        self.port = free_port()
        self.log_path = os.path.join(str(tmp), f"{name}.log")
        self.args = [sys.executable, os.path.join(HERE, "scripted_serve.py"), "--engine", "reference"]
        if engine is not None:
            self.args = [sys.executable, "-m", "ds4", "serve", "--engine", engine]
        self.args += ["--port", str(self.port), "--ctx", str(ctx), *args]
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout=90.0):
        self.log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.text_log()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not become healthy:\n{self.text_log()}")

    def stop(self, sig=signal.SIGTERM, timeout=60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not stop on {sig}:\n{self.text_log()}") from None
        self.log.close()
        return rc

    def text_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def reset(self) -> None:
        """Replace the live session with an unrelated one (a cold run next)."""
        r = httpx.post(self.base + "/v1/completions", json={"model": "x", "prompt": "reset", "max_tokens": 1})
        assert r.status_code == 200, r.text
