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
import jiter
import pytest
from helpers.agents import ATOOLS, RTOOLS, SYSTEM, TOOLS, warm_server
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.server import tool_stream as TS
from ds4.server import tools as T
from ds4.server.tool_cut import cut_reply, partial_object

warm = pytest.fixture(scope="module", name="warm")(warm_server)

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
    """The scripted prefill ends within the stream's hold (STREAM_HOLD_S):
    the start event is there before the headers go, and they carry the
    final block's rung and cached tokens; a prefill that outlasts the hold
    (a loaded machine) sends neither (the final event still has them)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "TALK about headers"}]
    body = {"model": "m", "messages": msgs, "tools": TOOLS, "stream": True}
    seen = 0
    for _ in range(3):
        with httpx.stream("POST", warm.base + "/v1/chat/completions", json=body, timeout=120) as r:
            head = dict(r.headers)
            data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        info = data[-1]["ds4"]
        assert ("x-ds4-rung" in head) == ("x-ds4-cached-tokens" in head)
        if "x-ds4-rung" in head:
            seen += 1
            assert head["x-ds4-rung"] == info["rung"]
            assert int(head["x-ds4-cached-tokens"]) == info["reused_tokens"]
    assert seen


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


# -- a call cut by max_tokens ----------------------------------------------------
#: ESCAPED's reply is a call of note whose "text" argument grows; the cut is
#: inside that string, after the call was announced (its name complete)
CUT = len('<tool_call>[{"name":"note","arguments":{"text":"caf\\u00e9 ')
CUT_ARGS = '{"text": "café '


def test_chat_a_call_cut_by_max_tokens_ends_the_same_streamed_and_not(warm):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "ESCAPED note, cut"}]
    whole = chat_plain(warm, msgs, max_tokens=CUT).choices[0]
    # (the SDK's stream helper refuses a length finish: the chunks are accumulated here)
    with warm.client() as c:
        chunks = list(c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=CUT, stream=True))
    text, calls, finish = "", {}, None
    for ch in chunks:
        for choice in ch.choices:
            text += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert whole.finish_reason == finish == "length"
    assert (whole.message.content or "") == text == ""  # no text: the block is the call
    shape = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert shape == [tuple(calls[k]) for k in sorted(calls)] == [("note", CUT_ARGS)]

    # the cut call sent back (its arguments do not parse) is history, not a failure
    back = [*msgs, whole.message.model_dump(exclude_none=True), {"role": "user", "content": "TALK again"}]
    assert chat_plain(warm, back).choices[0].message.content == "No tool needed."


def test_anthropic_a_call_cut_by_max_tokens_ends_the_same_streamed_and_not(warm):
    msgs = [{"role": "user", "content": "ESCAPED note, cut"}]
    with aclient(warm) as c:
        whole = c.messages.create(**_aargs(msgs, max_tokens=CUT))
    events, final = anthropic_stream(warm, msgs, max_tokens=CUT)
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    blocks = [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    assert blocks == [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content]
    assert blocks == [("tool_use", "note", {})]
    parts = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert "".join(parts) == CUT_ARGS
    assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]


@settings(max_examples=300, deadline=None)
@given(
    args=st.dictionaries(
        st.text(max_size=4),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3),
            max_leaves=6,
        ),
        max_size=4,
    ),
    data=st.data(),
)
def test_a_cut_calls_input_is_what_the_anthropic_sdk_parses_from_its_fragments(args, data):
    """The whole reply's ``input`` of a cut call is the SDK's partial parse
    (jiter's) of the streamed fragments."""
    whole = T.dump_json(args)
    text = whole[: data.draw(st.integers(1, len(whole)))]
    sp = TS.StreamSplitter(frozenset({"f"}))
    sp.feed('<tool_call>[{"name": "f", "arguments": ' + text)
    ((_, _, streamed),) = sp.cut()
    assert whole.startswith(streamed)
    assert partial_object(streamed) == jiter.from_json(streamed.encode(), partial_mode=True)


def test_responses_a_call_cut_by_max_tokens_ends_the_same_streamed_and_not(warm):
    """Responses keeps what the model generated (the stored response, its
    retrieval and ``previous_response_id`` hold it): an ``incomplete``
    response whose message is the text, streamed or not; a stream that had
    announced the call ends its item ``incomplete`` and sends the text."""
    with warm.client() as c:
        whole = c.responses.create(**_rargs("ESCAPED note, cut", max_output_tokens=CUT))
    # (the SDK's stream helper wants response.completed: the events are read here)
    with warm.client() as c:
        events = list(c.responses.create(**_rargs("ESCAPED note, cut", max_output_tokens=CUT), stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert whole.status == final.status == "incomplete"
    assert whole.incomplete_details == final.incomplete_details
    shape = [(o.type, o.status, o.content[0].text) for o in whole.output]
    assert shape == [(o.type, o.status, o.content[0].text) for o in final.output]
    assert [t for _, _, t in shape] == [whole.output_text] and whole.output_text.startswith("<tool_call>")
    done = {e.item.type: e.item for e in events if e.type == "response.output_item.done"}
    assert sorted((i.type, i.status) for i in done.values()) == [
        ("function_call", "incomplete"),
        ("message", "completed"),
    ]
    assert done["function_call"].arguments == CUT_ARGS and done["message"].content[0].text == whole.output_text
    assert not [e for e in events if e.type == "response.function_call_arguments.done"]


@pytest.mark.parametrize("ask", ["ESCAPED note", "PREFACE look up 5.", "TWO calls"])
def test_responses_streams_a_calls_arguments_as_they_are_generated(warm, ask):
    with warm.client() as c:
        whole = c.responses.create(**_rargs(ask))
    events, final = responses_stream(warm, ask)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert calls and [o.type for o in final.output] == [o.type for o in whole.output]
    for o in calls:
        added = next(
            e
            for e in events
            if e.type == "response.output_item.added"
            and e.item.type == "function_call"
            and e.item.name == o.name
            and e.output_index == whole.output.index(o)
        )
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.output_index == added.output_index
        ]
        assert len(deltas) > 1, deltas
        assert "".join(deltas) == o.arguments
        done = next(
            e
            for e in events
            if e.type == "response.function_call_arguments.done" and e.output_index == added.output_index
        )
        assert done.arguments == o.arguments
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in final.output] == [
        (o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in whole.output
    ]


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(["f", "g"]), st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4))
        ),
        min_size=1,
        max_size=3,
    ),
    data=st.data(),
)
def test_a_stream_cut_inside_an_announced_call_is_what_the_whole_reply_holds(calls, data):
    """Cut anywhere, in any pieces: when a call was announced, the stream's
    text is the text before the block, its calls are the whole reply's
    (:func:`cut_reply`), each ended once; else the stream is the text."""
    full = "Hm.\n" + T.render_calls(calls)
    text = full[: data.draw(st.integers(0, len(full) - 1))]
    sp = TS.StreamSplitter(frozenset({"f", "g"}))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=6))))
    events = [e for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True) for e in sp.feed(text[a:b])]
    events += sp.close([], length=True)
    streamed = "".join(e.text for e in events if e.kind == "text")
    got = cut_reply(TS.StreamSplitter(frozenset({"f", "g"})), text)
    if got is None:
        assert streamed == text and not [e for e in events if e.kind == "start"]
        return
    pre, cut = got
    assert streamed == pre == "Hm."
    names = {e.index: e.text for e in events if e.kind == "start"}
    args = {k: "".join(e.text for e in events if e.kind == "args" and e.index == k) for k in names}
    assert [(k, names[k], args[k]) for k in sorted(names)] == cut
    assert sorted(e.index for e in events if e.kind == "end") == sorted(names)
