"""Damaged files never get through, and never crash.

From valid checkpoints (several tensors), every truncation, every single bit
flip, and (hypothesis) random byte overwrites, splices of two valid files,
multi-bit flips, truncations combined with overwrites and appended garbage:
opening the result with the original prompt and name checking on either
loads exactly an original (same text, header fields and tensor bytes; only
the mutable hits/last_used may differ) or raises a ds4.errors.CheckpointError
subclass. Anything else -- pyo3's PanicException (a BaseException), OSError,
MemoryError, a plain ValueError -- fails. Both mmap and pread modes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4 import errors as E
from ds4.checkpoint import open_checkpoint

MUTABLE = set(range(12, 16)) | set(range(32, 40))  # hits, last_used: outside the checksums
VERSION_BYTE = 3
SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


def _arrays(seed, layout):
    rng = np.random.default_rng(seed)
    out = {}
    for name, dtype, shape in layout:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[name] = np.frombuffer(rng.bytes(n), dtype=dtype).reshape(shape)
    return out


LAYOUT = [
    ("kv", "<f4", (3, 5)),
    ("blob", "|u1", (37,)),
    ("pos", "<i8", (4,)),
    ("half", "<f2", (2, 2, 3)),
    ("empty", "<f8", (0, 2)),
]
LAYOUT2 = [("logits", "<f4", (19,)), ("kv", "<f2", (4, 9)), ("state", "|u1", (70,))]


def signature(ck):
    """Everything a load yields except the mutable hits/last_used."""
    tensors = tuple((n, dt, tuple(shape), ck.array(n).tobytes()) for n, dt, shape, _o, _b in ck.tensor_table())
    return (
        ck.version,
        ck.text,
        ck.abi,
        ck.tokens,
        ck.ctx,
        ck.quant_bits,
        ck.reason,
        ck.flags,
        ck.created,
        ck.payload_bytes,
        tensors,
    )


@pytest.fixture(scope="module")
def originals(tmp_path_factory, write_ck):
    """name -> (bytes, text, signature) for four valid files: A, B (other
    text and layout), C (A's text, other values), D (A's text, other layout)."""
    d = tmp_path_factory.mktemp("originals")
    ta = b"<|user|>Summarise the following document.\n" + bytes(range(32, 90))
    tb = b"a completely different conversation " * 3
    specs = {
        "A": (ta, _arrays(1, LAYOUT), dict(tokens=40, ctx=4096, quant_bits=4, reason="cold", flags=0)),
        "B": (tb, _arrays(2, LAYOUT2), dict(tokens=33, ctx=2048, quant_bits=2, reason="evict", flags=1)),
        "C": (ta, _arrays(3, LAYOUT), dict(tokens=40, ctx=4096, quant_bits=4, reason="cold", flags=0)),
        "D": (ta, _arrays(4, LAYOUT2), dict(tokens=41, ctx=4096, quant_bits=4, reason="continued", flags=0)),
    }
    out = {}
    for key, (text, arrays, kw) in specs.items():
        sub = d / key
        sub.mkdir()
        path = write_ck(sub, text, arrays, **kw)
        data = Path(path).read_bytes()
        out[key] = (data, text, signature(open_checkpoint(path, prompt=text)))
    return out


@pytest.fixture(scope="module")
def scratch():
    d = tempfile.mkdtemp(prefix="ds4-corrupt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def try_open(scratch, data: bytes, text: bytes, mmap: bool):
    """Write ``data`` as ``sha1(text).kv`` and open it; return the signature
    of the loaded checkpoint, or the CheckpointError it raised. Any other
    exception (including a Rust panic) fails the test."""
    path = os.path.join(scratch, hashlib.sha1(text).hexdigest() + ".kv")
    if os.path.exists(path):
        os.unlink(path)  # a fresh inode: never rewrite a file someone may have mapped
    with open(path, "wb") as f:
        f.write(data)
    try:
        ck = open_checkpoint(path, prompt=text + b" and the continuation", check_name=True, mmap=mmap)
        return signature(ck)
    except BaseException as e:
        if not isinstance(e, E.CheckpointError):
            raise AssertionError(
                f"open raised {type(e).__module__}.{type(e).__name__} (not a CheckpointError): {e!r}"
            ) from e
        assert e.code in E.ERROR_CODES and e.path == path
        return e


def assert_loaded_one_of(result, allowed, what):
    if not isinstance(result, E.CheckpointError):
        assert result in allowed, f"{what}: loaded content that is not an original"


# -- exhaustive: every truncation, every single bit flip ----------------------


@pytest.mark.parametrize("mmap", [True, False])
def test_every_truncation_is_corrupt(originals, scratch, mmap):
    data, text, _sig = originals["A"]
    for n in range(len(data)):
        r = try_open(scratch, data[:n], text, mmap)
        assert isinstance(r, E.CorruptCheckpointError), f"truncated to {n}: {r!r}"
        assert isinstance(r, (E.TooShortError, E.TruncatedCheckpointError)), f"truncated to {n}: {r!r}"


@pytest.mark.parametrize("key", ["A", "B"])
@pytest.mark.parametrize("mmap", [True, False])
def test_every_single_bit_flip(originals, scratch, mmap, key):
    """Flips in hits/last_used load the original; a flip in the version byte is
    an unsupported (newer/unknown) version, or v3 (2 ^ 1), whose header
    checksum then fails (corrupt); anything else is corrupt."""
    data, text, sig = originals[key]
    assert len(data) > 400
    for i in range(len(data)):
        for bit in range(8):
            b = bytearray(data)
            b[i] ^= 1 << bit
            r = try_open(scratch, bytes(b), text, mmap)
            where = f"flip byte {i} bit {bit}"
            if i in MUTABLE:
                assert r == sig, f"{where}: a mutable field must not affect the load: {r!r}"
            elif i == VERSION_BYTE and data[i] ^ (1 << bit) == 3:
                assert isinstance(r, E.HeaderChecksumError), f"{where}: {r!r}"
            elif i == VERSION_BYTE:
                assert isinstance(r, E.UnsupportedVersionError), f"{where}: {r!r}"
            else:
                assert isinstance(r, E.CorruptCheckpointError), f"{where}: {r!r}"


# -- hypothesis ----------------------------------------------------------------

which = st.sampled_from("ABCD")


@SETTINGS
@given(key=which, data=st.data())
def test_truncation_and_single_flip_any_file(originals, scratch, key, data):
    raw, text, sig = originals[key]
    n = data.draw(st.integers(0, len(raw) - 1), label="truncate to")
    i = data.draw(st.integers(0, len(raw) - 1), label="flip byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    flipped = bytearray(raw)
    flipped[i] ^= 1 << bit
    for mmap in (True, False):
        r = try_open(scratch, raw[:n], text, mmap)
        assert isinstance(r, E.CorruptCheckpointError), r
        r = try_open(scratch, bytes(flipped), text, mmap)
        if i in MUTABLE:
            assert r == sig
        elif i == VERSION_BYTE and raw[i] ^ (1 << bit) == 3:  # read as v3: its header checksum fails
            assert isinstance(r, E.HeaderChecksumError), r
        elif i == VERSION_BYTE:
            assert isinstance(r, E.UnsupportedVersionError), r
        else:
            assert isinstance(r, E.CorruptCheckpointError), r


@SETTINGS
@given(key=which, data=st.data())
def test_random_overwrites(originals, scratch, key, data):
    raw, text, sig = originals[key]
    b = bytearray(raw)
    header_bias = data.draw(st.booleans(), label="bias to header")
    hi = min(len(raw), 256) - 1 if header_bias else len(raw) - 1
    k = data.draw(st.integers(1, 16), label="bytes")
    positions = data.draw(st.lists(st.integers(0, hi), min_size=k, max_size=k), label="positions")
    values = data.draw(st.binary(min_size=k, max_size=k), label="values")
    for p, v in zip(positions, values, strict=False):
        b[p] = v
    changed = {i for i in range(len(raw)) if b[i] != raw[i]}
    for mmap in (True, False):
        r = try_open(scratch, bytes(b), text, mmap)
        if changed <= MUTABLE:
            assert r == sig, f"only mutable bytes changed {sorted(changed)}: {r!r}"
        else:
            # header, text and payload are all covered by a check: a real change cannot load
            assert isinstance(r, E.CheckpointError), f"bytes {sorted(changed)} changed yet the file loaded"


@SETTINGS
@given(a=which, b=which, data=st.data())
def test_splices(originals, scratch, a, b, data):
    """prefix of one valid file + suffix of another, opened under the first's
    name and prompt: loads the first's content exactly, or is rejected with a
    CheckpointError. The second's content may load only when it holds the
    very same text (C and D hold A's): a file of another text (B under A's
    name) must never load."""
    ra, ta, sa = originals[a]
    rb, tb, sb = originals[b]
    i = data.draw(st.integers(0, len(ra)), label="cut a")
    aligned = data.draw(st.booleans(), label="same cut in b")
    j = min(i, len(rb)) if aligned else data.draw(st.integers(0, len(rb)), label="cut b")
    spliced = ra[:i] + rb[j:]
    allowed = (sa, sb) if tb == ta else (sa,)
    for mmap in (True, False):
        r = try_open(scratch, spliced, ta, mmap)
        assert_loaded_one_of(r, allowed, f"{a}[:{i}] + {b}[{j}:]")


@pytest.mark.parametrize("mmap", [True, False])
def test_splice_of_another_text_never_loads(originals, scratch, mmap):
    """The splices that matter most, deterministically (every 7th aligned
    cut): A's head with B's tail (B holds another text), opened under A's
    name and prompt, loads A's content exactly or is rejected -- never B's;
    B whole under A's name is rejected."""
    ra, ta, sa = originals["A"]
    rb, tb, sb = originals["B"]
    assert tb != ta and sb != sa
    assert isinstance(try_open(scratch, rb, ta, mmap), E.CheckpointError)
    for i in range(0, len(ra) + 1, 7):
        r = try_open(scratch, ra[:i] + rb[min(i, len(rb)) :], ta, mmap)
        assert isinstance(r, E.CheckpointError) or r == sa, f"A[:{i}] + B[{min(i, len(rb))}:] loaded B's content"


