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

A resident's state is only ever changed by its own lane, so a handover
between two tokens leaves each session exactly as a single-session run
would: the engine contexts are separate, and the outputs stay identical to
one request at a time (the pool's tests compare them with a cold server).
"""

from __future__ import annotations

import collections
import threading

__all__ = ["Baton"]


class Baton:
    """A fair (FIFO) lock with a cheap :meth:`pass_` for long holders."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: int | None = None
        self._waiting: collections.deque[int] = collections.deque()
        #: how many times the baton changed hands at a pass (the operator's view)
        self.handovers = 0

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
            while self._holder is not None or self._waiting[0] != me:
                self._cond.wait()
            self._waiting.popleft()
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
        """Hand the baton to the lane that waited longest and queue for it
        again; nothing when no lane waits (the holder keeps running)."""
        with self._cond:
            if not self._waiting:
                return
            if self._holder != threading.get_ident():
                raise RuntimeError("the baton is passed by a lane that does not hold it")
            self.handovers += 1
        self.release()
        self.acquire()

    def __enter__(self) -> Baton:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
