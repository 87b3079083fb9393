"""The prefill progress bar of ``ds4 run``, ``ds4 chat`` and ``ds4 bench``:
one line on stderr, redrawn in place (``\\r``), at most every ``every``
seconds, once a prefill has run for ``delay`` seconds (1 by default;
``DS4_PROGRESS_DELAY`` overrides it, the tests set 0), and erased when the
prefill ends. When stderr is not a terminal it writes nothing at all.

It is the ``progress(done, total)`` callback the turn driver, the ladder
and :meth:`ds4.Session.sync` take; the ladder also calls its
:meth:`ProgressBar.serving` before each prefill it runs, so the line says
which rung served the part that is not prefilled (``rung=disk
cached=2048``)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["DEFAULT_DELAY", "ProgressBar", "progress_delay"]

#: seconds a prefill runs before its bar is drawn
DEFAULT_DELAY = 1.0


def progress_delay() -> float:
    """``DS4_PROGRESS_DELAY`` in seconds (a number >= 0), else the default."""
    try:
        delay = float(os.environ.get("DS4_PROGRESS_DELAY", DEFAULT_DELAY))
    except ValueError:
        return DEFAULT_DELAY
    return delay if delay >= 0 else DEFAULT_DELAY


class ProgressBar:
    """A prefill progress bar on ``stream`` (stderr), drawn only when it is
    a terminal. ``check`` runs on every update, drawn or not (it may raise,
    e.g. KeyboardInterrupt, which stops the prefill). ``clock`` is the time
    source (tests pass their own); ``columns`` the line's width (default:
    the terminal's)."""

    def __init__(
        self,
        label: str = "prefill",
        stream: TextIO | None = None,
        delay: float | None = None,
        check: Callable[[], None] | None = None,
        every: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
        columns: int | None = None,
    ):
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.enabled = False
        self.label, self.check, self.every, self.clock = label, check, every, clock
        self.delay = progress_delay() if delay is None else delay
        self.columns = columns
        self.t0 = clock()
        self.last: float | None = None  # when the line was last drawn
        self.rung: str | None = None
        self.reused = 0
        self.drawn = False

    def serving(self, rung: str, reused: int) -> None:
        """The ladder's word before a prefill: ``rung`` served ``reused``
        tokens, the prefill computes the rest. Its clock starts here."""
        self.rung, self.reused = rung, reused
        self.t0 = self.clock()

    def __call__(self, done: int, total: int) -> None:
        if self.check is not None:
            self.check()
        if not self.enabled:
            return
        now = self.clock()
        el = now - self.t0
        if not self.drawn and el < self.delay:
            return
        if self.last is not None and now - self.last < self.every and done < total:
            return  # throttled; the last update of a pass is always drawn
        self.stream.write("\r\x1b[K" + self.line(done, total, el))
        self.stream.flush()
        self.last, self.drawn = now, True

    def line(self, done: int, total: int, elapsed: float) -> str:
        """The bar's text (no control characters), fitted to the width."""
        frac = min(1.0, done / max(1, total))
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(total - done) / rate:3.0f}s" if rate > 0 else "  ?s"
        served = f", rung={self.rung} cached={self.reused}" if self.rung is not None else ""
        # fixed widths within a prefill: the bar keeps its length as the numbers change
        tail = f" {done:{len(str(total))}d}/{total} tok {rate:5.0f} tok/s eta {eta}{served}"
        cols = self.columns or shutil.get_terminal_size((80, 24)).columns
        room = cols - 1 - len(self.label) - 3 - len(tail)  # never the last column: no wrap
        width = max(5, min(30, room))
        fill = int(frac * width)
        return f"{self.label} [{'#' * fill}{'.' * (width - fill)}]{tail}"[: max(1, cols - 1)]

    def close(self) -> None:
        """Erase the line (when one was drawn); the next prefill starts afresh."""
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self.drawn, self.last = False, None
