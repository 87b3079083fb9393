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
from ds4.turn import GenParams, TextStream, TurnDriver

CTX = 512


def _chat(eng, *texts):
    msgs = []
    for i, t in enumerate(texts):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return eng.render_chat(msgs)


def _with_conversation(eng, tmp_path):
    """A generator whose store and live session hold conversation A."""
    store = ds4.KVStore(tmp_path / "kv", min_tokens=8, boundary_align_tokens=8)
    g = TurnDriver(eng, CTX, store=store)
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
    g = TurnDriver(eng, CTX)
    with pytest.raises(PromptError):
        g.generate(_chat(eng, "an unrelated prompt, never prefilled"), GenParams(stop=("\ud800",)))
    assert g.sess.n_past == 0 and g.counters["requests"] == 1 and g.counters["completion_tokens"] == 0


# -- an unreadable checkpoint is a typed rejection, never a failed turn ---------
def test_an_unreadable_checkpoint_is_skipped_and_kept(eng, tmp_path, monkeypatch):
    import ds4.kvstore

    store = ds4.KVStore(tmp_path / "kv", min_tokens=8, boundary_align_tokens=8)
    prompt = _chat(eng, "a conversation whose checkpoint becomes unreadable after indexing")
    g = TurnDriver(eng, CTX, store=store)
    g.generate(prompt, GenParams(max_tokens=2))
    stored = [p for p in (tmp_path / "kv").iterdir() if p.suffix == ".kv"]
    assert stored
    real = ds4.kvstore.admission.open_checkpoint  # where a load opens a file

    def denied(path, *a, **kw):  # as after chmod 000 by another user (the suite may run as root)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ds4.kvstore.admission, "open_checkpoint", denied)
    fresh = TurnDriver(eng, CTX, store=store)
    for _ in range(2):  # every request with that prefix: served, never a failure
        res = fresh.generate(prompt + " more", GenParams(max_tokens=2))
        codes = {(stage, code) for (_, stage, code, _) in res.report.rejected}
        assert codes == {("open", "unreadable")}, res.report.rejected
        assert res.report.rung in ("prefill", "live")
    assert fresh.counters["ladder_retries"] == 0 and fresh.counters["errors"] == 0
    assert all(p.exists() for p in stored), "an unreadable checkpoint was removed"
    monkeypatch.setattr(ds4.kvstore.admission, "open_checkpoint", real)
    again = TurnDriver(eng, CTX, store=store).generate(prompt + " more", GenParams(max_tokens=2))
    assert again.report.rung == "disk" and not again.report.rejected


# -- completion_tokens when a stop sequence starts inside a token ----------------
def test_text_stream_counts_the_token_a_stop_starts_inside():
    out = TextStream(("de",), None)
    assert [out.push(b) for b in (b"ab", b"cd", b"ef")] == [False, False, True]
    assert out.close() == "abc"
    assert out.tokens_before_stop() == 1  # "ab": the KV state keeps only it
    assert out.tokens_in_text() == 2  # "ab" and the "c" of "cd" were returned
    edge = TextStream(("cd",), None)  # a stop starting on a token boundary
    assert [edge.push(b) for b in (b"ab", b"cd")] == [False, True]
    assert edge.close() == "ab" and edge.tokens_before_stop() == edge.tokens_in_text() == 1
    assert TextStream((), None).tokens_in_text() == 0


def test_completion_tokens_count_a_token_cut_by_the_stop():
    from ds4.engines.llamacpp import LlamaCppEngine  # multi-byte tokens (the reference engine's are bytes)

    eng = LlamaCppEngine()
    prompt = eng.render_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    full = TurnDriver(eng, CTX).generate(prompt, GenParams(max_tokens=24))
    pieces = [eng.token_bytes(t) for t in full.tokens]
    # a two-byte ASCII stop: the last byte of token i and the first of token i + 1,
    # seen nowhere earlier in the answer
    cut = next(
        i
        for i in range(1, len(pieces) - 1)
        if len(pieces[i]) > 1
        and len(pieces[i + 1]) > 0
        and (pieces[i][-1:] + pieces[i + 1][:1]).isascii()
        and (pieces[i][-1:] + pieces[i + 1][:1]) not in b"".join(pieces[: i + 1])[:-1]
    )
    stop = (pieces[cut][-1:] + pieces[cut + 1][:1]).decode()
    res = TurnDriver(eng, CTX).generate(prompt, GenParams(max_tokens=24, stop=(stop,)))
    assert res.finish_reason == "stop"
    assert res.text.encode() == b"".join(pieces[:cut]) + pieces[cut][:-1]
    assert res.completion_tokens == cut + 1  # tokens 0..cut reached the client (the last one in part)
    assert len(res.tokens) == cut  # the KV state keeps whole tokens only


def test_the_old_name_of_the_turn_driver_still_works_and_warns():
    import ds4.turn

    with pytest.warns(DeprecationWarning, match="TurnDriver"):
        old = ds4.turn.Generator
    assert old is TurnDriver
    with pytest.warns(DeprecationWarning):
        from ds4.turn import Generator  # noqa: F401  (the old import line users have)
    with pytest.raises(AttributeError):
        ds4.turn.NoSuchThing  # noqa: B018
