"""System text that changes on every request, taken out before a prompt is
rendered and keyed (on every protocol), so that an agent's turns stay
prefix hits.

The billing line
    Claude Code (>= 2.1) opens its system prompt with ``x-anthropic-billing-
    header: cc_version=...; cc_entrypoint=...; cch=<5 hex>;``, and ``cch``
    changes on every request: kept, every turn would be a prefill from
    there on. A system text whose *first line* starts with
    ``x-anthropic-billing-header:`` loses that line and its newline, nothing
    else (a text that was only that line disappears): an Anthropic ``system``
    string or each of its blocks, a chat ``system``/``developer`` message, a
    Responses ``instructions`` or ``system``/``developer`` message (proxies
    forward the line there too). Anthropic's other ``x-anthropic-`` first
    lines go the same way (ds4 drops such blocks). ``--keep-billing-header``
    keeps the billing line. The removal is logged at info level once per
    client, a client being a distinct (``cc_version``, ``cc_entrypoint``)
    pair of the line (the first :data:`MAX_LOGGED` pairs; ``cch`` is never
    logged).

Volatile lines (``--prompt-volatile REGEX``, repeatable)
    Each line of system text (the client's; not the tools block, never a
    user's or an assistant's text) that a pattern matches (``re.search``:
    ``^`` anchors at the line's start) is dropped (``drop``, the default) or
    moved (``tail``): the matched lines of all system messages, in their
    order, become one system turn of their own after the last message, just
    before the assistant's turn, so the model still sees them while the
    system text and the history before them stay the same from turn to turn.
    A system text that held only such lines disappears. A turn's canonical
    checkpoint (ds4.server.conversation) holds the stable part and the reply,
    never the tail turn, so the next request, which renders its own tail
    turn after its own last message, extends it.

Transient spans (``--prompt-transient REGEX``, repeatable;
``--prompt-transient-builtin`` adds :data:`BUILTIN_TRANSIENT`)
    Agents inject per-turn text *into* user and tool messages (Claude
    Code's ``<system-reminder>`` blocks, Cline's and Roo's
    ``<environment_details>``) and drop it from older messages on the next
    request, so the history no longer starts with what was prefilled. Each
    match (``re.search`` with ``re.DOTALL``) in a user or tool turn's text
    is taken out with the white space around it (a span between two texts
    leaves one blank line, at either end nothing). ``drop`` (the default
    mode): every span is removed. ``tail``: the spans of the messages after
    the last assistant message (the current request's own) go, in their
    order, into the tail system turn after the last message, with the
    volatile lines, so the model still sees the current ones; older
    messages' spans are dropped (the chat template must accept a system
    turn there: Gemma's refuses one). The trade-off: the model never sees
    older spans, and in ``tail`` the current ones after the conversation
    rather than in their message.

These rules are a function of the request alone (a replayed history and a
``previous_response_id`` chain render the same).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, cast

from ..keytext import BUILTIN_TRANSIENT
from ..serve_args import VOLATILE_MODES as MODES

__all__ = ["BILLING", "BUILTIN_TRANSIENT", "MODES", "SystemText"]


class _Message(Protocol):
    role: str
    content: str


M = TypeVar("M", bound=_Message)


log = logging.getLogger("ds4.server")

BILLING = "x-anthropic-billing-header:"
ANTHROPIC = "x-anthropic-"
#: distinct clients whose billing line's removal is logged (then no more lines)
MAX_LOGGED = 256


def _field(v: str) -> str:
    return "".join(ch for ch in v if ch.isprintable())[:64]


class SystemText:
    """What ``ds4 serve`` takes out of the system text of a request."""

    def __init__(
        self,
        keep_billing_header: bool = False,
        patterns: Sequence[str] = (),
        mode: str = "drop",
        transient: Sequence[str] = (),
        transient_mode: str = "drop",
    ):
        if mode not in MODES or transient_mode not in MODES:
            raise ValueError(f"modes are {', '.join(MODES)}, not {mode!r} or {transient_mode!r}")
        self.keep_billing_header = keep_billing_header
        self.patterns = tuple(re.compile(p) for p in patterns)  # re.error for a bad one
        self.mode = mode
        #: spans taken out of user and tool turns (module docstring)
        self.transient = tuple(re.compile(r"\s*(?:" + p + r")\s*", re.DOTALL) for p in transient)
        self.transient_mode = transient_mode
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # parsers run on the loop's pool, renders on the worker

    def header(self, text: str, anthropic: bool = False) -> str | None:
        """``text`` without its first line when that line is the billing
        header (with ``anthropic``, any ``x-anthropic-`` line), and without
        that line's newline; None when nothing is left."""
        first, _, rest = text.partition("\n")
        if first.startswith(BILLING):
            if self.keep_billing_header:
                return text
            self._logged_once(first)
        elif not (anthropic and first.startswith(ANTHROPIC)):
            return text
        return rest or None

    def _logged_once(self, line: str) -> None:
        fields = dict(kv.strip().partition("=")[::2] for kv in line[len(BILLING) :].split(";"))
        client = (_field(fields.get("cc_version", "")), _field(fields.get("cc_entrypoint", "")))
        with self._lock:
            if client in self._logged or len(self._logged) >= MAX_LOGGED:
                return
            self._logged.add(client)
        log.info(
            "x-anthropic-billing-header removed from the system text (cc_version=%s cc_entrypoint=%s): "
            "its cch changes on every request; --keep-billing-header keeps it",
            *client,
        )

    def lines(self, text: str) -> tuple[str, list[str]]:
        """(``text`` without the lines a pattern matches, those lines)."""
        if not self.patterns:
            return text, []
        kept: list[str] = []
        moved: list[str] = []
        for line in text.split("\n"):
            (moved if any(p.search(line) for p in self.patterns) else kept).append(line)
        return ("\n".join(kept), moved) if moved else (text, [])

    def spans(self, text: str) -> tuple[str, list[str]]:
        """(``text`` without its transient spans, those spans stripped)."""
        if not self.transient:
            return text, []
        found: list[str] = []

        def cut(m: re.Match[str]) -> str:
            found.append(m.group(0).strip())
            inner = m.start() > 0 and m.end() < len(m.string)
            return "\n\n" if inner else ""

        for p in self.transient:
            text = p.sub(cut, text)
        return text, found

    def strip_messages(self, messages: Sequence[M]) -> tuple[list[M], list[str]]:
        """(``messages`` with the transient spans out of every user and tool
        message's content, the spans of those after the last assistant
        message): before the chat convention renders them, so a message
        reads as its client sends it once the span is dropped; a user
        message left empty goes (Claude Code sends a reminder as a text
        block beside tool results, a user message of its own here, and
        drops the block, so the message, from older requests)."""
        if not self.transient:
            return list(messages), []
        last_reply = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        out: list[M] = []
        current: list[str] = []
        for i, m in enumerate(messages):
            if m.role not in ("user", "tool"):
                out.append(m)
                continue
            text, cut = self.spans(m.content)
            if i > last_reply:
                current += cut
            if cut and m.role == "user" and not text.strip() and not getattr(m, "tool_calls", None):
                continue  # a message that held only spans (Claude Code's reminder block): the client drops it whole
            out.append(cast(M, dataclasses.replace(cast(Any, m), content=text)) if cut else m)
        return out, current

    def render(self, turns: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """Engine chat turns as rendered: each system turn without its
        volatile lines (one that held only those disappears); in ``tail``
        mode, those lines as a system turn after the last."""
        out, tail = self.split(turns)
        return [*out, tail] if tail is not None else out

    def split(
        self, turns: Sequence[dict[str, str]], spans: Sequence[str] = ()
    ) -> tuple[list[dict[str, str]], dict[str, str] | None]:
        """(the turns without their volatile lines, the ``tail`` mode's
        system turn of those lines, and in ``tail`` transient mode of the
        current ``spans`` (:meth:`strip_messages`), or None): :meth:`render`
        in two parts, so that a turn's canonical checkpoint can leave the
        tail out."""
        out: list[dict[str, str]] = []
        tail: list[str] = []
        for t in turns:
            if t["role"] != "system":
                out.append(t)
                continue
            text, moved = self.lines(t["content"])
            tail += moved
            if not moved:
                out.append(t)
            elif text.strip("\n"):
                out.append({**t, "content": text})
        parts = ["\n".join(tail)] if tail and self.mode == "tail" else []
        parts += list(spans) if self.transient_mode == "tail" else []
        if parts:
            return out, {"role": "system", "content": "\n\n".join(parts)}
        return out, None
