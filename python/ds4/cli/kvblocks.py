"""``ds4 kv`` on a store with shared blocks (docs/DESIGN.md, "Blocks";
docs/FORMAT.md §7): which files are manifests, what their block tables
name and how much of it another manifest names too, a manifest's blocks
verified as a load verifies them (``_core.open_blocks``), every block file
of ``blocks/`` on its own (``_core.verify_block``), the blocks no manifest
names (orphans), and the totals of ``kv stats``. Nothing here changes a
file: ``kv gc`` removes orphans through the store's
:class:`~ds4.kvstore.blocks.BlockStore`, under its lock.

A manifest's table is read only when its header's flags say it is one
(its payload is read for it; with ``--verify`` it was verified first).
Which blocks are orphans follows the store's rule: a file whose table
cannot be decoded names none; while a file cannot be read at all (an
``OSError``), no block is called an orphan."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable

from .. import _core
from ..checkpoint import open_checkpoint
from ..errors import BlockError, CheckpointError
from ..kvstore import Entry, KVStore, scan_dir
from ..kvstore.blocks import BLOCKS_DIR, MANIFEST_FLAG, TABLE_TENSOR, BlockStore, list_blocks
from .kvinfo import READABLE, Info
from .term import human_bytes

__all__ = ["MANIFEST_KEYS", "Manifests", "annotate", "block_files", "blocks_cell", "manifest_line", "plan_evict"]

Record = tuple[bytes, int, int, int]
Table = tuple[int, list[Record]]

#: what ``kv ls``/``show``/``verify`` add to a manifest's facts
MANIFEST_KEYS = ("blocks", "block_tokens", "block_bytes", "shared_blocks", "shared_block_bytes", "missing_blocks")
#: about the most payload bytes of a manifest's blocks one ``open_blocks`` call reads (and holds)
CHUNK_BYTES = 64 << 20
_SUFFIX = ".kvb"


def block_files(d: str) -> dict[str, int]:
    """The block files in ``d``'s ``blocks/`` as the store lists them
    (:func:`~ds4.kvstore.blocks.list_blocks`): hex name -> bytes. Nothing
    is removed (the store's listing also drops old temp files)."""
    return list_blocks(os.path.join(d, BLOCKS_DIR))[0]


def _is_manifest(info: Info) -> bool:
    return info.get("status") in READABLE and info.get("version", 0) >= 2 and bool(info["flags"] & MANIFEST_FLAG)


def _read(path: str, full: bool) -> tuple[Table, BlockError | None]:
    """A manifest's block table; with ``full`` (its payload verified
    already) also whether it names the blocks of its own tokens, as a load
    checks it (a ``block_table`` error when not)."""
    ck = open_checkpoint(path, verify_checksum=False)
    try:
        try:
            buf = ck.tensor_buffer(TABLE_TENSOR)
        except KeyError:
            raise BlockError("a manifest without its block table", code="block_table", path=path) from None
        block, recs = _core.read_block_table(buf)
        bad = None
        if full and [r[0] for r in recs] != BlockStore.names_of(ck, block):
            bad = BlockError("the block table does not name this state's blocks", code="block_table", path=path)
        return (block, recs), bad
    finally:
        ck.release()


def _failed(info: Info, e: CheckpointError | OSError) -> None:
    """``info`` refused for ``e`` (a block of it, or its table)."""
    if isinstance(e, CheckpointError):
        err = {"stage": e.stage, "code": e.code, "reason": e.reason}
        block = getattr(e, "block", "")  # a BlockError's hex name
        if block:
            err["block"] = block
        info.update(status=e.kind, error=err)
    else:
        info.update(status="error", error={"stage": "block", "code": "os_error", "reason": str(e)})


class Manifests:
    """The block files of directory ``d`` and the tables of its manifests
    (added with :meth:`add_info` or :meth:`add_path`): how many manifests
    name each block."""

    def __init__(self, d: str):
        self.dir, self.blocks_dir = d, os.path.join(d, BLOCKS_DIR)
        self.files = block_files(d)
        self.tables: dict[str, Table] = {}
        self.errors: dict[str, CheckpointError] = {}  # a table that did not decode or name its tokens' blocks
        self.unknown = False  # a file could not be read: it may name any block
        self.users: collections.Counter[str] = collections.Counter()

    def add(self, name: str, path: str, full: bool = False) -> None:
        try:
            table, bad = _read(path, full)
        except CheckpointError as e:
            self.errors[name] = e
            return
        except OSError:
            self.unknown = True
            return
        self.tables[name] = table
        self.users.update({r[0].hex() for r in table[1]})
        if bad is not None:
            self.errors[name] = bad

    def add_info(self, info: Info, full: bool) -> None:
        if info.get("status") == "error":
            self.unknown = True
        elif _is_manifest(info):
            self.add(info["name"], info["path"], full and info["status"] == "ok")

    def add_path(self, path: str) -> None:
        """A file of the directory not inspected: its header says whether
        it is a manifest."""
        try:
            ck = open_checkpoint(path, load_payload=False)
        except CheckpointError:
            return
        except OSError:
            self.unknown = True
            return
        if ck.version >= 2 and ck.flags & MANIFEST_FLAG:
            self.add(os.path.basename(path), path)

    def facts(self, info: Info) -> None:
        """A readable file's ``manifest`` (whether it is one) and a
        manifest's :data:`MANIFEST_KEYS`: its blocks, their tokens each, their
        payload bytes, those another manifest of the directory names too
        (count and bytes), those with no file in ``blocks/``."""
        if info.get("status") not in READABLE:
            return
        name = info["name"]
        info["manifest"] = _is_manifest(info)
        e = self.errors.get(name)
        if e is not None:
            info["block_table_error"] = {"stage": e.stage, "code": e.code, "reason": e.reason}
        t = self.tables.get(name)
        if t is None:
            return
        block, recs = t
        shared = [r for r in recs if self.users[r[0].hex()] > 1]
        info.update(
            blocks=len(recs),
            block_tokens=block,
            block_bytes=sum(r[2] for r in recs),
            shared_blocks=len(shared),
            shared_block_bytes=sum(r[2] for r in shared),
            missing_blocks=sum(1 for r in recs if r[0].hex() not in self.files),
        )

    def verify(self, info: Info, seen: dict[tuple[Record, str], BlockError | None]) -> None:
        """A manifest that passed the pipeline, checked as a load checks it
        before the session: its table against its tokens, then every block
        it names (``open_blocks``, a chunk of blocks at a time); the first
        failure makes it the block's (stage ``block``). ``seen``: the blocks
        already verified for an ABI (a block two manifests share is read once)."""
        name = info["name"]
        if info.get("status") != "ok" or not info.get("manifest"):
            return
        e = self.errors.get(name)
        if e is not None:
            _failed(info, e)
            return
        t = self.tables.get(name)
        if t is None:
            return
        try:
            err = self._open(t, str(info["abi"]), seen)
        except OSError as oe:
            _failed(info, oe)
            return
        if err is not None:
            _failed(info, err)

    def _open(self, t: Table, abi: str, seen: dict[tuple[Record, str], BlockError | None]) -> BlockError | None:
        block, recs = t
        pending: list[Record] = []

        def flush() -> BlockError | None:
            if not pending:
                return None
            try:
                _core.open_blocks(self.blocks_dir, _core.block_table(block, pending), abi)
            except BlockError as e:
                for r in pending:
                    if r[0].hex() == e.block:
                        seen[(r, abi)] = e
                return e
            seen.update(((r, abi), None) for r in pending)
            pending.clear()
            return None

        for r in recs:
            if (r, abi) in seen:  # the chunk before it first: the first failure in table order is the one told
                err = flush() or seen[(r, abi)]
                if err is not None:
                    return err
                continue
            pending.append(r)
            if sum(p[2] for p in pending) >= CHUNK_BYTES and (err := flush()) is not None:
                return err
        return flush()

    def orphans(self) -> list[str] | None:
        """The block files no manifest names, sorted (None while a file
        could not be read)."""
        return None if self.unknown else sorted(h for h in self.files if not self.users[h])

    def check_files(self) -> list[Info]:
        """Every block file verified on its own (``verify_block``: its
        header, its name against its file's, its payload checksum), each
        with whether it is an orphan."""
        orphans = set(self.orphans() or ())
        out: list[Info] = []
        for h, size in sorted(self.files.items()):
            r: Info = {"name": h, "size": size, "orphan": h in orphans, "ok": True}
            try:
                _core.verify_block(os.path.join(self.blocks_dir, h + _SUFFIX))
            except CheckpointError as e:
                r.update(ok=False, status=e.kind, stage=e.stage, code=e.code, reason=e.reason)
            except OSError as e:
                r.update(ok=False, status="error", stage="block", code="os_error", reason=str(e))
            out.append(r)
        return out

    def totals(self, infos: list[Info]) -> Info:
        """``kv stats``' figures of the directory's files ``infos``: the
        manifests and their bytes, the block files and theirs, the orphans,
        the bytes on disk (files and blocks), the bytes the files would take
        as single files (each manifest's file plus its blocks' payloads) and
        the ratio of the two."""
        file_bytes = sum(i.get("size", 0) for i in infos)
        block_bytes = sum(self.files.values())
        orphans = self.orphans()
        disk = file_bytes + block_bytes
        single = file_bytes + sum(sum(r[2] for r in t[1]) for t in self.tables.values())
        return {
            "manifests": len(self.tables),
            "manifest_bytes": sum(i.get("size", 0) for i in infos if i["name"] in self.tables),
            "block_files": len(self.files),
            "block_files_bytes": block_bytes,
            "orphan_blocks": None if orphans is None else len(orphans),
            "disk_bytes": disk,
            "single_file_bytes": single,
            "dedup_ratio": single / disk if disk else None,
        }


def annotate(infos: list[Info], d: str, full: bool, whole: bool = True) -> Manifests:
    """Every readable file of ``infos`` (files of directory ``d``) with its
    manifest facts (:meth:`Manifests.facts`); with ``full``, every manifest
    that passed the pipeline with its blocks verified (:meth:`Manifests.verify`).
    Unless ``whole`` (``infos`` are every file of ``d``), the directory's
    other manifests are read too, for what is shared."""
    m = Manifests(d)
    for i in infos:
        m.add_info(i, full)
    if not whole:
        names = {i["name"] for i in infos}
        for p in scan_dir(d)[0]:
            if os.path.basename(p) not in names:
                m.add_path(p)
    seen: dict[tuple[Record, str], BlockError | None] = {}
    for i in infos:
        m.facts(i)
        if full:
            m.verify(i, seen)
    return m


def manifest_line(i: Info) -> str | None:
    """A manifest in words (``kv show``), None for any other file."""
    if not i.get("manifest"):
        return None
    if "blocks" not in i:
        er = i.get("block_table_error") or {}
        return f"its block table cannot be read: {er.get('code')}: {er.get('reason')}"
    line = (
        f"{i['blocks']} blocks of {i['block_tokens']} tokens, {human_bytes(i['block_bytes'])} in blocks "
        f"({human_bytes(i['shared_block_bytes'])} shared with other checkpoints)"
    )
    return line + (f", {i['missing_blocks']} missing" if i["missing_blocks"] else "")


def blocks_cell(i: Info) -> str:
    """A file's BLOCKS cell in ``kv ls``."""
    if "blocks" not in i:
        return "?" if i.get("manifest") else "-"
    missing = f", {i['missing_blocks']} missing" if i["missing_blocks"] else ""
    return f"{i['blocks']} ({i['shared_blocks']} shared{missing})"


def plan_evict(store: KVStore, ents: list[Entry], m: Manifests, gone_blocks: Iterable[str]) -> tuple[list[str], int]:
    """What the store's eviction (``KVStore.evict_names``) would remove of
    ``ents``, planned without removing: each manifest charged an equal share
    of every block it names, as the store charges it, planned again while
    blocks are left; the names in order and how many blocks would go with
    them (``gone_blocks``: those already counted out, the orphans)."""
    files = dict(m.files)
    for h in gone_blocks:
        files.pop(h, None)
    refs = {name: {r[0].hex() for r in t[1]} for name, t in m.tables.items()}
    names: list[str] = []
    left, freed = list(ents), 0
    while True:
        users = collections.Counter(h for e in left for h in refs.get(e.name, ()) if h in files)
        charged = [
            dataclasses.replace(e, size=e.size + sum(files[h] // users[h] for h in refs.get(e.name, ()) if h in files))
            for e in left
        ]
        plan = [v.name for v in store.plan_evict(charged)]
        if not plan:
            return names, freed
        names += plan
        left = [e for e in left if e.name not in set(plan)]
        live = {h for e in left for h in refs.get(e.name, ())}
        dead = [] if m.unknown else [h for h in files if h not in live]  # the store removes none then
        freed += len(dead)
        for h in dead:
            del files[h]
        if not files:
            return names, freed
