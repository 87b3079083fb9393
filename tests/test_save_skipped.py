"""Issue 42 item 2: a save that does not happen says why.

Each case makes the store decline (or fail) a real save and checks the
reason ``KVStore.store_live_checked`` gives (while ``store_live_prefix``
keeps its contract: None, or the ``OSError``)."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
from kv_helpers import BASE, prefilled

import ds4
from ds4.checkpoint import write_checkpoint
from ds4.errors import InvalidSessionError, StoreFullError
from ds4.kvstore import SaveSkip, save
from ds4.kvstore.skips import SKIP_CODES


def kv_files(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".kv"))


# -- the store: store_live_checked, and store_live_prefix's contract kept ----------


def test_the_codes_are_a_stable_set():
    assert SKIP_CODES == (
        "engine_cannot_load",
        "below_min_tokens",
        "above_cold_max_tokens",
        "name_held_by_other_model",
        "over_budget",
        "disk_full",
        "write_error",
        "session_invalid",
    )
    skip = SaveSkip("cold", "below_min_tokens", "40 tokens < min 64")
    assert str(skip) == "cold save skipped: below_min_tokens (40 tokens < min 64)"
    assert skip.as_dict() == {"kind": "cold", "code": "below_min_tokens", "detail": "40 tokens < min 64"}


def test_below_min_tokens(eng, tmp_path):
    s = prefilled(eng, BASE[:30])
    st = ds4.KVStore(tmp_path, min_tokens=s.n_past + 1)
    assert st.store_live_prefix(s, "evict") is None
    assert st.store_live_checked(s, "evict") == SaveSkip(
        "evict", "below_min_tokens", f"{s.n_past} tokens < min {s.n_past + 1}"
    )
    # the caller's own minimum (ds4 chat's named saves) is the one reported
    st = ds4.KVStore(tmp_path, min_tokens=1)
    got = st.store_live_checked(s, "named", min_tokens=s.n_past + 5)
    assert got == SaveSkip("named", "below_min_tokens", f"{s.n_past} tokens < min {s.n_past + 5}")
    assert kv_files(tmp_path) == []
    assert st.store_live_checked(s, "named", min_tokens=s.n_past) == st.store_live_prefix(s, "named")


def test_over_budget(eng, tmp_path):
    s = prefilled(eng, BASE)
    st = ds4.KVStore(tmp_path, budget_mb=0.01, min_tokens=8)
    assert st.store_live_prefix(s, "cold") is None
    got = st.store_live_checked(s, "cold")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("cold", "over_budget")
    assert got.detail.startswith("estimated file size ") and got.detail.endswith("exceeds the budget of 0.0 MiB")
    assert kv_files(tmp_path) == [] and st.stats["stores"] == 0


def _foreign(tmp_path, s) -> str:
    """Another engine's checkpoint (another payload ABI) under the name of
    ``s``'s key text."""
    key = s.key_bytes()
    path = os.path.join(tmp_path, hashlib.sha1(key).hexdigest() + ".kv")
    write_checkpoint(path, key, s.export_arrays(), abi="another-engine/9", tokens=s.n_past, ctx=s.ctx)
    return path


def test_name_held_by_other_model(eng, tmp_path):
    s = prefilled(eng, BASE[:60])
    path = _foreign(tmp_path, s)
    st = ds4.KVStore(tmp_path, min_tokens=8)
    assert st.store_live_prefix(s, "cold") is None
    got = st.store_live_checked(s, "cold")
    name = os.path.basename(path)
    assert got == SaveSkip(
        "cold",
        "name_held_by_other_model",
        f"{name[:12]} is held by a file this engine cannot load, another model's (kept)",
    )
    assert kv_files(tmp_path) == [name]  # kept


def test_engine_cannot_load(tmp_path):
    eng = ds4.ReferenceEngine()
    s = prefilled(eng, BASE[:60])
    eng.checkpoints_ok = False  # as the llama.cpp engine when its start-up round trip failed
    st = ds4.KVStore(tmp_path, min_tokens=8)
    assert st.store_live_prefix(s, "continued") is None
    got = st.store_live_checked(s, "continued")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("continued", "engine_cannot_load")
    assert kv_files(tmp_path) == []


def test_session_invalid(eng, tmp_path):
    s = prefilled(eng, BASE[:60])
    s.invalidate("a test")
    st = ds4.KVStore(tmp_path, min_tokens=8)
    with pytest.raises(InvalidSessionError):
        st.store_live_prefix(s, "evict")  # the contract: it must be valid
    got = st.store_live_checked(s, "evict")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("evict", "session_invalid")


@pytest.mark.parametrize(("err", "code"), [(errno.ENOSPC, "disk_full"), (errno.EIO, "write_error")])
def test_a_write_that_fails(eng, tmp_path, monkeypatch, err, code):
    """The file system's failure (stood in for at the writer: a real full
    disk is not made here); the store's own handling is what runs."""

    def failing(path, *a, **kw):
        raise OSError(err, os.strerror(err), path)

    monkeypatch.setattr(save, "write_checkpoint", failing)
    s = prefilled(eng, BASE[:60])
    st = ds4.KVStore(tmp_path, min_tokens=8)
    with pytest.raises(OSError) as raised:
        st.store_live_prefix(s, "cold")  # the contract: the typed error
    assert isinstance(raised.value, StoreFullError) == (err == errno.ENOSPC)
    got = st.store_live_checked(s, "cold")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("cold", code)
    assert os.strerror(err) in got.detail and str(tmp_path) not in got.detail  # no path
