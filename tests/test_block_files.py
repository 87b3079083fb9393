"""KV block files through ``ds4._core`` (docs/FORMAT.md §7): the chained
names, the durable write, a manifest's block table, the verification of a
table's blocks into one buffer, and ``BlockError`` (its codes, ``.block``,
``.path``, pickling). §7.5's vectors are recomputed with the independent
``blake3`` and ``xxhash`` packages."""

from __future__ import annotations

import errno
import os
import pickle
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
import xxhash
from helpers.checkpoints import flip_byte

from ds4 import _core
from ds4.errors import ERROR_CODES, BlockError, CorruptCheckpointError, from_core

ROOT = Path(__file__).resolve().parent.parent
ABI = "test-abi"
KEY = _core.derive_auth_key(b"ds4 block test secret, not for use")
BT = 4


def _store(d: Path, n: int = 3, key: bytes | None = None) -> tuple[bytes, bytes, list[bytes]]:
    """``n`` blocks of ``BT`` tokens (float32 payloads of different sizes)
    written to ``d``: the table, the joined payloads, the names."""
    names = _core.block_names(_core.block_root(ABI, b""), np.arange(n * BT, dtype=np.int32), BT, ABI)
    records, joined = [], b""
    for i, name in enumerate(names):
        payload = np.linspace(i, i + 1, 16 + 4 * i, dtype=np.float32)
        size, cks = _core.write_block(d, name, BT, ABI, payload, key)
        assert size == 128 + payload.nbytes + (32 if key else 0)
        assert cks == xxhash.xxh3_64_intdigest(payload.tobytes()) == _core.xxh3_64(payload)
        records.append((name, BT, payload.nbytes, cks))
        joined += payload.tobytes()
    return _core.block_table(BT, records), joined, names


def _path(d: Path, name: bytes) -> str:
    return str(d / f"{name.hex()}.kvb")


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "keyed"])
def test_round_trip(tmp_path, key):
    table, joined, names = _store(tmp_path, 3, key)
    assert _core.open_blocks(tmp_path, table, ABI, key) == joined
    if key is not None:  # a MAC trailer is accepted without a key
        assert _core.open_blocks(tmp_path, table, ABI) == joined
    block_tokens, records = _core.read_block_table(table)
    assert block_tokens == BT and [r[0] for r in records] == names
    assert len(table) == 16 + 56 * 3 and _core.block_table(block_tokens, records) == table
    p = _path(tmp_path, names[1])
    head = _core.read_block_header(p)
    assert head == _core.verify_block(p, ABI, key)
    assert head["name"] == names[1].hex() and head["n_tokens"] == BT and head["authenticated"] == (key is not None)
    assert head["abi_tag"] == _core.model_tag(ABI) and head["file_len"] == os.path.getsize(p)
    assert head["checksum"] == records[1][3] and head["payload_len"] == records[1][2]
    assert os.stat(p).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == sorted(f"{n.hex()}.kvb" for n in names)  # no temp file left


def test_three_blocks_on_one_and_two_threads_are_the_same_bytes(tmp_path):
    table, joined, _ = _store(tmp_path, 3, KEY)
    one = _core.open_blocks(tmp_path, table, ABI, KEY, threads=1)
    two = _core.open_blocks(tmp_path, table, ABI, KEY, threads=2)
    assert isinstance(one, bytes) and one == two == joined


def test_names_chain_and_arguments():
    root = _core.block_root(ABI, b"")
    toks = np.arange(10, dtype=np.int32)
    names = _core.block_names(root, toks, BT, ABI)
    assert len(names) == 2 and all(len(n) == 32 for n in names)  # the partial tail is not named
    other = toks.copy()
    other[1] += 1
    assert all(a != b for a, b in zip(names, _core.block_names(root, other, BT, ABI), strict=True))
    assert _core.block_root(ABI, b"\xff\x00ns:a\xff\x00") != root
    with pytest.raises(ValueError, match="negative"):
        _core.block_names(root, np.array([1, -2, 3, 4], np.int32), BT, ABI)
    with pytest.raises(ValueError, match="block_tokens"):
        _core.block_names(root, toks, 0, ABI)
    with pytest.raises(ValueError, match="32 bytes"):
        _core.block_names(root[:31], toks, BT, ABI)


