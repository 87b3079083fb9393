"""KVStore policy: index, lookup, eviction, temp cleanup, shared directories,
hostile and failing directories."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.kv import prefilled

import ds4
from ds4 import _core
from ds4.errors import InvalidSessionError, StoreError
from ds4.kvstore import Candidates, KVStore, StorePolicy
from ds4.kvstore.files import pid_space
from ds4.recovery import load_first, try_load_text


def test_ds4_defaults(tmp_path):
    p = StorePolicy()
    assert (
        p.budget_mb,
        p.min_tokens,
        p.cold_max_tokens,
        p.continued_interval_tokens,
        p.boundary_trim_tokens,
        p.boundary_align_tokens,
    ) == (4096, 512, 30000, 10000, 32, 2048)
    assert KVStore(tmp_path).policy == p  # a store without knobs has ds4's
    st = KVStore(tmp_path, 64, policy=dataclasses.replace(p, min_tokens=8), min_tokens=16)
    assert (st.budget_bytes, st.min_tokens) == (64 * 2**20, 16)  # keywords on top of the policy


def test_cold_store_len_policy(tmp_path):
    st = KVStore(tmp_path)
    assert st.policy.cold_store_len(100) is None  # below min
    assert st.policy.cold_store_len(5000) == 4096  # trim 32, align down 2048
    assert st.policy.cold_store_len(2080) == 2048
    # ds4 would fall back to the full length here, losing the trim
    assert st.policy.cold_store_len(1000) == 968
    assert st.policy.cold_store_len(540) is None  # 540-32 < 512
    assert st.continued_step() == 10240


def test_store_requires_valid_session_and_min_tokens(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=50)
    s = ds4.Session(eng, ctx=512)
    with pytest.raises(InvalidSessionError):
        st.store_live_prefix(s)
    s.sync(eng.tokenize("too short", special=True))
    assert st.store_live_prefix(s) is None
    assert [f for f in os.listdir(tmp_path) if f.endswith(".kv")] == []


def test_store_and_lookup_longest_first(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    base = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 3
    paths = []
    for n in (20, 60, 120):
        s = prefilled(eng, base[:n])
        paths.append(st.store_live_prefix(s, "cold"))
    for p in paths:
        assert os.stat(p).st_mode & 0o777 == 0o600
    hits = st.lookup(base + " and more")
    assert [e.text_bytes for e in hits] == [120, 60, 20]
    assert st.lookup("unrelated prompt text that matches nothing") == []
    # storing the same state again is a no-op
    s = prefilled(eng, base[:60])
    assert st.store_live_prefix(s, "cold") == paths[1]
    assert st.stats["stores"] == 3


def test_index_is_kept_and_notices_other_processes(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    s = prefilled(eng, "one two three four five six seven")
    st.store_live_prefix(s)
    scans = st.stats["scans"]
    for _ in range(5):
        st.lookup("one two three four five six seven eight")
    assert st.stats["scans"] == scans  # no rescan while the directory is unchanged
    other = KVStore(tmp_path, min_tokens=8)  # "another process"
    s2 = prefilled(eng, "nine ten eleven twelve thirteen")
    other.store_live_prefix(s2)
    time.sleep(0.01)
    assert [e.text_bytes for e in st.lookup("nine ten eleven twelve thirteen fourteen")] == [
        len("nine ten eleven twelve thirteen")
    ]
    other.remove(os.path.basename(st.lookup("nine ten eleven twelve thirteen fourteen")[0].path))
    assert st.lookup("nine ten eleven twelve thirteen fourteen") == []


def test_eviction_policy(eng, tmp_path):
    # ds4's score alone: no fresh guard (every file here was written just now)
    st = KVStore(tmp_path, budget_mb=100, min_tokens=8, fresh_guard_s=0)
    texts = [f"conversation number {i} " * 12 for i in range(4)]
    paths = [st.store_live_prefix(prefilled(eng, t)) for t in texts]
    size = os.path.getsize(paths[0])
    # give entry 1 hits so it scores higher than 0 and 2
    for _ in range(3):
        _core.touch(paths[1], int(time.time()))
    st.refresh(force=True)
    st.policy = dataclasses.replace(st.policy, budget_mb=(int(size * 2.5)) / 2**20)  # room for two files
    removed = st.evict()
    assert removed == 2
    left = sorted(os.listdir(tmp_path))
    assert os.path.basename(paths[1]) in left  # most hits
    assert os.path.basename(paths[3]) in left  # lowest score among the rest is older
    # newest file protected even when over budget with it alone
    st.policy = dataclasses.replace(st.policy, budget_mb=(size // 2) / 2**20)
    p = st.store_live_prefix(prefilled(eng, "the newest one " * 12))
    assert p is None  # estimated size exceeds the whole budget: declined up front
    st.policy = dataclasses.replace(st.policy, budget_mb=(int(size * 1.2)) / 2**20)
    p = st.store_live_prefix(prefilled(eng, "the newest one " * 12))
    assert os.path.exists(p)
    assert [f for f in os.listdir(tmp_path) if f.endswith(".kv")] == [os.path.basename(p)]


def test_score_formula():
    e = ds4.kvstore.Entry(
        "x",
        "x",
        2,
        tokens=1000,
        text_bytes=10,
        hits=4,
        created=0,
        last_used=1000,
        size=500,
        abi="",
        reason="cold",
        ctx=0,
        stat_key=(),
    )
    now = 1000 + 6 * 3600  # one half-life later
    assert e.score(now) == pytest.approx((4 * 0.5 + 1) * 1000 / 500)


def test_orphaned_temp_files_and_corrupt_files_are_cleaned(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    p = st.store_live_prefix(prefilled(eng, "a checkpoint to keep around"))
    name = os.path.basename(p)
    # a temp file of a dead writer, and one of a live writer (this process)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f".{name}.tmp.{dead_pid}.{pid_space()}.abc123"
    orphan.write_bytes(b"partial")
    mine = tmp_path / f".{name}.tmp.{os.getpid()}.{pid_space()}.def456"
    mine.write_bytes(b"in progress")
    corrupt = tmp_path / ("0" * 40 + ".kv")
    corrupt.write_bytes(b"KVC\x02garbage")
    KVStore(tmp_path, min_tokens=8)
    assert not orphan.exists()
    assert mine.exists()
    assert not corrupt.exists()
    assert (tmp_path / name).exists()


def test_hostile_directory_entries(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    good = st.store_live_prefix(prefilled(eng, "a perfectly good checkpoint"))
    # a directory, a symlink and a FIFO with checkpoint names; a file not named like one
    os.mkdir(tmp_path / ("1" * 40 + ".kv"))
    os.symlink(good, tmp_path / ("2" * 40 + ".kv"))
    os.mkfifo(tmp_path / ("3" * 40 + ".kv"))
    (tmp_path / "notes.txt").write_text("hello")
    st2 = KVStore(tmp_path, min_tokens=8)
    assert [e.path for e in st2.entries()] == [good]
    # nothing of the user's was deleted
    assert (tmp_path / ("1" * 40 + ".kv")).is_dir()
    assert (tmp_path / ("2" * 40 + ".kv")).is_symlink()
    assert (tmp_path / "notes.txt").exists()
    with pytest.raises(StoreError):
        KVStore(tmp_path / "notes.txt")


def _unwritable_child(d, q):
    import ds4 as _ds4

    # everything imported and built first: the other user cannot read root's
    # Python installation, so nothing may be imported after the switch
    eng = _ds4.ReferenceEngine()
    s = _ds4.Session(eng, ctx=512)
    s.sync(eng.tokenize("this will not be stored " * 4, special=True))
    os.setgid(65534)
    os.setuid(65534)
    try:
        st = KVStore(d, min_tokens=8, trust_dir=True)  # root's directory: trusted, so the write itself is what fails
        st.store_live_prefix(s)
        q.put("stored?!")
    except StoreError as e:
        q.put(f"StoreError {type(e).__name__} {s.checkpoint_valid}")
    except BaseException as e:  # pragma: no cover - reported to the parent
        q.put(f"other {type(e).__name__}: {e}")


def test_unwritable_directory_gives_store_error(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o755)  # owned by root; the child runs as nobody
    os.chmod(tmp_path, 0o755)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_unwritable_child, args=(str(d), q))
    p.start()
    p.join(60)
    msg = q.get(timeout=5)
    assert msg.startswith("StoreError") and msg.endswith("True"), msg  # session stays valid
    assert os.listdir(d) == []


FULL_DISK_CHILD = r"""
import json, os, resource, signal, sys
import ds4
from ds4.errors import StoreError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
d = sys.argv[1]
eng = ds4.ReferenceEngine()
st = ds4.KVStore(d, min_tokens=8)
s = ds4.Session(eng, ctx=2048)
s.sync(eng.tokenize("small one " * 10, special=True))
first = st.store_live_prefix(s)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # the "disk" is now full
s.sync(eng.tokenize("a much longer conversation " * 60, special=True))
try:
    st.store_live_prefix(s)
    out = {"error": None}
