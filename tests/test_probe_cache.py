"""The start-up probe's batch policy is kept on disk between starts
(issue 35, item 4; :mod:`ds4.engines.llamacpp_policy_cache`): a second
engine of the same model, build and settings measures no batch policy and
has the same facts; a file of another key, a corrupt or linked one, or the
cache turned off, makes the probe measure again."""

from __future__ import annotations

import json
import os

import pytest
from helpers import models

from ds4.engines import llamacpp_probe as P
from ds4.engines.llamacpp import LlamaCppEngine


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory; the process's own probe cache emptied (and
    put back after, for the tests that follow); the splits counted."""
    monkeypatch.setenv("DS4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DS4_PROBE_CACHE", raising=False)
    monkeypatch.setattr(P, "_cache", {})
    calls: list[tuple[int, int]] = []
    alike = P._alike

    def counted(ctx, toks, floor, mult):
        calls.append((floor, mult))
        return alike(ctx, toks, floor, mult)

    monkeypatch.setattr(P, "_alike", counted)
    return tmp_path / "probes", calls


def _fresh(name: str, **kw) -> LlamaCppEngine:
    P._cache.clear()  # a new process, as far as the probe knows
    return LlamaCppEngine(model_path=models.model_path(name), **kw)


def _facts(eng: LlamaCppEngine) -> tuple:
    f = eng.facts()
    return f["batch"], f["exact_verified"], eng.serial, eng.payload_abi()


@pytest.mark.parametrize("name", ["smollm2", "phi3", "mamba2"])
def test_a_second_start_reads_the_policy_and_measures_none(cache, name):
    d, calls = cache
    first = _facts(_fresh(name))
    assert calls, "the first start measures"
    assert len(os.listdir(d)) == 1
    calls.clear()
    again = _fresh(name)
    assert calls == [] and _facts(again) == first


def test_another_key_or_a_bad_file_is_measured_again(cache):
    d, calls = cache
    want = _facts(_fresh("phi3"))
    [name] = os.listdir(d)
    path = d / name
    doc = json.loads(path.read_text())
    for bad in (
        b"not json",
        json.dumps({**doc, "key": {**doc["key"], "probe": 1}}).encode(),  # an older probe's
        json.dumps({**doc, "floor": 3}).encode(),  # not a candidate
        json.dumps({**doc, "serial": "yes"}).encode(),
        b"{" * (1 << 17),
    ):
        path.write_bytes(bad)
        calls.clear()
        assert _facts(_fresh("phi3")) == want and calls, bad[:40]
        assert json.loads(path.read_text()) == doc  # measured and kept again
    calls.clear()
    _fresh("phi3", n_batch=256)  # another batch size: another key
    assert calls and len(os.listdir(d)) == 2


def test_a_linked_file_is_not_read(cache, tmp_path):
    d, calls = cache
    want = _facts(_fresh("qwen3"))
    [name] = os.listdir(d)
    target = tmp_path / "elsewhere.json"
    os.replace(d / name, target)
    os.symlink(target, d / name)
    calls.clear()
    assert _facts(_fresh("qwen3")) == want and calls


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    d, calls = cache
    monkeypatch.setenv("DS4_PROBE_CACHE", "off")
    _fresh("phi3")
    _fresh("phi3")
    assert not d.exists() and len(calls) >= 2


def test_the_pools_batched_decode_check_is_kept_too(cache, monkeypatch):
    """The pool's start-up check that batched steps are exact (seconds of
    prefills and steps) runs once per key; its answer is read back."""
    from ds4.engines import llamacpp_batch as B

    checks: list[int] = []
    real = B.batched_exact
    monkeypatch.setattr(B, "batched_exact", lambda eng, prompts, **kw: checks.append(1) or real(eng, prompts, **kw))
    for _ in range(2):
        eng = _fresh("smollm2", exact="strict")
        shared = eng.batched_contexts(2, 256)
        assert isinstance(shared, B.SharedContext)
        for c in shared.contexts:
            c.close()
    assert checks == [1]