def test_bad_write_arguments(tmp_path):
    name = bytes(32)
    with pytest.raises(ValueError, match="at least one token"):
        _core.write_block(tmp_path, name, 0, ABI, b"x")
    with pytest.raises(ValueError, match="32 bytes"):
        _core.write_block(tmp_path, name[:5], 1, ABI, b"x")
    with pytest.raises(ValueError, match="auth_key"):
        _core.write_block(tmp_path, name, 1, ABI, b"x", b"short")
    with pytest.raises(OSError) as ei:
        _core.write_block(tmp_path / "missing", name, 1, ABI, b"x")
    assert ei.value.errno == errno.ENOENT and not isinstance(ei.value, BlockError)
    with pytest.raises(ValueError, match="block_tokens"):
        _core.block_table(0, [])


def _refusal(tmp_path, damage, code, index=1, key=None, abi=ABI):
    table, _, names = _store(tmp_path, 3, KEY if key == "write" else None)
    damage(tmp_path, names)
    with pytest.raises(BlockError) as ei:
        _core.open_blocks(tmp_path, table, abi, KEY if key in ("read", "write") else None)
    e = ei.value
    assert (e.code, e.stage, e.kind) == (code, "block", "corrupt")
    assert e.block == names[index].hex() and e.path == _path(tmp_path, names[index])
    assert isinstance(e, CorruptCheckpointError) and str(e).startswith(f"{code} (stage block): ")
    return e


def _renamed(d: Path, n: list[bytes]) -> None:
    """Block 2, rewritten at block 1's payload length, renamed onto block 1."""
    _core.write_block(d, n[2], BT, ABI, np.zeros(20, np.float32))
    os.replace(_path(d, n[2]), _path(d, n[1]))


def _symlinked(d: Path, n: list[bytes]) -> None:
    os.unlink(_path(d, n[1]))
    os.symlink(_path(d, n[0]), _path(d, n[1]))


def test_refusal_codes(tmp_path):
    cases = {
        "block_missing": lambda d, n: os.unlink(_path(d, n[1])),
        "block_corrupt": lambda d, n: flip_byte(_path(d, n[1]), 40),
        "block_short": lambda d, n: os.truncate(_path(d, n[1]), 150),
        "block_name": _renamed,
        "block_checksum": lambda d, n: flip_byte(_path(d, n[1]), 130),
    }
    for code, damage in cases.items():
        sub = tmp_path / code
        sub.mkdir()
        _refusal(sub, damage, code)
    (tmp_path / "abi").mkdir()
    _refusal(tmp_path / "abi", lambda d, n: None, "block_abi", index=0, abi="other")
    (tmp_path / "nomac").mkdir()
    _refusal(tmp_path / "nomac", lambda d, n: None, "block_mac_missing", index=0, key="read")
    (tmp_path / "mac").mkdir()
    last = 128 + 80 + 31  # block 1: the header, 20 float32, the MAC's last byte
    _refusal(tmp_path / "mac", lambda d, n: flip_byte(_path(d, n[1]), last), "block_mac", key="write")
    (tmp_path / "link").mkdir()
    e = _refusal(tmp_path / "link", _symlinked, "block_corrupt")
    assert "symlink" in e.reason


def test_verify_block_and_the_header_alone(tmp_path):
    _, _, names = _store(tmp_path, 1, KEY)
    p = _path(tmp_path, names[0])
    flip_byte(p, 128)
    assert _core.read_block_header(p)["payload_len"] == 64  # the header alone is intact
    with pytest.raises(BlockError) as ei:
        _core.verify_block(p)
    assert (ei.value.code, ei.value.block, ei.value.path) == ("block_checksum", names[0].hex(), p)
    q = str(tmp_path / "x.kvb")
    os.replace(p, q)
    with pytest.raises(BlockError) as ei:
        _core.read_block_header(str(tmp_path / "none.kvb"))
    assert ei.value.code == "block_missing" and ei.value.block == ""
    with pytest.raises(BlockError, match="block_name"):
        _core.verify_block(q)


def test_a_malformed_table_is_block_table_of_the_manifest():
    good = _core.block_table(BT, [(bytes(32), BT, 8, 1)])
    for bad in (good[:-1], good + b"\0", b"KVBX" + good[4:], good[:52] + b"\1" + good[53:]):
        with pytest.raises(BlockError) as ei:
            _core.read_block_table(bad)
        e = ei.value
        assert (e.code, e.stage, e.kind, e.block, e.path) == ("block_table", "payload", "corrupt", "", None)
    with pytest.raises(BlockError, match="block_table"):
        _core.open_blocks("/nonexistent", good[:-1], ABI)
    # raised from Python (a manifest without its table): the same stage
    e = BlockError("no table", code="block_table", path="/m.kv")
    assert (e.code, e.stage, e.path) == ("block_table", "payload", "/m.kv")


