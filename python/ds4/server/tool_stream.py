"""The incremental tool-call parser of a stream: :class:`StreamSplitter`
does what :func:`ds4.server.tools.parse_reply` does on a whole reply, as the
text arrives. Visible text goes out at once except what could be the start
of a ``<tool_call>`` marker; inside a block, each call is announced once its
name is complete and declared, then its arguments stream as fragments of
their canonical text (re-serialized as they are read, so they join to
exactly the parsed call's ``arguments``); a block that turns out not to
parse ends the calls already announced and follows them with the block's
text. The convention itself (markers, canonical form) is
:mod:`ds4.server.tools`'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

from .tools import CALL_END, CALL_START, InvalidCalls, ParsedReply, dump_json, no_dups, parse_reply

log = logging.getLogger("ds4.server")

__all__ = ["StreamEvent", "StreamSplitter"]


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One event of a stream (:meth:`StreamSplitter.feed`): ``text`` (visible
    text), ``start`` (call ``index`` named ``text``), ``args`` (a fragment
    ``text`` of call ``index``'s canonical arguments) or ``end`` (call
    ``index`` complete)."""

    kind: str
    text: str = ""
    index: int = -1


_HEX = frozenset("0123456789abcdefABCDEF")


def _hex4(s: str) -> int:
    if len(s) != 4 or not set(s) <= _HEX:
        raise InvalidCalls("invalid \\uXXXX escape")
    return int(s, 16)


def _safe_cut(raw: str) -> int:
    """The longest prefix of a JSON string body ``raw`` (still open) that
    decodes the same alone as followed by more: not inside an escape, and
    not ending in a high surrogate escape the next one may pair with (as
    Python's ``json`` pairs them)."""
    i, n, cut = 0, len(raw), 0
    while i < n:
        if raw[i] != "\\":
            i += 1
        elif i + 1 >= n:
            break
        elif raw[i + 1] != "u":
            i += 2
        elif i + 6 > n:
            break
        elif not 0xD800 <= _hex4(raw[i + 2 : i + 6]) <= 0xDBFF:
            i += 6
        elif i + 6 >= n or (raw[i + 6] == "\\" and i + 7 >= n):
            break
        elif raw[i + 6 : i + 8] != "\\u":
            i += 6  # a lone high surrogate
        elif i + 12 > n:
            break
        else:
            i += 12 if 0xDC00 <= _hex4(raw[i + 8 : i + 12]) <= 0xDFFF else 6
        cut = i
    return cut


class _Frame:
    __slots__ = ("keys", "kind", "member", "n", "state")

    def __init__(self, kind: str):
        self.kind = kind  # "{" or "["
        self.state = "first"  # first, key, colon, value, next
        self.member: str | int | None = None  # the key or index of the member being read
        self.n = 0
        self.keys: set[str] = set()


