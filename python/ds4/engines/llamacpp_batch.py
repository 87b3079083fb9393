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
matrices are read once for all of them.

Prefill pieces batch too (:attr:`SharedContext.batch_prefill`; the server's
``--batch-prefill on``), under one more rule: **every sequence in a batch
gets the same rows**, the shortest piece's (padded to the floor), and the
longer pieces go on in later batches. Given pieces of unequal lengths,
llama.cpp cuts the batch into ubatches of equal per-sequence counts
itself, and the rests it cuts off run through the short-batch kernels
unpadded: other bits (``benches/probe_batch_exact.py --prefill``). One-token
steps and prefill pieces batch apart, so a prefill is never cut down to a
decode step's rows. Rewinds and state imports run per sequence (a
sequence's cells only; the other streams are untouched). At start
(:func:`batched_exact`) the engine checks it on its own build: prompts of
different lengths prefilled together, then batched steps, against
single-session ones; a build where they differ decodes per session.

The pool's lanes take turns through a baton (:mod:`ds4.server.baton`);
only the holder calls into a context. A lane's decode step *posts* its
token and hands the baton over (:attr:`SharedContext.handover`); the other
lanes post theirs the same way; the first posted lane to get the baton back
runs one batch for every posted token and leaves each lane its logits.
Without a handover (one thread) a step runs at once, alone.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import EngineError
from . import llamacpp_policy_cache as policy_cache
from .llamacpp_context import LlamaCppContext
from .llamacpp_lib import Batch
from .llamacpp_owner import Idle, Owner, context_params, open_context, padded, step_rows
from .llamacpp_state import restream

log = logging.getLogger("ds4.engines.llamacpp")

#: canonical mode batches the pool's decode steps up to this many rows per
#: sequence (:func:`batch_pays`)
_BATCH_PAYS_ROWS = 2


class Pooled(Owner, Protocol):
    """What the pool's choice of layout reads of its engine."""

    #: decode steps unpadded, replies canonicalized (``--exact canonical``)
    canonical: bool
    #: whether this build's batched steps are exact (None: not checked yet)
    batched_ok: bool | None


def batch_pays(engine: Pooled) -> bool:
    """Whether the pool's batched decode (each sequence padded to
    :func:`~ds4.engines.llamacpp_owner.step_rows`) is worth it: always in strict mode (every step is
    padded anyway); in canonical mode, where a resident alone decodes
    unpadded and canonicalizes after, only for a pad of at most one row
    (measured, ``benches/bench_batch_step.py --canonical``: four residents
    at 2 rows, SmolLM2, 1.13-1.43x the per-token rate of unpadded single
    steps; at 8 rows, Gemma 3, 0.60-0.81x)."""
    return not engine.canonical or step_rows(engine.batch_floor, engine.batch_multiple) <= _BATCH_PAYS_ROWS


def shared_context(engine: Pooled, n_seq: int, n_ctx: int, *, always: bool = False) -> SharedContext | None:
    """One context of ``n_seq`` sequences of ``n_ctx`` tokens whose decode
    steps are batched (its ``contexts``, one per session), or None where
    that would not be exact: outside exact mode, without a learnt state
    layout, on a recurrent memory, or on a build whose batched steps differ
    from single-session ones (checked once per engine, here). And, unless
    ``always``, None where a batched step costs more than it saves
    (:func:`batch_pays`)."""
    if not engine.exact or engine.state_layout is None or n_seq < 2:
        return None
    if not (always or batch_pays(engine)):
        log.info(
            "batched decode: a step padded to %d rows costs more per token than each resident's "
            "unpadded step and its canonicalization; each resident decodes on its own",
            step_rows(engine.batch_floor, engine.batch_multiple),
        )
        return None
    if engine.recurrent:
        # one sequence per call (its residents' states cannot be cut,
        # copied or restreamed as a KV cache's)
        return None
    if engine.batched_ok is None:
        # two prompts a batch multiple apart past the floor (12 and 16
        # tokens on Gemma 3): batched at their own lengths, not in this
        # layout, llama.cpp runs the longer one's rest short and unpadded
        f, m = engine.batch_floor, engine.batch_multiple
        probe = [
            list(range(11, 11 + f + m)),
            list(range(40, 40 + f + 2 * m)),
            list(range(70, 79)),
            list(range(90, 113)),
        ]
        base = getattr(engine, "probe_key", None)
        key = None if base is None else {**base, "check": "batched_decode", "prompts": probe}
        kept = None if key is None else policy_cache.load_flag(key)  # checked at an earlier start
        engine.batched_ok = batched_exact(engine, probe) if kept is None else kept
        if key is not None and kept is None:
            policy_cache.store_flag(key, engine.batched_ok)
        if not engine.batched_ok:
            log.warning("llama.cpp: batched decode is not bit-identical on this build; decoding per session")
    if not engine.batched_ok:
        return None
    return SharedContext(engine, n_seq, n_ctx)


