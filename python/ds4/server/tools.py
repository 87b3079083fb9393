"""ds4's tool-call convention for ChatML models (SmolLM2 has no tool
syntax of its own): rendered and parsed here, nowhere else.

The convention (close to the one SmolLM2-Instruct saw in training)
    * The tools are described in the system turn, before the client's
      system text (so a boundary trim cuts the client's tail, not the
      schemas): :func:`tools_block`, one compact JSON line per tool.
    * A call is a JSON array of ``{"name", "arguments"}`` objects between
      ``<tool_call>`` and ``</tool_call>``, after any visible text::

          Let me look.
          <tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}}]</tool_call>

      Several objects in the one array are parallel calls. Decoding stops
      right after ``</tool_call>`` (kept in the text and the KV state).
    * A run of tool results is one ``tool`` turn, each result between
      ``<tool_response>`` and ``</tool_response>`` (names and ids are not
      rendered, as in ds4: the prompt does not depend on random ids).

Canonical form
    :func:`render_calls` writes every call the same way whatever the client
    sent: the arguments parsed as JSON (key order kept) and dumped with
    ``json.dumps`` defaults, ``ensure_ascii=False``; arguments that are not
    a JSON object are passed as a string. Only the wrapper's own closing
    tags are escaped (``</tool_call>`` inside JSON as ``\\u003c/tool_call>``,
    ``</tool_response>`` inside a result as ``&lt;/tool_response>``).

Parsing
    :func:`parse_reply` is strict (small models drift): the text after the
    first ``<tool_call>`` must be one JSON array (or object) of calls to
    declared tools with object arguments, closed by ``</tool_call>`` and
    followed by nothing but whitespace. Anything else is returned whole as
    content, never an error (a duplicate key in a call included: its
    streamed prefix could not be canonical). :class:`ds4.server.tool_stream.StreamSplitter`
    does the same incrementally for streams.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..constrain import json_rule

log = logging.getLogger("ds4.server")

__all__ = [
    "CALL_END",
    "CALL_START",
    "RESULT_END",
    "RESULT_START",
    "InvalidCalls",
    "ParsedCall",
    "ParsedReply",
    "dump_json",
    "no_dups",
    "parse_reply",
    "render_calls",
    "render_results",
    "tool_call_grammar",
    "tools_block",
]

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
RESULT_START = "<tool_response>"
RESULT_END = "</tool_response>"


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # canonical JSON text of the arguments object


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    content: str
    calls: tuple[ParsedCall, ...] = ()


def dump_json(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


def canonical_arguments(arguments: str | Mapping[str, Any] | None) -> Any:
    """The arguments as the value rendered: a parsed JSON object, or the
    raw string when it is not one (rendered as a JSON string)."""
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        v = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return v if isinstance(v, dict) else arguments


def tools_block(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
    """The system-turn text that describes ``tools`` (each ``{"name",
    "description", "parameters"}``) and how to call them. ``tool_choice``
    is not in it: a forced call is the grammar's work
    (:func:`tool_call_grammar`), so a request that forces a call and the
    next one that does not render the same prompt and share its cache."""
    lines = [
        "You have access to the following tools:",
        "<tools>",
        *(dump_json(dict(t)) for t in tools),
        "</tools>",
        "To call tools, answer with a JSON array of calls between <tool_call> and </tool_call>, like this:",
        f'{CALL_START}[{{"name": "tool_name", "arguments": {{"argument": "value"}}}}]{CALL_END}',
        "The arguments must follow the tool's parameters schema. Tool results come back between "
        f"{RESULT_START} and {RESULT_END}.",
    ]
    if not parallel:
        lines.append("Call at most one tool per answer.")
    return "\n".join(lines)


def render_calls(calls: Sequence[tuple[str, str | Mapping[str, Any] | None]]) -> str:
    """The canonical call block for ``(name, arguments)`` pairs."""
    body = dump_json([{"name": n, "arguments": canonical_arguments(a)} for n, a in calls])
    return CALL_START + body.replace(CALL_END, "\\u003c/tool_call>") + CALL_END


def render_assistant(content: str, calls: Sequence[tuple[str, str | Mapping[str, Any] | None]]) -> str:
    """An assistant turn's text: its content, then (on its own line) its calls."""
    if not calls:
        return content
    block = render_calls(calls)
    return f"{content}\n{block}" if content else block


def render_results(results: Sequence[str]) -> str:
    """The text of one ``tool`` turn holding ``results``, in order."""
    esc = "&lt;" + RESULT_END[1:]
    return "\n".join(f"{RESULT_START}\n{r.replace(RESULT_END, esc)}\n{RESULT_END}" for r in results)


class InvalidCalls(ValueError):
    """The call block cannot be strict JSON calls."""


def no_dups(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise InvalidCalls("duplicate key")
    return d


def _parse_calls(body: str, names: frozenset[str] | None) -> tuple[ParsedCall, ...] | None:
    try:
        v = json.loads(body, object_pairs_hook=no_dups)
    except ValueError:
        return None
    items = v if isinstance(v, list) else [v]
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        args = it.get("arguments", {})
        if isinstance(args, str):  # a model that quotes its arguments
            try:
                args = json.loads(args, object_pairs_hook=no_dups)
            except ValueError:
                return None
        if not isinstance(args, dict) or (names is not None and it["name"] not in names):
            return None
        out.append(ParsedCall(it["name"], dump_json(args)))
    return tuple(out) or None


def parse_reply(text: str, names: frozenset[str] | None = None) -> ParsedReply:
    """Split a generated reply into content and calls (see the module
    docstring); ``names`` are the declared tools (None: any name)."""
    i = text.find(CALL_START)
    if i < 0:
        return ParsedReply(text)
    j = text.find(CALL_END, i)
    if j < 0 or text[j + len(CALL_END) :].strip():
        log.warning("invalid tool call returned as assistant text (%s)", "unclosed" if j < 0 else "text after it")
        return ParsedReply(text)
    calls = _parse_calls(text[i + len(CALL_START) : j], names)
    if calls is None:
        log.warning("invalid tool call returned as assistant text (not a JSON call to a declared tool)")
        return ParsedReply(text)
    return ParsedReply(text[:i].rstrip(), calls)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], choice: str | None, parallel: bool = True) -> str:
    """The llguidance lark grammar of a reply that is one call block (for
    ``tool_choice`` ``required`` or a named tool): ``<tool_call>``, a JSON
    array of calls whose arguments follow each tool's schema, ``</tool_call>``,
    every JSON item in ds4's format (:func:`ds4.constrain.json_rule`: the
    canonical form of :func:`render_calls`); one call only when not
    ``parallel``. For :meth:`ds4.constrain.Constraint.lark`
    (``Conversation.gen_params``)."""
    chosen = [t for t in tools if choice in (None, "required") or t.get("name") == choice]
    alts = []
    for k, t in enumerate(chosen):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": t.get("name")},
                "arguments": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        alts.append(f"call{k}: {json_rule(schema)}")
    names = " | ".join(f"call{k}" for k in range(len(chosen))) or "call0"
    more = '("," " "? call)* ' if parallel else ""
    rules = [
        f'start: "{CALL_START}[" call {more}"]{CALL_END}"',
        f"call: {names}",
        *alts,
    ]
    return "\n".join(rules) + "\n"
