"""The OpenAI Responses protocol: ``POST /v1/responses`` (whole, or streamed
as typed events ``response.created`` ... ``response.completed``), over the
shared conversation model (:mod:`ds4.server.conversation`) and the one turn
driver.

Input
    ``input`` is a string or a list of items: messages (``input_text`` /
    ``output_text`` parts), ``function_call``, ``function_call_output`` and
    ``reasoning`` (its ``content`` ``reasoning_text`` parts, else its
    ``summary`` texts: the reasoning of the assistant turn that follows it,
    rendered as the chat template renders reasoning; ``encrypted_content``
    is not read).
    ``instructions`` is the system turn (not carried over from a previous
    response, as in OpenAI's API). Function ``tools``, ``tool_choice``,
    ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
    ``top_p``. ``text.format`` constrains the reply as chat's
    ``response_format`` does (:func:`text_format`: ``text``, ``json_object``,
    ``json_schema`` with its ``name`` and ``schema``, enforced whether
    ``strict`` is true or not; a schema the grammar library rejects is a
    400), and the response object's ``text.format`` echoes it.

State
    With ``store`` (the default), each response is kept as a record: its
    owner, its head (what the response object says of the request, its
    status and usage) and the conversation through its output (calls with
    their ids), each message with its item id. With a cache directory the
    records are files in it (:mod:`ds4.kvstore.records`, counted in its
    budget), so ``previous_response_id`` resolves after a restart; without
    one they live in memory (the last 1,000). An unknown
    ``previous_response_id`` gets OpenAI's 400 ``previous_response_not_found``.
    Tool outputs whose calls the input (and the previous response) does
    not hold (ds4's 400/409 split): with a ``previous_response_id``, a 400
    (that response never made the call); without one, a 400 for a call id
    this server never issued, and for one it did, the live tool state
    serves the request when it answers exactly the calls generated at the
    live end (ds4's ``responses-tool-output`` match); when that state is
    gone, ds4's 409 ("replay the full input history"). ds4's
    ``responses-visible`` match is the ladder's ``memory-text`` rung: after a
    turn the live state is the canonical rendering of the conversation, so a
    request that extends it continues from the live tokens.

Reasoning
    A reply's reasoning (``<think>…</think>``, :mod:`ds4.server.reasoning`)
    is a ``reasoning`` output item before the message (id ``rs_`` and the
    message's hex), its text as one ``summary_text`` (ds4 shows the whole
    reasoning: it keeps no hidden part); streamed as that item's
    ``response.reasoning_summary_part.added``,
    ``response.reasoning_summary_text.delta`` events, their ``.done``
    events, then the message at output index 1. A reply cut inside its
    reasoning is an ``incomplete`` response with the reasoning item and an
    empty message. ``reasoning_tokens`` stays 0 (not counted apart).

Retrieval
    ``GET /v1/responses/{id}`` (the response object as created, without
    the ``ds4`` block), ``DELETE /v1/responses/{id}`` (``{"id", "object":
    "response", "deleted": true}``; the record's file removed under the
    store's lock, after which ``previous_response_id`` to it is unknown) and
    ``GET /v1/responses/{id}/input_items`` (the items the response was
    given, the previous responses' included, without the instructions;
    ``order`` ``desc`` by default or ``asc``, ``limit`` 1-100 (20),
    ``after`` an item id). An unknown id gets OpenAI's 404 ``Response with
    id '...' not found.``; a ``store: false`` response was never stored.

Owners
    A stored response belongs to the tenant that created it
    (:mod:`ds4.server.tenants`: the key's tenant, ``anonymous`` without
    keys). For any other tenant it does not exist: ``previous_response_id``
    gets the same 400 and every retrieval route the same 404, with the same
    message, as an unknown id; the only work done beyond an unknown id's is
    reading the record. The binding is to the tenant, not to ``cache_salt``:
    OpenAI scopes stored responses to the project (the key), and a salt is a
    cache partition a client may vary per request (it is not an identity;
    its value is never stored). Records written before owners existed
    (no ``owner`` field) are the anonymous tenant's: a server without keys
    keeps continuing and deleting them (they have no response object to
    retrieve: 404), a server with keys treats them as another tenant's.
    A record that cannot be read or does not validate is a not-found and is
    removed (:meth:`ds4.kvstore.records.RecordStore.get`).
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..constrain import Constraint
from ..errors import ConstraintError
from ..turn import GenParams, GenResult
from .conversation import Conversation, Message, Outcome, Tool, ToolCall, issued_call_id, results_without_calls
from .fields import format_name, int_from, num_in, utf8_len
from .reasoning import ReasoningSplitter
from .tenants import ANONYMOUS
from .volatile import SystemText
from .wire import JSON, ApiError, Turn, Wire, bad, cache_salt_of, ds4_info, exception_to_api, sse

__all__ = ["MemoryRecords", "ResponsesParser", "ResponsesWire", "StoredResponses"]

log = logging.getLogger("ds4.server")

KIND = "response"
MAX_MEMORY_RECORDS = 1000
#: the record format written since responses are bound to their tenant and
#: retrievable (a record without ``v`` is the first format: messages only)
RECORD_VERSION = 2
ROLES = ("system", "user", "assistant", "tool")


class Records(Protocol):
    def get(self, kind: str, key: str, check: Callable[[Any], object] | None = None) -> Any | None: ...

    def put(self, kind: str, key: str, data: Any) -> bool: ...

    def delete(self, kind: str, key: str) -> bool: ...


class MemoryRecords:
    """The records of a server without a cache directory (lost on restart)."""

    def __init__(self, limit: int = MAX_MEMORY_RECORDS):
        self.limit = limit
        self._d: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # the worker puts, request threads get and delete

    def get(self, kind: str, key: str, check: Callable[[Any], object] | None = None) -> Any | None:
        with self._lock:
            data = self._d.get(f"{kind}-{key}")
        if data is not None and check is not None:
            try:
                check(data)
            except (ValueError, TypeError, KeyError) as e:
                log.warning("record %s-%s invalid (%s): removed", kind, key, e)
                self.delete(kind, key)
                return None
        return data

    def put(self, kind: str, key: str, data: Any) -> bool:
        with self._lock:
            self._d[f"{kind}-{key}"] = data
            while len(self._d) > self.limit:
                self._d.popitem(last=False)
        return True

    def delete(self, kind: str, key: str) -> bool:
        with self._lock:
            return self._d.pop(f"{kind}-{key}", None) is not None


def _str(v: object, param: str) -> str:
    if not isinstance(v, str):
        raise bad(f"'{param}' must be a string", param, "invalid_type")
    if utf8_len(v) is None:
        raise bad(f"'{param}' is not valid Unicode (a lone surrogate)", param, "invalid_string")
    return v


def _text(v: object, param: str) -> str:
    """A string, or a list of text parts, as one string."""
    if isinstance(v, str):
        return _str(v, param)
    if not isinstance(v, list):
        raise bad(f"'{param}' must be a string or an array of text parts", param, "invalid_type")
    out = []
    for j, p in enumerate(v):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            raise bad(f"'{param}[{j}]': only text parts are supported", param)
        out.append(_str(p.get("text"), f"{param}[{j}].text"))
    return "".join(out)


def _to_json(m: Message, item_id: str) -> JSON:
    d: JSON = {"id": item_id, "role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [[c.id, c.name, c.arguments] for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    return d


def _from_json(d: JSON) -> Message:
    calls = [ToolCall(i, n, a) for i, n, a in d.get("tool_calls", [])]
    return Message(d["role"], d["content"], calls, d.get("tool_call_id"), d.get("reasoning"))


def _reasoning_only(m: Message) -> bool:
    """An assistant turn a reasoning item opened, with nothing else yet."""
    return m.role == "assistant" and m.reasoning is not None and not m.content and not m.tool_calls


def _reasoning_text(it: JSON, p: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content parts, else
    its ``summary`` texts (joined by blank lines)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = it.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad(f"'{p}.{key}' must be an array", "input", "invalid_type")
        texts = [
            _str(part.get("text"), f"{p}.{key}")
            for part in parts
            if isinstance(part, dict) and part.get("type") == kind
        ]
        if texts:
            return "\n\n".join(texts)
    return ""


def reasoning_id(msg_id: str) -> str:
    """The reasoning item's id beside the message item ``msg_id``."""
    return "rs_" + msg_id.removeprefix("msg_")


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> JSON:
    summary = [{"type": "summary_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": summary}


def new_item_id(m: Message) -> str:
    """A new input item's id (``msg_`` for messages, ``fco_`` for a tool's output)."""
    return ("fco_" if m.role == "tool" else "msg_") + secrets.token_hex(12)


class ResponsesTurn(Turn):
    """A Responses request: the Turn, plus what its answer and record need."""

    def __init__(
        self, params: GenParams, stream: bool, conv: Conversation, body: JSON, history: list[Message], ids: list[str]
    ):
        super().__init__("chat", None, params, stream, True, conv)
        self.body = body
        self.history = history  # the conversation without the instructions
        self.ids = ids  # the input item id of each message of history
        self.rid = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex  # the output message's item id
        self.created = int(time.time())
        self.store = body.get("store") is not False
        self.tenant = ANONYMOUS  # who asked: the owner of its stored response
        self.text_format: JSON = {"type": "text"}  # what the response's text.format says

    @property
    def param(self) -> str:
        return "input"


class ResponsesParser:
    """Validates ``/v1/responses`` bodies (previous responses from ``stored``,
    the requesting tenant's only)."""

    def __init__(
        self,
        default_max_tokens: int,
        ctx: int,
        stored: StoredResponses,
        max_prompt_bytes: int | None = None,
        volatile: SystemText | None = None,
    ):
        self.default_max_tokens = default_max_tokens if default_max_tokens > 0 else ctx
        self.stored = stored
        self.max_prompt_bytes = max_prompt_bytes
        self.volatile = volatile or SystemText()

    def _item(self, i: int, it: object, out: list[Message]) -> None:
        p = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"'{p}' must be an object", "input", "invalid_type")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"'{p}.role' must be user, assistant, system or developer", "input")
            text: str | None = _text(it.get("content"), p)
            if role in ("system", "developer"):
                text = self.volatile.header(str(text))  # None: it was the billing line alone
            if role == "assistant" and out and _reasoning_only(out[-1]):
                out[-1].content = str(text)  # the message its reasoning item opened
            elif text is not None:
                out.append(Message("system" if role == "developer" else str(role), text))
        elif kind == "function_call":
            call = ToolCall(_str(it.get("call_id"), f"{p}.call_id"), _str(it.get("name"), f"{p}.name"), "")
            call.arguments = _str(it.get("arguments", "{}"), f"{p}.arguments")
            if out and out[-1].role == "assistant":
                out[-1].tool_calls.append(call)  # calls follow the assistant's text in one turn
            else:
                out.append(Message("assistant", "", [call]))
        elif kind == "function_call_output":
            call_id = _str(it.get("call_id"), f"{p}.call_id")
            out.append(Message("tool", _text(it.get("output", ""), f"{p}.output"), tool_call_id=call_id))
        elif kind == "reasoning":
            text = _reasoning_text(it, p)
            if out and _reasoning_only(out[-1]):
                out[-1].reasoning = f"{out[-1].reasoning}\n\n{text}" if text else out[-1].reasoning
            elif text:
                out.append(Message("assistant", "", reasoning=text))  # the assistant turn it opens
        else:
            raise bad(f"'{p}.type' {kind!r} is not supported", "input")

    @staticmethod
    def _tools(body: JSON) -> tuple[list[Tool], str, bool]:
        raw = body.get("tools") or []
        if not isinstance(raw, list):
            raise bad("'tools' must be an array", "tools", "invalid_type")
        tools = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad(f"tools[{i}]: only function tools are supported", "tools")
            params = t.get("parameters") or {}
            if not isinstance(params, dict):
                raise bad(f"tools[{i}].parameters must be an object", "tools", "invalid_type")
            tools.append(Tool(_str(t.get("name"), "tools"), _str(t.get("description") or "", "tools"), params))
        tc = body.get("tool_choice", "auto")
        if isinstance(tc, dict) and tc.get("type") == "function":
            choice = _str(tc.get("name"), "tool_choice")
            if choice not in {t.name for t in tools}:
                raise bad(f"tool_choice names {choice!r}, which is not in 'tools'", "tool_choice")
        elif tc in ("auto", "none", "required"):
            choice = str(tc)
            if choice == "required" and not tools:
                raise bad("tool_choice 'required' needs 'tools'", "tool_choice")
        else:
            raise bad("'tool_choice' must be 'auto', 'none', 'required' or a function", "tool_choice")
        par = body.get("parallel_tool_calls")
        if par is not None and not isinstance(par, bool):
            raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
        return tools, choice, par is not False

    @staticmethod
    def _num(body: JSON, key: str, lo: float, hi: float) -> float | None:
        v = body.get(key)
        if v is None:
            return None
        if not num_in(v, lo, hi):
            raise bad(f"'{key}' must be a number between {lo} and {hi}", key)
        return float(v)

    def _params(self, body: JSON) -> GenParams:
        mot = body.get("max_output_tokens")
        if mot is not None and not int_from(mot, 1):
            raise bad("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
        top_p = self._num(body, "top_p", 0.0, 1.0)
        return GenParams(
            max_tokens=self.default_max_tokens if mot is None else mot,
            temperature=self._num(body, "temperature", 0.0, 2.0) or 0.0,
            top_p=top_p or 1.0,
        )

    def _previous(self, body: JSON, tenant: str) -> tuple[list[Message], list[str]]:
        prev = body.get("previous_response_id")
        if prev is None:
            return [], []
        prev = _str(prev, "previous_response_id")
        rec = self.stored.lookup(prev, tenant)
        if rec is None:  # unknown, deleted, unreadable, or another tenant's: one answer
            raise ApiError(
                400,
                f"Previous response with id '{prev}' not found.",
                "invalid_request_error",
                "previous_response_id",
                "previous_response_not_found",
            )
        msgs = rec["messages"]
        return [_from_json(m) for m in msgs], [m.get("id") or new_item_id(_from_json(m)) for m in msgs]

    def parse(self, raw: object, tenant: str = ANONYMOUS) -> ResponsesTurn:
        """The turn of a request body from ``tenant`` (whose stored
        responses alone ``previous_response_id`` may name)."""
        if not isinstance(raw, dict):
            raise bad("the request body must be a JSON object", None, "invalid_type")
        _str(raw.get("model"), "model")
        history, ids = self._previous(raw, tenant)
        inp = raw.get("input")
        new: list[Message] = []
        if isinstance(inp, str):
            new.append(Message("user", inp))
        elif isinstance(inp, list) and inp:
            for i, it in enumerate(inp):
                self._item(i, it, new)
        else:
            raise bad("'input' must be a string or a non-empty array of items", "input", "missing_required_parameter")
        missing = self._check_outputs(history + new, len(history), raw.get("previous_response_id"))
        history = history + new
        ids = ids + [new_item_id(m) for m in new]
        msgs = list(history)
        if raw.get("instructions") is not None:
            instructions = self.volatile.header(_str(raw["instructions"], "instructions"))
            if instructions is not None:
                msgs.insert(0, Message("system", instructions))
        tools, choice, parallel = self._tools(raw)
        conv = Conversation(msgs, tools, choice, parallel, volatile=self.volatile, live_only=bool(missing))
        n = sum(
            len(m.content.encode()) + len((m.reasoning or "").encode()) + sum(len(c.arguments) for c in m.tool_calls)
            for m in msgs
        )
        if self.max_prompt_bytes is not None and n > self.max_prompt_bytes:
            raise bad(f"the input has {n} bytes, more than fit the context", "input", "context_length_exceeded")
        stream = raw.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("'stream' must be a boolean", "stream", "invalid_type")
        constraint, echo = text_format(raw.get("text"))
        params = self._params(raw)
        params.constraint = constraint  # as chat's response_format: a forced tool call's grammar wins
        try:
            params = conv.gen_params(params)
        except ConstraintError as e:
            raise bad(f"the tools' parameters cannot be enforced: {e}", "tools", "invalid_json_schema") from None
        turn = ResponsesTurn(params, stream, conv, raw, history, ids)
        turn.text_format = echo
        turn.cache_salt = cache_salt_of(raw)
        turn.tenant = tenant
        return turn

    @staticmethod
    def _check_outputs(history: list[Message], start: int, prev: object) -> list[str]:
        """The call ids of the tool outputs of the input (``history[start:]``,
        after the previous responses' messages) that no earlier call of
        ``history`` made (only the live tool state can serve them); a 400
        for any with a previous response (it never made that call) and for
        any this server never issued. (A stored conversation is not judged
        again: a turn served from the live state holds its outputs without
        their calls.)"""
        missing = results_without_calls(history, start)
        for cid in missing:
            if prev is not None:
                why = f"response '{prev}' and the input before the output made no such call"
            elif not issued_call_id(cid):
                why = "no function_call earlier in the input has it and this server never issued it"
            else:
                continue
            raise bad(
                f"No tool call found for function call output with call_id {cid}: {why}", "input", "unknown_call_id"
            )
        return missing


def text_format(text: object) -> tuple[Constraint | None, JSON]:
    """``text.format`` as a constraint, and what the response object says of
    it: ``text`` (none; also when ``text`` or its ``format`` is absent),
    ``json_object`` (any JSON object), ``json_schema`` (JSON valid under
    its ``schema``, whether ``strict`` is true or not; the echo has its
    ``name``, ``schema``, ``description`` and ``strict`` as given). A bad
    one is a 400 naming the field; a schema the grammar library rejects is
    ``invalid_json_schema`` (the check chat's ``response_format`` makes)."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise bad("'text' must be an object", "text", "invalid_type")
    p = "text.format"
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad(f"'{p}' must be an object with a string 'type'", p, "invalid_type")
    kind = fmt["type"]
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return Constraint.json_object(), {"type": "json_object"}
    if kind != "json_schema":
        raise bad(f"'{p}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{p}.type")
    return _json_schema_format(fmt, p)


def _json_schema_format(fmt: JSON, p: str) -> tuple[Constraint, JSON]:
    """A ``json_schema`` format (``p``: its parameter) as a constraint and its echo."""
    name = fmt.get("name")
    if name is None:
        raise bad(f"Missing required parameter: '{p}.name'.", f"{p}.name", "missing_required_parameter")
    if not format_name(name):
        raise bad(f"'{p}.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{p}.name")
    schema = fmt.get("schema")
    if schema is None:
        raise bad(f"Missing required parameter: '{p}.schema'.", f"{p}.schema", "missing_required_parameter")
    if not isinstance(schema, dict):
        raise bad(f"'{p}.schema' must be an object", f"{p}.schema", "invalid_type")
    strict, description = fmt.get("strict"), fmt.get("description")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"'{p}.strict' must be a boolean", f"{p}.strict", "invalid_type")
    if description is not None:
        _str(description, f"{p}.description")
    try:
        constraint = Constraint.json_schema(schema)
    except ConstraintError as e:
        raise bad(f"Invalid schema for response_format '{name}': {e}", f"{p}.schema", "invalid_json_schema") from None
    echo = {"type": "json_schema", "name": name, "schema": schema, "description": description, "strict": strict}
    return constraint, echo


def _usage(res: GenResult) -> JSON:
    return {
        "input_tokens": res.prompt_tokens,
        "input_tokens_details": {"cached_tokens": res.cached_tokens},
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def _status(oc: Outcome) -> str:
    return "incomplete" if oc.finish_reason == "length" else "completed"


def _msg_item(item_id: str, text: str, status: str) -> JSON:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(c: ToolCall, status: str, item_id: str | None = None) -> JSON:
    args = c.arguments if status == "completed" else ""
    item = {"id": item_id or "fc_" + c.id, "type": "function_call", "status": status, "call_id": c.id, "name": c.name}
    return {**item, "arguments": args}


def _output(msg_id: str, content: str, calls: list[ToolCall], reasoning: str | None = None) -> list[JSON]:
    """A turn's output items: its reasoning (when it has some), its text as
    a message (also when empty and there are no calls), then one item per
    call."""
    output: list[JSON] = [] if reasoning is None else [_reasoning_item(reasoning_id(msg_id), reasoning)]
    if content or not calls:
        output.append(_msg_item(msg_id, content, "completed"))
    return output + [_call_item(c, "completed") for c in calls]


def _head(turn: ResponsesTurn, model: str) -> JSON:
    """What a response object says of its request (a stored response keeps it)."""
    b = turn.body
    return {
        "id": turn.rid,
        "created_at": turn.created,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "model": model,
        "parallel_tool_calls": turn.conv.parallel_tool_calls if turn.conv else True,
        "previous_response_id": b.get("previous_response_id"),
        "temperature": b.get("temperature", 1.0),
        "top_p": b.get("top_p", 1.0),
        "tool_choice": b.get("tool_choice", "auto"),
        "tools": b.get("tools") or [],
        "text": {"format": turn.text_format},
        "metadata": b.get("metadata") or {},
    }


def _response(head: JSON, status: str, output: list[JSON], usage: JSON | None, store: bool) -> JSON:
    """The response object (``POST /v1/responses``, its events, ``GET /v1/responses/{id}``)."""
    h = head
    return {
        "id": h["id"],
        "object": "response",
        "created_at": h["created_at"],
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": h["instructions"],
        "max_output_tokens": h["max_output_tokens"],
        "model": h["model"],
        "output": output,
        "parallel_tool_calls": h["parallel_tool_calls"],
        "previous_response_id": h["previous_response_id"],
        "store": store,
        "temperature": h["temperature"],
        "top_p": h["top_p"],
        "tool_choice": h["tool_choice"],
        "tools": h["tools"],
        "text": h.get("text") or {"format": {"type": "text"}},  # a record stored before text.format: none
        "truncation": "disabled",
        "metadata": h["metadata"],
        "usage": usage,
    }


class ResponsesReply:
    """The bodies of one ``/v1/responses`` answer (events carry ``event:``
    lines and a ``sequence_number``)."""

    terminator = b""

    def __init__(self, turn: ResponsesTurn, model: str, debug: bool):
        self.turn, self.model, self.debug = turn, model, debug
        self.seq = 0
        self.msg_id = turn.msg_id
        self.splitter = turn.conv.splitter() if turn.conv is not None else None
        self.msg_open = False
        self.rsplit: ReasoningSplitter | None = None  # made on the first text (the prompt is rendered then)
        self.reasoning: str | None = None  # the reasoning item's text so far (None: no item)
        self.reasoning_done = False
        self.msg_index = 0  # the message's output index (1 after a reasoning item)

    def _ev(self, kind: str, **data: Any) -> bytes:
        d = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse(d, ensure_ascii=False, event=kind)

    def _outcome(self, res: GenResult) -> Outcome:
        oc = self.turn.agent.outcome if self.turn.agent is not None else None
        return oc if oc is not None else Outcome(res.text, [], res.finish_reason)

    def _msg_item(self, text: str, status: str) -> JSON:
        return _msg_item(self.msg_id, text, status)

    def _response(self, status: str, output: list[JSON], res: GenResult | None) -> JSON:
        usage = _usage(res) if res is not None else None
        return _response(_head(self.turn, self.model), status, output, usage, self.turn.store)

    def _final(self, res: GenResult) -> tuple[str, list[JSON], Outcome]:
        oc = self._outcome(res)
        return _status(oc), _output(self.msg_id, oc.content, oc.calls, oc.reasoning), oc

    def complete(self, res: GenResult) -> JSON:
        status, output, _ = self._final(res)
        return {**self._response(status, output, res), "ds4": ds4_info(res, self.debug)}

    # -- the stream ------------------------------------------------------------
    def opening(self) -> list[bytes]:
        r = self._response("in_progress", [], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _open_message(self) -> list[bytes]:
        if self.msg_open:
            return []
        self.msg_open = True
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._ev("response.output_item.added", output_index=self.msg_index, item=self._msg_item("", "in_progress")),
            self._ev(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=self.msg_index,
                content_index=0,
                part=part,
            ),
        ]

    def _delta(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._open_message()
        ids = {"item_id": self.msg_id, "output_index": self.msg_index, "content_index": 0}
        out.append(self._ev("response.output_text.delta", **ids, delta=text))
        return out

    def _think(self, text: str) -> list[bytes]:
        """A reasoning summary delta (the item opened on the first)."""
        if not text:
            return []
        out = []
        rid = reasoning_id(self.msg_id)
        ids = {"item_id": rid, "output_index": 0, "summary_index": 0}
        if self.reasoning is None:
            self.reasoning, self.msg_index = "", 1
            out.append(
                self._ev("response.output_item.added", output_index=0, item=_reasoning_item(rid, "", "in_progress"))
            )
            part = {"type": "summary_text", "text": ""}
            out.append(self._ev("response.reasoning_summary_part.added", **ids, part=part))
        self.reasoning += text
        return [*out, self._ev("response.reasoning_summary_text.delta", **ids, delta=text)]

    def _end_think(self) -> list[bytes]:
        """The reasoning item's done events (once, before the message)."""
        if self.reasoning is None or self.reasoning_done:
            return []
        self.reasoning_done = True
        rid, text = reasoning_id(self.msg_id), self.reasoning
        ids = {"item_id": rid, "output_index": 0, "summary_index": 0}
        return [
            self._ev("response.reasoning_summary_text.done", **ids, text=text),
            self._ev("response.reasoning_summary_part.done", **ids, part={"type": "summary_text", "text": text}),
            self._ev("response.output_item.done", output_index=0, item=_reasoning_item(rid, text)),
        ]

    def _split(self, text: str) -> tuple[list[bytes], str]:
        """A text delta through the reasoning splitter: the reasoning events
        and the content left."""
        if self.turn.agent is None:
            return [], text
        if self.rsplit is None:
            self.rsplit = self.turn.agent.reasoning_splitter()
        reasoning, content = self.rsplit.push(text)
        out = self._think(reasoning)
        return (out + self._end_think() if content else out), content

    def chunk(self, text: str) -> bytes:
        pre, text = self._split(text)
        if self.splitter is not None:
            text = self.splitter.push(text)
        return b"".join(pre + self._delta(text))

    def closing(self, res: GenResult) -> list[bytes]:
        status, output, oc = self._final(res)
        out: list[bytes] = []
        if self.rsplit is not None:
            reasoning, content = self.rsplit.finish()
            out += self._think(reasoning) + self._end_think()
            if content and self.splitter is not None:
                content = self.splitter.push(content)
            out += self._delta(content)
        if self.splitter is not None:
            _, rest = self.splitter.finish()
            out += self._delta(rest if oc.calls else self.splitter.buf[self.splitter.shown :])
        if not oc.calls:
            out += self._open_message()  # an empty answer is still a message
        k = self.msg_index
        if self.msg_open:
            text = oc.content
            ids = {"item_id": self.msg_id, "output_index": k, "content_index": 0}
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(self._ev("response.output_text.done", **ids, text=text))
            out.append(self._ev("response.content_part.done", **ids, part=part))
            out.append(self._ev("response.output_item.done", output_index=k, item=self._msg_item(text, "completed")))
            k += 1
        for c in oc.calls:
            item_id = "fc_" + c.id
            out.append(self._ev("response.output_item.added", output_index=k, item=_call_item(c, "in_progress")))
            out.append(
                self._ev("response.function_call_arguments.delta", item_id=item_id, output_index=k, delta=c.arguments)
            )
            out.append(
                self._ev(
                    "response.function_call_arguments.done", item_id=item_id, output_index=k, arguments=c.arguments
                )
            )
            out.append(self._ev("response.output_item.done", output_index=k, item=_call_item(c, "completed")))
            k += 1
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._ev(kind, response=self._response(status, output, res)))
        return out

    def failed(self, e: BaseException) -> list[bytes]:
        api = exception_to_api(e, "input", self.debug)
        return [self._ev("error", code=api.code, message=api.message, param=api.param)]


