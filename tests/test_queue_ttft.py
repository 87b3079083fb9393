"""TTFT counts from the request's arrival (issue 35, item 3): a request
that waits behind another turn on ``--sessions 1`` reports the wait as
``queue_ms`` in its ``ds4`` block, its ``ttft_ms`` includes it, and
``/metrics`` has it in ``ds4_queue_seconds`` beside a ``ds4_ttft_seconds``
that includes it too; ``/ui``'s recent turns carry it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers.metric_samples import samples
from helpers.server import ds4_block


def test_a_request_that_waited_counts_its_wait_in_ttft(tmp_path, serve):
    srv = serve("--sessions", "1", "--no-kv-cache", name="q", tmp=tmp_path)
    c, model = srv.client(), srv.model()  # closed below
    first_started = threading.Event()
    done: dict[str, float] = {}

    def long_turn() -> None:
        stream = c.completions.create(
            model=model, prompt="Once upon a time " * 20, max_tokens=400, stream=True, temperature=0
        )
        for _ in stream:
            first_started.set()
        done["a"] = time.perf_counter()

    a = threading.Thread(target=long_turn)
    a.start()
    assert first_started.wait(60)
    sent = time.perf_counter()
    r = c.completions.create(model=model, prompt="A short one.", max_tokens=4, temperature=0)
    a.join(60)
    info = ds4_block(r)
    waited_ms = (done["a"] - sent) * 1000  # the first turn ran on while this one waited
    # the second turn could not begin before the first ended (one
    # resident): its queue covers that, less the two requests' transit
    assert waited_ms > 50, "the first turn ended too soon to show a wait"
    assert info["queue_ms"] >= waited_ms - 50, (info, waited_ms)
    assert info["ttft_ms"] >= info["queue_ms"] > 0
    assert info["total_ms"] >= info["ttft_ms"]
    m = samples(httpx.get(srv.base + "/metrics", timeout=10).text)
    labels = (("protocol", "completions"), ("rung", "prefill"))
    assert m[("ds4_queue_seconds_count", labels)] == 2
    assert m[("ds4_queue_seconds_sum", labels)] >= info["queue_ms"] / 1000
    assert m[("ds4_ttft_seconds_sum", labels)] >= m[("ds4_queue_seconds_sum", labels)]
    recent = httpx.get(srv.base + "/ui/data", timeout=10).json()["recent"]
    assert max(t["queue_ms"] for t in recent) == info["queue_ms"]
    c.close()


def test_every_resident_has_its_own_gauges(tmp_path, serve):
    """``ds4_session_tokens`` and its siblings, one series per resident
    (``session`` label, no tenant): the one that served holds the turn."""
    srv = serve("--sessions", "2", "--no-kv-cache", name="g", tmp=tmp_path)
    with srv.client() as c:
        r = c.completions.create(model=srv.model(), prompt="Gauges " * 10, max_tokens=3, temperature=0)
    m = samples(httpx.get(srv.base + "/metrics", timeout=10).text)
    tokens = {k: m[("ds4_session_tokens", (("session", k),))] for k in ("0", "1")}
    want = r.usage.prompt_tokens + r.usage.completion_tokens
    assert sorted(tokens.values()) == [0, pytest.approx(want, abs=1)], tokens
    held = [k for k, v in tokens.items() if v]
    assert m[("ds4_session_valid", (("session", held[0]),))] == 1
    assert all(m[("ds4_session_busy", (("session", k),))] == 0 for k in ("0", "1"))
    assert not any(name.startswith("ds4_session") and "tenant" in dict(lb) for name, lb in m)
