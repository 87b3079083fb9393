"""What a llama.cpp context needs of its engine (:class:`Owner`: the model,
the facts of its batches, the bookkeeping of the llama handles; a closed
context's handles are kept by the engine for the next context of the same
size, :class:`Idle`), and how every context of an engine is opened
(:func:`context_params`, :func:`open_context`): one home for the settings
a single-sequence context (:mod:`~ds4.engines.llamacpp_context`), the
pool's shared one (:mod:`~ds4.engines.llamacpp_batch`) and the exactness
probes must share."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from ..errors import EngineError
from .llamacpp_lib import Batch
from .llamacpp_state import StateLayout

__all__ = ["Idle", "Owner", "context_params", "open_context", "padded", "step_rows"]

_LLAMA_FLASH_ATTN_TYPE_DISABLED = 0


def padded(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


def step_rows(floor: int, multiple: int) -> int:
    """The rows of a padded decode step: one token padded to the batch
    policy ``floor`` x ``multiple`` (1: a one-token step is a batch the
    kernels treat as a prefill's)."""
    return max(floor, padded(1, multiple))


def context_params(engine: Owner, n_ctx: int, n_seq_max: int = 1) -> Any:
    """The ``llama_context_params`` of every context the engine makes (of
    ``n_ctx`` cells; ``n_seq_max`` sequences: one, but for
    ``benches/probe_batch_exact.py``, which must use the same settings)."""
    lc = engine.lc
    cap = engine.batch_room
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cap
    # serial: llama.cpp evaluates every token on its own (a memory whose
    # batches are exact at no size: every token then takes the one path)
    cparams.n_ubatch = 1 if engine.serial else cap
    cparams.n_seq_max = n_seq_max
    # a recurrent memory drops the pad tokens of a batch by rolling back to a
    # snapshot (only where the architecture keeps them: LFM2's, say)
    cparams.n_rs_seq = engine.rollback_room
    cparams.n_threads = engine.n_threads
    cparams.n_threads_batch = engine.n_threads
    cparams.flash_attn_type = _LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.type_k = engine.type_k
    cparams.type_v = engine.type_v
    cparams.swa_full = True  # SWA layers keep every position: rewind stays exact
    cparams.embeddings = False
    cparams.offload_kqv = False
    cparams.no_perf = True
    return cparams


def open_context(engine: Owner, params: Any, cells: int, what: str) -> tuple[Any, Any]:
    """A llama context of ``params`` with at least ``cells`` cells per
    sequence, counted as opened by ``engine``, and its memory handle;
    EngineError (``what``: the context asked for) when llama.cpp gives none."""
    lc = engine.lc
    ctx = lc.llama_init_from_model(engine.model, params)
    if not ctx:
        raise EngineError(f"llama.cpp could not create a context of {what}")
    engine.context_opened()
    if lc.llama_n_ctx_seq(ctx) < cells:  # pragma: no cover - llama only rounds up
        lc.llama_free(ctx)
        engine.context_freed()
        raise EngineError("llama.cpp gave a smaller context than requested")
    return ctx, lc.llama_get_memory(ctx)


class Owner(Protocol):
    """What a context needs of its engine (:class:`~ds4.engines.llamacpp.LlamaCppEngine`)."""

    n_batch: int
    #: the most tokens one decode is given: ``n_batch`` with room for the
    #: pads of the strictest batch policy the probe may choose
    batch_room: int
    n_threads: int
    exact: bool
    batch_floor: int
    batch_multiple: int
    type_k: int
    type_v: int
    vocab_size: int
    can_rewind: bool
    #: the model's memory has a recurrent part (pure recurrent or hybrid)
    recurrent: bool
    #: snapshots a context asks for so a recurrent memory can drop pads
    rollback_room: int
    #: every token evaluated on its own (ubatches of one)
    serial: bool
    n_swa: int
    state_layout: StateLayout | None

    @property
    def lc(self) -> Any:
        """The ``llama_cpp`` module (its low-level API)."""

    @property
    def model(self) -> Any:
        """The loaded ``llama_model``."""

    def keep(self, idle: Idle) -> bool:
        """Take a closing context's handles (False: the caller frees them)."""

    def context_opened(self) -> None:
        """A context made its own llama handles."""

    def context_freed(self) -> None:
        """A context freed its llama handles."""


@dataclasses.dataclass
class Idle:
    """The llama handles of a closed context, kept by its engine."""

    n_ctx: int
    ctx: Any
    mem: Any
    batch: Batch
