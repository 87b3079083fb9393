"""What an operator sees and manages of the tenants' shares of a cache
directory: ``ds4 kv stats`` (bytes and checkpoints per tenant, and with
``--tenant-share F`` who is over F of the budget), ``ds4 kv gc
--budget-mb N --tenant-share F`` (the plan the server's store evicts with;
``--dry-run`` prints the same plan), and the operator's ``/health``
(``kv.tenants``, from the in-memory index; never in a tenant's view).

Real files written by the reference engine in several namespaces."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from helpers.procs import ds4_cmd, ds4_json
from helpers.server import KV_FLAGS, topic_chat

import ds4
from ds4.kvstore import KVStore
from ds4.server.tenants import tenant_of

SECRET = "sk-gcshare-bare-key"
#: a bare key's tenant: its digest name, never the key
CAROL = tenant_of(SECRET)


def _session(eng, ns, text):
    s = ds4.Session(eng, ctx=2048)
    s.set_namespace(ns)
    s.sync(eng.tokenize(text, special=True))
    return s


@pytest.fixture(scope="module")
def tenants_dir(tmp_path_factory, eng):
    """alice: two files (one salted); bob: five longer ones; carol (a bare
    key's digest name): one; the default namespace: one. Returns the
    directory and each file's tenant and size."""
    d = tmp_path_factory.mktemp("kvt") / "kv"
    st = KVStore(d, min_tokens=1)
    files: dict[str, tuple[str, int]] = {}
    plan = [("alice", "alice keeps conversation 0 " * 4), ("alice/salt-1", "alice keeps conversation 1 " * 4)]
    plan += [("bob", f"bob floods the cache, prompt {i} " * 6) for i in range(5)]
    plan += [(CAROL, "carol's only prompt " * 4), (None, "a prompt without a key " * 4)]
    for ns, text in plan:
        path = st.store_live_prefix(_session(eng, ns, text))
        assert path is not None
        tenant = "anonymous" if ns is None else ns.split("/", 1)[0]
        files[os.path.basename(path)] = (tenant, os.path.getsize(path))
    return str(d), files


def _held(files) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for tenant, size in files.values():
        t = out.setdefault(tenant, {"bytes": 0, "checkpoints": 0})
        t["bytes"] += size
        t["checkpoints"] += 1
    return out


def _copy(src, tmp_path) -> str:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return str(dst)


# -- ds4 kv stats -------------------------------------------------------------------
def test_stats_shows_each_tenants_bytes_and_checkpoints(tenants_dir):
    d, files = tenants_dir
    held = _held(files)
    st, rc = ds4_json("kv", "stats", d)
    assert rc == 0 and st["tenants"] == held
    assert set(held) == {"alice", "bob", CAROL, "anonymous"}
    assert "share_bytes" not in st and not any("over_share" in t for t in st["tenants"].values())
    # the names ds4 kv ls shows, file by file
    ls, _ = ds4_json("kv", "ls", d)
    assert {f["name"]: f["tenant"] for f in ls["files"]} == {n: t for n, (t, _) in files.items()}
    out = ds4_cmd("kv", "stats", d).stdout
    assert "TENANT" in out and all(name in out for name in held)
    bob_row = next(line for line in out.splitlines() if line.startswith("bob "))
    assert bob_row.split()[1] == "5"
    # a tenant is a name: the bare key never shows, its digest name does
    for cmd in (("stats", d), ("stats", d, "--json"), ("ls", d), ("ls", d, "--json")):
        text = ds4_cmd("kv", *cmd).stdout
        assert CAROL in text and SECRET not in text


def test_stats_with_a_share_says_who_is_over_it(tenants_dir):
    d, files = tenants_dir
    held = _held(files)
    total = sum(size for _, size in files.values())
    budget_mb = total / 2**20
    for share in (0.5, 0.1):
        st, rc = ds4_json("kv", "stats", d, "--tenant-share", str(share), "--budget-mb", f"{budget_mb:.9f}")
        assert rc == 0 and st["tenant_share"] == share
        limit = st["budget_bytes"]  # no records in this directory: the whole budget
        assert abs(limit - total) <= 1 and st["share_bytes"] == int(share * limit)
        over = {t for t, v in st["tenants"].items() if v["over_share"]}
        assert over == {t for t, v in held.items() if v["bytes"] > share * limit}
        assert {t: {k: v[k] for k in ("bytes", "checkpoints")} for t, v in st["tenants"].items()} == held
        if share == 0.5:
            assert over == {"bob"}  # bob's five long files are more than half of everything
        else:
            assert over >= {"alice", "bob"} and "anonymous" not in over
    out = ds4_cmd("kv", "stats", d, "--tenant-share", "0.5", "--budget-mb", f"{budget_mb:.9f}").stdout
    assert "tenant share   0.5" in out
    rows = {
        line.split()[0]: line.split()[-1] for line in out.splitlines() if line.split()[:1] and line.split()[0] in held
    }
    assert rows == {t: ("OVER" if t == "bob" else "ok") for t in held}
    # without --budget-mb: ds4 serve's default budget, said in the output
    st, _ = ds4_json("kv", "stats", d, "--tenant-share", "0.5")
    assert st["budget_bytes"] == 4096 * 2**20 and not any(v["over_share"] for v in st["tenants"].values())


@pytest.mark.parametrize("bad", ["0", "-0.5", "1.5", "nan", "half"])
def test_a_share_outside_zero_one_is_a_usage_error(tenants_dir, tmp_path, bad):
    d, files = tenants_dir
    for cmd in (["stats", d], ["gc", d, "--budget-mb", "0.1"], ["gc", d, "--budget-mb", "0.1", "--dry-run"]):
        p = ds4_cmd("kv", *cmd, "--tenant-share", bad, check=False)
        assert p.returncode == 2 and "must be in (0, 1]" in p.stderr, p.stderr
    assert sorted(n for n in os.listdir(d) if n.endswith(".kv")) == sorted(files)  # nothing evicted


def test_gc_share_needs_a_budget_and_a_directory(tenants_dir):
    d, files = tenants_dir
    p = ds4_cmd("kv", "gc", d, "--tenant-share", "0.5", check=False)
    assert p.returncode == 2 and "--budget-mb" in p.stderr
    for cmd in (["gc", "--remote", "redis://127.0.0.1:1"], ["stats", "--remote", "redis://127.0.0.1:1"]):
        p = ds4_cmd("kv", *cmd, "--tenant-share", "0.5", check=False)
        assert p.returncode == 2 and "--tenant-share" in p.stderr
    assert sorted(n for n in os.listdir(d) if n.endswith(".kv")) == sorted(files)


# -- ds4 kv gc --tenant-share ---------------------------------------------------------
def test_gc_evicts_with_the_servers_plan_and_the_dry_run_prints_it(tenants_dir, tmp_path):
    src, files = tenants_dir
    total = sum(size for _, size in files.values())
    budget = f"{total * 0.7 / 2**20:.9f}"
    d = _copy(src, tmp_path)
    before = sorted(os.listdir(d))
    dry = {}
    for share in ("1", "0.5"):
        g, rc = ds4_json("kv", "gc", d, "--budget-mb", budget, "--tenant-share", share, "--dry-run")
        assert rc == 0 and g["evicted"] and sorted(os.listdir(d)) == before  # nothing changed
        dry[share] = g["evicted"]
    # with shares bob (over half of the budget) loses his own files, and only his
    assert {files[n][0] for n in dry["0.5"]} == {"bob"}
    # ds4's one order takes the lowest scores whoever holds them: not only bob's
    assert {files[n][0] for n in dry["1"]} != {"bob"}
    # the plan is the store's (the server's): KVStore(tenant_share=F) plans the same
    store = KVStore(_copy(src, tmp_path / "b"), budget_mb=float(budget), scan=False, tenant_share=0.5)
    store.refresh(force=True)
    assert [e.name for e in store.plan_evict(store.entries())] == dry["0.5"]
    out = ds4_cmd("kv", "gc", d, "--budget-mb", budget, "--tenant-share", "0.5", "--dry-run").stdout
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("would evict")] == dry["0.5"]
    # the real run evicts that plan, in that order
    g, rc = ds4_json("kv", "gc", d, "--budget-mb", budget, "--tenant-share", "0.5")
    assert rc == 0 and g["evicted"] == dry["0.5"]
    left = {n for n in os.listdir(d) if n.endswith(".kv") and not n.startswith(".")}
    assert left == set(files) - set(dry["0.5"]) and g["bytes_after"] <= float(budget) * 2**20
    st, _ = ds4_json("kv", "stats", d)
    assert st["tenants"]["alice"] == _held(files)["alice"]  # alice, within her share, untouched


