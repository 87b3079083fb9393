"""No span prefilled twice (``ds4.frontier``; docs/DESIGN.md, "Frontiers").

Two shapes on SmolLM2 (llama.cpp), each a conversation whose client sends
its last reply back *changed* (an agent dropping a reply's reasoning or
eliding it), so the checkpoint of the whole last turn (prompt + reply) is
never a prefix of the next prompt, and the next turn resumes from the last
turn's prompt end, its *frontier*, or from something older:

* two conversations interleaved on one live session (``--sessions 1``):
  each turn's live state is evicted by the other conversation's turn;
* a conversation whose live state is lost after every turn without a save
  (a new session each turn on one store: a lane whose state was
  invalidated, a save refused), so nothing stores the frontier until a
  load of the same checkpoint followed by the same prefilled span is seen
  again (a reload loop: the store remembers its loads for the process's
  life), which is reported and stored then; from there each turn that
  loads a frontier the guard stored stores its own at once.

Each turn's prefilled span is ``[reused, prompt)`` in tokens; the key text
of the first ``frontier_tokens`` tokens of each span is compared across a
conversation's turns. With the store's ``frontier_tokens=0`` (the guard
off) the same spans are prefilled again on every turn: the control."""

from __future__ import annotations

import pytest

import ds4
from ds4 import frontier
from ds4.keytext import tokenize_prompt
from ds4.turn import GenParams, TurnDriver

CTX = 8192
LIMIT = 512
GEN = GenParams(max_tokens=24)


@pytest.fixture(scope="module")
def smollm2():
    return ds4.LlamaCppEngine()


def _system(k: int) -> str:
    return f"You are agent {k}. Answer in one short sentence and never use lists. " * 6


def _task(k: int, turn: int) -> str:
    return f"Task {turn} of agent {k}: read the log lines below and say which failed.\n" + "".join(
        f"line {turn}.{i}: job {k * 100 + i} finished with status {'ok' if i % 7 else 'failed'}\n" for i in range(32)
    )


class Convo:
    """One agent's messages; each reply is sent back elided."""

    def __init__(self, k: int):
        self.k, self.msgs, self.turn = k, [{"role": "system", "content": _system(k)}], 0

    def prompt(self, eng):
        self.turn += 1
        self.msgs.append({"role": "user", "content": _task(self.k, self.turn)})
        return eng.render_chat(self.msgs)

    def replied(self, text: str) -> None:
        self.msgs.append({"role": "assistant", "content": f"(reply {self.turn} elided: {len(text)} characters)"})


def _spans(eng, sess, prompt, rep) -> bytes:
    """The key text of the first LIMIT tokens the turn prefilled (b"" when fewer)."""
    toks = tokenize_prompt(eng, prompt)
    span = toks[rep.reused_tokens : rep.reused_tokens + LIMIT]
    return sess.key_of(span) if len(span) == LIMIT else b""


def _twice(spans: list[bytes]) -> list[int]:
    """The turns whose prefilled span of LIMIT tokens an earlier turn prefilled."""
    return [i for i, s in enumerate(spans) if s and s in spans[:i]]


@pytest.mark.parametrize("limit", [LIMIT, 0])
def test_interleaved_conversations_never_prefill_a_span_twice(smollm2, tmp_path, limit):
    store = ds4.KVStore(str(tmp_path / ("on" if limit else "off")), min_tokens=64, frontier_tokens=limit)
    gen = TurnDriver(smollm2, CTX, store)
    convos = [Convo(0), Convo(1)]
    spans: dict[int, list[bytes]] = {0: [], 1: []}
    frontier_saves = 0
    for _turn in range(3):
        for c in convos:
            prompt = c.prompt(smollm2)
            res = gen.generate(prompt, GEN)
            rep = res.report
            spans[c.k].append(_spans(smollm2, gen.sess, prompt, rep))
            frontier_saves += rep.frontier_saved is not None
            c.replied(res.text)
    twice = {k: _twice(v) for k, v in spans.items()}
    if limit:
        assert twice == {0: [], 1: []}, twice
        assert frontier_saves >= 4  # each evicted conversation's last prompt end
    else:  # the control: every later turn prefills its first task again from the system prompt's checkpoint
        assert twice[0] and twice[1], twice
        assert frontier_saves == 0


