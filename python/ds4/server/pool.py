"""The pool of resident sessions (``ds4 serve --sessions N``): N live
sessions, each its own :class:`ds4.turn.TurnDriver` (its own
:class:`ds4.Session` and engine context) over the one engine and the one
store, each with its own live tool state (:class:`LiveTools`). The worker
runs one lane per resident (:mod:`ds4.server.worker`); the pool decides
*which* resident serves a job (:meth:`Pool.route`), never one that another
lane is serving (``busy``), in this order:

1. a tool-result continuation goes to the resident that generated the calls
   (its live tool state names them and it still holds that turn, in the
   request's namespace);
2. a resident of the request's namespace whose whole live state the prompt
   starts with (a live hit), the longest;
3. the resident the request's hint (``X-Session-Id``, ``prompt_cache_key``,
   ``user``, Anthropic's ``metadata.user_id``) last served, when it is still
   in the request's namespace: a hint only picks, the ladder still decides
   the rung, so a wrong hint costs time, never correctness;
4. the idle resident of the request's namespace that shares the longest
   prefix with the prompt (by tokens, at least :data:`MIN_SHARED` of them;
   the least recently used among equals): when a free (empty) resident
   exists and the engine can copy a prefix from RAM, the free one takes a
   copy of it (``copied``: the holder keeps its own conversation live);
   when no resident is empty, the holder itself (``shared``: a state is
   lost anyway, and this one's prefix saves its prefill; the ladder's
   rewrite rung keeps it, the tokens past it saved first, reason
   ``evict``). An empty resident is never passed over for a holder that
   cannot be copied: its live state (a tool loop's, a live-only
   continuation's) would be lost for a prefill the disk may save.
   Prefill saved against state lost, no other threshold;
5. a free (empty) resident;
6. the least recently used one: the ladder saves its state first (reason
   ``evict``, as one session's switch does), then reuses it.

Tenants and cache salts never share a resident's state: only a resident
whose ``sess.namespace`` is the request's can be a live hit or a hint's
pick, and a resident taken over by another namespace is saved and switched
(:func:`ds4.recovery.switch_namespace`). With one resident (``--sessions 1``)
:meth:`Pool.route` renders the job's prompt and returns it: today's server.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import _core
from ..keytext import tokenize_prompt
from ..turn import TurnDriver
from .conversation import AgentTurn, LiveTools
from .hints import MAX_HINT_BYTES, HintTable
from .tenants import ANONYMOUS

if TYPE_CHECKING:
    from .work import Work

log = logging.getLogger("ds4.server")

__all__ = ["HINT_HEADER", "Pool", "Resident", "body_hint", "usable_hint"]

#: the request header that names a client's session (a routing hint)
HINT_HEADER = "x-session-id"
#: the fewest shared tokens rule 4 acts on (fewer: a chat template's preamble)
MIN_SHARED = 16


def usable_hint(v: object) -> str | None:
    """``v`` when it can be a routing hint: a string of 1 to
    :data:`MAX_HINT_BYTES` UTF-8 bytes (checked without encoding a long
    one); anything else None, so a long hint is dropped where it is read
    and never travels with the job."""
    if not isinstance(v, str) or not v or len(v) > MAX_HINT_BYTES:
        return None
    return v if len(v.encode("utf-8", "surrogatepass")) <= MAX_HINT_BYTES else None


def body_hint(body: object) -> str | None:
    """A request body's routing hint: OpenAI's ``prompt_cache_key``, then
    ``user``, then Anthropic's ``metadata.user_id`` (strings of at most
    :data:`MAX_HINT_BYTES` UTF-8 bytes; a longer one is no hint)."""
    if not isinstance(body, Mapping):
        return None
    for v in (body.get("prompt_cache_key"), body.get("user")):
        if isinstance(v, str) and v:
            return usable_hint(v)
    meta = body.get("metadata")
    return usable_hint(meta.get("user_id") if isinstance(meta, Mapping) else None)


@dataclasses.dataclass(eq=False)
class Resident:
    """One resident session: its generator, its live tool state, and when
    it last served."""

    index: int
    gen: TurnDriver
    live: LiveTools
    last_used: float = 0.0
    served: int = 0
    busy: bool = False  # a lane is serving a job on it
    #: why the last job was routed here: "only" (a pool of one), "continuation",
    #: "live", "hint", "copied" or "shared" (rule 4), "free" or "lru"
    pick: str = "only"
    last_rung: str | None = None  # the cache level that served its last turn
    #: the resident its current turn copied its prefix from (a shared prefill), or None
    copied_from: int | None = None
    #: routed as ``copied``: the resident and token count to copy before the turn
    copy_source: tuple[Resident, int] | None = None
    #: whose conversation the live state holds: (namespace, the hint's
    #: digest) of the last turn served whole, None without a hint
    #: (``--divergence-text own``)
    owner: tuple[str | None, bytes] | None = None

    def view(self) -> dict[str, Any]:
        """The operator's line for it (``/health``)."""
        sess = self.gen.sess
        return {
            "index": self.index,
            # the namespace's tenant (a cache salt's digest left out): the operator's view only
            "tenant": ANONYMOUS if sess.namespace is None else sess.namespace.split("/salt-")[0],
            "valid": sess.checkpoint_valid,
            "tokens": sess.n_past,
            "served": self.served,
            "busy": self.busy,
            "last_rung": self.last_rung,
            "last_used": round(self.last_used, 3) if self.last_used else None,
        }


