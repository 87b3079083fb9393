"""Issue 42 item 2: a save that does not happen says why.

Each case makes the store decline (or fail) a real save and checks the
reason where a caller sees it: ``KVStore.store_live_checked`` (while
``store_live_prefix`` keeps its contract: None, or the ``OSError``), the
``save_skipped`` of the report a turn returns (cold, evict, prompt and
continued saves), and through the server: the ``ds4`` block, ``/metrics``
and ``/ui/data`` (a real ``ds4 serve`` on the reference engine, and one
in process for a store over its budget)."""

from __future__ import annotations

import errno
import hashlib
import os
import time

import httpx
import pytest
from helpers.kv import BASE, prefilled, toks
from helpers.metric_samples import samples
from starlette.testclient import TestClient

import ds4
from ds4.checkpoint import write_checkpoint
from ds4.errors import InvalidSessionError, StoreFullError
from ds4.kvstore import SaveSkip, checkpoint_name, save
from ds4.kvstore.skips import SKIP_CODES
from ds4.turn import GenParams, TurnDriver


def kv_files(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".kv"))


# -- the store: store_live_checked, and store_live_prefix's contract kept ----------


def test_the_codes_are_a_stable_set():
    assert SKIP_CODES == (
        "engine_cannot_load",
        "below_min_tokens",
        "above_cold_max_tokens",
        "name_held_by_other_model",
        "over_budget",
        "disk_full",
        "write_error",
        "session_invalid",
        "write_budget",
    )
    skip = SaveSkip("cold", "below_min_tokens", "40 tokens < min 64")
    assert str(skip) == "cold save skipped: below_min_tokens (40 tokens < min 64)"
    assert skip.as_dict() == {"kind": "cold", "code": "below_min_tokens", "detail": "40 tokens < min 64"}


def test_below_min_tokens(eng, tmp_path):
    s = prefilled(eng, BASE[:30])
    st = ds4.KVStore(tmp_path, min_tokens=s.n_past + 1)
    assert st.store_live_prefix(s, "evict") is None
    assert st.store_live_checked(s, "evict") == SaveSkip(
        "evict", "below_min_tokens", f"{s.n_past} tokens < min {s.n_past + 1}"
    )
    # the caller's own minimum (ds4 chat's named saves) is the one reported
    st = ds4.KVStore(tmp_path, min_tokens=1)
    got = st.store_live_checked(s, "named", min_tokens=s.n_past + 5)
    assert got == SaveSkip("named", "below_min_tokens", f"{s.n_past} tokens < min {s.n_past + 5}")
    assert kv_files(tmp_path) == []
    assert st.store_live_checked(s, "named", min_tokens=s.n_past) == st.store_live_prefix(s, "named")


def test_over_budget(eng, tmp_path):
    s = prefilled(eng, BASE)
    st = ds4.KVStore(tmp_path, budget_mb=0.01, min_tokens=8)
    assert st.store_live_prefix(s, "cold") is None
    got = st.store_live_checked(s, "cold")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("cold", "over_budget")
    assert got.detail.startswith("estimated file size ") and got.detail.endswith("exceeds the budget of 0.0 MiB")
    assert kv_files(tmp_path) == [] and st.stats["stores"] == 0


def _foreign(tmp_path, s) -> str:
    """Another engine's checkpoint (another payload ABI) under the name
    ``s``'s own save would take (a file copied or renamed into the
    directory: per-model names never collide otherwise)."""
    key = s.key_bytes()
    path = os.path.join(tmp_path, checkpoint_name(hashlib.sha1(key).hexdigest(), s.payload_abi))
    write_checkpoint(path, key, s.export_arrays(), abi="another-engine/9", tokens=s.n_past, ctx=s.ctx)
    return path


def test_name_held_by_other_model(eng, tmp_path):
    s = prefilled(eng, BASE[:60])
    path = _foreign(tmp_path, s)
    st = ds4.KVStore(tmp_path, min_tokens=8)
    assert st.store_live_prefix(s, "cold") is None
    got = st.store_live_checked(s, "cold")
    name = os.path.basename(path)
    assert got == SaveSkip(
        "cold",
        "name_held_by_other_model",
        f"{name[:12]} is held by a file this engine cannot load, another model's (kept)",
    )
    assert kv_files(tmp_path) == [name]  # kept