@pytest.mark.parametrize("limit", [LIMIT, 0])
def test_a_reload_loop_is_reported_and_its_frontier_stored(smollm2, tmp_path, limit):
    store = ds4.KVStore(str(tmp_path / ("on" if limit else "off")), min_tokens=64, frontier_tokens=limit)
    c = Convo(7)
    spans, reports = [], []
    for _turn in range(5):
        gen = TurnDriver(smollm2, CTX, store)  # a new session each turn, the last one dropped unsaved
        prompt = c.prompt(smollm2)
        res = gen.generate(prompt, GEN)
        reports.append(res.report)
        spans.append(_spans(smollm2, gen.sess, prompt, res.report))
        c.replied(res.text)
        del gen
    loops = [i for i, r in enumerate(reports) if r.reload is not None]
    if limit:
        # turns 2 and 3 (index 1, 2) load the system prompt's cold checkpoint and
        # prefill the first task again; the second such load is the loop
        assert loops == [2], [(r.rung, r.reused_tokens, r.reload) for r in reports]
        r = reports[2]
        assert r.reload["times"] == 2 and r.reload["depth"] == r.reused_tokens and r.frontier_saved
        for i in (3, 4):  # each loads the last frontier and stores its own at once (the state is lost again)
            assert reports[i].rung == "disk" and reports[i].reused_tokens == reports[i - 1].prompt_tokens
            assert reports[i].reload is None and reports[i].frontier_saved
        assert _twice(spans) == [2]  # before the loop was seen, never after
    else:
        assert loops == [] and all(r.frontier_saved is None for r in reports)
        assert _twice(spans) == [2, 3, 4]


def test_the_guard_remembers_a_bounded_number_of_loads():
    class Store:  # any object a weak reference can name (a KVStore in use)
        pass

    st = Store()
    for k in range(frontier.MAX_LOADS + 300):
        assert frontier._remember(frontier._LOADS, st, (f"c{k}.kv", b"d")) == 1
    seen = frontier._LOADS[st]
    assert len(seen) == frontier.MAX_LOADS and ("c0.kv", b"d") not in seen
    assert frontier._remember(frontier._LOADS, st, (f"c{frontier.MAX_LOADS + 299}.kv", b"d")) == 2
    assert frontier._remember(frontier._LOADS, st, ("never.kv", b""), count=False) == 0
    assert ("never.kv", b"") not in seen  # a look-up adds nothing
    n = len(frontier._LOADS)
    del st, seen
    assert len(frontier._LOADS) == n - 1  # dropped with its store (a weak key)


@pytest.mark.parametrize("limit", [LIMIT, 0])
def test_a_resend_after_a_restart_loads_the_prompts_own_state(smollm2, tmp_path, limit):
    """The shutdown save holds the reply after the prompt; with the guard the
    prompt's end is stored beside it, so the same request sent again after a
    restart resumes from its whole prompt and answers as before."""
    c = Convo(3)
    prompt = c.prompt(smollm2)
    gen = TurnDriver(smollm2, CTX, ds4.KVStore(str(tmp_path), min_tokens=64, frontier_tokens=limit))
    first = gen.generate(prompt, GEN)
    assert first.report.rung == "prefill" and gen.shutdown_save() is not None
    again = TurnDriver(smollm2, CTX, ds4.KVStore(str(tmp_path), min_tokens=64, frontier_tokens=limit))
    res = again.generate(prompt, GEN)
    assert res.text == first.text and res.report.rung == "disk"
    if limit:
        assert res.report.reused_tokens == res.report.prompt_tokens
    else:  # the system prompt's cold checkpoint: the task prefilled again
        assert res.report.reused_tokens < res.report.prompt_tokens - LIMIT
