"""Volatile system-prompt lines (issue 21, item 1), with the official
``anthropic`` and ``openai`` clients against servers over the scripted
reference engine: Claude Code's ``x-anthropic-billing-header`` line (its
``cch`` changes on every request) is removed before rendering and keying,
in each form a client sends it, and only that line; ``--keep-billing-header``
keeps it (and the loop then misses at the header); ``--prompt-volatile``
drops or moves the lines of system text it matches (a date line), never a
user's text."""

from __future__ import annotations

import secrets

import anthropic
import pytest
from helpers.agents import ATOOLS, KV_FLAGS, RTOOLS, SYSTEM, ScriptedServer, tool_results
from helpers.cc_loop import echoed
from helpers.scripted_engine import ScriptedEngine
from helpers.server import stored_texts

from ds4.server.anthropic import MessagesParser
from ds4.server.volatile import SystemText

FORMS = ["string", "block", "separate"]
DATE = "^Current date:"
#: a long system text (Claude Code's is ~2,000 tokens) with a line that
#: changes on every turn in the middle of it
HEAD = "You are an agent. Use the tools to answer.\n" + "\n".join(f"rule-{i}: be exact and brief." for i in range(200))
TAIL = "\n".join(f"note-{i}: keep the answer short." for i in range(200))


def header() -> str:
    """Claude Code's billing line, with a fresh ``cch`` (5 hex digits)."""
    return f"x-anthropic-billing-header: cc_version=2.1.37.3a1; cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"


def with_header(form: str, text: str = SYSTEM, hdr: str | None = None):
    hdr = hdr or header()
    if form == "string":
        return f"{hdr}\n{text}"
    if form == "block":
        return [{"type": "text", "text": f"{hdr}\n{text}"}]
    return [{"type": "text", "text": hdr}, {"type": "text", "text": text}]


def dated(k: int) -> str:
    return f"{HEAD}\nCurrent date: 2026-12-01 21:00:{k:02d}\n{TAIL}"


UNDATED = f"{HEAD}\n{TAIL}"
CTX = 16384


def _server(serve_module, name, *flags):
    return serve_module(*KV_FLAGS, *flags, name=name, cls=ScriptedServer, kv=True, ctx=CTX)


@pytest.fixture(scope="module")
def plain(serve_module):
    return _server(serve_module, "plain")


@pytest.fixture(scope="module")
def keep(serve_module):
    return _server(serve_module, "keep", "--keep-billing-header")


@pytest.fixture(scope="module")
def drop(serve_module):
    return _server(serve_module, "drop", "--prompt-volatile", DATE)


@pytest.fixture(scope="module")
def tail(serve_module):
    return _server(serve_module, "tail", "--prompt-volatile", DATE, "--prompt-volatile-mode", "tail")


def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=300)


def count(srv, system, messages=None) -> int:
    messages = messages or [{"role": "user", "content": "Look up 3."}]
    kw = {} if system is None else {"system": system}
    with client(srv) as c:
        return c.messages.count_tokens(model="any", messages=messages, tools=ATOOLS, **kw).input_tokens


def ask(srv, messages, system):
    """(the assistant message to append, stop_reason, usage, prompt tokens)."""
    with client(srv) as c:
        r = c.messages.create(
            model="claude-x", max_tokens=300, system=system, messages=messages, tools=ATOOLS, timeout=300
        )
    content = echoed(r.content)
    u = r.usage
    return (
        {"role": "assistant", "content": content},
        r.stop_reason,
        u,
        u.cache_read_input_tokens + u.cache_creation_input_tokens,
    )


def rendered(system, keep_billing_header=False, **rules) -> str:
    """The prompt a server renders for this system (in process: the parser
    and the conversation a ``/v1/messages`` turn renders)."""
    p = MessagesParser(0, CTX, volatile=SystemText(keep_billing_header=keep_billing_header, **rules))
    conv = p.conversation(
        {"model": "m", "system": system, "messages": [{"role": "user", "content": "Look up 3."}], "tools": ATOOLS}
    )
    return ScriptedEngine().render_chat(conv.engine_messages())


