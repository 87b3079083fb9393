"""The first request after a start waits for nothing a later one does not
(issue 40 item 4): no module imported on its path, no chat template
compiled, no key text table built over the whole vocabulary. Checked with
Python's own import tracer and the engine's calls, never a timer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers import models
from helpers.ports import free_port

import ds4
from ds4.engines import chat_template
from ds4.keytext import KeyRenderer

pytestmark = pytest.mark.timeout(600)

#: a chat of about 700 SmolLM2 tokens
MSGS = [
    {"role": "system", "content": "You keep the harbour's tide log and answer from it. " * 60},
    {"role": "user", "content": "When is high water at the north berth?"},
]


def _requests(base: str) -> list[int]:
    """One of each kind a client sends first: chat, streamed chat, Messages
    and Responses streamed, a completion, a refusal, the metrics."""
    out = []
    with httpx.Client(base_url=base, timeout=300) as c:
        out.append(c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 4}).status_code)
        for path, body in (
            ("/v1/chat/completions", {"model": "m", "messages": MSGS, "max_tokens": 4, "stream": True}),
            (
                "/v1/messages",
                {"model": "m", "messages": MSGS[1:], "system": MSGS[0]["content"], "max_tokens": 4, "stream": True},
            ),
            ("/v1/responses", {"model": "m", "input": MSGS[1]["content"], "max_output_tokens": 4, "stream": True}),
        ):
            with c.stream("POST", path, json=body) as r:
                r.read()
                out.append(r.status_code)
        out.append(c.post("/v1/completions", json={"model": "m", "prompt": "Tide:", "max_tokens": 4}).status_code)
        out.append(
            c.post(
                "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
            ).status_code
        )
        out.append(c.get("/metrics").status_code)
    return out


def test_the_first_requests_after_a_start_import_nothing(tmp_path):
    """``ds4 serve`` under Python's import tracer (``PYTHONPROFILEIMPORTTIME``:
    a line on stderr for every module imported): from the moment its port
    accepts a connection, the first request of each kind imports no module
    (anyio's streams, the executor's thread pool, jinja2's escapes and
    prometheus_client's families were all imported on first use before)."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    args = [sys.executable, "-m", "ds4", "serve", "--engine", "llamacpp", "--model", models.model_path("smollm2")]
    args += ["--port", str(port), "--ctx", "2048", "--sessions", "1", "--kv-disk-dir", str(tmp_path / "kv")]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
        )
    try:
        deadline = time.monotonic() + 300
        while True:  # no /health first: the requests below are the first it serves
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the port never opened"
                time.sleep(0.02)
        at_start = log_path.read_text()
        assert at_start.count("import time:") > 100  # the tracer is on
        assert _requests(f"http://127.0.0.1:{port}") == [200, 200, 200, 200, 200, 400, 200]
        later = log_path.read_text()[len(at_start) :]
        assert [line for line in later.splitlines() if line.startswith("import time:")] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


class _Counted:
    """Counts the calls of one callable."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)


def test_the_first_request_compiles_no_template_and_builds_no_vocabulary_table(tmp_path, monkeypatch):
    """The app ``ds4 serve`` builds, started (its lifespan run, as uvicorn
    does before it binds the port): the first chat compiles no template,
    and asks the engine for the bytes of no more token ids than it renders
    (the key text table fills per id; built whole, it took one call per
    vocabulary id, 49,152 on SmolLM2, on the first request)."""
    from starlette.testclient import TestClient

    from ds4.cli import build_parser
    from ds4.server.guard import Guard
    from ds4.server.serve import build_app

    flags = ["serve", "--engine", "llamacpp", "--model", models.model_path("smollm2"), "--ctx", "2048"]
    app = build_app(build_parser().parse_args([*flags, "--kv-disk-dir", str(tmp_path / "kv")]), Guard())
    engine = app.state.service.gen.engine
    with TestClient(app, base_url="http://127.0.0.1") as http:
        compiles, compile_ = [], chat_template.TemplateRenderer.__init__

        def counted_compile(self, *a, **kw):
            compiles.append(a)
            compile_(self, *a, **kw)

        monkeypatch.setattr(chat_template.TemplateRenderer, "__init__", counted_compile)
        pieces = engine.token_bytes = _Counted(engine.token_bytes)
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200, r.text
    ids = set(engine.tokenize(engine.render_chat(MSGS), special=True))
    assert compiles == []
    # the prompt's distinct ids and the reply's 8, at most: not the vocabulary
    assert 0 < pieces.calls <= len(ids) + 8 < engine.vocab_size // 50


def test_the_key_table_fills_per_id():
    eng = ds4.ReferenceEngine()
    keys = KeyRenderer(eng)
    assert len(keys.table) == 0
    toks = eng.tokenize("the tide turns at noon")
    assert keys.render(toks) == b"".join(eng.token_bytes(t) for t in toks)
    assert set(keys.table) == set(toks)
    with pytest.raises(ValueError, match="out of range"):
        keys.piece(eng.vocab_size)
    with pytest.raises(ValueError, match="out of range"):
        keys.piece(-1)  # a list's -1 was the last id: a dict asks the engine, which refuses
