"""Every architecture the tiny random-weight models cover (tests/helpers/models.py,
written at setup by scripts/tiny_models.py): a recurrent one (Mamba-2), two
hybrids (LFM2: conv layers and attention, with llama.cpp's rollback
snapshots; Granite 4 hybrid: Mamba-2 layers and attention, without), and two
dense ones whose tokenizer splits a generated reply other ways than its
text re-tokenizes (Qwen 3 with GQA 4:1, Phi-3 with a fused QKV).

On each: the engine starts and says what its memory can do; a disk resume in
a new session, a live continuation, a checkpoint taken after generation and
a corrupted payload byte all give the cold prefill's logits bit for bit and
its 40 greedy tokens; a reply whose ids are not its text's tokenization is
cut by the token check (the report says where) and still gives cold's
output on the live and the disk rung; a recurrent model's checkpoint is
``incompatible`` to a dense engine (and the reverse) and stays on disk."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.models import RECURRENT, TINY, engine
from helpers.redis_servers import RedisNode

import ds4
from ds4.errors import UnsupportedModelError
from ds4.keytext import tokenize_prompt
from ds4.kvstore.remote import RemoteTier

GEN = 40
CTX = 4096


@pytest.fixture(scope="module", params=TINY)
def eng(request):
    return engine(request.param)


def name_of(eng) -> str:
    return next(m for m in TINY if engine(m) is eng)


def story(n: int = 40, tail: str = "") -> str:
    return "The quick brown fox jumps over the lazy dog near the river bank. " * n + tail


def store(d):
    return ds4.KVStore(str(d), budget_mb=4096, min_tokens=16)


def cold(eng, prompt: str) -> tuple[np.ndarray, list[int]]:
    """The logits and greedy reply of a cold, single-session prefill."""
    s = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s, None, prompt)
    assert rep.rung == "prefill"
    return s.logits.copy(), s.generate(GEN)


def assert_cold(eng, s, prompt: str) -> None:
    """``s`` holds exactly what a cold prefill of ``prompt`` would."""
    logits, reply = cold(eng, prompt)
    assert s.tokens == tokenize_prompt(eng, prompt)
    assert np.array_equal(s.logits, logits)
    assert s.generate(GEN) == reply


def test_the_engine_says_what_its_memory_can_do(eng):
    """The start-up probe asked the memory instead of assuming: recurrent
    parts cannot truncate; LFM2 keeps rollback snapshots (so it pads), the
    others none; every model found an exact policy, and its states survive
    the round trip."""
    name, f = name_of(eng), eng.facts()
    assert f["arch"] == {"phi3": "phi3"}.get(name, name)
    kind = {"mamba2": "recurrent", "lfm2": "hybrid", "granitehybrid": "hybrid"}.get(name, "attention")
    assert f["memory"] == kind
    assert f["truncate"] is (name not in RECURRENT) and f["copy"] is (name not in RECURRENT)
    assert (f["rollback"] > 0) is (name == "lfm2")
    assert f["exact_verified"] and f["checkpoints"]
    assert f["batched_decode"] is (name not in RECURRENT)
    abi = eng.payload_abi()
    assert (f" mem={kind}" in abi) is (name in RECURRENT)
    if "serial" in f["batch"]:  # only where no batch the memory can take was exact
        assert f["rollback"] == 0 and name in RECURRENT
    if name in RECURRENT:
        assert eng.state_layout.recurrent is not None


def test_disk_resume_in_a_new_session_equals_cold(eng, tmp_path):
    st = store(tmp_path)
    p = story(40, "And then the fox said nothing.")
    s = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s, st, p, cold_save=True)
    assert rep.rung == "prefill"
    q = p + " The heron stood still in the reeds."
    s2 = ds4.Session(eng, ctx=CTX)
    rep2 = ds4.recover(s2, st, q)
    assert rep2.rung == "disk" and rep2.reused_tokens > 0 and not rep2.rejected
    assert_cold(eng, s2, q)


def test_a_checkpoint_after_generation_resumes_as_cold(eng, tmp_path):
    """Prompt + 40 generated tokens saved, then the next turn in a new
    session: a disk resume where the reply's ids are its text's tokens, the
    token check's cut where they are not (a recurrent state cannot be cut:
    then an honest prefill); a reply that is not valid UTF-8 text (random
    weights) matches neither; always cold's output."""
    st = store(tmp_path)
    p = story(30)
    s = ds4.Session(eng, ctx=CTX)
    ds4.recover(s, st, p)
    reply = s.generate(GEN)
    assert st.store_live_prefix(s, "continued")
    q = p + eng.detokenize(reply) + " The otters laughed."
    s2 = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s2, st, q)
    if tokenize_prompt(eng, q)[: s.n_past] == s.tokens:  # the reply's ids are its text's
        assert rep.rung == "disk" and rep.reused_tokens == s.n_past and rep.token_check is None
    elif rep.token_check is not None:  # the text matched, the ids did not
        assert rep.token_check["against"] == "disk" and rep.token_check["of"] == s.n_past
        if name_of(eng) in RECURRENT:  # the state cannot be cut: the prompt's own checkpoint, if any
            assert any("next checkpoint" in e for e in rep.events)
            assert rep.rung == "prefill" or rep.reused_tokens <= rep.token_check["kept"]
        else:
            assert rep.rung == "disk" and rep.reused_tokens == rep.token_check["kept"]
    assert_cold(eng, s2, q)


