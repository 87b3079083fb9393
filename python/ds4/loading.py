"""The ladder's disk and remote rungs on their own: load the longest stored
prefix of a prompt into a session (docs/DESIGN.md, "Recovery ladder").

The store only proposes and judges (:meth:`ds4.kvstore.KVStore.candidates`,
its verdicts: :mod:`ds4.kvstore.admission`), the shared tier only downloads
(:meth:`ds4.kvstore.remote.RemoteTier.fetch`); the session is loaded, and
invalidated after a corrupt candidate, here and in :mod:`ds4.recovery` only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from .checkpoint import open_checkpoint
from .errors import BlockError, CheckpointError, CorruptCheckpointError, ImportFailedError
from .kvstore import Candidates, Entry, KVStore, LoadResult, Matches, RejectionLog
from .kvstore.admission import version_of
from .kvstore.entries import NamedLoad
from .kvstore.files import NOT_REGULAR, StatKey, stat_key
from .kvstore.rejection import import_failure
from .kvstore.remote import RemoteEntry
from .session import Session

__all__ = ["load_first", "load_named", "load_shorter", "try_load_text"]

#: the loads' own clock (what the store and the tier log of a load), apart
#: from the report's timings (``time.perf_counter``)
load_clock = time.perf_counter


def try_load_text(
    store: KVStore, sess: Session, prompt_text: str | bytes, report: RejectionLog | None = None
) -> LoadResult | None:
    """One rung of the ladder on its own, as in ds4: load the longest
    stored prefix of ``prompt_text`` into ``sess``. Corrupt candidates
    invalidate the session and are removed; incompatible ones are kept;
    the next candidate is tried. Returns None when nothing loaded.
    Bytes are a key text (:mod:`ds4.keytext`); a ``str`` is taken as
    its UTF-8 bytes in the session's namespace (its key text when no
    marker's lead byte is typed in it as text)."""
    pb = sess.key_of(()) + prompt_text.encode("utf-8") if isinstance(prompt_text, str) else bytes(prompt_text)
    found = store.candidates(pb, ctx=sess.ctx, abi=sess.payload_abi, namespace=sess.namespace)
    if report is not None:
        report.rejected.extend(found.rejected)
    return load_first(store, sess, found, report)


def load_first(
    store: KVStore, sess: Session, found: Candidates, report: RejectionLog | None = None
) -> LoadResult | None:
    """Load the first of ``found`` (:meth:`KVStore.candidates`) that passes
    the whole verification pipeline into ``sess``; see :func:`try_load_text`.
    The candidates rejected at load time are added to ``report`` (those
    rejected at indexing are the caller's, in ``found.rejected``). A remote
    candidate longer than every local one is downloaded and tried first."""
    res = None
    longer = store.remote_longer(found)
    if longer:
        res = _load_remote(store, sess, found.prompt, longer, report)
    if res is None:
        res = _load_entries(store, sess, found.entries, found.prompt, report)
    if res is None:
        store.miss()
    return res


def load_shorter(
    store: KVStore, sess: Session, found: Candidates, below: int, report: RejectionLog | None = None
) -> LoadResult | None:
    """Load the first local candidate of ``found`` whose text is shorter
    than ``below`` bytes (the ladder's next try when the token check cut a
    loaded state that cannot rewind); as :func:`load_first` otherwise."""
    return _load_entries(store, sess, (e for e in found.entries if e.text_bytes < below), found.prompt, report)


def _load_remote(
    store: KVStore, sess: Session, prompt: bytes, entries: list[RemoteEntry], report: RejectionLog | None
) -> LoadResult | None:
    """Download the first remote candidate that verifies, then load it as a
    local file. A remote entry that fails any check (chunks, the whole
    pipeline, the engine's own) is deleted from the tier and the next one
    is tried; the tier failing stops here (the local candidates are next)."""
    tier = store.shared
    assert tier is not None
    for r in entries:
        if not tier.available():
            return None
        t0 = load_clock()
        e = tier.fetch(sess, prompt, r, report)
        if e is None:
            continue
        res = _load_entries(store, sess, [e], prompt, report)
        if res is not None:
            tier.loaded(r, t0)
            res.tier = "remote"
            return res
        tier.not_loaded(r, e)
    return None


