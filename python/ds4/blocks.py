"""A state's append-only bytes as blocks of tokens (docs/DESIGN.md, "Blocks").

An engine whose exported state holds, for every token, rows that never
change once written (an attention layer's K and V) describes where they
sit with :meth:`block_layout` (``{array name: ArrayRuns}``). A state of
``n`` tokens then splits, for a block size ``B``, into ``n // B`` blocks
(block ``b``: every run's rows of tokens ``b*B .. (b+1)*B``, runs in
order) and a *residue*: each array with those tokens' rows taken out,
plus every array the layout does not name (a sliding window's ring, a
recurrent state, the logits, the tokens). :func:`join` puts them back
byte for byte.

A block's bytes are a function of the tokens before its end alone when
the engine's states are (exact mode: a resume equals a cold prefill bit
for bit, for any split of the prompt): that is what lets two checkpoints
of one prefix share its blocks, and what :func:`block_tokens_for` keeps
by sizing a block as a multiple of the engine's batch granule.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .errors import EngineStateError

__all__ = [
    "SPARE",
    "ArrayRuns",
    "BlockLayout",
    "Run",
    "Spare",
    "block_layout",
    "block_tokens_for",
    "join",
    "layer_rows_layout",
    "rows_layout",
    "split",
]


@dataclasses.dataclass(frozen=True)
class Run:
    """An append-only region of an array's bytes: ``rows`` rows, each of
    ``unit`` bytes a token over every token, starting at byte ``start``
    (row ``r``'s token ``t`` at ``start + (r * n + t) * unit``)."""

    start: int
    rows: int
    unit: int

    def span(self, n: int) -> int:
        return self.rows * self.unit * n


@dataclasses.dataclass(frozen=True)
class ArrayRuns:
    """One array of a state of ``n`` tokens: its dtype and shape whole, and
    its append-only runs in byte order (not overlapping)."""

    dtype: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def per_token(self) -> int:
        return sum(r.rows * r.unit for r in self.runs)


BlockLayout = Mapping[str, ArrayRuns]


class _Layouts(Protocol):
    def block_layout(self, n_tokens: int) -> BlockLayout | None: ...


def block_layout(engine: object, n_tokens: int) -> BlockLayout | None:
    """The engine's layout of a state of ``n_tokens`` (None: it has no
    append-only part it can name, or its states depend on how the prompt
    was split, so blocks could not be shared)."""
    fn = getattr(engine, "block_layout", None)
    return None if fn is None else fn(n_tokens)


def rows_layout(
    shapes: Mapping[str, tuple[int, ...]], names: Sequence[str], dtype: str = "<f4"
) -> dict[str, ArrayRuns]:
    """The layout of arrays whose first axis is the token (``names`` of
    ``shapes``, a state's whole shapes): one run each, a token's row."""
    item = np.dtype(dtype).itemsize
    return {
        k: ArrayRuns(dtype, tuple(shapes[k]), (Run(0, 1, item * int(np.prod(shapes[k][1:], dtype=np.int64))),))
        for k in names
    }


def layer_rows_layout(engine: Any, n: int) -> dict[str, ArrayRuns]:
    """The reference engine's layout (its ``block_layout``): the float32
    ``layer{i}.k`` and ``layer{i}.v`` of every layer not in its
    ``sliding_layers`` (a sliding layer's ring is not append-only)."""
    shapes = engine.state_shapes(n)
    skip = set(engine.sliding_layers)
    names = [f"layer{i}.{x}" for i in range(len(shapes) // 2) if i not in skip for x in "kv"]
    return rows_layout(shapes, names)


def block_tokens_for(engine: object, wanted: int) -> int:
    """``wanted`` rounded up to a multiple of the engine's batch granule
    (``block_granule``: the batch sizes its kernels treat alike come in
    multiples of it; 1 when it says nothing)."""
    g = max(1, int(getattr(engine, "block_granule", 1) or 1))
    return max(g, (max(1, wanted) + g - 1) // g * g)


def _regions(flat: np.ndarray, runs: Sequence[Run], n: int) -> list[np.ndarray]:
    """Each run's region of ``flat`` as a ``(rows, n, unit)`` view."""
    return [flat[r.start : r.start + r.span(n)].reshape(r.rows, n, r.unit) for r in runs]


def _flat(a: np.ndarray, spec: ArrayRuns, name: str) -> np.ndarray:
    if a.dtype != np.dtype(spec.dtype) or tuple(a.shape) != spec.shape:
        raise EngineStateError(f"{name}: {a.dtype}{list(a.shape)} is not the layout's {spec.dtype}{list(spec.shape)}")
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class Blocks:
    """The blocks of a state (:func:`split`), each made when asked for
    (``blocks[b]``: a new contiguous uint8 array), so a save copies only
    the blocks it writes."""

    def __init__(self, regions: list[np.ndarray], count: int, block: int, nbytes: int):
        self._regions, self._count, self.block, self.nbytes_each = regions, count, block, nbytes

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, b: int) -> np.ndarray:
        if not 0 <= b < self._count:
            raise IndexError(b)
        lo, hi = b * self.block, (b + 1) * self.block
        return np.concatenate([reg[:, lo:hi, :].reshape(-1) for reg in self._regions])


def split(
    arrays: Mapping[str, np.ndarray], layout: BlockLayout, n: int, block: int
) -> tuple[Blocks, dict[str, np.ndarray]]:
    """``arrays`` (a state of ``n`` tokens) as ``n // block`` blocks (made
    when asked for: :class:`Blocks`) and the residue (the layout's arrays
    as uint8 with the blocks' rows taken out; every other array as it is).
    The blocks view ``arrays``: they must not change meanwhile."""
    m = n // block * block
    regions: dict[str, list[np.ndarray]] = {}
    residue: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        spec = layout.get(name)
        if spec is None:
            residue[name] = a
            continue
        flat = _flat(a, spec, name)
        regs = _regions(flat, spec.runs, n)
        regions[name] = regs
        parts, at = [], 0
        for r, reg in zip(spec.runs, regs, strict=True):
            parts += [flat[at : r.start], reg[:, m:, :].reshape(-1)]
            at = r.start + r.span(n)
        parts.append(flat[at:])
        residue[name] = np.concatenate(parts)
    missing = set(layout) - set(arrays)
    if missing:
        raise EngineStateError(f"the state has no {sorted(missing)}")
    ordered = [reg for name in layout for reg in regions[name]]  # the layout's order, not the arrays'
    return Blocks(ordered, n // block, block, block_bytes(layout, block)), residue


def block_bytes(layout: BlockLayout, block: int) -> int:
    """The payload size of one block."""
    return block * sum(spec.per_token() for spec in layout.values())


Target = tuple[np.ndarray, list[tuple[int, int, int]]]


class Spare:
    """The buffer of the last state joined in this process, lent again when
    it is large enough and nothing holds it any more (no array of an
    earlier load is alive: the engine copied that state and dropped it; an
    engine or snapshot that keeps the arrays keeps the buffer theirs), else
    a new one, kept instead. Reusing it spares a long load the kernel's
    zeroing and faulting of fresh pages (and, with transparent huge pages,
    its compaction); the cost is one buffer the size of the largest state
    joined, held for the process's life."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self.lock:  # the check and the view that takes it, together
            buf = self.buf
            # its references: the attribute, ``buf`` and getrefcount's own argument
            if buf is not None and buf.size >= nbytes and sys.getrefcount(buf) == 3:
                return buf[:nbytes]
            self.buf = np.empty(nbytes, np.uint8)  # one in use stays its users' until they drop it
            return self.buf[:nbytes]


#: the process's buffer for joined states (:meth:`ds4.kvstore.blocks.BlockStore.assemble`)
SPARE = Spare()


def unjoined(
    residue: Mapping[str, np.ndarray],
    layout: BlockLayout,
    n: int,
    block: int,
    alloc: Callable[[int], np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], list[Target]]:
    """The arrays :func:`split` took apart, with everything but the blocks'
    rows filled from ``residue``, and where the blocks go: for each of the
    layout's arrays in order, its bytes (writable) and runs (``start, rows,
    unit``), what ``ds4._core.open_blocks_into`` fills. The arrays are
    carved from one buffer, ``alloc(bytes)`` (writable uint8; a new one by
    default): every byte of them is written here or by the blocks. Raises
    EngineStateError when a residue's size is not the layout's."""
    m = n // block * block
    out: dict[str, np.ndarray] = {}
    flats: dict[str, np.ndarray] = {}
    offsets, total = {}, 0
    for name in layout:
        offsets[name] = total
        total += -(-layout[name].nbytes // 64) * 64  # each array 64-byte aligned in the buffer
    buf = (alloc or (lambda k: np.empty(k, np.uint8)))(total)
    for name, a in residue.items():
        spec = layout.get(name)
        if spec is None:
            out[name] = a
            continue
        res = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        want = spec.nbytes - m * spec.per_token()
        if res.size != want:
            raise EngineStateError(f"{name}: the residue holds {res.size} bytes, the layout {want}")
        full = buf[offsets[name] : offsets[name] + spec.nbytes]
        at = got = 0
        for r, reg in zip(spec.runs, _regions(full, spec.runs, n), strict=True):
            gap = r.start - at
            full[at : r.start] = res[got : got + gap]
            got += gap
            tail = r.rows * r.unit * (n - m)
            reg[:, m:, :] = res[got : got + tail].reshape(r.rows, n - m, r.unit)
            got += tail
            at = r.start + r.span(n)
        full[at:] = res[got:]
        flats[name] = full
        out[name] = full.view(spec.dtype).reshape(spec.shape)
    missing = set(layout) - set(residue)
    if missing:
        raise EngineStateError(f"the residue has no {sorted(missing)}")
    targets = [(flats[name], [(r.start, r.rows, r.unit) for r in layout[name].runs]) for name in layout]
    return out, targets


def join(
    residue: Mapping[str, np.ndarray], blocks: bytes | memoryview | np.ndarray, layout: BlockLayout, n: int, block: int
) -> dict[str, np.ndarray]:
    """The arrays :func:`split` took apart, ``blocks`` being the blocks'
    payloads concatenated in order (``n // block`` of them): what a load
    gets from ``ds4._core.open_blocks_into`` without the concatenation.
    Raises EngineStateError when the sizes do not add up."""
    nb = n // block
    size = block_bytes(layout, block)
    payload = np.frombuffer(blocks, dtype=np.uint8) if not isinstance(blocks, np.ndarray) else blocks.reshape(-1)
    if payload.size != nb * size:
        raise EngineStateError(f"the blocks hold {payload.size} bytes, {nb} blocks of this layout take {nb * size}")
    out, targets = unjoined(residue, layout, n, block)
    regions = [reg for flat, runs in targets for reg in _regions(flat, [Run(*r) for r in runs], n)]
    for b in range(nb):
        blk = payload[b * size : (b + 1) * size]
        at = 0
        for reg in regions:
            k = reg.shape[0] * block * reg.shape[2]
            reg[:, b * block : (b + 1) * block, :] = blk[at : at + k].reshape(reg.shape[0], block, reg.shape[2])
            at += k
    return out
