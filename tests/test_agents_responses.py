"""OpenAI Responses (issue 9, item 5) with the official ``openai`` client,
against servers over the scripted reference engine: ten-turn tool loops
with ``previous_response_id`` and with full replay (replies equal a cold
server's, prompts served from the cache from the second turn on), stored
responses surviving a restart, the 400 for outputs nobody's calls made,
OpenAI's error for an unknown ``previous_response_id``."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from helpers.agents import KV_FLAGS, RTOOLS, SYSTEM, ScriptedServer, cold_server, warm_server

cold = pytest.fixture(scope="module", name="cold")(cold_server)
warm = pytest.fixture(scope="module", name="warm")(warm_server)


def ask(srv, input, stream=False, **kw):
    """The Response (for a stream: the one in response.completed)."""
    args = {"model": "gpt-x", "instructions": SYSTEM, "input": input, "tools": RTOOLS, **kw}
    if not stream:
        with srv.client() as c:
            return c.responses.create(**args)
    with srv.client() as c, c.responses.create(stream=True, **args) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    r = events[-1].response
    assert deltas == "".join(o.content[0].text for o in r.output if o.type == "message")
    return r


def items(r):
    """The response's output as input items (full replay)."""
    out = []
    for o in r.output:
        if o.type == "message":
            out.append({"role": "assistant", "content": o.content[0].text})
        else:
            out.append({"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments})
    return out


def shape(r):
    return [(o.type, o.content[0].text if o.type == "message" else (o.name, o.arguments)) for o in r.output]


def next_input(r, turn):
    calls = [o for o in r.output if o.type == "function_call"]
    if calls:
        return [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"value {c.arguments} is 42"}
            for c in calls
        ]
    return [{"role": "user", "content": f"And {turn}?"}]


def cold_shape(cold, history):
    cold.reset()
    r = ask(cold, history)
    assert r.usage.input_tokens_details.cached_tokens == 0
    return shape(r)


@pytest.mark.parametrize("mode", ["previous", "previous-stream", "replay"])
def test_ten_turn_tool_loop_is_cached_and_matches_a_cold_server(warm, cold, mode):
    history = [{"role": "user", "content": f"Look up 4 ({mode})."}]
    inp, prev = list(history), None
    for turn in range(10):
        if mode == "replay":
            r = ask(warm, history)
        else:
            r = ask(warm, inp, stream=mode.endswith("stream"), previous_response_id=prev)
        assert r.status == "completed" and r.id.startswith("resp_")
        assert shape(r) == cold_shape(cold, history), turn
        if turn:
            u = r.usage
            assert u.input_tokens_details.cached_tokens >= 0.95 * u.input_tokens, (turn, u)
        inp, prev = next_input(r, turn), r.id
        history += items(r) + inp
    kinds = {t for t, _ in shape(r)}
    assert kinds <= {"message", "function_call"}


def test_unknown_previous_response_and_live_only_outputs(warm):
    with pytest.raises(openai.BadRequestError) as ei:
        ask(warm, "hi", previous_response_id="resp_doesnotexist")
    assert ei.value.code == "previous_response_not_found"
    # tool outputs alone, for calls nobody made here: ds4's 400 (tests/test_agents_call_ids.py: the 409)
    out = [{"type": "function_call_output", "call_id": "call_unknown", "output": "1"}]
    resp = httpx.post(warm.base + "/v1/responses", json={"model": "m", "input": out}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unknown_call_id"
    # tool outputs alone for the calls generated at the live end: continued live
    r = ask(warm, "Look up 8.", store=False)
    (call,) = [o for o in r.output if o.type == "function_call"]
    r2 = ask(warm, [{"type": "function_call_output", "call_id": call.call_id, "output": "eight"}])
    assert shape(r2) == [("message", "Result: eight.")]
    assert r2.usage.input_tokens_details.cached_tokens >= 0.95 * r2.usage.input_tokens
    assert "responses live continuation match=tool-output-ids" in warm.text_log()
    with pytest.raises(openai.BadRequestError):  # store=false: nothing to continue from
        ask(warm, "x", previous_response_id=r.id)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_stored_responses_survive_a_restart_in_the_cache_budget(tmp_path, serve, cold, sig):
    kv = tmp_path / "kv"
    srv = serve("--kv-disk-dir", str(kv), *KV_FLAGS, name="a", cls=ScriptedServer, tmp=tmp_path)
    history = [{"role": "user", "content": "Look up 6."}]
    try:
        r = ask(srv, history)
        inp = next_input(r, 0)
        history += items(r) + inp
    finally:
        srv.stop(sig)  # SIGKILL: no shutdown save; the record and the continued saves were on disk already
    assert any(n.startswith("response-resp_") for n in os.listdir(kv / "records"))
    srv2 = serve("--kv-disk-dir", str(kv), *KV_FLAGS, name="b", cls=ScriptedServer, tmp=tmp_path)
    r2 = ask(srv2, inp, previous_response_id=r.id)
    srv2.stop()
    assert r2.model_extra["ds4"]["rung"] == "disk" and r2.usage.input_tokens_details.cached_tokens > 0
    if sig == signal.SIGTERM:  # the shutdown save holds the whole turn
        assert r2.usage.input_tokens_details.cached_tokens >= 0.95 * r2.usage.input_tokens
    assert shape(r2) == cold_shape(cold, history)
