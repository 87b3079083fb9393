"""The Anthropic Messages protocol: ``POST /v1/messages`` (whole or
streamed: ``message_start``, content blocks, ``message_delta``,
``message_stop``) and ``POST /v1/messages/count_tokens``, over the shared
conversation model (:mod:`ds4.server.conversation`) and the one turn
driver. Errors are Anthropic-shaped: ``{"type": "error", "error": {"type",
"message"}}``. The ``anthropic-version`` header is accepted (any value).

Mapping
    ``system`` (a string or text blocks) is the system turn: a block (or
    the string) whose first line starts with ``x-anthropic-`` loses that
    line, one that held only it is dropped, as in ds4 (the billing line
    unless ``--keep-billing-header``; :mod:`ds4.server.volatile`); ``text`` blocks are
    content; an assistant's ``tool_use`` blocks are its calls; a user's
    ``tool_result`` blocks are tool results (text content, ``is_error``
    noted as ``Error:``); an assistant's ``thinking`` blocks are its
    reasoning, rendered as the chat template renders reasoning
    (``redacted_thinking`` is dropped: ds4 never writes it, and its data is
    no text); a ``thinking`` block's ``signature`` is not checked. ``tool_choice`` ``auto``/``any``/``tool``/``none`` map to
    auto/required/named/none, ``disable_parallel_tool_use`` to
    ``parallel_tool_calls: false``. Images and documents get a 400.

Tool results (ds4's 400/409 split)
    A ``tool_result`` whose ``tool_use_id`` no earlier ``tool_use`` of the
    request has and this server never issued is a 400 (``count_tokens``
    too). One whose call this server issued but the history leaves out can
    only be served from the live tool state (ds4's live-only
    continuation): when that state no longer holds the turn, a 409 "retry
    by replaying the full messages history".

Answers
    Bodies, stream events, usage, thinking blocks and errors (the wire):
    :mod:`ds4.server.anthropic_reply`.
"""

from __future__ import annotations

import json

from ..errors import ConstraintError
from ..turn import GenParams
from .cache_diagnostics import diagnosis
from .conversation import Conversation, Message, Tool, ToolCall, issued_call_id, results_without_calls
from .fields import int_from, is_int, num_in, utf8_len
from .tenants import ANONYMOUS
from .thinking import anthropic_kwargs
from .volatile import SystemText
from .wire import JSON, ApiError, ApiRequest, MakeAgent, bad, cache_salt_of

__all__ = ["MessagesParser"]


def _bad(msg: str) -> ApiError:
    """A 400 in Anthropic's terms: a message, no ``param`` or ``code``."""
    return bad(msg, code=None)


