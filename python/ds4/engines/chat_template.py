"""Chat templates for llama.cpp models: the GGUF's own
``tokenizer.chat_template``, a built-in for known families whose GGUF has
none, or a typed error.

Which one renders a chat (:func:`chat_renderer`)
    1. The GGUF's ``tokenizer.chat_template``, rendered with Jinja2 the way
       llama-cpp-python's ``Jinja2ChatFormatter`` (and Transformers) render
       it: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
       ``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}``
       passed through, ``tojson`` without ASCII escapes, and the variables
       ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``,
       ``raise_exception`` and ``strftime_now`` (``tools`` and the like are
       None). The template is never patched (:class:`TemplateRenderer`).
    2. Without one, a built-in for the architecture (``general.architecture``):
       Gemma (``gemma``, ``gemma2``, ``gemma3``, ``gemma3n``) is
       :func:`render_gemma`, the official Gemma 3 template reimplemented.
    3. Otherwise :class:`~ds4.errors.NoChatTemplateError`, which names
       ``--raw`` (run the prompt as raw text): ds4 never guesses a format.

What is special
    The result is a :class:`ds4.keytext.Prompt`. Only the template's own
    output may hold markers: a message's content (client text) is always a
    text span, so a user typing ``<|im_start|>`` or ``<start_of_turn>`` gets
    those characters' text tokens. Within the template's output, each
    occurrence of a control token's text (``<|im_start|>``, ``<bos>``,
    ``<start_of_turn>``: the engine's ``special_token_ids``) is a special
    span of its own and everything else is text, merged with the contents
    next to it, so the tokens are what tokenizing the whole rendering with
    special parsing gives when the contents hold no marker (and SmolLM2's
    spans are exactly :func:`~ds4.engines.llamacpp_lib.render_chatml`'s).

How the contents are found (the template's output is not trusted to tell)
    The chat is rendered twice: as it is, and with each non-empty content
    wrapped in sentinels that carry a random nonce. The wrapped rendering
    is split at the sentinels: each opening one must be followed by its own
    closing one, with the message's content between them unchanged. The
    pieces, sentinels removed, must then reproduce the plain rendering
    exactly, the template's own pieces as they are and each content as it
    is or stripped of its surrounding whitespace (str.strip, lstrip or
    rstrip: a template's ``| trim``). A template that cuts into, drops part
    of, transforms or branches on a content so that these checks fail
    raises :class:`~ds4.errors.ChatTemplateSegmentsError`, never a guess (a
    content may appear any number of times, each a text span).
    Messages reach the template as ``{"role", "content"}``, contents
    strings, and an assistant turn with reasoning also has
    ``reasoning_content`` (wrapped in sentinels and checked like a content:
    client text, a text span); a role holding a marker's text is refused.

Reasoning (``reasoning_content``)
    A GGUF template renders it as it was written to (Qwen3's renders it in
    ``<think>`` tags in the turns after the last user message and drops it
    from earlier ones; a template that never reads it, SmolLM2's, drops it
    everywhere). The Gemma built-in drops it (Gemma has no reasoning
    format). The reference engine's ChatML (:mod:`ds4.engines._bytetok`)
    keeps it in every turn.
"""

from __future__ import annotations

import json
import re
import secrets
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any, Protocol

from ..errors import ChatTemplateError, ChatTemplateSegmentsError, NoChatTemplateError
from ..keytext import Prompt

__all__ = [
    "BUILTIN_TEMPLATES",
    "GEMMA_ARCHS",
    "ChatRenderer",
    "MarkerSplitter",
    "TemplateRenderer",
    "chat_renderer",
    "marker_texts",
    "render_gemma",
]


class ChatRenderer(Protocol):
    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt: ...


