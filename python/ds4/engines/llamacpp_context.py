"""One llama.cpp context of :class:`~ds4.engines.llamacpp.LlamaCppEngine`:
:class:`LlamaCppContext`, a ``llama_context`` holding one token sequence
(``seq_id`` 0): evaluation in batches aligned to absolute positions, padded
in exact mode (:mod:`ds4.engines.llamacpp`, "Determinism"), the exact
rewind (:meth:`~LlamaCppContext.truncate`), and the state's export and
import (checked by :mod:`~ds4.engines.llamacpp_state`).

A context knows its engine only through
:class:`~ds4.engines.llamacpp_owner.Owner`: the model, the facts of its
batches, and the engine's bookkeeping of the llama handles. So this module imports no engine, and the
start-up probe (:mod:`~ds4.engines.llamacpp_probe`), which measures on a
context, stands below the engine too.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..engine import as_token_array
from ..errors import ContextOverflowError, EngineError, EngineStateError, ImportFailedError
from .llamacpp_lib import Batch
from .llamacpp_owner import Idle, Owner, context_params, open_context, padded, step_rows
from .llamacpp_state import check_payload, full_layout, walk_state

__all__ = ["LlamaCppContext"]


@dataclasses.dataclass(frozen=True)
class _Mark:
    """A sequence's state where its unpadded reply began (canonical mode, a
    memory that cannot drop positions): the blob, the logits after it and
    the context's bookkeeping then."""

    blob: np.ndarray
    logits: np.ndarray | None
    known_from: int
    rewind_min: int


