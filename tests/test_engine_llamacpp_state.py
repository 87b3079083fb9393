"""The llama.cpp engine's payload checks (ds4.engines.llamacpp_state), on
synthetic state blobs: no model, no llama.cpp.

Every rejection is checked by its exact message, so that a check that fires
for the wrong reason (another check's bug hiding this one's) fails too. The
blobs follow the layout walk_state documents (llama-cpp-python 0.3.36, a
sequence-0 state: one cache for a plain model, a full and a windowed one for
a sliding-window model); tests/test_engine_llamacpp.py and
tests/test_models_exact.py check the same walker against real blobs
exported by llama.cpp for SmolLM2 and Gemma 3."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.engines.llamacpp_state import (
    SEQ_MAGIC,
    CacheLayout,
    StateLayout,
    _Reader,
    check_payload,
    full_layout,
    learn_layout,
    walk_state,
)
from ds4.errors import EngineStateError

F16 = 1
K = (F16, 8)
V_T = (F16, 2, 4)


def cache(n_layer=2, *, n_swa=0, v_trans=True, k=K, v=V_T):
    return CacheLayout(n_swa, v_trans, (k,) * n_layer, (v,) * n_layer)


PLAIN = StateLayout((cache(),))
SWA = StateLayout((cache(1), cache(3, n_swa=4)))


def cache_bytes(positions, c, *, n_stream=1, cells=None, v_trans=None, n_layer=None, k=None, v=None, fill=None):
    """One cache's part of a blob: the cells at ``positions`` (or the raw
    ``cells``: (pos, n_seq, seq_id) each), then every layer's K and V with
    ``c``'s headers unless overridden; the data bytes are ``fill(pos)`` per
    cell (default: the position's low byte, so layouts can be told apart)."""
    cells = [(p, 1, 0) for p in positions] if cells is None else cells
    fill = fill or (lambda p: p & 0xFF)
    vt = int(c.v_trans) if v_trans is None else v_trans
    nl = len(c.k) if n_layer is None else n_layer
    out = [struct.pack("<II", n_stream, len(cells)), b"".join(struct.pack("<iIi", *x) for x in cells)]
    out.append(struct.pack("<II", vt, nl))
    for il in range(nl):
        kt, krow = k or c.k[min(il, len(c.k) - 1)]
        out += [struct.pack("<iQ", kt, krow), b"".join(bytes([fill(x[0])]) * krow for x in cells)]
    for il in range(nl):
        vh = v or c.v[min(il, len(c.v) - 1)]
        if vt:
            _, el, embd = vh
            col = b"".join(bytes([fill(x[0])]) * el for x in cells)
            out += [struct.pack("<iII", *vh), col * embd]
        else:
            out += [struct.pack("<iQ", *vh), b"".join(bytes([fill(x[0])]) * vh[1] for x in cells)]
    return b"".join(out)


def make_blob(n=3, layout=PLAIN, *, magic=SEQ_MAGIC, seq=0, trailing=b"", caches=None):
    """A well-formed sequence-0 state of ``n`` tokens under ``layout`` (each
    windowed cache holding its last ``min(n, n_swa)`` positions), or the
    given cache parts."""
    parts = [struct.pack("<Ii", magic, seq)]
    if caches is None:
        caches = [cache_bytes(range(n - c.cells(n), n), c) for c in layout.caches]
    parts += caches
    parts.append(trailing)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def rejects(blob, n, message, layout=PLAIN):
    """walk_state raises EngineStateError with exactly ``message``."""
    with pytest.raises(EngineStateError) as ei:
        walk_state(blob, n, layout)
    assert ei.value.reason == message


# -- walk_state: what it accepts -------------------------------------------------
def test_walks_a_well_formed_blob():
    for n in (1, 3, 9):
        assert len(walk_state(make_blob(n), n, PLAIN)) == 1
        assert make_blob(n).size == PLAIN.size(n)
    one = StateLayout((cache(1),))
    walk_state(make_blob(1, one), 1, one)
    # flash attention: V stored in rows, like K
    rows = StateLayout((cache(v_trans=False, v=(F16, 8)),))
    walk_state(make_blob(3, rows), 3, rows)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 11])
