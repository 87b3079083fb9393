"""Session: the live KV state of one conversation, with ds4's semantics
made strict (docs/DESIGN.md, "Session"): ``checkpoint_valid`` means the
engine state and ``logits`` describe exactly ``tokens``; :meth:`Session.invalidate`
is the one place validity is cleared; :meth:`Session.rewrite_from_common`
leaves the session untouched when the engine cannot rewind (``REBUILD_NEEDED``);
loads are verified and validated before the live state changes.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .checkpoint import TOKENS_TENSOR, check_tokens
from .engine import Engine, EngineContext
from .errors import (
    CheckpointError,
    ContextOverflowError,
    ContextTooSmallError,
    EmptyPromptError,
    EngineError,
    EngineStateError,
    ImportFailedError,
    InvalidSessionError,
    PrefillCancelledError,
    TokensTextMismatchError,
)
from .keytext import KeyRenderer, common_token_prefix, preamble
from .snapshots import Snapshots, restore

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

log = logging.getLogger("ds4.session")

Progress = Callable[[int, int], None]

__all__ = ["TOKENS_TENSOR", "Rewrite", "Session"]


class Rewrite(enum.Enum):
    OK = "ok"
    REBUILD_NEEDED = "rebuild_needed"
    ERROR = "error"


class Session:
    """One conversation's tokens, engine KV state and next-token logits."""

    def __init__(self, engine: Engine, ctx: int = 8192, *, lazy: bool = False):
        if ctx <= 1:
            raise ValueError(f"ctx must be > 1, got {ctx}")
        if ctx > engine.max_ctx:
            raise ValueError(f"ctx {ctx} exceeds the engine's maximum {engine.max_ctx}")
        self.engine = engine
        self.ctx = ctx
        self._ectx_open = None if lazy else engine.new_context(ctx)  # lazy: at first use (_ectx)
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None
        self._valid = False
        self._abi = engine.payload_abi()
        self.last_error: str | None = None
        self._keys = KeyRenderer.of(engine)
        self._namespace: str | None = None
        self._preamble = b""
        #: RAM snapshots, kept where the engine cannot always rewind
        #: (recurrent memory, windowed imports: :mod:`ds4.snapshots`)
        self.snapshots = Snapshots()
        self._snap_on = bool(getattr(engine, "rewind_limited", False))
        #: where the last rewind came from: a snapshot's token count, or None
        self.last_snapshot: int | None = None

    @property
    def _ectx(self) -> EngineContext:
        """The engine context (a lazy session's opened at first use)."""
        if self._ectx_open is None:
            self._ectx_open = self.engine.new_context(self.ctx)
        return self._ectx_open

    # -- state ---------------------------------------------------------------
    @property
    def checkpoint_valid(self) -> bool:
        return self._valid

    @property
    def tokens(self) -> list[int]:
        """A copy of the live tokens (empty when invalid)."""
        return list(self._tokens) if self._valid else []

    @property
    def n_past(self) -> int:
        return len(self._tokens) if self._valid else 0

    @property
    def logits(self) -> np.ndarray | None:
        """Next-token logits (read-only view), or None when invalid."""
        if not self._valid or self._logits is None:
            return None
        v = self._logits.view()
        v.flags.writeable = False
        return v

    @property
    def payload_abi(self) -> str:
        return self._abi

    @property
    def namespace(self) -> str | None:
        """The cache namespace the live state belongs to (None: the default);
        see :mod:`ds4.keytext`."""
        return self._namespace

    def set_namespace(self, namespace: str | None) -> None:
        """Make the session belong to ``namespace``; a change invalidates the
        live state (it is another namespace's: never reused across)."""
        pre = preamble(namespace)
        if namespace != self._namespace:
            self.invalidate("namespace switch")
            self.snapshots.clear()  # another namespace's: never reused across
            self._namespace, self._preamble = namespace, pre

    @property
    def canonical(self) -> bool:
        """False while a reply's unpadded decode steps are in the state."""
        return bool(getattr(self._ectx, "canonical", True))

    def canonicalize(self) -> float:
        """Make the state and logits a prefill's (the engine prefills a
        reply's unpadded steps again: llama.cpp's canonical mode); the ms."""
        if self.canonical or not self._valid:
            return 0.0
        t0 = time.perf_counter()
        try:
            self._ectx.canonicalize()  # type: ignore[attr-defined]  # an engine with unpadded steps has it
            self._logits = np.asarray(self._ectx.last_logits(), dtype=np.float32)
        except Exception as e:
            self.invalidate(f"canonicalize failed: {e}")
            raise
        return (time.perf_counter() - t0) * 1000

    @property
    def key_renderer(self) -> KeyRenderer:
        return self._keys

    def text_bytes(self, n: int | None = None) -> bytes:
        """The key rendering of the first ``n`` live tokens (no namespace
        preamble): their bytes, special markers distinguished from text
        (:mod:`ds4.keytext`)."""
        return self._keys.render(self._tokens if n is None else self._tokens[:n])

    def key_bytes(self, n: int | None = None) -> bytes:
        """The key text of the first ``n`` live tokens: the namespace's
        preamble, then :meth:`text_bytes` (what a checkpoint is named after)."""
        return self._preamble + (self.text_bytes() if n is None else self.text_bytes(n))

    def key_of(self, tokens: Sequence[int]) -> bytes:
        """The key text ``tokens`` would have in this session's namespace."""
        return self._preamble + self._keys.render(tokens)

    def argmax(self) -> int:
        if not self._valid or self._logits is None:
            raise InvalidSessionError("argmax on a session without a valid checkpoint")
        return int(np.argmax(self._logits))

    def adopt_context(self, ectx: EngineContext) -> None:
        """Run on ``ectx``, an engine context of this session's ``ctx``
        tokens (a pool's batched one), instead of its own, which is closed.
        Only while the session holds nothing."""
        if self._valid or self._tokens:
            raise RuntimeError("a session adopts a context only while it is empty")
        if ectx.n_ctx != self.ctx:
            raise ValueError(f"the context holds {ectx.n_ctx} tokens, the session {self.ctx}")
        old, self._ectx_open = self._ectx_open, ectx
        close = getattr(old, "close", None)  # None: never opened
        if close is not None:
            close()

    def adopt_prefix(self, other: Session, n_tokens: int) -> bool:
        """Take ``other``'s first ``n_tokens`` live tokens (and namespace)
        into this empty session without a disk load (a pool's free resident
        starting on a prefix another holds), copied by the engine context
        (``copy_prefix``, as a cold prefill would hold them). False, this
        session unchanged, when it cannot or ``other`` holds no valid state
        that long."""
        n = int(n_tokens)
        copy = getattr(self._ectx, "copy_prefix", None)
        if copy is None or other is self or not other._valid or not 1 <= n <= len(other._tokens) or n >= self.ctx:
            return False
        if self._valid or self._tokens:
            raise RuntimeError("a session adopts a prefix only while it is empty")
        self.set_namespace(other.namespace)
        try:
            if not copy(other._ectx, n):
                return False
            logits = np.asarray(self._ectx.last_logits(), dtype=np.float32)
        except Exception as e:
            self.invalidate(f"prefix copy failed: {e}")
            raise
        self._tokens = list(other._tokens[:n])
        self._logits = logits
        self._valid = True
        return True

    def invalidate(self, reason: str = "") -> None:
        """Clear validity (the one place that does). The engine state is reset
        so nothing stale can be extended by mistake."""
        if self._valid or self._tokens:
            log.debug("session invalidated%s", f": {reason}" if reason else "")
        self._valid = False
        self._tokens = []
        self._logits = None
        try:
            self._ectx.reset()
        except Exception:  # a broken engine context: a fresh one at next use
            self._ectx_open = None

    # -- prefill / decode ----------------------------------------------------
    def check_prompt(self, tokens: Sequence[int]) -> None:
        """Raise for an empty prompt or one that leaves no room in ``ctx``."""
        if len(tokens) == 0:
            raise EmptyPromptError("prompt is empty")
        if len(tokens) >= self.ctx:
            raise ContextOverflowError(len(tokens), self.ctx)

    def _eval(self, toks: Sequence[int], progress: Progress | None = None, *, step: bool = False) -> None:
        try:
            # a decode step: the engine's own (llama.cpp's canonical mode: unpadded)
            step_fn = getattr(self._ectx, "eval_step", None) if step else None
            logits = step_fn(toks[0]) if step_fn is not None else self._ectx.eval(toks, progress)
        except (ContextOverflowError, ValueError) as e:
            # Rejected before the engine touched its state: keep validity
            # only if the engine guarantees that; be strict and invalidate.
            self.invalidate(f"eval rejected: {e}")
            raise
        except BaseException as e:
            self.invalidate(f"eval failed: {e}")
            if isinstance(e, EngineError) or not isinstance(e, Exception):
                raise
            raise EngineError(f"engine failed during prefill/decode: {e}") from e
        self._tokens.extend(int(t) for t in toks)
        self._logits = np.asarray(logits, dtype=np.float32)

    def sync(
        self,
        tokens: Sequence[int],
        *,
        progress: Callable[[int, int], None] | None = None,
        frontier_every: int | None = None,
        on_frontier: Callable[[Session], None] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> int:
        """Make the session describe ``tokens``; return how many were reused.

        Extends the live state when it is valid and ``tokens`` extends it;
        otherwise rebuilds from scratch. With ``frontier_every``, prefill is
        split at absolute multiples of it and ``on_frontier(self)`` runs at
        each (the state is valid there: continued saves hook in here). With
        ``cancel``, prefill is also split at absolute multiples of the
        engine's batch (``prefill_chunk``, where the engine's own batches
        fall, so results are unchanged) and ``cancel()`` is asked before each
        piece: when it says so, :class:`ds4.errors.PrefillCancelledError` is
        raised with the session valid at the tokens evaluated. On any other
        failure the session is invalid and the error propagates."""
        tokens = [int(t) for t in tokens]
        self.check_prompt(tokens)
        reused = 0
        if self._valid and len(tokens) >= len(self._tokens) and tokens[: len(self._tokens)] == self._tokens:
            reused = len(self._tokens)
        else:
            self.invalidate("sync rebuild")
            self._valid = True  # an empty state describes zero tokens exactly
        if reused == len(tokens):
            return reused
        self._prefill_from(tokens, reused, progress, frontier_every, on_frontier, cancel)
        return reused

    @property
    def prefill_chunk(self) -> int:
        """Where a cancellable prefill may stop: absolute multiples of the
        engine's batch (512 when it has none)."""
        return int(getattr(self.engine, "n_batch", 0) or 512)

    def _cuts(self, start: int, end: int, frontier_every: int | None, cancellable: bool) -> list[int]:
        cuts = {end}
        snap_every = self.snapshots.every if self._snap_on and self.snapshots.enabled else None
        for every in (frontier_every, self.prefill_chunk if cancellable else None, snap_every):
            if every:
                cuts.update(range((start // every + 1) * every, end, every))
        return sorted(cuts)

    def _prefill_from(
        self,
        tokens: list[int],
        start: int,
        progress: Progress | None,
        frontier_every: int | None,
        on_frontier: Callable[[Session], None] | None,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        total = len(tokens) - start
        cuts = self._cuts(start, len(tokens), frontier_every if on_frontier else None, cancel is not None)
        pos = start
        for cut in cuts:
            if cancel is not None and cancel():
                raise PrefillCancelledError(pos, len(tokens))
            base = pos - start

            def prog(done: int, _tot: int, base: int = base, progress: Progress | None = progress) -> None:
                assert progress is not None
                progress(base + done, total)

            self._eval(tokens[pos:cut], prog if progress else None)
            pos = cut
            every = self.snapshots.every
            if cut == len(tokens) or (every and cut % every == 0):
                self._snapshot(periodic=cut != len(tokens))
            if on_frontier and frontier_every and cut % frontier_every == 0:
                on_frontier(self)

    def _snapshot(self, periodic: bool) -> None:
        """Keep the live state in RAM where the engine cannot always rewind."""
        if self._snap_on and self.snapshots.enabled:
            self.snapshots.add(self._tokens, self._ectx.export_state(), periodic)

    def eval_token(self, token: int) -> np.ndarray:
        """Decode one token on top of a valid state; returns the new logits."""
        if not self._valid:
            raise InvalidSessionError("cannot extend a session without a valid checkpoint")
        if len(self._tokens) + 1 >= self.ctx:
            raise ContextOverflowError(len(self._tokens) + 1, self.ctx)
        self._eval([int(token)], step=True)
        logits = self.logits
        assert logits is not None  # a valid session has logits
        return logits

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Common token prefix with the live state (0 when invalid)."""
        if not self._valid:
            return 0
        return common_token_prefix(self._tokens, tokens)

    def rewind(self, n_tokens: int) -> bool:
        """Keep the first ``n_tokens`` (1 <= n <= n_past) live tokens, state
        and logits exactly a cold prefill's. False, the session untouched,
        when the engine cannot rewind there and no RAM snapshot is at or
        before the cut (one is: imported, the gap prefilled, ``last_snapshot``
        says where); an engine failure half-way invalidates and raises."""
        n = int(n_tokens)
        if not self._valid or not 0 < n <= len(self._tokens):
            return False
        if n == len(self._tokens):
            return True
        self.last_snapshot = None
        try:
            if self._ectx.truncate(n):
                logits = np.asarray(self._ectx.last_logits(), dtype=np.float32)
            elif (snap := self.snapshots.best(self._tokens, n)) is not None and self._snap_on:
                # no cut: the newest snapshot at or before it, the gap prefilled
                logits = restore(self._ectx, snap, self._tokens[:n])
                self.last_snapshot = len(snap.tokens)
                self.snapshots.counters["restored"] += 1
            else:
                return False
        except Exception as e:
            # the engine may have changed its state half-way: never left valid
            self.invalidate(f"rewind failed: {e}")
            raise
        del self._tokens[n:]
        self._logits = logits
        return True

    def rewrite_from_common(self, tokens: Sequence[int]) -> Rewrite:
        """ds4's rewrite: OK when the common prefix is the whole live state
        (then extend), or when the engine can rewind to it; REBUILD_NEEDED
        (session untouched) when it cannot; ERROR on bad input or an invalid
        session. ``last_error`` says why."""
        tokens = [int(t) for t in tokens]
        self.last_error = None
        if len(tokens) == 0 or len(tokens) >= self.ctx:
            self.last_error = "prompt exceeds context" if tokens else "prompt is empty"
            return Rewrite.ERROR
        if not self._valid:
            self.last_error = "session has no valid checkpoint"
            return Rewrite.ERROR
        common = self.common_prefix(tokens)
        live = len(self._tokens)
        if common < live:
            try:
                rewound = self.rewind(common)
            except Exception as e:
                self.last_error = f"rewind failed: {e}"
                return Rewrite.ERROR
            if not rewound:
                self.last_error = f"rewrite needs rebuild: common={common} live={live} canonical={len(tokens)}"
                return Rewrite.REBUILD_NEEDED
        try:
            self.sync(tokens)
        except Exception as e:
            self.last_error = str(e)
            return Rewrite.ERROR
        return Rewrite.OK

    # -- checkpoints ---------------------------------------------------------
    def export_arrays(self) -> dict[str, np.ndarray]:
        """Named arrays for a checkpoint of the live state (valid only)."""
        if not self._valid or not self._tokens:
            raise InvalidSessionError("cannot save a session without a valid checkpoint")
        self.canonicalize()  # what is stored or copied is a prefill's state
        arrays = dict(self._ectx.export_state())
        if TOKENS_TENSOR in arrays:
            raise EngineError(f"engine state uses the reserved tensor name {TOKENS_TENSOR!r}")
        arrays[TOKENS_TENSOR] = np.asarray(self._tokens, dtype=np.int32)
        return arrays

    def load_arrays(self, arrays: Mapping[str, np.ndarray], n_tokens: int, *, text: bytes | None = None) -> None:
        """Replace the live state with a checkpoint's arrays, transactionally:
        everything is validated before the live state changes; if the engine
        fails half-way the session is invalid (never half-loaded). With
        ``text`` (the checkpoint's verified text), the tokens must render
        exactly it, after this session's namespace preamble (:meth:`key_of`):
        the text is what was verified against the prompt, the tokens are
        what the engine continues from."""
        toks = check_tokens(arrays, n_tokens)
        if n_tokens >= self.ctx:
            raise ContextTooSmallError(f"{n_tokens} tokens do not fit a context of {self.ctx}")
        if int(toks.max()) >= self.engine.vocab_size:
            raise EngineStateError("payload tokens are out of the vocabulary's range")
        state = {k: v for k, v in arrays.items() if k != TOKENS_TENSOR}
        if "logits" not in state or state["logits"].shape != (self.engine.vocab_size,):
            raise EngineStateError("payload has no logits of the vocabulary's size")
        new_tokens = [int(t) for t in toks]
        if text is not None and self.key_of(new_tokens) != text:
            raise TokensTextMismatchError(f"the {n_tokens} tokens do not render the checkpoint's {len(text)}-byte text")
        new_logits = np.array(state["logits"], dtype=np.float32)  # own copy
        try:
            self._ectx.import_state(state, n_tokens)
        except (EngineStateError, ImportFailedError):
            # engines validate before mutating; invalidated anyway: never foreign state marked valid
            self.invalidate("engine rejected checkpoint")
            raise
        except Exception as e:  # not proven corrupt (a limit of the engine): kept
            self.invalidate(f"engine failed loading checkpoint: {e}")
            raise ImportFailedError(f"engine failed to load the state: {e}") from e
        know = getattr(self._ectx, "know_tokens", None)
        if know is not None:
            know(new_tokens)  # verified against the text: a rewind may re-decode them
        self._tokens = new_tokens
        self._logits = new_logits
        self._valid = True

    def load_checkpoint(self, ck: Checkpoint) -> None:
        """Load an opened, verified :class:`ds4.checkpoint.Checkpoint`."""
        if ck.abi != self._abi:
            from .errors import AbiMismatchError

            raise AbiMismatchError(f"payload ABI {ck.abi!r} differs from {self._abi!r}", path=str(ck.path))
        try:
            self.load_arrays(ck.load_arrays(), ck.tokens, text=bytes(ck.text))
        except CheckpointError:
            # a map that lost its pages reads zeros, which fail any check:
            # then the truncation is the cause, and is what is raised
            self._check_intact(ck)
            raise
        # what the engine read is what was verified (no truncation or rewrite meanwhile)
        self._check_intact(ck)

    def _check_intact(self, ck: Checkpoint) -> None:
        """The load's last step: what the engine read is what was verified
        (no page of the map lost, its lease not taken by a writer), then the
        lease goes back so writers waiting for the file go on."""
        try:
            ck.check_intact()
        except CheckpointError as e:
            self.invalidate(f"checkpoint {e.code} while loading")
            raise
        finally:
            ck.release()

    def generate(
        self, max_tokens: int, *, stop_tokens: Sequence[int] = (), on_token: Callable[[int], None] | None = None
    ) -> list[int]:
        """Greedy decode up to ``max_tokens``; stops after a stop token (which
        is returned but not evaluated, so the state ends at the last decoded
        token's logits)."""
        out: list[int] = []
        stops = set(int(s) for s in stop_tokens)
        for _ in range(max_tokens):
            t = self.argmax()
            out.append(t)
            if on_token:
                on_token(t)
            if t in stops or self.n_past + 1 >= self.ctx:
                break
            self.eval_token(t)
        return out
