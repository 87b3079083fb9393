"""The shared tier's plumbing (:mod:`.remote`): what one lookup or scan
found (and the scan of a namespace itself), the tier's connection (its
client and the failure breaker that skips a failing tier for a while), a
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
from typing import TYPE_CHECKING, Any, TypeVar

from .. import _core
from ..errors import RemoteChunkError, RemoteManifestError
from .counters import Counters
from .rejection import Rejection
from .remote_layout import HEADER_BYTES, BlockRecord, KeyLayout, RemoteEntry, chunk_digest, is_sha

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

log = logging.getLogger("ds4.kvstore")

__all__ = [
    "Breaker",
    "Connection",
    "FileWriter",
    "RemoteLookup",
    "RemoteScan",
    "commit",
    "delete_checkpoint",
    "fetch_chunks",
    "lookup_prefixes",
    "matching",
    "read_chunks",
    "read_entries",
    "scan_namespace",
]

#: chunks fetched per pipelined round trip (bounds the memory of a download)
FETCH_BATCH_BYTES = 16 * 2**20

T = TypeVar("T")

#: a lookup's verdict on a manifest it cannot use (:func:`lookup_prefixes`):
#: (its SHA-1, why, the entry when it parsed, its index member's text length,
#: the manifest's bytes) -> the rejection reported (the tier counts and deletes it)
Reject = Callable[[str, RemoteManifestError, RemoteEntry | None, int | None, bytes | None], Rejection]

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


class Connection:
    """One tier's Redis client (redis.Redis or redis.cluster.RedisCluster,
    made on first use: a cluster's slot map is read then; bounded connect
    and socket timeouts, no retries) and its :class:`Breaker`. Every
    operation of the tier runs through :meth:`call`; a failure is counted
    (``errors``, in its own :attr:`counters`, merged into the tier's stats),
    logged and fed to the breaker. Nothing runs while the breaker is open or
    once :attr:`closed`."""

    def __init__(self, url: str, cluster: bool, breaker: Breaker, *, connect_timeout_s: float, op_timeout_s: float):
        self.url, self.cluster, self.breaker = url, cluster, breaker
        self.connect_timeout_s, self.op_timeout_s = connect_timeout_s, op_timeout_s
        self.counters = Counters("errors")
        #: set when its tier closes: no operation runs from then on
        self.closed = False
        self._client: Redis | RedisCluster | None = None
        self._lock = threading.Lock()

    def client(self) -> Redis | RedisCluster:
        """The client, created on first use."""
        with self._lock:
            if self._client is None:
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                kw: dict[str, Any] = {
                    "socket_connect_timeout": self.connect_timeout_s,
                    "socket_timeout": self.op_timeout_s,
                    "retry": Retry(NoBackoff(), 0),
                }
                if self.cluster:
                    from redis.cluster import RedisCluster

                    self._client = RedisCluster.from_url(self.url, **kw)
                else:
                    from redis import Redis

                    self._client = Redis.from_url(self.url, **kw)
            return self._client

    def drop(self) -> None:
        """Close the client (the next :meth:`client` makes a new one)."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception as e:  # closing a broken client must not fail a request
                log.debug("kv remote close failed: %s", e)

    def available(self) -> bool:
        return not self.closed and self.breaker.allow()

    def call(self, what: str, fn: Callable[[Any], T]) -> T | None:
        """Run ``fn(client)``; a Redis or socket failure is logged, counted
        (the breaker) and returns None. Errors of ds4's own (a corrupt
        chunk) pass through."""
        from redis.exceptions import ClusterError, RedisClusterException, RedisError, ResponseError

        if not self.available():
            return None
        try:
            out = fn(self.client())
        except ResponseError as e:
            if isinstance(e, ClusterError):  # the cluster is down: an outage
                self._failed(what, e)
                return None
            # the server answered (out of memory, a refused command): not an outage
            self.counters.add("errors")
            log.warning("kv remote %s refused: %s", what, e)
            return None
        except (RedisError, RedisClusterException, OSError) as e:
            self._failed(what, e)
            return None
        self.breaker.success()
        return out

    def _failed(self, what: str, e: BaseException) -> None:
        """Count a failure of the tier (the breaker) and log it."""
        self.counters.add("errors")
        self.breaker.failure(e)
        log.warning("kv remote %s failed: %s: %s", what, type(e).__name__, e)
        if self.cluster:
            self.drop()  # a cluster client re-reads the slot map when rebuilt


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


def lookup_prefixes(
    c: Any, keys: KeyLayout, prompt: bytes, min_tokens: int, ctx: int | None, reject: Reject
) -> tuple[RemoteLookup, int]:
    """The checkpoints of ``keys``' index whose text is a prefix of
    ``prompt`` (:func:`matching`) with at least ``min_tokens`` and fewer
    than ``ctx`` tokens, longest first, their manifests read in one
    pipelined round trip; and how many index members whose manifest is
    gone were pruned. A manifest that does not parse, or whose text length
    is not its index member's, goes to ``reject``; so does one skipped for
    its size whose claims are not its file's header's (another replica's
    sizes, or a manifest lying to stay unused: its header decides)."""
    hits = matching(c, keys, prompt)
    if not hits:
        return RemoteLookup([], []), 0
    pipe = c.pipeline(transaction=False)
    for _, sha in hits:
        pipe.get(keys.manifest(sha))
    raws = pipe.execute()
    out: list[RemoteEntry] = []
    skipped: list[RemoteEntry] = []
    rejected: list[Rejection] = []
    gone = []
    for (n, sha), raw in zip(hits, raws, strict=True):
        if raw is None:
            gone.append(keys.member(n, sha))
            continue
        try:
            e = RemoteEntry.from_bytes(raw, sha, keys.abi)
            if e.text_bytes != n:
                raise RemoteManifestError("manifest's text length differs from the index")
        except RemoteManifestError as err:
            rejected.append(reject(sha, err, None, n, raw))
            continue
        usable = e.tokens >= min_tokens and (ctx is None or e.tokens < ctx)
        (out if usable else skipped).append(e)
    if skipped:
        pipe = c.pipeline(transaction=False)
        for e in skipped:
            pipe.getrange(keys.chunk(e.sha, 0), 0, HEADER_BYTES - 1)
        for e, head in zip(skipped, pipe.execute(), strict=True):
            try:
                e.check_header(head)
            except RemoteManifestError as err:
                rejected.append(reject(e.sha, err, e, None, None))
    pruned = int(c.zrem(keys.index, *gone)) if gone else 0
    return RemoteLookup(out, rejected), pruned


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
