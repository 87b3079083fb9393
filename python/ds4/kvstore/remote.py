"""The shared checkpoint tier: checkpoint files kept in Redis (one node, or a
Redis Cluster) so that several ``ds4 serve`` replicas share their prefixes.

The local directory stays the first tier; this module only moves a
checkpoint file's bytes to and from Redis. Nothing read from Redis is
trusted: a download lands in a temp file of the local directory and goes
through the whole verification pipeline (:mod:`ds4.kvstore`) before it is
renamed and loaded like any local checkpoint.

:class:`RemoteTier` is the one object the store (and ``ds4 kv --remote``)
talks to. Its parts are its own: the connection, one client and one breaker
(:class:`.remote_io.Connection`), the background uploads
(:class:`.uploads.UploadQueue`) and, once a store attaches it, its side in
the store's directory (:class:`.tiered.DirectorySide`: downloads verified
and adopted there, pulls and pushes). The key layout, the manifests and
the URLs are :mod:`.remote_layout`'s, the plumbing :mod:`.remote_io`'s,
the shared blocks :mod:`.remote_blocks`'s.

Failures of the tier never fail a request: every operation has bounded
connect and socket timeouts, errors are counted, and after
``fail_threshold`` consecutive failures the tier is skipped for
``cooldown_s`` seconds (:class:`Breaker`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import RemoteManifestError, RemoteTierError
from . import remote_blocks as rb
from . import remote_io as rio
from .counters import Counted, Counters, merged
from .rejection import Rejection, RejectionLog, rejection_of
from .remote_io import (
    Breaker,
    Connection,
    RemoteLookup,
    RemoteScan,
    delete_checkpoint,
    fetch_chunks,
    scan_namespace,
)
from .remote_layout import (
    CHUNK_BYTES,
    DEFAULT_NAMESPACE,
    HEADER_BYTES,
    SCHEMES,
    BlockRecord,
    KeyLayout,
    RemoteEntry,
    chunk_digest,
    is_sha,
    parse_remote_url,
    redact_url,
)
from .uploads import UploadQueue, store_file

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from redis import Redis
    from redis.cluster import RedisCluster

    from ..session import Session
    from .blocks import BlockStore
    from .entries import Candidates, Entry
    from .tiered import Adopt, DirectorySide, OpenFor

log = logging.getLogger("ds4.kvstore")

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_NAMESPACE",
    "HEADER_BYTES",
    "SCHEMES",
    "Breaker",
    "KeyLayout",
    "RemoteEntry",
    "RemoteLookup",
    "RemoteScan",
    "RemoteTier",
    "chunk_digest",
    "parse_remote_url",
    "redact_url",
]

#: index members checked for a vanished checkpoint after each upload
PRUNE_SAMPLE = 16

Client = Any  # redis.Redis or redis.cluster.RedisCluster


class RemoteTier:
    """A Redis (or Redis Cluster) tier for one store, the one object the
    store holds of it. Thread-safe: lookups and downloads run on the
    caller's thread, uploads on one background thread fed by a bounded
    queue (:mod:`.uploads`: a full queue drops its oldest entry).

    Alone (``ds4 kv ls|stats|gc|rm --remote``) it reads and deletes what
    Redis holds; attached to a store (:meth:`attach`, which
    :class:`ds4.kvstore.KVStore` does), it also adds its candidates to the
    store's lookups and downloads, verifies and adopts them into its
    directory (:meth:`fetch`, :meth:`pull`) and uploads it (:meth:`push`)."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int = 0,
        namespace: str = DEFAULT_NAMESPACE,
        connect_timeout_s: float = 1.0,
        op_timeout_s: float = 2.0,
        fail_threshold: int = 3,
        cooldown_s: float = 30.0,
        queue_max: int = 8,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self.cluster, self._url = parse_remote_url(url)
        self.url = redact_url(url)
        if ttl_s < 0:
            raise ValueError("--kv-remote-ttl must be >= 0 (0: no TTL)")
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk size must be in 1..{CHUNK_BYTES}")
        KeyLayout(namespace, "")  # validates the namespace
        self.ttl_s = int(ttl_s)
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.queue_max = max(1, queue_max)
        #: the tier's own counters, in the order :attr:`stats` shows them (its
        #: connection counts ``errors``, its upload queue ``upload_dropped``)
        names = "lookups hits rejected deleted pruned uploads upload_present upload_dropped upload_failed errors"
        names += " blocks_uploaded blocks_present blocks_downloaded blocks_rejected"
        self.counters = Counters(*names.split(), "bytes_uploaded", "bytes_downloaded")
        #: the client and the failure breaker (:class:`.remote_io.Connection`)
        self._conn = Connection(
            self._url,
            self.cluster,
            Breaker(fail_threshold, cooldown_s),
            connect_timeout_s=connect_timeout_s,
            op_timeout_s=op_timeout_s,
        )
        self.breaker = self._conn.breaker
        #: the background uploads (:mod:`.uploads`): each runs this tier's
        #: :meth:`upload` as it is when the upload runs
        self._uploads = UploadQueue(lambda *item: self.upload(*item), self.queue_max)
        #: its side in its store's directory (:meth:`attach`; None: no store)
        self._local: DirectorySide | None = None

    # -- connection ---------------------------------------------------------
    def client(self) -> Redis | RedisCluster:
        """The client, created on first use (a cluster's slot map is read then)."""
        return self._conn.client()

    def available(self) -> bool:
        """Whether the tier may be asked now (not cooling down, not closed)."""
        return self._conn.available()

    # -- the store's directory (:mod:`.tiered`) --------------------------------
    def attach(
        self, blocks: BlockStore, *, open_for: OpenFor, adopt: Adopt, locked: Callable[[], AbstractContextManager[None]]
    ) -> None:
        """Serve the store whose block files ``blocks`` holds (once: a tier
        serves one store). Its hooks: ``open_for`` opens a downloaded temp
        file for a session against a prompt (the whole pipeline, no name
        check), ``adopt`` renames a verified one in and indexes it,
        ``locked`` is the directory's lock."""
        if self._local is not None:
            raise ValueError("this remote tier serves another store already")
        from .tiered import DirectorySide

        self._local = DirectorySide(self, blocks, open_for=open_for, adopt=adopt, locked=locked)

    def _side(self) -> DirectorySide:
        if self._local is None:
            raise ValueError("this remote tier serves no store (KVStore(remote=...) attaches it)")
        return self._local

    @property
    def local(self) -> Counted:
        """Its side in the store's directory, as the store's counters
        (:attr:`ds4.kvstore.KVStore.stats`) merge it: the remote entries
        the directory rejected."""
        return self._side()

    def add_candidates(self, found: Candidates, abi: str, *, min_tokens: int, ctx: int | None) -> None:
        """Add this tier's prefixes of ``found.prompt`` of ``abi`` to ``found``
        (skipped while the tier cools down), and its state when asked."""
        self._side().add_candidates(found, abi, min_tokens=min_tokens, ctx=ctx)

    def longer(self, found: Candidates) -> list[RemoteEntry]:
        """The remote candidates of ``found`` longer than every local one of
        the session's model (the ladder tries them first)."""
        return self._side().longer(found)

    def fetch(self, sess: Session, prompt: bytes, r: RemoteEntry, report: RejectionLog | None) -> Entry | None:
        """Download ``r`` into the store's directory for a load into ``sess``
        against ``prompt``, verified as a load verifies, and adopted: the
        local entry it became, or None (:meth:`.tiered.DirectorySide.download`)."""
        return self._side().fetch(sess, prompt, r, report)

    def loaded(self, r: RemoteEntry, t0: float) -> None:
        """The download of ``r`` (started at ``t0``) loaded: a hit of the tier."""
        self._side().loaded(r, t0)

    def not_loaded(self, r: RemoteEntry, e: Entry) -> None:
        """The download of ``r`` (``e``) did not load: deleted from the tier
        when the load judged it corrupt."""
        self._side().not_loaded(r, e)

    def pull(self, r: RemoteEntry, report: RejectionLog | None, *, auth_key: bytes | None, mmap: bool) -> Entry | None:
        """See :meth:`ds4.kvstore.KVStore.pull`."""
        return self._side().pull(r, report, auth_key=auth_key, mmap=mmap)

    def push(self, entries: Iterable[Entry]) -> dict[str, int]:
        """See :meth:`ds4.kvstore.KVStore.push`."""
        return self._side().push(entries)

    # -- lookup ------------------------------------------------------------
    def lookup(self, prompt: bytes, abi: str, *, min_tokens: int = 1, ctx: int | None = None) -> RemoteLookup:
        """The remote checkpoints of ``abi`` whose text is a prefix of
        ``prompt``, longest first. Index members whose manifest is gone are
        pruned; a manifest that does not parse is deleted (and reported)."""
        keys = KeyLayout(self.namespace, abi)
        self.counters["lookups"] += 1
        found = self._conn.call("lookup", lambda c: self._lookup(c, keys, prompt, min_tokens, ctx))
        return found if found is not None else RemoteLookup([], [])

    def _lookup(self, c: Client, keys: KeyLayout, prompt: bytes, min_tokens: int, ctx: int | None) -> RemoteLookup:
        found, pruned = rio.lookup_prefixes(c, keys, prompt, min_tokens, ctx, functools.partial(self._reject, c, keys))
        self.counters["pruned"] += pruned
        return found

    def _reject(
        self,
        c: Client,
        keys: KeyLayout,
        sha: str,
        err: RemoteManifestError,
        entry: RemoteEntry | None,
        text_bytes: int | None,
        raw: bytes | None,
    ) -> Rejection:
        """A manifest rejected by a lookup: reported, counted, deleted."""
        self.counters["rejected"] += 1
        log.warning("kv remote rejected manifest of %s: %s (deleted)", sha[:12], err.reason)
        self._delete(c, keys, sha, entry, text_bytes, raw)
        return rejection_of(f"remote:{sha}-{keys.abi_id}.kv", err)

    # -- download ----------------------------------------------------------
    def fetch_file(self, entry: RemoteEntry, fd: int) -> bool:
        """Write ``entry``'s bytes to ``fd``, each chunk checked against its
        length and digest on the way (:class:`RemoteChunkError`: missing,
        truncated or altered). False when the tier failed meanwhile."""
        keys = KeyLayout(self.namespace, entry.abi)
        return self._conn.call("download", lambda c: fetch_chunks(c, keys, entry, fd)) is not None

    def fetch_block(self, name: str, abi: str, fd: int) -> BlockRecord | None:
        """Write shared block ``name``'s file to ``fd``, each chunk checked
        on the way (:func:`.remote_blocks.fetch_block`: missing, damaged);
        None when the tier failed meanwhile."""
        keys = KeyLayout(self.namespace, abi)
        rec = self._conn.call("download", lambda c: rb.fetch_block(c, keys, name, fd))
        if rec is not None:
            self.counters.add("blocks_downloaded")  # on the download's fetch threads
            self.counters.add("bytes_downloaded", rec.size)
        return rec

    def delete_block(self, name: str, abi: str, *, abi_id: str | None = None) -> bool:
        """Delete one shared block (record and chunks) of ``abi`` (or of the
        ABI whose id is ``abi_id``): a damaged or forged one, or one no
        manifest names (``ds4 kv gc --remote``)."""
        keys = KeyLayout(self.namespace, abi) if abi_id is None else KeyLayout.of_abi_id(self.namespace, abi_id)
        return bool(self._conn.call("delete", lambda c: rb.delete_block(c, keys, name)))

    def touch(self, entry: RemoteEntry) -> None:
        """Refresh the TTL of a checkpoint that served a request."""
        if not self.ttl_s:
            return
        keys, ttl = KeyLayout(self.namespace, entry.abi), self.ttl_s

        def run(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.expire(keys.manifest(entry.sha), ttl)
            for i in range(len(entry.digests)):
                pipe.expire(keys.chunk(entry.sha, i), ttl)
            pipe.expire(keys.index, ttl)
            pipe.execute()
            if entry.blocks:  # the blocks it names live as long as it does
                rb.refresh_blocks(c, keys, rb.records_of(c, keys, entry.blocks), ttl)

        self._conn.call("touch", run)

    # -- removal -----------------------------------------------------------
    def delete(self, sha: str, abi: str, entry: RemoteEntry | None = None, text_bytes: int | None = None) -> bool:
        """Delete one remote checkpoint (manifest and chunks, then its index
        member). An ``entry`` read from Redis is deleted only while Redis
        still holds the manifest it was read from (:func:`.remote_io.delete_checkpoint`)."""
        keys = KeyLayout(self.namespace, abi)
        n_text = entry.text_bytes if entry is not None else text_bytes
        return bool(self._conn.call("delete", lambda c: self._delete(c, keys, sha, entry, n_text)))

    def _delete(
        self,
        c: Client,
        keys: KeyLayout,
        sha: str,
        entry: RemoteEntry | None,
        text_bytes: int | None,
        raw: bytes | None = None,
    ) -> bool:
        raw = raw if raw is not None else (entry.raw if entry is not None and entry.raw else None)
        if text_bytes is None and entry is not None:
            text_bytes = entry.text_bytes
        gone = delete_checkpoint(c, keys, sha, entry, raw)
        if raw is not None and not gone:
            return False  # replaced (or gone) since it was read: nothing of the new one deleted
        if text_bytes is not None:
            c.zrem(keys.index, keys.member(text_bytes, sha))
        else:
            stale = [m for m in c.zrange(keys.index, 0, -1) if m.decode("ascii", "replace").endswith(":" + sha)]
            if stale:
                c.zrem(keys.index, *stale)
        self.counters["deleted"] += 1
        return gone

    def prune(self, abi: str, sample: int | None = None) -> int:
        """Remove index members whose checkpoint is gone (expired, evicted
        by ``maxmemory-policy``, deleted): all of them, or a random
        ``sample``. Returns how many went."""
        keys = KeyLayout(self.namespace, abi)

        def run(c: Client) -> int:
            if sample is None:
                members = c.zrange(keys.index, 0, -1)
            else:
                members = c.zrandmember(keys.index, sample) or []
            parsed = [(m, m.decode("ascii", "replace").partition(":")[2]) for m in members]
            parsed = [(m, sha) for m, sha in parsed if is_sha(sha)]
            pipe = c.pipeline(transaction=False)
            for _, sha in parsed:
                pipe.exists(keys.manifest(sha))
            gone = [m for (m, _), there in zip(parsed, pipe.execute() if parsed else [], strict=True) if not there]
            n = int(c.zrem(keys.index, *gone)) if gone else 0
            self.counters["pruned"] += n
            return n

        return self._conn.call("prune", run) or 0

    def entries(self, abi: str) -> list[RemoteEntry]:
        """Every readable remote checkpoint of ``abi`` (``ds4 kv ls --remote``)."""
        keys = KeyLayout(self.namespace, abi)

        return self._conn.call("list", lambda c: rio.read_entries(c, keys)) or []

    def scan(self) -> RemoteScan:
        """Every remote checkpoint of this namespace, of every ABI (``ds4 kv
        ls|stats|gc --remote``): the readable ones, the index members whose
        manifest is gone, and those whose manifest does not parse."""
        ns, now = self.namespace, time.time()
        out = self._conn.call("scan", lambda c: rb.scan_blocks(c, scan_namespace(c, ns), ns, now))
        if out is None:
            raise RemoteTierError(0, f"the remote tier {self.url} cannot be read ({self.breaker.last_error})")
        return out

    def delete_member(self, index: str, member: str) -> bool:
        """Delete the checkpoint an index member names (its manifest need
        not parse) and the member."""
        n_text, _, sha = member.partition(":")
        keys = KeyLayout.of_index(self.namespace, index)

        def run(c: Client) -> bool:
            return self._delete(c, keys, sha, None, int(n_text) if n_text.isdigit() else None)

        return bool(self._conn.call("delete", run))

    # -- upload ------------------------------------------------------------
    def enqueue(self, path: str, abi: str, tokens: int, text_bytes: int, blocks: Sequence[str] = ()) -> None:
        """Queue a freshly stored checkpoint (and the paths of the block
        files a manifest names) for upload; returns at once. A full queue
        drops its oldest entry (logged)."""
        if not self._conn.closed:
            self._uploads.put(path, abi, tokens, text_bytes, tuple(blocks))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the upload queue is empty and idle; False on timeout."""
        return self._uploads.flush(timeout)

    def upload(self, path: str, abi: str, tokens: int, text_bytes: int, blocks: Sequence[str] = ()) -> str:
        """Upload one checkpoint file now, after the block files ``blocks``
        (a manifest's) the tier lacks: ``stored``, ``present`` (its
        manifest there describes this file: its TTL refreshed; one that
        describes another file is deleted and this one stored),
        ``claimed`` (another uploader is at it, or committed meanwhile),
        ``gone`` (the file or one of its blocks went first), ``skipped``
        (the tier is down) or ``failed``."""
        sha = os.path.basename(path)[:40]
        keys = KeyLayout(self.namespace, abi)
        if not self.available():
            return "skipped"
        if blocks:  # first: a manifest in the tier names only blocks the tier holds
            up = self._conn.call(
                "upload", lambda c: rb.upload_blocks(c, keys, blocks, ttl=self.ttl_s, chunk_bytes=self.chunk_bytes)
            )
            if up is None:
                self.counters["upload_failed"] += 1
                return "failed"
            up.count(self.counters)
            if up.gone:
                return "gone"
        names = tuple(os.path.basename(b)[:64] for b in blocks)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "gone"
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            facts = (size, tokens, text_bytes)
            out = self._conn.call("upload", lambda c: self._upload(c, keys, sha, f, facts, names))
        if out is None:
            self.counters["upload_failed"] += 1
            return "failed"
        if out == "stored":
            self.counters["uploads"] += 1
            self.counters["bytes_uploaded"] += size
            self.prune(abi, PRUNE_SAMPLE)
        elif out == "present":
            self.counters["upload_present"] += 1
        return out

    def _upload(
        self, c: Client, keys: KeyLayout, sha: str, f: Any, facts: tuple[int, int, int], blocks: tuple[str, ...]
    ) -> str:
        """:func:`.uploads.store_file` through this tier's TTL, chunk size and deletion."""

        def delete(sha: str, entry: RemoteEntry | None, raw: bytes | None) -> bool:
            return self._delete(c, keys, sha, entry, None, raw)

        return store_file(c, keys, sha, f, facts, blocks, ttl=self.ttl_s, chunk_bytes=self.chunk_bytes, delete=delete)

    # -- state -------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """The tier's counters, its connection's and its upload queue's, merged."""
        return merged(self, self._conn, self._uploads)

    def status(self) -> dict[str, object]:
        """What ``/health`` and the ladder report show of the tier."""
        out: dict[str, object] = dict(url=self.url, cluster=self.cluster, namespace=self.namespace, state=self.state)
        out.update(ttl_s=self.ttl_s, queued=len(self._uploads), cooldowns=self.breaker.cooldowns)
        return {**out, "last_error": self.breaker.last_error, **self.stats}

    @property
    def state(self) -> str:
        return "closed" if self._conn.closed else self.breaker.state

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued uploads (up to ``timeout``), stop the uploader
        and close the connections."""
        if self._conn.closed:
            return
        self.flush(timeout)
        self._conn.closed = True
        dropped = self._uploads.stop(timeout)
        if dropped:
            log.warning("kv remote closed with %d uploads not done", dropped)
        self._conn.drop()
