"""Terminal output for the ``ds4`` commands: sizes, ages, safe text and
tables (the prefill progress bar is :mod:`ds4.cli.progress`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "age", "human_bytes", "preview", "printable", "table"]

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
