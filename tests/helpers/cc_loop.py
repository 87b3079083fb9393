"""A Claude-Code-shaped agent loop (issue 21), shared by
tests/test_agents_cc_loop.py and benches/bench_agents_cc.py.

What Claude Code sends on every request of a tool loop, as far as the
prompt cache is concerned:

* the billing line ``x-anthropic-billing-header: cc_version=...;
  cc_entrypoint=cli; cch=<5 hex>;`` with a new ``cch`` each request, as its
  own system block, as the first line of the main block, or as the first
  line of a string ``system`` (:data:`FORMS`);
* a long system text (tool rules, style rules, an environment block) with
  ``Today's date is ...`` in the environment block: here the clock moves
  on every turn, so the line differs on every request (:func:`system_text`);
* the tools (``Bash`` first, then ``Read``, ``Edit``, ``Grep``, ``Glob``,
  ``TodoWrite``), ``cache_control`` marks on the system's last block;
* the history: each assistant message echoed with its ``tool_use`` blocks,
  then a user message of ``tool_result`` blocks, and with ``reminder`` a
  ``<system-reminder>`` text block beside them (Claude Code adds such
  blocks to tool-result messages: the request then ends in a user turn,
  not in the results, so the server renders the whole history instead of
  continuing its live tool state).

:func:`script` is the model's side: a scripted reference engine
(tests/helpers/cc_serve.py) answers every request that declares tools with one
``Bash`` call in ds4's convention (python/ds4/server/tools.py), so the loop
never ends and every turn is ``tool_use``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
FORMS = ("separate", "block", "string")
DATE_RE = r"^Today's date is "
#: Claude Code's tool loop: the user's task, then tool calls and results
TASK = "The test tests/test_parser.py::test_empty_input fails. Find out why and fix it."
REMINDER = "<system-reminder>\nThe TodoWrite tool hasn't been used recently; consider using it.\n</system-reminder>"


def _schema(props: dict[str, str], required: list[str]) -> dict:
    """A tool's input schema as Claude Code writes them (no extra
    properties), each string at most 32 characters (so that a forced call
    on a small real model ends within a few dozen tokens)."""
    return {
        "type": "object",
        "properties": {k: {"type": "string", "description": d, "maxLength": 32} for k, d in props.items()},
        "required": required,
        "additionalProperties": False,
    }


TOOLS = [
    {
        "name": "Bash",
        "description": "Executes a given bash command in a persistent shell session with optional timeout.",
        "input_schema": _schema({"command": "The command to execute"}, ["command"]),
    },
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem.",
        "input_schema": _schema({"file_path": "The absolute path to the file to read"}, ["file_path"]),
    },
    {
        "name": "Edit",
        "description": "Performs exact string replacements in files.",
        "input_schema": _schema(
            {"file_path": "The file to modify", "old_string": "The text to replace", "new_string": "The new text"},
            ["file_path", "old_string", "new_string"],
        ),
    },
    {
        "name": "Grep",
        "description": "A powerful search tool built on ripgrep.",
        "input_schema": _schema({"pattern": "The regular expression to search for"}, ["pattern"]),
    },
    {
        "name": "Glob",
        "description": "Fast file pattern matching tool that works with any codebase size.",
        "input_schema": _schema({"pattern": "The glob pattern to match files against"}, ["pattern"]),
    },
    {
        "name": "TodoWrite",
        "description": "Use this tool to create and manage a structured task list for your current coding session.",
        "input_schema": _schema({"todos": "The updated todo list"}, ["todos"]),
    },
]

_RULES = [
    "You are an interactive CLI tool that helps users with software engineering tasks.",
    "Use the instructions below and the tools available to you to assist the user.",
    "IMPORTANT: Assist with defensive security tasks only.",
    "You should be concise, direct, and to the point.",
    "When you run a non-trivial bash command, you should explain what the command does and why you are running it.",
    "Only use emojis if the user explicitly requests it.",
    "When making changes to files, first understand the file's code conventions.",
    "NEVER assume that a given library is available, even if it is well known.",
    "Always follow security best practices. Never introduce code that exposes or logs secrets and keys.",
    "Use the TodoWrite tool to plan the task if required.",
    "Use the available search tools to understand the codebase and the user's query.",
    "Verify the solution if possible with tests. NEVER assume specific test framework or test script.",
]
_ENV = [
    "<env>",
    "Working directory: /home/user/project",
    "Is directory a git repo: Yes",
    "Platform: linux",
    "OS Version: Linux 6.8.0",
    "DATE",
    "</env>",
    "You are powered by the model named Sonnet 4.5.",
    "gitStatus: This is the git status at the start of the conversation.",
    "Current branch: main",
    "Main branch (you will usually use this for PRs): main",
]


def date_line(turn: int) -> str:
    """The environment block's date line; the clock moves on every turn."""
    return f"Today's date is 2026-12-02 10:{31 + turn // 60:02d}:{turn % 60:02d}"


def system_text(turn: int, size: int = 3000) -> str:
    """About ``size`` bytes of Claude Code-like system text (rules, then the
    environment block with the turn's date line, then more rules): the date
    line sits about two thirds in, so a miss there re-prefills the rest."""
    rules: list[str] = []
    k = 0
    while sum(len(r) + 1 for r in rules) < size * 2 // 3:
        rules.append(f"- {_RULES[k % len(_RULES)]} (rule {k})")
        k += 1
    more: list[str] = []
    while sum(len(r) + 1 for r in rules + _ENV + more) < size:
        more.append(f"- {_RULES[k % len(_RULES)]} (rule {k})")
        k += 1
    env = [date_line(turn) if x == "DATE" else x for x in _ENV]
    return "\n".join(rules + env + more)


