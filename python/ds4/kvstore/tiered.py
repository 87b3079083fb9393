"""The directory's side of the shared tier: what the tier
(:class:`.remote.RemoteTier`, the one object the store holds) does in its
store's directory with what Redis holds (:class:`DirectorySide`, the
tier's private collaborator, made when a store attaches the tier).

* A lookup also asks the tier (skipped while it cools down).
* A remote candidate is streamed into a temp file of the directory, the
  whole verification pipeline runs on it (``check_name`` off: the temp
  name; then the text's SHA-1 must be the key's), and the store renames it
  to its model's name (``<sha1>-<abi id>.kv``) under its lock and indexes it (the ``adopt`` hook); the
  ladder then loads it like any local file (:func:`ds4.recovery.load_first`).
* A remote entry rejected for what it is (damaged or forged chunks, a
  manifest whose claims are not its file's header's, the pipeline's or the
  engine's corrupt verdict, a wrong or missing MAC where the store has a
  key) is deleted from the tier (:data:`FORGED`), so that an honest upload
  replaces it; another engine's is kept there, and a failure of the tier
  (a timeout, a lost connection) deletes nothing.
* ``ds4 kv pull`` and ``ds4 kv push`` move files between the two tiers.

This module never names a file or takes the lock itself: the store does
(through the hooks it hands over), as it does for every file it holds. It
knows the store only by those hooks and its block files, and the tier only
by what it asks of it (:class:`Tier`): it imports neither.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import (
    AbiMismatchError,
    BlockError,
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    MacMissingError,
    NameMismatchError,
)
from .blocks import MANIFEST_FLAG, BlockStore
from .counters import Counters
from .entries import Candidates, Entry
from .files import create_temp
from .rejection import RejectionLog, rejection_of
from .remote_layout import HEADER_BYTES, BlockRecord, RemoteEntry

#: the blocks of one download fetched at once (round trips, fsyncs and checks overlapping)
FETCH_THREADS = 4

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from ..session import Session
    from .remote_io import RemoteLookup

log = logging.getLogger("ds4.kvstore")

__all__ = ["Adopt", "DirectorySide", "OpenFor", "Tier"]

#: the store's hooks: open a file for a session against a prompt (without
#: the name check), adopt a verified temp file under its name
OpenFor = Callable[["Session", str, bytes], Checkpoint]
Adopt = Callable[[str, str, Checkpoint], "Entry | None"]


#: a remote entry rejected for what it is, deleted from the tier so that an
#: honest upload replaces it: damaged or forged bytes (chunks, manifest, the
#: pipeline's corrupt verdicts, a wrong MAC), not the prompt's or not its
#: key's text, no MAC where the replicas share a key (a download happens
#: with a key only when the store has one), a file of another ABI than its
#: key's. Another engine's quantization, version or context, or an import
#: the engine refused, is kept (another replica's).
FORGED = (CorruptCheckpointError, CheckpointMismatchError, MacMissingError, AbiMismatchError)


class Tier(Protocol):
    """What the directory's side asks of its tier (:class:`.remote.RemoteTier`):
    its state, its lookups, downloads, deletions, refreshes and uploads,
    and its counters (a hit, the bytes of a download, a rejection)."""

    @property
    def counters(self) -> Counters: ...

    @property
    def state(self) -> str: ...

    def available(self) -> bool: ...

    def lookup(self, prompt: bytes, abi: str, *, min_tokens: int = 1, ctx: int | None = None) -> RemoteLookup: ...

    def fetch_file(self, entry: RemoteEntry, fd: int) -> bool: ...

    def fetch_block(self, name: str, abi: str, fd: int) -> BlockRecord | None: ...

    def delete(self, sha: str, abi: str, entry: RemoteEntry | None = None, text_bytes: int | None = None) -> bool: ...

    def delete_block(self, name: str, abi: str, *, abi_id: str | None = None) -> bool: ...

    def touch(self, entry: RemoteEntry) -> None: ...

    def upload(self, path: str, abi: str, tokens: int, text_bytes: int, blocks: Sequence[str] = ()) -> str: ...


class DirectorySide:
    """One tier's side in its store's directory (the tier's private part:
    the store reaches it through :class:`.remote.RemoteTier`). A rejected
    remote entry counts in its :attr:`counters` (merged into the store's
    stats) and in the tier's."""

    def __init__(
        self,
        tier: Tier,
        blocks: BlockStore,
        *,
        open_for: OpenFor,
        adopt: Adopt,
        locked: Callable[[], AbstractContextManager[None]],
    ):
        self.tier = tier
        self.blocks = blocks
        self.dir = blocks.root
        self.counters = Counters("rejected")
        self._open_for = open_for
        self._adopt = adopt
        self._locked = locked

    def add_candidates(self, found: Candidates, abi: str, *, min_tokens: int, ctx: int | None) -> None:
        """Add the tier's prefixes of ``found.prompt`` to ``found`` (and, in
        the default namespace, the remote entries rejected on the way), and
        the tier's state when it was asked."""
        if self.tier.available():
            got = self.tier.lookup(found.prompt, abi, min_tokens=min_tokens, ctx=ctx)
            found.remote = got.entries
            if found.namespace is None:
                found.rejected.extend(got.rejected)
        found.remote_state = self.tier.state

    def longer(self, found: Candidates) -> list[RemoteEntry]:
        """The remote candidates of ``found`` longer than every local one of
        the session's model (tried first)."""
        if not found.remote:
            return []
        abi = found.remote[0].abi  # the session's: another model's local file of the text does not count
        best = next((e.text_bytes for e in found.entries if e.abi == abi), -1)
        return [r for r in found.remote if r.text_bytes > best]

    def fetch(self, sess: Session, prompt: bytes, r: RemoteEntry, report: RejectionLog | None) -> Entry | None:
        """Download ``r`` for a load into ``sess`` against ``prompt``
        (:meth:`download`, verified as a load verifies): the local entry it
        became, or None. The ladder loads it (:func:`ds4.recovery.load_first`)."""
        return self.download(r, lambda tmp: self._open_for(sess, tmp, prompt), report)

    def loaded(self, r: RemoteEntry, t0: float) -> None:
        """The download of ``r`` (started at ``t0``) loaded: a hit of the tier."""
        self.tier.touch(r)
        self.tier.counters["hits"] += 1
        self.tier.counters["bytes_downloaded"] += r.size
        log.info(
            "kv remote hit tokens=%d key=%s download+load=%.1f ms",
            r.tokens,
            r.name[:12],
            (time.perf_counter() - t0) * 1000,
        )

    def not_loaded(self, r: RemoteEntry, e: Entry) -> None:
        """The download of ``r`` (``e``) did not load: when the load judged
        it corrupt (and the store discarded it), it is deleted from the tier."""
        if not os.path.lexists(e.path):
            self.tier.delete(r.sha, r.abi, r)

    def pull(self, r: RemoteEntry, report: RejectionLog | None, *, auth_key: bytes | None, mmap: bool) -> Entry | None:
        """Download ``r`` on its own (``ds4 kv pull``: :meth:`ds4.kvstore.KVStore.pull`),
        verified whole with the store's key and the tensor checks of a load."""

        def opener(tmp: str) -> Checkpoint:
            ck = open_checkpoint(tmp, check_name=False, auth_key=auth_key, mmap=mmap)
            ck.load_arrays()
            return ck

        return self.download(r, opener, report)

    def push(self, entries: Iterable[Entry]) -> dict[str, int]:
        """Upload ``entries`` now (``ds4 kv push``: :meth:`ds4.kvstore.KVStore.push`);
        counts by outcome."""
        out: dict[str, int] = {}
        for e in entries:
            if e.version == 1:
                res = "skipped_v1"
            else:
                self.blocks.refs_of(e)  # a manifest's blocks go first
                res = self.tier.upload(e.path, e.abi, e.tokens, e.text_bytes, self.blocks.paths_of(e.name))
            out[res] = out.get(res, 0) + 1
        return out

    def download(
        self, r: RemoteEntry, opener: Callable[[str], Checkpoint], report: RejectionLog | None
    ) -> Entry | None:
        """Stream ``r`` into a temp file of the directory, run the whole
        verification pipeline on it (``opener``), and have the store adopt
        it under its name; the index entry of the new file, or None
        (rejected: deleted from the tier when damaged, kept when another
        engine's; or the tier failed; or a local file holds the name)."""
        if os.path.lexists(os.path.join(self.dir, r.name)):  # another engine's, or not a file: kept
            return None
        fd, tmp = create_temp(self.dir, r.name)
        try:
            try:
                ok = self.tier.fetch_file(r, fd)
                if ok:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if not ok:
                return None
            with open(tmp, "rb") as f:
                head = f.read(HEADER_BYTES)
            r.check_header(head)  # the manifest's claims are the file's
            manifest = bool(head[6] & MANIFEST_FLAG)
            # a manifest's blocks go in under the lock, and it is adopted under it: no eviction
            # between takes them for orphans
            with self._locked() if manifest else contextlib.nullcontext():
                if manifest and not self._fetch_blocks(r, tmp):
                    return None
                ck = opener(tmp)
                if ck.text_sha1 != r.sha:
                    raise NameMismatchError("the downloaded text's SHA-1 is not the key's", path=tmp)
                e = self._adopt(tmp, r.name, ck)
                del ck
            return e
        except CheckpointError as err:  # what it is: deleted; another engine's or context's: kept
            self._reject(r, err, report, delete=isinstance(err, FORGED))
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _fetch_blocks(self, r: RemoteEntry, tmp: str) -> bool:
        """Download the blocks the verified manifest ``tmp`` names that the
        directory lacks, each checked as a load checks it. False when the
        tier failed meanwhile. A block missing from the tier, damaged or
        forged is deleted from the tier (what is left of it) and its error
        raised: the manifest is rejected (and deleted: the tier cannot serve
        it; an honest upload of it, which sends its blocks first, replaces it)."""
        missing = self.blocks.missing(tmp)
        try:
            return self._fetch_each(r, missing)
        finally:
            if missing:
                self.blocks.synced()  # the renames durable before the manifest's (its adopt)

    def _fetch_each(self, r: RemoteEntry, missing: list[tuple[bytes, int, int, int]]) -> bool:
        """Each block of ``missing`` downloaded (:meth:`BlockStore.download`)
        on up to :data:`FETCH_THREADS` threads, so that one block's round
        trips, fsync and check overlap another's. After a failure the blocks
        not started are not; those under way finish (the good ones kept as
        orphans until the next eviction, every refused one deleted from the
        tier). The verdict is the first failure in table order: a refusal
        raised, the tier's failure False."""

        def one(rec: tuple[bytes, int, int, int]) -> int:
            return self.blocks.download(rec, r.abi, functools.partial(self.tier.fetch_block, rec[0].hex(), r.abi))

        verdict: CheckpointError | bool = True
        with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ds4-block-fetch") as pool:
            futures = [pool.submit(one, rec) for rec in missing]
            for rec, fut in zip(missing, futures, strict=True):
                if verdict is not True and fut.cancel():
                    continue
                try:
                    got = fut.result()
                except CheckpointError as err:
                    self._refused_block(rec[0].hex(), r.abi, err)
                    verdict = err if verdict is True else verdict
                    continue
                if not got and verdict is True:  # the tier failed first
                    verdict = False
        if isinstance(verdict, CheckpointError):
            raise verdict
        return verdict

    def _refused_block(self, h: str, abi: str, err: CheckpointError) -> None:
        self.tier.delete_block(h, abi)  # a missing one's chunks too (a record expired or evicted alone)
        if not (isinstance(err, BlockError) and err.code == "block_missing"):
            self.tier.counters["blocks_rejected"] += 1
            log.warning("kv remote rejected block %s: %s (deleted from the tier)", h[:12], err)

    def _reject(self, r: RemoteEntry, err: CheckpointError, report: RejectionLog | None, *, delete: bool) -> None:
        self.counters["rejected"] += 1
        self.tier.counters["rejected"] += 1
        if report is not None:
            report.rejected.append(rejection_of(f"remote:{r.name}", err))
        if delete:
            self.tier.delete(r.sha, r.abi, r)
            log.warning("kv remote rejected %s: %s (deleted from the tier)", r.name[:12], err)
        else:
            log.info("kv remote skipped %s: %s (kept)", r.name[:12], err)
