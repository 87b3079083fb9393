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

Decode steps go first, then prefills shortest first. A lane reports what
it is doing (:meth:`Baton.mark`): routing and the ladder's loads (nothing
marked), a prefill with so many tokens left, or decoding. At a handover
every waiting lane that is not prefilling is eligible, and so is one
prefilling its last piece (at most ``join`` tokens left, the lanes' prefill
chunk: it costs the others one short piece and then decodes beside them,
in their batch where steps are batched); a longer prefill is eligible only
when no other kind of lane waits or holds the baton, and then only the one
with the fewest tokens left (the earliest to arrive among equals; the
holder counts too). So a reply's tokens, its first included, are not
held behind another request's long prefill, and
concurrent prefills finish one after another, nearest to its first token
first, instead of all together at the end (four cold prompts served round
robin all got their first token when the last did): as one request at a
time, but with no store round trip between them.

No starvation: a prefill passed over for a decode step while it was the one
in line, or for a prefill that arrived after it, counts a skip; after
:data:`MAX_SKIPS` it is eligible anyway (a long generation lets a waiting
prefill one chunk in every so many tokens; a stream of shorter prompts lets
an older long one through). Passed over for an earlier prefill it counts
none: that one ends.

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
    """A fair lock with a cheap :meth:`pass_` for long holders (the module
    docstring: who goes next)."""

    def __init__(self, join: int = 0) -> None:
        #: a prefill with at most this many tokens left goes like a decode step
        #: (one piece from its first token: it joins the others' decoding)
        self.join = int(join)
        self._cond = threading.Condition()
        self._holder: int | None = None
        self._waiting: collections.deque[int] = collections.deque()
        self._lanes: dict[int, _Lane] = {}
        self._pick: int | None = None  # the waiting lane chosen to go next (None: not chosen yet)
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

    def _lane(self, t: int) -> _Lane:
        return self._lanes.get(t) or _Lane()

    def _queued(self, t: int) -> bool:
        """``t`` is a prefill that waits its turn after decode steps."""
        left = self._lane(t).prefill_left
        return left is not None and left > self.join

    def _choose(self, lanes: list[int]) -> int:
        """Of ``lanes`` (in FIFO order, the passing holder last), the one
        to run next; the others' skips counted (the module docstring)."""
        pre = [t for t in lanes if self._queued(t)]
        best = min(pre, key=lambda t: (self._lane(t).prefill_left or 0, self._lane(t).arrival)) if pre else None
        decoding = len(pre) < len(lanes)
        nxt = next(
            t for t in lanes if not self._queued(t) or self._lane(t).skips >= MAX_SKIPS or (t == best and not decoding)
        )
        x = self._lane(nxt)
        for t in pre:
            ln = self._lanes[t]
            if t == nxt:
                ln.skips = 0
            elif (not self._queued(nxt) and t == best) or (self._queued(nxt) and x.arrival > ln.arrival):
                ln.skips += 1
        return nxt

    def _wait_turn(self, me: int) -> None:
        """Queue ``me`` (the lock held) and wait until it is chosen."""
        self._waiting.append(me)
        while True:
            if self._holder is None and self._choose_waiting() == me:
                self._waiting.remove(me)
                self._holder = me
                return
            self._cond.wait()

    def _choose_waiting(self) -> int | None:
        if not self._waiting:
            return None
        if self._pick is None:
            self._pick = self._choose(list(self._waiting))
        return self._pick

    def acquire(self) -> None:
        """Wait for the baton behind every lane already waiting."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                raise RuntimeError("the baton is not re-entrant")
            if self._holder is None and not self._waiting:
                self._holder = me
                return
            self._wait_turn(me)

    def release(self) -> None:
        with self._cond:
            self._release(threading.get_ident())

    def _release(self, me: int) -> None:
        if self._holder != me:
            raise RuntimeError("the baton is released by a lane that does not hold it")
        self._holder, self._pick = None, None
        self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Lanes waiting for the baton."""
        return len(self._waiting)

    def pass_(self) -> None:
        """Hand the baton to the lane that should run next (the module
        docstring) and queue for it again, in one step (no lane can slip in
        between); nothing when that is the holder (it keeps running)."""
        me = threading.get_ident()
        with self._cond:
            if not self._waiting:
                return
            if self._holder != me:
                raise RuntimeError("the baton is passed by a lane that does not hold it")
            nxt = self._choose([*self._waiting, me])
            if nxt == me:
                return
            self.handovers += 1
            self._release(me)
            self._pick = nxt  # chosen already: its skips are counted once
            self._wait_turn(me)

    def __enter__(self) -> Baton:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
