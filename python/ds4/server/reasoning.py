"""A reply's reasoning: the ``<think>…</think>`` part a reasoning model
writes before its answer, split from the content (whole replies:
:func:`split_reasoning`; streams: :class:`ReasoningSplitter`).

The rule
    A reply whose text starts (after whitespace) with ``<think>`` has
    reasoning: the text up to the first ``</think>``, stripped of
    surrounding whitespace. The content is what follows ``</think>``,
    stripped of leading whitespace. A ``<think>`` later in a reply is
    content (a model that reasons writes it first). A prompt that already
    opens the reasoning (a template whose generation prompt ends in
    ``<think>``: ``opened``) makes the reply's text up to ``</think>`` the
    reasoning.

    A reply cut (``max_tokens``) before ``</think>`` is all reasoning: the
    reasoning is what was written (``closed`` is False) and the content is
    empty; the finish reason says ``length``. No canonicalization follows
    such a turn (there is no answer to render): the next turn is served as
    the ladder serves it.

The stream splitter yields exactly what :func:`split_reasoning` gives for
the whole text, in pieces: it holds back what could still be the start of
a ``<think>`` or ``</think>`` tag and whitespace that may turn out to be
stripped.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CLOSE", "OPEN", "ReasoningSplitter", "Split", "split_reasoning"]

OPEN, CLOSE = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the reply has no reasoning
    content: str
    closed: bool = False  # the reasoning ended with </think>


def split_reasoning(text: str, opened: bool = False) -> Split:
    """``text`` (a whole reply) as reasoning and content (the module's rule)."""
    if opened:
        body = text
    else:
        s = text.lstrip()
        if not s.startswith(OPEN):
            return Split(None, text)
        body = s[len(OPEN) :]
    i = body.find(CLOSE)
    if i < 0:
        return Split(body.strip(), "", False)
    return Split(body[:i].strip(), body[i + len(CLOSE) :].lstrip(), True)


def _partial(buf: str, tag: str) -> int:
    """The length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits a streamed reply: :meth:`push` a delta, get ``(reasoning,
    content)`` pieces to send now; :meth:`finish` gives the rest. The
    pieces joined are :func:`split_reasoning`'s reasoning and content."""

    def __init__(self, opened: bool = False):
        self.state = "reasoning" if opened else "start"
        self.buf = ""
        self.lead = True  # no reasoning text sent yet (its leading whitespace is stripped)
        self.has_reasoning = opened

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith(OPEN):
                self.state, self.buf, self.has_reasoning = "reasoning", s[len(OPEN) :], True
            elif OPEN.startswith(s):
                return "", ""  # still undecided (whitespace, or part of the tag)
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.lead:
                self.buf = self.buf.lstrip()
            i = self.buf.find(CLOSE)
            if i >= 0:
                reasoning, self.buf = self.buf[:i].rstrip(), self.buf[i + len(CLOSE) :]
                self.state = "after"
            else:
                keep = self.buf[: len(self.buf) - _partial(self.buf, CLOSE)]
                keep = keep.rstrip()  # trailing whitespace waits: it may be the last before </think>
                reasoning, self.buf = keep, self.buf[len(keep) :]
            if reasoning:
                self.lead = False
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if self.buf:
                self.state = "content"
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: ``(reasoning, content)``."""
        buf, self.buf = self.buf, ""
        if self.state == "start":
            return "", buf
        if self.state == "reasoning":
            return buf.strip() if self.lead else buf.rstrip(), ""
        return "", buf if self.state == "content" else ""
