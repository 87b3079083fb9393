"""Per-tenant shares of the disk budget (``KVStore(tenant_share=F)``,
``ds4 serve --kv-tenant-share F``): a tenant over F of the budget loses its
own checkpoints first, so a tenant flooding the cache cannot evict another
tenant that stays within its share. The namespace each entry belongs to is
read with its header and kept in the index file (docs/FORMAT.md §5).

Every test here also runs (or plans) with the share off and shows the
other outcome: what the share changes."""

from __future__ import annotations

import os
import shutil
import struct

import pytest
import xxhash
from helpers.server import KV_FLAGS, SYSTEM

import ds4
from ds4 import kvstore
from ds4.keytext import preamble
from ds4.kvstore import INDEX_NAME, Entry, KVStore, plan_eviction
from ds4.kvstore.entries import text_namespace

NOW = 2_000_000_000


def _e(name, ns, size=100, tokens=100, last_used=NOW):
    """An entry of tenant namespace ``ns``; fewer tokens: a lower score."""
    return Entry(name, name, 2, tokens, 10, 0, 0, last_used, size, "t/1", "cold", 4096, (), ns)


def _plan(entries, limit, share, protect=None):
    return [e.name for e in plan_eviction(entries, limit, NOW, protect, tenant_share=share)]


# -- the plan ---------------------------------------------------------------------
def test_a_tenant_over_its_share_loses_its_own_entries_first():
    # alice holds one low-scoring entry; bob floods with better-scoring ones
    entries = [_e("a1", "alice", tokens=10)] + [_e(f"b{i}", "bob", tokens=50 + i) for i in range(6)]
    assert _plan(entries, 500, 1.0) == ["a1", "b0"]  # ds4's one order: alice's goes first
    assert _plan(entries, 500, 0.5) == ["b0", "b1"]  # bob holds 600 > 250: his, in his order


def test_under_share_tenants_go_only_when_no_tenant_is_over():
    a = [_e("a1", "alice", tokens=10)]
    b = [_e(f"b{i}", "bob", tokens=40 + i) for i in range(3)]
    c = [_e(f"c{i}", "carol", tokens=30 + i) for i in range(3)]
    # share 0.4 of 500 = 200: bob and carol (300 each) are over; the lowest of theirs first
    assert _plan(a + b + c, 500, 0.4) == ["c0", "b0"]
    assert _plan(a + b + c, 500, 1.0) == ["a1", "c0"]
    # share 0.4 of 400 = 160: carol stays over after c0, so c1 goes before bob's
    assert _plan(a + b + c, 400, 0.4) == ["c0", "c1", "b0"]
    # share 0.5 of 400 = 200: after c0 and b0 nobody is over (200 is not
    # more than 200), and ds4's order picks alice's
    assert _plan(a + b + c, 400, 0.5) == ["c0", "b0", "a1"]
    assert _plan(a + b + c, 400, 1.0) == ["a1", "c0", "c1"]


def test_the_protected_file_never_goes_and_then_others_do():
    # bob's one file is the newest (protected) and alone over the share:
    # nothing of his can go, so alice's entries do (nothing else can)
    entries = [_e("a1", "alice", tokens=60), _e("a2", "alice", tokens=50), _e("b-new", "bob", size=400, tokens=1)]
    assert _plan(entries, 300, 0.5, protect="b-new") == ["a2", "a1"]
    # unprotected, it is bob's (and the lowest score anyway)
    assert _plan(entries, 300, 0.5) == ["b-new"]
    # bob over with a protected file and another one: the other goes first
    entries.append(_e("b-old", "bob", size=100, tokens=90))
    assert _plan(entries, 600, 0.5, protect="b-new") == ["b-old"]
    assert _plan(entries, 600, 1.0, protect="b-new") == ["a2"]


def test_the_salts_of_one_tenant_share_its_share():
    # each of alice's namespaces is under 200, alice is not: 300 > 200
    alice = [_e("a0", "alice", tokens=50), _e("a1", "alice/salt-1", tokens=51), _e("a2", "alice/salt-2", tokens=52)]
    bob = [_e("b0", "bob", tokens=10), _e("b1", "bob", tokens=11)]
    assert [e.tenant for e in alice] == ["alice"] * 3
    assert _plan(alice + bob, 400, 0.5) == ["a0"]
    assert _plan(alice + bob, 400, 1.0) == ["b0"]


def test_the_default_namespace_is_one_tenant():
    # no key: the default namespace, and the anonymous caller's salts
    anon = [_e("d0", None, tokens=50), _e("d1", "anonymous/salt-0123456789abcdef", tokens=60)]
    assert {e.tenant for e in anon} == {None}
    bob = [_e("b0", "bob", tokens=10)]
    # each namespace holds 100 <= 125, the default tenant 200 > 125
    assert _plan(anon + bob, 250, 0.5) == ["d0"]
    assert _plan(anon + bob, 250, 1.0) == ["b0"]


