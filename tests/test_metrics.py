"""``GET /metrics`` (ds4.server.metrics) read back with prometheus_client's
own text parser after a known sequence of requests on every protocol: the
per-request counters and histograms hold exactly what the replies said
(their ``ds4`` blocks and usage), the store's and the tenants' series what
the operator's ``/health`` says; a tenant's key gets 403, no label value
carries prompt text, a path or a key. ``/ui/data``: the operator's view
and a tenant's (its own turns only). In-process (Starlette's TestClient
over the reference engine)."""

from __future__ import annotations

import collections
import os
import time

import httpx
import pytest
from helpers.checkpoints import flip_payload_byte
from helpers.metric_samples import samples
from starlette.testclient import TestClient

import ds4
from ds4.kvstore.entries import model_of
from ds4.server.app import create_app
from ds4.server.guard import Guard
from ds4.server.metrics import LATENCY_BUCKETS
from ds4.server.worker import Service
from ds4.turn import TurnDriver

KA, KB, KOPS = "sk-metrics-alice", "sk-metrics-bob", "sk-metrics-ops"
#: words only the prompts hold: no label may carry them
SECRET_WORDS = ("zebrafinch", "quokka", "axolotl")


def _chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about the {topic}, briefly, in two sentences please."}]


def _usage(protocol: str, body: dict) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of a reply, in its protocol's words."""
    u = body["usage"]
    if protocol == "messages":
        cached = u["cache_read_input_tokens"]
        return u["input_tokens"] + cached + u["cache_creation_input_tokens"], cached, u["output_tokens"]
    if protocol == "responses":
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]


def _idle(service: Service) -> None:
    """Until the worker's snapshot after the last job is published (it is
    taken a moment after the reply went out)."""
    for _ in range(400):
        if not service.status["busy"]:
            return
        time.sleep(0.01)
    raise AssertionError("the worker stayed busy")