# -- markers -------------------------------------------------------------------
class MarkerSplitter:
    """Splits trusted template text at marker (control token) texts,
    leftmost-longest."""

    def __init__(self, markers: Iterable[str]):
        self.markers = frozenset(m for m in markers if m)
        self._lengths = sorted({len(m) for m in self.markers}, reverse=True)
        self._first = frozenset(m[0] for m in self.markers)

    def find(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """The first marker in ``text`` at or after ``start``: (offset, marker)."""
        for i in range(start, len(text)):
            if text[i] in self._first:
                for n in self._lengths:
                    if text[i : i + n] in self.markers:
                        return i, text[i : i + n]
        return None

    def split(self, text: str) -> list[tuple[str, bool]]:
        """``text`` as (piece, is_marker) pieces."""
        out: list[tuple[str, bool]] = []
        at = 0
        while (hit := self.find(text, at)) is not None:
            i, m = hit
            out += [(text[at:i], False), (m, True)]
            at = i + len(m)
        out.append((text[at:], False))
        return [p for p in out if p[0]]


def _segments(spans: Iterable[tuple[str, bool]], splitter: MarkerSplitter) -> Prompt:
    """A Prompt from (text, trusted) spans: markers in trusted spans are
    special spans of their own; all other text is merged into text spans."""
    out: list[tuple[str, bool]] = []
    for text, trusted in spans:
        for piece, special in splitter.split(text) if trusted else [(text, False)]:
            if not special and out and not out[-1][1]:
                out[-1] = (out[-1][0] + piece, False)
            else:
                out.append((piece, special))
    return Prompt(out)


# -- messages ------------------------------------------------------------------
def _messages(messages: Sequence[Mapping[str, str]], splitter: MarkerSplitter) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages):
        try:
            role, content = m["role"], m["content"]
        except (KeyError, TypeError):
            raise ChatTemplateError(f"message {i}: a mapping with 'role' and 'content' is needed") from None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ChatTemplateError(f"message {i}: role and content must be strings")
        if splitter.find(role) is not None:
            raise ChatTemplateError(f"message {i}: the role {role!r} holds a marker")
        msg = {"role": role, "content": content}
        reasoning = m.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatTemplateError(f"message {i}: reasoning_content must be a string")
            if reasoning:
                msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


#: the message fields a template gets that are client text (each a text span)
_TEXT_FIELDS = ("content", "reasoning_content")


# -- the GGUF's template (Jinja2) ------------------------------------------------
def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


@cache
def _environment() -> Any:
    """The Jinja2 environment chat templates are compiled in (Jinja2 is
    imported on first use)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class IgnoreGenerationTags(jinja2.ext.Extension):
        """Transformers' ``{% generation %}`` tag, passed through."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[IgnoreGenerationTags, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    return env


_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points around a sentinel


