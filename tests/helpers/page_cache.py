"""How much of a file the page cache holds: ``mincore(2)`` over a shared
read-only map of the whole file (through ctypes: Python has no binding).
Shared by the page-cache test (tests/test_page_cache.py) and its bench (benches/bench_page_cache.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

__all__ = ["resident_bytes"]

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: str | os.PathLike[str], start: int = 0) -> int:
    """Bytes of ``path`` from ``start`` (rounded down to a page) to its end
    in the page cache now (whole pages; the last one counted as the
    file's tail). Mapping a file reads none of it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            page = mmap.PAGESIZE
            vec = ctypes.create_string_buffer(-(-size // page))
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
            pages = sum(b & 1 for b in vec.raw[start // page :])
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size - start // mmap.PAGESIZE * mmap.PAGESIZE, pages * mmap.PAGESIZE)
