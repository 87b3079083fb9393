"""The engine protocol.

An *engine* knows a model: how to render a chat into text, how to tokenize,
and how to make a fresh *context*. A *context* (one per Session) holds the KV
state of one token sequence and evaluates tokens on top of it.

Invariants every engine keeps (the Session relies on them):

* ``ctx.eval(tokens)`` appends ``tokens`` at position ``ctx.n_past`` and
  returns the float32 logits of the last one (shape ``[vocab_size]``). On any
  failure it raises :class:`ds4.errors.EngineError` and the context's state is
  unspecified (the Session invalidates itself).
* Evaluating ``a + b`` in one call or as ``a`` then ``b`` yields the same
  state and logits (bit-identical for the reference engine; token-identical
  greedy output for llama.cpp).
* ``ctx.export_state()`` returns named numpy arrays that describe exactly the
  ``n_past`` tokens; ``ctx.import_state(arrays, n_tokens)`` restores them.
  Import first validates everything it can (names, dtypes, shapes, token
  count) and raises :class:`ds4.errors.EngineStateError` *before* touching the
  live state; arrays may be read-only views of a memory-mapped file and must
  not be copied through Python ``bytes``.
* ``payload_abi()`` names engine id, model fingerprint and payload layout
  version; two engines with the same ABI string can load each other's
  payloads.
* Optionally, an engine says how large its exported state of n tokens can
  be: ``state_bytes()`` returns ``(fixed, per_token)`` (at most
  ``fixed + per_token * n`` bytes), or ``state_shapes(n)`` gives the float32
  arrays' shapes. :func:`state_bound` reads either; a load refuses a
  compressed checkpoint declaring more (docs/FORMAT.md §1.10).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class EngineContext(Protocol):
    n_ctx: int

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None:
        """Drop all state: ``n_past`` becomes 0."""

    def eval(self, tokens: Sequence[int], progress=None) -> np.ndarray:
        """Append ``tokens``; return float32 logits for the last one.

        ``progress(done, total)`` is called between chunks when given."""

    def export_state(self) -> dict[str, np.ndarray]:
        """The KV state of the ``n_past`` tokens as named arrays."""

    def import_state(self, arrays: Mapping[str, np.ndarray], n_tokens: int) -> None:
        """Replace the state with ``arrays`` (validated first)."""

    def truncate(self, n_tokens: int) -> bool:
        """Drop tokens past ``n_tokens``; False (state unchanged) when this
        engine cannot. After True, :meth:`last_logits` holds the logits of
        token ``n_tokens - 1``."""

    def last_logits(self) -> np.ndarray:
        """Logits after the last evaluated token (a copy)."""


@runtime_checkable
class Engine(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int
    max_ctx: int

    def payload_abi(self) -> str: ...

    def new_context(self, n_ctx: int) -> EngineContext: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat as text; engines return a :class:`ds4.keytext.Prompt`
        (a ``str``) whose marker spans are special and contents text. An
        engine may list its special tokens in ``special_token_ids`` (the
        key text escapes their lead bytes in other tokens).
        ``template_kwargs``: more variables for a chat template that reads
        them (``enable_thinking``); a format with no template ignores them."""

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Tokens of ``text``; ``special=True`` parses chat markers as special tokens."""

    def token_bytes(self, token: int) -> bytes: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...


def as_token_array(tokens: Sequence[int], vocab_size: int, dtype=np.int32) -> np.ndarray:
    """Validate token ids for ``EngineContext.eval`` before anything changes:
    a non-empty 1-D integer sequence, every id in ``[0, vocab_size)``.
    Raises ValueError otherwise."""
    try:
        arr = np.asarray(tokens)
    except Exception:
        raise ValueError("tokens must be a 1-D sequence of token ids") from None
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence of token ids")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size})")
    return arr.astype(dtype, copy=False)


#: what a checkpoint payload may hold beyond its arrays' bytes: the
#: format's alignment (64 bytes a tensor) with room to spare
STATE_SLACK = 1 << 20


def state_bound(engine: object) -> tuple[int, int] | None:
    """``(fixed, per_token)``: a checkpoint payload of n tokens of
    ``engine`` holds at most ``fixed + per_token * n`` raw bytes, from the
    engine's ``state_bytes()`` or ``state_shapes(n)`` (float32 arrays whose
    rows never grow faster than the tokens), plus the session's int32 token
    array, with slack (:data:`STATE_SLACK`, and a sixteenth more a token);
    None when the engine cannot say."""
    try:
        got = getattr(engine, "state_bytes", None)
        shapes = getattr(engine, "state_shapes", None)
        if callable(got):
            b = got()
            if b is None:
                return None
            fixed, per = int(b[0]), int(b[1])
        elif callable(shapes):

            def size(n: int) -> int:
                return sum(4 * math.prod(s) for s in shapes(n).values())

            fixed, per = size(0), size(1) - size(0)
        else:
            return None
    except Exception:  # an engine that cannot say: the loader's ratio rule only
        return None
    if fixed < 0 or per < 0:
        return None
    return fixed + STATE_SLACK, per + per // 16 + 4
