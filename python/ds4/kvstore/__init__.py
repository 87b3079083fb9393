"""KVStore: a directory of checkpoints with ds4's policy on top (docs/DESIGN.md,
"Store policy"). The store is the one door; each part owns its concern:

* files ``<sha1 of the key text>-<model tag>.kv`` (:meth:`KVStore.path_for`;
  an earlier release's ``<sha1>.kv`` is read too), written by the Rust core
  (temp file, fsync, rename, fsync of the directory, mode 0600): :mod:`.save`;
* the index, in the core and in ``.ds4.index``, kept in step with the
  directory; it only proposes candidates, every load verifies the whole file:
  :mod:`.indexed`; lookup is one call into the core (:class:`Matches`);
* the store's verdict on a candidate the ladder (:mod:`ds4.loading`) loads:
  a corrupt file removed or quarantined, an incompatible one kept:
  :mod:`.admission`, through the one removal (:mod:`.remove`);
* the budget and ds4's eviction score, tenant shares, superseded snapshots:
  :mod:`.eviction`, :mod:`.entries`, :class:`StorePolicy`;
* shared block files and manifests (:mod:`.blocks`), stored Responses
  (:mod:`.records`), the write log and budget (:mod:`.writes`);
* an exclusive ``flock`` on ``.ds4.lock`` around stores, evictions,
  discards and removals: processes share a directory;
* with ``remote=`` (a Redis URL), a shared second tier (:mod:`.remote`,
  :mod:`.tiered`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from .. import _core
from ..errors import CheckpointError
from ..errors import StoreError as StoreError  # what opening a store raises (re-exported)
from .admission import Admission
from .blocks import BlockStore
from .considered import longest_considered, stored_text
from .counters import Counted, Counters, merged
from .entries import (
    HALF_LIFE_S,
    Candidates,
    Entry,
    IndexRow,
    LoadResult,
    Matches,
    NamedLoad,
    model_usage,
    plan_eviction,
    tenant_usage,
)
from .eviction import Eviction
from .files import (
    INDEX_NAME,
    LOCK_NAME,
    NOT_REGULAR,
    TMP_MAX_AGE_S,
    DirLock,
    StatKey,
    checkpoint_name,
    is_checkpoint_name,
    legacy_name,
    open_cache_dir,
    remove_orphaned_temp,
    scan_dir,
    stat_key,
    temp_is_orphaned,
    temp_writer_pid,
)
from .indexed import DirIndex
from .parts import StoreParts
from .policy import CHATML_MARKERS, StorePolicy, chat_anchor
from .records import RecordStore
from .rejection import Refusal, Rejection, RejectionLog
from .remove import discard_exact, is_regular, remove_exact
from .save import Saves
from .skips import SaveSkip
from .writes import WriteLog

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..session import Session
    from .remote import RemoteEntry, RemoteTier

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
_LAZY = {"RemoteTier": "remote", "RemoteEntry": "remote", "DEFAULT_NAMESPACE": "remote"}


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
        policy = dataclasses.replace(policy or StorePolicy(), **knobs)
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
        self.writes = WriteLog(self.dir, policy.write_budget_bytes)
        # small JSON records (stored Responses) in records/: at most 1 % of
        # the budget, and counted in it (eviction makes room for them)
        self.records = RecordStore(self.dir, max(1 << 16, policy.budget_bytes // 100), self.locked)
        #: the store's own counters (its index and tier keep theirs: :attr:`stats`)
        self.counters = Counters(
            "hits", "misses", "stores", "evictions", "superseded", "rejected", "removed_corrupt", "scans"
        )
        #: the index and its file, kept in step with the directory
        #: (:mod:`.indexed`); headers are read through :func:`index_header`,
        #: looked up when called
        self.index = DirIndex(
            self.dir,
            read_header=lambda idx, path: index_header(idx, path),
            discard=self.discard,
            try_lock=self._lock.try_held,
        )
        #: the shared block files and which manifest names which (:mod:`.blocks`)
        self.blocks = BlockStore(self.dir, auth_key, self.index)
        # what the store's collaborators share (:mod:`.parts`): its loads'
        # verdicts, its saves, its eviction
        parts = StoreParts(
            self.dir, policy, auth_key, self.index, self.blocks, self.writes, self.records, self.counters,
            self.remote, self.locked, self.discard,
        )  # fmt: skip
        self._parts = parts
        self._admission = Admission(parts)
        self._eviction = Eviction(parts)
        self._saves = Saves(parts, self._eviction)
        if self.remote is not None:  # the tier's side in this directory (:mod:`.tiered`)
            # a download is verified for a session (:mod:`.admission`), then renamed in (:mod:`.save`)
            opener = functools.partial(self._admission.open, check_name=False)
            self.remote.attach(self.blocks, open_for=opener, adopt=self._saves.adopt, locked=self.locked)
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
        return [Entry.from_row(self.dir, row) for row in self.index.rows()]

    def rows(self) -> list[IndexRow]:
        """The index's rows as it stands: no refresh, no lock (what a status
        page lists)."""
        return self.index.rows()

    def total_bytes(self) -> int:
        return self.index.total_bytes() + self.blocks.total_bytes()

    @property
    def stats(self) -> dict[str, int]:
        """The counters of the store, its index and its use of the shared
        tier, merged (:mod:`.counters`)."""
        parts: list[Counted] = [self, self.index, self.writes, *([] if self.remote is None else [self.remote.local])]
        return merged(*parts)

    def summary(self) -> dict[str, object]:
        """The directory, its indexed files and bytes, and the counters
        (what a status page shows), from the index as it stands (its heap too)."""
        idx = self.index  # each model's bytes, files and hits too (``models``: :func:`.entries.model_usage`)
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
        return tenant_usage(self.index.namespace_usage())

    # -- lookup --------------------------------------------------------------
    def lookup(self, prompt: str | bytes, abi: str | None = None, ctx: int | None = None) -> list[Entry]:
        """Entries whose name equals the SHA-1 of a prefix of ``prompt``,
        longest first (one call into the core, see :class:`KVStore`); with
        at least ``min_tokens`` tokens, of ``abi`` (or ds4 v1), fewer
        tokens than ``ctx``. Their headers were read when indexed; a load
        verifies the whole file again."""
        self.refresh()
        pb = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
        rows = self.index.lookup(pb, min_tokens=max(0, self.min_tokens), abi=abi, ctx=ctx)
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
        rows = self.index.prefixes(prompt, min_tokens=max(0, self.min_tokens), ctx=ctx)
        entries = Matches(self.dir, rows, self.index.checker(self.min_tokens, None, ctx))
        rejected = self.index.take_unreported()
        found = Candidates(prompt, entries, [] if namespace is not None else rejected, namespace)
        if self.remote is not None and abi is not None:
            self.remote.add_candidates(found, abi, min_tokens=self.min_tokens, ctx=ctx)
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
        try:
            with self.locked():
                dest = discard_exact(self.dir, name, err, where, expect, self.policy.quarantine_dir)
                self.index.persist()
        except OSError as e:
            log.error("kv cache could not remove corrupt file %s: %s", name, e)
            return None
        if dest is not None:
            self.counters["removed_corrupt"] += 1
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

    # -- files ----------------------------------------------------------------
    def path_for(self, sha: str, abi: str | None = None) -> str:
        """Where the checkpoint of key SHA-1 ``sha`` lives in this directory:
        ``<sha>-<model tag>.kv`` for payload ABI ``abi``, an earlier
        release's ``<sha>.kv`` without one. ``sha`` must be 40 hex
        digits (ValueError): a name never reaches outside the directory."""
        if not is_checkpoint_name(legacy_name(sha)):
            raise ValueError(f"not a checkpoint key: {sha!r}")
        return os.path.join(self.dir, legacy_name(sha) if abi is None else checkpoint_name(sha, abi))

    def find_named(self, sha: str, abi: str) -> str | None:
        """The path of ``sha``'s checkpoint for ``abi`` that exists: this
        model's name, else an earlier release's; None when neither does."""
        return next((p for p in (self.path_for(sha, abi), self.path_for(sha)) if os.path.lexists(p)), None)

    # -- load (the store's side, :mod:`.admission`; the ladder loads: :mod:`ds4.loading`)
    def open_for(self, sess: Session, path: str, prompt: bytes) -> Checkpoint:
        """Open ``path`` for a load into ``sess`` with this store's checks
        (:meth:`.admission.Admission.open`); raises what the pipeline raises."""
        return self._admission.open(sess, path, prompt)

    def refuse(self, e: Entry, err: Exception, judged: StatKey | None) -> Refusal | None:
        """The store's verdict on a candidate that failed to open or load
        (:meth:`.admission.Admission.refuse`)."""
        return self._admission.refuse(e, err, judged)

    def count_hit(self, e: Entry, ck: Checkpoint, ms: float, judged: StatKey | None) -> LoadResult:
        """Count a load of ``e`` (:meth:`.admission.Admission.hit`)."""
        return self._admission.hit(e, ck, ms, judged)

    def longest_considered(
        self, found: Candidates, *, ctx: int | None = None, exclude: Collection[str] = ()
    ) -> Entry | None:
        """The longest checkpoint ``found``'s lookup considered
        (:func:`.considered.longest_considered`)."""
        return longest_considered(self._parts, found, ctx=ctx, exclude=exclude)

    def stored_text(self, entry: Entry, namespace: str | None) -> bytes | None:
        """``entry``'s key text when it is in ``namespace`` (:func:`.considered.stored_text`)."""
        return stored_text(self._parts, entry, namespace)

    def miss(self) -> None:
        """Count a disk rung that loaded nothing."""
        self.counters["misses"] += 1

    def remote_longer(self, found: Candidates) -> list[RemoteEntry]:
        """:meth:`.remote.RemoteTier.longer` (none without a shared tier)."""
        return [] if self.remote is None else self.remote.longer(found)

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
    def shared(self) -> RemoteTier | None:
        """The shared tier, attached to this directory (None: no tier)."""
        return self.remote

    def _shared_tier(self) -> RemoteTier:
        if self.remote is None:
            raise ValueError("this store has no remote tier")
        return self.remote

    # -- store policy (:class:`StorePolicy`) ------------------------------------
    @property
    def policy(self) -> StorePolicy:
        """The store's knobs; a new value takes effect at the next call."""
        return self._parts.policy

    @policy.setter
    def policy(self, value: StorePolicy) -> None:
        self._parts.policy = value

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
        of ``supersedes``, its prefill's earlier snapshots (:meth:`.save.Saves.supersede`).
        Why it declined: :meth:`store_live_checked`."""
        got = self._saves.live(sess, reason, min_tokens, supersedes)
        return got if isinstance(got, str) else None

    def store_live_checked(
        self, sess: Session, reason: str = "cold", *, min_tokens: int | None = None, supersedes: Collection[str] = ()
    ) -> str | SaveSkip:
        """:meth:`store_live_prefix` that says why nothing was saved: the
        path, or a :class:`.skips.SaveSkip` of kind ``reason`` whose code
        (:data:`.skips.SKIP_CODES`) is the policy's refusal, a failed write
        (``disk_full``, ``write_error``: no OSError is raised) or a session
        without a valid state (``session_invalid``): :meth:`.save.Saves.checked`."""
        return self._saves.checked(sess, reason, min_tokens, supersedes)

    # -- eviction (:mod:`.eviction`) -------------------------------------------
    def evict(self) -> int:
        """Evict down to the budget; returns how many files went."""
        return len(self.evict_names())

    def evict_names(self) -> list[str]:
        """Evict down to the budget (:meth:`plan_evict`'s plan); returns the
        names removed, in the plan's order."""
        return self._eviction.run()

    def eviction_limit(self) -> int:
        """The bytes the checkpoints may hold: the budget, less what the
        records (stored Responses) take of it."""
        return self._eviction.limit()

    def plan_evict(self, entries: list[Entry], protect: str | None = None) -> list[Entry]:
        """What an eviction of ``entries`` removes, in order, with this
        store's limit and tenant share (:func:`.entries.plan_eviction`):
        :meth:`evict` and ``ds4 kv gc --dry-run`` plan with it."""
        return self._eviction.plan(entries, protect)
