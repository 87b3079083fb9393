"""Reasoning-visible turns (issue 21, item 3): a reply's ``<think>…</think>``
is chat's ``reasoning_content``, an Anthropic ``thinking`` block and a
Responses ``reasoning`` item (whole and streamed); history reasoning is
rendered as the chat template renders it; after a reasoning turn the live
state is the rendering the next request holds, so the next turn is a live
hit.

Two scripted servers (tests/helpers/scripted_engine.py, whose ``THINK`` turns
reason): one renders with the reference engine's ChatML, which keeps
reasoning in every turn (a client that sends it back hits the live state;
one that strips it diverges at the ``<think>``, reported in
``ds4.divergence``), one with a Qwen3-like Jinja template, which drops it
from the turns before the last user message (both clients hit the live
state, which was canonicalized to the stripped form)."""

from __future__ import annotations

import anthropic
import pytest
from helpers.agents import KV_FLAGS, ScriptedServer

from ds4.server.reasoning import ReasoningSplitter, split_reasoning

SYSTEM = "You reason. " + " ".join(f"rule-{i}: think first." for i in range(30))


# -- the split -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nabc\n</think>\n\nHello.", False, ("abc", "Hello.", True)),
        ("  <think>x</think>y", False, ("x", "y", True)),
        ("<think>\n a b \n", False, ("a b", "", False)),  # cut inside the reasoning
        ("plain <think>x</think>", False, (None, "plain <think>x</think>", False)),
        ("x\n</think>\n\ny", True, ("x", "y", True)),  # the prompt opened it
        ("<thi", False, (None, "<thi", False)),
    ],
)
def test_split_and_the_stream_splitter_agree(text, opened, want):
    sp = split_reasoning(text, opened)
    assert (sp.reasoning, sp.content, sp.closed) == want
    for cut in range(1, 9):
        s = ReasoningSplitter(opened)
        pieces = [s.push(text[i : i + cut]) for i in range(0, len(text), cut)] + [s.finish()]
        r, c = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        assert (r if s.has_reasoning else None, c) == (sp.reasoning, sp.content), cut
        # no content before the reasoning is over
        first_c = next((i for i, p in enumerate(pieces) if p[1]), len(pieces))
        assert not any(p[0] for p in pieces[first_c + 1 :]), cut


def test_next_turn_prefix_ends_where_the_assistant_turn_does():
    """The rendering every next request starts with: the reply as an
    earlier turn, up to its end-of-turn (not the next turn's opening)."""
    from types import SimpleNamespace

    from helpers.scripted_engine import QWEN3_LIKE, ScriptedEngine

    from ds4.engines.chat_template import render_gemma
    from ds4.server.conversation import next_turn_prefix

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    gemma = next_turn_prefix(SimpleNamespace(render_chat=lambda m, g=True, kw=None: render_gemma(m, g)), msgs)
    assert str(gemma) == "<bos><start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\na<end_of_turn>\n"
    qwen = next_turn_prefix(ScriptedEngine(template=QWEN3_LIKE), msgs)
    assert str(qwen) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    chatml = next_turn_prefix(ScriptedEngine(), msgs)
    assert str(chatml) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\na<|im_end|>\n"


# -- servers -------------------------------------------------------------------
@pytest.fixture(scope="module")
def chatml(serve_module):
    return serve_module(*KV_FLAGS, name="chatml", cls=ScriptedServer, kv=True)


@pytest.fixture(scope="module")
def qwen(serve_module):
    return serve_module(*KV_FLAGS, name="qwen", cls=ScriptedServer, kv=True, env={"DS4_SCRIPTED_TEMPLATE": "qwen3"})


def _tail(text: str) -> int:
    """The tokens a new user turn and the generation prompt add (the byte
    tokenizer: one per byte, one per marker: three, and a newline)."""
    return 4 + len(f"user\n{text}") + len("assistant\n")


