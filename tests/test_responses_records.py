"""Stored Responses: bound to the tenant that created them, and retrievable
(``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items``) with the
official ``openai`` client, against ``ds4 serve`` over the scripted
reference engine (tests/helpers/agents.py).

Another tenant's id behaves exactly as an unknown id (the same status and
body); a round trip survives a restart with a cache directory; a deleted
id is unknown to ``previous_response_id``; ``store: false`` is never
retrievable; a corrupt record is a clean not-found and is removed, never a
500. The records' lock excludes the other threads of the process."""

from __future__ import annotations

import json
import os
import threading

import httpx
import openai
import pytest
from helpers.agents import KV_FLAGS, RTOOLS, SYSTEM, ScriptedServer

from ds4.kvstore.files import DirLock
from ds4.kvstore.records import RecordStore
from ds4.server.response_store import record_key
from ds4.server.tenants import ANONYMOUS

KA, KB = "sk-records-alice", "sk-records-bob"
UNKNOWN = "resp_" + "0" * 32


def _keyed(serve, tmp, name, *flags):
    """A server with two tenants' keys, alice the operator, started through
    the ``serve`` (or ``serve_module``) factory."""
    keys = tmp / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\n", encoding="utf-8")
    flags = ("--api-key-file", str(keys), "--admin-tenant", "alice", *flags)
    # KA: the key of health() (the operator's view) and client()
    return serve(*flags, name=name, cls=ScriptedServer, tmp=tmp, key=KA)


@pytest.fixture(scope="module", params=["disk", "memory"])
def keyed(request, serve_module, tmp_path_factory):
    """A server with two tenants' keys, its records in a cache directory or in memory."""
    tmp = tmp_path_factory.mktemp(f"keyed-{request.param}")
    flags = ["--kv-disk-dir", str(tmp / "kv"), *KV_FLAGS] if request.param == "disk" else ["--no-kv-cache"]
    srv = _keyed(serve_module, tmp, request.param, *flags)
    srv.records = str(tmp / "kv" / "records") if request.param == "disk" else None
    yield srv
    srv.stop()  # before the other mode's


@pytest.fixture(scope="module")
def open_srv(serve_module):
    """A server without keys (every request is the anonymous tenant), with a cache directory."""
    srv = serve_module(*KV_FLAGS, name="open", cls=ScriptedServer, kv=True)
    srv.records = str(srv.tmp / "kv" / "records")
    return srv


def create(client, input, **kw):
    return client.responses.create(model="gpt-x", instructions=SYSTEM, input=input, tools=RTOOLS, **kw)


def outputs_for(r):
    """Tool outputs for the response's calls."""
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    return [{"type": "function_call_output", "call_id": c.call_id, "output": f"{c.arguments} is 42"} for c in calls]


def body(r) -> dict:
    """The response object as created, without ds4's own block."""
    d = r.to_dict()
    d.pop("ds4", None)
    return d


def raw_error(srv, method, path, key, **kw):
    r = httpx.request(method, srv.base + path, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kw)
    return r.status_code, r.json()


def record_path(srv, rid, legacy=False):
    """Where ``srv`` keeps ``rid``'s record: under its owner's key (alice's
    on the keyed servers, the anonymous tenant's on the open one), or under
    the bare id (``legacy``: a record written before the owner's digest)."""
    owner = "alice" if getattr(srv, "key", None) == KA else ANONYMOUS
    return os.path.join(srv.records, f"response-{rid if legacy else record_key(rid, owner)}.json")


def assert_unknown_to(srv, key, rid):
    """Every route answers for ``rid`` exactly what it answers for an unknown id."""
    for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
        got = raw_error(srv, method, f"/v1/responses/{rid}{path}", key)
        ref = raw_error(srv, method, f"/v1/responses/{UNKNOWN}{path}", key)
        assert got[0] == ref[0] == 404, (method, path, got)
        assert json.dumps(got[1]).replace(rid, UNKNOWN) == json.dumps(ref[1]), (got, ref)
        assert got[1]["error"] == {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    prev = {"model": "m", "input": "And then?", "previous_response_id": rid}
    got = raw_error(srv, "POST", "/v1/responses", key, json=prev)
    ref = raw_error(srv, "POST", "/v1/responses", key, json={**prev, "previous_response_id": UNKNOWN})
    assert got[0] == ref[0] == 400 and json.dumps(got[1]).replace(rid, UNKNOWN) == json.dumps(ref[1])
    assert got[1]["error"]["code"] == "previous_response_not_found"


# ---------------------------------------------------------------------------
def test_another_tenant_cannot_continue_retrieve_list_or_delete(keyed):
    a, b = keyed.client(KA), keyed.client(KB)
    r = create(a, "Look up 4.")
    assert [o.type for o in r.output] == ["function_call"]
    with pytest.raises(openai.BadRequestError) as ei:  # the old lookup by id alone continued A's conversation
        create(b, outputs_for(r), previous_response_id=r.id)
    assert ei.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    assert_unknown_to(keyed, KB, r.id)
    for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):  # no key: the guard's 401
        resp = httpx.request(method, f"{keyed.base}/v1/responses/{r.id}{path}", timeout=60)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    if keyed.records:
        assert os.path.exists(record_path(keyed, r.id))
    # A's response is untouched: retrieved, listed and continued
    assert body(a.responses.retrieve(r.id)) == body(r)
    assert [i.type for i in a.responses.input_items.list(r.id)] == ["message"]
    r2 = create(a, outputs_for(r), previous_response_id=r.id)
    assert r2.output[0].type == "message" and r2.output[0].content[0].text.startswith("Result: ")
    # and B's own responses are B's alone
    rb = create(b, "Look up 5.", store=True)
    assert body(b.responses.retrieve(rb.id)) == body(rb)
    assert_unknown_to(keyed, KA, rb.id)
    assert keyed.health()["counters"]["errors"] == 0


