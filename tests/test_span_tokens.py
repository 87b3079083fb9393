"""Prompt spans tokenized once (``ds4.keytext.SpanTokens``) and the
divergence's span naming (``transient_span``) without a whole-text scan.

A chat renders its whole history every turn; each message is a span
tokenized on its own, so the engine's :class:`SpanTokens` returns a long
span's tokens from memory from the second turn on. What it returns must be
what the tokenizer returns (exactness), within its bound, from any thread."""

from __future__ import annotations

import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4
from ds4 import keytext
from ds4.keytext import BUILTIN_TRANSIENT, Prompt, SpanTokens, span_tokens, tokenize_prompt


class Counting:
    """An engine's tokenizer that counts the spans it is asked for."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def tokenize(self, text, special=False):
        self.calls += 1
        return self.inner.tokenize(text, special=special)


@pytest.fixture(scope="module")
def smollm2():
    return ds4.LlamaCppEngine()


def _chat(eng, turns):
    msgs = [{"role": "system", "content": "You are a careful assistant who answers briefly. " * 12}]
    for k in range(turns):
        msgs += [
            {"role": "user", "content": f"Question {k}: what is in   the  box {k}?\n\n" * 20},
            {"role": "assistant", "content": f"Answer {k}: a fox,\tthen  a heron. " * 15},
        ]
    return eng.render_chat([*msgs, {"role": "user", "content": "And now?"}])


@pytest.mark.parametrize("which", ["reference", "llamacpp"])
def test_a_cached_span_is_the_tokenizers_own(which, eng, smollm2):
    engine = eng if which == "reference" else smollm2
    counting = Counting(engine)
    for turns in range(1, 5):  # each turn's prompt holds the last one's messages again
        prompt = _chat(engine, turns)
        assert isinstance(prompt, Prompt)
        want = [t for text, sp in prompt.segments for t in engine.tokenize(text, special=sp)]
        calls = counting.calls
        assert tokenize_prompt(counting, prompt) == want
        long_spans = sum(len(text) >= 256 for text, _ in prompt.segments)
        asked = counting.calls - calls
        # only the new long spans (the last turn's two messages) and the short ones go to the tokenizer
        assert asked == len(prompt.segments) - long_spans + (1 + 2 if turns == 1 else 2), (turns, asked)
        assert tokenize_prompt(counting, prompt) == want  # the same prompt again: every long span a hit
        assert counting.calls - calls - asked == len(prompt.segments) - long_spans


def test_the_cache_keeps_its_bound_and_forgets_the_oldest(eng):
    cache = SpanTokens(min_chars=8, max_chars=1000)
    spans = [f"span number {k} " * 10 for k in range(40)]  # about 150 characters each
    for s in spans:
        assert cache.tokens(eng, s, False) == eng.tokenize(s)
        assert cache.chars <= 1000
    assert 0 < len(cache) < 40 and cache.misses == 40
    cache.tokens(eng, spans[-1], False)  # the newest is kept, the first long gone
    assert cache.hits == 1
    cache.tokens(eng, spans[0], False)
    assert cache.hits == 1 and cache.misses == 41
    # a span longer than the whole bound is tokenized, never kept
    big = "x y " * 600
    assert cache.tokens(eng, big, False) == eng.tokenize(big) and cache.chars <= 1000


def test_markers_and_text_are_kept_apart(smollm2):
    cache = SpanTokens(min_chars=4)
    text = "<|im_start|>user hello there<|im_end|>"
    as_text, as_markers = cache.tokens(smollm2, text, False), cache.tokens(smollm2, text, True)
    assert as_text == smollm2.tokenize(text) and as_markers == smollm2.tokenize(text, special=True)
    assert as_text != as_markers and cache.misses == 2


def test_threads_get_the_tokenizers_answer(smollm2):
    prompts = [_chat(smollm2, k) for k in range(1, 6)]
    want = [tokenize_prompt(smollm2, p) for p in prompts]
    keytext._SPAN_TOKENS.pop(smollm2, None)  # a fresh cache, filled by the threads at once
    errors: list[str] = []

    def run(i: int) -> None:
        for j in range(20):
            k = (i + j) % len(prompts)
            if tokenize_prompt(smollm2, prompts[k]) != want[k]:
                errors.append(f"thread {i} prompt {k}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert span_tokens(smollm2).hits > 0


# the divergence's span naming against a whole-text scan (what it was before)
_SCAN = tuple(
    re.compile(rb"\s*(?:" + p.encode().replace(b"<", b"\xff?<") + rb")", re.DOTALL) for p in BUILTIN_TRANSIENT
)


def _scan(text: bytes, at: int) -> str | None:
    for p in _SCAN:
        for m in p.finditer(text):
            if m.start() > at:
                break
            if at < m.end():
                return re.search(rb"<[A-Za-z_][\w-]*>", m.group(0)).group(0).decode()
    return None


PIECES = [
    b"<system-reminder>",
    b"</system-reminder>",
    b"\xff<system-reminder>",
    b"\xff</system-reminder>",
    b"<environment_details>",
    b"</environment_details>",
    b"\xff",
    b" ",
    b"\n",
    b"\t",
    b"word",
    b"<",
    b"system-reminder>",
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.integers(min_value=0, max_value=200))
def test_transient_span_names_what_a_whole_scan_names(pieces, at):
    text = b"".join(pieces)
    at = at % (len(text) + 1)
    assert keytext.transient_span(text, at) == _scan(text, at)
