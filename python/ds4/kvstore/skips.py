"""Why a checkpoint was not saved (issue 42): :class:`SaveSkip` (the save's
kind, a stable code, a sentence with the numbers) and the codes, defined
here only (docs/DESIGN.md, "Saves that did not happen").

:meth:`ds4.kvstore.KVStore.store_live_checked` returns one where
:meth:`~ds4.kvstore.KVStore.store_live_prefix` returns None (or raises);
the ladder and the turn driver put a request's own in its report
(``RecoveryReport.save_skipped``), from where the server's ``ds4`` block,
``/metrics`` and ``/ui`` show them."""

from __future__ import annotations

import dataclasses
import errno

from ..errors import StoreFullError

__all__ = [
    "ABOVE_COLD_MAX_TOKENS",
    "BELOW_MIN_TOKENS",
    "DISK_FULL",
    "ENGINE_CANNOT_LOAD",
    "NAME_HELD_BY_OTHER_MODEL",
    "OVER_BUDGET",
    "SESSION_INVALID",
    "SKIP_CODES",
    "WRITE_BUDGET",
    "WRITE_ERROR",
    "SaveSkip",
    "cold_too_long",
    "cold_too_short",
    "session_invalid",
    "write_failed",
]

#: the engine's state did not survive its start-up round trip: it could
#: never load a file it wrote
ENGINE_CANNOT_LOAD = "engine_cannot_load"
#: fewer tokens than the store's ``min_tokens`` (a cold save: after its
#: boundary trim)
BELOW_MIN_TOKENS = "below_min_tokens"
#: a prompt longer than ``cold_max_tokens`` gets no cold save
ABOVE_COLD_MAX_TOKENS = "above_cold_max_tokens"
#: the key's file name is held by a file this engine cannot load (another
#: engine's or model's checkpoint, or an entry that is not a regular file):
#: it is kept, and nothing is written under its name
NAME_HELD_BY_OTHER_MODEL = "name_held_by_other_model"
#: the file's estimated size exceeds the store's budget
OVER_BUDGET = "over_budget"
#: the disk (or the user's quota) is full
DISK_FULL = "disk_full"
#: any other failure to write the file
WRITE_ERROR = "write_error"
#: the session holds no valid state to save
SESSION_INVALID = "session_invalid"
#: the save's bytes would take the last 24 hours' writes over the write
#: budget (``--kv-write-budget-gb-per-day``, :mod:`.writes`)
WRITE_BUDGET = "write_budget"

#: every code, in the order above: a stable set (a new one is added, none renamed)
SKIP_CODES = (
    ENGINE_CANNOT_LOAD,
    BELOW_MIN_TOKENS,
    ABOVE_COLD_MAX_TOKENS,
    NAME_HELD_BY_OTHER_MODEL,
    OVER_BUDGET,
    DISK_FULL,
    WRITE_ERROR,
    SESSION_INVALID,
    WRITE_BUDGET,
)


@dataclasses.dataclass(frozen=True)
class SaveSkip:
    """A save that did not happen: its ``kind`` (the save's reason: ``cold``,
    ``continued``, ``evict``, ``prompt``, ``shutdown``, ...), a ``code`` of
    :data:`SKIP_CODES` and a ``detail`` for people, with the numbers (no
    path, no text)."""

    kind: str
    code: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "code": self.code, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.kind} save skipped: {self.code} ({self.detail})"


def write_failed(kind: str, e: OSError) -> SaveSkip:
    """The skip of a write that raised ``e``: ``disk_full`` or ``write_error``,
    its detail the error's message (never the path)."""
    full = isinstance(e, StoreFullError) or e.errno in (errno.ENOSPC, errno.EDQUOT)
    return SaveSkip(kind, DISK_FULL if full else WRITE_ERROR, e.strerror or str(e) or type(e).__name__)


def cold_too_short(n_tokens: int, min_tokens: int, trim: int) -> SaveSkip:
    """The skip of a cold save a prompt of ``n_tokens`` is too short for
    (:meth:`ds4.kvstore.StorePolicy.cold_store_at` found no length)."""
    if n_tokens < min_tokens or trim <= 0:
        return SaveSkip("cold", BELOW_MIN_TOKENS, f"{n_tokens} tokens < min {min_tokens}")
    return SaveSkip(
        "cold",
        BELOW_MIN_TOKENS,
        f"{n_tokens} tokens less the {trim}-token boundary trim: {n_tokens - trim} < min {min_tokens}",
    )


def cold_too_long(n_tokens: int, cold_max_tokens: int) -> SaveSkip:
    """The skip of a cold save a prompt of ``n_tokens`` is too long for."""
    return SaveSkip("cold", ABOVE_COLD_MAX_TOKENS, f"{n_tokens} tokens > cold max {cold_max_tokens}")


def session_invalid(kind: str, e: Exception) -> SaveSkip:
    """The skip of a save asked of a session without a valid state."""
    return SaveSkip(kind, SESSION_INVALID, str(e) or "the session has no valid state")
