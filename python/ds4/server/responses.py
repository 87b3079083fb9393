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

Answers
    The response object and its stream of typed events:
    :mod:`ds4.server.responses_reply`.

Stored responses
    ``store``, ``previous_response_id`` and the retrieval routes:
    :mod:`ds4.server.response_store`.
"""

from __future__ import annotations

import secrets
import time
import uuid

from ..errors import ConstraintError
from ..turn import GenParams
from .conversation import (
    AgentTurn,
    Conversation,
    Message,
    Tool,
    ToolCall,
    issued_call_id,
    results_without_calls,
)
from .fields import int_from, num_in
from .formats import text_format
from .response_store import (
    StoredResponses,
    from_record,
)
from .tenants import ANONYMOUS
from .thinking import openai_kwargs
from .volatile import SystemText
from .wire import JSON, ApiError, ApiRequest, MakeAgent, bad, cache_salt_of, str_field

__all__ = ["ResponsesParser", "ResponsesRequest"]


def _text(v: object, param: str) -> str:
    """A string, or a list of text parts, as one string."""
    if isinstance(v, str):
        return str_field(v, param)
    if not isinstance(v, list):
        raise bad(f"'{param}' must be a string or an array of text parts", param, "invalid_type")
    out = []
    for j, p in enumerate(v):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            raise bad(f"'{param}[{j}]': only text parts are supported", param)
        out.append(str_field(p.get("text"), f"{param}[{j}].text"))
    return "".join(out)


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
            str_field(part.get("text"), f"{p}.{key}")
            for part in parts
            if isinstance(part, dict) and part.get("type") == kind
        ]
        if texts:
            return "\n\n".join(texts)
    return ""


def new_item_id(m: Message) -> str:
    """A new input item's id (``msg_`` for messages, ``fco_`` for a tool's output)."""
    return ("fco_" if m.role == "tool" else "msg_") + secrets.token_hex(12)


class ResponsesRequest(ApiRequest):
    """A Responses request: the ApiRequest, plus what its answer and record need
    (``tenant``: who asked, the owner of its stored response)."""

    def __init__(
        self,
        params: GenParams,
        stream: bool,
        conv: Conversation,
        body: JSON,
        history: list[Message],
        ids: list[str],
        *,
        agent: AgentTurn | None,
        text_format: JSON,
        tenant: str,
    ):
        super().__init__(params, stream, True, conv=conv, agent=agent, cache_salt=cache_salt_of(body))
        self.body = body
        self.history = history  # the conversation without the instructions
        self.ids = ids  # the input item id of each message of history
        self.rid = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex  # the output message's item id
        self.created = int(time.time())
        self.store = body.get("store") is not False
        self.tenant = tenant
        self.text_format = text_format  # what the response's text.format says

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
        make_agent: MakeAgent | None = None,
    ):
        self.default_max_tokens = default_max_tokens if default_max_tokens > 0 else ctx
        self.make_agent = make_agent  # a chat's agent turn (None: parse only)
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
            call = ToolCall(str_field(it.get("call_id"), f"{p}.call_id"), str_field(it.get("name"), f"{p}.name"), "")
            call.arguments = str_field(it.get("arguments", "{}"), f"{p}.arguments")
            if out and out[-1].role == "assistant":
                out[-1].tool_calls.append(call)  # calls follow the assistant's text in one turn
            else:
                out.append(Message("assistant", "", [call]))
        elif kind == "function_call_output":
            call_id = str_field(it.get("call_id"), f"{p}.call_id")
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
            tools.append(
                Tool(str_field(t.get("name"), "tools"), str_field(t.get("description") or "", "tools"), params)
            )
        tc = body.get("tool_choice", "auto")
        if isinstance(tc, dict) and tc.get("type") == "function":
            choice = str_field(tc.get("name"), "tool_choice")
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
        prev = str_field(prev, "previous_response_id")
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
        return [from_record(m) for m in msgs], [m.get("id") or new_item_id(from_record(m)) for m in msgs]

    def parse(self, raw: object, tenant: str = ANONYMOUS) -> ResponsesRequest:
        """The parsed request of a body from ``tenant`` (whose stored
        responses alone ``previous_response_id`` may name)."""
        if not isinstance(raw, dict):
            raise bad("the request body must be a JSON object", None, "invalid_type")
        str_field(raw.get("model"), "model")
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
            instructions = self.volatile.header(str_field(raw["instructions"], "instructions"))
            if instructions is not None:
                msgs.insert(0, Message("system", instructions))
        tools, choice, parallel = self._tools(raw)
        conv = Conversation(
            msgs,
            tools,
            choice,
            parallel,
            volatile=self.volatile,
            live_only=bool(missing),
            template_kwargs=openai_kwargs(raw, "reasoning"),
        )
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
        agent = self.make_agent(conv, label="responses") if self.make_agent is not None else None
        req = ResponsesRequest(params, stream, conv, raw, history, ids, agent=agent, text_format=echo, tenant=tenant)
        if agent is not None:  # the worker stores the response, before the final event
            agent.on_outcome = lambda oc, res: self.stored.remember(req, oc, res)
        return req

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
