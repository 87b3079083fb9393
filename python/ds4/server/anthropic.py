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

Usage
    ``cache_read_input_tokens`` are the tokens reused (live state or disk);
    ``cache_creation_input_tokens`` the tokens prefilled, which the live
    state holds afterwards; ``input_tokens`` is 0, so the three add up to
    the prompt, as they do in Anthropic's accounting.

Thinking
    A reply's reasoning (``<think>…</think>``, :mod:`ds4.server.reasoning`)
    is a ``thinking`` block before the text (streamed as a
    ``content_block_start`` of type ``thinking``, ``thinking_delta`` events,
    one ``signature_delta`` and the block's stop); its ``signature`` is a
    SHA-256 of the thinking text, which ds4 does not check when the block
    comes back. A reply cut inside its reasoning (``max_tokens``) is its
    ``thinking`` block alone.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from ..errors import ConstraintError
from ..turn import GenParams, GenResult
from .conversation import (
    Conversation,
    Message,
    Outcome,
    Tool,
    ToolCall,
    issued_call_id,
    new_call_id,
    results_without_calls,
)
from .fields import int_from, num_in, utf8_len
from .reasoning import ReasoningSplitter
from .tool_stream import StreamEvent
from .volatile import SystemText
from .wire import JSON, ApiError, Turn, Wire, bad, cache_salt_of, ds4_info, exception_to_api, sse

__all__ = ["AnthropicWire", "MessagesParser"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
}


def _bad(msg: str) -> ApiError:
    """A 400 in Anthropic's terms: a message, no ``param`` or ``code``."""
    return bad(msg, code=None)


def error_body(status: int, message: str) -> JSON:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


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
    :class:`~ds4.server.wire.Turn` carrying a :class:`Conversation`."""

    def __init__(
        self,
        default_max_tokens: int,
        ctx: int,
        max_prompt_bytes: int | None = None,
        volatile: SystemText | None = None,
    ):
        self.default_max_tokens = default_max_tokens if default_max_tokens > 0 else ctx
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
        conv = Conversation(msgs, tools, choice, parallel, volatile=self.volatile, live_only=bool(missing))
        n = sum(
            len(m.content.encode()) + len((m.reasoning or "").encode()) + sum(len(c.arguments) for c in m.tool_calls)
            for m in conv.messages
        )
        if self.max_prompt_bytes is not None and n > self.max_prompt_bytes:
            raise _bad(f"prompt is too long: {n} bytes cannot fit the context")
        return conv

    def messages(self, raw: object) -> Turn:
        conv = self.conversation(raw)
        assert isinstance(raw, dict)
        try:
            params = conv.gen_params(self._params(raw))
        except ConstraintError as e:
            raise _bad(f"tools: the input_schema cannot be enforced: {e}") from None
        stream = raw.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream: must be a boolean")
        return Turn("chat", None, params, stream, True, conv, cache_salt=cache_salt_of(raw))


def _sse(event: str, data: JSON) -> bytes:
    return sse(data, ensure_ascii=False, event=event)


def usage(res: GenResult | None) -> JSON:
    if res is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    return {
        "input_tokens": 0,
        "output_tokens": res.completion_tokens,
        "cache_read_input_tokens": res.cached_tokens,
        "cache_creation_input_tokens": res.prompt_tokens - res.cached_tokens,
    }


def signature(thinking: str) -> str:
    """A thinking block's signature: the SHA-256 of its text (ds4 does not
    check it when the block comes back)."""
    return hashlib.sha256(thinking.encode("utf-8", "replace")).hexdigest()


def stop_reason(oc: Outcome, res: GenResult) -> tuple[str, str | None]:
    if oc.calls:
        return "tool_use", None
    if res.stop_sequence is not None:
        return "stop_sequence", res.stop_sequence
    return ("max_tokens", None) if oc.finish_reason == "length" else ("end_turn", None)


class MessagesReply:
    """The bodies of one ``/v1/messages`` answer. A stream with tools goes
    through the convention's splitter (:class:`ds4.server.tool_stream.StreamSplitter`):
    text in a text block, then each call as it is generated, a ``tool_use``
    block (the id the turn's outcome will hold, the name, ``input: {}``)
    once its name is complete, its canonical arguments as ``input_json_delta``
    fragments, ``content_block_stop`` when its object closes."""

    terminator = b""

    def __init__(self, turn: Turn, model: str, debug: bool):
        self.turn, self.model, self.debug = turn, model, debug
        self.id = "msg_" + uuid.uuid4().hex[:24]
        conv = turn.conv
        self.splitter = conv.splitter() if conv is not None else None
        self.text_open = False
        self.index = 0  # the index of the block open or next (thinking, text, then each call)
        self.rsplit: ReasoningSplitter | None = None  # made on the first text (the prompt is rendered then)
        self.thinking: str | None = None  # the thinking block's text so far (None: no block)
        self.think_done = False  # the thinking block is closed

    def _outcome(self, res: GenResult) -> Outcome:
        oc = self.turn.agent.outcome if self.turn.agent is not None else None
        return oc if oc is not None else Outcome(res.text, [], res.finish_reason)

    def _message(self, content: list[JSON], res: GenResult | None) -> JSON:
        reason, seq = (None, None)
        if res is not None:
            reason, seq = stop_reason(self._outcome(res), res)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": usage(res),
        }

    def complete(self, res: GenResult) -> JSON:
        oc = self._outcome(res)
        content: list[JSON] = []
        if oc.reasoning is not None:
            content.append({"type": "thinking", "thinking": oc.reasoning, "signature": signature(oc.reasoning)})
        if oc.content or (not oc.calls and oc.reasoning is None):
            content.append({"type": "text", "text": oc.content})
        content += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in oc.calls
        ]
        return {**self._message(content, res), "ds4": ds4_info(res, self.debug)}

    # -- the stream ------------------------------------------------------------
    def opening(self) -> list[bytes]:
        return [_sse("message_start", {"type": "message_start", "message": self._message([], None)})]

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = []
        if not self.text_open:
            self.text_open = True
            block = {"type": "text", "text": ""}
            start = {"type": "content_block_start", "index": self.index, "content_block": block}
            out.append(_sse("content_block_start", start))
        delta = {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}
        out.append(_sse("content_block_delta", delta))
        return out

    def _stop_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]

    def _events(self, events: list[StreamEvent]) -> list[bytes]:
        """The events of the splitter's: text in a text block, each call a
        ``tool_use`` block (started once its name is known, ``input_json_delta``
        fragments, stopped when its object closes)."""
        out = []
        for e in events:
            if e.kind == "text":
                out += self._text(e.text)
            elif e.kind == "start":
                out += self._stop_text()
                agent = self.turn.agent
                cid = agent.call_id(e.index) if agent is not None else new_call_id("toolu_")
                block = {"type": "tool_use", "id": cid, "name": e.text, "input": {}}
                start = {"type": "content_block_start", "index": self.index, "content_block": block}
                out.append(_sse("content_block_start", start))
            elif e.kind == "args":
                part = {"type": "input_json_delta", "partial_json": e.text}
                out.append(
                    _sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": part})
                )
            elif e.kind == "end":
                out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
                self.index += 1
        return out

    def _think(self, text: str) -> list[bytes]:
        """A thinking delta (the block, the first of the message, opened on
        the first)."""
        if not text:
            return []
        out = []
        if self.thinking is None:
            self.thinking = ""
            block = {"type": "thinking", "thinking": "", "signature": ""}
            start = {"type": "content_block_start", "index": self.index, "content_block": block}
            out.append(_sse("content_block_start", start))
        self.thinking += text
        delta = {
            "type": "content_block_delta",
            "index": self.index,
            "delta": {"type": "thinking_delta", "thinking": text},
        }
        return [*out, _sse("content_block_delta", delta)]

    def _end_think(self) -> list[bytes]:
        """The thinking block's signature and stop (once, before the text)."""
        if self.thinking is None or self.think_done:
            return []
        self.think_done = True
        sig = {"type": "signature_delta", "signature": signature(self.thinking)}
        self.index += 1
        return [
            _sse("content_block_delta", {"type": "content_block_delta", "index": self.index - 1, "delta": sig}),
            _sse("content_block_stop", {"type": "content_block_stop", "index": self.index - 1}),
        ]

    def _split(self, text: str) -> tuple[list[bytes], str]:
        """A text delta through the reasoning splitter: the thinking events
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
            return b"".join(pre + self._events(self.splitter.feed(text)))
        return b"".join(pre + self._text(text))

    def closing(self, res: GenResult) -> list[bytes]:
        oc = self._outcome(res)
        out: list[bytes] = []
        if self.rsplit is not None:
            reasoning, content = self.rsplit.finish()
            out += self._think(reasoning) + self._end_think()
            if content and self.splitter is not None:
                out += self._events(self.splitter.feed(content))
            else:
                out += self._text(content)
        if self.splitter is not None:
            out += self._events(self.splitter.close([(c.name, c.arguments) for c in oc.calls]))
        out += self._stop_text()
        reason, seq = stop_reason(oc, res)
        delta: JSON = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": usage(res),
        }
        out += [_sse("message_delta", delta), _sse("message_stop", {"type": "message_stop"})]
        return out

    def failed(self, e: BaseException) -> list[bytes]:
        api = exception_to_api(e, None, self.debug)
        return [_sse("error", error_body(api.status, api.message))]


class AnthropicWire(Wire):
    def reply(self, turn: Turn) -> MessagesReply:
        return MessagesReply(turn, self.model, self.debug)

    def error(self, e: BaseException, param: str | None = None) -> tuple[int, JSON]:
        api = e if isinstance(e, ApiError) else exception_to_api(e, param, self.debug)
        return api.status, error_body(api.status, api.message)
