"""The recovery report, field by field, on every rung of the ladder.

Each test checks the report ``recover`` returns against an independent
expectation: which rung and source served, how many tokens were reused and
prefilled, what was saved and loaded, which events were recorded, and where
the time went. Timings are made exact with a fake ``perf_counter`` in
``ds4.recovery`` that advances by a fixed step per call.
"""

from __future__ import annotations

import json
import logging
import os
import types

import numpy as np
import pytest
from helpers.checkpoints import stored_path
from helpers.kv import toks

import ds4
from ds4 import _core, recovery
from ds4.checkpoint import open_checkpoint, write_checkpoint
from ds4.kvstore.skips import SaveSkip
from ds4.recovery import RecoveryReport

STEP = 0.25  # seconds per perf_counter call: every interval is 250 ms
MS = STEP * 1000
IM_START = "<|im_start|>"


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter for ds4.recovery only (the store and the engines
    keep the real one): 100.25, 100.5, ... one step per call."""
    calls = []

    def perf_counter():
        calls.append(None)
        return 100.0 + STEP * len(calls)

    monkeypatch.setattr(recovery, "time", types.SimpleNamespace(perf_counter=perf_counter))
    return calls


def byte_toks(eng, text):
    """The tokens of ``text`` with the special markers spelled out in bytes:
    the same rendered text, a different tokenization."""
    return eng.tokenize(text, special=False)


def cold_logits(eng, tokens, ctx):
    c = ds4.Session(eng, ctx=ctx)
    c.sync(tokens)
    return np.array(c.logits)


def rewindable(monkeypatch, sess):
    """Give ``sess``'s engine context an exact rewind (re-prefill of the kept
    prefix), as an engine without sliding layers could do natively."""
    ectx = sess._ectx

    def truncate(self, n):
        keep = list(sess._tokens[:n])  # the session trims its tokens after this returns
        self.reset()
        if keep:
            self.eval(keep)
        return True

    monkeypatch.setattr(ectx, "truncate", types.MethodType(truncate, ectx))


def kv_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".kv"))


def ladder_event(rung, source, reused, prompt, rejected, total_ms):
    return (
        f"ds4 ladder rung={rung} source={source} reused={reused} prompt={prompt} "
        f"prefill={prompt - reused} rejected={rejected} total={total_ms:.1f} ms"
    )


# -- RecoveryReport itself -------------------------------------------------------


def test_as_dict_spells_out_every_field():
    rep = RecoveryReport(
        rung="disk",
        source="disk-text",
        reused_tokens=7,
        prompt_tokens=9,
        loaded_path="/c/x.kv",
        rejected=[
            ("/c/y.kv", "payload", "payload_checksum", "checksum differs"),
            ("/c/z.kv", "header", "abi", "other engine"),
        ],
        timings={"tokenize_ms": 1.5},
        evict_saved="/c/e.kv",
        cold_saved=None,
        save_skipped=[SaveSkip("cold", "below_min_tokens", "40 tokens < min 64")],
        events=["one"],
        remote="up",
        divergence={"against": "live", "token": 3, "byte": 5, "cached": "ab", "prompt": "cd"},
        token_check={"against": "disk", "kept": 6, "of": 7},
        snapshot=5,
        frontier_saved="/c/f.kv",
        reload={"checkpoint": "x.kv", "depth": 7, "span": 2, "times": 2},
    )
    assert rep.as_dict() == {
        "rung": "disk",
        "source": "disk-text",
        "reused_tokens": 7,
        "prompt_tokens": 9,
        "loaded_path": "/c/x.kv",
        "rejected": [
            {"path": "/c/y.kv", "stage": "payload", "code": "payload_checksum", "reason": "checksum differs"},
            {"path": "/c/z.kv", "stage": "header", "code": "abi", "reason": "other engine"},
        ],
        "timings": {"tokenize_ms": 1.5},
        "evict_saved": "/c/e.kv",
        "cold_saved": None,
        "prompt_saved": None,
        "frontier_saved": "/c/f.kv",
        "reload": {"checkpoint": "x.kv", "depth": 7, "span": 2, "times": 2},
        "save_skipped": [{"kind": "cold", "code": "below_min_tokens", "detail": "40 tokens < min 64"}],
        "events": ["one"],
        "remote": "up",
        "divergence": {"against": "live", "token": 3, "byte": 5, "cached": "ab", "prompt": "cd"},
        "token_check": {"against": "disk", "kept": 6, "of": 7},
        "snapshot": 5,
    }
    assert RecoveryReport().as_dict()["rejected"] == []
    assert RecoveryReport().as_dict()["token_check"] is None
    assert RecoveryReport().as_dict()["divergence"] is None
    assert RecoveryReport().as_dict()["save_skipped"] == []
    json.dumps(rep.as_dict())  # ds4 run --json prints it


def test_event_formats_only_with_arguments():
    rep = RecoveryReport()
    rep.log_event("reused=%d of %s", 3, "ten")
    rep.log_event("a literal 100% and %d, no arguments")
    assert rep.events == ["reused=3 of ten", "a literal 100% and %d, no arguments"]


# -- rung 4: full prefill --------------------------------------------------------


def test_prefill_report_progress_and_frontiers(eng, clock):
    prompt = "The quick brown fox jumps over the lazy d"  # 41 tokens
    tokens = toks(eng, prompt)
    assert len(tokens) == 41
    s = ds4.Session(eng, ctx=128)
    progress, frontiers = [], []
    rep = ds4.recover(
        s,
        None,
        prompt,
        progress=lambda done, total: progress.append((done, total)),
        frontier_every=16,
        on_frontier=lambda sess: frontiers.append((sess.n_past, sess.checkpoint_valid)),
    )
    assert progress == [(16, 41), (32, 41), (41, 41)]
    assert frontiers == [(16, True), (32, True)]
    assert s.tokens == tokens and np.array_equal(s.logits, cold_logits(eng, tokens, 128))
    # clock calls: start, tokenize start/end, prefill start/end, total
    assert len(clock) == 6
    assert rep.timings == {"tokenize_ms": MS, "prefill_ms": MS, "total_ms": 5 * MS}
    assert rep.as_dict() == {
        "rung": "prefill",
        "source": "full",
        "reused_tokens": 0,
        "prompt_tokens": 41,
        "loaded_path": None,
        "rejected": [],
        "timings": {"tokenize_ms": MS, "prefill_ms": MS, "total_ms": 5 * MS},
        "evict_saved": None,
        "cold_saved": None,
        "prompt_saved": None,
        "frontier_saved": None,
        "reload": None,
        "save_skipped": [],
        "events": [ladder_event("prefill", "full", 0, 41, 0, 5 * MS)],
        "remote": "",
        "divergence": None,  # a fresh session, no store: no candidate
        "token_check": None,
        "snapshot": None,
    }


def test_bytes_prompt_equals_str_prompt(eng):
    prompt = "<|im_start|>user\nsmörgåsbord, naïve café<|im_end|>\n"
    tokens = toks(eng, prompt)
    a = ds4.Session(eng, ctx=256)
    rep = ds4.recover(a, None, prompt.encode("utf-8"))
    assert (rep.rung, rep.source, rep.prompt_tokens) == ("prefill", "full", len(tokens))
    assert a.tokens == tokens
    rep = ds4.recover(a, None, bytearray((prompt + "more").encode("utf-8")))
    assert (rep.rung, rep.source, rep.reused_tokens) == ("live", "memory-token", len(tokens))
    assert a.tokens == toks(eng, prompt + "more")


# -- rung 1: the live session ----------------------------------------------------


def test_live_token_prefix_same_and_longer_prompt(eng, clock):
    prompt = "<|im_start|>user\nthe same prompt twice"
    tokens = toks(eng, prompt)
    s = ds4.Session(eng, ctx=128)
    s.sync(tokens)
    rep = ds4.recover(s, None, prompt)  # exactly the live tokens
    assert (rep.rung, rep.source, rep.reused_tokens, rep.prompt_tokens) == (
        "live",
        "memory-token",
        len(tokens),
        len(tokens),
    )
    assert rep.timings == {"tokenize_ms": MS, "prefill_ms": MS, "total_ms": 5 * MS}
    assert rep.events == [ladder_event("live", "memory-token", len(tokens), len(tokens), 0, 5 * MS)]
    assert s.tokens == tokens
    longer = toks(eng, prompt + ", and more")
    rep = ds4.recover(s, None, prompt + ", and more")
    assert (rep.rung, rep.source, rep.reused_tokens, rep.prompt_tokens) == (
        "live",
        "memory-token",
        len(tokens),
        len(longer),
    )
    assert s.tokens == longer and np.array_equal(s.logits, cold_logits(eng, longer, 128))


def test_live_markers_spelled_as_text_are_not_reused(eng):
    """Issue 11, item 5: live tokens that spell the markers as text render
    the same bytes as the prompt's real markers, but not the same key text:
    the live rung never extends them (a forged turn is not a real one, nor
    the reverse); the prompt's own tokens are prefilled."""
    live_text = IM_START + "user\nhi"
    live = byte_toks(eng, live_text)
    s = ds4.Session(eng, ctx=128)
    s.sync(live)
    assert s.text_bytes() != s.key_of(toks(eng, live_text))
    for prompt in (live_text + " there", live_text):
        s.sync(live)
        rep = ds4.recover(s, None, prompt)
        assert (rep.rung, rep.source, rep.reused_tokens) == ("prefill", "full", 0)
        assert s.tokens == toks(eng, prompt)


