"""``ds4.loading.load_named``: ``ds4 chat``'s /load and its system prompt,
pinned per outcome (issue 24: the mutation run over the invalidation sites
left 64 of its 95 mutants alive, no test of that selection calling it).

For each outcome: the status and what rides on it (tokens, ms, the error),
which file stays or goes, and the session after it: loaded and equal to a
cold prefill, untouched (missing), or invalid and empty (every failure).
Each test starts from a live session of another conversation, so a failure
path that forgets to invalidate leaves it valid and the test fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import types

import numpy as np
import pytest
from helpers.checkpoints import flip_payload_byte
from helpers.kv import toks

import ds4
from ds4 import checkpoint as ckmod
from ds4 import loading
from ds4.checkpoint import write_checkpoint
from ds4.errors import CorruptCheckpointError, ImportFailedError
from ds4.kvstore import KVStore
from ds4.loading import load_named

CTX = 512
DONOR = "the donor conversation of a named session, loaded from disk"
LIVE = "an unrelated live conversation that a failed load must not leave valid"
KEY = ds4._core.derive_auth_key(b"ds4 test secret, not for production use")


def _sha(text: bytes) -> str:
    return hashlib.sha1(text).hexdigest()


def _live(eng, ctx=CTX, text=LIVE):
    s = ds4.Session(eng, ctx=ctx)
    s.sync(toks(eng, text))
    assert s.checkpoint_valid and s.n_past > 0
    return s


def _donor(eng, text=DONOR, ctx=CTX):
    d = ds4.Session(eng, ctx=ctx)
    d.sync(toks(eng, text))
    return d


def _save(directory, sess, *, abi=None, auth_key=None):
    """``sess`` as ``<sha1(text)>.kv`` in ``directory``: (path, text)."""
    text = sess.text_bytes()
    path = os.path.join(os.fspath(directory), _sha(text) + ".kv")
    write_checkpoint(
        path,
        text,
        sess.export_arrays(),
        abi=abi or sess.payload_abi,
        tokens=sess.n_past,
        ctx=sess.ctx,
        auth_key=auth_key,
    )
    return path, text


def _invalid_and_empty(s):
    assert not s.checkpoint_valid
    assert s.tokens == [] and s.n_past == 0 and s.logits is None
    assert s._ectx.n_past == 0


def _equals_cold(s, eng, tokens):
    cold = ds4.Session(eng, ctx=s.ctx)
    cold.sync(tokens)
    assert s.checkpoint_valid and s.tokens == list(tokens)
    assert np.array_equal(s.logits, cold.logits)
    assert s.generate(4) == cold.generate(4)


@pytest.fixture
def store(tmp_path, monkeypatch):
    d = tmp_path / "kv"
    d.mkdir()
    # a relative path would be looked up here, not in the store's directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return KVStore(d)


def _clock(monkeypatch, *ticks):
    """``load_named``'s own ``time.perf_counter``, a fixed sequence (the
    module's name ``time`` only: nothing else sees it)."""
    it = iter(ticks)
    monkeypatch.setattr(loading, "time", types.SimpleNamespace(perf_counter=lambda: next(it)))


# -- loaded -------------------------------------------------------------------
def test_loads_the_named_checkpoint_with_its_tokens_and_time(eng, store, monkeypatch):
    donor = _donor(eng)
    path, text = _save(store.dir, donor)
    sess = _live(eng)
    _clock(monkeypatch, 10.0, 10.25)
    got = load_named(store, sess, _sha(text), text)
    assert got.status == "loaded" and got.error is None
    assert got.tokens == donor.n_past > 0
    assert got.ms == 250.0
    _equals_cold(sess, eng, donor.tokens)
    assert os.path.exists(path)


