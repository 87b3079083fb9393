"""Batched decode (``ds4.engines.llamacpp_batch``, issue 22 item 3), on both
real models: one llama context of N sequences whose one-token steps go into
one ``llama_decode``. Exactness is the condition: every sequence's logits,
step by step, are the bits a cold single-session context gives for the same
prompt, whatever the batch held (1 to 4 sequences, of different lengths,
joining, leaving and starting over on a reused stream), and a sequence's
exported state is the one a single context exports.

Nothing here is skipped: both models ship with the test setup."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import models

from ds4.engines import llamacpp_batch as B
from ds4.engines.llamacpp_context import LlamaCppContext
from ds4.errors import EngineError

N_CTX = 256
#: per prompt: (its text, the step it starts at, how many tokens it decodes)
SCHEDULE = (
    ("A short note about apples.", 0, 9),
    ("The history of the river, told slowly and with many small details about its banks.", 1, 4),
    ("List three colours: red, green, and", 3, 7),
    (
        "Dear reader, this letter is long. " * 6 + "It ends with a question: why do otters hold hands?",
        3,
        5,
    ),
    ("One more conversation starts on a stream another one left:", 6, 6),
)


def _prompt(eng, text):
    head = [eng.bos_token_id] if eng.add_bos else []
    return head + eng.tokenize(text)


def _alone(eng, prompt, n):
    """A cold single-session context's logits for ``prompt`` and its ``n``
    greedy tokens (the first entry is the prompt's last logits)."""
    c = LlamaCppContext(eng, N_CTX)
    try:
        seen = [c.eval(prompt).copy()]
        for _ in range(n):
            seen.append(c.eval([int(np.argmax(seen[-1]))]).copy())
    finally:
        c.close()
    return seen


@pytest.fixture(scope="module", params=models.MODELS)
def world(request):
    eng = models.engine(request.param)
    prompts = [_prompt(eng, text) for text, _, _ in SCHEDULE]
    assert len({len(p) for p in prompts}) == len(prompts), "different lengths"
    cold = [_alone(eng, p, n) for p, (_, _, n) in zip(prompts, SCHEDULE, strict=True)]
    return eng, prompts, cold


def test_the_engine_finds_its_batched_steps_exact(world):
    eng, _, _ = world
    assert B.batched_exact(eng, [list(range(11, 20)), list(range(40, 63)), list(range(70, 75))])
    shared = eng.batched_contexts(3, N_CTX, always=True)  # exact; whether it pays is asked below
    assert isinstance(shared, B.SharedContext) and len(shared.contexts) == 3
    for c in shared.contexts:
        c.close()
    assert shared.ctx is None  # the last sequence closed frees the llama context


def test_mixed_batches_of_one_to_four_are_bit_identical_to_single_sessions(world):
    """Five conversations over four streams: they join at different steps,
    the second leaves early and the fifth starts on its reused stream, so
    the steps hold 1, 2, 3 and 4 sequences of different lengths."""
    eng, prompts, cold = world
    shared = B.SharedContext(eng, 4, N_CTX)
    ctxs = shared.contexts
    seq_of = {0: 0, 1: 1, 2: 2, 3: 3, 4: 1}  # the fifth reuses the second's stream
    got: dict[int, list[np.ndarray]] = {}
    try:
        for t in range(12):
            for k, (_, start, _) in enumerate(SCHEDULE):
                if start == t:
                    c = ctxs[seq_of[k]]
                    if c.n_past:
                        c.reset()  # the stream's cells only
                    got[k] = [c.eval(prompts[k]).copy()]
            live = [k for k in got if len(got[k]) <= SCHEDULE[k][2]]
            live = [k for k in live if not (k == 1 and 4 in got)]
            if not live:
                continue
            items = [(ctxs[seq_of[k]], int(np.argmax(got[k][-1]))) for k in live]
            out = shared.decode_many(items)
            for k, (c, tok), lg in zip(live, items, out, strict=True):
                c.accept(tok, lg)
                got[k].append(lg)
    finally:
        for c in ctxs:
            c.close()
    assert set(shared.steps) == {1, 2, 3, 4}, shared.steps
    for k, seen in got.items():
        assert len(seen) == len(cold[k]), k
        same = [bool(np.array_equal(a, b)) for a, b in zip(seen, cold[k], strict=True)]
        assert all(same), (k, same)


def test_a_sequence_exports_the_state_a_single_context_exports(world):
    """Restreamed to the one-stream form: a checkpoint made in a pool is the
    file a single session writes, and a single session's state loads into
    any sequence and goes on to the same logits."""
    eng, prompts, cold = world
    single = LlamaCppContext(eng, N_CTX)
    shared = B.SharedContext(eng, 3, N_CTX)
    try:
        single.eval(prompts[2])
        ref = single.export_state()
        shared.contexts[0].eval(prompts[0])  # the other streams hold other states
        sc = shared.contexts[2]
        sc.eval(prompts[2])
        mine = sc.export_state()
        assert set(mine) == set(ref)
        for name in ref:
            assert np.array_equal(mine[name], ref[name]), name
        other = shared.contexts[1]
        other.import_state(ref, len(prompts[2]))
        assert np.array_equal(other.last_logits(), cold[2][0])
        tok = int(np.argmax(cold[2][0]))
        (lg,) = shared.decode_many([(other, tok)])
        assert np.array_equal(lg, cold[2][1])
    finally:
        single.close()
        for c in shared.contexts:
            c.close()


def test_a_step_posted_by_several_threads_runs_as_one_batch(world):
    """The pool's path: each lane posts its token and hands over; the lane
    that gets the turn back first runs one batch for every posted token."""
    eng, prompts, cold = world
    shared = B.SharedContext(eng, 2, N_CTX)
    a, b = shared.contexts
    try:
        a.eval(prompts[0])
        b.eval(prompts[2])
        ta, tb = int(np.argmax(cold[0][0])), int(np.argmax(cold[2][0]))
        inner: list[np.ndarray] = []

        def handover():
            # the first lane's handover: the second lane posts and runs the batch
            shared.handover = lambda: None
            inner.append(b.eval([tb]).copy())

        shared.handover = handover
        la = a.eval([ta])
        assert shared.steps == {2: 1}  # one llama_decode for both
        assert np.array_equal(la, cold[0][1]) and np.array_equal(inner[0], cold[2][1])
    finally:
        for c in shared.contexts:
            c.close()


def test_prefill_pieces_of_different_lengths_batch_bit_identically(world):
    """Batched prefill: pieces of 1 to 4 sequences of different lengths in
    one llama_decode each; every sequence gets the shortest piece's rows,
    the longer ones go on in later batches, and each prompt's logits are a
    cold single context's."""
    eng, prompts, cold = world
    shared = B.SharedContext(eng, 4, N_CTX)
    try:
        # all four together; as the shortest finishes, 3, 2 and then 1 go on
        left = {k: np.array(prompts[k]) for k in range(4)}
        last: dict[int, np.ndarray] = {}
        while any(t.size for t in left.values()):
            ks = [k for k, t in left.items() if t.size]
            out = shared.eval_many([(shared.contexts[k], left[k]) for k in ks])
            for k, (n, lg) in zip(ks, out, strict=True):
                assert 1 <= n <= left[k].size
                shared.contexts[k].accept_many(left[k][:n], lg)
                left[k], last[k] = left[k][n:], lg
        for k in range(4):
            assert shared.contexts[k].n_past == len(prompts[k])
            assert np.array_equal(last[k], cold[k][0]), k
            # and the state goes on as a cold one does
            assert np.array_equal(shared.contexts[k].eval([int(np.argmax(last[k]))]), cold[k][1]), k
        assert set(shared.prefill_steps) == {1, 2, 3, 4}, shared.prefill_steps
    finally:
        for c in shared.contexts:
            c.close()


@pytest.mark.parametrize("seed", [1, 4, 5])
def test_random_prefill_pieces_over_three_streams_stay_bit_identical(world, seed):
    """Three sequences fed in random pieces (1 to 60 tokens; some sequences
    sitting a batch out), the pieces of every batch put in together: at
    every piece's end each sequence's logits are those of a single context
    fed the same pieces. Batched at their own lengths instead (each padded
    alone, not to one row count), these three schedules come out in other
    bits on SmolLM2 (``benches/probe_batch_exact.py --prefill`` finds a fifth
    of such piece ends differ)."""
    import random

    eng, _, _ = world
    rng = random.Random(seed)
    texts = [_prompt(eng, (text + " ") * 4) for text, _, _ in SCHEDULE[:3]]
    plans = []
    for t in texts:
        cuts, i = [], 0
        while i < len(t):
            n = min(rng.choice([1, 2, 3, rng.randint(1, 60)]), len(t) - i)
            cuts.append(t[i : i + n])
            i += n
        plans.append(cuts)
    want = []
    for cuts in plans:
        c = LlamaCppContext(eng, N_CTX)
        try:
            want.append([c.eval(p).copy() for p in cuts])
        finally:
            c.close()
    shared = B.SharedContext(eng, 3, N_CTX)
    ctxs, at = shared.contexts, [0, 0, 0]
    left = [np.array(plans[k][0]) for k in range(3)]
    bad = []
    try:
        while any(at[k] < len(plans[k]) for k in range(3)):
            ks = [k for k in range(3) if at[k] < len(plans[k])]
            ks = [k for k in ks if rng.random() < 0.7] or ks[:1]
            for k, (n, lg) in zip(ks, shared.eval_many([(ctxs[k], left[k]) for k in ks]), strict=True):
                ctxs[k].accept_many(left[k][:n], lg)
                left[k] = left[k][n:]
                if not left[k].size:
                    if not np.array_equal(lg, want[k][at[k]]):
                        bad.append((k, at[k]))
                    at[k] += 1
                    if at[k] < len(plans[k]):
                        left[k] = np.array(plans[k][at[k]])
    finally:
        for c in ctxs:
            c.close()
    assert not bad, bad
    assert any(k >= 2 for k in shared.prefill_steps), shared.prefill_steps


def test_two_pieces_a_multiple_apart_stay_bit_identical(world):
    """Pieces of floor + multiple and floor + 2 multiples tokens (12 and 16
    on Gemma 3) from the start of two streams: the shorter one's rows for
    both, then the longer one's rest padded on its own. Put in together at
    their own lengths, llama.cpp cuts the rest off into a ubatch of its
    own, short of Gemma's floor, and the longer prompt's logits differ."""
    eng, prompts, _ = world
    f, m = eng.batch_floor, eng.batch_multiple
    pieces = [np.array(prompts[3][: f + m]), np.array(prompts[3][5 : 5 + f + 2 * m])]
    cold = [_alone(eng, list(p), 1) for p in pieces]
    shared = B.SharedContext(eng, 2, N_CTX)
    ctxs = shared.contexts
    try:
        last = [np.empty(0)] * 2
        left = list(pieces)
        while any(t.size for t in left):
            ks = [k for k in range(2) if left[k].size]
            for k, (n, lg) in zip(ks, shared.eval_many([(ctxs[k], left[k]) for k in ks]), strict=True):
                ctxs[k].accept_many(left[k][:n], lg)
                left[k], last[k] = left[k][n:], lg
        for k in range(2):
            assert np.array_equal(last[k], cold[k][0]), k
            assert np.array_equal(ctxs[k].eval([int(np.argmax(last[k]))]), cold[k][1]), k
        # both together, then the rest alone (a one-token rest, SmolLM2's, counts as a step)
        both = shared.prefill_steps + shared.steps
        assert shared.prefill_steps[2] == 1 and both[1] == 3 and sum(both.values()) == 4, both
    finally:
        for c in ctxs:
            c.close()


@pytest.mark.parametrize("batch_prefill", [True, False])
def test_lanes_prefill_and_decode_through_one_batch_as_the_pool_does(world, batch_prefill):
    """Four lanes on one baton, as the pool's: each prefills its prompt
    (handing over at every chunk and every piece) and decodes its tokens.
    Prefill pieces go in together (or, with ``batch_prefill`` off, each
    sequence prefills on its own), decode steps go in together (the two
    kinds in separate batches), and every lane's logits, from the prompt's
    last to its last token, are a cold single context's."""
    import threading

    from ds4.server.baton import Baton

    eng, prompts, cold = world
    shared = B.SharedContext(eng, 4, N_CTX)
    shared.batch_prefill = batch_prefill
    baton = Baton()
    shared.handover = baton.pass_
    got: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def lane(k: int) -> None:
        c = shared.contexts[k]
        try:
            with baton:
                seen = [c.eval(prompts[k], progress=lambda _d, _t: baton.pass_()).copy()]
                for _ in range(SCHEDULE[k][2]):
                    seen.append(c.eval([int(np.argmax(seen[-1]))]).copy())
            got[k] = seen
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=lane, args=(k,)) for k in range(4)]
        with baton:  # every lane queued before the first runs
            for t in threads:
                t.start()
            while baton.waiting < 4:
                threading.Event().wait(0.005)
        for t in threads:
            t.join(600)
        assert not errors, errors
        for k in range(4):
            same = [bool(np.array_equal(a, b)) for a, b in zip(got[k], cold[k], strict=True)]
            assert len(got[k]) == len(cold[k]) and all(same), (k, same)
        if batch_prefill:
            assert 4 in shared.prefill_steps, shared.prefill_steps
        else:
            assert not shared.prefill_steps, shared.prefill_steps
        assert 4 in shared.steps and 1 in shared.steps, shared.steps
    finally:
        for c in shared.contexts:
            c.close()


