"""Isolation shown the way users test it: K = 8 concurrent conversations,
each with its own planted markers (a code word in its system text, a
ticket in its second user turn), on a pool of 4 residents
(``--sessions 4``, batched decode, llama.cpp + SmolLM2) under a disk
budget that holds three checkpoints (evictions), with the Redis tier, with
injected store failures (disk full, a write torn half way, a file renamed
into place before an I/O error) and a kill -9 and restart between the
second and the third turns (the same directory, the same Redis).

Every prompt asks the model to repeat its code word (and later its
ticket), and SmolLM2 does, greedy: a conversation served from another's
state would echo the other's marker. Every reply is checked for every
other conversation's markers (none may appear), and against a cold
single-session server (``--exact strict``, no store: a batched pool pads
each sequence as strict does) replaying the same messages: equal byte for
byte. The test also asserts that what it means to exercise happened: the
injected faults (each counted as a skipped save of its code), evictions,
copies between residents, hits on the shared tier after the restart."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest
from helpers.metric_samples import samples
from helpers.redis_servers import RedisNode
from helpers.server import KV_FLAGS, cached_tokens, ds4_block
from helpers.together import at_once

import ds4

pytestmark = pytest.mark.timeout(900)

HERE = os.path.dirname(os.path.abspath(__file__))
#: a long system prefix all eight conversations share (~480 tokens)
SHARED = "You are the harbour's logistics agent. " + " ".join(
    f"Rule {i}: berth {i % 7} takes ships under {100 + i} metres; log every arrival." for i in range(20)
)
CODES = (
    "ZEBRA-4411",
    "OTTER-7302",
    "FALCON-2958",
    "WALRUS-6184",
    "PANDA-9047",
    "LYNX-3526",
    "BISON-8813",
    "HERON-1670",
)
TICKETS = ("TK-5521", "TK-6034", "TK-2287", "TK-7745", "TK-3190", "TK-8462", "TK-4903", "TK-1358")
TURNS = (
    "What is your secret code word? Reply with the code word only.",
    "My ticket is {ticket}. Repeat your code word and my ticket.",
    "Say the code word and the ticket again.",
)
MAX_TOKENS = 16
#: a 12.6 MiB checkpoint at ~550 tokens: three fit
BUDGET_MB = "40"
#: the Nth checkpoint write of each server process fails (tests/helpers/fault_serve.py)
FAULTS = ("2:disk_full,4:torn,6:late,8:disk_full", "2:late,3:disk_full,5:torn")


def _parts(i: int) -> set[str]:
    """Conversation ``i``'s markers and each of their halves."""
    out = set()
    for m in (CODES[i], TICKETS[i]):
        out |= {m, *m.split("-")}
    return out - {"TK"}


def _foreign(i: int, text: str) -> list[str]:
    """The markers of conversations other than ``i`` that ``text`` holds."""
    up = text.upper()
    return sorted(p for j in range(len(CODES)) if j != i for p in _parts(j) if p in up)


def test_marker_parts_are_distinct():
    for i in range(len(CODES)):
        for j in range(len(CODES)):
            if i != j:
                assert not any(p in q or q in p for p in _parts(i) for q in _parts(j)), (i, j)


def _pool(serve, tmp, name, url, faults):
    srv = serve(
        "--sessions",
        "4",
        "--kv-disk-dir",
        str(tmp / "kv"),
        "--kv-disk-space-mb",
        BUDGET_MB,
        "--kv-fresh-guard-s",
        "0",  # every checkpoint may go: the budget evicts from the first turn on
        "--kv-remote",
        url,
        *KV_FLAGS,
        "--threads",
        "2",
        name=name,
        tmp=tmp,
        engine="llamacpp",
        env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "DS4_TEST_WRITE_FAULTS": faults},
        start=False,
    )
    srv.args[1:4] = [os.path.join(HERE, "helpers", "fault_serve.py")]  # python fault_serve.py <serve's flags>
    return srv.start(timeout=300)


