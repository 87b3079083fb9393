"""Every rung of the ladder on both real models (tests/helpers/models.py): live,
rewrite, disk, remote (Redis) and a ``kill -9``'d process's checkpoints,
with checkpoints taken during prefill (cold), after generation
(continued), and at evict; each turn's greedy reply equals a cold
single-session prefill's; a reply whose ids are not its text's own
tokenization is cut by the token check on the live, disk and remote rungs;
a regenerated reply (the same prompt again) rewinds live or resumes from disk.
Gemma 3's rewind limits and the ladder's honest
REBUILD_NEEDED are here too, with an engine double that cannot rewind
(llama.cpp's recurrent memory refuses a partial ``seq_rm``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers.cold_cache import cached, engine_key
from helpers.models import MODELS, engine, model_path
from helpers.redis_servers import RedisNode

import ds4
from ds4.keytext import tokenize_prompt
from ds4.kvstore.remote import RemoteTier
from ds4.recovery import recover

GEN = 8
CTX = 4096


def story(eng, n_sentences=70, tail=""):
    """A raw-text prompt of about 1,000-1,300 tokens (BOS is added by the
    ladder for the models that want it)."""
    s = "The quick brown fox jumps over the lazy dog near the river bank. "
    return s * n_sentences + tail


def cold_reply(eng, prompt):
    """Greedy reply of a cold, single-session prefill (no store), computed
    once per engine and prompt (several tests compare with the same one:
    tests/helpers/cold_cache.py)."""

    def compute():
        s = ds4.Session(eng, ctx=CTX)
        rep = recover(s, None, prompt)
        assert rep.rung == "prefill"
        return s.generate(GEN)

    return list(cached(("rungs.cold_reply", engine_key(eng), CTX, GEN, prompt), compute))


def store(d, **kw):
    return ds4.KVStore(d, budget_mb=4096, min_tokens=16, **kw)


@pytest.fixture(scope="module", params=MODELS)
def eng(request):
    return engine(request.param)


def test_disk_rung_from_a_cold_save_equals_cold(eng, tmp_path):
    p = story(eng, tail="And then the fox said")
    st = store(tmp_path / "kv")
    s = ds4.Session(eng, ctx=CTX)
    rep = recover(s, st, p, cold_save=True)
    assert rep.rung == "prefill" and rep.cold_saved
    first = s.generate(GEN)
    q = p + " that the river was cold"
    s2 = ds4.Session(eng, ctx=CTX)  # a new session: nothing live
    rep2 = recover(s2, st, q)
    assert rep2.rung == "disk" and rep2.reused_tokens > 0
    assert s2.generate(GEN) == cold_reply(eng, q)
    assert first == cold_reply(eng, p)


def test_continued_checkpoint_after_generation_equals_cold(eng, tmp_path):
    """A checkpoint of prompt + reply (decoded token by token), resumed with
    the next user text in a new session."""
    st = store(tmp_path / "kv")
    p = story(eng, 40)
    s = ds4.Session(eng, ctx=CTX)
    recover(s, st, p)
    reply = s.generate(GEN)
    assert st.store_live_prefix(s, "continued")
    q = p + eng.detokenize(reply) + " The otters laughed."
    s2 = ds4.Session(eng, ctx=CTX)
    rep = recover(s2, st, q)
    assert rep.rung == "disk" and rep.reused_tokens == s.n_past
    assert s2.generate(GEN) == cold_reply(eng, q)


@pytest.mark.parametrize("keep_sentences", [30, 37, 60])
def test_rewrite_rung_across_the_window_equals_cold(eng, keep_sentences):
    """Live prompt A, then prompt B sharing A's first sentences (before,
    around and past Gemma's 512-token window): the rewind serves B."""
    a = story(eng, 75, tail="The end.")
    b = story(eng, keep_sentences, tail="But the heron stood still in the reeds, waiting.")
    s = ds4.Session(eng, ctx=CTX)
    recover(s, None, a)
    rep = recover(s, None, b)
    assert rep.rung == "rewrite" and rep.reused_tokens > 0
    assert s.generate(GEN) == cold_reply(eng, b)


