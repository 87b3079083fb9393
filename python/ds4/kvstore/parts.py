"""What the store's collaborators share (:class:`StoreParts`): its directory,
its knobs and key, its index, blocks, write log, records and counters, its
shared tier, its lock and its one removal of a corrupt file. The store builds
it once; the store's side of a load (:mod:`.admission`), its saves
(:mod:`.save`), its eviction (:mod:`.eviction`) and a miss's lookup
(:mod:`.considered`) take it instead of the whole store, so none of them
imports the store back or reaches past what is named here."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from .entries import Entry

if TYPE_CHECKING:  # the parts' own modules import this one (annotations only here)
    from ..errors import CheckpointError
    from .blocks import BlockStore
    from .counters import Counters
    from .files import StatKey
    from .indexed import DirIndex
    from .policy import StorePolicy
    from .records import RecordStore
    from .remote import RemoteTier
    from .writes import WriteLog

__all__ = ["StoreParts"]


@dataclasses.dataclass
class StoreParts:
    """One store's parts, as its collaborators see them (the store's own
    attributes of the same names are these objects). Only ``policy`` is
    ever replaced (:attr:`ds4.kvstore.KVStore.policy`'s setter)."""

    #: the checkpoint directory (opened and checked: :func:`.files.open_cache_dir`)
    dir: str
    policy: StorePolicy
    #: with a key, every file written carries a MAC and every one read must
    auth_key: bytes | None
    index: DirIndex
    blocks: BlockStore
    writes: WriteLog
    records: RecordStore
    #: the store's own counters (hits, misses, stores, evictions, ...)
    counters: Counters
    #: the shared tier (None: this directory only)
    remote: RemoteTier | None
    #: the directory's exclusive lock (re-entrant within the store)
    locked: Callable[[], contextlib.AbstractContextManager[None]]
    #: the one removal of a corrupt file (:meth:`ds4.kvstore.KVStore.discard`)
    discard: Callable[[str, CheckpointError, str, StatKey | None], str | None]

    def entries(self) -> list[Entry]:
        """Every indexed checkpoint, the index brought up to date first."""
        self.index.refresh()
        return [Entry.from_row(self.dir, row) for row in self.index.rows()]
