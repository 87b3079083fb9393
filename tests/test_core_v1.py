"""ds4's own v1 files, built byte by byte from the documented layout
(ds4_kvstore.c): 48-byte header, u32 text length, text, DSV4 payload,
optional KTM trailer. They are listed, verified and inspected, never loaded
into an engine."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4._core as core
from ds4 import errors as E
from ds4.checkpoint import open_checkpoint

DSV4_MAGIC = 0x34565344
DSV4_KEYS = [
    "magic",
    "version",
    "ctx",
    "prefill_cap",
    "raw_cap",
    "raw_window",
    "comp_cap",
    "tokens",
    "layers",
    "head_dim",
    "indexer_dim",
    "vocab",
    "raw_live",
]


def dsv4_fields(*, ctx=32768, tokens=100, magic=DSV4_MAGIC, version=1, raw_window=128):
    return [magic, version, ctx, 2048, 4096, raw_window, 8192, tokens, 43, 512, 128, 129280, min(raw_window, tokens)]


def v1_file(
    text: bytes,
    *,
    quant=4,
    reason=1,
    ext=0,
    tokens=100,
    hits=3,
    ctx=32768,
    created=1_700_000_000,
    last_used=1_700_000_500,
    fields=None,
    body=b"\x11" * 200,
    trailer=b"",
    payload_bytes=None,
    text_bytes=None,
):
    payload = struct.pack("<13I", *(fields or dsv4_fields(ctx=ctx, tokens=tokens))) + body
    head = b"KVC" + bytes([1, quant, reason, ext, 0])
    head += struct.pack("<III", tokens, hits, ctx) + bytes(4)
    head += struct.pack("<QQQ", created, last_used, len(payload) if payload_bytes is None else payload_bytes)
    assert len(head) == 48
    head += struct.pack("<I", len(text) if text_bytes is None else text_bytes)
    return head + text + payload + trailer


def ktm_trailer(entries):
    out = b"KTM" + bytes([1]) + struct.pack("<I", len(entries))
    for ident, dsml in entries:
        out += struct.pack("<II", len(ident), len(dsml)) + ident + dsml
    return out


TEXT = b"<\xef\xbd\x9cbegin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>You are a helpful assistant." * 3


def put(d, data: bytes, text: bytes = TEXT) -> str:
    """Write ``data`` as the file named after ``text`` (a new file: a
    checkpoint opened earlier may still hold a read lease on the old one)."""
    path = os.path.join(d, hashlib.sha1(text).hexdigest() + ".kv")
    if os.path.exists(path):
        os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("load_payload", [True, False])
@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("quant,reason", [(2, 0), (4, 1), (4, 6), (2, 3)])
def test_v1_fields(tmp_path, load_payload, mmap, quant, reason):
    body = bytes(range(256)) * 3
    data = v1_file(
        TEXT, quant=quant, reason=reason, tokens=777, hits=9, ctx=65536, created=111, last_used=222, body=body
    )
    path = put(tmp_path, data)
    ck = open_checkpoint(path, prompt=TEXT + b"<|User|>hi", load_payload=load_payload, mmap=mmap)
    assert (ck.version, ck.quant_bits, ck.reason, ck.flags) == (1, quant, reason, 0)
    assert (ck.tokens, ck.hits, ck.ctx, ck.created, ck.last_used) == (777, 9, 65536, 111, 222)
    assert ck.text == TEXT and ck.text_bytes == len(TEXT) and ck.text_sha1 == hashlib.sha1(TEXT).hexdigest()
    assert ck.payload_bytes == 52 + len(body) and ck.payload_offset == 52 + len(TEXT)
    assert ck.file_size == len(data) and ck.trailer_bytes == 0
    assert ck.abi == "" and ck.tensor_table() == []
    assert ck.dsv4 == dict(zip(DSV4_KEYS, dsv4_fields(ctx=65536, tokens=777), strict=True))
    assert ck.payload_loaded is load_payload
    if load_payload:
        assert ck.mapped is mmap
        assert bytes(ck.payload_buffer()) == data[52 + len(TEXT) :]
    else:
        with pytest.raises(ValueError):
            ck.payload_buffer()


def test_v1_trailer(tmp_path):
    trailer = ktm_trailer([(b"call_1", b"<tool>x</tool>"), (b"call_2", b"<tool>y</tool>")])
    path = put(tmp_path, v1_file(TEXT, ext=1, trailer=trailer))
    for load_payload in (True, False):
        ck = open_checkpoint(path, load_payload=load_payload)
        assert ck.flags == 1 and ck.trailer_bytes == len(trailer)
        assert ck.file_size == 52 + len(TEXT) + ck.payload_bytes + len(trailer)
    assert bytes(open_checkpoint(path).payload_buffer()) == struct.pack("<13I", *dsv4_fields()) + b"\x11" * 200
    # ext bit set, no trailer: fine too
    ck = open_checkpoint(put(tmp_path, v1_file(TEXT, ext=1)))
    assert ck.trailer_bytes == 0
    # other ext bits: ds4's reader allows bytes after the payload whatever the bits say
    ck = open_checkpoint(put(tmp_path, v1_file(TEXT, ext=6, trailer=trailer)))
    assert ck.trailer_bytes == len(trailer)


def test_v1_trailing_bytes_without_ext_bit(tmp_path):
    """ds4 loads a file longer than header + text + payload (``st_size >=``
    is its rule): the extra bytes are trailer room, never corruption."""
    ck = open_checkpoint(put(tmp_path, v1_file(TEXT, trailer=b"KTM\x01" + bytes(4))))
    assert ck.trailer_bytes == 8 and ck.flags == 0


@pytest.mark.parametrize("ext", [0, 1])
def test_v1_truncated(tmp_path, ext):
    data = v1_file(TEXT, ext=ext)
    for n in (0, 3, 47, 51):
        with pytest.raises(E.TooShortError):
            open_checkpoint(put(tmp_path, data[:n]))
    for n in (52, 53, 52 + len(TEXT), 52 + len(TEXT) + 51, len(data) - 1):
        with pytest.raises(E.TruncatedCheckpointError):
            open_checkpoint(put(tmp_path, data[:n]))
        with pytest.raises(E.TruncatedCheckpointError):
            open_checkpoint(put(tmp_path, data[:n]), load_payload=False)


@pytest.mark.parametrize("mmap", [True, False])
def test_v1_huge_sizes(tmp_path, mmap):
    for pb, cls in [
        (1 << 60, E.TruncatedCheckpointError),
        ((1 << 64) - 1, E.SizeOverflowError),
        ((1 << 64) - 52, E.SizeOverflowError),
    ]:
        for ext in (0, 1):
            with pytest.raises(cls):
                open_checkpoint(put(tmp_path, v1_file(TEXT, payload_bytes=pb, ext=ext)), mmap=mmap)
    with pytest.raises(E.TruncatedCheckpointError):
        open_checkpoint(put(tmp_path, v1_file(TEXT, text_bytes=0xFFFFFFFF)), mmap=mmap)


@pytest.mark.parametrize(
    "fields,body",
    [
        (dsv4_fields(magic=0x34565345), b"\x00" * 64),
        (dsv4_fields(magic=0), b"\x00" * 64),
        (dsv4_fields(version=2), b"\x00" * 64),
        (dsv4_fields(tokens=99), b"\x00" * 64),  # header says 100
        (dsv4_fields(tokens=101), b""),
    ],
    ids=["magic+1", "magic0", "version2", "tokens-1", "tokens+1"],
)
def test_v1_bad_payload_header(tmp_path, fields, body):
    path = put(tmp_path, v1_file(TEXT, tokens=100, fields=fields, body=body))
    with pytest.raises(E.BadV1PayloadError) as ei:
        open_checkpoint(path)
    assert ei.value.stage == "payload" and isinstance(ei.value, E.CorruptCheckpointError)
    ck = open_checkpoint(path, load_payload=False)  # the header and text are fine
    assert ck.text == TEXT and ck.dsv4 is None


@pytest.mark.parametrize("n", [0, 4, 51])
def test_v1_payload_shorter_than_dsv4_header(tmp_path, n):
    data = v1_file(TEXT)
    head_end = 52 + len(TEXT)
    short = data[:40] + struct.pack("<Q", n) + data[48:head_end] + data[head_end : head_end + n]
    with pytest.raises(E.BadV1PayloadError):
        open_checkpoint(put(tmp_path, short))


def test_v1_never_matches_an_engine_abi(tmp_path):
    path = put(tmp_path, v1_file(TEXT))
    with pytest.raises(E.AbiMismatchError) as ei:
        open_checkpoint(path, expected_abi="ref-llama/1 model=sha256:00 layout=1")
    assert isinstance(ei.value, E.IncompatibleCheckpointError)


def test_v1_never_matches_even_an_empty_abi(tmp_path):
    """A v1 file has no ABI string; it must not compare equal to an engine
    whose ABI happens to be empty: any expected_abi rejects v1."""
    path = put(tmp_path, v1_file(TEXT))
    with pytest.raises(E.AbiMismatchError):
        open_checkpoint(path, expected_abi="")


def test_v1_other_checks(tmp_path):
    path = put(tmp_path, v1_file(TEXT, quant=2, tokens=500))
    with pytest.raises(E.QuantMismatchError):
        open_checkpoint(path, quant_bits=4)
    assert open_checkpoint(path, quant_bits=2).quant_bits == 2
    with pytest.raises(E.ContextTooSmallError):
        open_checkpoint(path, ctx=499)
    assert open_checkpoint(path, ctx=500).tokens == 500
    with pytest.raises(E.NotPrefixError):
        open_checkpoint(path, prompt=TEXT[:-1])
    renamed = tmp_path / (hashlib.sha1(b"other").hexdigest() + ".kv")
    renamed.write_bytes(Path(path).read_bytes())
    with pytest.raises(E.NameMismatchError):
        open_checkpoint(renamed)
    b = bytearray(Path(path).read_bytes())
    b[60] ^= 1  # inside the text
    with pytest.raises(E.NameMismatchError):
        open_checkpoint(put(tmp_path, bytes(b)))
    b = bytearray(Path(path).read_bytes())
    b[1] = ord("X")
    with pytest.raises(E.BadMagicError):
        open_checkpoint(put(tmp_path, bytes(b)))


def test_v1_touch(tmp_path):
    data = v1_file(TEXT, hits=3, last_used=5)
    path = put(tmp_path, data)
    assert core.touch(path, 1_800_000_000) == 4
    ck = open_checkpoint(path, prompt=TEXT)
    assert (ck.hits, ck.last_used, ck.created) == (4, 1_800_000_000, 1_700_000_000)
    after = Path(path).read_bytes()
    changed = [i for i in range(len(data)) if data[i] != after[i]]
    assert set(changed) <= set(range(12, 16)) | set(range(32, 40)), changed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), ext=st.sampled_from([0, 1]), trailer=st.binary(max_size=30))
def test_v1_mutations_never_crash(tmp_path, data, ext, trailer):
    """v1 has no checksums: a damaged v1 file may load, but opening never
    raises anything but a CheckpointError, and what loads is self-consistent."""
    raw = bytearray(v1_file(TEXT, ext=ext, trailer=trailer if ext else b""))
    for p, v in data.draw(
        st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=12), label="overwrites"
    ):
        raw[p] = v
    cut = data.draw(st.integers(0, len(raw)), label="keep")
    blob = bytes(raw[:cut]) + data.draw(st.binary(max_size=40), label="append")
    for mmap in (True, False):
        for load_payload in (True, False):
            try:
                ck = open_checkpoint(put(tmp_path, blob), prompt=TEXT + b"!", mmap=mmap, load_payload=load_payload)
            except BaseException as e:
                assert isinstance(e, E.CheckpointError), f"{type(e).__name__}: {e!r}"
                continue
            assert ck.text == TEXT
            if ck.version == 1:
                assert ck.payload_offset + ck.payload_bytes + ck.trailer_bytes == ck.file_size == len(blob)
                if load_payload:
                    assert len(ck.payload_buffer()) == ck.payload_bytes
                    assert ck.dsv4 is not None and ck.dsv4["tokens"] == ck.tokens