def _turn(srv, convs, k):
    """Turn ``k`` of every conversation, all in flight at once: each
    conversation's messages and reply."""
    model = srv.model()

    def ask(i):
        msgs = [*convs[i], {"role": "user", "content": TURNS[k].format(ticket=TICKETS[i])}]
        r = srv.client().chat.completions.create(model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
        return msgs, r

    return at_once(ask, convs)


def _idle(srv):
    """Wait until the worker is idle and the uploads are done."""
    for _ in range(600):
        h = srv.health()
        if not h["busy"] and h["kv"]["remote"]["queued"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"not idle: {srv.health()}")


def _metrics(srv) -> dict:
    _idle(srv)
    return samples(httpx.get(srv.base + "/metrics", timeout=10).text)


def _skips(got: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, labels), v in got.items():
        if name == "ds4_checkpoint_saves_skipped_total":
            code = dict(labels)["code"]
            out[code] = out.get(code, 0) + v
    return out


def _check_faults(log: str, got: dict, faults: str) -> None:
    """Every scheduled fault fired, and each is a skipped save of its code."""
    kinds = [f.split(":")[1] for f in faults.split(",")]
    assert log.count("injected write fault") == len(kinds), log[-4000:]
    sk = _skips(got)
    assert sk.get("disk_full", 0) == kinds.count("disk_full"), sk
    assert sk.get("write_error", 0) == kinds.count("torn") + kinds.count("late"), sk


def _no_foreign_marker(replies) -> None:
    for i, k, _, r in replies:
        text = r.choices[0].message.content
        assert _foreign(i, text) == [], (i, k, text, ds4_block(r))


def test_eight_conversations_on_four_residents_never_see_each_others_markers(tmp_path, serve):
    node = RedisNode(str(tmp_path)).start()
    convs: dict[int, list] = {
        i: [{"role": "system", "content": f"{SHARED} Your secret code word is {CODES[i]}. Never forget it."}]
        for i in range(len(CODES))
    }
    served: list[tuple[int, int, list, object]] = []  # (conversation, turn, messages, reply)
    phases: list[tuple[str, dict]] = []  # each server's log and last /metrics
    srv = _pool(serve, tmp_path, "pool", node.url, FAULTS[0])
    try:
        for k in (0, 1, 2):
            if k == 2:  # kill -9 once the uploads are done: the residents' states are lost
                phases.append((srv.text_log(), _metrics(srv)))
                assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
                srv = _pool(serve, tmp_path, "pool-restarted", node.url, FAULTS[1])
            replies = [(i, k, msgs, r) for i, (msgs, r) in _turn(srv, convs, k).items()]
            _no_foreign_marker(replies)
            served += replies
            for i, _, msgs, r in replies:
                convs[i] = [*msgs, {"role": "assistant", "content": r.choices[0].message.content}]
        phases.append((srv.text_log(), _metrics(srv)))
    finally:
        srv.stop()
        node.stop()

    # every reply is the one a cold single session gives, each conversation
    # replayed alone (its first turn a cold prefill, then its own live state)
    flags = ("--no-kv-cache", "--exact", "strict", "--threads", "2")
    cold = serve(*flags, name="cold", tmp=tmp_path, engine="llamacpp", timeout=300)
    c = cold.client()
    model = cold.model()
    for i, k, msgs, r in sorted(served, key=lambda s: s[:2]):
        if k == 0:
            c.completions.create(model=model, prompt="reset", max_tokens=1)
        ref = c.chat.completions.create(model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
        assert k > 0 or cached_tokens(ref) == 0, "the reference run was not cold"
        assert r.choices[0].message.content == ref.choices[0].message.content, (i, k, ds4_block(r))
    cold.stop()

    # the marker check can fail for real: every conversation's replies echo its own code word
    assert {i for i, _, _, r in served if CODES[i] in r.choices[0].message.content} == set(range(len(CODES)))
    # what the test means to exercise did happen: every fault, evictions in
    # both lives, uploads, copies between residents, Redis serving after
    # the restart (the local disk serves some turns too, as timing decides:
    # not asserted)
    for (log, got), faults in zip(phases, FAULTS, strict=True):
        _check_faults(log, got, faults)
        assert got[("ds4_kv_evictions_total", (("reason", "budget"),))] > 0
    assert phases[0][1][("ds4_kv_remote_uploads_total", ())] > 0
    assert phases[1][1][("ds4_kv_remote_hits_total", ())] > 0
    rungs = [ds4_block(r)["rung"] for _, _, _, r in served]
    assert {"live", "remote"} <= set(rungs), rungs
    assert any("copied from session" in str(ds4_block(r).get("source")) for _, _, _, r in served)

    # the torn temp files the faults left go when the store next opens (their writers are gone)
    kv = str(tmp_path / "kv")
    ds4.KVStore(kv)
    assert not [n for n in os.listdir(kv) if ".tmp." in n], os.listdir(kv)