def test_legacy_name_of_other_model_does_not_block(eng, tmp_path):
    # an earlier release's <sha1>.kv of another model holds no name of ours
    s = prefilled(eng, BASE[:60])
    key = s.key_bytes()
    legacy = hashlib.sha1(key).hexdigest() + ".kv"
    write_checkpoint(
        os.path.join(tmp_path, legacy), key, s.export_arrays(), abi="another-engine/9", tokens=s.n_past, ctx=s.ctx
    )
    st = ds4.KVStore(tmp_path, min_tokens=8)
    got = st.store_live_checked(s, "cold")
    assert isinstance(got, str) and os.path.basename(got) == checkpoint_name(
        hashlib.sha1(key).hexdigest(), s.payload_abi
    )
    assert sorted(kv_files(tmp_path)) == sorted([legacy, os.path.basename(got)])


def test_engine_cannot_load(tmp_path):
    eng = ds4.ReferenceEngine()
    s = prefilled(eng, BASE[:60])
    eng.checkpoints_ok = False  # as the llama.cpp engine when its start-up round trip failed
    st = ds4.KVStore(tmp_path, min_tokens=8)
    assert st.store_live_prefix(s, "continued") is None
    got = st.store_live_checked(s, "continued")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("continued", "engine_cannot_load")
    assert kv_files(tmp_path) == []


def test_session_invalid(eng, tmp_path):
    s = prefilled(eng, BASE[:60])
    s.invalidate("a test")
    st = ds4.KVStore(tmp_path, min_tokens=8)
    with pytest.raises(InvalidSessionError):
        st.store_live_prefix(s, "evict")  # the contract: it must be valid
    got = st.store_live_checked(s, "evict")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("evict", "session_invalid")


@pytest.mark.parametrize(("err", "code"), [(errno.ENOSPC, "disk_full"), (errno.EIO, "write_error")])
def test_a_write_that_fails(eng, tmp_path, monkeypatch, err, code):
    """The file system's failure (stood in for at the writer: a real full
    disk is not made here); the store's own handling is what runs."""

    def failing(path, *a, **kw):
        raise OSError(err, os.strerror(err), path)

    monkeypatch.setattr(save, "write_checkpoint", failing)
    s = prefilled(eng, BASE[:60])
    st = ds4.KVStore(tmp_path, min_tokens=8)
    with pytest.raises(OSError) as raised:
        st.store_live_prefix(s, "cold")  # the contract: the typed error
    assert isinstance(raised.value, StoreFullError) == (err == errno.ENOSPC)
    got = st.store_live_checked(s, "cold")
    assert isinstance(got, SaveSkip) and (got.kind, got.code) == ("cold", code)
    assert os.strerror(err) in got.detail and str(tmp_path) not in got.detail  # no path


# -- the report: the ladder's saves ------------------------------------------------

UNRELATED = "Zebra stripes: nothing in common with anything stored here"


def _cold_store(tmp_path, **kw):
    kw.setdefault("min_tokens", 64)
    kw.setdefault("boundary_trim_tokens", 32)
    kw.setdefault("boundary_align_tokens", 64)
    return ds4.KVStore(tmp_path, **kw)


def test_a_cold_save_below_min_tokens_is_in_the_report(eng, tmp_path):
    prompt = "short and sweet, forty tokens or so: under min"
    n = len(toks(eng, prompt))
    assert n < 64
    rep = ds4.recover(ds4.Session(eng, ctx=512), _cold_store(tmp_path), prompt, cold_save=True)
    assert rep.cold_saved is None and kv_files(tmp_path) == []
    assert rep.save_skipped == [SaveSkip("cold", "below_min_tokens", f"{n} tokens < min 64")]
    assert rep.as_dict()["save_skipped"] == [
        {"kind": "cold", "code": "below_min_tokens", "detail": f"{n} tokens < min 64"}
    ]
    # long enough, but not once the boundary trim is taken off
    prompt = BASE[:80]
    n = len(toks(eng, prompt))
    assert 64 <= n < 96
    rep = ds4.recover(ds4.Session(eng, ctx=512), _cold_store(tmp_path), prompt, cold_save=True)
    detail = f"{n} tokens less the 32-token boundary trim: {n - 32} < min 64"
    assert rep.save_skipped == [SaveSkip("cold", "below_min_tokens", detail)]
    # without cold_save, nothing was to be saved: nothing is reported
    assert ds4.recover(ds4.Session(eng, ctx=512), _cold_store(tmp_path), prompt).save_skipped == []


