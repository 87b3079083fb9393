"""Tool calls in ``/v1/chat/completions`` (issue 9, items 1 and 3): the
convention (ds4.server.tools) on its own, then agent loops with the official
``openai`` client against servers over the scripted reference engine
(tests/helpers/scripted_engine.py): every reply equals a cold server's, and from the
second turn on at least 95 % of each prompt is served from the cache."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from helpers.agents import KV_FLAGS, SYSTEM, TOOLS, ScriptedServer, cold_answer, cold_server, warm_server

from ds4.server import tool_stream as TS
from ds4.server import tools as T
from ds4.server.conversation import Conversation, Message, Tool
from ds4.turn import GenParams


# -- the convention ------------------------------------------------------------
def test_parse_reply_calls_content_and_malformed_text():
    names = frozenset({"lookup", "note"})
    r = T.parse_reply('Let me see.\n<tool_call>[{"name": "lookup", "arguments": {"n": 3}}]</tool_call>', names)
    assert r.content == "Let me see." and [(c.name, json.loads(c.arguments)) for c in r.calls] == [("lookup", {"n": 3})]
    two = T.parse_reply(
        '<tool_call>[{"name":"lookup","arguments":{"n":1}},{"name":"note","arguments":"{}"}]</tool_call>'
    )
    assert [c.name for c in two.calls] == ["lookup", "note"] and two.calls[1].arguments == "{}"
    one = T.parse_reply('<tool_call>{"name": "note", "arguments": {"text": "a"}}</tool_call>', names)
    assert one.calls[0].name == "note"
    for bad in (
        '<tool_call>[{"name": "lookup", "arguments": {"n": </tool_call>',  # not JSON
        '<tool_call>[{"name": "rm_rf", "arguments": {}}]</tool_call>',  # undeclared tool
        '<tool_call>[{"name": "lookup", "arguments": [1]}]</tool_call>',  # arguments not an object
        '<tool_call>[{"name": "lookup", "arguments": {}}]',  # unclosed
        '<tool_call>[{"name": "lookup", "arguments": {}}]</tool_call> and more',  # text after the block
        "<tool_call>[]</tool_call>",
    ):
        assert T.parse_reply(bad, names) == T.ParsedReply(bad), bad
    assert T.parse_reply("plain text", names) == T.ParsedReply("plain text")


def test_canonical_rendering_round_trips_and_escapes_its_own_tags():
    block = T.render_calls([("note", '{"text":"a </tool_call> b","z":1,"a":2}')])
    assert (
        block
        == '<tool_call>[{"name": "note", "arguments": {"text": "a \\u003c/tool_call> b", "z": 1, "a": 2}}]</tool_call>'
    )
    r = T.parse_reply(block, frozenset({"note"}))
    assert json.loads(r.calls[0].arguments) == {"text": "a </tool_call> b", "z": 1, "a": 2}
    # the canonical form does not depend on the client's spacing
    assert T.render_calls([("note", '{ "z" : 1 }')]) == T.render_calls([("note", {"z": 1})])
    assert T.render_calls([("note", "not json")]).startswith('<tool_call>[{"name": "note", "arguments": "not json"}')
    assert T.render_results(["x </tool_response> y"]) == "<tool_response>\nx &lt;/tool_response> y\n</tool_response>"


@pytest.mark.parametrize("cut", range(1, 12))
def test_stream_splitter_holds_back_the_block_and_agrees_with_the_parser(cut):
    text = 'Looking.\n<tool_call>[{"name": "lookup", "arguments": {"n": 3}}]</tool_call>'
    sp = TS.StreamSplitter(frozenset({"lookup"}))
    shown = "".join(sp.push(text[i : i + cut]) for i in range(0, len(text), cut))
    rep, rest = sp.finish()
    assert shown + rest == "Looking." and rep == T.parse_reply(text, frozenset({"lookup"}))
    bad = "Hm <tool_call>[oops]</tool_call>"
    sp = TS.StreamSplitter(frozenset({"lookup"}))
    shown = "".join(sp.push(bad[i : i + cut]) for i in range(0, len(bad), cut))
    rep, rest = sp.finish()
    assert shown + rest == bad and not rep.calls  # not a call: every byte is content


class _ByteTokenizer:
    """A byte-level tokenizer for llguidance (256 bytes + an end token)."""

    def __init__(self):
        self.eos_token_id, self.bos_token_id = 256, None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, s):
        return list(s) if isinstance(s, bytes) else list(s.encode())


def _accepts(grammar: str, text: str) -> bool:
    import llguidance

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar))
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def test_tool_call_grammar_accepts_exactly_the_canonical_calls_it_allows():
    fns = [t["function"] for t in TOOLS]
    required, named = T.tool_call_grammar(fns, "required"), T.tool_call_grammar(fns, "note")
    assert _accepts(required, T.render_calls([("lookup", {"n": 3})]))
    assert _accepts(required, T.render_calls([("lookup", {"n": 3}), ("note", {"text": "hi"})]))
    assert not _accepts(required, T.render_calls([("lookup", {"n": "three"})]))  # against the schema
    assert not _accepts(required, "plain text")
    assert _accepts(named, T.render_calls([("note", {"text": "a"})]))
    assert not _accepts(named, T.render_calls([("lookup", {"n": 3})]))  # not the named tool


def test_one_call_only_when_parallel_calls_are_off():
    fns = [t["function"] for t in TOOLS]
    single = T.tool_call_grammar(fns, "required", parallel=False)
    assert _accepts(single, T.render_calls([("lookup", {"n": 3})]))
    assert not _accepts(single, T.render_calls([("lookup", {"n": 3}), ("note", {"text": "hi"})]))


@pytest.mark.parametrize("choice", ["required", "note"])
def test_a_forced_call_renders_the_prompt_of_an_unforced_one(choice):
    """The tool choice is the grammar's work, not the prompt's: an agent that
    forces a call, then sends the result with ``auto``, keeps one prompt
    (and its cache), and a resumed reply is a cold one."""
    tools = [Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in TOOLS]
    msgs = [Message("system", SYSTEM), Message("user", "Look up 7.")]
    forced = Conversation(msgs, tools, choice).engine_messages()
    assert forced == Conversation(msgs, tools, "auto").engine_messages()
    assert Conversation(msgs, tools, choice).gen_params(GenParams(max_tokens=8)).constraint is not None


# -- servers -------------------------------------------------------------------
cold = pytest.fixture(scope="module", name="cold")(cold_server)
warm = pytest.fixture(scope="module", name="warm")(warm_server)


def ask(srv, messages, stream=False, **kw):
    """One chat turn: (message dict to append, finish_reason, usage, ds4 block)."""
    with srv.client() as c:
        return _ask(c, messages, stream, kw)


def _ask(c, messages, stream, kw):
    if not stream:
        r = c.chat.completions.create(model="agent-x", messages=messages, tools=TOOLS, **kw)
        m = r.choices[0].message
        msg = {"role": "assistant", "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": t.id,
                    "type": "function",
                    "function": {"name": t.function.name, "arguments": t.function.arguments},
                }
                for t in m.tool_calls
            ]
        return msg, r.choices[0].finish_reason, r.usage, (r.model_extra or {}).get("ds4")
    content, calls, finish, usage = "", {}, None, None
    for ch in c.chat.completions.create(
        model="agent-x", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                cur = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = tc.id or cur["id"]
                if tc.function is not None:
                    cur["name"] += tc.function.name or ""
                    cur["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    return msg, finish, usage, None


def strip_ids(msg):
    out = dict(msg)
    if "tool_calls" in out:
        out["tool_calls"] = [{**t, "id": None} for t in out["tool_calls"]]
    return out


def result_for(msg):
    return [
        {"role": "tool", "tool_call_id": t["id"], "content": f"value of {t['function']['arguments']} is 42"}
        for t in msg["tool_calls"]
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_ten_turn_tool_loop_is_cached_and_matches_a_cold_server(warm, cold, stream):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Look up 7 ({stream})."}]
    for turn in range(10):
        msg, finish, usage, _ = ask(warm, msgs, stream=stream)
        cold_msg, cold_finish = cold_answer(ask, cold, msgs)
        assert strip_ids(msg) == strip_ids(cold_msg) and finish == cold_finish, turn
        if turn:
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached >= 0.95 * usage.prompt_tokens, (turn, cached, usage.prompt_tokens)
        msgs.append(msg)
        if finish == "tool_calls":
            assert msg["tool_calls"] and msg["content"] == ""
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]).keys() == {"n"}
            msgs += result_for(msg)
        else:
            assert finish == "stop" and msg["content"].startswith("Result: value of")
            msgs.append({"role": "user", "content": f"Now look up {turn}."})
    assert "tool checkpoint" in warm.text_log()


def test_malformed_call_text_is_content_and_unknown_ids_render_in_full(warm, cold):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "MALFORMED please"}]
    msg, finish, _, _ = ask(warm, msgs)
    assert finish == "stop" and "tool_calls" not in msg and msg["content"].startswith("<tool_call>[")
    # results for ids this server never generated: the whole history is rendered
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look up 5."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_elsewhere", "type": "function", "function": {"name": "lookup", "arguments": '{"n":5}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_nobody_made", "content": "five"},
    ]
    msg, finish, _, _ = ask(warm, msgs)
    assert finish == "stop" and msg["content"] == "Result: five." == cold_answer(ask, cold, msgs)[0]["content"]


def test_non_canonical_call_is_rebuilt_and_the_next_turn_is_a_live_hit(warm, cold):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "COMPACT call"}]
    msg, finish, _, _ = ask(warm, msgs)
    assert finish == "tool_calls"
    log = warm.text_log()
    assert "reason=canonical-tail-rewrite" in log and "tool checkpoint rebuild done source=" in log
    msgs += [msg, *result_for(msg)]
    msg2, finish2, usage, x = ask(warm, msgs)
    assert finish2 == "stop" and x["rung"] == "live"
    assert usage.prompt_tokens_details.cached_tokens >= 0.95 * usage.prompt_tokens
    assert strip_ids(msg2) == strip_ids(cold_answer(ask, cold, msgs)[0])


def test_parallel_calls_tool_choice_none_and_validation(warm):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "TWO calls"}]
    msg, finish, _, _ = ask(warm, msgs)
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 2
    assert len({t["id"] for t in msg["tool_calls"]}) == 2
    msg, finish, _, _ = ask(warm, msgs, parallel_tool_calls=False)
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1
    msg, finish, _, _ = ask(warm, msgs, tool_choice="none")  # no tools described: no call
    assert finish == "stop" and msg["content"] == "Hello from the script."
    # forced (a grammar constraint): the call block, canonical, so the live state needs no rebuild
    msg, finish, _, _ = ask(warm, msgs, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert finish == "tool_calls" and {t["function"]["name"] for t in msg["tool_calls"]} == {"lookup"}
    msg, finish, _, _ = ask(warm, msgs, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1
    for bad in (
        {"tool_choice": {"type": "function", "function": {"name": "missing"}}},
        {"tool_choice": "sometimes"},
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        {
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
        },
    ):
        body = {"model": "m", "messages": msgs, "tools": TOOLS, **bad}
        r = httpx.post(warm.base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)


def test_killed_mid_loop_the_next_turn_is_served_from_disk(tmp_path, serve, cold):
    kv = str(tmp_path / "kv")
    srv = serve("--kv-disk-dir", kv, *KV_FLAGS, name="a", cls=ScriptedServer, tmp=tmp_path)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Look up 9."}]
    try:
        msg, _, _, _ = ask(srv, msgs)
        msgs += [msg, *result_for(msg)]
    finally:
        srv.stop(signal.SIGKILL)  # no shutdown save: what is on disk was saved on the way
    srv2 = serve("--kv-disk-dir", kv, *KV_FLAGS, name="b", cls=ScriptedServer, tmp=tmp_path)
    msg2, _, usage, x = ask(srv2, msgs)
    srv2.stop()
    assert x["rung"] == "disk" and usage.prompt_tokens_details.cached_tokens > 0, x
    assert strip_ids(msg2) == strip_ids(cold_answer(ask, cold, msgs)[0])


def test_smollm2_tool_conversation_streams_and_continues_live(tmp_path, serve):
    """The one SmolLM2 tool loop: the call is forced (``tool_choice``
    ``required``: SmolLM2 never calls a tool on its own), streamed through
    the call splitter as BPE pieces, and equals a cold server's; the call is
    left in its canonical rendering, so the next request (the call echoed,
    its result added) continues from the live state, with the cold
    server's answer."""
    import llama_cpp  # noqa: F401  (CI installs it; this test must not be skipped)

    kv = str(tmp_path / "kv")
    warm = serve(
        "--kv-disk-dir", kv, "--threads", "2", name="w", cls=ScriptedServer, tmp=tmp_path, engine="llamacpp", ctx=2048
    )
    cold = serve(
        "--no-kv-cache", "--threads", "2", name="c", cls=ScriptedServer, tmp=tmp_path, engine="llamacpp", ctx=2048
    )
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris? Use a tool if you need one."},
    ]
    kw = {"max_tokens": 64, "tool_choice": "required"}
    first, finish, _, _ = ask(warm, msgs, stream=True, **kw)
    cold.reset()
    cold_first, cold_finish, u1, _ = ask(cold, msgs, **kw)
    assert finish == "tool_calls" and first["tool_calls"], first
    assert strip_ids(first) == strip_ids(cold_first) and finish == cold_finish
    msgs += [first, *result_for(first)]
    second, _, usage, x = ask(warm, msgs, max_tokens=12)
    # the whole first request and its call came from the live state; only the result turn was prefilled
    assert x["rung"] == "live" and usage.prompt_tokens_details.cached_tokens >= u1.total_tokens, (x, u1, usage)
    assert strip_ids(second) == strip_ids(cold_answer(ask, cold, msgs, max_tokens=12)[0])
