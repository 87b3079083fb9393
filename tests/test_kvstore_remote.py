"""The shared checkpoint tier (ds4/kvstore/remote.py) against real
``redis-server`` processes: a single node and a three-master cluster.

Two stores with separate directories stand for two replicas: what one
stores, the other loads from Redis (rung ``remote``), bit-exact with a cold
prefill. Damaged chunks and manifests are rejected, deleted from Redis and
the next candidate is used; a dead or full Redis costs misses, never an
error."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from helpers.kv import prefilled
from helpers.redis_servers import RedisNode
from redis.crc import key_slot

import ds4
from ds4.checkpoint import open_checkpoint
from ds4.errors import RemoteManifestError
from ds4.kvstore import KVStore
from ds4.kvstore.remote import CHUNK_BYTES, KeyLayout, RemoteEntry, RemoteTier, parse_remote_url, redact_url
from ds4.recovery import recover

CHUNK = 64 * 1024  # small chunks: every test checkpoint spans several
MIN_TOKENS = 32


class Replicas:
    """Stores over separate directories sharing one tier URL; closed at the end."""

    def __init__(self, tmp_path, url, **tier_kw):
        self.tmp, self.url, self.tier_kw, self.stores = tmp_path, url, tier_kw, []

    def store(self, name, **kw):
        tier = RemoteTier(self.url, chunk_bytes=CHUNK, **self.tier_kw)
        st = KVStore(self.tmp / name, remote=tier, min_tokens=MIN_TOKENS, **kw)
        self.stores.append(st)
        return st

    def close(self):
        for st in self.stores:
            st.close()


@pytest.fixture
def replicas(tmp_path):
    made = []

    def make(url, **tier_kw):
        r = Replicas(tmp_path, url, **tier_kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _prompt(topic, n=40):
    return " ".join(f"{topic}-{i}" for i in range(n)) + " end."


def _stored(st, eng, prompt, ctx=2048):
    """A replica's checkpoint of ``prompt`` (prefilled here), stored and
    uploaded; its path."""
    s = prefilled(eng, prompt, ctx)
    path = st.store_live_prefix(s, "cold")
    assert path is not None
    assert st.remote.flush(30)
    return path


def _keys(node):
    with node.client() as c:
        return sorted(k.decode() for k in c.keys("ds4:*"))


# -- the URL ---------------------------------------------------------------
def test_remote_urls():
    assert parse_remote_url("redis://127.0.0.1:6379/2") == (False, "redis://127.0.0.1:6379/2")
    assert parse_remote_url("rediss://h:1/0") == (False, "rediss://h:1/0")
    assert parse_remote_url("redis+cluster://h:7000") == (True, "redis://h:7000")
    assert parse_remote_url("rediss+cluster://u:pw@h:7000") == (True, "rediss://u:pw@h:7000")
    for bad in ("http://h:1", "redis://", "redis://h:1/x", "redis+cluster://h:1/3", "redis://h:99999", "h:6379"):
        with pytest.raises(ValueError):
            parse_remote_url(bad)
    assert redact_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert "secret" not in RemoteTier("redis://:secret@h:1/0").status()["url"]
    with pytest.raises(ValueError):
        RemoteTier("redis://h:1/0", namespace="a{b}")
    with pytest.raises(ValueError):
        RemoteTier("redis://h:1/0", chunk_bytes=CHUNK_BYTES + 1)


def test_manifest_fields_are_checked():
    e = RemoteEntry("a" * 40, "abi", 100, 8, 10, 4, ("0" * 32,) * 3)
    assert RemoteEntry.from_bytes(e.to_bytes(), "a" * 40, "abi") == e
    d = json.loads(e.to_bytes())
    bad = [
        b"not json",
        b"[]",
        json.dumps({**d, "v": 2}).encode(),
        json.dumps({**d, "sha1": "b" * 40}).encode(),
        json.dumps({**d, "abi": "other"}).encode(),
        json.dumps({**d, "size": -1}).encode(),
        json.dumps({**d, "size": 11}).encode(),  # 3 chunks of 4 hold at most 12, 11 needs 3: fine; 13 needs 4
        json.dumps({**d, "chunks": d["chunks"][:2]}).encode(),
        json.dumps({**d, "chunks": ["zz" * 16] * 3}).encode(),
        json.dumps({**d, "chunk_bytes": CHUNK_BYTES + 1}).encode(),
        json.dumps({**d, "tokens": True}).encode(),
        json.dumps({**d, "text_bytes": 11}).encode(),
    ]
    ok = 0
    for raw in bad:
        try:
            RemoteEntry.from_bytes(raw, "a" * 40, "abi")
            ok += 1
        except RemoteManifestError as err:
            assert err.kind == "corrupt" and err.code == "remote_manifest"
    assert ok == 1  # only the size of 11 (still 3 chunks) is a valid manifest


# -- two replicas, one Redis -------------------------------------------------
@pytest.mark.parametrize("where", ["node", "cluster"])
def test_second_replica_resumes_from_the_tier(eng, request, replicas, where):
    srv = request.getfixturevalue("flushed" if where == "node" else "cluster")
    r = replicas(srv.url)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt(f"tides-{where}")
    _stored(a, eng, prompt)
    assert a.remote.stats["uploads"] == 1
    follow = prompt + " And one more question about it?"
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, follow, cold_save=True)
    assert rep.rung == "remote" and rep.source == "remote-text" and rep.remote == "up"
    assert rep.reused_tokens > MIN_TOKENS and not rep.rejected
    cold = prefilled(eng, follow, ctx=2048)
    assert s.tokens == cold.tokens
    assert np.array_equal(s.logits, cold.logits)  # bit-exact with a cold prefill
    # the file is now B's own: the next lookup is local
    s2 = ds4.Session(eng, ctx=2048)
    assert recover(s2, b, follow).rung == "disk"
    assert b.summary()["remote"]["hits"] == 1
    # the bytes each way (/metrics: ds4_kv_remote_uploaded_bytes_total, ..._downloaded_...): the one file's
    size = os.path.getsize(rep.loaded_path)
    assert a.remote.stats["bytes_uploaded"] == size == b.summary()["remote"]["bytes_downloaded"]
    assert a.remote.stats["bytes_downloaded"] == 0


def test_key_layout_one_tag_chunks_and_index(eng, flushed, replicas):
    r = replicas(flushed.url)
    a = r.store("a")
    prompt = _prompt("layout", 60)
    path = _stored(a, eng, prompt)
    name = os.path.basename(path)
    sha = name[:40]
    size = os.path.getsize(path)
    keys = KeyLayout("shared", ds4.Session(eng, ctx=2048).payload_abi)
    got = _keys(flushed)
    n_chunks = -(-size // CHUNK)
    assert n_chunks >= 2
    assert got == sorted([keys.index, keys.manifest(sha), *(keys.chunk(sha, i) for i in range(n_chunks))])
    with flushed.client() as c:
        slots = {key_slot(k.encode()) for k in got if k != keys.index}
        assert len(slots) == 1  # one hash tag per checkpoint
        assert all(c.strlen(keys.chunk(sha, i)) <= CHUNK for i in range(n_chunks))
        assert b"".join(c.get(keys.chunk(sha, i)) for i in range(n_chunks)) == Path(path).read_bytes()
        text_len = int(c.zrange(keys.index, 0, -1)[0].decode().partition(":")[0])
        assert c.ttl(keys.manifest(sha)) == -1 and c.ttl(keys.chunk(sha, 0)) == -1  # no TTL asked for
    assert text_len == open_checkpoint(path, load_payload=False).text_bytes


def test_a_half_upload_is_never_visible(eng, flushed, replicas, monkeypatch):
    r = replicas(flushed.url)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt("half")
    real_set = None

    def crash_before_commit(self, c, keys, sha, f, facts, blocks):
        nonlocal real_set
        # the chunks go up, then the uploader dies before its commit
        for i, chunk in enumerate(iter(lambda: f.read(CHUNK), b"")):
            c.set(keys.chunk(sha, i), chunk, ex=600)
        raise ConnectionError("killed mid-upload")

    monkeypatch.setattr(RemoteTier, "_upload", crash_before_commit)
    _stored(a, eng, prompt)
    assert a.remote.stats["upload_failed"] == 1
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, prompt + " next")
    assert rep.rung == "prefill" and not rep.rejected
    with flushed.client() as c:
        chunks = c.keys("ds4:*:c:*")
        assert chunks and all(0 < c.ttl(k) <= 600 for k in chunks)  # leftovers expire
        assert not c.keys("ds4:*:m")


def test_remote_only_when_longer_than_local(eng, flushed, replicas):
    r = replicas(flushed.url)
    a, b = r.store("a"), r.store("b")
    base = _prompt("longer")
    _stored(b, eng, base)  # B holds a short prefix itself (and uploads it)
    _stored(a, eng, base + " " + _prompt("more", 30))  # A a longer one
    s = ds4.Session(eng, ctx=2048)
    follow = base + " " + _prompt("more", 30) + " tail"
    rep = recover(s, b, follow)
    assert rep.rung == "remote"
    s2 = ds4.Session(eng, ctx=2048)
    assert recover(s2, b, base + " other").rung == "disk"  # the local one is as long as the tier's


# -- damage ------------------------------------------------------------------
def _two_remote_prefixes(eng, a, short, long):
    _stored(a, eng, short)
    _stored(a, eng, long)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    entries = sorted(a.remote.entries(abi), key=lambda e: -e.text_bytes)
    assert len(entries) == 2
    return KeyLayout("shared", abi), entries


def _flip(c, key, at=100):
    v = bytearray(c.get(key))
    v[at % len(v)] ^= 0x10
    c.set(key, bytes(v))


@pytest.mark.parametrize(
    "damage", ["chunk_bit_flip", "chunk_truncated", "chunk_missing", "manifest_garbage", "manifest_forged"]
)
def test_damaged_remote_entry_is_rejected_deleted_and_the_next_one_used(eng, flushed, replicas, damage):
    r = replicas(flushed.url)
    a, b = r.store("a"), r.store("b")
    short = _prompt("dmg", 40)
    long = short + " " + _prompt("dmg2", 40)
    keys, (top, second) = _two_remote_prefixes(eng, a, short, long)
    with flushed.client() as c:
        if damage == "chunk_bit_flip":
            _flip(c, keys.chunk(top.sha, 1))
        elif damage == "chunk_truncated":
            c.set(keys.chunk(top.sha, 0), c.get(keys.chunk(top.sha, 0))[:-7])
        elif damage == "chunk_missing":
            c.delete(keys.chunk(top.sha, 2))
        elif damage == "manifest_garbage":
            c.set(keys.manifest(top.sha), b'{"v":1,"sha1":')
        else:  # forged: a payload byte flipped and the manifest's digests recomputed to match
            _flip(c, keys.chunk(top.sha, 1), at=CHUNK // 2)
            digests = list(top.digests)
            digests[1] = xxhash.xxh3_128_hexdigest(c.get(keys.chunk(top.sha, 1)))
            forged = RemoteEntry(
                top.sha, top.abi, top.tokens, top.text_bytes, top.size, top.chunk_bytes, tuple(digests)
            )
            c.set(keys.manifest(top.sha), forged.to_bytes())
    s = ds4.Session(eng, ctx=2048)
    follow = long + " question?"
    rep = recover(s, b, follow)
    assert rep.rung == "remote" and rep.reused_tokens == second.tokens  # the next candidate
    assert [x[0] for x in rep.rejected] == [f"remote:{top.name}"]
    code = rep.rejected[0][2]
    expect = {
        "chunk_bit_flip": "remote_chunk",
        "chunk_truncated": "remote_chunk",
        "chunk_missing": "remote_chunk",
        "manifest_garbage": "remote_manifest",
        "manifest_forged": "payload_checksum",  # the Rust pipeline's own check
    }[damage]
    assert code == expect, rep.rejected
    with flushed.client() as c:  # deleted from Redis, manifest, chunks and index member
        assert not c.exists(keys.manifest(top.sha))
        assert not c.keys(keys.tag(top.sha).replace("{", "\\{").replace("}", "\\}") + "*")
        assert [m.decode().split(":")[1] for m in c.zrange(keys.index, 0, -1)] == [second.sha]
    assert np.array_equal(s.logits, prefilled(eng, follow, ctx=2048).logits)
    assert not [n for n in os.listdir(b.dir) if ".tmp." in n]  # no temp file left behind


def test_damaged_only_entry_falls_back_to_prefill(eng, flushed, replicas):
    r = replicas(flushed.url)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt("only")
    _stored(a, eng, prompt)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    (e,) = a.remote.entries(abi)
    keys = KeyLayout("shared", abi)
    with flushed.client() as c:
        _flip(c, keys.chunk(e.sha, 0), at=5)
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, prompt + "?")
    assert rep.rung == "prefill" and rep.rejected[0][2] == "remote_chunk"
    assert np.array_equal(s.logits, prefilled(eng, prompt + "?", ctx=2048).logits)
    assert a.remote.entries(abi) == []


# -- failures of the tier ------------------------------------------------------
def test_redis_down_then_back(eng, tmp_path):
    srv = RedisNode(str(tmp_path / "r")).start()
    tier_kw = {"cooldown_s": 30.0, "fail_threshold": 2, "connect_timeout_s": 0.3, "op_timeout_s": 0.5}
    a = KVStore(tmp_path / "a", remote=RemoteTier(srv.url, chunk_bytes=CHUNK, **tier_kw), min_tokens=MIN_TOKENS)
    b = KVStore(tmp_path / "b", remote=RemoteTier(srv.url, chunk_bytes=CHUNK, **tier_kw), min_tokens=MIN_TOKENS)
    # the breakers' clock, moved on by the test: the cool-down neither ends
    # while a slow machine runs the failing requests nor needs a sleep
    later = [0.0]
    for store in (a, b):
        store.remote.breaker.clock = lambda: time.monotonic() + later[0]
    try:
        p1 = _prompt("down-1")
        _stored(a, eng, p1)
        srv.stop()  # killed in the middle of the conversation
        p2 = _prompt("down-2")
        s = ds4.Session(eng, ctx=2048)
        rep = recover(s, a, p2, cold_save=True)  # served locally; the upload fails quietly
        assert rep.rung == "prefill" and rep.cold_saved and os.path.exists(rep.cold_saved)
        a.remote.flush(10)
        for _ in range(3):
            s = ds4.Session(eng, ctx=2048)
            rep = recover(s, b, p1 + " again")
            assert rep.rung == "prefill"
        assert b.remote.state == "cooldown" and rep.remote in ("cooldown", "degraded")
        assert b.summary()["remote"]["state"] == "cooldown"
        # local checkpoints are untouched and still served
        s = ds4.Session(eng, ctx=2048)
        assert recover(s, a, p2 + " local").rung == "disk"
        # restarted (empty): used again after the cool-down
        srv = RedisNode(str(tmp_path / "r"), port=srv.port).start()
        later[0] += 31.0  # the cool-down is over
        p3 = _prompt("down-3")
        _stored(a, eng, p3)
        assert a.remote.stats["uploads"] >= 1
        s = ds4.Session(eng, ctx=2048)
        rep = recover(s, b, p3 + " back")
        assert rep.rung == "remote" and rep.remote == "up"
    finally:
        a.close()
        b.close()
        srv.stop()


def test_maxmemory_far_below_the_working_set_misses_without_errors(eng, tmp_path):
    srv = RedisNode(str(tmp_path / "r"), "--maxmemory", "1mb", "--maxmemory-policy", "allkeys-lru").start()
    a = KVStore(tmp_path / "a", remote=RemoteTier(srv.url, chunk_bytes=CHUNK), min_tokens=MIN_TOKENS)
    b = KVStore(tmp_path / "b", remote=RemoteTier(srv.url, chunk_bytes=CHUNK), min_tokens=MIN_TOKENS)
    try:
        prompts = [_prompt(f"mem-{i}", 60) for i in range(8)]
        for p in prompts:
            _stored(a, eng, p)
        for p in prompts:
            s = ds4.Session(eng, ctx=2048)
            rep = recover(s, b, p + " x")
            assert rep.rung in ("remote", "prefill")
            assert all(x[2] in ("remote_chunk",) for x in rep.rejected), rep.rejected
            assert np.array_equal(s.logits, prefilled(eng, p + " x", ctx=2048).logits)
        assert b.remote.state == "up"
    finally:
        a.close()
        b.close()
        srv.stop()


def test_noeviction_full_redis_refuses_uploads_quietly(eng, tmp_path):
    srv = RedisNode(str(tmp_path / "r"), "--maxmemory", "1mb", "--maxmemory-policy", "noeviction").start()
    a = KVStore(tmp_path / "a", remote=RemoteTier(srv.url, chunk_bytes=CHUNK), min_tokens=MIN_TOKENS)
    try:
        for i in range(6):
            path = _stored(a, eng, _prompt(f"full-{i}", 60))
            assert os.path.exists(path)  # the local checkpoint is never lost
        st = a.remote.status()
        assert st["upload_failed"] >= 1 and st["state"] == "up"  # refused (OOM), not an outage
    finally:
        a.close()
        srv.stop()


def test_full_upload_queue_drops_the_oldest(eng, flushed, tmp_path, caplog):
    tier = RemoteTier(flushed.url, chunk_bytes=CHUNK, queue_max=2)
    gate = __import__("threading").Event()
    real = RemoteTier.upload

    def slow(self, *a):
        gate.wait(30)
        return real(self, *a)

    tier.upload = slow.__get__(tier)  # the first upload blocks until released
    st = KVStore(tmp_path / "q", remote=tier, min_tokens=MIN_TOKENS)
    try:
        paths = []
        for i in range(5):
            s = ds4.Session(eng, ctx=2048)
            paths.append(recover(s, st, _prompt(f"q-{i}"), cold_save=True).cold_saved)
        assert tier.stats["upload_dropped"] >= 2
        assert "upload queue full" in caplog.text
        gate.set()
        assert tier.flush(30)
        abi = ds4.Session(eng, ctx=2048).payload_abi
        up = {e.name for e in tier.entries(abi)}
        assert os.path.basename(paths[-1]) in up and os.path.basename(paths[1]) not in up
    finally:
        gate.set()
        st.close()


# -- eviction: TTL and pruning ---------------------------------------------------
def test_ttl_set_and_refreshed_on_hit_and_index_pruned(eng, flushed, replicas):
    r = replicas(flushed.url, ttl_s=100)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt("ttl")
    _stored(a, eng, prompt)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    keys = KeyLayout("shared", abi)
    (e,) = a.remote.entries(abi)
    with flushed.client() as c:
        assert 90 <= c.ttl(keys.manifest(e.sha)) <= 100 and 90 <= c.ttl(keys.chunk(e.sha, 0)) <= 100
        for k in [keys.manifest(e.sha), keys.chunk(e.sha, 0)]:
            c.expire(k, 10)
    s = ds4.Session(eng, ctx=2048)
    assert recover(s, b, prompt + "!").rung == "remote"
    with flushed.client() as c:  # refreshed by the hit
        assert c.ttl(keys.manifest(e.sha)) > 50 and c.ttl(keys.chunk(e.sha, 0)) > 50
        c.delete(keys.manifest(e.sha))  # expired or evicted
        assert c.zcard(keys.index) == 1
    s = ds4.Session(eng, ctx=2048)
    c_store = r.store("c")
    assert recover(s, c_store, prompt + "?").rung == "prefill"
    with flushed.client() as c:
        assert c.zcard(keys.index) == 0  # pruned on the way
    assert c_store.remote.stats["pruned"] == 1


# -- namespaces (tenants) ----------------------------------------------------------
def test_namespaces_never_share(eng, flushed, replicas):
    ra = replicas(flushed.url, namespace="tenant-a")
    rb = replicas(flushed.url, namespace="tenant-b")
    a, b = ra.store("a"), rb.store("b")
    prompt = _prompt("ns")
    _stored(a, eng, prompt)
    s = ds4.Session(eng, ctx=2048)
    assert recover(s, b, prompt + "?").rung == "prefill"
    a2 = ra.store("a2")
    s = ds4.Session(eng, ctx=2048)
    assert recover(s, a2, prompt + "?").rung == "remote"


# -- authentication ----------------------------------------------------------------
def _fix_checksums(raw: bytearray) -> int:
    """Recompute a v2 file's payload and header checksums (what a forger can do)."""
    import xxhash

    meta_len = int.from_bytes(raw[20:24], "little")
    text_len = int.from_bytes(raw[48:52], "little")
    payload_len = int.from_bytes(raw[40:48], "little")
    po = -(-(96 + meta_len + text_len) // 64) * 64
    raw[80:88] = xxhash.xxh3_64_intdigest(bytes(raw[po : po + payload_len])).to_bytes(8, "little")
    fixed = bytearray(raw[:96])
    for a, b in ((12, 16), (32, 40), (88, 96)):
        fixed[a:b] = bytes(b - a)
    raw[88:96] = xxhash.xxh3_64_intdigest(bytes(fixed) + bytes(raw[96 : 96 + meta_len])).to_bytes(8, "little")
    return po


def test_forged_remote_checkpoint_without_a_valid_mac_is_rejected(eng, flushed, replicas):
    from ds4 import _core

    key = _core.derive_auth_key(b"a shared secret of the replicas")
    r = replicas(flushed.url)
    a, b = r.store("a", auth_key=key), r.store("b", auth_key=key)
    short = _prompt("mac", 40)
    long = short + " " + _prompt("mac2", 40)
    keys, (top, second) = _two_remote_prefixes(eng, a, short, long)
    with flushed.client() as c:
        raw = bytearray(b"".join(c.get(keys.chunk(top.sha, i)) for i in range(len(top.digests))))
        po = _fix_checksums(raw)
        raw[po + 200] ^= 0x40  # the forged state
        _fix_checksums(raw)
        chunks = [bytes(raw[i : i + CHUNK]) for i in range(0, len(raw), CHUNK)]
        for i, ch in enumerate(chunks):
            c.set(keys.chunk(top.sha, i), ch)
        digests = tuple(xxhash.xxh3_128_hexdigest(ch) for ch in chunks)
        forged = RemoteEntry(top.sha, top.abi, top.tokens, top.text_bytes, top.size, top.chunk_bytes, digests)
        c.set(keys.manifest(top.sha), forged.to_bytes())
    plain = r.store("plain")  # a replica without the key
    follow = long + " question?"
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, follow)
    assert [(x[0], x[2]) for x in rep.rejected] == [(f"remote:{top.name}", "mac_mismatch")]
    assert rep.rung == "remote" and rep.reused_tokens == second.tokens
    with flushed.client() as c:
        assert not c.exists(keys.manifest(top.sha))
    assert np.array_equal(s.logits, prefilled(eng, follow, ctx=2048).logits)
    # an unauthenticated replica's upload is never loaded by a keyed one: it
    # is deleted from the tier (the keyed replicas' upload takes its place)
    p = _prompt("plain-upload", 50)
    _stored(plain, eng, p)
    (unkeyed,) = [e for e in plain.remote.entries(top.abi) if e.text_bytes > len(long)]
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, p + "?")
    assert rep.rung == "prefill" and [x[2] for x in rep.rejected] == ["mac_missing"]
    assert unkeyed not in plain.remote.entries(top.abi)