class _Scan:
    """An incremental JSON scanner that accepts what ``json.loads`` accepts
    (duplicate keys refused, as :func:`parse_reply` refuses them) and
    reports, by path (the keys and indexes from the top value), where each
    value starts (``start(path, kind)``: ``{``, ``[``, ``"`` or ``lit``), the
    canonical text (``json.dumps`` defaults, ``ensure_ascii=False``) of what
    it has read (``emit(path, text)``; a string's text as it grows, a
    number or literal once complete) and where each value ends
    (``end(path, value)``: a string's or a literal's value, None for a
    container). Raises :class:`InvalidCalls` at the first character that cannot
    be JSON."""

    def __init__(self, hook: _CallBlock):
        self.hook = hook
        self.stack: list[_Frame] = []
        self.top = "value"  # then "done"
        self.tok: str | None = None  # None, '"' (a string) or "lit" (a number or literal)
        self.is_key = False
        self.raw = ""  # the string body not yet decoded
        self.bs = False  # after a backslash
        self.hexleft = 0
        self.parts: list[str] = []  # the string decoded so far
        self.lit = ""

    def path(self) -> tuple[str | int, ...]:
        return tuple(f.member for f in self.stack)  # type: ignore[misc]

    def cpath(self) -> tuple[str | int, ...]:
        return tuple(f.member for f in self.stack[:-1])  # type: ignore[misc]

    def feed(self, s: str) -> None:
        for ch in s:
            self._char(ch)
        if self.tok == '"':
            self._flush(False)

    def _char(self, ch: str) -> None:
        if self.tok == '"':
            self._string_char(ch)
            return
        if self.tok == "lit":
            if ch.isalnum() or ch in "+-.":
                self.lit += ch
                return
            self._lit_end()
        if ch not in " \t\n\r":
            self._structure(ch)

    def _string_char(self, ch: str) -> None:
        if self.hexleft:
            self.hexleft -= 1
        elif self.bs:
            self.bs, self.hexleft = False, 4 if ch == "u" else 0
        elif ch == "\\":
            self.bs = True
        elif ch == '"':
            self._string_end()
            return
        self.raw += ch

    def _structure(self, ch: str) -> None:
        f = self.stack[-1] if self.stack else None
        state = f.state if f is not None else self.top
        if f is not None and ch == ("}" if f.kind == "{" else "]") and (state == "next" or state == "first"):
            self.stack.pop()
            self.hook.emit(self.path(), ch)
            self._value_done(None)
        elif f is not None and state == "next" and ch == ",":
            f.state = "key" if f.kind == "{" else "value"
            self.hook.emit(self.cpath(), ", ")
        elif f is not None and f.kind == "{" and state in ("first", "key"):
            if ch != '"':
                raise InvalidCalls("a key expected")
            self._string_start(True)
        elif f is not None and state == "colon":
            if ch != ":":
                raise InvalidCalls("a colon expected")
            f.state = "value"
        elif state in ("value", "first"):
            self._value(ch)
        else:
            raise InvalidCalls(f"unexpected {ch!r}")

    def _value(self, ch: str) -> None:
        if self.stack and self.stack[-1].kind == "[":
            self.stack[-1].member = self.stack[-1].n
        p = self.path()
        if ch in "{[":
            self.hook.start(p, ch)
            self.hook.emit(p, ch)
            self.stack.append(_Frame(ch))
        elif ch == '"':
            self.hook.start(p, ch)
            self.hook.emit(p, ch)
            self._string_start(False)
        elif ch.isalnum() or ch in "+-.":
            self.hook.start(p, "lit")
            self.tok, self.lit = "lit", ch
        else:
            raise InvalidCalls(f"unexpected {ch!r}")

    def _value_done(self, value: object) -> None:
        self.hook.end(self.path(), value)
        if self.stack:
            self.stack[-1].n += 1
            self.stack[-1].state = "next"
        else:
            self.top = "done"

    def _string_start(self, is_key: bool) -> None:
        self.tok, self.is_key, self.raw, self.bs, self.hexleft, self.parts = '"', is_key, "", False, 0, []

    def _flush(self, final: bool) -> None:
        cut = len(self.raw) if final else _safe_cut(self.raw)
        if not cut:
            return
        try:
            piece = json.loads('"' + self.raw[:cut] + '"')
        except ValueError as e:
            raise InvalidCalls(str(e)) from None
        self.raw = self.raw[cut:]
        self.parts.append(piece)
        if not self.is_key and piece:
            self.hook.emit(self.path(), dump_json(piece)[1:-1])

    def _string_end(self) -> None:
        self._flush(True)
        self.tok = None
        value = "".join(self.parts)
        if self.is_key:
            f = self.stack[-1]
            if value in f.keys:
                raise InvalidCalls(f"duplicate key {value!r}")
            f.keys.add(value)
            f.member, f.state = value, "colon"
            self.hook.emit(self.cpath(), dump_json(value) + ": ")
            return
        self.hook.emit(self.path(), '"')
        self._value_done(value)

    def _lit_end(self) -> None:
        self.tok = None
        try:
            value = json.loads(self.lit)
        except ValueError as e:
            raise InvalidCalls(str(e)) from None
        self.hook.emit(self.path(), dump_json(value))
        self._value_done(value)


@dataclasses.dataclass
class _LiveCall:
    name: str | None = None
    mode: str | None = None  # "{": arguments streamed; '"': quoted (sent whole); None: not seen yet
    text: str = ""  # the canonical arguments text so far
    started: bool = False
    ended: bool = False