def billing_header() -> str:
    """Claude Code's billing line with a new ``cch`` (5 hex digits)."""
    return f"x-anthropic-billing-header: cc_version=2.1.37.3a1; cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"


def system(form: str, turn: int, size: int = 3000, header: str | None = None):
    """The ``system`` field of turn ``turn`` in ``form`` (a new cch)."""
    hdr = header or billing_header()
    text = system_text(turn, size)
    cc = {"cache_control": {"type": "ephemeral"}}
    if form == "string":
        return f"{hdr}\n{text}"
    if form == "block":
        return [{"type": "text", "text": f"{hdr}\n{text}", **cc}]
    if form == "separate":
        return [{"type": "text", "text": hdr}, {"type": "text", "text": text, **cc}]
    raise ValueError(form)


def tool_output(turn: int) -> str:
    """A short tool result (the test keeps the loop fast)."""
    return f"step {turn}: ok\ntests/test_parser.py:{10 + turn}: assert parse('') == []"


# -- the model's side (the scripted engine) ------------------------------------
def script(prompt: str) -> str:
    """One Bash call on every request that declares tools (so every turn
    of the loop is ``tool_use``); without tools, a short text."""
    if "<tools>" not in prompt:
        return "Hello from the script."
    m = re.search(r"<tools>\n(.*)\n", prompt)
    name = json.loads(m.group(1))["name"] if m else "none"
    n = prompt.count("<tool_response>")
    return (
        "<tool_call>" + json.dumps([{"name": name, "arguments": {"command": f"pytest -x -k step{n}"}}]) + "</tool_call>"
    )


def serve_command() -> list[str]:
    """The command line of ``ds4 serve`` over the scripted engine with
    :func:`script` (tests/helpers/cc_serve.py)."""
    return [sys.executable, os.path.join(HERE, "cc_serve.py"), "--engine", "reference"]


# -- the client's side ----------------------------------------------------------
def echoed(blocks) -> list[dict]:
    """An Anthropic reply's content blocks (``text`` and ``tool_use``) as a
    client sends them back in the next request's history."""
    out: list[dict] = []
    for b in blocks:
        if b.type == "text":
            out.append({"type": "text", "text": b.text})
        else:
            out.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.input})
    return out


def client(base: str, timeout: float = 600):
    import anthropic

    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=timeout)


def send(c, body: dict, turn: int) -> dict:
    """One request (``body``: the keyword arguments of ``messages.create``):
    its row (usage, stop reason, ds4 block, wall time, the content to echo)."""
    t0 = time.perf_counter()
    r = c.messages.create(**body)
    wall = time.perf_counter() - t0
    u = r.usage
    content = echoed(r.content)
    return {
        "turn": turn,
        "stop_reason": r.stop_reason,
        "input_tokens": u.input_tokens,
        "cache_read": u.cache_read_input_tokens,
        "cache_creation": u.cache_creation_input_tokens,
        # Anthropic's accounting: the three add up to the prompt (ds4 reports input_tokens 0)
        "prompt": u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens,
        "ds4": (r.model_extra or {})["ds4"],
        "wall_s": wall,
        "content": content,
    }


def _without_old_reminders(msgs: list[dict]) -> list[dict]:
    """The history with the reminder blocks of every message but the last
    dropped (what Claude Code sends: a reminder lives one request)."""
    out = [
        {
            **m,
            "content": [
                b for b in m["content"] if not (b["type"] == "text" and b["text"].startswith("<system-reminder>"))
            ],
        }
        for m in msgs[:-1]
    ]
    return [*out, msgs[-1]]


def loop(
    base: str,
    turns: int,
    form: str,
    *,
    size: int = 3000,
    reminder: bool = True,
    transient: bool = False,
    max_tokens: int = 300,
    tool_choice: dict | None = None,
    timeout: float = 600,
    on_turn: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """``turns`` requests of a Claude Code tool loop against ``base`` with
    the official ``anthropic`` client, a new ``cch`` and a new date line
    each; one row per request (:func:`send`, plus ``body``: exactly what
    was sent, ``header``: its billing line). With ``transient`` the
    reminder names its turn (it changes every turn) and the older ones are
    dropped from the history, as Claude Code drops them."""
    msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": TASK}]}]
    rows: list[dict] = []
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    hdr = ""
    with client(base, timeout) as c:
        for turn in range(turns):
            prev, hdr = hdr, billing_header()
            while hdr[-6:] == prev[-6:]:  # a new cch each request (1 in 16^5 would repeat)
                hdr = billing_header()
            body = {
                "model": "claude-code-loop",  # any name (the SDK warns on deprecated real ones)
                "max_tokens": max_tokens,
                "system": system(form, turn, size, hdr),
                "messages": copy.deepcopy(_without_old_reminders(msgs) if transient else msgs),
                "tools": TOOLS,
                **extra,
            }
            row = {**send(c, body, turn), "body": body, "header": hdr}
            rows.append(row)
            if on_turn is not None:
                on_turn(turn, row)
            content = row["content"]
            msgs.append({"role": "assistant", "content": content})
            results = [
                {"type": "tool_result", "tool_use_id": b["id"], "content": tool_output(turn)}
                for b in content
                if b["type"] == "tool_use"
            ]
            if results:
                note = REMINDER.replace("recently", f"recently (turn {turn + 1})") if transient else REMINDER
                text = [{"type": "text", "text": note}] if reminder else []
                msgs.append({"role": "user", "content": results + text})
            else:  # the model answered in text: the user goes on
                msgs.append({"role": "user", "content": [{"type": "text", "text": "Go on."}]})
    return rows
