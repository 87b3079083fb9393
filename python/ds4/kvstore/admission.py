"""The store's side of a load (:class:`Admission`; the ladder,
:mod:`ds4.loading`, does the loading): open a candidate through the whole
verification pipeline with the store's checks, judge one that failed (count
it; remove a corrupt file, keep an incompatible or unreadable one; say
whether the session must be invalidated), and count a hit (stamp it, or
consume the file)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from .. import _core
from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import BlockError, CheckpointError, CorruptCheckpointError
from .entries import Entry, LoadResult
from .files import NOT_REGULAR, StatKey, stat_key
from .parts import StoreParts
from .rejection import Refusal, Rejection, import_failure, rejection_of
from .remove import remove_exact


def _state_bound(engine: object) -> tuple[int, int] | None:
    # ds4.engine imports numpy: only a load needs it (the kv commands that
    # never load, e.g. kv lookup, stay light: tests/test_cli.py)
    from ..engine import state_bound

    return state_bound(engine)


if TYPE_CHECKING:
    from ..session import Session

log = logging.getLogger("ds4.kvstore")

__all__ = ["Admission", "version_of"]


def version_of(e: Entry) -> StatKey:
    """The stat key of ``e``'s file as it is now: the version a corrupt
    verdict on it is about (:meth:`Admission.refuse`)."""
    return stat_key(os.lstat(e.path))


class Admission:
    """One store's verdicts on the candidates a ladder loads (``parts``)."""

    def __init__(self, parts: StoreParts):
        self._p = parts

    def open(self, sess: Session, path: str, prompt: bytes, *, check_name: bool = True) -> Checkpoint:
        """Open ``path`` through the whole verification pipeline for a load
        into ``sess`` against ``prompt`` (this store's checks: quant, key,
        checksum, mmap); raises what the pipeline raises. A compressed file
        declaring more raw bytes than the engine's state of its token count
        takes (:func:`ds4.engine.state_bound`) is refused before anything is
        allocated; one of the store's own files (``check_name``) also when it
        declares more than the whole budget (a save over it is skipped: no
        such file is this store's). A download (another replica's, whose
        budget may be larger) is held to the engine's bound only."""
        p = self._p
        ck = open_checkpoint(
            path,
            prompt=prompt,
            check_name=check_name,
            expected_abi=sess.payload_abi,
            quant_bits=getattr(sess.engine, "quant_bits", 0) if p.policy.reject_different_quant else None,
            ctx=sess.ctx - 1,
            verify_checksum=p.policy.verify_checksum,
            mmap=p.policy.mmap,
            auth_key=p.auth_key,
            state_bytes=_state_bound(sess.engine),
            max_raw_bytes=p.policy.budget_bytes if check_name else None,
        )
        return p.blocks.assemble(ck, sess.engine)  # a manifest: its blocks verified and joined (:mod:`.blocks`)

    def refuse(self, e: Entry, err: Exception, judged: StatKey | None) -> Refusal | None:
        """The store's side of a candidate that failed to open or load
        (``judged``: its version before it was judged, :func:`version_of`):
        counted; a corrupt file is removed (or quarantined), an
        incompatible or unreadable one kept. None when the file was gone
        (removed by another process: forgotten)."""
        p = self._p
        if isinstance(err, FileNotFoundError):
            p.index.drop(e.name, None)  # read again if it comes back
            return None
        p.counters["rejected"] += 1
        if isinstance(err, OSError):  # unreadable (permissions, I/O): a typed rejection; skipped and kept
            return Refusal(Rejection(e.path, "open", "unreadable", err.strerror or type(err).__name__))
        if isinstance(err, BlockError) and err.code != "block_table":  # a block of the manifest, not the manifest
            p.blocks.refused(err)
            return Refusal(rejection_of(err.path or e.path, err), f"block {err.block[:12]} of {e.name} refused")
        if isinstance(err, CheckpointError):
            rej = rejection_of(e.path, err)
            if isinstance(err, CorruptCheckpointError) and err.code != NOT_REGULAR:
                p.discard(e.path, err, "load", judged)
                return Refusal(rej, f"corrupt checkpoint {e.name}")
            log.info("kv cache skipped file=%s stage=%s code=%s reason=%s (kept)", *rejection_of(e.name, err))
            return Refusal(rej)
        rej = import_failure(e.path, err)
        log.error("kv cache could not load %s: %s (kept)", e.name, rej.reason)
        return Refusal(rej, f"checkpoint {e.name} failed to load")

    def hit(self, e: Entry, ck: Checkpoint, ms: float, judged: StatKey | None) -> LoadResult:
        """Count a load of ``e`` (``ck``, loaded in ``ms``): its hit stamped
        in the file and the index, or, over ``cold_max_tokens`` with
        ``consume_over_cold_max``, the file consumed. What the load reused."""
        p = self._p
        now = int(time.time())
        if p.policy.consume_over_cold_max and 0 < p.policy.cold_max_tokens < ck.tokens:
            # ds4's consume: a load longer than cold_max_tokens deletes the
            # file (the version that was loaded; through the one removal).
            p.index.forget(e.name)
            try:
                with p.locked():
                    gone = remove_exact(p.dir, e.name, judged) is not None
                    p.index.persist()
            except OSError as ex:
                log.error("kv cache could not consume %s: %s", e.name, ex)
                gone = False
            if gone:
                log.info("kv cache hit text tokens=%d consumed file=%s", ck.tokens, e.path)
        else:
            try:
                e.hits = _core.touch(e.path, now)
                e.last_used = now
                st = os.stat(e.path)
                e.stat_key = stat_key(st)
                p.index.set_hit(e.name, e.hits, now, e.stat_key)
            except OSError as ex:
                log.debug("kv cache touch failed for %s: %s", e.name, ex)
        p.counters["hits"] += 1
        log.info(
            "kv cache hit text tokens=%d text=%d key=%s load=%.1f ms file=%s",
            ck.tokens,
            ck.text_bytes,
            e.name[:12],
            ms,
            e.path,
        )
        return LoadResult(path=e.path, tokens=ck.tokens, text_bytes=ck.text_bytes)