def test_live_text_cut_inside_utf8_prefills(eng):
    """The live text ends inside a UTF-8 sequence of the prompt: the suffix
    cannot be tokenized alone, so the live rung declines."""
    prompt = IM_START + "user\ncafé"
    live_b = (IM_START + "user\ncaf").encode() + "é".encode()[:1]
    live = list(live_b)  # byte tokens
    s = ds4.Session(eng, ctx=128)
    s.sync(live)
    rep = ds4.recover(s, None, prompt)
    assert (rep.rung, rep.source, rep.reused_tokens) == ("prefill", "full", 0)
    assert s.tokens == toks(eng, prompt)


# -- rung 2: rewrite (rewind) -----------------------------------------------------


A = "shared prefix then branch one"
B = "shared prefix then branch two, longer"


def test_rewind_report(eng, clock, monkeypatch):
    a, b = toks(eng, A), toks(eng, B)
    s = ds4.Session(eng, ctx=128)
    s.sync(a)
    common = s.common_prefix(b)
    assert 0 < common < len(a)
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, None, B)
    # start, tokenize start/end, rewrite start/end, total
    assert len(clock) == 6
    assert rep.as_dict() == {
        "rung": "rewrite",
        "source": "memory-rewind",
        "reused_tokens": common,
        "prompt_tokens": len(b),
        "loaded_path": None,
        "rejected": [],
        "timings": {"tokenize_ms": MS, "rewrite_ms": MS, "total_ms": 5 * MS},
        "evict_saved": None,
        "cold_saved": None,
        "prompt_saved": None,
        "frontier_saved": None,
        "reload": None,
        "save_skipped": [],
        "events": [f"ds4 ladder rung=rewrite reused={common} prompt={len(b)}"],
        "remote": "",
        # "shared prefix then branch " (26 bytes, one token each), then "one" / "two"
        "divergence": {"against": "live", "token": 26, "byte": 26, "cached": "one", "prompt": "two, longer"},
        "token_check": None,  # the tokens part where the text does
        "snapshot": None,
    }
    assert s.tokens == b and np.array_equal(s.logits, cold_logits(eng, b, 128))