class Pool:
    """The residents and the routing rule (module docstring). Used by the
    worker thread only; :meth:`views` is read from the event loop (a copy
    of plain values)."""

    def __init__(
        self,
        primary: TurnDriver,
        size: int = 1,
        live: LiveTools | None = None,
        *,
        batched: bool = False,
        batch_prefill: bool = False,
        batch_always: bool = False,
    ):
        if size < 1:
            raise ValueError(f"a pool needs at least one session, got {size}")
        self.residents = [Resident(0, primary, live or LiveTools())]
        for k in range(1, size):
            # opened at first need (or never: a batched pool's residents adopt
            # its one context): the server answers sooner after a start
            g = TurnDriver(primary.engine, primary.ctx, primary.store, lazy=True)
            g.counters = primary.counters  # one set of server-wide counters
            snaps = primary.sess.snapshots  # each resident keeps its own, under the same budget
            g.sess.snapshots.configure(snaps.count, snaps.max_bytes / 2**20, snaps.every)
            self.residents.append(Resident(k, g, LiveTools()))
        self.hints = HintTable()  # bounded: ds4.server.hints
        #: the residents' one batched context (``--batch-decode``), or None:
        #: each decodes in its own context
        self.shared: Any = None
        if batched and size > 1:
            self._share(batch_prefill, batch_always)

    def _share(self, batch_prefill: bool, always: bool) -> None:
        """Put the residents on one context whose decode steps (and, with
        ``batch_prefill``, prefill pieces) are batched, where the engine has
        one that is exact and, unless ``always``, worth it (else each keeps
        its own)."""
        make = getattr(self.residents[0].gen.engine, "batched_contexts", None)
        shared = make(self.size, self.residents[0].gen.sess.ctx, always=always) if make is not None else None
        if shared is None:
            log.info("batched decode: not available on this engine; each resident decodes on its own")
            return
        for r, c in zip(self.residents, shared.contexts, strict=True):
            r.gen.sess.adopt_context(c)
        shared.batch_prefill = batch_prefill
        self.shared = shared
        what = "step and prefill piece" if batch_prefill else "step"
        log.info("batched decode: %d residents in one context, one llama_decode per %s", self.size, what)

    @property
    def size(self) -> int:
        return len(self.residents)

    def views(self) -> list[dict[str, Any]]:
        return [r.view() for r in self.residents]

    # -- routing -------------------------------------------------------------
    def route(self, work: Work, namespace: str | None, hint: str | None = None) -> tuple[Resident, str]:
        """The resident that serves ``work`` and the prompt rendered for it
        (an agent turn bound to that resident's generator and live tool
        state). A refusal raised by the rendering (a continuation whose
        state no resident holds) leaves every resident untouched."""
        if self.size == 1:
            r = self.residents[0]
            prompt = work.render(r.gen.engine, namespace)  # a refusal leaves the resident free
            r.pick = "only"
            return self._used(r, namespace, hint), prompt
        cont = self._continuing(work, namespace)
        if cont is not None:
            _bind(work, cont)
            prompt = work.render(cont.gen.engine, namespace)
            cont.pick = "continuation"
            return self._used(cont, namespace, hint), prompt
        engine = self.residents[0].gen.engine
        if isinstance(work, AgentTurn):  # no resident's live tool state: the plain rendering
            work.gen, work.live = self.residents[0].gen, LiveTools()
        prompt = work.render(engine, namespace)
        chosen, pick = self._choose(prompt, namespace, hint)
        chosen.pick = pick
        _bind(work, chosen)
        return self._used(chosen, namespace, hint), prompt

    def _continuing(self, work: Work, namespace: str | None) -> Resident | None:
        """The resident whose live tool state the request's trailing tool
        results answer, still holding that turn in ``namespace``."""
        if not isinstance(work, AgentTurn):
            return None
        ids = frozenset(m.tool_call_id or "" for m in work.conv.trailing_results())
        if not ids:
            return None
        for r in self._idle():
            sess = r.gen.sess
            if r.live.ids == ids and sess.namespace == namespace and sess.checkpoint_valid:
                if sess.key_bytes() == r.live.key:
                    log.info("pool: continuation of session %d's tool calls", r.index)
                    return r
        return None

    def _idle(self) -> list[Resident]:
        """The residents no lane is serving (never empty when a lane asks:
        there are as many residents as lanes)."""
        return [r for r in self.residents if not r.busy]

    def _choose(self, prompt: str, namespace: str | None, hint: str | None) -> tuple[Resident, str]:
        idle = self._idle()
        for r in idle:
            r.copy_source = None
        mine = [r for r in idle if r.gen.sess.namespace == namespace and r.gen.sess.checkpoint_valid]
        best, shared = _longest_live(mine, prompt) if mine else (None, None)
        if best is not None:
            return best, "live"
        k = self.hints.get(namespace, hint)
        if k is not None and not self.residents[k].busy and self.residents[k].gen.sess.namespace == namespace:
            log.info("pool: hint picks session %d", k)
            return self.residents[k], "hint"
        free = [r for r in idle if not r.gen.sess.checkpoint_valid]
        if shared is not None:
            holder, n = shared
            lost = holder.gen.sess.n_past - n
            if free and _can_copy(free[0], holder):
                to = min(free, key=lambda r: r.index)
                to.copy_source = (holder, n)
                log.info("pool: session %d takes a copy of session %d's %d shared tokens", to.index, holder.index, n)
                return to, "copied"
            if not free:  # something is lost anyway: the share saves its prefill
                log.info(
                    "pool: session %d shares this conversation's %d tokens (%d past them saved first)",
                    holder.index,
                    n,
                    lost,
                )
                return holder, "shared"
        if free:
            return min(free, key=lambda r: r.index), "free"
        lru = min(idle, key=lambda r: r.last_used)
        log.info("pool: session %d (least recently used, %d tokens) reused", lru.index, lru.gen.sess.n_past)
        return lru, "lru"

    def _used(self, r: Resident, namespace: str | None, hint: str | None) -> Resident:
        r.busy = True
        r.last_used = time.time()
        r.served += 1
        if hint and self.size > 1:
            self.hints.put(namespace, hint, r.index)
        return r

    def release(self, r: Resident) -> None:
        """The job on ``r`` is over: another lane may route to it."""
        r.busy = False

    # -- shutdown --------------------------------------------------------------
    def shutdown_save(self) -> None:
        """Store every valid resident (reason ``shutdown``), the least
        recently used first; never raises. The last one stored is the
        resident a request was routed to last: the store's eviction never
        removes the file it has just written, so when the budget cannot
        hold every resident's state, an older resident's save cannot evict
        the most recent conversation's."""
        for r in sorted(self.residents, key=lambda r: r.last_used):
            try:
                r.gen.shutdown_save()
            except Exception:  # pragma: no cover - defensive
                log.exception("shutdown save of session %d failed", r.index)


