"""The cache diagnostics' table on its own (``ds4.server.cache_diagnostics``):
its bound, and each answer from the recorded request."""

from __future__ import annotations

from ds4.server.cache_diagnostics import CacheDiagnostics, Diagnosis


def _d(prev, tools=b"t", system=b"s", other=b"o", chain=(b"1", b"2"), tenant="alice"):
    return Diagnosis(tenant, prev, tools, system, other, tuple(chain))


def test_the_table_keeps_its_bound_and_forgets_the_oldest():
    table = CacheDiagnostics(max_records=100)
    for k in range(250):
        table.record(_d(None), f"msg_{k}", 1000)
        assert len(table) <= 100
    assert table.reason(_d("msg_149"))[0] == "previous_message_not_found"  # forgotten
    assert table.reason(_d("msg_150")) == (None, 1000)  # kept


def test_each_answer():
    table = CacheDiagnostics()
    table.record(_d(None), "msg_a", 800)
    assert table.answer(_d(None), 10) is None  # the first turn
    assert table.answer(_d("msg_a", chain=(b"1", b"2", b"3")), 700) is None  # appended only
    assert table.answer(_d("msg_a", chain=(b"1", b"x", b"3")), 300) == {
        "cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 500}
    }
    assert table.answer(_d("msg_a", chain=(b"1",)), 900)["cache_miss_reason"]["cache_missed_input_tokens"] == 0
    assert table.answer(_d("msg_a", tools=b"T"), 0)["cache_miss_reason"]["type"] == "tools_changed"
    assert table.answer(_d("msg_a", system=b"S"), 0)["cache_miss_reason"]["type"] == "system_changed"
    assert table.answer(_d("msg_a", other=b"O"), 0) == {"cache_miss_reason": {"type": "unavailable"}}
    assert table.answer(_d("msg_a", tenant="bob"), 0) == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    # the turn's cached tokens not known yet (a stream's first event): pending
    assert table.answer(_d("msg_a", system=b"S"), None) == {"cache_miss_reason": None}
