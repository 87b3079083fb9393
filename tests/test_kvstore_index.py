"""The store's persisted index (``.ds4.index``, issue 12): a fresh store
opens from it without reading unchanged headers; a torn, stale, foreign or
tampered index never causes a wrong load or a lost file and is rebuilt; a
file is indexed from its header, its text checked when it is a candidate."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from helpers.checkpoints import stored_name, stored_path
from helpers.kv import BASE, prefilled

import ds4
from ds4 import _core, kvstore
from ds4.kvstore import INDEX_NAME, KVStore
from ds4.kvstore.files import INDEX_TMP_NAME, is_checkpoint_name, is_temp_name, stat_key
from ds4.recovery import try_load_text

TEXTS = [BASE * 2, BASE * 3, "another conversation entirely " * 8]
RECORD = 112  # bytes of one record of the index file (docs/FORMAT.md)


@pytest.fixture(scope="module")
def cold(eng):
    """text -> (tokens, logits) of a cold prefill: what a load must give."""
    out = {}
    for t in TEXTS:
        s = prefilled(eng, t)
        out[t] = (list(s.tokens), np.array(s.logits))
    return out


def _store(d, **kw):
    kw.setdefault("min_tokens", 8)
    return KVStore(d, **kw)


def _fill(eng, d):
    st = _store(d)
    paths = [st.store_live_prefix(prefilled(eng, t)) for t in TEXTS]
    assert all(paths) and os.path.isfile(os.path.join(d, INDEX_NAME))
    return st, paths


def _reads(monkeypatch):
    """The files a store reads to index them (their headers)."""
    seen = []
    real = kvstore.index_header

    def spy(idx, path):
        seen.append(os.path.basename(path))
        return real(idx, path)

    monkeypatch.setattr(kvstore, "index_header", spy)
    return seen


def _facts(st):
    return sorted((e.name, e.tokens, e.text_bytes, e.size, e.stat_key) for e in st.entries())


def _check_loads(eng, st, cold, expect):
    """Every text loads exactly its cold state from the file ``expect`` says
    (a text -> path), or nothing when ``expect`` has no path for it."""
    for t in TEXTS:
        s = ds4.Session(eng, ctx=4096)
        r = try_load_text(st, s, t + " and then?")
        want = expect.get(t)
        assert (r.path if r else None) == want, t[:20]
        if r is not None:  # the state of the text the file holds, exactly
            toks, logits = cold[ds4.open_checkpoint(r.path, load_payload=False).text.decode()]
            assert s.tokens == toks and np.array_equal(s.logits, logits), "WRONG state loaded"


def _ck_names(d):
    return sorted(n for n in os.listdir(d) if is_checkpoint_name(n))


def test_a_fresh_store_opens_from_the_index_without_reading_a_header(eng, tmp_path, monkeypatch, cold):
    st, paths = _fill(eng, tmp_path)
    facts = _facts(st)
    reads = _reads(monkeypatch)
    again = _store(tmp_path)
    assert reads == [] and again.stats["index_rebuilds"] == 0
    assert _facts(again) == facts
    _check_loads(eng, again, cold, dict(zip(TEXTS, paths, strict=True)))


def test_the_index_file_follows_the_file_policy(eng, tmp_path):
    _fill(eng, tmp_path)
    for name in (INDEX_NAME, INDEX_TMP_NAME):
        assert not is_checkpoint_name(name) and not is_temp_name(name)
    assert not os.path.exists(tmp_path / INDEX_TMP_NAME)
    assert (os.stat(tmp_path / INDEX_NAME).st_mode & 0o777) == 0o600
    # `kv ls` and every scan see checkpoints only
    assert kvstore.scan_dir(str(tmp_path))[0] == [str(tmp_path / n) for n in _ck_names(tmp_path)]


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_a_damaged_index_is_rebuilt_at_every_byte(eng, tmp_path, monkeypatch, cold, how):
    st, paths = _fill(eng, tmp_path)
    facts = _facts(st)
    good = (tmp_path / INDEX_NAME).read_bytes()
    expect = dict(zip(TEXTS, paths, strict=True))
    reads = _reads(monkeypatch)
    for i in range(len(good)):
        bad = good[:i] if how == "torn" else good[:i] + bytes([good[i] ^ 0x10]) + good[i + 1 :]
        (tmp_path / INDEX_NAME).write_bytes(bad)
        reads.clear()
        again = _store(tmp_path)
        assert again.stats["index_rebuilds"] == 1, i
        assert sorted(reads) == _ck_names(tmp_path), i  # rebuilt from the headers
        assert _facts(again) == facts, i
        assert (tmp_path / INDEX_NAME).read_bytes() != bad, i  # and written again
    _check_loads(eng, _store(tmp_path), cold, expect)
    assert _ck_names(tmp_path) == sorted(os.path.basename(p) for p in paths)  # nothing lost


def _another_process_changes(eng, d, with_lock):
    """Another process adds a file, replaces one (a new inode under the same
    name) and removes one; with the lock (a ds4 store, which rewrites the
    index too) or without it (a writer that knows nothing of the index)."""
    before = os.stat(d)
    abi = ds4.Session(eng, ctx=4096).payload_abi
    if with_lock:
        other = _store(d)
        added = other.store_live_prefix(prefilled(eng, TEXTS[2] + "more words " * 4))
        other.remove(stored_name(TEXTS[1], abi))
    else:
        s = prefilled(eng, TEXTS[2] + "more words " * 4)
        added = stored_path(d, s.text_bytes(), abi)
        ds4.checkpoint.write_checkpoint(
            added, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=s.n_past, ctx=s.ctx
        )
        os.unlink(stored_path(d, TEXTS[1], abi))
    # replaced: the same text written again (temp file, rename: a new inode)
    s = prefilled(eng, TEXTS[0])
    p0 = stored_path(d, TEXTS[0], abi)
    ino = os.stat(p0).st_ino
    ds4.checkpoint.write_checkpoint(
        p0, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=s.n_past, ctx=s.ctx
    )
    assert os.stat(p0).st_ino != ino
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))  # even when the mtime cannot tell
    return added


@pytest.mark.parametrize("with_lock", [True, False])
def test_a_stale_index_is_brought_up_to_date(eng, tmp_path, monkeypatch, cold, with_lock):
    _st, paths = _fill(eng, tmp_path)
    stale = (tmp_path / INDEX_NAME).read_bytes()
    keys = {n: stat_key(os.stat(tmp_path / n)) for n in _ck_names(tmp_path)}  # what `stale` records
    added = _another_process_changes(eng, str(tmp_path), with_lock)
    for index_bytes in (None, stale):  # the index as the other process left it, and the old one
        moved = set()
        if index_bytes is not None:
            (tmp_path / INDEX_NAME).write_bytes(index_bytes)
            # the first pass's loads stamped their hits in place: the old
            # index's records of those files are stale, and read again
            moved = {n for n in _ck_names(tmp_path) if n in keys and stat_key(os.stat(tmp_path / n)) != keys[n]}
        reads = _reads(monkeypatch)
        again = _store(tmp_path)
        assert again.stats["index_rebuilds"] == 0
        names = {e.name for e in again.entries()}
        assert names == set(_ck_names(tmp_path)) == {os.path.basename(p) for p in (paths[0], paths[2], added)}
        # only what changed since the index was written is read
        assert set(reads) <= {os.path.basename(paths[0]), os.path.basename(added)} | moved
        assert again.stats["index_mismatches"] == 0  # stale, not lying
        _check_loads(eng, again, cold, {TEXTS[0]: paths[0], TEXTS[1]: paths[0], TEXTS[2]: paths[2]})
        monkeypatch.undo()
    assert _facts(_store(tmp_path)) == _facts(_store(tmp_path, scan=True))


def test_another_directorys_index_is_not_used(eng, tmp_path, monkeypatch, cold):
    a, b = tmp_path / "a", tmp_path / "b"
    _st, paths = _fill(eng, str(a))
    _store(b).store_live_prefix(prefilled(eng, TEXTS[1] + "in b " * 10))
    shutil.copyfile(b / INDEX_NAME, a / INDEX_NAME)  # swapped in
    reads = _reads(monkeypatch)
    again = _store(a)
    assert again.stats["index_rebuilds"] == 1 and sorted(reads) == _ck_names(a)
    assert {e.name for e in again.entries()} == set(_ck_names(a))
    _check_loads(eng, again, cold, dict(zip(TEXTS, paths, strict=True)))
    assert len(_ck_names(a)) == 3 and len(_ck_names(b)) == 1


def _records(raw):
    """(head + ABI table, records, checksum) of an index file."""
    n = struct.unpack_from("<I", raw, 12)[0]
    body = raw[:-8]
    start = len(body) - n * RECORD
    return body[:start], [body[start + i * RECORD : start + (i + 1) * RECORD] for i in range(n)]


def _seal(head, records):
    body = head + b"".join(records)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def test_a_tampered_index_never_loads_a_wrong_state(eng, tmp_path, cold):
    """Records rewritten so that each name carries another file's facts
    (length, tail, stat key), the checksum recomputed: the index is
    believed, and still nothing wrong is loaded and nothing is lost."""
    _st, paths = _fill(eng, tmp_path)
    raw = (tmp_path / INDEX_NAME).read_bytes()
    head, recs = _records(raw)
    assert _seal(head, recs) == raw
    names = [r[:20] for r in recs]
    swapped = [names[(i + 1) % len(recs)] + r[20:] for i, r in enumerate(recs)]  # name i -> facts of i+1
    (tmp_path / INDEX_NAME).write_bytes(_seal(head, swapped))
    st = _store(tmp_path)
    assert st.stats["index_rebuilds"] == 0  # the checksum holds: believed
    for t in TEXTS:
        s = ds4.Session(eng, ctx=4096)
        r = try_load_text(st, s, t + " and then?")
        if r is not None:  # only the true file of this text can load
            assert r.path == paths[TEXTS.index(t)]
            toks, logits = cold[t]
            assert s.tokens == toks and np.array_equal(s.logits, logits)
    assert _ck_names(tmp_path) == sorted(os.path.basename(p) for p in paths)  # nothing lost
    # without the recomputed checksum the tampering is seen: rebuilt
    (tmp_path / INDEX_NAME).write_bytes(_seal(head, swapped)[:-1] + b"\x00")
    again = _store(tmp_path)
    assert again.stats["index_rebuilds"] == 1
    _check_loads(eng, again, cold, dict(zip(TEXTS, paths, strict=True)))


def test_indexing_reads_the_header_not_the_text(eng, tmp_path, monkeypatch, cold):
    """A file whose text no longer hashes to its name (its header intact) is
    indexed from its header; it is never loaded, and is removed when it is
    a candidate. One whose header's SHA-1 is not its name is refused at once."""
    _st, paths = _fill(eng, tmp_path)
    os.unlink(tmp_path / INDEX_NAME)
    victim = paths[1]
    text = ds4.open_checkpoint(victim, load_payload=False).text
    raw = bytearray(Path(victim).read_bytes())
    raw[raw.index(text) + 3] ^= 0x01  # inside the text, far from its tail
    with open(victim, "r+b") as f:
        f.write(raw)
    liar = tmp_path / ("0" * 40 + ".kv")
    shutil.copyfile(paths[2], liar)  # a header recording another name's SHA-1
    calls = []
    real_open = kvstore.admission.open_checkpoint  # where a load opens a file
    monkeypatch.setattr(kvstore.admission, "open_checkpoint", lambda p, **kw: (calls.append(p), real_open(p, **kw))[1])
    st = _store(tmp_path)
    assert calls == []  # no file was opened through the pipeline (its text hashed) to index it
    assert os.path.basename(victim) in {e.name for e in st.entries()}
    assert not liar.exists() and st.stats["removed_corrupt"] == 1
    # the damaged file is a candidate for its text: rejected, removed, and the
    # ladder goes on to the next (shorter) stored prefix
    s = ds4.Session(eng, ctx=4096)
    rep = ds4.recovery.RecoveryReport()
    r = try_load_text(st, s, TEXTS[1] + " and then?", report=rep)
    # (the refused file's rejection is reported to this first ladder run too)
    assert [(p, c) for (p, _s, c, _r) in rep.rejected] == [(str(liar), "name_mismatch"), (victim, "text_sha1_mismatch")]
    assert r is not None and r.path == paths[0]
    toks, logits = cold[TEXTS[0]]
    assert s.tokens == toks and np.array_equal(s.logits, logits)
    assert not os.path.exists(victim) and os.path.exists(paths[0]) and os.path.exists(paths[2])


