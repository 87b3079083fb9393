"""Terminal output for the ``ds4`` commands: sizes, ages, safe text, tables
and the prefill progress bar."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "ProgressBar", "age", "human_bytes", "preview", "printable", "table"]

#: the exit statuses of every ``ds4`` command
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def age(ts: int, now: float | None = None) -> str:
    if not ts:
        return "-"
    d = max(0, int((now or time.time()) - ts))
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= s:
            return f"{d // s}{unit} ago"
    return f"{d}s ago"


_CTRL = {c: "\ufffd" for c in [*list(range(0, 32)), 127, *list(range(128, 160))] if c not in (9, 10)}


def printable(s: str) -> str:
    """Terminal-safe text: control characters (except tab and newline) are
    shown as U+FFFD so random model bytes cannot drive the terminal."""
    return s.translate(_CTRL)


def preview(text: bytes, n: int = 48) -> str:
    s = text.decode("utf-8", "replace").replace("\n", "\\n")
    s = printable(s)
    return s if len(s) <= n else s[: n - 1] + "…"


def table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    cols = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    for r in cols:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() + "\n")


class ProgressBar:
    """A prefill progress bar on stderr, shown once a prefill has run for
    ``delay`` seconds; silent when the stream is not a TTY. ``check`` runs on
    every update (it may raise, e.g. KeyboardInterrupt)."""

    def __init__(
        self,
        label: str = "prefill",
        stream: TextIO | None = None,
        delay: float | None = None,
        check: Callable[[], None] | None = None,
        width: int = 30,
    ):
        if delay is None:  # DS4_PROGRESS_DELAY overrides the 1.5 s (tests set 0)
            try:
                delay = float(os.environ.get("DS4_PROGRESS_DELAY", "1.5"))
            except ValueError:
                delay = 1.5
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self.label, self.delay, self.check, self.width = label, delay, check, width
        self.t0 = time.perf_counter()
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if self.check is not None:
            self.check()
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        if el < self.delay:
            return
        frac = min(1.0, done / max(1, total))
        fill = int(frac * self.width)
        rate = done / max(el, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0.0
        self.stream.write(
            f"\r\x1b[K{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} tok "
            f"{rate:.0f} tok/s eta {eta:.0f}s"
        )
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False


def report_removed(
    as_json: bool,
    removed: list[str],
    problems_key: str,
    problems: list[str],
    cmd: str,
    describe: Callable[[str], str] = str,
) -> int:
    """What a ``kv rm`` did: JSON (``removed`` and ``problems_key``) or one
    line per removed name on stdout and one per problem (``describe``d) on
    stderr; the exit status (a failure when there was any problem)."""
    if as_json:
        print(json.dumps({"removed": removed, problems_key: problems}, indent=1))
    else:
        for n in removed:
            print(f"removed {n}")
        for p in problems:
            print(f"{cmd}: {describe(p)}", file=sys.stderr)
    return EXIT_FAIL if problems else EXIT_OK