class _CallBlock:
    """The calls of a block as its text arrives (the hooks of :class:`_Scan`):
    a call starts once its name is complete and a declared tool (and it is
    within ``max_calls``), then its canonical arguments stream as they are
    read; once the block cannot be strict calls (``dead``) nothing more is
    announced."""

    def __init__(self, names: frozenset[str] | None, max_calls: int | None):
        self.names, self.max_calls = names, max_calls
        self.scan = _Scan(self)
        self.top: str | None = None
        self.calls: dict[int, _LiveCall] = {}
        self.out: list[StreamEvent] = []
        self.dead = False

    def feed(self, s: str, eof: bool = False) -> list[StreamEvent]:
        if not self.dead:
            try:
                self.scan.feed(s)
                if eof and self.scan.top != "done":
                    raise InvalidCalls("the block ends before its JSON")
            except InvalidCalls as e:
                self.dead = True
                log.debug("tool call block stops streaming: %s", e)
        out, self.out = self.out, []
        return out

    def _call(self, path: tuple[str | int, ...]) -> tuple[_LiveCall, tuple[str | int, ...]] | None:
        if self.top == "[" and path and isinstance(path[0], int):
            return self.calls.get(path[0]) or _LiveCall(), path[1:]
        if self.top == "{":
            return self.calls.get(0) or _LiveCall(), path
        return None

    def start(self, path: tuple[str | int, ...], kind: str) -> None:
        if not path:
            self.top = kind
            if kind == "{":
                self.calls[0] = _LiveCall()
            elif kind != "[":
                raise InvalidCalls("not a call array")
            return
        if self.top == "[" and len(path) == 1:
            if kind != "{":
                raise InvalidCalls("a call is not an object")
            self.calls[int(path[0])] = _LiveCall()
            return
        got = self._call(path)
        if got is None:
            return
        c, rest = got
        if rest == ("name",) and kind != '"':
            raise InvalidCalls("a call's name is not a string")
        if rest == ("arguments",):
            if kind not in '{"':
                raise InvalidCalls("a call's arguments are not an object")
            c.mode = kind

    def _index(self, path: tuple[str | int, ...]) -> int:
        return int(path[0]) if self.top == "[" else 0

    def emit(self, path: tuple[str | int, ...], text: str) -> None:
        got = self._call(path)
        if got is None:
            return
        c, rest = got
        if rest[:1] == ("arguments",) and c.mode == "{":
            c.text += text
            if c.started:
                self.out.append(StreamEvent("args", text, self._index(path)))

    def end(self, path: tuple[str | int, ...], value: object) -> None:
        got = self._call(path) if path or self.top == "{" else None
        if got is None:
            return
        c, rest = got
        k = self._index(path)
        if rest == ("name",):
            assert isinstance(value, str)
            if self.names is not None and value not in self.names:
                raise InvalidCalls(f"{value!r} is not a declared tool")
            c.name = value
            if self.max_calls is None or k < self.max_calls:
                c.started = True
                self.out.append(StreamEvent("start", value, k))
                if c.text:
                    self.out.append(StreamEvent("args", c.text, k))
        elif rest == ("arguments",) and c.mode == '"':
            assert isinstance(value, str)
            self._whole(c, k, _quoted_arguments(value))
        elif rest == ():
            if c.name is None:
                raise InvalidCalls("a call without a name")
            if c.mode is None:
                self._whole(c, k, "{}")
            if c.started:
                c.ended = True
                self.out.append(StreamEvent("end", "", k))

    def _whole(self, c: _LiveCall, k: int, text: str) -> None:
        c.text = text
        if c.started:
            self.out.append(StreamEvent("args", text, k))


def _quoted_arguments(s: str) -> str:
    """The canonical text of arguments a model quoted (a JSON string
    holding the object)."""
    v = json.loads(s, object_pairs_hook=no_dups)  # InvalidCalls is a ValueError
    if not isinstance(v, dict):
        raise InvalidCalls("quoted arguments are not an object")
    return dump_json(v)