def chat(srv, messages, stream=False, **kw):
    """(reasoning, content, finish, usage, ds4 block) of one chat turn."""
    with srv.client() as c:
        if not stream:
            r = c.chat.completions.create(model="m", messages=messages, **kw)
            m = r.choices[0].message
            extra = m.model_extra or {}
            return extra.get("reasoning_content"), m.content, r.choices[0].finish_reason, r.usage, r.model_extra["ds4"]
        kinds, reasoning, content, finish, usage = [], "", "", None, None
        for ch in c.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}, **kw
        ):
            usage = ch.usage or usage
            for choice in ch.choices:
                d = choice.delta
                r_part = (d.model_extra or {}).get("reasoning_content")
                if r_part:
                    kinds.append("r")
                    reasoning += r_part
                if d.content:
                    kinds.append("c")
                    content += d.content
                finish = choice.finish_reason or finish
        assert kinds == sorted(kinds, key=lambda k: k == "c") and "r" in kinds, kinds  # reasoning first
        return reasoning, content, finish, usage, None


def test_chat_reasoning_field_whole_streamed_and_cut(chatml):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "THINK about it"}]
    reasoning, content, finish, _, x = chat(chatml, msgs)
    n = int(content.removeprefix("The answer is ").rstrip("."))
    assert reasoning == f"Thinking about {n}." and content == f"The answer is {n}." and finish == "stop", x
    assert chat(chatml, msgs, stream=True)[:3] == (reasoning, content, "stop")
    # max_tokens inside the reasoning: all reasoning, no content, finish length
    cut = chat(chatml, msgs, max_tokens=15)
    assert cut[:3] == ("Thinkin", "", "length")
    # no THINK: no reasoning field at all
    assert chat(chatml, [{"role": "user", "content": "hi"}])[0] is None


@pytest.mark.parametrize("stream", [False, True])
def test_chatml_sent_back_is_a_live_hit_and_stripped_reports_the_divergence(chatml, stream):
    """ChatML keeps reasoning in earlier turns: sent back, the whole previous
    turn is served from the live state; stripped, the prompt leaves the live
    state at its ``<think>`` (the divergence block says so)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"THINK {stream}"}]
    reasoning, content, _, u1, _ = chat(chatml, msgs, stream=stream)
    nxt = "and then?"
    back = [*msgs, {"role": "assistant", "content": content, "reasoning_content": reasoning}]
    back.append({"role": "user", "content": nxt})
    _, _, _, u2, x = chat(chatml, back)
    assert x["rung"] == "live", x
    assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens - _tail(nxt), (u1, u2)
    assert u2.prompt_tokens_details.cached_tokens > u1.prompt_tokens + u1.completion_tokens

    chat(chatml, msgs, stream=stream)  # the live state: that turn again
    stripped = [*msgs, {"role": "assistant", "content": content}, {"role": "user", "content": nxt}]
    x = chat(chatml, stripped)[4]
    d = x["divergence"]
    assert x["rung"] != "live" and d["against"] == "live", x
    assert d["cached"].startswith("<think>") and d["prompt"].startswith("The answer is"), d


@pytest.mark.parametrize("stream", [False, True])
def test_qwen_template_both_clients_hit_live(qwen, stream):
    """A template that drops reasoning from earlier turns renders both
    clients' next requests alike; the live state was canonicalized to that
    rendering, so each is a live hit covering the whole previous turn."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"THINK qwen {stream}"}]
    for form in ("back", "stripped"):
        reasoning, content, _, u1, _ = chat(qwen, msgs, stream=stream)
        assert reasoning.startswith("Thinking about") and content.startswith("The answer is")
        turn = {"role": "assistant", "content": content}
        if form == "back":
            turn["reasoning_content"] = reasoning
        nxt = f"more, {form}"
        _, _, _, u2, x = chat(qwen, [*msgs, turn, {"role": "user", "content": nxt}])
        assert x["rung"] == "live", (form, x)
        assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens - _tail(nxt), (form, u1, u2)
    log = qwen.text_log()
    assert "tool checkpoint canonicalized" in log or "tool checkpoint rebuild done" in log


# -- Anthropic -----------------------------------------------------------------
def aclient(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=120)


def amessages(srv, messages, stream=False, **kw):
    args = {"model": "claude-x", "max_tokens": 300, "system": SYSTEM, "messages": messages, **kw}
    with aclient(srv) as c:
        if not stream:
            return c.messages.create(**args), None
        with c.messages.stream(**args) as s:
            events = [(ev.type, getattr(getattr(ev, "delta", None), "type", None)) for ev in s]
            return s.get_final_message(), events


