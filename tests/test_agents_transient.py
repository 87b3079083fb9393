"""Transient spans inside user and tool messages: agents inject per-turn
text into their messages (Claude Code's ``<system-reminder>`` blocks,
Cline's ``<environment_details>``) and drop it from older messages on the
next request. ``--prompt-transient-builtin`` takes the known clients' spans
out before rendering (``drop``, the default, or ``tail``: the current
request's own spans after the last message, where the model sees them); every
turn from the second is then a live hit that prefills at most 5 % of its
prompt. Without it the history no longer starts with what was prefilled,
and the divergence names the span. The official ``anthropic`` and
``openai`` clients, servers over the scripted reference engine."""

from __future__ import annotations

import anthropic
import openai
import pytest
from helpers.agents import ATOOLS, KV_FLAGS, ScriptedServer
from helpers.cc_loop import echoed

from ds4.server.conversation import Message, turns
from ds4.server.volatile import BUILTIN_TRANSIENT, SystemText

#: a long system text, as an agent's is
SYSTEM = "You are an agent. Use the tools to answer.\n" + "\n".join(
    f"rule-{i}: be exact and brief." for i in range(150)
)
CTX = 16384


@pytest.fixture(scope="module")
def plain(serve_module):
    return serve_module(*KV_FLAGS, name="plain", cls=ScriptedServer, kv=True, ctx=CTX)


@pytest.fixture(scope="module", params=["drop", "tail"])
def builtin(serve_module, request):
    flags = ("--prompt-transient-builtin", "--prompt-transient-mode", request.param)
    srv = serve_module(*KV_FLAGS, *flags, name=f"builtin-{request.param}", cls=ScriptedServer, kv=True, ctx=CTX)
    yield srv
    srv.stop()  # before the next mode's server starts


def reminder(k: int) -> str:
    return f"<system-reminder>\nTodo list changed at step {k}: {'x' * (k % 5)}\n</system-reminder>"


def _strip_reminders(msgs: list[dict]) -> list[dict]:
    """What Claude Code sends for older messages: their reminder blocks gone."""
    out = []
    for m in msgs:
        c = m["content"]
        if isinstance(c, list):
            c = [b for b in c if not (b.get("type") == "text" and b["text"].startswith("<system-reminder>"))]
            c = [
                {**b, "content": [x for x in b["content"] if not x["text"].startswith("<system-reminder>")]}
                if b.get("type") == "tool_result" and isinstance(b.get("content"), list)
                else b
                for b in c
            ]
        out.append({**m, "content": c})
    return out


def cc_loop(srv, turns: int = 6, beside: bool = False) -> list[dict]:
    """A Claude-Code-shaped tool loop: a fresh reminder in every user
    message and tool result, the older ones dropped. Each turn's ds4 block
    and usage. ``beside``: the reminder as a text block after the tool
    results (Claude Code's shape), not inside a result's content."""
    history: list[dict] = []
    pending = {
        "role": "user",
        "content": [{"type": "text", "text": reminder(0)}, {"type": "text", "text": "Look up 5."}],
    }
    out = []
    with anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=300) as c:
        for k in range(turns):
            msgs = [*_strip_reminders(history), pending]
            r = c.messages.create(model="claude-x", max_tokens=300, system=SYSTEM, messages=msgs, tools=ATOOLS)
            u = r.usage
            out.append({**r.model_extra["ds4"], "prompt": u.cache_read_input_tokens + u.cache_creation_input_tokens})
            history = [*msgs, {"role": "assistant", "content": echoed(r.content)}]
            if r.stop_reason == "tool_use":
                inside = [] if beside else [{"type": "text", "text": reminder(k + 1)}]
                blocks = [
                    {
                        "type": "tool_result",
                        "tool_use_id": b.id,
                        "content": [{"type": "text", "text": f"value of n={b.input['n']} is 42"}, *inside],
                    }
                    for b in r.content
                    if b.type == "tool_use"
                ]
                after = [{"type": "text", "text": reminder(k + 1)}] if beside else []
                pending = {"role": "user", "content": blocks + after}
            else:
                text = [{"type": "text", "text": reminder(k + 1)}, {"type": "text", "text": f"And {k}?"}]
                pending = {"role": "user", "content": text}
    return out