def _not_found(rid: str) -> ApiError:
    """OpenAI's 404 for a response id it does not know (or that is not the caller's)."""
    return ApiError(404, f"Response with id '{rid}' not found.", "invalid_request_error", None, None)


def _check_message(m: object) -> None:
    if not isinstance(m, dict) or m["role"] not in ROLES or not isinstance(m["content"], str):
        raise ValueError("a message is not an object with a role and a text")
    for c in m.get("tool_calls", []):
        if not isinstance(c, list) or len(c) != 3 or not all(isinstance(x, str) for x in c):
            raise ValueError("a tool call is not [id, name, arguments]")
    if not isinstance(m.get("reasoning", ""), str):
        raise ValueError("a message's reasoning is not a string")
    if not isinstance(m.get("tool_call_id", ""), str) or not isinstance(m.get("id", ""), str):
        raise ValueError("a message's ids are not strings")


def _check_record(rid: str, d: object) -> None:
    """Raise ValueError (TypeError, KeyError) unless ``d`` is a response
    record: the first format (messages) or this one (``v`` 2: an owner, the
    response's head, every message with its item id, the output last)."""
    if not isinstance(d, dict) or not isinstance(d["messages"], list) or not d["messages"]:
        raise ValueError("no messages")
    for m in d["messages"]:
        _check_message(m)
    if not isinstance(d.get("owner", ANONYMOUS), str):
        raise ValueError("the owner is not a string")
    if "v" not in d:
        return
    head, last = d["response"], d["messages"][-1]
    if not isinstance(d["v"], int) or d["v"] < RECORD_VERSION or not isinstance(head, dict):
        raise ValueError("not a response record")
    if head["id"] != rid or head["status"] not in ("completed", "incomplete") or not isinstance(head["usage"], dict):
        raise ValueError("the response's head does not match its name")
    if not isinstance(head.get("text", {}), dict):
        raise ValueError("the response's text settings are not an object")
    if last["role"] != "assistant" or not all("id" in m for m in d["messages"]):
        raise ValueError("the messages have no item ids")


