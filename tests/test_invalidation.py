"""Every place the live session is invalidated, pinned.

Invalidation is what the design stands on: a failed load, a failed engine, a
corrupt candidate must leave the live session invalid and empty (never
half-loaded, never silently holding another conversation's state), and the
next use must rebuild from a clean state, equal to a cold prefill.

Each test starts from a *valid* session holding some other conversation, so
a missing ``invalidate`` leaves it marked valid (with stale tokens, or with
tokens that no longer describe the engine's state) and the test fails.
"""

from __future__ import annotations

import io
import os
import types

import numpy as np
import pytest
from helpers.checkpoints import flip_payload_byte
from helpers.kv import toks

import ds4
from ds4 import Rewrite, recovery
from ds4.errors import (
    CorruptCheckpointError,
    EngineError,
    EngineStateError,
    ImportFailedError,
    PayloadChecksumError,
)
from ds4.recovery import try_load_text
from ds4.turn import GenParams, TurnDriver

CTX = 512


def live_session(eng, text="an unrelated live conversation that must not survive a failure"):
    s = ds4.Session(eng, ctx=CTX)
    s.sync(toks(eng, text))
    assert s.checkpoint_valid and s.n_past > 0
    return s


def assert_invalid_and_empty(s):
    assert not s.checkpoint_valid
    assert s.tokens == [] and s.n_past == 0 and s.logits is None
    assert s._ectx.n_past == 0, "the engine context still holds state after invalidation"


def assert_rebuilds_clean(s, eng, tokens):
    """The next use starts from nothing and ends equal to a cold prefill."""
    assert s.sync(tokens) == 0
    cold = ds4.Session(eng, ctx=s.ctx)
    cold.sync(tokens)
    assert s.tokens == list(tokens)
    assert np.array_equal(s.logits, cold.logits)
    assert s.generate(5) == cold.generate(5)


@pytest.fixture
def saved_checkpoint(eng, save_session):
    """``saved_checkpoint(directory, text) -> (path, tokens)``: a v2
    checkpoint of ``text``, prefilled in a donor session."""

    def save(directory, text):
        donor = ds4.Session(eng, ctx=CTX)
        t = toks(eng, text)
        donor.sync(t)
        return save_session(directory, donor), t

    return save


# -- Session.load_arrays / load_checkpoint ------------------------------------
def _donor_arrays(eng, text="the donor conversation, loaded from disk"):
    d = ds4.Session(eng, ctx=CTX)
    d.sync(toks(eng, text))
    return d.export_arrays(), d.n_past, d.tokens


def test_engine_import_failing_half_way_invalidates(eng):
    s = live_session(eng)
    arrays, n, donor_tokens = _donor_arrays(eng)
    real_import = s._ectx.import_state

    def half_way(self, state, n_tokens):
        real_import(state, n_tokens)  # the engine's state is now the donor's...
        raise RuntimeError("device lost while importing")  # ...and then it fails

    s._ectx.import_state = types.MethodType(half_way, s._ectx)
    with pytest.raises(ImportFailedError):  # not the file's fault as far as is known: kept by a store
        s.load_arrays(arrays, n)
    assert_invalid_and_empty(s)
    del s._ectx.import_state
    assert_rebuilds_clean(s, eng, donor_tokens)


def test_engine_rejecting_the_state_invalidates(eng):
    s = live_session(eng)
    arrays, n, _ = _donor_arrays(eng)
    bad = dict(arrays)
    k = next(name for name in arrays if name not in ("tokens", "logits"))
    bad[k] = arrays[k][:-1]  # a wrongly shaped KV tensor: the engine says no
    with pytest.raises(EngineStateError):
        s.load_arrays(bad, n)
    assert_invalid_and_empty(s)
    assert_rebuilds_clean(s, eng, toks(eng, "after the rejected load"))


def test_engine_rejecting_after_mutating_invalidates(eng):
    """An engine that breaks its promise (mutates, then says EngineStateError)
    still cannot leave foreign state marked valid."""
    s = live_session(eng)
    arrays, n, donor_tokens = _donor_arrays(eng)
    real_import = s._ectx.import_state

    def liar(self, state, n_tokens):
        real_import(state, n_tokens)
        raise EngineStateError("rejected after all")

    s._ectx.import_state = types.MethodType(liar, s._ectx)
    with pytest.raises(EngineStateError):
        s.load_arrays(arrays, n)
    assert_invalid_and_empty(s)
    del s._ectx.import_state
    assert_rebuilds_clean(s, eng, donor_tokens)


