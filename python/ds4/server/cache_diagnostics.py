"""Anthropic's cache diagnostics (the ``cache-diagnosis`` beta), answered
by ds4 (docs/DESIGN.md, "Why a turn missed, in the client's own terms").

A request that carries ``diagnostics: {"previous_message_id": ...}`` (the
``id`` of this client's previous ``/v1/messages`` reply, or null on the
first turn to opt in) gets ``diagnostics: {"cache_miss_reason": ...}`` in
its reply: why the prompt could not reuse the previous request's prefix,
in the official types: ``tools_changed``, ``system_changed``,
``messages_changed`` (an earlier entry differs, not only entries appended),
``unavailable`` (another prompt-affecting field differs: here the
``cache_salt``, which gives the request another cache), or
``previous_message_not_found`` (an unknown id, one of another tenant, or
one forgotten); ``diagnostics`` is null when nothing diverged. ``model``
is never the reason: the server has one model, whatever name is asked.

The comparison is on what ds4 renders, not on the raw request: the system
text without its volatile lines and the messages without their transient
spans (``--prompt-volatile``, ``--prompt-transient``), so a change ds4
takes out of the cache key is no miss here either. ``cache_missed_input_tokens``
is ds4's own figure: the previous request's prompt tokens less the tokens
this turn read from the cache (the ladder's verdict), at least 0.

What is kept per reply: digests (tools, system, the salt, the chain of the
messages) and two counts, about 120 bytes, keyed by the tenant and the
message id; the last :data:`MAX_RECORDS` of replies that opted in."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from . import tools as conv_tools

__all__ = ["MAX_RECORDS", "CacheDiagnostics", "Diagnosis", "diagnosis"]

#: the replies whose requests are remembered, the oldest forgotten
MAX_RECORDS = 4096


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b(json.dumps(parts, ensure_ascii=False).encode(), digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """One request's side: who asked, the id it compares with (None: the
    first turn), and the digests of what it renders (``chain[i]``: of its
    first ``i + 1`` messages after the system turn)."""

    tenant: str
    previous_id: str | None
    tools: bytes
    system: bytes
    other: bytes
    chain: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class _Record:
    tools: bytes
    system: bytes
    other: bytes
    n_messages: int
    last: bytes  # chain[n_messages - 1] (b"" when no message)
    prompt_tokens: int


def diagnosis(conv: Any, tenant: str, previous_id: str | None, cache_salt: str | None) -> Diagnosis:
    """The digests of ``conv`` (a :class:`ds4.server.conversation.Conversation`)
    as ds4 renders it."""
    out, _tail = conv.stable_messages()
    system = ""
    if out and out[0]["role"] == "system":
        system = out[0]["content"]
        out = out[1:]
    tools: list[Any] = []
    if conv.tools_active:
        tools = [t.schema() for t in conv.tools]
        block = conv_tools.tools_block(tools, conv.parallel_tool_calls)
        system = system.removeprefix(block).removeprefix("\n\n")
    chain, h = [], b""
    for m in out:
        h = _digest(h.hex(), m["role"], m["content"])
        chain.append(h)
    return Diagnosis(
        tenant,
        previous_id,
        _digest(tools, conv.parallel_tool_calls if tools else None),
        _digest(system),
        _digest(cache_salt),
        tuple(chain),
    )


class CacheDiagnostics:
    """The requests of the last replies that opted in, and the answers."""

    def __init__(self, max_records: int = MAX_RECORDS):
        self.max_records = int(max_records)
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, d: Diagnosis, message_id: str, prompt_tokens: int) -> None:
        """Remember the request of the reply ``message_id``."""
        rec = _Record(d.tools, d.system, d.other, len(d.chain), d.chain[-1] if d.chain else b"", int(prompt_tokens))
        with self._lock:
            self._records[(d.tenant, message_id)] = rec
            self._records.move_to_end((d.tenant, message_id))
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def reason(self, d: Diagnosis) -> tuple[str | None, int]:
        """The reason's type (None: nothing diverged) and the previous
        request's prompt tokens (0 when unknown)."""
        if d.previous_id is None:
            return None, 0
        with self._lock:
            prev = self._records.get((d.tenant, d.previous_id))
        if prev is None:
            return "previous_message_not_found", 0
        if prev.tools != d.tools:
            return "tools_changed", prev.prompt_tokens
        if prev.system != d.system:
            return "system_changed", prev.prompt_tokens
        if prev.other != d.other:
            return "unavailable", prev.prompt_tokens
        n = prev.n_messages
        if n > len(d.chain) or (n > 0 and d.chain[n - 1] != prev.last):
            return "messages_changed", prev.prompt_tokens
        return None, prev.prompt_tokens

    def answer(self, d: Diagnosis, cached_tokens: int | None) -> dict[str, Any] | None:
        """The reply's ``diagnostics``: None when nothing diverged; a reason
        with the tokens missed; ``{"cache_miss_reason": None}`` (pending, as
        the official API sends while its comparison runs) when the turn's
        cached tokens are not known yet (a stream's first event)."""
        kind, prev_tokens = self.reason(d)
        if kind is None:
            return None
        if kind in ("previous_message_not_found", "unavailable"):
            return {"cache_miss_reason": {"type": kind}}
        if cached_tokens is None:
            return {"cache_miss_reason": None}
        return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": max(0, prev_tokens - cached_tokens)}}
