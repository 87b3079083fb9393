"""A turn refused before it touches anything leaves the live session alone
(issue 11, items 4, 6 and 7), and what a turn reports is exact.

The counterpart of test_invalidation.py: there, every failure after the
session moved must invalidate it; here, a request that is refused before
(a prompt or stop sequence that is not valid Unicode, bytes that are not
UTF-8, an unreadable checkpoint) must keep an unrelated conversation's live
state, with no invalidation and no evict save, so that conversation's next
turn is served from memory.
"""

from __future__ import annotations

import pytest

import ds4
from ds4.errors import PromptError
from ds4.turn import Generator, GenParams

CTX = 512


@pytest.fixture(scope="module")
def eng():
    return ds4.ReferenceEngine()


def _chat(eng, *texts):
    msgs = []
    for i, t in enumerate(texts):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return eng.render_chat(msgs)


def _with_conversation(eng, tmp_path):
    """A generator whose store and live session hold conversation A."""
    store = ds4.KVStore(tmp_path / "kv", min_tokens=8, boundary_align_tokens=8)
    g = Generator(eng, CTX, store=store)
    first = _chat(eng, "conversation A: tell me about tides, the moon and the sea")
    res = g.generate(first, GenParams(max_tokens=2))
    assert g.sess.checkpoint_valid
    return g, first + res.text


@pytest.mark.parametrize(
    "prompt, params",
    [
        ("a prompt with a lone surrogate \ud800 in it", GenParams(max_tokens=4)),
        (b"bytes that are not UTF-8 \xff\xfe", GenParams(max_tokens=4)),
        ("a fine prompt", GenParams(max_tokens=4, stop=("ok", "\udfff"))),
    ],
    ids=["surrogate-prompt", "non-utf8-bytes", "surrogate-stop"],
)
def test_a_refused_turn_keeps_an_unrelated_conversation_cached(eng, tmp_path, prompt, params):
    g, a_so_far = _with_conversation(eng, tmp_path)
    before = (
        list(g.sess.tokens),
        g.sess.n_past,
        dict(g.store.stats),
        sorted(p.name for p in (tmp_path / "kv").iterdir()),
    )
    with pytest.raises(PromptError):
        g.generate(prompt, params)
    after = (
        list(g.sess.tokens),
        g.sess.n_past,
        dict(g.store.stats),
        sorted(p.name for p in (tmp_path / "kv").iterdir()),
    )
    assert g.sess.checkpoint_valid, "a refused turn invalidated the live session"
    assert after == before, "a refused turn touched the session or the store (evict save, load)"
    assert g.counters["ladder_retries"] == 0
    # conversation A goes on from memory, with all of its tokens cached
    nxt = g.generate(a_so_far + "\nAnd the sun?", GenParams(max_tokens=2))
    assert nxt.report.rung == "live" and nxt.cached_tokens == before[1]


def test_a_surrogate_stop_is_refused_before_the_prefill(eng):
    g = Generator(eng, CTX)
    with pytest.raises(PromptError):
        g.generate(_chat(eng, "an unrelated prompt, never prefilled"), GenParams(stop=("\ud800",)))
    assert g.sess.n_past == 0 and g.counters["requests"] == 1 and g.counters["completion_tokens"] == 0
