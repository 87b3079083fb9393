"""The pool's routing hints are bounded (issue 36, item 1;
:mod:`ds4.server.hints`): a long hint is ignored, a kept one costs its
digest, one namespace keeps at most so many and cannot push out another's,
and the table holds at most so many in all. Asserted through the table's
accounting, not the process's memory."""

from __future__ import annotations

from ds4.server.hints import DIGEST_BYTES, MAX_HINT_BYTES, MAX_HINTS, MAX_PER_NAMESPACE, HintTable
from ds4.server.pool import Pool, body_hint, usable_hint
from ds4.turn import TurnDriver


def test_a_flood_of_huge_hints_keeps_nothing_and_routes_nothing():
    t = HintTable()
    big = "h" * (8 << 20)  # the red team's 8 MiB
    for k in range(200):
        assert not t.put("tenant-a", f"{k}:{big[: (8 << 20) - 8]}", 1)
    assert t.stats() == {"hints": 0, "namespaces": 0, "digest_bytes": 0}
    edge = "x" * MAX_HINT_BYTES
    assert t.put("tenant-a", edge, 2) and t.get("tenant-a", edge) == 2
    assert not t.put("tenant-a", edge + "x", 3) and t.get("tenant-a", edge + "x") is None


def test_one_namespace_cannot_push_out_anothers_and_the_table_is_bounded():
    t = HintTable()
    assert t.put("tenant-b", "b's session", 3)
    for k in range(5 * MAX_PER_NAMESPACE):
        t.put("tenant-a", f"session {k}", k % 4)
    assert t.get("tenant-b", "b's session") == 3  # not pushed out by a's flood
    assert t.get("tenant-a", "session 0") is None  # a's oldest forgotten
    assert t.get("tenant-a", f"session {5 * MAX_PER_NAMESPACE - 1}") == (5 * MAX_PER_NAMESPACE - 1) % 4
    assert t.stats()["hints"] == MAX_PER_NAMESPACE + 1
    for n in range(3 * MAX_HINTS // MAX_PER_NAMESPACE):  # many namespaces, each full
        for k in range(MAX_PER_NAMESPACE):
            t.put(f"tenant-{n}", f"s{k}", 0)
    st = t.stats()
    assert st["hints"] == MAX_HINTS and st["digest_bytes"] == MAX_HINTS * DIGEST_BYTES
    # a hint is namespaced: the same string in another namespace is another hint
    assert t.put("tenant-c", "shared name", 1) and t.put("tenant-d", "shared name", 2)
    assert (t.get("tenant-c", "shared name"), t.get("tenant-d", "shared name")) == (1, 2)


def test_the_pool_keeps_its_hints_in_the_bounded_table(eng):
    pool = Pool(TurnDriver(eng, 64), 2)
    r = pool.residents[1]
    pool._used(r, "tenant-a", "h" * (1 << 20))
    pool.release(r)
    pool._used(r, "tenant-a", "my session")
    pool.release(r)
    assert pool.hints.stats()["hints"] == 1 and pool.hints.get("tenant-a", "my session") == 1


def test_a_long_hint_is_dropped_where_it_is_read():
    """An over-long hint never travels with the job (its 8 MiB string
    held by the job, encoded by the lane: the server's RSS grew with every
    such request); the bound counts UTF-8 bytes, not characters."""
    big = "k" * (8 << 20)
    assert body_hint({"prompt_cache_key": big}) is None
    assert body_hint({"user": big}) is None and body_hint({"metadata": {"user_id": big}}) is None
    assert body_hint({"prompt_cache_key": "s" * MAX_HINT_BYTES}) == "s" * MAX_HINT_BYTES
    assert body_hint({"prompt_cache_key": "é" * (MAX_HINT_BYTES // 2 + 1)}) is None  # 258 bytes, 129 characters
    assert usable_hint("é" * (MAX_HINT_BYTES // 2)) is not None
    assert usable_hint(None) is None and usable_hint("") is None and usable_hint(42) is None


def test_the_operators_health_counts_the_hints_kept(eng):
    from starlette.testclient import TestClient

    from ds4.server.app import create_app
    from ds4.server.worker import Service

    gen = TurnDriver(eng, 256)
    service = Service(gen, "m", pool=Pool(gen, 2))
    with TestClient(create_app(service), base_url="http://127.0.0.1") as c:
        for i, hint in enumerate(("conv-a", "conv-b", "x" * 4096)):
            body = {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1}
            r = c.post("/v1/chat/completions", json={**body, "prompt_cache_key": hint})
            assert r.status_code == 200
        h = c.get("/health").json()
    assert h["hints"] == {"hints": 2, "namespaces": 1, "digest_bytes": 2 * DIGEST_BYTES}