def test_a_cold_save_above_cold_max_tokens_is_in_the_report(eng, tmp_path):
    prompt = BASE * 2
    n = len(toks(eng, prompt))
    st = _cold_store(tmp_path, cold_max_tokens=n - 1)
    rep = ds4.recover(ds4.Session(eng, ctx=512), st, prompt, cold_save=True)
    assert rep.save_skipped == [SaveSkip("cold", "above_cold_max_tokens", f"{n} tokens > cold max {n - 1}")]
    # 0: cold saves are off, not declined
    off = _cold_store(tmp_path, cold_max_tokens=0)
    assert ds4.recover(ds4.Session(eng, ctx=512), off, prompt, cold_save=True).save_skipped == []


def test_an_over_budget_cold_save_is_in_the_report(eng, tmp_path):
    st = _cold_store(tmp_path, budget_mb=0.01, min_tokens=8, boundary_align_tokens=8)
    rep = ds4.recover(ds4.Session(eng, ctx=512), st, BASE * 2, cold_save=True)
    assert rep.rung == "prefill" and rep.cold_saved is None and kv_files(tmp_path) == []
    assert [(k.kind, k.code) for k in rep.save_skipped] == [("cold", "over_budget")]


def test_an_evict_save_of_a_name_held_by_another_model_is_in_the_report(eng, tmp_path):
    live = prefilled(eng, BASE[:60], ctx=512)
    path = _foreign(tmp_path, live)
    st = ds4.KVStore(tmp_path, min_tokens=8)
    rep = ds4.recover(live, st, UNRELATED)
    assert rep.rung == "prefill" and rep.evict_saved is None
    assert [(k.kind, k.code) for k in rep.save_skipped] == [("evict", "name_held_by_other_model")]
    assert os.path.basename(path)[:12] in rep.save_skipped[0].detail
    assert kv_files(tmp_path) == [os.path.basename(path)]


def test_an_evict_save_below_min_tokens_is_reported_once(eng, tmp_path):
    live = prefilled(eng, BASE[:20], ctx=512)
    n = live.n_past
    st = ds4.KVStore(tmp_path, min_tokens=n + 1)
    rep = ds4.recover(live, st, UNRELATED)
    assert rep.save_skipped == [SaveSkip("evict", "below_min_tokens", f"{n} tokens < min {n + 1}")]
    # evict_save=False: the caller turned it off, nothing to report
    live = prefilled(eng, BASE[:20], ctx=512)
    assert ds4.recover(live, st, UNRELATED, evict_save=False).save_skipped == []


def test_the_prompt_save_is_reported_as_prompt(eng, tmp_path):
    """The whole prompt's save (written with reason ``continued``) is the
    ``prompt`` kind, as ``prompt_saved`` and the metrics' ``prompt``."""
    prompt = BASE[:40]
    n = len(toks(eng, prompt))
    st = ds4.KVStore(tmp_path, min_tokens=n + 1)
    rep = ds4.recover(ds4.Session(eng, ctx=512), st, prompt, prompt_save=True)
    assert rep.prompt_saved is None
    assert rep.save_skipped == [SaveSkip("prompt", "below_min_tokens", f"{n} tokens < min {n + 1}")]


# -- the report of a turn: the continued saves too ----------------------------------


def test_a_turns_continued_saves_over_budget_are_in_its_report(eng, tmp_path):
    st = ds4.KVStore(
        tmp_path,
        budget_mb=0.01,
        min_tokens=8,
        boundary_trim_tokens=4,
        boundary_align_tokens=8,
        continued_interval_tokens=16,
    )
    gen = TurnDriver(eng, 512, st)
    res = gen.generate(BASE * 2, GenParams(max_tokens=40))
    kinds = [(k.kind, k.code) for k in res.report.save_skipped]
    assert kinds[0] == ("cold", "over_budget")
    assert kinds.count(("continued", "over_budget")) >= 2  # the prefill's frontiers and the generation's
    assert set(kinds) == {("cold", "over_budget"), ("continued", "over_budget")}
    assert kv_files(tmp_path) == [] and gen.counters["continued_saves"] == 0
    # the next turn's report has its own skips only
    res2 = gen.generate(BASE * 2 + res.text + " and more", GenParams(max_tokens=1))
    assert res2.report.save_skipped is not res.report.save_skipped
    assert len(res.report.save_skipped) == len(kinds)