except StoreError as e:
    out = {"error": type(e).__name__, "errno": e.errno}
out["valid"] = s.checkpoint_valid
out["first"] = first
print(json.dumps(out))
"""


def test_full_disk_gives_typed_error_and_loses_nothing(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] in ("StoreError", "StoreFullError"), out
    assert out["valid"] is True
    files = os.listdir(tmp_path)
    assert [f for f in files if ".tmp." in f] == []  # no half-written file
    assert os.path.basename(out["first"]) in files
    ds4.open_checkpoint(out["first"])  # the earlier checkpoint is intact


def _worker(d, i, n, q):
    import ds4 as _ds4

    eng = _ds4.ReferenceEngine()
    st = _ds4.KVStore(d, budget_mb=1, min_tokens=8)
    errors = []
    for j in range(n):
        s = _ds4.Session(eng, ctx=1024)
        text = f"worker {i} conversation {j} " * 8
        s.sync(eng.tokenize(text, special=True))
        try:
            st.store_live_prefix(s)
            s2 = _ds4.Session(eng, ctx=1024)
            _ds4.recover(s2, st, text + " next turn")
            if not s2.checkpoint_valid:
                errors.append("invalid after recover")
        except Exception as e:  # pragma: no cover - reported
            errors.append(repr(e))
    q.put(errors)


def test_processes_share_a_directory(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), i, 8, q)) for i in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    assert results == [[], [], []]
    files = [f for f in os.listdir(tmp_path) if f.endswith(".kv")]
    assert [f for f in os.listdir(tmp_path) if ".tmp." in f] == []
    total = sum(os.path.getsize(tmp_path / f) for f in files)
    assert total <= 1024 * 1024 * 1.01 + max(os.path.getsize(tmp_path / f) for f in files)
    for f in files:
        ds4.open_checkpoint(tmp_path / f)  # every surviving file verifies


def test_quarantine_dir(eng, tmp_path):
    d, qd = tmp_path / "c", tmp_path / "q"
    st = KVStore(d, min_tokens=8, quarantine_dir=qd)
    text = "quarantine this checkpoint please " * 2
    p = st.store_live_prefix(prefilled(eng, text))
    b = bytearray(Path(p).read_bytes())
    b[-3] ^= 1
    Path(p).write_bytes(b)
    s = ds4.Session(eng, ctx=1024)
    rep = ds4.recover(s, st, text + "!")
    assert rep.rung == "prefill" and rep.rejected[0][2] == "payload_checksum"
    assert not os.path.exists(p)
    assert len(os.listdir(qd)) == 1 and os.listdir(qd)[0].endswith(".payload_checksum")


def test_ds4_server_and_agent_temp_files_are_cleaned_too(tmp_path):
    """ds4-server leaves `<sha>.kv.tmp.<pid>` and ds4-agent `<sha>.kv.tmp.XXXXXX`
    (mkstemp) behind when they crash: an hour of age removes them. Their pid
    is not asked about: the writer may live in another PID namespace (a
    ds4-server in another container sharing the directory), where a pid
    that is dead here is alive; its save in flight must not be lost."""
    dead = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    server_tmp = tmp_path / ("a" * 40 + f".kv.tmp.{dead}")
    server_tmp.write_bytes(b"x")
    agent_tmp = tmp_path / ("b" * 40 + ".kv.tmp.Xy12Zq")
    agent_tmp.write_bytes(b"x")
    fresh_agent_tmp = tmp_path / ("c" * 40 + ".kv.tmp.Ab34Cd")
    fresh_agent_tmp.write_bytes(b"x")
    old = time.time() - 2 * 3600
    os.utime(agent_tmp, (old, old))
    fresh_server_tmp = tmp_path / ("d" * 40 + f".kv.tmp.{dead}")
    fresh_server_tmp.write_bytes(b"x")
    old = time.time() - 2 * 3600
    os.utime(server_tmp, (old, old))
    KVStore(tmp_path)
    assert not server_tmp.exists() and not agent_tmp.exists()
    assert fresh_agent_tmp.exists()  # no pid, young: may still be written
    assert fresh_server_tmp.exists()  # a pid dead here, young: may be written in another container


def test_reject_different_quant(eng, tmp_path):
    """A checkpoint of another quantization is skipped and kept when the store
    rejects other quantizations, and used when it does not."""
    text = "quantized elsewhere, same engine otherwise " * 2
    s = prefilled(eng, text)
    p = tmp_path / (_core.sha1_hex(s.text_bytes()) + ".kv")
    ds4.write_checkpoint(
        p, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=s.n_past, ctx=s.ctx, quant_bits=4
    )
    s2 = ds4.Session(eng, ctx=4096)
    rep = ds4.recover(s2, KVStore(tmp_path, min_tokens=8, reject_different_quant=True), text + "?")
    assert rep.rung == "prefill" and [r[2] for r in rep.rejected] == ["quant_mismatch"] and p.exists()
    s3 = ds4.Session(eng, ctx=4096)
    rep = ds4.recover(s3, KVStore(tmp_path, min_tokens=8, reject_different_quant=False), text + "?")
    assert rep.rung == "disk"


# The SHAttered identical-prefix SHA-1 collision (Stevens et al., 2017), the
# pair rust/tests/errors_text.rs uses: two different 320-byte messages with the
# same SHA-1 (and the same internal state, so any common suffix keeps them
# colliding).
SHATTERED_PREFIX = bytes.fromhex(
    "255044462d312e330a25e2e3cfd30a0a0a312030206f626a0a3c3c2f57696474682032203020522f4865696768742033203020522f547970652034203020522f537562747970652035203020522f46696c7465722036203020522f436f6c6f7253706163652037203020522f4c656e6774682038203020522f42697473506572436f6d706f6e656e7420383e3e0a73747265616d0affd8fffe00245348412d3120697320646561642121212121852fec092339759c39b1a1c63c4c97e1fffe01"
)
SHATTERED_1 = SHATTERED_PREFIX + bytes.fromhex(
    "7f46dc93a6b67e013b029aaa1db2560b45ca67d688c7f84b8c4c791fe02b3df614f86db1690901c56b45c1530afedfb76038e972722fe7ad728f0e4904e046c230570fe9d41398abe12ef5bc942be33542a4802d98b5d70f2a332ec37fac3514e74ddc0f2cc1a874cd0c78305a21566461309789606bd0bf3f98cda8044629a1"
)
SHATTERED_2 = SHATTERED_PREFIX + bytes.fromhex(
    "7346dc9166b67e118f029ab621b2560ff9ca67cca8c7f85ba84c79030c2b3de218f86db3a90901d5df45c14f26fedfb3dc38e96ac22fe7bd728f0e45bce046d23c570feb141398bb552ef5a0a82be331fea48037b8b5d71f0e332edf93ac3500eb4ddc0decc1a864790c782c76215660dd309791d06bd0af3f98cda4bc4629b1"
)


def test_real_sha1_collision_is_caught_by_the_byte_prefix_check(eng, tmp_path, write_ck):
    """A checkpoint of text A (named sha1(A)) and a prompt starting with B,
    where sha1(A) == sha1(B) but A != B: the hash-only index lookup picks the
    file, and the byte-prefix check rejects it with PrefixCollisionError --
    through ds4.open_checkpoint and through the store's load."""
    import hashlib

    from ds4.errors import CorruptCheckpointError, PrefixCollisionError
    from ds4.recovery import RecoveryReport

    a, b = SHATTERED_1, SHATTERED_2
    assert len(a) == len(b) == 320 and a != b
    assert hashlib.sha1(a).digest() == hashlib.sha1(b).digest() == bytes.fromhex(_core.sha1_hex(b))
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    prompt = b + b" and the rest of the prompt"
    honest = a + b" and the rest of the prompt"
    sess = ds4.Session(eng, ctx=4096)
    path = write_ck(tmp_path, a, abi=sess.payload_abi, tokens=320, quant_bits=getattr(eng, "quant_bits", 0))
    assert os.path.basename(path) == hashlib.sha1(b).hexdigest() + ".kv"

    # directly
    for mmap in (True, False):
        with pytest.raises(PrefixCollisionError) as ei:
            ds4.open_checkpoint(path, prompt=prompt, mmap=mmap)
        e = ei.value
        assert isinstance(e, CorruptCheckpointError)
        assert (e.code, e.stage, e.path) == ("prefix_collision", "text", path)
        assert ds4.open_checkpoint(path, prompt=honest, mmap=mmap).text == a
    assert ds4.open_checkpoint(path, prompt=a).text == a

    # through the store: the lookup's tail filter already tells the two
    # texts apart (they differ in their last 8 bytes), so the colliding
    # prompt finds nothing and the honest file stays...
    store = KVStore(tmp_path, min_tokens=16)
    assert a[-8:] != b[-8:]
    assert store.lookup(prompt) == []
    [entry] = store.lookup(honest)
    assert entry.path == path
    assert try_load_text(store, sess, prompt) is None and os.path.exists(path)
    # ...and when a candidate does collide (the index is only a proposal),
    # the load refuses the bytes
    rep = RecoveryReport()
    assert load_first(store, sess, Candidates(prompt, [entry], []), report=rep) is None
    assert [(p, s, c) for (p, s, c, _r) in rep.rejected] == [(path, "text", "prefix_collision")], rep.rejected
    assert f"differ at {first_diff}" in rep.rejected[0][3], rep.rejected
    assert not sess.checkpoint_valid and store.stats["hits"] == 0 and store.stats["rejected"] == 1


