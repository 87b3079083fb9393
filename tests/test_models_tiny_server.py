"""The tiny models (recurrent, hybrid and dense) behind the real server, with the
official openai client (issue 34): ``/health`` says what the memory can
do; four conversations interleaved on ``--sessions 4`` each get a cold
server's replies; an edited last user turn resumes from a RAM snapshot
(rung ``rewrite``, the snapshot in the ``ds4`` block); after a SIGTERM and
a restart on the same cache directory a conversation resumes from disk;
every reply equals a cold server's."""

from __future__ import annotations

import signal

import httpx
import pytest
from helpers.models import RECURRENT, TINY, model_path
from helpers.server import Server

CTX = 4096
MAX = 24


def convo(k: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are assistant number {k}. " * 90},
        {"role": "user", "content": f"Tell me a story about the fox number {k}. " * 8},
    ]


def chat(srv, msgs):
    r = srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=MAX, temperature=0)
    return r.choices[0].message.content, (r.model_extra or {}).get("ds4", {})


@pytest.fixture(scope="module", params=TINY)
def name(request):
    return request.param


@pytest.fixture(scope="module")
def cold(name, tmp_path_factory):
    """A server without a disk cache or snapshots; ``cold(msgs)`` replaces
    its live session first, so each reply is a cold prefill's."""
    tmp = tmp_path_factory.mktemp(f"cold-{name}")
    srv = Server(
        str(tmp),
        "cold",
        "--model",
        model_path(name),
        "--no-kv-cache",
        "--sessions",
        "1",
        "--ctx-checkpoints",
        "0",
        engine="llamacpp",
        ctx=CTX,
    )
    srv.start(timeout=300)

    def run(msgs):
        srv.client().completions.create(model=srv.model(), prompt="reset", max_tokens=1)
        text, info = chat(srv, msgs)
        assert info["rung"] == "prefill"
        return text

    yield run
    srv.stop()


def test_recurrent_models_served_exactly(name, cold, tmp_path):
    kv = str(tmp_path / "kv")
    args = ("--model", model_path(name), "--kv-disk-dir", kv, "--sessions", "4")
    srv = Server(str(tmp_path), "a", *args, engine="llamacpp", ctx=CTX)
    srv.start(timeout=300)
    try:
        health = httpx.get(srv.base + "/health", headers=srv.headers, timeout=10).json()
        facts, recurrent = health["engine_facts"], name in RECURRENT
        assert (facts["memory"] in ("recurrent", "hybrid")) is recurrent and facts["truncate"] is not recurrent
        assert facts["exact_verified"] and facts["checkpoints"] and facts["batched_decode"] is not recurrent
        assert (" mem=" in health["payload_abi"]) is recurrent
        convos = [convo(k) for k in range(4)]
        for _turn in range(2):  # interleaved: each conversation's turn in turn
            for k, msgs in enumerate(convos):
                text, _info = chat(srv, msgs)
                assert text == cold(msgs), (k, _turn)
                msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({k})"}]
        # conversation 0's last user turn, edited: its previous prompt's snapshot
        edited = [*convos[0][:-1], {"role": "user", "content": "No, tell me about the heron instead."}]
        text, info = chat(srv, edited)
        assert info["rung"] == "rewrite", info
        if recurrent:  # the snapshot of the previous turn's prompt
            assert info["snapshot"] is not None and info["reused_tokens"] == info["snapshot"] > 0
        else:  # the memory rewinds
            assert info["snapshot"] is None and info["reused_tokens"] > 0
        assert text == cold(edited)
    finally:
        srv.stop(signal.SIGTERM)
    srv2 = Server(str(tmp_path), "b", *args, engine="llamacpp", ctx=CTX)
    srv2.start(timeout=300)
    try:
        text, info = chat(srv2, convos[1])
        assert info["rung"] == "disk" and info["reused_tokens"] > 0, (info, srv2.text_log()[-3000:])
        assert text == cold(convos[1])
    finally:
        srv2.stop()


@pytest.mark.parametrize("name", RECURRENT, scope="module")
def test_an_evicted_residents_edited_turn_resumes_from_disk(name, cold, tmp_path):
    """A recurrent resident evicted from the pool (``--sessions 2``, a third
    conversation) loses its RAM snapshots; its turn-boundary states are on
    disk (each prefill's prompt, reason ``continued``), so its edited last
    user turn resumes from the previous turn's prompt there, as the live
    snapshot would have, and equals cold."""
    kv = str(tmp_path / "kv")
    srv = Server(
        str(tmp_path),
        "a",
        "--model",
        model_path(name),
        "--kv-disk-dir",
        kv,
        "--sessions",
        "2",
        engine="llamacpp",
        ctx=CTX,
    )
    srv.start(timeout=300)
    try:
        first = convo(0)
        r = srv.client().chat.completions.create(model=srv.model(), messages=first, max_tokens=MAX, temperature=0)
        text, turn1 = r.choices[0].message.content, r.usage.prompt_tokens
        msgs = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And then? (0)"}]
        text, info = chat(srv, msgs)
        assert info["rung"] == "live", info
        for k in (1, 2):  # the second fills the free resident, the third evicts conversation 0's
            chat(srv, convo(k))
        edited = [*msgs[:-1], {"role": "user", "content": "No, tell me about the heron instead."}]
        text, info = chat(srv, edited)
        assert info["rung"] == "disk" and info["reused_tokens"] == turn1, (info, srv.text_log()[-3000:])
        assert text == cold(edited)
    finally:
        srv.stop()