@pytest.fixture
def served(tmp_path):
    eng = ds4.ReferenceEngine()
    store = ds4.KVStore(str(tmp_path / "kv"), budget_mb=64, min_tokens=8)
    service = Service(TurnDriver(eng, 512, store), "ds4-reference")
    guard = Guard([(KA, "alice"), (KB, "bob"), (KOPS, "ops")], admin_tenants=["ops"])
    with TestClient(create_app(service, guard=guard), base_url="http://127.0.0.1") as c:
        yield c, service, store


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _sequence(c: TestClient, store: ds4.KVStore) -> list[tuple[str, str, dict]]:
    """The known requests: (protocol, tenant, reply) of each answered one."""
    a, b = _auth(KA), _auth(KB)
    done = []

    def post(protocol: str, path: str, body: dict, headers: dict, tenant: str) -> dict:
        r = c.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        done.append((protocol, tenant, r.json()))
        return r.json()

    first = post(
        "chat", "/v1/chat/completions", {"model": "m", "messages": _chat("zebrafinch"), "max_tokens": 4}, a, "alice"
    )
    cold = first["ds4"]["cold_saved"]
    assert cold is not None  # the prompt's cold checkpoint
    follow = [*_chat("zebrafinch"), first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    post("chat", "/v1/chat/completions", {"model": "m", "messages": follow, "max_tokens": 3}, a, "alice")
    post("completions", "/v1/completions", {"model": "m", "prompt": "The quokka smiles at", "max_tokens": 5}, b, "bob")
    flip_payload_byte(
        os.path.join(store.dir, cold), keep_mtime=True
    )  # alice's cold checkpoint: rejected when next tried
    post("messages", "/v1/messages", {"model": "m", "max_tokens": 3, "messages": _chat("zebrafinch")}, a, "alice")
    post("responses", "/v1/responses", {"model": "m", "max_output_tokens": 2, "input": "An axolotl is"}, b, "bob")
    post("chat", "/v1/chat/completions", {"model": "m", "messages": _chat("zebrafinch"), "max_tokens": 2}, a, "alice")
    # refused by the worker (over the context): a 400, counted as rejected
    long = {"model": "m", "messages": [{"role": "user", "content": "quokka " * 600}], "max_tokens": 2}
    assert c.post("/v1/chat/completions", json=long, headers=a).status_code == 400
    return done


class Expected:
    """What the replies said, summed as the metrics should hold it."""

    def __init__(self, done: list[tuple[str, str, dict]]):
        self.series: dict[tuple[str, tuple], float] = collections.Counter()
        self.ttfts: dict[tuple, list[float]] = collections.defaultdict(list)
        self.loads, self.saves, self.rejections = collections.Counter(), collections.Counter(), collections.Counter()
        for protocol, _tenant, body in done:
            self._add(protocol, body)

    def _add(self, protocol: str, body: dict) -> None:
        info = body["ds4"]
        labels = (("protocol", protocol), ("rung", info["rung"]))
        prompt, cached, completion = _usage(protocol, body)
        for name, n in (("requests", 1), ("prompt_tokens", prompt), ("cached_tokens", cached)):
            self.series[(f"ds4_{name}_total", labels)] += n
        self.series[("ds4_prefilled_tokens_total", labels)] += prompt - cached
        self.series[("ds4_completion_tokens_total", labels)] += completion
        self.ttfts[labels].append(info["ttft_ms"] / 1000.0)
        self.loads[info["rung"]] += bool(info["loaded_path"])
        for reason in ("cold", "evict", "prompt"):
            self.saves[reason] += bool(info[f"{reason}_saved"])
        for rej in info["rejected"]:
            self.rejections[(rej["stage"], rej["code"])] += 1


def _check_histograms(got: dict, ttfts: dict[tuple, list[float]]) -> None:
    for labels, ts in ttfts.items():
        assert got[("ds4_ttft_seconds_count", labels)] == len(ts)
        assert got[("ds4_request_duration_seconds_count", labels)] == len(ts)
        assert got[("ds4_ttft_seconds_sum", labels)] == pytest.approx(sum(ts), abs=1e-5 * len(ts))
        for le in LATENCY_BUCKETS:
            if all(abs(t - le) > 1e-5 for t in ts):  # a TTFT within the replies' rounding of an edge: not decidable
                want_n = sum(t <= le for t in ts)
                assert got[("ds4_ttft_seconds_bucket", (("le", repr(float(le))), *labels))] == want_n
        assert got[("ds4_ttft_seconds_bucket", (("le", "+Inf"), *labels))] == len(ts)


def _check_store(got: dict, h: dict, want: Expected, budget: int) -> None:
    """The series read at scrape time: the same figures as the operator's /health."""
    for tenant, counters in h["tenants"].items():
        for name, value in counters.items():
            assert got[(f"ds4_tenant_{name}_total", (("tenant", tenant),))] == value
    assert got[("ds4_tenant_requests_total", (("tenant", "alice"),))] == 5  # 4 answered, 1 rejected
    assert got[("ds4_tenant_rejected_total", (("tenant", "alice"),))] == 1
    kv = h["kv"]
    assert got[("ds4_kv_checkpoints", ())] == kv["files"]
    assert got[("ds4_kv_bytes", ())] == kv["bytes"] > 0
    # the store's count also has the saves outside a ladder: a namespace switch's, continued snapshots
    assert got[("ds4_kv_stores_total", ())] == kv["stores"] >= sum(want.saves.values())
    assert got[("ds4_continued_saves_total", ())] == h["counters"]["continued_saves"]
    assert got[("ds4_kv_rejected_total", ())] == kv["rejected"] == sum(want.rejections.values())
    assert got[("ds4_kv_evictions_total", (("reason", "corrupt"),))] == kv["removed_corrupt"] == 1
    assert got[("ds4_kv_budget_bytes", ())] == budget
    assert got[("ds4_kv_index_heap_bytes", ())] > 0
    assert got[("ds4_kv_index_mismatches_total", ())] == kv["index_mismatches"] == 0  # an honest index
    for tenant, u in kv["tenants"].items():
        assert got[("ds4_kv_tenant_bytes", (("tenant", tenant),))] == u["bytes"]
    # one model here: its bytes, files and hits are the store's
    [(model, m)] = kv["models"].items()
    assert model == model_of(h["payload_abi"]) and len(model) == 16
    assert got[("ds4_kv_model_bytes", (("model", model),))] == m["bytes"] == kv["bytes"]
    assert got[("ds4_kv_model_checkpoints", (("model", model),))] == m["checkpoints"] == kv["files"]
    assert got[("ds4_kv_model_hits", (("model", model),))] == m["hits"] >= 1
    # every save's bytes by its reason: together what the store counted written, at least what is on disk
    written = {k[1][0][1]: v for k, v in got.items() if k[0] == "ds4_kv_written_bytes_total"}
    assert written == kv["written_by_reason"]
    assert sum(written.values()) == kv["bytes_written"] >= kv["bytes"] > 0 and written["cold"] > 0
    assert got[("ds4_kv_dedup_ratio", ())] == kv["dedup_ratio"] == 1.0  # no blocks here
    assert got[("ds4_kv_write_budget_bytes", ())] == got[("ds4_kv_written_day_bytes", ())] == 0
    assert got[("ds4_queue_depth", ())] == 0 and got[("ds4_worker_busy", ())] == 0
    assert got[("ds4_jobs_running", ())] == 0


def test_metrics_hold_exactly_what_the_replies_said(served):
    c, service, store = served
    done = _sequence(c, store)
    _idle(service)
    r = c.get("/metrics", headers=_auth(KOPS))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)

    want = Expected(done)
    assert want.rejections, "the flipped checkpoint was never tried: the sequence tests nothing of rejections"
    assert len({k[1] for k in want.series}) >= 3, "the sequence should reach several (protocol, rung) pairs"
    for key, value in want.series.items():
        assert got.get(key) == value, (key, got.get(key), value)
    # every such series the server has is one of those: nothing counted twice or elsewhere
    for name in ("ds4_requests_total", "ds4_prompt_tokens_total", "ds4_cached_tokens_total"):
        assert {k for k in got if k[0] == name} == {k for k in want.series if k[0] == name}
    _check_histograms(got, want.ttfts)
    for rung, n in want.loads.items():
        assert got.get(("ds4_checkpoint_loads_total", (("rung", rung),)), 0) == n
    for reason, n in want.saves.items():
        assert got.get(("ds4_checkpoint_saves_total", (("reason", reason),)), 0) == n
    for (stage, code), n in want.rejections.items():
        assert got[("ds4_checkpoint_rejections_total", (("code", code), ("stage", stage)))] == n
    assert got[("ds4_requests_failed_total", (("protocol", "chat"), ("reason", "rejected")))] == 1
    _check_store(got, c.get("/health", headers=_auth(KOPS)).json(), want, store.budget_bytes)
    assert got[("ds4_worker_busy_seconds_total", ())] >= sum(b["ds4"]["total_ms"] for _, _, b in done) / 1000.0

    # no label value carries prompt text, a path or a key
    values = {v for _, labels in got for _, v in labels}
    for v in values:
        assert "/" not in v and os.sep not in v, v
        assert not any(w in v for w in (*SECRET_WORDS, KA, KB, KOPS, str(store.dir))), v


