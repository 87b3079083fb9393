"""Tool calls streamed as they are generated (issue 21, item 5): the
incremental call parser of :class:`ds4.server.tools.StreamSplitter` against
:func:`ds4.server.tools.parse_reply` (hypothesis: random call arrays, in the
canonical rendering and in others, split at random points), then chat
completions (official ``openai`` client) and Anthropic Messages (official
``anthropic`` client) over the scripted engine: a call's header (id, name)
arrives before its arguments, the arguments in several fragments that join
to exactly the non-streamed call's arguments, the streamed ids continue the
live state, parallel calls get indexes 0 and 1, text before a call comes
first, and a block that does not parse ends as the whole text, with no
``tool_calls`` finish."""

from __future__ import annotations

import itertools
import json

import anthropic
import pytest
from helpers.agents import ATOOLS, SYSTEM, TOOLS, warm_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4.server import tool_stream as TS
from ds4.server import tools as T

NAMES = frozenset({"lookup", "note", "read_file"})

# -- the incremental parser ----------------------------------------------------
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
    | st.sampled_from(["</tool_call>", 'a "q" \\ b', "\x00\x1f\t\n", "caf\u00e9 \U0001f600", "<", "\\u"])
)
_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8,
)
_calls = st.lists(
    st.tuples(st.sampled_from(sorted(NAMES)), st.dictionaries(st.text(max_size=5), _values, max_size=4)),
    min_size=1,
    max_size=3,
)


def _escape(body: str) -> str:
    return body.replace(T.CALL_END, "\\u003c/tool_call>")


def _block(calls, style: str) -> str:
    """A call block as a model might write it: canonical, or another JSON
    spelling of the same calls."""
    if style == "canonical":
        return T.render_calls(calls)
    objs = [{"name": n, "arguments": a} for n, a in calls]
    if style == "compact-ascii":
        body = json.dumps(objs, ensure_ascii=True, separators=(",", ":"))
    elif style == "indented":
        body = json.dumps(objs, ensure_ascii=False, indent=2)
    elif style == "args-first":
        body = json.dumps([{"arguments": a, "name": n} for n, a in calls])
    elif style == "quoted":  # the arguments as a JSON string
        body = json.dumps([{"name": n, "arguments": json.dumps(a)} for n, a in calls])
    else:  # a single object, no array
        body = json.dumps(objs[0])
    return T.CALL_START + _escape(body) + T.CALL_END


STYLES = ["canonical", "compact-ascii", "indented", "args-first", "quoted", "single"]


def _run(text: str, cuts: list[int], max_calls=None, names=NAMES):
    sp = TS.StreamSplitter(names, max_calls)
    live = []
    edges = sorted({0, *cuts, len(text)})
    for a, b in itertools.pairwise(edges):
        live += sp.feed(text[a:b])
    return sp, live