def _bind(work: Work, r: Resident) -> None:
    if isinstance(work, AgentTurn):
        work.gen, work.live = r.gen, r.live


def _can_copy(to: Resident, holder: Resident) -> bool:
    """Whether ``to``'s engine context can take a prefix of ``holder``'s
    from RAM (``copy_prefix``: llama.cpp's contexts of one engine; the
    reference engine's cannot)."""
    eng = to.gen.engine
    return eng is holder.gen.engine and bool(getattr(eng, "can_copy_prefix", False))


def _longest_live(mine: list[Resident], prompt: str) -> tuple[Resident | None, tuple[Resident, int] | None]:
    """The resident whose whole live state ``prompt`` starts with (by
    tokens, or by key text as the live rung compares), the longest; and,
    when there is none, the one sharing the longest prefix of tokens with
    the prompt (at least :data:`MIN_SHARED`; the lowest index among equals)
    and that count, or None."""
    sess0 = mine[0].gen.sess
    tokens = tokenize_prompt(sess0.engine, prompt)
    key = sess0.key_of(tokens)  # one namespace: one preamble
    best, best_n = None, 0
    shared: list[tuple[int, Resident]] = []
    for r in mine:
        sess = r.gen.sess
        live = sess.tokens
        whole = len(live) <= len(tokens) and tokens[: len(live)] == live
        if not whole:
            live_key = sess.key_bytes()
            whole = _core.common_prefix_len(live_key, key) == len(live_key)
        if whole and len(live) > best_n:
            best, best_n = r, len(live)
        elif not whole:
            shared.append((sess.common_prefix(tokens), r))
    if best is not None:
        log.info("pool: live prefix of session %d (%d tokens)", best.index, best_n)
        return best, None
    if not shared:
        return None, None
    n, r = max(shared, key=lambda x: (x[0], -x[1].last_used))  # among equals, the least recently used
    return None, ((r, n) if n >= MIN_SHARED else None)
