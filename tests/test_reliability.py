"""Reliability (issue #5): a full filesystem, several processes hammering one
directory, a hostile cache directory. The long campaigns live in
scripts/campaign.py; these are their in-suite versions."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest

import ds4
from ds4.errors import StoreError, StoreFullError
from ds4.recovery import try_load_text


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs mounted for this test (CI and developers run as root)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_store_onto_a_full_filesystem(small_fs):
    eng = ds4.ReferenceEngine()
    st = ds4.KVStore(small_fs / "cache", budget_mb=1024, min_tokens=8)
    stored = []
    err = None
    for i in range(200):
        s = ds4.Session(eng, ctx=4096)
        s.sync(eng.tokenize(f"conversation {i} " * 40, special=True))
        try:
            p = st.store_live_prefix(s)
        except StoreError as e:
            err = e
            assert s.checkpoint_valid  # the live session is not harmed
            break
        stored.append((p, s.tokens, np.array(s.logits)))
    assert isinstance(err, StoreFullError), err
    assert "disk full" in str(err)
    assert len(stored) >= 3
    names = os.listdir(small_fs / "cache")
    assert [n for n in names if ".tmp." in n] == []  # no partial file
    assert sorted(n for n in names if n.endswith(".kv")) == sorted(os.path.basename(p) for p, _, _ in stored)
    for p, toks, logits in stored:  # every earlier checkpoint still loads, exactly
        s = ds4.Session(eng, ctx=4096)
        s.load_checkpoint(ds4.open_checkpoint(p, expected_abi=eng.payload_abi()))
        assert s.tokens == toks and np.array_equal(s.logits, logits)


def _mixed_worker(d, wid, n_ops, seed, q):
    """store / lookup+load (now and then through a store freshly opened from
    the shared index file) / touch / evict at random; every load is checked
    against a cold prefill of the same text. Puts loads + 1000 * reopens."""
    import random

    import ds4 as _ds4

    rnd = random.Random(seed)
    eng = _ds4.ReferenceEngine()
    st = _ds4.KVStore(d, budget_mb=0.5, min_tokens=8)
    texts = [f"shared conversation {k} " * (6 + k) for k in range(12)]
    cold = {}
    problems, loads, reopened = [], 0, 0
    for _ in range(n_ops):
        t = rnd.choice(texts)
        op = rnd.random()
        try:
            if op < 0.35:
                s = _ds4.Session(eng, ctx=2048)
                s.sync(eng.tokenize(t, special=True))
                st.store_live_prefix(s)
            elif op < 0.85:
                if rnd.random() < 0.15:  # a fresh store: opened from the shared index file
                    st = _ds4.KVStore(d, budget_mb=0.5, min_tokens=8)
                    reopened += 1
                s = _ds4.Session(eng, ctx=2048)
                res = try_load_text(st, s, t + " and then?")
                if res is not None:
                    loads += 1
                    key = res.path
                    if t not in cold:
                        c = _ds4.Session(eng, ctx=2048)
                        c.sync(eng.tokenize(t, special=True))
                        cold[t] = (c.tokens, np.array(c.logits))
                    toks, logits = cold[t]
                    if s.tokens != toks or not np.array_equal(s.logits, logits):
                        problems.append(f"wrong state loaded from {key}")
            elif op < 0.95:
                for e in st.entries()[:2]:
                    try:
                        _ds4._core.touch(e.path, 1)
                    except FileNotFoundError:
                        pass  # evicted by another process: a documented miss
            else:
                st.evict()
        except Exception as e:  # anything else is a failure
            problems.append(f"{type(e).__name__}: {e}")
    q.put((wid, problems, loads + 1000 * reopened))


def test_four_processes_mixed_operations(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_mixed_worker, args=(str(tmp_path), i, 60, 1000 + i, q)) for i in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(problems == [] for _, problems, _ in results), results
    assert sum(n % 1000 for _, _, n in results) > 0  # loads
    assert sum(n // 1000 for _, _, n in results) > 0  # stores opened from the index file
    files = [f for f in os.listdir(tmp_path) if f.endswith(".kv")]
    sizes = [os.path.getsize(tmp_path / f) for f in files]
    st = ds4.KVStore(tmp_path, budget_mb=0.5)
    st.evict()  # at rest, the budget holds after one eviction pass (newest protected)
    files = [f for f in os.listdir(tmp_path) if f.endswith(".kv")]
    assert sum(os.path.getsize(tmp_path / f) for f in files) <= 0.5 * 2**20 or len(files) == 1
    assert [f for f in os.listdir(tmp_path) if ".tmp" in f] == []
    for f in files:
        ds4.open_checkpoint(tmp_path / f)
    # the index file the processes shared is whole, and a store opened from
    # it knows exactly the files at rest
    again = ds4.KVStore(tmp_path, budget_mb=0.5)
    assert again.stats["index_rebuilds"] == 0
    assert sorted(e.name for e in again.entries()) == sorted(files)
    assert sizes  # something was stored during the run


def test_symlinked_cache_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(StoreError):
        ds4.KVStore(link)


def test_symlink_entries_are_never_followed_outside(tmp_path):
    eng = ds4.ReferenceEngine()
    outside = tmp_path / "outside"
    outside.mkdir()
    text = "a checkpoint that lives outside the cache " * 2
    s = ds4.Session(eng, ctx=1024)
    s.sync(eng.tokenize(text, special=True))
    ds4.KVStore(outside, min_tokens=8).store_live_prefix(s)
    target = next(outside.glob("*.kv"))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / target.name).symlink_to(target)  # a symlink where a file should be
    st = ds4.KVStore(cache, min_tokens=8)
    s2 = ds4.Session(eng, ctx=1024)
    rep = ds4.recover(s2, st, text + " more")
    assert rep.rung == "prefill"  # not loaded through the link
    assert target.exists() and (cache / target.name).is_symlink()  # nothing deleted


UNREADABLE_CHILD = r"""
import os, sys
import ds4
from ds4 import KVStore, Session, recover  # imported while the interpreter's own files are still readable
eng = ds4.ReferenceEngine()
os.setgid(65534); os.setuid(65534)  # now another user, who cannot read the 0600 file (nor root's Python)
# the directory is root's: refused unless trusted (tests/test_dir_trust.py); trusted here
st = KVStore(sys.argv[1], min_tokens=8, trust_dir=True)
s = Session(eng, ctx=1024)
rep = recover(s, st, sys.argv[2])
print(rep.rung, s.checkpoint_valid)
"""


def test_unreadable_checkpoint_is_skipped_not_crashed(tmp_path):
    import shutil
    import tempfile

    eng = ds4.ReferenceEngine()
    base = tempfile.mkdtemp(prefix="ds4-unreadable-", dir="/tmp")  # traversable by others
    os.chmod(base, 0o755)
    d = os.path.join(base, "cache")
    text = "owned by someone else and unreadable " * 2
    s = ds4.Session(eng, ctx=1024)
    s.sync(eng.tokenize(text, special=True))
    p = ds4.KVStore(d, min_tokens=8).store_live_prefix(s)
    os.chmod(d, 0o755)  # the directory is listable by the other user; the 0600 file is not readable
    r = subprocess.run(
        [sys.executable, "-c", UNREADABLE_CHILD, str(d), text + " more"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["prefill", "True"]
    assert os.path.exists(p)  # not deleted: unreadable is not corrupt
    shutil.rmtree(base)


def test_files_0600_in_a_0700_directory(tmp_path):
    eng = ds4.ReferenceEngine()
    d = tmp_path / "fresh" / "cache"
    st = ds4.KVStore(d, min_tokens=8)
    s = ds4.Session(eng, ctx=1024)
    s.sync(eng.tokenize("permissions matter here " * 2, special=True))
    p = st.store_live_prefix(s)
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(p).st_mode & 0o777 == 0o600
