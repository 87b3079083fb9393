"""Two ``ds4 serve`` replicas with separate local directories and one Redis
(a single node, then a three-master cluster): turn one on A, turn two on B,
served from the shared tier with the reply of a cold server. Redis killed
in the middle of a conversation, then restarted: no 5xx, served locally
meanwhile, the tier used again afterwards (those two replicas are built in
this process from the same flags, so that the test moves their breakers'
clock on instead of waiting out the cool-down)."""

from __future__ import annotations

import time

import httpx
import pytest
from helpers.metric_samples import samples
from helpers.redis_servers import RedisClusterNodes, RedisNode
from helpers.server import CTX, KV_FLAGS, Server, cached_tokens, cold_chat, ds4_block, topic_chat


@pytest.fixture(scope="module")
def cold(serve_module):
    return serve_module("--no-kv-cache", name="cold")


def _replica(tmp, name, url, *extra):
    srv = Server(str(tmp), name, "--kv-disk-dir", str(tmp / f"kv-{name}"), "--kv-remote", url, *KV_FLAGS, *extra)
    return srv.start()


def _wait_uploaded(redis_clients, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.keys("ds4:*:m") for c in redis_clients):
            return
        time.sleep(0.05)
    raise AssertionError("nothing was uploaded to the tier")


def _remote_metrics(srv) -> None:
    """B's /metrics once its worker is idle: the tier up, one hit, its bytes."""
    for _ in range(200):
        if not srv.health()["busy"]:
            break
        time.sleep(0.05)
    got = samples(httpx.get(srv.base + "/metrics", timeout=10).text)
    assert [
        st for st in ("up", "degraded", "cooldown", "closed") if got[("ds4_kv_remote_state", (("state", st),))]
    ] == ["up"]
    assert got[("ds4_kv_remote_hits_total", ())] == 1
    assert got[("ds4_kv_remote_downloaded_bytes_total", ())] > 0
    assert got[("ds4_requests_total", (("protocol", "chat"), ("rung", "remote")))] == 1
    assert got[("ds4_checkpoint_loads_total", (("rung", "remote"),))] == 1


def _two_turns(tmp, cold, url, clients, topic):
    a = _replica(tmp, "a", url)
    b = _replica(tmp, "b", url)
    try:
        model = a.model()
        msgs = topic_chat(topic, 24)
        r1 = a.client().chat.completions.create(model=model, messages=msgs, max_tokens=2)
        ref1 = cold_chat(cold, msgs, max_tokens=2)
        assert r1.choices[0].message.content == ref1.choices[0].message.content
        _wait_uploaded(clients)
        msgs = [
            *msgs,
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "And?"},
        ]
        r2 = b.client().chat.completions.create(model=model, messages=msgs, max_tokens=6)
        ref2 = cold_chat(cold, msgs, max_tokens=6)
        assert r2.choices[0].message.content == ref2.choices[0].message.content
        assert r2.usage.prompt_tokens == ref2.usage.prompt_tokens
        x = ds4_block(r2)
        assert x["rung"] == "remote", x
        assert cached_tokens(r2) == x["reused_tokens"] > 0  # counted as cached
        h = b.health()["kv"]["remote"]
        assert h["state"] == "up" and h["hits"] == 1
        _remote_metrics(b)
    finally:
        a.stop()
        b.stop()


def test_turn_two_on_another_replica_is_served_from_redis(tmp_path, cold):
    node = RedisNode(str(tmp_path)).start()
    try:
        with node.client() as c:
            _two_turns(tmp_path, cold, node.url, [c], "harbours")
    finally:
        node.stop()


def test_turn_two_on_another_replica_is_served_from_a_cluster(tmp_path, cold):
    cluster = RedisClusterNodes(str(tmp_path)).start()
    clients = [n.client() for n in cluster.nodes]
    try:
        _two_turns(tmp_path, cold, cluster.url, clients, "glaciers")
    finally:
        for c in clients:
            c.close()
        cluster.stop()


