"""The shared tier's plumbing (:mod:`.remote`): what one lookup or scan
found (and the scan of a namespace itself), the failure breaker that skips a failing tier for a while, and the
download's writer thread (disk writes overlapping network reads)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import RemoteManifestError
from .rejection import Rejection
from .remote_layout import KeyLayout, RemoteEntry, is_sha

log = logging.getLogger("ds4.kvstore")

__all__ = ["Breaker", "FileWriter", "RemoteLookup", "RemoteScan", "read_chunks", "scan_namespace"]


@dataclasses.dataclass
class RemoteScan:
    """Everything one namespace of the tier holds (:meth:`RemoteTier.scan`):
    readable entries; (index, member) pairs whose manifest is gone; and
    (index, member, why) of manifests that do not parse."""

    entries: list[RemoteEntry]
    gone: list[tuple[str, str]]
    damaged: list[tuple[str, str, str]]


@dataclasses.dataclass
class RemoteLookup:
    """What one remote lookup found: matching entries (longest first) and
    the remote entries rejected on the way (deleted from Redis)."""

    entries: list[RemoteEntry]
    rejected: list[Rejection]


class Breaker:
    """Consecutive failures of the tier; after ``threshold`` of them the
    tier is skipped for ``cooldown_s`` seconds, then tried again."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.threshold = max(1, threshold)
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.failures = 0
        self.open_until = 0.0
        self.last_error = ""
        self.cooldowns = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    def success(self) -> None:
        with self._lock:
            self.failures = 0

    def failure(self, err: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = type(err).__name__
            if self.failures >= self.threshold:
                self.open_until = self.clock() + self.cooldown_s
                self.failures = 0
                self.cooldowns += 1
                log.warning(
                    "kv remote tier unavailable after %d failures (%s): served locally for %.0f s",
                    self.threshold,
                    self.last_error,
                    self.cooldown_s,
                )

    @property
    def state(self) -> str:
        """``up``, ``degraded`` (failing, not yet cooling down) or ``cooldown``."""
        if self.clock() < self.open_until:
            return "cooldown"
        return "degraded" if self.failures else "up"


def scan_namespace(c: Any, namespace: str) -> RemoteScan:
    """What one namespace of the tier holds, read through the client ``c``
    (:meth:`.remote.RemoteTier.scan`): every index of every ABI, each
    member's manifest in one pipelined round trip."""
    found = RemoteScan([], [], [])
    pat = KeyLayout.index_pattern(namespace)
    for raw_key in sorted(set(c.scan_iter(match=pat, count=1000))):
        index = raw_key.decode("ascii", "replace")
        keys = KeyLayout.of_index(namespace, index)
        members = [m.decode("ascii", "replace") for m in c.zrange(index, 0, -1)]
        shas = [(m, m.partition(":")[2]) for m in members]
        shas = [(m, s) for m, s in shas if is_sha(s)]
        pipe = c.pipeline(transaction=False)
        for _, s in shas:
            pipe.get(keys.manifest(s))
        for (m, s), raw in zip(shas, pipe.execute() if shas else [], strict=True):
            if raw is None:
                found.gone.append((index, m))
                continue
            try:
                abi = json.loads(raw).get("abi")
                if not isinstance(abi, str) or KeyLayout(namespace, abi).abi_id != keys.abi_id:
                    raise RemoteManifestError("manifest's ABI is not its index's")
                found.entries.append(RemoteEntry.from_bytes(raw, s, abi))
            except (RemoteManifestError, ValueError, AttributeError) as e:
                found.damaged.append((index, m, str(e)))
    return found


def read_chunks(f: Any, size: int) -> Iterator[bytes]:
    while True:
        buf = f.read(size)
        if not buf:
            return
        yield buf


class FileWriter:
    """Writes chunks to ``fd`` on a thread of its own (a bounded queue), so
    that a download's disk writes overlap its network reads. ``finish``
    waits for the last write and raises the writer's error, if any."""

    def __init__(self, fd: int, depth: int = 4):
        self.fd = fd
        self.q: queue.Queue[bytes | None] = queue.Queue(depth)
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, name="ds4-kv-download", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            data = self.q.get()
            if data is None:
                return
            if self.error is None:
                try:
                    write_all(self.fd, data)
                except OSError as e:
                    self.error = e

    def put(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(data)

    def finish(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
