"""Cold results computed once per test process.

A cold prefill's greedy reply, logits or exported state is a pure function
of the engine (its model file and settings: ``payload_abi`` and the exact
mode), the context size, the text and the number of tokens generated
(docs/DESIGN.md, "Determinism"): a test that compares a resumed session
with one takes it from here, computed by the first test that asks (alone,
each test still computes its own). :func:`cached` keeps the value frozen --
lists and tuples as tuples, NumPy arrays as read-only copies, dicts as
tuples of items -- so no test can change what another one reads; a caller
that needs a list or a writeable array copies it."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = ["cached", "engine_key"]

_RESULTS: dict[Hashable, Any] = {}


def engine_key(eng) -> tuple:
    """What a cold result of ``eng`` depends on besides the text: its kind,
    its payload ABI (model fingerprint, layout, batch policy) and its exact
    mode (a reference engine has none)."""
    return (type(eng).__name__, eng.payload_abi(), getattr(eng, "exact_mode", None))


def _frozen(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        out = value.copy()
        out.flags.writeable = False
        return out
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    return value


def cached(key: Hashable, compute: Callable[[], Any]) -> Any:
    """The frozen value of ``compute()`` under ``key`` (computed at the
    first call with that key; ``key`` should start with the caller's name
    and :func:`engine_key`)."""
    try:
        return _RESULTS[key]
    except KeyError:
        value = _RESULTS[key] = _frozen(compute())
        return value
