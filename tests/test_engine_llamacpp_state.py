"""The llama.cpp engine's payload checks (ds4.engines.llamacpp_state), on
synthetic state blobs: no model, no llama.cpp.

Every rejection is checked by its exact message, so that a check that fires
for the wrong reason (another check's bug hiding this one's) fails too. The
blobs follow the layout walk_state documents (llama-cpp-python 0.3.36, one
stream); tests/test_engine_llamacpp.py checks the same walker against real
blobs exported by llama.cpp."""

from __future__ import annotations

import re
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from ds4.engines.llamacpp_state import _Reader, check_payload, walk_state
from ds4.errors import EngineStateError

F16 = 1


def facts(**kw):
    base = {"arch": "llama", "n_layer": 2, "type_k": F16, "type_v": F16, "flash_attn": False}
    base.update(kw)
    return SimpleNamespace(**base)


def make_blob(
    n=3,
    *,
    arch=b"llama",
    n_stream=1,
    cells=None,
    v_trans=1,
    n_layer=2,
    k=(F16, 8),
    v=(F16, 2, 4),
    trailing=b"",
):
    """A whole-context state blob: ``k`` is (type, row bytes) for every
    layer; ``v`` is (type, element bytes, width) when ``v_trans``, else
    (type, row bytes). ``cells``: (pos, n_seq, seq_id) per cell."""
    cells = [(i, 1, 0) for i in range(n)] if cells is None else cells
    out = [struct.pack("<I", len(arch)), arch, struct.pack("<II", n_stream, len(cells))]
    out += [struct.pack("<iIi", *c) for c in cells]
    out.append(struct.pack("<II", v_trans, n_layer))
    for _ in range(n_layer):
        out += [struct.pack("<iQ", k[0], k[1]), bytes(k[1] * len(cells))]
    for _ in range(n_layer):
        if v_trans:
            out += [struct.pack("<iII", *v), bytes(v[1] * v[2] * len(cells))]
        else:
            out += [struct.pack("<iQ", *v), bytes(v[1] * len(cells))]
    out.append(trailing)
    return np.frombuffer(b"".join(out), dtype=np.uint8)


def rejects(blob, n, message, eng=None):
    """walk_state raises EngineStateError with exactly ``message``."""
    with pytest.raises(EngineStateError) as ei:
        walk_state(blob, n, eng or facts())
    assert ei.value.reason == message


# -- walk_state: what it accepts -------------------------------------------------
def test_walks_a_well_formed_blob():
    walk_state(make_blob(3), 3, facts())
    walk_state(make_blob(1, n_layer=1), 1, facts(n_layer=1))
    # flash attention: V stored in rows, like K
    walk_state(make_blob(3, v_trans=0, v=(F16, 8)), 3, facts(flash_attn=True))


def test_walks_cells_in_any_order():
    walk_state(make_blob(cells=[(2, 1, 0), (0, 1, 0), (1, 1, 0)]), 3, facts())


def test_walks_an_empty_cache():
    """Zero cells (never imported: check_payload wants n >= 1) is still a
    consistent blob; every read of zero bytes succeeds."""
    walk_state(make_blob(0), 0, facts())
    walk_state(make_blob(0, v_trans=0, v=(F16, 8)), 0, facts(flash_attn=True))


def test_an_empty_architecture_name_is_read_as_empty():
    walk_state(make_blob(2, arch=b""), 2, facts(arch=""))
    rejects(make_blob(2, arch=b""), 2, "llama_state is for architecture b'', not 'llama'")


def test_row_and_header_bounds_are_inclusive():
    """K/V rows of 1 byte .. 2**24 bytes, V elements of 1..16 bytes, V width
    1..2**20 are accepted; one past either end is not (tested below)."""
    for k_row in (1, 1 << 24):
        walk_state(make_blob(1, n_layer=1, k=(F16, k_row)), 1, facts(n_layer=1))
    for v in ((F16, 1, 1), (F16, 16, 1), (F16, 1, 1 << 20)):
        walk_state(make_blob(1, n_layer=1, v=v), 1, facts(n_layer=1))
    walk_state(make_blob(1, n_layer=1, v_trans=0, v=(F16, 1 << 24)), 1, facts(n_layer=1, flash_attn=True))