def test_walks_a_windowed_blob(n):
    """The windowed cache holds exactly its last min(n, n_swa) positions."""
    blob = make_blob(n, SWA)
    spans = walk_state(blob, n, SWA)
    assert [s.cells for s in spans] == [n, min(n, 4)]
    assert blob.size == SWA.size(n)


def test_layout_sizes_and_description():
    assert PLAIN.caches[0].bytes_per_cell() == 12 + 2 * 8 + 2 * 2 * 4
    assert PLAIN.size(3) == 8 + 8 + 8 + 24 * 2 + 3 * PLAIN.caches[0].bytes_per_cell()
    assert re.fullmatch(r"2:[0-9a-f]{12}", PLAIN.describe())
    assert re.fullmatch(r"1\+3w4:[0-9a-f]{12}", SWA.describe())
    # any header change changes the description (the payload ABI)
    other = StateLayout((cache(k=(F16, 16)),))
    assert other.describe() != PLAIN.describe()
    assert not PLAIN.windowed and SWA.windowed


def test_reads_little_endian_fields_at_their_offsets():
    b = make_blob(3)
    assert b[:4].tobytes() == struct.pack("<I", SEQ_MAGIC)
    assert b[8:16].tobytes() == struct.pack("<II", 1, 3)


# -- walk_state: what it rejects -------------------------------------------------
def test_rejects_another_magic_and_another_sequence():
    rejects(make_blob(3, magic=SEQ_MAGIC ^ 1), 3, f"llama_state is not a sequence state (magic {SEQ_MAGIC ^ 1:#010x})")
    rejects(make_blob(3, seq=2), 3, "llama_state is of sequence 2, expected 0")


def test_rejects_other_stream_counts():
    for ns in (0, 2):
        blob = make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], n_stream=ns)])
        rejects(blob, 3, f"llama_state has {ns} KV streams, expected 1")


def test_rejects_another_cell_count():
    rejects(make_blob(3), 2, "llama_state holds 3 cells, expected 2")
    rejects(make_blob(3), 4, "llama_state holds 3 cells, expected 4")


@pytest.mark.parametrize("cells", [[(0, 1, 0), (1, 2, 0), (2, 1, 0)], [(0, 1, 0), (1, 1, 1), (2, 1, 0)]])
def test_rejects_cells_outside_sequence_0(cells):
    blob = make_blob(caches=[cache_bytes(None, PLAIN.caches[0], cells=cells)])
    rejects(blob, 3, "llama_state has cells outside sequence 0")


@pytest.mark.parametrize("positions", [[0, 1, 3], [0, 0, 1], [-1, 0, 1], [1, 2, 3], [2, 0, 1], [0, 2, 1]])
def test_rejects_positions_other_than_0_to_n_in_order(positions):
    """In order: a sequence restore puts cells where they come, and only
    ascending positions give the cold layout."""
    blob = make_blob(caches=[cache_bytes(positions, PLAIN.caches[0])])
    rejects(blob, 3, "llama_state cell positions are not 0..2 in order")


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7], [1, 2, 3, 4], [2, 3, 4, 6], [3, 2, 4, 5]])
def test_rejects_a_window_other_than_the_last_n_swa_positions(positions):
    """n = 6, window 4: the windowed cache must hold exactly 2..5."""
    c0, c1 = SWA.caches
    blob = make_blob(caches=[cache_bytes(range(6), c0), cache_bytes(positions, c1)])
    if len(positions) != 4:
        rejects(blob, 6, f"llama_state holds {len(positions)} cells, expected 4", SWA)
    else:
        rejects(blob, 6, "llama_state cell positions are not 2..5 in order", SWA)


def test_rejects_a_missing_or_an_extra_cache():
    c0 = SWA.caches[0]
    only_full = make_blob(caches=[cache_bytes(range(3), c0)])
    rejects(
        only_full, 3, f"llama_state truncated in the cache header (at byte {only_full.size} of {only_full.size})", SWA
    )
    both = make_blob(3, SWA)
    rejects(both, 3, f"llama_state has {both.size - only_full.size} trailing bytes", StateLayout((c0,)))


def test_rejects_layouts_of_another_attention_mode():
    blob = make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], v_trans=0, v=(F16, 8))])
    rejects(blob, 3, "llama_state cache 0 has v_trans=0, this engine uses 1")