def test_a_failed_batched_step_fails_every_posted_sequence_and_resets_it(world, monkeypatch):
    eng, prompts, _ = world
    shared = B.SharedContext(eng, 2, N_CTX)
    a, b = shared.contexts
    try:
        a.eval(prompts[0])
        b.eval(prompts[1])
        monkeypatch.setattr(shared._lc, "llama_decode", lambda ctx, batch: 1)
        with pytest.raises(EngineError, match="batched"):
            a.eval([1])
        assert a.n_past == 0 and b.n_past == len(prompts[1])  # the failed one only is reset
    finally:
        monkeypatch.undo()
        for c in shared.contexts:
            c.close()


def test_an_engine_whose_batches_differ_decodes_per_session(monkeypatch):
    """A build whose batched steps are not bit-identical (the check at the
    first call) gets no shared context: the pool decodes per session."""
    import ds4.engines.llamacpp as L

    monkeypatch.setenv("DS4_PROBE_CACHE", "off")  # the check runs, not a kept answer
    eng = L.LlamaCppEngine(model_path=models.model_path("smollm2"))
    try:
        asked = []
        monkeypatch.setattr(B, "batched_exact", lambda *a, **k: asked.append(a) or False)
        assert eng.batched_contexts(2, N_CTX) is None and len(asked) == 1
        assert eng.batched_contexts(3, N_CTX) is None and len(asked) == 1  # checked once
        monkeypatch.undo()
        eng.batched_ok = None
        shared = eng.batched_contexts(2, N_CTX)
        assert shared is not None
        for c in shared.contexts:
            c.close()
    finally:
        eng.close()


