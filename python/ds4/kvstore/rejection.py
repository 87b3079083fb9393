"""What the store records about a file it would not use: one
:class:`Rejection` per candidate (a local file, or ``remote:<name>`` on the
shared tier), and :class:`RejectionLog`, where the store writes them.

The store's own type, low in the graph: the ladder's report
(:class:`ds4.recovery.RecoveryReport`) is a :class:`RejectionLog` and
shows these as they are; no module of the store knows the report."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from ..errors import CheckpointError

__all__ = ["Refusal", "Rejection", "RejectionLog", "import_failure", "rejection_of"]


class Rejection(NamedTuple):
    """(path, stage, code, reason) of a file the store rejected (a tuple:
    it compares, unpacks and serializes as one)."""

    path: str
    stage: str
    code: str
    reason: str


class Refusal(NamedTuple):
    """The store's verdict on a candidate that failed to load
    (:meth:`ds4.kvstore.KVStore.refuse`): its rejection and, when the
    session it was loading into can no longer be trusted, why it must be
    invalidated (``""``: it need not be)."""

    rejection: Rejection
    invalidate: str = ""


class RejectionLog(Protocol):
    """Whatever collects a run's rejections (a ladder's report, or a
    command's): the store appends to its ``rejected`` list."""

    rejected: list[Rejection]


def rejection_of(path: str, err: CheckpointError) -> Rejection:
    """The rejection of a checkpoint error's file (its stage, code and
    reason, as the error tells them)."""
    return Rejection(path, err.stage, err.code, err.reason)


def import_failure(path: str, err: BaseException) -> Rejection:
    """The rejection of a candidate whose import failed with an error that
    is not a checkpoint error (a bug, or a limit of numpy or an engine):
    skipped and kept, never raised out of the ladder."""
    return Rejection(path, "engine", "import_failed", f"{type(err).__name__}: {err}")
