"""Prefills go shortest first (issue 35, item 2; :mod:`ds4.server.baton`):
at a handover decode steps go first, then of the prefilling lanes only the
one nearest to its first token; a prefill passed over too often goes
anyway. Four cold prompts sent together to a pool of four
then get their first tokens one after another, not all at the end."""

from __future__ import annotations

import re
import statistics
import threading

import pytest
from helpers.server import KV_FLAGS, ds4_block
from helpers.together import at_once

from ds4.server.baton import MAX_SKIPS, Baton


def _queue(b: Baton, name: str, left: int | None, order: list[str], arrival: float = 0.0) -> threading.Thread:
    """A lane that marks itself (prefilling ``left`` tokens, its job
    arrived at ``arrival``; or not) and queues for the baton behind the ones
    already waiting; when it gets it, it notes its name and lets go."""
    n = b.waiting

    def lane() -> None:
        b.mark(left, arrival=arrival)
        with b:
            order.append(name)

    t = threading.Thread(target=lane)
    t.start()
    while b.waiting < n + 1:
        threading.Event().wait(0.001)
    return t


def _join(ts: list[threading.Thread]) -> None:
    for t in ts:
        t.join()


def test_decode_steps_go_first_then_the_prefill_nearest_its_first_token():
    b = Baton()
    order: list[str] = []
    b.acquire()
    b.mark(100)  # the holder is prefilling, 100 tokens to go
    ts = [_queue(b, "B", 50, order), _queue(b, "C", None, order), _queue(b, "D", 200, order)]
    b.pass_()  # C (decoding) goes, then B (50 left, fewer than the holder's); D (200) waits for the holder
    assert order == ["C", "B"], order
    b.release()
    _join(ts)
    assert order == ["C", "B", "D"]


def test_a_decoding_holder_keeps_the_baton_until_a_prefill_was_passed_over_max_skips_times():
    """A reply's tokens are not held behind another's prefill chunks, but a
    long generation lets a waiting prefill one chunk in every so many."""
    b = Baton()
    order: list[str] = []
    b.acquire()
    b.mark(None)  # decoding
    t = _queue(b, "prefill", 100, order)
    for _ in range(MAX_SKIPS):
        b.pass_()
    assert order == [] and b.handovers == 0
    b.pass_()
    assert order == ["prefill"] and b.handovers == 1
    b.release()
    t.join()


def test_a_prefill_on_its_last_piece_goes_like_a_decode_step():
    """It costs the decoders one short piece and then decodes beside them
    (in their batch, where steps are batched); a longer one waits."""
    b = Baton(join=32)
    order: list[str] = []
    b.acquire()
    b.mark(None)  # decoding
    ts = [_queue(b, "long", 33, order), _queue(b, "last piece", 32, order)]
    b.pass_()
    assert order == ["last piece"], order
    b.release()
    _join(ts)
    assert order == ["last piece", "long"]


def test_a_prefill_passed_over_for_an_earlier_one_waits_for_it_but_a_later_one_lets_it_through():
    b = Baton()
    order: list[str] = []
    b.acquire()
    b.mark(10, arrival=0.0)  # nearest its first token, and first to arrive
    t = _queue(b, "long", 1000, order, arrival=1.0)
    for _ in range(3 * MAX_SKIPS):
        b.pass_()  # the earlier prefill ends first: no skips counted
    assert order == [] and b.handovers == 0
    b.mark(10, arrival=2.0)  # now a stream of shorter, later prompts
    passes = 0
    while "long" not in order:  # passed over at most MAX_SKIPS times: no starvation
        b.pass_()
        passes += 1
        assert passes <= MAX_SKIPS + 1, order
    assert passes == MAX_SKIPS + 1
    b.release()
    t.join()


def test_a_holder_nearest_its_first_token_keeps_the_baton_but_yields_to_a_decode():
    b = Baton()
    order: list[str] = []
    b.acquire()
    b.mark(10)
    t = _queue(b, "long", 1000, order)
    for _ in range(10):
        b.pass_()  # the waiting prefill is farther from its first token: kept
    assert order == [] and b.handovers == 0
    d = _queue(b, "decode", None, order)
    b.pass_()  # a decode step waits at most one chunk
    assert order == ["decode"]
    b.release()
    _join([t, d])
    assert order == ["decode", "long"]


@pytest.mark.parametrize("store", ["no-store", "store"])
def test_four_cold_prompts_together_get_their_first_tokens_one_after_another(tmp_path, serve, store):
    """Round robin gave all four their first token at about the time of
    the last; shortest first gives the first one in about a quarter of it
    and lowers the mean. The ratios are of one run's own TTFTs (from
    arrival: the ``ds4`` block's ``ttft_ms``). With a store, a full prefill
    stops at its cold save and goes on with the prompt's last tokens: that
    rest is what the lane has left, not the whole prompt again (marked so,
    every cold prompt waited behind the other three's prefills), and the
    reply's tokens are not held behind the next prefill's chunks."""
    flags = ("--no-kv-cache",) if store == "no-store" else ("--kv-disk-dir", str(tmp_path / "kv"), *KV_FLAGS)
    srv = serve("--sessions", "4", *flags, name="p4", tmp=tmp_path, ctx=8192)
    model = srv.model()
    words = ("amber", "basalt", "cobalt", "dune")

    def ask(w: str) -> dict:
        prompt = f"{w}: " + " ".join(f"{w}{i}" for i in range(600))
        msgs = [{"role": "user", "content": prompt}]
        with srv.client() as c:  # a chat: its template's last turn follows the cold save
            r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        return ds4_block(r)

    out = at_once(ask, words, 300)
    ttft = sorted(out[w]["ttft_ms"] for w in words)
    assert all(out[w]["rung"] == "prefill" for w in words), out
    assert ttft[0] <= 0.5 * ttft[-1], ttft  # the first did not wait for the slowest
    assert statistics.mean(ttft) <= 0.8 * ttft[-1], ttft
    # the server's own order: each prefill ends (its ladder line) and its
    # reply ends before the next prefill does, as one at a time
    events = re.findall(r"ds4 ladder rung|request done", srv.text_log())
    assert events == ["ds4 ladder rung", "request done"] * 4, events