def test_the_share_must_be_a_fraction(tmp_path):
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="tenant_share"):
            KVStore(tmp_path, tenant_share=bad)
    assert KVStore(tmp_path, tenant_share=0.25).tenant_share == 0.25


# -- namespaces in the index ----------------------------------------------------------
def test_the_index_reads_the_namespace_as_keytext_does():
    """``rust/index/entry.rs`` ``namespace_of`` and :func:`ds4.keytext.namespace_of`
    agree (via :func:`text_namespace`, the Python side's reading)."""
    long_id = "t" * 128
    for text, ns in [
        (b"plain", None),
        (preamble("alice") + b"hi", "alice"),
        (preamble("alice/salt-0123456789abcdef"), "alice/salt-0123456789abcdef"),
        (preamble(long_id) + b"x" * 500, long_id),
        (b"\xff\x00ns:alice", None),  # not whole
        (b"\xff\x00ns:a b\xff\x00x", None),  # not an id
        (b"\xff\x00ns:" + b"t" * 129 + b"\xff\x00", None),  # too long
    ]:
        assert text_namespace(text) == ns, text


def test_a_header_read_gives_the_namespace_and_the_tail(tmp_path, write_ck):
    """``StoreIndex.index_file`` reads the text's first 135 bytes and its
    last 8: texts shorter, as long as and longer than that window (the tail
    from the same read, or its own), each found again by a lookup."""
    pre = preamble("t" * 128)
    assert len(pre) == 135
    texts = {
        b"short": None,
        preamble("bob") + b"hi": "bob",
        pre: "t" * 128,
        pre + b"!": "t" * 128,
        pre + b"a longer text after the preamble " * 20: "t" * 128,
        b"\xff\x00ns:bob\xff\x01 a broken preamble " * 3: None,
    }
    idx = kvstore._core.StoreIndex()
    for text, ns in texts.items():
        row = idx.index_file(write_ck(tmp_path, text))
        assert row[-1] == ns and row[3] == len(text)
        assert idx.lookup(text + b" more", min_tokens=0)[0] == row  # the longest stored prefix


def _cli_error(*flags):
    import argparse

    from ds4.config import check_kv_args
    from ds4.serve_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return check_kv_args(p.parse_args(list(flags)))


def test_the_serve_flag_is_checked():
    assert _cli_error() is None and _cli_error("--kv-tenant-share", "0.5") is None
    for bad in ("0", "-1", "1.01", "nan"):
        assert _cli_error("--kv-tenant-share", bad) == "--kv-tenant-share must be in (0, 1]"


def _session(eng, ns, text):
    s = ds4.Session(eng, ctx=2048)
    s.set_namespace(ns)
    s.sync(eng.tokenize(text, special=True))
    return s


def _seal_version(raw, version):
    body = bytearray(raw[:-8])
    body[8:12] = struct.pack("<I", version)
    return bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))


