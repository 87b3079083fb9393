"""Fair turn-taking among the worker's lanes (``ds4 serve --sessions N``).

With a pool of N resident sessions the worker runs N lanes (threads), one
job each at most. Only the lane that holds the :class:`Baton` touches the
engine, the sessions, the store and the counters, so everything the one
worker thread owned before is still owned by one thread at a time, and no
store operation, save or load is ever interleaved with another. A lane
hands the baton over at the points where its turn can stop anyway: before
every generated token and at every prefill chunk boundary (the points where
it already asks whether its client left), so concurrent requests on
different residents advance together, token by token and chunk by chunk,
in arrival order (the baton is a FIFO: the lane that waited longest runs
next). A lane with nobody waiting keeps the baton: one request at a time
costs one uncontended check per token.

Prefills go shortest first. A lane reports what it is doing
(:meth:`Baton.mark`): routing and the ladder's loads (nothing marked), a
prefill with so many tokens left, or decoding. At a handover every waiting
lane that is not prefilling is eligible, but of the prefilling lanes only
the one with the fewest tokens left (the earliest to arrive among equals;
the holder counts too): so a decode stream waits at most one chunk behind
a prefill, and concurrent prefills finish one after another, nearest to
its first token first, instead of all together at the end (four cold
prompts served round robin all got their first token when the last did).
A prefill passed over :data:`MAX_SKIPS` times becomes eligible anyway (no
starvation by a stream of shorter ones).

A resident's state is only ever changed by its own lane, so a handover
between two tokens leaves each session exactly as a single-session run
would: the engine contexts are separate, and the outputs stay identical to
one request at a time (the pool's tests compare them with a cold server).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

__all__ = ["MAX_SKIPS", "Baton"]

#: handovers a waiting prefill may be passed over before it is eligible anyway
MAX_SKIPS = 64


@dataclasses.dataclass
class _Lane:
    """What a lane reported of its job (:meth:`Baton.mark`)."""

    prefill_left: int | None = None  # tokens left to prefill, None: not prefilling
    arrival: float = 0.0  # the job's arrival (ties between prefills)
    skips: int = 0  # handovers it was passed over at while prefilling


class Baton:
    """A fair (FIFO) lock with a cheap :meth:`pass_` for long holders."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: int | None = None
        self._waiting: collections.deque[int] = collections.deque()
        self._lanes: dict[int, _Lane] = {}
        #: how many times the baton changed hands at a pass (the operator's view)
        self.handovers = 0

    def mark(self, prefill_left: int | None, arrival: float = 0.0) -> None:
        """The calling lane is prefilling, ``prefill_left`` tokens to go
        (its job arrived at ``arrival``), or not (None: routing, loading,
        decoding, idle)."""
        me = threading.get_ident()
        with self._cond:
            lane = self._lanes.setdefault(me, _Lane())
            if prefill_left is None:
                lane.prefill_left, lane.skips = None, 0
            else:
                lane.prefill_left, lane.arrival = int(prefill_left), arrival

    def _eligible(self, extra: int | None = None) -> list[int]:
        """The waiting lanes that may take the baton next, in FIFO order:
        every lane not prefilling, and the prefilling one nearest to its
        first token (``extra``: the holder, counted as a rival though it is
        not listed), and any prefill passed over too often."""

        def key(t: int) -> tuple[int, float]:
            ln = self._lanes[t]
            return (ln.prefill_left or 0, ln.arrival)

        pre = [t for t in self._waiting if self._lanes.get(t, _Lane()).prefill_left is not None]
        if extra is not None and self._lanes.get(extra, _Lane()).prefill_left is not None:
            pre.append(extra)
        best = min(pre, key=key) if pre else None
        return [
            t
            for t in self._waiting
            if t == best or self._lanes.get(t, _Lane()).prefill_left is None or self._lanes[t].skips >= MAX_SKIPS
        ]

    def _next(self) -> int | None:
        ok = self._eligible()
        return ok[0] if ok else (self._waiting[0] if self._waiting else None)

    def acquire(self) -> None:
        """Wait for the baton behind every lane already waiting."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                raise RuntimeError("the baton is not re-entrant")
            if self._holder is None and not self._waiting:
                self._holder = me
                return
            self._waiting.append(me)
            while self._holder is not None or self._next() != me:
                self._cond.wait()
            for t in self._waiting:  # the prefills it went before
                lane = self._lanes.get(t)
                if t != me and lane is not None and lane.prefill_left is not None:
                    lane.skips += 1
            self._waiting.remove(me)
            lane = self._lanes.get(me)
            if lane is not None:
                lane.skips = 0
            self._holder = me

    def release(self) -> None:
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("the baton is released by a lane that does not hold it")
            self._holder = None
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Lanes waiting for the baton."""
        return len(self._waiting)

    def pass_(self) -> None:
        """Hand the baton to the eligible lane that waited longest (the
        module docstring) and queue for it again; nothing when no lane that
        may go before the holder waits (the holder keeps running)."""
        me = threading.get_ident()
        with self._cond:
            if not self._waiting:
                return
            if self._holder != me:
                raise RuntimeError("the baton is passed by a lane that does not hold it")
            if not self._eligible(extra=me):
                for t in self._waiting:  # passed over once more
                    lane = self._lanes.get(t)
                    if lane is not None and lane.prefill_left is not None:
                        lane.skips += 1
                return
            self.handovers += 1
        self.release()
        self.acquire()

    def __enter__(self) -> Baton:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