def test_rejects_another_layer_count():
    blob = make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], n_layer=3)])
    rejects(blob, 3, "llama_state cache 0 has 3 layers, the model 2")


@pytest.mark.parametrize("k", [(0, 8), (F16, 16), (F16, 7)])
def test_rejects_bad_k_headers(k):
    blob = make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], k=k)])
    rejects(blob, 3, f"llama_state cache 0 layer 0: bad K header (type {k[0]}, row {k[1]})")


@pytest.mark.parametrize("v", [(0, 2, 4), (F16, 4, 4), (F16, 2, 8)])
def test_rejects_bad_transposed_v_headers(v):
    blob = make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], v=v)])
    rejects(blob, 3, f"llama_state cache 0 layer 0: bad V header {v}")


def test_checks_every_layer_not_only_the_first():
    c = PLAIN.caches[0]
    good = cache_bytes(range(3), c)
    raw = bytearray(good)
    # layer 1's K header sits after the cells, the layer header and layer 0's K
    at = 8 + 12 * 3 + 8 + 12 + 8 * 3
    raw[at : at + 12] = struct.pack("<iQ", F16, 9)
    rejects(make_blob(caches=[bytes(raw)]), 3, "llama_state cache 0 layer 1: bad K header (type 1, row 9)")


def test_rejects_trailing_bytes():
    rejects(make_blob(3, trailing=b"\0"), 3, "llama_state has 1 trailing bytes")


def test_rejects_truncation_anywhere():
    """Every prefix of a good blob is refused, with a truncation message."""
    for layout, n in ((PLAIN, 3), (SWA, 6)):
        b = make_blob(n, layout)
        for cut in range(b.size):
            with pytest.raises(EngineStateError) as ei:
                walk_state(b[:cut], n, layout)
            assert ei.value.reason.startswith("llama_state truncated in "), (cut, ei.value.reason)


def test_rejects_a_cell_count_past_the_end():
    blob = make_blob(3).copy()
    blob[12:16].view("<u4")[0] = 10**9
    rejects(blob, 3, "llama_state holds 1000000000 cells, expected 3")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 255), st.sampled_from([(PLAIN, 3), (SWA, 6), (SWA, 2)]))
def test_any_one_byte_change_is_refused_or_walked_to_the_same_structure(at, value, case):
    """Fuzz: a byte changed anywhere either fails with EngineStateError or
    (a data byte) leaves the structure exactly as it was; never another
    exception, never a different cell count or span."""
    layout, n = case
    good = make_blob(n, layout)
    ref = [(s.start, s.cells, s.end) for s in walk_state(good, n, layout)]
    b = good.copy()
    b[at % b.size] = value
    try:
        spans = walk_state(b, n, layout)
    except EngineStateError:
        return
    assert [(s.start, s.cells, s.end) for s in spans] == ref


# -- learn_layout ------------------------------------------------------------------
def test_learns_the_layout_of_its_own_states():
    assert learn_layout(make_blob(3), 3, 0) == PLAIN
    assert learn_layout(make_blob(3, SWA), 3, 4) == SWA
    rows = StateLayout((cache(v_trans=False, v=(F16, 8)),))
    assert learn_layout(make_blob(1, rows), 1, 0) == rows


@pytest.mark.parametrize(
    "blob, n_swa, message",
    [
        (make_blob(3, SWA), 0, "llama_state has 2 caches (window 0): not a layout this engine knows"),
        (
            make_blob(3, StateLayout((cache(), cache(), cache()))),
            4,
            "llama_state has 3 caches (window 4): not a layout this engine knows",
        ),
        (
            make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], v_trans=2)]),
            0,
            "llama_state has a bad layer header",
        ),
        (
            make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], n_layer=0)]),
            0,
            "llama_state has a bad layer header",
        ),
        (make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], k=(F16, 0))]), 0, "llama_state has a bad K header"),
        (
            make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], v=(F16, 0, 4))]),
            0,
            "llama_state has a bad V header",
        ),
        (
            make_blob(caches=[cache_bytes(range(3), PLAIN.caches[0], v=(F16, 2, 0))]),
            0,
            "llama_state has a bad V header",
        ),
    ],
)
def test_learn_refuses_what_it_does_not_know(blob, n_swa, message):
    with pytest.raises(EngineStateError) as ei:
        learn_layout(blob, 3, n_swa)
    assert ei.value.reason == message


