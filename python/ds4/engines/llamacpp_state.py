"""The llama.cpp engine's state payload, and its checks.

State payload (``LlamaCppContext.export_state``)
    ``llama_state``: ``uint8[n]``, the bytes of ``llama_state_get_data``
    (for this llama.cpp version: the architecture name and the KV cache
    cells, positions and K/V rows; it holds *no* logits).
    ``logits``: ``float32[vocab_size]``, the logits of the last token.

``LlamaCppContext.import_state`` checks names, dtypes and shapes
(:func:`check_payload`), and (when the engine recognised the state layout at
start-up, which it does for SmolLM2) walks the blob's structure
(:func:`walk_state`): architecture, one stream, ``cell_count == n_tokens``,
cells of sequence 0 at exactly the positions ``0..n-1``, layer count, K/V
types and row sizes, and an exact total length. All of that happens before
the live context is touched. llama.cpp itself only checks the header-like
fields (its cell checks are debug ``assert``\\ s); the K/V bytes cannot be
verified by anyone but the payload checksum.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ..errors import EngineStateError

__all__ = ["PAYLOAD_NAMES", "ModelFacts", "check_payload", "walk_state"]

#: the names of the exported arrays
PAYLOAD_NAMES = frozenset({"llama_state", "logits"})
#: bounds on a K/V row (bytes) and on a transposed V's element size and width
_MAX_ROW = 1 << 24
_MAX_V_EL = 16
_MAX_V_EMBD = 1 << 20


class ModelFacts(Protocol):
    """What the walker needs to know about the model and the context setup."""

    arch: str
    n_layer: int
    type_k: int
    type_v: int
    flash_attn: bool


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


# Each reads exactly its field: .item() fails unless the slice holds one value
# (indexing [0] would also accept a longer slice).
def _u32(b: np.ndarray, at: int = 0) -> int:
    return int(b[at : at + 4].view("<u4").item())


def _i32(b: np.ndarray, at: int = 0) -> int:
    return int(b[at : at + 4].view("<i4").item())


def _u64(b: np.ndarray, at: int) -> int:
    return int(b[at : at + 8].view("<u8").item())


class _Reader:
    """Reads a blob front to back; every read is bounds-checked first."""

    def __init__(self, blob: np.ndarray):
        self.blob = blob
        self.size = int(blob.size)
        self.off = 0

    def take(self, n: int, what: str) -> np.ndarray:
        """The next ``n`` bytes; EngineStateError if fewer are left."""
        if n < 0 or self.off + n > self.size:
            raise EngineStateError(f"llama_state truncated in {what} (at byte {self.off} of {self.size})")
        out = self.blob[self.off : self.off + n]
        self.off += n
        return out


def walk_state(blob: np.ndarray, n_tokens: int, eng: ModelFacts) -> None:
    """Verify the structure of a whole-context llama.cpp state blob (the
    layout of llama-cpp-python 0.3.36 for a plain attention KV cache with
    one stream and no per-cell extension) without touching any context.

    Raises EngineStateError on the first inconsistency."""
    r = _Reader(blob)
    _check_arch(r, eng)
    cell_count = _check_cells(r, n_tokens)
    _check_layers(r, cell_count, eng)
    if r.off != r.size:
        raise EngineStateError(f"llama_state has {r.size - r.off} trailing bytes")


def _check_arch(r: _Reader, eng: ModelFacts) -> None:
    n = _u32(r.take(4, "the architecture name"))
    arch = bytes(r.take(n, "the architecture name"))  # a few bytes
    if arch != eng.arch.encode():
        raise EngineStateError(f"llama_state is for architecture {arch!r}, not {eng.arch!r}")


def _check_cells(r: _Reader, n_tokens: int) -> int:
    """The cache header and cell table: one stream, ``n_tokens`` cells, each
    in sequence 0 alone, at the positions ``0..n-1``. Returns the count."""
    h = r.take(8, "the cache header")
    n_stream, cell_count = _u32(h), _u32(h, 4)
    if n_stream != 1:
        raise EngineStateError(f"llama_state has {n_stream} KV streams, expected 1")
    if cell_count != n_tokens:
        raise EngineStateError(f"llama_state holds {cell_count} cells, expected {n_tokens}")
    # per cell: position (i32), number of sequences (u32), sequence id (i32)
    cells = r.take(12 * cell_count, "the cell table").view("<i4").reshape(cell_count, 3)
    if not (np.all(cells[:, 1] == 1) and np.all(cells[:, 2] == 0)):
        raise EngineStateError("llama_state has cells outside sequence 0")
    if not np.array_equal(np.sort(cells[:, 0]), np.arange(cell_count, dtype=np.int32)):
        raise EngineStateError("llama_state cell positions are not 0..n-1")
    return cell_count


def _check_layers(r: _Reader, cell_count: int, eng: ModelFacts) -> None:
    """The layer header, then every layer's K rows, then every layer's V
    (rows, or transposed: one column per element of the embedding)."""
    h = r.take(8, "the layer header")
    v_trans, n_layer = _u32(h), _u32(h, 4)
    if v_trans != (0 if eng.flash_attn else 1):
        raise EngineStateError(f"llama_state has v_trans={v_trans}, this engine uses {int(not eng.flash_attn)}")
    if n_layer != eng.n_layer:
        raise EngineStateError(f"llama_state has {n_layer} layers, the model {eng.n_layer}")
    for il in range(n_layer):
        _rows(r, il, "K", eng.type_k, cell_count)
    for il in range(n_layer):
        if v_trans:
            h = r.take(12, "a V header")
            v_type, v_el, v_embd = _i32(h), _u32(h, 4), _u32(h, 8)
            if v_type != eng.type_v or not 0 < v_el <= _MAX_V_EL or not 0 < v_embd <= _MAX_V_EMBD:
                raise EngineStateError(f"llama_state layer {il}: bad V header")
            r.take(v_el * v_embd * cell_count, "V rows")
        else:
            _rows(r, il, "V", eng.type_v, cell_count)


def _rows(r: _Reader, il: int, kind: str, type_: int, cell_count: int) -> None:
    """One layer's K (or untransposed V): type, row size, ``cell_count`` rows."""
    h = r.take(12, f"a {kind} header")
    t, row = _i32(h), _u64(h, 4)
    if t != type_ or not 0 < row <= _MAX_ROW:
        raise EngineStateError(f"llama_state layer {il}: bad {kind} header (type {t}, row {row})")
    r.take(row * cell_count, f"{kind} rows")