def test_a_stored_prefix_of_the_text_loads_unless_exact(eng, store):
    donor = _donor(eng)
    path, text = _save(store.dir, donor)
    longer = text + b" and the turn that follows it"
    sess = _live(eng)
    got = load_named(store, sess, _sha(text), longer)
    assert got.status == "loaded" and got.tokens == donor.n_past
    _equals_cold(sess, eng, donor.tokens)
    # exact: the stored text must be the whole text; the live session is kept
    sess = _live(eng)
    before = list(sess.tokens)
    got = load_named(store, sess, _sha(text), longer, exact=True)
    assert got.status == "missing" and got.error is None and got.tokens == 0
    assert sess.checkpoint_valid and sess.tokens == before
    assert os.path.exists(path)


def test_exact_loads_a_checkpoint_of_exactly_the_text(eng, store):
    donor = _donor(eng)
    _, text = _save(store.dir, donor)
    sess = _live(eng)
    got = load_named(store, sess, _sha(text), text, exact=True)
    assert got.status == "loaded" and got.tokens == donor.n_past
    _equals_cold(sess, eng, donor.tokens)


# -- missing, and a name that is not a key ------------------------------------
def test_a_missing_file_leaves_the_live_session_alone(eng, store):
    sess = _live(eng)
    before = list(sess.tokens)
    got = load_named(store, sess, "0" * 40, b"whatever")
    assert got.status == "missing" and got.error is None and got.tokens == 0
    assert sess.checkpoint_valid and sess.tokens == before


def test_a_name_that_is_not_a_key_is_refused_with_the_name(eng, store):
    sess = _live(eng)
    with pytest.raises(ValueError, match=r"not a checkpoint key: '\.\./x'"):
        load_named(store, sess, "../x", b"")
    assert sess.checkpoint_valid


# -- unusable: kept, the session invalidated -----------------------------------
def _unusable(got, sess, path, code):
    assert got.status == "unusable", got
    assert got.error is not None and got.error.code == code, got.error
    assert os.path.exists(path)  # not proven corrupt: kept
    _invalid_and_empty(sess)


def _names_in_debug(caplog, name):
    return any(name in r.getMessage() for r in caplog.records if r.name == "ds4.session")


def test_a_checkpoint_that_is_not_a_prefix_of_the_text_is_unusable(eng, store, caplog):
    _, text = _save(store.dir, _donor(eng))
    path = os.path.join(store.dir, _sha(text) + ".kv")
    sess = _live(eng)
    with caplog.at_level(logging.DEBUG, logger="ds4.session"):
        got = load_named(store, sess, _sha(text), b"another conversation altogether")
    _unusable(got, sess, path, "not_prefix")
    assert _names_in_debug(caplog, os.path.basename(path))  # why the session went


def test_another_models_file_is_judged_at_its_header_and_kept(eng, store):
    """A file of another payload ABI is not this engine's to read: refused at
    the header, its payload never checked (damaged here: still kept)."""
    path, text = _save(store.dir, _donor(eng), abi="another-engine/1")
    flip_payload_byte(path)
    sess = _live(eng)
    _unusable(load_named(store, sess, _sha(text), text), sess, path, "abi_mismatch")


def test_the_context_edge(eng, store):
    """A checkpoint of n tokens loads into a context of n + 1 (room for one
    more) and not into one of n: refused at the header, so a damaged payload
    is not judged and the file is kept."""
    donor = _donor(eng)
    n = donor.n_past
    path, text = _save(store.dir, donor)
    sess = _live(eng, ctx=n + 1, text=LIVE[:20])
    got = load_named(store, sess, _sha(text), text)
    assert got.status == "loaded" and got.tokens == n
    flip_payload_byte(path)
    sess = _live(eng, ctx=n, text=LIVE[:20])
    _unusable(load_named(store, sess, _sha(text), text), sess, path, "ctx_too_small")


def test_with_a_key_a_file_without_a_mac_is_unusable(eng, tmp_path, store):
    keyed = KVStore(store.dir, auth_key=KEY)
    path, text = _save(keyed.dir, _donor(eng))
    sess = _live(eng)
    _unusable(load_named(keyed, sess, _sha(text), text), sess, path, "mac_missing")
    # and with its MAC it loads
    path, text = _save(keyed.dir, _donor(eng), auth_key=KEY)
    sess = _live(eng)
    assert load_named(keyed, sess, _sha(text), text).status == "loaded"


