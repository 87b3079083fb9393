"""``GET /health`` on a multi-tenant server: a tenant's view shows nothing
that moves with another tenant's traffic (the queue, the worker's state,
the live session, the server-wide counters, the store), only the server's
fixed facts and its own counters; an ``--admin-tenant``'s keys see the
operator's view; a server without keys shows the operator's view to every
request, as it always did.

Real ``ds4 serve`` processes on 127.0.0.1 (reference engine), driven with
the official ``openai`` client; ``/health`` is read raw with ``httpx`` and
compared byte for byte."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest
from helpers.server import KV_FLAGS, topic_chat
from starlette.testclient import TestClient

from ds4.engines.reference import ReferenceContext
from ds4.server.app import create_app
from ds4.server.conversation import new_call_id
from ds4.server.guard import Guard, add_guard_args, guard_from_args
from ds4.server.tenants import tenant_of
from ds4.server.worker import TENANT_COUNTERS, Service
from ds4.turn import TurnDriver

KA, KB, KOPS = "sk-health-alice", "sk-health-bob", "sk-health-ops"
#: every field the operator's view had before tenants had a view of their own
OPERATOR_FIELDS = {"status", "model", "engine", "payload_abi", "queued", "busy", "session", "counters", "kv"}


@pytest.fixture(scope="module")
def srv(serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health")
    keys = tmp / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\nops:{KOPS}\n", encoding="utf-8")
    return serve_module(
        "--api-key-file",
        str(keys),
        "--admin-tenant",
        "ops",
        *KV_FLAGS,
        "--debug",  # paths would show in the operator's view: never in a tenant's
        name="health",
        tmp=tmp,
        kv=True,
        key=KOPS,
    )


def _health(srv, key) -> httpx.Response:
    r = httpx.get(srv.base + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r


def _settled(get) -> dict:
    """The operator's view once the worker is idle: its status is a
    snapshot taken after each job, a moment after the reply went out (a
    tenant's own counters are counted before it)."""
    for _ in range(200):
        h = get().json()
        if not h["busy"]:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the worker stayed busy: {h}")


def _a_traffic(srv) -> dict:
    """Alice's requests of every outcome: answered (chat, completion, a
    stream), refused (a prompt over the context). Returns what her usage
    said."""
    a, model = srv.client(KA), srv.model()
    seen = {"requests": 0, "rejected": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}

    def count(usage) -> None:
        seen["requests"] += 1
        seen["prompt_tokens"] += usage.prompt_tokens
        seen["completion_tokens"] += usage.completion_tokens
        d = getattr(usage, "prompt_tokens_details", None)
        seen["cached_tokens"] += d.cached_tokens if d is not None else 0

    msgs = topic_chat("alice-secret-project", 30)
    r = a.chat.completions.create(model=model, messages=msgs, max_tokens=4)
    count(r.usage)
    msgs = [*msgs, {"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "More?"}]
    count(a.chat.completions.create(model=model, messages=msgs, max_tokens=4).usage)
    count(a.completions.create(model=model, prompt="Alice's raw prompt " * 20, max_tokens=3).usage)
    chunks = list(
        a.chat.completions.create(
            model=model, messages=msgs, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    count(chunks[-1].usage)
    over = httpx.post(
        srv.base + "/v1/completions",
        headers={"Authorization": f"Bearer {KA}"},
        json={"model": model, "prompt": "x" * 3000, "max_tokens": 1},
        timeout=60,
    )
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded", over.text
    seen["requests"] += 1
    seen["rejected"] += 1
    return seen


def test_a_tenant_sees_nothing_of_another_tenants_traffic(srv):
    b0 = _health(srv, KB)
    ops0 = _settled(lambda: _health(srv, KOPS))
    body = b0.json()
    # the server's fixed facts and bob's own counters; nothing else
    assert set(body) == {"status", "model", "engine", "payload_abi", "tenant"}
    assert body["tenant"] == {"name": "bob", "counters": dict.fromkeys(TENANT_COUNTERS, 0)}
    assert body["status"] == "ok" and body["model"] == ops0["model"] and body["engine"] == "reference"
    assert ops0["kv"]["dir"] and ops0["kv"]["dir"] not in b0.text  # --debug: the directory to the operator only

    seen = _a_traffic(srv)
    # byte for byte what bob saw before alice's requests
    assert _health(srv, KB).content == b0.content

    # the operator saw all of it move
    ops1 = _settled(lambda: _health(srv, KOPS))
    assert OPERATOR_FIELDS <= set(ops1)
    assert ops1["counters"]["requests"] - ops0["counters"]["requests"] == seen["requests"]
    assert ops1["counters"]["rejected"] - ops0["counters"]["rejected"] == 1
    assert ops1["counters"]["prompt_tokens"] - ops0["counters"]["prompt_tokens"] == seen["prompt_tokens"]
    assert ops1["session"]["valid"] and ops1["session"]["n_past"] > 0
    assert ops1["kv"]["stores"] > ops0["kv"]["stores"]
    # alice's own counters, as her usage told her
    assert ops1["tenants"]["alice"] == {**dict.fromkeys(TENANT_COUNTERS, 0), **seen}
    assert "bob" not in ops1["tenants"]
    alice = _health(srv, KA).json()
    assert alice["tenant"] == {"name": "alice", "counters": ops1["tenants"]["alice"]}

    # bob's own request moves bob's counters, and only his; alice's next ones do not
    r = srv.client(KB).chat.completions.create(model=srv.model(), messages=topic_chat("bob-topic"), max_tokens=2)
    b1 = _health(srv, KB)
    mine = b1.json()["tenant"]["counters"]
    assert mine["requests"] == 1 and mine["prompt_tokens"] == r.usage.prompt_tokens
    assert mine["completion_tokens"] == r.usage.completion_tokens
    assert mine["cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    _a_traffic(srv)
    assert _health(srv, KB).content == b1.content


def test_a_tenants_view_while_another_tenants_stream_runs(srv):
    """While alice's stream is being answered (the worker busy, her prompt
    live), bob's /health is the same bytes as before she started."""
    b0 = _health(srv, KB).content
    a = srv.client(KA)
    stream = a.chat.completions.create(
        model=srv.model(), messages=topic_chat("alice-long", 60), max_tokens=64, stream=True
    )
    try:
        next(iter(stream))  # her job has started
        assert _health(srv, KB).content == b0
    finally:
        stream.close()
    assert _health(srv, KB).content == b0


def test_a_server_without_keys_shows_everyone_the_operators_view(tmp_path, serve):
    srv = serve("--kv-disk-dir", str(tmp_path / "kv"), *KV_FLAGS, name="nokeys", tmp=tmp_path)
    h0 = srv.health()
    assert OPERATOR_FIELDS <= set(h0) and "dir" not in h0["kv"]  # the directory only with --debug
    assert h0["queued"] == 0 and h0["busy"] is False and h0["tenants"] == {}
    r = srv.client().chat.completions.create(model=srv.model(), messages=topic_chat("single-user"), max_tokens=2)
    h1 = _settled(lambda: httpx.get(srv.base + "/health", timeout=10))
    assert h1["counters"]["requests"] == h0["counters"]["requests"] + 1
    assert h1["session"]["n_past"] >= r.usage.prompt_tokens
    assert h1["tenants"]["anonymous"]["requests"] == 1
    assert h1["tenants"]["anonymous"]["prompt_tokens"] == r.usage.prompt_tokens


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    add_guard_args(p)
    return p.parse_args(argv)


def test_admin_tenant_must_name_a_configured_tenant(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KA}\nops:{KOPS}\n", encoding="utf-8")
    g = guard_from_args(_args("--api-key-file", str(keys), "--admin-tenant", "ops"), env={})
    assert g.operator("ops") and not g.operator("alice")
    # a bare key's tenant is its digest name, as the log and ds4 kv ls show it
    g = guard_from_args(_args("--api-key", KB, "--admin-tenant", tenant_of(KB)), env={})
    assert g.operator(tenant_of(KB)) and not g.operator(tenant_of(KA))
    with pytest.raises(ValueError, match="names no tenant") as ei:
        guard_from_args(_args("--api-key-file", str(keys), "--admin-tenant", "mallory"), env={})
    assert KA not in str(ei.value) and KOPS not in str(ei.value)
    with pytest.raises(ValueError, match="needs keys"):
        guard_from_args(_args("--admin-tenant", "ops"), env={})
    # without keys every request is the operator (one user)
    assert Guard().operator("anonymous")
    assert not Guard([KA]).operator(tenant_of(KA))  # a key without --admin-tenant: its own view


def test_a_tenants_own_refusals_and_failures_are_counted_for_it_alone(eng, monkeypatch):
    """In process: alice's 409 (refused before the turn), 400 (refused by
    the turn) and 500 (an engine fault mid-decode) are her counters; bob's
    view does not move; the operator sees them under alice."""
    service = Service(TurnDriver(eng, 512), "ds4-reference")
    guard = Guard([(KA, "alice"), (KB, "bob"), (KOPS, "ops")], admin_tenants=["ops"])
    with TestClient(create_app(service, guard=guard), base_url="http://127.0.0.1") as c:

        def get(key: str) -> httpx.Response:
            r = c.get("/health", headers={"x-api-key": key})
            assert r.status_code == 200, r.text
            return r

        b0 = get(KB).content
        alice = {"Authorization": f"Bearer {KA}"}
        # an output for a call this server issued, its live state gone: 409 (refused by the worker)
        out = [{"type": "function_call_output", "call_id": new_call_id("call_"), "output": "1"}]
        gone = {"model": "any", "input": out}
        assert c.post("/v1/responses", json=gone, headers=alice).status_code == 409
        long = {"model": "any", "messages": [{"role": "user", "content": "x " * 512}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=long, headers=alice).status_code == 400
        real, armed = ReferenceContext.eval, [True]

        def faulty(self, tokens, progress=None):
            if armed and len(tokens) == 1:  # a decode step: the engine's bug
                armed.clear()
                raise TypeError("an engine bug")
            return real(self, tokens, progress)

        monkeypatch.setattr(ReferenceContext, "eval", faulty)
        hi = {"model": "any", "messages": [{"role": "user", "content": "Hi there."}], "max_tokens": 3}
        assert c.post("/v1/chat/completions", json=hi, headers=alice).status_code == 500
        assert not armed
        mine = get(KA).json()["tenant"]["counters"]
        assert {k: mine[k] for k in ("requests", "rejected", "errors", "cancelled")} == {
            "requests": 3,
            "rejected": 2,
            "errors": 1,
            "cancelled": 0,
        }
        assert get(KB).content == b0
        ops = _settled(lambda: get(KOPS))
        assert ops["tenants"] == {"alice": mine}
        assert ops["counters"]["rejected"] == 2 and ops["counters"]["errors"] == 1
