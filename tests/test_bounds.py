"""The per-server structures a client's requests fill are bounded: the
queue (``--max-queue``: QueueFull, a 429, past it), the stored responses
of a server without a cache directory (the last 1,000), and the turns the
metrics keep (2,048 rows). The routing hints' bounds are
tests/test_hints.py's, the bodies' tests/test_server_security.py's, a
compressed checkpoint's tests/test_v3_bounds.py's (docs/RELIABILITY.md,
"Bounds")."""

from __future__ import annotations

import threading

import pytest

from ds4.recovery import RecoveryReport
from ds4.server.metrics import Turns
from ds4.server.response_store import MAX_MEMORY_RECORDS, MemoryRecords
from ds4.server.work import TextPrompt
from ds4.server.worker import Job, QueueFull, Service
from ds4.turn import GenParams, GenResult, TurnDriver


def test_the_queue_refuses_past_max_queue(eng):
    service = Service(TurnDriver(eng, 128), "m", max_queue=2)
    done = threading.Event()
    events: list[str] = []

    def post(kind, value):
        events.append(kind)
        if kind in ("done", "error"):
            done.set()

    def job() -> Job:
        return Job(TextPrompt("hello"), GenParams(max_tokens=1), post)

    try:
        with service.baton:  # the lane takes the first job and waits for the baton
            service.submit(job())
            for _ in range(200):
                if service.queued == 0:
                    break
                threading.Event().wait(0.01)
            assert service.queued == 0
            service.submit(job())
            service.submit(job())
            with pytest.raises(QueueFull):
                service.submit(job())
        assert done.wait(30)
    finally:
        service.close()
    assert events.count("done") == 3


def test_memory_records_keep_the_last_ones_only():
    assert MAX_MEMORY_RECORDS == 1000
    rs = MemoryRecords(limit=3)
    for i in range(10):
        rs.put("response", f"r{i}", {"i": i})
    assert [rs.get("response", f"r{i}") for i in range(10)] == [None] * 7 + [{"i": 7}, {"i": 8}, {"i": 9}]


def test_the_metrics_keep_a_bounded_ring_of_turns():
    t = Turns(maxlen=5)
    res = GenResult("", [], "stop", RecoveryReport(), 1, 0, 0, 0.0, 0.0, 0.0)
    for _ in range(12):
        t.add("chat", "alice", res)
    assert len(t.since(0.0)) == 5