TRUNCATE_CHILD = r"""
import os, sys
import numpy as np
import ds4
from ds4.errors import TruncatedCheckpointError
eng = ds4.ReferenceEngine()
donor = ds4.Session(eng, ctx=512)
donor.sync(eng.tokenize("the donor conversation " * 6, special=True))
p = os.path.join(sys.argv[1], ds4._core.sha1_hex(donor.text_bytes()) + ".kv")
ds4.write_checkpoint(p, donor.text_bytes(), donor.export_arrays(), abi=donor.payload_abi, tokens=donor.n_past, ctx=512)
ck = ds4.open_checkpoint(p)            # verified and mapped, under a read lease
try:                                   # while the lease is held, nobody can open it to write
    os.open(p, os.O_WRONLY | os.O_NONBLOCK)
    print("writable?!")
except BlockingIOError:
    print("write refused")
ck.release()                           # given back (a load does so at its end) ...
os.truncate(p, 200)                    # ... another process truncates it before the engine copies
s = ds4.Session(eng, ctx=512)
live = eng.tokenize("an unrelated live conversation", special=True)
s.sync(live)
try:
    s.load_checkpoint(ck)
    print("loaded?!")
except TruncatedCheckpointError as e:
    print("raised", e.code)
print("state", s.checkpoint_valid, s.n_past, s.logits is None, s._ectx.n_past)
full = donor.tokens
print("rebuild", s.sync(full))
cold = ds4.Session(eng, ctx=512)
cold.sync(full)
print("equal", bool(np.array_equal(s.logits, cold.logits)))
"""


def test_truncation_during_load_invalidates(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", TRUNCATE_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [
        "write refused",
        "raised truncated",
        "state False 0 True 0",
        "rebuild 0",
        "equal True",
    ], r.stdout


# -- KVStore.try_load_text: a corrupt candidate --------------------------------
def test_corrupt_candidate_in_try_load_text_invalidates(eng, tmp_path, saved_checkpoint):
    prompt = eng.render_chat([{"role": "user", "content": "a question whose prefix is stored on disk"}])
    path, t = saved_checkpoint(tmp_path, prompt)
    store = ds4.KVStore(tmp_path, min_tokens=1)
    assert [e.path for e in store.lookup(prompt)] == [path]  # indexed: header and text are fine
    flip_payload_byte(path, keep_mtime=True)
    s = live_session(eng)
    rep = ds4.RecoveryReport()
    assert try_load_text(store, s, prompt, report=rep) is None
    assert_invalid_and_empty(s)
    assert not os.path.exists(path), "a corrupt candidate must be removed"
    assert [(p, code) for p, _stage, code, _r in rep.rejected] == [(path, PayloadChecksumError.code)]
    assert_rebuilds_clean(s, eng, t)


def test_corrupt_candidate_then_good_shorter_one(eng, tmp_path, saved_checkpoint):
    """The corrupt longer candidate invalidates and goes; the shorter good
    one loads; what loads equals a cold prefill of its tokens."""
    user = "a conversation with two checkpoints, the longer one damaged"
    short_text = eng.render_chat([{"role": "user", "content": user}], add_generation_prompt=False)
    prompt = eng.render_chat([{"role": "user", "content": user}])
    short_path, short_t = saved_checkpoint(tmp_path, short_text)
    long_path, _ = saved_checkpoint(tmp_path, prompt)
    store = ds4.KVStore(tmp_path, min_tokens=1)
    flip_payload_byte(long_path, keep_mtime=True)
    s = live_session(eng)
    res = try_load_text(store, s, prompt)
    assert res is not None and res.path == short_path
    assert not os.path.exists(long_path) and os.path.exists(short_path)
    cold = ds4.Session(eng, ctx=CTX)
    cold.sync(short_t)
    assert s.checkpoint_valid and s.tokens == short_t and np.array_equal(s.logits, cold.logits)


def test_incompatible_candidate_is_kept_and_does_not_touch_the_session(eng, tmp_path):
    """The contrast case: a file of another engine is skipped and kept."""
    prompt = eng.render_chat([{"role": "user", "content": "another model's checkpoint"}])
    t = toks(eng, prompt)
    donor = ds4.Session(eng, ctx=CTX)
    donor.sync(t)
    path = os.path.join(tmp_path, ds4._core.sha1_hex(donor.text_bytes()) + ".kv")
    ds4.write_checkpoint(
        path, donor.text_bytes(), donor.export_arrays(), abi="other-engine/9", tokens=donor.n_past, ctx=CTX
    )
    store = ds4.KVStore(tmp_path, min_tokens=1)
    s = live_session(eng)
    before = s.tokens
    assert try_load_text(store, s, prompt) is None
    assert os.path.exists(path)
    assert s.checkpoint_valid and s.tokens == before


