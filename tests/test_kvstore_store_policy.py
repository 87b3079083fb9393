"""The store under long agent sessions (issue #23 items 4 and 7): continued
snapshots superseded by a longer one of their text (ds4 PR #175), explicit
checkpoints weighted in eviction (PR #177), fresh entries guarded until
nothing else can go (PR #159), and ``ds4 kv verify`` counting the v1 files
ds4 ignores as ignored. Time is pinned by the ``now`` each plan is given."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import types

import pytest
from helpers.kv import toks
from test_core_v1 import TEXT, v1_file

import ds4
from ds4 import config, kvstore
from ds4.kvstore import Entry, KVStore, StorePolicy, plan_eviction
from ds4.kvstore import remove as kv_remove
from ds4.kvstore.entries import EXPLICIT_REASONS

NOW = 2_000_000_000


def _e(name, reason="cold", tokens=100, size=100, hits=0, created=NOW - 3600, last_used=0, ns=None):
    return Entry(name, name, 2, tokens, 10, hits, created, last_used, size, "t/1", reason, 4096, (), ns)


def _plan(entries, limit, *, weight=1.0, guard=0.0, share=1.0, protect=None):
    out = plan_eviction(entries, limit, NOW, protect, share, explicit_weight=weight, fresh_guard_s=guard)
    return [e.name for e in out]


# -- the explicit weight --------------------------------------------------------------
def test_the_weight_multiplies_only_an_explicit_checkpoints_score():
    assert EXPLICIT_REASONS == {"cold", "evict", "shutdown"}
    for reason in ("cold", "evict", "shutdown"):
        e = _e("x", reason, hits=2, last_used=NOW - 100)
        assert e.score(NOW, explicit_weight=4.0) == 4.0 * e.score(NOW)
    for reason in ("continued", "named", "agent-system", "agent-session", "unknown"):
        e = _e("x", reason, hits=2, last_used=NOW - 100)
        assert e.score(NOW, explicit_weight=4.0) == e.score(NOW)


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_the_weight_puts_continued_snapshots_before_explicit_checkpoints(share):
    # the cold file scores half the continued one by ds4's formula: ds4 (1)
    # evicts it first; the weight 4 (ds4 PR #177) makes it score twice as
    # high, so the continued one goes; a weight below the ratio changes nothing
    ents = [_e("cold", "cold", tokens=50), _e("cont", "continued", tokens=100)]
    assert _plan(ents, 100, weight=1.0, share=share) == ["cold"]
    assert _plan(ents, 100, weight=4.0, share=share) == ["cont"]
    assert _plan(ents, 100, weight=1.9, share=share) == ["cold"]
    assert _plan(ents, 100, weight=2.1, share=share) == ["cont"]
    assert _plan(ents, 0, weight=4.0, share=share) == ["cont", "cold"]


# -- the fresh guard --------------------------------------------------------------------
def test_fresh_means_never_hit_and_younger_than_the_guard():
    assert _e("x", created=NOW - 59).fresh(NOW, 60)
    assert not _e("x", created=NOW - 60).fresh(NOW, 60)  # exactly the guard's age: no longer fresh
    assert not _e("x", created=NOW - 10, hits=1).fresh(NOW, 60)  # hit once: it earned its place
    assert not _e("x", created=NOW - 10).fresh(NOW, 0)  # no guard
    assert not _e("x", created=0).fresh(NOW, 60)  # no creation time: not known to be fresh
    assert _e("x", created=NOW + 5).fresh(NOW, 60)  # a clock behind the writer's
    assert not _e("x", created=NOW + 5).fresh(NOW, 0)  # ... but no guard is no guard
    assert _e("x", created=NOW).fresh(NOW, 0.5)  # any positive guard, under a second too
    # the creation time 0 means unknown, whatever the clock says; 1 is a time
    assert not _e("x", created=0).fresh(30, 60)
    assert _e("x", created=1).fresh(30, 60)


def test_plan_eviction_defaults_to_ds4s_order():
    # without the knobs, plan_eviction is ds4's: one weight for every reason, no guard
    ents = [_e("cold", "cold", tokens=60), _e("cont", "continued", tokens=100)]
    assert [e.name for e in plan_eviction(ents, 100, NOW)] == ["cold"]  # 0.6 scores below 1.0
    ents = [_e("fresh", "continued", tokens=10, created=NOW), _e("old", "continued", hits=3, last_used=NOW - 30)]
    assert [e.name for e in plan_eviction(ents, 100, NOW)] == ["fresh"]  # written this second, not guarded


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_fresh_entry_goes_only_when_nothing_else_can(share):
    # ds4's score (and the weight) would evict the fresh cold save first
    # (fewest tokens per byte, PR #159); the guard keeps it while the older
    # hit one can go, and gives it up last when everything must
    ents = [_e("fresh", "cold", tokens=10, created=NOW - 5), _e("old", "continued", hits=3, last_used=NOW - 30)]
    assert _plan(ents, 100, guard=0, share=share) == ["fresh"]
    assert _plan(ents, 100, guard=60, weight=4.0, share=share) == ["old"]
    assert _plan(ents, 0, guard=60, weight=4.0, share=share) == ["old", "fresh"]
    # once the guard's time is up it is an entry like any other
    ents[0].created = NOW - 61
    assert _plan(ents, 100, guard=60, share=share) == ["fresh"]
    # the protected (newest) file still never goes, fresh or not
    assert _plan(ents, 0, guard=60, share=share, protect="old") == ["fresh"]


def test_the_guard_outranks_a_tenants_share():
    # alice is over her share with one fresh entry; bob is within his with
    # an old one: bob's goes first (nothing else can), then alice's
    ents = [
        _e("a-fresh", "continued", size=300, created=NOW - 1, ns="alice"),
        _e("b-old", "continued", size=100, tokens=1000, ns="bob"),
    ]
    assert _plan(ents, 300, share=0.5) == ["a-fresh"]  # no guard: the tenant over its share pays
    assert _plan(ents, 300, share=0.5, guard=60) == ["b-old"]
    assert _plan(ents, 0, share=0.5, guard=60) == ["b-old", "a-fresh"]


# -- the policy and its flags -----------------------------------------------------------
def test_the_policy_knobs_defaults_and_checks(tmp_path):
    pol = StorePolicy()
    assert (pol.explicit_weight, pol.fresh_guard_s) == (4.0, 60.0)
    for bad in ({"explicit_weight": 0.5}, {"explicit_weight": float("nan")}, {"fresh_guard_s": -1}):
        with pytest.raises(ValueError):
            StorePolicy(**bad)
    st = KVStore(tmp_path / "kw", budget_mb=1, explicit_weight=1, fresh_guard_s=0)  # keyword construction
    assert (st.policy.explicit_weight, st.policy.fresh_guard_s, st.policy.budget_mb) == (1, 0, 1)


def test_the_flags_reach_the_store(tmp_path):
    p = argparse.ArgumentParser()
    config.add_kv_args(p)
    args = p.parse_args(["--kv-disk-dir", str(tmp_path / "kv")])
    assert config.check_kv_args(args) is None
    st = config.make_store(args)
    assert (st.policy.explicit_weight, st.policy.fresh_guard_s) == (4.0, 60.0)
    args = p.parse_args(["--kv-disk-dir", str(tmp_path / "kv"), "--kv-explicit-weight", "1", "--kv-fresh-guard-s", "0"])
    st = config.make_store(args)
    assert (st.policy.explicit_weight, st.policy.fresh_guard_s) == (1.0, 0.0)
    assert "explicit-weight" in config.check_kv_args(p.parse_args(["--kv-explicit-weight", "0.5"]))
    assert "fresh-guard" in config.check_kv_args(p.parse_args(["--kv-fresh-guard-s", "-1"]))


def test_the_store_plans_with_its_policy(tmp_path, monkeypatch):
    # the cold file is fresh and scores half the continued one: the store's
    # defaults keep it (guard and weight), ds4's order (1, 0) evicts it
    ents = [_e("cold", "cold", tokens=50, created=NOW - 5), _e("cont", "continued", tokens=100)]
    monkeypatch.setattr(
        kvstore.eviction, "time", types.SimpleNamespace(time=lambda: NOW, perf_counter=time.perf_counter)
    )
    limit = 100 + KVStore(tmp_path / "r", scan=False).records.total_bytes()
    st = KVStore(tmp_path / "a", budget_mb=limit / 2**20, scan=False)
    ds4_order = KVStore(tmp_path / "b", budget_mb=limit / 2**20, scan=False, explicit_weight=1, fresh_guard_s=0)
    assert [e.name for e in st.plan_evict(ents)] == ["cont"]
    assert [e.name for e in ds4_order.plan_evict(ents)] == ["cold"]
    assert [
        e.name for e in KVStore(tmp_path / "c", budget_mb=limit / 2**20, scan=False, fresh_guard_s=0).plan_evict(ents)
    ] == ["cont"]  # the weight alone
    # the guard alone: a fresh continued snapshot scoring a tenth of an old one
    ents = [_e("fresh", "continued", tokens=10, created=NOW - 5), _e("old", "continued", tokens=100)]
    assert [e.name for e in st.plan_evict(ents)] == ["old"]
    assert [e.name for e in ds4_order.plan_evict(ents)] == ["fresh"]


# -- supersede pruning ----------------------------------------------------------------
@pytest.fixture(scope="module")
def eng():
    return ds4.ReferenceEngine()


PROMPT = "word " * 200


def _save(eng, store, n, reason, ns=None, among=()):
    """Save the first ``n`` tokens; ``among``: the paths the same prefill
    saved before (what a continued save may supersede)."""
    s = ds4.Session(eng, ctx=2048)
    s.set_namespace(ns)
    s.sync(toks(eng, PROMPT)[:n])
    return store.store_live_prefix(s, reason, supersedes=[os.path.basename(p) for p in among])


def _kv(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".kv"))


def test_a_continued_save_supersedes_the_nested_continued_ones(eng, tmp_path, monkeypatch):
    st = KVStore(tmp_path, min_tokens=8)
    cold = _save(eng, st, 32, "cold")
    c1 = _save(eng, st, 64, "continued")
    assert os.path.exists(cold) and os.path.exists(c1) and st.stats["superseded"] == 0  # cold: not continued
    c2 = _save(eng, st, 96, "continued", among=[c1])
    assert not os.path.exists(c1) and st.stats["superseded"] == 1
    # removals go through the store's one removal path, under its lock
    seen = []
    real = kv_remove.remove_exact

    def spy(directory, name, expect, **kw):
        seen.append((name, expect, st._lock.depth))
        return real(directory, name, expect, **kw)

    monkeypatch.setattr(kv_remove, "remove_exact", spy)
    c3 = _save(eng, st, 128, "continued", among=[c1, c2])
    assert seen == [(os.path.basename(c2), seen[0][1], 1)] and seen[0][1]  # judged at its indexed stat key
    assert _kv(tmp_path) == sorted(os.path.basename(p) for p in (cold, c3))
    assert st.stats["superseded"] == 2 and st.stats["evictions"] == 0
    assert [e.name for e in st.entries()] == [os.path.basename(c3), os.path.basename(cold)]


def test_supersede_off_keeps_every_snapshot(eng, tmp_path):
    # the policy's switch (the replay bench's "before" arm): the same saves
    # as above, nothing superseded
    assert StorePolicy().supersede is True
    st = KVStore(tmp_path, min_tokens=8, supersede=False)
    c1 = _save(eng, st, 64, "continued")
    c2 = _save(eng, st, 96, "continued", among=[c1])
    c3 = _save(eng, st, 128, "continued", among=[c1, c2])
    assert _kv(tmp_path) == sorted(os.path.basename(p) for p in (c1, c2, c3)) and st.stats["superseded"] == 0


def test_two_nested_continued_go_the_cold_one_stays(eng, tmp_path):
    """Two nested older continued snapshots and one cold one; the continued
    save removes both continued, keeps the cold one. (Each older snapshot is
    written in a directory of its own, then moved in: written here, the
    second would already have superseded the first.)"""
    st_cold = _save(eng, KVStore(tmp_path, min_tokens=8), 32, "cold")
    older = [_save(eng, KVStore(tmp_path / f"w{i}", min_tokens=8), n, "continued") for i, n in enumerate((64, 96))]
    for p in older:
        os.rename(p, os.path.join(tmp_path, os.path.basename(p)))
    st = KVStore(tmp_path, min_tokens=8)
    assert len(_kv(tmp_path)) == 3 and st.stats["superseded"] == 0
    new = _save(eng, st, 128, "continued", among=[st_cold, *older])
    assert _kv(tmp_path) == sorted(os.path.basename(p) for p in (st_cold, new))
    assert st.stats["superseded"] == 2
    # the stats' shape: the one new counter, the others as before
    assert set(st.stats) == {
        "hits",
        "misses",
        "stores",
        "evictions",
        "superseded",
        "rejected",
        "removed_corrupt",
        "scans",
        "index_rebuilds",
        "index_retries",
        "index_mismatches",
        "bytes_written",
        "write_budget_refused",
    }


def test_explicit_saves_and_other_namespaces_are_not_superseded(eng, tmp_path):
    st = KVStore(tmp_path, min_tokens=8)
    kept = [
        _save(eng, st, 32, "evict"),
        _save(eng, st, 48, "shutdown"),
        _save(eng, st, 56, "named"),
        # another namespace's continued snapshot: its text after the preamble
        # is a byte prefix of the new one, but its key text is not
        _save(eng, st, 64, "continued", ns="bob"),
    ]
    kept.append(_save(eng, st, 80, "cold"))  # a cold save prunes nothing, and is not pruned
    new = _save(eng, st, 128, "continued", ns=None, among=kept)
    assert _kv(tmp_path) == sorted(os.path.basename(p) for p in [*kept, new])
    assert st.stats["superseded"] == 0
    # in bob's namespace, his continued snapshot is superseded by his own
    bob = _save(eng, st, 128, "continued", ns="bob", among=kept)
    assert not os.path.exists(kept[3]) and os.path.exists(bob) and st.stats["superseded"] == 1


def test_an_earlier_turns_snapshot_is_not_superseded(eng, tmp_path):
    """Only the snapshots of the same prefill go: an earlier turn's
    continued snapshot (not among them) is the branch point an edited or
    regenerated turn resumes from (tests/test_models_rungs.py's edit case)."""
    st = KVStore(tmp_path, min_tokens=8)
    turn1 = _save(eng, st, 64, "continued")
    within = _save(eng, st, 96, "continued")
    new = _save(eng, st, 128, "continued", among=[within])
    assert os.path.exists(turn1) and not os.path.exists(within) and os.path.exists(new)
    assert st.stats["superseded"] == 1


def test_another_engines_continued_prefix_is_kept(eng, tmp_path, write_ck):
    st = KVStore(tmp_path, min_tokens=8)
    s = ds4.Session(eng, ctx=2048)
    s.sync(toks(eng, PROMPT)[:64])
    foreign = write_ck(tmp_path, s.key_bytes(), reason="continued", tokens=64, abi="other/1")
    new = _save(eng, st, 128, "continued", among=[foreign])
    assert os.path.exists(foreign) and os.path.exists(new) and st.stats["superseded"] == 0


# -- ds4 kv verify and the files ds4 ignores ------------------------------------------
def _verify(d, *extra):
    return subprocess.run(
        [sys.executable, "-m", "ds4", "kv", "verify", str(d), *extra], capture_output=True, text=True, timeout=120
    )


def test_verify_reports_ignored_v1_files_as_ignored(eng, tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    data = v1_file(TEXT, quant=3, tokens=100)  # a quantization ds4's reader skips
    with open(d / (hashlib.sha1(TEXT).hexdigest() + ".kv"), "wb") as f:
        f.write(data)
    good = _save(eng, KVStore(d, min_tokens=8), 32, "cold")
    p = _verify(d, "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and (out["ok"], out["failed"], out["ignored"]) == (1, 0, 1)
    p = _verify(d)
    assert p.returncode == 0 and "SKIP" in p.stdout and "1 ok, 0 failed, 1 ignored" in p.stdout
    # a corrupt file still fails the directory
    with open(good, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    p = _verify(d, "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 1 and (out["failed"], out["ignored"]) == (1, 1)
