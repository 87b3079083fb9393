"""The store's eviction (:class:`Eviction`): down to the budget by ds4's score
(:func:`.entries.plan_eviction`, the tenant share and the fresh-file guard
from the store's policy), the newest file protected, a shared block counted
once among the manifests that name it and removed when none is left
(:meth:`.blocks.BlockStore.settle`)."""

from __future__ import annotations

import time

from .. import _core
from .entries import Entry, plan_eviction
from .parts import StoreParts
from .remove import evict_entries

__all__ = ["Eviction"]


class Eviction:
    """Evicts one store's directory (``parts``) down to its budget."""

    def __init__(self, parts: StoreParts):
        self._p = parts

    def limit(self) -> int:
        """The bytes the checkpoints may hold: the budget, less what the
        records (stored Responses) take of it."""
        return self._p.policy.budget_bytes - self._p.records.total_bytes()

    def plan(self, entries: list[Entry], protect: str | None = None) -> list[Entry]:
        """What an eviction of ``entries`` removes, in order, with the
        store's limit and tenant share (:func:`.entries.plan_eviction`)."""
        pol = self._p.policy
        return plan_eviction(
            entries,
            self.limit(),
            time.time(),
            protect,
            pol.tenant_share,
            explicit_weight=pol.explicit_weight,
            fresh_guard_s=pol.fresh_guard_s,
        )

    def run(self) -> list[str]:
        """Evict down to the budget under the directory's lock; the names
        removed, in the plan's order (the index written after)."""
        with self._p.locked():
            removed = self.run_locked(protect=None)
            self._p.index.persist()
            return removed

    def run_locked(self, protect: str | None) -> list[str]:
        """Evict down to the budget, the caller holding the lock
        (``protect``: a name that stays); the names removed."""
        p = self._p
        removed: list[str] = []
        while True:  # again while shared blocks freed less than their manifests' shares
            p.index.refresh(force=True)
            entries = p.blocks.charge([Entry.from_row(p.dir, r) for r in p.index.rows()])  # a block counted once
            victims = self.plan(entries, protect)
            for victim in victims:
                p.index.forget(victim.name)
                p.blocks.forget(victim.name)
            gone = evict_entries(p.dir, victims)
            p.counters["evictions"] += len(gone)
            if gone:
                _core.sync_dir(p.dir)
                p.index.stale()
            removed += gone
            p.blocks.settle(entries, set(gone))  # orphans out, the references kept (in the index)
            if not gone or not len(p.blocks):
                return removed