def test_an_index_entry_that_is_not_a_regular_file_is_left_alone(eng, tmp_path, cold):
    _st, paths = _fill(eng, tmp_path)
    os.unlink(tmp_path / INDEX_NAME)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-target"
    elsewhere.write_bytes(b"not an index")
    os.symlink(elsewhere, tmp_path / INDEX_NAME)
    st = _store(tmp_path)
    assert st.stats["index_rebuilds"] == 1
    st.store_live_prefix(prefilled(eng, TEXTS[2] + "one more " * 5))
    assert os.path.islink(tmp_path / INDEX_NAME) and elsewhere.read_bytes() == b"not an index"
    assert not os.path.exists(tmp_path / INDEX_TMP_NAME)
    _check_loads(eng, _store(tmp_path), cold, dict(zip(TEXTS, paths, strict=True)))


def test_the_core_index_reports_its_size(tmp_path, write_ck):
    idx = _core.StoreIndex()
    for i in range(50):
        idx.index_file(write_ck(tmp_path, f"text number {i} " * 3))
    assert len(idx) == 50 and 50 * 64 <= idx.heap_bytes() <= 50 * 1024
    lengths = {row[3] for row in idx.entries()}
    assert lengths == {len(f"text number {i} " * 3) for i in range(50)}
    prompt = ("text number 7 " * 3 + "and more").encode()
    [hit] = idx.lookup(prompt, min_tokens=0)
    assert hit[0] == hashlib.sha1(prompt[: len("text number 7 " * 3)]).hexdigest() + ".kv"


