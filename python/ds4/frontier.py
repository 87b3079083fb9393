"""No span prefilled twice (docs/DESIGN.md, "Frontiers").

A turn that prefilled more than the store's ``frontier_tokens`` (512 by
default, ``--kv-frontier-tokens``; 0: off) since the last state of its
conversation that is on disk reached a *frontier*: the state at its
prompt's end. The next turn resumes from there whatever the client does to
the reply (drops its reasoning, cuts a call, edits it), so that state must
outlive the live session:

* while the session is live it is kept resident (a dense memory rewinds to
  it; a recurrent one stores every prompt anyway, ``recover``'s
  ``prompt_save``, and has no pending frontier);
* when the live state is about to go (another conversation's evict save, a
  rewind below it, a namespace switch, the shutdown save), it is stored
  after the full state's save: the session rewound to it and saved with
  reason ``frontier`` (:func:`store`);
* a turn that loaded a checkpoint and then prefilled a span of
  ``frontier_tokens`` or more that an earlier turn prefilled from the same
  checkpoint (a reload loop: the frontier was never stored, e.g. the
  process died, or a save was refused) is reported (``reload``) and its
  frontier stored at once, before the reply (:func:`after_turn`); from
  then on a turn that loads a frontier the guard stored stores its own at
  once too (that conversation is known to lose its live state).

The pending frontier of a session and the loads a store has seen are kept
here, by weak reference, so neither the session nor the store carries them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kvstore import KVStore, SaveSkip
    from .report import RecoveryReport
    from .session import Session

log = logging.getLogger("ds4.frontier")

__all__ = ["after_turn", "pending", "store"]

#: the loads a store remembers (each a checkpoint's name and the digest of
#: the span prefilled after it), the oldest forgotten
MAX_LOADS = 1024


@dataclasses.dataclass
class _Frontier:
    at: int  # the token count of the prompt end
    digest: int  # hash of the tokens before it: the state must still hold them
    unsaved: int  # tokens prefilled since the conversation's last state on disk
    due: bool  # more than frontier_tokens of them: stored when the live state goes


_PENDING: weakref.WeakKeyDictionary[Session, _Frontier] = weakref.WeakKeyDictionary()
_LOADS: weakref.WeakKeyDictionary[KVStore, OrderedDict[tuple[str, bytes], int]] = weakref.WeakKeyDictionary()
#: the frontiers the reload guard stored: a turn loading one stores its own at once
_EAGER: weakref.WeakKeyDictionary[KVStore, OrderedDict[tuple[str, bytes], int]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _limit(st: KVStore | None) -> int:
    return int(getattr(getattr(st, "policy", None), "frontier_tokens", 0) or 0)


def pending(sess: Session) -> int | None:
    """The token count of ``sess``'s frontier not yet stored, when its live
    state still holds it; else None."""
    with _LOCK:
        f = _PENDING.get(sess)
    if f is None or not f.due or not sess.checkpoint_valid or f.at > sess.n_past:
        return None
    return f.at if hash(tuple(sess.tokens[: f.at])) == f.digest else None


def after_turn(sess: Session, st: KVStore | None, rep: RecoveryReport, tokens: list[int]) -> None:
    """After a ladder run that brought ``sess`` to ``tokens`` (the prompt):
    note the frontier it reached (due once more than ``frontier_tokens``
    were prefilled since the conversation's last state on disk), and when
    it loaded a checkpoint and prefilled a span an earlier turn prefilled
    from the same one, report the reload loop and store the frontier now
    (reason ``frontier``)."""
    limit = _limit(st)
    if st is None or limit <= 0:
        return
    with _LOCK:
        old = _PENDING.pop(sess, None)
    if not sess.checkpoint_valid or sess.n_past != len(tokens) or rep.prompt_saved is not None:
        return  # nothing live, or the prompt is on disk (an engine that cannot rewind)
    prefilled = max(0, rep.prompt_tokens - rep.reused_tokens)
    # a live or rewound state goes on from what it held; a load or a prefill starts over
    goes_on = old is not None and rep.rung in ("live", "rewrite") and old.at <= rep.reused_tokens
    unsaved = (old.unsaved if old is not None and goes_on else 0) + prefilled
    if rep.rung in ("disk", "remote") and prefilled >= limit and _reloaded(sess, st, rep, tokens, limit):
        got = _saved(rep, st.store_live_checked(sess, "frontier"))
        if got is not None:  # a conversation seen losing its state: its next frontier too, at once
            _remember(_EAGER, st, (os.path.basename(got), b""))
        return
    if unsaved > 0:
        with _LOCK:
            _PENDING[sess] = _Frontier(len(tokens), hash(tuple(tokens)), unsaved, unsaved > limit)


def _reloaded(sess: Session, st: KVStore, rep: RecoveryReport, tokens: list[int], limit: int) -> bool:
    """Note this load; True (and the report's ``reload``) when the same
    checkpoint was loaded before and the same ``limit`` tokens prefilled
    after it."""
    name = os.path.basename(rep.loaded_path or "")
    start = rep.reused_tokens
    if _remember(_EAGER, st, (name, b""), count=False):
        return True  # a frontier the guard stored: this conversation loses its state, store the next one now
    span = hashlib.blake2b(sess.key_of(tokens[start : start + limit])[len(sess.key_of(())) :], digest_size=16)
    times = _remember(_LOADS, st, (name, span.digest()))
    if times < 2:
        return False
    rep.reload = {"checkpoint": name, "depth": start, "span": len(tokens) - start, "times": times}
    rep.log_event(
        "ds4 reload loop: %s loaded at %d tokens again and the same span prefilled (%d times); storing the frontier",
        name,
        start,
        times,
    )
    return True


def _remember(
    table: weakref.WeakKeyDictionary[KVStore, OrderedDict[tuple[str, bytes], int]],
    st: KVStore,
    key: tuple[str, bytes],
    count: bool = True,
) -> int:
    """How many times ``key`` was seen by ``st`` (this one counted unless
    not ``count``: then only looked up), the oldest forgotten past
    :data:`MAX_LOADS`."""
    with _LOCK:
        seen = table.setdefault(st, OrderedDict())
        times = seen.get(key, 0) + (1 if count else 0)
        if times:
            seen[key] = times
            seen.move_to_end(key)
        while len(seen) > MAX_LOADS:
            seen.popitem(last=False)
    return times


def _saved(rep: RecoveryReport | None, got: str | SaveSkip | None) -> str | None:
    if rep is None or got is None:
        return got if isinstance(got, str) else None
    if isinstance(got, str):
        rep.frontier_saved = got
        return got
    rep.save_skipped.append(got)
    return None


def store(sess: Session, st: KVStore | None, rep: RecoveryReport | None = None, *, keep: int = 0) -> str | None:
    """Store ``sess``'s pending frontier before its live state goes (after
    the full state's own save: the session is rewound to the frontier,
    which drops the tokens after it). ``keep``: the tokens the caller keeps
    live (a rewind to them); a frontier within them stays resident and is
    not stored. Never raises; the saved path or None (a skip is in
    ``rep``'s ``save_skipped``)."""
    at = pending(sess)
    if st is None or at is None or at <= keep:
        return None
    with _LOCK:
        _PENDING.pop(sess, None)
    try:
        if at < sess.n_past and not sess.rewind(at):
            return None
    except Exception as e:  # the session is invalid; the caller replaces it anyway
        log.warning("ds4 frontier: the rewind to %d tokens failed: %s", at, e)
        return None
    got = st.store_live_checked(sess, "frontier")
    if isinstance(got, str):
        log.info("ds4 frontier stored at %d tokens", at)
    return _saved(rep, got)