def test_unreachable_cluster_costs_misses_then_a_cooldown(eng, tmp_path):
    from helpers.ports import free_port

    tier = RemoteTier(f"redis+cluster://127.0.0.1:{free_port()}", fail_threshold=2, cooldown_s=60)
    st = KVStore(tmp_path / "kv", remote=tier, min_tokens=MIN_TOKENS)
    try:
        for _ in range(3):
            s = ds4.Session(eng, ctx=2048)
            rep = recover(s, st, _prompt("nowhere"), cold_save=True)
            assert rep.rung in ("prefill", "disk")
        assert tier.state == "cooldown" and tier.breaker.last_error
        assert tier.upload(rep.cold_saved or "", s.payload_abi, 1, 1) in ("skipped", "gone")
    finally:
        st.close()


def test_tenant_namespaces_of_sessions_never_share_through_the_tier(eng, flushed, replicas):
    # The server's tenants (and cache_salt) are session namespaces: their key
    # texts start with the namespace's preamble, so one tenant's checkpoint
    # on the shared tier is never a candidate for another tenant's prompt,
    # even on one tier namespace.
    r = replicas(flushed.url)
    a, b, a2 = r.store("a"), r.store("b"), r.store("a2")
    prompt = _prompt("tenant")
    s = ds4.Session(eng, ctx=2048)
    s.set_namespace("key-aaaa")
    s.sync(eng.tokenize(prompt, special=True))
    assert a.store_live_prefix(s, "cold") is not None
    assert a.remote.flush(30)
    other = ds4.Session(eng, ctx=2048)
    other.set_namespace("key-bbbb")
    rep = recover(other, b, prompt + "?")
    assert rep.rung == "prefill" and rep.reused_tokens == 0
    default = ds4.Session(eng, ctx=2048)
    assert recover(default, b, prompt + "?").rung == "prefill"
    same = ds4.Session(eng, ctx=2048)
    same.set_namespace("key-aaaa")
    rep = recover(same, a2, prompt + "?")
    assert rep.rung == "remote" and rep.reused_tokens > MIN_TOKENS
    cold = prefilled(eng, prompt + "?", ctx=2048)
    assert same.tokens == cold.tokens and np.array_equal(same.logits, cold.logits)


