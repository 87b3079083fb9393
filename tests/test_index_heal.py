"""Issue 23, item 3: an index that never hides a file.

A name the index dropped after a transient failure (the file changed while
its header was read, a rewrite in progress, a lock) is read again by the
next lookup once the file has changed since the failure, and at the latest
by the first lookup one retry period (``DirIndex.retry_s``, on the index's
own clock, injected here) after it; a file changed behind the index (same
name, same inode, the directory's mtime untouched: truncated in place) is
stat'ed before it is offered and never offered as indexed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ds4 import kvstore
from ds4.errors import CorruptCheckpointError
from ds4.kvstore import KVStore

TEXT = b"a checkpoint that a writer keeps rewriting in place " * 4
PROMPT = TEXT + b" and the question after it"


class Clock:
    """The index's clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _store(d, clock: Clock) -> KVStore:
    st = KVStore(d, min_tokens=1, scan=False)
    st.index.clock = clock  # before the open: its failures are on this clock too
    st.index.open()
    return st


def _names(st: KVStore, prompt: bytes = PROMPT) -> list[str]:
    """What the ladder would be offered, in order (every candidate)."""
    return [e.name for e in st.candidates(prompt).entries]


def test_a_name_dropped_while_its_file_was_rewritten_is_indexed_by_the_next_lookup(tmp_path, write_ck, monkeypatch):
    """The worst interleaving of the rewrite race, made deterministic: the
    refresh reads the header while the file is torn (truncated, rewrite in
    progress) and the writer finishes before the store judges it, so the
    corrupt verdict is about a version that is gone (the file stays), and
    the name was dropped. Before the fix it stayed hidden until the
    directory's mtime changed (an in-place rewrite never changes it)."""
    path = write_ck(tmp_path, TEXT)
    name = os.path.basename(path)
    good = Path(path).read_bytes()
    clock = Clock()
    st = _store(tmp_path, clock)
    assert _names(st) == [name]
    real = kvstore.index_header
    torn = {"n": 0}

    def read_while_rewritten(idx, p):
        if os.path.basename(p) == name and torn["n"] == 0:
            torn["n"] += 1
            try:
                return real(idx, p)
            finally:  # the writer finishes before the verdict
                with open(p, "r+b") as f:
                    f.write(good)
        return real(idx, p)

    monkeypatch.setattr(kvstore, "index_header", read_while_rewritten)
    with open(path, "r+b") as f:  # the writer starts, as cp does: truncate, then write
        f.truncate(0)
        f.write(good[:100])
    st.refresh(force=True)  # the scan that reads it torn
    assert torn["n"] == 1 and Path(path).read_bytes() == good  # kept: it changed since it was judged
    assert st.index.row(name) is None  # dropped from the index
    # the directory's mtime as the index last saw it: as when the store's
    # own index write lands in the same tick of the kernel's coarse clock,
    # or the lock was busy and no index file was written (an in-place
    # rewrite never changes it): no rescan will see the file again
    d = os.stat(tmp_path)
    os.utime(tmp_path, ns=(d.st_atime_ns, st.index._dir_mtime))
    scans = st.stats["scans"]
    # the very next lookup reads it again (its stat key changed since the failure)
    assert _names(st) == [name]
    assert st.stats["scans"] == scans and st.stats["index_retries"] == 1


def test_a_name_dropped_by_a_lock_comes_back_within_one_retry_period(tmp_path, write_ck, monkeypatch):
    """A failure that leaves no trace on the file (a lock: EACCES, EAGAIN):
    the name is retried by the first lookup one retry period later, not
    before (counted in lookups on the injected clock)."""
    path = write_ck(tmp_path, TEXT)
    name = os.path.basename(path)
    clock = Clock()
    real = kvstore.index_header
    locked = {"on": True}

    def flaky(idx, p):
        if os.path.basename(p) == name and locked["on"]:
            raise BlockingIOError(11, "Resource temporarily unavailable", p)
        return real(idx, p)

    monkeypatch.setattr(kvstore, "index_header", flaky)
    st = _store(tmp_path, clock)
    assert _names(st) == []
    locked["on"] = False  # the lock is gone; the file never changed
    misses = 0
    while not _names(st):
        misses += 1
        assert misses < 100
        clock.t += st.index.retry_s / 4
    # found by the first lookup at or after one period, none later
    assert misses == 4
    assert st.stats["index_retries"] == 1


