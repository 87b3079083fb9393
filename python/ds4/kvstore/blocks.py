"""The store's shared blocks (docs/DESIGN.md, "Blocks"; docs/FORMAT.md §7).

With ``StorePolicy.blocks`` a checkpoint of an engine that names its
state's append-only part (:mod:`ds4.blocks`) is written as a *manifest*:
a checkpoint file as any other (its key text, header, checksum and MAC),
whose payload holds the residue of the state and the ``ds4.blocks``
table, flagged in its header (:data:`MANIFEST_FLAG`); the blocks are
files of their own in ``blocks/``, each named by the chained digest of
the tokens up to its end (seeded with the payload ABI and the key text's
namespace), so two checkpoints of one prefix share its blocks. A save
writes only the blocks the directory lacks (each fsynced, then the
directory once), then the manifest, whose atomic rename is the commit
point: a crash leaves at most blocks no manifest names, which the next
eviction or ``ds4 kv gc`` removes.

A load opens every block the table names through the core
(``_core.open_blocks``: the table against the manifest's own tokens, then
each block's header, name, ABI tag, size, checksum and, with a key, MAC,
on up to two threads) before the session is touched; one that fails is a
:class:`~ds4.errors.BlockError` (stage ``block``): the block is removed
when it is damaged, the manifest kept (a later save of the same tokens
writes the block again and makes it whole), and the ladder goes on.

:class:`BlockStore` keeps which manifest names which blocks (read from a
manifest's table when it is written, loaded or first seen, unless
the index records it for the same version of the file: the block section
of ``.ds4.index``, :meth:`.indexed.DirIndex.blocks_of`), their sizes,
and counts a block once in the store's bytes: each manifest is charged its
own file and an equal share of every block it names, so the eviction
order and the budget see unique bytes.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING

from .. import _core
from ..checkpoint import Checkpoint, check_tokens, open_checkpoint
from ..errors import BlockError, CheckpointError, EngineStateError
from .entries import Entry, text_namespace
from .files import TMP_MAX_AGE_S, StatKey, create_temp, temp_is_orphaned

if TYPE_CHECKING:  # numpy and ds4.blocks are imported by a save or a load (a lookup needs neither)
    import numpy as np

    from ..blocks import Blocks
    from ..session import Session
    from .indexed import DirIndex

log = logging.getLogger("ds4.kvstore")

__all__ = ["BLOCKS_DIR", "MANIFEST_FLAG", "TABLE_TENSOR", "BlockStore", "Split", "list_blocks", "split_session"]

#: the subdirectory of the store's directory that holds the block files
BLOCKS_DIR = "blocks"
#: the payload tensor of a manifest that lists its blocks
TABLE_TENSOR = "ds4.blocks"
#: header flag (byte 6) of a manifest: its state's append-only part is in blocks
MANIFEST_FLAG = 0x08
_SUFFIX = ".kvb"
# A block's temp file as the core's writer names it (rust/format/writer.rs,
# ``temp_name``): ``.<64 hex>.kvb.tmp.<pid>.<pid space>.<unique>``.
_TMP_RE = re.compile(r"^\.[0-9a-f]{64}\.kvb\.tmp\.(?P<tail>[A-Za-z0-9.]+)$")
#: guards the bookkeeping of a download whose blocks are fetched on several threads
_DOWNLOADS = threading.Lock()


def _root(abi: str, text: bytes) -> bytes:
    ns = text_namespace(text)
    return _core.block_root(abi, b"" if ns is None else ns.encode("utf-8"))


class Split:
    """A live session's state cut into blocks for a save: the blocks'
    names and payloads (each made when written), and the residue arrays
    the manifest holds."""

    def __init__(self, names: list[bytes], payloads: Blocks, residue: dict[str, np.ndarray]):
        self.names, self.payloads, self.residue, self.block = names, payloads, residue, payloads.block

    def nbytes(self) -> int:
        """The bytes of the blocks and the residue together."""
        return len(self.payloads) * self.payloads.nbytes_each + sum(a.nbytes for a in self.residue.values())


def split_session(sess: Session, arrays: dict[str, np.ndarray], wanted: int) -> Split | None:
    """``arrays`` (``sess``'s export) as blocks of ``wanted`` tokens (rounded
    to the engine's granule), or None when the engine names no append-only
    part or the state is shorter than one block."""
    from ..blocks import block_layout, block_tokens_for, split

    n = sess.n_past
    block = block_tokens_for(sess.engine, wanted)
    layout = block_layout(sess.engine, n) if n >= block else None
    if layout is None:
        return None
    payloads, residue = split(arrays, layout, n, block)
    names = _core.block_names(_root(sess.payload_abi, sess.key_bytes()), arrays["tokens"], block, sess.payload_abi)
    if len(names) != len(payloads):
        raise EngineStateError(f"{len(names)} block names for {len(payloads)} blocks")
    return Split(names, payloads, residue)


def list_blocks(blocks_dir: str) -> tuple[dict[str, int], list[str]]:
    """The block files of ``blocks_dir`` (regular files named ``<64
    hex>.kvb``: hex name -> bytes) and the paths of block writers' temp
    files; nothing when there is no such directory. Nothing is removed."""
    sizes: dict[str, int] = {}
    temps: list[str] = []
    try:
        it = os.scandir(blocks_dir)
    except (FileNotFoundError, NotADirectoryError):
        return sizes, temps
    with it:
        for de in it:
            if de.name.endswith(_SUFFIX) and len(de.name) == 64 + len(_SUFFIX):
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    sizes[de.name[:64]] = st.st_size
            elif ".kvb.tmp." in de.name:
                temps.append(de.path)
    return sizes, temps


class BlockStore:
    """The ``blocks/`` directory of one store, and which manifest names
    which block. Every method that changes files runs under the store's
    lock (the caller holds it)."""

    def __init__(self, root: str, auth_key: bytes | None, index: DirIndex):
        self.root = root
        self._index = index  # the persistent record of which file names which blocks
        self.dir = os.path.join(root, BLOCKS_DIR)
        self.auth_key = auth_key
        self._sizes: dict[str, int] = {}  # block (hex) -> file bytes
        self._refs: dict[str, tuple[str, ...]] = {}  # manifest name -> its blocks (hex), () for a single file
        self._users: collections.Counter[str] = collections.Counter()
        self._listed = False
        self._trusted: dict[str, int] = {}  # blocks written or compared by this process: their checksums
        self._recorded: dict[str, StatKey] = {}  # manifest -> the stat key its blocks were recorded in the index for
        #: block files written and their bytes, blocks a save found present,
        #: present blocks whose bytes differed, corrupt and orphaned ones removed
        self.counts: collections.Counter[str] = collections.Counter()

    # -- the directory ---------------------------------------------------------
    def _list(self) -> None:
        if self._listed:
            return
        self._listed = True
        now = time.time()
        sizes, temps = list_blocks(self.dir)
        self._sizes.update(sizes)
        for path in temps:
            self._drop_temp(path, now)

    @staticmethod
    def _drop_temp(path: str, now: float) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        m = _TMP_RE.match(os.path.basename(path))
        # judged as a checkpoint's temp file of the same writer (its pid and
        # pid space: a dead writer of this namespace at once, else by age)
        name = f".{'0' * 40}.kv.tmp.{m['tail']}" if m else os.path.basename(path)
        if stat.S_ISREG(st.st_mode) and temp_is_orphaned(name, st.st_mtime, now, TMP_MAX_AGE_S):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def path(self, hexname: str) -> str:
        return os.path.join(self.dir, hexname + _SUFFIX)

    def total_bytes(self) -> int:
        self._list()
        return sum(self._sizes.values())

    def __len__(self) -> int:
        self._list()
        return len(self._sizes)

    # -- references --------------------------------------------------------------
    def note(self, name: str, blocks: Iterable[str]) -> None:
        """``name`` (a manifest, or a single file: no blocks) names ``blocks``."""
        self.forget(name)
        refs = tuple(blocks)
        self._refs[name] = refs
        self._users.update(refs)

    def forget(self, name: str) -> None:
        self._recorded.pop(name, None)
        old = self._refs.pop(name, None)
        if old:
            self._users.subtract(old)

    def refs_of(self, e: Entry) -> tuple[str, ...] | None:
        """The blocks ``e`` names (read from its file the first time: a
        manifest's table, its payload not checked, only the table's bytes
        read; nothing for any other file, or a corrupt one: the load judges
        it). None when the file could not be read now."""
        got = self._refs.get(e.name)
        if got is not None:
            return got
        rec = self._index.blocks_of(e.name)
        if rec is not None:  # recorded for the version indexed: the file not read
            self.note(e.name, rec)
            if e.stat_key:
                self._recorded[e.name] = e.stat_key
            return rec
        refs: tuple[str, ...] = ()
        try:
            # the header's checks and the table's bytes only (mapped), not the payload's checksum:
            # a damaged table may name wrong blocks, which keeps blocks longer or lets this
            # manifest's go, and its load refuses it (the payload's checksum covers the table)
            ck = open_checkpoint(e.path, check_name=False, verify_checksum=False)
            if ck.flags & MANIFEST_FLAG:
                _, records = _core.read_block_table(ck.array(TABLE_TENSOR))
                refs = tuple(r[0].hex() for r in records)
        except OSError:
            return None
        except (CheckpointError, KeyError):
            refs = ()
        self.note(e.name, refs)
        return refs

    def charge(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` with each manifest's size grown by its share of its
        blocks (a block's bytes split evenly among the entries naming it),
        so that their sizes add up to the unique bytes on disk."""
        self._list()
        if not self._sizes:
            return entries
        refs = {e.name: self.refs_of(e) or () for e in entries}
        users = collections.Counter(h for r in refs.values() for h in r)
        for e in entries:
            e.size += sum(self._sizes.get(h, 0) // users[h] for h in refs[e.name])
        return entries

    def settle(self, entries: list[Entry], gone: Collection[str]) -> None:
        """After an eviction of ``gone`` from ``entries``: the blocks no
        remaining entry names removed, then the references of the remaining
        ones recorded in the index (with blocks on disk), which the store's
        next write of its index file keeps (a failure to write it costs the
        next store a read of each manifest)."""
        left = [e for e in entries if e.name not in gone]
        self.remove(self.unreferenced(left), "orphans")
        if not self._sizes:
            return
        for e in left:  # each list handed to the index once per version of its file, not at every pass
            if e.stat_key and e.name in self._refs and self._recorded.get(e.name) != e.stat_key:
                self._index.set_blocks(e.name, e.stat_key, self._refs[e.name])
                self._recorded[e.name] = e.stat_key

    def unreferenced(self, entries: Iterable[Entry]) -> list[str]:
        """The blocks no entry names (those of a crashed save, or of removed
        manifests); none while an entry cannot be read (it may name any)."""
        self._list()
        if not self._sizes:
            return []
        live: set[str] = set()
        for e in entries:
            refs = self.refs_of(e)
            if refs is None:
                return []
            live.update(refs)
        return [h for h in self._sizes if h not in live]

    def summary(self, entries: Callable[[], Iterable[Entry]], file_bytes: int) -> dict[str, float]:
        """The block files (``block_files``, ``block_bytes``), the bytes the
        checkpoints ``entries()`` (whose files take ``file_bytes``) would take
        as single files (``logical_bytes``: each manifest's file and every
        block it names) and the ratio of those to the bytes on disk
        (``dedup_ratio``, 1.0 with no blocks). A manifest's table is read
        once per process (:meth:`refs_of`)."""
        self._list()
        blocks = sum(self._sizes.values())
        logical = file_bytes
        if self._sizes:
            for e in entries():
                logical += sum(self._sizes.get(h, 0) for h in self.refs_of(e) or ())
        disk = file_bytes + blocks
        return {
            "block_files": len(self._sizes),
            "block_bytes": blocks,
            "logical_bytes": logical,
            "dedup_ratio": logical / disk if disk and self._sizes else 1.0,
        }

    def remove(self, hexes: Iterable[str], why: str) -> int:
        """Remove block files; how many went."""
        gone = 0
        for h in hexes:
            try:
                os.unlink(self.path(h))
                gone += 1
            except FileNotFoundError:
                pass
            self._sizes.pop(h, None)
            self._trusted.pop(h, None)
        if gone:
            self.counts[why] += gone
            _core.sync_dir(self.dir)
        return gone

    # -- saves -------------------------------------------------------------------
    def new_bytes(self, sp: Split) -> int:
        """The payload bytes of the blocks of ``sp`` the directory lacks
        (what :meth:`write` would add, less the blocks' headers)."""
        self._list()
        return sp.payloads.nbytes_each * sum(1 for n in sp.names if n.hex() not in self._sizes)

    def write(self, sp: Split, abi: str) -> tuple[bytes, int] | None:
        """Write the blocks of ``sp`` the directory lacks (fsynced, then the
        directory): the table for the manifest and the bytes written. A
        block already there is compared once per process (its checksum
        against this state's bytes; then its name is trusted: a block's
        bytes are a function of its tokens). None when one differs (its
        bytes are not this state's: the caller writes a single file, and
        nothing is shared with it)."""
        self._list()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        records, written, size = [], 0, sp.payloads.nbytes_each
        for b, name in enumerate(sp.names):
            h = name.hex()
            cks = self._trusted.get(h)
            if cks is not None and os.path.isfile(self.path(h)):  # another process's eviction may have removed it
                records.append((name, sp.block, size, cks))
                self.counts["present"] += 1
                continue
            payload = sp.payloads[b]
            cks = _core.xxh3_64(payload)
            if h in self._sizes:
                try:
                    head = _core.read_block_header(self.path(h))
                except (CheckpointError, OSError):
                    head = None
                if head is not None and (self.auth_key is None or head["authenticated"]):
                    if head["checksum"] != cks or head["payload_len"] != size:
                        self.counts["mismatch"] += 1
                        log.warning("kv cache block %s differs from this state's: a single file is written", h[:12])
                        return None
                    self._trusted[h] = cks
                    records.append((name, sp.block, size, cks))
                    self.counts["present"] += 1
                    continue
            file_len, cks = _core.write_block(self.dir, name, sp.block, abi, payload, self.auth_key)
            self._sizes[h], self._trusted[h] = file_len, cks
            written += file_len
            self.counts["written"] += 1
            self.counts["bytes_written"] += file_len
            records.append((name, sp.block, size, cks))
        if written:
            _core.sync_dir(self.dir)
        return _core.block_table(sp.block, records), written

    # -- loads ---------------------------------------------------------------------
    def assemble(self, ck: Checkpoint, engine: object) -> Checkpoint:
        """``ck`` as it is (a single file), or a manifest's state joined from
        its verified blocks (:meth:`Checkpoint.joined`). Raises BlockError for a
        block that fails (or a table that does not name this state's
        blocks), EngineStateError when the engine cannot join it."""
        if not ck.flags & MANIFEST_FLAG:
            return ck
        from ..blocks import SPARE, block_layout, unjoined

        arrays = ck.arrays()
        table = arrays.pop(TABLE_TENSOR, None)
        if table is None:
            raise BlockError("a manifest without its block table", code="block_table", path=str(ck.path))
        block, records = _core.read_block_table(table)
        n = int(ck.tokens)
        toks = check_tokens(arrays, n)
        names = _core.block_names(_root(ck.abi, bytes(ck.text)), toks, block, ck.abi)
        if [r[0] for r in records] != names:
            raise BlockError("the block table does not name this state's blocks", code="block_table", path=str(ck.path))
        layout = block_layout(engine, n)
        if layout is None:
            raise EngineStateError("this engine cannot join a state from blocks")
        joined, targets = unjoined(arrays, layout, n, block, SPARE.take)
        _core.open_blocks_into(self.dir, table, ck.abi, targets, n, self.auth_key, 2)
        self.note(os.path.basename(str(ck.path)), [r[0].hex() for r in records])
        return ck.joined(joined)

    def refused(self, err: BlockError) -> None:
        """A block a load refused: removed when it is there and damaged
        (a missing one is only forgotten)."""
        h = err.block
        if not h:
            return
        if err.code == "block_missing":
            self._sizes.pop(h, None)
            self._trusted.pop(h, None)
            return
        log.warning("kv cache removed corrupt block %s: %s (%s)", h[:12], err.code, err.reason)
        self.remove([h], "removed_corrupt")

    # -- the shared tier -------------------------------------------------------------
    def paths_of(self, name: str) -> tuple[str, ...]:
        """The block files manifest ``name`` names, as this store knows them
        (what an upload of it sends first)."""
        return tuple(self.path(h) for h in self._refs.get(name, ()))

    def missing(self, manifest: str) -> list[tuple[bytes, int, int, int]]:
        """The records of the blocks a downloaded manifest's table names that
        this directory lacks; the manifest is verified whole first (header,
        text, checksum, MAC with a key): its table is trusted only then.
        Raises what the pipeline raises."""
        ck = open_checkpoint(manifest, check_name=False, auth_key=self.auth_key)
        try:
            table = ck.array(TABLE_TENSOR)
        except KeyError:
            raise BlockError("a manifest without its block table", code="block_table", path=manifest) from None
        _, records = _core.read_block_table(table)
        return [r for r in records if not os.path.isfile(self.path(r[0].hex()))]

    def download(self, record: tuple[bytes, int, int, int], abi: str, fetch: Callable[[int], object]) -> int:
        """Fetch the block a manifest's table ``record`` names (name, tokens,
        payload bytes, checksum) through ``fetch(fd)``: written to a temp
        file of ``blocks/``, fsynced, renamed in and checked as a load checks
        a block (header, name, ABI, size, checksum; MAC with a key) and
        against the record (removed when it fails). Its file's bytes; 0 when the tier failed
        (``fetch`` gave None). Raises BlockError when the bytes are not the
        block; the caller holds the store's lock and syncs the directory
        once after its last block (:meth:`synced`), before any manifest
        naming them is renamed in."""
        name, n_tokens, size, cks = record
        h = name.hex()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        fd, tmp = create_temp(self.dir, h + _SUFFIX, block=True)
        try:
            try:
                got = fetch(fd)
                if got is not None:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if got is None:
                return 0
            # renamed in, then checked under its name (a block's file name is part of its check); a load
            # elsewhere that finds it meanwhile verifies it whole itself, and one that fails goes again
            os.rename(tmp, self.path(h))
            tmp = self.path(h)
            head = _core.verify_block(tmp, abi, self.auth_key)
            if (head["name"], head["n_tokens"], head["payload_len"], head["checksum"]) != (h, n_tokens, size, cks):
                err = BlockError("the block the tier holds under this name is another", code="block_name", path=tmp)
                err.block = h
                raise err
            tmp = ""
        finally:
            if tmp and os.path.lexists(tmp):
                os.unlink(tmp)
        with _DOWNLOADS:  # several blocks of a download fetched at once (:mod:`.tiered`)
            self._sizes[h] = head["file_len"]
            self._trusted[h] = cks
            self.counts["downloaded"] += 1
        return int(head["file_len"])

    def synced(self) -> None:
        """The ``blocks/`` directory fsynced (after downloads: their renames made durable)."""
        _core.sync_dir(self.dir)

    # -- ds4 kv --------------------------------------------------------------------
    @staticmethod
    def names_of(ck: Checkpoint, block_tokens: int) -> list[bytes]:
        """The names of the blocks of ``ck``'s own tokens, ``block_tokens``
        each: what a manifest's table must name, as :meth:`assemble` checks
        it (``ds4 kv verify`` checks it too). Raises what
        :func:`~ds4.checkpoint.check_tokens` raises."""
        toks = check_tokens(ck.arrays(), int(ck.tokens))
        return _core.block_names(_root(ck.abi, bytes(ck.text)), toks, block_tokens, ck.abi)
