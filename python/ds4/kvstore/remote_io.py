"""The shared tier's plumbing (:mod:`.remote`): what one lookup or scan
found (and the scan of a namespace itself), the failure breaker that skips a failing tier for a while, a
checkpoint's removal, and the download: chunks checked against their
manifest, written by a thread of their own (disk writes overlapping network
reads)."""

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

from .. import _core
from ..errors import RemoteChunkError, RemoteManifestError
from .rejection import Rejection
from .remote_layout import BlockRecord, KeyLayout, RemoteEntry, chunk_digest, is_sha

log = logging.getLogger("ds4.kvstore")

__all__ = [
    "Breaker",
    "FileWriter",
    "RemoteLookup",
    "RemoteScan",
    "commit",
    "delete_checkpoint",
    "fetch_chunks",
    "matching",
    "read_chunks",
    "read_entries",
    "scan_namespace",
]

#: chunks fetched per pipelined round trip (bounds the memory of a download)
FETCH_BATCH_BYTES = 16 * 2**20

#: Deletes KEYS (a manifest, then its chunks: one hash tag, one slot) while
#: the manifest still holds ARGV[1], atomically: a rejection never deletes
#: an entry that replaced the one it judged.
_DELETE_IF_SAME = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""


@dataclasses.dataclass
class RemoteScan:
    """Everything one namespace of the tier holds (:meth:`RemoteTier.scan`):
    readable entries; (index, member) pairs whose manifest is gone;
    (index, member, why) of manifests that do not parse; and the blocks."""

    entries: list[RemoteEntry]
    gone: list[tuple[str, str]]
    damaged: list[tuple[str, str, str]]
    #: shared blocks (:mod:`.remote_blocks`): how many and their bytes, and
    #: (ABI id, block, bytes) of those no manifest names
    blocks: int = 0
    block_bytes: int = 0
    orphans: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)


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


def delete_checkpoint(c: Any, keys: KeyLayout, sha: str, entry: RemoteEntry | None, raw: bytes | None) -> bool:
    """Delete the manifest and chunks of ``sha`` (not its index member:
    another slot). With ``raw`` (the manifest a rejection judged), manifest
    and known chunks go in one atomic script, and only while the manifest
    is still ``raw``: False, nothing deleted, when it changed (an honest
    upload replaced it) or is gone. Without it, manifest first, so that
    nobody sees it while its chunks go. A chunk count that is not known (a
    damaged manifest) is found by deleting until a batch finds none."""
    n = len(entry.digests) if entry is not None else 0
    if raw is not None:
        if not c.eval(_DELETE_IF_SAME, 1 + n, keys.manifest(sha), *(keys.chunk(sha, i) for i in range(n)), raw):
            return False
        gone = True
    else:
        gone = bool(c.delete(keys.manifest(sha)))
        pipe = c.pipeline(transaction=True)
        for i in range(n):
            pipe.delete(keys.chunk(sha, i))
        if n:
            pipe.execute()
    start = n
    while entry is None:
        pipe = c.pipeline(transaction=False)
        for i in range(start, start + 64):
            pipe.delete(keys.chunk(sha, i))
        if not any(pipe.execute()):
            break
        start += 64
    return gone


def matching(c: Any, keys: KeyLayout, prompt: bytes) -> list[tuple[int, str]]:
    """(text bytes, SHA-1) of the index members whose text is a prefix of
    ``prompt``, longest first: the index read once, the prompt hashed once
    at every stored length."""
    members: list[tuple[int, str]] = []
    for raw in c.zrangebyscore(keys.index, 1, len(prompt)):
        text_len, _, sha = raw.decode("ascii", "replace").partition(":")
        if text_len.isdigit() and is_sha(sha):
            members.append((int(text_len), sha))
    lengths = sorted({n for n, _ in members if n <= len(prompt)})
    digests = dict(zip(lengths, _core.sha1_prefixes(prompt, lengths), strict=True)) if lengths else {}
    return sorted(((n, sha) for n, sha in members if digests.get(n) == sha), reverse=True)


def read_entries(c: Any, keys: KeyLayout) -> list[RemoteEntry]:
    """Every readable checkpoint of ``keys``' index."""
    shas = [m.decode("ascii", "replace").partition(":")[2] for m in c.zrange(keys.index, 0, -1)]
    shas = [s for s in shas if is_sha(s)]
    pipe = c.pipeline(transaction=False)
    for s in shas:
        pipe.get(keys.manifest(s))
    out = []
    for s, raw in zip(shas, pipe.execute() if shas else [], strict=True):
        if raw is None:
            continue
        try:
            out.append(RemoteEntry.from_bytes(raw, s, keys.abi))
        except RemoteManifestError:
            continue
    return out


def commit(c: Any, keys: KeyLayout, tag: str, n_chunks: int, key: str, value: bytes, ttl: int, *drop: str) -> None:
    """An upload's commit, in one transaction on ``tag``'s node: its chunks
    made permanent (or given ``ttl``), ``key`` set to ``value`` (a manifest
    or a block's record) and the keys ``drop`` (its claim) deleted: nobody
    sees ``key`` before every chunk is there for good."""
    pipe = c.pipeline(transaction=True)
    for i in range(n_chunks):
        if ttl:
            pipe.expire(keys.chunk(tag, i), ttl)
        else:
            pipe.persist(keys.chunk(tag, i))
    pipe.set(key, value, ex=ttl or None)
    for k in drop:
        pipe.delete(k)
    pipe.execute()


def fetch_chunks(c: Any, keys: KeyLayout, entry: RemoteEntry | BlockRecord, fd: int) -> bool:
    """Pipelined batches of ``entry``'s chunks, each checked against its
    length and digest (:class:`RemoteChunkError`: missing, truncated or
    altered), handed to a writer thread: the file is written while the next
    batch is on the wire. What a download holds is bounded by the manifest
    (a chunk at most ``CHUNK_BYTES``: one batch of
    :data:`FETCH_BATCH_BYTES` on the wire, a few chunks queued), whatever
    the chunk keys hold."""
    n = len(entry.digests)
    batch = max(1, FETCH_BATCH_BYTES // entry.chunk_bytes)
    # one round trip holds it all (a shared block): nothing to overlap, written here
    writer: FileWriter | _Direct = FileWriter(fd) if n > batch else _Direct(fd)
    try:
        for start in range(0, n, batch):
            pipe = c.pipeline(transaction=False)
            for i in range(start, min(n, start + batch)):
                # at most one byte more than the manifest says: a chunk key
                # holding more costs no more memory than its manifest's size
                pipe.getrange(keys.chunk(entry.sha, i), 0, entry.chunk_len(i))
            for i, raw in enumerate(pipe.execute(), start):
                if not raw:  # a missing key reads as empty (no chunk is)
                    raise RemoteChunkError(f"chunk {i} of {n} is missing")
                if len(raw) != entry.chunk_len(i):
                    raise RemoteChunkError(f"chunk {i} holds {len(raw)} bytes, its manifest says {entry.chunk_len(i)}")
                if chunk_digest(raw) != entry.digests[i]:
                    raise RemoteChunkError(f"chunk {i} does not match its manifest's digest")
                writer.put(raw)
    finally:
        writer.finish()
    return True


def read_chunks(f: Any, size: int) -> Iterator[bytes]:
    while True:
        buf = f.read(size)
        if not buf:
            return
        yield buf


class _Direct:
    """:class:`FileWriter`'s calls, writing on the caller's thread."""

    def __init__(self, fd: int):
        self.fd = fd

    def put(self, data: bytes) -> None:
        write_all(self.fd, data)

    def finish(self) -> None:
        pass


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