# -- the tier heals itself ---------------------------------------------------------
def _payload_offset(raw: bytes) -> int:
    meta_len = int.from_bytes(raw[20:24], "little")
    text_len = int.from_bytes(raw[48:52], "little")
    return -(-(96 + meta_len + text_len) // 64) * 64


def _plant(c, keys, e, data: bytes, tokens=None):
    """Replace what the tier holds under ``e``'s key by ``data``, chunked,
    with a manifest whose digests match (what anyone with write access to
    Redis can do); the manifest claims ``tokens`` (default: ``e``'s)."""
    for k in c.keys(keys.tag(e.sha).replace("{", "\\{").replace("}", "\\}") + "*"):
        c.delete(k)
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    for i, ch in enumerate(chunks):
        c.set(keys.chunk(e.sha, i), ch)
    digests = tuple(xxhash.xxh3_128_hexdigest(ch) for ch in chunks)
    n = e.tokens if tokens is None else tokens
    c.set(keys.manifest(e.sha), RemoteEntry(e.sha, e.abi, n, e.text_bytes, len(data), CHUNK, digests).to_bytes())


def _file_of(eng, directory, prompt, auth_key=None) -> bytes:
    """The bytes of a checkpoint of ``prompt`` stored by a store without a tier."""
    st = KVStore(directory, min_tokens=MIN_TOKENS, auth_key=auth_key)
    try:
        return Path(st.store_live_prefix(prefilled(eng, prompt, 2048), "cold")).read_bytes()
    finally:
        st.close()


FORGERIES = {  # forgery: the code it is rejected with
    "no_mac": "mac_missing",
    "wrong_mac": "mac_mismatch",
    "corrupted_payload": "payload_checksum",
    "manifest_tokens_over_ctx": "remote_manifest",
    "manifest_tokens_under_min": "remote_manifest",
    "manifest_tokens_fewer": "remote_manifest",
}


def _held(c, keys, sha):
    """Every key and index member of ``sha`` the tier holds."""
    tagged = [k.decode() for k in c.keys(keys.tag(sha).replace("{", "\\{").replace("}", "\\}") + "*")]
    return tagged + [m.decode() for m in c.zrange(keys.index, 0, -1) if m.decode().endswith(sha)]


@pytest.mark.parametrize("where", ["node", "cluster"])
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_entry_is_deleted_and_an_honest_upload_replaces_it(eng, request, replicas, tmp_path, forgery, where):
    from ds4 import _core

    srv = request.getfixturevalue("flushed" if where == "node" else "cluster")
    key = _core.derive_auth_key(b"the replicas' secret")
    r = replicas(srv.url)
    a, b = r.store("a", auth_key=key), r.store("b", auth_key=key)
    prompt = _prompt(f"heal-{forgery}-{where}", 40)
    path = _stored(a, eng, prompt)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    keys = KeyLayout("shared", abi)
    (honest,) = [e for e in a.remote.entries(abi) if e.sha == os.path.basename(path)[:40]]
    data, tokens = Path(path).read_bytes(), None
    if forgery == "no_mac":
        data = _file_of(eng, tmp_path / "plain", prompt)
    elif forgery == "wrong_mac":
        data = _file_of(eng, tmp_path / "other", prompt, auth_key=_core.derive_auth_key(b"another secret"))
    elif forgery == "corrupted_payload":
        raw = bytearray(data)
        raw[_payload_offset(data) + 200] ^= 0x40
        data = bytes(raw)
    else:
        tokens = {"over_ctx": 4096, "under_min": 1, "fewer": honest.tokens - 3}[forgery.split("tokens_")[1]]
    c = a.remote.client()
    _plant(c, keys, honest, data, tokens)
    follow = prompt + " question?"
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, follow)
    assert rep.rung == "prefill"
    assert [(x[0], x[2]) for x in rep.rejected] == [(f"remote:{honest.name}", FORGERIES[forgery])]
    assert _held(c, keys, honest.sha) == []  # manifest, chunks and index member: gone
    assert a.push() == {"stored": 1}  # the honest upload is not told "present"
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, follow)
    assert rep.rung == "remote" and rep.reused_tokens == honest.tokens and rep.rejected == []
    cold = prefilled(eng, follow, ctx=2048)
    assert s.tokens == cold.tokens and np.array_equal(s.logits, cold.logits)