@SETTINGS
@given(key=which, data=st.data())
def test_multi_flips_truncation_and_garbage(originals, scratch, key, data):
    raw, text, sig = originals[key]
    b = bytearray(raw)
    for i in data.draw(st.lists(st.integers(0, len(raw) * 8 - 1), min_size=1, max_size=8), label="bit flips"):
        b[i // 8] ^= 1 << (i % 8)
    cut = data.draw(st.integers(0, len(b)), label="keep")
    tail = data.draw(st.binary(max_size=200), label="append")
    mutated = bytes(b[:cut]) + tail
    for mmap in (True, False):
        r = try_open(scratch, mutated, text, mmap)
        if mutated == raw or (
            len(mutated) == len(raw) and {i for i in range(len(raw)) if mutated[i] != raw[i]} <= MUTABLE
        ):
            assert r == sig
        else:
            assert isinstance(r, E.CheckpointError), "a damaged file loaded"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=400), version=st.sampled_from([1, 2]), use_magic=st.booleans())
def test_arbitrary_bytes(scratch, blob, version, use_magic):
    """Arbitrary bytes (behind a valid magic and version, or not) never crash."""
    data = (b"KVC" + bytes([version]) + blob) if use_magic else blob
    for mmap in (True, False):
        r = try_open(scratch, data, b"whatever text", mmap)
        if not isinstance(r, E.CheckpointError):
            assert r[1] == b"whatever text"  # only a file holding exactly the named text may load
