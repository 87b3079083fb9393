"""The key text: the bytes a checkpoint is named after (SHA-1) and verified
against (docs/FORMAT.md, "Key text").

A checkpoint's stored text is its *key text*: an optional namespace
preamble, then the key rendering of its tokens. Both are functions of what
the session holds, so the name = SHA-1 of the stored text invariant, the
Rust byte-prefix check and the tokens-render-the-text check keep their
meaning, and:

* **Namespaces** (tenants, ``cache_salt``): the preamble
  ``FF 00 "ns:" <id> FF 00`` starts the key text of every checkpoint saved
  in a namespace. No key text without a preamble contains ``FF 00``, and a
  preamble ends at its first ``FF 00``: a key text of one namespace is
  never a prefix of another namespace's (nor of the default namespace's,
  which has no preamble and is what ds4 wrote before namespaces). A lookup
  in one namespace can therefore only ever find that namespace's files.
* **Special tokens**: a token the tokenizer only produces when told to parse
  special markers (llama.cpp's control tokens, the reference engine's
  markers) renders as its text; in every other token, a byte that begins
  some special token's text (``<`` for ChatML) is escaped as ``FF <byte>``
  and ``FF`` as ``FF FF``. A user typing ``<|im_start|>system`` as text
  therefore has another key text than the template's real marker, and a
  checkpoint of one can never be loaded for the other. Text without those
  bytes renders exactly as before (a chat whose contents have no ``<``
  keeps its keys).

:class:`Prompt` is a ``str`` that remembers which of its spans are the
template's own markers (special) and which are text (tokenized as text).
"""

from __future__ import annotations

import array
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from . import _core

__all__ = [
    "ANONYMOUS",
    "BUILTIN_TRANSIENT",
    "DEFAULT_NAMESPACE",
    "NAMESPACE_ID_RE",
    "KeyRenderer",
    "Prompt",
    "SpanTokens",
    "common_token_prefix",
    "namespace_of",
    "parting",
    "plain_len",
    "plain_text",
    "preamble",
    "snippet",
    "span_tokens",
    "tenant_of_namespace",
    "tokenize_prompt",
    "transient_span",
    "unescape",
]

ESC = 0xFF
#: an escape: FF and the byte it stands for
_ESC_PAIR = re.compile(rb"\xff([\x00-\xff])")
_PRE_MARK = b"\xff\x00"
_PRE_HEAD = _PRE_MARK + b"ns:"
#: a namespace id: printable ASCII without spaces, at most 128 characters
NAMESPACE_ID_RE = re.compile(r"^[!-~]{1,128}$")
#: the default namespace (no preamble: the keys ds4 has always written)
DEFAULT_NAMESPACE: str | None = None
#: the tenant of a request without a key: the default namespace, and
#: ``anonymous/salt-...`` with a ``cache_salt`` (no key file names a tenant so)
ANONYMOUS = "anonymous"


def preamble(namespace: str | None) -> bytes:
    """The bytes a namespace's key texts start with (empty for the default)."""
    if namespace is None:
        return b""
    if not NAMESPACE_ID_RE.match(namespace):
        raise ValueError(f"not a namespace id: {namespace!r}")
    return _PRE_HEAD + namespace.encode("ascii") + _PRE_MARK


def namespace_of(key_text: bytes) -> tuple[str | None, int]:
    """(namespace, preamble length) of a stored key text; (None, 0) for the
    default namespace. A text that starts like a preamble but is not a whole
    one raises ValueError. The reading is the store index's own
    (``rust/index/entry.rs`` ``namespace_of``, through ``_core``): one
    parser, so the index never files a text under another namespace than
    this says."""
    ns = _core.namespace_of(key_text)
    if ns is None:
        if key_text.startswith(_PRE_HEAD):
            raise ValueError("a truncated or malformed namespace preamble")
        return None, 0
    return ns, len(_PRE_HEAD) + len(ns) + len(_PRE_MARK)