def test_an_upload_replaces_a_manifest_that_is_not_its_file(eng, flushed, replicas):
    r = replicas(flushed.url)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt("replace", 40)
    path = _stored(a, eng, prompt)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    (honest,) = a.remote.entries(abi)
    with flushed.client() as c:  # a manifest lying to stay unused, before any lookup saw it
        _plant(c, KeyLayout("shared", abi), honest, Path(path).read_bytes(), tokens=10**6)
    assert a.push() == {"stored": 1}
    assert a.remote.entries(abi) == [honest]
    assert a.push() == {"present": 1}  # its own manifest: present
    s = ds4.Session(eng, ctx=2048)
    assert recover(s, b, prompt + "?").rung == "remote"


@pytest.mark.parametrize("where", ["node", "cluster"])
def test_a_rejection_never_deletes_the_entry_that_replaced_it(eng, request, replicas, where):
    srv = request.getfixturevalue("flushed" if where == "node" else "cluster")
    r = replicas(srv.url)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt(f"raced-{where}", 40)
    path = _stored(a, eng, prompt)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    keys = KeyLayout("shared", abi)
    (honest,) = [e for e in a.remote.entries(abi) if e.sha == os.path.basename(path)[:40]]
    c = a.remote.client()
    _plant(c, keys, honest, Path(path).read_bytes(), tokens=10**6)
    (judged,) = [e for e in b.remote.entries(abi) if e.sha == honest.sha]  # what a replica read and judges
    assert judged.tokens == 10**6
    assert a.push() == {"stored": 1}  # meanwhile, the honest upload replaced it
    assert b.remote.delete(judged.sha, abi, judged) is False
    assert [e for e in a.remote.entries(abi) if e.sha == honest.sha] == [honest]
    assert all(c.exists(keys.chunk(honest.sha, i)) for i in range(len(honest.digests)))
    s = ds4.Session(eng, ctx=2048)
    assert recover(s, b, prompt + "?").rung == "remote"


