"""``ds4 serve``: :func:`serve_main` (its flags are :mod:`ds4.serve_args`'s,
defined apart so that the ``ds4`` command's parser never imports the
server), which builds the engine, the generator and the worker,
then serves :func:`ds4.server.app.create_app` with uvicorn until SIGTERM or
SIGINT (the lifespan hook then stores every valid resident session).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import sys
from typing import TYPE_CHECKING

from ..config import build_engine, check_kv_args, engine_model_id, make_store
from ..turn import TurnDriver
from .app import create_app
from .body import BodyLimits
from .guard import Guard, guard_from_args
from .pool import Pool
from .sizing import SessionsDontFit, resolve_sessions
from .volatile import BUILTIN_TRANSIENT, SystemText
from .worker import Service

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("ds4.server")

__all__ = ["MMAP_THRESHOLD", "build_app", "fix_mmap_threshold", "serve_main"]

#: allocations of at least this many bytes get their own pages, returned at
#: their free (glibc's M_MMAP_THRESHOLD, set once at start)
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process (False: not glibc).

    glibc raises the threshold to the size of each mmapped block freed (up
    to 32 MiB), so after the first large request body every later one is
    carved from an arena, and a thread's arena keeps what it freed: 60
    requests of 8 MiB each grew a server by 52 MiB (the bytes in a field it
    ignores) to 202 MiB (in an over-long routing hint), none of it
    referenced. A fixed threshold turns that adjustment off: a body, its
    parsed strings and their copies of 4 MiB or more are mapped and
    unmapped whole (bench: benches/bench_hint_rss.py, BENCHMARKS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(nbytes)) == 1)
    except OSError:
        return False


def build_app(args: argparse.Namespace, guard: Guard) -> Starlette:
    """The app ``ds4 serve`` serves for ``args`` (already checked): the
    engine, the store, the generator, the pool and the worker
    (``app.state.service``). Tests build a replica in process with it."""
    engine = build_engine(args.engine, args.model, args.threads, getattr(args, "exact", None))
    if args.ctx > engine.max_ctx:
        log.warning("--ctx %d exceeds the model's %d; using %d", args.ctx, engine.max_ctx, engine.max_ctx)
    sessions, why = resolve_sessions(args.sessions, args.sessions_mem_mb, engine, min(args.ctx, engine.max_ctx))
    if why:
        log.info("%s", why)
    gen = TurnDriver(engine, args.ctx, make_store(args))
    gen.sess.snapshots.configure(args.ctx_checkpoints, args.ctx_checkpoints_mb, args.ctx_checkpoint_every)
    pool = Pool(
        gen,
        sessions,
        batched=args.batch_decode != "off",
        batch_prefill=args.batch_prefill == "on",
        batch_always=args.batch_decode == "on",
    )
    service = Service(gen, engine_model_id(engine), max_queue=args.max_queue, pool=pool)
    service.divergence_text = args.divergence_text
    limits = BodyLimits(max_bytes=int(args.max_body_mb * 1024 * 1024), read_timeout_s=args.body_timeout)
    return create_app(
        service,
        default_max_tokens=args.default_max_tokens,
        model_aliases=args.model_alias,
        guard=guard,
        limits=limits,
        debug=args.debug,
        sse_keepalive_s=args.sse_keepalive,
        volatile=SystemText(
            args.keep_billing_header,
            args.prompt_volatile,
            args.prompt_volatile_mode,
            transient=[*args.prompt_transient, *(BUILTIN_TRANSIENT if args.prompt_transient_builtin else ())],
            transient_mode=args.prompt_transient_mode,
        ),
        metrics=not args.no_metrics and _metrics_available(),
    )


def _metrics_available() -> bool:
    """Whether ``prometheus_client`` is installed (``/metrics`` and ``/ui``
    need it); a warning naming the extra when it is not."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        log.warning("GET /metrics and /ui are off: they need prometheus-client (pip install 'ds4[metrics]')")
        return False
    return True


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
    if not args.sse_keepalive > 0:
        log.error("--sse-keepalive must be > 0 (seconds)")
        return 2
    if args.sessions_mem_mb is not None and not args.sessions_mem_mb > 0:
        log.error("--sessions-mem-mb must be > 0")
        return 2
    try:
        guard = guard_from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    fix_mmap_threshold()
    try:
        app = build_app(args, guard)
    except SessionsDontFit as e:
        log.error("%s", e)
        return 2
    service: Service = app.state.service
    gen, pool, engine = service.gen, service.pool, service.gen.engine
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=args.shutdown_grace,
        timeout_keep_alive=args.keep_alive_timeout,
        http=with_header_timeout(args.header_timeout),
        access_log=args.log_level == "debug",
    )
    server = ReadyServer(
        config,
        f"ds4 server ready on {args.host}:{args.port} model={service.model_id} engine={engine.name} ctx={gen.ctx} "
        f"{f'sessions={pool.size} ' if pool.size > 1 else ''}kv={gen.store.dir if gen.store else 'off'} keys={'on' if guard.needs_key else 'off'}",
        on_stop=(max(0.0, args.shutdown_grace - 1.0), app.state.end_open_runs),
    )
    try:
        server.run()
    finally:
        service.close()  # no-op after the lifespan hook ran
    return 0