def test_a_live_continuation_equals_cold(eng):
    p = story(30)
    s = ds4.Session(eng, ctx=CTX)
    ds4.recover(s, None, p)
    reply = s.generate(GEN)
    n = s.n_past
    q = p + eng.detokenize(reply) + " Again."
    own = tokenize_prompt(eng, q)
    live = s.tokens
    rep = ds4.recover(s, None, q)
    if own[:n] == live:  # the reply's ids are its text's
        assert rep.rung == "live" and rep.reused_tokens == n and rep.token_check is None
    elif rep.token_check is not None:  # the text matched, the ids did not
        assert rep.token_check["against"] == "live"
        if name_of(eng) in RECURRENT:  # from the prompt's snapshot, when the cut is past it
            assert rep.rung in ("rewrite", "prefill")
            assert (rep.rung == "rewrite") is (rep.snapshot is not None)
        else:
            assert rep.rung == "rewrite" and rep.snapshot is None
    assert_cold(eng, s, q)


def test_a_corrupted_payload_byte_falls_back_to_cold(eng, tmp_path):
    st = store(tmp_path)
    p = story(30, "The end.")
    s = ds4.Session(eng, ctx=CTX)
    ds4.recover(s, st, p)
    path = st.store_live_prefix(s, "continued")
    assert path
    with open(path, "r+b") as f:  # a byte of the payload (the file's tail)
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))
    q = p + " More."
    s2 = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s2, store(tmp_path), q)
    assert rep.rung == "prefill"
    assert [c for (_p, _s, c, _r) in rep.rejected] == ["payload_checksum"]
    assert not os.path.exists(path)
    assert_cold(eng, s2, q)


def _respelled(eng, text: str) -> list[int]:
    """Ids that spell ``text`` byte for byte but are not its tokenization:
    each character tokenized on its own."""
    ids = [t for ch in text for t in eng.tokenize(ch)]
    assert eng.detokenize(ids) == text and ids != eng.tokenize(text)
    return ids


@pytest.mark.parametrize("rung", ["live", "disk"])
def test_a_reply_respelled_is_cut_by_the_token_check(eng, tmp_path, rung):
    """A reply whose ids spell a whitespace run another way than the text
    re-tokenizes (forced: one character a token) is reused only up to the
    first id the prompt's own tokenization does not have; the next turn's
    logits and reply are cold's."""
    p = story(20)
    reply = "  Well,    the  river   was   cold.\n\n  "
    s = ds4.Session(eng, ctx=CTX)
    ds4.recover(s, None, p)
    head = s.tokens
    s.sync(head + _respelled(eng, reply))
    q = p + reply + "And then?"
    own = tokenize_prompt(eng, q)
    kept = s.common_prefix(own)
    assert 0 < kept < s.n_past
    st = store(tmp_path)
    if rung == "disk":
        assert st.store_live_prefix(s, "continued")
        s = ds4.Session(eng, ctx=CTX)
    rep = ds4.recover(s, st, q, evict_save=False, prompt_save=False)
    assert rep.token_check == {"against": rung, "kept": kept, "of": len(head) + len(_respelled(eng, reply))}
    assert any(f"token_check: kept {kept} of" in e for e in rep.events)
    if name_of(eng) in RECURRENT and rep.rung == "rewrite":  # the live session's snapshot
        assert rung == "live" and rep.reused_tokens == rep.snapshot <= kept
    elif name_of(eng) in RECURRENT:  # a loaded state has no snapshot to go back to
        assert rep.rung == "prefill" and rep.reused_tokens == 0
    else:
        assert rep.rung == ("rewrite" if rung == "live" else "disk") and rep.reused_tokens == kept
    assert_cold(eng, s, q)