def _num(body: JSON, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not num_in(v, lo, hi):
        raise _bad(f"{key}: must be a number between {lo} and {hi}")
    return float(v)


def _int(body: JSON, key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not int_from(v, lo):
        raise _bad(f"{key}: must be an integer >= {lo}")
    return v


def _str(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise _bad(f"{where}: must be a string")
    if utf8_len(v) is None:
        raise _bad(f"{where}: is not valid Unicode (a lone surrogate)")
    return v


def _text_blocks(v: object, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(v, str):
        return _str(v, where)
    if not isinstance(v, list):
        raise _bad(f"{where}: must be a string or an array of content blocks")
    out = []
    for j, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _bad(f"{where}.{j}: only text blocks are supported here")
        out.append(_str(b.get("text"), f"{where}.{j}.text"))
    return "".join(out)


class MessagesParser:
    """Validates ``/v1/messages`` and ``count_tokens`` bodies into a
    :class:`~ds4.server.wire.ApiRequest` carrying a :class:`Conversation`."""

    def __init__(
        self,
        default_max_tokens: int,
        ctx: int,
        max_prompt_bytes: int | None = None,
        volatile: SystemText | None = None,
        make_agent: MakeAgent | None = None,
    ):
        self.default_max_tokens = default_max_tokens if default_max_tokens > 0 else ctx
        self.make_agent = make_agent  # a chat's agent turn (None: parse only)
        self.max_prompt_bytes = max_prompt_bytes
        self.volatile = volatile or SystemText()

    def _system(self, body: JSON) -> list[Message]:
        sys_ = body.get("system")
        if sys_ is None:
            return []
        if isinstance(sys_, str):
            parts = [_str(sys_, "system")]
        elif isinstance(sys_, list):
            parts = [_text_blocks([b], f"system.{j}") for j, b in enumerate(sys_)]
        else:
            raise _bad("system: must be a string or an array of text blocks")
        kept = [self.volatile.header(p, anthropic=True) for p in parts]
        parts = [p for p in kept if p is not None]
        return [Message("system", "\n".join(parts))] if parts else []

    @staticmethod
    def _blocks(i: int, role: str, content: object) -> list[Message]:
        where = f"messages.{i}.content"
        if isinstance(content, str):
            return [Message(role, _str(content, where))]
        if not isinstance(content, list):
            raise _bad(f"{where}: must be a string or an array of content blocks")
        out: list[Message] = []
        text: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        for j, b in enumerate(content):
            w = f"{where}.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(_str(b.get("text"), f"{w}.text"))
            elif kind == "tool_use" and role == "assistant":
                inp = b.get("input", {})
                if not isinstance(inp, dict):
                    raise _bad(f"{w}.input: must be an object")
                calls.append(ToolCall(_str(b.get("id"), f"{w}.id"), _str(b.get("name"), f"{w}.name"), json.dumps(inp)))
            elif kind == "tool_result" and role == "user":
                res = _text_blocks(b.get("content", ""), f"{w}.content")
                if b.get("is_error") is True:
                    res = f"Error: {res}"
                out.append(Message("tool", res, tool_call_id=_str(b.get("tool_use_id"), f"{w}.tool_use_id")))
            elif kind == "thinking" and role == "assistant":
                thinking.append(_str(b.get("thinking"), f"{w}.thinking"))
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise _bad(f"{w}: content blocks of type {kind!r} are not supported")
        if text or calls or thinking or not out:
            out.append(Message(role, "".join(text), calls, reasoning="\n\n".join(thinking) or None))
        return out

    def _messages(self, body: JSON) -> list[Message]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages: must be a non-empty array")
        out = self._system(body)
        for i, m in enumerate(msgs):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("user", "assistant"):
                raise _bad(f"messages.{i}.role: must be 'user' or 'assistant'")
            assert isinstance(m, dict)
            out.extend(self._blocks(i, role, m.get("content")))
        return out

    @staticmethod
    def _tools(body: JSON) -> tuple[list[Tool], str, bool]:
        raw = body.get("tools") or []
        if not isinstance(raw, list):
            raise _bad("tools: must be an array")
        tools = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                raise _bad(f"tools.{i}: only custom tools (name, description, input_schema) are supported")
            schema = t.get("input_schema", {})
            if not isinstance(schema, dict):
                raise _bad(f"tools.{i}.input_schema: must be an object")
            desc = t.get("description") or ""
            tools.append(Tool(_str(t.get("name"), f"tools.{i}.name"), _str(desc, f"tools.{i}.description"), schema))
        tc = body.get("tool_choice")
        if tc is None:
            return tools, "auto", True
        kind = tc.get("type") if isinstance(tc, dict) else None
        assert kind is None or isinstance(tc, dict)
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        if kind == "tool":
            choice = _str(tc.get("name"), "tool_choice.name")
            if choice not in {t.name for t in tools}:
                raise _bad(f"tool_choice.name: {choice!r} is not in tools")
        if choice is None:
            raise _bad("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'")
        if choice == "required" and not tools:
            raise _bad("tool_choice: 'any' needs tools")
        return tools, choice, not (isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True)

    def _params(self, body: JSON) -> GenParams:
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list):
            raise _bad("stop_sequences: must be an array of strings")
        stop = tuple(_str(s, "stop_sequences") for s in stops if s != "")
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise _bad("metadata: must be an object")
        max_tokens = _int(body, "max_tokens", 1)
        top_k = _int(body, "top_k", 0)
        top_p = _num(body, "top_p", 0.0, 1.0)
        return GenParams(
            max_tokens=self.default_max_tokens if max_tokens is None else max_tokens,
            stop=stop,
            temperature=_num(body, "temperature", 0.0, 1.0) or 0.0,
            top_p=1.0 if not top_p else top_p,
            top_k=top_k or 0,
        )

    def conversation(self, raw: object) -> Conversation:
        if not isinstance(raw, dict):
            raise _bad("the request body must be a JSON object")
        _str(raw.get("model"), "model")  # any name; answered with the served one
        tools, choice, parallel = self._tools(raw)
        msgs = self._messages(raw)
        missing = results_without_calls(msgs)
        for cid in missing:
            if not issued_call_id(cid):
                raise _bad(
                    f"messages: a tool_result answers tool_use_id {cid!r}, which no earlier tool_use block "
                    "has and this server never issued; send the tool_use with its result"
                )
        mt = raw.get("max_tokens")
        kw = anthropic_kwargs(raw, mt if is_int(mt) else None)
        conv = Conversation(
            msgs, tools, choice, parallel, volatile=self.volatile, live_only=bool(missing), template_kwargs=kw
        )
        n = sum(
            len(m.content.encode()) + len((m.reasoning or "").encode()) + sum(len(c.arguments) for c in m.tool_calls)
            for m in conv.messages
        )
        if self.max_prompt_bytes is not None and n > self.max_prompt_bytes:
            raise _bad(f"prompt is too long: {n} bytes cannot fit the context")
        return conv

    def messages(self, raw: object, tenant: str = ANONYMOUS) -> ApiRequest:
        """The parsed request of a body from ``tenant`` (the owner of the
        replies its ``diagnostics.previous_message_id`` may name)."""
        conv = self.conversation(raw)
        assert isinstance(raw, dict)
        try:
            params = conv.gen_params(self._params(raw))
        except ConstraintError as e:
            raise _bad(f"tools: the input_schema cannot be enforced: {e}") from None
        stream = raw.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream: must be a boolean")
        agent = self.make_agent(conv, id_prefix="toolu_", label="anthropic") if self.make_agent is not None else None
        salt = cache_salt_of(raw)
        diag = None
        if "diagnostics" in raw and raw["diagnostics"] is not None:  # the cache-diagnosis beta
            d = raw["diagnostics"]
            if not isinstance(d, dict):
                raise _bad("diagnostics: must be an object")
            prev = d.get("previous_message_id")
            if prev is not None and not isinstance(prev, str):
                raise _bad("diagnostics.previous_message_id: must be a string or null")
            diag = diagnosis(conv, tenant, prev, salt)
        return ApiRequest(params, stream, True, conv=conv, agent=agent, cache_salt=salt, diagnosis=diag)