def test_a_failure_of_the_tier_deletes_nothing(eng, flushed, replicas, monkeypatch):
    import redis

    import ds4.kvstore.remote as remote

    r = replicas(flushed.url)
    a, b = r.store("a"), r.store("b")
    prompt = _prompt("transient", 40)
    _stored(a, eng, prompt)
    before = _keys(flushed)

    def timeout(*_a, **_kw):
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(remote, "fetch_chunks", timeout)
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, b, prompt + "?")
    assert rep.rung == "prefill" and rep.rejected == []
    assert _keys(flushed) == before and b.remote.stats["deleted"] == 0
    monkeypatch.undo()
    s = ds4.Session(eng, ctx=2048)
    assert recover(s, b, prompt + "?").rung == "remote"


def test_an_honest_entry_a_replica_cannot_use_is_kept(eng, flushed, replicas):
    # skipped for its size (fewer tokens than this replica's minimum; more
    # than its context is the same path): its header agrees with its
    # manifest, so it is another replica's, never deleted
    r = replicas(flushed.url)
    a = r.store("a")
    picky = KVStore(r.tmp / "picky", remote=RemoteTier(flushed.url, chunk_bytes=CHUNK), min_tokens=10**4)
    r.stores.append(picky)
    prompt = _prompt("kept", 40)
    _stored(a, eng, prompt)
    before = _keys(flushed)
    s = ds4.Session(eng, ctx=2048)
    rep = recover(s, picky, prompt + "?")
    assert rep.rung == "prefill" and rep.rejected == []
    assert _keys(flushed) == before and picky.remote.stats["deleted"] == 0


def test_an_upload_never_replaces_what_another_upload_committed_meanwhile(eng, flushed, replicas, monkeypatch):
    r = replicas(flushed.url)
    a = r.store("a")
    prompt = _prompt("interleaved", 40)
    path = _stored(a, eng, prompt)
    abi = ds4.Session(eng, ctx=2048).payload_abi
    keys = KeyLayout("shared", abi)
    (honest,) = a.remote.entries(abi)
    c = a.remote.client()
    _plant(c, keys, honest, Path(path).read_bytes(), tokens=10**6)
    theirs = honest.to_bytes()
    judge = RemoteEntry.describes

    def describes_then_replaced(raw, *args):  # another upload commits between the read and the delete
        c.set(keys.manifest(honest.sha), theirs)
        return judge(raw, *args)

    monkeypatch.setattr(RemoteEntry, "describes", staticmethod(describes_then_replaced))
    assert a.remote.upload(path, abi, honest.tokens, honest.text_bytes) == "claimed"
    assert c.get(keys.manifest(honest.sha)) == theirs
    assert all(c.exists(keys.chunk(honest.sha, i)) for i in range(len(honest.digests)))
