"""What the llama.cpp engine learns about a model when it loads it.

Two facts that no metadata states, measured on a small context:

* **The state layout** (:class:`~ds4.engines.llamacpp_state.StateLayout`):
  the caches of a state the engine exported itself, their windows and
  every layer's K/V headers. Imported states must match it exactly.
* **The batch sizes the kernels treat alike.** ggml's CPU kernels compute a
  token's activations along paths that depend on the size of the batch it
  is in: a batch of one token takes the matrix-vector path (every model);
  with weights in a repacked type (Q4_K and others, the ``CPU_REPACK``
  buffer) rows go through the kernel four at a time and the rest through a
  row kernel; and on Gemma 3 270M batches of two to seven tokens differ
  from longer ones in the last bits. A resume replays other batches than a
  cold prefill (the suffix after a checkpoint, one token at a time after
  generation), so exactness needs every batch to be one the kernels treat
  like any other. The probe evaluates a 32-token sequence whole and in
  splits with short batches, under each candidate policy (pad every batch
  to at least ``floor`` tokens, a multiple of ``multiple``), and keeps the
  cheapest under which every split equals the whole bit for bit:
  SmolLM2-135M (Q4_1) needs 2x1 (the single-token pad ds4 always had),
  Gemma 3 270M (Q4_K_M) 8x4. A model for which no candidate passes keeps
  the strictest, with ``exact_verified`` False (logged).

Probes are cached per model file (path, size, mtime), batch size and thread
count for the life of the process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Protocol

import numpy as np

from ..errors import EngineError, EngineStateError
from .llamacpp_context import LlamaCppContext, Owner
from .llamacpp_state import StateLayout, learn_layout, walk_state

__all__ = ["CANDIDATES", "Probe", "probe_engine"]

log = logging.getLogger("ds4.engines.llamacpp")

#: batch policies (floor, multiple), cheapest first
CANDIDATES: tuple[tuple[int, int], ...] = ((2, 1), (8, 4))
#: the probe's splits of its 32 tokens (each a list of batch lengths)
SPLITS: tuple[tuple[int, ...], ...] = ((31, 1), (29, 3), (26, 6), (3, 29), (1, 31), (30, 1, 1))
_N = 32


@dataclasses.dataclass(frozen=True)
class Probe:
    layout: StateLayout | None
    bytes_per_token: int
    batch_floor: int
    batch_multiple: int
    exact_verified: bool


_cache: dict[tuple[object, ...], Probe] = {}


class Probed(Owner, Protocol):
    """The engine being probed (:class:`~ds4.engines.llamacpp.LlamaCppEngine`,
    as it starts): a context's owner, with its model file and tokenizer."""

    model_path: str

    def tokenize(self, text: str, special: bool = False) -> list[int]: ...


def probe_engine(eng: Probed) -> Probe:
    """The probe of ``eng``'s model (cached; see the module docstring)."""
    st = os.stat(eng.model_path)
    key = (os.path.realpath(eng.model_path), st.st_size, st.st_mtime_ns, eng.n_batch, eng.n_threads)
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = _probe(eng)
    return hit


def _probe(eng: Probed) -> Probe:
    try:
        ctx = LlamaCppContext(eng, 256)
    except EngineError:  # pragma: no cover
        return Probe(None, 0, *CANDIDATES[-1], False)
    try:
        layout, per_token = _layout(ctx, eng)
        toks = _tokens(eng)
        for floor, mult in CANDIDATES:
            if _alike(ctx, toks, floor, mult):
                return Probe(layout, per_token, floor, mult, True)
        log.warning(
            "llama.cpp engine: no batch policy made %s's results independent of the batch split; "
            "resumed sessions may differ from a cold prefill in the last bits",
            os.path.basename(eng.model_path),
        )
        return Probe(layout, per_token, *CANDIDATES[-1], False)
    finally:
        ctx.close()


def _layout(ctx: LlamaCppContext, eng: Probed) -> tuple[StateLayout | None, int]:
    """The layout of the engine's own 1- and 3-token states, and the bytes a
    token adds to the blob (below the window)."""
    try:
        sizes, layout = [], None
        for n in (1, 3):
            ctx.reset()
            ctx.eval(list(range(n)))
            blob = ctx.export_state()["llama_state"]
            layout = learn_layout(blob, n, eng.n_swa)
            walk_state(blob, n, layout)  # its own checks agree
            sizes.append(int(blob.size))
        return layout, (sizes[1] - sizes[0]) // 2
    except (EngineError, EngineStateError):
        return None, 0


def _tokens(eng: Probed) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. "
    toks = eng.tokenize(text * 4)[:_N]
    if len(toks) < _N:  # pragma: no cover - every tokenizer splits this text finer
        toks += [toks[-1]] * (_N - len(toks))
    return toks


def _alike(ctx: LlamaCppContext, toks: list[int], floor: int, mult: int) -> bool:
    """Whether, padded to ``floor`` x ``mult``, every split of ``toks``
    gives the logits of the whole, bit for bit."""
    ctx.batch_floor, ctx.batch_multiple = floor, mult

    def run(pieces: tuple[int, ...]) -> np.ndarray:
        ctx.reset()
        at = 0
        for p in pieces:
            logits = ctx.eval(toks[at : at + p])
            at += p
        return logits

    ref = run((_N,))
    return all(np.array_equal(run(s), ref) for s in SPLITS)
