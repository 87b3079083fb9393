"""What every protocol shares (OpenAI chat and completions, Anthropic
Messages, OpenAI Responses): the parsed request (:class:`ApiRequest`), the
:class:`Wire` a protocol answers through, :class:`ApiError` and the
validation helpers that raise it, the mapping of failures to errors
(:func:`exception_to_api`), the ``ds4`` block of every response
(:func:`ds4_info`) and server-sent events (:func:`sse`).

The protocol modules (:mod:`ds4.server.openai`, :mod:`ds4.server.anthropic`,
:mod:`ds4.server.responses`) are siblings over this one; none imports another.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Protocol

from ..errors import ContextOverflowError, EmptyPromptError, EngineError, PromptError
from ..report import RecoveryReport
from ..turn import GenParams, GenResult
from .cache_diagnostics import Diagnosis
from .conversation import AgentTurn, Conversation, LiveStateGone
from .fields import is_int, is_num, utf8_len
from .worker import Cancelled, QueueFull, ShuttingDown, TextPrompt, Work

__all__ = [
    "JSON",
    "SSE_DONE",
    "ApiError",
    "ApiRequest",
    "MakeAgent",
    "ReasoningEvents",
    "Wire",
    "bad",
    "cache_salt_of",
    "ds4_info",
    "exception_to_api",
    "http_error",
    "invalid_json",
    "opt_bool",
    "opt_int",
    "opt_num",
    "scrub",
    "shown_path",
    "sse",
    "str_field",
    "utf8_bytes",
]

JSON = dict[str, Any]


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> JSON:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(msg: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, msg, "invalid_request_error", param, code)


def opt_int(body: JSON, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v):
        raise bad(f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{key}' must be {rng}, got {v}", key)
    return int(v)


def opt_num(body: JSON, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v):
        raise bad(f"'{key}' must be a number, got {type(v).__name__}", key, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def opt_bool(body: JSON, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {type(v).__name__}", key, "invalid_type")
    return v


def str_field(v: object, param: str) -> str:
    """A string field (``param``: its name), valid Unicode; a 400 otherwise."""
    if not isinstance(v, str):
        raise bad(f"'{param}' must be a string", param, "invalid_type")
    if utf8_len(v) is None:
        raise bad(f"'{param}' is not valid Unicode (a lone surrogate)", param, "invalid_string")
    return v


def cache_salt_of(body: JSON) -> str | None:
    """``cache_salt`` (vLLM's name; taken on every protocol): a non-empty
    string, or absent."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise bad("'cache_salt' must be a non-empty string", "cache_salt", "invalid_type")
    utf8_bytes(v, "cache_salt")
    return v


def utf8_bytes(s: str, param: str) -> int:
    """Bytes of ``s`` in UTF-8 (:func:`.fields.utf8_len`); 400 when it
    holds a lone surrogate."""
    n = utf8_len(s)
    if n is None:
        raise bad(f"'{param}' is not valid Unicode (a lone surrogate)", param, "invalid_string")
    return n


class MakeAgent(Protocol):
    """Makes a chat's agent turn (the app's: over its live tool state and
    generator); a parser without one parses only (its chats have no agent)."""

    def __call__(self, conv: Conversation, *, id_prefix: str = "call_", label: str = "chat") -> AgentTurn: ...


class ApiRequest:
    """One parsed request: what to run (a chat's conversation and its agent
    turn, or a completion's raw prompt), how to generate, and how to
    answer. Whole once made: nothing is filled in after parsing. (A
    *turn* is one generation over the conversation, :mod:`ds4.turn`'s and
    an agent turn's; a request is what the client sent.)"""

    def __init__(
        self,
        params: GenParams,
        stream: bool,
        include_usage: bool,
        *,
        conv: Conversation | None = None,
        agent: AgentTurn | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        diagnosis: Diagnosis | None = None,
    ):
        self.params = params
        self.stream = stream
        self.include_usage = include_usage
        # a chat (every chat: its reasoning is split and canonicalized, its
        # tools parsed): the worker runs it as an agent turn (ds4.server.conversation)
        self.conv = conv
        self.agent = agent
        self.prompt = prompt  # a completion's prompt text
        self.cache_salt = cache_salt  # vLLM's field: its own cache namespace (ds4.server.tenants)
        # Anthropic's cache diagnostics asked for (ds4.server.cache_diagnostics)
        self.diagnosis = diagnosis

    @property
    def kind(self) -> str:
        """``chat`` (a conversation) or ``completion`` (a raw prompt)."""
        return "chat" if self.conv is not None else "completion"

    @property
    def param(self) -> str:
        """The request field an error about the prompt points at."""
        return "messages" if self.kind == "chat" else "prompt"

    def work(self) -> Work:
        """What the worker runs: the agent turn, or the completion's prompt."""
        if self.agent is not None:
            return self.agent
        if self.prompt is None:
            raise ValueError("a chat parsed without an agent turn cannot run")
        return TextPrompt(self.prompt)


def invalid_json(e: Exception) -> ApiError:
    return ApiError(
        400, f"We could not parse the JSON body of your request: {e}", "invalid_request_error", None, "invalid_json"
    )


# an absolute path: its directories are dropped from what a client sees
_ABS_DIRS = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"]+/)+")