# -- a resident taking another's prefix (the shared prefill), without a disk load ---


def _greedy(c, rest, n=6):
    seen = [c.eval(rest).copy()]
    for _ in range(n):
        seen.append(c.eval([int(np.argmax(seen[-1]))]).copy())
    return seen


@pytest.mark.parametrize("name", models.MODELS)
def test_a_sequence_copies_another_s_prefix_as_a_cold_prefill_holds_it(name):
    """``copy_prefix``: the source's whole stream copied, then cut where the
    prompts part (640 tokens: past Gemma 3's 512-token window, so the
    window layers' masked cells must come along), gives every logit vector
    a cold single context gives for the second prompt, step by step; the
    source, which had decoded two tokens, goes on as if nothing happened."""
    eng = models.engine(name)
    base = models.text_tokens(eng, 700)
    src_prompt = base[:650] + eng.tokenize(" apples and pears")
    prompt = base[:640] + eng.tokenize(" a different ending about otters")
    n = 640
    cold = LlamaCppContext(eng, 1024)
    try:
        want = _greedy(cold, prompt)
    finally:
        cold.close()
    shared = B.SharedContext(eng, 3, 1024)
    a, b, other = shared.contexts
    try:
        other.eval(base[:100])  # a third stream holds something else
        a.eval(src_prompt)
        a.eval([5])
        src_logits = a.eval([7]).copy()
        assert b.copy_prefix(a, n)
        assert b.n_past == n and b.tokens == prompt[:n]
        got = _greedy(b, prompt[n:])
        assert all(np.array_equal(x, y) for x, y in zip(want, got, strict=True)), name
        alone = LlamaCppContext(eng, 1024)
        try:
            alone.eval(src_prompt)
            alone.eval([5])
            assert np.array_equal(alone.eval([7]), src_logits)
            assert np.array_equal(a.eval([9]), alone.eval([9]))  # the source is intact
        finally:
            alone.close()
    finally:
        for c in shared.contexts:
            c.close()


