"""The recovery report: what one run of the ladder (:mod:`ds4.recovery`)
did, which rung served, what it reused, loaded, rejected and saved, where
the time went, and the saves of its request that did not happen and why
(``save_skipped``). The server's ``ds4`` block, ``/metrics`` and ``/ui``
and ``ds4 run --json`` show it. Re-exported by :mod:`ds4.recovery`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .kvstore import Rejection
from .kvstore.skips import SaveSkip

log = logging.getLogger("ds4.recovery")

__all__ = ["DIVERGENCE_TEXT", "RecoveryReport", "scoped_divergence"]

#: what a client is shown of a divergence's texts (``ds4 serve --divergence-text``)
DIVERGENCE_TEXT = ("off", "own", "all")


@dataclasses.dataclass
class RecoveryReport:
    """What one run of the ladder did (:func:`ds4.recovery.recover`), and the
    saves of its request that did not happen (the turn driver adds its own:
    :mod:`ds4.turn`). ``as_dict`` is its JSON form (``ds4 run --json``)."""

    rung: str = "prefill"
    source: str = ""
    reused_tokens: int = 0
    prompt_tokens: int = 0
    loaded_path: str | None = None
    rejected: list[Rejection] = dataclasses.field(default_factory=list)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    evict_saved: str | None = None
    cold_saved: str | None = None
    #: the whole prompt's checkpoint (``recover(prompt_save=...)``)
    prompt_saved: str | None = None
    #: the turn boundary stored so that no span is prefilled twice
    #: (:mod:`ds4.frontier`: before the live state holding it went, or at
    #: once on a reload loop); None: none this run
    frontier_saved: str | None = None
    #: a reload loop seen (:mod:`ds4.frontier`): the same checkpoint loaded
    #: and the same span prefilled after it as on an earlier turn:
    #: ``{"checkpoint", "depth", "span", "times"}``; None: none
    reload: dict[str, Any] | None = None
    #: every save this request could have written and did not, with why
    #: (:class:`ds4.kvstore.skips.SaveSkip`: kind, code, detail), in the
    #: order they were declined; empty when nothing was skipped
    save_skipped: list[SaveSkip] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)
    #: the shared tier's state when the store was asked (``up``,
    #: ``degraded``, ``cooldown``, ``closed``); ``""``: no tier, or not asked
    remote: str = ""
    #: where the prompt left the best candidate it had (:meth:`ds4.recovery._Ladder.divergence`):
    #: ``{"against": "live"|"checkpoint", "token", "byte", "cached", "prompt"}``;
    #: ``cached`` is ``""`` exactly when the prompt holds the whole candidate;
    #: None when there was no candidate (a server shows a client the texts by
    #: :func:`scoped_divergence`)
    divergence: dict[str, Any] | None = None
    #: when the token check cut a text match (:meth:`ds4.recovery._Ladder.token_check`):
    #: ``{"against": "live"|"disk"|"remote", "kept": K, "of": M}``, the
    #: state's first K tokens of M being the prompt's own; None: no cut
    token_check: dict[str, Any] | None = None
    #: the token count of the RAM snapshot the rewrite rung resumed from
    #: (an engine that cannot rewind: :mod:`ds4.snapshots`); None: none
    snapshot: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rejected"] = [{"path": p, "stage": s, "code": c, "reason": r} for (p, s, c, r) in self.rejected]
        d["save_skipped"] = [s.as_dict() for s in self.save_skipped]
        return d

    def log_event(self, msg: str, *args: object) -> None:
        """``msg % args`` added to :attr:`events` and logged (ds4's own log line)."""
        text = msg % args if args else msg
        self.events.append(text)
        log.info(text)


def scoped_divergence(d: dict[str, Any] | None, policy: str, own: bool) -> dict[str, Any] | None:
    """The divergence ``d`` as a client may see it (``--divergence-text``):
    ``all``, whole; ``own`` (the default), whole when ``own`` (the
    operator's request, or a candidate of the requester's own conversation:
    the live state of the last turn of the same namespace and routing
    hint), else without the stored side's
    text (``cached`` None: another conversation's bytes); ``off``, the
    offsets only (``cached`` and ``prompt`` None). The offsets (``against``,
    ``token``, ``byte``) are everyone's."""
    if d is None or policy == "all" or (policy == "own" and own):
        return d
    if policy == "own":
        return {**d, "cached": None}
    return {**d, "cached": None, "prompt": None}