def scrub(text: str, debug: bool = False) -> str:
    """``text`` without the directories of any absolute path (unless ``debug``)."""
    return text if debug else _ABS_DIRS.sub("", text)


def shown_path(path: str | None, debug: bool = False) -> str | None:
    """A checkpoint path as a client sees it: its file name (whole with ``debug``)."""
    return path if debug or path is None else os.path.basename(path)


def exception_to_api(e: BaseException, param: str | None, debug: bool = False) -> ApiError:
    """The HTTP answer to a failed or refused job. A 5xx says what failed,
    not where (the log has the details) unless ``debug``; no message shows
    an absolute path unless ``debug``."""
    err = _exception_to_api(e, param)
    if err.status >= 500 and not debug and err.code in ("engine_error", "internal_error"):
        err.message = f"{err.message.split(':', 1)[0]} ({type(e).__name__}; see the server log)"
    err.message = scrub(err.message, debug)
    return err


def _exception_to_api(e: BaseException, param: str | None) -> ApiError:
    if isinstance(e, ContextOverflowError):
        return ApiError(
            400,
            f"This model's maximum context length is {e.ctx} tokens; the prompt has {e.n_tokens} tokens "
            "(one more is needed to generate)",
            "invalid_request_error",
            param,
            "context_length_exceeded",
        )
    if isinstance(e, EmptyPromptError):
        return bad("the prompt is empty", param)
    if isinstance(e, LiveStateGone):
        return ApiError(409, str(e), "invalid_request_error", param, "live_state_gone")
    if isinstance(e, PromptError):  # the client's, typed where it was judged; any other ValueError is a bug: 500
        return bad(str(e), param)
    if isinstance(e, Cancelled):
        return ApiError(499, "client closed the request", "invalid_request_error", None, "cancelled")
    if isinstance(e, QueueFull):
        return ApiError(429, f"too many queued requests ({e.pending})", "rate_limit_error", code="queue_full")
    if isinstance(e, ShuttingDown):
        return ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
    if isinstance(e, EngineError):
        return ApiError(500, f"the engine failed: {e}", "server_error", None, "engine_error")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error", None, "internal_error")


def http_error(status: int, detail: str) -> JSON:
    """The body for an error the router raised (404, 405, ...)."""
    return {
        "error": {
            "message": detail,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": {404: "not_found", 405: "method_not_allowed"}.get(status),
        }
    }


