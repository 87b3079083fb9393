"""The start-up probe's batch policy (and the pool's batched-decode check),
kept on disk between starts.

Finding the batch sizes a model's kernels treat alike
(:mod:`~ds4.engines.llamacpp_probe`) evaluates a few hundred tokens under
each candidate policy: seconds at every start of every process (a server,
``ds4 run``, each test's server). The answer depends only on the model file,
the llama.cpp build, the CPU, the context settings and the probe itself, so
it is stored under a key naming all of them and read back at the next start
with the same key: the probe then measures only what is cheap (the memory,
the state layout, the export/import round trip).

The key holds the model's SHA-256, llama-cpp-python's version and its
shared library's path, size and modification time, llama.cpp's system info
line (the CPU features its kernels were picked for), the batch size, the
thread count, the K/V cache types, the exact flag, the memory's facts, the
candidate policies and :data:`PROBE_VERSION` (bumped whenever the probe
measures something else or another way: its results from before are not
used). A file whose key differs in anything is not used.

Files live in ``$DS4_CACHE_DIR/probes`` (default ``$XDG_CACHE_HOME/ds4``,
else ``~/.cache/ds4``), one small JSON file per key, written atomically
(a temporary file, fsync, rename). ``DS4_PROBE_CACHE=off`` turns the cache
off. A file that is not a regular file, too large, not JSON, of another key
or with values outside the candidates is ignored (and replaced by the next
probe's result): the worst a hostile file can do is make the probe run."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Sequence
from typing import Any

from ..durable import write_durably

__all__ = ["PROBE_VERSION", "Policy", "cache_dir", "load", "load_flag", "store", "store_flag"]

log = logging.getLogger("ds4.engines.llamacpp")

#: what the probe measures and how (2: state and logits, a reply's one-token steps)
PROBE_VERSION = 2
#: the largest file read back
_MAX_BYTES = 1 << 16

#: (floor, multiple, verified, serial)
Policy = tuple[int, int, bool, bool]


def cache_dir() -> str | None:
    """Where the probes are kept, or None when the cache is off."""
    if os.environ.get("DS4_PROBE_CACHE", "").lower() in ("0", "off", "no", "false"):
        return None
    base = os.environ.get("DS4_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "ds4")
    return os.path.join(base, "probes")


def _path(d: str, key: dict[str, Any]) -> str:
    text = json.dumps(key, sort_keys=True)
    return os.path.join(d, hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")


def _read(key: dict[str, Any]) -> dict[str, Any] | None:
    """The document stored under ``key``, or None (none, off, or not one to trust)."""
    d = cache_dir()
    if d is None:
        return None
    path = _path(d, key)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())  # the file opened, not the path again
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
                return None
            doc = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != json.loads(json.dumps(key)):
        return None
    return doc


def _write(key: dict[str, Any], fields: dict[str, Any]) -> None:
    """Keep ``fields`` under ``key``; a failure is logged, never raised."""
    d = cache_dir()
    if d is None:
        return
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        write_durably(_path(d, key), json.dumps({"key": key, **fields}, sort_keys=True).encode())
    except OSError as e:
        log.info("llama.cpp engine: a start-up check's result is not kept (%s)", e)


def load(key: dict[str, Any], candidates: Sequence[tuple[int, int]]) -> Policy | None:
    """The policy stored under ``key``, or None (none, off, or not one to trust)."""
    doc = _read(key)
    if doc is None:
        return None
    floor, mult, verified, serial = (doc.get(k) for k in ("floor", "multiple", "verified", "serial"))
    if not (isinstance(verified, bool) and isinstance(serial, bool)):
        return None
    if not any(floor == f and mult == m for f, m in candidates) or (serial and (floor, mult) != (1, 1)):
        return None
    return int(floor), int(mult), verified, serial  # type: ignore[arg-type]


def store(key: dict[str, Any], policy: Policy) -> None:
    """Keep ``policy`` under ``key``."""
    floor, mult, verified, serial = policy
    _write(key, {"floor": floor, "multiple": mult, "verified": verified, "serial": serial})


def load_flag(key: dict[str, Any]) -> bool | None:
    """A yes/no check's answer stored under ``key`` (the pool's batched
    decode: :func:`~ds4.engines.llamacpp_batch.shared_context`), or None."""
    doc = _read(key)
    ok = None if doc is None else doc.get("ok")
    return ok if isinstance(ok, bool) else None


def store_flag(key: dict[str, Any], ok: bool) -> None:
    """Keep a yes/no check's answer under ``key``."""
    _write(key, {"ok": bool(ok)})