def test_another_tenant_cannot_continue_the_live_tool_state(keyed):
    """Tool outputs alone (no previous response) continue the live state
    only for its own tenant: B answering A's calls gets ds4's 409, as when
    the state is gone, and A's own answer still continues from it."""
    a, b = keyed.client(KA), keyed.client(KB)
    r = create(a, "Look up 8.", store=False)
    with pytest.raises(openai.ConflictError) as ei:
        create(b, outputs_for(r))
    assert "replaying the full input history" in ei.value.message
    assert "responses live continuation declined: the live state is another namespace's" in keyed.text_log()
    # B's attempt moved nothing: A's outputs still continue A's live state
    r2 = create(a, outputs_for(r))
    assert r2.output[0].content[0].text.startswith("Result: ")
    assert r2.usage.input_tokens_details.cached_tokens >= 0.95 * r2.usage.input_tokens


def test_store_false_is_not_retrievable(keyed):
    a = keyed.client(KA)
    r = create(a, "Look up 7.", store=False)
    assert r.store is False
    assert_unknown_to(keyed, KA, r.id)


def _input_ids(client, rid, **kw):
    return [i.id for i in client.responses.input_items.list(rid, **kw).data]


def test_round_trip_and_restart(tmp_path, serve):
    kv = tmp_path / "kv"
    srv = _keyed(serve, tmp_path, "first", "--kv-disk-dir", str(kv), *KV_FLAGS)
    srv.records = str(kv / "records")
    a = srv.client(KA)
    r1 = create(a, "Look up 4.")
    r2 = create(a, outputs_for(r1), previous_response_id=r1.id)
    r3 = create(a, "And 11?", previous_response_id=r2.id, metadata={"k": "v"}, max_output_tokens=64)
    for r in (r1, r2, r3):
        got = a.responses.retrieve(r.id)
        assert body(got) == body(r) and got.usage.input_tokens == r.usage.input_tokens > 0
    asc = a.responses.input_items.list(r3.id, order="asc").data
    (call,) = [o for o in r1.output if o.type == "function_call"]
    assert [(i.type, getattr(i, "role", None)) for i in asc] == [
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert asc[0].content[0].text == "Look up 4." and asc[4].content[0].text == "And 11?"
    # the earlier outputs keep the ids they were created with
    assert (asc[1].id, asc[1].call_id, asc[1].arguments) == (call.id, call.call_id, call.arguments)
    assert asc[2].call_id == call.call_id and asc[2].output == f"{call.arguments} is 42"
    assert asc[3].id == r2.output[0].id and asc[3].content[0].text == r2.output[0].content[0].text
    ids = [i.id for i in asc]
    assert len(set(ids)) == len(ids)
    page = a.responses.input_items.list(r3.id, limit=2)
    assert [i.id for i in page.data] == ids[::-1][:2] and page.has_more
    assert (page.first_id, page.last_id) == (ids[-1], ids[-2])
    assert [i.id for i in a.responses.input_items.list(r3.id, limit=2)] == ids[::-1]  # all pages, default desc
    assert _input_ids(a, r3.id, order="asc", after=ids[1], limit=2) == ids[2:4]
    last = a.responses.input_items.list(r3.id, order="asc", after=ids[-1])
    assert last.data == [] and last.has_more is False
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_nothere"}):
        with pytest.raises(openai.BadRequestError):
            a.responses.input_items.list(r3.id, **bad)
    before = {r.id: body(a.responses.retrieve(r.id)) for r in (r1, r2, r3)}
    items_before = _input_ids(a, r3.id, order="asc")
    srv.stop()
    srv = _keyed(serve, tmp_path, "second", "--kv-disk-dir", str(kv), *KV_FLAGS)
    srv.records = str(kv / "records")
    a = srv.client(KA)
    assert {r.id: body(a.responses.retrieve(r.id)) for r in (r1, r2, r3)} == before
    assert _input_ids(a, r3.id, order="asc") == items_before
    assert_unknown_to(srv, KB, r2.id)  # the owner survives the restart
    status, deleted = raw_error(srv, "DELETE", f"/v1/responses/{r2.id}", KA)
    assert (status, deleted) == (200, {"id": r2.id, "object": "response", "deleted": True})
    assert not os.path.exists(record_path(srv, r2.id))
    assert_unknown_to(srv, KA, r2.id)  # retrieve, list, delete again: 404; previous_response_id: 400
    # the others stand (r3's record holds its whole conversation)
    assert body(a.responses.retrieve(r3.id)) == before[r3.id]
    a.responses.delete(r1.id)  # the official client's delete (it returns None)
    assert_unknown_to(srv, KA, r1.id)
    r4 = create(a, "And 12?", previous_response_id=r3.id)
    assert r4.status == "completed" and srv.health()["counters"]["errors"] == 0


def test_a_streamed_response_is_retrieved_as_it_completed(open_srv):
    c = open_srv.client()
    with c.responses.create(
        model="m", instructions=SYSTEM, input="Look up 6.", tools=RTOOLS, stream=True, temperature=0.5
    ) as s:
        done = [e for e in s if e.type == "response.completed"][-1].response
    got = c.responses.retrieve(done.id)
    assert body(got) == body(done) and got.temperature == 0.5 and got.usage.output_tokens > 0
    assert [i.content[0].text for i in c.responses.input_items.list(done.id)] == ["Look up 6."]


def _corruptions():
    head = {"id": "resp_other", "created_at": 1, "status": "completed", "usage": {}}
    msgs = [{"id": "msg_1", "role": "user", "content": "x"}, {"id": "msg_2", "role": "assistant", "content": "y"}]
    return {
        "truncated": None,  # the file cut in half
        "garbage": b"\x00\xff not json at all",
        "not-an-object": b"[1, 2, 3]",
        "bad-messages": json.dumps({"messages": 5}).encode(),
        "bad-call": json.dumps({"messages": [{"role": "assistant", "content": "", "tool_calls": [[1]]}]}).encode(),
        "other-id": json.dumps({"v": 2, "owner": "alice", "response": head, "messages": msgs}).encode(),
        "deep": b"[" * 100_000,
    }


@pytest.mark.parametrize("kind", list(_corruptions()))
def test_corrupt_record_is_a_clean_not_found_and_is_removed(open_srv, kind):
    srv = open_srv
    c = srv.client()
    for route in ("retrieve", "previous", "items"):
        r = create(c, f"Look up {len(kind)}.")
        path = record_path(srv, r.id)
        data = _corruptions()[kind]
        if data is None:
            with open(path, "rb") as f:
                whole = f.read()
            data = whole[: len(whole) // 2]
        with open(path, "wb") as f:
            f.write(data)
        if route == "retrieve":
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(r.id)
        elif route == "items":
            with pytest.raises(openai.NotFoundError):
                c.responses.input_items.list(r.id)
        else:
            with pytest.raises(openai.BadRequestError) as ei:
                create(c, outputs_for(r), previous_response_id=r.id)
            assert ei.value.code == "previous_response_not_found"
        assert not os.path.exists(path), "the corrupt record was kept"
        assert_unknown_to(srv, "unused", r.id)
    assert f"record {os.path.basename(path)} unreadable" in srv.text_log()
    assert "unhandled error" not in srv.text_log() and srv.health()["counters"]["errors"] == 0


def test_a_symlinked_record_is_not_followed_nor_removed(open_srv, tmp_path):
    c = open_srv.client()
    r = create(c, "Look up 3.")
    target = tmp_path / "elsewhere.json"
    os.replace(record_path(open_srv, r.id), target)
    os.symlink(target, record_path(open_srv, r.id))
    assert_unknown_to(open_srv, "unused", r.id)
    assert os.path.islink(record_path(open_srv, r.id)) and target.exists()


def test_records_of_the_first_format_belong_to_the_anonymous_tenant(open_srv, tmp_path, serve):
    """A record written before responses had owners (messages only): on a
    server without keys it still continues a conversation and can be
    deleted, but has no response object to retrieve; on a server with keys
    it is no tenant's."""
    rid = "resp_" + "1" * 32
    old = {"messages": [{"role": "user", "content": "Look up 9."}, {"role": "assistant", "content": "Nine."}]}
    with open(record_path(open_srv, rid, legacy=True), "w", encoding="utf-8") as f:
        json.dump(old, f)
    c = open_srv.client()
    r = create(c, "And 10?", previous_response_id=rid)
    assert r.status == "completed"
    assert [i.content[0].text for i in c.responses.input_items.list(r.id, order="asc")] == [
        "Look up 9.",
        "Nine.",
        "And 10?",
    ]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list(rid)
    c.responses.delete(rid)
    assert not os.path.exists(record_path(open_srv, rid, legacy=True))
    # the same record under a server with keys: nobody's
    kv = tmp_path / "kv"
    os.makedirs(kv / "records")
    with open(kv / "records" / f"response-{rid}.json", "w", encoding="utf-8") as f:
        json.dump(old, f)
    srv = _keyed(serve, tmp_path, "keyed-old", "--kv-disk-dir", str(kv), *KV_FLAGS)
    srv.records = str(kv / "records")
    for key in (KA, KB):
        assert_unknown_to(srv, key, rid)
    assert os.path.exists(record_path(srv, rid, legacy=True))  # not corrupt: kept


# -- the lock the records are kept under -------------------------------------------
class _WatchedLock:
    """A thread lock that sets ``moved`` when a thread finds it held by
    another and starts waiting for it: the proof that the other thread
    reached ``held()`` while the lock was held."""

    def __init__(self, inner, moved):
        self.inner, self.moved = inner, moved

    def acquire(self, blocking=True, timeout=-1):
        if self.inner.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.moved.set()
        return self.inner.acquire(True, timeout)

    def release(self):
        self.inner.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def test_the_store_lock_excludes_other_threads(tmp_path):
    """The worker stores (holding the directory's lock) while a request
    thread deletes a record: the lock is re-entrant within one thread only."""
    lock = DirLock(str(tmp_path))
    held, release, moved = threading.Event(), threading.Event(), threading.Event()
    lock._thread_lock = _WatchedLock(lock._thread_lock, moved)
    seen = {}

    def holder():
        with lock.held(), lock.held():  # re-entrant in its own thread
            held.set()
            release.wait(30)
            seen["released"] = True

    def other():
        with lock.try_held() as got:
            seen["try_held"] = got
        with lock.held():
            seen["entered_after_release"] = seen.get("released", False)
        moved.set()  # also when held() let it in without waiting (the test then fails)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(30)
    u = threading.Thread(target=other)
    u.start()
    assert moved.wait(30)  # the other thread waits in held() (or got in: see below)
    release.set()
    t.join(30)
    u.join(30)
    assert seen == {"released": True, "try_held": False, "entered_after_release": True}


def test_record_store_delete_and_check(tmp_path):
    lock = DirLock(str(tmp_path))
    rs = RecordStore(str(tmp_path), 1 << 16, lock.held)
    assert rs.put("response", "resp_a", {"messages": [1]}) and rs.put("response", "resp_b", {"x": 1})
    total = rs.total_bytes()
    assert rs.delete("response", "resp_a") and not rs.delete("response", "resp_a")
    assert rs.get("response", "resp_a") is None and rs.total_bytes() < total
    # a record its reader's check rejects is missing and removed
    assert rs.get("response", "resp_b", lambda d: d["messages"]) is None
    assert not os.path.exists(tmp_path / "records" / "response-resp_b.json") and rs.total_bytes() == 0
    with pytest.raises(ValueError):
        rs.delete("response", "../x")


def test_another_tenants_id_costs_what_an_unknown_id_costs(tmp_path, monkeypatch):
    """Constant time by construction: a record's name holds its owner's
    digest, so bob's lookup of alice's id opens names that do not exist, as
    for an unknown id: the same calls, each failing the same way, no byte
    read (a timing difference was measurable when bob's lookup read alice's
    record and compared owners)."""
    from ds4.server.response_store import KIND, StoredResponses

    rs = RecordStore(str(tmp_path), 1 << 16)
    stored = StoredResponses(rs, "m")
    rid = "resp_" + "a" * 32
    rec = {
        "owner": "alice",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}],
    }
    assert rs.put(KIND, record_key(rid, "alice"), rec)
    assert stored.lookup(rid, "alice") == rec
    calls = []
    real_open = os.open

    def spy(path, *a, **kw):
        try:
            fd = real_open(path, *a, **kw)
        except OSError as e:
            calls.append((os.path.basename(str(path)).replace(rid, "ID").replace(UNKNOWN, "ID"), e.errno))
            raise
        calls.append((os.path.basename(str(path)).replace(rid, "ID").replace(UNKNOWN, "ID"), "opened"))
        return fd

    monkeypatch.setattr(os, "open", spy)
    assert stored.lookup(rid, "bob") is None
    theirs, calls[:] = list(calls), []
    assert stored.lookup(UNKNOWN, "bob") is None
    unknown = list(calls)
    assert theirs == unknown
    files = [c for c in theirs if c[0] != os.path.basename(rs.dir)]
    assert len(files) == 2 and all(c[1] != "opened" for c in files)  # the owner's name, then the bare id: none exists