def env(k: int) -> str:
    return (
        f"<environment_details>\n# Current Time\n2026-12-07 00:{k:02d}:13\n"
        f"# Current Working Directory Files\nsrc/main.py\nsrc/util_{k}.py\n</environment_details>"
    )


def cline_loop(srv, turns: int = 5) -> list[dict]:
    """A Cline-shaped chat: every user message ends with an
    ``<environment_details>`` block (a clock, a file list), removed from
    older messages by the client."""
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    out = []
    with openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        for k in range(turns):
            ask = {"role": "user", "content": f"<task>\nStep {k}: explain it.\n</task>\n\n{env(k)}"}
            r = c.chat.completions.create(model="m", messages=[*msgs, ask], max_tokens=8, temperature=0)
            u = r.usage
            out.append(
                {**r.model_extra["ds4"], "prompt": u.prompt_tokens, "cached": u.prompt_tokens_details.cached_tokens}
            )
            plain_ask = {"role": "user", "content": f"<task>\nStep {k}: explain it.\n</task>"}
            msgs += [plain_ask, {"role": "assistant", "content": r.choices[0].message.content}]
    return out


@pytest.mark.parametrize("beside", [False, True], ids=["in-result", "beside-results"])
def test_claude_code_reminders_are_live_hits_with_the_builtins(builtin, beside):
    turns = cc_loop(builtin, beside=beside)
    for k, t in enumerate(turns[1:], 1):
        assert t["rung"] == "live", (k, t)
        assert t["prompt"] - t["reused_tokens"] <= 0.05 * t["prompt"], (k, t)


def test_cline_environment_details_are_live_hits_with_the_builtins(builtin):
    turns = cline_loop(builtin)
    for k, t in enumerate(turns[1:], 1):
        assert t["rung"] == "live", (k, t)
        assert t["prompt"] - t["cached"] <= 0.05 * t["prompt"], (k, t)


def test_without_the_builtins_the_divergence_names_the_span(plain):
    turns = cline_loop(plain, turns=3)
    for k, t in enumerate(turns[1:], 1):
        d = t["divergence"]
        assert d is not None and d["span"] == "<environment_details>", (k, d)
        assert t["prompt"] - t["cached"] > 0.05 * t["prompt"] or t["rung"] != "live", (k, t)
    turns = cc_loop(plain, turns=3)
    assert any((t["divergence"] or {}).get("span") == "<system-reminder>" for t in turns[1:]), turns


def test_the_spans_leave_with_their_white_space_and_the_current_ones_go_to_the_tail():
    st = SystemText(transient=BUILTIN_TRANSIENT, transient_mode="tail")
    msgs = [
        Message("system", "S"),
        Message("user", f"{reminder(1)}\nFirst.\n\n{env(1)}"),
        Message("assistant", "Done."),
        Message("tool", f"result 42\n\n{reminder(2)}\n\nmore", tool_call_id="c1"),
        Message("user", f"Second.\n\n{env(2)}"),
    ]
    out, spans = st.strip_messages(msgs)
    assert [m.content for m in out] == ["S", "First.", "Done.", "result 42\n\nmore", "Second."]
    assert spans == [reminder(2), env(2)]  # the current request's own, in their order
    assert out[3].tool_call_id == "c1" and msgs[1].content.startswith("<system-reminder>")  # a copy
    stable, tail = st.split(turns(out), spans)
    assert tail == {"role": "system", "content": f"{reminder(2)}\n\n{env(2)}"}
    drop = SystemText(transient=BUILTIN_TRANSIENT)  # drop: the default
    assert drop.split(turns(drop.strip_messages(msgs)[0]), spans) == (stable, None)
    assert SystemText().strip_messages(msgs) == (msgs, [])  # off by default
