"""Which manifest names which blocks, recorded in the store's index
(``.ds4.index``'s block section): a store that opens the directory again
evicts, and finds the blocks no manifest names, without opening a
manifest whose record still matches its file; a manifest replaced since
(another inode, size or mtime) is read again; an index file that is
damaged or not a regular file is no record at all (rebuilt from the
headers), and nothing a manifest names is ever removed for it. The
reference engine."""

from __future__ import annotations

import os

import pytest
from helpers.kv import prefilled

import ds4
from ds4 import _core
from ds4.kvstore import blocks as kv_blocks
from ds4.kvstore.blocks import BLOCKS_DIR
from ds4.kvstore.files import INDEX_NAME

BASE = " ".join(f"word{i % 50}" for i in range(300))


def _text(k: int) -> str:
    return BASE + f" task {k}: " + " ".join(f"t{k}x{i}" for i in range(40))


def _store(d) -> ds4.KVStore:
    return ds4.KVStore(str(d), budget_mb=1024, min_tokens=8, frontier_tokens=0, blocks=True, block_tokens=16)


def _blocks(d) -> set[str]:
    return {f[:64] for f in os.listdir(d / BLOCKS_DIR) if f.endswith(".kvb") and not f.startswith(".")}


def _recorded(d) -> dict[str, tuple[tuple[int, int, int], set[str]]]:
    """The index file's records that carry blocks: name -> (stat key, blocks)."""
    idx, _ = _core.StoreIndex.load(str(d / INDEX_NAME))
    out = {}
    for row in idx.entries():
        got = idx.blocks_of(row[0])
        if got is not None:
            out[row[0]] = (row[10], {got[i : i + 32].hex() for i in range(0, len(got), 32)})
    return out


@pytest.fixture
def opened(monkeypatch):
    """The manifests the store module opens (their paths)."""
    seen: list[str] = []
    real = kv_blocks.open_checkpoint

    def counting(path, *a, **kw):
        seen.append(os.path.basename(str(path)))
        return real(path, *a, **kw)

    monkeypatch.setattr(kv_blocks, "open_checkpoint", counting)
    return seen


def _three(eng, d) -> list[str]:
    st = _store(d)
    paths = [st.store_live_checked(prefilled(eng, _text(k)), "cold") for k in range(3)]
    assert all(isinstance(p, str) for p in paths)
    return [os.path.basename(p) for p in paths]


def test_a_new_store_evicts_and_finds_orphans_without_opening_a_manifest(eng, tmp_path, opened):
    d = tmp_path / "kv"
    names = _three(eng, d)
    refs = _recorded(d)
    assert set(refs) == set(names) and all(len(r[1]) > 0 for r in refs.values())
    before = _blocks(d)
    assert refs[names[0]][1] & refs[names[1]][1]  # the shared prefix's blocks
    os.unlink(d / names[2])  # its own blocks are orphans now
    opened.clear()
    st = _store(d)
    assert st.evict() == 0
    assert opened == []  # every remaining manifest's record matched its file
    left = _blocks(d)
    assert left == refs[names[0]][1] | refs[names[1]][1] and left < before
    # and the state still loads whole from what stayed
    s = ds4.Session(eng, ctx=4096)
    rep = ds4.recover(s, st, _text(0), evict_save=False)
    assert rep.rung == "disk" and not rep.rejected
    assert set(_recorded(d)) == set(names[:2])  # the index written again without it


def test_a_manifest_replaced_since_its_record_is_read_again(eng, tmp_path, opened):
    d = tmp_path / "kv"
    names = _three(eng, d)
    blocks = _recorded(d)[names[1]][1]
    os.utime(d / names[1], ns=(1, 1))  # another mtime: the record no longer matches
    opened.clear()
    assert _store(d).evict() == 0
    assert opened == [names[1]]
    key, again = _recorded(d)[names[1]]
    assert key[2] == 1 and again == blocks  # recorded again with its new stat key


@pytest.mark.parametrize("kind", ["garbage", "torn", "symlink", "directory"])
def test_an_index_file_that_cannot_be_trusted_is_no_record(eng, tmp_path, opened, kind):
    d = tmp_path / "kv"
    names = _three(eng, d)
    p = d / INDEX_NAME
    good = p.read_bytes()
    named = _blocks(d)
    p.unlink()
    if kind == "garbage":
        p.write_bytes(b"\x00{not an index")
    elif kind == "torn":
        p.write_bytes(good[:-40])  # the block section cut short
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(good)
        p.symlink_to(tmp_path / "elsewhere")
    else:
        p.mkdir()
    opened.clear()
    st = _store(d)
    assert st.evict() == 0
    assert sorted(opened) == sorted(names)  # each manifest read for its table
    assert _blocks(d) == named  # nothing a manifest names removed
    if kind in ("symlink", "directory"):  # never followed, never replaced
        assert p.is_symlink() if kind == "symlink" else p.is_dir()
    else:
        assert set(_recorded(d)) == set(names)  # written again, whole