def _input_item(d: JSON, used: set[str]) -> list[JSON]:
    """One stored message as input items (an assistant turn: its text and
    its calls; a call's item id is ``fc_`` and its call id, made unique
    within the list)."""
    m = _from_json(d)
    if m.role == "tool":
        return [
            {
                "id": d["id"],
                "type": "function_call_output",
                "call_id": m.tool_call_id,
                "output": m.content,
                "status": "completed",
            }
        ]
    if m.role != "assistant":
        part = {"type": "input_text", "text": m.content}
        return [{"id": d["id"], "type": "message", "role": m.role, "status": "completed", "content": [part]}]
    out = [_reasoning_item(reasoning_id(d["id"]), m.reasoning)] if m.reasoning is not None else []
    out += [_msg_item(d["id"], m.content, "completed")] if m.content or not m.tool_calls else []
    for c in m.tool_calls:
        item_id, k = "fc_" + c.id, 1
        while item_id in used:
            item_id, k = f"fc_{c.id}_{k}", k + 1
        used.add(item_id)
        out.append(_call_item(c, "completed", item_id))
    return out


def _query_int(query: Mapping[str, str], key: str, default: int, lo: int, hi: int) -> int:
    v = query.get(key)
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        n = lo - 1
    if not lo <= n <= hi:
        raise bad(f"'{key}' must be an integer between {lo} and {hi}", key)
    return n