# -- through the server ------------------------------------------------------------


def _skip_series(got: dict) -> dict[tuple[str, str], float]:
    """``ds4_checkpoint_saves_skipped_total`` by (kind, code)."""
    return {
        (dict(labels)["kind"], dict(labels)["code"]): v
        for (name, labels), v in got.items()
        if name == "ds4_checkpoint_saves_skipped_total"
    }


def test_a_real_server_says_why_it_did_not_save(tmp_path, serve):
    """A real ``ds4 serve``: a short prompt's cold save and, when an
    unrelated prompt replaces it, its evict save are below
    ``--kv-cache-min-tokens``: the ``ds4`` block, ``/metrics`` and
    ``/ui/data`` say so."""

    srv = serve("--kv-disk-dir", str(tmp_path / "kv"), "--kv-cache-min-tokens", "64", name="skips", tmp=tmp_path)
    c = srv.client()
    model = srv.model()
    a = c.completions.create(model=model, prompt="Tides rise because", max_tokens=4)
    n = a.usage.prompt_tokens
    assert n < 64
    info = a.model_extra["ds4"]
    assert info["rung"] == "prefill" and info["cold_saved"] is None
    cold = {"kind": "cold", "code": "below_min_tokens", "detail": f"{n} tokens < min 64"}
    assert info["save_skipped"] == [cold], info
    b = c.completions.create(model=model, prompt="Zebras run fast", max_tokens=2)
    live = n + a.usage.completion_tokens  # the first turn's state, all but its last token evaluated
    skipped = b.model_extra["ds4"]["save_skipped"]
    assert [(k["kind"], k["code"]) for k in skipped] == [
        ("evict", "below_min_tokens"),
        ("cold", "below_min_tokens"),
    ]
    assert skipped[0]["detail"] in (f"{live} tokens < min 64", f"{live - 1} tokens < min 64")

    got = _skip_series(samples(httpx.get(srv.base + "/metrics", timeout=10).text))
    assert got == {("cold", "below_min_tokens"): 2.0, ("evict", "below_min_tokens"): 1.0}

    data = httpx.get(srv.base + "/ui/data", timeout=10).json()
    assert [t["save_skipped"] for t in data["recent"]] == [skipped, [cold]]  # newest first
    assert data["save_skipped"] == {"below_min_tokens": {"cold": 2, "evict": 1}}
    assert "ui/ui.js" in httpx.get(srv.base + "/ui", timeout=10).text
    assert "save skipped: " in httpx.get(srv.base + "/ui/ui.js", timeout=10).text


def test_an_over_budget_store_in_the_ds4_block_and_the_metrics(eng, tmp_path):
    from ds4.server.app import create_app
    from ds4.server.worker import Service

    store = ds4.KVStore(tmp_path / "kv", budget_mb=0.01, min_tokens=8)
    service = Service(TurnDriver(eng, 512, store), "ds4-reference")
    with TestClient(create_app(service), base_url="http://127.0.0.1") as c:
        body = {"model": "m", "messages": [{"role": "user", "content": BASE}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        skipped = r.json()["ds4"]["save_skipped"]
        assert [(k["kind"], k["code"]) for k in skipped] == [("cold", "over_budget")]
        assert "exceeds the budget of 0.0 MiB" in skipped[0]["detail"]
        for _ in range(400):  # the worker's snapshot after the job
            if not service.status["busy"]:
                break
            time.sleep(0.01)
        got = _skip_series(samples(c.get("/metrics").text))
        assert got == {("cold", "over_budget"): 1.0}
        assert c.get("/ui/data").json()["save_skipped"] == {"over_budget": {"cold": 1}}
    assert kv_files(tmp_path / "kv") == []