@pytest.mark.parametrize("srv_name", ["chatml", "qwen"])
def test_anthropic_thinking_block_and_live_hits(request, srv_name):
    srv = request.getfixturevalue(srv_name)
    msgs = [{"role": "user", "content": f"THINK in anthropic {srv_name}"}]
    r, _ = amessages(srv, msgs)
    assert [b.type for b in r.content] == ["thinking", "text"], r.content
    think, text = r.content
    assert think.thinking.startswith("Thinking about") and think.signature and text.text.startswith("The answer is")
    s, events = amessages(srv, msgs, stream=True)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in s.content] == [
        ("thinking", think.thinking),
        ("text", text.text),
    ]
    deltas = [d for k, d in events if k == "content_block_delta"]
    assert deltas.index("signature_delta") > deltas.index("thinking_delta")
    assert deltas.index("text_delta") > deltas.index("signature_delta")
    nxt = "and?"
    sent = {"type": "thinking", "thinking": think.thinking, "signature": think.signature}
    for content in ([sent, {"type": "text", "text": text.text}], [{"type": "text", "text": text.text}]):
        amessages(srv, msgs)  # the live state: the first turn
        r2, _ = amessages(srv, [*msgs, {"role": "assistant", "content": content}, {"role": "user", "content": nxt}])
        u = r2.usage
        total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        live = r2.model_extra["ds4"]
        if len(content) == 2 or srv_name == "qwen":  # sent back; or stripped where the template drops it
            assert live["rung"] == "live" and u.cache_read_input_tokens == total - _tail(nxt), (content, live, u)
        else:
            assert live["rung"] != "live" and live["divergence"]["cached"].startswith("<think>"), live


# -- Responses -----------------------------------------------------------------
@pytest.mark.parametrize("srv_name", ["chatml", "qwen"])
def test_responses_reasoning_item_and_live_hits(request, srv_name):
    srv = request.getfixturevalue(srv_name)
    with srv.client() as c:
        inp = [{"role": "user", "content": f"THINK in responses {srv_name}"}]
        r = c.responses.create(model="m", instructions=SYSTEM, input=inp)
        assert [o.type for o in r.output] == ["reasoning", "message"], r.output
        rs, msg = r.output
        assert rs.id == "rs_" + msg.id.removeprefix("msg_") and rs.summary[0].text.startswith("Thinking about")
        assert r.output_text.startswith("The answer is")
        events = list(c.responses.create(model="m", instructions=SYSTEM, input=inp, stream=True))
        kinds = [e.type for e in events]
        assert kinds.index("response.reasoning_summary_text.delta") < kinds.index("response.output_text.delta")
        final = events[-1].response
        assert [o.type for o in final.output] == ["reasoning", "message"]
        assert final.output[0].summary[0].text == rs.summary[0].text and final.output_text == r.output_text
        got = c.responses.retrieve(final.id)
        assert got.output[0].summary[0].text == rs.summary[0].text
        nxt = "go on"
        # previous_response_id (the stored reasoning), the items sent back, and the items stripped of it
        items = [o.model_dump(exclude_none=True) for o in final.output]
        for form, kw in (
            ("previous", {"previous_response_id": final.id, "input": nxt}),
            ("back", {"input": [*inp, *items, {"role": "user", "content": nxt}]}),
            ("stripped", {"input": [*inp, items[1], {"role": "user", "content": nxt}]}),
        ):
            c.responses.create(model="m", instructions=SYSTEM, input=inp)  # the live state: the first turn
            r2 = c.responses.create(model="m", instructions=SYSTEM, **kw)
            x, u = r2.model_extra["ds4"], r2.usage
            if form != "stripped" or srv_name == "qwen":
                assert x["rung"] == "live", (form, x)
                assert u.input_tokens_details.cached_tokens == u.input_tokens - _tail(nxt), (form, u)
            else:
                assert x["rung"] != "live" and x["divergence"]["cached"].startswith("<think>"), (form, x)
