"""Session semantics (docs/DESIGN.md, "Session"), on the reference engine."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.kv import toks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from ds4 import Rewrite
from ds4.errors import (
    ContextOverflowError,
    ContextTooSmallError,
    CorruptCheckpointError,
    EmptyPromptError,
    EngineError,
    EngineStateError,
    ImportFailedError,
    IncompatibleCheckpointError,
    InvalidSessionError,
    TokenCountMismatchError,
)


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


def test_load_checkpoint_of_another_abi_names_both_and_the_file(eng, tmp_path, save_session):
    from ds4.errors import AbiMismatchError

    d = ds4.Session(eng, ctx=256)
    d.sync(toks(eng, "another engine's state"))
    p = save_session(tmp_path, d, abi="other/1")
    ck = ds4.open_checkpoint(p)  # no expected ABI: the session is the one to refuse it
    s = ds4.Session(eng, ctx=256)
    s.sync(toks(eng, "the live conversation"))
    with pytest.raises(AbiMismatchError) as ei:
        s.load_checkpoint(ck)
    assert ei.value.path == p
    assert ei.value.reason == f"payload ABI 'other/1' differs from {s.payload_abi!r}"
    assert s.checkpoint_valid  # refused before anything changed


# -- load_arrays: every check runs before the live state changes ------------------


def _live(eng, ctx=64, text="the live conversation"):
    s = ds4.Session(eng, ctx=ctx)
    s.sync(toks(eng, text))
    return s


def _snapshot(s):
    """Everything observable about a session, engine state included."""
    if not s.checkpoint_valid:
        return (False, s.tokens, s.logits, None)
    state = {k: np.array(v) for k, v in s.export_arrays().items()}
    return (True, s.tokens, np.array(s.logits), state)


def _assert_same(s, snap):
    now = _snapshot(s)
    assert now[:2] == snap[:2]
    if snap[0]:
        assert np.array_equal(now[2], snap[2])
        assert now[3].keys() == snap[3].keys()
        assert all(np.array_equal(now[3][k], snap[3][k]) for k in snap[3])


def _donor_arrays(eng, n, ctx=64):
    d = ds4.Session(eng, ctx=ctx)
    d.sync(list(range(97, 97 + n)))
    return d.export_arrays()


def _bad_tokens(arrays):
    n = len(arrays["tokens"])
    t = arrays["tokens"]
    yield "missing", {k: v for k, v in arrays.items() if k != "tokens"}
    yield "int64", {**arrays, "tokens": t.astype(np.int64)}
    yield "uint32", {**arrays, "tokens": t.astype(np.uint32)}
    yield "2-d int32", {**arrays, "tokens": t.reshape(n, 1)}
    yield "0-d int32", {**arrays, "tokens": np.array(t[0], dtype=np.int32)}


def test_load_rejects_a_tokens_tensor_that_is_not_an_int32_vector(eng):
    s = _live(eng)
    snap = _snapshot(s)
    arrays = _donor_arrays(eng, 9)
    for what, bad in _bad_tokens(arrays):
        with pytest.raises(EngineStateError) as ei:
            s.load_arrays(bad, 9 if what != "0-d int32" else 1)
        assert ei.value.reason == "payload has no int32 'tokens' tensor", what
        assert ei.value.code == "engine_rejected" and ei.value.stage == "engine"
        _assert_same(s, snap)


def test_load_rejects_a_token_count_that_differs_from_the_header(eng):
    s = _live(eng)
    snap = _snapshot(s)
    arrays = _donor_arrays(eng, 9)
    for header in (8, 10):
        with pytest.raises(TokenCountMismatchError) as ei:
            s.load_arrays(arrays, header)
        assert ei.value.reason == f"payload holds 9 tokens, the header says {header}"
        assert ei.value.code == "token_count_mismatch"
        _assert_same(s, snap)


@pytest.mark.parametrize("n", [0, 32, 33])
def test_load_rejects_token_counts_outside_one_to_ctx_minus_one(eng, n):
    """A checkpoint must leave room for one more token: ``0 < n < ctx``.
    Both failures are checkpoint errors (a rejection of that candidate, never
    a prompt error escaping the ladder, issue 13): no tokens is corrupt, too
    many for this context is incompatible (kept: a larger context loads it).
    The reason names the count and the context; nothing changes."""
    s = _live(eng, ctx=32)
    snap = _snapshot(s)
    if n:
        arrays = _donor_arrays(eng, n, ctx=64)
        with pytest.raises(ContextTooSmallError) as ei:
            s.load_arrays(arrays, n)
        assert ei.value.reason == f"{n} tokens do not fit a context of 32"
    else:
        arrays = {**_donor_arrays(eng, 1), "tokens": np.zeros(0, np.int32)}
        with pytest.raises(TokenCountMismatchError) as ei:
            s.load_arrays(arrays, n)
        assert ei.value.reason == "payload holds no tokens"
    _assert_same(s, snap)


def test_load_of_ctx_minus_one_tokens_fits(eng):
    arrays = _donor_arrays(eng, 31, ctx=64)
    s = _live(eng, ctx=32)
    s.load_arrays(arrays, 31)
    assert s.checkpoint_valid and s.tokens == list(range(97, 128))
    assert np.array_equal(s.logits, _cold(eng, list(range(97, 128)), 32))


def test_load_accepts_token_ids_zero_and_vocab_size_minus_one(eng):
    """The vocabulary check is exactly ``0 <= id < vocab_size``: both ends of
    the range load (the reference engine does not re-check ids against its
    KV, so the ids are what the session reports)."""
    arrays = _donor_arrays(eng, 5)
    ids = np.array([0, eng.vocab_size - 1, 0, 7, eng.vocab_size - 1], np.int32)
    s = _live(eng)
    s.load_arrays({**arrays, "tokens": ids}, 5)
    assert s.checkpoint_valid and s.tokens == ids.tolist()
    assert np.array_equal(s.logits, arrays["logits"])


@pytest.mark.parametrize("bad_id", ["vocab_size", -1])
def test_load_rejects_token_ids_just_outside_the_vocabulary(eng, bad_id):
    arrays = _donor_arrays(eng, 5)
    bad = eng.vocab_size if bad_id == "vocab_size" else -1
    ids = np.array([1, 2, bad, 3, eng.vocab_size - 1], np.int32)
    s = _live(eng)
    snap = _snapshot(s)
    with pytest.raises(EngineStateError) as ei:
        s.load_arrays({**arrays, "tokens": ids}, 5)
    assert ei.value.reason == "payload tokens are out of the vocabulary's range"
    _assert_same(s, snap)


@pytest.mark.parametrize("logits", ["missing", "short", "long", "2-d"])
def test_load_rejects_logits_not_of_the_vocabulary_size(eng, logits):
    arrays = _donor_arrays(eng, 5)
    lg = arrays["logits"]
    bad = {
        "missing": {k: v for k, v in arrays.items() if k != "logits"},
        "short": {**arrays, "logits": lg[:-1]},
        "long": {**arrays, "logits": np.append(lg, np.float32(0))},
        "2-d": {**arrays, "logits": lg.reshape(1, -1)},
    }[logits]
    s = _live(eng)
    snap = _snapshot(s)
    with pytest.raises(EngineStateError) as ei:
        s.load_arrays(bad, 5)
    assert ei.value.reason == "payload has no logits of the vocabulary's size"
    _assert_same(s, snap)


def test_loaded_logits_are_an_own_float32_copy(eng, monkeypatch):
    """Whatever dtype an engine accepts for the logits tensor, the session
    keeps its own float32 copy (as after a prefill or a rewind)."""
    arrays = _donor_arrays(eng, 5)
    s = _live(eng)
    real = s._ectx.import_state

    def import_state(state, n):  # an engine that takes float64 logits
        assert state["logits"].dtype == np.float64
        real({**state, "logits": state["logits"].astype(np.float32)}, n)

    monkeypatch.setattr(s._ectx, "import_state", import_state)
    wide = arrays["logits"].astype(np.float64)
    s.load_arrays({**arrays, "logits": wide}, 5)
    assert s.logits.dtype == np.float32 and np.array_equal(s.logits, arrays["logits"])
    wide[:] = 0  # the checkpoint's array is not the session's
    assert np.array_equal(s.logits, arrays["logits"])


def test_engine_failure_while_loading_is_an_import_failure_and_invalidates(eng, monkeypatch):
    """Not proof of a corrupt file (a limit or fault of the engine): typed
    ``import_failed``, incompatible, so a store keeps the file."""
    arrays = _donor_arrays(eng, 5)
    s = _live(eng)
    cause = RuntimeError("device lost")

    def import_state(state, n):
        raise cause

    monkeypatch.setattr(s._ectx, "import_state", import_state)
    with pytest.raises(ImportFailedError) as ei:
        s.load_arrays(arrays, 5)
    assert ei.value.reason == "engine failed to load the state: device lost"
    assert isinstance(ei.value, IncompatibleCheckpointError) and not isinstance(ei.value, CorruptCheckpointError)
    assert ei.value.__cause__ is cause
    assert not s.checkpoint_valid and s.tokens == [] and s.logits is None


# -- eval_token / export_arrays guards ----------------------------------------------


def test_eval_token_guards_are_typed_and_say_why(eng):
    s = ds4.Session(eng, ctx=16)
    with pytest.raises(InvalidSessionError) as ei:
        s.eval_token(5)
    assert str(ei.value) == "cannot extend a session without a valid checkpoint"
    s.sync(list(range(97, 97 + 15)))
    snap = _snapshot(s)
    with pytest.raises(ContextOverflowError) as ei:
        s.eval_token(100)  # would make 16 tokens in a 16-token context
    assert (ei.value.n_tokens, ei.value.ctx) == (16, 16)
    assert str(ei.value) == "prompt of 16 tokens does not fit context 16"
    _assert_same(s, snap)  # refused before the engine saw it


def test_export_arrays_guards_are_typed_and_say_why(eng, monkeypatch):
    s = ds4.Session(eng, ctx=64)
    with pytest.raises(InvalidSessionError) as ei:
        s.export_arrays()
    assert str(ei.value) == "cannot save a session without a valid checkpoint"
    s.sync(toks(eng, "a live state"))
    real = s._ectx.export_state
    monkeypatch.setattr(s._ectx, "export_state", lambda: {**real(), "tokens": np.zeros(1, np.int32)})
    with pytest.raises(EngineError) as ei:
        s.export_arrays()
    assert str(ei.value) == "engine state uses the reserved tensor name 'tokens'"


def test_mid_cold_prefill_the_session_has_no_logits_and_cannot_be_saved(eng):
    """During the first chunk of a cold prefill the session describes zero
    tokens: an observer (the progress callback) sees no logits, argmax and
    export refuse with InvalidSessionError."""
    seen = []

    def progress(done, total):
        if s.n_past:
            return
        seen.append(("logits", s.logits))
        for what in ("argmax", "export_arrays"):
            try:
                getattr(s, what)()
                seen.append((what, "returned"))
            except Exception as e:  # recorded, asserted below
                seen.append((what, type(e), str(e)))

    s = ds4.Session(eng, ctx=64)
    s.sync(toks(eng, "a cold prompt"), progress=progress)
    assert seen[:3] == [
        ("logits", None),
        ("argmax", InvalidSessionError, "argmax on a session without a valid checkpoint"),
        ("export_arrays", InvalidSessionError, "cannot save a session without a valid checkpoint"),
    ]
    assert s.checkpoint_valid and s.tokens == toks(eng, "a cold prompt")


def test_invalidate_replaces_an_engine_context_that_cannot_reset(eng, monkeypatch):
    """A broken engine context is replaced by a fresh one of the session's
    size: invalidate itself never raises, and the session works again."""
    s = _live(eng, ctx=48)
    broken = s._ectx

    def reset():
        raise RuntimeError("context lost")

    monkeypatch.setattr(broken, "reset", reset)
    s.invalidate("test")
    assert not s.checkpoint_valid and s.tokens == [] and s.logits is None
    assert s._ectx is not broken and s._ectx.n_ctx == 48 and s._ectx.n_past == 0
    arrays = _donor_arrays(eng, 6)
    s.load_arrays(arrays, 6)  # straight into the new context, no reset first
    assert s.checkpoint_valid and s.tokens == list(range(97, 103))
    cold = ds4.Session(eng, ctx=48)
    cold.sync(list(range(97, 103)))
    assert np.array_equal(s.logits, cold.logits) and s.generate(4) == cold.generate(4)


# -- checkpoint writing: what the Python side does before the Rust core -----------


def _ck_path(d, text=b"t"):
    return d / (ds4._core.sha1_hex(text) + ".kv")


def test_write_refuses_big_endian_arrays_naming_the_tensor(tmp_path):
    with pytest.raises(ValueError) as ei:
        ds4.write_checkpoint(
            _ck_path(tmp_path), b"t", {"ok": np.zeros(2), "kv.be": np.zeros(3, ">f4")}, abi="t/1", tokens=1, ctx=2
        )
    assert str(ei.value) == "tensor 'kv.be': big-endian arrays are not supported"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.uint16])
@pytest.mark.parametrize("step", [2, -1, -3])
def test_one_dimensional_strided_arrays_are_written_in_logical_order(tmp_path, dtype, step):
    """A 1-D view with a stride (a slice with a step, a reversal) has no
    contiguous bytes to stream: the writer copies it to C order first."""
    a = np.arange(20, dtype=dtype)[::step]
    assert not a.flags.c_contiguous
    p = _ck_path(tmp_path)
    ds4.write_checkpoint(p, b"t", {"a": a}, abi="t/1", tokens=1, ctx=2)
    got = ds4.open_checkpoint(p).array("a")
    assert got.dtype == a.dtype and got.shape == a.shape and got.tolist() == a.tolist()


def test_unknown_reason_names_are_stored_as_named(tmp_path):
    from ds4.checkpoint import REASONS, reason_code

    assert reason_code("a-label-of-my-own") == REASONS.index("named")
    assert reason_code("evict") == REASONS.index("evict") and reason_code(5) == 5
    p = _ck_path(tmp_path)
    ds4.write_checkpoint(p, b"t", {}, abi="t/1", tokens=1, ctx=2, reason="a-label-of-my-own")
    assert ds4.open_checkpoint(p).reason_name == "named"

    p2 = _ck_path(tmp_path, b"u")
    ds4.write_checkpoint(p2, b"u", {}, abi="t/1", tokens=1, ctx=2)  # the default reason
    assert ds4.open_checkpoint(p2).reason_name == "cold"


# -- construction, prompt checks, prefill plumbing ----------------------------------


def test_new_session_state_exactly(eng):
    s = ds4.Session(eng)
    assert s.ctx == 8192  # the default context
    assert s.checkpoint_valid is False and s.last_error is None and s.n_past == 0
    assert s.text_bytes() == b"" and s.text_bytes(3) == b""


def test_session_context_bounds(eng):
    for ctx in (1, 0, -5):
        with pytest.raises(ValueError) as ei:
            ds4.Session(eng, ctx=ctx)
        assert str(ei.value) == f"ctx must be > 1, got {ctx}"
    assert ds4.Session(eng, ctx=2).ctx == 2
    assert ds4.Session(eng, ctx=eng.max_ctx).ctx == eng.max_ctx
    with pytest.raises(ValueError) as ei:
        ds4.Session(eng, ctx=eng.max_ctx + 1)
    assert str(ei.value) == f"ctx {eng.max_ctx + 1} exceeds the engine's maximum {eng.max_ctx}"


def test_check_prompt_errors_are_exact(eng):
    s = ds4.Session(eng, ctx=16)
    with pytest.raises(EmptyPromptError) as ei:
        s.check_prompt([])
    assert str(ei.value) == "prompt is empty"
    s.check_prompt(list(range(97, 97 + 15)))  # ctx - 1 fits
    with pytest.raises(ContextOverflowError) as ei:
        s.sync(list(range(97, 97 + 16)))
    assert (ei.value.n_tokens, ei.value.ctx) == (16, 16)
    assert not s.checkpoint_valid


def test_engine_logits_are_kept_as_float32(eng, monkeypatch):
    s = ds4.Session(eng, ctx=64)
    real = s._ectx.eval
    monkeypatch.setattr(s._ectx, "eval", lambda t, progress=None: real(t, progress).astype(np.float64))
    a = toks(eng, "wide logits")
    s.sync(a)
    assert s.logits.dtype == np.float32 and np.array_equal(s.logits, _cold(eng, a, 64))


@pytest.mark.parametrize("exc", [EngineError("engine says no"), KeyboardInterrupt()])
def test_engine_errors_and_interrupts_propagate_unwrapped(eng, monkeypatch, exc):
    s = _live(eng)

    def boom(tokens, progress=None):
        raise exc

    monkeypatch.setattr(s._ectx, "eval", boom)
    with pytest.raises(type(exc)) as ei:
        s.eval_token(5)
    assert ei.value is exc
    assert not s.checkpoint_valid and s.tokens == []


def test_extension_progress_counts_only_the_new_tokens(eng):
    """Progress of an extension runs over the new tokens only, across the
    frontier cuts, ending at (total, total)."""
    a = list(range(97, 97 + 40))
    for fe, fronts in ((None, None), (8, [])):
        s = ds4.Session(eng, ctx=64)
        s.sync(a[:13])
        prog = []
        on_frontier = None if fronts is None else (lambda sess, f=fronts: f.append(sess.n_past))
        assert (
            s.sync(a, progress=lambda d, t, p=prog: p.append((d, t)), frontier_every=fe, on_frontier=on_frontier) == 13
        )
        assert {t for _, t in prog} == {27}
        assert [d for d, _ in prog] == sorted(d for d, _ in prog) and prog[-1] == (27, 27)
        if fronts is not None:
            assert fronts == [16, 24, 32, 40]  # the end is a multiple too
            assert {16 - 13, 24 - 13, 32 - 13} <= {d for d, _ in prog}
        assert s.tokens == a and np.array_equal(s.logits, _cold(eng, a, 64))


def test_frontier_callback_without_an_interval_is_never_called(eng):
    a = list(range(97, 97 + 20))
    s = ds4.Session(eng, ctx=64)
    called = []
    assert s.sync(a, on_frontier=called.append) == 0
    assert called == [] and s.tokens == a


def test_frontier_interval_without_a_callback_does_not_split_the_prefill(eng, monkeypatch):
    s = ds4.Session(eng, ctx=64)
    real, calls = s._ectx.eval, []

    def counting(tokens, progress=None):
        calls.append(len(tokens))
        return real(tokens, progress)

    monkeypatch.setattr(s._ectx, "eval", counting)
    s.sync(list(range(97, 97 + 20)), frontier_every=4)
    assert calls == [20]


def test_open_checkpoint_maps_by_default_and_reads_with_pread_on_request(eng, tmp_path, save_session):
    d = ds4.Session(eng, ctx=256)
    d.sync(toks(eng, "a checkpoint to open two ways"))
    p = save_session(tmp_path, d)
    assert ds4.open_checkpoint(p).mapped is True
    assert ds4.open_checkpoint(p, mmap=False).mapped is False


def test_checkpoint_without_its_core_says_which_attribute():
    """A Checkpoint being copied or unpickled has no ``_core`` yet: asking
    for it is a plain AttributeError naming it (no recursion)."""
    bare = ds4.checkpoint.Checkpoint.__new__(ds4.checkpoint.Checkpoint)
    with pytest.raises(AttributeError) as ei:
        _ = bare._core
    assert ei.value.args == ("_core",)


class _Counting:
    """An engine that counts the contexts it opens (otherwise ``inner``)."""

    def __init__(self, inner):
        self.inner, self.opened = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def new_context(self, n_ctx):
        self.opened += 1
        return self.inner.new_context(n_ctx)


def test_a_lazy_session_opens_its_context_at_first_use_and_matches_an_eager_one(eng):
    counting = _Counting(eng)
    lazy = ds4.Session(counting, ctx=64, lazy=True)
    assert counting.opened == 0 and not lazy.checkpoint_valid
    eager = ds4.Session(eng, ctx=64)
    for s in (lazy, eager):
        s.sync(toks(eng, "a lazy context is opened when the first prompt comes"))
    assert counting.opened == 1
    assert lazy.tokens == eager.tokens
    np.testing.assert_array_equal(lazy.logits, eager.logits)


def test_a_pools_spare_residents_open_no_context_at_start(eng):
    """The server answers sooner: resident 0's context is opened at start (a
    context that does not fit fails there), the others' at first need."""
    from ds4.server.pool import Pool
    from ds4.turn import TurnDriver

    counting = _Counting(eng)
    pool = Pool(TurnDriver(counting, 64), 4)
    assert pool.size == 4 and counting.opened == 1
    pool.residents[3].gen.sess.sync(toks(eng, "the fourth resident's first prompt"))
    assert counting.opened == 2
