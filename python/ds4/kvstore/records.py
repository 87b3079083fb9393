"""Small JSON records kept beside the checkpoints (the server's stored
Responses, so that ``previous_response_id`` still resolves after a
restart), in the ``records/`` subdirectory of the cache directory.

* Names are ``<kind>-<key>.json`` with ``kind`` and ``key`` of letters,
  digits, ``_`` and ``-`` only (a key can never name a path elsewhere);
  entries that are not regular files are ignored, never read or removed.
* Writes are atomic (a temp file in the same directory, fsync, rename,
  fsync of the directory), mode 0600, under the store's lock.
* Nothing is reached through a link: ``records/`` is opened with
  ``O_NOFOLLOW`` and every name in it under that descriptor (``openat``,
  ``renameat``, ``unlinkat``), so a ``records`` symlink (or a link swapped
  in later) never leads a write, a read or the trim outside the cache
  directory. Such a ``records`` is a :class:`ds4.errors.StoreError`
  (``ELOOP``/``ENOTDIR``) for a write or a delete and a warning; a read
  finds nothing and the records count no bytes.
* Bounded: the records together stay within ``max_bytes`` (the oldest
  removed first), and :class:`ds4.kvstore.KVStore` counts their bytes in
  its budget (its checkpoints are evicted to make room for them).
* A record that cannot be read or parsed, or that the caller's ``check``
  rejects (its own format's validation), is reported as missing (and
  removed): it is a cache, the client can replay its history.
* :meth:`RecordStore.delete` removes one record (a regular file only),
  under the lock; a reader that opened it before still reads it whole, a
  reader after finds nothing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator
from typing import Any

from ..durable import write_durably
from ..errors import StoreError

log = logging.getLogger("ds4.kvstore")

__all__ = ["RECORDS_DIR", "RecordStore"]

RECORDS_DIR = "records"
_PART = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}-[A-Za-z0-9_-]{1,128}\.json$")


class RecordStore:
    """``<cache dir>/records/``: put, get and the bytes they take."""

    def __init__(
        self, cache_dir: str, max_bytes: int, lock: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    ):
        self.dir = os.path.join(cache_dir, RECORDS_DIR)
        self.max_bytes = int(max_bytes)
        self._lock = lock
        self._sizes: dict[str, tuple[int, int]] | None = None  # name -> (size, mtime_ns)
        self._warned = False

    @contextlib.contextmanager
    def _opened(self, create: bool = False) -> Iterator[int | None]:
        """A descriptor of ``records/`` opened without following a link
        (None when it does not exist and ``create`` is false). A link or a
        non-directory there raises :class:`StoreError`, logged once."""
        if create:
            os.makedirs(os.path.dirname(self.dir), mode=0o700, exist_ok=True)  # the cache directory (a store's exists)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.dir, 0o700)
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            fd = None
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:
                link = stat.S_ISLNK(os.lstat(self.dir).st_mode)
            except OSError:
                link = e.errno == errno.ELOOP
            what = "a symlink" if link else "not a directory"
            if not self._warned:
                self._warned = True
                log.warning("%s is %s: no record is read or written through it (remove it)", self.dir, what)
            code = errno.ELOOP if link else errno.ENOTDIR
            raise StoreError(code, f"the records directory is {what} (remove it)", self.dir) from e
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return self._lock() if self._lock is not None else contextlib.nullcontext()

    @staticmethod
    def _name(kind: str, key: str) -> str:
        if not _PART.match(kind) or not _PART.match(key):
            raise ValueError(f"a record is named by [A-Za-z0-9_-] only: {kind!r}, {key!r}")
        return f"{kind}-{key}.json"

    def _scan(self, dfd: int | None) -> dict[str, tuple[int, int]]:
        if self._sizes is None:
            sizes = {}
            if dfd is not None:
                with os.scandir(dfd) as it:
                    for de in it:
                        if _NAME.match(de.name):
                            st = de.stat(follow_symlinks=False)
                            if stat.S_ISREG(st.st_mode):
                                sizes[de.name] = (st.st_size, st.st_mtime_ns)
            self._sizes = sizes
        return self._sizes

    def total_bytes(self) -> int:
        """The bytes the records take (0 when ``records/`` is a link)."""
        if self._sizes is None:
            try:
                with self._opened() as dfd:
                    self._scan(dfd)
            except StoreError:
                return 0
        return sum(s for s, _ in (self._sizes or {}).values())

    def put(self, kind: str, key: str, data: Any) -> bool:
        """Store ``data`` (JSON) as the record ``kind``/``key``; False when
        it alone exceeds ``max_bytes`` (nothing is written)."""
        name = self._name(kind, key)
        blob = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        if len(blob) > self.max_bytes:
            log.info("record %s not stored: %d bytes > the records' bound %d", name, len(blob), self.max_bytes)
            return False
        with self._locked(), self._opened(create=True) as dfd:
            assert dfd is not None  # created
            sizes = self._scan(dfd)
            write_durably(name, blob, dir_fd=dfd)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            sizes[name] = (st.st_size, st.st_mtime_ns)
            self._trim(dfd, sizes, keep=name)
            os.fsync(dfd)
        return True

    def _trim(self, dfd: int, sizes: dict[str, tuple[int, int]], keep: str) -> None:
        """Remove the oldest records until the rest fit ``max_bytes``."""
        total = sum(s for s, _ in sizes.values())
        for name in sorted(sizes, key=lambda n: sizes[n][1]):
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=dfd)
            total -= sizes.pop(name)[0]
            log.info("record %s evicted (records over %d bytes)", name, self.max_bytes)

    def get(self, kind: str, key: str, check: Callable[[Any], object] | None = None) -> Any | None:
        """The record's data, or None when there is none (or it is
        unreadable, or ``check(data)`` raises ValueError, TypeError or
        KeyError: such a record is removed, and the error logged)."""
        name = self._name(kind, key)
        try:
            with self._opened() as dfd:
                fd = None if dfd is None else os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:  # none, or records/ is a link (StoreError, logged)
            return None
        if fd is None:
            return None
        ident = None
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    return None
                ident = (st.st_dev, st.st_ino)
                raw = f.read(self.max_bytes + 1)
            data = json.loads(raw)
            if check is not None:
                check(data)
            return data
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:
            log.warning("record %s unreadable (%s: %s): removed", name, type(e).__name__, e)
            with contextlib.suppress(OSError):
                self._remove_version(name, ident)
            return None

    def _remove_version(self, name: str, ident: tuple[int, int] | None) -> bool:
        """Remove ``name`` (a regular file) under the lock; with ``ident``
        (device, inode) only that version of it (not a record written
        since under the same name)."""
        with self._locked(), self._opened() as dfd:
            if dfd is None:
                return False
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or (ident is not None and ident != (st.st_dev, st.st_ino)):
                    return False
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return False
            if self._sizes is not None:
                self._sizes.pop(name, None)
            os.fsync(dfd)
        return True

    def delete(self, kind: str, key: str) -> bool:
        """Remove the record ``kind``/``key``; False when there was none."""
        return self._remove_version(self._name(kind, key), None)
