"""``GET /metrics``: the server's figures in the Prometheus text format,
through the maintained ``prometheus_client`` library (``pip install
'ds4[metrics]'``), one :class:`~prometheus_client.CollectorRegistry` per
server (never the process's default one: several servers share a test
process).

Two kinds of series:

* **Per request**, observed as the worker posts a job's last event
  (:meth:`Metrics.observer`: one call per event, in the worker thread,
  before the reply goes out; a few counter increments under
  ``prometheus_client``'s own short locks): requests and tokens by protocol
  and rung, failed requests by reason, TTFT and total latency histograms,
  the checkpoints each turn loaded, saved and rejected (by stage and code),
  and the saves it did not make (by kind and code, with their counts by
  code for the web page: :attr:`Metrics.skipped_by_code`).
  The same observation keeps the recent turns the web page shows
  (:class:`Turns`).
* **Read at scrape time** (:class:`_Snapshot`, a custom collector) from what
  the worker already publishes without a lock: its status snapshot (taken
  after each job: the store's summary, the shared tier's state and
  counters, the server-wide counters), the queue's length, the busy time,
  and each tenant's counters. A scrape never takes a lock the worker holds.

No label carries prompt text, a file path or a key: protocols, rungs,
reasons, stages and codes are fixed words, and tenants are the operator's
names (or ``key-`` digests, never the key).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import PromptError

if TYPE_CHECKING:
    from ..turn import GenResult
    from .worker import Service

log = logging.getLogger("ds4.server")

__all__ = ["LATENCY_BUCKETS", "PROTOCOLS", "Metrics", "Turns", "protocol_of"]

#: the protocol label of each route that runs a turn
PROTOCOLS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
#: seconds: the TTFT and total latency histograms' upper bounds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: the shared tier's states (one gauge each, 1 for the current one)
REMOTE_STATES = ("up", "degraded", "cooldown", "closed")
#: the store's eviction counters, by the reason the metric says
_EVICTIONS = {"budget": "evictions", "superseded": "superseded", "corrupt": "removed_corrupt"}
#: the shared tier's counters shown as ``ds4_kv_remote_<name>_total``
_REMOTE_COUNTERS = ("lookups", "hits", "rejected", "uploads", "upload_failed", "upload_dropped", "errors", "cooldowns")


def protocol_of(path: str) -> str:
    """The protocol label of a request path (``other`` for none of ours)."""
    return PROTOCOLS.get(path, "other")


def _failure(err: BaseException) -> str:
    """Why a request got no turn: ``cancelled`` (its client left while it
    was queued), ``rejected`` (a 4xx the worker judged), ``refused`` (the
    queue full, the server shutting down) or ``error`` (a 5xx)."""
    from .worker import Cancelled, QueueFull, ShuttingDown

    if isinstance(err, Cancelled):
        return "cancelled"
    if isinstance(err, PromptError):
        return "rejected"
    if isinstance(err, (QueueFull, ShuttingDown)):
        return "refused"
    return "error"


class Turns:
    """The recent turns (the web page's table and chart): a bounded ring of
    small dicts, appended by the worker thread, copied whole by a reader
    (``deque`` appends and copies are atomic). No prompt text: a
    divergence is its ``against``, ``token`` and ``byte`` only."""

    def __init__(self, maxlen: int = 2048):
        self._ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)

    def add(self, protocol: str, tenant: str, res: GenResult) -> None:
        rep = res.report
        div = rep.divergence
        self._ring.append(
            {
                "t": time.time(),
                "protocol": protocol,
                "tenant": tenant,
                "rung": rep.rung,
                "cached": res.cached_tokens,
                "prompt": res.prompt_tokens,
                "completion": res.completion_tokens,
                "finish": res.finish_reason,
                "ttft_ms": round(res.ttft_s * 1000.0, 3),
                "queue_ms": round(res.queue_s * 1000.0, 3),
                "total_ms": round(res.total_s * 1000.0, 3),
                "divergence": None if div is None else {k: div.get(k) for k in ("against", "token", "byte")},
                "snapshot": rep.snapshot,
                "save_skipped": [s.as_dict() for s in rep.save_skipped],
            }
        )

    def since(self, t0: float, tenant: str | None = None) -> list[dict[str, Any]]:
        """The turns after ``t0`` (every tenant's, or ``tenant``'s only), oldest first."""
        return [d for d in list(self._ring) if d["t"] >= t0 and (tenant is None or d["tenant"] == tenant)]


class Metrics:
    """One server's registry, its per-request series, and the collector of
    the figures read at scrape time."""

    def __init__(self, service: Service, turns: Turns | None = None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.service = service
        self.turns = turns if turns is not None else Turns()
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(name, doc, ["protocol", "rung"], buckets=LATENCY_BUCKETS, registry=r)

        by_rung = ["protocol", "rung"]
        self.requests = counter("ds4_requests", "Turns the worker ran, by protocol and rung", by_rung)
        self.failed = counter(
            "ds4_requests_failed",
            "Requests without a turn: cancelled, rejected, refused, error",
            ["protocol", "reason"],
        )
        self.prompt_tokens = counter("ds4_prompt_tokens", "Prompt tokens of the turns", by_rung)
        self.cached_tokens = counter("ds4_cached_tokens", "Prompt tokens resumed (live or a checkpoint)", by_rung)
        self.prefilled_tokens = counter("ds4_prefilled_tokens", "Prompt tokens prefilled (prompt - cached)", by_rung)
        self.completion_tokens = counter("ds4_completion_tokens", "Generated tokens of the turns", by_rung)
        self.ttft = histogram(
            "ds4_ttft_seconds", "Time to the first token from the request's arrival (turns not cancelled)"
        )
        self.queue = histogram("ds4_queue_seconds", "Time a request waited before its turn began (turns not cancelled)")
        self.latency = histogram("ds4_request_duration_seconds", "A turn's total time (turns not cancelled)")
        self.loads = counter("ds4_checkpoint_loads", "Checkpoints a turn loaded, by rung (disk, remote)", ["rung"])
        self.saves = counter(
            "ds4_checkpoint_saves", "Checkpoints a turn's ladder saved: cold, evict, prompt", ["reason"]
        )
        self.rejections = counter(
            "ds4_checkpoint_rejections", "Checkpoints a turn rejected, by stage and code", ["stage", "code"]
        )
        self.skipped = counter(
            "ds4_checkpoint_saves_skipped",
            "Saves a turn did not make, by kind (cold, continued, evict, prompt) and code (ds4.kvstore.skips)",
            ["kind", "code"],
        )
        #: the same counts, code -> kind -> saves skipped (the web page's): a
        #: dict replaced whole by the worker thread, read without a lock
        self.skipped_by_code: dict[str, dict[str, int]] = {}
        r.register(_Snapshot(service))

    def observer(self, protocol: str, tenant: str) -> Callable[[str, Any], None]:
        """What a job's ``post`` calls with each event (``kind``, ``value``):
        ``done`` and ``error`` are counted, the rest ignored."""

        def observe(kind: str, value: Any) -> None:
            try:
                if kind == "done":
                    self._done(protocol, tenant, value)
                elif kind == "error":
                    self.failed.labels(protocol, _failure(value)).inc()
            except Exception:  # a figure lost, never the reply it rides on
                log.exception("metrics: the %s event of a %s request was not counted", kind, protocol)

        return observe

    def _done(self, protocol: str, tenant: str, res: GenResult) -> None:
        rep = res.report
        rung = rep.rung
        self.requests.labels(protocol, rung).inc()
        self.prompt_tokens.labels(protocol, rung).inc(res.prompt_tokens)
        self.cached_tokens.labels(protocol, rung).inc(res.cached_tokens)
        self.prefilled_tokens.labels(protocol, rung).inc(max(0, res.prompt_tokens - res.cached_tokens))
        self.completion_tokens.labels(protocol, rung).inc(res.completion_tokens)
        if res.finish_reason != "cancelled":
            self.ttft.labels(protocol, rung).observe(res.ttft_s)
            self.queue.labels(protocol, rung).observe(res.queue_s)
            self.latency.labels(protocol, rung).observe(res.total_s)
        if rep.loaded_path is not None:
            self.loads.labels(rung).inc()
        saves = ("cold", rep.cold_saved), ("evict", rep.evict_saved), ("prompt", rep.prompt_saved)
        for reason, saved in (*saves, ("frontier", rep.frontier_saved)):
            if saved is not None:
                self.saves.labels(reason).inc()
        for rej in rep.rejected:
            self.rejections.labels(rej[1], rej[2]).inc()
        if rep.save_skipped:
            by_code = {code: dict(kinds) for code, kinds in self.skipped_by_code.items()}
            for skip in rep.save_skipped:
                self.skipped.labels(skip.kind, skip.code).inc()
                kinds = by_code.setdefault(skip.code, {})
                kinds[skip.kind] = kinds.get(skip.kind, 0) + 1
            self.skipped_by_code = by_code
        self.turns.add(protocol, tenant, res)

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Snapshot:
    """The figures the worker publishes, read at scrape time: its status
    snapshot (a dict replaced whole after each job), the queue's length,
    its busy time, and the tenants' counters (each tenant's dict replaced
    whole). Nothing here takes a lock."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.service
        st = s.status
        yield GaugeMetricFamily("ds4_queue_depth", "Jobs waiting for the worker", value=s.queued)
        yield GaugeMetricFamily("ds4_worker_busy", "1 while the worker runs a job", value=int(bool(st.get("busy"))))
        yield GaugeMetricFamily("ds4_jobs_running", "Jobs the lanes run now", value=st.get("running", 0))
        yield CounterMetricFamily(
            "ds4_worker_busy_seconds", "Seconds of jobs, summed over the lanes (--sessions)", value=s.busy_s
        )
        yield from _residents(st)
        counters = st.get("counters", {})
        for name in ("ladder_retries", "continued_saves", "stop_rewound", "stop_invalidated"):
            yield CounterMetricFamily(f"ds4_{name}", f"The server's {name} counter", value=counters.get(name, 0))
        yield from _tenants(s.all_tenant_counters())
        kv = st.get("kv")
        if kv is not None:
            yield from _store(kv, s.gen.store.budget_bytes if s.gen.store is not None else 0)


