"""The llama.cpp engine's state payload, and its checks.

State payload (``LlamaCppContext.export_state``)
    ``llama_state``: ``uint8[n]``, the bytes of ``llama_state_seq_get_data``
    for sequence 0 (for llama-cpp-python 0.3.36: a magic and the sequence id,
    then each KV cache of the model's memory: the cells' positions, then
    every layer's K rows and V rows or columns). A plain attention model has
    one cache. A sliding-window (SWA) model such as Gemma 3 has two, the
    full-attention layers' cache and the SWA layers' cache, and llama.cpp
    writes only the SWA cells a later token can still see: the last
    ``n_swa`` positions. A Gemma 3 270M file therefore grows by 3 layers'
    K/V per token, not 18. The blob holds *no* logits.
    ``logits``: ``float32[vocab_size]``, the logits of the last token.

Recurrent and hybrid models (Mamba-2, LFM2, Granite 4 hybrid) add the
recurrent memory's part after the KV caches (a pure recurrent model has no
KV cache): one cell per sequence, at the position of the last token, with
no sequence ids (a sequence's own state), then ``s_trans`` (always 0) and
the memory's layer count, then every recurrent layer's ``r`` row (the conv
state) and every recurrent layer's ``s`` row (the SSM state; empty for a
conv-only layer such as LFM2's), each behind its ``(type, row bytes)``.
Its size does not grow with the tokens: the state *is* the summary of
them, which is also why it cannot be rewound (:mod:`~ds4.engines.llamacpp`).

What makes a state valid is described by a :class:`StateLayout`: each
cache's window (0: every position), V transposition, and per layer the K/V
types and row sizes. The engine learns it at start-up from a state it
exported itself (:func:`learn_layout`), and every imported blob must match
it exactly (:func:`walk_state`): one stream, cells of sequence 0 alone at
exactly the positions ``0..n-1`` in order (the window's cache: exactly its
last ``min(n, n_swa)`` positions), the layer headers, an exact total
length. All of that happens before the live context is touched. llama.cpp
itself only checks the header-like fields (its cell checks are debug
``assert``\\ s); the K/V bytes cannot be verified by anyone but the payload
checksum.

Exactness on import (docs/DESIGN.md, "Sliding-window models")
    llama.cpp's attention sums over cache cells in cell order, so a restored
    state must put every position in the cell a cold prefill would have
    used: position ``i`` in cell ``i``, in both caches, and the search head
    after the last cell. A whole-context restore (``llama_state_set_data``)
    puts the cells there but leaves the head at cell 0, where the SWA cache
    then reuses the cells that fell out of the window for the next tokens
    (their order changes; the logits differ from cold). The engine restores
    through ``llama_state_seq_set_data`` instead, which leaves the head after
    the last restored cell, and :func:`full_layout` gives the SWA cache back
    its out-of-window cells, as zeros: no later token can see them (the
    mask is -inf there, and 0 x 0 adds nothing), but they hold their cells.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from ..blocks import ArrayRuns, Run
from ..errors import EngineStateError
from .llamacpp_blob import _MAX_LAYERS, _MAX_ROW, _i32, _Reader, _u32, _u64
from .llamacpp_recurrent import RecurrentLayout, _learn_recurrent, _recurrent

__all__ = [
    "PAYLOAD_NAMES",
    "SEQ_MAGIC",
    "CacheLayout",
    "ModelFacts",
    "RecurrentLayout",
    "StateLayout",
    "check_payload",
    "full_layout",
    "learn_layout",
    "restream",
    "walk_state",
]

#: the names of the exported arrays
PAYLOAD_NAMES = frozenset({"llama_state", "logits"})
#: the first field of a llama.cpp sequence state (llama-context.cpp ``io_magic``)
SEQ_MAGIC = 0xAF143CD8
#: bounds on a transposed V's element size and width, and the caches a
#: layout may have (a row's and the layers' bounds: llamacpp_blob)
_MAX_V_EL = 16
_MAX_V_EMBD = 1 << 20
_MAX_CACHES = 4


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """One KV cache of the state: its window (``0``: it keeps every
    position), whether V is stored transposed, and per layer the K header
    ``(type, row bytes)`` and the V header (``(type, element bytes,
    width)`` when transposed, else ``(type, row bytes)``)."""

    n_swa: int
    v_trans: bool
    k: tuple[tuple[int, int], ...]
    v: tuple[tuple[int, ...], ...]

    def bytes_per_cell(self) -> int:
        """Bytes one cell adds to this cache's part of the blob (the cell
        meta and every layer's K and V)."""
        kv = sum(row for _, row in self.k)
        kv += sum((h[1] * h[2]) if self.v_trans else h[1] for h in self.v)
        return 12 + kv

    def cells(self, n_tokens: int) -> int:
        """How many cells this cache writes for a state of ``n_tokens``."""
        return min(n_tokens, self.n_swa) if self.n_swa else n_tokens


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The caches of a model's state, in blob order, and the recurrent part
    after them (None: the model has none)."""

    caches: tuple[CacheLayout, ...]
    recurrent: RecurrentLayout | None = None

    def describe(self) -> str:
        """A short, stable text of the layout for the payload ABI: each
        cache's layer count and window, the recurrent layers (``r``: how
        many, of how many layers), and a digest of every layer header. A
        plain or windowed model's text is what it was before recurrent
        parts were known (its checkpoints keep their ABI)."""
        import hashlib

        parts = [f"{len(c.k)}" + (f"w{c.n_swa}" if c.n_swa else "") for c in self.caches]
        what: object = self.caches
        if self.recurrent is not None:
            parts.append(f"r{len(self.recurrent.r)}of{self.recurrent.n_layer}")
            what = (self.caches, self.recurrent)
        h = hashlib.sha256(repr(what).encode()).hexdigest()[:12]
        return f"{'+'.join(parts)}:{h}"

    def size(self, n_tokens: int) -> int:
        """The exact blob length of a state of ``n_tokens``."""
        total = 8  # magic, sequence id
        for c in self.caches:
            total += 8 + 8 + 24 * len(c.k) + c.bytes_per_cell() * c.cells(n_tokens)
        if self.recurrent is not None:
            total += self.recurrent.size()
        return total

    @property
    def windowed(self) -> bool:
        return any(c.n_swa for c in self.caches)


class ModelFacts(Protocol):
    """What the walker needs to know about the model and the context setup."""

    state_layout: StateLayout | None


# -- payload arrays ------------------------------------------------------------
def check_payload(
    arrays: Mapping[str, np.ndarray], n_tokens: int, n_ctx: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Names, types, dtypes and shapes of a payload for a context of
    ``n_ctx`` tokens. Returns the blob (C-contiguous), a copy of the logits
    and the token count; raises EngineStateError otherwise."""
    try:
        names = set(arrays.keys())
    except AttributeError:
        raise EngineStateError("state arrays must be a mapping of names to arrays") from None
    if names != PAYLOAD_NAMES:
        raise EngineStateError(f"expected arrays llama_state and logits, got {sorted(names)}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)):
        raise EngineStateError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
    n = int(n_tokens)
    if not 0 < n <= n_ctx:
        raise EngineStateError(f"n_tokens {n} outside 1..{n_ctx}")
    blob, logits = arrays["llama_state"], arrays["logits"]
    if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1 or blob.size == 0:
        raise EngineStateError("llama_state must be a non-empty 1-D uint8 array")
    if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.shape != (vocab_size,):
        raise EngineStateError(f"logits must be float32[{vocab_size}]")
    if not np.all(np.isfinite(logits)):
        raise EngineStateError("logits contain NaN or infinity")
    return np.ascontiguousarray(blob), np.array(logits, dtype=np.float32, copy=True), n


@dataclasses.dataclass
class _Span:
    """Where one cache's parts sit in a walked blob (byte offsets)."""

    start: int  # the cache's first byte (its stream count)
    cells: int  # cell count
    k: list[tuple[int, int]]  # per layer: header offset, row bytes
    v: list[tuple[int, int]]  # per layer: header offset, bytes per cell (el * width, or row)
    end: int


# -- walking -------------------------------------------------------------------
def _head(r: _Reader) -> None:
    h = r.take(8, "the sequence header")
    if _u32(h) != SEQ_MAGIC:
        raise EngineStateError(f"llama_state is not a sequence state (magic {_u32(h):#010x})")
    if _i32(h, 4) != 0:
        raise EngineStateError(f"llama_state is of sequence {_i32(h, 4)}, expected 0")


def _cells(r: _Reader, expect: range) -> int:
    """The cache header and cell table: one stream, the cells of ``expect``
    in order, each in sequence 0 alone. Returns the count."""
    h = r.take(8, "the cache header")
    n_stream, cell_count = _u32(h), _u32(h, 4)
    if n_stream != 1:
        raise EngineStateError(f"llama_state has {n_stream} KV streams, expected 1")
    if cell_count != len(expect):
        raise EngineStateError(f"llama_state holds {cell_count} cells, expected {len(expect)}")
    # per cell: position (i32), number of sequences (u32), sequence id (i32)
    cells = r.take(12 * cell_count, "the cell table").view("<i4").reshape(cell_count, 3)
    if not (np.all(cells[:, 1] == 1) and np.all(cells[:, 2] == 0)):
        raise EngineStateError("llama_state has cells outside sequence 0")
    if not np.array_equal(cells[:, 0], np.arange(expect.start, expect.stop, dtype=np.int32)):
        raise EngineStateError(
            f"llama_state cell positions are not {expect.start}..{expect.stop - 1} in order"
            if cell_count
            else "llama_state cell positions are wrong"
        )
    return cell_count


def _layers(
    r: _Reader, cell_count: int, c: CacheLayout, ic: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The layer header, then every layer's K rows, then every layer's V,
    each header equal to the layout's. Returns the K and V offsets."""
    h = r.take(8, "the layer header")
    v_trans, n_layer = _u32(h), _u32(h, 4)
    if v_trans != int(c.v_trans):
        raise EngineStateError(f"llama_state cache {ic} has v_trans={v_trans}, this engine uses {int(c.v_trans)}")
    if n_layer != len(c.k):
        raise EngineStateError(f"llama_state cache {ic} has {n_layer} layers, the model {len(c.k)}")
    ks, vs = [], []
    for il, (kt, krow) in enumerate(c.k):
        at = r.off
        h = r.take(12, "a K header")
        if (_i32(h), _u64(h, 4)) != (kt, krow):
            raise EngineStateError(
                f"llama_state cache {ic} layer {il}: bad K header (type {_i32(h)}, row {_u64(h, 4)})"
            )
        r.take(krow * cell_count, "K rows")
        ks.append((at, krow))
    for il, vh in enumerate(c.v):
        at = r.off
        if c.v_trans:
            h = r.take(12, "a V header")
            got: tuple[int, ...] = (_i32(h), _u32(h, 4), _u32(h, 8))
            per = vh[1] * vh[2]
        else:
            h = r.take(12, "a V header")
            got = (_i32(h), _u64(h, 4))
            per = vh[1]
        if got != tuple(vh):
            raise EngineStateError(f"llama_state cache {ic} layer {il}: bad V header {got}")
        r.take(per * cell_count, "V rows")
        vs.append((at, per))
    return ks, vs


def walk_state(blob: np.ndarray, n_tokens: int, layout: StateLayout) -> list[_Span]:
    """Verify the structure of a sequence-0 state blob against ``layout``
    without touching any context. Returns where each cache's parts are.

    Raises EngineStateError on the first inconsistency."""
    r = _Reader(blob)
    _head(r)
    spans = []
    for ic, c in enumerate(layout.caches):
        start = r.off
        count = c.cells(n_tokens)
        n = _cells(r, range(n_tokens - count, n_tokens))
        ks, vs = _layers(r, n, c, ic)
        spans.append(_Span(start, n, ks, vs, r.off))
    if layout.recurrent is not None:
        _recurrent(r, n_tokens, layout.recurrent)
    if r.off != r.size:
        raise EngineStateError(f"llama_state has {r.size - r.off} trailing bytes")
    return spans


def _learn_cache(r: _Reader, n_tokens: int) -> CacheLayout:
    """One KV cache of a state this engine exported itself: its cell table
    and every layer's K and V headers, read with the walker's bounds."""
    _cells(r, range(n_tokens))
    h = r.take(8, "the layer header")
    v_trans, n_layer = _u32(h), _u32(h, 4)
    if v_trans > 1 or not 0 < n_layer <= _MAX_LAYERS:
        raise EngineStateError("llama_state has a bad layer header")
    k = []
    for _ in range(n_layer):
        h = r.take(12, "a K header")
        kt, krow = _i32(h), _u64(h, 4)
        if not 0 < krow <= _MAX_ROW:
            raise EngineStateError("llama_state has a bad K header")
        r.take(krow * n_tokens, "K rows")
        k.append((kt, krow))
    v: list[tuple[int, ...]] = []
    for _ in range(n_layer):
        h = r.take(12, "a V header")
        if v_trans:
            vt, el, embd = _i32(h), _u32(h, 4), _u32(h, 8)
            if not 0 < el <= _MAX_V_EL or not 0 < embd <= _MAX_V_EMBD:
                raise EngineStateError("llama_state has a bad V header")
            r.take(el * embd * n_tokens, "V rows")
            v.append((vt, el, embd))
        else:
            vt, row = _i32(h), _u64(h, 4)
            if not 0 < row <= _MAX_ROW:
                raise EngineStateError("llama_state has a bad V header")
            r.take(row * n_tokens, "V rows")
            v.append((vt, row))
    return CacheLayout(0, bool(v_trans), tuple(k), tuple(v))


def learn_layout(
    blob: np.ndarray, n_tokens: int, n_swa: int, *, recurrent: bool = False, kv_caches: int | None = None
) -> StateLayout:
    """The layout of a state this engine exported itself (``n_tokens`` of
    them, fewer than the window): each cache's layer headers, read with the
    same bounds checks. The second of two caches is the window's (``n_swa``).
    A model with a recurrent memory (``recurrent``) has ``kv_caches`` KV
    caches first (0: a pure recurrent model; 1: a hybrid), then the
    recurrent part. Raises EngineStateError when the blob is not understood."""
    r = _Reader(blob)
    _head(r)
    caches: list[CacheLayout] = []
    while r.off < r.size and (kv_caches is None or len(caches) < kv_caches):
        if len(caches) == _MAX_CACHES:
            raise EngineStateError("llama_state has too many caches")
        caches.append(_learn_cache(r, n_tokens))
    if recurrent:
        if kv_caches is None or len(caches) != kv_caches:
            raise EngineStateError(f"llama_state has {len(caches)} KV caches before its recurrent part")
        if n_swa > 0:
            raise EngineStateError("a windowed hybrid memory is not a layout this engine knows")
        return StateLayout(tuple(caches), _learn_recurrent(r, n_tokens))
    if len(caches) == 2 and n_swa > 0:
        caches[1] = dataclasses.replace(caches[1], n_swa=int(n_swa))
    elif len(caches) != 1:
        raise EngineStateError(f"llama_state has {len(caches)} caches (window {n_swa}): not a layout this engine knows")
    return StateLayout(tuple(caches))


# -- the cold layout -----------------------------------------------------------
def full_layout(blob: np.ndarray, n_tokens: int, layout: StateLayout, spans: Sequence[_Span]) -> np.ndarray:
    """``blob`` with every windowed cache given all ``n_tokens`` cells, the
    ones before its window as zeros, so that a sequence restore puts every
    position in the cell a cold prefill used (see the module docstring).
    The blob itself when no cache is short of cells (no copy)."""
    short = [s for s in spans if s.cells < n_tokens]
    if not short:
        return blob
    parts: list[np.ndarray] = [blob[: spans[0].start]]
    for c, s in zip(layout.caches, spans, strict=True):
        if s.cells == n_tokens:
            parts.append(blob[s.start : s.end])
            continue
        pad, n = n_tokens - s.cells, n_tokens
        cells = np.zeros((n, 3), "<i4")
        cells[:, 0] = np.arange(n, dtype=np.int32)
        cells[:, 1] = 1
        parts += [np.array([1, n], "<u4").view(np.uint8), cells.view(np.uint8).ravel()]
        lh = s.start + 8 + 12 * s.cells
        parts.append(blob[lh : lh + 8])
        for at, row in s.k:
            parts += [blob[at : at + 12], np.zeros(pad * row, np.uint8), blob[at + 12 : at + 12 + row * s.cells]]
        for (at, per), vh in zip(s.v, c.v, strict=True):
            data = blob[at + 12 : at + 12 + per * s.cells]
            parts.append(blob[at : at + 12])
            if c.v_trans:  # one column of cells per element of the width
                el, embd = vh[1], vh[2]
                out = np.zeros((embd, n * el), np.uint8)
                out[:, pad * el :] = data.reshape(embd, s.cells * el)
                parts.append(out.ravel())
            else:
                parts += [np.zeros(pad * per, np.uint8), data]
    parts.append(blob[spans[-1].end :])  # the recurrent part, if any
    return np.concatenate(parts)


def _u32s(*v: int) -> np.ndarray:
    return np.array(v, "<u4").view(np.uint8)


def restream(blob: np.ndarray, layout: StateLayout, *, seq: tuple[int, int], to: tuple[int, int]) -> np.ndarray:
    """The state of sequence ``seq[0]`` of a context of ``seq[1]`` KV
    streams (one per sequence: ``kv_unified`` off), rewritten as the state
    of sequence ``to[0]`` of a context of ``to[1]`` streams. llama.cpp
    writes a sequence's state with every stream's cell count, the others'
    zero, and its cells tagged with its id (which it ignores on a restore:
    the target sequence is the caller's); a batched pool's checkpoints are
    stored in the one-stream form (``(0, 1)``) every other context reads.
    Bounds-checked as :func:`walk_state`; EngineStateError when the blob is
    not such a state."""
    (s_from, n_from), (s_to, n_to) = seq, to
    r = _Reader(blob)
    h = r.take(8, "the sequence header")
    if _u32(h) != SEQ_MAGIC or _i32(h, 4) != s_from:
        raise EngineStateError(f"llama_state is not a state of sequence {s_from}")
    parts: list[np.ndarray] = [_u32s(SEQ_MAGIC, s_to)]
    for ic, c in enumerate(layout.caches):
        if _u32(r.take(4, "the stream count")) != n_from:
            raise EngineStateError(f"llama_state does not have {n_from} KV streams")
        body: list[np.ndarray] = []
        for st in range(n_from):
            count = _u32(r.take(4, "a stream's cell count"))
            if st != s_from:
                if count:
                    raise EngineStateError("llama_state has cells in another sequence's stream")
                continue
            cells = r.take(12 * count, "the cell table").view("<i4").reshape(count, 3).copy()
            if not np.all(cells[:, 2] == s_from):
                raise EngineStateError(f"llama_state has cells outside sequence {s_from}")
            cells[:, 2] = s_to
            start = r.off
            if count:
                _layers(r, count, c, ic)
            body = [_u32s(count), cells.view(np.uint8).ravel(), blob[start : r.off]]
        parts.append(_u32s(n_to))
        for st in range(n_to):
            parts += body if st == s_to else [_u32s(0)]
    if r.off != r.size:
        raise EngineStateError(f"llama_state has {r.size - r.off} trailing bytes")
    return np.concatenate(parts)


# -- blocks ----------------------------------------------------------------------
def block_runs(layout: StateLayout, n_tokens: int) -> ArrayRuns:
    """The append-only runs of a state blob of ``n_tokens`` (:mod:`ds4.blocks`):
    every layer's K rows and V rows (or a transposed V's columns: ``width``
    rows of ``element`` bytes a token) of each cache that keeps every
    position. A window's cache, the cell tables, the headers and the
    recurrent part stay in the residue."""
    n, off, runs = int(n_tokens), 8, []
    for c in layout.caches:
        cells = c.cells(n)
        off += 8 + 12 * cells + 8
        for _, row in c.k:
            off += 12
            if not c.n_swa:
                runs.append(Run(off, 1, row))
            off += row * cells
        for vh in c.v:
            off += 12
            rows, unit = (vh[2], vh[1]) if c.v_trans else (1, vh[1])
            if not c.n_swa:
                runs.append(Run(off, rows, unit))
            off += rows * unit * cells
    return ArrayRuns("|u1", (layout.size(n),), tuple(runs))


def engine_block_layout(engine: object, n_tokens: int) -> dict[str, ArrayRuns] | None:
    """An exact engine's block layout (its states are a function of the
    tokens, whatever the prompt's split); None for any other."""
    layout = getattr(engine, "state_layout", None)
    if layout is None or not getattr(engine, "exact_verified", False) or not getattr(engine, "checkpoints_ok", False):
        return None
    runs = block_runs(layout, n_tokens)
    return {"llama_state": runs} if runs.runs else None
