"""Requests sent together, as the concurrency tests send them: ``fn(key)``
for every key, each in a thread of its own, all started before any is
waited for."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def at_once(fn: Callable[[Any], Any], keys: Iterable[Any], timeout: float = 600) -> dict[Any, Any]:
    """``{key: fn(key)}``, the calls made in threads started together. Any
    exception a call raised fails the test once every thread ended, as
    does a call still running after ``timeout`` seconds."""
    keys = list(keys)
    out: dict[Any, Any] = {}
    errs: list[BaseException] = []

    def run(k: Any) -> None:
        try:
            out[k] = fn(k)
        except BaseException as e:  # reported below, in the test's thread
            errs.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errs, errs
    missing = [k for k in keys if k not in out]
    assert not missing, f"no answer within {timeout} s: {missing}"
    return out