class _InProcess:
    """A replica built in this process by ``ds4 serve``'s own
    :func:`ds4.server.serve.build_app` from the same flags as
    :func:`_replica`, served through Starlette's test client, so that the
    test moves its tier's breaker clock on (``later``) instead of waiting
    the cool-down out on the wall clock."""

    def __init__(self, tmp, name, url, later, *extra):
        from starlette.testclient import TestClient

        from ds4.cli import build_parser
        from ds4.server.guard import Guard
        from ds4.server.serve import build_app

        flags = ["serve", "--engine", "reference", "--ctx", str(CTX), "--default-max-tokens", "16", "--sessions", "1"]
        args = build_parser().parse_args(
            [*flags, "--kv-disk-dir", str(tmp / f"kv-{name}"), "--kv-remote", url, *KV_FLAGS, *extra]
        )
        app = build_app(args, Guard())
        self.service = app.state.service
        self.service.gen.store.remote.breaker.clock = lambda: time.monotonic() + later[0]
        self.http = TestClient(app, base_url="http://127.0.0.1").__enter__()

    def chat(self, msgs, max_tokens):
        r = self.http.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text  # every request answered: a 5xx fails here
        return r.json()

    def remote_state(self):
        return self.http.get("/health").json()["kv"]["remote"]["state"]

    def stop(self):
        self.http.__exit__(None, None, None)


def test_redis_killed_mid_conversation_then_restarted(tmp_path, cold):
    node = RedisNode(str(tmp_path)).start()
    later = [0.0]  # the replicas' breaker clocks, moved on by the test
    a = _InProcess(tmp_path, "a", node.url, later, "--kv-remote-cooldown", "30")
    b = _InProcess(tmp_path, "b", node.url, later, "--kv-remote-cooldown", "30")
    try:
        msgs = topic_chat("volcanoes", 24)
        r1 = a.chat(msgs, 2)
        node.stop()  # killed
        msgs = [
            *msgs,
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Go on."},
        ]
        want = cold_chat(cold, msgs, max_tokens=4).choices[0].message.content
        for srv in (a, b, b, b):
            r = srv.chat(msgs, 4)
            assert r["choices"][0]["message"]["content"] == want
        assert r["ds4"]["rung"] != "remote"  # served locally
        # the clock stands still: b's failures opened its breaker, and the
        # cool-down cannot end while a slow machine runs the requests
        assert b.remote_state() == "cooldown"
        node = RedisNode(str(tmp_path), port=node.port).start()  # back, empty
        assert b.remote_state() == "cooldown"  # not tried again before the cool-down ends
        later[0] += 31.0  # the cool-down is over
        with node.client() as c:
            msgs2 = topic_chat("deserts", 24)
            r = a.chat(msgs2, 2)
            _wait_uploaded([c])
        msgs2 = [
            *msgs2,
            {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Then?"},
        ]
        r = b.chat(msgs2, 4)
        assert r["ds4"]["rung"] == "remote"
        assert b.remote_state() == "up"
    finally:
        a.stop()
        b.stop()
        node.stop()


def test_two_servers_200_mixed_requests_each(tmp_path, cold):
    """Two replicas x 200 requests drawn at random from 12 conversations x 4
    turns, in parallel, one Redis: every reply equals a cold server's, some
    come from the tier, and every remote checkpoint verifies afterwards."""
    import random
    import threading

    from ds4.cli import main

    node = RedisNode(str(tmp_path)).start()
    a = _replica(tmp_path, "a", node.url)
    b = _replica(tmp_path, "b", node.url)
    try:
        model = a.model()

        def msgs(conv, turn):
            out = topic_chat(f"topic{conv}", 16)
            for t in range(turn):
                out += [
                    {"role": "assistant", "content": f"Noted, part {t}."},
                    {"role": "user", "content": f"More {t}?"},
                ]
            return out

        want = {}
        for conv in range(12):
            for turn in range(4):
                r = cold_chat(cold, msgs(conv, turn), max_tokens=2)
                want[(conv, turn)] = r.choices[0].message.content
        rungs: list[str] = []
        errors: list[str] = []

        def drive(srv, seed):
            rng = random.Random(seed)
            c = srv.client()
            for _ in range(200):
                key = (rng.randrange(12), rng.randrange(4))
                try:
                    r = c.chat.completions.create(model=model, messages=msgs(*key), max_tokens=2)
                except Exception as e:  # a 5xx (or anything else) is a failure of the test
                    errors.append(f"{key}: {e}")
                    continue
                if r.choices[0].message.content != want[key]:
                    errors.append(f"{key}: wrong reply (rung {ds4_block(r)['rung']})")
                rungs.append(ds4_block(r)["rung"])

        threads = [threading.Thread(target=drive, args=(srv, i)) for i, srv in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert len(rungs) == 400 and "remote" in rungs
    finally:
        a.stop()
        b.stop()
    try:
        assert main(["kv", "verify", "--remote", node.url]) == 0  # every remote checkpoint verifies
    finally:
        node.stop()