# -- full_layout ---------------------------------------------------------------------
def test_full_layout_is_the_blob_itself_without_a_short_cache():
    b = make_blob(3, SWA)  # 3 < window 4: every cell present
    assert full_layout(b, 3, SWA, walk_state(b, 3, SWA)) is b
    p = make_blob(9)
    assert full_layout(p, 9, PLAIN, walk_state(p, 9, PLAIN)) is p


@pytest.mark.parametrize("rows", [False, True])
def test_full_layout_gives_the_window_its_earlier_cells_as_zeros(rows):
    """n = 7, window 4: the windowed cache gets cells 0..6, 0..2 zero, 3..6
    its own bytes, in the layout llama.cpp writes for 7 cells."""
    v = (F16, 8) if rows else V_T
    lay = StateLayout((cache(1, v_trans=not rows, v=v), cache(2, n_swa=4, v_trans=not rows, v=v)))
    n = 7
    b = make_blob(n, lay)
    out = full_layout(b, n, lay, walk_state(b, n, lay))
    c0, c1 = lay.caches
    exp = make_blob(
        n, lay, caches=[cache_bytes(range(n), c0), cache_bytes(range(n), c1, fill=lambda p: 0 if p < 3 else p)]
    )
    assert np.array_equal(out, exp)
    # and it walks as a whole-window state
    full = StateLayout((c0, CacheLayout(0, c1.v_trans, c1.k, c1.v)))
    assert [s.cells for s in walk_state(out, n, full)] == [n, n]


def test_reader_refuses_negative_lengths():
    r = _Reader(np.zeros(4, np.uint8))
    with pytest.raises(EngineStateError):
        r.take(-1, "x")
    assert r.take(4, "y").size == 4
    with pytest.raises(EngineStateError):
        r.take(1, "z")


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


# -- the section each truncation names (pinned: a wrong name would mislead) -----
def _sections(n, layout):
    """(first byte, section name) of every part of a good blob, in order."""
    out, at = [(0, "the sequence header")], 8
    for c in layout.caches:
        cells = c.cells(n)
        out += [(at, "the cache header"), (at + 8, "the cell table")]
        at += 8 + 12 * cells
        out.append((at, "the layer header"))
        at += 8
        for _, row in c.k:
            out += [(at, "a K header"), (at + 12, "K rows")]
            at += 12 + row * cells
        for vh in c.v:
            per = vh[1] * vh[2] if c.v_trans else vh[1]
            out += [(at, "a V header"), (at + 12, "V rows")]
            at += 12 + per * cells
    return out


@pytest.mark.parametrize("layout, n", [(PLAIN, 3), (SWA, 6)])
@pytest.mark.parametrize("fn", ["walk", "learn"])
def test_a_truncation_names_the_section_it_falls_in(layout, n, fn):
    b = make_blob(n, layout)
    secs = _sections(n, layout)
    if fn == "learn":
        n = min(n, 4)  # learn_layout reads states shorter than the window
        b = make_blob(n, layout)
        secs = _sections(n, layout)
    for (start, name), (nxt, _) in zip(secs, [*secs[1:], (b.size, "")], strict=True):
        for cut in {start, (start + nxt) // 2}:
            if cut >= nxt or (fn == "learn" and cut == start and name == "the cache header"):
                continue  # learn_layout reads caches while bytes are left: a cut there is fewer caches
            with pytest.raises(EngineStateError) as ei:
                walk_state(b[:cut], n, layout) if fn == "walk" else learn_layout(b[:cut], n, layout.caches[-1].n_swa)
            assert ei.value.reason.startswith(f"llama_state truncated in {name} (at byte "), (
                cut,
                name,
                ei.value.reason,
            )


def test_learn_refuses_more_than_four_caches_and_takes_a_window_of_one():
    five = StateLayout(tuple(cache() for _ in range(5)))
    with pytest.raises(EngineStateError) as ei:
        learn_layout(make_blob(1, five), 1, 4)
    assert ei.value.reason == "llama_state has too many caches"
    one = StateLayout((cache(1), cache(3, n_swa=1)))
    assert learn_layout(make_blob(1, one), 1, 1) == one
