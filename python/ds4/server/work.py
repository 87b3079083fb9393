"""What a job runs (:class:`Work`), by its type: an agent turn
(:class:`ds4.server.conversation.AgentTurn`) or a completion's
:class:`TextPrompt`. Here, apart from the worker, so that the pool, which
routes a job's work, and the worker, which runs the pool, do not import
each other."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from ..keytext import Prompt

if TYPE_CHECKING:
    from ..engine import Engine
    from ..turn import GenResult

__all__ = ["TextPrompt", "Work"]


class Work(Protocol):
    """What a job runs, by its type: :meth:`render` its prompt (in the
    worker thread, in the job's cache namespace), then, once decoded and
    before the ``done`` event, :meth:`done`. An agent turn
    (:class:`ds4.server.conversation.AgentTurn`: a chat, whatever its
    protocol) is one; :class:`TextPrompt` (a completion) the other."""

    def render(self, engine: Engine, namespace: str | None = None) -> str: ...

    def done(self, res: GenResult) -> None: ...


@dataclasses.dataclass(frozen=True)
class TextPrompt:
    """A completion's prompt: client text, in which no marker is special."""

    text: str

    def render(self, engine: Engine, namespace: str | None = None) -> str:
        return Prompt.text(self.text)

    def done(self, res: GenResult) -> None:
        """Nothing follows a completion's decoding."""