def test_namespaces_round_trip_through_the_index_file(eng, tmp_path, monkeypatch):
    st = KVStore(tmp_path, min_tokens=1)
    want = {}
    for ns, text in [(None, "default text " * 4), ("alice", "alice's text " * 4), ("alice/salt-1", "salted " * 4)]:
        want[os.path.basename(st.store_live_prefix(_session(eng, ns, text)))] = ns
    assert {e.name: e.namespace for e in st.entries()} == want
    reads = []
    real = kvstore.index_header
    monkeypatch.setattr(kvstore, "index_header", lambda idx, p: reads.append(p) or real(idx, p))
    again = KVStore(tmp_path, min_tokens=1)
    assert again.stats["index_rebuilds"] == 0 and reads == []  # from the index file alone
    assert {e.name: e.namespace for e in again.entries()} == want
    raw = (tmp_path / INDEX_NAME).read_bytes()
    for damaged in (raw[: len(raw) // 2], _seal_version(raw, 3)):  # torn; the previous version
        (tmp_path / INDEX_NAME).write_bytes(damaged)
        reads.clear()
        rebuilt = KVStore(tmp_path, min_tokens=1)
        assert rebuilt.stats["index_rebuilds"] == 1 and sorted(map(os.path.basename, reads)) == sorted(want)
        assert {e.name: e.namespace for e in rebuilt.entries()} == want
        assert (tmp_path / INDEX_NAME).read_bytes()[8:12] == struct.pack("<I", 4)  # written again, current


# -- a store with real files ----------------------------------------------------------
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_flooding_tenant_cannot_push_another_below_its_share(eng, tmp_path, share):
    st = KVStore(tmp_path, budget_mb=0.6, min_tokens=1, tenant_share=share)
    mine = [st.store_live_prefix(_session(eng, "alice", f"alice keeps conversation {i} " * 4)) for i in range(2)]
    held = sum(os.path.getsize(p) for p in mine)
    assert held < share * st.budget_bytes or share == 1.0
    for i in range(12):  # bob's flood: longer prompts, every one a new file
        assert st.store_live_prefix(_session(eng, "bob/salt-7", f"bob floods the cache, prompt {i} " * 6))
    assert st.stats["evictions"] > 0 and st.total_bytes() <= st.budget_bytes
    alive = [os.path.exists(p) for p in mine]
    if share < 1.0:
        assert alive == [True, True]  # alice stays within her share: untouched
        bob = sum(e.size for e in st.entries() if e.tenant == "bob")
        assert bob <= st.budget_bytes - held
    else:
        assert alive == [False, False]  # one order for all: bob's flood evicted alice


# -- the server ---------------------------------------------------------------------------
KA, KB = "sk-share-alice", "sk-share-bob"


@pytest.mark.parametrize("share", ["1", "0.5"])
def test_a_tenants_system_prompt_survives_anothers_flood(tmp_path, serve, share):
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\n", encoding="utf-8")
    kv = tmp_path / "kv"
    srv = serve(
        "--api-key-file",
        str(keys),
        "--kv-disk-dir",
        str(kv),
        "--kv-disk-space-mb",
        "0.5",
        "--kv-tenant-share",
        share,
        "--admin-tenant",
        "alice",  # her key reads the operator's /health (the store's counters)
        *KV_FLAGS,
        name=f"share-{share}",
        tmp=tmp_path,
        key=KA,
    )
    a, b = srv.client(KA), srv.client(KB)
    model = srv.model()
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    a.chat.completions.create(model=model, messages=ask, max_tokens=4)
    alice = {e.name for e in KVStore(kv, scan=True).entries() if e.tenant == "alice"}
    assert alice  # the system prompt's cold save (the chat anchor)
    for i in range(6):
        flood = [
            {"role": "system", "content": f"Bob's system prompt number {i}: " + "be terse and exact. " * 6},
            {"role": "user", "content": f"Question {i}?"},
        ]
        b.chat.completions.create(model=model, messages=flood, max_tokens=4)
    assert srv.health()["kv"]["evictions"] > 0
    left = {e.name for e in KVStore(kv, scan=True).entries() if e.tenant == "alice"}
    again = a.chat.completions.create(
        model=model, messages=[*ask[:1], {"role": "user", "content": "Another colour?"}], max_tokens=4
    )
    cached = again.usage.prompt_tokens_details.cached_tokens
    if share == "0.5":
        assert alice <= left and cached > 0  # her system prompt is still on disk, and loaded
    else:
        assert not alice & left and cached == 0  # bob's flood evicted it
    srv.stop()
    shutil.rmtree(kv, ignore_errors=True)


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_ties_go_least_recently_used_then_first_written(share):
    """ds4's tie-breaks, with and without shares: among entries of one
    score, the least recently used goes first (a never-used file by its
    creation time), then the file written first (its stat key's mtime; a
    file not yet stat'ed counts as written at time 0)."""

    def tie(name, created, last_used=0, mtime=None):
        st = () if mtime is None else (1, 100, mtime)
        return Entry(name, name, 2, 100, 10, 0, created, last_used, 100, "t/1", "cold", 4096, st, None)

    lru = [tie("new", created=300), tie("used", created=400, last_used=50), tie("old", created=100)]
    assert [e.name for e in plan_eviction(lru, 0, NOW, tenant_share=share)] == ["used", "old", "new"]
    same_age = [tie("later", 100, mtime=200), tie("earlier", 100, mtime=1), tie("unstated", 100)]
    assert [e.name for e in plan_eviction(same_age, 0, NOW, tenant_share=share)] == ["unstated", "earlier", "later"]


# -- a forged index file -------------------------------------------------------------
RECORD = 112  # bytes of one index record (docs/FORMAT.md §6); its `ns` reference at 44


def _namespace_table(raw):
    """The index file's namespace strings, and where its records start."""
    n, n_abi, n_ns = struct.unpack_from("<III", raw, 12)
    at, strings = 56, []
    for i in range(n_abi + n_ns):
        (ln,) = struct.unpack_from("<I", raw, at)
        if i >= n_abi:
            strings.append(raw[at + 4 : at + 4 + ln].decode())
        at += 4 + ln
    assert len(raw) - 8 - at == n * RECORD + 8  # the records, then an empty block section
    return strings, at


def _reattribute(raw, frm, to):
    """The index file with every record of namespace ``frm`` put under
    ``to``, its checksum recomputed (what a forger who can write the file
    can do)."""
    strings, start = _namespace_table(raw)
    body = bytearray(raw[:-8])
    f, t = strings.index(frm), strings.index(to)
    moved = 0
    for r in range(start, len(body) - 8, RECORD):
        if struct.unpack_from("<I", body, r + 44)[0] == f:
            struct.pack_into("<I", body, r + 44, t)
            moved += 1
    return bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body))), moved


