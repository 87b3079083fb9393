"""The store's index and its upkeep: what keeps the in-memory
``_core.StoreIndex`` (name -> header facts and stat key) and the index file
(``.ds4.index``, docs/FORMAT.md §6) in step with the directory.

* Opening reads the index file and lists the directory once (names and
  inode numbers, no ``stat``); only the files that are new or were replaced
  since it was written are read, from their headers. Every other record is
  checked against its file (stat key, fixed header, ABI, namespace
  preamble: one open and one or two small reads, in the core), and one that
  disagrees is read from its header too. A missing, damaged or foreign
  index file is rebuilt from the headers (a full rescan).
* A running store rescans only when the directory's mtime changes, and
  re-reads only new or changed files; orphaned temp files are removed on
  the way.
* The index file is written back only when the in-memory index changed,
  under the directory's lock (held, or free now: never waited for).
* It never hides a file: a name dropped after a failure that may pass (the
  file changed while its header was read, a rewrite in progress, a lock,
  a corrupt verdict on a version that is gone) is remembered with the
  file's stat key at the failure, and every refresh stats it again: it is
  read again as soon as the file has changed, and at the latest one
  :attr:`DirIndex.retry_s` after the failure. A candidate is stat'ed
  before it is offered (:meth:`DirIndex.current`): a file changed behind
  the index (same inode, the directory untouched: truncated or rewritten
  in place) is read again instead of offered as indexed.

This module never removes a checkpoint or takes the lock itself: the store
hands over its hooks (:class:`ds4.kvstore.KVStore`): reading one header, the
removal of a corrupt file, the lock's non-blocking attempt. It only
proposes candidates; every load runs the whole verification pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

from .. import _core
from ..errors import CheckpointError, CorruptCheckpointError, StoreError
from .counters import Counters
from .entries import Check, Entry, IndexRow
from .files import (
    INDEX_NAME,
    INDEX_TMP_NAME,
    NOT_REGULAR,
    StatKey,
    is_checkpoint_name,
    is_temp_name,
    remove_orphaned_temp,
    stat_key,
)
from .rejection import Rejection, rejection_of

log = logging.getLogger("ds4.kvstore")

__all__ = ["RETRY_S", "DirIndex"]

#: the longest a name dropped after a transient failure waits to be read
#: again when its file does not change (seconds, on :attr:`DirIndex.clock`)
RETRY_S = 30.0

#: threads the open's check of the index file's records uses (each file:
#: one open, one ``fstat``, one or two small reads)
CHECK_THREADS = min(4, os.cpu_count() or 1)

#: the store's hooks: read one file's header into the index; remove (or
#: quarantine) a corrupt file judged at a stat key; try the directory's lock
#: without waiting (yields whether it is held)
ReadHeader = Callable[[_core.StoreIndex, str], object]
Discard = Callable[[str, CheckpointError, str, StatKey | None], object]
TryLock = Callable[[], contextlib.AbstractContextManager[bool]]


class DirIndex:
    """One directory's index; its :attr:`counters` (``scans``,
    ``index_rebuilds``, ``index_retries``: dropped names read again,
    ``index_mismatches``: records the open found their files disagree with) are
    merged into the store's stats."""

    def __init__(
        self,
        directory: str,
        *,
        read_header: ReadHeader,
        discard: Discard,
        try_lock: TryLock,
    ):
        self.dir = directory
        self.counters = Counters("scans", "index_rebuilds", "index_retries", "index_mismatches")
        #: names dropped after a failure that may pass: name -> (the file's
        #: stat key then, or None, and when, on :attr:`clock`)
        self.dropped: dict[str, tuple[StatKey | None, float]] = {}
        #: the retries' clock (monotonic seconds) and their bound
        self.clock: Callable[[], float] = time.monotonic
        self.retry_s = RETRY_S
        self._read_header = read_header
        self._discard = discard
        self._try_lock = try_lock
        #: name -> header facts and stat key; also the files kept but not
        #: indexed (another format's), by stat key, so a rescan reports them once
        self._idx = _core.StoreIndex()
        #: files rejected while indexing, not yet reported to a ladder run
        self.unreported: list[Rejection] = []
        self._dir_mtime: int | None = None
        # the in-memory index differs from the index file
        self._dirty = False

    def take_unreported(self) -> list[Rejection]:
        """The files rejected while indexing since the last call."""
        out, self.unreported = self.unreported, []
        return out

    def stale(self) -> None:
        """The directory changed under this store's own hand (eviction):
        the next :meth:`refresh` rescans it."""
        self._dir_mtime = None

    def refresh(self, force: bool = False) -> None:
        """Bring the index up to date with the directory. Cheap when nothing
        changed (one stat of the directory)."""
        try:
            mt = os.stat(self.dir).st_mtime_ns
        except OSError as e:
            raise StoreError(e.errno, f"cache directory unavailable: {e.strerror}", self.dir) from e
        if not force and mt == self._dir_mtime:
            self._retry_dropped()
            return
        self.counters["scans"] += 1
        seen = {}
        now = time.time()
        with os.scandir(self.dir) as it:
            for de in it:
                name = de.name
                if is_checkpoint_name(name):
                    seen[name] = de
                elif is_temp_name(name):
                    remove_orphaned_temp(de.path, now)
        known = self._idx.keys()
        for name in known:
            if name not in seen:
                self._idx.remove(name)
                self._dirty = True
        for name, de in seen.items():
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            key = stat_key(st)
            old = known.get(name)
            if old is not None and old[0] == key:
                continue
            self._idx.remove(name)
            self.index_file(name, de.path, key)
        self._dir_mtime = mt

    def drop(self, name: str, key: StatKey | None) -> None:
        """Forget ``name`` after a failure that may pass (its file's stat
        key then, or None): the next refresh reads it again once the file
        has changed, and at the latest :attr:`retry_s` later."""
        self.forget(name)
        self.dropped[name] = (key, self.clock())

    def _retry_dropped(self) -> None:
        """Read again each dropped name whose file changed since, or whose
        retry is due; forget the ones whose file stayed gone that long."""
        now = self.clock()
        for name, (key, when) in list(self.dropped.items()):
            due = now - when >= self.retry_s
            try:
                cur = stat_key(os.lstat(os.path.join(self.dir, name)))
            except OSError:
                if due:
                    del self.dropped[name]
                continue
            if cur != key or due:
                del self.dropped[name]
                self.counters["index_retries"] += 1
                self._idx.remove(name)
                self.index_file(name, os.path.join(self.dir, name), cur)

    def checker(self, min_tokens: int, abi: str | None, ctx: int | None, hold: bool = True) -> Check:
        """:meth:`current` with a lookup's filters (``min_tokens``, ``abi``:
        or a v1 file, fewer tokens than ``ctx``), for :class:`Matches`; its
        rejections handed to it (``hold``) or left for the next lookup."""

        def ok(e: Entry) -> bool:
            return (
                e.tokens >= min_tokens
                and (ctx is None or e.tokens < ctx)
                and (abi is None or e.version == 1 or e.abi == abi)
            )

        return lambda e: self.current(e, ok, hold)

    def current(self, e: Entry, ok: Callable[[Entry], bool], hold: bool = True) -> tuple[Entry | None, list[Rejection]]:
        """``e`` as its file is now, before it is offered: one ``lstat``; the
        indexed stat key (size, mtime, inode) -> ``e``; another -> its
        header read again (a corrupt one discarded) and the fresh entry
        when it is still the same candidate (its text as long, ``ok``),
        else None; gone -> None. With the rejections that re-read made."""
        try:
            key = stat_key(os.lstat(e.path))
        except FileNotFoundError:
            self.drop(e.name, None)
            return None, []
        except OSError:
            return e, []  # the load judges it
        if key == e.stat_key:
            return e, []
        before = len(self.unreported)
        self._idx.remove(e.name)
        self.index_file(e.name, e.path, key)
        refused: list[Rejection] = []
        if hold:
            refused, self.unreported = self.unreported[before:], self.unreported[:before]
        row = self._idx.get(e.name)
        fresh = None if row is None else Entry.from_row(self.dir, row)
        if fresh is None or fresh.text_bytes != e.text_bytes or not ok(fresh):
            return None, refused
        return fresh, refused

    def open(self) -> None:
        """Open the store: read the index file and list the directory once
        (names and inode numbers, no ``stat``); only the files that are new
        or were replaced since the index was written are read, from their
        headers, and those whose file disagrees with their record
        (:meth:`_check_records`). Without a usable index file, a full
        rescan rebuilds it."""
        try:
            st = os.stat(self.dir)
        except OSError as e:
            raise StoreError(e.errno, f"cache directory unavailable: {e.strerror}", self.dir) from e
        idx = self._read_index(st)
        if idx is None:
            self.counters["index_rebuilds"] += 1
            self._dirty = True
            self.refresh(force=True)
        else:
            self._idx = idx
            self.counters["scans"] += 1
            changed, others, gone = idx.sync_listing(self.dir)
            now = time.time()
            for name in others:
                if is_temp_name(name):
                    remove_orphaned_temp(os.path.join(self.dir, name), now)
            self._dirty = bool(gone)
            known = idx.keys() if changed else {}
            for name in changed:
                self._recheck(name, known.get(name))
            self._check_records()
            self._dir_mtime = st.st_mtime_ns
        self.persist()

    def _check_records(self) -> None:
        """Every record the index file gave (and the listing did not send
        to a header read) checked against its file (``check_files``: its
        stat key, its fixed header's facts and ABI, the namespace its
        text's preamble names; one open and one or two small reads a
        file): one that disagrees is read again from its header, so a
        forged index attributes no file to another tenant past the open.
        A stale stat key (a hit the index file was not written after) is
        read again silently; any other disagreement is counted
        (``index_mismatches``) and warned of once."""
        bad = self._idx.check_files(self.dir, threads=CHECK_THREADS)
        lied: dict[str, int] = {}
        for name, how in bad:
            if how not in ("changed", "unreadable"):
                lied[how] = lied.get(how, 0) + 1
            self._recheck(name, None)
        if lied:
            n = sum(lied.values())
            self.counters["index_mismatches"] += n
            what = ", ".join(f"{k} {v}" for k, v in sorted(lied.items()))
            log.warning("kv cache index file disagreed with %d files (%s): read again from their headers", n, what)

    def _read_index(self, st: os.stat_result) -> _core.StoreIndex | None:
        """The index file's contents, or None when it is missing, damaged
        (torn, tampered: its checksum), not a regular file, or describes
        another directory (copied or swapped in)."""
        path = os.path.join(self.dir, INDEX_NAME)
        try:
            idx, (dev, ino, _mtime, _scanned) = _core.StoreIndex.load(path)
        except FileNotFoundError:
            return None
        except (CheckpointError, OSError) as e:
            log.warning("kv cache index file unusable (%s): rebuilt from the headers", e)
            return None
        if (dev, ino) != (st.st_dev, st.st_ino):
            log.warning("kv cache index file describes another directory: rebuilt from the headers")
            return None
        return idx

    def _recheck(self, name: str, known: tuple[StatKey, bool] | None) -> None:
        """A name the listing shows as new or replaced: stat it, and index
        it when its stat key is not the one indexed."""
        path = os.path.join(self.dir, name)
        try:
            key = stat_key(os.lstat(path))
        except FileNotFoundError:
            self.forget(name)
            return
        if known is not None and known[0] == key:
            return
        self._idx.remove(name)
        self.index_file(name, path, key)

    def persist(self) -> None:
        """Write the index file when the in-memory index changed since it
        was read or written: only under the directory's lock (held, or free
        now: a lookup never waits for it), never over an entry that is not a
        regular file. A failure costs the next open a rescan, nothing more."""
        path = os.path.join(self.dir, INDEX_NAME)
        if not self._dirty or (len(self._idx) == 0 and not os.path.lexists(path)):
            return
        try:
            before = os.stat(self.dir).st_mtime_ns
            with self._try_lock() as held:
                if not held:
                    return
                st = os.stat(self.dir)
                stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, int(time.time() * 1e9))
                self._idx.save(path, os.path.join(self.dir, INDEX_TMP_NAME), stamp)
                after = os.stat(self.dir).st_mtime_ns
        except (StoreError, CheckpointError, OSError) as e:
            log.warning("kv cache could not write its index file: %s", e)
            return
        self._dirty = False
        if self._dir_mtime == before:
            self._dir_mtime = after  # the lock file and the rename were the only changes

    def index_file(self, name: str, path: str, key: StatKey) -> None:
        """Index one file from its header; a corrupt one is discarded (the
        store's hook) and reported, another format's is kept and reported,
        one that is not a regular file or cannot be read is left out."""
        self._dirty = True
        self.dropped.pop(name, None)
        try:
            self._read_header(self._idx, path)
        except CorruptCheckpointError as e:
            if e.code == NOT_REGULAR:
                log.warning("kv cache ignoring %s: %s", name, e.reason)
                return
            self._discard(path, e, "refresh", key)  # drops the name: kept when it changed since
            self.unreported.append(rejection_of(path, e))
            return
        except CheckpointError as e:
            log.info("kv cache skipped file=%s stage=%s code=%s reason=%s (kept)", name, e.stage, e.code, e.reason)
            self.unreported.append(rejection_of(path, e))
            self._idx.keep(name, key)
            return
        except OSError as e:  # gone meanwhile (a rename in progress), locked, unreadable: retried
            if not isinstance(e, FileNotFoundError):
                log.warning("kv cache cannot read %s: %s (retried)", name, e)
            self.drop(name, key)
            return

    def blocks_of(self, name: str) -> tuple[str, ...] | None:
        """The blocks (hex names) recorded for the version of ``name`` the
        index holds (an index file's block section, or :meth:`set_blocks`);
        None when none are: its file is read then."""
        got = self._idx.blocks_of(name)
        return None if got is None else tuple(got[i : i + 32].hex() for i in range(0, len(got), 32))

    def set_blocks(self, name: str, key: StatKey, blocks: tuple[str, ...]) -> None:
        """Record the blocks ``name``'s file names, read from the version of
        stat key ``key`` (kept only while the index holds that version);
        written with the index file."""
        if self._idx.set_blocks(name, key, bytes.fromhex("".join(blocks))):
            self._dirty = True

    def forget(self, name: str) -> None:
        """Drop ``name`` from the index (the file is gone or going)."""
        if self._idx.remove(name):
            self._dirty = True

    # -- what the index holds, as it stands (no refresh: :meth:`refresh`) ------
    def rows(self) -> list[IndexRow]:
        """Every indexed file's row (``StoreIndex.entries``)."""
        return self._idx.entries()

    def row(self, name: str) -> IndexRow | None:
        """The row of ``name``; None when it is not indexed."""
        return self._idx.get(name)

    def lookup(self, text: bytes, *, min_tokens: int, abi: str | None, ctx: int | None) -> list[IndexRow]:
        """The rows whose text is a prefix of ``text``, longest first, with
        the core's filters (``StoreIndex.lookup``)."""
        return self._idx.lookup(text, min_tokens=min_tokens, abi=abi, ctx=ctx)

    def prefixes(self, prompt: bytes, *, min_tokens: int, ctx: int | None) -> _core.Prefixes:
        """The prefixes of ``prompt`` found one at a time, longest first
        (``StoreIndex.prefixes``: the next is hashed when asked for)."""
        return self._idx.prefixes(prompt, min_tokens=min_tokens, ctx=ctx)

    def longest(
        self, text_bytes: int, namespace: str | None, *, min_tokens: int, ctx: int | None, exclude: list[str]
    ) -> IndexRow | None:
        """The longest row of ``namespace`` no longer than ``text_bytes``
        (``StoreIndex.longest``)."""
        return self._idx.longest(text_bytes, namespace, min_tokens=min_tokens, ctx=ctx, exclude=exclude)

    def set_hit(self, name: str, hits: int, last_used: int, key: StatKey) -> None:
        """Record a hit stamped in ``name``'s file (its new stat key ``key``)."""
        self._idx.set_hit(name, hits, last_used, key)

    def total_bytes(self) -> int:
        return self._idx.total_bytes()

    def namespace_usage(self) -> list[tuple[str | None, int, int]]:
        return self._idx.namespace_usage()

    def abi_usage(self) -> list[tuple[str, int, int, int]]:
        return self._idx.abi_usage()

    def heap_bytes(self) -> int:
        return self._idx.heap_bytes()

    def __len__(self) -> int:
        return len(self._idx)
