"""Streams from the first second: a streamed request whose prompt takes a
while to prefill gets its headers, its first event and keepalives while the
prefill runs; a client that leaves during the prefill stops it at the next
chunk, with the live session valid there and reused by the next request."""

from __future__ import annotations

import time

import httpx
import pytest

CTX = 8192


@pytest.fixture(scope="module")
def srv(serve_module):
    # a keepalive far shorter than the prefill: the stream starts reading events some time
    # after the job starts, so on a fast machine a 0.2 s interval could fit no comment at all
    return serve_module("--sse-keepalive", "0.03", name="stream", kv=True, ctx=CTX)


def _long_messages(word="item", n_words=1000):
    """About 7,000 tokens on the reference engine (a token per byte): a
    prefill of a second or more."""
    body = " ".join(f"{word}{i % 89}" for i in range(n_words))
    return [{"role": "user", "content": f"Summarise this list: {body}"}]


def _wait_idle(srv, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = srv.health()
        if not h["busy"] and h["queued"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError("the worker stayed busy")


def _events(lines):
    """(kind, line) for each SSE line: 'comment', 'data' or 'done'."""
    for line in lines:
        if not line:
            continue
        if line.startswith(":"):
            yield "comment", line
        elif line == "data: [DONE]":
            yield "done", line
        else:
            yield "data", line


def test_a_stream_sends_its_headers_and_keepalives_during_the_prefill(srv):
    h0 = _wait_idle(srv)
    body = {"model": srv.model(), "messages": _long_messages(), "max_tokens": 2, "stream": True}
    seen = []
    with httpx.stream("POST", srv.base + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for kind, line in _events(r.iter_lines()):
            if not seen:  # the first event is out while the job is still running
                assert srv.health()["busy"]
            seen.append((kind, line))
            if kind == "done":
                break
    kinds = [k for k, _ in seen]
    first_content = next(i for i, (k, line) in enumerate(seen) if k == "data" and '"content": "' in line and i > 0)
    # the opening chunk (role) first, then keepalive comments while the prompt is prefilled, then the text
    assert kinds[0] == "data" and '"role": "assistant"' in seen[0][1]
    assert "comment" in kinds[1:first_content], kinds
    assert kinds[-1] == "done"
    h1 = _wait_idle(srv)
    assert h1["counters"]["requests"] == h0["counters"]["requests"] + 1 and h1["session"]["valid"]


def test_a_client_leaving_during_the_prefill_stops_it_at_a_chunk_boundary(srv):
    msgs = _long_messages("thing", 900)
    h0 = _wait_idle(srv)
    body = {"model": srv.model(), "messages": msgs, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", srv.base + "/v1/chat/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert '"role": "assistant"' in first
        assert srv.health()["busy"]  # still prefilling when the client leaves
    h1 = _wait_idle(srv)
    assert h1["counters"]["cancelled"] == h0["counters"]["cancelled"] + 1
    assert h1["counters"]["errors"] == h0["counters"]["errors"]
    sess = h1["session"]
    assert sess["valid"] and sess["n_past"] > 0 and sess["n_past"] % 512 == 0
    # the next request for the same prompt goes on from where the prefill stopped
    r2 = httpx.post(
        srv.base + "/v1/chat/completions", json={**body, "stream": False}, headers=srv.headers, timeout=300
    ).json()
    assert r2["ds4"]["rung"] == "live" and r2["usage"]["prompt_tokens_details"]["cached_tokens"] == sess["n_past"]
    assert r2["usage"]["prompt_tokens"] > sess["n_past"]