class StreamSplitter:
    """Incremental :func:`parse_reply` for a stream.

    ``feed(piece)`` returns the :class:`StreamEvent`\\ s that may be sent
    now: visible text at once, except what could be the start of a
    ``<tool_call>`` marker and trailing whitespace (the separator before a
    block); inside a block, each call as it is generated (``start`` once its
    name is complete and a declared tool, within ``max_calls``; ``args``
    fragments; ``end`` when its object closes). The arguments are
    re-serialized as they are read, so the fragments of a call are pieces of
    its canonical arguments text (:func:`render_calls`' form, whatever the
    model's spacing and escapes): a string grows character by character, a
    number or literal goes out once complete, quoted arguments (a JSON
    string holding the object) go out whole when the string closes. Once
    the block cannot be strict calls (a JSON error, a duplicate key, an
    undeclared name, a non-object call) nothing more is announced.

    ``close(calls)`` ends the stream given the turn's parsed calls (the
    ``(name, arguments)`` of :func:`parse_reply` on the whole text, after
    ``parallel_tool_calls``): with calls, the fragments not yet sent (a
    quoted or late argument text, a call not announced live) and the ends,
    so each call's fragments join to exactly its ``arguments``. Without
    calls (no block, or one that failed strict parsing: unclosed at
    ``max_tokens``, invalid JSON...) the calls already announced end as
    they are (they cannot be taken back) and the text not yet shown follows
    as visible text, so the stream's text is the whole reply, as the
    non-stream reply's content is; the finish reason is then the turn's
    (``stop``/``length``), never ``tool_calls``. Except a block cut by
    ``max_tokens`` inside an announced call (``close([], length=True)``,
    :meth:`cut`): its calls end and nothing follows, as in the whole reply
    (:func:`ds4.server.tool_cut.cut_reply`); the finish is ``length``.

    ``push(piece)`` is ``feed`` reduced to its text (a block held until it
    closes), ``finish()`` the final :class:`ParsedReply` and the text still
    held back, for a protocol that sends calls whole at the end."""

    def __init__(self, names: frozenset[str] | None = None, max_calls: int | None = None):
        self.names = names
        self.buf = ""  # everything pushed
        self.shown = 0  # chars of buf already returned as text
        self.block_at: int | None = None
        self.block = _CallBlock(names, max_calls)
        self.fed = 0  # chars of buf given to the block's scanner
        self.closed = False  # the block's end marker seen

    def feed(self, piece: str) -> list[StreamEvent]:
        self.buf += piece
        out = []
        if self.block_at is None:
            text = self._text()
            if text:
                out.append(StreamEvent("text", text))
            if self.block_at is None:
                return out
        if self.closed:
            return out
        j = self.buf.find(CALL_END, self.fed)
        if j >= 0:
            limit = j
        else:  # hold back a possible end marker
            limit = len(self.buf)
            for k in range(1, len(CALL_END)):
                if self.buf.endswith(CALL_END[:k]):
                    limit = len(self.buf) - k
            limit = max(limit, self.fed)
        body, self.fed, self.closed = self.buf[self.fed : limit], limit, j >= 0
        return _joined(out + self.block.feed(body, eof=self.closed))

    def push(self, piece: str) -> str:
        return "".join(e.text for e in self.feed(piece) if e.kind == "text")

    def _text(self) -> str:
        i = self.buf.find(CALL_START, self.shown)
        if i >= 0:
            self.block_at = i
            self.fed = i + len(CALL_START)
            end = max(self.shown, len(self.buf[:i].rstrip()))  # the separator before a block is not content
            out, self.shown = self.buf[self.shown : end], end
            return out
        # hold back a possible marker start, and trailing whitespace (the
        # separator before a block)
        safe = len(self.buf)
        for k in range(1, len(CALL_START)):
            if self.buf.endswith(CALL_START[:k]):
                safe = len(self.buf) - k
        safe = max(self.shown, len(self.buf[:safe].rstrip()))
        out, self.shown = self.buf[self.shown : safe], safe
        return out

    def finish(self) -> tuple[ParsedReply, str]:
        """The reply, and the text not yet shown that belongs to its content."""
        rep = parse_reply(self.buf, self.names)
        if rep.calls:
            return rep, rep.content[self.shown :] if len(rep.content) > self.shown else ""
        return rep, self.buf[self.shown :]

    def cut(self) -> list[tuple[int, str, str]]:
        """``(index, name, arguments so far)`` of the calls announced in a block
        still valid and open when the text ended (a ``max_tokens`` cut)."""
        open_block = self.block_at is not None and not self.closed and not self.block.dead
        return [(k, c.name or "", c.text) for k, c in sorted(self.block.calls.items()) if c.started and open_block]

    def close(self, calls: Sequence[tuple[str, str]], length: bool = False) -> list[StreamEvent]:
        """The stream's last events, given the turn's calls and whether it
        ended at ``max_tokens`` (``length``; see the class docstring)."""
        out = []
        live = self.block.calls
        if not calls and length and self.cut():
            return [StreamEvent("end", "", k) for k, c in sorted(live.items()) if c.started and not c.ended]
        if not calls:
            out += [StreamEvent("end", "", k) for k, c in sorted(live.items()) if c.started and not c.ended]
            if self.buf[self.shown :]:
                out.append(StreamEvent("text", self.buf[self.shown :]))
            return out
        _, rest = self.finish()
        if rest:
            out.append(StreamEvent("text", rest))
        for k, (name, arguments) in enumerate(calls):
            c = live.get(k)
            if c is None or not c.started:
                out += [StreamEvent("start", name, k), StreamEvent("args", arguments, k), StreamEvent("end", "", k)]
                continue
            if c.name != name or not arguments.startswith(c.text):  # pragma: no cover - a bug of the scanner
                log.error("streamed tool call %d diverged from its parsed form", k)
            elif len(arguments) > len(c.text):
                out.append(StreamEvent("args", arguments[len(c.text) :], k))
            if not c.ended:
                out.append(StreamEvent("end", "", k))
        return _joined(out)


def _joined(events: list[StreamEvent]) -> list[StreamEvent]:
    """Consecutive text or fragments of one call as one event."""
    out: list[StreamEvent] = []
    for e in events:
        if out and e.kind in ("text", "args") and out[-1].kind == e.kind and out[-1].index == e.index:
            out[-1] = StreamEvent(e.kind, out[-1].text + e.text, e.index)
        else:
            out.append(e)
    return out
