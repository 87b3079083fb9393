"""Issue 21: the Claude-Code-shaped tool loop, 20 turns, with the official
``anthropic`` client against ``ds4 serve`` processes on 127.0.0.1 over the
scripted reference engine (tests/helpers/cc_serve.py: a ``Bash`` call on every
request, so every turn is ``tool_use``; one token a byte). The loop
(tests/helpers/cc_loop.py): the billing line with a new ``cch`` each request in each
of its three forms, a 3,000-byte system text with ``Today's date is ...``
moving every turn, Claude Code's tools, the assistant's calls echoed and a
user message of ``tool_result`` blocks appended each turn.

Two shapes of the user message that carries the results:

* with a ``<system-reminder>`` text block beside the results (the default
  here): the request ends in a user turn, so the server renders the whole
  history each turn, and the system text's volatile parts decide whether
  it is a prefix of what the live state holds;
* the results alone: the request ends in results for exactly the calls the
  live state generated, and the server continues that state (ds4's
  tool-output match) whatever the client's new system text says.

Usage is Anthropic's accounting as ds4 reports it: ``input_tokens`` 0,
``cache_read_input_tokens`` the reused tokens, ``cache_creation_input_tokens``
the prefilled ones; the prompt is their sum.
"""

from __future__ import annotations

import pytest
from helpers import cc_loop
from helpers.agents import KV_FLAGS, ScriptedServer
from helpers.cc_loop import DATE_RE, FORMS, date_line
from helpers.scripted_engine import ScriptedEngine

from ds4.server.anthropic import MessagesParser
from ds4.server.volatile import SystemText

CTX = 16384
TURNS = 20


class CcServer(ScriptedServer):
    def __init__(self, tmp, name, *args, **kw):
        super().__init__(tmp, name, *args, **kw)
        self.args[:2] = cc_loop.serve_command()[:2]  # tests/helpers/cc_serve.py: a call on every request


def _server(serve_module, name, *flags):
    return serve_module(*KV_FLAGS, *flags, name=name, cls=CcServer, kv=True, ctx=CTX)


@pytest.fixture(scope="module")
def plain(serve_module):
    return _server(serve_module, "plain")


@pytest.fixture(scope="module")
def drop(serve_module):
    return _server(serve_module, "drop", "--prompt-volatile", DATE_RE)


@pytest.fixture(scope="module")
def tail(serve_module):
    return _server(serve_module, "tail", "--prompt-volatile", DATE_RE, "--prompt-volatile-mode", "tail")


@pytest.fixture(scope="module")
def keep(serve_module):
    return _server(serve_module, "keep", "--keep-billing-header", "--prompt-volatile", DATE_RE)


_engine: list[ScriptedEngine] = []


def rendered(body: dict, **volatile) -> str:
    """The prompt a server with these rules renders for ``body`` (in
    process: the parser and the engine's chat rendering)."""
    if not _engine:
        _engine.append(ScriptedEngine())
    conv = MessagesParser(0, CTX, volatile=SystemText(**volatile)).conversation({**body, "model": "m"})
    return _engine[0].render_chat(conv.engine_messages())


def tokens(text: str) -> int:
    """Tokens of rendered text on the reference engine (a byte each, a marker one)."""
    return len(text.encode()) - 11 * text.count("<|im_start|>") - 9 * text.count("<|im_end|>")


def assert_hits(rows: list[dict], what) -> None:
    assert [r["stop_reason"] for r in rows] == ["tool_use"] * len(rows), what
    for r in rows:
        assert r["input_tokens"] == 0 and r["cache_read"] + r["cache_creation"] == r["prompt"], (what, r)
    for r in rows[1:]:
        assert r["cache_read"] >= 0.95 * r["prompt"], (what, r["turn"], r["prompt"], r["cache_read"])
        d = r["ds4"]["divergence"]  # the prompt extends the live state: it leaves it at its end
        assert d["against"] == "live" and d["cached"] == "", (what, r["turn"], d)


def assert_miss_at(rows: list[dict], k: int, text: str, start: int, end: int) -> dict:
    """Turn ``k`` (0-based) missed in ``text`` (its prompt, rendered) between
    bytes ``start`` and ``end``, and its ``divergence`` says so exactly."""
    r = rows[k]
    assert r["cache_read"] < 0.95 * r["prompt"], (k, r["prompt"], r["cache_read"])
    d = r["ds4"]["divergence"]
    assert d["against"] in ("live", "checkpoint"), d
    assert start <= d["byte"] < end, (d, start, end)
    assert d["prompt"] == text[d["byte"] : d["byte"] + 32] and d["token"] == tokens(text[: d["byte"]]), d
    assert d["cached"][:1] != d["prompt"][:1], d
    return d


