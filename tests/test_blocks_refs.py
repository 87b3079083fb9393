"""Which manifest names which blocks, kept in ``blocks/.refs``
(``ds4.kvstore.block_refs``): a store that opens the directory again
evicts, and finds the blocks no manifest names, without opening a
manifest whose record still matches its file; a manifest replaced since
(another inode, size or mtime) is read again; a references file that is
damaged, of another shape or not a regular file is no record at all, and
nothing a manifest names is ever removed for it. The reference engine."""

from __future__ import annotations

import json
import os

import pytest
from kv_helpers import prefilled

import ds4
from ds4.kvstore import blocks as kv_blocks
from ds4.kvstore.block_refs import REFS_NAME, read_refs
from ds4.kvstore.blocks import BLOCKS_DIR

BASE = " ".join(f"word{i % 50}" for i in range(300))


def _text(k: int) -> str:
    return BASE + f" task {k}: " + " ".join(f"t{k}x{i}" for i in range(40))


def _store(d) -> ds4.KVStore:
    return ds4.KVStore(str(d), budget_mb=1024, min_tokens=8, frontier_tokens=0, blocks=True, block_tokens=16)


def _blocks(d) -> set[str]:
    return {f[:64] for f in os.listdir(d / BLOCKS_DIR) if f.endswith(".kvb") and not f.startswith(".")}


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
    refs = read_refs(str(d / BLOCKS_DIR))
    assert set(refs) == set(names) and all(len(r[1]) > 0 for r in refs.values())
    before = _blocks(d)
    os.unlink(d / names[2])  # its own blocks are orphans now
    opened.clear()
    st = _store(d)
    assert st.evict() == 0
    assert opened == []  # every remaining manifest's record matched its file
    left = _blocks(d)
    assert left == set(refs[names[0]][1]) | set(refs[names[1]][1]) and left < before
    # and the state still loads whole from what stayed
    s = ds4.Session(eng, ctx=4096)
    rep = ds4.recover(s, st, _text(0), evict_save=False)
    assert rep.rung == "disk" and not rep.rejected
    assert names[2] not in read_refs(str(d / BLOCKS_DIR))  # the file was written again without it


def test_a_manifest_replaced_since_its_record_is_read_again(eng, tmp_path, opened):
    d = tmp_path / "kv"
    names = _three(eng, d)
    os.utime(d / names[1], ns=(1, 1))  # another mtime: the record no longer matches
    opened.clear()
    assert _store(d).evict() == 0
    assert opened == [names[1]]
    assert read_refs(str(d / BLOCKS_DIR))[names[1]][0][2] == 1  # recorded again with its new stat key


@pytest.mark.parametrize("kind", ["garbage", "symlink", "directory", "bad_index", "other_version"])
def test_a_references_file_that_cannot_be_trusted_is_no_record(eng, tmp_path, opened, kind):
    d = tmp_path / "kv"
    names = _three(eng, d)
    p = d / BLOCKS_DIR / REFS_NAME
    good = json.loads(p.read_text())
    named = _blocks(d)
    p.unlink()
    if kind == "garbage":
        p.write_bytes(b"\x00{not json")
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text(json.dumps({**good, "files": {}}))
        p.symlink_to(tmp_path / "elsewhere")
    elif kind == "directory":
        p.mkdir()
    elif kind == "bad_index":
        bad = {**good, "files": {n: [*r[:3], [len(good["blocks"]) + 5]] for n, r in good["files"].items()}}
        p.write_text(json.dumps(bad))
    else:
        p.write_text(json.dumps({**good, "version": 2}))
    assert read_refs(str(d / BLOCKS_DIR)) == {}
    opened.clear()
    st = _store(d)
    assert st.evict() == 0
    assert sorted(opened) == sorted(names)  # each manifest read for its table
    assert _blocks(d) == named  # nothing a manifest names removed
    if kind in ("symlink", "directory"):  # never followed, never replaced
        assert p.is_symlink() if kind == "symlink" else p.is_dir()
        assert json.loads((tmp_path / "elsewhere").read_text())["files"] == {} if kind == "symlink" else True
    else:
        assert set(read_refs(str(d / BLOCKS_DIR))) == set(names)  # written again, whole