def test_rewind_to_a_single_common_token(eng, monkeypatch):
    a, b = toks(eng, "sXYZ one"), toks(eng, "sABC two")
    s = ds4.Session(eng, ctx=128)
    s.sync(a)
    assert s.common_prefix(b) == 1
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, None, "sABC two")
    assert (rep.rung, rep.source, rep.reused_tokens, rep.prompt_tokens) == ("rewrite", "memory-rewind", 1, len(b))
    assert s.tokens == b and np.array_equal(s.logits, cold_logits(eng, b, 128))


@pytest.mark.parametrize("extra_min", [0, 1])
def test_rewind_evict_saves_the_discarded_branch(eng, tmp_path, monkeypatch, extra_min):
    """Before a rewind, the live state is saved (reason "evict") when it has
    at least ``min_tokens`` tokens: exactly at the minimum it is saved."""
    a, b = toks(eng, A), toks(eng, B)
    store = ds4.KVStore(str(tmp_path), min_tokens=len(a) + extra_min)
    s = ds4.Session(eng, ctx=128)
    s.sync(a)
    common = s.common_prefix(b)
    a_text = s.text_bytes()
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, store, B)
    assert (rep.rung, rep.source, rep.reused_tokens) == ("rewrite", "memory-rewind", common)
    assert s.tokens == b
    if extra_min:
        assert rep.evict_saved is None and kv_files(tmp_path) == []
        return
    expected = stored_path(tmp_path, a_text, s.payload_abi)
    assert rep.evict_saved == expected and kv_files(tmp_path) == [os.path.basename(expected)]
    ck = open_checkpoint(expected, prompt=a_text)
    assert ck.reason_name == "evict" and ck.tokens == len(a)
    # the saved branch is what the live session held before the rewind
    back = ds4.Session(eng, ctx=128)
    back.load_checkpoint(ck)
    assert back.tokens == a and np.array_equal(back.logits, cold_logits(eng, a, 128))