def test_reads_little_endian_fields_at_their_offsets():
    """A K type and row size whose bytes all differ: read at the right place."""
    eng = facts(type_k=0x01020304, n_layer=1)
    walk_state(make_blob(2, n_layer=1, k=(0x01020304, 0x010203)), 2, eng)
    rejects(
        make_blob(2, n_layer=1, k=(0x04030201, 0x010203)),
        2,
        "llama_state layer 0: bad K header (type 67305985, row 66051)",
        eng,
    )


# -- walk_state: what it rejects, and why -----------------------------------------
def test_rejects_a_foreign_architecture():
    rejects(make_blob(3, arch=b"gpt2"), 3, "llama_state is for architecture b'gpt2', not 'llama'")
    rejects(make_blob(3, arch=b"llam"), 3, "llama_state is for architecture b'llam', not 'llama'")
    rejects(make_blob(3, arch=b"llamaa"), 3, "llama_state is for architecture b'llamaa', not 'llama'")


def test_rejects_other_stream_counts():
    rejects(make_blob(3, n_stream=2), 3, "llama_state has 2 KV streams, expected 1")
    rejects(make_blob(3, n_stream=0), 3, "llama_state has 0 KV streams, expected 1")


def test_rejects_another_cell_count():
    rejects(make_blob(3), 2, "llama_state holds 3 cells, expected 2")
    rejects(make_blob(3), 4, "llama_state holds 3 cells, expected 4")


@pytest.mark.parametrize(
    "cells",
    [
        [(0, 1, 0), (1, 2, 0), (2, 1, 0)],  # a cell in two sequences
        [(0, 1, 0), (1, 0, 0), (2, 1, 0)],  # a cell in none
        [(0, 1, 0), (1, 1, 1), (2, 1, 0)],  # a cell of sequence 1
        [(0, 1, 0), (1, 1, 0), (2, 1, -1)],
    ],
)
def test_rejects_cells_outside_sequence_0(cells):
    rejects(make_blob(cells=cells), 3, "llama_state has cells outside sequence 0")


@pytest.mark.parametrize(
    "positions",
    [(0, 1, 3), (0, 1, 1), (1, 2, 3), (-1, 0, 1), (0, 2, 2), (2, 1, 1)],
)
def test_rejects_positions_other_than_0_to_n(positions):
    rejects(make_blob(cells=[(p, 1, 0) for p in positions]), 3, "llama_state cell positions are not 0..n-1")


def test_rejects_layouts_of_another_attention_mode():
    rejects(make_blob(3, v_trans=0, v=(F16, 8)), 3, "llama_state has v_trans=0, this engine uses 1")
    rejects(make_blob(3), 3, "llama_state has v_trans=1, this engine uses 0", facts(flash_attn=True))
    rejects(make_blob(3, v_trans=2), 3, "llama_state has v_trans=2, this engine uses 1")


def test_rejects_another_layer_count():
    rejects(make_blob(3, n_layer=3), 3, "llama_state has 3 layers, the model 2")
    rejects(make_blob(3, n_layer=1), 3, "llama_state has 1 layers, the model 2")


@pytest.mark.parametrize(("k_type", "k_row"), [(0, 8), (2, 8), (F16, 0), (F16, (1 << 24) + 1), (F16, 1 << 40)])
def test_rejects_bad_k_headers(k_type, k_row):
    blob = make_blob(1, n_layer=1, k=(k_type, 8)).copy()
    blob[37 + 4 : 37 + 12].view("<u8")[0] = k_row  # the header only: the check comes first
    rejects(blob, 1, f"llama_state layer 0: bad K header (type {k_type}, row {k_row})", facts(n_layer=1))