def test_gc_without_a_share_plans_as_before(tenants_dir, tmp_path):
    """``--dry-run`` without ``--tenant-share`` plans with F = 1 (ds4's one
    order) and names what the real run then evicts."""
    src, files = tenants_dir
    total = sum(size for _, size in files.values())
    budget = f"{total * 0.7 / 2**20:.9f}"
    d = _copy(src, tmp_path)
    g, _ = ds4_json("kv", "gc", d, "--budget-mb", budget, "--dry-run")
    g1, _ = ds4_json("kv", "gc", d, "--budget-mb", budget, "--tenant-share", "1", "--dry-run")
    assert g["evicted"] and g["evicted"] == g1["evicted"]
    real, _ = ds4_json("kv", "gc", d, "--budget-mb", budget)
    assert real["evicted"] == g["evicted"]


# -- the store's summary ----------------------------------------------------------------
def test_the_summary_counts_tenants_from_the_index_alone(tenants_dir, tmp_path, monkeypatch):
    src, files = tenants_dir
    store = KVStore(_copy(src, tmp_path), min_tokens=1)
    assert store.summary()["tenants"] == _held(files)

    def no_scan(*a, **k):
        raise AssertionError("the summary listed or read the directory")

    monkeypatch.setattr(store, "refresh", no_scan)
    monkeypatch.setattr(os, "scandir", no_scan)
    monkeypatch.setattr(os, "listdir", no_scan)
    assert store.tenant_usage() == _held(files)
    assert store.summary()["tenants"] == _held(files)


