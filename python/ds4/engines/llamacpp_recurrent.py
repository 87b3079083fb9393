"""The recurrent part of a llama.cpp sequence state (Mamba-2, LFM2's conv
layers, Granite 4 hybrid's Mamba-2 layers), after the KV caches
(:mod:`~ds4.engines.llamacpp_state` has the whole blob's layout).

For llama-cpp-python 0.3.36 (``llama_memory_recurrent::state_write``): the
cell count (one: a sequence's own state), the cell's position (the last
token's) and a sequence-id count of 0, then ``s_trans`` (always 0) and the
memory's layer count, then each recurrent layer's ``r`` row (the conv
state) behind its ``(type i32, row bytes u64)``, then each one's ``s`` row
(the SSM state; empty for a conv-only layer). Attention layers of a hybrid
write nothing here. Its size does not depend on the token count."""

from __future__ import annotations

import dataclasses

from ..errors import EngineStateError
from .llamacpp_blob import _MAX_LAYERS, _MAX_ROW, _i32, _Reader, _u32, _u64

__all__ = ["RecurrentLayout"]


@dataclasses.dataclass(frozen=True)
class RecurrentLayout:
    """The recurrent memory's part of a state: the memory's layer count
    (every layer of the model; attention layers write nothing here), and per
    recurrent layer the ``r`` header (conv state) and the ``s`` header (SSM
    state), each ``(type, row bytes)``. One cell (the sequence's state)
    whatever the token count."""

    n_layer: int
    r: tuple[tuple[int, int], ...]
    s: tuple[tuple[int, int], ...]

    def size(self) -> int:
        """Bytes of this part: cell count, one cell's meta, the layer
        header and every row behind its header."""
        return 4 + 8 + 8 + sum(12 + row for _, row in self.r + self.s)


def _recurrent_cell(r: _Reader, n_tokens: int) -> None:
    """The recurrent part's cell table: one cell, at the last token's
    position, of this sequence alone (no sequence ids written)."""
    h = r.take(4, "the recurrent cell count")
    if _u32(h) != 1:
        raise EngineStateError(f"llama_state has {_u32(h)} recurrent cells, expected 1")
    cell = r.take(8, "the recurrent cell")
    if _i32(cell) != n_tokens - 1 or _u32(cell, 4) != 0:
        raise EngineStateError(
            f"llama_state's recurrent cell is at position {_i32(cell)} with {_u32(cell, 4)} sequence ids, "
            f"expected {n_tokens - 1} and none"
        )


def _recurrent(r: _Reader, n_tokens: int, rl: RecurrentLayout) -> None:
    """The recurrent part of a walked blob, every header equal to ``rl``'s."""
    _recurrent_cell(r, n_tokens)
    h = r.take(8, "the recurrent layer header")
    if (_u32(h), _u32(h, 4)) != (0, rl.n_layer):
        raise EngineStateError(
            f"llama_state's recurrent part has s_trans={_u32(h)} and {_u32(h, 4)} layers, "
            f"this engine 0 and {rl.n_layer}"
        )
    for what, rows in (("r", rl.r), ("s", rl.s)):
        for il, (t, row) in enumerate(rows):
            h = r.take(12, f"a recurrent {what} header")
            if (_i32(h), _u64(h, 4)) != (t, row):
                raise EngineStateError(
                    f"llama_state recurrent layer {il}: bad {what} header (type {_i32(h)}, row {_u64(h, 4)})"
                )
            r.take(row, f"a recurrent {what} row")


def _learn_recurrent(r: _Reader, n_tokens: int) -> RecurrentLayout:
    """The recurrent part of a state this engine exported itself: the rest
    of the blob, ``r`` rows then as many ``s`` rows."""
    _recurrent_cell(r, n_tokens)
    h = r.take(8, "the recurrent layer header")
    s_trans, n_layer = _u32(h), _u32(h, 4)
    if s_trans != 0 or not 0 < n_layer <= _MAX_LAYERS:
        raise EngineStateError("llama_state has a bad recurrent layer header")
    rows: list[tuple[int, int]] = []
    while r.off < r.size:
        if len(rows) == 2 * n_layer:
            raise EngineStateError("llama_state has more recurrent rows than layers")
        h = r.take(12, "a recurrent header")
        t, row = _i32(h), _u64(h, 4)
        if not 0 <= row <= _MAX_ROW:
            raise EngineStateError("llama_state has a bad recurrent header")
        r.take(row, "a recurrent row")
        rows.append((t, row))
    if not rows or len(rows) % 2:
        raise EngineStateError(f"llama_state has {len(rows)} recurrent rows: not r and s rows of each layer")
    k = len(rows) // 2
    return RecurrentLayout(int(n_layer), tuple(rows[:k]), tuple(rows[k:]))