def test_eviction_ranks_every_models_files_by_one_score(eng, tmp_path):
    # two models' checkpoints of the same three texts in one directory: the
    # budget evicts by ds4's score alone, whichever model a file belongs to,
    # in the order it would if every file were one model's
    other = ds4.ReferenceEngine(seed=1)
    assert other.payload_abi() != eng.payload_abi()
    st = KVStore(tmp_path, budget_mb=100, min_tokens=8, fresh_guard_s=0)
    texts = [f"conversation number {i} " * 12 for i in range(3)]
    paths = {
        (m, i): st.store_live_prefix(prefilled(e, t))
        for i, t in enumerate(texts)
        for m, e in (("a", eng), ("b", other))
    }
    assert len({os.path.basename(p) for p in paths.values()}) == 6
    for key, n in ((("b", 0), 3), (("a", 1), 2), (("a", 2), 1)):
        for _ in range(n):
            _core.touch(paths[key], int(time.time()))
    st.refresh(force=True)
    size = max(os.path.getsize(p) for p in paths.values())
    st.policy = dataclasses.replace(st.policy, budget_mb=int(size * 3.5) / 2**20)  # room for three files
    as_one = [dataclasses.replace(e, abi="one model") for e in st.entries()]
    expected = [e.name for e in st.plan_evict(as_one)]
    assert st.evict_names() == expected
    # the files nobody hit went, two of them B's and one A's
    assert sorted(expected) == sorted(os.path.basename(paths[k]) for k in (("a", 0), ("b", 1), ("b", 2)))
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".kv")) == sorted(
        os.path.basename(paths[k]) for k in (("b", 0), ("a", 1), ("a", 2))
    )