__all__ = ["SeqContext", "SharedContext", "batch_pays", "batched_exact", "shared_context"]


class SharedContext:
    """One llama_context of ``n_seq`` sequences, one KV stream each, every
    stream of ``n_ctx`` cells (and the pad's room)."""

    def __init__(self, engine: Owner, n_seq: int, n_ctx: int):
        if n_seq < 1:
            raise ValueError("n_seq must be at least 1")
        lc = engine.lc
        self._lc, self.engine = lc, engine
        self.n_seq, self.n_ctx = int(n_seq), int(n_ctx)
        cap = engine.batch_room
        self.rows_per_seq = step_rows(engine.batch_floor, engine.batch_multiple)
        if self.rows_per_seq * self.n_seq > cap:
            raise ValueError(f"{n_seq} sequences of {self.rows_per_seq} rows exceed the batch of {cap}")
        p = context_params(engine, (self.n_ctx + cap) * self.n_seq, n_seq_max=self.n_seq)
        p.kv_unified = False
        self.ctx, self.mem = open_context(engine, p, self.n_ctx + cap, f"{n_seq} x {n_ctx} tokens")
        self._batch: Batch | None = Batch(lc, cap)
        #: called by a decode step after posting its token: the pool's
        #: baton handover (nothing: a step runs at once)
        self.handover: Callable[[], None] = lambda: None
        self._posted: dict[int, tuple[SeqContext, np.ndarray]] = {}
        self._results: dict[int, tuple[int, np.ndarray] | EngineError] = {}
        #: batched decode steps run, by how many sequences they held
        self.steps: collections.Counter[int] = collections.Counter()
        #: whether prefill pieces are batched too (else each sequence
        #: prefills on its own, as a single context does)
        self.batch_prefill = True
        #: batched prefill pieces run, by how many sequences they held
        self.prefill_steps: collections.Counter[int] = collections.Counter()
        self._open = set(range(self.n_seq))
        self.contexts = [SeqContext(self, s) for s in range(self.n_seq)]

    # -- the steps ---------------------------------------------------------
    def step(self, sc: SeqContext, tokens: np.ndarray) -> tuple[int, np.ndarray]:
        """The next piece of ``sc``'s ``tokens`` (its next token, or a prefill
        chunk's rest), evaluated with every other posted piece: post it, hand
        over, and run the batch unless another lane ran it. How many of the
        tokens went in (a prefill piece may go in part, :meth:`eval_many`),
        and the logits after the last of them."""
        self._posted[sc.seq] = (sc, tokens)
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
        # one-token steps together, prefill pieces together: one batch holds
        # one row count per sequence, and a prefill cut down to a decode
        # step's rows would run in pieces of the floor
        for group in ([p for p in posted if p[1].size == 1], [p for p in posted if p[1].size > 1]):
            if not group:
                continue
            try:
                out = self.eval_many(group)
            except EngineError as e:
                for sc, _toks in group:
                    self._results[sc.seq] = EngineError(f"batched decode failed: {e}")
                continue
            for (sc, _toks), got in zip(group, out, strict=True):
                self._results[sc.seq] = got

    def rows_for(self, lengths: Sequence[int]) -> int:
        """The rows each sequence gets in one batch of pieces of ``lengths``
        tokens: the shortest piece padded to the engine's floor (and its
        multiple), within the batch's room; longer pieces go in up to that."""
        eng = self.engine
        rows = max(eng.batch_floor, padded(min(lengths), eng.batch_multiple))
        room = eng.batch_room // len(lengths) // eng.batch_multiple * eng.batch_multiple
        return max(self.rows_per_seq, min(rows, room))

    def eval_many(self, items: Sequence[tuple[SeqContext, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
        """One llama_decode of the next tokens of each of ``items``'
        sequences (one piece each, at each one's next position). Every
        sequence has the same rows (:meth:`rows_for`): its first tokens,
        padded on its own with copies of its last one where it has fewer.
        That is the layout a split-KV batch is exact in: llama.cpp cuts a
        batch of unequal sequences into ubatches of equal ones, and the
        pieces it cuts off go through short-batch kernels unpadded
        (``benches/probe_batch_exact.py --prefill``). For each item: how
        many of its tokens went in, and the logits after the last. The
        contexts' own bookkeeping is theirs (:meth:`SeqContext.accept_many`)."""
        batch = self._batch
        if batch is None or not items:
            raise EngineError("the shared context is closed" if batch is None else "nothing to decode")
        if len({sc.seq for sc, _ in items}) != len(items):
            raise ValueError("one piece per sequence")
        lc = self._lc
        m = self.rows_for([int(t.size) for _, t in items])
        takes = []
        for k, (sc, toks) in enumerate(items):
            r, n = k * m, min(int(toks.size), m)
            pos = sc.n_past
            batch.token[r : r + n] = toks[:n]
            batch.token[r + n : r + m] = toks[n - 1]
            batch.pos[r : r + m] = np.arange(pos, pos + m, dtype=np.int32)
            batch.logits[r : r + m] = 0
            batch.logits[r + n - 1] = 1
            for i in range(r, r + m):
                batch.set_seq(i, sc.seq)
            takes.append(n)
        batch.raw.n_tokens = m * len(items)
        rc = lc.llama_decode(self.ctx, batch.raw)
        batch.logits[: m * len(items)] = 0
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} in a batched step")
        out = []
        for k, ((sc, _toks), n) in enumerate(zip(items, takes, strict=True)):
            p = lc.llama_get_logits_ith(self.ctx, k * m + n - 1)
            if not p:
                raise EngineError("llama.cpp returned no logits")
            out.append((n, np.ctypeslib.as_array(p, shape=(self.engine.vocab_size,)).copy()))
            if m > n and not lc.llama_memory_seq_rm(self.mem, sc.seq, sc.n_past + n, -1):
                raise EngineError("llama.cpp could not drop the pad tokens")  # pragma: no cover
        (self.steps if max(takes) == 1 else self.prefill_steps)[len(items)] += 1
        return out

    def decode_many(self, items: Sequence[tuple[SeqContext, int]]) -> list[np.ndarray]:
        """One llama_decode of one token for each of ``items``' sequences
        (:meth:`eval_many` of one-token pieces); their logits, in order."""
        got = self.eval_many([(sc, np.array([int(tok)], dtype=np.int32)) for sc, tok in items])
        return [logits for _n, logits in got]

    def copy_stream(self, src: int, dst: int) -> None:
        """Copy every cell of sequence ``src``'s stream into ``dst``'s (a
        windowed layer's masked ones too, as ``swa_full`` keeps them); the
        buffers are copied at the next decode's memory update."""
        self._lc.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

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
        self.engine.context_freed()

    def view(self) -> dict[str, Any]:
        """The operator's view: how many batched decode steps and prefill
        pieces held how many sequences."""
        return {
            "sequences": self.n_seq,
            "steps": {str(k): v for k, v in sorted(self.steps.items())},
            "prefill": self.batch_prefill,
            "prefill_steps": {str(k): v for k, v in sorted(self.prefill_steps.items())},
        }


class SeqContext(LlamaCppContext):
    """One sequence (one KV stream) of a :class:`SharedContext`: a
    :class:`~ds4.engines.llamacpp_context.LlamaCppContext` in every way
    (prefill, rewind, export, import, all on its own stream), but its
    one-token decode steps, which are batched with the other sequences'.
    It extends its base through the base's protected interface only
    (:data:`~ds4.engines.llamacpp_context.LlamaCppContext.PROTECTED`)."""

    def __init__(self, shared: SharedContext, seq: int):
        eng = shared.engine
        own = Batch(eng.lc, eng.batch_room, seq)
        # its decode steps are the batch's (padded on their own): none unpadded
        idle = Idle(shared.n_ctx, shared.ctx, shared.mem, own)
        super().__init__(eng, shared.n_ctx, reuse=idle, unpadded_steps=False)
        self.seq = seq
        #: the batched context this is a sequence of
        self.shared = shared

    def _clear(self, data: bool = True) -> None:
        # this sequence's cells only (their bytes left, ``data`` or not): the other streams are other residents'
        self._drop_positions()

    def _layout(self) -> Any:
        layout = self.shared.engine.state_layout
        if layout is None:
            raise EngineError("a batched context needs the engine's learnt state layout")
        return layout

    def _portable(self, blob: np.ndarray) -> np.ndarray:
        # stored as a one-sequence context's state: a checkpoint of a pool
        # loads anywhere, and every check reads it as it reads any other
        return restream(blob, self._layout(), seq=(self.seq, self.shared.n_seq), to=(0, 1))

    def _native(self, blob: np.ndarray) -> np.ndarray:
        return restream(blob, self._layout(), seq=(0, 1), to=(self.seq, self.shared.n_seq))

    def _feed(self, chunk: np.ndarray, last: bool) -> int:
        """A piece of a chunk through the shared context's steps, batched
        with the other sequences' pieces (it may go in part); a prefill
        piece without ``batch_prefill``, or outside exact mode, on this
        sequence's own, as a single context feeds it."""
        if not self.shared.engine.exact or (chunk.size > 1 and not self.shared.batch_prefill):
            return super()._feed(chunk, last)
        n, logits = self.shared.step(self, chunk)
        self.accept_many(chunk[:n], logits)
        return n

    def copy_prefix(self, other: object, n_tokens: int) -> bool:
        """``other``'s first ``n_tokens`` positions, copied: its whole
        stream (:meth:`SharedContext.copy_stream`), then cut at ``n_tokens``
        as a rewind cuts (the last kept token decoded again:
        :meth:`~ds4.engines.llamacpp_context.LlamaCppContext._adopt_prefix`).
        Bit-identical to a cold prefill of those tokens on both models
        (``tests/test_engine_llamacpp_batch.py``). False, this context
        unchanged, when ``other`` is not another sequence of the same
        batched context, or when it could not rewind to ``n_tokens`` itself
        (unknown ids, a windowed import longer than its window)."""
        self._check_open()
        if not isinstance(other, SeqContext) or other.shared is not self.shared or other is self:
            return False
        # copied at the cut's own decode, at once, before another sequence can change its cells
        return self._adopt_prefix(other, int(n_tokens), lambda: self.shared.copy_stream(other.seq, self.seq))

    def accept(self, token: int, logits: np.ndarray) -> None:
        """``token`` was decoded in a batched step with these logits."""
        self.accept_many((token,), logits)

    def accept_many(self, tokens: Sequence[int] | np.ndarray, logits: np.ndarray) -> None:
        """``tokens`` went in, in a batched piece, with these logits after them."""
        self._record_decoded(tokens, logits)

    def _release(self, ctx: Any) -> None:
        # the llama context is the shared one's: this sequence's cells emptied and
        # its own batch freed; the shared context frees its context with its last sequence
        try:
            self._clear()
            self._free_batch()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        self.shared.released(self.seq)


def _prefill_together(shared: SharedContext, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """``prompts`` prefilled into the shared context's first sequences, all
    the pieces one batch each step (the shortest one's rows, the longer ones
    going on); the logits after each prompt."""
    left = [np.asarray(p, dtype=np.int32) for p in prompts]
    last: list[np.ndarray | None] = [None] * len(left)
    while any(t.size for t in left):
        ks = [k for k, t in enumerate(left) if t.size]
        out = shared.eval_many([(shared.contexts[k], left[k]) for k in ks])
        for k, (n, logits) in zip(ks, out, strict=True):
            shared.contexts[k].accept_many(left[k][:n], logits)
            left[k], last[k] = left[k][n:], logits
    return [lg for lg in last if lg is not None]


def batched_exact(engine: Owner, prompts: Sequence[Sequence[int]], steps: int = 4) -> bool:
    """Whether this build's batched steps are bit-identical to
    single-session ones: each of ``prompts`` (2 or more, of different
    lengths) prefilled and decoded greedily for ``steps`` tokens in one
    context of its own, then all together in a :class:`SharedContext`, the
    prefills' pieces batched, then every step one batch."""
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
        got = [[lg] for lg in _prefill_together(shared, prompts)]
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
