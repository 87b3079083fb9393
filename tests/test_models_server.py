"""Gemma 3 behind the real server, with the official openai client: a
conversation's state stored at SIGTERM (reason shutdown) resumes exactly
after a restart, and a cold server gives the same replies. And the ABI
keeps each model's checkpoints to itself: a Gemma file is incompatible for
SmolLM2 and for Gemma built otherwise (kept, never removed)."""

from __future__ import annotations

import os
import signal

import pytest
from helpers.models import engine, gemma_path

import ds4
from ds4.errors import IncompatibleCheckpointError
from ds4.recovery import recover

CTX = 4096
MSGS = [
    {"role": "system", "content": "You answer in one short sentence."},
    {
        "role": "user",
        "content": "The quick brown fox jumps over the lazy dog near the river. " * 50 + "What did the fox do?",
    },
]


def chat(srv, msgs):
    r = srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=12, temperature=0)
    return r.choices[0].message.content, r


def cached(r):
    d = r.usage.prompt_tokens_details
    return d.cached_tokens if d is not None else 0


@pytest.fixture(scope="module")
def cold(serve_module, tmp_path_factory):
    """A Gemma server without a disk cache; ``cold(msgs)`` replaces its live
    session first (a raw prompt: it shares only the BOS with a chat)."""
    tmp = tmp_path_factory.mktemp("gemma-cold")
    srv = serve_module(
        "--model", gemma_path(), "--no-kv-cache", name="cold", tmp=tmp, engine="llamacpp", ctx=CTX, timeout=300
    )

    def run(msgs):
        srv.client().completions.create(model=srv.model(), prompt="reset", max_tokens=1)
        text, r = chat(srv, msgs)
        assert cached(r) <= 1, "the reference run was not cold"
        return text

    return run


def test_gemma_served_turn_survives_sigterm_and_restart(tmp_path, serve, cold):
    kv = str(tmp_path / "kv")
    flags = ("--model", gemma_path(), "--kv-disk-dir", kv)
    srv = serve(*flags, name="a", tmp=tmp_path, engine="llamacpp", ctx=CTX, timeout=300)
    try:
        assert srv.model() == "gemma-3-270m-q4_k_m"
        first, _ = chat(srv, MSGS)
    finally:
        srv.stop(signal.SIGTERM)
    assert "persisting current KV cache before shutdown" in srv.text_log()
    assert first == cold(MSGS)
    turn2 = [*MSGS, {"role": "assistant", "content": first}, {"role": "user", "content": "And the dog?"}]
    srv2 = serve(*flags, name="b", tmp=tmp_path, engine="llamacpp", ctx=CTX, timeout=300)
    second, r = chat(srv2, turn2)
    srv2.stop()
    assert (r.model_extra or {}).get("ds4", {}).get("rung") == "disk", r.model_extra
    assert cached(r) > 0.8 * r.usage.prompt_tokens
    assert second == cold(turn2)


def test_a_gemma_checkpoint_is_incompatible_elsewhere_and_kept(tmp_path):
    gemma, smol = engine("gemma3"), engine("smollm2")
    d = str(tmp_path / "kv")
    st = ds4.KVStore(d, budget_mb=1024, min_tokens=16)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    s = ds4.Session(gemma, ctx=CTX)
    recover(s, st, text)
    path = st.store_live_prefix(s, "continued")
    assert path and os.path.exists(path)
    inexact = ds4.LlamaCppEngine(model_path=gemma_path(), exact=False)  # another batch policy: other bits
    try:
        for other in (smol, inexact):
            assert other.payload_abi() != gemma.payload_abi()
            with pytest.raises(IncompatibleCheckpointError):
                ds4.open_checkpoint(path, expected_abi=other.payload_abi())
            rep = recover(ds4.Session(other, ctx=CTX), ds4.KVStore(d, budget_mb=1024, min_tokens=16), text + " Again.")
            assert rep.rung == "prefill"
            assert os.path.exists(path)  # kept: another engine's file
    finally:
        inexact.close()
