"""Restart after interleaving: conversation A, then conversation B in the
same ``ds4 serve`` process, SIGTERM, a new process on the same directory,
then B's next turn (its history, the reply and a new user message). B comes
back from the checkpoint the shutdown stored of it (rung ``disk``, every
token of it reused), and A's next turn from the one stored of A (``evict``
when B replaced it on one session, ``shutdown`` when it stayed resident on
a pool). Both on ``--sessions 1`` and on pools of 2 and 4 residents, with B
sharing A's system prompt or nothing with A; every reply equals a cold
single-session server's. The same over llama.cpp (SmolLM2: A's reply ends
at the model's end-of-turn token), one session. On a pool under a budget
too small for every resident's save, the conversation served last is the
one stored last, so it is kept.

Resending B's exact request (or A's) after the restart is served from disk
too, from the longest stored prefix of its prompt: a shutdown checkpoint
holds the reply's tokens after the prompt, so it is no prefix of the same
prompt sent again; the prompt's last continued or cold frontier is.
"""

from __future__ import annotations

import os
import shutil

import pytest
from helpers.server import KV_FLAGS, SYSTEM, cached_tokens, cold_chat, ds4_block, stored_texts

#: a system prompt of a few hundred tokens (A's; B's too in the "shared" shape)
LONG_SYSTEM = SYSTEM + " " + " ".join(f"r{i}." for i in range(40))
#: B's own system prompt in the "distinct" shape: nothing in common with A's
OTHER_SYSTEM = "You are a terse pirate. " + " ".join(f"l{i}." for i in range(40))


@pytest.fixture(scope="module")
def cold(serve_module):
    return serve_module("--no-kv-cache", name="cold")


def _conv(topic: str, system: str) -> list:
    words = " ".join(f"{topic}{i}" for i in range(20))
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Please explain {topic}; words: {words}."},
    ]


def _next(msgs: list, reply: str) -> list:
    return [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me more."}]


def _server(serve, tmp, name, kv, sessions):
    return serve("--sessions", str(sessions), "--kv-disk-dir", str(kv), *KV_FLAGS, name=name, tmp=tmp)


def _ask(srv, msgs):
    return srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=2)


@pytest.mark.parametrize(
    ("sessions", "shape"), [(1, "shared"), (1, "distinct"), (2, "shared"), (2, "distinct"), (4, "shared")]
)
def test_a_then_b_then_sigterm_resumes_b_from_its_shutdown_checkpoint(tmp_path, serve, cold, sessions, shape):
    a = _conv("harbours", LONG_SYSTEM)
    b = _conv("rivers", LONG_SYSTEM if shape == "shared" else OTHER_SYSTEM)
    kv = tmp_path / "kv"
    srv = _server(serve, tmp_path, "first", kv, sessions)
    ra, rb = _ask(srv, a), _ask(srv, b)
    srv.stop()
    # the replies are valid UTF-8, so the clients' echoes are byte-exact
    ta, tb = ra.choices[0].message.content, rb.choices[0].message.content
    assert "\ufffd" not in ta + tb, (ta, tb)
    # what each process held when it stopped: the prompt and the reply's
    # tokens but the last (never evaluated)
    a_n = ra.usage.prompt_tokens + ra.usage.completion_tokens - 1
    b_n = rb.usage.prompt_tokens + rb.usage.completion_tokens - 1
    stored = stored_texts(str(kv))
    b_shut = [p for p, (_t, reason, n) in stored.items() if reason == "shutdown" and n == b_n]
    a_reason = "evict" if sessions == 1 else "shutdown"  # B replaced A / A stayed resident
    a_ck = [p for p, (_t, reason, n) in stored.items() if reason == a_reason and n == a_n]
    assert len(b_shut) == 1 and len(a_ck) == 1, sorted(stored.values(), key=lambda v: v[2])

    exact = tmp_path / "exact"
    shutil.copytree(kv, exact / "kv")

    # the restart on the same directory: B's next turn, then A's
    srv2 = _server(serve, tmp_path, "second", kv, sessions)
    b2, a2 = _next(b, tb), _next(a, ta)
    rb2 = _ask(srv2, b2)
    ra2 = _ask(srv2, a2)
    srv2.stop()
    for r, msgs, n, ck in ((rb2, b2, b_n, b_shut[0]), (ra2, a2, a_n, a_ck[0])):
        x = ds4_block(r)
        assert x["rung"] == "disk" and x["loaded_path"] == os.path.basename(ck), (shape, sessions, x)
        assert x["reused_tokens"] == cached_tokens(r) == n, (shape, sessions, x)
        assert r.choices[0].message.content == cold_chat(cold, msgs, max_tokens=2).choices[0].message.content
    log = srv2.text_log()
    assert f"ds4 ladder rung=disk source=disk-text reused={b_n} prompt={rb2.usage.prompt_tokens}" in log, log

    # B's exact request again (and A's) on another restart of the stopped
    # directory: from disk, the longest stored prefix of the prompt
    srv3 = _server(serve, exact, "third", exact / "kv", sessions)
    rb3 = _ask(srv3, b)
    ra3 = _ask(srv3, a)
    srv3.stop()
    for r, before in ((rb3, rb), (ra3, ra)):
        x = ds4_block(r)
        assert x["rung"] == "disk" and 0 < x["reused_tokens"] < r.usage.prompt_tokens, (shape, sessions, x)
        assert r.choices[0].message.content == before.choices[0].message.content


