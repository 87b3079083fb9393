"""KVStore at its edges: what one load does (LoadResult, the hit written into
the file, the counters), the options that reach the verification pipeline,
corrupt files removed or quarantined, stale index entries, temp-file
orphan detection per writer, and the policy helpers at their boundaries.

Time is pinned by replacing the module's clock, never by sleeping."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
import types

import pytest

import ds4
from ds4 import kvstore
from ds4.kvstore import Entry, KVStore, LoadResult, temp_is_orphaned, temp_writer_pid
from ds4.recovery import RecoveryReport

SHA = "ab" * 20
BASE = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "


@pytest.fixture(scope="module")
def eng():
    return ds4.ReferenceEngine()


def _sess(eng, text, ctx=4096):
    s = ds4.Session(eng, ctx=ctx)
    s.sync(eng.tokenize(text, special=True))
    return s


def _clock(monkeypatch, t):
    """Pin ``time.time()`` as the store sees it."""
    monkeypatch.setattr(kvstore, "time", types.SimpleNamespace(time=lambda: t, perf_counter=time.perf_counter))


def _header(path):
    return ds4.open_checkpoint(path, load_payload=False)


def _flip_payload_byte(path):
    """Flip the lowest mantissa bit of the first logit: the value stays
    finite and plausible, only the payload checksum notices."""
    ck = ds4.open_checkpoint(path, load_payload=False)
    [off] = [o for (name, _dt, _shape, o, _n) in ck.tensor_table() if name == "logits"]
    off += ck.payload_offset
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))


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


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


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
    # a dead writer's file is orphaned at once, in every naming scheme that has a pid
    dead = _dead_pid()
    for n in (f".{SHA}.kv.tmp.{dead}.9f8e", f"{SHA}.kv.tmp.{dead}"):
        assert temp_is_orphaned(n, 1000.0, 1000.0) is True
    # this process's own temp files are live while young
    assert temp_is_orphaned(f".{SHA}.kv.tmp.{os.getpid()}.9f8e", 1000.0, 1000.0) is False


def test_probing_a_live_writer_sends_it_no_signal():
    """The liveness probe is signal 0: a live writer is neither disturbed nor
    judged orphaned while its file is young."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        now = time.time()
        for n in (f".{SHA}.kv.tmp.{child.pid}.9f8e", f"{SHA}.kv.tmp.{child.pid}"):
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
    assert not os.path.lexists(link) and not os.path.lexists(dangling)
    assert target.read_bytes() == b"user data"  # the link went, not what it points to


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
    s = _sess(eng, text)
    p = st.store_live_prefix(s)
    n, nb = s.n_past, len(s.text_bytes())
    assert nb == len(text.encode("utf-8")) != len(text)
    T = 1_800_000_000
    _clock(monkeypatch, T)
    prompt = text + "and then a question"

    s2 = ds4.Session(eng, ctx=4096)
    r = st.try_load_text(s2, prompt)  # str prompts are encoded as UTF-8
    assert r == LoadResult(path=p, tokens=n, text_bytes=nb)
    assert s2.checkpoint_valid and s2.n_past == n
    h = _header(p)
    assert (h.hits, h.last_used) == (1, T)  # the hit is written into the file
    [e] = st.entries()
    assert (e.hits, e.last_used) == (1, T)  # and into the index entry

    # the index entry is current: a forced rescan re-reads nothing
    opened = []
    real_open = kvstore.open_checkpoint
    monkeypatch.setattr(kvstore, "open_checkpoint", lambda path, **kw: (opened.append(path), real_open(path, **kw))[1])
    st.refresh(force=True)
    assert opened == []
    monkeypatch.setattr(kvstore, "open_checkpoint", real_open)

    _clock(monkeypatch, T + 60)
    r = st.try_load_text(ds4.Session(eng, ctx=4096), prompt.encode("utf-8"))
    assert r == LoadResult(path=p, tokens=n, text_bytes=nb)
    h = _header(p)
    assert (h.hits, h.last_used) == (2, T + 60)

    for _ in range(2):
        sx = _sess(eng, "something else", ctx=4096)
        assert st.try_load_text(sx, "nothing stored starts like this one") is None
        assert sx.checkpoint_valid  # a miss leaves the session alone
    assert (st.stats["hits"], st.stats["misses"], st.stats["rejected"], st.stats["removed_corrupt"]) == (2, 2, 0, 0)


