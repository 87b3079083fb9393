"""What the store's saves write, and the write budget that bounds it.

Every save's bytes (a single file's, or a manifest's and the blocks it
added) are counted (:attr:`WriteLog.counters`' ``bytes_written``) and by
the save's reason (:meth:`WriteLog.by_reason`; ``/metrics`` shows them as
``ds4_kv_written_bytes_total{reason}``).

With a write budget (``--kv-write-budget-gb-per-day``, ``StorePolicy.
write_budget_gb_per_day``) the bytes of the last 24 hours are kept in the
directory (``.ds4.writes``: one count per hour, written under the store's
lock through a temp file, fsync'd and renamed, so every process sharing
the directory counts against one budget), and a save is admitted before
anything is written (:meth:`WriteLog.admit`):

* no save is admitted when its bytes would take the last 24 hours over the
  budget (code ``write_budget``);
* an ``evict`` or ``frontier`` save (a session's state kept as it is
  replaced: often never loaded) whose new bytes are at most a quarter of
  its state (its blocks mostly on disk already) is cheap and admitted
  like any other; a mostly new one only while the day's writes stay under
  the budget times the likelihood that such a snapshot is hit, measured on
  the directory (its ``evict`` and ``frontier`` checkpoints that were
  loaded at least once, out of all of them, with one hit and one miss
  assumed so that an empty directory gives one half).

A ``.ds4.writes`` that cannot be read (damaged, not a regular file,
another format) counts as an empty day and is replaced at the next save;
nothing else in the directory is touched."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterable

from ..durable import write_durably
from .counters import Counters
from .skips import WRITE_BUDGET, SaveSkip

__all__ = ["CHEAP_SHARE", "SPECULATIVE_REASONS", "WRITES_NAME", "WriteLog", "hit_share"]

WRITES_NAME = ".ds4.writes"
_TMP_NAME = ".ds4.writes.tmp"
_HOUR = 3600
_DAY_HOURS = 24
#: the saves that are often never loaded: a state kept as it is replaced
SPECULATIVE_REASONS = frozenset({"evict", "frontier"})
#: a speculative save is cheap when its new bytes are at most this share of its state
CHEAP_SHARE = 0.25


class WriteLog:
    """The bytes a store's saves write, by reason, and its write budget
    (``budget_bytes`` a day, 0: none) over the directory ``d``."""

    def __init__(self, d: str, budget_bytes: int):
        self.dir, self.budget_bytes = d, budget_bytes
        self.counters = Counters("bytes_written", "write_budget_refused")
        self._by_reason: dict[str, int] = {}

    # -- the last 24 hours -------------------------------------------------------
    def _hours(self, now: float) -> dict[int, int]:
        """The directory's bytes written per hour in the 24 hours up to
        ``now`` (empty when its file cannot be read)."""
        path = os.path.join(self.dir, WRITES_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return {}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {}
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(1 << 16)
            doc = json.loads(raw)
            hours = {int(h): int(n) for h, n in doc["hours"].items()} if doc.get("version") == 1 else {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}
        finally:
            os.close(fd)
        first = int(now) // _HOUR - _DAY_HOURS + 1
        return {h: n for h, n in hours.items() if h >= first and n > 0}

    def _write(self, hours: dict[int, int]) -> None:
        """``.ds4.writes`` replaced (the caller holds the store's lock)."""
        data = json.dumps({"version": 1, "hours": {str(h): n for h, n in sorted(hours.items())}}).encode()
        # a fixed temp name (a crashed writer's is ours to replace, as the index's); never over a
        # symlink or a directory someone put in the file's place
        write_durably(
            os.path.join(self.dir, WRITES_NAME), data, tmp=os.path.join(self.dir, _TMP_NAME), regular_only=True
        )

    def day_bytes(self, now: float | None = None) -> int:
        """The directory's bytes written in the last 24 hours (with a budget;
        0 without one: nothing is kept)."""
        return sum(self._hours(time.time() if now is None else now).values()) if self.budget_bytes else 0

    # -- a save ---------------------------------------------------------------------
    def admit(self, reason: str, new_bytes: int, state_bytes: int, hit_share: Callable[[], float]) -> SaveSkip | None:
        """None when a save of ``reason`` that writes ``new_bytes`` (of a
        state of ``state_bytes``) fits the budget, else why not.
        ``hit_share``: the likelihood that a speculative save is loaded
        (:func:`hit_share`; asked only for a mostly new speculative save)."""
        if not self.budget_bytes:
            return None
        used = self.day_bytes()
        limit, share = self.budget_bytes, 1.0
        if reason in SPECULATIVE_REASONS and new_bytes > CHEAP_SHARE * state_bytes:
            share = hit_share()
            limit = int(self.budget_bytes * share)
        if used + new_bytes <= limit:
            return None
        self.counters["write_budget_refused"] += 1
        mib = 2**20
        why = "" if share == 1.0 else f" (a mostly new {reason} snapshot: {share:.2f} of it)"
        return SaveSkip(
            reason,
            WRITE_BUDGET,
            f"{new_bytes / mib:.1f} MiB more would make {(used + new_bytes) / mib:.1f} MiB in 24 h, "
            f"over the write budget of {limit / mib:.1f} MiB{why}",
        )

    def record(self, reason: str, nbytes: int) -> None:
        """A save of ``reason`` wrote ``nbytes`` (the caller holds the
        store's lock). A failure to keep the day's count is not the save's:
        the next save writes the file again."""
        self.counters["bytes_written"] += nbytes
        self._by_reason[reason] = self._by_reason.get(reason, 0) + nbytes
        if not self.budget_bytes or nbytes <= 0:
            return
        now = time.time()
        hours = self._hours(now)
        h = int(now) // _HOUR
        hours[h] = hours.get(h, 0) + nbytes
        try:
            self._write(hours)
        except OSError:
            pass

    def summary(self) -> dict[str, object]:
        """The bytes this store's saves wrote by reason (``written_by_reason``),
        the write budget (bytes a day, 0: none) and the directory's bytes
        written in the last 24 hours (0 without a budget)."""
        return {
            "written_by_reason": self.by_reason(),
            "write_budget_bytes": self.budget_bytes,
            "written_day_bytes": self.day_bytes(),
        }

    def by_reason(self) -> dict[str, int]:
        """Bytes written by this store's saves, by reason."""
        return dict(self._by_reason)


def hit_share(entries: Iterable[tuple[str, int]]) -> float:
    """The likelihood that a speculative save is loaded, from the
    directory's ``(reason, hits)`` of its checkpoints: those of
    :data:`SPECULATIVE_REASONS` hit at least once, plus one, over all of
    them plus two."""
    n = hit = 0
    for reason, hits in entries:
        if reason in SPECULATIVE_REASONS:
            n += 1
            hit += hits > 0
    return (hit + 1) / (n + 2)