# -- the operator's /health ---------------------------------------------------------------
KA, KB, KOPS = "sk-gcshare-alice", "sk-gcshare-bob", "sk-gcshare-ops"


def test_the_operators_health_shows_each_tenants_bytes_a_tenants_does_not(tmp_path, serve):
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\nops:{KOPS}\n", encoding="utf-8")
    kv = tmp_path / "kv"
    srv = serve(
        "--api-key-file",
        str(keys),
        "--admin-tenant",
        "ops",
        "--kv-disk-dir",
        str(kv),
        *KV_FLAGS,
        name="gcshare",
        tmp=tmp_path,
        key=KOPS,
    )
    get = lambda key: httpx.get(srv.base + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=10)  # noqa: E731
    model = srv.model()
    b0 = get(KB)
    srv.client(KA).chat.completions.create(model=model, messages=topic_chat("alice-gcshare", 30), max_tokens=2)
    srv.client(KB).chat.completions.create(model=model, messages=topic_chat("bob-gcshare", 30), max_tokens=2)
    for _ in range(200):  # the operator's status is a snapshot taken after each job
        h = get(KOPS).json()
        if not h["busy"] and {"alice", "bob"} <= set(h["kv"]["tenants"]):
            break
    on_disk = KVStore(kv, trust_dir=True).tenant_usage()
    assert h["kv"]["tenants"] == on_disk and {"alice", "bob"} <= set(on_disk)
    assert all(v["bytes"] > 0 and v["checkpoints"] > 0 for v in on_disk.values())
    assert sum(v["bytes"] for v in on_disk.values()) == h["kv"]["bytes"]
    # a tenant's view: its own name and counters, never the store's tenants
    for key, name in ((KA, "alice"), (KB, "bob")):
        body = get(key)
        assert set(body.json()) == {"status", "model", "engine", "payload_abi", "tenant"}
        assert "tenants" not in body.text and body.json()["tenant"]["name"] == name
    assert "tenants" not in b0.text and "kv" not in json.loads(b0.text)