def test_a_prefix_is_copied_only_where_the_source_could_rewind_to_it():
    """No copy (False, the context unchanged) from itself, from a context
    outside the batched one, past the source's length, or into the part of a
    windowed import longer than its window, which the source could not
    rewind into either (Gemma 3)."""
    eng = models.engine("gemma3")
    toks = models.text_tokens(eng, 700)
    shared = B.SharedContext(eng, 2, 1024)
    a, b = shared.contexts
    single = LlamaCppContext(eng, 1024)
    try:
        single.eval(toks[:600])
        a.eval(toks[:20])
        b.eval(toks[:30])
        assert not b.copy_prefix(b, 10) and not b.copy_prefix(single, 10) and not b.copy_prefix(a, 21)
        assert b.n_past == 30 and b.tokens == toks[:30]
        state = single.export_state()
        a.import_state(state, 600)  # windowed: 600 > 512, its early window cells are zeros
        a.know_tokens(toks[:600])
        assert not b.copy_prefix(a, 550) and b.n_past == 30
        assert b.copy_prefix(a, 600) and b.n_past == 600  # the whole import: no cut into it
        assert not b.truncate(550) and b.n_past == 600  # and the copy is no more rewindable than its source
    finally:
        single.close()
        for c in shared.contexts:
            c.close()