class StoredResponses:
    """The server's stored responses (``records``: a cache directory's
    :class:`ds4.kvstore.records.RecordStore` or :class:`MemoryRecords`),
    each bound to the tenant that created it: for any other tenant it does
    not exist (the same answers as an unknown id)."""

    def __init__(self, records: Records, model: str):
        self.records, self.model = records, model

    def remember(self, turn: ResponsesTurn, oc: Outcome, res: GenResult) -> None:
        """Store the response's record (the worker runs this, before the
        final event, so a client's next request finds it): its owner, its
        head, and the conversation through its output (without the
        instructions), each message with its item id."""
        if not turn.store or oc.finish_reason == "cancelled":
            return
        msgs = [*turn.history, Message("assistant", oc.content, list(oc.calls), reasoning=oc.reasoning)]
        ids = [*turn.ids, turn.msg_id]
        rec = {
            "v": RECORD_VERSION,
            "owner": turn.tenant,
            "response": {**_head(turn, self.model), "status": _status(oc), "usage": _usage(res)},
            "messages": [_to_json(m, i) for m, i in zip(msgs, ids, strict=True)],
        }
        try:
            self.records.put(KIND, turn.rid, rec)
        except OSError as e:  # the answer still goes out; previous_response_id to it will be unknown
            log.warning("response %s not stored: %s", turn.rid, e)

    def lookup(self, rid: str, tenant: str) -> JSON | None:
        """The record of ``rid`` when ``tenant`` owns it; None when there is
        none, it is unreadable (then removed) or another tenant's. A record
        of the first format (no owner) is the anonymous tenant's."""
        try:
            rec: JSON | None = self.records.get(KIND, rid, lambda d: _check_record(rid, d))
        except ValueError:  # not a name a record can have
            return None
        if rec is None:
            return None
        owner = str(rec.get("owner", ANONYMOUS))
        return rec if hmac.compare_digest(owner.encode(), tenant.encode()) else None

    def _retrievable(self, rid: str, tenant: str) -> JSON:
        rec = self.lookup(rid, tenant)
        if rec is None or "response" not in rec:  # a record of the first format has no response object
            raise _not_found(rid)
        return rec

    def retrieve(self, rid: str, tenant: str, query: Mapping[str, str]) -> JSON:
        """``GET /v1/responses/{rid}``: the response object as created."""
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise bad("streaming a stored response again is not supported", "stream")
        rec = self._retrievable(rid, tenant)
        head, last = rec["response"], rec["messages"][-1]
        out = _from_json(last)
        output = _output(last["id"], out.content, out.tool_calls, out.reasoning)
        return _response(head, head["status"], output, head["usage"], True)

    def input_items(self, rid: str, tenant: str, query: Mapping[str, str]) -> JSON:
        """``GET /v1/responses/{rid}/input_items``: the items the response
        was given (the previous responses' too), ``order`` ``desc`` (the
        default) or ``asc``, ``limit`` 1-100 (20), after the item ``after``."""
        limit = _query_int(query, "limit", 20, 1, 100)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad("'order' must be 'asc' or 'desc'", "order")
        rec = self._retrievable(rid, tenant)
        used: set[str] = set()
        items = [it for d in rec["messages"][:-1] for it in _input_item(d, used)]
        if order == "desc":
            items.reverse()
        start = 0
        after = query.get("after")
        if after is not None:
            start = next((i + 1 for i, it in enumerate(items) if it["id"] == after), -1)
            if start < 0:
                raise bad(f"no input item with id '{after}' in response '{rid}'", "after")
        page = items[start : start + limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }

    def delete(self, rid: str, tenant: str) -> JSON:
        """``DELETE /v1/responses/{rid}``: the record removed (a
        ``previous_response_id`` naming it is then unknown)."""
        if self.lookup(rid, tenant) is None:
            raise _not_found(rid)
        try:
            removed = self.records.delete(KIND, rid)
        except OSError as e:
            log.warning("response %s not deleted: %s", rid, e)
            raise ApiError(500, f"the response could not be deleted: {type(e).__name__}", "server_error") from None
        if not removed:  # deleted meanwhile
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}


class ResponsesWire(Wire):
    def __init__(self, model: str, stored: StoredResponses, debug: bool = False):
        super().__init__(model, debug)
        self.stored = stored

    def reply(self, turn: Turn) -> ResponsesReply:
        assert isinstance(turn, ResponsesTurn)
        return ResponsesReply(turn, self.model, self.debug)
