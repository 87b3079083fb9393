"""The shared tier's blocks (:mod:`.remote`; docs/FORMAT.md §7): a block
file stored once in Redis for every checkpoint that names it, under its
own name (:meth:`.remote_layout.KeyLayout.block`), chunked and committed as
a checkpoint is (chunks first, the record last, in one transaction on the
block's node).

An upload stores only the blocks the tier lacks (one pipelined read of
their records first); a download fetches one block's chunks, each checked
against its record's length and digest. What makes a downloaded block
trusted is the block's own check in the directory (its header, name, ABI,
checksum and, with a key, MAC: :meth:`.blocks.BlockStore.adopt`) and the
load's, never the record. A block no remote manifest names is removed by
``ds4 kv gc --remote`` once it is older than an upload takes, or by the
tier's TTL."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import BlockError, RemoteChunkError, RemoteManifestError
from .counters import Counters
from .remote_io import RemoteScan, commit, fetch_chunks, read_chunks
from .remote_layout import BlockRecord, KeyLayout, abi_id, chunk_digest, is_block

__all__ = ["BlockUpload", "delete_block", "fetch_block", "refresh_blocks", "scan_blocks", "upload_blocks"]

#: chunks of a block whose record is not committed expire after this, and
#: ``gc`` leaves a block no manifest names alone for as long
UPLOAD_TTL_S = 600


class BlockUpload:
    """What one checkpoint's blocks upload did: blocks stored and their
    bytes, blocks the tier held already, and whether a block file went
    (evicted locally meanwhile: the checkpoint is not uploaded)."""

    def __init__(self) -> None:
        self.stored = self.present = self.bytes = 0
        self.gone = False

    def count(self, counters: Counters) -> None:
        """Add it to a tier's counters."""
        counters.add("blocks_uploaded", self.stored)  # on the upload thread, beside a download's fetch threads
        counters.add("blocks_present", self.present)
        counters.add("bytes_uploaded", self.bytes)


def upload_blocks(c: Any, keys: KeyLayout, paths: Sequence[str], *, ttl: int, chunk_bytes: int) -> BlockUpload:
    """Store the block files ``paths`` (``<name>.kvb``) the tier lacks;
    refresh the TTL of those it holds. Stops at the first file gone."""
    out = BlockUpload()
    names = [os.path.basename(p)[:64] for p in paths]
    pipe = c.pipeline(transaction=False)
    for h in names:
        pipe.get(keys.block(h))
    held = []
    for path, h, raw in zip(paths, names, pipe.execute() if names else [], strict=True):
        rec = _record(raw, h)
        if rec is not None:
            out.present += 1
            held.append(rec)
            continue
        n = _upload_block(c, keys, h, path, ttl, chunk_bytes)
        if n is None:
            out.gone = True
            return out
        out.stored += n > 0
        out.present += n == 0
        out.bytes += n
    if ttl and held:
        refresh_blocks(c, keys, held, ttl)
    return out


def _record(raw: bytes | None, name: str) -> BlockRecord | None:
    if raw is None:
        return None
    try:
        return BlockRecord.from_bytes(raw, name)
    except RemoteManifestError:
        return None  # damaged: stored again over it


def _upload_block(c: Any, keys: KeyLayout, h: str, path: str, ttl: int, chunk_bytes: int) -> int | None:
    """Store one block file: its bytes; 0 when another uploader holds its
    claim or committed it meanwhile; None when the file is gone or changed."""
    if not c.set(keys.claim(h), str(os.getpid()), nx=True, ex=UPLOAD_TTL_S):
        return 0  # another replica is storing it (a manifest naming it before that commit fails its download)
    try:
        if _record(c.get(keys.block(h)), h) is not None:
            return 0
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        digests: list[str] = []
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for chunk in read_chunks(f, chunk_bytes):
                digests.append(chunk_digest(chunk))
                c.set(keys.chunk(h, len(digests) - 1), chunk, ex=UPLOAD_TTL_S)
        total = sum(min(chunk_bytes, size - i * chunk_bytes) for i in range(len(digests)))
        if total != size or size == 0:  # changed under us: the uncommitted chunks expire
            return None
        rec = BlockRecord(h, size, chunk_bytes, tuple(digests), int(time.time()))
        commit(c, keys, h, len(digests), keys.block(h), rec.to_bytes(), ttl)
        return size
    finally:
        c.delete(keys.claim(h))