def test_a_tight_budget_keeps_the_last_conversation_of_a_pool_across_a_restart(tmp_path, serve, cold):
    """A on session 0, X on session 1, then B takes session 0 (A is saved,
    ``evict``); SIGTERM under a budget that holds one resident's
    ``shutdown`` save beside A's: the pool stores X (least recently used)
    first and B last, so B's file is the one the budget keeps (stored in
    index order, X's save evicted B's and B's next turn was a prefill)."""
    a = _conv("harbours", LONG_SYSTEM)
    b = _conv("rivers", OTHER_SYSTEM)
    x = _conv("forests", "Be kind. " + " ".join(f"k{i}." for i in range(40)))
    kv = tmp_path / "kv"
    budget = ("--kv-disk-space-mb", "0.8")  # the reference engine's files here: 0.2-0.35 MiB
    srv = serve("--sessions", "2", "--kv-disk-dir", str(kv), *KV_FLAGS, *budget, name="first", tmp=tmp_path)
    _ask(srv, a), _ask(srv, x)
    rb = _ask(srv, b)
    assert [s["index"] for s in srv.health()["sessions"] if s["tokens"] == rb.usage.prompt_tokens + 1] == [0]
    srv.stop()
    tb = rb.choices[0].message.content
    assert "\ufffd" not in tb, tb
    b_n = rb.usage.prompt_tokens + rb.usage.completion_tokens - 1
    stored = stored_texts(str(kv))
    b_shut = [p for p, (_t, reason, n) in stored.items() if reason == "shutdown" and n == b_n]
    assert len(b_shut) == 1, sorted(stored.values(), key=lambda v: v[2])
    srv2 = serve("--sessions", "2", "--kv-disk-dir", str(kv), *KV_FLAGS, *budget, name="second", tmp=tmp_path)
    b2 = _next(b, tb)
    rb2 = _ask(srv2, b2)
    srv2.stop()
    xb = ds4_block(rb2)
    assert xb["rung"] == "disk" and xb["loaded_path"] == os.path.basename(b_shut[0]), xb
    assert xb["reused_tokens"] == b_n
    assert rb2.choices[0].message.content == cold_chat(cold, b2, max_tokens=2).choices[0].message.content


def test_the_sequence_on_a_real_model_whose_first_reply_ends_at_its_end_token(tmp_path, serve):
    """The same sequence over llama.cpp (SmolLM2, as CI installs it), one
    session: A's reply ends at the model's end-of-turn token, B's at the
    length limit; B's next turn resumes from B's shutdown checkpoint and
    A's from its evict one, every token of each reused, and both replies
    equal a cold server's."""
    import llama_cpp  # noqa: F401  (CI installs it; this test must not be skipped)

    system = "You are a helpful geography assistant. Answer in one short sentence. " * 3
    a = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    b = [{"role": "system", "content": system}, {"role": "user", "content": "Describe a harbour at dawn."}]
    kv = tmp_path / "kv"
    llama = ("--threads", "2")

    def llama_server(name, *flags):
        return serve(*flags, *llama, name=name, tmp=tmp_path, engine="llamacpp")

    srv = llama_server("first", "--kv-disk-dir", str(kv), *KV_FLAGS)
    c, model = srv.client(), srv.model()
    ra = c.chat.completions.create(model=model, messages=a, max_tokens=48)
    rb = c.chat.completions.create(model=model, messages=b, max_tokens=24)
    srv.stop()
    assert ra.choices[0].finish_reason == "stop" and rb.choices[0].finish_reason == "length"
    stored = stored_texts(str(kv))
    ck = {reason: (p, n) for p, (_t, reason, n) in stored.items() if reason in ("shutdown", "evict")}
    assert len(ck) == 2, stored
    a2, b2 = _next(a, ra.choices[0].message.content), _next(b, rb.choices[0].message.content)
    srv2 = llama_server("second", "--kv-disk-dir", str(kv), *KV_FLAGS)
    cold = llama_server("cold", "--no-kv-cache")
    for msgs, reason in ((b2, "shutdown"), (a2, "evict")):
        r = srv2.client().chat.completions.create(model=model, messages=msgs, max_tokens=8)
        x = ds4_block(r)
        assert x["rung"] == "disk" and x["loaded_path"] == os.path.basename(ck[reason][0]), (reason, x)
        assert x["reused_tokens"] == ck[reason][1], (reason, x)
        cold.client().completions.create(model=model, prompt="Hello", max_tokens=1)  # its live session replaced
        ref = cold.client().chat.completions.create(model=model, messages=msgs, max_tokens=8)
        assert cached_tokens(ref) == 0 and r.choices[0].message.content == ref.choices[0].message.content
