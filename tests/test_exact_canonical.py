"""``--exact canonical`` (issue 40): decode steps unpadded, as llama.cpp
decodes them, and the reply's positions prefilled again before its state is
extended, rewound, stored or copied. Every state that is reused is then
bit for bit a cold prefill's, so a resumed session replies as a cold one;
``off`` states have their own payload ABI and are never loaded by an exact
engine. On SmolLM2 (batch policy 2x1), Gemma 3 (8x4, a sliding window) and
the tiny models: LFM2 (hybrid, 2x1: its memory cannot drop the reply, so
the state at the reply's start is kept and restored), Qwen3 and Phi-3
(2x1), Mamba-2 and Granite 4 hybrid (serial: every token its own ubatch,
in a prefill too, so a one-token step is a prefill's and nothing is
redone)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.models import ALL, greedy_session, model_path, text_tokens

import ds4
from ds4.engines.llamacpp import LlamaCppEngine
from ds4.engines.llamacpp_owner import padded
from ds4.turn import GenParams, TurnDriver

pytestmark = pytest.mark.timeout(600)

GEN = 24


@pytest.fixture(scope="module", params=ALL)
def engines(request):
    """(canonical, strict) engines of one model."""
    path = model_path(request.param)
    return LlamaCppEngine(model_path=path, exact="canonical"), LlamaCppEngine(model_path=path, exact="strict")


def step_rows(eng) -> int:
    """The rows of a strict decode step: one token padded to the batch policy."""
    return eng.step_rows


def prefilled(eng, toks) -> ds4.Session:
    s = ds4.Session(eng, ctx=1024)
    s.sync(toks)
    return s


def same_state(a: ds4.Session, b: ds4.Session) -> bool:
    x, y = a.export_arrays(), b.export_arrays()
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("mode", ["canonical", "strict"])
def test_a_replys_state_is_made_a_prefills(engines, mode):
    """A 300-token prompt and a reply: the state exported after it is bit
    for bit a prefill's of the same tokens (strict: by its padded steps;
    canonical: by the export's canonicalization). The start-up probe once
    let Phi-3 and Mamba-2 decode unpadded where this failed."""
    eng = engines[0] if mode == "canonical" else engines[1]
    toks = text_tokens(eng, 300)
    s = prefilled(eng, toks)
    assert s.canonical
    greedy_session(s, GEN)
    # canonical: the reply's steps went unpadded, to redo unless one row is a prefill's batch
    assert s.canonical == (mode == "strict" or step_rows(eng) == 1)
    fresh = prefilled(eng, s.tokens)
    assert same_state(s, fresh)  # bit for bit
    assert s.canonical
    np.testing.assert_array_equal(s.logits, fresh.logits)


def test_canonical_steps_go_unpadded_and_strict_ones_padded(engines):
    can, strict = engines
    toks = text_tokens(can, 200)
    pads = {}
    for name, eng in (("canonical", can), ("strict", strict)):
        s = prefilled(eng, toks)
        ectx, decode, seen = s._ectx, s._ectx._decode, []

        def spy(t, pos0, pad=True, decode=decode, seen=seen, eng=eng):
            n = int(t.size)
            seen.append(max(eng.batch_floor, padded(n, eng.batch_multiple)) if pad else n)
            decode(t, pos0, pad)

        ectx._decode = spy
        greedy_session(s, 8)
        pads[name] = seen
    assert pads["canonical"] == [1] * 8  # llama.cpp's own one-token step
    assert pads["strict"] == [step_rows(strict)] * 8  # padded to the engine's batch policy


def test_a_resumed_session_replies_as_a_cold_one(engines):
    can, _ = engines
    p1 = text_tokens(can, 260)
    a = prefilled(can, p1)
    r1 = greedy_session(a, GEN)
    user = can.tokenize(" Then the otters swam to the far bank and waited.")
    p2 = p1 + r1 + user
    cold = prefilled(can, p2)
    want = greedy_session(cold, GEN)
    # live: the session that decoded r1 is extended (canonicalized first)
    a.sync(p2)
    assert greedy_session(a, GEN) == want
    # disk: a state stored after turn 1 (its export is canonical) loaded anew
    b = prefilled(can, p1)
    greedy_session(b, GEN)
    arrays, n = b.export_arrays(), b.n_past
    d = ds4.Session(can, ctx=1024)
    d.load_arrays(arrays, n)
    d.sync(p2)
    assert greedy_session(d, GEN) == want


@pytest.mark.parametrize("back", [3, GEN // 2, GEN + 5])
def test_a_rewind_into_or_before_the_reply_is_a_prefills(engines, back):
    """Before the reply only where the memory can rewind (a recurrent one
    goes back to the reply's start: its turn-boundary snapshot)."""
    can, _ = engines
    if back > GEN and not can.can_rewind:
        back = GEN
    p = text_tokens(can, 240)
    s = prefilled(can, p)
    greedy_session(s, GEN)
    keep = s.n_past - back
    assert s.rewind(keep)
    # a memory that cannot rewind goes back through the state kept at the
    # reply's start (LFM2), or, with nothing to redo, the turn's snapshot
    assert (s.last_snapshot is None) == (can.can_rewind or step_rows(can) > 1)
    fresh = prefilled(can, s.tokens)
    np.testing.assert_array_equal(s.logits, fresh.logits)
    assert same_state(s, fresh)


def test_strict_and_canonical_states_are_one_abi(engines):
    can, strict = engines
    assert can.payload_abi() == strict.payload_abi()
    p = text_tokens(can, 200)
    s = prefilled(can, p)
    greedy_session(s, GEN)
    arrays, n, toks = s.export_arrays(), s.n_past, s.tokens
    t = ds4.Session(strict, ctx=1024)
    t.load_arrays(arrays, n)
    assert same_state(t, prefilled(strict, toks))


def test_a_turn_that_comes_first_waits_for_the_canonicalization_and_says_so(engines, tmp_path):
    can, _ = engines
    gen = TurnDriver(can, 1024, ds4.KVStore(tmp_path, min_tokens=16))
    msgs = [{"role": "user", "content": "Tell me about the tides in the harbour. " * 12}]
    first = gen.generate(can.render_chat(msgs), GenParams(max_tokens=GEN))
    redo = step_rows(can) > 1  # else the unpadded steps were a prefill's already
    assert gen.sess.canonical != redo  # nothing has canonicalized it yet
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And at night?"}]
    second = gen.generate(can.render_chat(msgs), GenParams(max_tokens=GEN))
    assert ("canonicalize_ms" in second.report.timings) == redo
    assert second.report.timings.get("canonicalize_ms", 1) > 0
    assert second.report.rung in ("live", "rewrite")
    cold = TurnDriver(can, 1024).generate(can.render_chat(msgs), GenParams(max_tokens=GEN))
    assert cold.report.rung == "prefill" and "canonicalize_ms" not in cold.report.timings
    assert second.tokens == cold.tokens


def test_off_states_are_never_loaded_by_an_exact_engine(tmp_path):
    path = model_path("smollm2")
    off, exact = LlamaCppEngine(model_path=path, exact="off"), LlamaCppEngine(model_path=path, exact="canonical")
    assert off.payload_abi() != exact.payload_abi()
    prompt = off.render_chat([{"role": "user", "content": "The harbour master logs every ship. " * 20}])
    st = ds4.KVStore(tmp_path, min_tokens=16)
    s = ds4.Session(off, ctx=1024)
    ds4.recover(s, st, prompt)
    assert st.store_live_prefix(s, "continued")
    e = ds4.Session(exact, ctx=1024)
    rep = ds4.recover(e, st, prompt)
    assert rep.rung == "prefill"
    assert [code for _p, _s, code, _r in rep.rejected] == ["abi_mismatch"]


def test_the_mode_is_a_flag_and_checked():
    with pytest.raises(ValueError, match="strict, canonical, off"):
        LlamaCppEngine(model_path=model_path("smollm2"), exact="fast")
    from ds4.cli import build_parser

    args = build_parser().parse_args(["serve", "--exact", "canonical"])
    assert args.exact == "canonical"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--exact", "sometimes"])


def _chat(srv, msgs):
    r = srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=GEN, temperature=0)
    return r.choices[0].message.content, (r.model_extra or {}).get("ds4", {})