class LlamaCppContext:
    """One llama_context holding one token sequence (seq_id 0). Closing it
    (or dropping it) hands its llama context, cleared, to the engine, which
    gives it to the next context of the same size.

    A subclass (:class:`~ds4.engines.llamacpp_batch.SeqContext`) extends it
    through :data:`PROTECTED` only (each member's doc says "protected"); every
    other underscore member is this class's own (a test holds it to that)."""

    #: the protected interface: the hooks a subclass may override, then what it may call
    PROTECTED: ClassVar[tuple[str, ...]] = ("_feed", "_clear", "_portable", "_native", "_release")
    PROTECTED += ("_check_open", "_drop_positions", "_free_batch", "_record_decoded", "_adopt_prefix")

    def __init__(self, engine: Owner, n_ctx: int, *, reuse: Idle | None = None, unpadded_steps: bool = True):
        lc = engine.lc
        self._lc = lc
        self._engine = engine
        self.n_ctx = int(n_ctx)
        self._ctx = None
        self._batch: Batch | None = None
        nb = engine.n_batch
        self._nb = nb
        self._exact = engine.exact
        #: exact mode: every decode is padded to at least ``batch_floor``
        #: tokens, a multiple of ``batch_multiple``: a batch size the engine's
        #: kernels treat alike (ds4.engines.llamacpp, "Determinism")
        self.batch_floor = engine.batch_floor
        self.batch_multiple = engine.batch_multiple
        self._tokens: list[int] = []
        # tokens [0, _known_from) came from import_state: their ids are unknown
        self._known_from = 0
        # the shortest state a rewind may leave: 0, but after an import of a
        # windowed state the window layers' cells before its window are zeros
        # (a rewind to n re-decodes token n-1, which sees the window before
        # it), so then the import's length, unless it fit in the window
        self._rewind_min = 0
        self._logits: np.ndarray | None = None
        # canonical mode: decode steps go unpadded from here on (None: the
        # state is canonical, what a prefill of its tokens gives); never with
        # ``unpadded_steps`` off (a batched sequence's steps are its batch's)
        self._canonical = unpadded_steps and bool(getattr(engine, "canonical", False))
        self._dirty_from: int | None = None
        # where the memory cannot drop the reply's positions (recurrent,
        # hybrid, a windowed import): the state at the reply's start
        self._mark: _Mark | None = None
        #: the sequence id this context's tokens are in (0; a batched
        #: context's, :mod:`~ds4.engines.llamacpp_batch`, is its stream's)
        self.seq = 0
        if reuse is not None:
            self._ctx, self._mem, self._batch = reuse.ctx, reuse.mem, reuse.batch
            return
        cap = engine.batch_room
        params = context_params(engine, self.n_ctx + cap)
        self._ctx, self._mem = open_context(engine, params, self.n_ctx + cap, f"{n_ctx} tokens")
        self._batch = Batch(lc, cap)

    # -- bookkeeping -------------------------------------------------------
    @property
    def raw(self) -> Any:
        """The ``llama_context`` handle (for the probe's questions to it)."""
        self._check_open()
        return self._ctx

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    def _check_open(self) -> None:
        """(protected) EngineError when the context is closed."""
        if self._ctx is None:
            raise EngineError("the context is closed")

    def _clear(self, data: bool = True) -> None:
        """(protected hook) Empty the context's cells (a restore then puts position i in cell i, as a cold
        prefill does); ``data``: zero the buffers too (a restore needs not: empty cells are masked)."""
        self._lc.llama_memory_clear(self._mem, data)

    def _drop_positions(self, start: int = -1, end: int = -1) -> bool:
        """(protected) Drop the sequence's cells at positions ``start`` to ``end``
        (exclusive; -1: unbounded, so no argument drops them all); whether llama.cpp did."""
        return bool(self._lc.llama_memory_seq_rm(self._mem, self.seq, start, end))

    def reset(self) -> None:
        self._check_open()
        self._clear()
        self._tokens, self._known_from, self._rewind_min = [], 0, 0
        self._logits, self._dirty_from, self._mark = None, None, None

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self._release(ctx)

    def _release(self, ctx: Any) -> None:
        """(protected hook) Give up the llama context ``ctx`` (this context just
        closed): to the engine, for the next context of its size, or freed."""
        eng = self._engine
        if self._batch is not None and eng.keep(Idle(self.n_ctx, ctx, self._mem, self._batch)):
            self._batch = None
            return
        try:
            self._free_batch()
            self._lc.llama_free(ctx)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        eng.context_freed()

    def _free_batch(self) -> None:
        """(protected) Free this context's own batch (nothing once freed or handed on)."""
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch.raw)
            self._batch = None

    def __del__(self) -> None:  # pragma: no cover - GC timing
        try:
            self.close()
        except Exception:
            pass

    # -- evaluation --------------------------------------------------------
    def _as_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return as_token_array(tokens, self._engine.vocab_size, np.int32)

    def _decode(self, toks: np.ndarray, pos0: int, pad: bool = True) -> None:
        """One llama_decode of 1..n_batch tokens, logits for the last one.

        In exact mode a batch shorter than the engine's floor, or not a
        multiple of its multiple, is padded with copies of its last token at
        the next positions (causal attention: they cannot influence the real
        tokens), whose cells are removed right after."""
        n = int(toks.size)
        m = max(self.batch_floor, padded(n, self.batch_multiple)) if pad else n
        batch = self._batch
        if batch is None:
            raise EngineError("the context is closed")
        rc = self._lc.llama_decode(self._ctx, batch.load(toks, pos0, m))
        batch.logits[n - 1] = 0
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} at position {pos0}")
        if m > n and not self._drop_positions(pos0 + n):
            # a recurrent memory without enough rollback snapshots; the
            # start-up probe only picks a padded policy it saw work
            raise EngineError(f"llama.cpp could not drop the {m - n} pad tokens at position {pos0 + n}")

    def _read_logits(self) -> np.ndarray:
        p = self._lc.llama_get_logits_ith(self._ctx, -1)
        if not p:
            raise EngineError("llama.cpp returned no logits")
        return np.ctypeslib.as_array(p, shape=(self._engine.vocab_size,)).copy()

    def eval(self, tokens: Sequence[int], progress: Callable[[int, int], object] | None = None) -> np.ndarray:
        self._check_open()
        self.canonicalize()  # what it extends is a prefill's state
        toks = self._as_tokens(tokens)
        n_past = self.n_past
        total = int(toks.size)
        if n_past + total > self.n_ctx:
            raise ContextOverflowError(n_past + total, self.n_ctx)
        nb = self._nb
        done = 0
        try:
            while done < total:
                # chunk boundaries at absolute multiples of n_batch
                end = done + min(total - done, nb - self.n_past % nb)
                while done < end:
                    done += self._feed(toks[done:end], end == total)
                if progress is not None:
                    progress(done, total)
        except EngineError:
            self.reset()
            raise
        return self.last_logits()

    def _feed(self, chunk: np.ndarray, last: bool) -> int:
        """(protected hook) Evaluate ``chunk`` (a piece of one aligned chunk)
        at the next position, the logits read when it is the ``last`` of the
        eval; how many of its tokens went in (here all: one llama_decode)."""
        self._decode(chunk, self.n_past)
        self._tokens.extend(chunk.tolist())
        if last:
            self._logits = self._read_logits()
        return int(chunk.size)

    def eval_step(self, token: int) -> np.ndarray:
        """One generated token. In canonical mode it is decoded unpadded
        (llama.cpp's own one-token path) when a rewind to where the reply's
        unpadded steps began is exact, and :meth:`canonicalize` prefills
        them again before the state is extended, rewound or exported; else
        it is :meth:`eval`."""
        pos = self.n_past
        if not self._canonical or step_rows(self.batch_floor, self.batch_multiple) == 1:
            return self.eval([token])  # a one-token batch is one the kernels treat as a prefill's
        self._check_open()
        toks = self._as_tokens([token])
        if pos + 1 > self.n_ctx:
            raise ContextOverflowError(pos + 1, self.n_ctx)
        if self._dirty_from is None and not self._rewindable(pos) and pos > 0:
            # the memory cannot drop the reply: keep the state at its start
            self._mark = _Mark(self._get_blob(), self._logits, self._known_from, self._rewind_min)
        try:
            self._decode(toks, pos, pad=False)
            self._tokens.append(int(toks[0]))
            self._logits = self._read_logits()
        except EngineError:
            self.reset()
            raise
        if self._dirty_from is None:
            self._dirty_from = pos
        return self._logits  # a new array each step, never changed in place: no copy

    @property
    def canonical(self) -> bool:
        """True when the state is what a prefill of its tokens gives."""
        return self._dirty_from is None

    def canonicalize(self) -> None:
        """Make the state canonical: drop the positions decoded unpadded and
        prefill them again (padded, chunks aligned as a prefill's), so that
        the state and logits equal a cold prefill's (:meth:`ds4.session.Session.canonicalize`
        times it)."""
        d = self._dirty_from
        if d is None:
            return
        tail = self._tokens[d:]
        self._back_to(d)
        self.eval(tail)

    def _back_to(self, d: int) -> None:
        """Drop the unpadded positions (from ``d``): cut them, or restore the
        state the mark kept at ``d``. EngineError (the context reset) when
        llama.cpp refuses."""
        mark, self._mark, self._dirty_from = self._mark, None, None
        try:
            if mark is None:
                if not self._cut(d):
                    raise EngineError(f"llama.cpp could not drop the unpadded positions from {d}")
                return
            self._set_blob(mark.blob, d)
        except EngineError:
            self.reset()
            raise
        del self._tokens[d:]
        self._logits, self._known_from, self._rewind_min = mark.logits, mark.known_from, mark.rewind_min

    def last_logits(self) -> np.ndarray:
        """Logits after the last evaluated token (a copy); used after truncate()."""
        if self._logits is None:
            raise EngineError("the context is empty")
        return self._logits.copy()

    def truncate(self, n_tokens: int) -> bool:
        """Drop positions >= ``n_tokens``.

        llama.cpp keeps no logits for earlier positions, so the last kept
        token is removed too and evaluated again to get its logits (exact:
        bit-identical to a cold prefill in ``exact`` mode). That needs its
        id, which the context knows for tokens it evaluated itself, and for
        imported ones once told (:meth:`know_tokens`). It returns False and
        leaves the state unchanged when the ids are unknown, when the model
        cannot rewind (recurrent memory), and when the cut reaches into a
        windowed import longer than its window (``_rewind_min``)."""
        self._check_open()
        n = int(n_tokens)
        if n < 0 or n > self.n_past:
            raise ValueError(f"cannot truncate {self.n_past} tokens to {n}")
        if n == self.n_past:
            return True
        if n == 0:
            self.reset()
            return True
        d = self._dirty_from
        if d is not None and self._mark is not None and n >= d:
            # into the reply of a memory that cannot rewind: from its mark
            tail = self._tokens[d:n]
            self._back_to(d)
            if tail:
                self.eval(tail)
            return True
        if not self._rewindable(n):
            return False
        if d is not None and n > d:
            self.canonicalize()  # the kept part of the reply as a prefill has it
        ok = self._cut(n)
        if ok and d is not None and n <= d:
            self._dirty_from = None  # every unpadded position went
        return ok

    def _rewindable(self, n: int) -> bool:
        """Whether a cut at ``n`` (>= 1) is exact here: the kept last token's
        id known, the model able to rewind, the cut outside a windowed import."""
        return n - 1 >= self._known_from and self._engine.can_rewind and n >= self._rewind_min

    def _cut(self, n: int) -> bool:
        """Keep positions < ``n`` (1 <= n <= n_past, the ids known): drop
        the rest and the last kept token, and decode that token again for
        its logits."""
        if not self._drop_positions(n - 1):
            return False
        last = self._tokens[n - 1]
        del self._tokens[n - 1 :]
        try:
            self._decode(np.array([last], dtype=np.int32), n - 1)
            self._tokens.append(last)
            self._logits = self._read_logits()
        except EngineError:
            self.reset()
            raise
        return True

    def copy_prefix(self, other: object, n_tokens: int) -> bool:
        """Make this context hold ``other``'s first ``n_tokens`` positions,
        as a cold prefill of them would (a pool's resident taking another's
        shared prefix without a disk load): ``other``'s exported state
        (canonical) imported here as a checkpoint's is, its ids told, then
        cut at ``n_tokens`` as a rewind cuts. False, this context holding
        nothing, when ``other`` is not a context of its own of the same
        engine, or when the cut is not exact here: unknown ids, a memory
        that cannot rewind short of its whole state, and a windowed state
        longer than its window (an export holds only the window's cells of
        those layers: Gemma 3 copies a prefix only of a state within its
        window, or the whole state). Sequences of one batched context copy
        every cell across streams instead
        (:class:`~ds4.engines.llamacpp_batch.SeqContext`)."""
        self._check_open()
        n = int(n_tokens)
        if type(other) is not type(self) or other is self or other._engine is not self._engine:  # noqa: SLF001 (another context of this class)
            return False
        assert isinstance(other, LlamaCppContext)
        total = other.n_past
        if not 1 <= n <= total or total > self.n_ctx or (n < total and not other._rewindable(n)):  # noqa: SLF001 (another context of this class)
            return False
        self.import_state(other.export_state(), total)  # canonical first; checked as a load is
        if other._known_from == 0:  # noqa: SLF001 (another context of this class)
            self.know_tokens(other._tokens)  # noqa: SLF001 (another context of this class)
        if n == total:
            return True
        if self._rewindable(n) and self._cut(n):  # an engine error resets this context and is raised
            return True
        self.reset()
        return False

    def _adopt_prefix(self, other: LlamaCppContext, n: int, copy_cells: Callable[[], None]) -> bool:
        """(protected) Hold ``other``'s first ``n`` positions: the sequence emptied, ``copy_cells()``
        puts ``other``'s cells in it, its ids and rewind limits taken, then cut at ``n`` as a rewind
        cuts (an engine error resets this context and is raised). False, nothing changed, when
        ``other`` could not rewind to ``n`` itself or ``n`` leaves no room here."""
        if not 1 <= n <= other.n_past or n >= self.n_ctx or not other._rewindable(n):
            return False
        self._clear()
        copy_cells()
        self._tokens = list(other._tokens[:n])
        self._known_from, self._rewind_min, self._logits = other._known_from, other._rewind_min, None
        if self._cut(n):
            return True
        self.reset()  # pragma: no cover - llama.cpp refused a tail removal it allows
        return False

    def _record_decoded(self, tokens: Sequence[int] | np.ndarray, logits: np.ndarray) -> None:
        """(protected) ``tokens`` went in at the next positions (a batched step), ``logits`` after the last."""
        self._tokens.extend(int(t) for t in tokens)
        self._logits = logits

    # -- state -------------------------------------------------------------
    def export_state(self) -> dict[str, np.ndarray]:
        self._check_open()
        self.canonicalize()  # a stored or copied state is a prefill's
        if self.n_past == 0 or self._logits is None:
            raise EngineError("nothing to export: the context is empty")
        return {"llama_state": self._portable(self._get_blob()), "logits": self._logits.copy()}

    def _get_blob(self) -> np.ndarray:
        """The sequence's llama.cpp state, as this context writes it."""
        lc = self._lc
        size = int(lc.llama_state_seq_get_size(self._ctx, self.seq))
        if size <= 0:
            raise EngineError("llama_state_seq_get_size failed")
        buf = np.empty(size, dtype=np.uint8)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = int(lc.llama_state_seq_get_data(self._ctx, ptr, size, self.seq))
        if n <= 0 or n > size:
            raise EngineError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
        return buf[:n].copy() if n < size else buf

    def _set_blob(self, blob: np.ndarray, n_tokens: int) -> None:
        """Restore ``blob`` (this context's form) of ``n_tokens`` positions
        into the emptied sequence: a sequence restore into an empty cache
        puts position i in cell i and the head after the last cell, as a
        cold prefill leaves them (llamacpp_state, "Exactness on import").
        EngineStateError (the context not reset) when llama.cpp refuses it."""
        lc = self._lc
        self._clear(data=False)  # as a batched sequence restores: empty cells are masked until written
        ptr = ctypes.cast(ctypes.c_void_p(blob.ctypes.data), ctypes.POINTER(ctypes.c_uint8))
        n_read = int(lc.llama_state_seq_set_data(self._ctx, ptr, blob.size, self.seq))
        pos_min = int(lc.llama_memory_seq_pos_min(self._mem, self.seq))
        pos_max = int(lc.llama_memory_seq_pos_max(self._mem, self.seq))
        # a recurrent memory holds one cell, at the last position (a hybrid's
        # minimum is the larger of its two memories' minimums)
        first = n_tokens - 1 if self._engine.recurrent else 0
        if n_read != blob.size or pos_min != first or pos_max != n_tokens - 1:
            raise EngineStateError(
                f"llama.cpp rejected the state (read {n_read} of {blob.size} bytes, "
                f"positions {pos_min}..{pos_max}, expected {first}..{n_tokens - 1})"
            )

    def _portable(self, blob: np.ndarray) -> np.ndarray:
        """(protected hook) The exported blob as every context reads it (this one's: as is)."""
        return blob

    def _native(self, blob: np.ndarray) -> np.ndarray:
        """(protected hook) A checked blob as this context's llama.cpp restores it (as is)."""
        return blob

    def import_state(self, arrays: Mapping[str, np.ndarray], n_tokens: int) -> None:
        self._check_open()
        eng = self._engine
        # -- validate everything before touching the context ---------------
        blob, new_logits, n_tokens = check_payload(arrays, n_tokens, self.n_ctx, eng.vocab_size)
        layout = eng.state_layout
        if layout is not None:
            blob = full_layout(blob, n_tokens, layout, walk_state(blob, n_tokens, layout))
        # -- hand it to llama.cpp
        try:
            self._set_blob(self._native(blob), n_tokens)
        except EngineStateError as e:
            self.reset()
            if layout is None:  # nothing checked it first: the blob's fault as far as is known
                raise
            # the blob walked clean against the learnt layout and its file's
            # checksums held: a refusal is this engine's limit (a cache too
            # small, a memory that takes no such state), never proof of
            # corruption, so the file is kept
            raise ImportFailedError(f"llama.cpp refused a state that passed the layout check: {e.reason}") from e
        self._tokens = [-1] * n_tokens
        self._dirty_from = self._mark = None
        self._known_from = n_tokens
        short = layout is None or (layout.windowed and n_tokens > eng.n_swa)
        self._rewind_min = n_tokens if short else 0
        self._logits = new_logits

    def know_tokens(self, tokens: Sequence[int]) -> None:
        """The ids of the tokens the last import restored (a session checked
        them against the checkpoint's verified text), so that a rewind into
        the imported prefix can re-decode its last kept token. What the
        window layers lost stays lost: :meth:`truncate` still refuses a cut
        into a windowed import longer than its window (``_rewind_min``)."""
        if self._known_from == 0 or len(tokens) != len(self._tokens):
            raise EngineError("know_tokens: not the tokens of the last import")
        self._tokens = [int(t) for t in tokens]
        self._known_from = 0

    @property
    def tokens(self) -> list[int] | None:
        """The evaluated token ids, or None when a restored prefix hides them."""
        return None if self._known_from else list(self._tokens)
