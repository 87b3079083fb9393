"""The pieces under the agent protocols: the records beside the checkpoints
(stored Responses: bounded, counted in the store's budget, named safely), the
turn driver's stop_after and top_k, and the live tool state's match."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

import ds4
import ds4.turn
from ds4.kvstore import KVStore
from ds4.kvstore.records import RecordStore
from ds4.server.conversation import AgentTurn, Conversation, LiveStateGone, LiveTools, Message, Tool
from ds4.turn import GenParams, TextStream, TurnDriver, make_picker


def test_records_round_trip_survive_a_new_store_and_stay_bounded(tmp_path):
    st = KVStore(tmp_path / "kv", budget_mb=8)
    assert st.records.max_bytes == 8 * 2**20 // 100
    assert st.records.get("response", "resp_1") is None
    assert st.records.put("response", "resp_1", {"messages": [{"role": "user", "content": "héllo"}]})
    again = KVStore(tmp_path / "kv", budget_mb=8)  # a restart
    assert again.records.get("response", "resp_1") == {"messages": [{"role": "user", "content": "héllo"}]}
    path = tmp_path / "kv" / "records" / "response-resp_1.json"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    # bounded: the oldest go first, the newest always stays
    small = RecordStore(str(tmp_path / "small"), max_bytes=300)
    for i in range(10):
        assert small.put("response", f"r{i}", {"x": "y" * 100})
    kept = sorted(os.listdir(tmp_path / "small" / "records"))
    assert small.total_bytes() <= 300 and "response-r9.json" in kept and "response-r0.json" not in kept
    assert not small.put("response", "huge", {"x": "y" * 400})  # alone over the bound: not written
    with pytest.raises(ValueError):
        small.put("response", "../escape", {})
    with pytest.raises(ValueError):
        small.get("response", "a/b")
    # unreadable: reported missing, and removed
    (tmp_path / "small" / "records" / "response-r9.json").write_bytes(b"{not json")
    assert small.get("response", "r9") is None and not (tmp_path / "small" / "records" / "response-r9.json").exists()


def test_records_count_in_the_checkpoint_budget(tmp_path, save_session):
    eng = ds4.ReferenceEngine()
    st = KVStore(tmp_path / "kv", budget_mb=1, min_tokens=1)
    st.records.max_bytes = 900_000  # (a test bound: larger than the store's default 1 %)
    sess = ds4.Session(eng, ctx=4096)
    sess.sync(eng.tokenize("x" * 600))
    assert st.store_live_prefix(sess, "cold") is not None
    assert len(st.entries()) == 1
    # records that leave no room: the checkpoint is evicted, the records stay
    st.records.put("response", "big", {"x": "y" * 800_000})
    st.evict()
    assert st.entries() == [] and st.records.get("response", "big") is not None


def test_stop_after_keeps_the_marker_and_reports_no_stop_sequence():
    ts = TextStream(("STOP",), None, ("</tool_call>",))
    assert [ts.push(p.encode()) for p in ["a <tool", "_call>[]", "</tool_", "call>tail"]] == [False] * 3 + [True]
    assert ts.close() == "a <tool_call>[]</tool_call>" and ts.matched is None
    ts = TextStream(("STOP",), None, ("</tool_call>",))
    assert not ts.push(b"hi S") and ts.push(b"TOP</tool_call>")
    assert ts.close() == "hi " and ts.matched == "STOP"  # the earlier cut wins


def test_top_k_samples_only_among_the_k_best():
    logits = np.array([5.0, 4.0, 3.0, -1.0, -2.0], np.float32)
    pick = make_picker(GenParams(temperature=5.0, top_k=2, seed=1))
    assert {pick(logits) for _ in range(200)} == {0, 1}


def test_tool_results_for_the_live_calls_continue_live_and_a_gone_state_is_409():
    eng = ds4.ReferenceEngine()
    gen = TurnDriver(eng, 2048)
    live = LiveTools()
    conv = Conversation([Message("user", "hi"), Message("tool", "42", tool_call_id="call_a")], [Tool("f")])
    t = AgentTurn(conv, live, gen, live_only=True)
    with pytest.raises(LiveStateGone):
        t.render(eng)  # no live calls at all
    # a live state holding a turn that ended in the call call_a
    msgs = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "<tool_call>[]</tool_call>"}]
    text = eng.render_chat(msgs, add_generation_prompt=False)
    gen.sess.sync(eng.tokenize(text, special=True))
    live.remember(frozenset({"call_a"}), msgs, gen.sess.key_bytes())
    prompt = AgentTurn(conv, live, gen, live_only=True).render(eng)
    assert prompt.startswith(text) and prompt.endswith("<|im_start|>assistant\n") and "42" in prompt
    # another id: not this live state
    other = Conversation([Message("tool", "1", tool_call_id="call_b")], [Tool("f")])
    with pytest.raises(LiveStateGone):
        AgentTurn(other, live, gen, live_only=True).render(eng)
    # the live state moved since: no match, the history is rendered in full
    gen.sess.invalidate()
    assert AgentTurn(conv, live, gen).render(eng) == eng.render_chat(conv.engine_messages())


def test_canonicalize_outcomes(tmp_path):
    eng = ds4.ReferenceEngine()
    base = (
        "<|im_start|>system\n" + "rules " * 60 + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    canon = base + '<tool_call>[{"name": "f", "arguments": {}}]</tool_call><|im_end|>\n'
    store = KVStore(tmp_path / "kv", min_tokens=64, boundary_align_tokens=64)
    gen = TurnDriver(eng, 2048, store)

    def live(text):
        gen.sess.invalidate()
        gen.sess.sync(eng.tokenize(text, special=True))

    live(canon)
    assert gen.canonicalize(canon) == "unchanged"
    live(canon[: len(canon) - 12])  # the generated call, short of its end: extended
    assert gen.canonicalize(canon) == "rewritten" and gen.holds(canon)
    live(base + '<tool_call>[{"name":"f","arguments":{}}]</tool_call>')  # not canonical: no rewind here
    assert gen.canonicalize(canon) == "full" and gen.holds(canon)
    assert store.store_live_prefix(gen.sess, "cold")  # now the disk holds the canonical turn
    live(base + "something else entirely")
    assert gen.canonicalize(canon) == "disk" and gen.holds(canon)
    live(base)
    assert gen.canonicalize(base + "x" * 4096) == "failed"  # does not fit: refused, the live state kept
    assert gen.sess.checkpoint_valid and gen.sess.text_bytes() == base.encode()


def _tool_turn(eng, gen):
    """An agent turn whose reply was a call in compact (non-canonical)
    spacing, the live state at the prompt plus that reply."""
    conv = Conversation([Message("user", "hi " + "context " * 40)], [Tool("f")])
    live = LiveTools()
    turn = AgentTurn(conv, live, gen)
    prompt = turn.render(eng)
    reply = '<tool_call>[{"name":"f","arguments":{}}]</tool_call>'
    gen.sess.sync(eng.tokenize(prompt + reply, special=True))
    res = types.SimpleNamespace(text=reply, finish_reason="stop")
    return turn, live, res


def test_a_tool_turn_tokenizes_its_canonical_text_once(monkeypatch):
    eng = ds4.ReferenceEngine()
    gen = TurnDriver(eng, 2048)
    turn, live, res = _tool_turn(eng, gen)
    seen = []
    real = ds4.turn.tokenize_prompt

    def counting(engine, text):
        seen.append(str(text))
        return real(engine, text)

    monkeypatch.setattr(ds4.turn, "tokenize_prompt", counting)
    turn.done(res)
    (call,) = turn.outcome.calls
    assert len(seen) == 1 and seen[0].endswith('<tool_call>[{"name": "f", "arguments": {}}]</tool_call><|im_end|>\n')
    # the live tool state is the canonical turn's
    monkeypatch.setattr(ds4.turn, "tokenize_prompt", real)
    assert live.ids == {call.id} and live.key == gen.sess.key_bytes() and gen.holds(seen[0])


def test_a_rebuild_that_misses_the_canonical_turn_is_failed_and_not_remembered(monkeypatch):
    eng = ds4.ReferenceEngine()
    gen = TurnDriver(eng, 2048)
    turn, live, res = _tool_turn(eng, gen)
    # a ladder that claims a prefill and leaves the live state where it was
    monkeypatch.setattr(
        ds4.turn, "recover", lambda sess, *a, **k: types.SimpleNamespace(rung="prefill", reused_tokens=0)
    )
    assert gen.canonicalize(gen.engine.render_chat([{"role": "user", "content": "x"}])) == "failed"
    turn.done(res)
    assert turn.outcome.calls and not live.ids and live.key == b""
