"""``GET /metrics``, ``GET /ui`` (a live web page of the cache) and its
JSON, ``GET /ui/data``.

* ``/metrics``: :class:`ds4.server.metrics.Metrics`'s text, to the
  operator's keys only (an ``--admin-tenant``'s, or every request of a
  server without keys, as the operator's ``/health``); any other key gets
  403.
* ``/ui``, ``/ui/ui.js``, ``/ui/ui.css``: static files shipped in the
  package (``ds4/server/static/``: plain JavaScript, a canvas chart, no
  CDN, no build step), served without a key (they hold no data; the Host
  and Origin checks still apply) under a Content-Security-Policy of
  ``'self'`` only. On a keyed server the page asks for a key and sends it
  as a bearer token on each ``/ui/data`` request (kept in the page's
  memory: never in the URL, never stored).
* ``/ui/data``: what the page draws. The operator's: the hit rate and TTFT
  of the last minutes (bins), the recent turns (protocol, tenant, rung,
  cached and prompt tokens, TTFT, the divergence point without its text,
  the saves it did not make and why), the checkpoints by reason and age,
  the saves skipped by code, the bytes by tenant against the
  budget, the queue, and the resident sessions (``--sessions`` above 1). A
  tenant's: the same chart and turns of its own requests only, nothing
  that moves with another tenant's traffic (as its ``/health``).

The checkpoint table copies the store's index rows (one call into the
core, under the index's own lock only for the copy; never the directory's
lock), at most every :data:`CHECKPOINTS_EVERY_S` seconds; everything else
comes from the worker's published snapshot and the recent turns ring.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..keytext import ANONYMOUS
from .metrics import Metrics
from .wire import http_error

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from .worker import Service

__all__ = ["AGE_EDGES_S", "CHECKPOINTS_EVERY_S", "UI_PATHS", "Dashboard"]

#: the page's files: path -> (file in ds4/server/static, content type)
UI_PATHS = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/ui.js": ("ui.js", "text/javascript; charset=utf-8"),
    "/ui/ui.css": ("ui.css", "text/css; charset=utf-8"),
}
#: the page's scripts, styles, images and requests come from this server only
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
#: on every response of the page, its data and /metrics: never framed
#: (clickjacking), never sniffed into another type, never cached
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
#: checkpoint ages are counted below each of these (seconds), then above the last
AGE_EDGES_S = (60, 600, 3600, 86400)
#: the checkpoint table is copied from the index at most this often
CHECKPOINTS_EVERY_S = 5.0
#: the chart: this many seconds back, in bins of this many
WINDOW_S, BIN_S = 600, 30
#: turns listed in the table, newest first
RECENT = 50


def _forbidden() -> Response:
    from starlette.responses import JSONResponse

    body = http_error(403, "this endpoint is the operator's: use a key of an --admin-tenant")
    body["error"]["code"] = "operator_only"
    return JSONResponse(body, status_code=403, headers=HEADERS)


def series(
    turns: list[dict[str, Any]], now: float, window_s: int = WINDOW_S, bin_s: int = BIN_S
) -> list[dict[str, Any]]:
    """The chart's bins over the last ``window_s`` seconds (the last bin
    still filling), oldest first:
    each bin's start, turns, hit rate (cached / prompt tokens; None without
    a prompt token) and median TTFT in ms (None without a finished turn)."""
    n = window_s // bin_s
    start = (int(now // bin_s) + 1 - n) * bin_s  # bins on multiples of bin_s, the last one holding now
    bins: list[dict[str, Any]] = [{"t": start + i * bin_s, "turns": 0, "prompt": 0, "cached": 0} for i in range(n)]
    ttfts: list[list[float]] = [[] for _ in range(n)]
    for d in turns:
        i = int((d["t"] - start) // bin_s)
        if not 0 <= i < n:
            continue
        b = bins[i]
        b["turns"] += 1
        b["prompt"] += d["prompt"]
        b["cached"] += d["cached"]
        if d["finish"] != "cancelled":
            ttfts[i].append(d["ttft_ms"])
    for b, ts in zip(bins, ttfts, strict=True):
        b["hit_rate"] = round(b["cached"] / b["prompt"], 4) if b["prompt"] else None
        b["ttft_ms"] = round(statistics.median(ts), 3) if ts else None
    return bins


def checkpoint_table(rows: list[Any], now: float) -> dict[str, Any]:
    """Checkpoints and bytes by reason, and by reason and age bucket
    (:data:`AGE_EDGES_S`), of the index's rows (``StoreIndex.entries``)."""
    by: dict[str, dict[str, Any]] = {}
    for row in rows:
        reason, created, size = row[8], row[5], row[10][1]
        r = by.setdefault(reason, {"checkpoints": 0, "bytes": 0, "ages": [0] * (len(AGE_EDGES_S) + 1)})
        r["checkpoints"] += 1
        r["bytes"] += size
        age = max(0.0, now - created)
        r["ages"][next((i for i, e in enumerate(AGE_EDGES_S) if age < e), len(AGE_EDGES_S))] += 1
    return {"age_edges_s": list(AGE_EDGES_S), "by_reason": dict(sorted(by.items()))}


