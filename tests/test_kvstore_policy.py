"""KVStore at its edges: what one load does (LoadResult, the hit written into
the file, the counters), the options that reach the verification pipeline,
corrupt files removed or quarantined, stale index entries, temp-file
orphan detection per writer, and the policy helpers at their boundaries.

Time is pinned by replacing the module's clock, never by sleeping."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
from helpers.checkpoints import flip_payload_byte, stored_name, stored_path
from helpers.kv import BASE, prefilled
from helpers.procs import dead_pid

import ds4
from ds4 import kvstore
from ds4.errors import CheckpointError
from ds4.kvstore import Entry, KVStore, LoadResult, temp_is_orphaned, temp_writer_pid
from ds4.kvstore.files import pid_space
from ds4.recovery import RecoveryReport, try_load_text

SHA = "ab" * 20


def _clock(monkeypatch, t):
    """Pin ``time.time()`` as the store sees it (its eviction, the hits its
    loads stamp, a quarantined file's tag)."""
    fake = types.SimpleNamespace(time=lambda: t, perf_counter=time.perf_counter)
    for part in (kvstore.eviction, kvstore.admission, kvstore.remove):
        monkeypatch.setattr(part, "time", fake)


def _header(path):
    return ds4.open_checkpoint(path, load_payload=False)


def _codes(rep):
    return [(p, stage, code) for (p, stage, code, _reason) in rep.rejected]


# -- Entry.score ---------------------------------------------------------------


def _entry(**kw):
    base = dict(
        name="x",
        path="x",
        version=2,
        tokens=1000,
        text_bytes=10,
        hits=0,
        created=0,
        last_used=0,
        size=500,
        abi="",
        reason="cold",
        ctx=0,
        stat_key=(),
    )
    base.update(kw)
    return Entry(**base)


def test_score_formula_edges():
    now = 2_000_000_000
    # used just now: no decay at all, (hits + 1) * tokens / size exactly
    assert _entry(hits=1, last_used=now).score(now) == 4.0
    assert _entry(hits=4, last_used=now).score(now) == 10.0
    # a clock that went backwards does not boost the score
    assert _entry(hits=4, last_used=now + 500).score(now) == 10.0
    # last_used missing: the creation time counts; one half-life halves the hits
    assert _entry(hits=4, created=now - 6 * 3600).score(now) == 6.0
    # never used and no creation time: hits do not count at all
    assert _entry(hits=3).score(now) == 2.0
    # no hits: no bonus
    assert _entry(hits=0, last_used=now).score(now) == 2.0
    # the 0.01 floor: below it the decayed hits are dropped...
    assert _entry(hits=1, last_used=now - 7).score(now, half_life=1.0) == 2.0
    # ... and exactly 0.01 is kept (0.01 == m * 2**-59 exactly, so m hits
    # 59 half-lives ago decay to exactly the float 0.01)
    m, d = (0.01).as_integer_ratio()
    assert d == 2**59
    assert _entry(hits=m, last_used=now - 59).score(now, half_life=1.0) == (0.01 + 1.0) * 1000 / 500
    # a file size below one byte counts as one
    assert _entry(size=1).score(now) == 1000.0
    assert _entry(size=0).score(now) == 1000.0


# -- temp files ------------------------------------------------------------------


def test_temp_writer_pid_per_writer_scheme():
    assert temp_writer_pid(f".{SHA}.kv.tmp.1234.9f8e7d") == 1234  # ours
    assert temp_writer_pid(f".{SHA}.kv.tmp.1234") == 1234
    assert temp_writer_pid(f".{SHA}.kv.tmp.x1234.9f8e7d") is None  # ours, mangled pid: unknown, not an error
    assert temp_writer_pid(f"{SHA}.kv.tmp.4321") == 4321  # ds4-server
    assert temp_writer_pid(f"{SHA}.kv.tmp.Xy12Zq") is None  # ds4-agent (mkstemp): no pid
    assert temp_writer_pid(f"{SHA}.kv") is None
    assert temp_writer_pid("notes.txt") is None


def test_temp_is_orphaned_at_exactly_the_age_limit():
    name = f"{SHA}.kv.tmp.Xy12Zq"  # no pid: age alone decides
    assert temp_is_orphaned(name, 1000.0, 1000.0 + 3600) is False
    assert temp_is_orphaned(name, 1000.0, 1000.0 + 3600.5) is True
    assert temp_is_orphaned(name, 1000.0, 1010.0, max_age=10) is False
    assert temp_is_orphaned(name, 1000.0, 1011.0, max_age=10) is True
    # a dead writer's file of our own writer, in this PID namespace, is orphaned at once
    dead = dead_pid()
    here = pid_space()
    assert here != "x"
    assert temp_is_orphaned(f".{SHA}.kv.tmp.{dead}.{here}.9f8e", 1000.0, 1000.0) is True
    # foreign writers are judged by age only: ds4-server's pid, ours from another
    # namespace or host, or ours without the namespace, may be alive where they were written
    for n in (f"{SHA}.kv.tmp.{dead}", f".{SHA}.kv.tmp.{dead}.9f8e", f".{SHA}.kv.tmp.{dead}.0123456789abf0000.9f8e"):
        assert temp_is_orphaned(n, 1000.0, 1000.0) is False, n
        assert temp_is_orphaned(n, 1000.0, 1000.0 + 3601) is True, n
    # this process's own temp files are live while young
    assert temp_is_orphaned(f".{SHA}.kv.tmp.{os.getpid()}.{here}.9f8e", 1000.0, 1000.0) is False


def test_probing_a_live_writer_sends_it_no_signal():
    """The liveness probe is signal 0: a live writer is neither disturbed nor
    judged orphaned while its file is young."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        now = time.time()
        for n in (f".{SHA}.kv.tmp.{child.pid}.{pid_space()}.9f8e", f"{SHA}.kv.tmp.{child.pid}"):
            assert temp_is_orphaned(n, now, now) is False
    finally:
        # Had the probe sent a real signal, it is pending or delivered before
        # this one (lower signals are delivered first): the exit status says.
        child.terminate()
        rc = child.wait(30)
    assert rc == -signal.SIGTERM


def test_temp_age_is_the_entrys_own_not_a_symlink_targets(tmp_path):
    d = tmp_path / "cache"
    d.mkdir()
    target = tmp_path / "young-user-file"
    target.write_bytes(b"user data")
    link = d / f"{SHA}.kv.tmp.Xy12Zq"
    os.symlink(target, link)
    old = time.time() - 2 * 3600
    os.utime(link, (old, old), follow_symlinks=False)
    dangling = d / (("cd" * 20) + ".kv.tmp.Ab34Cd")
    os.symlink(tmp_path / "gone", dangling)
    os.utime(dangling, (old, old), follow_symlinks=False)
    KVStore(d)
    # old as they are, they are not regular files: ignored, like every
    # non-regular entry (issue 13), and what they point to is untouched
    assert os.path.islink(link) and os.path.islink(dangling)
    assert target.read_bytes() == b"user data"


# -- index, entries, remove ----------------------------------------------------------


def test_entries_order_and_total_bytes(tmp_path, write_ck):
    st = KVStore(tmp_path)
    texts = ["a" * 10, "b" * 30, "d" * 20, "c" * 20]  # indexed shortest first; two of one length
    paths = {}
    for t in texts:
        paths[t] = write_ck(tmp_path, t)
        st.refresh(force=True)
    want = sorted(texts, key=lambda t: (-len(t), hashlib.sha1(t.encode()).hexdigest()))
    assert [e.path for e in st.entries()] == [paths[t] for t in want]
    assert [e.text_bytes for e in st.entries()] == [30, 20, 20, 10]
    assert st.total_bytes() == sum(os.path.getsize(p) for p in paths.values())


def test_remove_return_value_and_index(tmp_path, write_ck):
    st = KVStore(tmp_path)
    p = write_ck(tmp_path, "x" * 40)
    st.refresh(force=True)
    assert st.total_bytes() == os.path.getsize(p)
    assert st.remove(p) is True
    assert not os.path.exists(p)
    assert st.total_bytes() == 0  # dropped from the index at once, no rescan needed
    assert st.remove(p) is False
    assert st.remove("f" * 40 + ".kv") is False
    # a file written since the last refresh (not in the index yet)
    q = write_ck(tmp_path, "y" * 40)
    assert st.remove(os.path.basename(q)) is True
    assert not os.path.exists(q)


def test_refresh_rescans_only_when_the_directory_changes(tmp_path, write_ck):
    st = KVStore(tmp_path)
    scans = st.stats["scans"]
    for _ in range(3):
        st.refresh()
        st.entries()
    assert st.stats["scans"] == scans
    st.refresh(force=True)
    assert st.stats["scans"] == scans + 1
    write_ck(tmp_path, "z" * 40)
    d = os.stat(tmp_path)
    os.utime(tmp_path, ns=(d.st_atime_ns, d.st_mtime_ns + 1_000_000))  # a visible change, whatever the granularity
    assert len(st.entries()) == 1
    assert st.stats["scans"] == scans + 2


# -- one load -------------------------------------------------------------------------


def test_load_result_hit_recorded_and_counters(eng, tmp_path, monkeypatch):
    st = KVStore(tmp_path, min_tokens=8)
    text = "a stored conversation, with ünïcödé in it, " * 2
    s = prefilled(eng, text)
    p = st.store_live_prefix(s)
    n, nb = s.n_past, len(s.text_bytes())
    assert nb == len(text.encode("utf-8")) != len(text)
    T = 1_800_000_000
    _clock(monkeypatch, T)
    prompt = text + "and then a question"

    s2 = ds4.Session(eng, ctx=4096)
    r = try_load_text(st, s2, prompt)  # str prompts are encoded as UTF-8
    assert r == LoadResult(path=p, tokens=n, text_bytes=nb)
    assert s2.checkpoint_valid and s2.n_past == n
    h = _header(p)
    assert (h.hits, h.last_used) == (1, T)  # the hit is written into the file
    [e] = st.entries()
    assert (e.hits, e.last_used) == (1, T)  # and into the index entry

    # the index entry is current: a forced rescan re-reads nothing
    opened = _record_opens(monkeypatch)
    st.refresh(force=True)
    assert opened == []
    monkeypatch.undo()

    _clock(monkeypatch, T + 60)
    r = try_load_text(st, ds4.Session(eng, ctx=4096), prompt.encode("utf-8"))
    assert r == LoadResult(path=p, tokens=n, text_bytes=nb)
    h = _header(p)
    assert (h.hits, h.last_used) == (2, T + 60)

    for _ in range(2):
        sx = prefilled(eng, "something else", ctx=4096)
        assert try_load_text(st, sx, "nothing stored starts like this one") is None
        assert sx.checkpoint_valid  # a miss leaves the session alone
    assert (st.stats["hits"], st.stats["misses"], st.stats["rejected"], st.stats["removed_corrupt"]) == (2, 2, 0, 0)


def _saved_at(directory, sess, created):
    """``sess`` written as ``<sha1(text)>.kv`` with that creation time."""
    text = sess.text_bytes()
    path = os.path.join(os.fspath(directory), hashlib.sha1(text).hexdigest() + ".kv")
    ds4.checkpoint.write_checkpoint(
        path, text, sess.export_arrays(), abi=sess.payload_abi, tokens=sess.n_past, ctx=sess.ctx, created=created
    )
    return path


@pytest.mark.parametrize("hit_old", [False, True])
def test_a_hit_keeps_the_older_checkpoint_over_a_newer_never_hit_one(eng, tmp_path, monkeypatch, hit_old):
    """Two checkpoints alike in size and tokens, the older written first:
    without a hit the older goes first (ties: least recently used); a hit on
    it makes the never-hit newer one go instead. The stamp that decides is
    the one written into the file and the index (eviction rebuilds its
    entries from them, not from the entry the load held). No fresh guard:
    the order is the score's and the recency's alone."""
    T = 1_700_000_000
    old = _saved_at(tmp_path, prefilled(eng, BASE[:60]), T)
    new = _saved_at(tmp_path, prefilled(eng, BASE[1:61]), T + 100)
    assert os.path.getsize(old) == os.path.getsize(new)
    st = KVStore(tmp_path, min_tokens=8, fresh_guard_s=0)
    _clock(monkeypatch, T + 200)
    if hit_old:
        r = try_load_text(st, ds4.Session(eng, ctx=4096), BASE[:60] + "?")
        assert r is not None and r.path == old
    st.policy = dataclasses.replace(st.policy, budget_mb=(st.total_bytes() - 1) / 2**20)
    assert st.evict_names() == [os.path.basename(new if hit_old else old)]


def test_consume_over_cold_max(eng, tmp_path):
    """With consume_over_cold_max, a load of a checkpoint longer than
    cold_max_tokens deletes the file, as ds4 does (it is consumed); a
    cold_max of 0 means no limit; the option off, every load records its
    hit and keeps the file."""
    text = BASE[:60]
    s = prefilled(eng, text)
    n = s.n_past
    cases = [
        (False, 8, True),
        (True, 8, False),
        (True, 0, True),
        (True, 1, False),
        (True, n - 1, False),
        (True, n, True),  # exactly at the limit is not over it
    ]
    for consume, cold_max, kept in cases:
        p = KVStore(tmp_path, min_tokens=8).store_live_prefix(s)
        st = KVStore(tmp_path, min_tokens=8, cold_max_tokens=cold_max, consume_over_cold_max=consume)
        before = _header(p).hits
        r = try_load_text(st, ds4.Session(eng, ctx=4096), text + "?")
        assert r is not None and r.tokens == n
        assert st.stats["hits"] == 1
        assert os.path.exists(p) == kept, (consume, cold_max)
        if kept:
            assert _header(p).hits == before + 1, (consume, cold_max)
        else:
            assert st.lookup(text + "?") == []


def test_consume_keeps_a_file_replaced_during_the_load(eng, tmp_path, monkeypatch):
    """Consume removes the version that was loaded only: a file replaced
    meanwhile (another writer's fresh save under the same name) stays."""
    text = BASE[:60]
    s = prefilled(eng, text)
    p = KVStore(tmp_path, min_tokens=8).store_live_prefix(s)
    st = KVStore(tmp_path, min_tokens=8, cold_max_tokens=1, consume_over_cold_max=True)
    real = ds4.Session.load_checkpoint

    def load_then_replace(self, ck):
        real(self, ck)
        os.unlink(p)
        KVStore(tmp_path, min_tokens=8).store_live_prefix(s)

    monkeypatch.setattr(ds4.Session, "load_checkpoint", load_then_replace)
    assert try_load_text(st, ds4.Session(eng, ctx=4096), text + "?") is not None
    assert os.path.exists(p)


def test_corrupt_candidates_are_quarantined(eng, tmp_path, monkeypatch):
    d, qd = tmp_path / "cache", tmp_path / "quarantine"
    st = KVStore(d, min_tokens=8, quarantine_dir=qd)
    paths = [st.store_live_prefix(prefilled(eng, BASE[:k])) for k in (30, 60)]
    for p in paths:
        flip_payload_byte(p, tensor="logits", mask=1)
    T = 1_750_000_123
    _clock(monkeypatch, T)
    sess = prefilled(eng, "a live session, soon invalid")
    rep = RecoveryReport()
    old = os.umask(0o022)
    try:
        assert try_load_text(st, sess, BASE[:60] + "?", report=rep) is None
    finally:
        os.umask(old)
    assert not sess.checkpoint_valid
    longest_first = paths[::-1]
    assert _codes(rep) == [(p, "payload", "payload_checksum") for p in longest_first]
    assert sorted(os.listdir(qd)) == sorted(f"{os.path.basename(p)}.{T}.payload_checksum" for p in paths)
    assert os.stat(qd).st_mode & 0o777 == 0o700
    assert [f for f in os.listdir(d) if f.endswith(".kv")] == []
    assert st.total_bytes() == 0  # dropped from the index, not only from the disk
    assert (st.stats["rejected"], st.stats["removed_corrupt"], st.stats["hits"], st.stats["misses"]) == (2, 2, 0, 1)
    assert st.entries() == []


def test_corrupt_candidate_removed_then_shorter_one_loads(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    short, long_ = (st.store_live_prefix(prefilled(eng, BASE[:k])) for k in (30, 60))
    flip_payload_byte(long_, tensor="logits", mask=1)
    rep = RecoveryReport()
    sess = ds4.Session(eng, ctx=4096)
    r = try_load_text(st, sess, BASE[:60] + "?", report=rep)
    assert r is not None and r.path == short and sess.checkpoint_valid
    assert _codes(rep) == [(long_, "payload", "payload_checksum")]
    assert not os.path.exists(long_)
    assert st.total_bytes() == os.path.getsize(short)
    assert (st.stats["rejected"], st.stats["removed_corrupt"], st.stats["hits"], st.stats["misses"]) == (1, 1, 1, 0)


def test_foreign_abi_file_is_kept_even_with_a_damaged_payload(eng, tmp_path, save_session):
    """ABI is checked at the header, before the payload: another engine's
    file is skipped and kept, never judged (or removed) by our checksum pass."""
    paths = []
    for k in (30, 60):
        s = prefilled(eng, BASE[:k])
        p = save_session(tmp_path, s, abi="another-engine/9")
        flip_payload_byte(p, tensor="logits", mask=1)
        paths.append(p)
    st = KVStore(tmp_path, min_tokens=8)
    rep = RecoveryReport()
    sess = prefilled(eng, "live")
    assert try_load_text(st, sess, BASE[:60] + "?", report=rep) is None
    assert _codes(rep) == [(p, "header", "abi_mismatch") for p in paths[::-1]]
    assert all(os.path.exists(p) for p in paths)
    assert (st.stats["rejected"], st.stats["removed_corrupt"], st.stats["misses"]) == (2, 0, 1)
    assert len(st.entries()) == 2


def test_engine_quant_bits_reach_the_check(eng, tmp_path):
    qeng = ds4.ReferenceEngine()
    qeng.quant_bits = 4  # an engine that declares its quantization
    text = BASE[:60]
    st = KVStore(tmp_path, min_tokens=8)
    p = st.store_live_prefix(prefilled(qeng, text))
    assert _header(p).quant_bits == 4
    rep = RecoveryReport()
    r = try_load_text(st, ds4.Session(qeng, ctx=4096), text + "?", report=rep)
    assert r is not None and r.path == p and rep.rejected == []
    # the plain engine (no quant_bits: 0) refuses it, and keeps it
    assert try_load_text(st, ds4.Session(eng, ctx=4096), text + "?", report=rep) is None
    assert _codes(rep) == [(p, "header", "quant_mismatch")] and os.path.exists(p)


def test_checksum_and_mmap_options_reach_the_load(eng, tmp_path):
    class Recording(ds4.Session):
        def load_checkpoint(self, ck):
            self.mapped = ck.mapped
            super().load_checkpoint(ck)

    text = BASE[:60]
    p = KVStore(tmp_path, min_tokens=8).store_live_prefix(prefilled(eng, text))
    for mm in (True, False):
        s = Recording(eng, ctx=4096)
        assert try_load_text(KVStore(tmp_path, min_tokens=8, mmap=mm), s, text + "?") is not None
        assert s.mapped is mm
    # with verify_checksum=False a flipped payload bit is not looked for
    flip_payload_byte(p, tensor="logits", mask=1)
    st = KVStore(tmp_path, min_tokens=8, verify_checksum=False)
    r = try_load_text(st, ds4.Session(eng, ctx=4096), text + "?")
    assert r is not None and r.path == p and os.path.exists(p)
    assert st.stats["removed_corrupt"] == 0


def test_session_context_bounds_the_candidates(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    s_short, s_long = prefilled(eng, BASE[:30]), prefilled(eng, BASE[:60])
    short, long_ = st.store_live_prefix(s_short), st.store_live_prefix(s_long)
    n_short, n_long = s_short.n_past, s_long.n_past
    # n_long tokens need a context of n_long + 1: exactly that fits
    rep = RecoveryReport()
    r = try_load_text(st, ds4.Session(eng, ctx=n_long + 1), BASE[:60] + "?", report=rep)
    assert r is not None and (r.path, r.tokens) == (long_, n_long) and rep.rejected == []
    # one less: the longer file is not even a candidate (not a rejection)
    rep = RecoveryReport()
    r = try_load_text(st, ds4.Session(eng, ctx=n_long), BASE[:60] + "?", report=rep)
    assert r is not None and (r.path, r.tokens) == (short, n_short)
    assert rep.rejected == [] and st.stats["rejected"] == 0


def _pin_dir_mtime(d, before):
    """Put the directory's mtime back: what another process's change looks
    like when it lands within the filesystem's timestamp granularity."""
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_stale_index_entry_is_rechecked_against_the_context(eng, tmp_path):
    """The index said 8 tokens; the file now holds more than the session's
    context (rewritten behind the index's back, its size and mtime as
    indexed, so the stat before the offer cannot tell): the load's own
    header check rejects it as incompatible instead of handing it to the
    session."""
    text = BASE[:60]
    s = prefilled(eng, text)
    n = s.n_past
    p = os.path.join(tmp_path, hashlib.sha1(s.text_bytes()).hexdigest() + ".kv")
    honest = os.path.join(tmp_path, "honest.bin")
    ds4.write_checkpoint(honest, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=n, ctx=s.ctx)
    ds4.write_checkpoint(p, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=8, ctx=s.ctx)
    data = Path(honest).read_bytes()
    os.unlink(honest)
    st = KVStore(tmp_path, min_tokens=8)
    assert [e.tokens for e in st.entries()] == [8]
    before, indexed = os.stat(tmp_path), os.stat(p)
    with open(p, "r+b") as f:
        f.write(data)
        f.truncate()
    assert os.path.getsize(p) == indexed.st_size
    os.utime(p, ns=(indexed.st_atime_ns, indexed.st_mtime_ns))
    _pin_dir_mtime(tmp_path, before)
    rep = RecoveryReport()
    sess = ds4.Session(eng, ctx=n)
    assert try_load_text(st, sess, text + "?", report=rep) is None
    assert _codes(rep) == [(p, "header", "ctx_too_small")]
    assert os.path.exists(p) and st.stats["rejected"] == 1
    # with an mtime of its own, the stat before the offer re-reads it: the
    # lookup's own context filter then leaves it out (nothing to reject)
    os.utime(p, ns=(1, 1))
    rep = RecoveryReport()
    assert try_load_text(st, sess, text + "?", report=rep) is None
    assert rep.rejected == [] and st.stats["rejected"] == 1 and st.index.row(os.path.basename(p))[2] == n


def test_candidate_removed_behind_the_index_falls_back(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    short, long_ = (st.store_live_prefix(prefilled(eng, BASE[:k])) for k in (30, 60))
    st.refresh(force=True)
    before = os.stat(tmp_path)
    os.unlink(long_)  # another process removed it...
    _pin_dir_mtime(tmp_path, before)  # ...and a rescan cannot tell
    assert st.index.row(os.path.basename(long_)) is not None  # still indexed
    assert [e.path for e in st.lookup(BASE[:60] + "?")] == [short]  # the stat before the offer can
    assert st.index.row(os.path.basename(long_)) is None
    rep = RecoveryReport()
    r = try_load_text(st, ds4.Session(eng, ctx=4096), BASE[:60] + "?", report=rep)
    assert r is not None and r.path == short
    assert rep.rejected == [] and st.stats["rejected"] == 0 and st.stats["hits"] == 1
    assert [e.path for e in st.entries()] == [short]  # the vanished file left the index


# -- store policy helpers --------------------------------------------------------------


def test_cold_store_len_boundaries(tmp_path):
    st = KVStore(tmp_path, min_tokens=512, boundary_trim_tokens=0)
    assert st.policy.cold_store_len(511) is None
    assert st.policy.cold_store_len(512) == 512  # exactly the minimum is enough
    st = KVStore(tmp_path)  # trim 32, align 2048, min 512
    assert st.policy.cold_store_len(544) == 512  # trimmed to exactly the minimum
    assert st.policy.cold_store_len(543) is None
    st = KVStore(tmp_path, min_tokens=2048)
    assert st.policy.cold_store_len(2048 + 32 + 100) == 2048  # aligned down to exactly the minimum
    assert st.policy.cold_store_len(2048 + 31) is None
    st = KVStore(tmp_path, boundary_align_tokens=0)  # no alignment: trim only
    assert st.policy.cold_store_len(1000) == 968
    assert st.policy.cold_store_len(5000) == 4968
    st = KVStore(tmp_path, boundary_align_tokens=1)
    assert st.policy.cold_store_len(5000) == 4968


def test_continued_step_boundaries(tmp_path):
    assert KVStore(tmp_path, continued_interval_tokens=10240).continued_step() == 10240  # already aligned
    assert KVStore(tmp_path, continued_interval_tokens=10241).continued_step() == 12288
    assert KVStore(tmp_path, continued_interval_tokens=10239).continued_step() == 10240
    assert KVStore(tmp_path, continued_interval_tokens=10001, boundary_align_tokens=0).continued_step() == 10001
    assert KVStore(tmp_path, continued_interval_tokens=10001, boundary_align_tokens=1).continued_step() == 10001


# -- the index: what a refresh reads, keeps and rejects ------------------------------


def _v1_bytes(text: bytes, *, tokens: int, hits: int = 0, reason: int = 1, created=1_700_000_000, last_used=0):
    """A minimal ds4 v1 file (48-byte header, u32 text length, text, DSV4
    payload head), as tests/test_core_v1.py builds them."""
    import struct

    fields = [0x34565344, 1, 32768, 2048, 4096, 128, 8192, tokens, 43, 512, 128, 129280, min(128, tokens)]
    payload = struct.pack("<13I", *fields) + b"\x11" * 64
    head = b"KVC" + bytes([1, 4, reason, 0, 0])
    head += struct.pack("<III", tokens, hits, 32768) + bytes(4)
    head += struct.pack("<QQQ", created, last_used, len(payload))
    return head + struct.pack("<I", len(text)) + text + payload


def _put_v1(directory, text: bytes, **kw) -> str:
    path = os.path.join(os.fspath(directory), hashlib.sha1(text).hexdigest() + ".kv")
    with open(path, "wb") as f:
        f.write(_v1_bytes(text, **kw))
    return path


def _bump_dir(d):
    """Make the directory's mtime visibly different from any value a refresh
    has recorded so far (whatever the filesystem's timestamp granularity)."""
    s = os.stat(d)
    os.utime(d, ns=(s.st_atime_ns, s.st_mtime_ns + 1_000_000_000))


def _stat_key(p):
    s = os.stat(p)
    return (s.st_ino, s.st_size, s.st_mtime_ns)


def _record_opens(monkeypatch):
    """The files the store reads to index them (their headers)."""
    opened = []
    real_index = kvstore.index_header

    def spy(idx, path):
        opened.append(path)
        return real_index(idx, path)

    monkeypatch.setattr(kvstore, "index_header", spy)
    return opened


def test_index_entries_hold_the_header_facts(tmp_path, write_ck):
    t2, t1 = b"a version two checkpoint, " * 2, b"a version one checkpoint from ds4"
    p2 = write_ck(tmp_path, t2, tokens=77, ctx=2048, created=1_700_000_123, reason="continued", quant_bits=4)
    assert kvstore._core.touch(p2, 1_700_000_500) == 1
    assert kvstore._core.touch(p2, 1_700_000_900) == 2
    p1 = _put_v1(tmp_path, t1, tokens=99, hits=5, reason=4, created=1_600_000_000, last_used=1_600_000_100)
    st = KVStore(tmp_path)
    assert st.entries() == [
        Entry(
            name=os.path.basename(p2),
            path=p2,
            version=2,
            tokens=77,
            text_bytes=len(t2),
            hits=2,
            created=1_700_000_123,
            last_used=1_700_000_900,
            size=os.path.getsize(p2),
            abi="t/1",
            reason="continued",
            ctx=2048,
            stat_key=_stat_key(p2),
        ),
        Entry(
            name=os.path.basename(p1),
            path=p1,
            version=1,
            tokens=99,
            text_bytes=len(t1),
            hits=5,
            created=1_600_000_000,
            last_used=1_600_000_100,
            size=os.path.getsize(p1),
            abi="",
            reason="shutdown",
            ctx=32768,
            stat_key=_stat_key(p1),
        ),
    ]
    assert st.stats["scans"] == 1 and st.index.unreported == []


def test_a_rescan_rereads_only_new_and_changed_files(tmp_path, write_ck, monkeypatch):
    a, b = write_ck(tmp_path, "a" * 20, tokens=10), write_ck(tmp_path, "b" * 20, tokens=10)
    st = KVStore(tmp_path, min_tokens=1)
    opened = _record_opens(monkeypatch)
    # the directory did not change: nothing is even listed
    st.refresh()
    assert (opened, st.stats["scans"]) == ([], 1)
    # a new file: only it is read
    c = write_ck(tmp_path, "c" * 20, tokens=12)
    _bump_dir(tmp_path)
    st.refresh()
    assert (opened, st.stats["scans"]) == ([c], 2)
    # one file replaced (new inode, new size), one removed: only the replaced one is read
    opened.clear()
    write_ck(tmp_path, "b" * 20, tokens=11, ctx=100_000, arrays={"kv": b"\x01" * 100})
    os.unlink(a)
    _bump_dir(tmp_path)
    st.refresh()
    assert (opened, st.stats["scans"]) == ([b], 3)
    assert sorted((e.path, e.tokens, e.stat_key) for e in st.entries()) == sorted(
        [(b, 11, _stat_key(b)), (c, 12, _stat_key(c))]
    )
    # a hit written into a file changes its stat key: a rescan re-reads it
    opened.clear()
    kvstore._core.touch(c, 1_700_000_000)
    _bump_dir(tmp_path)
    st.refresh()
    assert opened == [c]
    assert {e.path: e.hits for e in st.entries()} == {b: 0, c: 1}
    # a change the directory's mtime does not show is not looked for...
    opened.clear()
    before = os.stat(tmp_path)
    d = write_ck(tmp_path, "d" * 20)
    _pin_dir_mtime(tmp_path, before)
    st.refresh()
    assert (opened, len(st.entries()), st.stats["scans"]) == ([], 2, 4)
    # ...until a forced refresh
    st.refresh(force=True)
    assert (opened, st.stats["scans"]) == ([d], 5)
    assert sorted(e.path for e in st.entries()) == sorted([b, c, d])


def _rejection(p):
    """What the verification pipeline says of ``p`` when indexing it."""
    with pytest.raises(CheckpointError) as ei:
        ds4.open_checkpoint(p, load_payload=False)
    return (p, ei.value.stage, ei.value.code, ei.value.reason)


def test_files_rejected_while_indexing_are_reported_once(eng, tmp_path, write_ck):
    good = write_ck(tmp_path, "a good one " * 3)
    corrupt = os.path.join(tmp_path, "0" * 40 + ".kv")
    with open(corrupt, "wb") as f:
        f.write(b"XYZ\x02" + bytes(200))  # bad magic: corrupt
    folder = os.path.join(tmp_path, "2" * 40 + ".kv")
    os.mkdir(folder)
    link = os.path.join(tmp_path, "3" * 40 + ".kv")
    os.symlink(good, link)
    bad_magic = _rejection(corrupt)
    assert bad_magic[1:3] == ("header", "bad_magic")

    st = KVStore(tmp_path, min_tokens=1)
    # the corrupt file is removed; the directory and the symlink are kept
    assert not os.path.lexists(corrupt)
    assert os.path.isdir(folder) and os.path.islink(link)
    assert [e.path for e in st.entries()] == [good]
    assert (st.stats["removed_corrupt"], st.stats["rejected"]) == (1, 0)
    # reported to the next load (the directory and the link are not files of
    # ours: they are neither removed nor reported)
    rep = RecoveryReport()
    assert try_load_text(st, ds4.Session(eng, ctx=4096), "no stored prefix", report=rep) is None
    assert rep.rejected == [bad_magic]
    # and only once
    rep = RecoveryReport()
    assert try_load_text(st, ds4.Session(eng, ctx=4096), "no stored prefix", report=rep) is None
    assert rep.rejected == []

    # a later format version: incompatible, kept, reported
    future = os.path.join(tmp_path, "1" * 40 + ".kv")
    with open(future, "wb") as f:
        f.write(b"KVC\x09" + bytes(200))
    unsupported = _rejection(future)
    assert unsupported[1:3] == ("header", "unsupported_version")
    _bump_dir(tmp_path)
    rep = RecoveryReport()
    assert try_load_text(st, ds4.Session(eng, ctx=4096), "no stored prefix", report=rep) is None
    assert rep.rejected == [unsupported]
    assert os.path.exists(future) and [e.path for e in st.entries()] == [good]
    assert (st.stats["removed_corrupt"], st.stats["rejected"]) == (1, 0)
    # a load without a report consumes what is pending too
    st.refresh(force=True)  # the incompatible file is read (and rejected) again
    assert try_load_text(st, ds4.Session(eng, ctx=4096), "no stored prefix") is None
    rep = RecoveryReport()
    assert try_load_text(st, ds4.Session(eng, ctx=4096), "no stored prefix", report=rep) is None
    assert rep.rejected == []
    assert os.path.exists(future) and st.stats["removed_corrupt"] == 1


def test_rejections_while_indexing_come_before_the_loads_own(eng, tmp_path, write_ck, save_session):
    s = prefilled(eng, BASE[:60])
    p = save_session(tmp_path, s, abi="another-engine/9")
    st = KVStore(tmp_path, min_tokens=8)
    future = os.path.join(tmp_path, "1" * 40 + ".kv")
    with open(future, "wb") as f:
        f.write(b"KVC\x09" + bytes(200))
    _bump_dir(tmp_path)
    rep = RecoveryReport()
    assert try_load_text(st, ds4.Session(eng, ctx=4096), BASE[:60] + "?", report=rep) is None
    assert _codes(rep) == [(future, "header", "unsupported_version"), (p, "header", "abi_mismatch")]


def test_unreadable_files_are_skipped_and_kept(tmp_path, write_ck, monkeypatch):
    ok = write_ck(tmp_path, "readable " * 3)
    locked = write_ck(tmp_path, "unreadable " * 3)
    gone = write_ck(tmp_path, "vanishing " * 3)
    real_index = kvstore.index_header

    def flaky(idx, path):
        if path == locked:
            raise PermissionError(13, "Permission denied", path)
        if path == gone:
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_index(idx, path)

    monkeypatch.setattr(kvstore, "index_header", flaky)
    st = KVStore(tmp_path, min_tokens=1)
    assert [e.path for e in st.entries()] == [ok]
    assert os.path.exists(locked) and os.path.exists(gone)
    assert st.index.unreported == [] and st.stats["removed_corrupt"] == 0
    # readable again: the next rescan indexes it
    monkeypatch.setattr(kvstore, "index_header", real_index)
    st.refresh(force=True)
    assert sorted(e.path for e in st.entries()) == sorted([ok, locked, gone])


# -- lookup's filters -------------------------------------------------------------------


def test_lookup_filters_and_order(tmp_path, write_ck):
    P = bytes(range(48, 58)) * 10  # "0123456789" * 10: 100 bytes
    p10 = write_ck(tmp_path, P[:10], tokens=8)  # exactly min_tokens
    p20 = write_ck(tmp_path, P[:20], tokens=7)  # below min_tokens
    p30 = write_ck(tmp_path, P[:30], tokens=9, abi="other/2")
    p40 = _put_v1(tmp_path, P[:40], tokens=10)  # v1: no ABI, matches any
    p50 = write_ck(tmp_path, P[:50], tokens=500)
    p100 = write_ck(tmp_path, P, tokens=12)  # exactly the prompt
    write_ck(tmp_path, P + b"and more", tokens=13)  # longer than the prompt
    write_ck(tmp_path, b"9876543210", tokens=50)  # as long as a hit, another text
    st = KVStore(tmp_path, min_tokens=8)

    def paths(*a, **kw):
        return [e.path for e in st.lookup(*a, **kw)]

    assert paths(P) == [p100, p50, p40, p30, p10]
    assert paths(P.decode()) == [p100, p50, p40, p30, p10]
    assert paths(P[:99]) == [p50, p40, p30, p10]
    assert paths(P[:50]) == [p50, p40, p30, p10]
    assert paths(P[:49]) == [p40, p30, p10]
    assert paths(P, abi="t/1") == [p100, p50, p40, p10]
    assert paths(P, abi="other/2") == [p40, p30]
    assert paths(P, abi="nobody/0") == [p40]
    # a checkpoint needs a context longer than its tokens
    assert paths(P, ctx=501) == [p100, p50, p40, p30, p10]
    assert paths(P, ctx=500) == [p100, p40, p30, p10]
    assert paths(P, ctx=10) == [p30, p10]
    assert paths(P, ctx=9) == [p10]
    assert paths(P, abi="t/1", ctx=12) == [p40, p10]
    st.policy = dataclasses.replace(st.policy, min_tokens=10)
    assert paths(P) == [p100, p50, p40]
    st.policy = dataclasses.replace(st.policy, min_tokens=0)
    assert paths(P[:25]) == [p20, p10]
    # nothing short enough, or nothing matching: an empty list
    st.policy = dataclasses.replace(st.policy, min_tokens=8)
    assert st.lookup(P[:9]) == [] and st.lookup(b"") == []
    assert st.lookup(b"x" * 100) == []


# -- a store finds its key taken ---------------------------------------------------------


def _snapshot(p):
    with open(p, "rb") as f:
        return f.read(), os.stat(p).st_ino


def test_store_over_the_same_engines_file_is_a_no_op(eng, tmp_path):
    """'same': the header and text are checked, not the payload (verified
    when loaded): even a damaged payload is not rewritten by a store."""
    st = KVStore(tmp_path, min_tokens=8)
    s = prefilled(eng, BASE[:60])
    p = st.store_live_prefix(s)
    before = _snapshot(p)
    assert st.store_live_prefix(prefilled(eng, BASE[:60])) == p
    assert _snapshot(p) == before
    flip_payload_byte(p, tensor="logits", mask=1)
    damaged = _snapshot(p)
    assert st.store_live_prefix(prefilled(eng, BASE[:60])) == p
    assert _snapshot(p) == damaged
    assert (st.stats["stores"], st.stats["removed_corrupt"]) == (1, 0)


def test_store_over_another_engines_file_keeps_it_and_writes_its_own(eng, tmp_path, save_session):
    """Another model's file of the same text (under an earlier release's
    name, <sha1>.kv): kept untouched, and this engine's goes beside it under
    its own model's name; each model resumes its own."""
    s = prefilled(eng, BASE[:60])
    p = save_session(tmp_path, s, abi="another-engine/9")
    before = _snapshot(p)
    st = KVStore(tmp_path, min_tokens=8)
    mine = stored_path(tmp_path, s.text_bytes(), s.payload_abi)
    assert st.store_live_prefix(s) == mine != p
    assert _snapshot(p) == before
    assert _header(p).abi == "another-engine/9" and _header(mine).abi == s.payload_abi
    assert (st.stats["stores"], st.stats["removed_corrupt"]) == (1, 0)
    assert s.checkpoint_valid
    assert st.store_live_prefix(s) == mine and st.stats["stores"] == 1  # stored once
    # a file under this model's name that records another ABI (renamed by
    # hand): never loaded, kept, and nothing is written over it
    os.unlink(mine)
    os.rename(p, mine)
    st = KVStore(tmp_path, min_tokens=8)
    assert st.store_live_prefix(s) is None
    assert _snapshot(mine) == before
    with pytest.raises(ds4.errors.AbiMismatchError, match="another-engine/9"):
        _header(mine)
    assert st.stats["removed_corrupt"] == 0


def test_store_over_a_corrupt_file_replaces_it(eng, tmp_path):
    s = prefilled(eng, BASE[:60])
    p = stored_path(tmp_path, s.text_bytes(), s.payload_abi)
    st = KVStore(tmp_path, min_tokens=8)
    with open(p, "wb") as f:  # written after the index was built: found by the store itself
        f.write(b"XYZ\x02" + bytes(200))
    assert st.store_live_prefix(s) == p
    h = _header(p)
    assert (h.abi, h.tokens, h.text) == (s.payload_abi, s.n_past, s.text_bytes())
    assert (st.stats["stores"], st.stats["removed_corrupt"]) == (1, 1)
    # the same with a quarantine directory: the corrupt file is moved there
    qd = tmp_path / "q"
    st = KVStore(tmp_path, min_tokens=8, quarantine_dir=qd)
    with open(p, "wb") as f:
        f.write(b"XYZ\x02" + bytes(200))
    assert st.store_live_prefix(s) == p
    [q] = os.listdir(qd)
    assert q.startswith(os.path.basename(p) + ".") and q.endswith(".bad_magic")
    assert Path(qd / q).read_bytes() == b"XYZ\x02" + bytes(200)
    assert _header(p).text == s.text_bytes()
    assert (st.stats["stores"], st.stats["removed_corrupt"]) == (1, 1)


def test_store_under_a_colliding_key_replaces_the_other_text(eng, tmp_path, write_ck):
    """A file named sha1(A) holding text B with sha1(B) == sha1(A) (the
    SHAttered pair): the store's byte check calls it corrupt (a prefix
    collision), removes it and writes A."""
    from test_kvstore import SHATTERED_1, SHATTERED_2

    s = prefilled(eng, BASE[:60])
    s.text_bytes = lambda: SHATTERED_1  # a session whose rendered text is A
    other = write_ck(
        tmp_path, SHATTERED_2, abi=s.payload_abi, tokens=s.n_past, name=stored_name(SHATTERED_1, s.payload_abi)
    )
    st = KVStore(tmp_path, min_tokens=8)
    p = st.store_live_prefix(s)
    assert p == other
    assert _header(p).text == SHATTERED_1
    assert (st.stats["stores"], st.stats["removed_corrupt"]) == (1, 1)
    # now the key holds A: storing A again is a no-op
    assert st.store_live_prefix(s) == p
    assert (st.stats["stores"], st.stats["removed_corrupt"]) == (1, 1)


def test_a_vanished_directory_is_a_store_error(tmp_path):
    d = tmp_path / "cache"
    st = KVStore(d)
    os.rmdir(d)
    with pytest.raises(kvstore.StoreError) as ei:
        st.refresh()
    e = ei.value
    assert (e.errno, e.strerror, e.filename) == (
        errno.ENOENT,
        f"cache directory unavailable: {os.strerror(errno.ENOENT)}",
        str(d),
    )
    assert isinstance(e, OSError) and isinstance(e.__cause__, FileNotFoundError)


def test_a_file_that_turns_bad_leaves_the_index(tmp_path, write_ck):
    keep = write_ck(tmp_path, "kept as it is " * 2)
    a, b = write_ck(tmp_path, "a" * 20), write_ck(tmp_path, "b" * 20)
    st = KVStore(tmp_path, min_tokens=1)
    assert len(st.entries()) == 3
    with open(a, "r+b") as f:  # now of a later format version: incompatible, kept
        f.write(b"KVC\x09")
    os.unlink(b)
    os.symlink(keep, b)  # now a symlink: not ours, ignored
    _bump_dir(tmp_path)
    assert [e.path for e in st.entries()] == [keep]
    assert os.path.exists(a) and os.path.islink(b)
    assert [(p, code) for (p, _s, code, _r) in st.index.unreported] == [(a, "unsupported_version")]


def test_symlink_loops_and_dangling_links_are_ignored(tmp_path, write_ck):
    good = write_ck(tmp_path, "a good one " * 3)
    loop = os.path.join(tmp_path, "4" * 40 + ".kv")
    os.symlink(loop, loop)  # resolving it fails with ELOOP
    dangling = os.path.join(tmp_path, "5" * 40 + ".kv")
    os.symlink(os.path.join(tmp_path, "gone"), dangling)
    st = KVStore(tmp_path, min_tokens=1)
    assert [e.path for e in st.entries()] == [good]
    assert os.path.islink(loop) and os.path.islink(dangling)
    assert st.index.unreported == [] and st.stats["removed_corrupt"] == 0


def test_a_file_removed_between_listing_and_stat_is_skipped(tmp_path, write_ck, monkeypatch):
    """Another process removes a checkpoint after the directory was listed:
    that file is skipped, the others are still indexed."""
    st = KVStore(tmp_path, min_tokens=1)
    files = [write_ck(tmp_path, c * 20) for c in "abc"]
    victim = files[1]
    real_scandir = os.scandir

    class Listing:
        def __init__(self, path):
            self.it = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            entries = sorted(self.it, key=lambda de: de.path != victim)  # the victim first
            yield from entries
            os.unlink(victim)  # listed, then removed before it is looked at

    monkeypatch.setattr(kvstore.os, "scandir", lambda p: Listing(p) if p == st.dir else real_scandir(p))
    st.refresh(force=True)
    monkeypatch.undo()
    assert sorted(e.path for e in st.entries()) == sorted([files[0], files[2]])


def test_a_kept_file_is_reported_once_however_often_the_directory_is_rescanned(tmp_path, write_ck, eng):
    """Another format's file is kept and not indexed; rescans (forced, or
    caused by another file arriving) must not report it again until it
    changes."""
    p = write_ck(tmp_path, "a newer ds4's checkpoint")
    b = bytearray(Path(p).read_bytes())
    b[3] = 9  # format version 9: incompatible, kept
    Path(p).write_bytes(bytes(b))
    store = KVStore(tmp_path, min_tokens=1)
    store.refresh(force=True)
    write_ck(tmp_path, "another file arrives")  # changes the directory: a rescan
    store.refresh()
    s = prefilled(eng, "some live conversation")
    rep = RecoveryReport()
    try_load_text(store, s, "unrelated prompt", report=rep)
    assert [(path, code) for path, _st, code, _r in rep.rejected] == [(p, "unsupported_version")]
    assert os.path.exists(p)
    # a change to the file is news: reported again
    b[200] ^= 1
    Path(p).write_bytes(bytes(b))
    os.utime(p, ns=(1, 1))
    store.refresh(force=True)
    rep2 = RecoveryReport()
    try_load_text(store, s, "unrelated prompt", report=rep2)
    assert [code for _p, _s, code, _r in rep2.rejected] == ["unsupported_version"]
