"""No path the store or the server writes, reads or trims leaves the cache
directory through a link: ``records/`` (the stored Responses) as a symlink,
or swapped for one after the store used it, and ``.ds4.index`` /
``.ds4.index.tmp`` as symlinks, leave every file outside byte-for-byte and
mtime-for-mtime as it was; a symlinked or foreign-owned ``.ds4.lock`` is a
:class:`ds4.errors.StoreError` naming the file, and ``ds4 kv gc`` says so."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys

import openai
import pytest
from helpers.agents import KV_FLAGS, ScriptedServer
from helpers.kv import prefilled

import ds4
from ds4.errors import StoreError
from ds4.kvstore.files import DirLock
from ds4.kvstore.records import RecordStore

OLD = 1_600_000_000  # an old mtime: the records' trim would take such a file first


def _outside(tmp_path):
    """A directory outside the cache holding a sentinel and a file named
    like an old record; returns (dir, snapshot)."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "sentinel").write_bytes(b"not yours\n")
    (out / "response-old.json").write_text('{"v":2,"owner":"","messages":[]}')
    for n in ("sentinel", "response-old.json"):
        os.utime(out / n, (OLD, OLD))
    return out, _snap(out)


def _snap(d) -> dict[str, tuple[bytes, int]]:
    return {n: ((d / n).read_bytes(), os.lstat(d / n).st_mtime_ns) for n in sorted(os.listdir(d))}


def test_a_records_symlink_is_refused_and_nothing_outside_is_read_written_or_trimmed(tmp_path, caplog):
    out, before = _outside(tmp_path)
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    os.symlink(out, kv / "records")
    rs = RecordStore(str(kv), 64)  # a bound so small that any put trims the oldest record
    with caplog.at_level(logging.WARNING, "ds4.kvstore"), pytest.raises(StoreError) as ei:
        rs.put("response", "new", {"x": "y" * 10})
    assert ei.value.errno == errno.ELOOP and "symlink" in str(ei.value) and str(kv / "records") in str(ei.value)
    assert "no record is read or written through it" in caplog.text
    assert rs.get("response", "old") is None  # the file outside is never read
    assert rs.total_bytes() == 0  # nor counted
    with pytest.raises(StoreError):
        rs.delete("response", "old")
    assert _snap(out) == before and os.path.islink(kv / "records")


def test_a_records_link_swapped_in_after_use_is_refused_too(tmp_path):
    out, before = _outside(tmp_path)
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    rs = RecordStore(str(kv), 1 << 16)
    assert rs.put("response", "a", {"x": 1}) and rs.get("response", "a") == {"x": 1}
    os.rename(kv / "records", kv / "records.real")
    os.symlink(out, kv / "records")
    rs.max_bytes = 16  # the next put would trim everything older
    with pytest.raises(StoreError):
        rs.put("response", "b", {"x": 2})
    assert rs.get("response", "a") is None and rs.get("response", "old") is None
    assert _snap(out) == before
    assert (kv / "records.real" / "response-a.json").exists()


def test_a_records_file_is_refused_and_kept(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    (kv / "records").write_bytes(b"mine")
    rs = RecordStore(str(kv), 1 << 16)
    with pytest.raises(StoreError) as ei:
        rs.put("response", "a", {"x": 1})
    assert ei.value.errno == errno.ENOTDIR and (kv / "records").read_bytes() == b"mine"


def test_the_server_answers_and_stores_nothing_through_a_records_link(tmp_path, serve):
    out, before = _outside(tmp_path)
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    os.symlink(out, kv / "records")
    srv = serve("--kv-disk-dir", str(kv), *KV_FLAGS, name="links", cls=ScriptedServer, tmp=tmp_path)
    c = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
    r = c.responses.create(model="m", input="Say something.", max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.output  # answered
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)  # not stored: the records directory is refused
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("old")
    srv.stop()
    assert "records directory is a symlink" in srv.text_log()
    assert _snap(out) == before


def test_the_index_files_are_never_written_through_links(tmp_path, eng):
    out = tmp_path / "outside"
    out.mkdir()
    for n in ("index", "index.tmp"):
        (out / n).write_bytes(b"sentinel " + n.encode())
        os.utime(out / n, (OLD, OLD))
    before = _snap(out)
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    os.symlink(out / "index", kv / ".ds4.index")
    os.symlink(out / "index.tmp", kv / ".ds4.index.tmp")
    st = ds4.KVStore(kv, min_tokens=1)
    sess = prefilled(eng, "alpha beta gamma delta epsilon zeta eta theta " * 4)
    assert st.store_live_prefix(sess) is not None
    assert st.evict_names() == [] and len(st.entries()) == 1
    p = subprocess.run(
        [sys.executable, "-m", "ds4", "kv", "gc", str(kv), "--budget-mb", "0.000001"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert _snap(out) == before
    assert os.path.islink(kv / ".ds4.index") or not os.path.lexists(kv / ".ds4.index")


def _gc(kv, *flags):
    return subprocess.run(
        [sys.executable, "-m", "ds4", "kv", "gc", str(kv), *flags], capture_output=True, text=True, timeout=120
    )


def test_a_symlinked_lock_stops_gc_with_an_error_naming_it(tmp_path, write_ck):
    out, before = _outside(tmp_path)
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    write_ck(kv, "a text to collect " * 4)
    os.symlink(out / "sentinel", kv / ".ds4.lock")
    p = _gc(kv, "--budget-mb", "0.000001")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "lock file: is a symlink (remove it)" in p.stderr and str(kv / ".ds4.lock") in p.stderr
    assert _snap(out) == before


def test_a_lock_owned_by_another_user_is_named_unless_the_directory_is_trusted(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    lock = kv / ".ds4.lock"
    lock.write_bytes(b"")
    other = os.geteuid() + 4242
    if os.geteuid() != 0:
        pytest.fail("this test chowns a file: it runs as root (CI and the dev machines do)")
    os.chown(lock, other, other)
    with pytest.raises(StoreError) as ei, DirLock(str(kv)).held():
        pass
    assert f"owned by uid {other}" in str(ei.value) and str(lock) in str(ei.value) and "--kv-trust-dir" in str(ei.value)
    with DirLock(str(kv), trust_dir=True).held():
        pass
    with pytest.raises(StoreError, match="owned by uid"), ds4.KVStore(kv).locked():
        pass
    # gc cleans a directory it is told to (a server user's): it trusts it, lock included
    assert _gc(kv).returncode == 0


def test_gc_takes_the_lock_first_so_a_bad_lock_stops_it_before_any_change(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    tmp = kv / f".{'ab' * 20}.kv.tmp.999999999.x.0123456789ab"  # an orphaned temp file gc would remove
    tmp.write_bytes(b"partial")
    os.utime(tmp, (OLD, OLD))
    os.mkfifo(kv / ".ds4.lock")
    p = _gc(kv, "--tmp-age", "0")
    assert p.returncode == 1 and "lock file is not a regular file" in p.stderr and str(kv / ".ds4.lock") in p.stderr
    assert tmp.read_bytes() == b"partial"
    os.unlink(kv / ".ds4.lock")
    p = _gc(kv, "--tmp-age", "0")
    assert p.returncode == 0 and "1 temp" in p.stdout and not tmp.exists()