class Dashboard:
    """The handlers of ``/metrics``, the page and ``/ui/data``."""

    def __init__(self, service: Service, metrics: Metrics, needs_key: bool):
        self.service, self.metrics = service, metrics
        static = resources.files("ds4.server").joinpath("static")
        self.files = {p: (static.joinpath(f).read_bytes(), t) for p, (f, t) in UI_PATHS.items()}
        page, ctype = self.files["/ui"]
        self.files["/ui"] = (page.replace(b"__DS4_NEEDS_KEY__", b"true" if needs_key else b"false"), ctype)
        self._checkpoints: tuple[float, dict[str, Any] | None] = (-CHECKPOINTS_EVERY_S, None)

    async def scrape(self, request: Request) -> Response:
        """``GET /metrics``: the operator's, or 403."""
        from starlette.responses import Response

        if not _operator(request):
            return _forbidden()
        body, ctype = self.metrics.exposition()
        return Response(body, media_type=ctype, headers=HEADERS)

    async def page(self, request: Request) -> Response:
        """The page's files (no key needed: they hold no data)."""
        from starlette.responses import Response

        body, ctype = self.files[request.url.path]
        return Response(body, media_type=ctype, headers=HEADERS)

    async def data(self, request: Request) -> Response:
        """``GET /ui/data``: the operator's whole view, or a tenant's own."""
        from starlette.responses import JSONResponse

        if _operator(request):
            return JSONResponse(await self._operator_data(), headers=HEADERS)
        tenant = str(request.scope.get("state", {}).get("ds4_tenant", ANONYMOUS))
        return JSONResponse(self._turns_data(tenant) | {"operator": False, "tenant": tenant}, headers=HEADERS)

    def _turns_data(self, tenant: str | None) -> dict[str, Any]:
        now = time.time()
        turns = self.metrics.turns.since(now - WINDOW_S, tenant)
        recent = turns[-RECENT:][::-1]
        if tenant is not None:  # a tenant's own rows: its name is the page's, no need to repeat it
            recent = [{k: v for k, v in d.items() if k != "tenant"} for d in recent]
        prompt, cached = sum(d["prompt"] for d in turns), sum(d["cached"] for d in turns)
        return {
            "now": now,
            "window_s": WINDOW_S,
            "bin_s": BIN_S,
            "series": series(turns, now),
            "totals": {"turns": len(turns), "prompt": prompt, "cached": cached},
            "recent": recent,
        }

    async def _operator_data(self) -> dict[str, Any]:
        s = self.service
        st = s.status
        out = self._turns_data(None) | {"operator": True, "queued": s.queued, "busy": bool(st.get("busy"))}
        kv = st.get("kv")
        store = s.gen.store
        if kv is not None and store is not None:
            out["kv"] = {k: kv.get(k, 0) for k in ("files", "bytes", "hits", "misses", "stores", "evictions")}
            out["budget_bytes"] = store.budget_bytes
            out["tenants_bytes"] = kv.get("tenants", {})
            out["models_bytes"] = kv.get("models", {})
            out["writes"] = writes_of(kv)
            out["checkpoints"] = await self._checkpoint_table()
            # the saves the turns did not make since the server started: code -> kind -> count
            out["save_skipped"] = self.metrics.skipped_by_code
            remote = kv.get("remote")
            if remote is not None:
                out["remote"] = {k: remote.get(k) for k in ("state", "hits", "lookups", "queued")}
        if "sessions" in st:
            out["sessions"] = st["sessions"]
        return out

    async def _checkpoint_table(self) -> dict[str, Any] | None:
        t, table = self._checkpoints
        now = time.monotonic()
        if table is None or now - t >= CHECKPOINTS_EVERY_S:
            store = self.service.gen.store
            assert store is not None
            # the index's rows as it stands: no refresh, no directory lock (the worker's)
            rows = await asyncio.to_thread(store.rows)
            table = checkpoint_table(rows, time.time())
            self._checkpoints = (now, table)
        return table


def writes_of(kv: dict[str, Any]) -> dict[str, Any]:
    """What the store's saves wrote since the start, by reason, the last 24
    hours' writes against the write budget (0: none) and the dedup ratio
    of the shared blocks (1: none shared)."""
    by = kv.get("written_by_reason", {})
    keys = ("written_day_bytes", "write_budget_bytes", "write_budget_refused", "block_bytes", "logical_bytes")
    return {"by_reason": by, "dedup_ratio": kv.get("dedup_ratio", 1.0), **{k: kv.get(k, 0) for k in keys}}


def _operator(request: Request) -> bool:
    return bool(request.scope.get("state", {}).get("ds4_operator", False))
