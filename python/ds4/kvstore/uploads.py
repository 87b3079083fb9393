"""The shared tier's uploads (:class:`.remote.RemoteTier`): a bounded FIFO
of checkpoint files to upload and the one thread that uploads them, so that
sharing a checkpoint never adds to a request's latency; and what one
checkpoint file's upload writes in Redis (:func:`store_file`: a claim, its
chunks, then its manifest in one commit). When an upload runs, its blocks
first, and what it counts are the tier's."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from .counters import Counters
from .remote_blocks import UPLOAD_TTL_S
from .remote_io import commit, read_chunks
from .remote_layout import KeyLayout, RemoteEntry, chunk_digest

log = logging.getLogger("ds4.kvstore")

__all__ = ["UploadQueue", "store_file"]

#: (path, payload ABI, tokens, text bytes, its block files' paths) of one checkpoint file
Upload = tuple[str, str, int, int, tuple[str, ...]]


class UploadQueue:
    """A bounded FIFO (a full queue drops its oldest entry: logged and
    counted ``upload_dropped``) and one daemon thread, started on the first
    entry, that calls ``upload`` on each (an exception is counted
    ``upload_failed`` and logged), in its own :attr:`counters` (merged into
    the tier's stats)."""

    def __init__(self, upload: Callable[[str, str, int, int, tuple[str, ...]], object], max_len: int):
        self._upload = upload
        self.counters = Counters("upload_dropped", "upload_failed")
        self.max_len = max(1, max_len)
        self._queue: collections.deque[Upload] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, path: str, abi: str, tokens: int, text_bytes: int, blocks: tuple[str, ...] = ()) -> None:
        """Queue one file; returns at once (nothing once stopped)."""
        with self._cv:
            if self._stopped:
                return
            if len(self._queue) >= self.max_len:
                old = self._queue.popleft()
                self.counters["upload_dropped"] += 1
                log.warning("kv remote upload queue full (%d): dropped %s", self.max_len, os.path.basename(old[0]))
            self._queue.append((path, abi, tokens, text_bytes, blocks))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ds4-kv-upload", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                self._upload(*item)
            except Exception:
                self.counters["upload_failed"] += 1
                log.exception("kv remote upload of %s failed", os.path.basename(item[0]))
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the queue is empty and idle; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> int:
        """Take no more entries, drop the queued ones and wait (up to
        ``timeout``) for the one being uploaded; how many were dropped."""
        with self._cv:
            self._stopped = True
            dropped = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        return dropped


#: the tier's deletion of one checkpoint of a key layout (:meth:`.remote.RemoteTier.delete`'s
#: work, counted): (its SHA-1, the entry or None, the manifest bytes judged or None) -> deleted
Delete = Callable[[str, RemoteEntry | None, bytes | None], bool]


def store_file(
    c: Any,
    keys: KeyLayout,
    sha: str,
    f: BinaryIO,
    facts: tuple[int, int, int],
    blocks: tuple[str, ...],
    *,
    ttl: int,
    chunk_bytes: int,
    delete: Delete,
) -> str:
    """Store the checkpoint file ``f`` of key ``sha`` (``facts``: its size,
    tokens and text bytes; ``blocks``: the block names its manifest lists)
    through the client ``c``: ``present`` (a manifest there describes this
    file: its TTL refreshed; one that describes another file is deleted and
    this one stored), ``claimed`` (another uploader holds the claim, or
    committed meanwhile), ``gone`` (the file changed under us: nothing left
    behind) or ``stored``."""
    size, tokens, text_bytes = facts
    there = c.get(keys.manifest(sha))
    if there is not None:
        if RemoteEntry.describes(there, sha, keys.abi, facts):
            if ttl:
                c.expire(keys.manifest(sha), ttl)
            return "present"
        log.warning("kv remote replaces %s: its manifest is not this checkpoint's", sha[:12])
        if not delete(sha, None, there):
            return "claimed"  # another upload replaced it meanwhile
    if not c.set(keys.claim(sha), str(os.getpid()), nx=True, ex=UPLOAD_TTL_S):
        return "claimed"
    if c.exists(keys.manifest(sha)):  # committed by another upload since the read
        c.delete(keys.claim(sha))
        return "claimed"
    digests: list[str] = []
    total = 0
    for chunk in read_chunks(f, chunk_bytes):
        digests.append(chunk_digest(chunk))
        c.set(keys.chunk(sha, len(digests) - 1), chunk, ex=UPLOAD_TTL_S)
        total += len(chunk)
    entry = RemoteEntry(sha, keys.abi, tokens, text_bytes, total, chunk_bytes, tuple(digests), blocks)
    if total != size or total == 0:  # the file changed under us: leave nothing behind
        delete(sha, entry, None)
        return "gone"
    # The commit, in one transaction on the tag's node: chunks made
    # permanent (or given the TTL), then the manifest; nobody sees a
    # manifest whose chunks are not all there.
    commit(c, keys, sha, len(digests), keys.manifest(sha), entry.to_bytes(), ttl, keys.claim(sha))
    c.zadd(keys.index, {keys.member(text_bytes, sha): text_bytes})
    if ttl:
        c.expire(keys.index, ttl)
    return "stored"
