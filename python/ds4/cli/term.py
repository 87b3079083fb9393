"""Terminal output for the ``ds4`` commands: sizes, ages, safe text and
tables (the prefill progress bar is :mod:`ds4.cli.progress`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = [
    "EXIT_FAIL",
    "EXIT_OK",
    "EXIT_USAGE",
    "age",
    "escaped",
    "human_bytes",
    "json_text",
    "preview",
    "printable",
    "table",
]

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


class Escaped(str):
    """Text already :func:`escaped` (a :func:`table` cell not escaped again)."""


_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    if ch.isprintable():
        return ch
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def escaped(s: object) -> Escaped:
    """``s`` on one line, safe for a terminal, as ``ls`` shows a file name:
    a backslash, a newline, a tab or a carriage return as ``\\``, ``\\n``,
    ``\\t``, ``\\r``; any other character Python does not call printable
    (ESC and every control, the bidi overrides, other format characters) as
    ``\\xHH``/``\\uHHHH``; printable text of any script as it is. What a
    store holds (a file name, a header's ABI string, an error's reason, a
    tenant) is printed through this: it can neither drive the terminal nor
    forge a line of the output."""
    t = str(s)
    if t.isprintable() and "\\" not in t:
        return Escaped(t)
    return Escaped("".join(_escape_char(ch) for ch in t))


def json_text(doc: object) -> str:
    """``doc`` as indented JSON (non-ASCII text as it is), with every
    character that is not printable escaped as ``\\uHHHH`` (JSON escapes
    only the C0 controls itself: C1 controls such as CSI and the bidi
    overrides would reach the terminal raw)."""
    s = json.dumps(doc, indent=1, ensure_ascii=False)
    return "".join(ch if ch.isprintable() or ch == "\n" else f"\\u{ord(ch):04x}" for ch in s)


def preview(text: bytes, n: int = 48) -> Escaped:
    """The start of ``text`` on one line (:func:`escaped`), at most ``n`` characters."""
    s = escaped(text.decode("utf-8", "replace"))
    return s if len(s) <= n else Escaped(s[: n - 1] + "…")


def table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    """Aligned columns, one row per line, every cell :func:`escaped`."""
    cols = [[c if isinstance(c, Escaped) else escaped(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    for r in cols:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() + "\n")


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
        print(json_text({"removed": removed, problems_key: problems}))
    else:
        for n in removed:
            print(f"removed {escaped(n)}")
        for p in problems:
            print(f"{cmd}: {escaped(describe(p))}", file=sys.stderr)
    return EXIT_FAIL if problems else EXIT_OK