def test_metrics_are_the_operators(served):
    c, _, _ = served
    r = c.get("/metrics", headers=_auth(KA))
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_only"
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", headers={"x-api-key": KOPS}).status_code == 200


def test_ui_data_operator_and_tenant_views(served):
    c, service, store = served
    _sequence(c, store)
    _idle(service)
    op = c.get("/ui/data", headers=_auth(KOPS)).json()
    assert op["operator"] is True
    assert {t["tenant"] for t in op["recent"]} == {"alice", "bob"}
    assert op["totals"]["turns"] == len(op["recent"]) == 6
    assert sum(b["turns"] for b in op["series"]) == 6
    assert op["budget_bytes"] == store.budget_bytes
    assert set(op["tenants_bytes"]) == {"alice", "bob"}
    assert [m["bytes"] for m in op["models_bytes"].values()] == [op["kv"]["bytes"]]
    assert sum(r["checkpoints"] for r in op["checkpoints"]["by_reason"].values()) == op["kv"]["files"]
    assert "cold" in op["checkpoints"]["by_reason"]
    w = op["writes"]
    assert sum(w["by_reason"].values()) >= op["kv"]["bytes"] and w["by_reason"]["cold"] > 0
    assert w["dedup_ratio"] == 1.0 and w["write_budget_bytes"] == 0
    # bob's own: his two turns, nothing of alice's, none of the store's or the queue's figures
    bob = c.get("/ui/data", headers=_auth(KB)).json()
    assert bob["operator"] is False and bob["tenant"] == "bob"
    assert [t["protocol"] for t in bob["recent"]] == ["responses", "completions"]
    assert not {"kv", "checkpoints", "tenants_bytes", "models_bytes", "queued", "sessions", "writes"} & set(bob)
    assert all("tenant" not in t for t in bob["recent"])
    # no text in a turn's row: the divergence is its place only
    for t in op["recent"]:
        assert t["divergence"] is None or set(t["divergence"]) == {"against", "token", "byte"}
    assert c.get("/ui/data").status_code == 401


