"""Issue 13, item 1: the bytes an engine loads are the bytes that were
verified, whatever another process does to the file meanwhile.

A writer process rewrites checkpoint A *in place* with the bytes of B (a
file of the same length and layout: another conversation), and back, both
as ``dd conv=notrunc`` does (open for writing, overwrite) and as ``cp B A``
does (open with ``O_TRUNC``, write), while this process loads A into a
session again and again for 20 seconds. A load that succeeds must hold A's
state; before the lease (a map read after its checksum) it could hold B's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ds4
from ds4.errors import CheckpointError

CTX = 2048
RACE_SECONDS = 20.0

WRITER = r"""
import os, sys, time
a, b_bytes_path, a_bytes_path, stop = sys.argv[1:5]
mine = {"B": open(b_bytes_path, "rb").read(), "A": open(a_bytes_path, "rb").read()}
n = 0
while not os.path.exists(stop):
    time.sleep(0.002)  # A as it should be, for a while: loads can verify it
    for which in ("B", "A"):
        data = mine[which]
        if n % 2:  # cp B A: truncate, then write
            fd = os.open(a, os.O_WRONLY | os.O_TRUNC)
        else:  # dd conv=notrunc: overwrite in place
            fd = os.open(a, os.O_WRONLY)
        try:
            half = len(data) // 2
            os.write(fd, data[:half])
            os.write(fd, data[half:])
        finally:
            os.close(fd)
        n += 1
print(n)
"""


def _state(eng, text):
    s = ds4.Session(eng, ctx=CTX)
    s.sync(eng.tokenize(text, special=True))
    return s


@pytest.mark.parametrize("mmap", [True])
def test_in_place_rewrite_race_loads_no_wrong_state(tmp_path, mmap):
    eng = ds4.ReferenceEngine()
    text_a = "conversation A: " + "alpha beta gamma " * 30
    text_b = "conversation B: " + "delta omega sigma " * 30
    text_b = text_b[: len(text_a)]
    sa, sb = _state(eng, text_a), _state(eng, text_b)
    assert sa.n_past == sb.n_past and len(sa.text_bytes()) == len(sb.text_bytes())
    d = tmp_path / "kv"
    d.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    pa = os.path.join(d, ds4._core.sha1_hex(sa.text_bytes()) + ".kv")
    pb = os.path.join(other, ds4._core.sha1_hex(sb.text_bytes()) + ".kv")
    for s, p in ((sa, pa), (sb, pb)):
        ds4.write_checkpoint(p, s.text_bytes(), s.export_arrays(), abi=s.payload_abi, tokens=s.n_past, ctx=CTX)
    a_bytes, b_bytes = Path(pa).read_bytes(), Path(pb).read_bytes()
    assert len(a_bytes) == len(b_bytes) and a_bytes != b_bytes
    a_copy = tmp_path / "a.bytes"
    a_copy.write_bytes(a_bytes)
    stop = tmp_path / "stop"
    want_tokens, want_logits = sa.tokens, np.array(sa.logits)

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, pa, str(pb), str(a_copy), str(stop)], stdout=subprocess.PIPE, text=True
    )
    loads = wrong = rejected = leased = copied = 0
    codes: dict[str, int] = {}
    want_state = sa.export_arrays()

    def holds_a(sess):
        got = sess.export_arrays()
        same = got.keys() == want_state.keys() and all(np.array_equal(got[k], want_state[k]) for k in got)
        return same and sess.tokens == want_tokens and np.array_equal(sess.logits, want_logits)

    s = ds4.Session(eng, ctx=CTX)
    # A slow engine: its import starts a moment after the load's own checks
    # (a large llama.cpp state takes milliseconds to copy), which is the
    # window a rewrite in place has to land in.
    real_import = s._ectx.import_state

    def slow_import(state, n_tokens):
        time.sleep(0.002)
        real_import(state, n_tokens)

    s._ectx.import_state = slow_import
    deadline = time.monotonic() + RACE_SECONDS
    try:
        while time.monotonic() < deadline:
            try:
                ck = ds4.open_checkpoint(pa, prompt=sa.text_bytes(), expected_abi=s.payload_abi, ctx=CTX - 1, mmap=mmap)
            except CheckpointError as e:  # a version that is not A's, refused by verification
                rejected += 1
                codes[e.code] = codes.get(e.code, 0) + 1
                continue
            lease_now = ck.leased
            try:
                s.load_checkpoint(ck)
            except CheckpointError as e:  # refused while loading
                rejected += 1
                codes[e.code] = codes.get(e.code, 0) + 1
                # refused before anything changed (the session keeps what it
                # held: A from an earlier load), or invalidated: never half-loaded
                wrong += s.checkpoint_valid and not holds_a(s)
                continue
            finally:
                del ck
            loads += 1
            leased += lease_now
            copied += not lease_now
            wrong += not holds_a(s)
    finally:
        stop.touch()
        out, _ = writer.communicate(timeout=120)
    rewrites = int(out.strip() or 0)
    print(f"loads={loads} (leased map {leased}, copy {copied}) rejected={rejected} {codes} rewrites={rewrites}")
    assert writer.returncode == 0
    assert wrong == 0, f"{wrong} of {loads} loads held another file's state"
    assert loads >= 50 and rewrites >= 50, (loads, rewrites)
    assert leased > 0
    # Every rejection is of a version that is not A's: typed, corrupt or changed.
    assert set(codes) <= {
        "payload_checksum",
        "text_sha1_mismatch",
        "name_mismatch",
        "truncated",
        "not_prefix",
        "changed_while_loading",
        "too_short",
        "tensor_table",
        "bad_metadata",
        "header_checksum",
        "bad_padding",
        "token_count_mismatch",
        "tokens_text_mismatch",
        "engine_rejected",
    }, codes