@pytest.mark.parametrize("v", [(0, 2, 4), (2, 2, 4), (F16, 0, 4), (F16, 17, 4), (F16, 2, 0), (F16, 1, (1 << 20) + 1)])
def test_rejects_bad_transposed_v_headers(v):
    rejects(make_blob(1, n_layer=1, v=v), 1, "llama_state layer 0: bad V header", facts(n_layer=1))


@pytest.mark.parametrize("v", [(0, 8), (2, 8), (F16, 0), (F16, (1 << 24) + 1)])
def test_rejects_bad_v_row_headers(v):
    eng = facts(n_layer=1, flash_attn=True)
    rejects(
        make_blob(1, n_layer=1, v_trans=0, v=v),
        1,
        f"llama_state layer 0: bad V header (type {v[0]}, row {v[1]})",
        eng,
    )


def test_checks_every_layer_not_only_the_first():
    blob = make_blob(2).copy()
    k1 = 4 + 5 + 8 + 24 + 8 + (12 + 16)  # layer 1's K header
    blob[k1 : k1 + 4].view("<i4")[0] = 0
    rejects(blob, 2, "llama_state layer 1: bad K header (type 0, row 8)")
    blob = make_blob(2).copy()
    v1 = 4 + 5 + 8 + 24 + 8 + 2 * (12 + 16) + (12 + 16)  # layer 1's V header
    blob[v1 : v1 + 4].view("<i4")[0] = 0
    rejects(blob, 2, "llama_state layer 1: bad V header")


def test_rejects_trailing_bytes():
    rejects(make_blob(3, trailing=b"\0"), 3, "llama_state has 1 trailing bytes")
    rejects(make_blob(3, trailing=b"abcde"), 3, "llama_state has 5 trailing bytes")


# every section, cut one byte short of its end (and right at its start)
SECTIONS = [
    # (what, where it starts, its length) in make_blob(2)
    ("the architecture name", 0, 4),
    ("the architecture name", 4, 5),
    ("the cache header", 9, 8),
    ("the cell table", 17, 24),
    ("the layer header", 41, 8),
    ("a K header", 49, 12),
    ("K rows", 61, 16),
    ("a V header", 49 + 2 * 28, 12),
    ("V rows", 49 + 2 * 28 + 12, 16),
]


@pytest.mark.parametrize(("what", "start", "length"), SECTIONS)
def test_rejects_truncation_in_every_section(what, start, length):
    blob = make_blob(2)
    assert blob.size == 49 + 4 * 28
    for cut in (start + length - 1, start) if length > 1 else (start,):
        rejects(blob[:cut], 2, f"llama_state truncated in {what} (at byte {start} of {cut})")


def test_rejects_a_huge_architecture_length():
    """2**32 - 1 would make llama.cpp allocate 4 GiB before failing."""
    blob = make_blob(2).copy()
    blob[0:4].view("<u4")[0] = 2**32 - 1
    rejects(blob, 2, f"llama_state truncated in the architecture name (at byte 4 of {blob.size})")


def test_rejects_a_cell_count_past_the_end():
    blob = make_blob(2).copy()
    blob[13:17].view("<u4")[0] = 10**6
    rejects(blob, 10**6, f"llama_state truncated in the cell table (at byte 17 of {blob.size})")


def test_rejects_rows_past_the_end():
    blob = make_blob(2, n_layer=1).copy()
    blob[49 + 4 : 49 + 12].view("<u8")[0] = 1 << 24
    rejects(blob, 2, f"llama_state truncated in K rows (at byte 61 of {blob.size})", facts(n_layer=1))


def test_reader_refuses_negative_lengths():
    r = _Reader(np.zeros(8, np.uint8))
    r.take(3, "x")
    with pytest.raises(EngineStateError, match=re.escape("llama_state truncated in y (at byte 3 of 8)")):
        r.take(-1, "y")
    assert r.off == 3
    assert r.take(5, "z").size == 5 and r.off == 8
    assert r.take(0, "end").size == 0


