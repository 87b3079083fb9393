"""Shared blocks (``ds4.blocks``, ``ds4.kvstore.blocks``; docs/DESIGN.md,
"Blocks") on the reference engine: a state split into blocks and joined
back byte for byte; a store with ``blocks=True`` writing each block once
across a conversation's saves and across conversations of one prefix; a
load that equals a cold prefill; every damaged or missing block refused
before the session is touched (typed, stage ``block``), the block removed,
the ladder going on to what is left; and eviction that never removes a
block a kept manifest names, while orphans go."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.kv import prefilled, toks
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4
from ds4 import _core, blocks
from ds4.errors import BlockError
from ds4.kvstore.blocks import BLOCKS_DIR, MANIFEST_FLAG

B = 16  # tokens per block in these tests (the reference engine's granule is 1)


def _text(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    return " ".join(words[i] for i in rng.integers(0, len(words), n_words))


def _store(path, **kw) -> ds4.KVStore:
    kw.setdefault("min_tokens", 8)
    return ds4.KVStore(str(path), blocks=True, block_tokens=B, **kw)


def _block_files(store: ds4.KVStore) -> list[str]:
    d = os.path.join(store.dir, BLOCKS_DIR)
    return sorted(f for f in os.listdir(d) if f.endswith(".kvb")) if os.path.isdir(d) else []


def _resumed(store: ds4.KVStore, eng, text: str) -> tuple[ds4.Session, ds4.RecoveryReport]:
    s = ds4.Session(eng, ctx=4096)
    return s, ds4.recover(s, store, text, evict_save=False)


def _equal_cold(eng, sess: ds4.Session, text: str) -> None:
    cold = prefilled(eng, text)
    assert sess.tokens == cold.tokens
    assert np.array_equal(sess.logits, cold.logits)
    assert sess.generate(12) == cold.generate(12)


# -- split and join ----------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), block=st.integers(1, 80))
def test_split_then_join_gives_back_every_byte(eng, n, block):
    s = prefilled(eng, _text(400, seed=n))
    s.rewind(min(n, s.n_past))
    arrays = s.export_arrays()
    n = s.n_past
    layout = eng.block_layout(n)
    parts, residue = blocks.split(arrays, layout, n, block)
    assert len(parts) == n // block
    assert all(p.nbytes == blocks.block_bytes(layout, block) for p in parts)
    joined = blocks.join(residue, np.concatenate(parts) if parts else b"", layout, n, block)
    assert joined.keys() == arrays.keys()
    for k, a in arrays.items():
        assert joined[k].dtype == a.dtype and np.array_equal(joined[k], a), k


def test_a_blocks_bytes_do_not_depend_on_how_the_prompt_was_split(eng):
    ids = toks(eng, _text(200, seed=3))
    whole = ds4.Session(eng, ctx=4096)
    whole.sync(ids)
    pieces = ds4.Session(eng, ctx=4096)
    for cut in (37, 90, 91, 150, len(ids)):
        pieces.sync(ids[:cut])
    n = len(ids)
    layout = eng.block_layout(n)
    a, _ = blocks.split(whole.export_arrays(), layout, n, B)
    b, _ = blocks.split(pieces.export_arrays(), layout, n, B)
    assert len(a) == n // B and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_join_refuses_sizes_that_do_not_add_up(eng):
    s = prefilled(eng, _text(100))
    n = s.n_past
    layout = eng.block_layout(n)
    parts, residue = blocks.split(s.export_arrays(), layout, n, B)
    with pytest.raises(ds4.errors.EngineStateError):
        blocks.join(residue, np.concatenate(parts)[:-1], layout, n, B)
    name = next(iter(layout))
    short = {**residue, name: residue[name][:-4]}
    with pytest.raises(ds4.errors.EngineStateError):
        blocks.join(short, np.concatenate(parts), layout, n, B)


# -- the store ---------------------------------------------------------------
def _conversation(eng, turns: int, seed: int = 0) -> list[str]:
    """The prompts of a conversation whose every turn extends the last."""
    out, text = [], _text(60, seed=seed)
    for t in range(turns):
        text += " " + _text(25 + 7 * t, seed=seed * 100 + t)
        out.append(text)
    return out


def test_a_conversation_saved_each_turn_writes_each_block_once(eng, tmp_path):
    store = _store(tmp_path / "kv")
    sess = ds4.Session(eng, ctx=4096)
    for prompt in _conversation(eng, 10):
        sess.sync(toks(eng, prompt))
        assert isinstance(store.store_live_checked(sess, "continued"), str)
    n = sess.n_past
    per_block = blocks.block_bytes(eng.block_layout(n), B)
    files = _block_files(store)
    assert len(files) == n // B  # every block of the last state, each written once
    assert store.blocks.counts["written"] == n // B
    assert store.blocks.counts["bytes_written"] == sum(
        os.path.getsize(os.path.join(store.blocks.dir, f)) for f in files
    )
    assert all(os.path.getsize(os.path.join(store.blocks.dir, f)) - per_block in (128, 160) for f in files)
    for e in store.entries():
        assert ds4.open_checkpoint(e.path, load_payload=False).flags & MANIFEST_FLAG
    # a new process's store: the last manifest loads, and equals a cold prefill
    again = _store(tmp_path / "kv")
    s, rep = _resumed(again, eng, prompt + " next")
    assert rep.rung == "disk" and rep.reused_tokens == n
    _equal_cold(eng, s, prompt + " next")


def test_conversations_of_one_prefix_share_its_blocks(eng, tmp_path):
    store = _store(tmp_path / "kv")
    system = _text(300, seed=9)
    a = system + " first task " + _text(40, seed=1)
    b = system + " second task " + _text(40, seed=2)
    for text in (a, b):
        assert isinstance(store.store_live_checked(prefilled(eng, text), "cold"), str)
    ta, tb = toks(eng, a), toks(eng, b)
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y) // B
    assert store.blocks.counts["present"] >= shared > 0
    assert len(_block_files(store)) == len(toks(eng, a)) // B + len(toks(eng, b)) // B - store.blocks.counts["present"]
    for text in (a, b):
        s, rep = _resumed(_store(tmp_path / "kv"), eng, text)
        assert rep.rung == "disk" and rep.reused_tokens == len(toks(eng, text))
        _equal_cold(eng, s, text)


def test_tenants_never_share_a_block(eng, tmp_path):
    store = _store(tmp_path / "kv")
    text = _text(120, seed=4)
    for ns in (None, "tenant-a"):
        s = ds4.Session(eng, ctx=4096)
        s.set_namespace(ns)
        s.sync(toks(eng, text))
        assert isinstance(store.store_live_checked(s, "cold"), str)
    assert store.blocks.counts["present"] == 0
    assert len(_block_files(store)) == 2 * (len(toks(eng, text)) // B)


def _two_saved(eng, tmp_path):
    """A store with two manifests of one prefix (sharing its blocks) and a
    shorter single checkpoint of the prefix's start (what the ladder can
    still fall back to)."""
    store = _store(tmp_path / "kv")
    base = _text(200, seed=5)
    short = prefilled(eng, base[:60])
    plain = ds4.KVStore(str(tmp_path / "kv"), min_tokens=8)
    assert isinstance(plain.store_live_checked(short, "cold"), str)
    texts = [base + " one", base + " two"]
    for t in texts:
        assert isinstance(store.store_live_checked(prefilled(eng, t), "cold"), str)
    return store, texts


def _corrupt(path: str, how: str) -> None:
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 7)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) - 3)
    elif how == "remove":
        os.unlink(path)
    elif how == "header":
        with open(path, "r+b") as f:
            f.seek(41)
            f.write(b"\x7f")


@pytest.mark.parametrize(
    ("how", "code"),
    [("flip", "block_checksum"), ("truncate", "block_short"), ("remove", "block_missing"), ("header", "block_corrupt")],
)
def test_a_damaged_shared_block_refuses_both_manifests_and_the_ladder_goes_on(eng, tmp_path, how, code):
    store, texts = _two_saved(eng, tmp_path)
    victim = _block_files(store)[0]  # block 0: named by both manifests
    _corrupt(os.path.join(store.blocks.dir, victim), how)
    for t in texts:
        s, rep = _resumed(_store(tmp_path / "kv"), eng, t)
        _equal_cold(eng, s, t)  # from the short single checkpoint, or cold: never a wrong state
        assert rep.rung != "disk" or rep.reused_tokens < len(toks(eng, t)) - 4
    codes = {(r.stage, r.code) for r in rep.rejected}
    # the first load met the damage (removed it); the second met a missing block
    assert ("block", "block_missing") in codes or ("block", code) in codes
    assert not os.path.exists(os.path.join(store.blocks.dir, victim))
    assert len(store.entries()) >= 3  # the manifests are kept: a save of the same tokens makes them whole


def test_a_missing_block_is_written_again_and_the_manifest_loads_again(eng, tmp_path):
    store, texts = _two_saved(eng, tmp_path)
    victim = _block_files(store)[0]
    os.unlink(os.path.join(store.blocks.dir, victim))
    s, rep = _resumed(_store(tmp_path / "kv"), eng, texts[0])
    assert any(r.code == "block_missing" for r in rep.rejected)
    fresh = _store(tmp_path / "kv")
    assert isinstance(fresh.store_live_checked(prefilled(eng, texts[0] + " more"), "cold"), str)
    assert victim in _block_files(fresh)
    s, rep = _resumed(_store(tmp_path / "kv"), eng, texts[1])
    assert rep.rung == "disk" and rep.reused_tokens == len(toks(eng, texts[1])) and not rep.rejected
    _equal_cold(eng, s, texts[1])


def test_a_block_renamed_to_another_blocks_name_is_refused(eng, tmp_path):
    store, texts = _two_saved(eng, tmp_path)
    files = _block_files(store)
    a, b = (os.path.join(store.blocks.dir, f) for f in files[:2])
    os.replace(b, a)  # b's bytes under a's name
    s, rep = _resumed(_store(tmp_path / "kv"), eng, texts[0])
    assert any((r.stage, r.code) == ("block", "block_name") for r in rep.rejected)
    _equal_cold(eng, s, texts[0])


def test_a_manifest_whose_table_does_not_name_its_tokens_blocks_is_corrupt(eng, tmp_path):
    store, _texts = _two_saved(eng, tmp_path)
    e = next(e for e in store.entries() if ds4.open_checkpoint(e.path, load_payload=False).flags & MANIFEST_FLAG)
    ck = ds4.open_checkpoint(e.path)
    arrays = {k: np.array(v) for k, v in ck.arrays().items()}
    block, recs = _core.read_block_table(arrays["ds4.blocks"])
    recs[0], recs[1] = recs[1], recs[0]
    arrays["ds4.blocks"] = np.frombuffer(_core.block_table(block, recs), np.uint8)
    ds4.write_checkpoint(e.path, bytes(ck.text), arrays, abi=ck.abi, tokens=ck.tokens, ctx=ck.ctx, flags=MANIFEST_FLAG)
    s = ds4.Session(eng, ctx=4096)
    with pytest.raises(BlockError) as ei:
        _store(tmp_path / "kv").blocks.assemble(ds4.open_checkpoint(e.path), eng)
    assert ei.value.code == "block_table" and ei.value.stage == "payload"
    rep = ds4.recover(s, _store(tmp_path / "kv"), bytes(ck.text).decode(), evict_save=False)
    assert any(r.code == "block_table" for r in rep.rejected)
    assert not os.path.exists(e.path)  # the manifest itself was damaged: removed


def test_with_a_key_a_block_without_its_mac_is_refused_and_rewritten(eng, tmp_path):
    key = _core.derive_auth_key(b"secret")
    plain = _store(tmp_path / "kv")
    text = _text(150, seed=6)
    assert isinstance(plain.store_live_checked(prefilled(eng, text), "cold"), str)
    keyed = _store(tmp_path / "kv", auth_key=key)
    s, rep = _resumed(keyed, eng, text)  # the manifest has no MAC: refused as such, before any block
    assert rep.rung != "disk" or rep.reused_tokens < len(toks(eng, text))
    assert isinstance(keyed.store_live_checked(prefilled(eng, text), "cold"), str)
    for f in _block_files(keyed):
        assert _core.read_block_header(os.path.join(keyed.blocks.dir, f))["authenticated"]
    s, rep = _resumed(_store(tmp_path / "kv", auth_key=key), eng, text)
    assert rep.rung == "disk" and rep.reused_tokens == len(toks(eng, text))
    _equal_cold(eng, s, text)


def test_eviction_keeps_every_block_a_kept_manifest_names_and_removes_orphans(eng, tmp_path):
    store = _store(tmp_path / "kv")
    base = _text(250, seed=7)
    for i in range(4):
        assert isinstance(store.store_live_checked(prefilled(eng, base + f" branch {i} " + _text(30, i)), "cold"), str)
    orphan = os.path.join(store.blocks.dir, "ab" * 32 + ".kvb")
    with open(orphan, "wb") as f:
        f.write(b"left by a crashed save")
    total = store.total_bytes() - len(b"left by a crashed save")
    # a budget one byte short: one manifest and its own blocks go, the shared prefix's blocks stay
    small = _store(tmp_path / "kv", budget_mb=(total - 1) / 2**20)
    small.evict()
    kept = small.entries()
    assert len(kept) == 3
    assert small.total_bytes() <= small.budget_bytes
    assert not os.path.exists(orphan)
    for e in kept:  # every kept manifest still loads whole
        text = bytes(ds4.open_checkpoint(e.path, load_payload=False).text).decode()
        s, rep = _resumed(_store(tmp_path / "kv"), eng, text)
        assert rep.rung == "disk" and rep.reused_tokens == len(toks(eng, text)) and not rep.rejected
        _equal_cold(eng, s, text)


def test_blocks_off_writes_single_files(eng, tmp_path):
    store = ds4.KVStore(str(tmp_path / "kv"), min_tokens=8)
    text = _text(150)
    assert isinstance(store.store_live_checked(prefilled(eng, text), "cold"), str)
    assert _block_files(store) == []
    (e,) = store.entries()
    assert not ds4.open_checkpoint(e.path, load_payload=False).flags & MANIFEST_FLAG


# -- the joined state's buffer ------------------------------------------------
def test_a_joined_states_buffer_is_lent_again_only_when_no_one_holds_it(eng, tmp_path):
    spare = blocks.Spare()
    held = spare.take(1000)
    other = spare.take(800)  # the first is still held: a buffer of its own
    assert not np.shares_memory(held, other)
    del held
    again = spare.take(500)  # the kept one (the last made) is held by ``other``: a new one
    assert not np.shares_memory(again, other)
    addr = again.ctypes.data
    del again, other
    assert spare.take(400).ctypes.data == addr  # nothing holds it now: lent again

    # two loads in a row in one process: the second reuses the first's buffer (the engine copied
    # the state), and neither session's state is the other's
    st = _store(tmp_path)
    x, y = _text(260, seed=21), _text(180, seed=22)
    for t in (x, y):
        st.store_live_prefix(prefilled(eng, t), "cold")
    sx, rx = _resumed(st, eng, x + " more")
    assert rx.rung == "disk"
    first = blocks.SPARE.buf.ctypes.data
    sy, ry = _resumed(st, eng, y + " more")
    assert ry.rung == "disk"
    assert blocks.SPARE.buf.ctypes.data == first
    _equal_cold(eng, sx, x + " more")
    _equal_cold(eng, sy, y + " more")
