"""SIGTERM during a long answer: the request gets its protocol's final
event before the connection closes, never a stream that simply stops.

``ds4 serve --shutdown-grace 2`` over the scripted engine (a ``LONG n``
prompt is answered with ``n`` bytes, several seconds of decoding): the
stream is read until its first text, the server gets SIGTERM, and the rest
of the stream is read to its end. Chat completions end with an error event
of code ``shutting_down`` and ``data: [DONE]``; Anthropic Messages with
``event: error``; Responses with an ``error`` event; a request that is not
streamed gets the 503 of ``shutting_down``. The server then exits as
uvicorn does after a SIGTERM (the lifespan hook still stores and closes)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from helpers.agents import ScriptedServer

LONG = "Say LONG 7000 please."
GRACE = "2"

BODIES = {
    "chat": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 7500, "stream": True},
    ),
    "messages": (
        "/v1/messages",
        {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 7500, "stream": True},
    ),
    "responses": ("/v1/responses", {"model": "m", "input": LONG, "max_output_tokens": 7500, "stream": True}),
}


def _events(lines: list[str]) -> list[tuple[str | None, str]]:
    """The SSE events as (event name, data), comments dropped."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((name, line[len("data: ") :]))
            name = None
    return out


@pytest.mark.parametrize("proto", list(BODIES))
def test_sigterm_sends_each_open_stream_a_final_event(tmp_path, serve, proto):
    srv = serve("--no-kv-cache", "--shutdown-grace", GRACE, name=proto, cls=ScriptedServer, tmp=tmp_path)
    path, body = BODIES[proto]
    lines: list[str] = []
    try:
        with httpx.stream("POST", srv.base + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            for line in it:  # 40 events in: the text is flowing
                lines.append(line)
                if sum(x.startswith("data: ") for x in lines) >= 40:
                    break
            srv.proc.send_signal(signal.SIGTERM)
            lines += list(it)
    finally:
        rc = srv.stop()
    assert rc in (0, -signal.SIGTERM), srv.text_log()  # uvicorn raises the signal it handled again once it is done
    evs = _events(lines)
    assert len(evs) >= 40 and "gen=7000" not in srv.text_log(), "the stream ended before the signal"
    if proto == "chat":
        assert evs[-1][1] == "[DONE]"
        err = json.loads(evs[-2][1])
        assert err["error"]["code"] == "shutting_down", evs[-2]
        assert not any('"finish_reason": "stop"' in d or '"finish_reason":"stop"' in d for _, d in evs)
    elif proto == "messages":
        name, data = evs[-1]
        assert name == "error" and json.loads(data)["error"]["type"] in ("overloaded_error", "api_error"), evs[-1]
        assert "shutting down" in json.loads(data)["error"]["message"]
        assert not any(n == "message_stop" for n, _ in evs)
    else:
        name, data = evs[-1]
        d = json.loads(data)
        assert d["type"] == "error" and d["code"] == "shutting_down", evs[-1]
        assert not any(json.loads(x).get("type") == "response.completed" for _, x in evs if x.startswith("{"))
    assert "ended with a final error event" in srv.text_log()


def test_sigterm_answers_a_request_not_streamed_with_a_503(tmp_path, serve):
    srv = serve("--no-kv-cache", "--shutdown-grace", GRACE, name="plain", cls=ScriptedServer, tmp=tmp_path)
    path, body = BODIES["chat"]
    got: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: got.setdefault("r", httpx.post(srv.base + path, json={**body, "stream": False}, timeout=60))
    )
    t.start()
    try:
        # the job is running once the server logs its ladder line
        for _ in range(200):
            if "ds4 ladder" in srv.text_log():
                break
            t.join(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
    finally:
        rc = srv.stop()
    assert rc in (0, -signal.SIGTERM)
    r = got["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