# -- the billing line ----------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_the_billing_line_is_removed_from_the_count_and_the_prompt(plain, keep, form):
    hdr = header()
    base = count(plain, SYSTEM)
    assert count(plain, with_header(form, hdr=hdr)) == base  # today 691 of 1,485 for string and block
    assert rendered(with_header(form, hdr=hdr)) == rendered(SYSTEM)
    # --keep-billing-header: the line and its newline are in the prompt (byte tokens)
    assert count(keep, SYSTEM) == base
    assert count(keep, with_header(form, hdr=hdr)) == base + len(hdr) + 1
    kept = rendered(with_header(form, hdr=hdr), keep_billing_header=True)
    assert kept == rendered(SYSTEM).replace(SYSTEM, f"{hdr}\n{SYSTEM}")


def test_only_the_first_line_and_only_that_line_goes(plain):
    hdr = header()
    none = count(plain, None)
    assert count(plain, [{"type": "text", "text": hdr}]) == none  # a block of the header alone disappears
    assert count(plain, hdr) == none
    # not the first line: kept, as any text
    assert count(plain, f"{SYSTEM}\n{hdr}") == count(plain, SYSTEM) + len(hdr) + 1
    # the rest of the text is kept whatever it is, a blank line or another header-like line included
    assert rendered(f"{hdr}\n\nx-anthropic-note: {SYSTEM}") == rendered(f"\nx-anthropic-note: {SYSTEM}")
    # another x-anthropic- block alone disappears, as in ds4; as a first line, that line only
    assert rendered([{"type": "text", "text": "x-anthropic-other: 1"}, {"type": "text", "text": SYSTEM}]) == rendered(
        SYSTEM
    )
    assert rendered(f"x-anthropic-other: 1\n{SYSTEM}") == rendered(SYSTEM)


def test_chat_and_responses_system_text_lose_the_billing_line(plain, keep):
    hdr = header()
    for srv, extra in ((plain, 0), (keep, len(hdr) + 1)):
        with srv.client() as c:
            for role in ("system", "developer"):
                msgs = [{"role": role, "content": f"{hdr}\n{SYSTEM}"}, {"role": "user", "content": "hi"}]
                r = c.chat.completions.create(model="m", messages=msgs, max_tokens=2)
                ref = c.chat.completions.create(
                    model="m", messages=[{"role": role, "content": SYSTEM}, msgs[1]], max_tokens=2
                )
                assert r.usage.prompt_tokens == ref.usage.prompt_tokens + extra, (srv, role)
            r = c.responses.create(model="m", instructions=f"{hdr}\n{SYSTEM}", input="hi", max_output_tokens=2)
            ref = c.responses.create(model="m", instructions=SYSTEM, input="hi", max_output_tokens=2)
            assert r.usage.input_tokens == ref.usage.input_tokens + extra
            dev = [{"role": "developer", "content": f"{hdr}\n{SYSTEM}"}, {"role": "user", "content": "hi"}]
            r = c.responses.create(model="m", input=dev, tools=RTOOLS, max_output_tokens=2)
            ref = c.responses.create(model="m", input=[{**dev[0], "content": SYSTEM}, dev[1]], tools=RTOOLS)
            assert r.usage.input_tokens == ref.usage.input_tokens + extra
    # logged once per client (its cc_version and cc_entrypoint), never when kept
    assert plain.text_log().count("x-anthropic-billing-header removed") == 1
    assert "x-anthropic-billing-header removed" not in keep.text_log()


