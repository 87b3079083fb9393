"""RAM snapshots of a session's state, for memories that cannot rewind
(issue 34, item 3; docs/DESIGN.md, "Recurrent and hybrid models").

A recurrent memory (Mamba-2, LFM2, Granite 4 hybrid) keeps one state that
summarises every token, and a sliding-window state loaded from disk has
lost its early cells: neither can drop a tail of positions. So a session
over such an engine keeps copies of its exported state (the engine's own
payload, the one a checkpoint holds, exact on import: the engine's
start-up round trip checks it) at turn boundaries (the end of each
prefill) and every ``every`` tokens of a prefill. A rewind the engine
refuses goes to the newest snapshot at or before the cut, imports it and
prefills the gap: an edited last turn, a regenerated reply or a client
that drops its last reasoning resumes from there instead of from nothing.

Bounded by ``count`` snapshots and ``max_bytes`` of arrays; past either,
periodic snapshots go first (oldest first), then turn boundaries (oldest
first). ``count`` 0 turns them off. Snapshots belong to the session's
namespace and are dropped when it changes (nothing crosses tenants).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["DEFAULT_COUNT", "DEFAULT_EVERY", "DEFAULT_MB", "Snapshot", "Snapshots", "restore"]

#: llama.cpp's server keeps 8 context checkpoints by default (--ctx-checkpoints)
DEFAULT_COUNT = 8
DEFAULT_MB = 256
#: a periodic snapshot every this many tokens of a prefill (0: turn boundaries only)
DEFAULT_EVERY = 4096


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The state after ``tokens`` (their ids, the engine's arrays, the
    logits after the last), taken at a turn boundary or periodically."""

    tokens: tuple[int, ...]
    arrays: Mapping[str, np.ndarray]
    periodic: bool

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values()) + 8 * len(self.tokens)


class Snapshots:
    """A session's snapshots, newest last, within their budget."""

    def __init__(self, count: int = DEFAULT_COUNT, max_mb: float = DEFAULT_MB, every: int = DEFAULT_EVERY):
        self.configure(count, max_mb, every)
        self._items: list[Snapshot] = []
        #: counters: taken, restored, dropped (over the budget)
        self.counters = {"taken": 0, "restored": 0, "dropped": 0}

    def configure(self, count: int, max_mb: float, every: int) -> None:
        if count < 0 or max_mb < 0 or every < 0:
            raise ValueError("snapshot count, budget and interval must be >= 0")
        self.count, self.max_bytes, self.every = int(count), int(max_mb * 2**20), int(every)

    @property
    def enabled(self) -> bool:
        return self.count > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._items)

    def positions(self) -> list[int]:
        """The token counts the snapshots hold, oldest first."""
        return [len(s.tokens) for s in self._items]

    def clear(self) -> None:
        self._items.clear()

    def add(self, tokens: Sequence[int], arrays: Mapping[str, np.ndarray], periodic: bool) -> None:
        """Keep the state after ``tokens`` (replacing one of the same
        tokens), then drop down to the budget; a snapshot larger than the
        whole budget is not kept."""
        snap = Snapshot(tuple(int(t) for t in tokens), dict(arrays), periodic)
        if not self.enabled or snap.nbytes > self.max_bytes:
            return
        self._items = [s for s in self._items if s.tokens != snap.tokens]
        self._items.append(snap)
        self.counters["taken"] += 1
        while len(self._items) > self.count or self.nbytes > self.max_bytes:
            victim = next((s for s in self._items if s.periodic), self._items[0])
            self._items.remove(victim)
            self.counters["dropped"] += 1

    def best(self, tokens: Sequence[int], at_most: int) -> Snapshot | None:
        """The longest snapshot whose tokens are a prefix of ``tokens`` and
        no longer than ``at_most``."""
        best: Snapshot | None = None
        for s in self._items:
            n = len(s.tokens)
            if n <= at_most and (best is None or n > len(best.tokens)) and tuple(tokens[:n]) == s.tokens:
                best = s
        return best


def restore(ectx: Any, snap: Snapshot, tokens: Sequence[int]) -> np.ndarray:
    """Put ``snap`` into the engine context ``ectx`` and prefill the rest
    of ``tokens`` (which ``snap``'s tokens begin); the logits after the
    last. The caller invalidates its session when this raises (the context
    may be half-way)."""
    n = len(snap.tokens)
    ectx.import_state(dict(snap.arrays), n)
    know = getattr(ectx, "know_tokens", None)
    if know is not None:
        know(list(snap.tokens))
    logits = ectx.eval(list(tokens[n:])) if len(tokens) > n else ectx.last_logits()
    return np.asarray(logits, dtype=np.float32)
