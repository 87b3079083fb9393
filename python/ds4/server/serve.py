"""``ds4 serve``: its command line (:func:`add_serve_args`) and
:func:`serve_main`, which builds the engine, the generator and the worker,
then serves :func:`ds4.server.app.create_app` with uvicorn until SIGTERM or
SIGINT (the lifespan hook then stores the live session).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from ..config import add_engine_args, add_kv_args, build_engine, check_kv_args, engine_model_id, make_store
from ..turn import Generator
from .app import SSE_KEEPALIVE_S, create_app
from .body import BodyLimits
from .guard import add_guard_args, guard_from_args
from .volatile import MODES, SystemText
from .worker import Service

log = logging.getLogger("ds4.server")

__all__ = ["add_serve_args", "serve_main"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    add_engine_args(p)
    add_kv_args(p)
    p.add_argument(
        "--kv-tenant-share",
        type=float,
        default=1.0,
        metavar="F",
        help="a tenant (API key) holding more than F of the disk budget loses its own checkpoints first "
        "(0 < F <= 1; default 1: one eviction order for all)",
    )
    p.add_argument("--no-kv-cache", action="store_true", help="no disk cache at all (the live session is still reused)")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=0,
        metavar="N",
        help="max_tokens when a request gives none (default 0: until end of generation or the context)",
    )
    p.add_argument("--max-queue", type=int, default=64, metavar="N", help="queued requests before 429 (default 64)")
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model id /v1/models/{id} knows (repeatable; requests may name any model)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_guard_args(p)
    g = p.add_argument_group('volatile system text (docs/DESIGN.md, "Volatile system text")')
    g.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's x-anthropic-billing-header first line of system text (its cch changes on every "
        "request: each turn is then a prefill from there on)",
    )
    g.add_argument(
        "--prompt-volatile",
        action="append",
        default=[],
        type=_regex,
        metavar="REGEX",
        help="lines of system text this matches (re.search; repeatable) are dropped or moved to the prompt's tail "
        "(--prompt-volatile-mode); never user or assistant text",
    )
    g.add_argument(
        "--prompt-volatile-mode",
        choices=MODES,
        default="drop",
        help="drop: the lines are removed; tail: they become a system turn after the last message, in their "
        "order (default drop)",
    )
    p.add_argument(
        "--sse-keepalive",
        type=float,
        default=SSE_KEEPALIVE_S,
        metavar="S",
        help=f"a keepalive comment on a stream silent this long, e.g. during a prefill (default {SSE_KEEPALIVE_S:g})",
    )
    p.add_argument(
        "--debug", action="store_true", help="show absolute paths and error details in HTTP answers and /health"
    )
    g = p.add_argument_group("request limits")
    g.add_argument("--max-body-mb", type=float, default=16, metavar="MB", help="largest request body (default 16 MiB)")
    g.add_argument(
        "--body-timeout", type=float, default=30, metavar="S", help="a request body must arrive within S s (default 30)"
    )
    g.add_argument(
        "--header-timeout", type=float, default=10, metavar="S", help="request line and headers within S s (default 10)"
    )
    g.add_argument(
        "--keep-alive-timeout", type=int, default=5, metavar="S", help="close idle keep-alive connections (default 5 s)"
    )


def _regex(s: str) -> str:
    """A ``--prompt-volatile`` pattern, compiled once to check it."""
    try:
        re.compile(s)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not a valid regular expression: {e}") from None
    return s


def serve_main(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn

        from .http11 import ReadyServer, with_header_timeout
    except ImportError as e:
        print(f"ds4 serve needs starlette and uvicorn ({e}): pip install 'ds4[server]'", file=sys.stderr)
        return 1

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    msg = check_kv_args(args)
    if msg:
        log.error("%s", msg)
        return 2
    if args.ctx < 16:
        log.error("--ctx must be >= 16")
        return 2
    try:
        guard = guard_from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    engine = build_engine(args.engine, args.model, args.threads)
    if args.ctx > engine.max_ctx:
        log.warning("--ctx %d exceeds the model's %d; using %d", args.ctx, engine.max_ctx, engine.max_ctx)
    gen = Generator(engine, args.ctx, make_store(args))
    service = Service(gen, engine_model_id(engine), max_queue=args.max_queue)
    limits = BodyLimits(max_bytes=int(args.max_body_mb * 1024 * 1024), read_timeout_s=args.body_timeout)
    app = create_app(
        service,
        default_max_tokens=args.default_max_tokens,
        model_aliases=args.model_alias,
        guard=guard,
        limits=limits,
        debug=args.debug,
        sse_keepalive_s=args.sse_keepalive,
        volatile=SystemText(args.keep_billing_header, args.prompt_volatile, args.prompt_volatile_mode),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=30,
        timeout_keep_alive=args.keep_alive_timeout,
        http=with_header_timeout(args.header_timeout),
        access_log=args.log_level == "debug",
    )
    server = ReadyServer(
        config,
        f"ds4 server ready on {args.host}:{args.port} model={service.model_id} engine={engine.name} ctx={gen.ctx} "
        f"kv={gen.store.dir if gen.store else 'off'} keys={'on' if guard.needs_key else 'off'}",
    )
    try:
        server.run()
    finally:
        service.close()  # no-op after the lifespan hook ran
    return 0