# -- every turn a hit ----------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_twenty_turns_with_a_new_cch_and_date_each_are_hits_from_turn_2(drop, form):
    """``--prompt-volatile`` (drop) for the date line, the billing line
    removed by default: the whole history rendered every turn is a prefix
    of the live state's from turn 2 on (>= 95% of each prompt read)."""
    rows = cc_loop.loop(drop.base, TURNS, form)
    assert_hits(rows, form)
    # the model was shown the system text without the header and the date line
    first = rows[0]["body"]
    text = rendered(first, patterns=(DATE_RE,))
    assert rows[0]["prompt"] == tokens(text)
    assert rows[0]["header"] not in text and "Today's date" not in text and "(rule 1)" in text
    assert rows[-1]["prompt"] > rows[0]["prompt"] + (TURNS - 1) * 300  # the history grew every turn


@pytest.mark.parametrize("mode", ["drop", "tail", "none"])
def test_results_alone_continue_the_live_state_in_every_mode(plain, drop, tail, mode):
    """The results alone in the user message: each turn continues the live
    tool state, a hit from turn 2 on in every mode, without the flag too.
    (The continued prompt is what the live state holds: without the flag,
    the first turn's date line and, kept, its billing line; the client's
    new ones are not rendered until the history is. In ``tail`` mode the
    request's own date turn follows the results.)"""
    srv = {"drop": drop, "tail": tail, "none": plain}[mode]
    rows = cc_loop.loop(srv.base, 8, "separate", reminder=False)  # (the 20-turn loop above; shorter here)
    assert_hits(rows, mode)
    assert "live continuation match=tool-output-ids" in srv.text_log()


# -- misses, and where they are -------------------------------------------------
def test_without_the_flag_the_date_line_misses_every_turn(plain):
    """No ``--prompt-volatile``: each turn leaves what the server holds at
    the date line's seconds, and ``divergence`` points there (the reference
    engine cannot rewind: the whole prompt is prefilled again)."""
    rows = cc_loop.loop(plain.base, 3, "block")
    assert [r["stop_reason"] for r in rows] == ["tool_use"] * 3
    for k in range(1, 3):
        text = rendered(rows[k]["body"])
        assert rows[k]["prompt"] == tokens(text)
        line = date_line(k)
        at = text.index(line)
        d = assert_miss_at(rows, k, text, at + len("Today's date is "), at + len(line))
        if d["against"] == "live":
            assert d["cached"].startswith(date_line(k - 1)[d["byte"] - at :]), d


@pytest.mark.parametrize("form", FORMS)
def test_a_kept_billing_header_misses_at_its_cch(keep, form):
    """``--keep-billing-header`` (the date line dropped): every turn misses
    inside the header's ``cch=`` value, which ``divergence`` shows."""
    rows = cc_loop.loop(keep.base, 3, form)
    assert [r["stop_reason"] for r in rows] == ["tool_use"] * 3
    for k in range(1, 3):
        text = rendered(rows[k]["body"], keep_billing_header=True, patterns=(DATE_RE,))
        hdr = rows[k]["header"]
        cch = text.index(hdr) + hdr.index("cch=") + len("cch=")
        assert_miss_at(rows, k, text, cch, cch + 5)


def test_tail_mode_is_a_hit_and_shows_each_turn_its_own_date(tail):
    """``--prompt-volatile-mode tail`` moves the date line into a system
    turn after the last message. The canonical checkpoint of a turn leaves
    that turn out (the next request renders it after its own last message):
    the live state after turn k is the stable history and the reply, so
    turn k+1, the whole history rendered, is a hit from turn 2 on, and each
    turn's prompt ends in its own date (the model sees today's)."""
    rows = cc_loop.loop(tail.base, 8, "separate")
    assert_hits(rows, "tail")
    for k, r in enumerate(rows):
        text = rendered(r["body"], patterns=(DATE_RE,), mode="tail")
        assert r["prompt"] == tokens(text)
        assert text.rindex("<|im_start|>system\n" + date_line(k)) > text.rindex("<|im_start|>user\n"), k