# -- engine failures during prefill and decode ----------------------------------
def test_eval_failure_during_prefill_invalidates(eng):
    s = live_session(eng)
    live = s.tokens
    real_eval = s._ectx.eval

    def dies_half_way(self, tokens, progress=None):
        real_eval(tokens[: len(tokens) // 2])  # part of the suffix is in the KV state
        raise RuntimeError("simulated device failure")

    s._ectx.eval = types.MethodType(dies_half_way, s._ectx)
    extended = live + toks(eng, " and a continuation that fails half way")
    with pytest.raises(EngineError):
        s.sync(extended)
    assert_invalid_and_empty(s)
    del s._ectx.eval
    assert_rebuilds_clean(s, eng, extended)


def test_eval_failure_during_decode_invalidates(eng):
    s = live_session(eng)
    live = s.tokens

    def boom(tokens, progress=None):
        raise RuntimeError("simulated device failure")

    s._ectx.eval = boom
    with pytest.raises(EngineError):
        s.eval_token(7)
    assert_invalid_and_empty(s)
    del s._ectx.eval
    assert_rebuilds_clean(s, eng, live)


def test_eval_rejecting_its_input_invalidates(eng):
    """A ValueError from the engine (bad input) also ends the session: the
    engine's state is not guaranteed untouched."""
    s = live_session(eng)
    with pytest.raises(ValueError):
        s.sync([*s.tokens, eng.vocab_size + 3])
    assert_invalid_and_empty(s)


def test_rewind_failure_invalidates(eng):
    s = live_session(eng, "shared prefix then branch one, the live branch")
    other = toks(eng, "shared prefix then branch two, the new one")
    assert 0 < s.common_prefix(other) < s.n_past

    def truncate(self, n):
        self.reset()  # the rewind got half way...
        raise RuntimeError("rewind failed")  # ...and then failed

    s._ectx.truncate = types.MethodType(truncate, s._ectx)
    assert s.rewrite_from_common(other) is Rewrite.ERROR
    assert "rewind failed" in s.last_error
    assert_invalid_and_empty(s)
    del s._ectx.truncate
    assert_rebuilds_clean(s, eng, other)


def test_rebuild_needed_leaves_the_session_untouched(eng):
    """The contrast case: an engine that cannot rewind says so and keeps its
    state; nothing is invalidated."""
    s = live_session(eng, "shared prefix then branch one, the live branch")
    before = (s.tokens, np.array(s.logits))
    assert s.rewrite_from_common(toks(eng, "shared prefix then branch two")) is Rewrite.REBUILD_NEEDED
    assert s.checkpoint_valid and s.tokens == before[0] and np.array_equal(s.logits, before[1])


# -- the ladder -------------------------------------------------------------
def _non_utf8_cut(eng, prompt):
    """A token count whose rendered bytes end inside a UTF-8 sequence."""
    t = toks(eng, prompt)
    s = ds4.Session(eng, ctx=CTX)
    s.sync(t)
    for n in range(len(t) - 1, 0, -1):
        try:
            s.text_bytes(n).decode("utf-8")
        except UnicodeDecodeError:
            return t, n
    pytest.fail("no token boundary falls inside a UTF-8 sequence")


def test_disk_load_cut_inside_a_utf8_sequence_resumes_with_the_prompts_tokens(eng, tmp_path):
    """The checkpoint ends inside a UTF-8 sequence, but between two of the
    prompt's tokens: the rest of the prompt's own tokens follow it (no
    re-tokenizing of a suffix that is not text on its own)."""
    prompt = eng.render_chat([{"role": "user", "content": "héllo wörld, ünïcödé everywhere: ééééé ßßß"}])
    full, cut = _non_utf8_cut(eng, prompt)
    donor = ds4.Session(eng, ctx=CTX)
    donor.sync(full[:cut])
    store = ds4.KVStore(tmp_path, min_tokens=1)
    assert store.store_live_prefix(donor, "named") is not None
    s = live_session(eng)
    rep = ds4.recover(s, store, prompt, evict_save=False)
    assert rep.rung == "disk" and rep.reused_tokens == cut
    assert store.stats["hits"] == 1
    cold = ds4.Session(eng, ctx=CTX)
    cold.sync(full)
    assert s.tokens == full and np.array_equal(s.logits, cold.logits)


def test_ladder_disk_rung_with_only_corrupt_candidates_prefills_clean(eng, tmp_path, saved_checkpoint):
    prompt = eng.render_chat([{"role": "user", "content": "every stored prefix of this prompt is damaged"}])
    path, t = saved_checkpoint(tmp_path, prompt)
    store = ds4.KVStore(tmp_path, min_tokens=1)
    flip_payload_byte(path, keep_mtime=True)
    s = live_session(eng)
    rep = ds4.recover(s, store, prompt, evict_save=False)
    assert rep.rung == "prefill"
    assert [c for _p, _s, c, _r in rep.rejected] == [PayloadChecksumError.code]
    cold = ds4.Session(eng, ctx=CTX)
    cold.sync(t)
    assert s.tokens == t and np.array_equal(s.logits, cold.logits)


# -- the server's turn driver -------------------------------------------------
def _prompt(eng, text):
    return eng.render_chat([{"role": "user", "content": text}])


def test_stop_sequence_past_the_kv_state_invalidates(eng):
    prompt = _prompt(eng, "generate something long enough to hold a stop sequence")
    probe = TurnDriver(eng, CTX)
    full = probe.generate(prompt, GenParams(max_tokens=24))
    pieces = [eng.token_bytes(t) for t in full.tokens]
    # a stop string spanning several generated tokens, first seen where it is
    # taken from: tokens past its start have been evaluated when it is found
    stop = None
    for i in range(2, len(pieces) - 4):
        cand = b"".join(pieces[i : i + 3])
        head = b"".join(pieces[:i])
        try:
            text = cand.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip() and (head + cand).find(cand) == len(head):
            stop = text
            break
    assert stop is not None, full.text
    g = TurnDriver(eng, CTX)
    res = g.generate(prompt, GenParams(max_tokens=24, stop=(stop,)))
    assert res.finish_reason == "stop" and res.stop_action == "invalidated"
    assert g.counters["stop_invalidated"] == 1
    assert_invalid_and_empty(g.sess)
    again = g.generate(prompt, GenParams(max_tokens=24))
    assert again.report.rung == "prefill" and again.cached_tokens == 0
    assert again.tokens == full.tokens and again.text == full.text


def test_request_failure_in_the_server_invalidates(eng):
    prompt = _prompt(eng, "a request whose client callback fails mid-stream")
    cold = TurnDriver(eng, CTX).generate(prompt, GenParams(max_tokens=12))
    g = TurnDriver(eng, CTX)
    n = [0]

    def on_text(_piece):
        n[0] += 1
        if n[0] == 2:
            raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        g.generate(prompt, GenParams(max_tokens=12), on_text=on_text)
    assert_invalid_and_empty(g.sess)
    again = g.generate(prompt, GenParams(max_tokens=12))
    assert again.report.rung == "prefill" and again.tokens == cold.tokens


def test_a_failing_rung_invalidates_and_the_retry_is_clean(eng, tmp_path, monkeypatch):
    prompt = _prompt(eng, "the disk rung raises an I/O error once")
    cold = TurnDriver(eng, CTX).generate(prompt, GenParams(max_tokens=8))
    store = ds4.KVStore(tmp_path, min_tokens=1)
    g = TurnDriver(eng, CTX, store=store)
    g.sess.sync(toks(eng, "an unrelated live conversation"))
    real = recovery.load_first  # the disk rung
    calls = []

    def flaky(store, sess, found, report=None):
        calls.append(sess.checkpoint_valid)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real(store, sess, found, report=report)

    monkeypatch.setattr(recovery, "load_first", flaky)
    res = g.generate(prompt, GenParams(max_tokens=8))
    assert g.counters["ladder_retries"] == 1
    assert calls == [True, False]  # the retry ran on an invalidated session
    assert res.tokens == cold.tokens


# -- the chat REPL ----------------------------------------------------------
def _repl(eng, system=""):
    from ds4.cli.chat import ChatREPL

    g = TurnDriver(eng, CTX)
    return ChatREPL(g, system, max_tokens=6, out=io.StringIO(), err=io.StringIO())


def test_chat_clear_invalidates(eng):
    r = _repl(eng)
    r.turn("hello there")
    assert r.sess.checkpoint_valid and r.sess.n_past > 0
    r.handle("/clear")
    assert_invalid_and_empty(r.sess)
    assert r.messages == []
    r.turn("a new question")
    cold = TurnDriver(eng, CTX).generate(_prompt(eng, "a new question"), GenParams(max_tokens=6))
    assert r.messages[-1]["content"] == cold.text


def test_chat_new_without_system_prompt_invalidates(eng):
    r = _repl(eng)
    r.turn("hello there")
    r.handle("/new")
    assert_invalid_and_empty(r.sess)
    assert r.messages == []


def test_chat_new_with_system_prompt_holds_only_the_system_prompt(eng):
    system = "You are a terse assistant."
    r = _repl(eng, system)
    r.reset_to_system()
    r.turn("hello there")
    assert r.sess.n_past > len(
        toks(eng, eng.render_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    )
    r.handle("/new")
    sys_toks = toks(eng, eng.render_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    cold = ds4.Session(eng, ctx=CTX)
    cold.sync(sys_toks)
    assert r.sess.checkpoint_valid and r.sess.tokens == sys_toks
    assert np.array_equal(r.sess.logits, cold.logits)


def test_corrupt_error_class_is_what_the_ladder_removes():
    """The removal decision keys on the class hierarchy: keep it so."""
    assert issubclass(PayloadChecksumError, CorruptCheckpointError)
