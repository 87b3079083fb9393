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

These rules are a function of the request alone (a replayed history and a
``previous_response_id`` chain render the same).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

from ..serve_args import VOLATILE_MODES as MODES

__all__ = ["BILLING", "MODES", "SystemText"]

log = logging.getLogger("ds4.server")

BILLING = "x-anthropic-billing-header:"
ANTHROPIC = "x-anthropic-"
#: distinct clients whose billing line's removal is logged (then no more lines)
MAX_LOGGED = 256


def _field(v: str) -> str:
    return "".join(ch for ch in v if ch.isprintable())[:64]


class SystemText:
    """What ``ds4 serve`` takes out of the system text of a request."""

    def __init__(self, keep_billing_header: bool = False, patterns: Sequence[str] = (), mode: str = "drop"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.keep_billing_header = keep_billing_header
        self.patterns = tuple(re.compile(p) for p in patterns)  # re.error for a bad one
        self.mode = mode
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

    def render(self, turns: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """Engine chat turns as rendered: each system turn without its
        volatile lines (one that held only those disappears); in ``tail``
        mode, those lines as a system turn after the last."""
        out, tail = self.split(turns)
        return [*out, tail] if tail is not None else out

    def split(self, turns: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, str] | None]:
        """(the turns without their volatile lines, the ``tail`` mode's
        system turn of those lines or None): :meth:`render` in two parts,
        so that a turn's canonical checkpoint can leave the tail out."""
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
        if tail and self.mode == "tail":
            return out, {"role": "system", "content": "\n".join(tail)}
        return out, None
