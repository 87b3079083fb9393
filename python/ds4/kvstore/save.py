"""Writing into the store's directory: a live session (the policy's checks,
:meth:`Saves.live`: a save it declines says why, a :class:`.skips.SaveSkip`;
the export, the budget estimate, and the durable write with its typed
errors), and a verified download of the shared tier (:meth:`Saves.adopt`)."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from .. import _core
from ..checkpoint import open_checkpoint, reason_code, write_checkpoint
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InvalidSessionError,
    MacMissingError,
    StoreError,
    StoreFullError,
)
from .blocks import MANIFEST_FLAG, TABLE_TENSOR, split_session
from .entries import Entry, text_namespace
from .eviction import Eviction
from .files import NOT_REGULAR, StatKey, checkpoint_name, legacy_name, stat_key
from .parts import StoreParts
from .remove import evict_entries
from .skips import (
    BELOW_MIN_TOKENS,
    ENGINE_CANNOT_LOAD,
    NAME_HELD_BY_OTHER_MODEL,
    OVER_BUDGET,
    SaveSkip,
    session_invalid,
    write_failed,
)
from .writes import hit_share

if TYPE_CHECKING:
    import numpy as np

    from ..checkpoint import Checkpoint
    from ..session import Session

log = logging.getLogger("ds4.kvstore")

__all__ = ["Saves", "existing_file", "write_live"]


def write_live(
    path: str,
    sess: Session,
    text: bytes,
    reason: str,
    budget_bytes: int,
    auth_key: bytes | None = None,
    *,
    codec: str = "none",
    level: int = 1,
    arrays: dict[str, np.ndarray] | None = None,
    flags: int = 0,
    more: int = 0,
) -> int | SaveSkip:
    """Export ``sess`` (or take its exported ``arrays``) and write it
    durably to ``path`` under ``text`` (with a MAC when ``auth_key`` is
    given; its payload compressed when ``codec`` is ``"zstd"``: a v3 file;
    ``flags``: the header's); returns the file size, or an ``over_budget``
    skip when the estimate (plus ``more`` bytes written beside it) does not
    fit ``budget_bytes``. Disk full is :class:`ds4.errors.StoreFullError`."""
    if arrays is None:
        arrays = sess.export_arrays()
    est = sum(a.nbytes for a in arrays.values()) + len(text) + 4096 + 64 * len(arrays) + more
    if est + est // 100 > budget_bytes:
        detail = f"estimated file size {est / 2**20:.1f} MiB exceeds the budget of {budget_bytes / 2**20:.1f} MiB"
        log.warning("kv cache store skipped reason=%s: %s", reason, detail)
        return SaveSkip(reason, OVER_BUDGET, detail)
    try:
        return write_checkpoint(
            path,
            text,
            arrays,
            abi=sess.payload_abi,
            tokens=sess.n_past,
            ctx=sess.ctx,
            reason=reason_code(reason),
            quant_bits=getattr(sess.engine, "quant_bits", 0),
            auth_key=auth_key,
            codec=codec,
            level=level,
            flags=flags,
        )
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFullError(e.errno, f"disk full while storing checkpoint: {e.strerror}", path) from e
        raise StoreError(e.errno, f"cannot store checkpoint: {e.strerror}", path) from e


def existing_file(
    path: str,
    sess: Session,
    text: bytes,
    discard: Callable[[str, CheckpointError, str, StatKey], object],
    auth_key: bytes | None = None,
) -> str | None:
    """'same' if a file for this engine and text exists (header and text
    verified; its payload is verified when it is loaded, and removed then
    if corrupt), 'foreign' if a valid file of another engine holds the
    key, None otherwise (missing, without the MAC a configured key needs:
    replaced; or corrupt: then it is ``discard``-ed)."""
    try:
        judged = stat_key(os.lstat(path))
    except FileNotFoundError:
        return None
    try:
        ck = open_checkpoint(path, prompt=text, expected_abi=sess.payload_abi, load_payload=False, auth_key=auth_key)
    except MacMissingError:
        return None  # written before the key was configured: the new, authenticated file replaces it
    except IncompatibleCheckpointError:
        return "foreign"
    except CorruptCheckpointError as e:
        if e.code == NOT_REGULAR:
            return "foreign"  # not a file ds4 may replace: kept, and nothing is stored under its name
        discard(path, e, "store", judged)
        return None
    except CheckpointError:
        return "foreign"
    return "same" if ck.text == text else None


def _skipped(reason: str, code: str, detail: str) -> SaveSkip:
    log.info("kv cache store skipped reason=%s: %s (%s)", reason, code, detail)
    return SaveSkip(reason, code, detail)


class Saves:
    """One store's writes (``parts``): a live session, checked against the
    policy, written, indexed, shared and evicted for; a verified download
    renamed in."""

    def __init__(self, parts: StoreParts, eviction: Eviction):
        self._p = parts
        self._eviction = eviction

    def _write_state(self, path: str, sess: Session, text: bytes, reason: str) -> int | SaveSkip:
        """:func:`write_live` with the store's knobs: with ``blocks`` on and an
        engine that names its state's append-only part, the blocks the
        directory lacks and then the manifest (:mod:`.blocks`), else one file."""
        p = self._p
        pol, budget, key = p.policy, p.policy.budget_bytes, p.auth_key
        arrays = sess.export_arrays()
        sp = split_session(sess, arrays, pol.block_tokens) if pol.blocks else None
        if sp is not None and sp.nbytes() > budget:
            sp = None
        state = sum(a.nbytes for a in arrays.values())
        new = state if sp is None else p.blocks.new_bytes(sp) + sum(a.nbytes for a in sp.residue.values())
        refused = p.writes.admit(reason, new, state, lambda: hit_share((e.reason, e.hits) for e in p.entries()))
        if refused is not None:
            return refused
        got = p.blocks.write(sp, sess.payload_abi) if sp is not None else None
        if got is not None and got[1]:
            p.writes.record(reason, got[1])  # the blocks are on disk whatever becomes of the manifest
        if sp is None or got is None:
            size = write_live(
                path, sess, text, reason, budget, key, codec=pol.codec, level=pol.codec_level, arrays=arrays
            )
            if not isinstance(size, SaveSkip):
                p.writes.record(reason, size)
                p.blocks.forget(os.path.basename(path))  # a single file now: it names no blocks
            return size
        import numpy as np

        residue = {**sp.residue, TABLE_TENSOR: np.frombuffer(got[0], np.uint8)}
        size = write_live(
            path,
            sess,
            text,
            reason,
            budget,
            key,
            codec=pol.codec,
            level=pol.codec_level,
            arrays=residue,
            flags=MANIFEST_FLAG,
        )
        if not isinstance(size, SaveSkip):
            p.writes.record(reason, size)
            p.blocks.note(os.path.basename(path), [n.hex() for n in sp.names])
        return size

    def live(
        self, sess: Session, reason: str, min_tokens: int | None, supersedes: Collection[str] = ()
    ) -> str | SaveSkip:
        """See :meth:`ds4.kvstore.KVStore.store_live_checked` (the store's lock,
        index and eviction; this module's checks and write): the path, or why
        nothing was written (a write that fails raises)."""
        p = self._p
        if not sess.checkpoint_valid:
            raise InvalidSessionError("cannot store a session without a valid checkpoint")
        if not getattr(sess.engine, "checkpoints_ok", True):
            # the engine's state did not survive its start-up round trip: a file
            # it could never load again is not written
            return _skipped(reason, ENGINE_CANNOT_LOAD, "this engine cannot load its own states")
        n = sess.n_past
        floor = max(1, p.policy.min_tokens if min_tokens is None else min_tokens)
        if n < floor:
            return _skipped(reason, BELOW_MIN_TOKENS, f"{n} tokens < min {floor}")
        text = sess.key_bytes()
        sha = _core.sha1_hex(text)
        name = checkpoint_name(sha, sess.payload_abi)
        path = os.path.join(p.dir, name)
        t0 = time.perf_counter()
        with p.locked():
            # Cheap checks first: an existing file for this key needs no
            # export of the (possibly large) engine state. A release before
            # per-model names wrote this model's file as <sha>.kv: it serves.
            legacy = os.path.join(p.dir, legacy_name(sha))
            if existing_file(legacy, sess, text, p.discard, p.auth_key) == "same":
                log.info("kv cache store reason=%s: %s already stored", reason, legacy_name(sha)[:12])
                return legacy
            existing = existing_file(path, sess, text, p.discard, p.auth_key)
            if existing == "same":
                log.info("kv cache store reason=%s: %s already stored", reason, name[:12])
                return path
            if existing == "foreign":
                detail = f"{name[:12]} is held by a file this engine cannot load, another model's (kept)"
                return _skipped(reason, NAME_HELD_BY_OTHER_MODEL, detail)
            size = self._write_state(path, sess, text, reason)
            if isinstance(size, SaveSkip):
                return size
            p.counters["stores"] += 1
            p.index.index_file(name, path, stat_key(os.lstat(path)))
            if reason == "continued" and supersedes and p.policy.supersede:
                self.supersede(text, name, sess.payload_abi, supersedes)
            if p.remote is not None:  # shared in the background: never adds to this request's latency
                p.remote.enqueue(path, sess.payload_abi, n, len(text), p.blocks.paths_of(name))
            log.info(
                "kv cache stored tokens=%d reason=%s key=%s size=%.2f MiB save=%.1f ms",
                n,
                reason,
                name[:12],
                size / 2**20,
                (time.perf_counter() - t0) * 1000,
            )
            self._eviction.run_locked(protect=name)
            p.index.persist()
        return path

    def checked(
        self, sess: Session, reason: str, min_tokens: int | None, supersedes: Collection[str] = ()
    ) -> str | SaveSkip:
        """:meth:`live` raising nothing for a save that did not happen: a
        session without a valid state is a ``session_invalid`` skip, a write
        that raised an OSError a ``disk_full`` or ``write_error`` one (logged).
        The skip goes back to the caller only: the store keeps no last one
        (the server's lanes share it)."""
        try:
            return self.live(sess, reason, min_tokens, supersedes)
        except InvalidSessionError as e:
            return session_invalid(reason, e)
        except OSError as e:
            skip = write_failed(reason, e)
            log.warning("kv cache %s", skip)
            return skip

    def supersede(self, text: bytes, name: str, abi: str, among: Collection[str]) -> list[str]:
        """Remove the ``continued`` snapshots a new continued one (``name``, of
        key text ``text``) supersedes: those ``among`` the names the same prefill
        wrote before it (a long prefill's nested snapshots, ds4 PR #175), of this
        engine (``abi``) and this namespace, whose text is a strict prefix of
        ``text``. An earlier turn's snapshots are never among them: they are the
        branch points an edited or regenerated turn resumes from. Explicit checkpoints (cold, evict,
        shutdown, named, agent) stay. The caller holds the store's lock; the
        files go through :func:`.remove.evict_entries` (each only as indexed)
        and are counted as ``superseded``. Returns the names removed."""
        p = self._p
        ns = text_namespace(text)
        olds = [
            e
            for e in (Entry.from_row(p.dir, row) for row in p.index.lookup(text, min_tokens=0, abi=abi, ctx=None))
            if e.name != name
            and e.name in among
            and e.reason == "continued"
            and e.version >= 2
            and e.abi == abi
            and e.text_bytes < len(text)
            and e.namespace == ns
        ]
        for e in olds:
            p.index.forget(e.name)
        removed = evict_entries(p.dir, olds, why="superseded")
        p.counters["superseded"] += len(removed)
        if removed:
            _core.sync_dir(p.dir)
            p.index.stale()
        return removed

    def adopt(self, tmp: str, name: str, ck: Checkpoint) -> Entry | None:
        """Rename a verified download ``tmp`` to ``name`` under the store's lock,
        index it and evict to the budget (it protected): its entry, or None
        when a file took the name meanwhile or it did not index (the shared
        tier's ``adopt`` hook, :mod:`.tiered`)."""
        p = self._p
        final = os.path.join(p.dir, name)
        with p.locked():
            if os.path.lexists(final):
                return None
            os.rename(tmp, final)
            _core.sync_dir(p.dir)
            key = stat_key(os.lstat(final))
            e = Entry.from_checkpoint(ck, final, key)
            p.index.index_file(name, final, key)
            self._eviction.run_locked(protect=name)
            p.index.persist()
        return e if p.index.row(name) is not None else None