@pytest.mark.parametrize("pair", [("mamba2", "qwen3"), ("qwen3", "mamba2"), ("lfm2", "phi3")])
def test_another_architectures_checkpoint_is_incompatible_and_kept(tmp_path, pair):
    """One store directory, two models: the other model's checkpoint of the
    same text is skipped as incompatible (never deleted), and the first
    model, back on the directory, resumes from its own file."""
    first, other = engine(pair[0]), engine(pair[1])
    p = story(30, "The end.")
    s = ds4.Session(first, ctx=CTX)
    ds4.recover(s, store(tmp_path), p)
    path = store(tmp_path).store_live_prefix(s, "continued")
    assert path
    q = p + " More."
    s2 = ds4.Session(other, ctx=CTX)
    rep = ds4.recover(s2, store(tmp_path), q, evict_save=False, prompt_save=False)
    assert rep.rung == "prefill"
    assert os.path.exists(path)
    assert all(c == "abi_mismatch" for (_p, _s, c, _r) in rep.rejected)
    s3 = ds4.Session(first, ctx=CTX)
    rep3 = ds4.recover(s3, store(tmp_path), q)
    assert rep3.rung == "disk" and rep3.loaded_path == path
    assert_cold(first, s3, q)


def test_an_unsupported_model_is_a_typed_error():
    """What cannot run is UnsupportedModelError: a stable code, the
    architecture and what to do (it pickles, as every ds4 error does)."""
    import pickle

    e = UnsupportedModelError("bert", "llama.cpp cannot evaluate a prompt with it", "pick another GGUF")
    assert e.code == "model_unsupported" and e.arch == "bert"
    assert "bert" in str(e) and "pick another GGUF" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert (back.arch, back.reason, back.hint, str(back)) == (e.arch, e.reason, e.hint, str(e))
    assert isinstance(e, ds4.errors.EngineError)


@pytest.mark.parametrize("name", RECURRENT)
def test_the_recurrent_part_of_a_state_is_walked_and_bounded(name):
    """A recurrent or hybrid state is checked whole before any context is
    touched: its real blob walks; a recurrent cell moved off the last
    position, a row header changed, a byte short or one too many are each
    a typed error (EngineStateError, which the ladder counts as corrupt)."""
    from ds4.engines.llamacpp_state import walk_state
    from ds4.errors import EngineStateError

    eng = engine(name)
    layout = eng.state_layout
    s = ds4.Session(eng, ctx=CTX)
    ds4.recover(s, None, story(5))
    n = s.n_past
    blob = s.export_arrays()["llama_state"]
    walk_state(blob, n, layout)
    assert blob.size == layout.size(n)
    part = layout.recurrent.size()
    at = blob.size - part  # the recurrent part's first byte: its cell count

    def forged(off: int, value: int, dtype: str) -> np.ndarray:
        b = blob.copy()
        b[off : off + np.dtype(dtype).itemsize] = np.array([value], dtype).view(np.uint8)
        return b

    cases = {
        "cell count": forged(at, 2, "<u4"),
        "position": forged(at + 4, n - 2, "<i4"),
        "sequence ids": forged(at + 8, 1, "<u4"),
        "layer count": forged(at + 16, layout.recurrent.n_layer + 1, "<u4"),
        "row size": forged(at + 24, layout.recurrent.r[0][1] + 1, "<u8"),
        "truncated": blob[:-1].copy(),
        "trailing": np.concatenate([blob, np.zeros(1, np.uint8)]),
    }
    for what, bad in cases.items():
        with pytest.raises(EngineStateError):
            walk_state(bad, n, layout)
        with pytest.raises(EngineStateError):
            s.load_arrays({**s.export_arrays(), "llama_state": bad}, n)
        assert not s.checkpoint_valid, what
        ds4.recover(s, None, story(5))


def _chat(eng, turns: list[str], replies: list[str]) -> str:
    msgs = []
    for i, u in enumerate(turns):
        msgs.append({"role": "user", "content": u})
        if i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    return eng.render_chat(msgs)


