"""Batched decode for a pool of resident sessions (issue 22, item 3): one
``llama_context`` of N sequences, :class:`SharedContext`, handing out N
:class:`SeqContext` s (one per resident), whose decode steps go into one
``llama_decode`` when several residents decode at once.

Exactness is the condition, and it holds only in one layout, measured by
``benches/probe_batch_exact.py`` on SmolLM2 and Gemma 3 (DESIGN.md,
"Batched decode"):

- **one KV stream per sequence** (``kv_unified`` off). With one unified
  cache a sequence's attention runs over the other sequences' (masked)
  cells too, and the sums come out in other bits;
- **each sequence padded on its own** to the engine's exact-mode batch
  floor (its token, then copies at the next positions, dropped after the
  step). A split-KV ubatch is cut per stream, so a sequence with one token
  in a batch of K ran its attention products (KQ, KQV) on the single-token
  path, which gives other bits than the floor-sized batch its single
  session runs.

So a batched step of K sequences is a batch of K x floor tokens, each
sequence's rows as its own single-session step would be; the weight
matrices are read once for all of them. Prefill chunks, rewinds and state
imports run per sequence (a sequence's cells only; the other streams are
untouched). At start (:func:`batched_exact`) the engine checks it on its
own build: two sequences, batched steps against single-session ones; a
build where they differ decodes per session.

The pool's lanes take turns through a baton (:mod:`ds4.server.baton`);
only the holder calls into a context. A lane's decode step *posts* its
token and hands the baton over (:attr:`SharedContext.handover`); the other
lanes post theirs the same way; the first posted lane to get the baton back
runs one batch for every posted token and leaves each lane its logits.
Without a handover (one thread) a step runs at once, alone.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ContextOverflowError, EngineError
from .llamacpp_context import Idle, LlamaCppContext, Owner, context_params, open_context, padded
from .llamacpp_lib import Batch
from .llamacpp_state import restream

__all__ = ["SeqContext", "SharedContext", "batched_exact"]


class SharedContext:
    """One llama_context of ``n_seq`` sequences, one KV stream each, every
    stream of ``n_ctx`` cells (and the pad's room)."""

    def __init__(self, engine: Owner, n_seq: int, n_ctx: int):
        if n_seq < 1:
            raise ValueError("n_seq must be at least 1")
        lc = engine.lc
        self._lc, self._engine = lc, engine
        self.n_seq, self.n_ctx = int(n_seq), int(n_ctx)
        cap = engine.batch_room
        self.rows_per_seq = max(engine.batch_floor, padded(1, engine.batch_multiple))
        if self.rows_per_seq * self.n_seq > cap:
            raise ValueError(f"{n_seq} sequences of {self.rows_per_seq} rows exceed the batch of {cap}")
        p = context_params(engine, (self.n_ctx + cap) * self.n_seq, n_seq_max=self.n_seq)
        p.kv_unified = False
        self.ctx, self.mem = open_context(engine, p, self.n_ctx + cap, f"{n_seq} x {n_ctx} tokens")
        self._batch: Batch | None = Batch(lc, cap)
        #: called by a decode step after posting its token: the pool's
        #: baton handover (nothing: a step runs at once)
        self.handover: Callable[[], None] = lambda: None
        self._posted: dict[int, tuple[SeqContext, int]] = {}
        self._results: dict[int, np.ndarray | EngineError] = {}
        #: batched steps run, by how many sequences they held
        self.steps: collections.Counter[int] = collections.Counter()
        self._open = set(range(self.n_seq))
        self.contexts = [SeqContext(self, s) for s in range(self.n_seq)]

    # -- the steps ---------------------------------------------------------
    def step(self, sc: SeqContext, token: int) -> np.ndarray:
        """``sc``'s next token, decoded with every other posted one: post it,
        hand over, and run the batch unless another lane ran it."""
        self._posted[sc.seq] = (sc, token)
        self.handover()
        got = self._results.pop(sc.seq, None)
        if got is None:
            self._run()
            got = self._results.pop(sc.seq)
        if isinstance(got, EngineError):
            raise got
        return got

    def _run(self) -> None:
        posted, self._posted = list(self._posted.values()), {}
        try:
            out = self.decode_many([(sc, tok) for sc, tok in posted])
        except EngineError as e:
            for sc, _tok in posted:
                self._results[sc.seq] = EngineError(f"batched decode failed: {e}")
            return
        for (sc, _tok), logits in zip(posted, out, strict=True):
            self._results[sc.seq] = logits

    def decode_many(self, items: Sequence[tuple[SeqContext, int]]) -> list[np.ndarray]:
        """One llama_decode of one token for each of ``items``' sequences
        (at each one's next position, each padded on its own); their
        logits, in order. The contexts' own bookkeeping is theirs
        (:meth:`SeqContext.eval`)."""
        batch = self._batch
        if batch is None or not items:
            raise EngineError("the shared context is closed" if batch is None else "nothing to decode")
        m, lc = self.rows_per_seq, self._lc
        if len({sc.seq for sc, _ in items}) != len(items):
            raise ValueError("one token per sequence")
        for k, (sc, tok) in enumerate(items):
            r = k * m
            pos = sc.n_past
            batch.token[r : r + m] = tok
            batch.pos[r : r + m] = np.arange(pos, pos + m, dtype=np.int32)
            batch.logits[r : r + m] = 0
            batch.logits[r] = 1
            for i in range(r, r + m):
                batch.set_seq(i, sc.seq)
        batch.raw.n_tokens = m * len(items)
        rc = lc.llama_decode(self.ctx, batch.raw)
        batch.logits[: m * len(items)] = 0
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} in a batched step")
        out = []
        for k, (sc, _tok) in enumerate(items):
            p = lc.llama_get_logits_ith(self.ctx, k * m)
            if not p:
                raise EngineError("llama.cpp returned no logits")
            out.append(np.ctypeslib.as_array(p, shape=(self._engine.vocab_size,)).copy())
            if m > 1 and not lc.llama_memory_seq_rm(self.mem, sc.seq, sc.n_past + 1, -1):
                raise EngineError("llama.cpp could not drop the pad tokens")  # pragma: no cover
        self.steps[len(items)] += 1
        return out

    # -- lifetime ----------------------------------------------------------
    def released(self, seq: int) -> None:
        """A sequence's context closed; the llama context goes with the last."""
        self._open.discard(seq)
        if not self._open:
            self._free()

    def _free(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is None:
            return
        try:
            if self._batch is not None:
                self._lc.llama_batch_free(self._batch.raw)
                self._batch = None
            self._lc.llama_free(ctx)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        self._engine.context_freed()

    def view(self) -> dict[str, Any]:
        """The operator's view: how many batched steps held how many sequences."""
        return {"sequences": self.n_seq, "steps": {str(k): v for k, v in sorted(self.steps.items())}}


class SeqContext(LlamaCppContext):
    """One sequence (one KV stream) of a :class:`SharedContext`: a
    :class:`~ds4.engines.llamacpp_context.LlamaCppContext` in every way
    (prefill, rewind, export, import, all on its own stream), but its
    one-token decode steps, which are batched with the other sequences'."""

    def __init__(self, shared: SharedContext, seq: int):
        eng = shared._engine
        own = Batch(eng.lc, eng.batch_room, seq)
        super().__init__(eng, shared.n_ctx, reuse=Idle(shared.n_ctx, shared.ctx, shared.mem, own))
        self.seq = seq
        self._shared = shared

    def _clear(self) -> None:
        # this sequence's cells only: the other streams are other residents'
        self._lc.llama_memory_seq_rm(self._mem, self.seq, -1, -1)

    def _layout(self) -> Any:
        layout = self._engine.state_layout
        if layout is None:
            raise EngineError("a batched context needs the engine's learnt state layout")
        return layout

    def _portable(self, blob: np.ndarray) -> np.ndarray:
        # stored as a one-sequence context's state: a checkpoint of a pool
        # loads anywhere, and every check reads it as it reads any other
        return restream(blob, self._layout(), seq=(self.seq, self._shared.n_seq), to=(0, 1))

    def _native(self, blob: np.ndarray) -> np.ndarray:
        return restream(blob, self._layout(), seq=(0, 1), to=(self.seq, self._shared.n_seq))

    def eval(self, tokens: Sequence[int], progress: Callable[[int, int], object] | None = None) -> np.ndarray:
        if len(tokens) != 1 or not self._exact:
            return super().eval(tokens, progress)
        self._check_open()
        tok = int(self._as_tokens(tokens)[0])
        if self.n_past + 1 > self.n_ctx:
            raise ContextOverflowError(self.n_past + 1, self.n_ctx)
        try:
            logits = self._shared.step(self, tok)
        except EngineError:
            self.reset()
            raise
        self.accept(tok, logits)
        if progress is not None:
            progress(1, 1)
        return self.last_logits()

    def copy_prefix(self, other: object, n_tokens: int) -> bool:
        """``other``'s first ``n_tokens`` positions, copied: its whole
        stream (``llama_memory_seq_cp`` across streams copies every cell, a
        windowed layer's masked ones too, as ``swa_full`` keeps them), then
        cut at ``n_tokens`` as a rewind cuts (the last kept token decoded
        again). Bit-identical to a cold prefill of those tokens on both
        models (``tests/test_engine_llamacpp_batch.py``). False, this
        context unchanged, when ``other`` is not another sequence of the same
        batched context, or when it could not rewind to ``n_tokens`` itself
        (unknown ids, a windowed import longer than its window)."""
        self._check_open()
        n = int(n_tokens)
        if not isinstance(other, SeqContext) or other._shared is not self._shared or other is self:
            return False
        if not 1 <= n <= other.n_past or n >= self.n_ctx or not other._rewindable(n):
            return False
        lc = self._lc
        self._clear()
        # the buffers are copied at the next decode's memory update: the
        # cut's own decode, at once, before another sequence can change its cells
        lc.llama_memory_seq_cp(self._mem, other.seq, self.seq, -1, -1)
        # what the source could not rewind into, this copy cannot either
        self._tokens = list(other._tokens[:n])
        self._known_from, self._rewind_min, self._logits = other._known_from, other._rewind_min, None
        if self._cut(n):  # an engine error resets this context and is raised
            return True
        self.reset()  # pragma: no cover - llama.cpp refused a tail removal it allows
        return False

    def accept(self, token: int, logits: np.ndarray) -> None:
        """``token`` was decoded in a batched step with these logits."""
        self._tokens.append(int(token))
        self._logits = logits

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        try:
            self._clear()
            if self._batch is not None:
                self._lc.llama_batch_free(self._batch.raw)
                self._batch = None
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        self._shared.released(self.seq)


def batched_exact(engine: Owner, prompts: Sequence[Sequence[int]], steps: int = 4) -> bool:
    """Whether this build's batched steps are bit-identical to
    single-session ones: each of ``prompts`` (2 or more) decoded greedily
    for ``steps`` tokens in one context of its own, then all together in a
    :class:`SharedContext`, every step one batch."""
    n_ctx = max(len(p) for p in prompts) + steps + 2
    alone = []
    for p in prompts:
        c = LlamaCppContext(engine, n_ctx)
        try:
            seen = [c.eval(p)]
            for _ in range(steps):
                seen.append(c.eval([int(np.argmax(seen[-1]))]))
        finally:
            c.close()
        alone.append(seen)
    shared = SharedContext(engine, len(prompts), n_ctx)
    try:
        ctxs = shared.contexts
        got = [[c.eval(p)] for c, p in zip(ctxs, prompts, strict=True)]
        for _ in range(steps):
            toks = [int(np.argmax(g[-1])) for g in got]
            out = shared.decode_many(list(zip(ctxs, toks, strict=True)))
            for c, t, g, lg in zip(ctxs, toks, got, out, strict=True):
                c.accept(t, lg)
                g.append(lg)
    finally:
        for c in shared.contexts:
            c.close()
    return all(np.array_equal(a, b) for sa, sb in zip(alone, got, strict=True) for a, b in zip(sa, sb, strict=True))