def test_a_plain_error_of_the_import_is_a_typed_unusable_and_kept(eng, store, monkeypatch, caplog):
    """An error that is not a checkpoint error (a limit of numpy, a bug)
    proves nothing about the file: typed as ``import_failed``, kept."""
    path, text = _save(store.dir, _donor(eng))
    sess = _live(eng)

    def numpy_says_no(self):
        raise ValueError("Maximum allowed dimension exceeded")

    monkeypatch.setattr(ckmod.Checkpoint, "load_arrays", numpy_says_no)
    with caplog.at_level(logging.DEBUG, logger="ds4.session"):
        got = load_named(store, sess, _sha(text), text)
    _unusable(got, sess, path, "import_failed")
    assert isinstance(got.error, ImportFailedError)
    assert got.error.reason == "ValueError: Maximum allowed dimension exceeded"
    assert got.error.path == path
    assert _names_in_debug(caplog, os.path.basename(path))


def test_a_non_regular_entry_is_unusable_and_left_alone(eng, store, caplog):
    name = "1" * 40 + ".kv"
    os.mkfifo(os.path.join(store.dir, name))
    sess = _live(eng)
    with caplog.at_level(logging.DEBUG, logger="ds4.session"):
        got = load_named(store, sess, name[:40], b"")
    _unusable(got, sess, os.path.join(store.dir, name), "not_regular_file")
    assert _names_in_debug(caplog, name)


# -- corrupt: discarded, the session invalidated --------------------------------
def test_a_corrupt_file_is_removed_and_invalidates(eng, store, caplog):
    path, text = _save(store.dir, _donor(eng))
    flip_payload_byte(path)
    sess = _live(eng)
    with caplog.at_level(logging.DEBUG):
        got = load_named(store, sess, _sha(text), text)
    assert got.status == "corrupt" and got.error is not None and got.error.code == "payload_checksum"
    assert got.tokens == 0
    assert not os.path.exists(path)
    assert store.counters["removed_corrupt"] == 1
    _invalid_and_empty(sess)
    assert _names_in_debug(caplog, os.path.basename(path))
    # the store's line says which load found it
    assert any(
        "(named load)" in r.getMessage() and os.path.basename(path) in r.getMessage()
        for r in caplog.records
        if r.name == "ds4.kvstore"
    )


def test_a_corrupt_file_goes_to_quarantine_when_there_is_one(eng, tmp_path):
    d = tmp_path / "kv"
    q = tmp_path / "q"
    store = KVStore(d, quarantine_dir=q)
    path, text = _save(store.dir, _donor(eng))
    flip_payload_byte(path)
    sess = _live(eng)
    assert load_named(store, sess, _sha(text), text).status == "corrupt"
    assert not os.path.exists(path)
    assert [n for n in os.listdir(q) if os.path.basename(path) in n]
    _invalid_and_empty(sess)


def test_a_file_replaced_after_it_was_judged_is_not_removed(eng, store, monkeypatch):
    """The verdict is about the version that was read: a writer that put a
    new file in its place meanwhile keeps it (the stat key taken first)."""
    donor = _donor(eng)
    path, text = _save(store.dir, donor)
    with open(path, "rb") as f:
        good = f.read()
    flip_payload_byte(path)
    real = loading.open_checkpoint

    def replaced_while_judged(p, **kw):
        try:
            return real(p, **kw)
        except CorruptCheckpointError:
            tmp = p + ".new"
            with open(tmp, "wb") as f:
                f.write(good)
            os.replace(tmp, p)  # a new inode: another version
            raise

    monkeypatch.setattr(loading, "open_checkpoint", replaced_while_judged)
    sess = _live(eng)
    got = load_named(store, sess, _sha(text), text)
    assert got.status == "corrupt"
    _invalid_and_empty(sess)
    with open(path, "rb") as f:
        assert f.read() == good  # the new version stays
    assert store.counters["removed_corrupt"] == 0
