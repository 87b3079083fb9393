"""Issue 13, item 4: one discard for every path of the store and the CLI.

Only the version of a file that was judged corrupt leaves (a fresh file put
in its place stays, even when it arrives between the check and the move);
quarantine works across filesystems; entries that are not regular files
(symlinks, FIFOs, directories with a checkpoint's name) are never moved or
deleted, by the store, ``kv gc``, ``kv rm`` or ``ds4 chat``; names resolve
only inside the directory; the lock and the chat index are never opened
through a symlink; the chat index cannot name a file outside the directory.
Interleavings are forced by wrapping the store's own calls, never by timing."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import shutil
import stat
import tempfile
import time

import numpy as np
import pytest
from helpers.procs import ds4_cmd

import ds4
from ds4 import kvstore
from ds4.cli.chat import CHAT_INDEX, ChatREPL, atomic_write_json
from ds4.errors import CorruptCheckpointError, StoreError
from ds4.kvstore import KVStore, remove, stat_key
from ds4.loading import load_named
from ds4.recovery import try_load_text
from ds4.turn import TurnDriver

TEXT = "the quick brown fox jumps over the lazy dog " * 3


def _name(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest() + ".kv"


def _corrupt(path) -> None:
    """Flip one payload byte: the header stays valid, the checksum does not."""
    ck = ds4.open_checkpoint(path, load_payload=False)
    off = ck.payload_offset + 5
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def _judge(path):
    """(stat key before the open, the corrupt verdict), as every caller takes them."""
    key = stat_key(os.lstat(path))
    with pytest.raises(CorruptCheckpointError) as ei:
        ds4.open_checkpoint(path)
    return key, ei.value


def _good_copy(write_ck, tmp_path, text=TEXT) -> str:
    side = tmp_path / "side"
    side.mkdir(exist_ok=True)
    return write_ck(side, text)


def _ls(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n != kvstore.LOCK_NAME)


def _read(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


# -- the judged version only ------------------------------------------------------


def test_discard_leaves_a_fresh_file_that_replaced_the_judged_one(tmp_path, write_ck):
    d = tmp_path / "kv"
    d.mkdir()
    p = write_ck(d, TEXT)
    _corrupt(p)
    key, err = _judge(p)
    os.replace(_good_copy(write_ck, tmp_path), p)  # a writer's rename: a new inode under the name
    store = KVStore(d, scan=False)
    assert store.discard(p, err, "test", key) is None
    ds4.open_checkpoint(p)  # the fresh file is there and verifies
    assert store.stats["removed_corrupt"] == 0
    # the same file, judged as it is now, goes
    _corrupt(p)
    key, err = _judge(p)
    assert store.discard(p, err, "test", key) == p
    assert _ls(d) == []


def test_an_in_place_rewrite_after_the_verdict_is_kept_too(tmp_path, write_ck):
    d = tmp_path / "kv"
    d.mkdir()
    p = write_ck(d, TEXT)
    _corrupt(p)
    key, err = _judge(p)
    with open(_good_copy(write_ck, tmp_path), "rb") as f:  # cp GOOD p: same inode, new bytes
        good = f.read()
    with open(p, "r+b") as f:
        f.write(good)
    os.utime(p, ns=(key[2] + 1_000_000, key[2] + 1_000_000))
    assert KVStore(d, scan=False).discard(p, err, "test", key) is None
    ds4.open_checkpoint(p)


def test_forced_interleaving_during_a_load_keeps_the_fresh_file(tmp_path, monkeypatch):
    """The issue's race: a load judges a file corrupt, a writer renames a
    good file over it, then the store discards. The good file stays and the
    next load uses it."""
    eng = ds4.ReferenceEngine()
    d = tmp_path / "kv"
    store = KVStore(d, min_tokens=1)
    sess = ds4.Session(eng, ctx=512)
    sess.sync(eng.tokenize(TEXT, special=True))
    path = store.store_live_prefix(sess, "cold")
    good = str(tmp_path / "good.kv")
    shutil.copy(path, good)
    _corrupt(path)
    real = kvstore.admission.open_checkpoint  # where a load opens a file

    def racing_open(p, **kw):
        try:
            return real(p, **kw)
        except CorruptCheckpointError:
            os.replace(good, p)  # lands after the verdict, before the discard
            raise

    monkeypatch.setattr(kvstore.admission, "open_checkpoint", racing_open)
    fresh = ds4.Session(eng, ctx=512)
    assert try_load_text(store, fresh, TEXT) is None  # this load saw the corrupt version
    assert not fresh.checkpoint_valid
    monkeypatch.setattr(kvstore.admission, "open_checkpoint", real)
    assert os.path.exists(path)
    store.refresh(force=True)
    res = try_load_text(store, fresh, TEXT)
    assert res is not None and res.path == path and fresh.checkpoint_valid


def test_a_swap_between_the_check_and_the_move_is_put_back(tmp_path, write_ck, monkeypatch):
    """A writer that does not take ds4's lock renames a good file over the
    name after the stat-key check: the entry taken aside is checked again,
    found not to be the judged one, and linked back; nothing is left over."""
    d = tmp_path / "kv"
    d.mkdir()
    p = write_ck(d, TEXT)
    _corrupt(p)
    key, _err = _judge(p)
    good = _good_copy(write_ck, tmp_path)
    real = remove._aside_name

    def swap_then_name(name):
        os.replace(good, p)
        return real(name)

    monkeypatch.setattr(remove, "_aside_name", swap_then_name)
    assert remove.remove_exact(str(d), os.path.basename(p), key) is None
    assert _ls(d) == [os.path.basename(p)]
    ds4.open_checkpoint(p)


def test_eviction_skips_a_victim_replaced_behind_the_index(tmp_path, write_ck):
    d = tmp_path / "kv"
    d.mkdir()
    old = write_ck(d, TEXT, tokens=7, created=1_000)
    store = KVStore(d, budget_mb=1, min_tokens=1)
    [entry] = store.entries()
    os.replace(_good_copy(write_ck, tmp_path), old)
    assert remove.remove_exact(str(d), entry.name, entry.stat_key) is None
    assert os.path.exists(old)


# -- quarantine across filesystems ------------------------------------------------


def test_quarantine_on_another_filesystem_copies_then_unlinks(tmp_path, write_ck):
    """/dev/shm is another filesystem than the test's directory: the rename
    fails with EXDEV and the file is copied (same bytes, mode 0600), synced,
    and removed from the cache directory."""
    d = tmp_path / "kv"
    d.mkdir()
    q = tempfile.mkdtemp(prefix="ds4-quarantine-", dir="/dev/shm")
    try:
        assert os.stat(q).st_dev != os.stat(d).st_dev
        p = write_ck(d, TEXT)
        _corrupt(p)
        with open(p, "rb") as f:
            corrupt_bytes = f.read()
        key, err = _judge(p)
        dest = KVStore(d, quarantine_dir=q, scan=False).discard(p, err, "test", key)
        assert dest is not None and os.path.dirname(dest) == q
        assert os.path.basename(dest).startswith(os.path.basename(p) + ".")
        assert dest.endswith("." + err.code)
        with open(dest, "rb") as f:
            assert f.read() == corrupt_bytes
        assert stat.S_IMODE(os.stat(dest).st_mode) == 0o600
        assert _ls(d) == []
    finally:
        shutil.rmtree(q)


def test_quarantine_that_cannot_be_written_still_removes_the_file(tmp_path, write_ck, monkeypatch):
    d = tmp_path / "kv"
    d.mkdir()
    q = tmp_path / "q"
    p = write_ck(d, TEXT)
    _corrupt(p)
    key, err = _judge(p)
    real_rename = os.rename

    def exdev_into_q(src, dst, *a, **kw):
        if os.fspath(dst).startswith(os.fspath(q)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst, *a, **kw)

    def full(src, dest):
        with open(dest, "wb") as f:
            f.write(b"partial")
        os.unlink(dest)  # what _copy_durably does on its way out
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "rename", exdev_into_q)
    monkeypatch.setattr(remove, "_copy_durably", full)
    assert KVStore(d, quarantine_dir=q, scan=False).discard(p, err, "test", key) == p
    assert _ls(d) == [] and os.listdir(q) == []


# -- entries that are not regular files -------------------------------------------


def _hostile_dir(tmp_path, write_ck):
    """A directory of entries with checkpoint and temp names that are not
    regular files, pointing at files outside it; returns (dir, what each
    entry is, the outside files and their bytes)."""
    d = tmp_path / "kv"
    d.mkdir()
    out = tmp_path / "outside"
    out.mkdir()
    good_out = write_ck(out, "a good file outside " * 4)
    bad_out = write_ck(out, "a bad file outside " * 4)
    _corrupt(bad_out)
    entries = {
        _name("a good file outside " * 4): "symlink",
        _name("a bad file outside " * 4): "symlink",
        _name("fifo"): "fifo",
        _name("directory"): "dir",
        _name("dangling"): "symlink",
        ("ab" * 20) + ".kv.tmp.1.dead": "dir",
        ("cd" * 20) + ".kv.tmp.XyZ123": "fifo",
        ("ef" * 20) + ".kv.tmp.2": "symlink",
    }
    for n, kind in entries.items():
        p = d / n
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
            (p / "inside").write_bytes(b"x")
        elif n == _name("dangling"):
            os.symlink(tmp_path / "nowhere", p)
        elif ".tmp." in n:
            os.symlink(good_out, p)
        else:
            os.symlink(out / n, p)
    old = time.time() - 10 * 3600
    for n in entries:
        os.utime(d / n, (old, old), follow_symlinks=False)
    # one real checkpoint beside them (with the tokens tensor a load checks)
    write_ck(d, TEXT, {"tokens": np.arange(7, dtype=np.int32), "logits": np.zeros(4, np.float32)})
    snap = {p: _read(p) for p in (good_out, bad_out)}
    return d, entries, snap


def _unchanged(d, entries, snap):
    for n, kind in entries.items():
        st = os.lstat(d / n)
        want = {"fifo": stat.S_ISFIFO, "dir": stat.S_ISDIR, "symlink": stat.S_ISLNK}[kind]
        assert want(st.st_mode), (n, kind)
        if kind == "dir":
            assert (d / n / "inside").read_bytes() == b"x"
    for p, b in snap.items():
        assert _read(p) == b


def test_the_store_never_moves_or_deletes_a_non_regular_entry(tmp_path, write_ck):
    d, entries, snap = _hostile_dir(tmp_path, write_ck)
    q = tmp_path / "q"
    store = KVStore(d, min_tokens=1, quarantine_dir=q)  # indexing: ignored
    assert [e.name for e in store.entries()] == [_name(TEXT)]
    store.policy = dataclasses.replace(
        store.policy, budget_mb=(1) / 2**20
    )  # the eviction below would take everything it may
    err = CorruptCheckpointError("forced verdict")
    for n in entries:
        assert store.discard(str(d / n), err, "test", None) is None
        if n.endswith(".kv"):
            assert store.remove(n) is False
    store.evict()
    eng = ds4.ReferenceEngine()
    sess = ds4.Session(eng, ctx=512)
    for n in entries:  # a chat's named load of each: kept, the session not trusted
        if n.endswith(".kv"):
            assert load_named(store, sess, n[:40], b"").status == "unusable", n
    _unchanged(d, entries, snap)
    assert not q.exists()


def test_kv_gc_and_rm_ignore_non_regular_entries(tmp_path, write_ck):
    d, entries, snap = _hostile_dir(tmp_path, write_ck)
    q = tmp_path / "q"
    real_bytes = os.path.getsize(d / _name(TEXT))
    p = ds4_cmd(
        "kv", "gc", d, "--budget-mb", "0.000001", "--tmp-age", "0", "--quarantine-dir", q, "--json", check=False
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["removed_corrupt"] == [] and out["removed_temp"] == [] and out["quarantined"] == []
    assert {k["name"] for k in out["kept_unusable"]} == {n for n in entries if n.endswith(".kv")}
    assert out["bytes_before"] == real_bytes  # a symlink's target is not counted
    p = ds4_cmd("kv", "rm", d, "--all", check=False)
    assert p.returncode != 0 and "not a regular file" in p.stderr
    _unchanged(d, entries, snap)
    assert not (d / _name(TEXT)).exists()  # the one regular file: gc evicted it (or rm removed it)


# -- names resolve inside the directory -------------------------------------------


def test_kv_rm_never_touches_a_path_outside_the_directory(tmp_path, write_ck):
    d = tmp_path / "kv"
    d.mkdir()
    o = tmp_path / "elsewhere"
    o.mkdir()
    inside = write_ck(d, TEXT)
    twin = write_ck(o, TEXT)  # same name, outside
    other = write_ck(o, "another text entirely " * 3)
    for target in (twin, other, "../elsewhere/" + os.path.basename(other)):
        p = ds4_cmd("kv", "rm", d, target, check=False)
        assert p.returncode != 0 and "is not in" in p.stderr, (target, p.stderr)
    assert os.path.exists(inside) and os.path.exists(twin) and os.path.exists(other)
    # the store's own remove reduces a path to its name: DIR's file, never the outside one
    assert KVStore(d, scan=False).remove(twin) is True
    assert not os.path.exists(inside) and os.path.exists(twin)
    inside = write_ck(d, TEXT)
    p = ds4_cmd("kv", "rm", d, inside, check=False)  # a path inside the directory is fine
    assert p.returncode == 0 and not os.path.exists(inside)


# -- no symlink is followed when a file is created or read --------------------------


def test_a_symlinked_lock_file_is_refused_and_its_target_never_created(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    target = tmp_path / "victim"
    os.symlink(target, d / kvstore.LOCK_NAME)
    store = KVStore(d)
    with pytest.raises(StoreError, match="symlink"), store.locked():
        pass
    assert not target.exists()
    os.unlink(d / kvstore.LOCK_NAME)
    os.mkfifo(d / kvstore.LOCK_NAME)
    with pytest.raises(StoreError, match="not a regular file"), store.locked():
        pass


def _repl(d):
    eng = ds4.ReferenceEngine()
    store = KVStore(d, min_tokens=1)
    err = io.StringIO()
    return ChatREPL(TurnDriver(eng, 1024, store), "Be brief.", 8, out=io.StringIO(), err=err), err


def test_the_chat_index_is_never_read_or_written_through_a_symlink(tmp_path):
    d = tmp_path / "kv"
    repl, err = _repl(d)
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({"sessions": {"x": {"sha": "ab" * 20, "messages": []}}}))
    os.symlink(planted, d / CHAT_INDEX)
    assert repl.load_index() == {}
    assert "cannot read" in err.getvalue()
    atomic_write_json(repl.index_path, {"version": 1, "sessions": {}})
    assert not os.path.islink(d / CHAT_INDEX)  # the link was replaced, never written through
    assert json.loads(planted.read_text())["sessions"]["x"]["sha"] == "ab" * 20
    assert stat.S_IMODE(os.stat(d / CHAT_INDEX).st_mode) == 0o600
    assert _ls(d) == [CHAT_INDEX]  # no temp file left


def test_a_crafted_chat_index_cannot_reach_outside_the_directory(tmp_path, write_ck):
    d = tmp_path / "kv"
    repl, err = _repl(d)
    victim = write_ck(tmp_path, TEXT)  # a checkpoint outside the directory, corrupt
    _corrupt(victim)
    victim_bytes = _read(victim)
    sha = os.path.basename(victim)[:40]
    os.symlink(victim, d / f"{sha}.kv")  # and a link to it under a valid name
    msgs = [{"role": "user", "content": "hi"}]
    sessions = {
        "traversal": {"sha": f"../{sha}", "messages": msgs},
        "absolute": {"sha": victim[:-3], "messages": msgs},
        "not-a-str": {"sha": ["x"], "messages": msgs},
        "link": {"sha": sha, "messages": msgs},
    }
    atomic_write_json(repl.index_path, {"version": 1, "sessions": sessions})
    for name in ("traversal", "absolute", "not-a-str"):
        repl.cmd_switch(name)
        assert f"[switched to {name}: its index entry names no valid checkpoint" in err.getvalue()
        assert not repl.sess.checkpoint_valid
    repl.cmd_switch("link")
    assert "checkpoint unusable (not_regular_file)" in err.getvalue()
    assert _read(victim) == victim_bytes and os.path.islink(d / f"{sha}.kv")
    with pytest.raises(ValueError):
        load_named(repl.store, repl.sess, f"../{sha}", b"")


def test_kv_verify_counts_ignored_entries_apart_from_failures(tmp_path, write_ck):
    """Symlinks, FIFOs and directories under checkpoint names are ignored by
    the store: ``kv verify`` reports them as ignored, not as failures, and
    exits 0 when every real checkpoint verifies."""
    d, entries, snap = _hostile_dir(tmp_path, write_ck)
    p = ds4_cmd("kv", "verify", d, "--json", check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    kv_entries = {n for n in entries if n.endswith(".kv")}
    assert out["ok"] == 1 and out["failed"] == 0 and out["ignored"] == len(kv_entries)
    assert {f["name"] for f in out["files"] if f.get("status") == "ignored"} == kv_entries
    text = ds4_cmd("kv", "verify", d, check=False).stdout
    assert f"1 ok, 0 failed, {len(kv_entries)} ignored" in text and "FAIL" not in text
    _corrupt(d / _name(TEXT))
    assert ds4_cmd("kv", "verify", d, check=False).returncode == 1  # a real failure still fails
    _unchanged(d, entries, snap)


def test_the_store_names_its_files(tmp_path):
    """``KVStore.path_for``: a key's file for a model (``<sha>-<tag>.kv``)
    or an earlier release's (``<sha>.kv``), always inside the directory; a
    key that is not 40 hex digits is refused. ``find_named``
    prefers the model's own file to an earlier release's."""
    st = KVStore(tmp_path)
    sha, abi = "ab" * 20, "llama.cpp:model-a"
    own, legacy = st.path_for(sha, abi), st.path_for(sha)
    assert own == os.path.join(st.dir, kvstore.checkpoint_name(sha, abi)) and own != legacy
    assert legacy == os.path.join(st.dir, sha + ".kv")
    assert st.path_for(sha, "llama.cpp:model-b") != own  # another model, another name
    for bad in ("ab" * 19, "ab" * 21, "xy" * 20, "../" + "a" * 37, "a" * 39 + "/", ""):
        with pytest.raises(ValueError):
            st.path_for(bad, abi)
    assert st.find_named(sha, abi) is None
    open(legacy, "wb").close()
    assert st.find_named(sha, abi) == legacy
    open(own, "wb").close()
    assert st.find_named(sha, abi) == own
