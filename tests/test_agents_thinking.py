"""Thinking switches (``ds4.server.thinking``): Anthropic ``thinking``,
OpenAI ``reasoning_effort`` and Responses ``reasoning.effort``, and
``chat_template_kwargs``, each reaching the chat template as its
variables, so the prompt is rendered exactly as the template defines
(a Qwen3-like template: an empty ``<think></think>`` after the generation
prompt when ``enable_thinking`` is false) and the checkpoint keys follow
the rendered bytes. Through the official ``openai`` and ``anthropic``
clients against ``ds4 serve`` over the scripted engine with that template."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from helpers.agents import KV_FLAGS, ScriptedServer
from helpers.scripted_engine import QWEN3_LIKE, ScriptedEngine

import ds4
from ds4.engines.chat_template import TemplateRenderer

OFF = "<think>\n\n</think>\n\n"  # what the template adds when thinking is off
MSGS = [{"role": "system", "content": "You are brief. " * 20}, {"role": "user", "content": "Tell me about the fox."}]


def test_the_template_renders_its_own_switch_and_other_formats_ignore_it():
    r = TemplateRenderer(QWEN3_LIKE, markers=("<|im_start|>", "<|im_end|>"))
    on, off = r.render(MSGS), r.render(MSGS, True, {"enable_thinking": False})
    assert off == on + OFF and r.render(MSGS, True, {"enable_thinking": True}) == on
    assert off.segments[-1] == ("assistant\n" + OFF, False)  # the template's text after the marker, as text
    # a fixed format has no variables: the reference engine's ChatML renders alike
    ref = ds4.ReferenceEngine()
    assert ref.render_chat(MSGS, True, {"enable_thinking": False}) == ref.render_chat(MSGS)


@pytest.fixture(scope="module")
def srv(serve_module):
    env = {"DS4_SCRIPTED_TEMPLATE": "qwen3"}
    return serve_module(*KV_FLAGS, name="thinking", cls=ScriptedServer, kv=True, env=env)


def chat(srv, **kw):
    r = srv.client().chat.completions.create(model="m", messages=MSGS, max_tokens=8, temperature=0, **kw)
    return r.usage.prompt_tokens, r.model_extra["ds4"]


def claude(srv, **kw):
    with anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0) as c:
        r = c.messages.create(model="m", max_tokens=2048, system=MSGS[0]["content"], messages=MSGS[1:], **kw)
    u = r.usage
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def respond(srv, **kw):
    r = srv.client().responses.create(model="m", instructions=MSGS[0]["content"], input=MSGS[1]["content"], **kw)
    return r.usage.input_tokens


def test_each_protocols_switch_renders_the_templates_bytes(srv):
    n_off = len(ScriptedEngine().tokenize(OFF))
    base, _ = chat(srv)
    assert chat(srv, reasoning_effort="none")[0] == base + n_off
    assert chat(srv, reasoning_effort="minimal")[0] == base + n_off
    assert chat(srv, reasoning_effort="high")[0] == base  # on: the template adds nothing
    off_kw = {"chat_template_kwargs": {"enable_thinking": False}}
    assert chat(srv, extra_body=off_kw)[0] == base + n_off
    # an explicit enable_thinking wins over the effort
    on_kw = {"chat_template_kwargs": {"enable_thinking": True}}
    assert chat(srv, reasoning_effort="none", extra_body=on_kw)[0] == base
    assert claude(srv, thinking={"type": "disabled"}) == claude(srv) + n_off
    assert claude(srv, thinking={"type": "enabled", "budget_tokens": 1024}) == claude(srv)
    assert respond(srv, reasoning={"effort": "none"}) == respond(srv) + n_off
    assert respond(srv, reasoning={"effort": "medium"}) == respond(srv)


def test_the_keys_follow_the_rendered_bytes(srv):
    chat(srv, reasoning_effort="none")  # the live state: the prompt with the empty think block, then the reply
    n, info = chat(srv)  # the same messages, thinking on: the prompt parts where the block began
    d = info["divergence"]
    assert d is not None and d["against"] in ("live", "checkpoint"), info
    assert d["cached"].startswith("<think>") and d["prompt"] == ""  # the prompt ends where the block began
    assert info["reused_tokens"] <= n


@pytest.mark.parametrize(
    "path,body,where",
    [
        ("/v1/chat/completions", {"chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ("/v1/chat/completions", {"reasoning_effort": "max"}, "reasoning_effort"),
        ("/v1/responses", {"reasoning": {"effort": "lots"}}, "reasoning.effort"),
        ("/v1/messages", {"thinking": {"type": "sometimes"}}, "thinking"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 4096}}, "less than max_tokens"),
    ],
)
def test_a_bad_switch_is_a_400(srv, path, body, where):
    base = {"model": "m", "max_tokens": 2048}
    if path == "/v1/responses":
        base = {"model": "m", "input": "hi"}
    elif path == "/v1/messages":
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(srv.base + path, json={**base, **body}, timeout=30)
    assert r.status_code == 400 and where in r.text, r.text
