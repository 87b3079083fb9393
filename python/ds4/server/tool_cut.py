"""A reply cut by ``max_tokens`` inside a tool call its stream already
announced (:meth:`ds4.server.tool_stream.StreamSplitter.cut`): the whole
reply has the same calls as the stream, the last one incomplete
(:func:`cut_reply`), and an Anthropic ``tool_use`` block's ``input`` is
what the SDKs parse from the fragments streamed (:func:`partial_object`)."""

from __future__ import annotations

import json

from .tool_stream import StreamSplitter

__all__ = ["cut_reply", "partial_object"]


def cut_reply(splitter: StreamSplitter | None, content: str) -> tuple[str, list[tuple[int, str, str]]] | None:
    """A whole reply cut by ``max_tokens`` as its stream ended
    (:meth:`StreamSplitter.cut`): the text before the block and the calls
    announced, the last one's arguments incomplete; None when the stream
    ended with text only (no call announced, or the block had failed).
    ``splitter`` is a fresh one of the turn's (the scanner's state does not
    depend on how the text was cut into pieces)."""
    if splitter is None:
        return None
    splitter.feed(content)
    calls = splitter.cut()
    return (splitter.buf[: splitter.shown], calls) if calls else None


def partial_object(text: str) -> dict:
    """The object a canonical arguments prefix (a cut call's) holds so far,
    as the SDKs parse an incomplete ``input_json_delta`` stream: complete
    members only (an unfinished string, number or key is left out), the
    open containers closed."""
    stack: list[str] = []
    ok, ok_stack = 0, ""
    i, n, in_str, is_key = 0, len(text), False, False
    while i < n:
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_str = False
                if not is_key:
                    ok, ok_stack = i + 1, "".join(stack)
        elif ch == '"':
            in_str = True
            is_key = bool(stack) and stack[-1] == "{" and text[:i].rstrip()[-1:] in ("{", ",")
        elif ch in "{[":
            stack.append(ch)
            ok, ok_stack = i + 1, "".join(stack)
        elif ch in "}]":
            stack.pop()
            ok, ok_stack = i + 1, "".join(stack)
        elif ch not in " ,:":
            j = i
            while j < n and text[j] not in " ,:}]":
                j += 1
            ok, ok_stack = j, "".join(stack)  # the scanner emits a number or literal once complete
            i = j
            continue
        i += 1
    if not ok:
        return {}
    closers = "".join("}" if c == "{" else "]" for c in reversed(ok_stack))
    try:
        v = json.loads(text[:ok] + closers)
    except ValueError:  # pragma: no cover - not a canonical prefix
        return {}
    return v if isinstance(v, dict) else {}
