"""What ``GET /health`` shows, and to whom.

Two views:

* **The operator's** (every request of a server without keys; on a keyed
  server only the keys of an ``--admin-tenant``): liveness, the model, the
  engine, the payload ABI, the queue's length, whether the worker is busy,
  the live session (valid, length, context), the server-wide counters, the
  store's summary (its directory only with ``--debug``) with the shared
  tier's state and each tenant's bytes and checkpoints on disk
  (``kv.tenants``: from the in-memory index, in the worker's snapshot),
  each tenant's own counters (``tenants``), and with ``--sessions`` above 1
  the resident sessions (``sessions``: index, tenant, tokens, last used)
  and the routing hints kept (``hints``: how many, in how many
  namespaces, their digests' bytes).
* **A tenant's** (any other key): liveness, the model, the engine, the
  payload ABI, and the tenant's own name and counters. Nothing in it moves
  with another tenant's traffic: the queue's length, ``busy``, the live
  session's length and the store's counts all do (B polling them learns
  when A sends requests and how long A's prompts are), so none is shown.
"""

from __future__ import annotations

from typing import Any

from .worker import Service

__all__ = ["operator_view", "tenant_view"]


def _head(service: Service) -> dict[str, Any]:
    """What every view shows: fixed for the server's lifetime."""
    g = service.gen
    head = {
        "status": "ok",
        "model": service.model_id,
        "engine": g.engine.name,
        "payload_abi": g.sess.payload_abi,
    }
    facts = getattr(g.engine, "facts", None)
    if facts is not None:  # what the engine's start-up probe learnt of the model
        head["engine_facts"] = facts()
    return head


def operator_view(service: Service, debug: bool = False) -> dict[str, Any]:
    """The whole server's state (the body ``/health`` always had, and
    ``tenants``)."""
    status = dict(service.status)
    if "kv" in status and not debug:  # the cache directory's path only with --debug
        status["kv"] = {k: v for k, v in status["kv"].items() if k != "dir"}
    return {**_head(service), "queued": service.queued, **status, "tenants": service.all_tenant_counters()}


def tenant_view(service: Service, tenant: str) -> dict[str, Any]:
    """What ``tenant`` may see: the server's fixed facts and its own counters."""
    return {**_head(service), "tenant": {"name": tenant, "counters": service.tenant_counters(tenant)}}