def _check_events(events, rep_content, calls):
    """The events say exactly the reply: its content, then each call once,
    its name, fragments joining to its arguments, its end."""
    assert "".join(e.text for e in events if e.kind == "text") == rep_content
    for k, c in enumerate(calls):
        mine = [(i, e) for i, e in enumerate(events) if e.index == k]
        kinds = [e.kind for _, e in mine]
        assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("start") == kinds.count("end") == 1
        assert mine[0][1].text == c.name
        assert "".join(e.text for _, e in mine if e.kind == "args") == c.arguments
    assert {e.index for e in events if e.kind != "text"} == set(range(len(calls)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=_calls, style=st.sampled_from(STYLES), pre=st.text(max_size=8), data=st.data())
def test_streamed_events_reassemble_to_the_parsed_calls(calls, style, pre, data):
    if style == "single":
        calls = calls[:1]
    text = (f"{pre}\n" if pre else "") + _block(calls, style)
    rep = T.parse_reply(text, NAMES)
    assert rep.calls and len(rep.calls) == len(calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    sp, live = _run(text, cuts)
    # the whole block was fed (its end marker too): every call went out live
    assert sum(e.kind == "end" for e in live) == len(calls)
    tail = sp.close([(c.name, c.arguments) for c in rep.calls])
    assert [e for e in tail if e.kind != "text"] == []
    _check_events(live + tail, rep.content, rep.calls)
    # no call is announced before its name is complete: each start follows the name's closing quote
    if style == "canonical":
        starts = [e for e in live if e.kind == "start"]
        assert [e.text for e in starts] == [n for n, _ in calls]


@settings(max_examples=200, deadline=None)
@given(calls=_calls, data=st.data())
def test_a_cut_block_ends_as_text_and_its_announced_fragments_are_honest(calls, data):
    """A block cut short (``max_tokens``) is no call: the calls already
    announced end, the text not yet shown follows, so the text events are
    the whole reply; every fragment sent was a prefix of the call's
    canonical arguments."""
    full = "Hm.\n" + T.render_calls(calls)
    text = full[: data.draw(st.integers(0, len(full) - 1))]
    rep = T.parse_reply(text, NAMES)
    assert not rep.calls
    sp, live = _run(text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    events = live + sp.close([])
    assert "".join(e.text for e in events if e.kind == "text") == text
    canon = T.parse_reply(full, NAMES).calls
    for k in {e.index for e in events if e.kind == "start"}:
        kinds = [e.kind for e in events if e.index == k]
        assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("end") == 1
        assert canon[k].arguments.startswith("".join(e.text for e in events if e.index == k and e.kind == "args"))


def test_a_call_starts_once_its_name_is_complete_and_declared():
    text = '<tool_call>[{"name": "lookup", "arguments": {"n": 3}}]</tool_call>'
    upto = text.index('"lookup"') + len('"lookup')
    sp, live = _run(text[:upto], [])
    assert live == []  # the name's closing quote is not there yet
    more = sp.feed('"')
    assert more == [TS.StreamEvent("start", "lookup", 0)]
    assert sp.feed(', "arguments": {"n') == [TS.StreamEvent("args", "{", 0)]  # the key waits for its end
    assert sp.feed('"') == [TS.StreamEvent("args", '"n": ', 0)]
    assert sp.feed(": 3") == []  # a number waits for its end
    assert sp.feed("}") == [TS.StreamEvent("args", "3}", 0)]
    # an undeclared name is never announced, and nothing after it
    sp, live = _run('<tool_call>[{"name": "rm_rf", "arguments": {"n": 3}}]</tool_call>', [5, 30])
    assert live == []
    assert sp.close([]) == [TS.StreamEvent("text", '<tool_call>[{"name": "rm_rf", "arguments": {"n": 3}}]</tool_call>')]


def test_without_parallel_calls_only_the_first_is_announced():
    text = T.render_calls([("lookup", {"n": 1}), ("note", {"text": "x"})])
    sp, live = _run(text, [7, 40], max_calls=1)
    assert {e.index for e in live} == {0}
    assert sp.close([("lookup", '{"n": 1}')]) == []


def test_duplicate_keys_are_not_a_call():
    """``{"a": 1, "a": 2}`` would stream ``"a": 1`` before its canonical
    form (``{"a": 2}``) is known: a generated call with duplicate keys is
    refused, streamed or not."""
    text = '<tool_call>[{"name": "note", "arguments": {"a": 1, "b": 2, "a": 3}}]</tool_call>'
    assert T.parse_reply(text, NAMES) == T.ParsedReply(text)
    sp, live = _run(text, [])
    frags = "".join(e.text for e in live if e.kind == "args")
    assert frags == '{"a": 1, "b": 2, '  # stopped at the duplicate key
    tail = sp.close([])
    assert tail == [TS.StreamEvent("end", "", 0), TS.StreamEvent("text", text)]


def test_the_scanner_is_as_strict_as_json_loads():
    """Blocks json.loads refuses are not streamed to the end; ones it
    accepts are, re-serialized."""
    for body, ok in [
        ('{"n": 01}', False),
        ('{"n": NaN}', True),
        ('{"n": -Infinity}', True),
        ('{"n": 1.0e2}', True),
        ('{"n": "\\x"}', False),
        ('{"n": "a\tb"}', False),  # a raw control character
        ('{"n": "\\ud83d\\ude00 \\ud83d x \\udc00"}', True),
        ('{"n": "\\ud800\\ud800\\udc00"}', True),
        ('{"n": [1,]}', False),
        ('{"n": tru}', False),
        ('{"n" 1}', False),
    ]:
        text = f'<tool_call>[{{"name": "note", "arguments": {body}}}]</tool_call>'
        rep = T.parse_reply(text, NAMES)
        assert bool(rep.calls) == ok, body
        for step in (1, 2, 5):
            sp, live = _run(text, list(range(0, len(text), step)))
            ends = [e for e in live if e.kind == "end"]
            assert bool(ends) == ok, (body, step)
            if ok:
                _check_events(live + sp.close([(c.name, c.arguments) for c in rep.calls]), "", rep.calls)


# -- servers -------------------------------------------------------------------
warm = pytest.fixture(scope="module", name="warm")(warm_server)


def chat_stream(srv, msgs, **kw):
    """The stream's events in order: ("text", s), ("start", index, id, name,
    arguments), ("args", index, fragment), ("finish", reason)."""
    ev: list[tuple] = []
    with srv.client() as c:
        for ch in c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True, **kw):
            for choice in ch.choices:
                d = choice.delta
                if d.content:
                    ev.append(("text", d.content))
                for tc in d.tool_calls or []:
                    if tc.id is not None:
                        assert tc.type == "function"
                        ev.append(("start", tc.index, tc.id, tc.function.name, tc.function.arguments))
                    else:
                        assert tc.function.name is None
                        ev.append(("args", tc.index, tc.function.arguments))
                if choice.finish_reason:
                    ev.append(("finish", choice.finish_reason))
    return ev


def chat_plain(srv, msgs, **kw):
    with srv.client() as c:
        return c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, **kw)


def _matches(srv, label):
    """How many requests continued from the live tool state by their results' ids."""
    return srv.text_log().count(f"{label} live continuation match=tool-output-ids")


def _frags(ev, k):
    return [e[2] for e in ev if e[0] == "args" and e[1] == k]


def _first(ev, kind, k=None):
    return next(i for i, e in enumerate(ev) if e[0] == kind and (k is None or e[1] == k))


def _last(ev, kind, k):
    return max(i for i, e in enumerate(ev) if e[0] == kind and e[1] == k)


@pytest.mark.parametrize("ask", ["Look up 7.", "ESCAPED note", "PREFACE look up 8."])
def test_chat_streams_the_call_live_and_its_id_continues(warm, ask):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
    whole = chat_plain(warm, msgs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    ev = chat_stream(warm, msgs)
    starts = [e for e in ev if e[0] == "start"]
    assert len(starts) == 1 and starts[0][1] == 0 and starts[0][3] == whole.message.tool_calls[0].function.name
    assert starts[0][4] == ""
    frags = _frags(ev, 0)
    assert len(frags) > 1, ev  # the arguments as they are generated, not one delta at the end
    assert "".join(frags) == whole.message.tool_calls[0].function.arguments
    assert _first(ev, "start") < _last(ev, "args", 0)  # name and id before the arguments end
    assert ev[-1] == ("finish", "tool_calls")
    text = "".join(e[1] for e in ev if e[0] == "text")
    assert text == (whole.message.content or "")
    if ask.startswith("PREFACE"):
        assert text == "Let me look that up." and _first(ev, "text") < _first(ev, "start")
    if ask.startswith("ESCAPED"):  # the model's \u escapes and compact spacing, re-serialized
        n = json.loads("".join(frags))["n"]
        assert "".join(frags) == f'{{"text": "caf\u00e9 \\"{n}\\"", "n": {n}}}'
    # the streamed id is the one the server knows: the result continues live
    cid = starts[0][2]
    assert cid.startswith("call_")
    call = {"id": cid, "type": "function", "function": {"name": starts[0][3], "arguments": "".join(frags)}}
    msgs += [
        {"role": "assistant", "content": text or None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": cid, "content": "42"},
    ]
    before = _matches(warm, "chat")
    r = chat_plain(warm, msgs)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Result: 42."
    assert _matches(warm, "chat") == before + 1  # the live calls' ids are the streamed ones
    assert r.model_extra["ds4"]["rung"] == "live", r.model_extra["ds4"]
    assert r.usage.prompt_tokens_details.cached_tokens >= 0.95 * r.usage.prompt_tokens


def test_chat_parallel_calls_stream_with_indexes_0_and_1(warm):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "TWO calls"}]
    whole = chat_plain(warm, msgs).choices[0].message.tool_calls
    ev = chat_stream(warm, msgs)
    starts = [e for e in ev if e[0] == "start"]
    assert [e[1] for e in starts] == [0, 1] and len({e[2] for e in starts}) == 2
    for k in (0, 1):
        assert len(_frags(ev, k)) > 1 and "".join(_frags(ev, k)) == whole[k].function.arguments
    assert _last(ev, "args", 0) < _first(ev, "start", 1)  # the second call starts after the first's arguments
    assert ev[-1] == ("finish", "tool_calls")
    msgs.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": e[2], "type": "function", "function": {"name": e[3], "arguments": "".join(_frags(ev, e[1]))}}
                for e in starts
            ],
        }
    )
    msgs += [{"role": "tool", "tool_call_id": e[2], "content": f"r{e[1]}"} for e in starts]
    before = _matches(warm, "chat")
    r = chat_plain(warm, msgs)
    assert r.model_extra["ds4"]["rung"] == "live" and r.choices[0].message.content == "Result: r1."
    assert _matches(warm, "chat") == before + 1
    # parallel_tool_calls=false: one call, live too
    ev = chat_stream(warm, msgs[:2], parallel_tool_calls=False)
    assert [e[1] for e in ev if e[0] == "start"] == [0] and {e[1] for e in ev if e[0] == "args"} == {0}
    one = chat_plain(warm, msgs[:2], parallel_tool_calls=False).choices[0].message.tool_calls
    assert len(one) == 1 and "".join(_frags(ev, 0)) == one[0].function.arguments and ev[-1] == ("finish", "tool_calls")


