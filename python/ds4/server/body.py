"""A request body, read with bounds: media type, size, time, JSON depth and
strings the engine can encode. Every refusal is an :class:`ApiError`
(415, 413, 408, 400) raised before a job exists.

The JSON is parsed on a worker thread (``asyncio.to_thread``), not on the
event loop, so a large body does not stall other connections (``/health``,
streaming answers). Before ``json.loads`` the nesting depth is measured with
NumPy over the structural bytes outside strings: Python's parser would
raise ``RecursionError`` (a 500) long after spending the time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from .wire import ApiError, invalid_json

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["BodyLimits", "check_strings", "json_depth", "parse_json", "read_json"]

#: JSON strings (the unrolled form: linear time, no backtracking)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 16 * 1024 * 1024
    read_timeout_s: float = 30.0
    max_depth: int = 64


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside
    strings do not count)."""
    a = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    s = a[(a == _OPEN[0]) | (a == _OPEN[1]) | (a == _CLOSE[0]) | (a == _CLOSE[1])]
    if not s.size:
        return 0
    step = np.where((s == _OPEN[0]) | (s == _OPEN[1]), 1, -1).astype(np.int64)
    return int(np.cumsum(step).max())


def _safe(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def check_strings(obj: Any) -> None:
    """Every string of ``obj`` (keys too) must encode as UTF-8: JSON allows
    lone surrogates (``"\\ud800"``), which no tokenizer can take. 400 with
    the path of the first one."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        o, path = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    400,
                    f"{_safe(path) or 'the body'} holds a string that is not valid Unicode (a lone surrogate)",
                    "invalid_request_error",
                    _safe(path) or None,
                    "invalid_string",
                ) from None
        elif isinstance(o, dict):
            for k, v in o.items():
                p = f"{path}.{k}" if path else str(k)
                stack.append((k, p))
                stack.append((v, p))
        elif isinstance(o, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(o))


def parse_json(raw: bytes, max_depth: int = 64) -> Any:
    """``raw`` as JSON, refused (400) when nested deeper than ``max_depth``,
    malformed, or holding a string that is not valid Unicode."""
    if json_depth(raw) > max_depth:
        raise ApiError(
            400,
            f"the JSON body is nested deeper than {max_depth} levels",
            "invalid_request_error",
            None,
            "invalid_json",
        )
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise invalid_json(e) from None
    check_strings(obj)
    return obj


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def _read(request: Request, limit: int) -> bytes:
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise _too_large(limit)
    return bytes(buf)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body exceeds {limit // (1024 * 1024)} MiB",
        "invalid_request_error",
        None,
        "request_too_large",
    )


async def read_json(request: Request, limits: BodyLimits) -> Any:
    """The request's JSON body within ``limits`` (see the module)."""
    mt = _media_type(request)
    if mt != "application/json" and not (mt.startswith("application/") and mt.endswith("+json")):
        raise ApiError(
            415,
            f"the body must be JSON (Content-Type: application/json), not {mt or 'none'!r}",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_large(limits.max_bytes)
    try:
        raw = await asyncio.wait_for(_read(request, limits.max_bytes), limits.read_timeout_s)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.read_timeout_s:g} s",
            "invalid_request_error",
            None,
            "request_timeout",
        ) from None
    return await asyncio.to_thread(parse_json, raw, limits.max_depth)