def test_page_files_load_without_a_key(served):
    c, _, _ = served
    for path, kind in (("/ui", "text/html"), ("/ui/ui.js", "text/javascript"), ("/ui/ui.css", "text/css")):
        r = c.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        assert "script-src 'self'" in r.headers["content-security-policy"]
    assert b'data-needs-key="true"' in c.get("/ui").content
    assert c.post("/ui").status_code in (401, 405)  # only GET is open


def test_the_page_its_data_and_metrics_can_never_be_framed(served):
    c, _, _ = served
    for path, key in (("/ui", None), ("/ui/ui.js", None), ("/ui/data", KOPS), ("/ui/data", KB), ("/metrics", KOPS)):
        r = c.get(path, headers=_auth(key) if key else {})
        assert r.status_code == 200, path
        assert r.headers["x-frame-options"] == "DENY", path
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"], path
        assert r.headers["x-content-type-options"] == "nosniff", path
    r = c.get("/metrics", headers=_auth(KA))  # the tenant's refusal too
    assert r.status_code == 403 and r.headers["x-frame-options"] == "DENY"


def test_no_metrics_serves_neither(tmp_path):
    service = Service(TurnDriver(ds4.ReferenceEngine(), 256), "ds4-reference")
    with TestClient(create_app(service, metrics=False), base_url="http://127.0.0.1") as c:
        for path in ("/metrics", "/ui", "/ui/data", "/ui/ui.js"):
            assert c.get(path).status_code == 404, path
        assert c.get("/health").status_code == 200


def test_serve_no_metrics_flag(tmp_path, serve):
    """``ds4 serve --no-metrics``: a real server without the routes; one
    without the flag has them."""

    off = serve("--no-kv-cache", "--no-metrics", name="off", tmp=tmp_path)
    assert httpx.get(off.base + "/metrics", timeout=10).status_code == 404
    assert httpx.get(off.base + "/ui", timeout=10).status_code == 404
    off.stop()
    on = serve("--no-kv-cache", name="on", tmp=tmp_path)
    r = httpx.get(on.base + "/metrics", timeout=10)
    assert r.status_code == 200 and "ds4_queue_depth 0.0" in r.text


def test_keyless_server_shows_everyone_the_metrics(tmp_path):
    service = Service(TurnDriver(ds4.ReferenceEngine(), 256), "ds4-reference")
    with TestClient(create_app(service), base_url="http://127.0.0.1") as c:
        body = {"model": "m", "prompt": "The quokka smiles at", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
        got = samples(c.get("/metrics").text)
        assert got[("ds4_requests_total", (("protocol", "completions"), ("rung", "prefill")))] == 1
        assert ("ds4_kv_bytes", ()) not in got  # no store: no store series
        assert b'data-needs-key="false"' in c.get("/ui").content


def test_a_failing_observation_never_reaches_the_worker(caplog):
    """The observer runs inside the job's post, in the worker thread: a
    failure there loses the figure, never the reply (nor the worker)."""
    from ds4.server.metrics import Metrics

    service = Service(TurnDriver(ds4.ReferenceEngine(), 256), "ds4-reference")
    try:
        m = Metrics(service)
        m.observer("chat", "alice")("done", object())  # not a GenResult
        assert "was not counted" in caplog.text
        assert not any(s.name == "ds4_requests_total" for f in m.registry.collect() for s in f.samples)
    finally:
        service.close()


def test_ui_data_lists_the_resident_sessions(tmp_path):
    """With ``--sessions 2`` the operator's data has the pool's residents
    (``/health``'s ``sessions``); with one, no such list."""
    from ds4.server.pool import Pool

    gen = TurnDriver(ds4.ReferenceEngine(), 256)
    service = Service(gen, "ds4-reference", pool=Pool(gen, 2))
    with TestClient(create_app(service), base_url="http://127.0.0.1") as c:
        body = {"model": "m", "prompt": "The quokka smiles at", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
        _idle(service)
        sessions = c.get("/ui/data").json()["sessions"]
        assert sessions == c.get("/health").json()["sessions"]
        assert [s["index"] for s in sessions] == [0, 1] and sum(s["served"] for s in sessions) == 1
    single = Service(TurnDriver(ds4.ReferenceEngine(), 256), "ds4-reference")
    with TestClient(create_app(single), base_url="http://127.0.0.1") as c:
        assert "sessions" not in c.get("/ui/data").json()
