"""BLAS thread control for the reference engine.

The reference model's matmuls are small: OpenBLAS threads cost more than they
give, and on a busy machine their spin-waiting makes a prefill 10-20x slower.
``ReferenceContext.eval`` therefore caps the BLAS thread count while it runs
(results do not depend on it: every matmul is exact). threadpoolctl is used
when installed, else the OpenBLAS that NumPy loaded is found in
/proc/self/maps and called directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["blas_threads"]

#: undoes a thread cap
Restore = Callable[[], None]
#: caps the BLAS threads at n; returns how to undo it
Limiter = Callable[[int], Restore]

_SET_NAMES = (
    "openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
)
_GET_NAMES = (
    "openblas_get_num_threads",
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
)


class _BlasState:
    """Process-wide: how deep the nested caps are, how to undo the outermost
    one, and the limiter (looked up once; None when there is none)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.restore: Restore | None = None
        self.looked_up = False
        self.limiter: Limiter | None = None


_blas = _BlasState()


def _find_openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) ctypes functions of the loaded OpenBLAS, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for gname, sname in zip(_GET_NAMES, _SET_NAMES, strict=True):
            get, set_ = getattr(lib, gname, None), getattr(lib, sname, None)
            if get is not None and set_ is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                return get, set_
    return None


def _threadpoolctl_limiter() -> Limiter | None:
    try:
        # imported by name: an optional dependency that ships no type information
        threadpool_limits: Any = importlib.import_module("threadpoolctl").threadpool_limits
    except Exception:
        return None

    def limit(n: int) -> Restore:
        restore: Restore = threadpool_limits(limits=n, user_api="blas").restore_original_limits
        return restore

    return limit


def _openblas_limiter() -> Limiter | None:
    found = _find_openblas()
    if found is None:
        return None
    get, set_ = found

    def limit(n: int) -> Restore:
        old = int(get())
        set_(int(n))
        return lambda: set_(old)

    return limit


def _blas_api() -> Limiter | None:
    """The limiter to use (threadpoolctl, else OpenBLAS), looked up once."""
    if not _blas.looked_up:
        _blas.limiter = _threadpoolctl_limiter() or _openblas_limiter()
        _blas.looked_up = True
    return _blas.limiter


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Cap the BLAS threads at ``n`` for the duration (no-op for None)."""
    if n is None:
        yield
        return
    with _blas.lock:
        if _blas.depth == 0:
            limiter = _blas_api()
            try:
                _blas.restore = limiter(n) if limiter is not None else None
            except Exception:  # pragma: no cover - best effort
                _blas.restore = None
        _blas.depth += 1
    try:
        yield
    finally:
        with _blas.lock:
            _blas.depth -= 1
            if _blas.depth == 0:
                restore, _blas.restore = _blas.restore, None
                try:
                    if restore is not None:
                        restore()
                except Exception:  # pragma: no cover - best effort
                    pass
