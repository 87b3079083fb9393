"""What a turn is asked (:class:`GenParams`: how many tokens, stops,
sampling, a constraint) and what it gives (:class:`GenResult`: the text and
tokens, the recovery report, the token counts a client is billed, and the
timings: TTFT and total from the request's arrival where a server queued
it). :mod:`ds4.turn` drives turns and exports both."""

from __future__ import annotations

import dataclasses
from typing import Any

from .constrain import Constraint
from .recovery import RecoveryReport

__all__ = ["GenParams", "GenResult"]


@dataclasses.dataclass
class GenParams:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    constraint: Constraint | None = None
    #: strings that end the turn once generated, kept in the text and the KV
    #: state (a tool call's closing tag); finish_reason "stop"
    stop_after: tuple[str, ...] = ()


@dataclasses.dataclass
class GenResult:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop", "length" or "cancelled"
    report: RecoveryReport
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_s: float
    total_s: float
    stop_action: str | None = None  # None, "rewound" or "invalidated"
    stop_sequence: str | None = None  # the stop sequence that ended the text, if one did
    #: how long the request waited before its turn began (a server's queue;
    #: included in ``ttft_s`` and ``total_s``: :meth:`queued`)
    queue_s: float = 0.0

    def queued(self, wait_s: float) -> None:
        """Count ``wait_s`` of waiting before the turn began: TTFT and the
        total are then from the request's arrival."""
        self.queue_s += wait_s
        self.ttft_s += wait_s
        self.total_s += wait_s

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
