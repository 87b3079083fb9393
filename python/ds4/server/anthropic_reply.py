"""The answers of the Anthropic Messages protocol (:mod:`ds4.server.anthropic`
parses the requests): a whole message, or its stream (``message_start``,
content blocks, ``message_delta``, ``message_stop``), and Anthropic-shaped
errors ``{"type": "error", "error": {"type", "message"}}``.

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

from ..report import RecoveryReport
from ..turn import GenResult
from .cache_diagnostics import CacheDiagnostics
from .conversation import Outcome, new_call_id
from .tool_cut import cut_reply, partial_object
from .tool_stream import StreamEvent
from .wire import JSON, ApiError, ApiRequest, ReasoningEvents, Wire, ds4_info, exception_to_api, sse

__all__ = ["AnthropicWire", "MessagesReply", "error_body"]

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


def error_body(status: int, message: str) -> JSON:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


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


class MessagesReply(ReasoningEvents):
    """The bodies of one ``/v1/messages`` answer. A stream with tools goes
    through the convention's splitter (:class:`ds4.server.tool_stream.StreamSplitter`):
    text in a text block, then each call as it is generated, a ``tool_use``
    block (the id the turn's outcome will hold, the name, ``input: {}``)
    once its name is complete, its canonical arguments as ``input_json_delta``
    fragments, ``content_block_stop`` when its object closes."""

    terminator = b""

    def __init__(
        self,
        req: ApiRequest,
        model: str,
        debug: bool,
        diagnostics: CacheDiagnostics | None = None,
        started: RecoveryReport | None = None,
    ):
        self.req, self.model, self.debug = req, model, debug
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.diagnostics = diagnostics
        # the turn's cached tokens, when the ladder ran before the first byte
        self.cached = started.reused_tokens if started is not None else None
        conv = req.conv
        self.splitter = conv.splitter() if conv is not None else None
        self.text_open = False
        self.index = 0  # the index of the block open or next (thinking, text, then each call)
        self.thinking: str | None = None  # the thinking block's text so far (None: no block)
        self.think_done = False  # the thinking block is closed

    def _diagnostics(self, res: GenResult | None) -> JSON:
        """The ``diagnostics`` key of a reply that asked for it (none otherwise)."""
        d = self.req.diagnosis
        if d is None or self.diagnostics is None:
            return {}
        if res is not None:  # the whole turn: remembered for the next request's comparison
            answer = self.diagnostics.answer(d, res.cached_tokens)
            self.diagnostics.record(d, self.id, res.prompt_tokens)
            return {"diagnostics": answer}
        return {"diagnostics": self.diagnostics.answer(d, self.cached)}

    def _outcome(self, res: GenResult) -> Outcome:
        oc = self.req.agent.outcome if self.req.agent is not None else None
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
            **self._diagnostics(res),
        }

    def complete(self, res: GenResult) -> JSON:
        oc = self._outcome(res)
        content: list[JSON] = []
        if oc.reasoning is not None:
            content.append({"type": "thinking", "thinking": oc.reasoning, "signature": signature(oc.reasoning)})
        cut = self._cut(oc)
        if cut is not None:  # the tool_use blocks its stream announced, the last one incomplete
            if cut[0]:
                content.append({"type": "text", "text": cut[0]})
            content += [
                {"type": "tool_use", "id": self._call_id(k), "name": name, "input": partial_object(args)}
                for k, name, args in cut[1]
            ]
            return {**self._message(content, res), "ds4": ds4_info(res, self.debug)}
        if oc.content or (not oc.calls and oc.reasoning is None):
            content.append({"type": "text", "text": oc.content})
        content += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in oc.calls
        ]
        return {**self._message(content, res), "ds4": ds4_info(res, self.debug)}

    def _cut(self, oc: Outcome) -> tuple[str, list[tuple[int, str, str]]] | None:
        """A reply cut by ``max_tokens`` inside a call its stream announced
        (:func:`ds4.server.tool_cut.cut_reply`), else None."""
        if oc.calls or oc.finish_reason != "length" or self.req.conv is None:
            return None
        return cut_reply(self.req.conv.splitter(), oc.content)

    def _call_id(self, k: int) -> str:
        agent = self.req.agent
        return agent.call_id(k) if agent is not None else new_call_id("toolu_")

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
                block = {"type": "tool_use", "id": self._call_id(e.index), "name": e.text, "input": {}}
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

    def chunk(self, text: str) -> bytes:
        pre, text = self._split(text)
        if self.splitter is not None:
            return b"".join(pre + self._events(self.splitter.feed(text)))
        return b"".join(pre + self._text(text))

    def closing(self, res: GenResult) -> list[bytes]:
        oc = self._outcome(res)
        out: list[bytes] = []
        pre, content = self._held()
        out += pre
        if content is not None:
            if content and self.splitter is not None:
                out += self._events(self.splitter.feed(content))
            else:
                out += self._text(content)
        if self.splitter is not None:
            calls = [(c.name, c.arguments) for c in oc.calls]
            out += self._events(self.splitter.close(calls, length=oc.finish_reason == "length"))
        out += self._stop_text()
        reason, seq = stop_reason(oc, res)
        info = ds4_info(res, self.debug)  # the verdict, as the whole reply's; in usage too (clients log it)
        delta: JSON = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": {**usage(res), "ds4": info},
            "ds4": info,
            **self._diagnostics(res),  # the whole answer (message_start's may have been pending)
        }
        out += [_sse("message_delta", delta), _sse("message_stop", {"type": "message_stop"})]
        return out

    def failed(self, e: BaseException) -> list[bytes]:
        api = exception_to_api(e, None, self.debug)
        return [_sse("error", error_body(api.status, api.message))]


class AnthropicWire(Wire):
    def __init__(self, model: str, debug: bool = False):
        super().__init__(model, debug)
        #: the requests of the replies that asked for cache diagnostics
        self.diagnostics = CacheDiagnostics()

    def reply(self, req: ApiRequest, started: RecoveryReport | None = None) -> MessagesReply:
        return MessagesReply(req, self.model, self.debug, self.diagnostics, started)

    def error(self, e: BaseException, param: str | None = None) -> tuple[int, JSON]:
        api = e if isinstance(e, ApiError) else exception_to_api(e, param, self.debug)
        return api.status, error_body(api.status, api.message)
