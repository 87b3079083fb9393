"""The store's verdict on a candidate that failed to open or load
(:meth:`ds4.kvstore.KVStore.refuse`), one test per branch: what it is
rejected as, whether its file stays, whether the session it was loading
into must be invalidated, and what is counted. The ladder
(:mod:`ds4.loading`) acts on these verdicts; its tests (test_ladder,
test_invalidation) show the end to end, these pin each verdict exactly."""

from __future__ import annotations

import errno
import os
import shutil
from types import SimpleNamespace

import pytest
from helpers.kv import prefilled

import ds4
from ds4.errors import BadMagicError, IncompatibleCheckpointError, NotRegularFileError
from ds4.kvstore import KVStore
from ds4.kvstore.admission import version_of
from ds4.kvstore.rejection import Refusal, Rejection
from ds4.loading import try_load_text

TEXT = "one two three four five six seven eight nine ten"


@pytest.fixture
def stored(eng, tmp_path):
    """A store holding one checkpoint, and its entry as a lookup finds it."""
    st = KVStore(tmp_path, min_tokens=8)
    st.store_live_prefix(prefilled(eng, TEXT))
    (e,) = st.lookup(TEXT + " eleven")
    return st, e


def _indexed(st) -> set[str]:
    return {x.name for x in st._entries()}  # the index as it is, without a rescan


def test_a_file_gone_is_forgotten_and_not_counted(stored):
    st, e = stored
    os.remove(e.path)
    before = st.counters["rejected"]
    assert st.refuse(e, FileNotFoundError(errno.ENOENT, "gone"), None) is None
    assert e.name not in _indexed(st)
    assert st.counters["rejected"] == before


def test_an_unreadable_file_is_a_typed_rejection_kept_without_invalidating(stored):
    st, e = stored
    before = st.counters["rejected"]
    r = st.refuse(e, PermissionError(errno.EACCES, "Permission denied"), None)
    assert r == Refusal(Rejection(e.path, "open", "unreadable", "Permission denied"), "")
    # an OSError without a message is named by its class
    assert st.refuse(e, OSError(), None) == Refusal(Rejection(e.path, "open", "unreadable", "OSError"), "")
    assert st.counters["rejected"] == before + 2  # each one counted
    assert os.path.exists(e.path) and e.name in _indexed(st)


def test_an_incompatible_file_is_kept_without_invalidating(stored):
    st, e = stored
    err = IncompatibleCheckpointError("another engine's", path=e.path, stage="abi")
    assert st.refuse(e, err, version_of(e)) == Refusal(Rejection(e.path, "abi", err.code, err.reason), "")
    assert os.path.exists(e.path)


def test_a_corrupt_file_is_removed_and_invalidates(stored):
    st, e = stored
    before = st.counters["rejected"]
    err = BadMagicError(path=e.path)
    r = st.refuse(e, err, version_of(e))
    assert r == Refusal(Rejection(e.path, err.stage, err.code, err.reason), f"corrupt checkpoint {e.name}")
    assert not os.path.exists(e.path) and e.name not in _indexed(st)
    assert st.counters["rejected"] == before + 1


def test_a_corrupt_verdict_removes_only_the_version_it_judged(stored, tmp_path):
    st, e = stored
    judged = version_of(e)
    fresh = tmp_path / "fresh.kv.part"
    shutil.copyfile(e.path, fresh)
    os.replace(fresh, e.path)  # another writer's file in its place after the verdict
    r = st.refuse(e, BadMagicError(path=e.path), judged)
    assert r is not None and r.invalidate == f"corrupt checkpoint {e.name}"
    assert os.path.exists(e.path)  # not the file that was judged: kept


def test_a_corrupt_verdict_on_something_not_a_file_keeps_it(stored):
    st, e = stored
    err = NotRegularFileError(path=e.path)
    assert st.refuse(e, err, None) == Refusal(Rejection(e.path, err.stage, err.code, err.reason), "")
    assert os.path.exists(e.path)


def test_a_failed_import_is_kept_and_invalidates(stored):
    st, e = stored
    before = st.counters["rejected"]
    r = st.refuse(e, RuntimeError("device lost"), None)
    want = Rejection(e.path, "engine", "import_failed", "RuntimeError: device lost")
    assert r == Refusal(want, f"checkpoint {e.name} failed to load")
    assert os.path.exists(e.path) and st.counters["rejected"] == before + 1


def test_each_corrupt_file_removed_is_counted_once(eng, stored):
    st, e = stored
    st.store_live_prefix(prefilled(eng, "a second conversation about harbours and tides"))
    (e2,) = st.lookup("a second conversation about harbours and tides, go on")
    before = st.counters["removed_corrupt"]
    judged = version_of(e)
    assert st.discard(e.path, BadMagicError(path=e.path), "test", judged) == e.path  # removed: its own path
    assert st.discard(e2.path, BadMagicError(path=e2.path), "test", version_of(e2)) == e2.path
    assert st.counters["removed_corrupt"] == before + 2
    assert st.discard(e.path, BadMagicError(path=e.path), "test", judged) is None  # gone: not counted
    assert st.counters["removed_corrupt"] == before + 2


# -- the ladder's one-rung load asks the store with the session's limits --------
def test_try_load_text_skips_what_the_session_cannot_hold_at_lookup(eng, stored):
    st, e = stored
    report = SimpleNamespace(rejected=[])
    small = ds4.Session(eng, ctx=e.tokens - 1)  # one token short of the checkpoint
    assert try_load_text(st, small, TEXT + " eleven", report) is None
    assert report.rejected == []  # not a candidate, so not a rejection
    assert os.path.exists(e.path) and not small.checkpoint_valid


def test_try_load_text_in_a_namespace_is_not_told_of_other_files_rejected_at_indexing(eng, tmp_path):
    def store_with_garbage(d):
        st = KVStore(d, min_tokens=8)
        (d / ("0" * 40 + ".kv")).write_bytes(b"not a checkpoint at all" * 8)  # rejected when indexed
        return st

    tenant = ds4.Session(eng, ctx=4096)
    tenant.set_namespace("key-aaaa")
    report = SimpleNamespace(rejected=[])
    assert try_load_text(store_with_garbage(tmp_path / "ns"), tenant, TEXT, report) is None
    assert report.rejected == []  # possibly another namespace's file: logged, not reported
    report = SimpleNamespace(rejected=[])
    assert try_load_text(store_with_garbage(tmp_path / "default"), ds4.Session(eng, ctx=4096), TEXT, report) is None
    assert [r.code for r in report.rejected] == ["bad_magic"]  # the default namespace is told


def test_a_load_that_finds_nothing_is_one_miss_and_a_hit_is_none(eng, stored):
    st, _ = stored
    misses, hits = st.counters["misses"], st.counters["hits"]
    assert try_load_text(st, ds4.Session(eng, ctx=4096), "nothing stored starts like this") is None
    assert st.counters["misses"] == misses + 1
    assert try_load_text(st, ds4.Session(eng, ctx=4096), TEXT + " eleven") is not None
    assert (st.counters["misses"], st.counters["hits"]) == (misses + 1, hits + 1)
