"""The store's counters: each part (the store, its index, its shared tier's
use, the tier, its upload queue) keeps its own :class:`Counters`, and the
one that shows them (:attr:`ds4.kvstore.KVStore.stats`,
:attr:`.remote.RemoteTier.stats`) merges its parts' (:func:`merged`): no
part writes into another's."""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["Counted", "Counters", "merged"]

_LOCK = threading.Lock()


class Counters(dict[str, int]):
    """One part's own counters, every name at 0 until counted."""

    def __init__(self, *names: str):
        super().__init__(dict.fromkeys(names, 0))

    def add(self, name: str, n: int = 1) -> None:
        """``name`` counted ``n`` more, from any thread (``+=`` may lose a
        count to another thread's between its read and its write)."""
        with _LOCK:
            self[name] = self.get(name, 0) + n


class Counted(Protocol):
    """A part with counters of its own."""

    @property
    def counters(self) -> Counters: ...


def merged(*parts: Counted) -> dict[str, int]:
    """The parts' counters as one dict, in the parts' order (a name counted
    by several is their sum)."""
    out: dict[str, int] = {}
    for part in parts:
        for name, n in part.counters.items():
            out[name] = out.get(name, 0) + n
    return out