def test_live_rung_equals_cold(eng):
    p = story(eng, 30)
    s = ds4.Session(eng, ctx=CTX)
    recover(s, None, p)
    reply = s.generate(GEN)
    q = p + eng.detokenize(reply) + " Again."
    rep = recover(s, None, q)
    assert rep.rung == "live"
    assert s.generate(GEN) == cold_reply(eng, q)


def test_prompt_checkpoints_are_on_where_rewind_cannot_reach(eng):
    """Gemma's loaded states cannot be rewound past the window: the ladder
    stores each prompt by default there; SmolLM2 rewinds anything."""
    assert eng.rewind_limited is (eng.n_swa > 0)


def _edit_case(eng, st, sess, *, prompt_save=None):
    """Turn 1 (long user text, a reply), turn 2; then turn 2 again with the
    reply of turn 1 edited, in ``sess``. Returns the report, the edited
    prompt and turn 1's prompt length in tokens."""
    msgs = [{"role": "user", "content": story(eng, 30, "Tell me about the fox.")}]
    s = ds4.Session(eng, ctx=CTX)
    rep1 = recover(s, st, eng.render_chat(msgs), cold_save=True, prompt_save=prompt_save)
    answer = eng.detokenize(s.generate(GEN))
    turn2 = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the dog?"}]
    recover(s, st, eng.render_chat(turn2), prompt_save=prompt_save)
    s.generate(GEN)
    edited = [*msgs, {"role": "assistant", "content": "The fox is quick."}, {"role": "user", "content": "And the dog?"}]
    sess = sess or s
    rep = recover(sess, st, eng.render_chat(edited), prompt_save=prompt_save)
    return rep, eng.render_chat(edited), rep1.prompt_tokens, sess


def test_edited_last_assistant_turn_resumes_live(eng, tmp_path):
    """The agent rewrites its last answer and asks again in the same
    session: the live state is rewound to turn 1's prompt (exact on both
    models: the live SWA cache keeps every position), the reply is cold's."""
    rep, edited, turn1, s = _edit_case(eng, store(tmp_path / "kv"), None)
    assert rep.rung == "rewrite" and rep.reused_tokens >= turn1 - 1
    assert s.generate(GEN) == cold_reply(eng, edited)


def test_edited_last_assistant_turn_resumes_from_a_checkpoint(eng, tmp_path):
    """The same after a restart (a new session, nothing live): turn 1's
    prompt checkpoint serves the edit, not a prefill from zero. Gemma stores
    it by default; SmolLM2 when asked to (it does not need it live)."""
    st = store(tmp_path / "kv")
    fresh = ds4.Session(eng, ctx=CTX)
    rep, edited, turn1, _ = _edit_case(eng, st, fresh, prompt_save=None if eng.rewind_limited else True)
    assert rep.rung == "disk" and rep.reused_tokens >= turn1 - 1, rep.events
    assert fresh.generate(GEN) == cold_reply(eng, edited)


def test_evict_checkpoint_is_exact(eng, tmp_path):
    """The live session is replaced by another conversation: its state is
    saved (reason evict), and a new session resumes it exactly."""
    st = store(tmp_path / "kv")
    a = story(eng, 45, "First conversation.")
    s = ds4.Session(eng, ctx=CTX)
    recover(s, st, a)
    reply = s.generate(GEN)
    held = s.n_past
    other = "A completely different text about ships and the sea. " * 20
    rep = recover(s, st, other)
    assert rep.evict_saved
    q = a + eng.detokenize(reply) + " More."
    s2 = ds4.Session(eng, ctx=CTX)
    rep2 = recover(s2, st, q)
    assert rep2.rung == "disk" and rep2.reused_tokens == held
    assert s2.generate(GEN) == cold_reply(eng, q)