def test_canonical_mode_batches_only_where_a_padded_step_pays():
    """Under ``--exact canonical`` a resident alone decodes unpadded, so the
    pool batches (each sequence padded) only for a pad of one row: SmolLM2
    (2 rows) yes, Gemma 3 (8 rows) no, unless asked to always (``--batch-decode
    on``); in strict mode every step is padded anyway, and it batches."""
    from ds4.engines.llamacpp import LlamaCppEngine

    for name, pays in (("smollm2", True), ("gemma3", False)):
        can = LlamaCppEngine(model_path=models.model_path(name), exact="canonical")
        strict = LlamaCppEngine(model_path=models.model_path(name), exact="strict")
        assert can.step_rows == strict.step_rows == {"smollm2": 2, "gemma3": 8}[name]
        assert can.batch_pays is pays and strict.batch_pays
        shared = can.batched_contexts(2, N_CTX)
        assert (shared is not None) is pays
        forced = shared or can.batched_contexts(2, N_CTX, always=True)
        assert isinstance(forced, B.SharedContext)
        for c in forced.contexts:
            c.close()


def _underscored(cls):
    """The single-underscore names ``cls``'s own source defines, reads,
    writes, calls or overrides (``self._x``, ``super()._x``, ``other._x``,
    ``def _x``)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_a_sequence_extends_its_base_through_the_protected_interface_only():
    """``SeqContext`` touches no private member of ``LlamaCppContext``: of
    the base's underscore names (its attributes and methods), the subclass
    uses or overrides only those of the base's protected interface
    (``LlamaCppContext.PROTECTED``), each a method of the base documented as
    protected."""
    base = _underscored(LlamaCppContext)
    protected = set(LlamaCppContext.PROTECTED)
    assert len(protected) == len(LlamaCppContext.PROTECTED) and protected <= base
    for name in protected:
        assert "(protected" in (getattr(LlamaCppContext, name).__doc__ or ""), name
    touched = _underscored(B.SeqContext) & base
    assert touched - protected == set()
    assert {"_feed", "_clear", "_portable", "_native", "_release", "_adopt_prefix"} <= touched  # the test reads it
