"""The shared tier with shared blocks (ds4/kvstore/remote_blocks.py) against
real ``redis-server`` processes: a replica uploads only the blocks the tier
lacks and downloads only those its directory lacks; a resume from the tier
equals a cold prefill; a block missing from the tier, a damaged chunk, a
block stored under another block's name and one signed with another key
are each refused (typed, stage ``block``), the bad block deleted from the
tier, and the ladder goes on to a cold prefill that is still exact; ``ds4
kv gc --remote`` removes blocks no manifest names; a TTL covers blocks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers.kv import prefilled
from helpers.procs import ds4_json
from helpers.redis_servers import RedisClusterNodes
from redis.cluster import RedisCluster

import ds4
from ds4.kvstore import KVStore
from ds4.kvstore.blocks import BLOCKS_DIR
from ds4.kvstore.remote import KeyLayout, RemoteTier
from ds4.kvstore.remote_layout import BlockRecord

B = 16  # tokens per block
CHUNK = 32 * 1024  # small chunks: a block spans several
CTX = 4096


@pytest.fixture
def replica(tmp_path):
    made = []

    def make(url, name, key=None, **tier_kw):
        tier = RemoteTier(url, chunk_bytes=CHUNK, **tier_kw)
        st = KVStore(tmp_path / name, remote=tier, blocks=True, block_tokens=B, min_tokens=8, auth_key=key)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


def _words(n, seed):
    rng = np.random.default_rng(seed)
    words = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "jade"]
    return " ".join(words[i] for i in rng.integers(0, len(words), n))


def _save(st, eng, text, reason="cold"):
    path = st.store_live_prefix(prefilled(eng, text, CTX), reason)
    assert path is not None
    assert st.remote.flush(30)
    return path


def _local_blocks(st):
    d = os.path.join(st.dir, BLOCKS_DIR)
    return {f[:64]: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".kvb")}


def _tier_blocks(srv, ns="shared"):
    if isinstance(srv, RedisClusterNodes):  # every node's keys
        c = RedisCluster.from_url(srv.url.replace("+cluster", ""))
        keys = list(c.scan_iter(match=f"ds4:{{{ns}/*}}:b"))
        c.close()
    else:
        with srv.client() as c:
            keys = c.keys(f"ds4:{{{ns}/*}}:b")
    return sorted(k.decode().split("/")[2].split("}")[0] for k in keys)


def _resume(st, eng, text):
    s = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s, st, text, evict_save=False)
    return s, rep


def _equal_cold(eng, s, text):
    cold = prefilled(eng, text, CTX)
    assert s.tokens == cold.tokens
    assert np.array_equal(s.logits, cold.logits)
    assert s.generate(8) == cold.generate(8)


@pytest.mark.parametrize("where", ["node", "cluster"])
def test_blocks_go_up_once_and_come_down_only_when_missing(eng, request, replica, where):
    srv = request.getfixturevalue("flushed" if where == "node" else "cluster")
    a, b = replica(srv.url, "a"), replica(srv.url, "b")
    system = _words(200, seed=1)
    turns = [system + " turn one " + _words(30, seed=2)]
    turns.append(turns[0] + " turn two " + _words(30, seed=3))
    turns.append(turns[1] + " turn three " + _words(30, seed=4))
    for i, t in enumerate(turns):  # a conversation saved at every turn
        _save(a, eng, t, "cold" if i == 0 else "continued")
    up = a.remote.stats
    blocks_a = _local_blocks(a)
    remote = a.remote.entries(a.entries()[0].abi)
    assert len(remote) == 3 and len(blocks_a) >= 10
    assert all(set(e.blocks) <= set(blocks_a) for e in remote) and len(remote[-1].blocks) > len(remote[0].blocks)
    # every block went up once, whatever number of manifests name it
    assert up["blocks_uploaded"] == len(blocks_a)
    assert sorted(blocks_a) == _tier_blocks(srv)
    manifest_bytes = sum(e.size for e in remote)
    assert up["bytes_uploaded"] == sum(blocks_a.values()) + manifest_bytes  # each block once, each manifest's file
    assert up["blocks_present"] > 0  # a later turn's upload found its prefix's blocks there

    # replica B resumes the last turn from the tier: exact, and it fetched exactly that manifest's blocks
    follow = turns[2] + " and a question"
    s, rep = _resume(b, eng, follow)
    assert rep.rung == "remote" and not rep.rejected
    _equal_cold(eng, s, follow)
    got_b = _local_blocks(b)
    assert set(got_b) <= set(blocks_a) and len(got_b) == b.remote.stats["blocks_downloaded"]
    assert got_b == {h: blocks_a[h] for h in got_b}

    # a second conversation of the same system prompt, saved by A: B downloads only the blocks it lacks
    other = system + " another task " + _words(40, seed=5)
    _save(a, eng, other)
    before = b.remote.stats["blocks_downloaded"]
    s2, rep2 = _resume(b, eng, other + " go")
    assert rep2.rung == "remote"
    _equal_cold(eng, s2, other + " go")
    new = set(_local_blocks(b)) - set(got_b)
    assert b.remote.stats["blocks_downloaded"] - before == len(new) > 0
    shared = len(system.split()) // 2 // B  # the system prompt's whole blocks (a word is >= 1 token): not fetched again
    assert len(new) < len(_local_blocks(b)) - shared + 1


def _one_block_record(srv, st):
    keys = KeyLayout("shared", st.entries()[0].abi)
    hexes = _tier_blocks(srv)
    with srv.client() as c:
        recs = {h: BlockRecord.from_bytes(c.get(keys.block(h)), h) for h in hexes}
    return keys, recs


def _rejected_block(rep):
    return [r for r in rep.rejected if r[1] == "block"]


@pytest.mark.parametrize("harm", ["missing", "damaged_chunk", "other_block", "other_key"])
def test_bad_blocks_in_the_tier_are_refused(eng, flushed, replica, harm, tmp_path):
    key = bytes(range(32))
    a = replica(flushed.url, "a", key=key)
    text = _words(150, seed=7)
    _save(a, eng, text)
    keys, recs = _one_block_record(flushed, a)
    hexes = sorted(recs)
    victim, donor = hexes[2], hexes[3]
    with flushed.client() as c:
        if harm == "missing":
            c.delete(keys.block(victim))
        elif harm == "damaged_chunk":
            raw = bytearray(c.get(keys.chunk(victim, 0)))
            raw[100] ^= 0x01
            c.set(keys.chunk(victim, 0), bytes(raw))
        elif harm == "other_block":  # a real, signed block stored under another block's name
            for i in range(len(recs[donor].digests)):
                c.set(keys.chunk(victim, i), c.get(keys.chunk(donor, i)))
            d = json.loads(c.get(keys.block(donor)))
            c.set(keys.block(victim), json.dumps({**d, "block": victim}).encode())
    if harm == "other_key":  # a forger's replica, with its own key, stores the same block first
        with flushed.client() as c:
            c.delete(keys.block(victim))
        forger = replica(flushed.url, "forger", key=bytes(32))
        _save(forger, eng, text)
        assert _tier_blocks(flushed) == hexes  # the forger's upload filled the gap under the real name
    b = replica(flushed.url, "b", key=key)
    follow = text + " more"
    s, rep = _resume(b, eng, follow)
    assert rep.rung != "remote"  # the manifest was not loaded
    refused = _rejected_block(rep) + [r for r in rep.rejected if r[2] == "remote_chunk"]
    assert refused, rep.rejected
    want = {"missing": "block_missing", "damaged_chunk": "remote_chunk", "other_block": "block_name"}
    if harm in want:
        assert refused[0][2] == want[harm]
    else:
        assert refused[0][2] == "block_mac"
    _equal_cold(eng, s, follow)  # the ladder went on: still exact
    assert victim not in _local_blocks(b)  # nothing unverified kept
    assert victim not in _tier_blocks(flushed)  # the bad block deleted from the tier (or was never there)
    with flushed.client() as c:
        assert not c.keys("ds4:{shared/*/" + victim + "}:c:*")
        assert c.get(keys.manifest(a.entries()[0].name[:40])) is None  # the manifest it could not serve, deleted
    # an honest upload makes it whole again, and then it serves
    a.push()
    assert victim in _tier_blocks(flushed)
    c2 = replica(flushed.url, "c", key=key)
    s3, rep3 = _resume(c2, eng, follow)
    assert rep3.rung == "remote" and not rep3.rejected
    _equal_cold(eng, s3, follow)


def test_blocks_fetched_at_once_report_the_first_refusal_and_delete_every_one_found(eng, flushed, replica):
    a = replica(flushed.url, "a")
    text = _words(150, seed=11)
    path = _save(a, eng, text)
    _, table = ds4._core.read_block_table(ds4.open_checkpoint(path).array("ds4.blocks"))
    order = [r[0].hex() for r in table]
    assert len(order) >= 6
    keys = KeyLayout("shared", a.entries()[0].abi)
    first, second = order[1], order[3]  # both under way at once (four fetch threads)
    with flushed.client() as c:
        for victim in (second, first):
            raw = bytearray(c.get(keys.chunk(victim, 0)))
            raw[64] ^= 0x01
            c.set(keys.chunk(victim, 0), bytes(raw))
    b = replica(flushed.url, "b")
    follow = text + " again"
    s, rep = _resume(b, eng, follow)
    assert rep.rung != "remote"
    refused = [r for r in rep.rejected if r[2] == "remote_chunk"]
    assert len(refused) == 1, rep.rejected  # one verdict: the manifest's
    assert first in refused[0][3] or first[:12] in refused[0][3], refused  # the first in table order
    _equal_cold(eng, s, follow)
    local = _local_blocks(b)
    assert first not in local and second not in local  # nothing unverified kept
    tier = _tier_blocks(flushed)
    assert first not in tier and second not in tier  # each refused block found, deleted from the tier
    assert b.remote.stats["blocks_rejected"] == 2
    assert order[0] in local  # a good block fetched before the verdict: kept (an orphan until evicted)


def test_gc_removes_blocks_no_manifest_names(eng, flushed, replica, tmp_path):
    a = replica(flushed.url, "a")
    text = _words(120, seed=11)
    _save(a, eng, text)
    n = len(_tier_blocks(flushed))
    assert n >= 5
    doc, _ = ds4_json("kv", "stats", "--remote", flushed.url)
    assert doc["blocks"] == n and doc["orphan_blocks"] == 0
    # the checkpoint goes (ds4 kv rm --remote): its blocks are left, young, then old
    e = a.remote.entries(a.entries()[0].abi)[0]
    assert len(e.blocks) == n
    assert a.remote.delete(e.sha, e.abi, e)
    assert ds4_json("kv", "gc", "--remote", flushed.url)[0]["orphan_blocks"] == 0  # young: an upload may be under way
    keys = KeyLayout("shared", e.abi)
    with flushed.client() as c:  # age them past an upload's time
        for h in _tier_blocks(flushed):
            d = json.loads(c.get(keys.block(h)))
            c.set(keys.block(h), json.dumps({**d, "t": d["t"] - 3600}).encode())
    dry, _ = ds4_json("kv", "gc", "--remote", flushed.url, "--dry-run")
    assert dry["orphan_blocks"] == n and dry["removed_blocks"] == 0
    assert len(_tier_blocks(flushed)) == n
    done, _ = ds4_json("kv", "gc", "--remote", flushed.url)
    assert done["removed_blocks"] == n
    assert _tier_blocks(flushed) == []
    with flushed.client() as c:
        assert not c.keys("ds4:*:c:*")


def test_ttl_covers_blocks_and_a_hit_refreshes_them(eng, flushed, replica):
    a = replica(flushed.url, "a", ttl_s=300)
    text = _words(100, seed=13)
    _save(a, eng, text)
    keys = KeyLayout("shared", a.entries()[0].abi)
    hexes = _tier_blocks(flushed)
    with flushed.client() as c:
        assert all(0 < c.ttl(keys.block(h)) <= 300 for h in hexes)
        assert all(0 < c.ttl(keys.chunk(h, 0)) <= 300 for h in hexes)
        for h in hexes:
            c.expire(keys.block(h), 20)
            c.expire(keys.chunk(h, 0), 20)
    b = replica(flushed.url, "b", ttl_s=300)
    _, rep = _resume(b, eng, text + " again")
    assert rep.rung == "remote"
    with flushed.client() as c:
        assert all(c.ttl(keys.block(h)) > 20 for h in hexes)  # the hit gave the blocks the TTL again
        assert all(c.ttl(keys.chunk(h, 0)) > 20 for h in hexes)


def test_a_manifest_whose_blocks_went_locally_is_not_uploaded(eng, flushed, tmp_path):
    tier = RemoteTier(flushed.url, chunk_bytes=CHUNK)
    st = KVStore(tmp_path / "a", blocks=True, block_tokens=B, min_tokens=8)  # saved without a tier
    try:
        st.store_live_prefix(prefilled(eng, _words(100, seed=17), CTX), "cold")
        e = st.entries()[0]
        st.blocks.refs_of(e)
        paths = st.blocks.paths_of(e.name)
        os.unlink(paths[-1])
        assert tier.upload(e.path, e.abi, e.tokens, e.text_bytes, paths) == "gone"
        with flushed.client() as c:
            assert not c.keys("ds4:*:m")  # no manifest names a block the tier lacks
    finally:
        tier.close()
        st.close()


def test_a_manifest_without_its_table_from_the_tier_is_refused(eng, flushed, replica, tmp_path):
    from ds4.checkpoint import open_checkpoint, write_checkpoint
    from ds4.kvstore.blocks import MANIFEST_FLAG, TABLE_TENSOR

    a = replica(flushed.url, "a")
    text = _words(120, seed=19)
    path = _save(a, eng, text)
    ck = open_checkpoint(path)
    arrays = {k: np.array(v) for k, v in ck.arrays().items() if k != TABLE_TENSOR}
    forged = os.path.join(tmp_path, os.path.basename(path))  # flagged a manifest, with no table
    write_checkpoint(forged, bytes(ck.text), arrays, abi=ck.abi, tokens=ck.tokens, ctx=CTX, flags=MANIFEST_FLAG)
    e = a.remote.entries(ck.abi)[0]
    assert a.remote.delete(e.sha, e.abi, e)
    assert a.remote.upload(forged, ck.abi, ck.tokens, ck.text_bytes) == "stored"
    b = replica(flushed.url, "b")
    s, rep = _resume(b, eng, text + " more")
    assert rep.rung != "remote"
    assert [(r.stage, r.code) for r in rep.rejected] == [("payload", "block_table")]
    _equal_cold(eng, s, text + " more")
    assert a.remote.entries(ck.abi) == []  # deleted from the tier: an honest upload replaces it