def test_remote_rung_equals_cold(eng, tmp_path):
    srv = RedisNode(str(tmp_path / "r")).start()
    a = store(tmp_path / "a", remote=RemoteTier(srv.url))
    b = store(tmp_path / "b", remote=RemoteTier(srv.url))
    try:
        p = story(eng, 40, "Shared text.")
        s = ds4.Session(eng, ctx=CTX)
        assert recover(s, a, p, cold_save=True).cold_saved
        a.remote.flush(30)
        q = p + " Then it rained."
        s2 = ds4.Session(eng, ctx=CTX)
        rep = recover(s2, b, q)  # b's directory is empty: Redis serves it
        assert rep.rung == "remote" and rep.reused_tokens > 0
        assert s2.generate(GEN) == cold_reply(eng, q)
    finally:
        a.close()
        b.close()
        srv.stop()


_WRITER = textwrap.dedent(
    """
    import sys, ds4
    from ds4.recovery import recover
    eng = ds4.LlamaCppEngine(model_path=sys.argv[1])
    st = ds4.KVStore(sys.argv[2], budget_mb=4096, min_tokens=16)
    s = ds4.Session(eng, ctx=4096)
    recover(s, st, sys.argv[3], cold_save=True)
    s.generate(8)
    st.store_live_prefix(s, "continued")
    print("saved", flush=True)
    sys.stdin.read()  # wait to be killed
    """
)