def _namespaces(st):
    return {e.name: e.namespace for e in st.entries()}


def test_a_forged_index_cannot_move_bytes_between_tenants(eng, tmp_path, monkeypatch, caplog):
    """``.ds4.index`` rewritten so that bob's files are alice's (checksum
    recomputed): believed, bob's flood would be charged to alice and her
    own files evicted first. The open checks every record against its file
    (``StoreIndex.check_files``: the namespace the text's preamble names),
    reads the liars again from their headers and writes the index again:
    every namespace is its file's, the tenants' usage is a rebuild's, and an
    eviction under ``tenant_share`` picks the victims the honest index does."""
    d, honest = tmp_path / "kv", tmp_path / "honest"
    st = KVStore(d, min_tokens=1)
    mine = [st.store_live_prefix(_session(eng, "alice", f"alice keeps conversation {i} " * 4)) for i in range(2)]
    theirs = [
        st.store_live_prefix(_session(eng, "bob/salt-7", f"bob floods the cache, prompt {i} " * 6)) for i in range(8)
    ]
    truth = _namespaces(st)
    assert sorted(set(truth.values())) == ["alice", "bob/salt-7"]
    os.mkdir(honest)
    for p in mine + theirs:  # the same files (mtimes kept), no index file: rebuilt from the headers
        shutil.copy2(p, honest)
    raw, moved = _reattribute((d / INDEX_NAME).read_bytes(), "bob/salt-7", "alice")
    assert moved == len(theirs)
    (d / INDEX_NAME).write_bytes(raw)
    # what the forgery would do, believed: everything alice's, her files go first
    forged_rows, _ = kvstore._core.StoreIndex.load(str(d / INDEX_NAME))
    forged = [Entry.from_row(str(d), row) for row in forged_rows.entries()]
    assert {e.namespace for e in forged} == {"alice"}
    total = sum(e.size for e in forged)
    limit = int(total * 0.6)
    lie = {e.name for e in plan_eviction(forged, limit, NOW, tenant_share=0.5)}
    plan = {e.name for e in plan_eviction(KVStore(honest, min_tokens=1).entries(), limit, NOW, tenant_share=0.5)}
    assert lie & {os.path.basename(p) for p in mine} and not plan & {os.path.basename(p) for p in mine}
    # a fresh store from the forged index
    reads = []
    real = kvstore.index_header
    monkeypatch.setattr(kvstore, "index_header", lambda idx, p: reads.append(os.path.basename(p)) or real(idx, p))
    with caplog.at_level("WARNING", logger="ds4.kvstore"):
        opened = KVStore(d, min_tokens=1)
    assert opened.stats["index_rebuilds"] == 0 and opened.stats["index_mismatches"] == len(theirs)
    assert sorted(reads) == sorted(os.path.basename(p) for p in theirs)  # the liars alone, from their headers
    [warning] = [r.getMessage() for r in caplog.records if "disagreed" in r.getMessage()]
    assert f"disagreed with {len(theirs)} files (namespace {len(theirs)})" in warning
    assert _namespaces(opened) == truth
    rebuilt = KVStore(honest, min_tokens=1)
    assert opened.tenant_usage() == rebuilt.tenant_usage()
    assert {e.name for e in opened.plan_evict(opened.entries())} == set()  # within the budget
    assert {e.name for e in plan_eviction(opened.entries(), limit, NOW, tenant_share=0.5)} == plan
    # the index file was written again: the next open reads nothing and finds no liar
    reads.clear()
    again = KVStore(d, min_tokens=1)
    assert reads == [] and again.stats["index_mismatches"] == 0 and _namespaces(again) == truth
    # the eviction itself (a budget the files are over: evicted at the open, after the check)
    (d / INDEX_NAME).write_bytes(raw)
    budget_mb = limit / (1 << 20)
    evicted = KVStore(d, min_tokens=1, budget_mb=budget_mb, tenant_share=0.5)
    truly = KVStore(honest, min_tokens=1, budget_mb=budget_mb, tenant_share=0.5)
    assert evicted.stats["evictions"] == truly.stats["evictions"] > 0
    assert sorted(_namespaces(evicted)) == sorted(_namespaces(truly))
    assert all(os.path.exists(p) for p in mine)  # alice within her share: untouched
