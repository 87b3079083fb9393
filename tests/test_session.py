"""Session semantics (DESIGN.md "Session"), on the reference engine."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from ds4 import Rewrite
from ds4.errors import (
    ContextOverflowError,
    EmptyPromptError,
    EngineError,
    EngineStateError,
    InvalidSessionError,
    TokenCountMismatchError,
)


@pytest.fixture(scope="module")
def eng():
    return ds4.ReferenceEngine()


def toks(eng, text):
    return eng.tokenize(text, special=True)


def test_new_session_is_invalid(eng):
    s = ds4.Session(eng, ctx=512)
    assert not s.checkpoint_valid and s.tokens == [] and s.logits is None
    with pytest.raises(InvalidSessionError):
        s.argmax()
    with pytest.raises(InvalidSessionError):
        s.eval_token(1)
    with pytest.raises(InvalidSessionError):
        s.export_arrays()


def test_sync_extends_valid_state_only(eng):
    s = ds4.Session(eng, ctx=512)
    a = toks(eng, "hello there, general kenobi")
    assert s.sync(a[:10]) == 0
    assert s.sync(a) == 10  # extended: prefix reused
    assert s.tokens == a
    assert s.sync(a) == len(a)  # nothing to do
    b = toks(eng, "a different conversation")
    assert s.sync(b) == 0  # not an extension: rebuilt
    assert s.tokens == b
    s.invalidate()
    assert s.sync(b) == 0  # invalid state is never extended


def test_extend_equals_cold(eng):
    a = toks(eng, "The quick brown fox jumps over the lazy dog. " * 8)
    s1 = ds4.Session(eng, ctx=1024)
    s1.sync(a[:37])
    s1.sync(a)
    s2 = ds4.Session(eng, ctx=1024)
    s2.sync(a)
    assert np.array_equal(s1.logits, s2.logits)
    assert s1.generate(8) == s2.generate(8)


def test_invalidate_is_total(eng):
    s = ds4.Session(eng, ctx=512)
    s.sync(toks(eng, "some text"))
    s.invalidate()
    assert not s.checkpoint_valid and s.tokens == [] and s.logits is None and s.n_past == 0
    with pytest.raises(InvalidSessionError):
        s.eval_token(5)


def test_prompt_errors_leave_session_untouched(eng):
    s = ds4.Session(eng, ctx=64)
    a = toks(eng, "short prompt")
    s.sync(a)
    with pytest.raises(ContextOverflowError):
        s.sync(list(range(65)))
    # check_prompt runs before anything is touched
    assert s.checkpoint_valid and s.tokens == a
    with pytest.raises(EmptyPromptError):
        s.sync([])
    assert s.checkpoint_valid and s.tokens == a


def test_decode_at_context_end(eng):
    s = ds4.Session(eng, ctx=16)
    s.sync(list(range(97, 97 + 14)))
    s.eval_token(100)  # 15 tokens
    with pytest.raises(ContextOverflowError):
        s.eval_token(100)


def test_engine_error_mid_decode_invalidates(eng, monkeypatch):
    s = ds4.Session(eng, ctx=256)
    s.sync(toks(eng, "before the failure"))

    def boom(tokens, progress=None):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(s._ectx, "eval", boom)
    with pytest.raises(EngineError):
        s.eval_token(10)
    assert not s.checkpoint_valid and s.tokens == []


def test_rewrite_from_common(eng):
    s = ds4.Session(eng, ctx=512)
    a = toks(eng, "shared prefix then branch one")
    b = toks(eng, "shared prefix then branch two, longer")
    # invalid session -> ERROR
    assert s.rewrite_from_common(a) is Rewrite.ERROR
    s.sync(a)
    # common == live: extends, OK
    assert s.rewrite_from_common(a + toks(eng, " more")) is Rewrite.OK
    assert s.tokens == a + toks(eng, " more")
    before = (s.tokens, np.array(s.logits))
    # common < live and the reference engine cannot rewind: untouched
    assert s.rewrite_from_common(b) is Rewrite.REBUILD_NEEDED
    assert "rebuild" in s.last_error
    assert s.checkpoint_valid and s.tokens == before[0] and np.array_equal(s.logits, before[1])
    assert s.rewrite_from_common([]) is Rewrite.ERROR
    assert s.rewrite_from_common(list(range(600))) is Rewrite.ERROR
    assert s.tokens == before[0]


def test_export_load_round_trip_is_exact(eng, tmp_path):
    a = toks(eng, "checkpoint me " * 20)
    s = ds4.Session(eng, ctx=1024)
    s.sync(a)
    p = tmp_path / (ds4._core.sha1_hex(s.text_bytes()) + ".kv")
    ds4.write_checkpoint(p, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=s.n_past, ctx=s.ctx)
    ck = ds4.open_checkpoint(p, prompt=s.text_bytes(), expected_abi=s.payload_abi)
    s2 = ds4.Session(eng, ctx=1024)
    s2.load_checkpoint(ck)
    assert s2.checkpoint_valid and s2.tokens == a
    assert np.array_equal(s2.logits, s.logits)
    assert s2.generate(10) == s.generate(10)


def test_failed_load_is_transactional(eng, tmp_path):
    s = ds4.Session(eng, ctx=1024)
    a = toks(eng, "the live conversation")
    s.sync(a)
    live_logits = np.array(s.logits)
    donor = ds4.Session(eng, ctx=1024)
    donor.sync(toks(eng, "another conversation entirely"))
    arrays = donor.export_arrays()
    # token count mismatch: rejected before anything changes
    with pytest.raises(TokenCountMismatchError):
        s.load_arrays(arrays, donor.n_past + 1)
    assert s.checkpoint_valid and s.tokens == a and np.array_equal(s.logits, live_logits)
    # missing logits
    bad = {k: v for k, v in arrays.items() if k != "logits"}
    with pytest.raises(EngineStateError):
        s.load_arrays(bad, donor.n_past)
    assert s.checkpoint_valid and s.tokens == a
    # out-of-vocabulary tokens
    bad = dict(arrays)
    bad["tokens"] = np.full_like(arrays["tokens"], eng.vocab_size + 5)
    with pytest.raises(EngineStateError):
        s.load_arrays(bad, donor.n_past)
    assert s.checkpoint_valid and s.tokens == a
    # a wrongly shaped KV tensor: the engine rejects it. The session cannot
    # know how far a rejecting engine got, so it ends invalid and empty
    # (never half-loaded, never the old state claimed over a touched engine).
    bad = dict(arrays)
    k = next(n for n in arrays if n not in ("tokens", "logits"))
    bad[k] = arrays[k][:-1]
    with pytest.raises(EngineStateError):
        s.load_arrays(bad, donor.n_past)
    assert not s.checkpoint_valid and s.tokens == [] and s.logits is None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=20, max_size=300),
    cut_frac=st.floats(0.05, 0.95),
)
def test_resume_equals_cold_anywhere(eng, tmp_path_factory, text, cut_frac):
    """Random prompts, random cut points: save at the cut, resume from disk
    in a new store and session, extend to the full prompt: bit-identical
    logits and greedy continuation to a cold prefill."""
    prompt = eng.render_chat([{"role": "user", "content": text}])
    full = toks(eng, prompt)
    cut = max(1, int(len(full) * cut_frac))
    d = str(tmp_path_factory.mktemp("resume"))
    st_ = ds4.KVStore(d, min_tokens=1)
    a = ds4.Session(eng, ctx=2048)
    a.sync(full[:cut])
    assert st_.store_live_prefix(a, "named") is not None
    b = ds4.Session(eng, ctx=2048)
    rep = ds4.recover(b, ds4.KVStore(d, min_tokens=1), prompt)
    cold = ds4.Session(eng, ctx=2048)
    cold.sync(full)
    if rep.rung == "disk":
        assert rep.reused_tokens == cut
    else:
        # only when the cut splits a UTF-8 sequence is the suffix untokenizable
        assert not _utf8_boundary(a.text_bytes(), len(a.text_bytes()))
    assert b.tokens == full
    assert np.array_equal(b.logits, cold.logits)
    assert b.generate(6) == cold.generate(6)


def _utf8_boundary(b: bytes, n: int) -> bool:
    try:
        b[:n].decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_rewrite_rewinds_when_the_engine_can(eng, monkeypatch):
    """An engine that can truncate rewinds instead of rebuilding; the result
    equals a cold prefill of the new tokens."""
    import types

    a = toks(eng, "shared prefix then branch one")
    b = toks(eng, "shared prefix then branch two, longer")
    s = ds4.Session(eng, ctx=512)
    s.sync(a)
    common = s.common_prefix(b)

    def truncate(self, n):  # a rewinding engine: rebuild the prefix exactly
        self.reset()
        self.eval(a[:n])
        return True

    monkeypatch.setattr(s._ectx, "truncate", types.MethodType(truncate, s._ectx))
    assert s.rewrite_from_common(b) is Rewrite.OK
    cold = ds4.Session(eng, ctx=512)
    cold.sync(b)
    assert s.tokens == b and np.array_equal(s.logits, cold.logits)
    assert 0 < common < len(a)


def test_recover_bad_prompts_are_typed_and_harmless(eng, tmp_path):
    store = ds4.KVStore(tmp_path, min_tokens=4)
    s = ds4.Session(eng, ctx=128)
    a = toks(eng, "a live conversation to keep")
    s.sync(a)
    with pytest.raises(ContextOverflowError):
        ds4.recover(s, store, "x" * 500)
    with pytest.raises(EmptyPromptError):
        ds4.recover(s, store, "")
    assert s.checkpoint_valid and s.tokens == a  # untouched
    assert [f for f in os.listdir(tmp_path) if f.endswith(".kv")] == []  # nothing saved or lost


# -- generate against a hand-computed greedy chain --------------------------------


def _greedy_chain(eng, prompt_tokens, n, ctx):
    """The greedy continuation computed step by step through eval_token, with
    the logits after each evaluated token."""
    s = ds4.Session(eng, ctx=ctx)
    s.sync(prompt_tokens)
    chain, states = [], [np.array(s.logits)]
    for _ in range(n):
        t = int(np.argmax(s.logits))
        chain.append(t)
        s.eval_token(t)
        states.append(np.array(s.logits))
    return chain, states


def test_generate_is_the_greedy_chain(eng):
    a = toks(eng, "Once upon a time, ")
    chain, states = _greedy_chain(eng, a, 6, 256)
    s = ds4.Session(eng, ctx=256)
    s.sync(a)
    seen = []
    out = s.generate(6, on_token=seen.append)
    assert out == chain and seen == chain
    assert all(type(t) is int for t in out)
    # every generated token, the last one included, was evaluated
    assert s.tokens == a + chain and np.array_equal(s.logits, states[6])
    assert s.generate(0) == [] and s.tokens == a + chain


def test_generate_stops_after_a_stop_token_without_evaluating_it(eng):
    a = toks(eng, "Once upon a time, ")
    chain, states = _greedy_chain(eng, a, 8, 256)
    # the first position whose token did not occur before it
    k = next(i for i in range(1, len(chain)) if chain[i] not in chain[:i])
    s = ds4.Session(eng, ctx=256)
    s.sync(a)
    seen = []
    out = s.generate(20, stop_tokens=[np.int64(chain[k]), eng.vocab_size + 7], on_token=seen.append)
    assert out == chain[: k + 1] and seen == chain[: k + 1]
    assert s.tokens == a + chain[:k] and np.array_equal(s.logits, states[k])


def test_generate_stops_at_the_context_end(eng):
    """With ctx=16 and 10 prompt tokens, decoding may fill positions up to 15:
    six tokens come out (the sixth is returned but not evaluated), no error."""
    a = list(range(97, 107))
    chain, states = _greedy_chain(eng, a, 5, 16)
    s = ds4.Session(eng, ctx=16)
    s.sync(a)
    t6 = int(np.argmax(states[5]))
    out = s.generate(20)
    assert out == [*chain, t6]
    assert s.n_past == 15 and s.tokens == a + chain and np.array_equal(s.logits, states[5])
    # at the end already: one token comes out, nothing is evaluated
    assert s.generate(3) == [t6] and s.n_past == 15


# -- common_prefix / rewrite_from_common -----------------------------------------


def test_common_prefix_of_an_invalid_session_is_zero(eng):
    s = ds4.Session(eng, ctx=64)
    a = toks(eng, "abc")
    assert s.common_prefix(a) == 0
    s.sync(a)
    assert s.common_prefix([*a, 1]) == 3 and s.common_prefix([7]) == 0
    s.invalidate()
    assert s.common_prefix(a) == 0


def test_rewrite_errors_say_why(eng):
    s = ds4.Session(eng, ctx=32)
    a = toks(eng, "shared prefix")
    assert s.rewrite_from_common(a) is Rewrite.ERROR
    assert s.last_error == "session has no valid checkpoint"
    s.sync(a)
    assert s.rewrite_from_common([]) is Rewrite.ERROR
    assert s.last_error == "prompt is empty"
    # exactly ctx tokens (an extension of the live ones): no room left
    full = a + list(range(97, 97 + 32 - len(a)))
    assert len(full) == s.ctx
    assert s.rewrite_from_common(full) is Rewrite.ERROR
    assert s.last_error == "prompt exceeds context"
    assert s.checkpoint_valid and s.tokens == a
    # one below: fits; a success clears the previous error
    assert s.rewrite_from_common(full[:-1]) is Rewrite.OK
    assert s.last_error is None and s.tokens == full[:-1]


def test_rewrite_with_nothing_in_common_needs_rebuild(eng):
    s = ds4.Session(eng, ctx=128)
    a = toks(eng, "apples and pears")
    s.sync(a)
    before = np.array(s.logits)
    b = toks(eng, "zebras")
    assert s.rewrite_from_common(b) is Rewrite.REBUILD_NEEDED
    assert s.last_error == f"rewrite needs rebuild: common=0 live={len(a)} canonical={len(b)}"
    assert s.checkpoint_valid and s.tokens == a and np.array_equal(s.logits, before)


def test_rewrite_extension_never_asks_the_engine_to_rewind(eng, monkeypatch):
    """An engine that cannot rewind at all still extends: when the live state
    is a prefix of the new tokens no truncate is needed."""
    import types

    s = ds4.Session(eng, ctx=128)
    a = toks(eng, "a live conversation")
    s.sync(a)
    calls = []

    def truncate(self, n):
        calls.append(n)
        return False

    monkeypatch.setattr(s._ectx, "truncate", types.MethodType(truncate, s._ectx))
    b = a + toks(eng, " goes on")
    assert s.rewrite_from_common(b) is Rewrite.OK and s.last_error is None
    assert calls == [] and s.tokens == b


def _rewinding(monkeypatch, s, logits_dtype=None):
    """Give s's engine context an exact rewind (re-prefill of the kept prefix);
    optionally its last_logits returns another dtype."""
    import types

    ectx = s._ectx

    def truncate(self, n):
        keep = list(s._tokens[:n])
        self.reset()
        if keep:
            self.eval(keep)
        return True

    monkeypatch.setattr(ectx, "truncate", types.MethodType(truncate, ectx))
    if logits_dtype is not None:
        real = ectx.last_logits
        monkeypatch.setattr(ectx, "last_logits", lambda: real().astype(logits_dtype))


def _cold(eng, tokens, ctx):
    c = ds4.Session(eng, ctx=ctx)
    c.sync(tokens)
    return np.array(c.logits)


@pytest.mark.parametrize("dtype", [None, np.float64])
def test_rewind_to_a_strict_prefix_restores_the_engine_logits(eng, monkeypatch, dtype):
    """The new tokens are a prefix of the live ones: nothing is evaluated after
    the rewind, so the logits are the engine's restored ones (as float32)."""
    s = ds4.Session(eng, ctx=128)
    a = toks(eng, "a conversation to cut short")
    s.sync(a)
    _rewinding(monkeypatch, s, dtype)
    k = 9
    assert s.rewrite_from_common(a[:k]) is Rewrite.OK and s.last_error is None
    assert s.checkpoint_valid and s.tokens == a[:k]
    assert s.logits.dtype == np.float32 and np.array_equal(s.logits, _cold(eng, a[:k], 128))


