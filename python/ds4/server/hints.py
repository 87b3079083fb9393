"""The pool's routing hints, in bounded memory (``X-Session-Id``,
``prompt_cache_key``, ``user``, Anthropic's ``metadata.user_id``).

A hint only picks a resident within the request's namespace (DESIGN,
"Session pool"), so what the table keeps is small and fixed: a hint is
kept as a 16-byte BLAKE2b digest, never as the client's string; a hint of
more than :data:`MAX_HINT_BYTES` UTF-8 bytes is ignored (the request is
served, unrouted by it); each namespace keeps at most
:data:`MAX_PER_NAMESPACE` hints (its oldest forgotten first, so one tenant
flooding the table never pushes out another's), and the table at most
:data:`MAX_HINTS` in all (then the oldest of the namespace holding the
most goes). Before, 40 requests with distinct 8 MiB hints grew a server by
345 MiB: the table kept every string whole.
"""

from __future__ import annotations

import collections
import hashlib

__all__ = ["DIGEST_BYTES", "MAX_HINTS", "MAX_HINT_BYTES", "MAX_PER_NAMESPACE", "HintTable", "hint_digest"]

#: a longer hint is ignored (a session id, a cache key or a user id is short)
MAX_HINT_BYTES = 256
#: hints kept in all
MAX_HINTS = 4096
#: hints kept per namespace (a tenant's, or the default's)
MAX_PER_NAMESPACE = 1024
#: what a kept hint costs: its digest
DIGEST_BYTES = 16


def hint_digest(hint: str | None) -> bytes | None:
    """What is kept of ``hint``: its 16-byte digest; None for no hint, an
    empty one or one over :data:`MAX_HINT_BYTES`."""
    if not hint:
        return None
    b = hint.encode("utf-8", "surrogatepass")
    if not b or len(b) > MAX_HINT_BYTES:
        return None
    return hashlib.blake2b(b, digest_size=DIGEST_BYTES).digest()


class HintTable:
    """namespace -> hint digest -> resident index, bounded (module docstring).
    Used by the worker thread holding the baton only."""

    def __init__(self) -> None:
        self._by_ns: dict[str | None, collections.OrderedDict[bytes, int]] = {}
        self._count = 0

    def get(self, namespace: str | None, hint: str | None) -> int | None:
        d = hint_digest(hint)
        table = self._by_ns.get(namespace)
        return None if d is None or table is None else table.get(d)

    def put(self, namespace: str | None, hint: str | None, index: int) -> bool:
        """Remember that ``hint`` last went to resident ``index``; False when
        the hint is not kept (empty or too long)."""
        d = hint_digest(hint)
        if d is None:
            return False
        table = self._by_ns.setdefault(namespace, collections.OrderedDict())
        if d not in table:
            self._count += 1
        table[d] = index
        table.move_to_end(d)
        if len(table) > MAX_PER_NAMESPACE:
            self._drop(table)
        while self._count > MAX_HINTS:
            self._drop(max(self._by_ns.values(), key=len))
        return True

    def _drop(self, table: collections.OrderedDict[bytes, int]) -> None:
        table.popitem(last=False)
        self._count -= 1
        for ns in [ns for ns, t in self._by_ns.items() if not t]:
            del self._by_ns[ns]

    def stats(self) -> dict[str, int]:
        """Hints kept, namespaces holding some, and the bytes of the kept
        digests (a namespace's name is the tenant's, bounded by the keys)."""
        return {"hints": self._count, "namespaces": len(self._by_ns), "digest_bytes": self._count * DIGEST_BYTES}