def test_consume_over_cold_max(eng, tmp_path):
    """With consume_over_cold_max, a load of a checkpoint longer than
    cold_max_tokens records no hit (it is consumed); a cold_max of 0 means
    no limit; the option off, every load records its hit."""
    text = BASE[:60]
    s = _sess(eng, text)
    p = KVStore(tmp_path, min_tokens=8).store_live_prefix(s)
    n = s.n_past
    cases = [
        (False, 8, True),
        (True, 8, False),
        (True, 0, True),
        (True, 1, False),
        (True, n - 1, False),
        (True, n, True),  # exactly at the limit is not over it
    ]
    for consume, cold_max, recorded in cases:
        st = KVStore(tmp_path, min_tokens=8, cold_max_tokens=cold_max, consume_over_cold_max=consume)
        before = _header(p).hits
        r = st.try_load_text(ds4.Session(eng, ctx=4096), text + "?")
        assert r is not None and r.tokens == n
        assert st.stats["hits"] == 1
        assert _header(p).hits == before + (1 if recorded else 0), (consume, cold_max)


def test_corrupt_candidates_are_quarantined(eng, tmp_path, monkeypatch):
    d, qd = tmp_path / "cache", tmp_path / "quarantine"
    st = KVStore(d, min_tokens=8, quarantine_dir=qd)
    paths = [st.store_live_prefix(_sess(eng, BASE[:k])) for k in (30, 60)]
    for p in paths:
        _flip_payload_byte(p)
    T = 1_750_000_123
    _clock(monkeypatch, T)
    sess = _sess(eng, "a live session, soon invalid")
    rep = RecoveryReport()
    old = os.umask(0o022)
    try:
        assert st.try_load_text(sess, BASE[:60] + "?", report=rep) is None
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
    short, long_ = (st.store_live_prefix(_sess(eng, BASE[:k])) for k in (30, 60))
    _flip_payload_byte(long_)
    rep = RecoveryReport()
    sess = ds4.Session(eng, ctx=4096)
    r = st.try_load_text(sess, BASE[:60] + "?", report=rep)
    assert r is not None and r.path == short and sess.checkpoint_valid
    assert _codes(rep) == [(long_, "payload", "payload_checksum")]
    assert not os.path.exists(long_)
    assert st.total_bytes() == os.path.getsize(short)
    assert (st.stats["rejected"], st.stats["removed_corrupt"], st.stats["hits"], st.stats["misses"]) == (1, 1, 1, 0)


def test_foreign_abi_file_is_kept_even_with_a_damaged_payload(eng, tmp_path):
    """ABI is checked at the header, before the payload: another engine's
    file is skipped and kept, never judged (or removed) by our checksum pass."""
    paths = []
    for k in (30, 60):
        s = _sess(eng, BASE[:k])
        p = os.path.join(tmp_path, hashlib.sha1(s.text_bytes()).hexdigest() + ".kv")
        ds4.write_checkpoint(p, s.text_bytes(), s.export_arrays(), abi="another-engine/9", tokens=s.n_past, ctx=s.ctx)
        _flip_payload_byte(p)
        paths.append(p)
    st = KVStore(tmp_path, min_tokens=8)
    rep = RecoveryReport()
    sess = _sess(eng, "live")
    assert st.try_load_text(sess, BASE[:60] + "?", report=rep) is None
    assert _codes(rep) == [(p, "header", "abi_mismatch") for p in paths[::-1]]
    assert all(os.path.exists(p) for p in paths)
    assert (st.stats["rejected"], st.stats["removed_corrupt"], st.stats["misses"]) == (2, 0, 1)
    assert len(st.entries()) == 2


def test_engine_quant_bits_reach_the_check(eng, tmp_path):
    qeng = ds4.ReferenceEngine()
    qeng.quant_bits = 4  # an engine that declares its quantization
    text = BASE[:60]
    st = KVStore(tmp_path, min_tokens=8)
    p = st.store_live_prefix(_sess(qeng, text))
    assert _header(p).quant_bits == 4
    rep = RecoveryReport()
    r = st.try_load_text(ds4.Session(qeng, ctx=4096), text + "?", report=rep)
    assert r is not None and r.path == p and rep.rejected == []
    # the plain engine (no quant_bits: 0) refuses it, and keeps it
    assert st.try_load_text(ds4.Session(eng, ctx=4096), text + "?", report=rep) is None
    assert _codes(rep) == [(p, "header", "quant_mismatch")] and os.path.exists(p)


def test_checksum_and_mmap_options_reach_the_load(eng, tmp_path):
    class Recording(ds4.Session):
        def load_checkpoint(self, ck):
            self.mapped = ck.mapped
            super().load_checkpoint(ck)

    text = BASE[:60]
    p = KVStore(tmp_path, min_tokens=8).store_live_prefix(_sess(eng, text))
    for mm in (True, False):
        s = Recording(eng, ctx=4096)
        assert KVStore(tmp_path, min_tokens=8, mmap=mm).try_load_text(s, text + "?") is not None
        assert s.mapped is mm
    # with verify_checksum=False a flipped payload bit is not looked for
    _flip_payload_byte(p)
    st = KVStore(tmp_path, min_tokens=8, verify_checksum=False)
    r = st.try_load_text(ds4.Session(eng, ctx=4096), text + "?")
    assert r is not None and r.path == p and os.path.exists(p)
    assert st.stats["removed_corrupt"] == 0