def _load_entries(
    store: KVStore, sess: Session, entries: Iterable[Entry], prompt: bytes, report: RejectionLog | None
) -> LoadResult | None:
    """Load the first of ``entries`` that the store verifies and the session
    takes (each next one is found only when the one before is refused:
    :class:`ds4.kvstore.Matches`); a refused one is the store's to count, remove or keep
    (:meth:`ds4.kvstore.KVStore.refuse`), and invalidates the session when its verdict
    says so (a corrupt file, a failed import)."""
    for e in entries:
        _refused(entries, report)
        t0 = load_clock()
        judged: StatKey | None = None  # the version a corrupt verdict is about
        try:
            judged = version_of(e)
            ck = store.open_for(sess, e.path, prompt)
            sess.load_checkpoint(ck)
        except Exception as err:
            refusal = store.refuse(e, err, judged)
            if refusal is not None:
                if refusal.invalidate:
                    sess.invalidate(refusal.invalidate)
                if report is not None:
                    report.rejected.append(refusal.rejection)
            continue
        return store.count_hit(e, ck, (load_clock() - t0) * 1000, judged)
    _refused(entries, report)
    return None


def _refused(entries: Iterable[Entry], report: RejectionLog | None) -> None:
    """Report the candidates refused before they were offered (a file
    changed behind the index and found corrupt: :class:`Matches`)."""
    if isinstance(entries, Matches) and report is not None:
        report.rejected.extend(entries.take_refused())


def load_named(store: KVStore, sess: Session, sha: str, text: bytes, *, exact: bool = False) -> NamedLoad:
    """Load the checkpoint of text SHA-1 ``sha`` written by this session's
    model (``<sha>-<tag>.kv``, else an earlier release's ``<sha>.kv``) into
    ``sess`` (``ds4 chat``'s named sessions and system prompt), verified
    against ``text`` (its stored text must be a prefix of it; with
    ``exact``, equal to it). A corrupt file invalidates the session and is
    discarded by the store; an unusable one invalidates it and is kept.
    ``sha`` must be 40 hex digits: a name from an index file never
    reaches outside the directory."""
    path = store.find_named(sha, sess.payload_abi) or store.path_for(sha, sess.payload_abi)
    name = os.path.basename(path)
    t0 = time.perf_counter()
    try:
        judged = stat_key(os.lstat(path))
        ck = open_checkpoint(
            path, prompt=text, expected_abi=sess.payload_abi, ctx=sess.ctx - 1, auth_key=store.auth_key
        )
        if exact and ck.text != text:
            return NamedLoad("missing")  # a longer checkpoint is not this text's
        sess.load_checkpoint(store.blocks.assemble(ck, sess.engine))
    except FileNotFoundError:
        return NamedLoad("missing")
    except BlockError as e:  # one of its blocks: that block goes (when damaged), the manifest stays
        sess.invalidate(f"checkpoint {name}: {e.code}")
        if e.code != "block_table":
            store.blocks.refused(e)
            return NamedLoad("unusable", error=e)
        store.discard(path, e, "named load", judged)
        return NamedLoad("corrupt", error=e)
    except CorruptCheckpointError as e:
        if e.code == NOT_REGULAR:  # not ours to judge: kept, like any unusable file
            sess.invalidate(f"unusable checkpoint {name}")
            return NamedLoad("unusable", error=e)
        sess.invalidate(f"corrupt checkpoint {name}")
        store.discard(path, e, "named load", judged)
        return NamedLoad("corrupt", error=e)
    except CheckpointError as e:
        sess.invalidate(f"unusable checkpoint {name}")
        return NamedLoad("unusable", error=e)
    except Exception as e:
        sess.invalidate(f"checkpoint {name} failed to load")
        return NamedLoad("unusable", error=ImportFailedError(import_failure(path, e)[3], path=path))
    return NamedLoad("loaded", tokens=ck.tokens, ms=(time.perf_counter() - t0) * 1000)
