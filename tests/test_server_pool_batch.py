"""``ds4 serve --sessions 4 --batch-decode on`` on llama.cpp, with both
real models: four conversations sent at once, two turns each. The
residents' decode steps share llama_decode calls (``/health``'s
``batched`` counts steps of more than one sequence), and every reply is
the one a cold single-session server of the same decode layout gives
(``--exact strict``: a batched step pads each sequence) (issue 22, item 3's
condition), the second turns being live hits on their own residents. (``on``: under
the default ``--exact canonical`` ``auto`` batches SmolLM2's steps and not
Gemma 3's, whose 8-row pad costs more than it saves; ``on`` batches both.)"""

from __future__ import annotations

import re

import pytest
from helpers import models
from helpers.server import KV_FLAGS, ds4_block
from helpers.together import at_once

TOPICS = ("apples", "rivers", "the moon", "bicycles")
MAX_TOKENS = 12


def _msgs(topic):
    return [{"role": "user", "content": f"Tell me one fact about {topic}. Answer in one short sentence."}]


def _args(model):
    return ["--threads", "2", *([] if model == "smollm2" else ["--model", models.model_path(model)])]


@pytest.fixture(scope="module", params=models.MODELS)
def servers(request, serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"batch-{request.param}")
    flags = _args(request.param)
    # the batched pool pads each sequence's step as --exact strict does (a
    # batched row cannot drop its pads and stay exact: DESIGN.md, "Session
    # pool"), so its replies are a cold strict single session's
    cold_flags = ("--no-kv-cache", "--exact", "strict", *flags)
    cold = serve_module(*cold_flags, name="cold", tmp=tmp, engine="llamacpp", timeout=180)
    pool_flags = ("--sessions", "4", "--batch-decode", "on", *KV_FLAGS, *flags)
    pool = serve_module(*pool_flags, name="pool", tmp=tmp, kv=True, engine="llamacpp", timeout=180)
    yield cold, pool
    pool.stop()  # before the next model's
    cold.stop()


def _all_at_once(srv, convs):
    """One request per conversation, all in flight together."""
    model = srv.model()
    return at_once(
        lambda topic: srv.client().chat.completions.create(model=model, messages=convs[topic], max_tokens=MAX_TOKENS),
        convs,
    )


def test_four_conversations_batched_equal_a_cold_single_session_server(servers):
    cold, pool = servers
    assert pool.health()["batched"]["sequences"] == 4, pool.health()
    convs = {t: _msgs(t) for t in TOPICS}
    for turn in range(2):
        got = _all_at_once(pool, convs)
        for t in TOPICS:
            ref = cold.client().chat.completions.create(model=cold.model(), messages=convs[t], max_tokens=MAX_TOKENS)
            r = got[t]
            text = r.choices[0].message.content
            assert text == ref.choices[0].message.content, (t, turn)
            assert r.usage.completion_tokens == ref.usage.completion_tokens
            if turn == 1 and "\ufffd" not in convs[t][-2]["content"]:
                assert ds4_block(r)["rung"] == "live", (t, ds4_block(r))
            convs[t] = [*convs[t], {"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
    steps = {int(k): v for k, v in pool.health()["batched"]["steps"].items()}
    assert any(k >= 2 for k in steps), steps  # the residents' steps did share llama_decode calls
    assert sum(k * v for k, v in steps.items()) <= 2 * len(TOPICS) * MAX_TOKENS


def test_agents_starting_together_take_the_shared_prefix_from_ram(servers, tmp_path, serve):
    """Four conversations with one long system prompt sent at once to a
    fresh batched pool: one lane prefills it, the other three wait, then
    copy from that resident the tokens their prompts share with its live
    state (rung ``live``, ``copied from session J``), more than its cold
    checkpoint holds (the chat anchor), without loading it; every reply
    equals a cold single-session server's."""
    from helpers.server import SYSTEM

    from ds4.checkpoint import REASONS, open_checkpoint

    cold, pool = servers
    system = SYSTEM + " " + " ".join(f"Rule {i}: keep every answer short and exact." for i in range(40))
    convs = {
        t: [{"role": "system", "content": system}, {"role": "user", "content": f"Tell me of {t}."}] for t in TOPICS
    }
    model = "smollm2" if "--model" not in pool.args else "gemma3"
    fresh = serve(
        "--sessions",
        "4",
        "--batch-decode",
        "on",
        "--batch-prefill",  # the waiters' suffixes may go in together: the same replies
        "on",
        *KV_FLAGS,
        *_args(model),
        name="pool-copy",
        tmp=tmp_path,
        kv=True,
        engine="llamacpp",
        timeout=180,
    )
    got = _all_at_once(fresh, convs)
    for t in TOPICS:
        ref = cold.client().chat.completions.create(model=cold.model(), messages=convs[t], max_tokens=MAX_TOKENS)
        assert got[t].choices[0].message.content == ref.choices[0].message.content, t
    assert fresh.health()["levels"] == {"prefill": 1, "live": 3}, fresh.health()["levels"]
    first = next(t for t in TOPICS if ds4_block(got[t])["rung"] == "prefill")
    (src,) = [s["index"] for s in fresh.health()["sessions"] if s["last_rung"] == "prefill"]
    cks = [open_checkpoint(p, load_payload=False) for p in (tmp_path / "kv").iterdir() if p.suffix == ".kv"]
    (anchor,) = [ck.tokens for ck in cks if REASONS[ck.reason] == "cold"]  # the first lane's cold save
    takers = set()
    for t in TOPICS:
        if t == first:
            continue
        m = re.fullmatch(rf"session (\d+), copied from session {src}", ds4_block(got[t])["source"])
        assert m is not None, ds4_block(got[t])
        takers.add(int(m.group(1)))
        cached = got[t].usage.prompt_tokens_details.cached_tokens
        assert anchor < cached < got[t].usage.prompt_tokens, (t, anchor, cached)
    assert len(takers) == 3 and src not in takers, takers
    batched = fresh.health()["batched"]
    assert batched["prefill"] is True and batched["prefill_steps"], batched  # prefills went through it
