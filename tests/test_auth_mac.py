"""Authenticated checkpoints (docs/FORMAT.md §1.9): a keyed BLAKE3 MAC in a
32-byte trailer, computed in Rust in the checksum's pass. Checked against
the independent ``blake3`` package and FORMAT.md's vector; files without a
MAC still load when no key is configured; with a key, nothing loads
without a valid one, local or remote."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import blake3
import numpy as np
import pytest
import xxhash

import ds4
from ds4 import _core
from ds4.checkpoint import open_checkpoint, write_checkpoint
from ds4.errors import MacMismatchError, MacMissingError, PayloadChecksumError
from ds4.kvstore import KVStore
from ds4.recovery import recover

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = "ds4 checkpoint authentication key v1"
SECRET = b"ds4 test secret, not for production use"
KEY = _core.derive_auth_key(SECRET)
ARRAYS = {"tokens": np.arange(5, dtype=np.int32), "kv": np.linspace(-1, 1, 37).astype(np.float32)}


def _write(tmp_path, text=b"hello, authenticated world", key=KEY, arrays=ARRAYS):
    path = tmp_path / (hashlib.sha1(text).hexdigest() + ".kv")
    write_checkpoint(path, text, arrays, abi="t/1", tokens=5, ctx=64, created=1_700_000_000, auth_key=key)
    return path


def _independent_mac(raw: bytes, key: bytes) -> bytes:
    """FORMAT.md §1.9 with the blake3 package: the file up to the end of the
    payload, bytes 12..16, 32..40 and 80..96 read as zero, keyed BLAKE3."""
    body = bytearray(raw[:-32])
    for a, b in ((12, 16), (32, 40), (80, 96)):
        body[a:b] = bytes(b - a)
    return blake3.blake3(bytes(body), key=key).digest()


def test_key_derivation_matches_blake3_derive_key():
    assert KEY == blake3.blake3(SECRET, derive_key_context=CONTEXT).digest()
    assert len(KEY) == 32


def test_mac_trailer_matches_an_independent_blake3(tmp_path):
    path = _write(tmp_path)
    raw = path.read_bytes()
    ck = open_checkpoint(path, auth_key=KEY)
    assert ck.authenticated and ck.trailer_bytes == 32
    assert raw[52] == 1 and ck.file_size == len(raw) == ck.payload_offset + ck.payload_bytes + 32
    assert raw[-32:] == _independent_mac(raw, KEY)
    # the checksum still covers exactly the payload
    assert xxhash.xxh3_64_intdigest(raw[ck.payload_offset : ck.payload_offset + ck.payload_bytes]) == (
        ck.payload_checksum
    )


def test_backward_compatible_without_a_key(tmp_path):
    plain = _write(tmp_path, b"no mac here", key=None)
    assert not open_checkpoint(plain).authenticated  # an old file loads as before
    assert open_checkpoint(_write(tmp_path)).authenticated  # a MAC'd file loads without a key too
    with pytest.raises(MacMissingError) as ei:
        open_checkpoint(plain, auth_key=KEY)
    assert ei.value.kind == "incompatible" and ei.value.stage == "header"
    with pytest.raises(MacMissingError):  # even a header-only open
        open_checkpoint(plain, auth_key=KEY, load_payload=False)


@pytest.mark.slow
@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "copied"])
def test_wrong_key_and_forged_payload_are_rejected(tmp_path, mmap):
    # the MAC is fed in the checksum's pass both over a map and over a copy
    path = _write(tmp_path)
    with pytest.raises(MacMismatchError) as ei:
        open_checkpoint(path, auth_key=_core.derive_auth_key(b"another secret of enough bytes"), mmap=mmap)
    assert ei.value.kind == "corrupt" and ei.value.code == "mac_mismatch"
    # forged: a payload byte changed, the payload and header checksums recomputed
    raw = bytearray(path.read_bytes())
    ck = open_checkpoint(path)
    po, pb = ck.payload_offset, ck.payload_bytes
    # dropped before the file is written again below: a live map holds a read
    # lease on it, and a write of the file (even from this process) would
    # wait out the lease's break time (/proc/sys/fs/lease-break-time, 45 s)
    del ck
    raw[po + 70] ^= 0x01
    raw[80:88] = xxhash.xxh3_64_intdigest(bytes(raw[po : po + pb])).to_bytes(8, "little")
    fixed = bytearray(raw[:96])
    for a, b in ((12, 16), (32, 40), (88, 96)):
        fixed[a:b] = bytes(b - a)
    meta = bytes(raw[96 : 96 + int.from_bytes(raw[20:24], "little")])
    raw[88:96] = xxhash.xxh3_64_intdigest(bytes(fixed) + meta).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    assert open_checkpoint(path).payload_checksum == int.from_bytes(raw[80:88], "little")  # checksums agree
    with pytest.raises(MacMismatchError):
        open_checkpoint(path, auth_key=KEY, mmap=mmap)
    # a flipped payload byte without recomputed checksums is still the checksum's failure
    raw[po + 71] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(PayloadChecksumError):
        open_checkpoint(path, auth_key=KEY, mmap=mmap)


def test_mac_is_checked_without_the_checksum_and_survives_touch(tmp_path):
    path = _write(tmp_path)
    _core.touch(path, 1_800_000_000)
    open_checkpoint(path, auth_key=KEY, verify_checksum=False, mmap=False)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80  # the trailer itself
    path.write_bytes(bytes(raw))
    with pytest.raises(MacMismatchError):
        open_checkpoint(path, auth_key=KEY, verify_checksum=False)


def test_bad_auth_byte_and_bad_key_length(tmp_path):
    path = _write(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[52] = 2
    path.write_bytes(bytes(raw))
    with pytest.raises(ds4.errors.CorruptCheckpointError):
        open_checkpoint(path)
    with pytest.raises(ValueError):
        open_checkpoint(path, auth_key=b"short")


def test_format_md_vector():
    """FORMAT.md §4.3: the secret, the derived key and the MAC of the v2
    vector of §4.1 written with that key, checked with the blake3 package."""
    doc = (ROOT / "docs" / "FORMAT.md").read_text()
    sec = doc[doc.index("### 4.3") :]
    secret = re.search(r"secret: `([^`]+)`", sec).group(1).encode()
    key_hex = re.search(r"key: `([0-9a-f]{64})`", sec).group(1)
    mac_hex = re.search(r"mac: `([0-9a-f]{64})`", sec).group(1)
    body_hex = re.search(r"authenticated body \(hex\):\n```\n([0-9a-f\n]+)```", sec).group(1)
    body = bytes.fromhex(body_hex.replace("\n", ""))
    key = blake3.blake3(secret, derive_key_context=CONTEXT).digest()
    assert key.hex() == key_hex == _core.derive_auth_key(secret).hex()
    assert _independent_mac(body + bytes(32), key).hex() == mac_hex


def test_store_with_a_key(tmp_path):
    eng = ds4.ReferenceEngine()
    prompt = " ".join(f"key-{i}" for i in range(60))
    st = KVStore(tmp_path / "kv", min_tokens=16, auth_key=KEY)
    s = ds4.Session(eng, ctx=1024)
    rep = recover(s, st, prompt, cold_save=True)
    assert open_checkpoint(rep.cold_saved, auth_key=KEY).authenticated
    s2 = ds4.Session(eng, ctx=1024)
    assert recover(s2, st, prompt + " more").rung == "disk"
    # a planted file without a MAC (right name, right text, valid checksums) never loads; it is kept
    other = prompt + " planted"
    s3 = ds4.Session(eng, ctx=1024)
    s3.sync(eng.tokenize(other, special=True))
    text = s3.text_bytes()
    planted = st.dir + "/" + hashlib.sha1(text).hexdigest() + ".kv"
    write_checkpoint(planted, text, s3.export_arrays(), abi=s3.payload_abi, tokens=s3.n_past, ctx=s3.ctx)
    st2 = KVStore(tmp_path / "kv", min_tokens=16, auth_key=KEY)
    s4 = ds4.Session(eng, ctx=1024)
    rep = recover(s4, st2, other + "?")
    assert rep.rung == "disk" and rep.reused_tokens < s3.n_past  # the authenticated shorter one
    assert any(r[2] == "mac_missing" for r in rep.rejected)
    assert os.path.exists(planted)
    # without the key, the same directory still loads everything (backward compatible)
    st3 = KVStore(tmp_path / "kv", min_tokens=16)
    s5 = ds4.Session(eng, ctx=1024)
    assert recover(s5, st3, other + "?").reused_tokens == s3.n_past


def test_key_file_flag(tmp_path):
    import argparse

    from ds4.config import add_kv_args, check_kv_args, make_store, read_auth_key

    good = tmp_path / "key"
    good.write_bytes(SECRET)
    assert read_auth_key(str(good)) == KEY
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    p = argparse.ArgumentParser()
    add_kv_args(p)
    for bad in (short, tmp_path / "missing"):
        args = p.parse_args(["--kv-disk-dir", str(tmp_path / "kv"), "--kv-auth-key-file", str(bad)])
        assert "--kv-auth-key-file" in check_kv_args(args)
    args = p.parse_args(["--kv-disk-dir", str(tmp_path / "kv"), "--kv-auth-key-file", str(good)])
    assert check_kv_args(args) is None
    st = make_store(args)
    assert st.auth_key == KEY
