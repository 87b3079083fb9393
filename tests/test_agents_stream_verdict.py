"""Agent traffic streamed as Claude Code and Codex run it, with the official
``openai`` and ``anthropic`` SDKs' streaming helpers, against a server over
the scripted reference engine: every protocol's final streamed event
carries the ``ds4`` verdict block (the whole reply's, same rung, cached
tokens and divergence), the ``x-ds4-*`` headers carry the rung and cached
tokens when the prefill ends before the headers go; a tool call cut by
``max_tokens`` ends the same way streamed and not (finish ``length`` /
``max_tokens``, the same content); Responses streams a call's arguments
in several deltas."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from agent_helpers import RTOOLS, SYSTEM, TOOLS, warm_server

warm = pytest.fixture(scope="module", name="warm")(warm_server)

ATOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
KEYS = ("rung", "reused_tokens", "divergence")


def aclient(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)


def _agree(streamed: dict, whole: dict) -> None:
    assert set(streamed) == set(whole)
    assert {k: streamed[k] for k in KEYS} == {k: whole[k] for k in KEYS}, (streamed, whole)


# -- chat ----------------------------------------------------------------------
def chat_plain(srv, msgs, **kw):
    with srv.client() as c:
        return c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, **kw)


def chat_stream(srv, msgs, **kw):
    """(the chunks, the SDK's accumulated completion)."""
    with srv.client() as c, c.chat.completions.stream(model="m", messages=msgs, tools=TOOLS, **kw) as s:
        chunks = [e.chunk for e in s if e.type == "chunk"]
        return chunks, s.get_final_completion()


def test_chat_stream_carries_the_verdict(warm):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "TALK about chat verdicts"}]
    chat_plain(warm, msgs)
    chunks, final = chat_stream(warm, msgs)
    whole = chat_plain(warm, msgs)  # after the same state as the stream's
    assert final.choices[0].message.content == whole.choices[0].message.content == "No tool needed."
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    _agree(last.model_extra["ds4"], whole.model_extra["ds4"])
    assert all("ds4" not in (c.model_extra or {}) for c in chunks[:-1])
    # with include_usage the usage chunk carries it too
    chunks, _ = chat_stream(warm, msgs, stream_options={"include_usage": True})
    assert chunks[-1].usage is not None
    _agree(chunks[-1].model_extra["ds4"], whole.model_extra["ds4"])


def test_stream_headers_carry_the_rung_when_known_before_the_first_byte(warm):
    """The scripted prefill ends within the stream's hold: the start event
    is there before the headers go."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "TALK about headers"}]
    body = {"model": "m", "messages": msgs, "tools": TOOLS, "stream": True}
    with httpx.stream("POST", warm.base + "/v1/chat/completions", json=body, timeout=120) as r:
        head = dict(r.headers)
        data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    info = data[-1]["ds4"]
    assert head["x-ds4-rung"] == info["rung"]
    assert int(head["x-ds4-cached-tokens"]) == info["reused_tokens"]


# -- Anthropic -----------------------------------------------------------------
def _aargs(msgs, **kw):
    return {"model": "claude-x", "max_tokens": 300, "system": SYSTEM, "messages": msgs, "tools": ATOOLS, **kw}


def anthropic_stream(srv, msgs, **kw):
    with aclient(srv) as c, c.messages.stream(**_aargs(msgs, **kw)) as s:
        events = list(s)
        return events, s.get_final_message()


def test_anthropic_stream_carries_the_verdict(warm):
    msgs = [{"role": "user", "content": "TALK about anthropic verdicts"}]
    with aclient(warm) as c:
        c.messages.create(**_aargs(msgs))
    events, final = anthropic_stream(warm, msgs)
    with aclient(warm) as c:
        whole = c.messages.create(**_aargs(msgs))
    delta = next(e for e in events if e.type == "message_delta")
    _agree(delta.model_extra["ds4"], whole.model_extra["ds4"])
    _agree(delta.usage.model_extra["ds4"], whole.model_extra["ds4"])
    assert delta.usage.cache_read_input_tokens == whole.usage.cache_read_input_tokens
    assert final.content[0].text == whole.content[0].text


# -- Responses -----------------------------------------------------------------
def _rargs(input, **kw):
    return {"model": "gpt-x", "instructions": SYSTEM, "input": input, "tools": RTOOLS, **kw}


def responses_stream(srv, input, **kw):
    with srv.client() as c, c.responses.stream(**_rargs(input, **kw)) as s:
        events = list(s)
        return events, s.get_final_response()


def test_responses_stream_carries_the_verdict(warm):
    with warm.client() as c:
        c.responses.create(**_rargs("TALK about responses verdicts"))
    events, final = responses_stream(warm, "TALK about responses verdicts")
    with warm.client() as c:
        whole = c.responses.create(**_rargs("TALK about responses verdicts"))
    done = events[-1]
    assert done.type == "response.completed"
    _agree(done.response.model_extra["ds4"], whole.model_extra["ds4"])
    assert final.output_text == whole.output_text == "No tool needed."