def _residents(st: dict[str, Any]) -> Iterator[Any]:
    """Per resident session (``--sessions``; index 0 alone with one): the
    tokens it holds, whether they are a valid state and whether a lane is
    serving it. No tenant: a label would name whose state each holds."""
    from prometheus_client.core import GaugeMetricFamily

    views = st.get("sessions")
    if views is None:  # one resident: the worker's own session
        sess = st.get("session", {})
        busy = bool(st.get("busy"))
        views = [{"index": 0, "tokens": sess.get("n_past", 0), "valid": sess.get("valid", False), "busy": busy}]
    fams = {
        "tokens": GaugeMetricFamily("ds4_session_tokens", "Tokens a resident session holds", labels=["session"]),
        "valid": GaugeMetricFamily("ds4_session_valid", "1 while a resident holds a valid state", labels=["session"]),
        "busy": GaugeMetricFamily("ds4_session_busy", "1 while a lane serves a resident", labels=["session"]),
    }
    for v in views:
        for key, fam in fams.items():
            fam.add_metric([str(v["index"])], int(v.get(key) or 0))
    yield from fams.values()


def _tenants(by_tenant: dict[str, dict[str, int]]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    from .worker import TENANT_COUNTERS

    for name in TENANT_COUNTERS:
        fam = CounterMetricFamily(f"ds4_tenant_{name}", f"A tenant's {name} (its /health counters)", labels=["tenant"])
        for tenant, c in by_tenant.items():
            fam.add_metric([tenant], c.get(name, 0))
        yield fam


def _store(kv: dict[str, Any], budget: int) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("ds4_kv_checkpoints", "Checkpoints in the store's index", value=kv.get("files", 0))
    yield GaugeMetricFamily("ds4_kv_bytes", "Bytes of the indexed checkpoint files on disk", value=kv.get("bytes", 0))
    yield GaugeMetricFamily("ds4_kv_budget_bytes", "The disk budget (--kv-disk-space-mb)", value=budget)
    yield GaugeMetricFamily(
        "ds4_kv_index_heap_bytes", "Memory the store's index holds (an estimate)", value=kv.get("index_heap_bytes", 0)
    )
    for name in ("hits", "misses", "stores", "rejected", "scans", "index_rebuilds", "index_mismatches"):
        yield CounterMetricFamily(f"ds4_kv_{name}", f"The store's {name} counter", value=kv.get(name, 0))
    yield from _writes(kv)
    ev = CounterMetricFamily("ds4_kv_evictions", "Checkpoints removed, by reason", labels=["reason"])
    for reason, key in _EVICTIONS.items():
        ev.add_metric([reason], kv.get(key, 0))
    yield ev
    tb = GaugeMetricFamily("ds4_kv_tenant_bytes", "A tenant's checkpoint bytes on disk", labels=["tenant"])
    tc = GaugeMetricFamily("ds4_kv_tenant_checkpoints", "A tenant's checkpoints on disk", labels=["tenant"])
    for tenant, u in kv.get("tenants", {}).items():
        tb.add_metric([tenant], u.get("bytes", 0))
        tc.add_metric([tenant], u.get("checkpoints", 0))
    yield tb
    yield tc
    yield from _models(kv.get("models", {}))
    remote = kv.get("remote")
    if remote is not None:
        yield from _remote(remote)


def _writes(kv: dict[str, Any]) -> Iterator[Any]:
    """The bytes the store's saves wrote by reason, the write budget and the
    last 24 hours' writes, the block files and the dedup ratio."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    wr = CounterMetricFamily(
        "ds4_kv_written_bytes", "Bytes the store's saves wrote (files and blocks)", labels=["reason"]
    )
    for reason, n in kv.get("written_by_reason", {}).items():
        wr.add_metric([reason], n)
    yield wr
    yield CounterMetricFamily(
        "ds4_kv_write_budget_refused", "Saves skipped for the write budget", value=kv.get("write_budget_refused", 0)
    )
    for name, doc in (
        ("write_budget_bytes", "The write budget, bytes a day (--kv-write-budget-gb-per-day; 0: none)"),
        ("written_day_bytes", "Bytes the directory's saves wrote in the last 24 hours (with a write budget)"),
        ("block_files", "Shared block files on disk"),
        ("block_bytes", "Bytes of the shared block files"),
        ("logical_bytes", "Bytes the checkpoints would take as single files"),
        ("dedup_ratio", "Those bytes over the bytes on disk (1: nothing shared)"),
    ):
        yield GaugeMetricFamily(f"ds4_kv_{name}", doc, value=kv.get(name, 0))


def _models(by_model: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Each model's bytes, checkpoints and hits on disk, by the weights
    fingerprint its payload ABI records (``other``: an ABI naming none)."""
    from prometheus_client.core import GaugeMetricFamily

    for name, doc in (("bytes", "checkpoint bytes"), ("checkpoints", "checkpoints"), ("hits", "checkpoints' hits")):
        fam = GaugeMetricFamily(f"ds4_kv_model_{name}", f"A model's {doc} on disk", labels=["model"])
        for model, u in by_model.items():
            fam.add_metric([model], u.get(name, 0))
        yield fam


def _remote(rt: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    state = GaugeMetricFamily("ds4_kv_remote_state", "The shared tier's state (1: the current one)", labels=["state"])
    for name in REMOTE_STATES:
        state.add_metric([name], int(rt.get("state") == name))
    yield state
    yield GaugeMetricFamily("ds4_kv_remote_queued", "Uploads waiting", value=rt.get("queued", 0))
    for name in _REMOTE_COUNTERS:
        yield CounterMetricFamily(f"ds4_kv_remote_{name}", f"The shared tier's {name} counter", value=rt.get(name, 0))
    misses = max(0, int(rt.get("lookups", 0)) - int(rt.get("hits", 0)))
    yield CounterMetricFamily("ds4_kv_remote_misses", "Lookups of the tier whose find was not loaded", value=misses)
    for d in ("uploaded", "downloaded"):
        yield CounterMetricFamily(f"ds4_kv_remote_{d}_bytes", f"Checkpoint bytes {d}", value=rt.get(f"bytes_{d}", 0))
