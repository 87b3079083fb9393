"""Issue 13, item 2: what the Rust table check accepts, numpy accepts; any
failure while importing a candidate is a typed rejection of that candidate
(the ladder goes on); ``ds4 kv verify`` runs the checks a load runs.

The shape bomb is crafted from a real file: a zero-byte tensor's shape is
patched in the metadata and the header checksum recomputed
(``test_core_format.patch``), so every check before the table passes."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from helpers.procs import ds4_cmd
from test_core_format import patch

import ds4
from ds4 import checkpoint as ckmod
from ds4.checkpoint import write_checkpoint
from ds4.errors import (
    CheckpointError,
    ContextTooSmallError,
    EngineStateError,
    TensorTableError,
    TokenCountMismatchError,
)
from ds4.kvstore import KVStore
from ds4.loading import load_named

MARK = 12345  # a dimension no other u64 of the small file holds


def _bomb(write_ck, d, dim: int, dtype=np.uint8) -> str:
    """A small file with a zero-byte tensor of shape ``[0, dim]``."""
    p = write_ck(d, b"shape bomb", {"e": np.zeros((0, MARK), dtype)})
    with open(p, "rb") as f:
        raw = f.read()
    at = raw.index(struct.pack("<Q", MARK))
    patch(p, at, struct.pack("<Q", dim))
    return p


@pytest.mark.parametrize(
    ("dim", "dtype"),
    [(2**63, np.uint8), (2**64 - 1, np.uint8), (2**62, np.float32), (2**61, np.float64)],
)
def test_a_shape_numpy_refuses_is_refused_by_the_table(tmp_path, write_ck, dim, dtype):
    p = _bomb(write_ck, tmp_path, dim, dtype)
    ds4.open_checkpoint(p, load_payload=False)  # the header is fine
    with pytest.raises(ValueError):
        np.empty((0, dim), dtype)  # numpy's own verdict
    with pytest.raises(TensorTableError, match="beyond what an array can describe"):
        ds4.open_checkpoint(p)
    r = ds4_cmd("kv", "verify", p, "--json", check=False)  # kv verify FILE, the checks of a load
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["files"][0]["code"] == "tensor_table"


@pytest.mark.parametrize(("dim", "dtype"), [(2**62, np.uint8), (2**63 - 1, np.uint8), (2**59, np.float64)])
def test_a_shape_numpy_accepts_opens_and_views(tmp_path, write_ck, dim, dtype):
    p = _bomb(write_ck, tmp_path, dim, dtype)
    a = ds4.open_checkpoint(p).arrays()["e"]
    assert a.shape == (0, dim) and a.dtype == dtype and a.nbytes == 0


# -- the ladder: every import failure is a typed rejection -------------------------

BASE = "lighthouse keepers count the tides and write the hours in a book; " * 6


@pytest.fixture
def two(tmp_path):
    """A store with two prefixes of one conversation (short, long), and the
    prompt that extends both."""
    eng = ds4.ReferenceEngine()
    store = KVStore(tmp_path / "kv", min_tokens=1)
    paths = []
    for text in (BASE, BASE + "and the ships come in at dawn. " * 3):
        s = ds4.Session(eng, ctx=1024)
        s.sync(eng.tokenize(text, special=True))
        paths.append(store.store_live_prefix(s, "cold"))
    return eng, store, paths, BASE + "and the ships come in at dawn. " * 3 + "What then?"


def _rejections(rep):
    return [(os.path.basename(p), stage, code) for (p, stage, code, _r) in rep.rejected]


def test_a_plain_error_while_importing_is_a_typed_rejection_and_the_file_is_kept(two, monkeypatch):
    eng, store, (short, long), prompt = two
    real = ckmod.Checkpoint.load_arrays

    def numpy_says_no(self):
        if str(self._core.path) == long:
            raise ValueError("Maximum allowed dimension exceeded")  # what escaped the ladder before
        return real(self)

    monkeypatch.setattr(ckmod.Checkpoint, "load_arrays", numpy_says_no)
    sess = ds4.Session(eng, ctx=1024)
    rep = ds4.recover(sess, store, prompt, evict_save=False)
    assert rep.rung == "disk" and rep.loaded_path == short and sess.checkpoint_valid
    assert _rejections(rep) == [(os.path.basename(long), "engine", "import_failed")]
    assert "ValueError: Maximum allowed dimension exceeded" in rep.rejected[0][3]
    assert os.path.exists(long)  # not proven corrupt: kept
    # a named load of it: unusable, typed, kept
    got = load_named(store, sess, os.path.basename(long)[:40], prompt.encode())
    assert got.status == "unusable" and got.error is not None and got.error.code == "import_failed"
    assert isinstance(got.error, CheckpointError) and not sess.checkpoint_valid and os.path.exists(long)


def test_a_tensor_numpy_cannot_view_is_corrupt_and_removed(two, monkeypatch):
    eng, store, (short, long), prompt = two
    real = ckmod.Checkpoint._view

    def bad_view(self, name, dtype, shape, nbytes):
        if str(self._core.path) == long:
            raise ValueError("cannot reshape array of size 0 into shape (0,9223372036854775808)")
        return real(self, name, dtype, shape, nbytes)

    monkeypatch.setattr(ckmod.Checkpoint, "_view", bad_view)
    sess = ds4.Session(eng, ctx=1024)
    rep = ds4.recover(sess, store, prompt, evict_save=False)
    assert rep.rung == "disk" and rep.loaded_path == short
    assert _rejections(rep) == [(os.path.basename(long), "payload", "tensor_table")]
    assert not os.path.exists(long)


def test_token_checks_are_typed_and_shared_by_load_and_verify(tmp_path):
    """A file whose header says one token fewer than its tokens tensor holds:
    a load rejects it (token_count_mismatch, corrupt, removed), and kv verify,
    which said OK before, says the same; 0 tokens and too many for the
    context are typed too (they raised ContextOverflowError, a PromptError)."""
    eng = ds4.ReferenceEngine()
    d = tmp_path / "kv"
    d.mkdir()
    s = ds4.Session(eng, ctx=1024)
    s.sync(eng.tokenize(BASE, special=True))
    text = s.text_bytes()
    path = os.path.join(d, ds4._core.sha1_hex(text) + ".kv")
    write_checkpoint(path, text, s.export_arrays(), abi=s.payload_abi, tokens=s.n_past - 1, ctx=1024)
    r = ds4_cmd("kv", "verify", d, "--json", check=False)
    assert r.returncode == 1 and json.loads(r.stdout)["files"][0]["code"] == "token_count_mismatch"
    fresh = ds4.Session(eng, ctx=1024)
    rep = ds4.recover(fresh, KVStore(d, min_tokens=1), BASE + "more", evict_save=False)
    assert [c for (_p, _s, c, _r) in rep.rejected] == ["token_count_mismatch"] and rep.rung == "prefill"
    assert not os.path.exists(path)
    arrays = s.export_arrays()
    with pytest.raises(TokenCountMismatchError):
        fresh.load_arrays({**arrays, "tokens": np.zeros(0, np.int32)}, 0)
    with pytest.raises(ContextTooSmallError):
        ds4.Session(eng, ctx=s.n_past).load_arrays(arrays, s.n_past)
    with pytest.raises(EngineStateError, match="out of the vocabulary's range"):
        fresh.load_arrays({**arrays, "tokens": -np.ones(s.n_past, np.int32)}, s.n_past)


def test_an_engine_that_cannot_take_a_verified_state_keeps_the_file(two, monkeypatch):
    """A load the engine refuses for a limit of its own (here: memory runs
    out while importing the longer state) proves nothing about the file:
    ``import_failed``, kept, and the ladder goes on (it was ``engine_rejected``,
    corrupt, and the file deleted)."""
    eng, store, (short, long), prompt = two
    ctx_type = type(eng.new_context(8))
    real, limit = ctx_type.import_state, len(eng.tokenize(BASE, special=True))

    def out_of_memory(self, arrays, n_tokens):
        if n_tokens > limit:
            raise MemoryError("cannot allocate the state")
        return real(self, arrays, n_tokens)

    monkeypatch.setattr(ctx_type, "import_state", out_of_memory)
    sess = ds4.Session(eng, ctx=1024)
    rep = ds4.recover(sess, store, prompt, evict_save=False)
    assert rep.rung == "disk" and rep.loaded_path == short and sess.checkpoint_valid
    assert _rejections(rep) == [(os.path.basename(long), "engine", "import_failed")]
    assert os.path.exists(long)
    got = load_named(store, sess, os.path.basename(long)[:40], prompt.encode())
    assert got.status == "unusable" and got.error is not None and got.error.code == "import_failed"
    assert not sess.checkpoint_valid and os.path.exists(long)