def test_rewind_to_one_common_token(eng, monkeypatch):
    s = ds4.Session(eng, ctx=128)
    a, b = toks(eng, "sXYZ one"), toks(eng, "sABC two")
    s.sync(a)
    _rewinding(monkeypatch, s)
    assert s.common_prefix(b) == 1
    assert s.rewrite_from_common(b) is Rewrite.OK
    assert s.tokens == b and np.array_equal(s.logits, _cold(eng, b, 128))


def test_rewind_failure_invalidates_and_says_why(eng, monkeypatch):
    s = ds4.Session(eng, ctx=128)
    a, b = toks(eng, "shared prefix then branch one"), toks(eng, "shared prefix then branch two")
    s.sync(a)

    def truncate(n):
        raise RuntimeError("device lost")

    monkeypatch.setattr(s._ectx, "truncate", truncate)
    assert s.rewrite_from_common(b) is Rewrite.ERROR
    assert s.last_error == "rewind failed: device lost"
    assert not s.checkpoint_valid and s.tokens == [] and s.logits is None


def test_rewrite_reports_a_failed_prefill(eng, monkeypatch):
    s = ds4.Session(eng, ctx=128)
    a = toks(eng, "a live conversation")
    s.sync(a)

    def boom(tokens, progress=None):
        raise RuntimeError("device lost")

    monkeypatch.setattr(s._ectx, "eval", boom)
    assert s.rewrite_from_common(a + toks(eng, " goes on")) is Rewrite.ERROR
    assert s.last_error == "engine failed during prefill/decode: device lost"
    assert not s.checkpoint_valid