@pytest.mark.parametrize("name", RECURRENT)
@pytest.mark.parametrize("snapshots", [8, 0])
def test_an_edited_last_turn_resumes_from_a_snapshot(name, snapshots):
    """Two turns of a chat on a memory that cannot rewind, then the last
    user turn edited: served from the RAM snapshot of the previous turn's
    prompt (rung rewrite, the snapshot's position reused and reported),
    with cold's logits and reply; a regenerated reply resumes from the
    snapshot at its own prompt (nothing prefilled). With snapshots off the
    edit is an honest full prefill."""
    eng = engine(name)
    s = ds4.Session(eng, ctx=CTX)
    s.snapshots.configure(snapshots, 256, 0)
    first = story(10)
    p1 = _chat(eng, [first], [])
    ds4.recover(s, None, p1)
    r1 = eng.detokenize(s.generate(GEN, stop_tokens=sorted(eng.eog_token_ids)))
    p2 = _chat(eng, [first, "Tell me about the heron."], [r1])
    ds4.recover(s, None, p2)
    s.generate(GEN)
    edited = _chat(eng, [first, "Tell me about the otters instead."], [r1])
    restored = s.snapshots.counters["restored"]
    rep = ds4.recover(s, None, edited)
    n1 = len(tokenize_prompt(eng, p1))
    if snapshots:
        assert rep.rung == "rewrite" and rep.source == "snapshot"
        assert rep.snapshot is not None and n1 <= rep.snapshot == rep.reused_tokens
        assert any(f"snapshot={rep.snapshot}" in e for e in rep.events)
        assert s.snapshots.counters["restored"] == restored + 1
    else:
        assert rep.rung == "prefill" and rep.reused_tokens == 0 and len(s.snapshots) == 0
    assert_cold(eng, s, edited)
    # the reply regenerated: the snapshot at the edited prompt's end
    rep = ds4.recover(s, None, edited)
    n = len(tokenize_prompt(eng, edited))
    if snapshots:
        assert (rep.rung, rep.snapshot, rep.reused_tokens) == ("rewrite", n, n)
    assert_cold(eng, s, edited)


def test_snapshots_keep_their_budget_and_stay_in_their_namespace():
    """Periodic snapshots (every 64 tokens of a prefill) go before turn
    boundaries when over the count; none outlives a namespace switch."""
    eng = engine("mamba2")
    s = ds4.Session(eng, ctx=CTX)
    s.snapshots.configure(3, 256, 64)
    ds4.recover(s, None, story(30))  # about 400 tokens: 6 periodic, 1 boundary
    n = s.n_past
    pos = s.snapshots.positions()
    assert len(pos) == 3 and pos[-1] == n and all(p % 64 == 0 for p in pos[:-1])
    assert s.snapshots.counters["dropped"] == s.snapshots.counters["taken"] - 3
    s.set_namespace("tenant-b")
    assert len(s.snapshots) == 0
    s.snapshots.configure(2, 0.0001, 0)  # a budget smaller than one state keeps none
    ds4.recover(s, None, story(3))
    assert len(s.snapshots) == 0


@pytest.mark.parametrize("respelled", [False, True])
def test_the_remote_rung_equals_cold(eng, tmp_path, respelled):
    """One store saves to Redis, another with an empty directory resumes
    from it (rung remote) with cold's output; a reply respelled against its
    tokenization is cut there too (token_check against ``remote``)."""
    srv = RedisNode(str(tmp_path / "r")).start()
    a = ds4.KVStore(str(tmp_path / "a"), budget_mb=4096, min_tokens=16, remote=RemoteTier(srv.url))
    b = ds4.KVStore(str(tmp_path / "b"), budget_mb=4096, min_tokens=16, remote=RemoteTier(srv.url))
    try:
        p = story(30, "Shared text.")
        s = ds4.Session(eng, ctx=CTX)
        ds4.recover(s, None, p)
        reply = "  The  heron   waited.  "
        if respelled:
            s.sync(s.tokens + _respelled(eng, reply))
            p += reply
        assert a.store_live_prefix(s, "continued")
        a.remote.flush(30)
        q = p + " Then it rained."
        s2 = ds4.Session(eng, ctx=CTX)
        rep = ds4.recover(s2, b, q, evict_save=False, prompt_save=False)
        if not respelled:
            assert rep.rung == "remote" and rep.reused_tokens == s.n_past and rep.token_check is None
        else:
            assert rep.token_check is not None and rep.token_check["against"] == "remote"
            cut = name_of(eng) not in RECURRENT
            assert rep.rung == ("remote" if cut else "prefill")
        assert_cold(eng, s2, q)
    finally:
        a.close()
        b.close()
        srv.stop()
