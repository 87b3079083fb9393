"""A prefill that its caller cancels (a client gone) stops at a chunk
boundary with the session valid there, and the next turn extends it: no
work is lost, nothing is half-evaluated, and the answer equals a cold one."""

from __future__ import annotations

import numpy as np
import pytest

import ds4
from ds4.errors import PrefillCancelledError
from ds4.turn import GenParams, TurnDriver

CTX = 4096


def _prompt(eng, n_words=700):
    body = " ".join(f"w{i % 97}" for i in range(n_words))
    return eng.render_chat([{"role": "user", "content": body}])


def _cold(eng, prompt, n=6):
    return TurnDriver(eng, CTX).generate(prompt, GenParams(max_tokens=n))


def test_session_sync_stops_at_a_chunk_boundary_valid(eng):
    toks = eng.tokenize(_prompt(eng), special=True)
    assert len(toks) > 3 * 512
    s = ds4.Session(eng, ctx=CTX)
    asked = []

    def cancel():
        asked.append(s.n_past)
        return len(asked) == 3  # after two chunks

    with pytest.raises(PrefillCancelledError) as ei:
        s.sync(toks, cancel=cancel)
    assert asked == [0, 512, 1024]  # asked before each piece, at absolute multiples of the chunk
    assert (ei.value.n_past, ei.value.n_tokens) == (1024, len(toks))
    assert s.checkpoint_valid and s.tokens == toks[:1024]
    ref = ds4.Session(eng, ctx=CTX)
    ref.sync(toks[:1024])
    assert np.array_equal(s.logits, ref.logits)
    # the rest extends it
    assert s.sync(toks) == 1024 and s.tokens == toks


def test_cuts_fall_where_the_engine_batches_and_the_frontiers_fall(eng):
    s = ds4.Session(eng, ctx=CTX)
    assert s.prefill_chunk == 512
    s.sync(eng.tokenize("abc", special=True))
    seen = []
    toks = eng.tokenize(_prompt(eng), special=True)
    s.sync(toks, frontier_every=768, on_frontier=lambda x: seen.append(x.n_past), cancel=lambda: False)
    assert seen == list(range(768, len(toks), 768))  # frontiers only at their multiples, not at chunk cuts
    assert s.tokens == toks


def test_a_cancelled_turn_keeps_the_session_and_the_next_turn_extends_it(eng):
    prompt = _prompt(eng)
    cold = _cold(eng, prompt)
    g = TurnDriver(eng, CTX)
    calls = [0]

    def cancel():
        calls[0] += 1
        return calls[0] == 2  # during the prefill, after one chunk

    res = g.generate(prompt, GenParams(max_tokens=6), cancel=cancel)
    assert res.finish_reason == "cancelled" and res.tokens == [] and res.text == ""
    assert g.sess.checkpoint_valid and g.sess.n_past == 512
    assert g.counters["cancelled"] == 1 and g.counters["ladder_retries"] == 0
    again = g.generate(prompt, GenParams(max_tokens=6))
    assert again.report.rung == "live" and again.cached_tokens == 512
    assert again.tokens == cold.tokens


def test_a_cancel_during_decoding_still_stops_at_the_next_token(eng):
    prompt = _prompt(eng, 50)
    g = TurnDriver(eng, CTX)
    n = [0]

    def cancel():
        n[0] += 1
        return n[0] > 3  # prefill asks once (one piece), then decoding asks per token

    res = g.generate(prompt, GenParams(max_tokens=10), cancel=cancel)
    assert res.finish_reason == "cancelled" and len(res.tokens) == 2
    assert g.sess.checkpoint_valid
