"""Anthropic's cache diagnostics (the ``cache-diagnosis`` beta), answered
by ds4 (``ds4.server.cache_diagnostics``), through the official
``anthropic`` client: a request naming its previous reply's id in
``diagnostics.previous_message_id`` gets ``diagnostics.cache_miss_reason``
(``tools_changed``, ``system_changed``, ``messages_changed`` with the
tokens missed, ``unavailable`` for another ``cache_salt``,
``previous_message_not_found``) or null when it only appended; a change
ds4 keeps out of the cache key (a volatile system line) is no miss; one
tenant cannot probe another's ids; streamed replies carry it too."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from helpers.agents import ATOOLS, KV_FLAGS, ScriptedServer

KA, KB = "alice-key-0123456789", "bob-key-0123456789ab"
SYSTEM = "You are a careful assistant.\nToday's date is 2026-12-01.\n" + "Answer briefly and politely. " * 30


@pytest.fixture(scope="module")
def srv(serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diag")
    keys = tmp / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\n", encoding="utf-8")
    flags = ("--api-key-file", str(keys), "--prompt-volatile", "^Today's date is ")
    return serve_module(*KV_FLAGS, *flags, name="diag", cls=ScriptedServer, tmp=tmp, kv=True, key=KA)


def ask(srv, messages, previous="absent", key=KA, system=SYSTEM, tools=None, stream=False, **kw):
    args = {"model": "claude-x", "max_tokens": 24, "system": system, "messages": messages, **kw}
    if tools is not None:
        args["tools"] = tools
    if previous != "absent":
        args["diagnostics"] = {"previous_message_id": previous}
    with anthropic.Anthropic(base_url=srv.base, api_key=key, max_retries=0, timeout=120) as c:
        if not stream:
            return c.messages.create(**args)
        with c.messages.stream(**args) as s:
            events = list(s)
            return s.get_final_message(), events


def reason(r):
    d = r.diagnostics
    return None if d is None else (d.cache_miss_reason.type if d.cache_miss_reason is not None else "pending")


def missed(r):
    return r.diagnostics.cache_miss_reason.cache_missed_input_tokens


def total(r):
    """The prompt's tokens (Anthropic's three counts)."""
    u = r.usage
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def user(text):
    return {"role": "user", "content": text}


def test_each_reason_from_what_ds4_renders(srv):
    msgs = [user("Tell me about the fox. " * 20)]
    r1 = ask(srv, msgs, previous=None)  # the first turn opts in
    assert r1.diagnostics is None
    msgs2 = [*msgs, {"role": "assistant", "content": "It ran."}, user("And the heron?")]
    r2 = ask(srv, msgs2, previous=r1.id)
    assert r2.diagnostics is None and r2.usage.cache_read_input_tokens > 0  # appended only: no divergence

    # an earlier message edited: messages_changed, the tokens missed are ds4's own
    edited = [user("Tell me about the owl. " * 20), *msgs2[1:]]
    r3 = ask(srv, edited, previous=r2.id)
    assert reason(r3) == "messages_changed"
    prompt2 = total(r2)
    assert missed(r3) == max(0, prompt2 - r3.usage.cache_read_input_tokens) > 0

    # the system text changed: system_changed; only its volatile line changed: no miss
    r4 = ask(srv, msgs2, previous=r2.id, system=SYSTEM.replace("careful", "cheerful"))
    assert reason(r4) == "system_changed" and missed(r4) > 0
    r5 = ask(srv, msgs2, previous=r2.id, system=SYSTEM.replace("2026-12-01", "2026-12-02"))
    assert r5.diagnostics is None

    # tools added: tools_changed; another cache_salt: unavailable (another cache)
    r6 = ask(srv, msgs2, previous=r2.id, tools=ATOOLS)
    assert reason(r6) == "tools_changed"
    r7 = ask(srv, msgs2, previous=r2.id, extra_body={"cache_salt": "other"})
    assert reason(r7) == "unavailable" and r7.diagnostics.cache_miss_reason.model_extra == {}

    # an unknown id, and one of another tenant's replies, are both not found
    assert reason(ask(srv, msgs2, previous="msg_nope")) == "previous_message_not_found"
    assert reason(ask(srv, msgs2, previous=r2.id, key=KB)) == "previous_message_not_found"
    # without the field nothing is added (the reply's key is absent, so null)
    assert ask(srv, msgs2).diagnostics is None


def test_a_stream_carries_the_answer(srv):
    msgs = [user("Tell me about the badger. " * 20)]
    r1 = ask(srv, msgs, previous=None)
    edited = [user("Tell me about the otter. " * 20)]
    final, events = ask(srv, edited, previous=r1.id, stream=True)
    start = next(e for e in events if e.type == "message_start")
    # the ladder ran before the first byte here (a short prefill): the whole answer at message_start
    d = start.message.diagnostics
    assert d is not None and d.cache_miss_reason.type == "messages_changed"
    assert reason(final) == "messages_changed"
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.model_extra["diagnostics"]["cache_miss_reason"]["type"] == "messages_changed"
    assert delta.model_extra["diagnostics"] == d.model_dump()


def test_a_malformed_field_is_a_400(srv):
    for bad in ([], "x", {"previous_message_id": 7}):
        r = httpx.post(
            srv.base + "/v1/messages",
            headers={"x-api-key": KA},
            json={"model": "m", "max_tokens": 4, "messages": [user("hi")], "diagnostics": bad},
            timeout=30,
        )
        assert r.status_code == 400 and "diagnostics" in r.json()["error"]["message"], r.text