def test_a_file_truncated_behind_the_index_is_not_offered(tmp_path, write_ck):
    """Truncated in place after it was indexed (same inode, the directory
    untouched: no rescan sees it): the stat before the offer notices the
    size and mtime are not the indexed ones, reads the header again, and
    the corrupt file is removed and reported instead of offered; the next
    candidate is offered."""
    short = write_ck(tmp_path, TEXT[:60])
    path = write_ck(tmp_path, TEXT)
    st = _store(tmp_path, Clock())
    assert _names(st) == [os.path.basename(path), os.path.basename(short)]
    dir_mtime = os.stat(tmp_path).st_mtime_ns
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    assert os.stat(tmp_path).st_mtime_ns == dir_mtime  # nothing a rescan would notice
    found = st.candidates(PROMPT)
    assert [e.name for e in found.entries] == [os.path.basename(short)]
    assert not os.path.exists(path)  # corrupt at its header: removed, as a load would
    assert st.stats["removed_corrupt"] == 1
    # handed to the ladder with the candidates (loading reports them in its run)
    assert [(r[0], r[2]) for r in found.entries.refused] == [(path, "truncated")]
    # and through lookup() too
    assert [e.path for e in st.lookup(PROMPT)] == [short]


def test_a_file_rewritten_behind_the_index_is_offered_as_it_is_now(tmp_path, write_ck):
    """Rewritten in place with a valid file of the same text (other tokens):
    offered with the facts of the file on disk, not the indexed ones."""
    other = tmp_path / "other"  # a directory: the store ignores it
    other.mkdir()
    good = Path(write_ck(other, TEXT, tokens=9, created=1_700_000_123)).read_bytes()
    path = write_ck(tmp_path, TEXT, tokens=7)
    st = _store(tmp_path, Clock())
    assert [e.tokens for e in st.candidates(PROMPT).entries] == [7]
    dir_mtime = os.stat(tmp_path).st_mtime_ns
    with open(path, "r+b") as f:
        f.write(good)
    os.utime(path, ns=(1, 1))  # a new mtime whatever the clock's granularity
    assert os.stat(tmp_path).st_mtime_ns == dir_mtime  # nothing a rescan would notice
    [e] = st.candidates(PROMPT).entries
    assert (e.tokens, e.stat_key[2]) == (9, 1)


@pytest.mark.parametrize("readers", [2])
def test_rewrite_race_no_lookup_misses_a_valid_file_for_longer_than_one_period(tmp_path, write_ck, readers):
    """A writer rewrites the checkpoint in place in a loop (truncate + write,
    and overwrite without truncating, as ``cp`` and ``dd conv=notrunc`` do)
    while readers look it up, each through its own store. When the writer
    stops, the file on disk is valid: every reader finds it again within one
    retry period (counted in lookups on each reader's injected clock, the
    clock moved a quarter period per lookup), whatever the race dropped."""
    path = write_ck(tmp_path, TEXT)
    name = os.path.basename(path)
    good = Path(path).read_bytes()
    stop = threading.Event()
    rounds = 300
    done_writing = threading.Event()
    errors: list[BaseException] = []

    def writer():
        try:
            for n in range(rounds):
                flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if n % 2 else 0)
                fd = os.open(path, flags, 0o600)
                try:
                    os.write(fd, good[: len(good) // 2])
                    os.write(fd, good[len(good) // 2 :])
                finally:
                    os.close(fd)
        except BaseException as e:  # reported by the test
            errors.append(e)
        finally:
            done_writing.set()

    stores = [_store(tmp_path, Clock()) for _ in range(readers)]
    found_during = [0] * readers

    def reader(i):
        st = stores[i]
        try:
            while not stop.is_set():
                try:
                    found_during[i] += name in _names(st)
                except CorruptCheckpointError:
                    pass
                st.index.clock.t += st.index.retry_s / 4
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    w = threading.Thread(target=writer)
    for t in threads:
        t.start()
    w.start()
    done_writing.wait()
    stop.set()
    for t in [w, *threads]:
        t.join()
    assert not errors, errors
    if not os.path.exists(path):  # a reader judged it torn while it was unchanged, and removed it
        with open(path, "wb") as f:  # the writer's next round would write it again
            f.write(good)
    assert Path(path).read_bytes() == good
    for st in stores:
        misses = 0
        while name not in _names(st):
            misses += 1
            assert misses <= 4, f"hidden for {misses} lookups ({st.stats})"
            st.index.clock.t += st.index.retry_s / 4