def test_a_file_damaged_in_place_behind_the_index_is_caught_at_its_load(eng, tmp_path, monkeypatch, cold):
    """Damage inside the text under the same stat key (inode, size, and the
    mtime put back) is not the open's to see (it checks each record's stat
    key, the header's facts and the namespace preamble, not the text): the
    entry stays, and the load's own verification refuses the file, removes
    it and falls back to the next stored prefix."""
    _st, paths = _fill(eng, tmp_path)
    victim = paths[1]
    raw = bytearray(Path(victim).read_bytes())
    text = ds4.open_checkpoint(victim, load_payload=False).text
    raw[raw.index(text) + 5] ^= 0x02
    before = os.stat(victim)
    with open(victim, "r+b") as f:  # in place: same inode
        f.write(raw)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    reads = _reads(monkeypatch)
    st = _store(tmp_path)
    assert reads == [] and os.path.basename(victim) in {e.name for e in st.entries()}
    s = ds4.Session(eng, ctx=4096)
    rep = ds4.recovery.RecoveryReport()
    r = try_load_text(st, s, TEXTS[1] + " and then?", report=rep)
    assert [(p, c) for (p, _s, c, _r) in rep.rejected] == [(victim, "text_sha1_mismatch")]
    assert r is not None and r.path == paths[0]
    toks, logits = cold[TEXTS[0]]
    assert s.tokens == toks and np.array_equal(s.logits, logits)
    assert not os.path.exists(victim)
    assert os.path.basename(victim) not in {e.name for e in _store(tmp_path).entries()}


def test_an_upper_case_name_keeps_its_case_through_the_index_file(eng, tmp_path, monkeypatch, cold):
    """ds4 reads names in either case: the index records the name's case,
    so a store opened from the index file finds and loads the file."""
    st = _store(tmp_path)
    p = st.store_live_prefix(prefilled(eng, TEXTS[1]))
    upper = os.path.join(str(tmp_path), os.path.basename(p)[:40].upper() + os.path.basename(p)[40:])
    os.rename(p, upper)
    st = _store(tmp_path)
    st.store_live_prefix(prefilled(eng, TEXTS[2]))  # writes the index file
    reads = _reads(monkeypatch)
    again = _store(tmp_path)
    assert reads == [] and again.stats["index_rebuilds"] == 0
    assert upper in {e.path for e in again.entries()}
    other = stored_path(tmp_path, TEXTS[2], ds4.Session(eng, ctx=4096).payload_abi)
    _check_loads(eng, again, cold, {TEXTS[1]: upper, TEXTS[2]: other})
