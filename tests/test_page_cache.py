"""Page-cache hygiene (issue 23, item 6): a checkpoint, once written
durably (fsynced), leaves the page cache (``posix_fadvise(DONTNEED)`` on
its range, rust/format/writer.rs), so that hundreds of saves do not push
out the pages other processes use. ``mincore`` (tests/helpers/page_cache.py) sees
the page cache: a file written the same way without the hint stays
resident, which is what makes the assertions about the hint mean
something on this filesystem."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.kv import BASE, prefilled
from helpers.page_cache import resident_bytes

import ds4
from ds4.checkpoint import open_checkpoint, write_checkpoint
from ds4.kvstore import KVStore

MIB = 2**20


def _write(path, **kw):
    state = np.arange(4 * MIB // 4, dtype=np.int32)  # 4 MiB of payload
    text = "a page-cache prompt"
    name = os.path.join(path, ds4._core.sha1_hex(text.encode()) + ".kv")
    write_checkpoint(name, text, {"state": state}, abi="test/page-cache", tokens=3, ctx=64, **kw)
    return name


def test_a_plain_durable_write_stays_in_the_page_cache(tmp_path):
    # the control: what mincore shows of a file written and fsynced without the hint
    p = tmp_path / "plain"
    with open(p, "wb") as f:
        f.write(os.urandom(4 * MIB))
        f.flush()
        os.fsync(f.fileno())
    assert resident_bytes(p) >= 3 * MIB


@pytest.mark.parametrize("auth", [False, True])
def test_a_written_checkpoint_leaves_the_page_cache(tmp_path, auth):
    key = ds4._core.derive_auth_key(b"page cache") if auth else None
    (tmp_path / "kept").mkdir()
    kept = _write(tmp_path / "kept", drop_cache=False, auth_key=key)
    assert resident_bytes(kept) >= 3 * MIB  # the same write without the hint: resident
    dropped = _write(tmp_path, auth_key=key)
    assert os.path.getsize(dropped) > 4 * MIB
    assert resident_bytes(dropped) == 0
    ck = open_checkpoint(dropped, auth_key=key)  # and it reads back whole, from the disk
    assert np.array_equal(ck.array("state"), np.arange(4 * MIB // 4, dtype=np.int32))
    assert resident_bytes(dropped) > 0  # the load brought its pages back


def test_a_store_save_leaves_the_page_cache(tmp_path, eng):
    st = KVStore(tmp_path / "kv", min_tokens=1)
    try:
        path = st.store_live_prefix(prefilled(eng, BASE * 20, 4096), "cold")
        assert path is not None
        size = os.path.getsize(path)
        assert size > 512 * 1024
        # what stays is the store's read-back of the header (and the kernel's readahead)
        assert resident_bytes(path) <= size // 16
    finally:
        st.close()