def test_a_canonical_server_is_exact_live_and_from_disk(tmp_path, serve):
    """``ds4 serve --exact canonical``: the worker canonicalizes a reply
    once it is sent, so the next turn waits for nothing (``canonicalize_ms``
    0) and extends a prefill's state; the same turn after a restart resumes
    from disk; both reply as a cold server does."""
    import signal

    msgs = [
        {"role": "system", "content": "You keep the harbour's tide log and answer from it. " * 50},
        {"role": "user", "content": "When is high water at the north berth?"},
    ]
    flags = ("--model", model_path("smollm2"), "--exact", "canonical")
    kv = str(tmp_path / "kv")
    srv = serve(*flags, "--kv-disk-dir", kv, name="a", tmp=tmp_path, engine="llamacpp", ctx=2048, timeout=300)
    try:
        first, _ = _chat(srv, msgs)
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "And at the south berth?"}]
        live, info = _chat(srv, msgs)
        assert info["rung"] == "live" and info["canonicalize_ms"] == 0, info
    finally:
        srv.stop(signal.SIGTERM)
    srv = serve(*flags, "--kv-disk-dir", kv, name="b", tmp=tmp_path, engine="llamacpp", ctx=2048, timeout=300)
    try:
        disk, info = _chat(srv, msgs)
        assert info["rung"] == "disk" and info["reused_tokens"] > 0, info
    finally:
        srv.stop(signal.SIGTERM)
    cold_srv = serve(*flags, name="cold", tmp=tmp_path, engine="llamacpp", ctx=2048, timeout=300)
    try:
        cold, info = _chat(cold_srv, msgs)
        assert info["rung"] == "prefill", info
    finally:
        cold_srv.stop(signal.SIGTERM)
    assert live == disk == cold
