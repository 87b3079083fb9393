"""What the store's saves write (``ds4.kvstore.writes``): the bytes by the
save's reason, equal to the files and blocks that reached the disk; the
write budget (``--kv-write-budget-gb-per-day``) over the last 24 hours of
the directory, shared by every store on it, which refuses a save that
would go over (``write_budget``) and admits a mostly new ``evict``
snapshot only within the budget's share such snapshots are hit, a cheap
one (its blocks on disk already) like any save; a hostile ``.ds4.writes``
counts as an empty day and is never followed. The reference engine."""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers.kv import prefilled

import ds4
from ds4.config import add_kv_args, check_kv_args, make_store
from ds4.kvstore.blocks import BLOCKS_DIR
from ds4.kvstore.skips import WRITE_BUDGET, SaveSkip
from ds4.kvstore.writes import WRITES_NAME, hit_share

BASE = " ".join(f"word{i % 50}" for i in range(300))


def _text(k: int, extra: int = 40) -> str:
    return BASE + f" task {k}: " + " ".join(f"t{k}x{i}" for i in range(extra))


def _store(d, **kw) -> ds4.KVStore:
    kw.setdefault("budget_mb", 1024)
    return ds4.KVStore(str(d), min_tokens=8, frontier_tokens=0, **kw)


def _disk(d) -> int:
    return sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs if f.endswith((".kv", ".kvb"))
    )


def _day(d) -> int:
    with open(os.path.join(d, WRITES_NAME)) as f:
        return sum(json.load(f)["hours"].values())


@pytest.mark.parametrize("blocks", [False, True])
def test_bytes_written_by_reason_are_the_bytes_on_disk(eng, tmp_path, blocks):
    d = tmp_path / "kv"
    store = _store(d, blocks=blocks, block_tokens=16)
    sizes = {}
    for k, reason in enumerate(("cold", "continued", "evict")):
        assert isinstance(store.store_live_checked(prefilled(eng, _text(k)), reason), str)
        sizes[reason] = _disk(d) - sum(sizes.values())
    by = store.writes.by_reason()
    assert by == sizes  # nothing evicted, nothing rewritten: every byte on disk was counted once, by its save
    assert store.stats["bytes_written"] == sum(sizes.values())
    s = store.summary()
    assert s["written_by_reason"] == sizes and s["bytes_written"] == sum(sizes.values())
    if blocks:  # the second and third saves wrote only their own blocks: the shared head's are the first's
        assert sizes["continued"] < sizes["cold"] / 2 and s["block_files"] > 0
        assert s["logical_bytes"] > _disk(d) and s["dedup_ratio"] == pytest.approx(s["logical_bytes"] / _disk(d))
    else:
        assert s["dedup_ratio"] == 1.0 and s["block_files"] == 0 and s["logical_bytes"] == _disk(d)
    assert not os.path.exists(d / WRITES_NAME)  # no budget: nothing kept on disk


def test_the_budget_refuses_a_save_that_would_go_over_and_every_store_counts_against_it(eng, tmp_path):
    d = tmp_path / "kv"
    one = _disk_of_one(eng, tmp_path)
    budget_gb = 2.5 * one / 1e9  # two saves fit, the third does not
    a = _store(d, write_budget_gb_per_day=budget_gb)
    assert isinstance(a.store_live_checked(prefilled(eng, _text(1)), "cold"), str)
    b = _store(d, write_budget_gb_per_day=budget_gb)  # another process on the directory
    assert isinstance(b.store_live_checked(prefilled(eng, _text(2)), "cold"), str)
    assert _day(d) == _disk(d) == a.writes.day_bytes() == b.writes.day_bytes()
    got = a.store_live_checked(prefilled(eng, _text(3)), "continued")
    assert isinstance(got, SaveSkip) and got.code == WRITE_BUDGET and got.kind == "continued", got
    assert "over the write budget" in got.detail
    assert len(a.entries()) == 2 and a.stats["write_budget_refused"] == 1
    # the hours older than a day no longer count: the same save is admitted
    with open(d / WRITES_NAME) as f:
        doc = json.load(f)
    old = int(time.time()) // 3600 - 30
    doc["hours"] = {str(old): n for n in doc["hours"].values()}
    (d / WRITES_NAME).write_text(json.dumps(doc))
    assert a.writes.day_bytes() == 0
    assert isinstance(a.store_live_checked(prefilled(eng, _text(3)), "continued"), str)
    assert str(old) not in json.loads((d / WRITES_NAME).read_text())["hours"]  # dropped at the next write


def _disk_of_one(eng, tmp_path) -> int:
    d = tmp_path / "probe"
    assert isinstance(_store(d).store_live_checked(prefilled(eng, _text(0)), "cold"), str)
    return _disk(d)