def fetch_block(c: Any, keys: KeyLayout, name: str, fd: int) -> BlockRecord:
    """Write block ``name``'s file to ``fd``, each chunk checked against its
    record (BlockError ``block_missing`` when the block is not in the tier;
    :class:`RemoteChunkError` when a chunk is missing, short or altered;
    :class:`RemoteManifestError` when its record does not parse)."""
    raw = c.get(keys.block(name))
    if raw is None:
        err = BlockError(f"block {name[:12]} is not in the tier", code="block_missing")
        err.block = name
        raise err
    rec = BlockRecord.from_bytes(raw, name)
    try:
        fetch_chunks(c, keys, rec, fd)
    except RemoteChunkError as e:  # which block's chunk: several are fetched at once
        raise RemoteChunkError(f"block {name[:12]}: {e.reason}") from e
    return rec


def refresh_blocks(c: Any, keys: KeyLayout, records: Iterable[BlockRecord], ttl: int) -> None:
    """Give blocks (their records and chunks) the TTL ``ttl`` again."""
    pipe = c.pipeline(transaction=False)
    for rec in records:
        pipe.expire(keys.block(rec.name), ttl)
        for i in range(len(rec.digests)):
            pipe.expire(keys.chunk(rec.name, i), ttl)
    pipe.execute()


def records_of(c: Any, keys: KeyLayout, names: Sequence[str]) -> list[BlockRecord]:
    """The readable records of blocks ``names`` (one pipelined read)."""
    pipe = c.pipeline(transaction=False)
    for h in names:
        pipe.get(keys.block(h))
    got = [_record(raw, h) for h, raw in zip(names, pipe.execute() if names else [], strict=True)]
    return [r for r in got if r is not None]


def delete_block(c: Any, keys: KeyLayout, name: str) -> bool:
    """Delete a block's record, then its chunks (read from the record, or
    deleted until a batch finds none when it does not parse)."""
    raw = c.get(keys.block(name))
    gone = bool(c.delete(keys.block(name)))
    rec = _record(raw, name)
    start, n = 0, len(rec.digests) if rec is not None else 64
    while True:
        pipe = c.pipeline(transaction=False)
        for i in range(start, start + n):
            pipe.delete(keys.chunk(name, i))
        found = any(pipe.execute())
        if rec is not None or not found:
            return gone
        start += n


def scan_blocks(c: Any, found: RemoteScan, namespace: str, now: float) -> RemoteScan:
    """``found`` (a namespace's scan) with the namespace's blocks counted
    (``blocks``, ``block_bytes``) and its orphans listed: (ABI id, block,
    bytes) of each block no readable manifest names that was stored more
    than :data:`UPLOAD_TTL_S` ago, or whose record does not parse."""
    named = {(abi_id(e.abi), h) for e in found.entries for h in e.blocks}
    for raw_key in c.scan_iter(match=f"ds4:{{{namespace}/*}}:b", count=1000):
        key = raw_key.decode("ascii", "replace")
        parts = key[len("ds4:{") : -len("}:b")].split("/")
        if len(parts) != 3 or not is_block(parts[2]):
            continue
        raw = c.get(key)
        if raw is None:
            continue
        rec = _record(raw, parts[2])
        found.blocks += 1
        found.block_bytes += rec.size if rec is not None else 0
        if (parts[1], parts[2]) in named or (rec is not None and now - rec.stored_at < UPLOAD_TTL_S):
            continue
        found.orphans.append((parts[1], parts[2], rec.size if rec is not None else 0))
    return found