def test_chat_a_block_that_does_not_parse_ends_as_text(warm):
    """MALFORMED's block names a declared tool, then breaks: the call was
    announced (it cannot be taken back), its honest fragments stand, then
    the whole reply comes as content, as the non-stream reply's content,
    and the finish is ``stop``, not ``tool_calls``."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "MALFORMED please"}]
    whole = chat_plain(warm, msgs).choices[0]
    assert whole.finish_reason == "stop" and not whole.message.tool_calls
    ev = chat_stream(warm, msgs)
    assert [e[3] for e in ev if e[0] == "start"] == ["lookup"]
    assert "".join(_frags(ev, 0)) == '{"n": '
    assert "".join(e[1] for e in ev if e[0] == "text") == whole.message.content
    assert _first(ev, "text") > _first(ev, "start")
    assert ev[-1] == ("finish", "stop")


# -- Anthropic -------------------------------------------------------------------
def aclient(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)


def _aargs(msgs, **kw):
    return {"model": "claude-x", "max_tokens": 300, "system": SYSTEM, "messages": msgs, "tools": ATOOLS, **kw}


def anthropic_stream(srv, msgs, **kw):
    """(raw events in order, the SDK's accumulated final message)."""
    with aclient(srv) as c, c.messages.stream(**_aargs(msgs, **kw)) as s:
        events = [
            ev
            for ev in s
            if ev.type in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta")
        ]
        return events, s.get_final_message()


def _apart(events, index):
    return [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.index == index and e.delta.type == "input_json_delta"
    ]


@pytest.mark.parametrize("ask", ["Look up 4.", "PREFACE look up 5.", "TWO calls"])
def test_anthropic_streams_tool_use_live_and_its_id_continues(warm, ask):
    msgs = [{"role": "user", "content": ask}]
    with aclient(warm) as c:
        whole = c.messages.create(**_aargs(msgs))
    assert whole.stop_reason == "tool_use"
    events, final = anthropic_stream(warm, msgs)
    uses = [b for b in whole.content if b.type == "tool_use"]
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == len(uses) == (2 if ask == "TWO calls" else 1)
    for s, u in zip(starts, uses, strict=True):
        assert s.content_block.name == u.name and s.content_block.input == {}
        parts = _apart(events, s.index)
        assert len(parts) > 1, events
        assert "".join(parts) == json.dumps(u.input)  # the canonical arguments, as the whole reply's
        i_start = events.index(s)
        i_stop = next(i for i, e in enumerate(events) if e.type == "content_block_stop" and e.index == s.index)
        i_last = max(i for i, e in enumerate(events) if e.type == "content_block_delta" and e.index == s.index)
        assert i_start < i_last < i_stop
    if ask.startswith("PREFACE"):
        first = events[0]
        assert first.type == "content_block_start" and first.content_block.type == "text" and first.index == 0
        assert [s.index for s in starts] == [1]
        assert final.content[0].text == whole.content[0].text == "Let me look that up."
    else:
        assert [s.index for s in starts] == list(range(len(uses)))
    assert events[-1].type == "message_delta" and events[-1].delta.stop_reason == "tool_use"
    # the SDK accumulated the same message (the input parsed from the fragments), ids streamed
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content
    ]
    ids = [s.content_block.id for s in starts]
    assert [b.id for b in final.content if b.type == "tool_use"] == ids and all(i.startswith("toolu_") for i in ids)
    msgs = [
        *msgs,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": i, "content": f"r{k}"} for k, i in enumerate(ids)],
        },
    ]
    before = _matches(warm, "anthropic")
    with aclient(warm) as c:
        r = c.messages.create(**_aargs(msgs))
    assert r.stop_reason == "end_turn" and r.content[0].text == f"Result: r{len(ids) - 1}."
    assert _matches(warm, "anthropic") == before + 1  # the live calls' ids are the streamed ones
    assert r.model_extra["ds4"]["rung"] == "live", r.model_extra["ds4"]  # the streamed ids matched the live calls
    assert r.usage.cache_read_input_tokens > r.usage.cache_creation_input_tokens, r.usage


def test_anthropic_a_block_that_does_not_parse_ends_as_text(warm):
    msgs = [{"role": "user", "content": "MALFORMED please"}]
    with aclient(warm) as c:
        whole = c.messages.create(**_aargs(msgs))
    assert whole.stop_reason == "end_turn" and [b.type for b in whole.content] == ["text"]
    events, final = anthropic_stream(warm, msgs)
    kinds = [(e.type, e.index) for e in events if e.type != "message_delta"]
    assert kinds[0] == ("content_block_start", 0) and events[0].content_block.type == "tool_use"
    assert "".join(_apart(events, 0)) == '{"n": '
    assert ("content_block_stop", 0) in kinds and ("content_block_start", 1) in kinds
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == whole.content[0].text
    assert events[-1].delta.stop_reason == "end_turn"
    assert final.stop_reason == "end_turn" and final.content[-1].text == whole.content[0].text