def test_a_mostly_new_evict_snapshot_is_admitted_by_its_hit_likelihood_a_cheap_one_within_the_budget(eng, tmp_path):
    d = tmp_path / "kv"
    first = _store(d, write_budget_gb_per_day=1000.0, blocks=True, block_tokens=16)
    for k in (1, 2):
        assert isinstance(first.store_live_checked(prefilled(eng, _text(k)), "cold"), str)
    used = first.writes.day_bytes()
    assert used == _disk(d)
    new = prefilled(eng, "fresh text with nothing shared " * 40)
    state = sum(a.nbytes for a in new.export_arrays().values())
    # a budget the new state fits in whole, not in the half an evict snapshot gets on a directory
    # with none yet (one hit and one miss assumed)
    store = _store(d, write_budget_gb_per_day=1.25 * (used + state) / 1e9, blocks=True, block_tokens=16)
    got = store.store_live_checked(new, "evict")
    assert isinstance(got, SaveSkip) and got.code == WRITE_BUDGET and "evict snapshot: 0.50" in got.detail, got
    assert store.stats["write_budget_refused"] == 1
    # the same state as a continued save: within the whole budget, admitted
    assert isinstance(store.store_live_checked(new, "continued"), str)
    # an evict snapshot of a conversation whose blocks are on disk: cheap, admitted within the budget
    cheap = prefilled(eng, _text(1, extra=44))
    before = store.writes.day_bytes()
    assert isinstance(store.store_live_checked(cheap, "evict"), str)
    wrote = store.writes.day_bytes() - before
    assert 0 < wrote <= 0.25 * sum(a.nbytes for a in cheap.export_arrays().values())


def test_hit_share_counts_only_speculative_saves():
    assert hit_share([]) == 0.5
    assert hit_share([("cold", 0), ("continued", 9)]) == 0.5
    assert hit_share([("evict", 0)] * 8) == pytest.approx(0.1)
    assert hit_share([("evict", 3), ("frontier", 1), ("evict", 0)]) == pytest.approx(3 / 5)


@pytest.mark.parametrize("kind", ["garbage", "symlink", "directory", "wrong_shape"])
def test_a_hostile_writes_file_counts_as_an_empty_day_and_is_never_followed(eng, tmp_path, kind):
    d = tmp_path / "kv"
    d.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "hours": {str(int(time.time()) // 3600): 10**15}}))
    p = d / WRITES_NAME
    if kind == "garbage":
        p.write_bytes(b"\x00\xff not json")
    elif kind == "symlink":
        p.symlink_to(target)
    elif kind == "directory":
        p.mkdir()
    else:
        p.write_text(json.dumps({"version": 1, "hours": [1, 2, 3]}))
    store = _store(d, write_budget_gb_per_day=1.0)
    assert store.writes.day_bytes() == 0
    assert isinstance(store.store_live_checked(prefilled(eng, _text(1)), "cold"), str)
    if kind in ("symlink", "directory"):  # left as they are: the count is lost for the day, nothing else
        assert os.path.islink(p) if kind == "symlink" else p.is_dir()
        assert json.loads(target.read_text())["hours"] != {}
        assert not any(".tmp" in f for f in os.listdir(d) if f.startswith(".ds4.writes"))
    else:  # replaced by a good one
        assert _day(d) == _disk(d)


def test_the_flag_reaches_the_store_and_bad_values_are_refused(tmp_path):
    import argparse

    ap = argparse.ArgumentParser()
    add_kv_args(ap)
    args = ap.parse_args(["--kv-disk-dir", str(tmp_path / "kv"), "--kv-write-budget-gb-per-day", "1.5"])
    assert check_kv_args(args) is None
    store = make_store(args)
    assert store.policy.write_budget_bytes == 1_500_000_000 and store.writes.budget_bytes == 1_500_000_000
    for bad in ("-1", "nan", "inf"):
        args = ap.parse_args(["--kv-disk-dir", str(tmp_path / "kv"), "--kv-write-budget-gb-per-day", bad])
        assert "--kv-write-budget-gb-per-day" in check_kv_args(args)
    with pytest.raises(ValueError):
        ds4.KVStore(str(tmp_path / "x"), write_budget_gb_per_day=-1)


def test_blocks_written_before_a_failed_manifest_still_count(eng, tmp_path, monkeypatch):
    """The blocks reach the disk before the manifest: a manifest that fails
    to be written leaves them counted (they were written)."""
    from ds4.kvstore import save

    d = tmp_path / "kv"
    store = _store(d, blocks=True, block_tokens=16)

    def fail(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save, "write_live", fail)
    got = store.store_live_checked(prefilled(eng, _text(1)), "cold")
    assert isinstance(got, SaveSkip) and got.code == "disk_full"
    blocks = sum(
        os.path.getsize(os.path.join(d, BLOCKS_DIR, f)) for f in os.listdir(d / BLOCKS_DIR) if f.endswith(".kvb")
    )
    assert store.writes.by_reason() == {"cold": blocks} and blocks > 0