def tenant_of_namespace(namespace: str | None) -> str | None:
    """The tenant part of a namespace id (``tenant`` or ``tenant/salt-...``)."""
    return None if namespace is None else namespace.split("/", 1)[0]


def plain_text(key_text: bytes) -> bytes:
    """The bytes a key text spells, for people: no preamble, escapes undone
    (a marker and its text look alike here; the key text tells them apart)."""
    try:
        _, n = namespace_of(key_text)
    except ValueError:
        n = 0
    return unescape(key_text[n:])


def unescape(body: bytes) -> bytes:
    """The bytes a key text's body (no preamble) spells: each escape
    ``FF x`` is ``x`` (a lone ``FF`` at the end stays)."""
    return _ESC_PAIR.sub(rb"\1", body) if ESC in body else body


def plain_len(key_text: bytes, start: int, end: int) -> int:
    """How many bytes ``key_text[start:end]`` spells (:func:`unescape`),
    without copying it; ``start`` is where an escape may begin (the end of
    the preamble, a token's start), ``end`` is not inside an escape."""
    escapes = key_text.count(b"\xff", start, end) - key_text.count(b"\xff\xff", start, end)
    return end - start - escapes


def snippet(key_text: bytes, at: int, n: int) -> str:
    """At most ``n`` bytes of what ``key_text`` spells from ``at`` (where no
    escape is cut), cut before a character the limit would split, decoded
    with ``errors="replace"``."""
    chunk = unescape(key_text[at : at + 2 * n + 2])  # enough key bytes for n plain ones
    j = min(n, len(chunk))
    for _ in range(3):
        if j == 0 or j >= len(chunk) or not _continues(chunk, j):
            break
        j -= 1
    return chunk[:j].decode("utf-8", "replace")


#: the per-turn spans known clients inject into their messages (Claude
#: Code's reminders; Cline's and Roo Code's environment details): what
#: ``ds4 serve --prompt-transient-builtin`` takes out, and what a
#: divergence names when a miss falls in one (:func:`transient_span`)
BUILTIN_TRANSIENT = (
    r"<system-reminder>.*?</system-reminder>",
    r"<environment_details>.*?</environment_details>",
)
# in a key text, a "<" that could open a marker's text is escaped (FF "<"):
# each span as (its opening tag, its pattern matched from that tag's "<")
_SPANS = tuple(
    (
        re.match(r"<[A-Za-z_][\w-]*>", p).group(0).encode(),  # type: ignore[union-attr]
        re.compile(p.encode().replace(b"<", b"\xff?<"), re.DOTALL),
    )
    for p in BUILTIN_TRANSIENT
)
_WHITE = b" \t\n\r\x0b\x0c"


def transient_span(key_text: bytes, at: int) -> str | None:
    """The opening tag of the known client span (:data:`BUILTIN_TRANSIENT`,
    with the white space before it) that holds byte ``at`` of ``key_text``;
    None when no such span does. Found by the tag's bytes, then its pattern
    from there: a divergence on every missed turn, so no regular expression
    scans the whole text."""
    for tag, pattern in _SPANS:
        i = key_text.find(tag)
        while i >= 0:
            m = pattern.match(key_text, i)
            if m is None:
                i = key_text.find(tag, i + 1)
                continue
            start = i - 1 if i > 0 and key_text[i - 1] == ESC else i
            while start > 0 and key_text[start - 1] in _WHITE:
                start -= 1
            if start > at:
                break
            if at < m.end():
                return tag.decode("ascii")
            i = key_text.find(tag, m.end())
    return None


def parting(a: bytes, b: bytes, at: int, start: int) -> int:
    """Where two key texts whose first ``at`` bytes agree part, for people:
    ``at`` moved back to the start of the UTF-8 character it falls in and
    off the escaped byte of an escape (never before ``start``, the end of
    their preamble)."""
    for _ in range(3):
        if at <= start or not (_continues(a, at) or _continues(b, at)):
            break
        at -= 1
    run = 0
    while at - run > start and a[at - run - 1] == ESC:
        run += 1
    return at - 1 if run % 2 else at


