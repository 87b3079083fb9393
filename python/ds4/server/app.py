"""The ASGI app (Starlette, served by uvicorn; ``ds4 serve`` is
:mod:`ds4.server.serve`).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(non-streaming, or streaming over SSE: ``data: {json}`` chunks then ``data:
[DONE]``), ``POST /v1/messages`` (and ``/count_tokens``), ``POST
/v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, ``GET /v1/models``, ``GET
/v1/models/{id}``, ``GET /health``; ``GET /metrics``, ``GET /ui`` and
``GET /ui/data`` (:mod:`ds4.server.ui`) unless ``--no-metrics``.

A handler parses the request (its protocol's module over
:mod:`ds4.server.wire`), submits a job to
the one worker (:mod:`ds4.server.worker`) and relays its events. The job's
cancel flag is set as soon as the client disconnects. On SIGTERM/SIGINT
uvicorn drains the in-flight requests (``--shutdown-grace``, 30 s); one
second before that grace runs out, every request still running gets its
final event (:meth:`_Routes.end_open_runs`: a stream its protocol's error
event and terminator, ``[DONE]`` on chat; a non-streamed request the 503 of
``shutting_down``) and its job stops; then the lifespan hook closes the
worker, which stores the live session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..keytext import tokenize_prompt
from ..serve_args import SSE_KEEPALIVE_S
from ..turn import GenResult
from .anthropic import MessagesParser
from .anthropic_reply import AnthropicWire
from .body import BodyLimits, read_json
from .conversation import AgentTurn, Conversation
from .guard import Guard, GuardMiddleware
from .health import operator_view, tenant_view
from .metrics import Metrics, protocol_of
from .openai import OpenAIWire, RequestParser
from .pool import HINT_HEADER, body_hint, usable_hint
from .response_store import MemoryRecords, StoredResponses
from .responses import ResponsesParser
from .responses_reply import ResponsesWire
from .tenants import ANONYMOUS, namespace_for
from .volatile import SystemText
from .wire import ApiError, ApiRequest, Wire, http_error
from .worker import Job, Service, ShuttingDown

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger("ds4.server")

__all__ = ["create_app"]

Event = tuple[str, Any]

#: how long a streamed request waits for its job to start before sending
#: its headers (a quick refusal still gets its 4xx)
STREAM_HOLD_S = 0.5
#: the keepalive comment (sent every ``--sse-keepalive`` seconds, default
#: :data:`ds4.serve_args.SSE_KEEPALIVE_S`, while a stream has nothing to say)
SSE_KEEPALIVE = b": keepalive\n\n"


def tenant_of_request(request: Request) -> str:
    """The request's tenant (put in the scope by the guard)."""
    return str(request.scope.get("state", {}).get("ds4_tenant", ANONYMOUS))


