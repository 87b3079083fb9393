"""The request-field tests the three protocols share (:mod:`.openai`,
:mod:`.anthropic`, :mod:`.responses`): what counts as an integer or a
number in a JSON body (``true`` is neither), a number in a range, and text
a tokenizer can encode (UTF-8, no lone surrogate), a structured-output
format's name.

Only the tests: each protocol words its errors and gives them its own shape
(its module's ``_bad``), so a client sees what it always saw.
"""

from __future__ import annotations

import re
from typing import TypeGuard

__all__ = ["format_name", "int_from", "is_int", "is_num", "num_in", "utf8_len"]

_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_int(v: object) -> TypeGuard[int]:
    """A JSON integer (not a boolean)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> TypeGuard[int | float]:
    """A JSON number (not a boolean)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def num_in(v: object, lo: float, hi: float) -> bool:
    """A number between ``lo`` and ``hi`` (both included)."""
    return is_num(v) and lo <= v <= hi


def int_from(v: object, lo: int) -> bool:
    """An integer ``>= lo``."""
    return is_int(v) and v >= lo


def utf8_len(s: str) -> int | None:
    """Bytes of ``s`` in UTF-8; None when it holds a lone surrogate (valid
    JSON, but no tokenizer can encode it)."""
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def format_name(v: object) -> TypeGuard[str]:
    """A ``json_schema`` format's name: 1 to 64 of a-z, A-Z, 0-9, ``_``, ``-``."""
    return isinstance(v, str) and _FORMAT_NAME.fullmatch(v) is not None