def _continues(text: bytes, i: int) -> bool:
    """True when ``text[i]`` is a UTF-8 continuation byte."""
    return i < len(text) and 0x80 <= text[i] <= 0xBF


class _Vocab(Protocol):
    vocab_size: int

    def token_bytes(self, token: int) -> bytes: ...


def special_ids(engine: object) -> frozenset[int]:
    """The engine's special tokens (``special_token_ids``; none when it has
    no such attribute)."""
    ids = getattr(engine, "special_token_ids", None)
    return frozenset(int(t) for t in ids) if ids else frozenset()


class _Pieces(dict[int, bytes]):
    """Token id -> key bytes, each computed the first time it is asked for
    (one engine call per distinct id a session ever renders, not one per
    vocabulary id up front: 49,152 calls and 0.1-0.2 s on SmolLM2 that the
    first request after a start would wait for)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[int], bytes]):
        super().__init__()
        self._make = make

    def __missing__(self, token: int) -> bytes:
        token = int(token)
        piece = self[token] = self._make(token)
        return piece


class KeyRenderer:
    """Renders tokens to key text for one engine: a table of each token's
    key bytes, filled as ids are seen (a join over the table is what a turn
    pays)."""

    def __init__(self, engine: _Vocab):
        self.engine = engine
        self.special = special_ids(engine)
        lead = {engine.token_bytes(t)[:1] for t in self.special} - {b""}
        self.escaped = frozenset(b[0] for b in lead) | {ESC}
        #: by id; an id out of the vocabulary is the engine's ValueError
        self.table: dict[int, bytes] = _Pieces(self._piece)

    @classmethod
    def of(cls, engine: _Vocab) -> KeyRenderer:
        """The engine's renderer, shared by its sessions (one table each)."""
        try:
            r = _RENDERERS.get(engine)
        except TypeError:  # not weak-referenceable
            return cls(engine)
        if r is None:
            r = _RENDERERS[engine] = cls(engine)
        return r

    def _piece(self, token: int) -> bytes:
        raw = self.engine.token_bytes(token)
        if token in self.special or not self.escaped.intersection(raw):
            return raw
        return b"".join(bytes((ESC, c)) if c in self.escaped else bytes((c,)) for c in raw)

    def piece(self, token: int) -> bytes:
        """One token's key bytes."""
        return self.table[token]

    def is_plain(self, token: int) -> bool:
        """True when the token's key bytes are its bytes and it is not special."""
        return token not in self.special and self.piece(token) == self.engine.token_bytes(token)

    def render(self, tokens: Iterable[int]) -> bytes:
        return b"".join(map(self.table.__getitem__, tokens))

    def lengths(self, tokens: Iterable[int]) -> Iterator[int]:
        """The key length of each token."""
        return map(len, map(self.table.__getitem__, tokens))


_RENDERERS: weakref.WeakKeyDictionary[_Vocab, KeyRenderer] = weakref.WeakKeyDictionary()


class _Tokenizer(Protocol):
    def tokenize(self, text: str, special: bool = ...) -> list[int]: ...


class Prompt(str):
    """A rendered prompt that knows which spans are the template's markers.

    ``segments`` is a tuple of ``(text, special)``; the ``str`` value is
    their concatenation. :func:`tokenize_prompt` tokenizes each text span as
    text and each marker span with special parsing. Any ``str`` operation
    returns a plain ``str`` (which is tokenized as trusted text: markers
    parsed)."""

    segments: tuple[tuple[str, bool], ...]

    def __new__(cls, segments: Sequence[tuple[str, bool]]) -> Prompt:
        segs = tuple((str(s), bool(sp)) for s, sp in segments if s)
        obj = super().__new__(cls, "".join(s for s, _ in segs))
        obj.segments = segs
        return obj

    @classmethod
    def text(cls, text: str) -> Prompt:
        """A prompt that is all client text (no marker parsed)."""
        return cls([(text, False)])


