"""The answers of the OpenAI Responses protocol (:mod:`ds4.server.responses`
parses the requests): the response object, whole or streamed as typed
events (``response.created`` ... ``response.completed``), each with an
``event:`` line and a ``sequence_number``.

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

Calls
    With tools the text goes through the convention's splitter
    (:class:`ds4.server.tool_stream.StreamSplitter`), as chat's and
    Anthropic's: the message item is done before the first call, each call
    a ``function_call`` item added once its name is known, its arguments
    ``response.function_call_arguments.delta`` events as they are
    generated, its ``.done`` events at the finish. The final event's
    response object is the whole reply's, with the ``ds4`` block.
"""

from __future__ import annotations

from typing import Any

from ..report import RecoveryReport
from ..turn import GenResult
from .conversation import Outcome, new_call_id
from .response_store import (
    StoredResponses,
    message_item,
    output_items,
    reasoning_id,
    reasoning_item,
    response_head,
    response_object,
    status_of,
    usage_of,
)
from .responses import ResponsesRequest
from .tool_stream import StreamEvent
from .wire import JSON, ApiRequest, ReasoningEvents, Wire, ds4_info, exception_to_api, sse

__all__ = ["ResponsesReply", "ResponsesWire"]


class ResponsesReply(ReasoningEvents):
    """The bodies of one ``/v1/responses`` answer (events carry ``event:``
    lines and a ``sequence_number``)."""

    terminator = b""
    req: ResponsesRequest

    def __init__(self, req: ResponsesRequest, model: str, debug: bool):
        self.req, self.model, self.debug = req, model, debug
        self.seq = 0
        self.msg_id = req.msg_id
        self.splitter = req.conv.splitter() if req.conv is not None else None
        self.msg_open = False
        self.reasoning: str | None = None  # the reasoning item's text so far (None: no item)
        self.reasoning_done = False
        self.msg_index = 0  # the message's output index (1 after a reasoning item)
        self.n_out = 0  # output items added so far
        self.msg_text = ""  # the message's text so far
        self.msg_done = False
        self.live: dict[int, list[Any]] = {}  # call k: [output index, call id, name, arguments so far]

    def _ev(self, kind: str, **data: Any) -> bytes:
        d = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse(d, ensure_ascii=False, event=kind)

    def _outcome(self, res: GenResult) -> Outcome:
        oc = self.req.agent.outcome if self.req.agent is not None else None
        return oc if oc is not None else Outcome(res.text, [], res.finish_reason)

    def _msg_item(self, text: str, status: str) -> JSON:
        return message_item(self.msg_id, text, status)

    def _response(self, status: str, output: list[JSON], res: GenResult | None) -> JSON:
        usage = usage_of(res) if res is not None else None
        return response_object(response_head(self.req, self.model), status, output, usage, self.req.store)

    def _call_id(self, k: int) -> str:
        agent = self.req.agent
        return agent.call_id(k) if agent is not None else new_call_id("call_")

    def _final(self, res: GenResult) -> tuple[str, list[JSON], Outcome]:
        oc = self._outcome(res)
        return status_of(oc), output_items(self.msg_id, oc.content, oc.calls, oc.reasoning), oc

    @staticmethod
    def _call(cid: str, name: str, args: str, status: str) -> JSON:
        return {"id": "fc_" + cid, "type": "function_call", "status": status, "call_id": cid, "name": name} | {
            "arguments": args
        }

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
        self.msg_index, self.n_out = self.n_out, self.n_out + 1
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
        if self.msg_done:  # text after announced calls (a block that failed): a second message
            self.msg_id, self.msg_open, self.msg_done, self.msg_text = self.msg_id + "_2", False, False, ""
        out = self._open_message()
        self.msg_text += text
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
            self.reasoning, self.msg_index, self.n_out = "", 1, 1
            out.append(
                self._ev("response.output_item.added", output_index=0, item=reasoning_item(rid, "", "in_progress"))
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
            self._ev("response.output_item.done", output_index=0, item=reasoning_item(rid, text)),
        ]

    def _close_message(self) -> list[bytes]:
        """The message's done events (once), with the text it streamed."""
        if not self.msg_open or self.msg_done:
            return []
        self.msg_done = True
        k, text = self.msg_index, self.msg_text
        ids = {"item_id": self.msg_id, "output_index": k, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        return [
            self._ev("response.output_text.done", **ids, text=text),
            self._ev("response.content_part.done", **ids, part=part),
            self._ev("response.output_item.done", output_index=k, item=self._msg_item(text, "completed")),
        ]

    def _events(self, events: list[StreamEvent]) -> list[bytes]:
        """The splitter's events: text in the message, each call an item
        added once its name is known (the message done before it), its
        arguments as ``response.function_call_arguments.delta`` events as
        they are generated; the calls' done events come at the end."""
        out: list[bytes] = []
        for e in events:
            if e.kind == "text":
                out += self._delta(e.text)
            elif e.kind == "start":
                out += self._close_message()
                cid = self._call_id(e.index)
                self.live[e.index] = [self.n_out, cid, e.text, ""]
                item = self._call(cid, e.text, "", "in_progress")
                out.append(self._ev("response.output_item.added", output_index=self.n_out, item=item))
                self.n_out += 1
            elif e.kind == "args":
                c = self.live[e.index]
                c[3] += e.text
                out.append(
                    self._ev(
                        "response.function_call_arguments.delta", item_id="fc_" + c[1], output_index=c[0], delta=e.text
                    )
                )
        return out

    def chunk(self, text: str) -> bytes:
        pre, text = self._split(text)
        if self.splitter is not None:
            return b"".join(pre + self._events(self.splitter.feed(text)))
        return b"".join(pre + self._delta(text))

    def closing(self, res: GenResult) -> list[bytes]:
        status, output, oc = self._final(res)
        out: list[bytes] = []
        pre, content = self._held()
        out += pre
        if content is not None:
            if content and self.splitter is not None:
                out += self._events(self.splitter.feed(content))
            else:
                out += self._delta(content)
        if self.splitter is not None:
            calls = [(c.name, c.arguments) for c in oc.calls]
            # a call cut by max_tokens ends as the stored response holds it: an
            # incomplete item, then the text (the response object's message)
            out += self._events(self.splitter.close(calls))
        if not self.live:
            out += self._open_message()  # an empty answer is still a message
        out += self._close_message()
        done = "completed" if oc.calls else "incomplete"  # calls that did not parse: cut, or a failed block
        for _, (idx, cid, name, args) in sorted(self.live.items()):
            ids = {"item_id": "fc_" + cid, "output_index": idx}
            if oc.calls:
                out.append(self._ev("response.function_call_arguments.done", **ids, arguments=args))
            out.append(self._ev("response.output_item.done", output_index=idx, item=self._call(cid, name, args, done)))
        # the final response object carries the verdict (``ds4``), as the whole reply does
        final = {**self._response(status, output, res), "ds4": ds4_info(res, self.debug)}
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._ev(kind, response=final))
        return out

    def failed(self, e: BaseException) -> list[bytes]:
        api = exception_to_api(e, "input", self.debug)
        return [self._ev("error", code=api.code, message=api.message, param=api.param)]


class ResponsesWire(Wire):
    def __init__(self, model: str, stored: StoredResponses, debug: bool = False):
        super().__init__(model, debug)
        self.stored = stored

    def reply(self, req: ApiRequest, started: RecoveryReport | None = None) -> ResponsesReply:
        assert isinstance(req, ResponsesRequest)
        return ResponsesReply(req, self.model, self.debug)