def test_session_context_bounds_the_candidates(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    s_short, s_long = _sess(eng, BASE[:30]), _sess(eng, BASE[:60])
    short, long_ = st.store_live_prefix(s_short), st.store_live_prefix(s_long)
    n_short, n_long = s_short.n_past, s_long.n_past
    # n_long tokens need a context of n_long + 1: exactly that fits
    rep = RecoveryReport()
    r = st.try_load_text(ds4.Session(eng, ctx=n_long + 1), BASE[:60] + "?", report=rep)
    assert r is not None and (r.path, r.tokens) == (long_, n_long) and rep.rejected == []
    # one less: the longer file is not even a candidate (not a rejection)
    rep = RecoveryReport()
    r = st.try_load_text(ds4.Session(eng, ctx=n_long), BASE[:60] + "?", report=rep)
    assert r is not None and (r.path, r.tokens) == (short, n_short)
    assert rep.rejected == [] and st.stats["rejected"] == 0


def _pin_dir_mtime(d, before):
    """Put the directory's mtime back: what another process's change looks
    like when it lands within the filesystem's timestamp granularity."""
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_stale_index_entry_is_rechecked_against_the_context(eng, tmp_path):
    """The index said 8 tokens; the file now holds more than the session's
    context (rewritten behind the index's back): the load's own header check
    rejects it as incompatible instead of handing it to the session."""
    text = BASE[:60]
    s = _sess(eng, text)
    n = s.n_past
    p = os.path.join(tmp_path, hashlib.sha1(s.text_bytes()).hexdigest() + ".kv")
    honest = os.path.join(tmp_path, "honest.bin")
    ds4.write_checkpoint(honest, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=n, ctx=s.ctx)
    ds4.write_checkpoint(p, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=8, ctx=s.ctx)
    data = open(honest, "rb").read()
    os.unlink(honest)
    st = KVStore(tmp_path, min_tokens=8)
    assert [e.tokens for e in st.entries()] == [8]
    before = os.stat(tmp_path)
    with open(p, "r+b") as f:
        f.write(data)
        f.truncate()
    _pin_dir_mtime(tmp_path, before)
    rep = RecoveryReport()
    sess = ds4.Session(eng, ctx=n)
    assert st.try_load_text(sess, text + "?", report=rep) is None
    assert _codes(rep) == [(p, "header", "ctx_too_small")]
    assert os.path.exists(p) and st.stats["rejected"] == 1


def test_candidate_removed_behind_the_index_falls_back(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    short, long_ = (st.store_live_prefix(_sess(eng, BASE[:k])) for k in (30, 60))
    st.refresh(force=True)
    before = os.stat(tmp_path)
    os.unlink(long_)  # another process removed it...
    _pin_dir_mtime(tmp_path, before)  # ...and the index cannot tell
    assert len(st.lookup(BASE[:60] + "?")) == 2
    rep = RecoveryReport()
    r = st.try_load_text(ds4.Session(eng, ctx=4096), BASE[:60] + "?", report=rep)
    assert r is not None and r.path == short
    assert rep.rejected == [] and st.stats["rejected"] == 0 and st.stats["hits"] == 1
    assert [e.path for e in st.entries()] == [short]  # the vanished file left the index


# -- store policy helpers --------------------------------------------------------------


def test_cold_store_len_boundaries(tmp_path):
    st = KVStore(tmp_path, min_tokens=512, boundary_trim_tokens=0)
    assert st.cold_store_len(511) is None
    assert st.cold_store_len(512) == 512  # exactly the minimum is enough
    st = KVStore(tmp_path)  # trim 32, align 2048, min 512
    assert st.cold_store_len(544) == 512  # trimmed to exactly the minimum
    assert st.cold_store_len(543) is None
    st = KVStore(tmp_path, min_tokens=2048)
    assert st.cold_store_len(2048 + 32 + 100) == 2048  # aligned down to exactly the minimum
    assert st.cold_store_len(2048 + 31) is None
    st = KVStore(tmp_path, boundary_align_tokens=0)  # no alignment: trim only
    assert st.cold_store_len(1000) == 968
    assert st.cold_store_len(5000) == 4968
    st = KVStore(tmp_path, boundary_align_tokens=1)
    assert st.cold_store_len(5000) == 4968


def test_continued_step_boundaries(tmp_path):
    assert KVStore(tmp_path, continued_interval_tokens=10240).continued_step() == 10240  # already aligned
    assert KVStore(tmp_path, continued_interval_tokens=10241).continued_step() == 12288
    assert KVStore(tmp_path, continued_interval_tokens=10239).continued_step() == 10240
    assert KVStore(tmp_path, continued_interval_tokens=10001, boundary_align_tokens=0).continued_step() == 10001
    assert KVStore(tmp_path, continued_interval_tokens=10001, boundary_align_tokens=1).continued_step() == 10001
