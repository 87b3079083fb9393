"""The recovery ladder (docs/DESIGN.md, "Recovery ladder").

1. The live session: token-prefix match (a rendered byte-prefix match whose
   tokens are not the prompt's own is cut by the token check to their
   common prefix, the rewrite rung's rewind).
2. ``rewrite_from_common``; on REBUILD_NEEDED go on.
3. Disk checkpoints, longest first (corrupt: invalidate and remove, then the
   next; incompatible: skip and keep). With a shared tier, a remote
   checkpoint longer than every local one is downloaded, verified and
   loaded first: the rung is then ``remote``. A loaded state is kept only
   as far as its tokens are the prompt's own (the token check): a cold
   prefill evaluates the prompt's tokenization, so a resume must too.
4. Full prefill.

Before the live session is replaced by an unrelated prompt, it is saved
("evict") when a store is given. The report says which rung served, how many
tokens were reused, every rejected candidate and where the time went.

The prompt is encoded once, and the store is asked once per run: the rewrite
rung and the disk rung share one :class:`ds4.kvstore.Candidates`.

The report's ``divergence`` says where the prompt left the best candidate
the run had (:meth:`_Ladder.divergence`): the live state, or the longest
checkpoint of the prompt's namespace that the lookup considered; it is
also logged (``kv cache miss at byte ...``) when the prompt did not hold
that candidate whole.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence

from . import _core, frontier
from .errors import InvalidSessionError, PromptError
from .keytext import parting, plain_len, snippet, tokenize_prompt, transient_span
from .kvstore import Candidates, Entry, KVStore, LoadResult
from .kvstore.skips import cold_too_long, cold_too_short
from .loading import load_first, load_shorter, try_load_text
from .report import RecoveryReport
from .session import Rewrite, Session

log = logging.getLogger("ds4.recovery")

#: the most bytes of each text a divergence shows
SNIPPET_BYTES = 32

__all__ = ["RecoveryReport", "load_first", "recover", "switch_namespace", "try_load_text"]


def switch_namespace(sess: Session, store: KVStore | None, namespace: str | None) -> str | None:
    """Make ``sess`` belong to ``namespace`` (a tenant's, see
    :mod:`ds4.keytext`). When it belonged to another one, its valid live
    state is saved there first (an evict save, never raising) and then
    dropped: nothing of it is reused across namespaces. Returns the saved
    path (the caller's log only: it names the other namespace's file)."""
    if sess.namespace == namespace:
        return None
    saved = None
    # a save skipped here is only logged (by the store): the state is another
    # namespace's, and the request's report is not the place for its figures
    if store is not None and sess.checkpoint_valid and sess.n_past >= store.min_tokens:
        try:
            saved = store.store_live_prefix(sess, "evict")
        except (OSError, InvalidSessionError) as e:
            log.warning("ds4 evict save before a namespace switch failed: %s", e)
        frontier.store(sess, store)  # its last turn boundary too, when not on disk
    sess.set_namespace(namespace)
    return saved


def recover(
    sess: Session,
    store: KVStore | None,
    prompt_text: str | bytes,
    *,
    evict_save: bool = True,
    cold_save: bool = False,
    progress: Callable[[int, int], None] | None = None,
    frontier_every: int | None = None,
    on_frontier: Callable[[Session], None] | None = None,
    cancel: Callable[[], bool] | None = None,
    prompt_save: bool | None = None,
) -> RecoveryReport:
    """Bring ``sess`` to the state of ``prompt_text`` as cheaply as the
    verified material allows. ``store`` may be None (no disk rung). With
    ``cold_save``, a full prefill also stores ds4's trimmed/aligned cold
    prefix on the way. ``cancel`` makes the prefill stoppable (see
    :meth:`Session.sync`: :class:`ds4.errors.PrefillCancelledError`).

    ``prompt_save``: after prefilling anything, also store the whole prompt
    (reason ``continued``), the checkpoint an edited reply or a retried turn
    resumes from (llama.cpp's context checkpoints). ``None`` (the default)
    does so on engines whose rewind cannot reach into a loaded state
    (``engine.rewind_limited``: sliding-window and recurrent models), where
    no other checkpoint would be there for it.

    ``progress(done, total)`` is called as a prefill goes (the tokens it
    computes, done of total); when it also has a ``serving(rung, reused)``
    method, that is called before each prefill the ladder runs, with the
    rung that served the rest and how many tokens it reused."""
    if prompt_save is None:
        prompt_save = bool(getattr(sess.engine, "rewind_limited", False))
    ladder = _Ladder(sess, store, prompt_text, evict_save, progress, frontier_every, on_frontier, cancel)
    rep = ladder.run(cold_save)
    if prompt_save and store is not None and rep.prompt_tokens > rep.reused_tokens:
        ladder.save_prompt()
    frontier.after_turn(sess, store, rep, ladder.tokens)
    return rep


class _Ladder:
    """One run of the ladder: the rungs in order, sharing the prompt's
    bytes, its tokens and the store's one lookup."""

    def __init__(
        self,
        sess: Session,
        store: KVStore | None,
        prompt_text: str | bytes,
        evict_save: bool,
        progress: Callable[[int, int], None] | None,
        frontier_every: int | None,
        on_frontier: Callable[[Session], None] | None,
        cancel: Callable[[], bool] | None = None,
    ):
        self.t_start = time.perf_counter()
        self.rep = RecoveryReport()
        self.sess, self.store, self.engine = sess, store, sess.engine
        try:
            if isinstance(prompt_text, str):
                prompt_text.encode("utf-8")
                self.prompt_s = prompt_text  # a keytext.Prompt keeps its spans
            else:
                self.prompt_s = bytes(prompt_text).decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError) as e:  # a lone surrogate, or bytes that are not UTF-8
            raise PromptError(f"the prompt is not valid UTF-8 text: {e.reason} at {e.start}") from None
        self.evict_save = evict_save
        self.evict_tried = False  # see save_evict
        self.progress, self.frontier_every, self.on_frontier = progress, frontier_every, on_frontier
        self.tokens: list[int] = []
        self.prompt_b = b""  # the prompt's key text (in the session's namespace)
        self._cum: list[int] | None = None
        self._found: Candidates | None = None
        self.cancel = cancel
        self.pre = 0  # the length of the namespace's preamble in the key texts
        #: the live tokens and key text the run started from (the text is
        #: rendered only when the tokens are not a prefix of the prompt's)
        self.live_tokens: list[int] | None = None
        self.live_text: bytes | None = None
        self.considered: Entry | None = None  # see found()
        self.loaded: LoadResult | None = None  # the checkpoint the disk rung used

    def found(self) -> Candidates:
        """The store's candidates for this prompt, looked up once."""
        assert self.store is not None
        if self._found is None:
            self._found = self.store.candidates(
                self.prompt_b, ctx=self.sess.ctx, abi=self.sess.payload_abi, namespace=self.sess.namespace
            )
            self.rep.rejected.extend(self._found.rejected)
            self.rep.remote = self._found.remote_state
            # what the lookup considered, before this run stores anything (a
            # pass over the index rows in Python: see DESIGN, "Why a turn missed")
            self.considered = self.store.longest_considered(self._found, ctx=self.sess.ctx)
        return self._found

    def run(self, cold_save: bool) -> RecoveryReport:
        rep = self.climb(cold_save)
        self.divergence()
        return rep

    def climb(self, cold_save: bool) -> RecoveryReport:
        rep, sess = self.rep, self.sess
        t0 = time.perf_counter()
        self.tokens = tokenize_prompt(self.engine, self.prompt_s)
        rep.prompt_tokens = len(self.tokens)
        sess.check_prompt(self.tokens)  # typed error before anything is touched
        self.prompt_b = sess.key_of(self.tokens)
        self.pre = len(sess.key_of(()))
        rep.timings["tokenize_ms"] = (time.perf_counter() - t0) * 1000
        if not sess.canonical:
            # the last reply's unpadded steps prefilled again before its state
            # is compared, extended, rewound or saved: what this turn waited for
            rep.timings["canonicalize_ms"] = sess.canonicalize()
        if sess.checkpoint_valid:
            done = self.live()
            if done is not None:
                return done
        if self.store is not None:
            done = self.disk()
            if done is not None:
                return done
        return self.prefill(cold_save)

    def cum(self) -> list[int]:
        """``cum[i]``: the key length of the prompt's first ``i`` tokens (no
        preamble), computed once."""
        if self._cum is None:
            self._cum = [0, *itertools.accumulate(self.sess.key_renderer.lengths(self.tokens))]
        return self._cum

    def token_check(self, against: str) -> int:
        """The token check behind a text match: how many of the session's
        tokens are the prompt's own (its tokenization, the one a cold
        prefill evaluates), their longest common prefix. A state whose text
        is the prompt's but whose ids are not (a reply the model generated
        as other pieces than the text's tokenization, a cut inside a token)
        is kept only up to there, so the turn equals a cold prefill. A cut
        is in the report (``token_check``) and logged."""
        sess = self.sess
        matched = sess.n_past
        kept = sess.common_prefix(self.tokens)
        if kept < matched:
            self.rep.token_check = {"against": against, "kept": kept, "of": matched}
            self.rep.log_event("ds4 token_check: kept %d of %d (%s)", kept, matched, against)
        return kept

    def finish(self, rung: str, source: str, effective: Sequence[int], reused: int) -> RecoveryReport:
        rep = self.rep
        t = time.perf_counter()
        self.sync(effective, rung, reused)
        rep.timings["prefill_ms"] = (time.perf_counter() - t) * 1000
        rep.rung, rep.source, rep.reused_tokens = rung, source, reused
        rep.prompt_tokens = len(effective)
        rep.timings["total_ms"] = (time.perf_counter() - self.t_start) * 1000
        rep.log_event(
            "ds4 ladder rung=%s source=%s reused=%d prompt=%d prefill=%d rejected=%d total=%.1f ms",
            rung,
            source,
            reused,
            len(effective),
            len(effective) - reused,
            len(rep.rejected),
            rep.timings["total_ms"],
        )
        return rep

    def sync(self, tokens: Sequence[int], rung: str, reused: int) -> None:
        """The session to ``tokens``, the prefill of what ``rung`` did not
        serve (``reused`` tokens); a ``progress`` with a ``serving(rung,
        reused)`` method hears of both first (the CLI's bar shows them), one
        with ``planned(n)`` of the ``n`` tokens to prefill (a server lane's
        place in the baton's order)."""
        serving = getattr(self.progress, "serving", None)
        if callable(serving) and len(tokens) > reused:
            serving(rung, reused)
        planned = getattr(self.progress, "planned", None)  # a server lane's: shortest prefill first
        if callable(planned):
            # what is left: a full prefill's rest after its cold save extends
            # the live state, it does not start over
            n = self.sess.n_past  # 0 when invalid
            have = n if self.sess.common_prefix(tokens) == n else 0
            if len(tokens) > max(reused, have):
                planned(len(tokens) - max(reused, have))
        self.sess.sync(
            tokens,
            progress=self.progress,
            frontier_every=self.frontier_every,
            on_frontier=self.on_frontier,
            cancel=self.cancel,
        )

    def save(self, kind: str, reason: str | None = None) -> str | None:
        """Store the live session as a ``kind`` save (written with ``reason``,
        the kind by default; never raises): its path, or None with why in
        the report's ``save_skipped``."""
        assert self.store is not None
        got = self.store.store_live_checked(self.sess, reason or kind)
        if isinstance(got, str):
            return got
        self.rep.save_skipped.append(got if got.kind == kind else dataclasses.replace(got, kind=kind))
        return None

    def save_prompt(self) -> None:
        """Store the live session at the whole prompt (reason ``continued``)."""
        if self.store is not None:
            self.rep.prompt_saved = self.save("prompt", "continued")

    def save_evict(self, keep: int = 0) -> None:
        """Store the live session before it is replaced (once a run: a
        rewind that failed after its save leaves the same state), then its
        pending frontier when past the ``keep`` tokens a rewind keeps
        (:func:`ds4.frontier.store`)."""
        if self.store is not None and self.evict_save and not self.evict_tried:
            self.evict_tried = True
            self.rep.evict_saved = self.save("evict")
        if self.store is not None and self.evict_save:  # again after a rewind that kept it and then failed
            frontier.store(self.sess, self.store, self.rep, keep=keep)

    # where the prompt left its best candidate ----------------------------------
    def divergence(self) -> None:
        """Set the report's ``divergence``: where the prompt's key text left
        the best candidate the run had, and log it when that was a miss.

        The candidates: the live state the run started from (in the
        prompt's namespace: :func:`switch_namespace` drops any other), the
        checkpoint the disk rung loaded, and the longest checkpoint of the
        namespace the store's lookup considered
        (:meth:`ds4.kvstore.KVStore.longest_considered`, noted at the lookup,
        so nothing this run stores is one; its header and text are read only
        when it could be the best). A live state the prompt holds
        whole (the live rung) is the candidate; otherwise the one the prompt
        follows longest (ties: live, loaded, considered). Nothing is looked
        up again: without a lookup this run (a live hit, no store) only the
        live state is a candidate."""
        rep, prompt = self.rep, self.prompt_b
        best: tuple[int, str, bytes | None] | None = None  # (agreed key bytes, against, its key text)
        token: int | None = None  # the prompt's tokens before the parting, when known without counting
        if rep.rung == "live" and self.live_tokens is not None:
            if self.live_text is None:  # memory-token: the live tokens are the prompt's first ones
                token = len(self.live_tokens)
                agreed = len(prompt) - sum(self.sess.key_renderer.lengths(self.tokens[token:]))
            else:
                agreed = len(self.live_text)
            best = (agreed, "live", None)
        else:
            if self.live_text is not None:
                best = (_core.common_prefix_len(self.live_text, prompt), "live", self.live_text)
            if self.loaded is not None and (best is None or self.loaded.text_bytes > best[0]):
                best = (self.loaded.text_bytes, "checkpoint", None)
            e = self.considered
            if self.store is not None and e is not None and (best is None or e.text_bytes > best[0]):
                text = self.store.stored_text(e, self.sess.namespace)
                if text is not None:
                    agreed = _core.common_prefix_len(text, prompt)
                    if best is None or agreed > best[0]:
                        best = (agreed, "checkpoint", text)
        if best is None:
            return
        agreed, against, cached = best
        whole = cached is None or agreed >= len(cached)
        at = agreed if whole or cached is None else parting(cached, prompt, agreed, self.pre)
        if token is None:
            token = bisect.bisect_right(self.cum(), at - self.pre) - 1
        d = {
            "against": against,
            "token": token,
            "byte": plain_len(prompt, self.pre, at),
            "cached": "" if whole or cached is None else snippet(cached, at, SNIPPET_BYTES),
            "prompt": snippet(prompt, at, SNIPPET_BYTES),
        }
        if not whole:  # a miss inside a known client's per-turn span is named (--prompt-transient-builtin)
            span = (transient_span(cached, at) if cached is not None else None) or transient_span(prompt, at)
            if span is not None:
                d["span"] = span
        rep.divergence = d
        if not whole:
            log.info(
                "kv cache miss at byte %d (token %d) against %s: %s vs %s",
                d["byte"],
                d["token"],
                against,
                json.dumps(d["cached"], ensure_ascii=False),
                json.dumps(d["prompt"], ensure_ascii=False),
            )

    # 1. the live session ---------------------------------------------------
    def live(self) -> RecoveryReport | None:
        sess, tokens, prompt_b = self.sess, self.tokens, self.prompt_b
        live = self.live_tokens = sess.tokens
        if len(tokens) >= len(live) and tokens[: len(live)] == live:
            return self.finish("live", "memory-token", tokens, len(live))
        live_text = self.live_text = sess.key_bytes()
        if len(live_text) <= len(prompt_b) and prompt_b.startswith(live_text):
            # the text matches but the tokens do not: the rewrite below keeps
            # what the token check keeps
            self.token_check("live")
        done = self.rewrite(live)
        if done is not None:
            return done
        # The live state is about to be replaced: save it first.
        self.save_evict()
        return None

    # 2. rewrite to the common prefix ------------------------------------------
    def rewrite(self, live: list[int]) -> RecoveryReport | None:
        sess, tokens, rep = self.sess, self.tokens, self.rep
        common = sess.common_prefix(tokens)
        if 0 < common < len(live) and self.store is not None:
            # A rewind keeps only `common` tokens; a longer verified prefix on
            # disk reuses more (ds4 never rewinds, so it never has to choose).
            longest = self.found().longest()
            common_bytes = len(sess.key_bytes(common))
            if longest > common_bytes:
                rep.log_event("ds4 rewrite skipped: disk holds a longer prefix (%d bytes > %d)", longest, common_bytes)
                common = -1
        if common == 0:
            rep.log_event(
                "ds4 live kv cache miss live=%d prompt=%d common=0 reason=token-mismatch", len(live), len(tokens)
            )
        if common <= 0:
            return None
        if common < len(live):
            # A rewind discards the live tokens past `common`: save them
            # first, as ds4 does before any live state is replaced (ds4
            # cannot rewind, so for it this case is a plain miss).
            self.save_evict(keep=common)
        t = time.perf_counter()
        r = sess.rewrite_from_common(tokens)
        rep.timings["rewrite_ms"] = (time.perf_counter() - t) * 1000
        if r is Rewrite.OK:
            snap = rep.snapshot = sess.last_snapshot
            reused = common if snap is None else snap
            rep.rung, rep.source, rep.reused_tokens = "rewrite", "memory-rewind" if snap is None else "snapshot", reused
            rep.timings["total_ms"] = (time.perf_counter() - self.t_start) * 1000
            if snap is None:
                rep.log_event("ds4 ladder rung=rewrite reused=%d prompt=%d", common, len(tokens))
            else:
                rep.log_event("ds4 ladder rung=rewrite reused=%d prompt=%d snapshot=%d", reused, len(tokens), snap)
            return rep
        rep.log_event(
            "ds4 live kv cache miss live=%d prompt=%d common=%d reason=%s",
            len(live),
            len(tokens),
            common,
            sess.last_error or r.value,
        )
        return None

    # 3. disk ---------------------------------------------------------------
    def disk(self) -> RecoveryReport | None:
        assert self.store is not None
        sess, rep = self.sess, self.rep
        t = time.perf_counter()
        res = load_first(self.store, sess, self.found(), report=rep)
        rep.timings["disk_ms"] = (time.perf_counter() - t) * 1000
        while res is not None:
            rung = "remote" if res.tier == "remote" else "disk"
            kept = self.token_check(rung)
            if kept == res.tokens or self.cut(kept):
                rep.loaded_path, self.loaded = res.path, res
                return self.finish(rung, f"{rung}-text", self.tokens, kept)
            # a shorter checkpoint may end where the tokens still agree
            # (a turn's prompt, before a reply the check cut)
            rep.log_event("ds4 token_check: the loaded state cannot be cut to %d tokens; next checkpoint", kept)
            sess.invalidate("the token check cut a state that cannot rewind")
            t = time.perf_counter()
            res = load_shorter(self.store, sess, self.found(), res.text_bytes, report=rep)
            rep.timings["disk_ms"] += (time.perf_counter() - t) * 1000
        return None

    def cut(self, kept: int) -> bool:
        """Rewind a loaded state to the ``kept`` tokens the token check
        kept (the engine's rewind, else a RAM snapshot); False when neither
        can (the caller drops the state)."""
        try:
            return kept > 0 and self.sess.rewind(kept)
        except Exception as e:  # the session is invalid
            self.rep.log_event("ds4 token_check: the rewind to %d tokens failed: %s", kept, e)
            return False

    # 4. full prefill (with ds4's cold save on the way) -------------------------
    def prefill(self, cold_save: bool) -> RecoveryReport:
        sess, store, tokens = self.sess, self.store, self.tokens
        sess.invalidate("full prefill")
        if store is not None and cold_save and store.cold_max_tokens > 0:  # 0: no cold saves
            cold_len = self.cold_len(store)
            if cold_len is not None:
                self.sync(tokens[:cold_len], "prefill", 0)
                self.rep.cold_saved = self.save("cold")
        return self.finish("prefill", "full", tokens, 0)

    def cold_len(self, store: KVStore) -> int | None:
        """Where the cold save goes (:meth:`ds4.kvstore.StorePolicy.cold_store_at`,
        on the key rendering: a marker typed as text is no anchor); None, with
        why in the report, for a prompt too long or too short for one."""
        pol, n = store.policy, len(self.tokens)
        too_long = n > pol.cold_max_tokens
        at = None if too_long else pol.cold_store_at(self.tokens, self.sess.key_renderer.piece)
        if at is None:
            skip = (
                cold_too_long(n, pol.cold_max_tokens)
                if too_long
                else cold_too_short(n, pol.min_tokens, pol.boundary_trim_tokens)
            )
            log.info("kv cache %s", skip)
            self.rep.save_skipped.append(skip)
        return at