def loop(srv, system_of, turns=6, tag=""):
    """An Anthropic tool loop, the system text ``system_of(turn)`` each turn:
    [(stop_reason, usage, prompt tokens)]."""
    msgs = [{"role": "user", "content": f"Look up 5 ({tag})."}]
    out = []
    for turn in range(turns):
        msg, reason, usage, total = ask(srv, msgs, system_of(turn))
        out.append((reason, usage, total))
        msgs.append(msg)
        if reason == "tool_use":
            msgs.append(tool_results(msg))
        else:
            assert reason == "end_turn" and msg["content"][0]["text"].startswith("Result: value of n=")
            msgs.append({"role": "user", "content": f"And {turn}?"})
    return out


@pytest.mark.parametrize("form", FORMS)
def test_a_fresh_cch_every_turn_is_still_a_cache_hit(plain, keep, form):
    turns = loop(plain, lambda k: with_header(form), tag=form)
    assert [r for r, _, _ in turns] == ["tool_use", "end_turn"] * 3
    for k, (_, u, total) in enumerate(turns[1:], 1):
        assert u.cache_read_input_tokens >= 0.95 * total, (form, k, u)
    # the model saw the whole system text: the prompt is the header-less one's
    assert turns[0][2] == count(plain, SYSTEM, [{"role": "user", "content": f"Look up 5 ({form})."}])
    # kept, the header's cch misses every turn the history is rendered (a user's turn), before the system text
    turns = loop(keep, lambda k: with_header(form), tag=form)
    for k in (2, 4):
        _, u, total = turns[k]
        assert u.cache_read_input_tokens <= total - len(SYSTEM), (form, k, u)


# -- --prompt-volatile ---------------------------------------------------------
def test_a_date_line_changing_every_turn_misses_without_the_flag(plain):
    turns = loop(plain, dated, tag="no flag")
    for k in (2, 4):
        _, u, total = turns[k]
        assert u.cache_read_input_tokens < 0.9 * total, (k, u)


@pytest.mark.parametrize("mode", ["drop", "tail"])
def test_a_date_line_changing_every_turn_is_cached_with_the_flag(plain, drop, tail, mode):
    srv = drop if mode == "drop" else tail
    turns = loop(srv, dated, tag=mode)
    assert [r for r, _, _ in turns] == ["tool_use", "end_turn"] * 3
    for k, (_, u, total) in enumerate(turns[1:], 1):
        assert u.cache_read_input_tokens >= 0.95 * total, (mode, k, u)
    first = [{"role": "user", "content": f"Look up 5 ({mode})."}]
    assert turns[0][2] == count(srv, dated(0), first)
    # drop: the model sees the text without the line; tail: the line too, in a system turn of its own
    # (<|im_start|>, "system\n", the line, <|im_end|>, "\n": byte tokens and two markers)
    line = len("Current date: 2026-12-01 21:00:00")
    assert turns[0][2] == count(plain, UNDATED, first) + (0 if mode == "drop" else 1 + 7 + line + 1 + 1)


def test_a_user_message_matching_the_pattern_is_untouched(plain, drop, tail):
    msgs = [{"role": "user", "content": "Current date: 1999-01-01 00:00:00\nLook up 3."}]
    n = count(plain, SYSTEM, msgs)
    assert count(drop, SYSTEM, msgs) == n and count(tail, SYSTEM, msgs) == n
    p = rendered(SYSTEM, patterns=(DATE,), mode="drop")
    assert rendered(SYSTEM) == p