def test_checkpoint_array_by_name(eng, tmp_path):
    a = toks(eng, "checkpoint me")
    s = ds4.Session(eng, ctx=128)
    s.sync(a)
    p = tmp_path / (ds4._core.sha1_hex(s.text_bytes()) + ".kv")
    ds4.write_checkpoint(p, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=s.n_past, ctx=s.ctx)
    ck = ds4.open_checkpoint(p, prompt=s.text_bytes())
    assert ck.array("tokens").tolist() == a
    assert np.array_equal(ck.array("logits"), s.logits)
    with pytest.raises(KeyError) as ei:
        ck.array("no-such-tensor")
    assert ei.value.args == ("no-such-tensor",)


def test_argmax_on_an_invalid_session_says_why(eng):
    s = ds4.Session(eng, ctx=64)
    with pytest.raises(InvalidSessionError, match=r"^argmax on a session without a valid checkpoint$"):
        s.argmax()


def test_load_checkpoint_of_another_abi_names_both_and_the_file(eng, tmp_path):
    from ds4.errors import AbiMismatchError

    d = ds4.Session(eng, ctx=256)
    d.sync(toks(eng, "another engine's state"))
    p = tmp_path / (ds4._core.sha1_hex(d.text_bytes()) + ".kv")
    ds4.write_checkpoint(p, d.text_bytes(), d.export_arrays(), abi="other/1", tokens=d.n_past, ctx=256)
    ck = ds4.open_checkpoint(p)  # no expected ABI: the session is the one to refuse it
    s = ds4.Session(eng, ctx=256)
    s.sync(toks(eng, "the live conversation"))
    with pytest.raises(AbiMismatchError) as ei:
        s.load_checkpoint(ck)
    assert ei.value.path == str(p)
    assert ei.value.reason == f"payload ABI 'other/1' differs from {s.payload_abi!r}"
    assert s.checkpoint_valid  # refused before anything changed