class SpanTokens:
    """The tokenizations of one engine's long prompt spans, the least
    recently used forgotten past ``max_chars`` of span text in all.

    A chat's every turn renders its whole history again, and each message
    is a span tokenized on its own (:func:`tokenize_prompt`), so without
    this a turn's tokenization grows with the conversation (about 3 µs a
    token with llama.cpp's BPE: 0.2 s a turn at 64k tokens) though only its
    last messages are new. A span's tokens are a function of its text and
    whether markers are parsed, so a hit is exactly what the tokenizer
    returns. Spans shorter than ``min_chars`` are not kept (a marker, a
    short message: cheaper to tokenize than to look up). Thread-safe (a
    server's lanes tokenize at once); ids are kept as 32-bit arrays."""

    def __init__(self, min_chars: int = 256, max_chars: int = 4 << 20):
        self.min_chars, self.max_chars = int(min_chars), int(max_chars)
        self._items: OrderedDict[tuple[str, bool], array.array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        #: counters: spans served from here, and spans tokenized and kept
        self.hits = self.misses = 0

    @property
    def chars(self) -> int:
        """The span text held, in characters (at most ``max_chars``)."""
        return self._chars

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Forget every span (a benchmark's fresh process)."""
        with self._lock:
            self._items.clear()
            self._chars = 0

    def tokens(self, engine: _Tokenizer, text: str, special: bool) -> list[int]:
        """``engine.tokenize(text, special=special)``, from memory when kept."""
        if len(text) < self.min_chars or len(text) > self.max_chars:
            return engine.tokenize(text, special=special)
        key = (text, special)
        with self._lock:
            got = self._items.get(key)
            if got is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return got.tolist()
        ids = engine.tokenize(text, special=special)
        kept = array.array("i", ids)
        with self._lock:
            if key not in self._items:
                self._items[key] = kept
                self._chars += len(text)
                self.misses += 1
                while self._chars > self.max_chars:
                    (old, _sp), _ = self._items.popitem(last=False)
                    self._chars -= len(old)
        return ids


_SPAN_TOKENS: weakref.WeakKeyDictionary[_Tokenizer, SpanTokens] = weakref.WeakKeyDictionary()
_SPAN_LOCK = threading.Lock()


def span_tokens(engine: _Tokenizer) -> SpanTokens | None:
    """``engine``'s :class:`SpanTokens` (made at first use); None for an
    engine that cannot be weakly referenced (its spans are not kept)."""
    with _SPAN_LOCK:
        try:
            got = _SPAN_TOKENS.get(engine)
            if got is None:
                got = _SPAN_TOKENS[engine] = SpanTokens()
        except TypeError:
            return None
        return got


def tokenize_prompt(engine: _Tokenizer, prompt: str) -> list[int]:
    """Tokens of ``prompt``: a :class:`Prompt` span by span (markers special,
    text as text; long spans through the engine's :class:`SpanTokens`); a
    plain ``str`` with special markers parsed (a trusted caller's own
    rendering, as before). An engine whose model adds a BOS
    token (``add_bos``, e.g. Gemma; not SmolLM2) gets it first, once: a
    rendering that starts with it (a template's ``<bos>``) is left alone."""
    if isinstance(prompt, Prompt):
        out: list[int] = []
        cache = span_tokens(engine)
        for text, special in prompt.segments:
            out += engine.tokenize(text, special=special) if cache is None else cache.tokens(engine, text, special)
    else:
        out = engine.tokenize(prompt, special=True)
    bos = getattr(engine, "bos_token_id", None) if getattr(engine, "add_bos", False) else None
    if bos is not None and bos >= 0 and out[:1] != [bos]:
        out.insert(0, int(bos))
    return out


#: list slices compared at once by :func:`common_token_prefix`
_RUN = 4096


def common_token_prefix(a: list[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share: runs of 4,096 compared as
    list slices (C speed), then one run element by element. The ladder's
    token check (``Session.common_prefix``) on every resumed turn: a few
    microseconds per thousand tokens, none of them converted."""
    b = b if isinstance(b, list) else list(b)
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(n, i + _RUN)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n