class _JobRun:
    """One submitted job seen from the event loop: its events, and a
    watcher that cancels it when the client disconnects."""

    def __init__(self, service: Service, request: Request, req: ApiRequest, metrics: Metrics | None = None):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        tenant = tenant_of_request(request)
        observe = metrics.observer(protocol_of(request.url.path), tenant) if metrics is not None else None

        def post(k: str, v: Any) -> None:
            if observe is not None:  # /metrics (ds4.server.metrics): the turn's figures, before the reply
                observe(k, v)
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (k, v))
            except RuntimeError:  # loop closed: nobody is listening any more
                pass

        namespace = namespace_for(tenant, req.cache_salt)
        # a routing hint (ds4.server.pool): the header, else the body's (read_json put it in the scope)
        hint = usable_hint(request.headers.get(HINT_HEADER)) or request.scope.get("state", {}).get("ds4_hint")
        operator = bool(request.scope.get("state", {}).get("ds4_operator", False))
        self.job = Job(req.work(), req.params, post, namespace, tenant, hint, operator)
        try:
            service.submit(self.job)
        except Exception as e:  # refused (queue full, shutting down): counted, then answered
            if observe is not None:
                observe("error", e)
            raise
        self.watcher = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                self.job.cancel.set()
                return

    async def next(self) -> Event:
        try:
            return await self.events.get()
        except BaseException:  # the handler was cancelled (server shutting down): stop the job
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel the job (a no-op once it is done) and the watcher."""
        self.job.cancel.set()
        self.watcher.cancel()


async def _warm_streams() -> None:
    """What a streamed reply uses first (anyio's task group and memory
    streams, imported on first use): used once at start."""
    import anyio

    async with anyio.create_task_group():
        pass
    send, receive = anyio.create_memory_object_stream[bytes](1)
    send.close()
    receive.close()


class _Routes:
    def __init__(
        self,
        service: Service,
        default_max_tokens: int,
        model_aliases: Sequence[str],
        limits: BodyLimits,
        debug: bool,
        volatile: SystemText | None = None,
    ):
        self.service = service
        self.debug = debug
        self.keepalive_s = SSE_KEEPALIVE_S
        self.open_runs: set[_JobRun] = set()  # the requests being answered (end_open_runs)
        self.gen = service.gen
        self.live = service.pool.residents[0].live  # ds4's live tool state (the worker thread's), the first resident's
        self.limits = limits
        self.model_ids = (service.model_id, *[a for a in model_aliases if a != service.model_id])
        volatile = volatile or SystemText()  # one, so that the billing line is logged once per client
        self.parser = RequestParser(
            self.model_ids, default_max_tokens, self.gen.ctx, self.gen.max_prompt_bytes(), volatile, self.agent
        )
        self.metrics: Metrics | None = None  # /metrics and /ui (create_app)
        self.openai = OpenAIWire(service.model_id, debug)
        self.anthropic = AnthropicWire(service.model_id, debug)
        self.messages_parser = MessagesParser(
            default_max_tokens, self.gen.ctx, self.parser.max_prompt_bytes, volatile, self.agent
        )
        records = self.gen.store.records if self.gen.store is not None else MemoryRecords()
        self.stored = StoredResponses(records, service.model_id)
        self.responses_wire = ResponsesWire(service.model_id, self.stored, debug)
        self.responses_parser = ResponsesParser(
            default_max_tokens, self.gen.ctx, self.stored, self.parser.max_prompt_bytes, volatile, self.agent
        )

    def agent(self, conv: Conversation, *, id_prefix: str = "call_", label: str = "chat") -> AgentTurn:
        """A chat's agent turn, over ds4's live tool state and the generator
        (the parsers make one per chat: :class:`ds4.server.wire.MakeAgent`)."""
        return AgentTurn(conv, self.live, self.gen, id_prefix=id_prefix, label=label)

    @staticmethod
    def err(e: ApiError) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse(e.body(), status_code=e.status)

    @staticmethod
    def wire_err(wire: Wire, e: BaseException, param: str | None = None) -> Response:
        """``e`` (an ApiError, a refusal or a failed job) in ``wire``'s error shape."""
        from starlette.responses import JSONResponse

        status, body = wire.error(e, param)
        return JSONResponse(body, status_code=status)

    async def read_json(self, request: Request) -> object:
        body = await read_json(request, self.limits)
        request.scope.setdefault("state", {})["ds4_hint"] = body_hint(body)  # the pool's hint (_JobRun)
        return body

    async def chat_completions(self, request: Request) -> Response:
        try:
            # parsed off the loop: compiling a response_format schema can take seconds
            req = await asyncio.to_thread(self.parser.chat, await self.read_json(request))
            return await self.run(request, req)
        except ApiError as e:
            return self.err(e)

    async def completions(self, request: Request) -> Response:
        try:
            return await self.run(request, self.parser.completion(await self.read_json(request)))
        except ApiError as e:
            return self.err(e)

    async def messages(self, request: Request) -> Response:
        """Anthropic Messages (ds4.server.anthropic)."""
        try:
            req = self.messages_parser.messages(await self.read_json(request), tenant_of_request(request))
        except ApiError as e:
            return self.wire_err(self.anthropic, e)
        return await self.run(request, req, self.anthropic)

    async def responses(self, request: Request) -> Response:
        """OpenAI Responses (ds4.server.responses)."""
        try:  # parsed off the loop: a previous response is read from disk
            raw = await self.read_json(request)
            req = await asyncio.to_thread(self.responses_parser.parse, raw, tenant_of_request(request))
        except ApiError as e:
            return self.wire_err(self.responses_wire, e)
        return await self.run(request, req, self.responses_wire)

    async def stored_response(self, request: Request) -> Response:
        """``GET``/``DELETE /v1/responses/{id}``: the tenant's own stored response."""
        if request.method == "DELETE":
            return await self._stored(request, self.stored.delete)
        return await self._stored(request, lambda rid, t: self.stored.retrieve(rid, t, request.query_params))

    async def stored_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``."""
        return await self._stored(request, lambda rid, t: self.stored.input_items(rid, t, request.query_params))

    async def _stored(self, request: Request, call: Callable[[str, str], Any]) -> Response:
        from starlette.responses import JSONResponse

        try:  # off the loop: the record's file, and a removal takes the store's lock
            body = await asyncio.to_thread(call, request.path_params["response_id"], tenant_of_request(request))
        except ApiError as e:
            return self.wire_err(self.responses_wire, e)
        return JSONResponse(body)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``count_tokens``: the prompt's tokens, rendered in full."""
        from starlette.responses import JSONResponse

        try:
            conv = self.messages_parser.conversation(await self.read_json(request))
        except ApiError as e:
            return self.wire_err(self.anthropic, e)
        eng = self.gen.engine

        def count() -> int:
            msgs = conv.engine_messages()
            return len(tokenize_prompt(eng, eng.render_chat(msgs, template_kwargs=conv.template_kwargs)))  # as a turn

        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})

    async def run(self, request: Request, req: ApiRequest, wire: Wire | None = None) -> Response:
        """Submit ``req`` and answer it in ``wire``'s protocol (OpenAI's by default)."""
        wire = wire or self.openai
        try:
            run = _JobRun(self.service, request, req, self.metrics)
        except Exception as e:  # refused: queue full or shutting down
            return self.wire_err(wire, e)
        first = await self._first_event(run, req.stream)
        if first is not None and first[0] not in ("start", "error"):
            run.events.put_nowait(first)  # "done" before "start": a prefill cancelled (client gone)
        if first is not None and first[0] == "error":
            run.watcher.cancel()
            return self.wire_err(wire, first[1], req.param)
        # the ladder's verdict when it came before the first byte (Anthropic's diagnostics)
        reply = wire.reply(req, first[1] if first is not None and first[0] == "start" else None)
        if req.stream:
            from starlette.responses import StreamingResponse

            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if first is not None and first[0] == "start":
                # the prefill ended within STREAM_HOLD_S: the rung and the cached
                # tokens are known before the first byte (else only the final event has them)
                headers["x-ds4-rung"] = str(first[1].rung)
                headers["x-ds4-cached-tokens"] = str(first[1].reused_tokens)
            return StreamingResponse(self.stream(run, reply), media_type="text/event-stream", headers=headers)
        return await self.collect(run, reply, wire)

    @staticmethod
    async def _first_event(run: _JobRun, stream: bool) -> Event | None:
        """The job's first event; a stream waits for it at most
        ``STREAM_HOLD_S`` (a quick refusal still gets its 4xx; a long prefill
        does not hold the headers back), then None."""
        if not stream:
            return await run.next()
        try:
            return await asyncio.wait_for(run.events.get(), STREAM_HOLD_S)
        except TimeoutError:
            return None
        except BaseException:  # the handler was cancelled: stop the job
            run.stop()
            raise

    def end_open_runs(self) -> int:
        """The server is stopping and its grace is almost over: each request
        still being answered gets a final ``shutting_down`` error (after
        what its job already sent) and its job stops. Returns how many."""
        runs = list(self.open_runs)
        for run in runs:
            run.job.cancel.set()
            run.events.put_nowait(("error", ShuttingDown("the server is shutting down")))
        if runs:
            log.info("shutdown: %d running request(s) ended with a final error event", len(runs))
        return len(runs)

    async def collect(self, run: _JobRun, reply: Any, wire: Wire) -> Response:
        from starlette.responses import JSONResponse

        self.open_runs.add(run)
        try:
            while True:
                k, v = await run.next()
                if k == "done":
                    res: GenResult = v
                    return JSONResponse(reply.complete(res))
                if k == "error":
                    return self.wire_err(wire, v, reply.req.param)
        finally:
            self.open_runs.discard(run)
            run.watcher.cancel()

    async def stream(self, run: _JobRun, reply: Any) -> AsyncIterator[bytes]:
        """The SSE body: the opening chunk at once, a keepalive comment every
        ``keepalive_s`` (``--sse-keepalive``) while nothing else is sent (a long prefill), the
        text, then the closing chunks; a failure after the headers is an
        error event."""
        self.open_runs.add(run)
        try:
            for b in reply.opening():
                yield b
            while True:
                try:
                    k, v = await asyncio.wait_for(run.events.get(), self.keepalive_s)
                except TimeoutError:
                    yield SSE_KEEPALIVE
                    continue
                if k == "text":
                    b = reply.chunk(v)
                    if b:
                        yield b
                    continue
                if k == "done":
                    for b in reply.closing(v):
                        yield b
                    break
                if k == "error":
                    for b in reply.failed(v):
                        yield b
                    break
            if reply.terminator:
                yield reply.terminator
        finally:
            self.open_runs.discard(run)
            run.stop()  # a no-op when the job is done; stops it when the client left

    def model_obj(self, mid: str) -> dict[str, Any]:
        return {"id": mid, "object": "model", "created": int(self.service.started), "owned_by": "ds4"}

    async def models(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self.model_obj(self.service.model_id)]})

    async def model_get(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        mid = request.path_params["model"]
        if mid not in self.model_ids:
            return self.err(
                ApiError(404, f"the model '{mid}' does not exist", "invalid_request_error", "model", "model_not_found")
            )
        return JSONResponse(self.model_obj(mid))

    async def health(self, request: Request) -> Response:
        """The operator's view, or the tenant's own (ds4.server.health)."""
        from starlette.responses import JSONResponse

        if request.scope.get("state", {}).get("ds4_operator", False):
            return JSONResponse(operator_view(self.service, self.debug))
        return JSONResponse(tenant_view(self.service, tenant_of_request(request)))

    async def http_exc(self, request: Request, exc: Exception) -> Response:
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse

        assert isinstance(exc, HTTPException)
        return JSONResponse(http_error(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    async def any_exc(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return self.err(ApiError(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal_error"))


def create_app(
    service: Service,
    *,
    default_max_tokens: int = 0,
    model_aliases: Sequence[str] = (),
    guard: Guard | None = None,
    limits: BodyLimits | None = None,
    debug: bool = False,
    sse_keepalive_s: float = SSE_KEEPALIVE_S,
    volatile: SystemText | None = None,
    metrics: bool = True,
) -> Starlette:
    """The app; ``guard`` (keys, hosts, origins) defaults to no key and the
    loopback names, ``limits`` to a 16 MiB body read within 30 s,
    ``volatile`` (what is taken out of system text) to the billing line;
    ``metrics`` (``--no-metrics``: False) serves ``/metrics`` and ``/ui``
    (:mod:`ds4.server.ui`) and observes every turn for them."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    r = _Routes(service, default_max_tokens, model_aliases, limits or BodyLimits(), debug, volatile)
    r.keepalive_s = sse_keepalive_s
    guard = guard or Guard()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # uvicorn runs this before it binds the port: the first request
        # finds everything it uses already built and imported
        await asyncio.get_running_loop().run_in_executor(None, service.gen.warm)
        await _warm_streams()
        if r.metrics is not None:
            r.metrics.exposition()
        yield  # "ready" is logged once the port is bound (serve_main)
        await asyncio.get_running_loop().run_in_executor(None, service.close)
        log.info("ds4 server stopped")

    routes = [
        Route("/v1/chat/completions", r.chat_completions, methods=["POST"]),
        Route("/v1/completions", r.completions, methods=["POST"]),
        Route("/v1/messages", r.messages, methods=["POST"]),
        Route("/v1/responses", r.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", r.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", r.stored_items, methods=["GET"]),
        Route("/v1/messages/count_tokens", r.count_tokens, methods=["POST"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/v1/models/{model:path}", r.model_get, methods=["GET"]),
        Route("/health", r.health, methods=["GET"]),
    ]
    open_paths: list[str] = []
    if metrics:
        from .ui import UI_PATHS, Dashboard

        r.metrics = Metrics(service)
        dash = Dashboard(service, r.metrics, guard.needs_key)
        routes += [Route("/metrics", dash.scrape, methods=["GET"]), Route("/ui/data", dash.data, methods=["GET"])]
        routes += [Route(p, dash.page, methods=["GET"]) for p in UI_PATHS]
        open_paths += UI_PATHS
    app = Starlette(
        routes=routes,
        middleware=[Middleware(GuardMiddleware, guard=guard, open_paths=open_paths)],
        exception_handlers={HTTPException: r.http_exc, Exception: r.any_exc},
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.end_open_runs = r.end_open_runs  # serve_main: near the end of the shutdown grace
    return app
