"""SHA-1 and prefix helpers of ds4._core against hashlib and pure-Python
definitions, and the GIL being released around the heavy ones."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4._core as core

PROPS = settings(max_examples=300, deadline=None)


def py_common_prefix_len(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- sha1_hex -------------------------------------------------------------------


def test_sha1_vectors():
    assert core.sha1_hex(b"") == "da39a3ee5e6b4b0d3255bfef95601890afd80709"
    assert core.sha1_hex(b"abc") == "a9993e364706816aba3e25717850c26c9cd0d89d"
    assert core.sha1_hex(b"a" * 1_000_000) == "34aa973cd4c4daa4f61eeb2bdbad27316534016f"


@PROPS
@given(st.binary(max_size=5000))
def test_sha1_hex_matches_hashlib(data):
    assert core.sha1_hex(data) == hashlib.sha1(data).hexdigest()


@pytest.mark.parametrize("n", [3 << 20, (1 << 16), (1 << 16) + 1, 63, 64, 65, 55, 56])
def test_sha1_hex_sizes_and_buffer_types(n):
    data = os.urandom(n)
    want = hashlib.sha1(data).hexdigest()
    for obj in (
        data,
        bytearray(data),
        memoryview(data),
        np.frombuffer(data, np.uint8),
        np.frombuffer(data, np.uint8).copy(),
        memoryview(bytearray(data)),
    ):
        assert core.sha1_hex(obj) == want, type(obj)
    assert core.sha1_hex(memoryview(data)[1:]) == hashlib.sha1(data[1:]).hexdigest()


def test_sha1_hex_empty_buffers():
    want = hashlib.sha1(b"").hexdigest()
    for obj in (
        b"",
        bytearray(),
        memoryview(b""),
        np.empty(0, np.uint8),
        np.zeros(10, np.uint8)[5:5],
        memoryview(bytearray(b"ab"))[1:1],
    ):
        assert core.sha1_hex(obj) == want, type(obj)
    assert core.sha1_prefixes(bytearray(), [0]) == [want]
    assert core.common_prefix_len(bytearray(), b"") == 0 and core.is_byte_prefix(np.empty(0, np.uint8), bytearray())


def test_sha1_hex_rejects_what_it_cannot_hash_exactly():
    data = bytes(range(200))
    # a strided view must not be hashed as if it were contiguous
    with pytest.raises((ValueError, BufferError)):
        core.sha1_hex(memoryview(data)[::2])
    with pytest.raises(TypeError):
        core.sha1_hex("text")  # str must be encoded by the caller
    with pytest.raises((TypeError, ValueError, BufferError)):
        core.sha1_hex(np.zeros(4, np.float32))
    with pytest.raises((TypeError, ValueError, BufferError)):
        core.sha1_hex(np.zeros((4, 4), np.uint8)[:, ::2])


# -- sha1_prefixes ------------------------------------------------------------------


@PROPS
@given(data=st.binary(max_size=3000), extra=st.data())
def test_sha1_prefixes_match_hashlib(data, extra):
    lengths = extra.draw(st.lists(st.integers(0, len(data) + 200), max_size=40))
    lengths += extra.draw(st.lists(st.sampled_from(lengths), max_size=5)) if lengths else []  # duplicates
    got = core.sha1_prefixes(data, lengths)
    assert len(got) == len(lengths)
    for n, h in zip(lengths, got, strict=True):
        assert h == (hashlib.sha1(data[:n]).hexdigest() if n <= len(data) else None), n


def test_sha1_prefixes_edge_cases():
    data = os.urandom(1 << 20)
    lengths = [len(data), 0, 64, 63, 65, 1 << 19, len(data) + 1, 10**12, 64, 1 << 19]
    got = core.sha1_prefixes(np.frombuffer(data, np.uint8), lengths)
    for n, h in zip(lengths, got, strict=True):
        assert h == (hashlib.sha1(data[:n]).hexdigest() if n <= len(data) else None)
    assert core.sha1_prefixes(data, []) == []
    assert core.sha1_prefixes(b"", [0, 1]) == [hashlib.sha1(b"").hexdigest(), None]
    with pytest.raises(OverflowError):
        core.sha1_prefixes(data, [-1])
    with pytest.raises(OverflowError):
        core.sha1_prefixes(data, [1 << 64])


# -- byte prefix / common prefix ------------------------------------------------


pairs = st.one_of(
    st.tuples(st.binary(max_size=300), st.binary(max_size=300)),
    st.builds(lambda p, a, b: (p + a, p + b), st.binary(max_size=600), st.binary(max_size=40), st.binary(max_size=40)),
    st.builds(lambda p, a: (p, p + a), st.binary(max_size=600), st.binary(max_size=40)),
    st.builds(
        lambda p, i, v: (p, p[:i] + bytes([v]) + p[i + 1 :]),
        st.binary(min_size=1, max_size=600),
        st.integers(0, 599),
        st.integers(0, 255),
    ),
)


@PROPS
@given(pairs)
def test_is_byte_prefix_and_common_prefix_len(ab):
    a, b = ab
    assert core.is_byte_prefix(a, b) == b.startswith(a)
    assert core.is_byte_prefix(b, a) == a.startswith(b)
    n = py_common_prefix_len(a, b)
    assert core.common_prefix_len(a, b) == n == core.common_prefix_len(b, a)
    assert core.common_prefix_len(bytearray(a), memoryview(b)) == n


def test_prefix_helpers_large():
    """Above 64 KiB the GIL-free path is taken: same answers."""
    a = os.urandom(1 << 20)
    for i in (0, 7, 8, 9, (1 << 20) - 1, 123457):
        b = bytearray(a)
        b[i] ^= 0x40
        assert core.common_prefix_len(a, bytes(b)) == i
        assert not core.is_byte_prefix(a, bytes(b))
    assert core.common_prefix_len(a, a + b"x") == len(a)
    assert core.is_byte_prefix(a, a + b"tail") and core.is_byte_prefix(a, a)
    assert not core.is_byte_prefix(a + b"x", a)
    assert core.is_byte_prefix(b"", b"") and core.common_prefix_len(b"", a) == 0


@PROPS
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=60),
    st.lists(st.integers(0, 2**32 - 1), max_size=60),
    st.lists(st.integers(0, 2**32 - 1), max_size=60),
)
def test_common_token_prefix(p, a, b):
    x, y = p + a, p + b
    want = 0
    for s, t in zip(x, y, strict=False):
        if s != t:
            break
        want += 1
    assert core.common_token_prefix(x, y) == want == core.common_token_prefix(y, x)


def test_common_token_prefix_rejects_out_of_range():
    with pytest.raises(OverflowError):
        core.common_token_prefix([2**32], [0])
    with pytest.raises(OverflowError):
        core.common_token_prefix([-1], [0])


# -- the GIL is released ------------------------------------------------------------
#
# The probe: while this thread runs ``fn()``, how many increments does another
# Python thread make? Forced GIL hand-offs are switched off for the
# measurement (a switch interval far longer than the test), so the other
# thread can run Python code only while this thread *gives up* the GIL: a
# call that holds the GIL from start to end lets it make exactly zero
# increments -- every run, however long the call and however busy the machine
# -- and a call that releases the GIL lets it run for the whole call. No
# wall-clock threshold is involved.

CHUNK = 2000  # increments between the counter's short sleeps


@contextlib.contextmanager
def _no_forced_gil_switches():
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def progress_during(fn):
    """Increments made by another Python thread while ``fn()`` runs here."""
    count = [0]
    stop = threading.Event()
    started = threading.Event()

    def counter():
        started.set()
        while not stop.is_set():
            for _ in range(CHUNK):
                count[0] += 1
            # a real block (not a forced switch): lets a thread waiting for
            # the GIL take it, so the main thread is never starved
            time.sleep(0.0005)

    with _no_forced_gil_switches():
        t = threading.Thread(target=counter, daemon=True)
        t.start()
        started.wait()
        before = count[0]
        fn()
        during = count[0] - before
        stop.set()
        t.join()
    return during


def releases_gil(fn, attempts=5):
    """The check both tests use: ``(passed, increments per attempt)``. It
    passes when, in one of a few attempts (tolerating a busy machine), the
    other thread made at least ten chunks of increments during ``fn()``. A
    GIL holder scores exactly 0 in every attempt."""
    results = []
    for _ in range(attempts):
        results.append(progress_during(fn))
        if results[-1] >= 10 * CHUNK:
            return True, results
    return False, results


@pytest.fixture(scope="module")
def big():
    return np.frombuffer(os.urandom(64 << 20), np.uint8)


def _hashlib_small_chunks(buf):
    """A GIL-holding stand-in for a SHA-1 of ``buf``: hashlib keeps the GIL
    for updates under 2 KiB, and the loop between them is Python code."""
    h = hashlib.sha1()
    mv = memoryview(buf)
    for off in range(0, len(mv), 1024):
        h.update(mv[off : off + 1024])
    return h.hexdigest()


def _python_busy_loop():
    x = 0
    for i in range(3_000_000):
        x += i
    return x


@pytest.mark.timeout(120)
def test_gil_check_fails_for_a_gil_holder(big):
    """The control: the same check fails for stand-ins that hold the GIL (a C
    call in a Python loop, a pure-Python loop) -- with no progress at all, in
    every attempt -- and passes for hashlib on the whole buffer (which
    releases the GIL)."""
    assert _hashlib_small_chunks(big) == hashlib.sha1(big).hexdigest()
    for holder in (lambda: _hashlib_small_chunks(big), _python_busy_loop):
        assert releases_gil(holder) == (False, [0] * 5)
    ok, results = releases_gil(lambda: hashlib.sha1(big))
    assert ok, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["sha1_hex", "sha1_prefixes"])
def test_gil_released(big, which):
    """Another Python thread makes substantial progress (many chunks of
    increments) while one ``_core`` call works on 64 MiB; a GIL holder lets
    it make none (test_gil_check_fails_for_a_gil_holder)."""
    want = hashlib.sha1(big).hexdigest()
    if which == "sha1_hex":
        fn = lambda: core.sha1_hex(big)  # noqa: E731
        assert fn() == want
    else:
        fn = lambda: core.sha1_prefixes(big, [len(big), 1 << 20])  # noqa: E731
        assert fn()[0] == want
    ok, results = releases_gil(fn)
    assert ok, f"another thread made too little progress during {which} on 64 MiB (increments per attempt): {results}"