def test_rewind_without_evict_save_saves_nothing(eng, tmp_path, monkeypatch):
    a, _b = toks(eng, A), toks(eng, B)
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    s = ds4.Session(eng, ctx=128)
    s.sync(a)
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, store, B, evict_save=False)
    assert rep.rung == "rewrite" and rep.evict_saved is None
    assert kv_files(tmp_path) == []


def _store_prefix(eng, store, tokens, ctx=512):
    d = ds4.Session(eng, ctx=ctx)
    d.sync(tokens)
    path = store.store_live_prefix(d, "cold")
    assert path is not None
    return path


def test_longer_disk_prefix_beats_a_one_token_rewind(eng, tmp_path, monkeypatch):
    """Even when the engine can rewind, a longer verified prefix on disk wins
    (here the live session shares a single token with the prompt)."""
    prompt = "sABC a prompt whose long prefix is on disk"
    tokens = toks(eng, prompt)
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    path = _store_prefix(eng, store, tokens[:20])
    s = ds4.Session(eng, ctx=128)
    s.sync(toks(eng, "sXYZ another conversation"))
    assert s.common_prefix(tokens) == 1
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, store, prompt, evict_save=False)
    assert (rep.rung, rep.source, rep.reused_tokens, rep.loaded_path) == ("disk", "disk-text", 20, path)
    assert rep.prompt_tokens == len(tokens)
    assert any("rewrite skipped" in e for e in rep.events)
    assert "rewrite_ms" not in rep.timings
    assert s.tokens == tokens and np.array_equal(s.logits, cold_logits(eng, tokens, 128))


def test_disk_prefix_of_equal_length_does_not_beat_the_rewind(eng, tmp_path, monkeypatch):
    b = toks(eng, B)
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    s = ds4.Session(eng, ctx=128)
    s.sync(toks(eng, A))
    common = s.common_prefix(b)
    _store_prefix(eng, store, b[:common])  # disk holds exactly the common prefix
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, store, B, evict_save=False)
    assert (rep.rung, rep.source, rep.reused_tokens, rep.loaded_path) == ("rewrite", "memory-rewind", common, None)
    assert s.tokens == b


def test_disk_prefix_too_long_for_ctx_does_not_block_the_rewind(eng, tmp_path, monkeypatch):
    """A stored prefix with more tokens than the session's ctx cannot be
    loaded, so it must not make the ladder skip the rewind. (Its header
    claims 120 tokens for a short prefix: the lookup's ctx filter reads the
    header, the file is never opened.)"""
    ctx = 64
    head = IM_START * 10
    prompt = head + "xyz"
    tokens = toks(eng, prompt)
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    donor = ds4.Session(eng, ctx=512)
    donor.sync(toks(eng, head))
    key = donor.key_bytes()
    arrays = donor.export_arrays()
    arrays["tokens"] = np.resize(arrays["tokens"], 120)
    write_checkpoint(
        os.path.join(store.dir, _core.sha1_hex(key) + ".kv"), key, arrays, abi=donor.payload_abi, tokens=120, ctx=512
    )
    assert len(store.lookup(key + b"xyz")) == 1 and store.lookup(key + b"xyz", ctx=ctx) == []
    s = ds4.Session(eng, ctx=ctx)
    s.sync(toks(eng, IM_START * 5 + "abc"))
    assert s.common_prefix(tokens) == 5
    rewindable(monkeypatch, s)
    rep = ds4.recover(s, store, prompt, evict_save=False)
    assert (rep.rung, rep.source, rep.reused_tokens) == ("rewrite", "memory-rewind", 5)
    assert s.tokens == tokens and np.array_equal(s.logits, cold_logits(eng, tokens, ctx))


def test_nothing_in_common_skips_the_rewrite(eng, tmp_path, clock):
    """No common token: no rewrite is tried and no lookup is made for it; the
    miss is reported as a token mismatch and disk serves."""
    prompt = "Zebra stripes: a prompt stored on disk in part"
    tokens = toks(eng, prompt)
    store = ds4.KVStore(str(tmp_path), min_tokens=4)
    path = _store_prefix(eng, store, tokens[:24])
    s = ds4.Session(eng, ctx=128)
    live = toks(eng, "apples and pears")
    s.sync(live)
    assert s.common_prefix(tokens) == 0
    rep = ds4.recover(s, store, prompt)
    assert (rep.rung, rep.source, rep.reused_tokens, rep.loaded_path) == ("disk", "disk-text", 24, path)
    assert rep.prompt_tokens == len(tokens)
    # the live state was evict-saved before it was replaced
    assert rep.evict_saved == stored_path(tmp_path, b"apples and pears", s.payload_abi)
    miss = f"ds4 live kv cache miss live={len(live)} prompt={len(tokens)} common=0 reason=token-mismatch"
    # start, tokenize start/end, disk start/end, prefill start/end, total
    assert len(clock) == 8
    assert rep.timings == {"tokenize_ms": MS, "disk_ms": MS, "prefill_ms": MS, "total_ms": 7 * MS}
    assert rep.events == [miss, ladder_event("disk", "disk-text", 24, len(tokens), 0, 7 * MS)]
    assert s.tokens == tokens and np.array_equal(s.logits, cold_logits(eng, tokens, 128))


