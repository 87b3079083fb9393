"""The stored responses of the OpenAI Responses protocol
(:mod:`ds4.server.responses`): their records, the response objects and
items they are read back as, and the retrieval routes.

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
    message, as an unknown id, and the same work: a record is kept under
    its id and a digest of its owner (:func:`record_key`), so another
    tenant's lookup opens a name that does not exist, as an unknown id's
    does (no time difference tells that the id exists). The binding is to the tenant, not to ``cache_salt``:
    OpenAI scopes stored responses to the project (the key), and a salt is a
    cache partition a client may vary per request (it is not an identity;
    its value is never stored). Records written before owners existed
    (no ``owner`` field) are the anonymous tenant's: a server without keys
    keeps continuing and deleting them (they have no response object to
    retrieve: 404), a server with keys treats them as another tenant's.
    Records kept under the bare id (written before the owner's digest was
    in the name) are still found, after the owner's name misses.
    A record that cannot be read or does not validate is a not-found and is
    removed (:meth:`ds4.kvstore.records.RecordStore.get`).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..turn import GenResult
from .conversation import Conversation, Message, Outcome, ToolCall
from .tenants import ANONYMOUS
from .wire import JSON, ApiError, bad

__all__ = ["MemoryRecords", "Records", "StoredResponses", "record_key"]

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


def record_key(rid: str, tenant: str) -> str:
    """The key the record of response ``rid`` is kept under for its owner
    ``tenant``: the id, then 16 hex digits of a BLAKE2b digest of the
    tenant's name (only letters, digits, ``_`` and ``-``: a record name)."""
    owner = hashlib.blake2b(tenant.encode("utf-8"), digest_size=8, person=b"ds4 rec owner").hexdigest()
    return f"{rid}-{owner}"


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


def to_record(m: Message, item_id: str) -> JSON:
    d: JSON = {"id": item_id, "role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [[c.id, c.name, c.arguments] for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    return d


def from_record(d: JSON) -> Message:
    calls = [ToolCall(i, n, a) for i, n, a in d.get("tool_calls", [])]
    return Message(d["role"], d["content"], calls, d.get("tool_call_id"), d.get("reasoning"))


def reasoning_id(msg_id: str) -> str:
    """The reasoning item's id beside the message item ``msg_id``."""
    return "rs_" + msg_id.removeprefix("msg_")


def reasoning_item(item_id: str, text: str, status: str = "completed") -> JSON:
    summary = [{"type": "summary_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": summary}


def usage_of(res: GenResult) -> JSON:
    return {
        "input_tokens": res.prompt_tokens,
        "input_tokens_details": {"cached_tokens": res.cached_tokens},
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def status_of(oc: Outcome) -> str:
    return "incomplete" if oc.finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str) -> JSON:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(c: ToolCall, status: str, item_id: str | None = None) -> JSON:
    args = c.arguments if status == "completed" else ""
    item = {"id": item_id or "fc_" + c.id, "type": "function_call", "status": status, "call_id": c.id, "name": c.name}
    return {**item, "arguments": args}


def output_items(msg_id: str, content: str, calls: list[ToolCall], reasoning: str | None = None) -> list[JSON]:
    """A turn's output items: its reasoning (when it has some), its text as
    a message (also when empty and there are no calls), then one item per
    call."""
    output: list[JSON] = [] if reasoning is None else [reasoning_item(reasoning_id(msg_id), reasoning)]
    if content or not calls:
        output.append(message_item(msg_id, content, "completed"))
    return output + [call_item(c, "completed") for c in calls]


def response_object(head: JSON, status: str, output: list[JSON], usage: JSON | None, store: bool) -> JSON:
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


class RecordedRequest(Protocol):
    """What a request offers to be stored (:class:`ds4.server.responses.ResponsesRequest`)."""

    rid: str
    msg_id: str
    created: int
    tenant: str
    store: bool
    body: JSON  # the request
    conv: Conversation | None
    text_format: JSON  # the request's text.format, as echoed
    history: list[Message]
    ids: list[str]


def response_head(req: RecordedRequest, model: str) -> JSON:
    """What a response object says of its request (a stored response keeps it)."""
    b = req.body
    return {
        "id": req.rid,
        "created_at": req.created,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "model": model,
        "parallel_tool_calls": req.conv.parallel_tool_calls if req.conv else True,
        "previous_response_id": b.get("previous_response_id"),
        "temperature": b.get("temperature", 1.0),
        "top_p": b.get("top_p", 1.0),
        "tool_choice": b.get("tool_choice", "auto"),
        "tools": b.get("tools") or [],
        "text": {"format": req.text_format},
        "metadata": b.get("metadata") or {},
    }


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
    m = from_record(d)
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
    out = [reasoning_item(reasoning_id(d["id"]), m.reasoning)] if m.reasoning is not None else []
    out += [message_item(d["id"], m.content, "completed")] if m.content or not m.tool_calls else []
    for c in m.tool_calls:
        item_id, k = "fc_" + c.id, 1
        while item_id in used:
            item_id, k = f"fc_{c.id}_{k}", k + 1
        used.add(item_id)
        out.append(call_item(c, "completed", item_id))
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

    def remember(self, req: RecordedRequest, oc: Outcome, res: GenResult) -> None:
        """Store the response's record (the worker runs this, before the
        final event, so a client's next request finds it): its owner, its
        head, and the conversation through its output (without the
        instructions), each message with its item id."""
        if not req.store or oc.finish_reason == "cancelled":
            return
        msgs = [*req.history, Message("assistant", oc.content, list(oc.calls), reasoning=oc.reasoning)]
        ids = [*req.ids, req.msg_id]
        rec = {
            "v": RECORD_VERSION,
            "owner": req.tenant,
            "response": {**response_head(req, self.model), "status": status_of(oc), "usage": usage_of(res)},
            "messages": [to_record(m, i) for m, i in zip(msgs, ids, strict=True)],
        }
        try:
            self.records.put(KIND, record_key(req.rid, req.tenant), rec)
        except (OSError, ValueError) as e:  # the answer still goes out; previous_response_id to it will be unknown
            log.warning("response %s not stored: %s", req.rid, e)

    def lookup(self, rid: str, tenant: str) -> JSON | None:
        """The record of ``rid`` when ``tenant`` owns it; None when there is
        none, it is unreadable (then removed) or another tenant's. A record
        of the first format (no owner) is the anonymous tenant's."""
        found = self._find(rid, tenant)
        return None if found is None else found[0]

    def _find(self, rid: str, tenant: str) -> tuple[JSON, str] | None:
        """The record of ``rid`` that ``tenant`` owns and the key it is
        kept under: the owner's (:func:`record_key`), then the bare id."""
        for key in (record_key(rid, tenant), rid):
            try:
                rec: JSON | None = self.records.get(KIND, key, lambda d: _check_record(rid, d))
            except ValueError:  # not a name a record can have
                return None
            if rec is not None:
                owner = str(rec.get("owner", ANONYMOUS))
                return (rec, key) if hmac.compare_digest(owner.encode(), tenant.encode()) else None
        return None

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
        out = from_record(last)
        output = output_items(last["id"], out.content, out.tool_calls, out.reasoning)
        return response_object(head, head["status"], output, head["usage"], True)

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
        found = self._find(rid, tenant)
        if found is None:
            raise _not_found(rid)
        try:
            removed = self.records.delete(KIND, found[1])
        except OSError as e:
            log.warning("response %s not deleted: %s", rid, e)
            raise ApiError(500, f"the response could not be deleted: {type(e).__name__}", "server_error") from None
        if not removed:  # deleted meanwhile
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}