def test_tail_mode_renders_the_lines_after_the_rest_of_the_system_text(tmp_path, serve):
    """Over the wire: the prompt a tail server rendered (its usage counts
    the date turn after the user's message), and the checkpoint it keeps at
    shutdown: the turn's canonical rendering, the stable system text, the
    user's message and the reply without the date turn, which the next
    request renders after its own last message."""
    kv = tmp_path / "kv"
    flags = ("--prompt-volatile", DATE, "--prompt-volatile-mode", "tail")
    srv = serve(*KV_FLAGS, *flags, name="t", cls=ScriptedServer, tmp=tmp_path, kv=True, ctx=CTX)
    user = "Current date: 1999-01-01 00:00:00 is what my note says. Look up 3."
    with client(srv) as c:
        m = c.messages.create(model="m", max_tokens=300, system=dated(7), messages=[{"role": "user", "content": user}])
    srv.stop()
    date = "Current date: 2026-12-01 21:00:07"
    body = {"model": "m", "system": dated(7), "messages": [{"role": "user", "content": user}]}
    conv = MessagesParser(0, CTX, volatile=SystemText(patterns=(DATE,), mode="tail")).conversation(body)
    prompt = ScriptedEngine().render_chat(conv.engine_messages())  # what the server renders, in process
    head = prompt[: prompt.index("<|im_start|>user")]
    assert head.endswith(f"{HEAD}\n{TAIL}<|im_end|>\n")  # the stable system text: the line and its newline out
    assert prompt.endswith(f"<|im_start|>system\n{date}<|im_end|>\n<|im_start|>assistant\n")
    seen = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + (m.usage.cache_creation_input_tokens or 0)
    # a byte a token on the reference engine, a marker one
    assert seen == len(prompt.encode()) - 11 * prompt.count("<|im_start|>") - 9 * prompt.count("<|im_end|>")
    (text,) = [t.decode() for t, reason, _ in stored_texts(str(kv)).values() if reason == "shutdown"]
    assert text.startswith(head) and user in text and date not in text
    assert text.endswith(f"{user}<|im_end|>\n<|im_start|>assistant\n{m.content[0].text}<|im_end|>\n")
    # in process: the same, and drop leaves the line out
    assert rendered(dated(7), patterns=(DATE,), mode="tail").count(date) == 1
    assert date not in rendered(dated(7), patterns=(DATE,), mode="drop")


def test_a_bad_pattern_is_a_flag_error(tmp_path):
    srv = ScriptedServer(tmp_path, "bad", "--no-kv-cache", "--prompt-volatile", "([a-z")
    with pytest.raises(AssertionError, match="--prompt-volatile") as ei:
        srv.start()
    srv.log.close()  # start() leaves it open when the process exits
    assert "exited with 2" in str(ei.value) and "is not a valid regular expression" in str(ei.value)


def test_the_rules_in_process():
    """SystemText on engine chat turns: matched lines of every system turn,
    in order, dropped or moved after the last turn; user and assistant text
    untouched; a system turn of volatile lines only disappears."""
    turns = [
        {"role": "system", "content": "A\nCurrent date: 1\nB\ncwd: /x"},
        {"role": "user", "content": "Current date: user's"},
        {"role": "assistant", "content": "cwd: assistant's"},
        {"role": "system", "content": "Current date: 2"},
        {"role": "user", "content": "go"},
    ]
    drop = SystemText(patterns=(DATE, "^cwd:"))
    assert drop.render(turns) == [{"role": "system", "content": "A\nB"}, *turns[1:3], turns[4]]
    tail = SystemText(patterns=(DATE, "^cwd:"), mode="tail")
    assert tail.render(turns) == [
        {"role": "system", "content": "A\nB"},
        *turns[1:3],
        turns[4],
        {"role": "system", "content": "Current date: 1\ncwd: /x\nCurrent date: 2"},
    ]
    assert SystemText().render(turns) == turns  # no pattern: nothing moves
    hdr = header()
    assert SystemText().header(f"{hdr}\nrest\nmore") == "rest\nmore"
    assert SystemText().header(hdr) is None and SystemText().header(f"{hdr}\n") is None
    assert SystemText(keep_billing_header=True).header(f"{hdr}\nrest") == f"{hdr}\nrest"
    assert SystemText().header(f"rest\n{hdr}") == f"rest\n{hdr}"
    assert SystemText().header("x-anthropic-other: 1\nrest") == "x-anthropic-other: 1\nrest"  # only on Anthropic
    assert SystemText().header("x-anthropic-other: 1\nrest", anthropic=True) == "rest"
    with pytest.raises(ValueError):
        SystemText(mode="middle")