def test_checkpoints_of_a_killed_process_resume_exactly(eng, tmp_path):
    """A process saves, then dies by SIGKILL (no shutdown, no flush of
    anything): a new process's store serves its checkpoint exactly."""
    d = str(tmp_path / "kv")
    p = story(eng, 35, "Before the crash.")
    with subprocess.Popen(
        [sys.executable, "-c", _WRITER, model_path(_name(eng)), d, p],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as proc:
        try:
            assert proc.stdout.readline().strip() == b"saved"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert any(f.endswith(".kv") for f in os.listdir(d))
    q = p + " After the crash."
    s = ds4.Session(eng, ctx=CTX)
    rep = recover(s, store(d), q)
    assert rep.rung == "disk"
    assert s.generate(GEN) == cold_reply(eng, q)


def _name(eng):
    return next(m for m in MODELS if model_path(m) == eng.model_path)


# -- an engine that cannot rewind (recurrent memory) --------------------------------
class _NoRewind:
    """An engine double over a real model whose contexts refuse every
    partial removal, as llama.cpp's recurrent memory does."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    rewind_limited = True

    def new_context(self, n_ctx):
        ctx = self._inner.new_context(n_ctx)
        ctx.truncate = lambda n: n == ctx.n_past or (n == 0 and (ctx.reset() or True))
        return ctx


def test_an_engine_that_cannot_rewind_rebuilds_from_a_checkpoint(eng, tmp_path):
    """Live prompt A; prompt B shares part of it. The engine cannot rewind:
    REBUILD_NEEDED (the reason in the report), then the store's shorter
    checkpoint, and B's reply is cold's."""
    no = _NoRewind(eng)
    st = store(tmp_path / "kv")
    # the head ends at a token the prompts keep (a trailing space would
    # merge with the next word: the token check cuts that token, which an
    # engine that cannot rewind cannot do)
    head = story(eng, 20).rstrip()
    s = ds4.Session(no, ctx=CTX)
    s.snapshots.configure(0, 0, 0)  # no RAM snapshot to go back to (tests/test_models_tiny.py has them)
    recover(s, st, head, cold_save=True, prompt_save=False)
    a = head + " The first ending, with a long tail." * 5
    recover(s, st, a, prompt_save=False)
    b = head + " A second ending."
    rep = recover(s, st, b, prompt_save=False)
    assert rep.rung == "disk", rep.events
    assert any("rewrite needs rebuild" in e for e in rep.events), rep.events
    assert s.generate(GEN) == cold_reply(eng, b)


def test_rewind_into_a_loaded_state(eng, tmp_path):
    """A session loaded from disk, then a prompt that leaves the loaded
    prefix: SmolLM2's full cache rewinds into it (rung rewrite); a Gemma
    state longer than the window lost the window layers' earlier cells, so
    the rewind is refused (REBUILD_NEEDED: here, with no store, a prefill).
    Both replies are cold's."""
    st = store(tmp_path / "kv")
    a = story(eng, 75, "The end.")
    s = ds4.Session(eng, ctx=CTX)
    recover(s, st, a, prompt_save=False)
    assert st.store_live_prefix(s, "continued")
    loaded = ds4.Session(eng, ctx=CTX)
    assert recover(loaded, st, a + " More.", prompt_save=False).rung == "disk"
    b = story(eng, 30, "But the heron stood still in the reeds, waiting.")
    rep = recover(loaded, None, b)
    if eng.rewind_limited:
        assert rep.rung == "prefill", rep.events
        assert any("rewrite needs rebuild" in e for e in rep.events), rep.events
    else:
        assert rep.rung == "rewrite" and rep.reused_tokens > 300, rep.events
    assert loaded.generate(GEN) == cold_reply(eng, b)


def _respelled(eng, text: str) -> list[int]:
    """Ids that spell ``text`` byte for byte but are not its tokenization:
    each character tokenized on its own (what a model may generate)."""
    ids = [t for ch in text for t in eng.tokenize(ch)]
    assert eng.detokenize(ids) == text and ids != eng.tokenize(text)
    return ids


@pytest.mark.parametrize("rung", ["live", "disk", "remote"])
def test_a_reply_respelled_is_cut_by_the_token_check(eng, tmp_path, rung):
    """A reply whose ids spell a whitespace run another way than its text
    re-tokenizes is reused only up to the first id the prompt's own
    tokenization does not have, on every rung; the next turn's reply is a
    cold prefill's."""
    p = story(eng, 20)
    reply = "  Well,    the  river   was   cold.\n\n  "
    s = ds4.Session(eng, ctx=CTX)
    recover(s, None, p)
    head, ids = s.tokens, _respelled(eng, reply)
    s.sync(head + ids)
    q = p + reply + "And then?"
    kept = s.common_prefix(tokenize_prompt(eng, q))
    assert 0 < kept < s.n_past
    node = RedisNode(str(tmp_path / "r")).start() if rung == "remote" else None
    st = store(tmp_path / "kv", **({"remote": RemoteTier(node.url)} if node else {}))
    try:
        if rung != "live":
            assert st.store_live_prefix(s, "continued")
            s = ds4.Session(eng, ctx=CTX)
        if node is not None:
            st.remote.flush(30)
            st.close()
            st = store(tmp_path / "empty", remote=RemoteTier(node.url))  # only Redis holds it
        rep = recover(s, st, q, evict_save=False, prompt_save=False)
        assert rep.token_check == {"against": rung, "kept": kept, "of": len(head) + len(ids)}, rep.token_check
        assert rep.rung == ("rewrite" if rung == "live" else rung) and rep.reused_tokens == kept
        assert s.generate(GEN) == cold_reply(eng, q)
    finally:
        st.close()
        if node is not None:
            node.stop()


@pytest.mark.parametrize("rung", ["live", "disk"])
def test_a_regenerated_reply_equals_cold(eng, tmp_path, rung):
    """The same prompt sent again after its reply (a client's "regenerate"):
    the live session rewinds to the prompt's end, a new process resumes from
    the prompt's cold checkpoint (the continued one, prompt and reply, is not
    a prefix of it); either way the reply is a cold prefill's."""
    p = story(eng, 40, "What did the fox see?")
    st = store(tmp_path / "kv")
    s = ds4.Session(eng, ctx=CTX)
    assert recover(s, st, p, cold_save=True).cold_saved
    s.generate(GEN)
    assert st.store_live_prefix(s, "continued")
    if rung == "disk":
        s = ds4.Session(eng, ctx=CTX)
    rep = recover(s, st, p, evict_save=False, prompt_save=False)
    assert rep.rung == ("rewrite" if rung == "live" else "disk") and rep.reused_tokens > 0, rep.rung
    assert s.generate(GEN) == cold_reply(eng, p)