@pytest.mark.parametrize("extra_min", [0, 1])
def test_unrelated_prompt_evict_saves_the_live_state_at_exactly_min_tokens(eng, tmp_path, extra_min):
    """The live state an unrelated prompt replaces is saved with reason
    "evict" when it holds at least ``min_tokens`` tokens (not one fewer)."""
    live = toks(eng, "apples and pears, a live state to be replaced")
    store = ds4.KVStore(str(tmp_path), min_tokens=len(live) + extra_min)
    s = ds4.Session(eng, ctx=128)
    s.sync(live)
    live_text = s.text_bytes()
    prompt = "Zebra stripes: nothing in common with the live state"
    assert s.common_prefix(toks(eng, prompt)) == 0
    rep = ds4.recover(s, store, prompt)
    assert rep.rung == "prefill"
    if extra_min:
        assert rep.evict_saved is None and kv_files(tmp_path) == []
        return
    expected = stored_path(tmp_path, live_text, s.payload_abi)
    assert rep.evict_saved == expected
    ck = open_checkpoint(expected, prompt=live_text)
    assert ck.reason_name == "evict" and ck.tokens == len(live)


def test_disk_checkpoint_of_markers_spelled_as_text_is_never_a_candidate(eng, tmp_path):
    """Issue 11, item 5: a checkpoint whose tokens spell the chat markers as
    text renders the same bytes as the prompt with real markers, but is
    named after another key text: no lookup for the real prompt finds it
    (and the reverse), so neither loads for the other."""
    prompt = eng.render_chat([{"role": "user", "content": "spelled out byte by byte, then more"}])
    head = prompt[: len(prompt) // 2]
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    spelled = _store_prefix(eng, store, byte_toks(eng, head))
    real = ds4.Session(eng, ctx=512)
    real.sync(toks(eng, prompt))
    assert store.lookup(real.key_bytes()) == []
    s = ds4.Session(eng, ctx=512)
    rep = ds4.recover(s, store, prompt)
    assert (rep.rung, rep.reused_tokens, rep.loaded_path) == ("prefill", 0, None)
    assert store.stats["hits"] == 0 and os.path.exists(spelled)
    assert s.tokens == toks(eng, prompt)


def _cold_store(tmp_path, **kw):
    kw.setdefault("min_tokens", 8)
    kw.setdefault("boundary_trim_tokens", 3)
    kw.setdefault("boundary_align_tokens", 8)
    return ds4.KVStore(str(tmp_path), **kw)


def test_cold_save_stores_the_trimmed_aligned_prefix_on_the_way(eng, tmp_path):
    """A full prefill with ``cold_save`` stores ds4's cold prefix (trimmed,
    aligned; reason "cold") and reports it; progress and frontier callbacks
    see both parts of the prefill; the result equals a cold prefill."""
    prompt = eng.render_chat([{"role": "user", "content": "a cold prompt long enough to be stored on the way"}])
    tokens = toks(eng, prompt)
    store = _cold_store(tmp_path)
    cold_len = store.policy.cold_store_len(len(tokens))
    assert cold_len is not None and 0 < cold_len < len(tokens) and cold_len % 8 == 0
    prog, fronts = [], []
    s = ds4.Session(eng, ctx=256)
    rep = ds4.recover(
        s,
        store,
        prompt,
        cold_save=True,
        progress=lambda d, t: prog.append((d, t)),
        frontier_every=8,
        on_frontier=lambda sess: fronts.append(sess.n_past),
    )
    assert (rep.rung, rep.source, rep.reused_tokens, rep.prompt_tokens) == ("prefill", "full", 0, len(tokens))
    cold_text = eng.detokenize(tokens[:cold_len]).encode()
    expected = stored_path(tmp_path, cold_text, s.payload_abi)
    assert rep.cold_saved == expected and kv_files(tmp_path) == [os.path.basename(expected)]
    ck = open_checkpoint(expected, prompt=cold_text)
    assert ck.reason_name == "cold" and ck.tokens == cold_len
    assert fronts == list(range(8, len(tokens), 8))  # frontiers in the cold part and after it
    assert prog and prog[-1] == (len(tokens) - cold_len, len(tokens) - cold_len)  # the second part's progress
    assert (cold_len, cold_len) in prog  # the first part's progress ends at the cold length
    assert s.tokens == tokens and np.array_equal(s.logits, cold_logits(eng, tokens, 256))


@pytest.mark.parametrize("over", [0, 1])
def test_cold_save_up_to_exactly_cold_max_tokens(eng, tmp_path, over):
    prompt = eng.render_chat([{"role": "user", "content": "a prompt at the cold-save limit"}])
    tokens = toks(eng, prompt)
    store = _cold_store(tmp_path, cold_max_tokens=len(tokens) - over)
    s = ds4.Session(eng, ctx=256)
    rep = ds4.recover(s, store, prompt, cold_save=True)
    assert (rep.cold_saved is None) == bool(over)
    assert len(kv_files(tmp_path)) == (0 if over else 1)
    assert s.tokens == tokens


def test_cold_save_declined_for_a_prompt_too_short_to_store(eng, tmp_path):
    prompt = "short"
    store = _cold_store(tmp_path, min_tokens=64)
    s = ds4.Session(eng, ctx=256)
    rep = ds4.recover(s, store, prompt, cold_save=True)
    assert rep.cold_saved is None and kv_files(tmp_path) == [] and s.tokens == toks(eng, prompt)


def test_cold_save_without_a_store_is_a_plain_prefill(eng):
    prompt = "no store at all"
    s = ds4.Session(eng, ctx=256)
    rep = ds4.recover(s, None, prompt, cold_save=True)
    assert (rep.rung, rep.cold_saved) == ("prefill", None) and s.tokens == toks(eng, prompt)


class _CountingPrompt(str):
    """A prompt that counts its encodings to bytes."""

    encodings = 0

    def encode(self, *args, **kwargs):
        type(self).encodings += 1
        return str.encode(self, *args, **kwargs)


@pytest.mark.parametrize("on_disk", [False, True])
def test_one_lookup_and_one_encoding_per_ladder_run(eng, tmp_path, monkeypatch, on_disk):
    """The rewrite rung (does the disk hold more than a rewind keeps?) and
    the disk rung share one lookup: one call to ``candidates``, one pass
    of the prompt's prefix hashes, one encoding of the prompt."""
    store = ds4.KVStore(tmp_path, min_tokens=4, boundary_align_tokens=4)
    s = ds4.Session(eng, ctx=256)
    s.sync(toks(eng, A))
    store.store_live_prefix(_sess_at(eng, "an unrelated stored text"), "continued")  # a candidate to hash
    if on_disk:  # a stored prefix of B longer than what B shares with the live A
        store.store_live_prefix(_sess_at(eng, B[: len(B) - 3]), "continued")
    calls = {"candidates": 0, "index_lookups": 0}
    real_candidates = store.candidates

    def candidates(*a, **kw):
        calls["candidates"] += 1
        return real_candidates(*a, **kw)

    class CountingIndex:
        """The store's index (one lookup in the core = one hashing pass)."""

        def __init__(self, idx):
            self.idx = idx

        def lookup(self, *a, **kw):
            calls["index_lookups"] += 1
            return self.idx.lookup(*a, **kw)

        def prefixes(self, *a, **kw):  # the lazy lookup: one pass, the rest on demand
            calls["index_lookups"] += 1
            return self.idx.prefixes(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.idx, name)

    monkeypatch.setattr(store, "candidates", candidates)
    monkeypatch.setattr(store.index, "_idx", CountingIndex(store.index._idx))
    _CountingPrompt.encodings = 0
    rep = ds4.recover(s, store, _CountingPrompt(B), evict_save=False)
    assert rep.rung == ("disk" if on_disk else "prefill")
    assert calls == {"candidates": 1, "index_lookups": 1}
    assert _CountingPrompt.encodings == 1
    assert s.tokens == toks(eng, B)


def _sess_at(eng, text):
    s = ds4.Session(eng, ctx=256)
    s.sync(toks(eng, text))
    return s


# -- the divergence: where the prompt left its best candidate --------------------

SYS = "<|im_start|>system\nrules <a> cch=abc12; keep going<|im_end|>\n"
Q1 = "<|im_start|>user\nhi there, this is the first question<|im_end|>\n"
AS = "<|im_start|>assistant\nan answer of some length<|im_end|>\n"
Q2 = "<|im_start|>user\nand a second question<|im_end|>\n"
NONCE_AT = len("<|im_start|>system\nrules <a> cch=")  # one marker before it: 11 tokens fewer


def _ntok(text):
    """The reference engine's tokens of a rendering: one a byte, one a marker."""
    return len(text.encode()) - 11 * text.count("<|im_start|>") - 9 * text.count("<|im_end|>")


def _cut(text, n=32):
    """At most ``n`` bytes of ``text``, no character split."""
    return text.encode()[:n].decode("utf-8", "ignore")


def _fresh(eng, namespace=None, ctx=512):
    s = ds4.Session(eng, ctx=ctx)
    s.set_namespace(namespace)
    return s


def _at_ns(eng, text, namespace=None, ctx=512):
    s = _fresh(eng, namespace, ctx)
    s.sync(toks(eng, text))
    return s


def test_divergence_none_without_a_candidate(eng, tmp_path):
    """No live state and no checkpoint the lookup considered: None (a
    checkpoint longer than the prompt is not considered)."""
    assert ds4.recover(ds4.Session(eng, ctx=512), None, SYS + Q1).divergence is None
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    assert ds4.recover(ds4.Session(eng, ctx=512), store, SYS + Q1).divergence is None
    store.store_live_prefix(_at_ns(eng, SYS + Q1 + AS), "continued")
    assert ds4.recover(ds4.Session(eng, ctx=512), store, SYS + Q1).divergence is None


def test_divergence_of_a_live_hit_is_the_whole_live_state(eng):
    """The live rung used the live state whole: ``cached`` is empty and
    ``token``/``byte`` are its end (the prompt's typed ``<`` is an escape
    in the key text, not in the snippet)."""
    s = _at_ns(eng, "<|im_start|>user\nabc")  # 9 tokens, 20 bytes
    rep = ds4.recover(s, None, "<|im_start|>user\nabc<defg")
    assert rep.rung == "live"
    assert rep.divergence == {"against": "live", "token": 9, "byte": 20, "cached": "", "prompt": "<defg"}


def test_divergence_against_live_where_a_prompt_ends_early(eng):
    """A prompt that stops inside the live state (a retried turn): it left
    the live state where it ends; the live text goes on."""
    s = _at_ns(eng, SYS + Q1 + AS)
    rep = ds4.recover(s, None, SYS + Q1)
    n = len(SYS + Q1)
    assert rep.divergence == {"against": "live", "token": _ntok(SYS + Q1), "byte": n, "cached": AS[:32], "prompt": ""}


def test_divergence_against_a_checkpoint_at_a_nonce(eng, tmp_path, caplog):
    """After a restart (no live state) the prompt differs from the stored
    conversation at one nonce of its system text: nothing is a prefix, the
    lookup's longest considered checkpoint is the one it left, at the
    nonce's byte (counted in the rendered text, escapes undone) and token,
    both texts shown from there; the log says the same at info level."""
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    old = SYS + Q1 + AS
    store.store_live_prefix(_at_ns(eng, old), "shutdown")
    store.store_live_prefix(_at_ns(eng, SYS[:19] + "RULES"), "continued")  # shorter, parts earlier: not the best
    new = SYS.replace("abc12", "def34") + Q1 + AS + Q2
    with caplog.at_level(logging.INFO, logger="ds4.recovery"):
        rep = ds4.recover(ds4.Session(eng, ctx=512), store, new)
    assert rep.rung == "prefill"
    want = {
        "against": "checkpoint",
        "token": NONCE_AT - 11,
        "byte": NONCE_AT,
        "cached": old[NONCE_AT : NONCE_AT + 32],
        "prompt": new[NONCE_AT : NONCE_AT + 32],
    }
    assert rep.divergence == want
    line = (
        f"kv cache miss at byte {NONCE_AT} (token {NONCE_AT - 11}) against checkpoint: "
        f"{json.dumps(want['cached'])} vs {json.dumps(want['prompt'])}"
    )
    assert line in [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_divergence_prefers_the_checkpoint_the_prompt_follows_longest(eng, tmp_path):
    """A loaded prefix (the disk rung) against a longer checkpoint that the
    prompt leaves later: the later parting is the one shown; when the other
    checkpoint parts before the loaded one ends, the loaded one is shown,
    held whole."""
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    head = store.store_live_prefix(_at_ns(eng, SYS), "cold")
    q = Q1.replace("first", "final")  # parts inside the user turn
    store.store_live_prefix(_at_ns(eng, SYS + Q1 + AS), "continued")
    prompt = SYS + q + AS + Q2
    rep = ds4.recover(ds4.Session(eng, ctx=512), store, prompt)
    at = len(SYS + "<|im_start|>user\nhi there, this is the fi")
    assert (rep.rung, rep.loaded_path) == ("disk", head)
    assert rep.divergence == {
        "against": "checkpoint",
        "token": _ntok(prompt[:at]),
        "byte": at,
        "cached": (Q1 + AS)[at - len(SYS) :][:32],
        "prompt": (q + AS)[at - len(SYS) :][:32],
    }
    # the other checkpoint parts in the system text: the loaded one wins, whole
    store2 = ds4.KVStore(str(tmp_path / "two"), min_tokens=1)
    head = store2.store_live_prefix(_at_ns(eng, SYS), "cold")
    store2.store_live_prefix(_at_ns(eng, SYS.replace("rules", "RULES") + Q1 + AS), "continued")
    rep = ds4.recover(ds4.Session(eng, ctx=512), store2, prompt)
    assert (rep.rung, rep.loaded_path) == ("disk", head)
    n = len(toks(eng, SYS))
    assert rep.divergence == {"against": "checkpoint", "token": n, "byte": len(SYS), "cached": "", "prompt": q[:32]}


def test_divergence_never_shows_another_namespace(eng, tmp_path):
    """A tenant's (or salt's) checkpoint that would be the best candidate
    is never one for another namespace, nor for the default one: no
    candidate (None), or the namespace's own checkpoint."""
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    secret = SYS + "<|im_start|>user\nalice-secret-1234 and then some<|im_end|>\n"
    store.store_live_prefix(_at_ns(eng, secret, "alice"), "continued")
    prompt = SYS + "<|im_start|>user\nalice-secret-9999 and then some more<|im_end|>\n"
    for ns in (None, "bob", "alice/salt-0123456789abcdef"):
        assert ds4.recover(_fresh(eng, ns), store, prompt).divergence is None, ns
    own = SYS[:40].replace("rules", "Rules")  # bob's own, parting at byte 19
    store.store_live_prefix(_at_ns(eng, own, "bob"), "continued")
    d = ds4.recover(_fresh(eng, "bob"), store, prompt).divergence
    assert d == {"against": "checkpoint", "token": 8, "byte": 19, "cached": own[19:], "prompt": _cut(prompt[19:])}
    # alice's own prompt is shown her own text
    d = ds4.recover(_fresh(eng, "alice"), store, prompt).divergence
    assert d is not None and d["cached"].startswith("1234 and") and d["prompt"].startswith("9999 and")


def test_divergence_reads_the_text_not_the_payload(eng, tmp_path):
    """The considered checkpoint's header and text are read, not its
    payload: a payload that would fail a load still shows where the prompt
    left the text, and the file stays (no load was tried)."""
    store = ds4.KVStore(str(tmp_path), min_tokens=1)
    old = SYS + Q1
    path = store.store_live_prefix(_at_ns(eng, old), "continued")
    off = open_checkpoint(path, load_payload=False).payload_offset
    with open(path, "r+b") as f:
        f.seek(off + 64)
        b = f.read(1)
        f.seek(off + 64)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ds4.errors.CheckpointError):
        open_checkpoint(path)
    new = SYS.replace("abc12", "def34") + Q1 + AS
    d = ds4.recover(ds4.Session(eng, ctx=512), store, new).divergence
    assert d is not None and (d["against"], d["byte"]) == ("checkpoint", NONCE_AT)
    assert os.path.exists(path)


def test_divergence_backs_up_to_a_character_and_off_an_escape(eng):
    """A parting inside a UTF-8 character is shown from the character's
    start; a typed ``<`` against a real marker (the same bytes, another key
    text) is shown at the ``<``."""
    s = _at_ns(eng, "<|im_start|>user\ncafé au lait, s'il vous plaît")
    d = ds4.recover(s, None, "<|im_start|>user\ncafè noir").divergence
    at = len(b"<|im_start|>user\ncaf")
    cached = _cut("é au lait, s'il vous plaît")
    assert d == {"against": "live", "token": at - 11, "byte": at, "cached": cached, "prompt": "è noir"}
    s = _at_ns(eng, "<|im_start|>user\nx <|im_end|> y")
    typed = ds4.keytext.Prompt([("<|im_start|>", True), ("user\nx <|im_end|> z", False)])
    d = ds4.recover(s, None, typed).divergence
    assert d == {"against": "live", "token": 8, "byte": 19, "cached": "<|im_end|> y", "prompt": "<|im_end|> z"}
    # a 32-byte cut never splits a character
    s = _at_ns(eng, "ab" + "é" * 20)
    d = ds4.recover(s, None, "ac" + "é" * 20).divergence
    assert d is not None and d["cached"] == "b" + "é" * 15 and d["prompt"] == "c" + "é" * 15