class TemplateRenderer:
    """A GGUF chat template (Jinja2 source), compiled once.

    ``markers`` are the texts of the vocabulary's control tokens: the
    special spans of the template's output."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", markers: Iterable[str] = ()):
        import jinja2

        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.splitter = MarkerSplitter(markers)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the GGUF's chat template does not compile: {e}") from None

    def render_text(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        now: datetime | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's output as one string (what Jinja2ChatFormatter
        renders), markers and contents alike. ``template_kwargs``: more
        variables for the template (``enable_thinking``); never one of its
        own inputs."""
        import jinja2

        when = now or datetime.now()
        extra = dict(template_kwargs or {})
        try:
            out = self._template.render(
                **extra,
                messages=list(messages),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=bool(add_generation_prompt),
                raise_exception=_raise_exception,
                strftime_now=when.strftime,
                functions=None,
                function_call=None,
                tools=None,
                tool_choice=None,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        except TypeError as e:  # a variable named like one of the template's own inputs
            raise ChatTemplateError(f"the chat template's variables: {e}") from None
        return str(out)

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        msgs = _messages(messages, self.splitter)
        now = datetime.now()  # one clock for both renderings (strftime_now)
        plain = self.render_text(msgs, add_generation_prompt, now, template_kwargs)
        nonce = secrets.token_hex(8)
        if nonce in plain:  # pragma: no cover - 64 random bits
            raise ChatTemplateSegmentsError("the sentinel nonce occurs in the rendering")
        texts: list[str] = []  # what the k-th pair of sentinels holds
        wrapped = []
        for m in msgs:
            w = dict(m)
            for f in _TEXT_FIELDS:
                if m.get(f):
                    k = len(texts)
                    texts.append(m[f])
                    w[f] = f"{_OPEN}{nonce}.{k}.o{_CLOSE}{m[f]}{_OPEN}{nonce}.{k}.c{_CLOSE}"
            wrapped.append(w)
        marked = self.render_text(wrapped, add_generation_prompt, now, template_kwargs)
        pieces = _pieces(marked, nonce)
        if any(i >= 0 and text != texts[i] for text, i in pieces):
            raise ChatTemplateSegmentsError("the template transforms a message's content")
        spans = _align(pieces, plain)
        return _segments(spans, self.splitter)


def _pieces(marked: str, nonce: str) -> list[tuple[str, int]]:
    """The wrapped rendering as (text, message index) pieces, sentinels
    removed; the template's own pieces have index -1. A sentinel without its
    partner, or a remnant of one, raises."""
    pat = re.compile(re.escape(_OPEN + nonce) + r"\.(\d+)\.([oc])" + re.escape(_CLOSE))
    out: list[tuple[str, int]] = []
    at, open_at, open_id = 0, -1, ""
    for m in pat.finditer(marked):
        if m.group(2) == "o":
            if open_at >= 0:
                raise ChatTemplateSegmentsError("a message's content is cut or nested in the template's output")
            out.append((marked[at : m.start()], -1))
            open_at, open_id = m.end(), m.group(1)
        else:
            if open_at < 0 or m.group(1) != open_id:
                raise ChatTemplateSegmentsError("a message's content is cut in the template's output")
            out.append((marked[open_at : m.start()], int(open_id)))
            open_at = -1
        at = m.end()
    if open_at >= 0:
        raise ChatTemplateSegmentsError("a message's content is cut in the template's output")
    out.append((marked[at:], -1))
    if any(nonce in text for text, _ in out):
        raise ChatTemplateSegmentsError("a message's content is cut in the template's output")
    return out


def _align(pieces: Sequence[tuple[str, int]], plain: str) -> list[tuple[str, bool]]:
    """The plain rendering as (text, trusted) spans: ``pieces`` (the
    wrapped rendering's) must spell it, each template piece exactly and each
    content piece as it is or stripped (``| trim``). Raises
    ChatTemplateSegmentsError when they cannot."""
    # frontier: position in plain -> (previous position, the span that led here)
    steps: list[dict[int, tuple[int, str]]] = []
    frontier: dict[int, tuple[int, str]] = {0: (-1, "")}
    for text, index in pieces:
        options = list(dict.fromkeys((text, text.strip(), text.lstrip(), text.rstrip()))) if index >= 0 else [text]
        nxt: dict[int, tuple[int, str]] = {}
        for pos in frontier:
            for o in options:
                if plain.startswith(o, pos):
                    nxt.setdefault(pos + len(o), (pos, o))
        if not nxt:
            raise ChatTemplateSegmentsError(
                "the template's output with its contents marked differs from its output: "
                "its markers cannot be told apart from the messages' text"
            )
        steps.append(nxt)
        frontier = nxt
    if len(plain) not in frontier:
        raise ChatTemplateSegmentsError("the template's output with its contents marked is not its output")
    spans: list[tuple[str, bool]] = []
    pos = len(plain)
    for (_, index), step in zip(reversed(pieces), reversed(steps), strict=True):
        prev, text = step[pos]
        spans.append((text, index < 0))
        pos = prev
    spans.reverse()
    return spans


# -- built-ins -----------------------------------------------------------------
GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})
_GEMMA_MARKERS = MarkerSplitter(("<bos>", "<start_of_turn>", "<end_of_turn>"))


