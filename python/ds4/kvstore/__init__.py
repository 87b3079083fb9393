"""KVStore: a directory of checkpoints with ds4's policy on top.

* Files are ``<sha1 of the key text>-<model tag>.kv`` (:func:`checkpoint_name`;
  an earlier release's ``<sha1>.kv`` is read too), format v2, written by the
  Rust core: temp file, fsync, rename, fsync of the directory, mode 0600.
* The index (name -> header facts and stat key) lives in the Rust core
  (``_core.StoreIndex``) and persists in the directory (``.ds4.index``:
  written under the lock through a temp file, fsync'd, renamed, checksummed).
  Opening a store reads it and lists the directory once (names and inode
  numbers, no ``stat``): a file that is new or was replaced is indexed from
  its header, never by hashing its text; a damaged, foreign or missing index
  file is rebuilt from the headers. The index only proposes candidates:
  every load runs the whole verification pipeline (:mod:`.indexed`).
  A running store rescans only when the directory's mtime changes.
* Lookup is one call into the core, the GIL released (:class:`Matches`).
* With ``StorePolicy.blocks``, a checkpoint's append-only state goes into
  shared block files and the checkpoint is a manifest naming them (:mod:`.blocks`).
* Candidates are tried longest first by the ladder
  (:func:`ds4.recovery.load_first`, the one place a session is loaded from
  here); the store's verdict on one that fails (:mod:`.loads`): a corrupt
  one is removed (or moved to the quarantine directory), an incompatible
  one skipped and kept (docs/DESIGN.md, "Store policy"). The knobs are one
  :class:`StorePolicy` (:mod:`.policy`).
* Budget in MiB with 1 % slack; eviction by ds4's score
  ``(hits * 2^(-age/6h) + 1) * tokens / file_size`` (explicit checkpoints
  weighted, fresh files last: :class:`StorePolicy`), the newest file
  protected; one failed unlink does not stop eviction; a continued save
  supersedes the continued snapshots of its prefixes (:func:`.save.supersede`). With
  ``tenant_share`` F < 1, a tenant over F of the budget loses its own
  files first (:func:`.entries.plan_eviction`).
* Crashed writers' temp files and files whose header is corrupt are removed
  on refresh, blocks no manifest names at eviction: nothing leaks outside the budget.
* Stores, evictions, discards and removals take an exclusive ``flock`` on
  ``.ds4.lock``: processes share a directory. No other module removes a checkpoint.
* With ``remote=`` (a Redis URL, :mod:`.remote`), a shared second tier a
  lookup also asks; every local store is queued for upload (:mod:`.tiered`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from .. import _core
from ..errors import CheckpointError
from ..errors import StoreError as StoreError  # what opening a store raises (re-exported)
from .blocks import BlockStore
from .counters import Counted, Counters, merged
from .entries import (
    HALF_LIFE_S,
    Candidates,
    Entry,
    LoadResult,
    Matches,
    NamedLoad,
    model_usage,
    plan_eviction,
    tenant_usage,
)
from .files import (
    INDEX_NAME,
    LOCK_NAME,
    NOT_REGULAR,
    TMP_MAX_AGE_S,
    DirLock,
    StatKey,
    checkpoint_name,
    is_checkpoint_name,
    open_cache_dir,
    remove_orphaned_temp,
    scan_dir,
    stat_key,
    temp_is_orphaned,
    temp_writer_pid,
)
from .indexed import DirIndex
from .loads import open_for
from .policy import StorePolicy
from .records import RecordStore
from .rejection import Refusal, Rejection, RejectionLog
from .remove import evict_entries, is_regular, remove_exact
from .save import CHATML_MARKERS, adopt_download, chat_anchor, store_checked, store_live
from .skips import SaveSkip
from .writes import WriteLog

if TYPE_CHECKING:
    from ..session import Session
    from .remote import RemoteEntry, RemoteTier
    from .tiered import SharedTier

log = logging.getLogger("ds4.kvstore")


def index_header(index: _core.StoreIndex, path: str) -> object:
    """Index one file from its header (``StoreIndex.index_file``): the one
    place the store reads a file it has not indexed yet."""
    return index.index_file(path)


__all__ = [
    "CHATML_MARKERS",
    "HALF_LIFE_S",
    "INDEX_NAME",
    "LOCK_NAME",
    "NOT_REGULAR",
    "TMP_MAX_AGE_S",
    "Candidates",
    "Entry",
    "KVStore",
    "LoadResult",
    "Matches",
    "NamedLoad",
    "Refusal",
    "Rejection",
    "RejectionLog",
    "RemoteTier",
    "SaveSkip",
    "StorePolicy",
    "chat_anchor",
    "checkpoint_name",
    "is_checkpoint_name",
    "is_regular",
    "plan_eviction",
    "remove_orphaned_temp",
    "scan_dir",
    "stat_key",
    "temp_is_orphaned",
    "temp_writer_pid",
    "tenant_usage",
]


#: the shared tier's names this package re-exports, imported when first asked for
_LAZY = {"RemoteTier": "remote", "RemoteEntry": "remote", "DEFAULT_NAMESPACE": "remote", "SharedTier": "tiered"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


class KVStore:
    """A checkpoint directory with ds4's store policy (defaults are ds4's).

    The one boundary between ds4 and a cache directory: recovery, the
    server and every ``ds4`` command find, load, discard and remove
    checkpoints through it, under its one lock."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_mb: float | None = None,
        *,
        policy: StorePolicy | None = None,
        scan: bool = True,
        trust_dir: bool = False,
        remote: str | RemoteTier | None = None,
        remote_ttl_s: int = 0,
        remote_namespace: str | None = None,
        auth_key: bytes | None = None,
        **knobs: Any,
    ):
        """``policy`` (or ds4's defaults), with ``budget_mb`` and any other
        :class:`StorePolicy` field given by keyword on top of it."""
        if budget_mb is not None:
            knobs["budget_mb"] = budget_mb
        #: the store's knobs (:class:`StorePolicy`)
        self.policy = dataclasses.replace(policy or StorePolicy(), **knobs)
        self.dir = open_cache_dir(directory, trust_dir)
        if auth_key is not None and len(auth_key) != 32:
            raise ValueError("auth_key must be 32 bytes (ds4._core.derive_auth_key of the key file's bytes)")
        #: with a key, every checkpoint written carries a MAC and every one
        #: read must carry a valid one (docs/FORMAT.md §1.9)
        self.auth_key = auth_key
        if isinstance(remote, str):  # the tier's modules load for a tier only (a lookup never needs them)
            from .remote import DEFAULT_NAMESPACE, RemoteTier

            ns = DEFAULT_NAMESPACE if remote_namespace is None else remote_namespace
            remote = RemoteTier(remote, ttl_s=remote_ttl_s, namespace=ns)
        #: the shared tier (None: this directory only)
        self.remote = remote
        self._lock = DirLock(self.dir, trust_dir)
        #: the bytes its saves write, by reason, and the write budget (:mod:`.writes`)
        self.writes = WriteLog(self.dir, self.policy.write_budget_bytes)
        # small JSON records (stored Responses) in records/: at most 1 % of
        # the budget, and counted in it (eviction makes room for them)
        self.records = RecordStore(self.dir, max(1 << 16, self.budget_bytes // 100), self.locked)
        #: the store's own counters (its index and tier keep theirs: :attr:`stats`)
        self.counters = Counters(
            "hits", "misses", "stores", "evictions", "superseded", "rejected", "removed_corrupt", "scans"
        )
        #: the index and its file, kept in step with the directory
        #: (:mod:`.indexed`); headers are read through :func:`index_header`,
        #: looked up when called. The store's parts (:mod:`.loads`,
        #: :mod:`.save`, :mod:`.considered`) reach the index here.
        self.index = DirIndex(
            self.dir,
            read_header=lambda idx, path: index_header(idx, path),
            discard=self.discard,
            try_lock=self._lock.try_held,
        )
        #: the shared block files and which manifest names which (:mod:`.blocks`)
        self.blocks = BlockStore(self.dir, auth_key, self.index)
        #: what this directory does with the tier's files (:mod:`.tiered`)
        self._tiered = None
        if self.remote is not None:
            from .tiered import SharedTier

            # a download is verified for a session (:mod:`.loads`), then renamed in (:mod:`.save`)
            opener = functools.partial(open_for, self, check_name=False)
            adopt = functools.partial(adopt_download, self)
            self._tiered = SharedTier(self.remote, self.blocks, open_for=opener, adopt=adopt, locked=self.locked)
        if scan:
            self.index.open()
            if self.total_bytes() > self.budget_bytes:
                # as ds4 does when a store opens: a directory over its budget
                # comes down to it (one we cannot write to is still read)
                try:
                    self.evict()
                except OSError as e:
                    log.warning("kv cache over budget, cannot evict on open: %s", e)

    def close(self) -> None:
        """Finish the shared tier's queued uploads and close its connections
        (nothing to do without one)."""
        if self.remote is not None:
            self.remote.close()

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """The directory's exclusive lock (re-entrant within this store):
        stores, evictions, discards and removals hold it; so may a caller
        that keeps its own small files beside the checkpoints."""
        return self._lock.held()

    # -- index ---------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Bring the index up to date with the directory. Cheap when nothing
        changed (one stat of the directory); see :mod:`.indexed`."""
        self.index.refresh(force)

    def entries(self) -> list[Entry]:
        self.refresh()
        return sorted(self._entries(), key=lambda e: (-e.text_bytes, e.name))

    def _entries(self) -> list[Entry]:
        return [Entry.from_row(self.dir, row) for row in self.index.idx.entries()]

    def total_bytes(self) -> int:
        return self.index.idx.total_bytes() + self.blocks.total_bytes()

    @property
    def stats(self) -> dict[str, int]:
        """The counters of the store, its index and its use of the shared
        tier, merged (:mod:`.counters`)."""
        parts: list[Counted] = [self, self.index, self.writes, *([] if self._tiered is None else [self._tiered])]
        return merged(*parts)

    def summary(self) -> dict[str, object]:
        """The directory, its indexed files and bytes, and the counters
        (what a status page shows), from the index as it stands (its heap too)."""
        idx = self.index.idx  # each model's bytes, files and hits too (``models``: :func:`.entries.model_usage`)
        out: dict[str, object] = {"dir": self.dir, "files": len(idx), "bytes": self.total_bytes(), **self.stats}
        out.update(index_heap_bytes=idx.heap_bytes(), tenants=self.tenant_usage(), models=model_usage(idx.abi_usage()))
        out.update(**self.writes.summary(), **self.blocks.summary(self._entries, idx.total_bytes()))
        if self.remote is not None:
            out["remote"] = self.remote.status()
        return out

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Bytes and checkpoints of each tenant (:func:`.entries.tenant_usage`)
        from the index as it stands: no directory scan, no file read (the
        core sums each namespace; Python names its tenant)."""
        return tenant_usage(self.index.idx.namespace_usage())

    # -- lookup --------------------------------------------------------------
    def lookup(self, prompt: str | bytes, abi: str | None = None, ctx: int | None = None) -> list[Entry]:
        """Entries whose name equals the SHA-1 of a prefix of ``prompt``,
        longest first (one call into the core, see :class:`KVStore`); with
        at least ``min_tokens`` tokens, of ``abi`` (or ds4 v1), fewer
        tokens than ``ctx``. Their headers were read when indexed; a load
        verifies the whole file again."""
        self.refresh()
        pb = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
        rows = self.index.idx.lookup(pb, min_tokens=max(0, self.min_tokens), abi=abi, ctx=ctx)
        return list(Matches(self.dir, rows, self.index.checker(self.min_tokens, abi, ctx, hold=False)))

    def candidates(
        self, prompt: bytes, ctx: int | None = None, abi: str | None = None, namespace: str | None = None
    ) -> Candidates:
        """One lookup for one request: the stored prefixes of ``prompt``, a
        key text (see :meth:`lookup`), and the files rejected while indexing
        since the last call. The ladder asks once and hands the result to
        every rung that needs it (:func:`ds4.recovery.load_first`).

        ``namespace`` is the one the key text is in (:mod:`ds4.keytext`: its
        preamble starts ``prompt``, so only that namespace's files can
        match, here and on a shared tier, whose keys are the same SHA-1s). A
        namespaced lookup is not told of files rejected while indexing (they
        may be any namespace's; they are logged). With a shared tier and
        ``abi`` (the session's payload ABI), the tier's prefixes of
        ``prompt`` too (skipped while the tier cools down). The local ones are
        :class:`Matches`: the longest found here, the next ones when asked for."""
        self.refresh()
        rows = self.index.idx.prefixes(prompt, min_tokens=max(0, self.min_tokens), ctx=ctx)
        entries = Matches(self.dir, rows, self.index.checker(self.min_tokens, None, ctx))
        rejected = self.index.take_unreported()
        found = Candidates(prompt, entries, [] if namespace is not None else rejected, namespace)
        if self._tiered is not None and abi is not None:
            self._tiered.lookup(found, abi, min_tokens=self.min_tokens, ctx=ctx)
        return found

    # -- removal -------------------------------------------------------------
    def discard(self, path: str, err: CheckpointError, where: str, expect: StatKey | None) -> str | None:
        """Remove (or move to the quarantine directory) a corrupt file, under
        the directory's lock: the one place a corrupt checkpoint leaves.
        ``expect`` is the file's stat key taken before it was judged: a file
        that has changed since (a fresh one in its place) stays, and so does
        anything that is not a regular file (see :mod:`.remove`). Only the
        name counts: nothing outside this directory is touched. Returns where
        it went (its quarantine path, or its own path when removed), or None
        when it was gone, replaced, ignored or could not be removed."""
        name = os.path.basename(path)
        if not is_checkpoint_name(name):
            return None
        self.index.drop(name, expect)  # read again if it stays and changes (a rewrite in progress)
        how = f"stage={err.stage} code={err.code} reason={err.reason} ({where})"
        try:
            with self.locked():
                dest = remove_exact(
                    self.dir,
                    name,
                    expect,
                    quarantine_dir=self.policy.quarantine_dir,
                    tag=f"{int(time.time())}.{err.code}",
                )
                self.index.persist()
        except OSError as e:
            log.error("kv cache could not remove corrupt file %s: %s", name, e)
            return None
        if dest is not None:
            self.counters["removed_corrupt"] += 1
            if dest == os.path.join(self.dir, name):
                log.warning("kv cache removed corrupt file=%s %s", name, how)
            else:
                log.warning("kv cache quarantined corrupt file=%s %s -> %s", name, how, dest)
        return dest

    def remove(self, name_or_path: str) -> bool:
        """Remove the checkpoint of that name from this directory (a path is
        reduced to its name: nothing outside the directory is touched; an
        entry that is not a regular file is never removed). False when there
        was none."""
        name = os.path.basename(name_or_path)
        if not is_checkpoint_name(name):
            raise ValueError(f"not a checkpoint name: {name!r}")
        with self.locked():
            gone = remove_exact(self.dir, name, None) is not None
            self.index.forget(name)
            self.index.persist()
        return gone

    # -- load ----------------------------------------------------------------
    def miss(self) -> None:
        """Count a disk rung that loaded nothing."""
        self.counters["misses"] += 1

    def remote_longer(self, found: Candidates) -> list[RemoteEntry]:
        """:meth:`.tiered.SharedTier.longer` (none without a shared tier)."""
        return [] if self._tiered is None else self._tiered.longer(found)

    # -- the shared tier (kvstore/tiered.py) ----------------------------------
    def pull(self, r: RemoteEntry, report: RejectionLog | None = None) -> Entry | None:
        """Download one remote checkpoint into this directory (``ds4 kv
        pull``): the whole pipeline (with this store's key) and the checks
        every load makes on the tensors, then the rename. A damaged entry is
        deleted from the tier; None when nothing was added."""
        return self._shared_tier().pull(r, report, auth_key=self.auth_key, mmap=self.policy.mmap)

    def push(self) -> dict[str, int]:
        """Upload every checkpoint of this directory to the tier now (``ds4
        kv push``); counts by outcome (``stored``, ``present``, ...)."""
        return self._shared_tier().push(self.entries())

    @property
    def shared(self) -> SharedTier | None:
        """What this directory does with its shared tier (None: no tier)."""
        return self._tiered

    def _shared_tier(self) -> SharedTier:
        if self._tiered is None:
            raise ValueError("this store has no remote tier")
        return self._tiered

    # -- store policy (:class:`StorePolicy`) ------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.policy.budget_bytes

    @property
    def min_tokens(self) -> int:
        return self.policy.min_tokens

    @property
    def cold_max_tokens(self) -> int:
        return self.policy.cold_max_tokens

    @property
    def tenant_share(self) -> float:
        return self.policy.tenant_share

    def continued_step(self) -> int:
        """:meth:`StorePolicy.continued_step`."""
        return self.policy.continued_step()

    def store_live_prefix(
        self, sess: Session, reason: str = "cold", *, min_tokens: int | None = None, supersedes: Collection[str] = ()
    ) -> str | None:
        """Save the live session (which must be valid) under the SHA-1 of its
        key text (:meth:`Session.key_bytes`: its namespace's preamble, then
        its tokens' rendering). Returns the path, or None when the policy declines
        (too short, over budget, key held by another engine's file).
        ``min_tokens`` overrides the store's minimum (named and system-prompt
        checkpoints may be short); a continued save prunes what it supersedes
        of ``supersedes``, its prefill's earlier snapshots (:func:`.save.supersede`).
        Why it declined: :meth:`store_live_checked`."""
        got = store_live(self, sess, reason, min_tokens, supersedes)
        return got if isinstance(got, str) else None

    def store_live_checked(
        self, sess: Session, reason: str = "cold", *, min_tokens: int | None = None, supersedes: Collection[str] = ()
    ) -> str | SaveSkip:
        """:meth:`store_live_prefix` that says why nothing was saved: the
        path, or a :class:`.skips.SaveSkip` of kind ``reason`` whose code
        (:data:`.skips.SKIP_CODES`) is the policy's refusal, a failed write
        (``disk_full``, ``write_error``: no OSError is raised) or a session
        without a valid state (``session_invalid``): :func:`.save.store_checked`."""
        return store_checked(self, sess, reason, min_tokens, supersedes)

    # -- eviction --------------------------------------------------------------
    def evict(self) -> int:
        """Evict down to the budget; returns how many files went."""
        return len(self.evict_names())

    def evict_names(self) -> list[str]:
        """Evict down to the budget (:meth:`plan_evict`'s plan); returns the
        names removed, in the plan's order."""
        with self.locked():
            removed = self.evict_locked(protect=None)
            self.index.persist()
            return removed

    def eviction_limit(self) -> int:
        """The bytes the checkpoints may hold: the budget, less what the
        records (stored Responses) take of it."""
        return self.budget_bytes - self.records.total_bytes()

    def plan_evict(self, entries: list[Entry], protect: str | None = None) -> list[Entry]:
        """What an eviction of ``entries`` removes, in order, with this
        store's limit and tenant share (:func:`.entries.plan_eviction`):
        :meth:`evict` and ``ds4 kv gc --dry-run`` plan with it."""
        pol = self.policy
        return plan_eviction(
            entries,
            self.eviction_limit(),
            time.time(),
            protect,
            pol.tenant_share,
            explicit_weight=pol.explicit_weight,
            fresh_guard_s=pol.fresh_guard_s,
        )

    def evict_locked(self, protect: str | None) -> list[str]:
        """Evict down to the budget, the caller holding :meth:`locked`
        (``protect``: a name that stays); the names removed."""
        removed: list[str] = []
        while True:  # again while shared blocks freed less than their manifests' shares
            self.refresh(force=True)
            entries = self.blocks.charge(self._entries())  # a block counted once, shared among its manifests
            victims = self.plan_evict(entries, protect)
            for victim in victims:
                self.index.forget(victim.name)
                self.blocks.forget(victim.name)
            gone = evict_entries(self.dir, victims)
            self.counters["evictions"] += len(gone)
            if gone:
                _core.sync_dir(self.dir)
                self.index.stale()
            removed += gone
            self.blocks.settle(entries, set(gone))  # orphans out, the references kept (in the index)
            if not gone or not len(self.blocks):
                return removed
