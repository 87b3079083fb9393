"""ds4-server's 400/409 split for tool results (issue 21, item 6), with the
official ``anthropic`` and ``openai`` clients against a server over the
scripted reference engine: a result for a call id nobody issued (not in the
history, not by this server) is a 400 in the protocol's error shape; a
result whose call is not in the history, for a call this server issued,
needs the live tool state: served from it while it holds that turn, a 409
("retry by replaying the full ... history") once it is gone, and replaying
the full history then works; a Responses output for a call its
``previous_response_id`` response never made is a 400."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from helpers.agents import ATOOLS, RTOOLS, SYSTEM, tool_results, warm_server

warm = pytest.fixture(scope="module", name="warm")(warm_server)

H = {"anthropic-version": "2023-06-01"}


def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)


def create(srv, messages, **kw):
    with client(srv) as c:
        return c.messages.create(model="m", max_tokens=300, system=SYSTEM, messages=messages, tools=ATOOLS, **kw)


def as_msg(r) -> dict:
    content = [
        {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
        if b.type == "tool_use"
        else {"type": "text", "text": b.text}
        for b in r.content
    ]
    return {"role": "assistant", "content": content}


def cached_share(u) -> float:
    return u.cache_read_input_tokens / (u.cache_read_input_tokens + u.cache_creation_input_tokens)


# -- Anthropic -----------------------------------------------------------------
def test_anthropic_a_tool_use_id_nobody_issued_is_a_400(warm):
    result = {"type": "tool_result", "tool_use_id": "toolu_never_issued", "content": "1"}
    msgs = [
        {"role": "user", "content": "Look up 3."},
        {"role": "assistant", "content": "Let me see."},
        {"role": "user", "content": [result]},
    ]
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as ei:
            if stream:
                with (
                    client(warm) as c,
                    c.messages.stream(model="m", max_tokens=50, system=SYSTEM, messages=msgs, tools=ATOOLS) as s,
                ):
                    list(s)
            else:
                create(warm, msgs)
        body = ei.value.body
        assert ei.value.status_code == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error"
        assert "toolu_never_issued" in body["error"]["message"] and "tool_use" in body["error"]["message"]
    # count_tokens judges the same body the same way
    r = httpx.post(warm.base + "/v1/messages/count_tokens", headers=H, json={"model": "m", "messages": msgs})
    assert r.status_code == 400 and "toolu_never_issued" in r.json()["error"]["message"]
    # a call of the same history answers it: no state needed
    msgs[1] = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_never_issued", "name": "lookup", "input": {"n": 3}}],
    }
    assert create(warm, msgs).content[0].text == "Result: 1."


def test_anthropic_results_without_their_calls_need_the_live_state(warm):
    first = [{"role": "user", "content": "Look up 21."}]
    r = create(warm, first)
    assert r.stop_reason == "tool_use"
    call = as_msg(r)
    # the results alone, the calls left out: the live state holds that turn
    r2 = create(warm, [*first, tool_results(call)])
    assert r2.content[0].text.startswith("Result: value of n=") and cached_share(r2.usage) >= 0.95
    # again, after another request took the live session: 409, replay the full history
    r = create(warm, [{"role": "user", "content": "Look up 22."}])
    call = as_msg(r)
    warm.reset()
    for stream in (False, True):
        body = {"model": "m", "max_tokens": 50, "system": SYSTEM, "tools": ATOOLS, "stream": stream}
        resp = httpx.post(
            warm.base + "/v1/messages",
            headers=H,
            json={**body, "messages": [{"role": "user", "content": "Look up 22."}, tool_results(call)]},
            timeout=120,
        )
        assert resp.status_code == 409, resp.text  # today 200 from disk, the results without their calls
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert "retry by replaying the full messages history" in err["error"]["message"]
    with pytest.raises(anthropic.ConflictError):
        create(warm, [{"role": "user", "content": "Look up 22."}, tool_results(call)])
    # the full history replayed: answered
    r3 = create(warm, [{"role": "user", "content": "Look up 22."}, call, tool_results(call)])
    assert r3.content[0].text.startswith("Result: value of n=")


# -- Responses -----------------------------------------------------------------
def responses(srv, input, **kw):
    with srv.client() as c:
        return c.responses.create(model="m", instructions=SYSTEM, input=input, tools=RTOOLS, **kw)


def test_responses_an_output_its_previous_response_never_called_is_a_400(warm):
    r = responses(warm, "Look up 31.")
    (call,) = [o for o in r.output if o.type == "function_call"]
    other = responses(warm, "Look up 32.", store=False)
    (issued,) = [o for o in other.output if o.type == "function_call"]
    for call_id in ("call_bogus", issued.call_id):  # nobody's, and a call of another response
        out = [{"type": "function_call_output", "call_id": call_id, "output": "1"}]
        with pytest.raises(openai.BadRequestError) as ei:  # today 200, the output rendered without its call
            responses(warm, out, previous_response_id=r.id)
        err = ei.value.body
        assert ei.value.status_code == 400 and err["type"] == "invalid_request_error", err
        assert call_id in err["message"] and r.id in err["message"] and err["param"] == "input"
    out = [{"type": "function_call_output", "call_id": call.call_id, "output": "thirty-one"}]
    assert responses(warm, out, previous_response_id=r.id).output[0].content[0].text == "Result: thirty-one."


def test_responses_an_unknown_call_id_is_a_400_and_a_gone_state_a_409(warm):
    out = [{"type": "function_call_output", "call_id": "call_unknown", "output": "1"}]
    with pytest.raises(openai.BadRequestError) as ei:  # today 409, and replaying gave the same 409
        responses(warm, out)
    assert ei.value.code == "unknown_call_id" and "call_unknown" in ei.value.body["message"]
    # the call this server issued, the live state gone since: 409
    r = responses(warm, "Look up 33.", store=False)
    (call,) = [o for o in r.output if o.type == "function_call"]
    warm.reset()
    out = [{"type": "function_call_output", "call_id": call.call_id, "output": "thirty-three"}]
    with pytest.raises(openai.ConflictError) as ei:
        responses(warm, out)
    assert ei.value.status_code == 409 and ei.value.body["type"] == "invalid_request_error"
    assert "retry by replaying the full input history" in ei.value.body["message"]
    # replayed with its call: answered
    replay = [
        {"role": "user", "content": "Look up 33."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *out,
    ]
    assert responses(warm, replay).output[0].content[0].text == "Result: thirty-three."
    # and an id nobody issued, replayed with its (client-made) call: answered too
    replay[1] = {**replay[1], "call_id": "call_unknown"}
    replay[2] = {**replay[2], "call_id": "call_unknown"}
    assert responses(warm, replay).output[0].content[0].text == "Result: thirty-three."


def test_responses_a_chain_through_a_response_served_from_the_live_state_goes_on(warm):
    """A response served from the live tool state is stored with the
    outputs but not their calls (the input did not hold them): chaining
    from it is not judged again."""
    r = responses(warm, "Look up 34.", store=False)
    (call,) = [o for o in r.output if o.type == "function_call"]
    out = [{"type": "function_call_output", "call_id": call.call_id, "output": "thirty-four"}]
    r2 = responses(warm, out)
    assert r2.output[0].content[0].text == "Result: thirty-four."
    r3 = responses(warm, [{"role": "user", "content": "And 35?"}], previous_response_id=r2.id)
    assert r3.status == "completed" and [o.type for o in r3.output] == ["function_call"]