def test_block_errors_pickle(tmp_path):
    table, _, names = _store(tmp_path, 2)
    os.unlink(_path(tmp_path, names[0]))
    with pytest.raises(BlockError) as ei:
        _core.open_blocks(tmp_path, table, ABI)
    for e in (ei.value, from_core("block_table", "m", "/x.kv", "payload"), BlockError("r", code="block_mac")):
        for proto in range(pickle.HIGHEST_PROTOCOL + 1):
            r = pickle.loads(pickle.dumps(e, protocol=proto))
            assert type(r) is BlockError and str(r) == str(e) and r.args == e.args, f"{e.code}, protocol {proto}"
            assert (r.code, r.stage, r.block, r.path, r.reason) == (e.code, e.stage, e.block, e.path, e.reason), (
                f"{e.code}, protocol {proto}"
            )
    assert ei.value.code == "block_missing" and ei.value.block == names[0].hex()


def test_every_block_code_is_a_block_error():
    codes = {c for c, cls in ERROR_CODES.items() if cls is BlockError}
    assert codes == set(BlockError.codes.split())
    assert codes == {
        "block_table",
        "block_missing",
        "block_corrupt",
        "block_short",
        "block_name",
        "block_abi",
        "block_checksum",
        "block_mac_missing",
        "block_mac",
    }
    for code in codes:
        e = from_core(code, "m", "/p")
        assert type(e) is BlockError and e.code == code and e.stage == ("payload" if code == "block_table" else "block")


# ---- §7.5's vectors, recomputed with blake3 and xxhash --------------------


def _vector(doc: str, vid: str) -> str:
    body = doc.split(f"<!-- vector:{vid} -->", 1)[1].split("<!-- /vector -->", 1)[0].strip()
    return body.removeprefix("```text").removesuffix("```").strip()


def _xxd(dump: str) -> bytes:
    return b"".join(bytes.fromhex(line.split(": ", 1)[1][:39].replace(" ", "")) for line in dump.splitlines())


def _derive(context: str, data: bytes) -> bytes:
    return blake3.blake3(data, derive_key_context=context).digest()


def test_documented_vectors(tmp_path):
    doc = (ROOT / "docs" / "FORMAT.md").read_text()
    f = dict(line.split(" = ", 1) for line in _vector(doc, "block:fields").splitlines())
    abi = f["abi"].encode()
    framed = struct.pack("<I", len(abi)) + abi
    root = _derive("ds4 block root v1", framed)
    assert root.hex() == f["root"] == _core.block_root(ABI, b"").hex()
    ns = b"\xff\x00ns:alice\xff\x00"
    assert _derive("ds4 block root v1", framed + ns).hex() == f["root ns"] == _core.block_root(ABI, ns).hex()
    n0 = _derive("ds4 block name v1", root + struct.pack("<5I", 4, 1, 2, 3, 4) + framed)
    n1 = _derive("ds4 block name v1", n0 + struct.pack("<5I", 4, 5, 6, 7, 8) + framed)
    assert [n0.hex(), n1.hex()] == [f["name 0"], f["name 1"]]
    assert _core.block_names(root, np.arange(1, 10, dtype=np.int32), 4, ABI) == [n0, n1]
    payload = bytes(range(1, 9))
    file = _xxd(_vector(doc, "block:file"))
    assert file[128:] == payload and file[64:72].hex() == f["abi tag"]
    assert xxhash.xxh3_64_intdigest(payload) == int(f["payload checksum"], 16)
    assert (
        xxhash.xxh3_64_intdigest(file[:120]) == int(f["header checksum"], 16) == int.from_bytes(file[120:128], "little")
    )
    _core.write_block(tmp_path, n0, 4, ABI, payload)
    assert Path(_path(tmp_path, n0)).read_bytes() == file
    key = bytes(range(32))
    block_key = _derive("ds4 block authentication key v1", key)
    assert block_key.hex() == f["block key"]
    head = bytearray(file[:128])
    head[4] = 1
    head[120:] = xxhash.xxh3_64_intdigest(bytes(head[:120])).to_bytes(8, "little")
    assert int.from_bytes(head[120:], "little") == int(f["keyed header checksum"], 16)
    mac = blake3.blake3(bytes(head[:120]) + payload, key=block_key).digest()
    assert mac.hex() == f["mac"]
    _core.write_block(tmp_path, n0, 4, ABI, payload, key)
    assert Path(_path(tmp_path, n0)).read_bytes() == bytes(head) + payload + mac
    table = _xxd(_vector(doc, "block:table"))
    assert _core.block_table(4, [(n, 4, 8, int(f["payload checksum"], 16)) for n in (n0, n1)]) == table