# -- check_payload ----------------------------------------------------------------
V = 16


def payload(n=3, **kw):
    p = {"llama_state": make_blob(n), "logits": np.linspace(-1, 1, V, dtype=np.float32)}
    p.update(kw)
    return p


def payload_rejected(arrays, n, message, n_ctx=8):
    with pytest.raises(EngineStateError) as ei:
        check_payload(arrays, n, n_ctx, V)
    assert ei.value.reason == message


def test_check_payload_returns_contiguous_blob_a_logits_copy_and_an_int():
    p = payload()
    p["logits"] = p["logits"].copy()  # writable: the copy must not alias it
    blob, logits, n = check_payload(p, np.int64(3), 8, V)
    assert type(n) is int and n == 3
    assert np.array_equal(blob, p["llama_state"]) and blob.flags.c_contiguous
    assert logits.dtype == np.float32 and np.array_equal(logits, p["logits"])
    assert not np.shares_memory(logits, p["logits"])
    p["logits"][:] = 7
    assert logits[0] == np.float32(-1)


def test_check_payload_makes_a_strided_blob_contiguous():
    b = make_blob(3)
    strided = np.repeat(b, 2)[::2]
    assert not strided.flags.c_contiguous
    blob, _, _ = check_payload(payload(llama_state=strided), 3, 8, V)
    assert blob.flags.c_contiguous and np.array_equal(blob, b)


def test_check_payload_token_count_bounds():
    for n in (1, 8):
        assert check_payload(payload(), n, 8, V)[2] == n
    for n in (0, -1, 9):
        payload_rejected(payload(), n, f"n_tokens {n} outside 1..8")


@pytest.mark.parametrize("n", [True, False, 3.0, "3", None])
def test_check_payload_token_count_type(n):
    payload_rejected(payload(), n, f"n_tokens must be an int, got {type(n).__name__}")


@pytest.mark.parametrize("arrays", [[1, 2], make_blob(2), "llama_state", None, 3])
def test_check_payload_wants_a_mapping(arrays):
    payload_rejected(arrays, 3, "state arrays must be a mapping of names to arrays")


@pytest.mark.parametrize(
    "names",
    [["llama_state"], ["logits"], ["llama_state", "logits", "x"], ["state", "logits"], []],
)
def test_check_payload_wants_exactly_the_two_arrays(names):
    full = payload()
    arrays = {k: full.get(k, full["logits"]) for k in names}
    payload_rejected(arrays, 3, f"expected arrays llama_state and logits, got {sorted(names)}")


@pytest.mark.parametrize(
    "blob",
    [
        make_blob(3).view(np.int8),
        make_blob(3).reshape(1, -1),
        make_blob(3)[:0],
        list(make_blob(3)),
        make_blob(3).astype(np.uint16),
    ],
)
def test_check_payload_blob_type(blob):
    payload_rejected(payload(llama_state=blob), 3, "llama_state must be a non-empty 1-D uint8 array")


def test_check_payload_accepts_a_one_byte_blob():
    """Its structure is walk_state's business."""
    assert check_payload(payload(llama_state=np.zeros(1, np.uint8)), 3, 8, V)[0].size == 1


@pytest.mark.parametrize(
    "logits",
    [
        np.zeros(V, np.float64),
        np.zeros(V - 1, np.float32),
        np.zeros(V + 1, np.float32),
        np.zeros((1, V), np.float32),
        [0.0] * V,
        np.zeros(V, np.float16),
    ],
)
def test_check_payload_logits_type(logits):
    payload_rejected(payload(logits=logits), 3, f"logits must be float32[{V}]")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_payload_logits_finite(bad):
    logits = np.zeros(V, np.float32)
    logits[V - 1] = bad
    payload_rejected(payload(logits=logits), 3, "logits contain NaN or infinity")
