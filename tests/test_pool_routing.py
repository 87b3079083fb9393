"""The pool routes by what it saves (issue 35, item 1): a request that
shares a prefix with a resident holding another live conversation takes a
RAM copy of that prefix into a free resident (rung ``live``, source
``session K, copied from session J``) instead of going to disk or
prefilling, and the holder's own conversation stays live (an edited last
turn, a reply sent back stripped and instructor-style retries reuse a
resident's prefix too); with a free
resident, two conversations sharing a system prompt write no evict
checkpoint. On SmolLM2 (a batched pool: sequences copy across streams) and
Gemma 3 (under ``--exact canonical`` its residents decode alone: separate
contexts copy a state blob, ``LlamaCppContext.copy_prefix``). Every reply
equals a cold server's."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import models
from helpers.server import KV_FLAGS, cached_tokens, ds4_block, stored_texts

import ds4
from ds4.keytext import tokenize_prompt

pytestmark = pytest.mark.timeout(900)

#: a long shared system prompt (a main agent's, its subagents')
SYSTEM = "You are the harbour's logistics agent. " + " ".join(
    f"Rule {i}: berth {i % 7} takes ships under {100 + i} metres; log every arrival." for i in range(45)
)
MAX_TOKENS = 8


def _state(s: ds4.Session) -> dict:
    return s.export_arrays()


@pytest.mark.parametrize("model", models.MODELS)
def test_a_context_copies_a_prefix_of_another_as_a_prefill_holds_it(model):
    eng = models.engine(model)
    toks = models.text_tokens(eng, 300)
    a = ds4.Session(eng, ctx=1024)
    a.sync(toks)
    for _ in range(10):  # a reply (unpadded steps under canonical), not yet canonicalized
        a.eval_token(int(np.argmax(a.logits)))
    held = list(a.tokens)
    for n in (200, len(held)):
        b = ds4.Session(eng, ctx=1024)
        assert b.adopt_prefix(a, n)
        cold = ds4.Session(eng, ctx=1024)
        cold.sync(held[:n])
        x, y = _state(b), _state(cold)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), (model, n)
        np.testing.assert_array_equal(b.logits, cold.logits)
    assert a.tokens == held and a.canonical  # the source keeps its state, made a prefill's


def _flags(model):
    return ["--threads", "2", *([] if model == "smollm2" else ["--model", models.model_path(model)])]


@pytest.fixture(scope="module", params=models.MODELS)
def servers(request, serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"route-{request.param}")
    # both pools batch their decode steps, each sequence padded as --exact strict does
    flags = ("--no-kv-cache", "--exact", "strict", *_flags(request.param))
    cold = serve_module(*flags, name="cold", tmp=tmp, engine="llamacpp", timeout=300)
    yield request.param, tmp, cold
    cold.stop()  # before the next model's


def _pool(serve, tmp, name, n, model):
    kv = str(tmp / f"kv-{name}")
    batch = ["--batch-decode", "on"] if model == "gemma3" else []
    flags = ("--sessions", str(n), "--kv-disk-dir", kv, *KV_FLAGS, *batch, *_flags(model))
    srv = serve(*flags, name=name, tmp=tmp, engine="llamacpp", timeout=300)
    srv.kv_dir = kv
    return srv


def _ask(srv, cold, msgs):
    kw = {"messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
    with srv.client() as c, cold.client() as cc:  # closed: no socket left to the collector
        r = c.chat.completions.create(model=srv.model(), **kw)
        ref = cc.chat.completions.create(model=cold.model(), **kw)
    assert r.choices[0].message.content == ref.choices[0].message.content
    return r, r.choices[0].message.content


def _shared_tokens(model, msgs_a, msgs_b) -> int:
    """The tokens two chats' prompts share (the model's own tokenizer)."""
    eng = models.engine(model)
    a, b = (tokenize_prompt(eng, eng.render_chat(m)) for m in (msgs_a, msgs_b))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_subagent_takes_a_copy_and_the_main_agent_stays_live(servers, serve):
    model, tmp, cold = servers
    srv = _pool(serve, tmp, "sub", 3, model)
    main = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which berth for the Ayla?"}]
    _, text = _ask(srv, cold, main)
    sub = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise rule 3 only."}]
    r, _ = _ask(srv, cold, sub)
    x = ds4_block(r)
    shared = _shared_tokens(model, main, sub)
    assert x["rung"] == "live" and "copied from session" in x["source"], x
    assert cached_tokens(r) >= 0.95 * shared, (cached_tokens(r), shared)
    main += [{"role": "assistant", "content": text}, {"role": "user", "content": "And the Brin?"}]
    r, _ = _ask(srv, cold, main)
    assert ds4_block(r)["rung"] == "live", ds4_block(r)
    # an edited last turn of the main agent: a copy of the holder's prefix again
    edited = [*main[:-1], {"role": "user", "content": "And the Corra, please?"}]
    r, _ = _ask(srv, cold, edited)
    x = ds4_block(r)
    assert cached_tokens(r) >= 0.95 * _shared_tokens(model, main, edited), (x, cached_tokens(r))
    assert not any(reason == "evict" for (_, reason, _) in stored_texts(srv.kv_dir).values())
    # a client that sends its last reply back stripped (its reasoning
    # dropped, re-rendered), then instructor-style retries (the failed
    # reply and the validation error appended each time): each reuses
    # the prefix a resident holds (the three residents full now: an
    # evict may be written), none prefills it again
    prev, short = edited, text[: max(1, len(text) // 2)]
    msgs = [*main[:-2], {"role": "assistant", "content": short}, {"role": "user", "content": "And the Brin?"}]
    for k in range(3):
        r, _ = _ask(srv, cold, msgs)
        assert cached_tokens(r) >= 0.95 * _shared_tokens(model, prev, msgs), (k, ds4_block(r), cached_tokens(r))
        bad = [
            {"role": "assistant", "content": f"{{berth: {k}"},
            {"role": "user", "content": "Fix the errors: bad JSON"},
        ]
        prev, msgs = msgs, [*msgs, *bad]


def test_two_conversations_sharing_a_system_prompt_on_two_residents_write_no_evict(servers, serve):
    model, tmp, cold = servers
    srv = _pool(serve, tmp, "two", 2, model)
    convs = {
        t: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me of the {t}."}]
        for t in ("tide", "fog")
    }
    for turn in range(3):
        for t, msgs in convs.items():
            r, text = _ask(srv, cold, msgs)
            x = ds4_block(r)
            assert not x.get("evict_saved"), (turn, t, x)
            if turn:
                assert x["rung"] == "live", (turn, t, x)
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"More, part {turn}."}]
    assert not any(reason == "evict" for (_, reason, _) in stored_texts(srv.kv_dir).values())