def ds4_info(res: GenResult, debug: bool = False) -> JSON:
    """ds4's own block in every response: how the cache served the turn
    (checkpoints by file name; whole paths only with ``debug``) and where
    the prompt left its best candidate (``divergence``)."""
    r = res.report
    return {
        "rung": r.rung,
        "source": r.source,
        "reused_tokens": r.reused_tokens,
        "loaded_path": shown_path(r.loaded_path, debug),
        "rejected": [
            {"path": shown_path(p, debug), "stage": s, "code": c, "reason": scrub(rr, debug)}
            for (p, s, c, rr) in r.rejected
        ],
        "evict_saved": shown_path(r.evict_saved, debug),
        "cold_saved": shown_path(r.cold_saved, debug),
        "prompt_saved": shown_path(r.prompt_saved, debug),
        # the turn boundary stored so no span is prefilled twice, and a
        # reload loop seen (the same checkpoint, the same span after it): ds4.frontier
        "frontier_saved": shown_path(r.frontier_saved, debug),
        "reload": r.reload,
        # every save of the turn that did not happen, with why (ds4.kvstore.skips)
        "save_skipped": [{"kind": k.kind, "code": k.code, "detail": scrub(k.detail, debug)} for k in r.save_skipped],
        # where the prompt left the best candidate (ds4.recovery): the live
        # state or a checkpoint of the request's own namespace
        "divergence": r.divergence,
        # a text match the token check cut, and the RAM snapshot a rewrite
        # resumed from (a memory that cannot rewind): ds4.recovery
        "token_check": r.token_check,
        "snapshot": r.snapshot,
        "stop_action": res.stop_action,
        # the wait for the last reply's decode steps to be prefilled again
        # (llama.cpp's canonical mode) when this turn came before it was done
        "canonicalize_ms": round(r.timings.get("canonicalize_ms", 0.0), 3),
        # from the request's arrival; queue_ms the part it waited before its turn began
        "ttft_ms": round(res.ttft_s * 1000, 3),
        "queue_ms": round(res.queue_s * 1000, 3),
        "total_ms": round(res.total_s * 1000, 3),
    }


class Wire:
    """How one protocol answers (the app's routes are protocol-blind):
    ``reply(req, started)`` builds the response bodies of a request (an
    object with ``complete(res)``, and for streams ``opening()``,
    ``chunk(text)``, ``closing(res)``, ``failed(e)`` and ``terminator``;
    ``started``: the ladder's report when the turn started before the first
    byte, else None), ``error(e, param)`` the status and body of a refusal
    or failure."""

    def __init__(self, model: str, debug: bool = False):
        self.model, self.debug = model, debug

    def reply(self, req: ApiRequest, started: RecoveryReport | None = None) -> Any:
        raise NotImplementedError

    def error(self, e: BaseException, param: str | None = None) -> tuple[int, JSON]:
        api = e if isinstance(e, ApiError) else exception_to_api(e, param, self.debug)
        return api.status, api.body()


def sse(obj: JSON, ensure_ascii: bool = True, event: str | None = None) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (named ``event``, when given)."""
    data = b"data: " + json.dumps(obj, ensure_ascii=ensure_ascii).encode("utf-8") + b"\n\n"
    return data if event is None else f"event: {event}\n".encode() + data


SSE_DONE = b"data: [DONE]\n\n"


class ReasoningEvents:
    """A streamed reply's reasoning part, for a protocol that makes its own
    events of it (:meth:`_think` for a piece, :meth:`_end_think` once it
    ends): the request's agent turn splits each text delta at
    ``</think>`` (:meth:`_split`), and the closing flushes what the
    splitter still held (:meth:`_held`)."""

    req: ApiRequest

    def _think(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def _end_think(self) -> list[bytes]:
        raise NotImplementedError

    def _split(self, text: str) -> tuple[list[bytes], str]:
        """A text delta through the reasoning splitter: the reasoning
        events and the content left."""
        if self.req.agent is None:
            return [], text
        reasoning, content = self.req.agent.stream_reasoning(text)
        out = self._think(reasoning)
        return (out + self._end_think() if content else out), content

    def _held(self) -> tuple[list[bytes], str | None]:
        """At the end of the stream: the events of the reasoning the
        splitter still held, and the content after it (None: nothing held)."""
        held = self.req.agent.end_stream_reasoning() if self.req.agent is not None else None
        if held is None:
            return [], None
        reasoning, content = held
        return self._think(reasoning) + self._end_think(), content