def render_gemma(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> Prompt:
    """Gemma's chat format, for a Gemma GGUF without a template: the
    official Gemma 3 template reimplemented (tests/test_chat_template.py
    proves them equal). ``<bos>``, then a ``<start_of_turn>ROLE\\n`` ...
    ``<end_of_turn>\\n`` turn per message, contents stripped of surrounding
    whitespace (the template's ``| trim``), ``assistant`` named ``model``; a
    leading system message is no turn of its own but opens the first turn's
    content (its text, ``"\\n\\n"``, then the content). Roles must alternate
    user, assistant, ... after it (the template's own refusal, here a
    :class:`~ds4.errors.ChatTemplateError`). The generation prompt is
    ``<start_of_turn>model\\n``. Markers are special spans, roles and
    contents text.

    One extension, only where the official template refuses: Gemma has no
    tool turn after a model turn (a ``tool`` turn is accepted only where a
    model turn would be), so a ``tool`` turn where a user turn belongs is
    rendered as that user turn, and a user turn right after it (the text an
    agent sends beside its tool results) is joined to it after a blank
    line: an agent's tool loop renders instead of being refused."""
    msgs = _messages(messages, _GEMMA_MARKERS)
    prefix = ""
    if msgs and msgs[0]["role"] == "system":
        prefix = msgs[0]["content"] + "\n\n"
        msgs = msgs[1:]
    msgs = _gemma_tool_turns(msgs)
    out: list[tuple[str, bool]] = [("<bos>", True)]
    for i, m in enumerate(msgs):
        role = m["role"]
        if (role == "user") != (i % 2 == 0):
            _raise_exception("Conversation roles must alternate user/assistant/user/assistant/...")
        role = "model" if role == "assistant" else role
        body = (prefix if i == 0 else "") + m["content"].strip()
        out += [("<start_of_turn>", True), (f"{role}\n{body}", False), ("<end_of_turn>", True), ("\n", False)]
    if add_generation_prompt:
        out += [("<start_of_turn>", True), ("model\n", False)]
    return Prompt(out)


def _gemma_tool_turns(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """:func:`render_gemma`'s extension: a ``tool`` turn at a user turn's
    place becomes that user turn, and a user turn right after it is joined
    to it (contents trimmed, as the template trims, a blank line between)."""
    out: list[dict[str, str]] = []
    joinable = False  # the last turn is a tool turn made a user turn
    for m in msgs:
        if m["role"] == "tool" and len(out) % 2 == 0:
            out.append({**m, "role": "user"})
            joinable = True
        elif m["role"] == "user" and joinable:
            out[-1] = {**out[-1], "content": out[-1]["content"].strip() + "\n\n" + m["content"].strip()}
            joinable = False
        else:
            out.append(m)
            joinable = False
    return out


class _Builtin:
    def __init__(self, fn: Callable[[Sequence[Mapping[str, str]], bool], Prompt]):
        self.fn = fn

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """A built-in format: it reads no template variable (``template_kwargs`` ignored)."""
        return self.fn(messages, add_generation_prompt)


#: architecture -> the built-in format of a GGUF of it without a template
BUILTIN_TEMPLATES: dict[str, Callable[[Sequence[Mapping[str, str]], bool], Prompt]] = dict.fromkeys(
    GEMMA_ARCHS, render_gemma
)


# -- per engine ----------------------------------------------------------------
def marker_texts(engine: Any) -> frozenset[str]:
    """The texts of the engine's control tokens (``special_token_ids``)."""
    out = set()
    for t in getattr(engine, "special_token_ids", ()):
        try:
            out.add(engine.token_bytes(t).decode("utf-8"))
        except UnicodeDecodeError:
            continue
    out.discard("")
    return frozenset(out)


def _token_text(engine: Any, token: int | None) -> str:
    if token is None or not 0 <= token < int(engine.vocab_size):
        return ""
    return bytes(engine.token_bytes(token)).decode("utf-8", "replace")


def _bos_id(engine: Any) -> int | None:
    raw = engine.meta("tokenizer.ggml.bos_token_id")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _build(engine: Any) -> ChatRenderer:
    source = getattr(engine, "chat_template", None)
    arch = getattr(engine, "arch", "") or ""
    if source:
        return TemplateRenderer(
            source,
            bos_token=_token_text(engine, _bos_id(engine)),
            eos_token=_token_text(engine, getattr(engine, "eos_token_id", None)),
            markers=marker_texts(engine),
        )
    fn = BUILTIN_TEMPLATES.get(arch)
    if fn is not None:
        return _Builtin(fn)
    raise NoChatTemplateError(
        f"the model has no chat template (no tokenizer.chat_template in its GGUF) and ds4 has no built-in "
        f"format for its architecture {arch or '(unknown)'!r}: a chat cannot be rendered for it; "
        "run the prompt as raw text (ds4 run --raw, or the completions endpoint)"
    )


_RENDERERS: weakref.WeakKeyDictionary[Any, ChatRenderer] = weakref.WeakKeyDictionary()


def chat_renderer(engine: Any) -> ChatRenderer:
    """The renderer of the engine's chats (built once per engine): its
    GGUF's template, else its architecture's built-in; else
    :class:`~ds4.errors.NoChatTemplateError`. ``engine`` needs ``arch`` and
    ``chat_template``; the template path also ``meta``, ``vocab_size``,
    ``eos_token_id``, ``token_bytes`` and ``special_token_ids``."""
    try:
        hit = _RENDERERS.get(engine)
    except TypeError:  # not weak-referenceable
        return _build(engine)
    if hit is None:
        hit = _RENDERERS[engine] = _build(engine)
    return hit
