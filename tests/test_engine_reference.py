"""The NumPy reference engine: bit-exact splits, state round trips, strict
imports, the byte-level tokenizer and the payload ABI."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4.engine import Engine, EngineContext
from ds4.engines import _exact, reference
from ds4.engines.reference import ReferenceEngine
from ds4.errors import ContextOverflowError, EngineError, EngineStateError

pytestmark = pytest.mark.filterwarnings("error")

# module-level engines (hypothesis dislikes function-scoped fixtures)
ENGINE = ReferenceEngine()
# tiny window and chunk: rings wrap and chunks split every few tokens
SMALL = ReferenceEngine(seed=3, window=8, chunk=16, sliding_layers=(1, 3))
V = ENGINE.vocab_size

HYP = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32, k
        assert a[k].shape == b[k].shape, k
        assert np.array_equal(a[k], b[k]), k
        # bit-identical, not merely equal (no -0.0 vs 0.0 either)
        assert a[k].tobytes() == b[k].tobytes(), k


def _cold(engine, toks, n_ctx=4096):
    ctx = engine.new_context(n_ctx)
    logits = ctx.eval(toks)
    return logits, ctx.export_state()


def _split_run(engine, toks, cuts, reload, n_ctx=4096):
    """Evaluate ``toks`` in pieces at ``cuts``; before a piece, optionally move
    the state into a fresh context through export/import."""
    ctx = engine.new_context(n_ctx)
    bounds = [0, *cuts, len(toks)]
    logits = None
    for j, (a, b) in enumerate(itertools.pairwise(bounds)):
        if j and reload[j - 1]:
            st_ = ctx.export_state()
            ctx = engine.new_context(n_ctx)
            ctx.import_state(st_, a)
        logits = ctx.eval(toks[a:b])
    assert ctx.n_past == len(toks)
    return logits, ctx.export_state()


# -- protocol ----------------------------------------------------------------
def test_implements_protocol():
    ctx = ENGINE.new_context(64)
    assert isinstance(ENGINE, Engine)
    assert isinstance(ctx, EngineContext)
    assert ENGINE.vocab_size == 260
    assert ENGINE.eos_token_id == ENGINE.tokenize("<|im_end|>", special=True)[0] == 258
    assert ctx.n_ctx == 64 and ctx.n_past == 0


def test_new_context_validates_n_ctx():
    with pytest.raises(ValueError):
        ENGINE.new_context(0)
    with pytest.raises(ValueError):
        ENGINE.new_context(ENGINE.max_ctx + 1)
    with pytest.raises(TypeError):
        ENGINE.new_context(1.5)


def test_logits_shape_and_sanity():
    ctx = ENGINE.new_context(256)
    a = ctx.eval(_tokens(50))
    assert a.dtype == np.float32 and a.shape == (V,)
    assert np.all(np.isfinite(a))
    b = ENGINE.new_context(256).eval(_tokens(50, seed=1))
    assert not np.array_equal(a, b)  # the model is not constant
    # returned logits are a copy
    a[:] = 0
    assert not np.array_equal(ctx.export_state()["logits"], a)


def test_same_seed_same_model():
    other = ReferenceEngine()
    toks = _tokens(200)
    a, sa = _cold(ENGINE, toks)
    b, sb = _cold(other, toks)
    assert np.array_equal(a, b)
    _assert_same_state(sa, sb)


# -- bit-exactness -----------------------------------------------------------
@settings(HYP, max_examples=100)
@given(data=st.data())
def test_any_split_is_bit_identical_small(data):
    n = data.draw(st.integers(1, 100), label="n")
    toks = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n), label="tokens")
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=5), label="cuts"))) if n > 1 else []
    reload = data.draw(st.lists(st.booleans(), min_size=len(cuts), max_size=len(cuts)), label="reload")
    a, sa = _cold(SMALL, toks, n_ctx=128)
    b, sb = _split_run(SMALL, toks, cuts, reload, n_ctx=128)
    assert np.array_equal(a, b)
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, sb)


@settings(HYP, max_examples=30)
@given(data=st.data())
def test_any_split_is_bit_identical_default(data):
    n = data.draw(st.integers(2, 700), label="n")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    toks = _tokens(n, seed)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=3), label="cuts")))
    reload = data.draw(st.lists(st.booleans(), min_size=len(cuts), max_size=len(cuts)), label="reload")
    a, sa = _cold(ENGINE, toks)
    b, sb = _split_run(ENGINE, toks, cuts, reload)
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, sb)


COLD_1100 = None


@pytest.mark.parametrize("cut", [1, 2, 127, 128, 129, 200, 255, 256, 257, 383, 384, 511, 512, 513, 537, 1023, 1099])
def test_resume_at_cut_is_bit_identical(cut):
    """Cold prefill of 1100 tokens vs prefill ``cut`` + export/import into a
    fresh context + the rest: cuts around the window (128), chunk (256) and
    the attention tile (512) boundaries."""
    global COLD_1100
    toks = _tokens(1100, seed=7)
    if COLD_1100 is None:
        COLD_1100 = _cold(ENGINE, toks)
    a, sa = COLD_1100
    b, sb = _split_run(ENGINE, toks, [cut], [True])
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, sb)


def test_token_by_token_equals_prefill():
    toks = _tokens(300, seed=11)  # wraps the 128-slot ring, crosses a chunk
    a, sa = _cold(ENGINE, toks)
    ctx = ENGINE.new_context(4096)
    for t in toks:
        b = ctx.eval([t])
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, ctx.export_state())


def test_token_by_token_equals_prefill_small():
    toks = _tokens(90, seed=12)
    a, sa = _cold(SMALL, toks, n_ctx=128)
    ctx = SMALL.new_context(128)
    for t in toks:
        b = ctx.eval([t])
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, ctx.export_state())


def test_attention_tiling_does_not_change_a_bit(monkeypatch):
    """Blocks of 512 keys instead of the default ~1M-element blocks: the
    exact-integer attention gives the same bits."""
    toks = _tokens(1300, seed=5)
    a, sa = _cold(ENGINE, toks)
    monkeypatch.setattr(_exact, "SCRATCH_ELEMS", 1)
    b, sb = _cold(ENGINE, toks)
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, sb)


def test_blas_threads_do_not_change_a_bit():
    toks = _tokens(600, seed=9)
    a, sa = _cold(ENGINE, toks)
    eng = ReferenceEngine(blas_threads=None)
    b, sb = _cold(eng, toks)
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, sb)


def test_chunk_size_does_not_change_a_bit():
    toks = _tokens(700, seed=4)
    a, sa = _cold(ENGINE, toks)
    b, sb = _cold(ReferenceEngine(chunk=100), toks)
    assert ReferenceEngine(chunk=100).payload_abi() == ENGINE.payload_abi()
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, sb)


# -- state layout ------------------------------------------------------------
def test_state_names_and_shapes():
    e = ENGINE
    for n in (1, 5, 128, 129, 300):
        ctx = e.new_context(512)
        ctx.eval(_tokens(n))
        st_ = ctx.export_state()
        assert {k: v.shape for k, v in st_.items()} == e.state_shapes(n)
        for i in range(e.n_layers):
            rows = min(n, e.window) if i in e.sliding_layers else n
            assert st_[f"layer{i}.k"].shape == (rows, e.n_kv_heads, e.head_dim)
            assert st_[f"layer{i}.v"].shape == (rows, e.n_kv_heads, e.head_dim)
        assert st_["logits"].shape == (e.vocab_size,)
        assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in st_.values())
        assert "tokens" not in st_


@pytest.mark.parametrize("n", [5, 128, 129, 200, 256, 301])
def test_sliding_ring_saved_in_logical_order(n):
    """Layer 1 is sliding in ENGINE and full in FULL1; layer 0 (full in both)
    feeds it the same input, so its ring, saved oldest to newest, must equal
    the last ``window`` rows of the full cache."""
    full1 = ReferenceEngine(sliding_layers=(3,))
    toks = _tokens(n, seed=n)
    _, s_ring = _cold(ENGINE, toks)
    _, s_full = _cold(full1, toks)
    w = ENGINE.window
    for name in ("layer1.k", "layer1.v"):
        assert s_ring[name].shape[0] == min(n, w)
        assert np.array_equal(s_ring[name], s_full[name][-w:])
    assert np.array_equal(s_ring["layer0.k"], s_full["layer0.k"])


def test_export_is_a_copy_and_import_accepts_readonly_views(tmp_path):
    toks = _tokens(400, seed=2)
    ctx = ENGINE.new_context(1024)
    ctx.eval(toks[:333])
    st_ = ctx.export_state()
    before = {k: v.copy() for k, v in st_.items()}
    for v in st_.values():
        v[...] = 0  # scribbling on the export does not touch the context
    _assert_same_state(before, ctx.export_state())

    # a memory-mapped, read-only copy of the payload
    views = {}
    for k, v in before.items():
        path = tmp_path / f"{k}.bin"
        v.tofile(path)
        views[k] = np.memmap(path, dtype=np.float32, mode="r", shape=v.shape)
        assert not views[k].flags.writeable
    fresh = ENGINE.new_context(1024)
    fresh.import_state(views, 333)
    assert fresh.n_past == 333
    _assert_same_state(before, fresh.export_state())
    del views
    a = ctx.eval(toks[333:])
    b = fresh.eval(toks[333:])
    assert a.tobytes() == b.tobytes()
    _assert_same_state(ctx.export_state(), fresh.export_state())


def test_import_then_export_roundtrip_and_logits_survive():
    toks = _tokens(260, seed=3)
    ctx = ENGINE.new_context(512)
    logits = ctx.eval(toks)
    st_ = ctx.export_state()
    fresh = ENGINE.new_context(300)
    fresh.import_state(st_, 260)
    _assert_same_state(st_, fresh.export_state())
    assert np.array_equal(fresh.export_state()["logits"], logits)


def test_import_replaces_existing_state():
    a_toks, b_toks = _tokens(150, seed=1), _tokens(90, seed=2)
    ca = ENGINE.new_context(512)
    ca.eval(a_toks)
    cb = ENGINE.new_context(512)
    cb.eval(b_toks)
    ca.import_state(cb.export_state(), 90)
    assert ca.n_past == 90
    _assert_same_state(ca.export_state(), cb.export_state())
    x = ca.eval([1, 2, 3])
    y = cb.eval([1, 2, 3])
    assert x.tobytes() == y.tobytes()


def test_export_of_empty_context_raises():
    with pytest.raises(EngineError):
        ENGINE.new_context(16).export_state()


# -- import validation -------------------------------------------------------
def _bad_states(good: dict, n: int):
    """(label, arrays, n_tokens) for every kind of bad input."""
    yield "missing array", {k: v for k, v in good.items() if k != "layer2.v"}, n
    yield "missing logits", {k: v for k, v in good.items() if k != "logits"}, n
    yield "extra array", {**good, "tokens": np.zeros(n, np.float32)}, n
    yield "renamed array", {("layer9.k" if k == "layer0.k" else k): v for k, v in good.items()}, n
    yield "wrong dtype f64", {**good, "layer0.k": good["layer0.k"].astype(np.float64)}, n
    yield "wrong dtype f16", {**good, "layer1.v": good["layer1.v"].astype(np.float16)}, n
    yield "wrong dtype i8", {**good, "layer0.v": good["layer0.v"].astype(np.int8)}, n
    yield "big endian", {**good, "layer0.k": good["layer0.k"].astype(">f4")}, n
    yield "logits f64", {**good, "logits": good["logits"].astype(np.float64)}, n
    yield "short full layer", {**good, "layer0.k": good["layer0.k"][:-1]}, n
    yield "long ring", {**good, "layer1.k": np.concatenate([good["layer1.k"], good["layer1.k"][:1]])}, n
    yield "swapped axes", {**good, "layer2.k": np.ascontiguousarray(good["layer2.k"].transpose(1, 0, 2))}, n
    yield "flat", {**good, "layer2.v": good["layer2.v"].reshape(-1)}, n
    yield "logits shape", {**good, "logits": good["logits"][:-1]}, n
    yield "not an array", {**good, "layer0.k": good["layer0.k"].tolist()}, n
    yield "off grid", {**good, "layer0.k": good["layer0.k"] + np.float32(0.5)}, n
    yield "out of range", {**good, "layer3.v": good["layer3.v"] * np.float32(2.0)}, n
    nan_k = good["layer2.k"].copy()
    nan_k[0, 0, 0] = np.nan
    yield "nan in k", {**good, "layer2.k": nan_k}, n
    bad_logits = good["logits"].copy()
    bad_logits[3] = np.inf
    yield "inf logits", {**good, "logits": bad_logits}, n
    yield "token count too small", good, n - 1
    yield "token count too large", good, n + 1
    yield "zero tokens", good, 0
    yield "negative tokens", good, -5
    yield "n_tokens > n_ctx", good, 10_000
    yield "n_tokens float", good, float(n)
    yield "n_tokens bool", good, True
    yield "not a mapping", list(good.values()), n


def test_import_rejects_bad_input_without_touching_state():
    n = 200  # > window: the rings are full
    src = ENGINE.new_context(512)
    src.eval(_tokens(n, seed=21))
    good = src.export_state()

    live = ENGINE.new_context(512)
    live_toks = _tokens(77, seed=22)
    live.eval(live_toks)
    before = live.export_state()
    seen = set()
    for label, arrays, n_tokens in _bad_states(good, n):
        with pytest.raises(EngineStateError) as ei:
            live.import_state(arrays, n_tokens)
        assert ei.value.code == "engine_rejected" and ei.value.stage == "engine", label
        assert live.n_past == 77, label
        _assert_same_state(before, live.export_state())
        seen.add(label)
    assert len(seen) == 27
    # the live context still works and still matches a cold prefill
    cont = _tokens(10, seed=23)
    a = live.eval(cont)
    b = ENGINE.new_context(512).eval(live_toks + cont)
    assert a.tobytes() == b.tobytes()
    # and the good payload is accepted
    live.import_state(good, n)
    _assert_same_state(good, live.export_state())


def test_import_rejects_n_tokens_beyond_small_context():
    src = ENGINE.new_context(512)
    src.eval(_tokens(100))
    small = ENGINE.new_context(99)
    with pytest.raises(EngineStateError):
        small.import_state(src.export_state(), 100)
    assert small.n_past == 0


def test_import_rejects_other_models_payload():
    other = ReferenceEngine(n_layers=3, sliding_layers=(1,))
    ctx = other.new_context(256)
    ctx.eval(_tokens(40))
    with pytest.raises(EngineStateError):
        ENGINE.new_context(256).import_state(ctx.export_state(), 40)


# -- eval errors -------------------------------------------------------------
def test_context_overflow_leaves_state_untouched():
    ctx = ENGINE.new_context(100)
    ctx.eval(_tokens(60))
    before = ctx.export_state()
    with pytest.raises(ContextOverflowError) as ei:
        ctx.eval(_tokens(41))
    assert ei.value.n_tokens == 101 and ei.value.ctx == 100
    assert ctx.n_past == 60
    _assert_same_state(before, ctx.export_state())
    ctx.eval(_tokens(40))  # exactly full is fine
    assert ctx.n_past == 100
    with pytest.raises(ContextOverflowError):
        ctx.eval([1])


@pytest.mark.parametrize("bad", [[], [V], [-1], [1, 2, 300], [1.5], ["a"], [[1, 2]], [True]])
def test_eval_rejects_bad_tokens_without_touching_state(bad):
    ctx = ENGINE.new_context(100)
    ctx.eval(_tokens(30))
    before = ctx.export_state()
    with pytest.raises(ValueError):
        ctx.eval(bad)
    assert ctx.n_past == 30
    _assert_same_state(before, ctx.export_state())


def test_eval_accepts_numpy_tokens():
    toks = _tokens(50)
    a = ENGINE.new_context(64).eval(toks)
    b = ENGINE.new_context(64).eval(np.array(toks, dtype=np.int32))
    c = ENGINE.new_context(64).eval(tuple(np.array(toks, dtype=np.uint16)))
    assert a.tobytes() == b.tobytes() == c.tobytes()


def test_progress_reports_aligned_chunks():
    calls = []
    ctx = ENGINE.new_context(2048)
    ctx.eval(_tokens(100))
    ctx.eval(_tokens(600, seed=1), progress=lambda d, t: calls.append((d, t)))
    assert calls == [(156, 600), (412, 600), (600, 600)]  # boundaries at 256, 512


def test_progress_exception_leaves_a_consistent_state():
    toks = _tokens(700, seed=6)

    def stop(done, total):
        if done >= 256:
            raise KeyboardInterrupt

    ctx = ENGINE.new_context(1024)
    with pytest.raises(KeyboardInterrupt):
        ctx.eval(toks, progress=stop)
    assert ctx.n_past == 256
    b = ctx.eval(toks[256:])
    a, sa = _cold(ENGINE, toks)
    assert a.tobytes() == b.tobytes()
    _assert_same_state(sa, ctx.export_state())


def test_reset_and_truncate():
    toks = _tokens(150)
    ctx = ENGINE.new_context(256)
    ctx.eval(toks)
    before = ctx.export_state()
    assert ctx.truncate(150) is True
    for n in (1, 50, 149):
        assert ctx.truncate(n) is False  # the rings cannot be rewound
        assert ctx.n_past == 150
        _assert_same_state(before, ctx.export_state())
    with pytest.raises(ValueError):
        ctx.truncate(151)
    with pytest.raises(ValueError):
        ctx.truncate(-1)
    assert ctx.truncate(0) is True and ctx.n_past == 0
    a = ctx.eval(toks)
    assert a.tobytes() == before["logits"].tobytes()
    ctx.reset()
    assert ctx.n_past == 0
    with pytest.raises(EngineError):
        ctx.export_state()


def test_internal_failure_resets_and_raises_engine_error(monkeypatch):
    ctx = ENGINE.new_context(256)
    ctx.eval(_tokens(20))

    def boom(*a, **k):
        raise MemoryError("simulated")

    monkeypatch.setattr(_exact.ExactAttention, "attend", boom)
    with pytest.raises(EngineError):
        ctx.eval(_tokens(5))
    assert ctx.n_past == 0


# -- tokenizer ---------------------------------------------------------------
MARKERS = list(reference.SPECIAL_TOKENS)


def test_special_tokens_and_bytes():
    e = ENGINE
    assert e.tokenize("hé") == [104, 0xC3, 0xA9]
    for i, m in enumerate(MARKERS):
        assert e.tokenize(m, special=True) == [256 + i]
        assert e.tokenize(m, special=False) == list(m.encode())
        assert e.token_bytes(256 + i) == m.encode()
    assert e.token_bytes(65) == b"A"
    with pytest.raises(ValueError):
        e.token_bytes(V)
    with pytest.raises(ValueError):
        e.token_bytes(-1)
    assert e.detokenize([0xE2, 0x82]) == "\ufffd"  # a cut UTF-8 sequence
    assert e.detokenize([257, 104, 105, 258]) == "<|im_start|>hi<|im_end|>"
    assert e.tokenize("<|im_", special=True) == list(b"<|im_")
    assert e.tokenize("<<|eos|>|>", special=True) == [60, 259, 124, 62]


def test_render_chat():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = ENGINE.render_chat(msgs)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ENGINE.render_chat(msgs, add_generation_prompt=False) == text[: -len("<|im_start|>assistant\n")]
    toks = ENGINE.tokenize(text, special=True)
    assert toks[0] == 257 and toks.count(257) == 3 and toks.count(258) == 2
    assert ENGINE.detokenize(toks) == text
    with pytest.raises(ValueError):
        ENGINE.render_chat([{"content": "x"}])


@given(st.text(), st.booleans())
@settings(HYP, max_examples=200)
def test_tokenize_round_trip(text, special):
    toks = ENGINE.tokenize(text, special=special)
    assert all(0 <= t < V for t in toks)
    assert ENGINE.detokenize(toks) == text
    if not special:
        assert toks == list(text.encode("utf-8"))


_PIECES = st.lists(
    st.one_of(st.sampled_from([*MARKERS, "<|", "|>", "<", "|", ">", "im_", "end", "start"]), st.text(max_size=4)),
    max_size=6,
).map("".join)


@given(_PIECES, _PIECES)
@settings(HYP, max_examples=300)
def test_tokenize_concatenation_property(a, b):
    e = ENGINE
    assert e.tokenize(a + b) == e.tokenize(a) + e.tokenize(b)  # special=False: always
    joined = e.tokenize(a + b, special=True)
    marker_re = re.compile("|".join(re.escape(m) for m in MARKERS))
    straddles = any(m.start() < len(a) < m.end() for m in marker_re.finditer(a + b))
    if not straddles:
        assert joined == e.tokenize(a, special=True) + e.tokenize(b, special=True)
    assert e.detokenize(joined) == a + b


def test_rendered_chat_prefix_tokenizes_as_prefix():
    """Rendered chats only grow at message boundaries, which never cut a marker."""
    msgs = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "<|im_"}]
    short = ENGINE.render_chat(msgs[:1], add_generation_prompt=False)
    long = ENGINE.render_chat(msgs)
    assert long.startswith(short)
    ts, tl = ENGINE.tokenize(short, special=True), ENGINE.tokenize(long, special=True)
    assert tl[: len(ts)] == ts


# -- ABI ---------------------------------------------------------------------
def test_payload_abi():
    abi = ENGINE.payload_abi()
    assert re.fullmatch(r"ds4-ref/1 model=sha256:[0-9a-f]{16} layout=1", abi)
    assert ReferenceEngine(seed=0).payload_abi() == abi
    others = {
        ReferenceEngine(seed=1).payload_abi(),
        ReferenceEngine(n_layers=3, sliding_layers=(1,)).payload_abi(),
        ReferenceEngine(window=64).payload_abi(),
        ReferenceEngine(sliding_layers=(1,)).payload_abi(),
        ReferenceEngine(d_model=32, n_heads=2, n_kv_heads=1).payload_abi(),
    }
    assert abi not in others and len(others) == 5
    # context size, chunking and BLAS threads do not change the payload
    assert ReferenceEngine(max_ctx=1024, chunk=64, blas_threads=2).payload_abi() == abi


def test_greedy_decode_is_deterministic():
    def run():
        ctx = ENGINE.new_context(256)
        prompt = ENGINE.tokenize(ENGINE.render_chat([{"role": "user", "content": "hello"}]), special=True)
        logits = ctx.eval(prompt)
        out = []
        for _ in range(20):
            t = int(np.argmax(logits))
            out.append(t)
            if t == ENGINE.eos_token_id:
                break
            logits = ctx.eval([t])
        return out

    a = run()
    assert a == run()
    assert all(0 <= t < V for t in a)


def _donor_state(n, n_ctx=64):
    e = ReferenceEngine()
    c = e.new_context(n_ctx)
    c.eval([(7 * i + 3) % e.vocab_size for i in range(n)])
    return e, c.export_state()


def test_import_state_says_exactly_what_is_wrong():
    """Each rejection is an EngineStateError whose reason names the problem;
    nothing of the context changes (checked by importing after all)."""
    e, state = _donor_state(8)
    ctx = e.new_context(64)
    k = next(n for n in state if n != "logits")

    def reason(arrays, n):
        with pytest.raises(EngineStateError) as ei:
            ctx.import_state(arrays, n)
        return ei.value.reason

    assert reason(state, 8.0) == "n_tokens must be an int, got float"
    assert reason(state, True) == "n_tokens must be an int, got bool"
    assert reason(state, 0) == "n_tokens 0 outside 1..64"
    assert reason(state, 65) == "n_tokens 65 outside 1..64"
    assert reason(list(state.items()), 8) == "state arrays must be a mapping of names to arrays"
    bad = {n: a for n, a in state.items() if n != "logits"}
    bad["zz"] = state["logits"]
    assert reason(bad, 8) == "state arrays do not match the model: missing ['logits'], unexpected ['zz']"
    assert reason({**state, k: state[k].tolist()}, 8) == f"{k} is a list, not a numpy array"
    assert reason({**state, k: state[k].astype(np.float64)}, 8) == f"{k} has dtype float64, expected float32"
    assert (
        reason({**state, k: state[k][:-1]}, 8)
        == f"{k} has shape {state[k][:-1].shape}, expected {state[k].shape} for 8 tokens"
    )
    nan = state["logits"].copy()
    nan[3] = np.nan
    assert reason({**state, "logits": nan}, 8) == "logits contain NaN or infinity"
    off = state[k].copy()
    off.flat[0] = 0.5
    assert reason({**state, k: off}, 8) == f"{k} holds values off the int8 grid"
    assert ctx.n_past == 0
    ctx.import_state(state, 8)
    assert ctx.n_past == 8


def test_import_state_takes_exactly_n_ctx_tokens():
    e, state = _donor_state(64)
    ctx = e.new_context(64)
    ctx.import_state(state, 64)
    assert ctx.n_past == 64 and np.array_equal(ctx.last_logits(), state["logits"])


def test_imported_logits_are_the_contexts_own_float32_copy():
    e, state = _donor_state(8)
    ctx = e.new_context(64)
    src = state["logits"].copy()
    ctx.import_state({**state, "logits": src}, 8)
    src[:] = 0.0  # the caller's array (a mapped file, in real use) changes afterwards
    got = ctx.last_logits()
    assert got.dtype == np.float32 and np.array_equal(got, state["logits"])
