"""The worker: a FIFO queue of jobs and the lanes that own the live
sessions (the :class:`ds4.server.pool.Pool` of :class:`ds4.turn.TurnDriver`
residents, one by default; the pool picks which serves a job). HTTP handlers submit jobs and
relay the events the worker posts back (``start``, ``text`` pieces, then
``done`` or ``error``). Jobs start in arrival order. With one resident
(the default) one lane serves them one at a time; with N, N lanes serve up
to N jobs at once, each on its own resident, taking turns token by token
and prefill chunk by chunk (:class:`ds4.server.baton.Baton`: one lane at a
time touches the engine, the sessions and the store), so a long generation
does not hold a short turn behind it. The worker knows nothing of HTTP:
refusals are typed (:class:`QueueFull`, :class:`ShuttingDown`) and the
protocol modules turn them into responses.

A job whose client left while it was queued is skipped; a job whose client
leaves while it runs stops at the next token (its cancel flag is checked
before every token), and the session stays valid at exactly the tokens
evaluated. On shutdown the queue is drained and every valid resident
stored (reason ``shutdown``), unlike ds4.

Besides the server-wide counters (the generator's) and the snapshot of the
session and the store (:attr:`Service.status`, the operator's ``/health``),
the worker counts each tenant's own jobs (:meth:`Service.tenant_counters`):
what a tenant's ``/health`` shows, which moves with its own requests only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _core
from ..errors import PromptError
from ..keytext import tokenize_prompt
from ..recovery import RecoveryReport
from ..report import scoped_divergence
from ..turn import GenParams, GenResult, TurnDriver
from .baton import Baton
from .hints import hint_digest
from .pool import MIN_SHARED, Pool, Resident
from .tenants import ANONYMOUS
from .work import TextPrompt, Work

if TYPE_CHECKING:
    pass

log = logging.getLogger("ds4.server")

__all__ = [
    "TENANT_COUNTERS",
    "Cancelled",
    "Job",
    "ProgressLog",
    "QueueFull",
    "Service",
    "ShuttingDown",
    "TextPrompt",
    "Work",
]

#: a tenant's own counters: ``requests`` (its jobs the worker took, refused
#: and cancelled ones included), ``cancelled`` (its client left), ``rejected``
#: (a 4xx), ``errors`` (a 5xx), and the tokens of its turns
TENANT_COUNTERS = (
    "requests",
    "cancelled",
    "rejected",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
)


class Cancelled(Exception):
    """The job was cancelled (client gone) before it started."""


class QueueFull(Exception):
    """Too many jobs are waiting."""

    def __init__(self, pending: int):
        super().__init__(f"too many queued requests ({pending})")
        self.pending = pending


class ShuttingDown(Exception):
    """The service takes no more jobs."""


_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Job:
    """One turn to run: its :class:`Work`, how to generate, and whose it is.
    ``post(kind, value)`` delivers events to the handler."""

    work: Work
    params: GenParams
    post: Callable[[str, Any], None]
    namespace: str | None = None  # the tenant's cache namespace (ds4.server.tenants)
    tenant: str = ANONYMOUS  # whose job: its counters (Service.tenant_counters)
    hint: str | None = None  # the client's session hint (ds4.server.pool): which resident, never the rung
    operator: bool = False  # the operator's request (an --admin-tenant key, or no keys): sees every text
    id: int = dataclasses.field(default_factory=lambda: next(_ids), init=False)
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event, init=False)
    #: when the request arrived (its TTFT counts from here, the queue included)
    t_arrival: float = dataclasses.field(default_factory=time.perf_counter, init=False)


_SHUTDOWN = object()


class _LaneProgress:
    """A lane's prefill progress: logged (:class:`ProgressLog`) and told to
    the baton, which lets the prefill nearest to its first token go first
    (:mod:`ds4.server.baton`): its size before the first chunk
    (``planned``), what is left after each."""

    def __init__(self, label: str, baton: Baton, arrival: float):
        self.log, self.baton, self.arrival = ProgressLog(label), baton, arrival

    def planned(self, n: int) -> None:
        self.baton.mark(n, self.arrival)

    def __call__(self, done: int, total: int) -> None:
        self.log(done, total)
        self.baton.mark(total - done if done < total else None, self.arrival)


class ProgressLog:
    """Logs ds4-style prefill progress lines, at most one every ``every`` s."""

    def __init__(self, label: str, every: float = 2.0):
        self.label, self.every = label, every
        self.t0 = time.perf_counter()
        self.last = self.t0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            el = now - self.t0
            log.info(
                "%s prefill %d/%d (%.1f%%) avg=%.1f t/s %.1fs",
                self.label,
                done,
                total,
                100.0 * done / max(1, total),
                done / max(el, 1e-9),
                el,
            )


class Service:
    """A FIFO queue of jobs and the worker lanes that run them (one per
    resident session)."""

    def __init__(self, generator: TurnDriver, model_id: str, *, max_queue: int = 64, pool: Pool | None = None):
        self.gen = generator  # the first resident: the engine, the store, the context (the front end's)
        self.pool = pool if pool is not None else Pool(generator)
        self.model_id = model_id
        self.max_queue = max_queue
        #: which divergence texts a client sees: "off", "own" or "all" (--divergence-text)
        self.divergence_text = "own"
        self._q: queue.Queue[object] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        self.started = time.time()
        self.busy_s = 0.0  # seconds of jobs, summed over lanes (ds4_worker_busy_seconds_total)
        # tenant -> its counters; a tenant's dict is replaced whole, never
        # changed in place, so a reader on another thread sees one job's end
        self._by_tenant: dict[str, dict[str, int]] = {}
        #: which level of the cache served each turn (the rung: live, rewrite, disk, remote, prefill)
        self.levels: dict[str, int] = {}
        # a prefill's last piece goes like a decode step (ds4.server.baton)
        self.baton = Baton(join=self.pool.residents[0].gen.sess.prefill_chunk)
        self._running = 0  # jobs being served (under the baton)
        #: the prompts being prefilled, by job id: (namespace, prompt bytes,
        #: set once prefilled, the resident prefilling it)
        self._prefills: dict[int, tuple[str | None, bytes, threading.Event, Resident]] = {}
        if self.pool.shared is not None:
            # a decode step posts its token and hands over: the other lanes
            # post theirs, and one llama_decode runs them all
            self.pool.shared.handover = self.baton.pass_
        self.status = self._snapshot()
        n = self.pool.size
        self._lanes = [
            threading.Thread(target=self._run, name="ds4-worker" if n == 1 else f"ds4-worker-{k}", daemon=True)
            for k in range(n)
        ]
        for t in self._lanes:
            t.start()

    def _snapshot(self) -> dict[str, Any]:
        g = self.gen
        st: dict[str, Any] = {
            "busy": self._running > 0,
            "running": self._running,
            "levels": dict(self.levels),
            "session": {"valid": g.sess.checkpoint_valid, "n_past": g.sess.n_past, "ctx": g.sess.ctx},
            "counters": dict(g.counters),
        }
        if g.store is not None:
            st["kv"] = g.store.summary()
        if self.pool.size > 1:
            st["sessions"] = self.pool.views()
            st["hints"] = self.pool.hints.stats()  # the routing hints kept (bounded: server/hints.py)
        if self.pool.shared is not None:
            st["batched"] = self.pool.shared.view()
        return st

    def tenant_counters(self, tenant: str) -> dict[str, int]:
        """``tenant``'s own counters (zeros before its first job)."""
        return dict(self._by_tenant.get(tenant) or dict.fromkeys(TENANT_COUNTERS, 0))

    def all_tenant_counters(self) -> dict[str, dict[str, int]]:
        """Every tenant's counters that has had a job (the operator's view)."""
        return {t: dict(c) for t, c in sorted(self._by_tenant.copy().items())}

    def _count(self, job: Job, outcome: str | None, res: GenResult | None = None) -> None:
        """Count ``job`` for its tenant: one request, its ``outcome``
        counter (``cancelled``, ``rejected``, ``errors``; None: answered)
        and its tokens."""
        c = self.tenant_counters(job.tenant)
        c["requests"] += 1
        if outcome is not None:
            c[outcome] += 1
        if res is not None:
            c["prompt_tokens"] += res.prompt_tokens
            c["cached_tokens"] += res.cached_tokens
            c["completion_tokens"] += res.completion_tokens
        self._by_tenant[job.tenant] = c

    @property
    def queued(self) -> int:
        return self._pending

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`ShuttingDown` or :class:`QueueFull`."""
        with self._lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if self._pending >= self.max_queue:
                raise QueueFull(self._pending)
            self._pending += 1
        self._q.put(job)

    def close(self) -> None:
        """Drain the queue, store every valid resident (``shutdown``), stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._lanes:  # behind every queued job: each lane serves its share, then stops
            self._q.put(_SHUTDOWN)
        for t in self._lanes:
            t.join()
        with self.baton:
            self.pool.shutdown_save()  # every valid resident (one by default: --sessions 1)
            if self.gen.store is not None:
                self.gen.store.close()  # the shared tier's queued uploads, then its connections
            self.status = self._snapshot()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if not isinstance(job, Job):  # the shutdown marker
                return
            with self._lock:
                self._pending -= 1
            with self.baton:
                self._running += 1
                t0 = time.perf_counter()
                try:
                    self._serve(job)
                except BaseException:  # pragma: no cover - never let the worker die
                    log.exception("worker failed on job %d", job.id)
                finally:
                    self._running -= 1
                    self.busy_s += time.perf_counter() - t0  # under the baton: one lane at a time
                    self.status = self._snapshot()

    def _turns(self, job: Job) -> Callable[[], bool]:
        """The job's cancel check, asked before every token and prefill
        chunk: where its lane hands the baton to a waiting one."""

        def check() -> bool:
            self.baton.pass_()
            return job.cancel.is_set()

        return check

    def _named(self, rep: RecoveryReport, r: Resident) -> RecoveryReport:
        """A live hit of a pool names its resident (``source``: ``session
        K``), and the one it copied its prefix from (``session K, copied
        from session J``)."""
        if self.pool.size > 1 and rep.rung == "live":
            rep.source = f"session {r.index}"
            if r.copied_from is not None:
                rep.source += f", copied from session {r.copied_from}"
        return rep

    def _serve(self, job: Job) -> None:
        if job.cancel.is_set():
            log.info("job %d skipped: client disconnected while queued", job.id)
            self._count(job, "cancelled")
            job.post("error", Cancelled())
            return
        self.status = self._snapshot()
        try:
            # which resident (one by default; never one another lane is
            # serving); an agent turn's live tool state only in its
            # namespace, the resident's own
            resident, prompt = self.pool.route(job.work, job.namespace, job.hint)
        except Exception as e:
            self._failed(job, e)
            return
        try:
            self._serve_on(job, resident, prompt)
            self._canonicalize(resident)
        finally:
            self.pool.release(resident)  # after the done hook: it may still extend the resident's state

    @staticmethod
    def _canonicalize(resident: Resident) -> None:
        """The reply is sent: its unpadded decode steps are prefilled again
        now (llama.cpp's canonical mode), while the client reads it or runs
        its tools, not when its next turn comes (a job that arrives first
        waits for this, queued behind it)."""
        sess = resident.gen.sess
        if sess.canonical:
            return
        try:
            log.debug("session %d made canonical in %.1f ms", resident.index, sess.canonicalize())
        except Exception:  # the session is invalid: the next turn rebuilds it
            log.exception("canonicalizing session %d failed", resident.index)

    def _failed(self, job: Job, e: Exception) -> None:
        if isinstance(e, PromptError):
            # the client's fault, typed where the input was judged (the turn's
            # refusals, the agent turn's LiveStateGone): nothing was touched
            self.gen.counters["rejected"] += 1
            self._count(job, "rejected")
        else:  # anything else is ours (a ValueError of a bug included): a 5xx
            self.gen.counters["errors"] += 1
            self._count(job, "errors")
            log.exception("job %d failed", job.id, exc_info=e)
        job.post("error", e)

    def _serve_on(self, job: Job, resident: Resident, prompt: str) -> None:
        prev, resident.owner = resident.owner, None  # until this turn is served whole
        try:
            res = self._generate(job, resident, prompt)
        except Exception as e:
            self._failed(job, e)
            return
        key = hint_digest(job.hint)
        owner = None if key is None else (job.namespace, key)
        own = job.operator or (prev is not None and prev == owner)
        res.report.divergence = scoped_divergence(res.report.divergence, self.divergence_text, own)
        resident.owner = owner
        gen = resident.gen
        self._count(job, "cancelled" if res.finish_reason == "cancelled" else None, res)
        if res.finish_reason == "cancelled":
            log.info(
                "job %d: client disconnected; stopped after %d tokens (session %s at %d tokens)",
                job.id,
                res.completion_tokens,
                "valid" if gen.sess.checkpoint_valid else "invalid",
                gen.sess.n_past,
            )
        else:
            try:
                job.work.done(res)  # an agent turn's parse, canonicalize: before the final event
            except Exception:  # the reply still goes out (as text)
                log.exception("job %d: the agent turn's done hook failed", job.id)
        job.post("done", res)

    def _behind_sibling(self, job: Job, resident: Resident, pb: bytes) -> Resident | None:
        """A job about to prefill a prompt that another lane is prefilling
        the start of (a shared system prompt: agents starting together)
        waits, without the baton, until that prefill is done, instead of
        both prefilling the same tokens side by side (``pb``: the prompt's
        bytes); the resident that prefilled it, or None (no wait)."""
        if resident.pick not in ("free", "lru", "hint") or resident.gen.store is None:
            return None
        best, ev, sibling = 0, None, None
        for ns, other, done, r in self._prefills.values():
            n = _core.common_prefix_len(other, pb) if ns == job.namespace else 0
            if n > best:
                best, ev, sibling = n, done, r
        if ev is None or 2 * best < len(pb):
            return None
        log.info("job %d waits for another lane's prefill of its first %d bytes", job.id, best)
        self.baton.release()
        try:
            while not ev.wait(0.05) and not job.cancel.is_set():
                pass
        finally:
            self.baton.acquire()
        return sibling

    def _take_prefix(self, job: Job, resident: Resident, sibling: Resident, prompt: str) -> None:
        """After the wait, a free resident takes the prefix its prompt shares
        with the sibling's live state from RAM (``Session.adopt_prefix``: a
        batched context's sequences copy it, as a cold prefill would hold
        it), the tokens one session's rewind would keep; the ladder then
        extends it (rung ``live``). Where the engine cannot copy, the
        ladder loads the sibling's cold checkpoint, as before."""
        mine, theirs = resident.gen.sess, sibling.gen.sess
        if resident.pick != "free" or mine.checkpoint_valid or mine.n_past or theirs.namespace != job.namespace:
            return
        tokens = tokenize_prompt(mine.engine, prompt)
        n = theirs.common_prefix(tokens)
        if n < MIN_SHARED or not mine.adopt_prefix(theirs, n):
            return
        resident.copied_from = sibling.index
        log.info("job %d: session %d took %d tokens from session %d", job.id, resident.index, n, sibling.index)

    @staticmethod
    def _copy_routed(job: Job, resident: Resident) -> None:
        """A job routed ``copied`` (:mod:`ds4.server.pool`, rule 4): the free
        resident takes the prefix it shares with the holder's live state
        from RAM before the ladder runs (rung ``live`` then); the holder
        keeps its conversation. Where the copy fails the ladder goes on as
        for any free resident."""
        src, resident.copy_source = resident.copy_source, None
        if src is None:
            return
        holder, n = src
        mine = resident.gen.sess
        if mine.checkpoint_valid or mine.n_past or holder.gen.sess.namespace != job.namespace:
            return
        try:
            ok = mine.adopt_prefix(holder.gen.sess, n)
        except Exception:  # the free resident is invalid: the ladder rebuilds it
            log.exception("job %d: copying session %d's prefix failed", job.id, holder.index)
            return
        if ok:
            resident.copied_from = holder.index
            log.info("job %d: session %d took %d tokens from session %d", job.id, resident.index, n, holder.index)

    def _generate(self, job: Job, resident: Resident, prompt: str) -> GenResult:
        prefilled = threading.Event()
        resident.copied_from = None
        self._copy_routed(job, resident)
        if self.pool.size > 1:  # one lane has no sibling to wait for, nor to be waited for
            pb = prompt.encode("utf-8", "surrogatepass")
            sibling = self._behind_sibling(job, resident, pb)
            if sibling is not None:
                self._take_prefix(job, resident, sibling, prompt)
            self._prefills[job.id] = (job.namespace, pb, prefilled, resident)

        def on_start(rep: RecoveryReport) -> None:
            prefilled.set()
            self.baton.mark(None)  # decoding: never held behind another's prefill for more than a chunk
            job.post("start", self._named(rep, resident))

        progress = _LaneProgress(f"job {job.id}", self.baton, job.t_arrival)

        t_start = time.perf_counter()
        try:
            res = resident.gen.generate(
                prompt,
                job.params,
                namespace=job.namespace,
                on_start=on_start,
                on_text=lambda s: job.post("text", s),
                cancel=self._turns(job),
                progress=progress,
            )
        finally:
            self.baton.mark(None)
            prefilled.set()
            self._prefills.pop(job.id, None)
        res.queued(t_start - job.t_arrival)  # the queue, a sibling's prefill, the route: from arrival
        rung = res.report.rung
        self.levels = {**self.levels, rung: self.levels.get(rung, 0) + 1}
        resident.last_rung = rung
        return res
