"""Constrained decoding: a grammar the generated text must match.

A :class:`Constraint` is a compiled grammar, independent of any engine:

* ``Constraint.json_schema(schema)``: JSON that validates against ``schema``
  (a dict, or its JSON text);
* ``Constraint.json_object()``: any JSON object;
* ``Constraint.lark(grammar_text)``: llguidance's Lark syntax, where
  ``%json { ... }`` embeds a JSON schema, so "this literal prefix, then JSON
  matching this schema, then this literal suffix", possibly repeated, is::

      start: call+
      call: "<tool_call>" %json {"type": "object", ...} "</tool_call>"

  (``json_rule(schema)`` writes the ``%json`` part in ds4's JSON format).

An invalid, unsupported or too large schema or grammar raises
:class:`ds4.errors.ConstraintError` from the constructor.

JSON under a schema is written on one line, with ``", "`` between items and
``": "`` after keys (``{"a": 1, "b": [2, 3]}``): no free whitespace, so a
weak model cannot loop on newlines. A schema with its own ``"x-guidance"``
key gets llguidance's options instead (``{}``: its defaults, free
whitespace between items; see :data:`JSON_FORMAT`). A bare
``%json`` in a Lark grammar has llguidance's defaults (free whitespace);
:func:`json_rule` writes one in ds4's format.

At decode time (:meth:`Constraint.start`) the grammar meets an engine's
vocabulary, built once per engine from ``Engine.token_bytes``; the engine's
special tokens (``special_token_ids`` when it names them, else its
end-of-generation tokens) can never be produced as text, and its
end-of-generation tokens end the text. A :class:`Guide` then masks each
step's logits (the turn driver samples from what is left) and advances on
the chosen token. Nothing else changes: not the prompt, not the KV state,
not the cache keys.

The library is llguidance (see docs/DESIGN.md, "Constrained decoding").
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import llguidance as llg
import numpy as np

from .engine import Engine
from .errors import ConstraintError

log = logging.getLogger("ds4.constrain")

__all__ = ["JSON_FORMAT", "Constraint", "Guide", "engine_tokenizer", "json_rule"]

#: how JSON under a schema is written (llguidance's JSON options, given to
#: it as the schema's "x-guidance", unless the schema has its own)
JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: the grammar of any JSON object
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _schema(schema: Mapping[str, Any] | str) -> dict[str, Any]:
    """``schema`` as a dict with ds4's JSON format in its "x-guidance"."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ConstraintError(f"the JSON schema is not JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be an object, not {type(schema).__name__}")
    if "x-guidance" in schema:  # the schema's own options, as llguidance reads them
        if not isinstance(schema["x-guidance"], Mapping):
            raise ConstraintError("invalid JSON schema: 'x-guidance' must be an object")
        return dict(schema)
    return {**schema, "x-guidance": JSON_FORMAT}


def json_rule(schema: Mapping[str, Any] | str) -> str:
    """A Lark ``%json { ... }`` item for ``schema``, in ds4's JSON format:
    ``f'call: "<tool_call>" {json_rule(schema)} "</tool_call>"'``. The
    schema is checked when the whole grammar is (:meth:`Constraint.lark`)."""
    return "%json " + json.dumps(_schema(schema), ensure_ascii=False)


def _check(grammar: str, what: str) -> str:
    """``grammar`` when llguidance accepts it; ConstraintError otherwise."""
    try:
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConstraintError(f"invalid {what}: {e}") from None
    if is_error:
        raise ConstraintError(f"invalid {what}: {msgs[0] if msgs else 'rejected'}")
    return grammar


class Constraint:
    """A grammar the generated text must match (build it with the class
    methods). ``kind`` is ``json_schema``, ``json_object`` or ``lark``;
    ``grammar`` is llguidance's compiled form."""

    __slots__ = ("grammar", "kind")

    def __init__(self, kind: str, grammar: str):
        self.kind = kind
        self.grammar = grammar

    def __repr__(self) -> str:
        return f"Constraint({self.kind})"

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Constraint:
        """JSON that validates against ``schema`` (a JSON Schema object as a
        dict, or its JSON text)."""
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(_schema(schema))
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConstraintError(f"invalid JSON schema: {e}") from None
        return cls("json_schema", _check(grammar, "JSON schema"))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object."""
        c = cls.json_schema(_ANY_OBJECT)
        c.kind = "json_object"
        return c

    @classmethod
    def lark(cls, grammar_text: str) -> Constraint:
        """llguidance's Lark grammar (``%json { schema }`` embeds a schema)."""
        if not isinstance(grammar_text, str):
            raise ConstraintError(f"a Lark grammar must be a str, not {type(grammar_text).__name__}")
        return cls("lark", _check(llg.LLMatcher.grammar_from_lark(grammar_text), "Lark grammar"))

    def start(self, engine: Engine, end_ids: Iterable[int] | None = None) -> Guide:
        """A fresh :class:`Guide` over ``engine``'s vocabulary; ``end_ids``
        are the tokens that end a generation (default: the engine's EOS)."""
        ends = tuple(sorted({int(t) for t in end_ids})) if end_ids else (int(engine.eos_token_id),)
        return Guide(engine_tokenizer(engine, ends), self.grammar, int(engine.vocab_size))


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` asks of a tokenizer, from an
    engine: every token's bytes (specials prefixed with 0xff, which no
    UTF-8 text contains), the end token, and a tokenize function."""

    def __init__(self, engine: Engine, ends: Sequence[int]):
        specials = getattr(engine, "special_token_ids", None)
        special = {int(t) for t in specials} if specials is not None else set()
        special.update(ends)
        self.eos_token_id = ends[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(special)
        self.tokens = [
            (b"\xff" + engine.token_bytes(t)) if t in special else engine.token_bytes(t)
            for t in range(int(engine.vocab_size))
        ]
        self._tokenize = engine.tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenize(text)


# one vocabulary per live engine (llama.cpp's takes ~0.1 s to build)
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], llg.LLTokenizer]] = weakref.WeakKeyDictionary()


def engine_tokenizer(engine: Engine, ends: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's view of ``engine``'s vocabulary with ``ends`` as its
    end tokens (cached for the engine's lifetime)."""
    key = tuple(ends)
    try:
        per_engine = _TOKENIZERS.setdefault(engine, {})
    except TypeError:  # an engine that cannot be weakly referenced: no cache
        per_engine = {}
    tok = per_engine.get(key)
    if tok is None:
        tok = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(engine, key)), eos_token=list(key))
        per_engine[key] = tok
    return tok


class Guide:
    """One generation under a constraint: :meth:`mask` the logits of each
    step, :meth:`advance` on the token chosen from them."""

    def __init__(self, tokenizer: llg.LLTokenizer, grammar: str, vocab_size: int):
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self._bits = np.zeros(((tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
        self._out = np.empty(vocab_size, dtype=np.float32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as a bool array."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids at ``-inf`` (a new
        array; ``logits`` is not modified)."""
        out = self._out
        out.fill(-np.inf)
        np.copyto(out, logits, where=self.allowed())
        return out

    def advance(self, token: int) -> bool:
        """Consume ``token``; True when the text is complete (the grammar
        allows nothing more than an end) or the matcher failed (logged)."""
        m = self.matcher
        if not m.consume_token(int(token)):
            log.warning("constrained decoding stopped: %s", m.get_error())
            return True
        return m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match."""
        return bool(self.matcher.is_accepting())
