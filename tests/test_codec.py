"""The payload codec (docs/FORMAT.md §1.10, issue 23 item 5) through the
store, the ladder, the CLI and the shared tier: a store with ``codec="zstd"``
writes v3 files; a session resumed from one equals a cold prefill; a
damaged compressed file is rejected with its typed error, removed, and the
ladder falls back to the next checkpoint; ``ds4 kv show``/``verify`` and
``ds4 run --kv-codec zstd`` handle v3; the Redis tier moves the stored
(compressed) bytes."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from helpers.kv import BASE, prefilled

import ds4
from ds4.checkpoint import open_checkpoint
from ds4.config import add_kv_args, check_kv_args, make_store
from ds4.errors import BadFrameError, FrameTableError, MacMismatchError, PayloadChecksumError, UnsupportedCodecError
from ds4.kvstore import KVStore, StorePolicy

CTX = 4096


def _store(tmp_path, **kw):
    kw.setdefault("min_tokens", 8)
    return KVStore(tmp_path, codec="zstd", **kw)


def _reseal(path, edit=None):
    """Apply ``edit(bytearray)`` to the file, then recompute the payload
    checksum over the stored bytes and the header checksum (FORMAT.md §1.3,
    §1.10) with the C reference XXH3: a damage that only the frames' own
    checks can find."""
    ck = open_checkpoint(path, load_payload=False)
    off = ck.payload_offset
    b = bytearray(Path(path).read_bytes())
    if edit is not None:
        edit(b, ck)
    meta_len = struct.unpack_from("<I", b, 20)[0]
    end = off + struct.unpack_from("<Q", b, 40)[0]  # the stored frames (a MAC may follow)
    struct.pack_into("<Q", b, 80, xxhash.xxh3_64_intdigest(bytes(b[off:end])))
    fixed = bytearray(b[:96])
    for lo, hi in ((12, 16), (32, 40), (88, 96)):
        fixed[lo:hi] = bytes(hi - lo)
    struct.pack_into("<Q", b, 88, xxhash.xxh3_64_intdigest(bytes(fixed) + bytes(b[96 : 96 + meta_len])))
    Path(path).write_bytes(bytes(b))


def _flip_stored(b, ck):
    b[ck.payload_offset + ck.payload_bytes // 2] ^= 0x40


def test_policy_and_flags_choose_the_codec(tmp_path):
    assert StorePolicy().codec == "none" and StorePolicy().codec_level == 1  # the default: v2, zero-copy
    with pytest.raises(ValueError, match="codec"):
        StorePolicy(codec="lz4")
    with pytest.raises(ValueError, match="codec_level"):
        StorePolicy(codec="zstd", codec_level=0)
    p = argparse.ArgumentParser()
    add_kv_args(p)
    args = p.parse_args(["--kv-disk-dir", str(tmp_path), "--kv-codec", "zstd", "--kv-codec-level", "3"])
    assert check_kv_args(args) is None
    st = make_store(args)
    assert (st.policy.codec, st.policy.codec_level) == ("zstd", 3)
    st.close()
    assert make_store(p.parse_args(["--kv-disk-dir", str(tmp_path)])).policy.codec == "none"
    assert "--kv-codec-level" in check_kv_args(p.parse_args(["--kv-disk-dir", str(tmp_path), "--kv-codec-level", "23"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-codec", "gzip"])


def test_a_compressed_checkpoint_resumes_exactly_as_a_cold_prefill(eng, tmp_path):
    plain = KVStore(tmp_path / "v2", min_tokens=8)
    packed = _store(tmp_path / "v3")
    src = prefilled(eng, BASE * 4)
    p2 = plain.store_live_prefix(src, "cold")
    p3 = packed.store_live_prefix(src, "cold")
    a, b = open_checkpoint(p2), open_checkpoint(p3)
    assert (a.version, a.codec, a.mapped) == (2, "none", True)
    assert (b.version, b.codec, b.mapped) == (3, "zstd", False)
    assert b.codec_params == ("shuffle2", 1, 1 << 20, -(-b.raw_payload_bytes // (1 << 20)))
    assert b.raw_payload_bytes == a.payload_bytes and b.file_size == b.payload_offset + b.payload_bytes
    # the arrays a load hands the engine are the v2 file's, byte for byte
    aa, ba = a.load_arrays(), b.load_arrays()
    assert aa.keys() == ba.keys()
    for k in aa:
        assert aa[k].dtype == ba[k].dtype and aa[k].tobytes() == ba[k].tobytes(), k
    a.release()
    del a, b, aa, ba
    prompt = BASE * 4 + " and then one more question"
    s = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s, packed, prompt, evict_save=False)
    assert rep.rung == "disk" and rep.loaded_path == p3 and rep.reused_tokens == src.n_past
    cold = prefilled(eng, prompt)
    assert s.tokens == cold.tokens and np.array_equal(s.logits, cold.logits)
    assert s.generate(8) == cold.generate(8)


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        ("stored", PayloadChecksumError),  # the checksum over the stored bytes, before any decompression
        ("frame", BadFrameError),  # checksum resealed: the frame's own checks
        ("table", FrameTableError),  # the frame table no longer adds up (header resealed)
        ("codec", UnsupportedCodecError),  # incompatible: kept, not removed
    ],
)
def test_a_damaged_compressed_checkpoint_is_rejected_and_the_ladder_falls_back(eng, tmp_path, damage, error):
    st = _store(tmp_path)
    short = st.store_live_prefix(prefilled(eng, BASE), "cold")
    long_ = st.store_live_prefix(prefilled(eng, BASE * 3), "cold")
    if damage == "stored":
        with open(long_, "r+b") as f:
            b = bytearray(f.read())
            _flip_stored(b, open_checkpoint(long_, load_payload=False))
            f.seek(0)
            f.write(b)
    elif damage == "frame":
        _reseal(long_, _flip_stored)
    elif damage == "table":
        # frame 0's stored length one more (the table ends the metadata, 16 bytes an entry)
        def edit(b, ck):
            n = ck.codec_params[3]
            table = 96 + struct.unpack_from("<I", b, 20)[0] - 16 * n
            struct.pack_into("<I", b, table, struct.unpack_from("<I", b, table)[0] + 1)

        _reseal(long_, edit)
    else:
        _reseal(long_, lambda b, ck: b.__setitem__(53, 9))
    s = ds4.Session(eng, ctx=CTX)
    prompt = BASE * 3 + " what comes next"
    rep = ds4.recover(s, st, prompt, evict_save=False)
    assert [(p, c) for p, _s, c, _r in rep.rejected] == [(long_, error.code)]
    assert rep.rung == "disk" and rep.loaded_path == short
    assert os.path.exists(long_) == (error is UnsupportedCodecError)  # corrupt: removed; incompatible: kept
    cold = prefilled(eng, prompt)
    assert s.tokens == cold.tokens and np.array_equal(s.logits, cold.logits)
    with pytest.raises(error):
        if os.path.exists(long_):
            open_checkpoint(long_)
        else:
            raise error("removed")


def _ds4(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "ds4", *map(str, args)], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"ds4 {args} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def test_cli_run_writes_v3_and_kv_show_and_verify_read_it(tmp_path):
    kv = tmp_path / "kv"
    prompt = "A long question about harbours, tides and lighthouses, asked carefully and in order. " * 3
    flags = ["--kv-disk-dir", kv, "--kv-cache-min-tokens", "32", "--kv-cache-boundary-align-tokens", "64"]
    _ds4("run", "-p", prompt, "--engine", "reference", *flags, "--kv-codec", "zstd", "--max-tokens", "4", "--json")
    names = sorted(n for n in os.listdir(kv) if n.endswith(".kv"))
    assert names, "ds4 run stored nothing"
    for n in names:
        assert open_checkpoint(kv / n, load_payload=False).version == 3
    show = json.loads(_ds4("kv", "show", kv, names[0], "--verify", "--json").stdout)
    assert show["status"] == "ok" and show["version"] == 3
    assert show["codec"].startswith("zstd level 1, filter shuffle2, ") and show["raw_payload_bytes"] > 0
    assert "codec" in _ds4("kv", "show", kv, names[0]).stdout
    v = json.loads(_ds4("kv", "verify", kv, "--json").stdout)
    assert v["ok"] == len(names) and v["failed"] == 0
    _reseal(str(kv / names[0]), _flip_stored)
    p = _ds4("kv", "verify", kv, "--json", check=False)
    v = json.loads(p.stdout)
    assert p.returncode == 1 and v["failed"] == 1
    assert {f["name"]: f.get("code") for f in v["files"]}[names[0]] == "bad_frame"


def test_the_shared_tier_moves_the_stored_compressed_bytes(eng, tmp_path):
    from helpers.redis_servers import RedisNode

    from ds4.kvstore.remote import RemoteTier

    srv = RedisNode(str(tmp_path / "redis")).start()
    try:
        with srv.client() as c:
            c.flushall()
        a = KVStore(tmp_path / "a", remote=RemoteTier(srv.url, chunk_bytes=1 << 16), min_tokens=8, codec="zstd")
        b = KVStore(tmp_path / "b", remote=RemoteTier(srv.url, chunk_bytes=1 << 16), min_tokens=8)
        path = a.store_live_prefix(prefilled(eng, BASE * 3), "cold")
        assert a.remote.flush(30)
        size = os.path.getsize(path)
        assert a.remote.stats["bytes_uploaded"] == size  # the file as stored: v3 travels compressed
        prompt = BASE * 3 + " continued on another replica"
        s = ds4.Session(eng, ctx=CTX)
        rep = ds4.recover(s, b, prompt, evict_save=False)
        assert rep.rung == "remote" and not rep.rejected
        assert b.summary()["remote"]["bytes_downloaded"] == size
        assert open_checkpoint(rep.loaded_path, load_payload=False).version == 3
        cold = prefilled(eng, prompt)
        assert s.tokens == cold.tokens and np.array_equal(s.logits, cold.logits)
        a.close()
        b.close()
    finally:
        srv.stop()


def test_an_authenticated_compressed_store_round_trips_and_refuses_another_key(eng, tmp_path):
    key = ds4._core.derive_auth_key(b"a codec test secret, not for use")
    st = _store(tmp_path, auth_key=key)
    path = st.store_live_prefix(prefilled(eng, BASE * 2), "cold")
    ck = open_checkpoint(path, auth_key=key)
    assert (ck.version, ck.authenticated, ck.codec) == (3, True, "zstd")
    assert ck.file_size == ck.payload_offset + ck.payload_bytes + 32  # the MAC after the stored frames
    del ck
    prompt = BASE * 2 + " and the rest"
    s = ds4.Session(eng, ctx=CTX)
    assert ds4.recover(s, st, prompt, evict_save=False).rung == "disk"
    other = ds4._core.derive_auth_key(b"another secret of sixteen bytes")
    with pytest.raises(MacMismatchError):
        open_checkpoint(path, auth_key=other)
    # a stored byte changed and the payload checksum resealed: only the MAC sees it,
    # before a frame is decompressed (without the key, the frame's own checks do)
    _reseal(path, lambda b, ck: b.__setitem__(ck.payload_offset + 5, b[ck.payload_offset + 5] ^ 1))
    with pytest.raises(MacMismatchError):
        open_checkpoint(path, auth_key=key)
    with pytest.raises(BadFrameError):
        open_checkpoint(path)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_real_models_compressed_state_resumes_bit_for_bit(model, tmp_path):
    """SmolLM2 and Gemma 3 through llama.cpp (tests/helpers/models.py): a state
    stored as v3 at 700 tokens (past Gemma 3's 512-token window), loaded
    into a new session and continued, gives a cold prefill's logits and
    greedy tokens."""
    from helpers.models import engine, text_tokens

    eng = engine(model)
    toks = text_tokens(eng, 760)
    st = _store(tmp_path)
    src = ds4.Session(eng, ctx=2048)
    src.sync(toks[:700])
    path = st.store_live_prefix(src, "cold")
    ck = open_checkpoint(path, expected_abi=src.payload_abi)
    assert (ck.version, ck.codec) == (3, "zstd") and ck.payload_bytes < 0.9 * ck.raw_payload_bytes
    s = ds4.Session(eng, ctx=2048)
    s.load_checkpoint(ck)
    assert s.tokens == toks[:700]
    s.sync(toks)
    cold = ds4.Session(eng, ctx=2048)
    cold.sync(toks)
    assert np.array_equal(s.logits, cold.logits)
    assert s.generate(8) == cold.generate(8)
