"""The OpenAI protocol (``/v1/chat/completions`` and ``/v1/completions``):
request parsing and validation, and response and stream chunk bodies. Its
errors are the shared shape ``{"error": {"message", "type", "param",
"code"}}`` (:mod:`ds4.server.wire`).

Nothing here touches the session: a request that fails validation is
answered before a job exists.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

from ..errors import ConstraintError
from ..report import RecoveryReport
from ..turn import GenParams, GenResult
from .conversation import Conversation, Message, Outcome, Tool, ToolCall, new_call_id
from .fields import is_int
from .formats import response_format
from .thinking import openai_kwargs
from .tool_cut import cut_reply
from .tool_stream import StreamEvent, StreamSplitter
from .volatile import SystemText
from .wire import (
    JSON,
    ApiError,
    ApiRequest,
    MakeAgent,
    Wire,
    bad,
    cache_salt_of,
    ds4_info,
    exception_to_api,
    opt_bool,
    opt_int,
    opt_num,
    sse,
    utf8_bytes,
)

__all__ = ["OpenAIWire", "RequestParser"]


class RequestParser:
    """Validates ``/v1/chat/completions`` and ``/v1/completions`` bodies."""

    ROLES = ("system", "developer", "user", "assistant", "tool")

    def __init__(
        self,
        model_ids: Sequence[str],
        default_max_tokens: int,
        ctx: int,
        max_prompt_bytes: int | None = None,
        volatile: SystemText | None = None,
        make_agent: MakeAgent | None = None,
    ):
        self.model_ids = tuple(model_ids)
        self.make_agent = make_agent  # a chat's agent turn (None: parse only)
        # the billing line and the volatile lines of system text (ds4.server.volatile)
        self.volatile = volatile or SystemText()
        self.default_max_tokens = default_max_tokens
        self.ctx = ctx
        # a prompt longer than this cannot fit ctx whatever its tokens
        self.max_prompt_bytes = max_prompt_bytes

    def _default_max_tokens(self) -> int:
        """No ``max_tokens``: the server's default, or (0) until EOS or the
        context ends (a turn never generates more than ``ctx`` tokens)."""
        return self.default_max_tokens if self.default_max_tokens > 0 else self.ctx

    def _fits(self, n_bytes: int, param: str) -> None:
        """The context check before tokenizing: refuse a prompt whose bytes
        alone prove it does not fit (the worker checks the exact count)."""
        lim = self.max_prompt_bytes
        if lim is not None and n_bytes > lim:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.ctx} tokens; the prompt has {n_bytes} bytes, "
                f"more than {lim} bytes fit in it",
                "invalid_request_error",
                param,
                "context_length_exceeded",
            )

    def _model(self, body: object) -> JSON:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", None, "invalid_type")
        model = body.get("model")
        if model is None:
            raise bad("you must provide a model parameter", "model", "missing_required_parameter")
        if not isinstance(model, str):
            raise bad("'model' must be a string", "model", "invalid_type")
        # Any name is accepted, as ds4-server and llama-server do: agents send
        # their own model names. The answer names the served model.
        return body

    def _sampling(self, body: JSON) -> GenParams:
        n = opt_int(body, "n", 1)
        if n is not None and n != 1:
            raise bad("only n=1 is supported (one reply per request)", "n", "unsupported_value")
        best_of = opt_int(body, "best_of", 1)
        if best_of is not None and best_of != 1:
            raise bad("only best_of=1 is supported", "best_of", "unsupported_value")
        mt = opt_int(body, "max_tokens", 1)
        mct = opt_int(body, "max_completion_tokens", 1)
        max_tokens = mct if mct is not None else mt
        temperature = opt_num(body, "temperature", 0.0, 2.0) or 0.0
        top_p = opt_num(body, "top_p", 0.0, 1.0)
        if top_p is not None and top_p <= 0.0:
            raise bad("'top_p' must be > 0", "top_p")
        seed = body.get("seed")
        if seed is not None and not is_int(seed):
            raise bad("'seed' must be an integer", "seed", "invalid_type")
        if seed is not None and seed < 0:
            seed = seed & ((1 << 64) - 1)
        for k in ("frequency_penalty", "presence_penalty"):
            opt_num(body, k, -2.0, 2.0)
        return GenParams(
            max_tokens=self._default_max_tokens() if max_tokens is None else max_tokens,
            stop=self._stop(body),
            temperature=temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
        )

    @staticmethod
    def _stop(body: JSON) -> tuple[str, ...]:
        stop = body.get("stop")
        if stop is None:
            return ()
        if isinstance(stop, str):
            utf8_bytes(stop, "stop")
            return (stop,) if stop else ()
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            if len(stop) > 4:
                raise bad("'stop' takes at most 4 sequences", "stop")
            for s in stop:
                utf8_bytes(s, "stop")
            return tuple(s for s in stop if s)
        raise bad("'stop' must be a string or an array of strings", "stop", "invalid_type")

    @staticmethod
    def _stream(body: JSON) -> tuple[bool, bool]:
        stream = opt_bool(body, "stream") or False
        so = body.get("stream_options")
        if so is None:
            return stream, False
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        return stream, bool(opt_bool(so, "include_usage"))

    def _common(self, raw: object) -> tuple[JSON, GenParams, bool, bool]:
        body = self._model(raw)
        params = self._sampling(body)
        stream, include_usage = self._stream(body)
        return body, params, stream, include_usage

    def _message(self, i: int, m: object) -> Message:
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{p}.role must be a string", f"{p}.role", "invalid_type")
        if role not in self.ROLES:
            raise bad(f"{p}.role {role!r} is not supported (system, developer, user, assistant, tool)", f"{p}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{p}.content[{j}] must be a text part", f"{p}.content", "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{p}.content must be a string or an array of text parts", f"{p}.content", "invalid_type")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{p}.name must be a string", f"{p}.name", "invalid_type")
        utf8_bytes(name or "", f"{p}.name")
        msg = Message("system" if role == "developer" else role, content)
        if role == "assistant":
            msg.reasoning, msg.tool_calls = self._reasoning(p, m), self._calls(p, m.get("tool_calls"))
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str):
                raise bad(f"{p}.tool_call_id must be a string", f"{p}.tool_call_id", "invalid_type")
            msg.tool_call_id = tcid
        return msg

    @staticmethod
    def _reasoning(p: str, m: JSON) -> str | None:
        """An assistant message's ``reasoning_content`` (DeepSeek's and
        vLLM's name; ``reasoning`` is taken too, OpenRouter's): rendered as
        the chat template renders reasoning (ds4.server.reasoning)."""
        for key in ("reasoning_content", "reasoning"):
            v = m.get(key)
            if v is None:
                continue
            if not isinstance(v, str):
                raise bad(f"{p}.{key} must be a string", f"{p}.{key}", "invalid_type")
            utf8_bytes(v, f"{p}.{key}")
            return v or None
        return None

    @staticmethod
    def _calls(p: str, raw: object) -> list[ToolCall]:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise bad(f"{p}.tool_calls must be an array", f"{p}.tool_calls", "invalid_type")
        out = []
        for j, c in enumerate(raw):
            q = f"{p}.tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"{q} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", q, "invalid_type")
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                raise bad(f"{q}.function.arguments must be a JSON string", q, "invalid_type")
            utf8_bytes(args, q)
            out.append(ToolCall(str(c.get("id") or ""), fn["name"], args))
        return out

    @staticmethod
    def _tools(body: JSON) -> list[Tool]:
        raw = body.get("tools")
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise bad("'tools' must be an array", "tools", "invalid_type")
        out = []
        for i, t in enumerate(raw):
            fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}", "tools")
            params = fn.get("parameters") or {}
            if not isinstance(params, dict):
                raise bad(f"tools[{i}].function.parameters must be an object", "tools", "invalid_type")
            desc = fn.get("description") or ""
            if not isinstance(desc, str):
                raise bad(f"tools[{i}].function.description must be a string", "tools", "invalid_type")
            out.append(Tool(fn["name"], desc, params))
        return out

    @staticmethod
    def _tool_choice(body: JSON, tools: list[Tool]) -> str:
        tc = body.get("tool_choice")
        if tc is None:
            return "auto"
        if tc in ("auto", "none", "required"):
            if tc == "required" and not tools:
                raise bad("tool_choice 'required' needs 'tools'", "tool_choice")
            return str(tc)
        fn = tc.get("function") if isinstance(tc, dict) and tc.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad(
                "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name'}}",
                "tool_choice",
                "invalid_type",
            )
        if name not in {t.name for t in tools}:
            raise bad(f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice")
        return name

    def chat(self, raw: object) -> ApiRequest:
        body, params, stream, inc = self._common(raw)
        msgs = body.get("messages")
        if msgs is None:
            raise bad("'messages' is required", "messages", "missing_required_parameter")
        if not isinstance(msgs, list) or not msgs:
            raise bad("'messages' must be a non-empty array", "messages", "invalid_type")
        out = [self._message(i, m) for i, m in enumerate(msgs)]
        out = [m for m in out if m.role != "system" or self._system_text(m)]
        if opt_bool(body, "logprobs"):
            raise bad("logprobs are not supported", "logprobs", "unsupported_value")
        tools = self._tools(body)
        choice = self._tool_choice(body, tools)
        parallel = opt_bool(body, "parallel_tool_calls")
        n_bytes = sum(
            utf8_bytes(m.content, "messages") + len(m.reasoning or "") + sum(len(c.arguments) for c in m.tool_calls)
            for m in out
        )
        self._fits(n_bytes + sum(len(json.dumps(t.schema())) for t in tools), "messages")
        params.constraint = response_format(body.get("response_format"))
        salt = cache_salt_of(body)
        # every chat is an agent turn: its reply's reasoning is split off, and
        # a reasoning turn is canonicalized like a tool turn (ds4.server.conversation)
        conv = Conversation(
            out, tools, choice, parallel is not False, volatile=self.volatile, template_kwargs=openai_kwargs(body)
        )
        try:
            params = conv.gen_params(params)
        except ConstraintError as e:
            raise bad(f"the tools' parameters cannot be enforced: {e}", "tools", "invalid_json_schema") from None
        agent = self.make_agent(conv) if self.make_agent is not None else None
        return ApiRequest(params, stream, inc, conv=conv, agent=agent, cache_salt=salt)

    def _system_text(self, m: Message) -> bool:
        """``m`` (a system or developer message) without its billing line;
        False when nothing is left (the message is then dropped)."""
        text = self.volatile.header(m.content)
        if text is None:
            return False
        m.content = text
        return True

    def completion(self, raw: object) -> ApiRequest:
        body, params, stream, inc = self._common(raw)
        if "prompt" not in body or body["prompt"] is None:
            raise bad("'prompt' is required", "prompt", "missing_required_parameter")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string (or an array of one string)", "prompt", "invalid_type")
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        self._fits(utf8_bytes(prompt, "prompt"), "prompt")
        if body.get("logprobs") is not None:
            raise bad("logprobs are not supported", "logprobs", "unsupported_value")
        if opt_bool(body, "echo"):
            raise bad("echo is not supported", "echo", "unsupported_value")
        if body.get("suffix"):
            raise bad("suffix is not supported", "suffix", "unsupported_value")
        return ApiRequest(params, stream, inc, prompt=prompt, cache_salt=cache_salt_of(body))


class OpenAIWire(Wire):
    def reply(self, req: ApiRequest, started: RecoveryReport | None = None) -> Reply:
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        return Reply(req, prefix + uuid.uuid4().hex[:24], int(time.time()), self.model, self.debug)


class Reply:
    """The response bodies of one turn: a whole completion, or its SSE
    chunks. A chat with tools streams through the convention's splitter
    (:class:`ds4.server.tool_stream.StreamSplitter`): visible text as content
    deltas, each call as it is generated, a header delta (``index``, the
    ``id`` the turn's outcome will hold, ``type``, ``function.name`` and
    empty ``arguments``) once its name is complete, then ``arguments``
    fragments; what the splitter could not send live goes out at the end
    (see :meth:`ds4.server.tool_stream.StreamSplitter.close`). A reply's
    reasoning (``<think>…</think>``, :mod:`ds4.server.reasoning`) is the
    message's ``reasoning_content``, streamed as ``reasoning_content``
    deltas before the content's."""

    terminator = b"data: [DONE]\n\n"

    def __init__(self, req: ApiRequest, rid: str, created: int, model: str, debug: bool = False):
        self.req, self.rid, self.created, self.model = req, rid, created, model
        self.debug = debug
        self.chat = req.kind == "chat"
        self.splitter: StreamSplitter | None = req.conv.splitter() if req.conv is not None else None

    def _head(self, obj: str) -> JSON:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _outcome(self, res: GenResult) -> Outcome:
        oc = self.req.agent.outcome if self.req.agent is not None else None
        return oc if oc is not None else Outcome(res.text, [], res.finish_reason)

    def complete(self, res: GenResult) -> JSON:
        if self.chat:
            oc = self._outcome(res)
            msg: JSON = {"role": "assistant", "content": oc.content}
            if oc.reasoning is not None:
                msg["reasoning_content"] = oc.reasoning
            if oc.calls:
                msg["content"] = oc.content or None
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in oc.calls
                ]
            elif (cut := self._cut(oc)) is not None:  # the calls its stream announced, the last one incomplete
                msg["content"] = cut[0] or None
                msg["tool_calls"] = [
                    {"id": self._call_id(k), "type": "function", "function": {"name": name, "arguments": args}}
                    for k, name, args in cut[1]
                ]
            choice: JSON = {"index": 0, "message": msg, "logprobs": None, "finish_reason": oc.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
            obj = "text_completion"
        return {
            **self._head(obj),
            "system_fingerprint": None,
            "choices": [choice],
            "usage": res.usage(),
            "ds4": ds4_info(res, self.debug),
        }

    def _cut(self, oc: Outcome) -> tuple[str, list[tuple[int, str, str]]] | None:
        """A reply cut by ``max_tokens`` inside a call its stream announced
        (:func:`ds4.server.tool_cut.cut_reply`), else None."""
        if oc.calls or oc.finish_reason != "length" or self.req.conv is None:
            return None
        return cut_reply(self.req.conv.splitter(), oc.content)

    @property
    def _chunk_obj(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _delta(self, d: JSON, finish: str | None = None, extra: JSON | None = None) -> bytes:
        ch = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        o = {**self._head(self._chunk_obj), "system_fingerprint": None, "choices": [ch], **(extra or {})}
        return sse(o, ensure_ascii=False)

    def _call_id(self, k: int) -> str:
        agent = self.req.agent
        return agent.call_id(k) if agent is not None else new_call_id("call_")

    def _events(self, events: list[StreamEvent]) -> bytes:
        """The chunks of the splitter's events: text as content, a call's
        start as its header delta, its fragments as arguments deltas."""
        out = []
        for e in events:
            if e.kind == "text":
                out.append(self._delta({"content": e.text}))
            elif e.kind == "start":
                head = {"index": e.index, "id": self._call_id(e.index), "type": "function"}
                out.append(self._delta({"tool_calls": [{**head, "function": {"name": e.text, "arguments": ""}}]}))
            elif e.kind == "args":
                out.append(self._delta({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}))
        return b"".join(out)

    def _reasoning(self, delta: str) -> tuple[bytes, str]:
        """A text delta through the reasoning splitter: the reasoning delta
        to send first (``reasoning_content``) and the content left."""
        if self.req.agent is None:
            return b"", delta
        reasoning, content = self.req.agent.stream_reasoning(delta)
        return (self._delta({"reasoning_content": reasoning}) if reasoning else b""), content

    def chunk(
        self, delta: str | None, finish: str | None = None, first: bool = False, extra: JSON | None = None
    ) -> bytes:
        if self.chat:
            pre = b""
            if delta:
                pre, delta = self._reasoning(delta)
                if not delta and finish is None:
                    return pre
            if self.splitter is not None and delta and finish is None and not first:
                return pre + self._events(self.splitter.feed(delta))
            d: JSON = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            return pre + self._delta(d, finish, extra)
        ch = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        o = {**self._head(self._chunk_obj), "system_fingerprint": None, "choices": [ch], **(extra or {})}
        return sse(o, ensure_ascii=False)

    def opening(self) -> list[bytes]:
        return [self.chunk("", first=True)] if self.chat else []

    def closing(self, res: GenResult) -> list[bytes]:
        out = []
        finish = res.finish_reason
        held = self.req.agent.end_stream_reasoning() if self.chat and self.req.agent is not None else None
        if held is not None:
            reasoning, content = held
            if reasoning:
                out.append(self._delta({"reasoning_content": reasoning}))
            if content and self.splitter is not None:
                out.append(self._events(self.splitter.feed(content)))
            elif content:
                out.append(self._delta({"content": content}))
        if self.chat and self.splitter is not None:
            oc = self._outcome(res)
            calls = [(c.name, c.arguments) for c in oc.calls]
            ev = self._events(self.splitter.close(calls, length=oc.finish_reason == "length"))
            if ev:
                out.append(ev)
            finish = oc.finish_reason
        # the finish chunk carries the verdict (``ds4``), as the whole reply does
        out.append(self.chunk(None if self.chat else "", finish, extra={"ds4": ds4_info(res, self.debug)}))
        if self.req.include_usage:
            o = {**self._head(self._chunk_obj), "choices": [], "usage": res.usage(), "ds4": ds4_info(res, self.debug)}
            out.append(sse(o))
        return out

    def failed(self, e: BaseException) -> list[bytes]:
        return [sse(exception_to_api(e, self.req.param, self.debug).body())]
